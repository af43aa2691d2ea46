"""Tier K presets: how many residual stages, of which codebook sizes, each kind gets in each layer
and KV head; and the named presets (faithful, balanced, compact) a model's specs go by
(decisions 0010, 0027 and 0028).

A preset is a string::

    "e3"              entropy coded, 3 bits per element on average (kvdb.codecs.entropy_coded)
    "e1.25p64"        entropy coded at 1.25 bits, each head's first 64 coefficients predicted
                      from the previous layer's
    "t3"              transform coded at fixed rates, 3 bits per element (kvdb.codecs.transform)
    "k4v2"            keys 4 stages of 256, values 2 stages of 256, every layer
    "k2x1024v1x1024"  1024-entry codebooks
    "k3v2+k5@0-1"     as k3v2, but keys get 5 stages in layers 0 and 1 (``@a-b,c``; ``+v3@..`` too)
    "k3v3+k12@18.2"   as k3v3, but the keys of layer 18's KV head 2 get 12 stages (``@layer.head``)

A layer holds as many stages as its deepest head; a head with fewer uses a prefix of them (its
*depth*), so the heads of a layer share codebook sizes.
"""

from __future__ import annotations

import re

import numpy as np

from kvdb.codecs import fractal, transform
from kvdb.errors import InvalidArgument

KINDS = ("k", "v")

# The presets a user names (``--kv-preset``): from most faithful to most compact (issue 33).
NAMES = ("faithful", "balanced", "compact")
DEFAULT_NAME = "balanced"
# Every layer alike: the compact preset of a model nobody has measured (decision 0010), and
# deeper codes for the other names.
DEFAULT_PRESET = "k4v3"
UNMEASURED = {"faithful": "k8v6", "balanced": "k6v4", "compact": DEFAULT_PRESET}
# Entropy-coded presets below this many bits per element restore with the window recomputed (restore_window).
STORED_WINDOW_BITS = 0.5
# Presets measured on one model's weights (by their hash): deeper key codes for its copy heads,
# fewer where keys barely matter (benchmarks/kv_ideas.py at tag studies-2026-12-06, decisions 0027 and 0028). The heads
# are that model's, so no other model gets them. A name's figures are looked up by its spec
# (kvdb.codecs.fidelity), so changing a spec here is the whole change.
MEASURED_PRESETS = {
    # SmolLM2-135M-Instruct, the embedded model: every name entropy coded with each layer predicted
    # from the one before (decisions 0041 and 0042; e3 and e2 before them), balanced and compact
    # with one rotation per layer (decision 0043; balanced was e1.35p64, compact the residual-VQ
    # k3v3+k16@18.2+k12@7.2,20.2,23.0+k2@0-5+v2@0-1 of decision 0028 until decision 0044)
    "7d74ab7a13046166f57ed5b0ae3aa7974a6ea452d092cd9f66fe8efc4ef13f35": {
        "faithful": "e2.2p64",
        "balanced": "e0.9jp384",
        "compact": "e0.28jp384",
    },
}


# How much a restore sharpens de-quantized keys (``quant.Codebooks.sharpened``), measured on one
# model's weights (benchmarks/kv_ideas.py at tag studies-2026-12-06, decision 0029); 1.0, none,
# for a model nobody measured.
MEASURED_KEY_SHARPENING = {
    # SmolLM2-135M-Instruct, the embedded model
    "7d74ab7a13046166f57ed5b0ae3aa7974a6ea452d092cd9f66fe8efc4ef13f35": 1.05,
}


def named(weights_hash: str) -> dict[str, str]:
    """A model's named presets: ``{"faithful": spec, "balanced": spec, "compact": spec}``."""
    return MEASURED_PRESETS.get(weights_hash, UNMEASURED)


def resolve(name_or_spec: str, weights_hash: str) -> str:
    """The spec a preset name stands for with a model's weights; a spec is returned as given,
    once its grammar is checked (its layers and heads are checked against the model on use)."""
    given = name_or_spec.strip()
    if given in NAMES:
        return named(weights_hash)[given]
    if transform.is_transform_preset(given):
        transform.preset_bits(given)  # in range
        return given
    base, *overrides = given.split("+")
    if not _BASE.match(base) or not all(_OVERRIDE.match(o) for o in overrides):
        raise InvalidArgument(
            f"unknown preset {name_or_spec!r}: name one of {', '.join(NAMES)}, "
            "or give a spec such as 'e3' (entropy coded, bits per element), "
            "'e1.25p64' (the same, predicted from the previous layer), "
            "'e1.25p64i32' (predicted from its first 32 coefficients per head), "
            "'t3' (transform coded), 'k4v2' or 'k3v2+k5@0-1'"
        )
    return given


def name_of(spec: str, weights_hash: str) -> str | None:
    """The name a spec goes by with a model's weights (the most faithful, where two share it), else None."""
    return next((name for name, known in named(weights_hash).items() if known == spec), None)


def restore_window(spec: str) -> str:
    """How a restore of a preset makes its exact window unless told: with no forward pass
    (``stored``) for an entropy-coded preset of ``STORED_WINDOW_BITS`` or more, whose restored
    positions are close enough that recomputing the last 32 buys little (SmolLM2 ``e3``, KL 0.0030
    stored against 0.0028 recomputed at 8,000 tokens, decision 0041) at the cost of a forward pass
    over them; ``recompute`` for the others, whose errors the recomputed window hides from the next
    tokens (decision 0022; SmolLM2 ``e0.32jp384``, KL 0.211 and 0.298 stored against 0.167 and
    0.253 recomputed at 1,024 and 8,000 tokens, decision 0044)."""
    stored = transform.is_entropy_coded(spec) and transform.preset_bits(spec) >= STORED_WINDOW_BITS
    return "stored" if stored else "recompute"


def key_sharpening(weights_hash: str, spec: str = "") -> float:
    """The factor a restore sharpens a model's de-quantized keys by: none for a transform preset,
    whose quantizers leave too little error for centroids' flattening to matter."""
    return 1.0 if transform.is_transform_preset(spec) else MEASURED_KEY_SHARPENING.get(weights_hash, 1.0)


_BASE = re.compile(r"^k(\d+)(?:x(\d+))?v(\d+)(?:x(\d+))?$")
_OVERRIDE = re.compile(r"^([kv])(\d+)(?:x(\d+))?@([\d,.\-]+)$")


def _targets(spec: str, layers: int, heads: int) -> list[tuple[int, int | None]]:
    """``(layer, head)`` pairs an override names; head None means every head of the layer."""
    out: list[tuple[int, int | None]] = []
    for part in spec.split(","):
        if "." in part:
            a, _, h = part.partition(".")
            if not a.isdigit() or not h.isdigit():
                raise InvalidArgument(f"bad head {part!r}: expected layer.head, e.g. '18.2'")
            layer, head = int(a), int(h)
            if not 0 <= layer < layers or not 0 <= head < heads:
                raise InvalidArgument(f"head {part!r} is outside layers 0..{layers - 1}, heads 0..{heads - 1}")
            out.append((layer, head))
            continue
        a, _, b = part.partition("-")
        if not a.isdigit() or (b and not b.isdigit()):
            raise InvalidArgument(f"bad layer range {part!r}: expected e.g. '3', '0-5' or '18.2'")
        lo, hi = int(a), int(b) if b else int(a)
        if not 0 <= lo <= hi < layers:
            raise InvalidArgument(f"layer range {part!r} is outside 0..{layers - 1}")
        out.extend((layer, None) for layer in range(lo, hi + 1))
    return out


def head_allocation(preset: str, layers: int, heads: int) -> dict[str, list[list[tuple[int, ...]]]]:
    """Codebook sizes per stage, per kind, per layer, per head: ``{"k": [[(256, ...), ...], ...], "v": ...}``."""
    base, *overrides = preset.strip().split("+")
    m = _BASE.match(base)
    if not m:
        raise InvalidArgument(
            f"unknown preset {preset!r}: expected e.g. 'k4v2', 'k2x1024v1', 'k3v2+k5@0-1', 'k3v3+k12@18.2'"
        )
    ks, kn, vs, vn = int(m[1]), int(m[2] or 256), int(m[3]), int(m[4] or 256)
    alloc = {"k": [[(kn,) * ks] * heads for _ in range(layers)], "v": [[(vn,) * vs] * heads for _ in range(layers)]}
    for o in overrides:
        mo = _OVERRIDE.match(o)
        if not mo:
            raise InvalidArgument(f"bad preset override {o!r} in {preset!r}: expected e.g. 'k5@0-1' or 'k12@18.2'")
        sizes = (int(mo[3] or 256),) * int(mo[2])
        for layer, head in _targets(mo[4], layers, heads):
            for h in range(heads) if head is None else (head,):
                alloc[mo[1]][layer][h] = sizes
    for kind in KINDS:
        for layer, per_head in enumerate(alloc[kind]):
            longest = max(per_head, key=len)
            for sizes in per_head:
                if sizes != longest[: len(sizes)]:
                    raise InvalidArgument(
                        f"{preset!r} gives {kind} heads of layer {layer} codebooks of different sizes "
                        f"({sizes} and {longest}): "
                        "a layer's heads share its codebook sizes and differ only in how many stages they take"
                    )
                if any(not 2 <= s <= 65536 for s in sizes):
                    raise InvalidArgument(
                        f"codebook size {sizes[0]} in {preset!r} is outside 2..65536 (codes are uint16)"
                    )
    return alloc


def allocation(preset: str, layers: int, heads: int) -> dict[str, list[tuple[int, ...]]]:
    """Codebook sizes per stage, per layer, per kind, as many as the layer's deepest head takes:
    ``{"k": [(256, 256, ...), ...], "v": [...]}``."""
    per_head = head_allocation(preset, layers, heads)
    return {kind: [max(layer, key=len) for layer in per_head[kind]] for kind in KINDS}


def depths(preset: str, layers: int, heads: int) -> dict[str, np.ndarray]:
    """How many of its layer's stages each head takes: int ``[layers, heads]`` per kind."""
    per_head = head_allocation(preset, layers, heads)
    return {
        kind: np.array([[len(s) for s in layer] for layer in per_head[kind]], dtype=np.int64).reshape(layers, heads)
        for kind in KINDS
    }


def code_bytes_per_token(preset: str, layers: int, heads: int) -> float:
    """Ideal packed bytes per token of a preset's codes (fractal blocks add 12 B per 4096 symbols)."""
    alloc = head_allocation(preset, layers, heads)
    return (
        sum(
            fractal.layout(s).bits_per_symbol
            for kind in KINDS
            for layer in alloc[kind]
            for sizes in layer
            for s in sizes
        )
        / 8
    )

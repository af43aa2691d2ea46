"""What a tier K restore was measured to cost: the figures ``make fidelity`` (a release step:
``benchmarks/kv_presets.py``) writes to ``kvdb/data/kv_fidelity.json`` through ``record``
(docs/formats.md), per model (weights hash), preset spec, codebook source and context length.
``restore --mode auto`` takes tier K only for a preset measured here within the caller's
tolerance (docs/decisions/0039-auto-restore-takes-measured-presets.md).

A restore reads only the figures of a spec's shipped codebooks: they are the same on every machine
that builds the recipe. A "trained" entry is of the codebooks a benchmark trained on its own
corpus, kept for comparison; codebooks trained on an archive's sessions fit that archive, and
nothing measured them.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from kvdb.codecs import presets
from kvdb.errors import InvalidArgument
from kvdb.files import replace_whole

FILE = Path(__file__).resolve().parents[1] / "data" / "kv_fidelity.json"  # kvdb/data/
SOURCES = ("shipped", "trained")
FIGURES = ("ppl_ratio", "kl", "top1")


@functools.cache
def table() -> dict:
    """The whole file, read once per process."""
    return json.loads(FILE.read_text(encoding="utf-8"))


def measured(weights_hash: str, spec: str, source: str) -> dict | None:
    """``{"lengths": {"1024": {"ppl_ratio", "kl", "top1"}, ...}, "measured_by": ...}`` of a preset
    spec's codebooks of ``source`` on a model, or None where nothing measured them, or where they
    were measured with another key sharpening than a restore now applies (the figures are stale)."""
    found = table().get(weights_hash, {}).get(spec, {}).get(source)
    if not found or not found.get("lengths"):
        return None
    if found.get("key_sharpening", 1.0) != presets.key_sharpening(weights_hash, spec):
        return None
    return found


def worst_ppl(lengths: dict) -> tuple[int, float] | None:
    """(context length, perplexity ratio) of the worst measured length, or None if no length has one."""
    known = [(int(n), float(f["ppl_ratio"])) for n, f in lengths.items() if f.get("ppl_ratio") is not None]
    return max(known, key=lambda p: p[1]) if known else None


def record(
    weights_hash: str,
    spec: str,
    source: str,
    lengths: dict[int, dict[str, float | None]],
    key_sharpening: float,
    measured_by: str,
) -> None:
    """Write what a run measured of one preset spec's codebooks (``source``: "shipped" or
    "trained") on one model into ``FILE``, replacing that entry whole (its figures come from one
    run); other models', specs' and sources' entries are kept. ``lengths``: context length ->
    ``{"ppl_ratio", "kl", "top1"}``, a figure None where the run did not measure it;
    ``key_sharpening``: the factor the restores measured applied (``presets.key_sharpening``),
    without which ``measured`` ignores the entry; ``measured_by``: e.g. "benchmarks/kv_presets.py 2026-12-02"."""
    if source not in SOURCES:
        raise InvalidArgument(f"source {source!r}: expected one of {', '.join(SOURCES)}")
    for n, figures in lengths.items():
        if set(figures) != set(FIGURES):
            raise InvalidArgument(
                f"length {n}: expected the figures {', '.join(FIGURES)} (None where unmeasured), got {sorted(figures)}"
            )
    found = json.loads(FILE.read_text(encoding="utf-8")) if FILE.exists() else {}
    entry = {
        "key_sharpening": key_sharpening,
        "lengths": {
            str(n): {k: (None if v is None else round(float(v), 4)) for k, v in figures.items()}
            for n, figures in sorted(lengths.items())
        },
        "measured_by": measured_by,
    }
    found.setdefault(weights_hash, {}).setdefault(spec, {})[source] = entry
    replace_whole(FILE, (json.dumps(found, indent=2, sort_keys=True) + "\n").encode())
    table.cache_clear()

"""Per-layer keys and values of a token stream, RoPE undone/redone, and caches rebuilt from arrays.

The KV tier (docs/decisions/0008-tier-k-pre-rope-keys.md and 0009-tier-k-exact-window.md) stores quantized K and V;
this module is the torch side of it:

* :func:`capture_chunks` / :func:`capture` run the model over a token stream in chunks of
  ``CHUNK`` tokens (the same chunked forward ingest and prefill use) and hand back each chunk's
  K and V as float32 numpy arrays ``[layers, kv_heads, chunk, head_dim]``.
* With ``pre_rope=True`` the keys come back *before* the rotary position embedding: the cache
  holds rotated keys, and RoPE is a rotation per pair of dimensions, so applying the inverse
  rotation (cos, -sin) at each key's position recovers the projection exactly (to float32
  rounding). :func:`apply_rope` re-rotates on restore. Models without a rotary embedding
  (GPT-2 and other absolute-position models) have nothing to undo: both are the identity.
* :func:`build_cache` turns (de-quantized) arrays into a transformers ``DynamicCache`` usable
  with ``model(ids, cache=...)`` and ``generate``.
* :func:`restore_layers` is the
  approximate-restore path with the exact window policies the measurements chose: the
  attention sinks recomputed exactly from their tokens, or given exact, and the most recent
  tokens recomputed by a short forward pass over the restored prefix, or taken as stored. It
  builds the cache one layer at a time (docs/decisions/0024-restore-layer-by-layer.md).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from kvdb.errors import InvalidArgument, UnsupportedModel
from kvdb.model.loading import CHUNK, new_cache

SINKS = 4  # attention-sink positions kept exact
RECENT = 32  # most recent positions kept exact


# ------------------------------------------------------------------------------------------
# RoPE
# ------------------------------------------------------------------------------------------


def _rotary(model):
    """The model's rotary embedding module, or None for models without RoPE. It sits on the base
    model under whatever name the architecture gives it (``model.model``, ``model.gpt_neox``, ...)."""
    return getattr(getattr(model, "base_model", model), "rotary_emb", None)


@torch.no_grad()
def rope_tables(model, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """cos and sin (float32) of positions ``start .. start+count-1``, ``[count, rotary dims]``;
    or None for a model without RoPE. Where the rotary tables differ by layer type (Gemma3: local
    and global layers have their own base), ``[layers, 1, count, rotary dims]``, one per layer,
    to broadcast over the heads of ``[layers, heads, seq, dim]`` keys."""
    rotary = _rotary(model)
    if rotary is None:
        return None
    positions = torch.arange(start, start + count, dtype=torch.long)[None]
    probe = torch.zeros(1, dtype=torch.float32)
    if "layer_type" not in inspect.signature(rotary.forward).parameters:
        cos, sin = rotary(probe, positions)
        return cos[0].float(), sin[0].float()
    types = model.config.layer_types
    by_type = {kind: rotary(probe, positions, layer_type=kind) for kind in set(types)}
    cos = torch.stack([by_type[kind][0][0] for kind in types])[:, None]
    sin = torch.stack([by_type[kind][1][0] for kind in types])[:, None]
    return cos.float(), sin.float()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(model, keys, start: int = 0, inverse: bool = False) -> np.ndarray:
    """Rotate keys ``[..., seq, head_dim]`` to (or, ``inverse``, back from) their positions, as a
    new array (:func:`rotator` turns the caller's own in place).

    Forward is the model's own ``k * cos + rotate_half(k) * sin`` over the rotary dimensions: all
    of them, or with partial RoPE (GPT-NeoX's ``rotary_pct``, Phi3's ``partial_rotary_factor``)
    the first ``rotary_dim``, the rest passing through as the model passes them. The inverse is
    the transposed rotation divided by ``cos² + sin²`` (1 unless the rope type scales
    attention), so it is exact up to float32 rounding.
    """
    k = torch.tensor(np.asarray(keys, dtype=np.float32))
    return rotator(model, start, k.shape[-2], inverse)(k).numpy()


def _turned(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rotary = cos.shape[-1]
    if rotary > k.shape[-1] or rotary % 2:
        raise UnsupportedModel(
            f"rotary tables of {rotary} dims do not fit keys of {k.shape[-1]}; "
            "this model's RoPE layout is not supported"
        )
    turn, rest = k[..., :rotary], k[..., rotary:]
    turned = turn * cos + _rotate_half(turn) * sin
    return turned if rotary == k.shape[-1] else torch.cat([turned, rest], dim=-1)


def rotator(model, start: int, count: int, inverse: bool = False):
    """A function ``rotate(k, layer=None)`` turning pre-RoPE keys ``[..., count, head_dim]`` (a
    tensor of the caller's own, overwritten and returned) to positions ``start ..`` (or,
    ``inverse``, post-RoPE keys back from them); ``layer`` picks that layer's tables where they
    differ by layer, None takes keys of every layer.

    The tables are computed once for all the layers a restore turns one by one. The pairs
    (x1, x2) of the two halves become (x1 cos - x2 sin, x2 cos + x1 sin): three passes over the
    keys and a temporary of half their size, where the general form makes five and two
    (decision 0042 measured it). Rotary tables whose halves
    differ or cover part of the head take the general form."""
    tables = rope_tables(model, start, count)
    if tables is None:
        return lambda k, layer=None: k
    cos, sin = tables
    half = cos.shape[-1] // 2
    halves_alike = torch.equal(cos[..., :half], cos[..., half:]) and torch.equal(sin[..., :half], sin[..., half:])
    if inverse:  # the transposed rotation over cos² + sin² is a rotation by these tables
        norm = cos * cos + sin * sin
        cos, sin = cos / norm, -sin / norm

    @torch.no_grad()
    def rotate(k: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        c, s = (cos, sin) if layer is None or cos.dim() < 4 else (cos[layer], sin[layer])
        if not halves_alike or c.shape[-1] != k.shape[-1]:
            return k.copy_(_turned(k, c, s))
        c, s = c[..., :half], s[..., :half]
        x1, x2 = k[..., :half], k[..., half:]
        x2_sin = x2 * s
        x2.mul_(c).addcmul_(x1, s)
        x1.mul_(c).sub_(x2_sin)
        return k

    return rotate


def _layer_kv(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    entry = cache.layers[layer]
    return entry.keys, entry.values


@torch.no_grad()
def capture_chunks(
    model, ids, chunk: int = CHUNK, pre_rope: bool = False, cache=None
) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """Yield ``(start, keys, values)`` per chunk of ``ids``: float32 ``[layers, kv_heads, n, head_dim]``.

    One forward pass per chunk over a growing ``DynamicCache`` (pass ``cache`` to continue one);
    each chunk's arrays are copies, so the caller may keep or drop them. Keys are post-RoPE as the
    cache holds them, or pre-RoPE with ``pre_rope=True``.
    """
    ids = torch.as_tensor(np.asarray(ids, dtype=np.int64)).reshape(1, -1)
    cache = new_cache(model) if cache is None else cache
    offset = cache.get_seq_length()
    for start in range(0, ids.shape[1], chunk):
        end = min(start + chunk, ids.shape[1])
        model(ids[:, start:end], cache=cache, use_cache=True)
        lo, hi = offset + start, offset + end
        keys = np.stack([_layer_kv(cache, i)[0][0, :, lo:hi].float().numpy() for i in range(len(cache.layers))])
        values = np.stack([_layer_kv(cache, i)[1][0, :, lo:hi].float().numpy() for i in range(len(cache.layers))])
        if pre_rope:
            rotator(model, lo, hi - lo, inverse=True)(torch.from_numpy(keys))
        yield lo, np.ascontiguousarray(keys, dtype=np.float32), np.ascontiguousarray(values, dtype=np.float32)


def cache_arrays(
    cache, start: int = 0, end: int | None = None, dtype: torch.dtype = torch.float32
) -> tuple[np.ndarray, np.ndarray]:
    """Keys (post-RoPE, as cached) and values of positions [start, end) of a DynamicCache,
    ``[layers, kv_heads, seq, head_dim]`` in ``dtype``: ingest takes tier K from the pass it
    scores with, and the prefix cache float16 straight from the cache (one copy, not three)."""
    layers = range(len(cache.layers))
    keys = torch.stack([_layer_kv(cache, i)[0][0, :, start:end].to(dtype) for i in layers])
    values = torch.stack([_layer_kv(cache, i)[1][0, :, start:end].to(dtype) for i in layers])
    return keys.numpy(), values.numpy()


def capture(model, ids, chunk: int = CHUNK, pre_rope: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """All of ``ids``' keys and values, float32 ``[layers, kv_heads, seq, head_dim]`` each."""
    parts = list(capture_chunks(model, ids, chunk, pre_rope))
    if not parts:
        layers, _, kv, dim = attention_shape(model)
        empty = np.zeros((layers, kv, 0, dim), dtype=np.float32)
        return empty, empty.copy()
    return np.concatenate([p[1] for p in parts], axis=2), np.concatenate([p[2] for p in parts], axis=2)


# ------------------------------------------------------------------------------------------
# restore
# ------------------------------------------------------------------------------------------


def build_cache(model, keys, values, pre_rope: bool = False, start: int = 0, cache=None):
    """A ``DynamicCache`` holding ``keys``/``values`` ``[layers, kv_heads, seq, head_dim]``.

    ``pre_rope`` keys are rotated to positions ``start ..`` first. Passing ``cache`` appends to it
    (its length must be ``start``). The tensors take the model's dtype; a new cache's layers are
    views of them (float32 arrays are not copied again: the cache takes them over).
    """
    keys = torch.as_tensor(np.asarray(keys, dtype=np.float32))
    values = torch.as_tensor(np.asarray(values, dtype=np.float32))
    if keys.shape != values.shape or keys.ndim != 4:
        raise ValueError(
            f"keys and values must both be [layers, heads, seq, dim], got {tuple(keys.shape)} and {tuple(values.shape)}"
        )
    if pre_rope:
        keys = rotator(model, start, keys.shape[-2])(keys.clone())
    return _into_cache(model, keys, values, cache)


def _into_cache(model, keys: torch.Tensor, values: torch.Tensor, cache=None):
    dtype = next(model.parameters()).dtype
    keys, values = keys.to(dtype), values.to(dtype)
    if cache is not None:
        for layer in range(keys.shape[0]):
            cache.update(keys[layer][None], values[layer][None], layer)
        return cache
    cache = new_cache(model)
    for layer in range(keys.shape[0]):
        _hold(cache, layer, keys[layer][None], values[layer][None])
    return cache


def _hold(cache, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Make ``layer`` of ``cache`` hold these tensors by reference (views, no copy): update()
    creates the layer, then its tensors are these."""
    cache.update(keys[:, :, :0], values[:, :, :0], layer)
    cache.layers[layer].keys, cache.layers[layer].values = keys, values


def prefix_view(cache, positions: int):
    """A cache of the first ``positions`` positions of ``cache`` that shares its tensors (views,
    no copy): a cache layer grows by concatenation and crops by slicing, into new tensors, so
    neither cache changes what the other holds. A server resumes a turn from memory this way,
    where a copy of the whole cache was a share of the turn's time that grows with the context."""
    from transformers import DynamicCache

    view: Any = DynamicCache()  # its layers are made by update(): full-attention layers, which hold keys
    for index, layer in enumerate(cache.layers):
        _hold(view, index, layer.keys[:, :, :positions], layer.values[:, :, :positions])
    return view


WINDOWS = ("recompute", "stored", "quantized", "none")


@torch.no_grad()
def restore_layers(
    model,
    ids,
    layers,
    pre_rope: bool = False,
    sinks: int = SINKS,
    recent: int = RECENT,
    window: str = "recompute",
    exact_sinks: tuple[np.ndarray, np.ndarray] | None = None,
):
    """The approximate cache of ``ids`` from de-quantized keys and values: ``layers`` gives each
    layer's ``(keys, values)``, float32 ``[kv_heads, seq, head_dim]`` covering all of ``ids``
    (the cache takes them over), and is consumed one layer at a time, so a layer is rotated and
    placed while its decode is still in the CPU's cache (``code_layout.decode_streams``).

    ``window`` says what happens to the exact window:

    * ``"recompute"`` (default): the first ``sinks`` positions are recomputed from their tokens
      (exact: they attend only to themselves), positions ``sinks .. n-recent`` come from the
      arrays, and the last ``recent`` are recomputed by one forward pass of their tokens over
      that restored prefix (the same pass generation would make, so no bytes are stored for
      them; their values carry the prefix's quantization error only through attention).
    * ``"stored"``: no forward pass. The first positions are ``exact_sinks`` (their exact keys,
      as a cache holds them, and values: the same for every path that opens with the same
      tokens), everything else from the arrays.
    * ``"quantized"``: sinks recomputed, everything else from the arrays.
    * ``"none"``: every position from the arrays.

    Storing the window in fp16 instead is done by the caller: pass the exact arrays for those
    positions (``window="none"``).
    """
    if window not in WINDOWS:
        raise ValueError(f"window must be one of {', '.join(map(repr, WINDOWS))}, got {window!r}")
    if window == "stored" and exact_sinks is None:
        raise ValueError("window='stored' needs exact_sinks: the exact keys and values of the first positions")
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    n = len(ids)
    head = min(sinks, n) if window in ("recompute", "quantized") else 0
    tail = min(recent, n - head) if window == "recompute" else 0
    # positions taken from exact_sinks
    given = min(exact_sinks[0].shape[2], n) if window == "stored" and exact_sinks is not None else 0
    rotate = rotator(model, head, n - head - tail) if pre_rope else None
    dtype = next(model.parameters()).dtype
    cache = new_cache(model)
    restored = 0
    for layer, (k, v) in enumerate(layers):
        k, v = (torch.as_tensor(np.asarray(a, dtype=np.float32) if isinstance(a, np.ndarray) else a) for a in (k, v))
        if k.shape != v.shape or k.ndim != 3 or k.shape[1] < n:
            raise ValueError(
                f"layer {layer}: keys and values must both be [heads, seq >= {n}, dim], "
                f"got {tuple(k.shape)} and {tuple(v.shape)}"
            )
        k, v = k[:, head : n - tail], v[:, head : n - tail]
        if rotate is not None:
            rotate(k, layer)
        if given and exact_sinks is not None:
            k[:, :given] = torch.as_tensor(exact_sinks[0][layer, :, :given])
            v[:, :given] = torch.as_tensor(exact_sinks[1][layer, :, :given])
        k, v = k.to(dtype)[None], v.to(dtype)[None]
        _hold(cache, layer, k, v)
        restored += 1
    if restored != attention_shape(model)[0]:
        raise ValueError(f"{restored} layers of keys and values given; the model has {attention_shape(model)[0]}")
    _recompute_ends(model, cache, ids, head, tail)
    return cache


def _recompute_ends(model, cache, ids: np.ndarray, head: int, tail: int) -> None:
    """Run the first ``head`` and last ``tail`` tokens of ``ids`` in one forward pass onto a
    cache holding the middle (positions head .. n - tail), then put the cache in position order.

    One pass instead of two reads the weights once (decision 0009 has the measurement). The mask
    makes it the same computation: the sinks see only themselves, causally; the recent tokens see
    the middle, the sinks and, causally, themselves.
    """
    n, mid = len(ids), len(ids) - head - tail
    if head + tail == 0:
        return
    tokens = torch.as_tensor(np.concatenate([ids[:head], ids[n - tail :]]))[None]
    positions = torch.cat([torch.arange(head), torch.arange(n - tail, n)])[None]
    allowed = torch.zeros(head + tail, mid + head + tail, dtype=torch.bool)
    allowed[:head, mid : mid + head] = torch.ones(head, head, dtype=torch.bool).tril()
    allowed[head:, : mid + head] = True
    allowed[head:, mid + head :] = torch.ones(tail, tail, dtype=torch.bool).tril()
    keys_at = torch.cat([torch.arange(head, n - tail), positions[0]])  # the absolute position of each cached column
    model(
        tokens,
        cache=cache,
        position_ids=positions,
        attention_mask=_masks(model, allowed, positions[0], keys_at),
        use_cache=True,
    )
    for layer in cache.layers:  # [middle, sinks, recent] -> [sinks, middle, recent]
        layer.keys = torch.cat(
            [layer.keys[:, :, mid : mid + head], layer.keys[:, :, :mid], layer.keys[:, :, mid + head :]], dim=2
        )
        layer.values = torch.cat(
            [layer.values[:, :, mid : mid + head], layer.values[:, :, :mid], layer.values[:, :, mid + head :]], dim=2
        )


def _masks(model, allowed: torch.Tensor, queries_at: torch.Tensor, keys_at: torch.Tensor):
    """The additive 4-D mask of ``allowed`` (query x key), and for sliding-window layers the same
    mask cut to the window: a dict by layer type where the config names types per layer (Gemma2,
    Qwen2), the windowed mask alone where every layer slides (Mistral). A mask passed in is used
    as given, so the window must be in it."""
    dtype = next(model.parameters()).dtype

    def additive(ok: torch.Tensor) -> torch.Tensor:
        return torch.zeros(ok.shape, dtype=dtype).masked_fill(~ok, torch.finfo(dtype).min)[None, None]

    config = getattr(model, "config", None)
    window = getattr(config, "sliding_window", None)
    kinds = set(getattr(config, "layer_types", None) or [])
    if not window or (kinds and "sliding_attention" not in kinds):
        return additive(allowed)
    windowed = additive(allowed & (queries_at[:, None] - keys_at[None, :] < window))
    return (
        {kind: windowed if kind == "sliding_attention" else additive(allowed) for kind in kinds} if kinds else windowed
    )


@torch.no_grad()
def next_token_logits(model, cache, ids) -> torch.Tensor:
    """Run ``ids`` after ``cache`` (which it extends): the next-token logits at each step, float32
    ``[n, vocab]``; row i predicts ``ids[i+1]`` (the last row, what follows them)."""
    t = torch.as_tensor(np.asarray(ids, dtype=np.int64)).reshape(1, -1)
    return model(t, cache=cache, use_cache=True).logits[0].float()


@torch.no_grad()
def teacher_forced(model, cache, ids) -> tuple[np.ndarray, np.ndarray]:
    """Run ``ids`` after ``cache`` (which it extends): natural-log probability of ``ids[1:]`` and the argmax at
    each step.

    Returns ``(logp [n-1], argmax [n])``; position i predicts ``ids[i+1]``. The first id is the
    one following the cached prefix (its own probability belongs to the prefix's last logits).
    """
    logits = next_token_logits(model, cache, ids)
    logp = torch.log_softmax(logits, dim=-1)
    picked = logp[:-1].gather(1, torch.as_tensor(np.asarray(ids, dtype=np.int64))[1:, None])[:, 0]
    return picked.numpy(), logits.argmax(-1).numpy()


# ------------------------------------------------------------------------------------------
# error metrics for the quantizer: which key/value dimensions matter to the model
# ------------------------------------------------------------------------------------------


def _attention_modules(model):
    inner = getattr(model, "model", model)
    return [layer.self_attn for layer in inner.layers]


def attention_shape(model) -> tuple[int, int, int, int]:
    """(layers, query heads, KV heads, head dim); configs without ``num_key_value_heads`` (GPT-2,
    GPT-NeoX) have one KV head per query head."""
    cfg = model.config
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, heads, kv, dim


def cache_fisher(model, contexts: Iterable[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The diagonal Fisher information of the model's loss on ``contexts`` (token id arrays, each
    its own context, as the calibration captures are) with respect to its pre-RoPE
    keys and values: float64 ``[layers, kv_heads, head_dim]`` each, the mean over positions of the
    squared gradient, the attention sinks left out.

    A small error ``e`` in a cached vector raises the loss by about ``e^T F e / 2``, so scaling each
    dimension by ``sqrt(F)`` before quantizing makes squared error track what the model loses: the
    metric tier K's transform coder allocates its bits by (``kvdb.codecs.transform``). The gradient
    is taken with respect to the projections' outputs only: the weights get none."""
    layers, _, kv, dim = attention_shape(model)
    outputs: dict[tuple[int, int], torch.Tensor] = {}  # (k 0 / v 1, layer) -> the projection's output
    hooks = []
    for layer, attn in enumerate(_attention_modules(model)):
        for kind, proj in enumerate((attn.k_proj, attn.v_proj)):
            hooks.append(proj.register_forward_hook(lambda _m, _i, out, at=(kind, layer): outputs.__setitem__(at, out)))
    sums = np.zeros((2, layers, kv, dim))
    count = 0
    try:
        for ids in contexts:
            part = torch.as_tensor(np.asarray(ids, dtype=np.int64))[None]
            if part.shape[1] <= SINKS + 1:
                continue
            outputs.clear()
            with torch.enable_grad():
                embeds = model.get_input_embeddings()(part).detach().requires_grad_(True)
                loss = model(inputs_embeds=embeds, labels=part).loss * (part.shape[1] - 1)
                grads = torch.autograd.grad(loss, list(outputs.values()))
            for (kind, layer), g in zip(outputs, grads):
                g = g[0, SINKS:].double().reshape(-1, kv, dim)
                sums[kind, layer] += (g * g).sum(0).numpy()
            count += part.shape[1] - SINKS
    finally:
        for h in hooks:
            h.remove()
    if not count:
        raise InvalidArgument(f"the Fisher information needs a context longer than {SINKS + 1} tokens")
    return sums[0] / count, sums[1] / count


@torch.no_grad()
def key_weights(model, ids, chunk: int = CHUNK) -> np.ndarray:
    """Per key dimension, the RMS of the queries that read it: float32 ``[layers, kv_heads, head_dim]``.

    A key error ``e`` moves a logit by ``q · e``; its expected square is ``e^T E[q q^T] e``. Scaling
    key dimension d by ``sqrt(E[q_d^2])`` before quantizing makes plain L2 error track that (the
    diagonal of the metric). Queries are taken before RoPE from ``q_proj``, pooled over the query
    heads that share a KV head and, for RoPE models, over each rotated pair (d, d + dim/2): a
    relative rotation mixes the two, so only their mean matters to pre-RoPE keys.
    """
    layers, heads, kv, dim = attention_shape(model)
    sums = torch.zeros(layers, heads, dim, dtype=torch.float64)
    count = [0]
    hooks = []

    def hook(i):
        def fn(_module, _inp, out):
            q = out[0].double().reshape(-1, heads, dim)
            sums[i] += (q * q).sum(0)
            if i == 0:
                count[0] += q.shape[0]

        return fn

    for i, attn in enumerate(_attention_modules(model)):
        hooks.append(attn.q_proj.register_forward_hook(hook(i)))
    try:
        for _ in capture_chunks(model, ids, chunk):
            pass
    finally:
        for h in hooks:
            h.remove()
    ms = (sums / max(count[0], 1)).reshape(layers, kv, heads // kv, dim).mean(2)
    if _rotary(model) is not None:
        half = dim // 2
        pair = (ms[..., :half] + ms[..., half:]) / 2
        ms = torch.cat([pair, pair], dim=-1)
    return ms.sqrt().float().numpy()


@torch.no_grad()
def value_weights(model) -> np.ndarray:
    """Per value dimension, how much the output projection amplifies it: ``[layers, kv_heads, head_dim]``.

    A value error ``e`` reaches the residual stream as ``W_o[:, head] e`` for each query head of the
    group; the diagonal of ``sum_h W_h^T W_h`` (column norms) is its expected square per dimension.
    """
    layers, heads, kv, dim = attention_shape(model)
    out = np.empty((layers, kv, dim), dtype=np.float32)
    for i, attn in enumerate(_attention_modules(model)):
        w = attn.o_proj.weight.detach().double()  # [hidden, heads * dim]
        col = (w * w).sum(0).reshape(kv, heads // kv, dim).sum(1)
        out[i] = col.sqrt().float().numpy()
    return out

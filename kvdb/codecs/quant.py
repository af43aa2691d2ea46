"""Residual vector quantization of KV caches: codebooks, their bytes, training, codes (pure numpy + faiss).

One residual quantizer per (layer, KV head, kind), kind ``k`` (keys) or ``v`` (values), trained
with faiss k-means on the model's own vectors (choices and measurements in
docs/decisions/0010-tier-k-default-preset.md; byte layout in docs/formats.md). Stage s quantizes what
stages < s left over; the decoded vector is the sum of the
chosen centroids. Stages nest: the first n stages of a deeper quantizer are exactly the
quantizer a shallower preset would train, so one training run serves every preset that takes a
prefix of its stages (the benchmarks cut them down with ``benchmarks/kv_support.truncate``).

A preset (``kvdb.codecs.presets``) names how many stages, of which sizes, each kind gets in each layer
and head; a head with fewer stages than its layer uses a prefix of them. Codes are uint16
``[layers, heads, stages, seq]`` per kind; rows past a layer's or a head's depth hold 0 and are
never stored (``kvdb.codecs.code_layout``).

Codebooks serialize to a versioned, self-describing byte format (no pickle), see
:meth:`Codebooks.to_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from kvdb.codecs import framing
from kvdb.codecs.presets import DEFAULT_PRESET, KINDS, allocation, depths
from kvdb.errors import CorruptData, InvalidArgument

MAGIC = b"KVDBRVQ\x00"
VERSION = 2  # the newest this kvdb reads; a set whose heads all take their layer's stages is written as version 1


# ------------------------------------------------------------------------------------------
# codebooks
# ------------------------------------------------------------------------------------------


@dataclass
class Codebooks:
    """Centroids ``books[kind][layer][stage]``: float32 arrays ``[heads, size, dim]`` (fp16-exact values).

    ``pre_rope`` records whether keys were quantized before the rotary embedding (the restore path
    must then re-rotate them). ``meta`` is free-form JSON (model id, calibration text, ...).
    ``depths`` (kind -> int ``[layers, heads]``) holds, for a kind whose heads differ, how many of
    the layer's stages each head takes; a head's centroids past its depth are zero and never stored.
    """

    layers: int
    heads: int
    dim: int
    pre_rope: bool
    books: dict[str, list[list[np.ndarray]]]
    preset: str = ""
    meta: dict = field(default_factory=dict)
    weights: dict[str, np.ndarray] = field(default_factory=dict)  # kind -> [layers, heads, dim] metric scales
    depths: dict[str, np.ndarray] = field(default_factory=dict)  # kind -> [layers, heads], where heads differ
    _tables: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # kind -> gather_table()

    def stages(self, kind: str) -> list[tuple[int, ...]]:
        return [tuple(b.shape[1] for b in layer) for layer in self.books[kind]]

    def max_stages(self, kind: str) -> int:
        return max((len(s) for s in self.stages(kind)), default=0)

    def depth(self, kind: str) -> np.ndarray:
        """How many stages each head takes: int ``[layers, heads]``."""
        if kind in self.depths:
            return self.depths[kind]
        return np.repeat(np.array([len(s) for s in self.stages(kind)], dtype=np.int64)[:, None], self.heads, axis=1)

    def gather_table(self, kind: str):
        """(table, offsets): every centroid of ``kind`` as one float32 tensor ``[1 + total, dim]``,
        row 0 zero, each divided by its metric scales; and ``offsets[layer, head, stage]``, the
        row of that codebook's first centroid (0 where the layer or the head has no such stage). Built once."""
        if kind not in self._tables:
            import torch

            offsets = np.zeros((self.layers, self.heads, self.max_stages(kind)), np.int64)
            rows, at = [np.zeros((1, self.dim), np.float32)], 1
            depth = self.depth(kind)
            for layer, books in enumerate(self.books[kind]):
                scale = self.weights[kind][layer][:, None, :] if kind in self.weights else 1.0  # [heads, 1, dim]
                for stage, book in enumerate(books):
                    for head, centroids in enumerate(book / scale):
                        if stage >= depth[layer, head]:
                            continue
                        offsets[layer, head, stage] = at
                        rows.append(centroids)
                        at += len(centroids)
            self._tables[kind] = (torch.from_numpy(np.concatenate(rows).astype(np.float32)), offsets)
        return self._tables[kind]

    def sharpened(self, factor: float) -> Codebooks:
        """Codebooks for decoding only, whose keys come out ``factor`` times further from their
        head's centre (the mean of its first-stage centroids): ``c + factor * (sum - c)``.

        A centroid is the mean of the keys it stands for, so de-quantized keys spread less than
        the keys did, and attention over them is flatter than the model's: its copy heads lose
        the position they copy from (docs/decisions/0029-sharpened-keys.md). Folded into the
        centroids (the first stage moves toward ``c + factor * (centroid - c)``, later stages
        scale by ``factor``), so decoding is still the sum of one centroid per stage. Never
        encode with or store the result: its centroids are not the trained ones.
        """
        if factor == 1.0:
            return self
        books = dict(self.books)
        books["k"] = []
        for stages in self.books["k"]:
            if stages:
                centre = stages[0].mean(1, keepdims=True)  # [heads, 1, dim]
                stages = [centre + factor * (stages[0] - centre)] + [factor * stage for stage in stages[1:]]
            books["k"].append(stages)
        return replace(self, books=books, meta={**self.meta, "sharpened": factor})

    @property
    def nbytes(self) -> int:
        """Bytes the centroids take when stored (fp16): only the heads that take each stage."""
        return sum(
            int((self.depth(kind)[layer] > stage).sum()) * b.shape[1] * self.dim * 2
            for kind in KINDS
            for layer, books in enumerate(self.books[kind])
            for stage, b in enumerate(books)
        )

    # serialization ------------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        """``MAGIC | u32 version | u32 header length | JSON header | fp16 centroids | u32 CRC32``.

        The JSON header names everything needed to read the payload: ``layers``, ``heads``,
        ``dim``, ``pre_rope``, ``preset``, ``dtype`` ("<f2"), ``order`` and ``stages`` (per kind,
        per layer, the list of codebook sizes), plus ``meta``. The payload is every codebook in
        the order kind (k, v) > layer > stage, each a C-ordered little-endian float16 array
        ``[heads, size, dim]``, then for each kind listed in ``weights`` its float32 metric
        scales ``[layers, heads, dim]`` (vectors are multiplied by them before quantizing and
        divided after decoding). The CRC (zlib) covers every byte before it.

        Version 2 is written only where some head takes fewer stages than its layer: the header
        adds ``depths`` (per kind, per layer, each head's stage count) and each codebook holds
        only the heads that take its stage, ``[those heads, size, dim]``. Every other set is
        written as version 1, byte for byte as before.
        """
        _refuse_sharpened(self, "stored")
        header: dict[str, Any] = {
            "format": "kvdb-rvq",
            "layers": self.layers,
            "heads": self.heads,
            "dim": self.dim,
            "pre_rope": self.pre_rope,
            "preset": self.preset,
            "dtype": "<f2",
            "order": "kind>layer>stage; each [heads, size, dim] C-order",
            "stages": {kind: [list(s) for s in self.stages(kind)] for kind in KINDS},
            "meta": self.meta,
            "weights": [kind for kind in KINDS if kind in self.weights],
            "weights_dtype": "<f4",
        }
        if self.depths:
            header["depths"] = {kind: self.depth(kind).tolist() for kind in KINDS}
            header["order"] = "kind>layer>stage; each [heads that take the stage, size, dim] C-order"
        parts = []
        for kind in KINDS:
            depth = self.depth(kind)
            for layer, books in enumerate(self.books[kind]):
                for stage, book in enumerate(books):
                    parts.append(np.ascontiguousarray(book[depth[layer] > stage], dtype="<f2").tobytes())
        for kind in header["weights"]:
            parts.append(np.ascontiguousarray(self.weights[kind], dtype="<f4").tobytes())
        return framing.frame(MAGIC, 2 if self.depths else 1, header, parts)

    @classmethod
    def from_bytes(cls, blob: bytes) -> Codebooks:
        blob = bytes(blob)
        _, header, offset = framing.unframe(blob, MAGIC, VERSION, "codebook")
        heads, dim = header["heads"], header["dim"]
        dtype = np.dtype(header["dtype"])
        given = {
            kind: np.asarray(d, dtype=np.int64).reshape(header["layers"], heads)
            for kind, d in header.get("depths", {}).items()
        }
        books: dict[str, list[list[np.ndarray]]] = {}
        for kind in KINDS:
            books[kind] = []
            for layer_no, sizes in enumerate(header["stages"][kind]):
                layer = []
                for stage, size in enumerate(sizes):
                    has = given[kind][layer_no] > stage if kind in given else np.ones(heads, bool)
                    count = int(has.sum()) * size * dim
                    arr = np.zeros((heads, size, dim), np.float32)
                    arr[has] = np.frombuffer(blob, dtype=dtype, count=count, offset=offset).reshape(-1, size, dim)
                    layer.append(arr)
                    offset += count * dtype.itemsize
                books[kind].append(layer)
        weights = {}
        wdtype = np.dtype(header.get("weights_dtype", "<f4"))
        for kind in header.get("weights", []):
            count = header["layers"] * heads * dim
            weights[kind] = (
                np.frombuffer(blob, dtype=wdtype, count=count, offset=offset)
                .reshape(header["layers"], heads, dim)
                .astype(np.float32)
            )
            offset += count * wdtype.itemsize
        if offset != len(blob) - framing.CRC.size:
            raise CorruptData(f"codebook blob has {len(blob) - framing.CRC.size - offset} unexpected bytes")
        kept = {kind: d for kind, d in given.items() if not _uniform(d, header["stages"][kind])}
        return cls(
            header["layers"],
            heads,
            dim,
            header["pre_rope"],
            books,
            header.get("preset", ""),
            header.get("meta", {}),
            weights,
            kept,
        )


def _refuse_sharpened(codebooks: Codebooks, what: str) -> None:
    if "sharpened" in codebooks.meta:
        raise InvalidArgument(
            f"codebooks sharpened for decoding (x{codebooks.meta['sharpened']}) cannot be {what}; use the trained ones"
        )


def _uniform(depth: np.ndarray, stages: list) -> bool:
    """Whether every head takes all of its layer's stages."""
    return all((depth[layer] == len(sizes)).all() for layer, sizes in enumerate(stages))


# ------------------------------------------------------------------------------------------
# training
# ------------------------------------------------------------------------------------------


def _kmeans(x: np.ndarray, k: int, niter: int, seed: int, max_points: int) -> np.ndarray:
    import faiss

    if len(x) < k:  # too few vectors: every vector is a centroid, the rest repeat the mean
        out = np.repeat(x.mean(0, keepdims=True), k, axis=0)
        out[: len(x)] = x
        return out.astype(np.float32)
    km = faiss.Kmeans(
        x.shape[1],
        k,
        niter=niter,
        seed=seed,
        max_points_per_centroid=max_points,
        min_points_per_centroid=1,
        verbose=False,
    )
    km.train(np.ascontiguousarray(x, dtype=np.float32))
    assert km.centroids is not None  # set by train
    return km.centroids.reshape(k, x.shape[1]).copy()


def _fp16(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).astype(np.float32)


def train(
    vectors: dict[str, np.ndarray],
    preset: str = DEFAULT_PRESET,
    pre_rope: bool = True,
    niter: int = 12,
    seed: int = 1234,
    max_points: int = 50_000,
    meta: dict | None = None,
    progress=None,
    threads: int = 1,
    weights: dict[str, np.ndarray] | None = None,
) -> Codebooks:
    """Residual VQ codebooks for ``vectors = {"k": keys, "v": values}``, each ``[layers, heads, n, dim]``.

    A kind the preset gives no stages (``"k4v0"``) may be left out.
    Each stage is k-means (faiss, random init, ``niter`` iterations, one thread) on the
    residuals the earlier stages leave; centroids are rounded to float16 before the residuals
    are taken, so training, encoding and decoding all see the stored values. At most
    ``max_points`` vectors per codebook are sampled (faiss subsamples beyond
    ``max_points / size`` per centroid too). ``pre_rope`` only records what the keys are.

    ``weights`` (optional, per kind ``[layers, heads, dim]``, e.g. ``capture.key_weights`` and
    ``capture.value_weights``) sets the error metric: each dimension is scaled by its weight before
    quantizing, so L2 error tracks the model's sensitivity; weights are normalised to RMS 1.
    """
    import faiss

    shapes = {kind: np.shape(vectors[kind]) for kind in KINDS if kind in vectors}
    if (
        not shapes
        or any(len(s) != 4 for s in shapes.values())
        or len({(s[0], s[1], s[3]) for s in shapes.values()}) != 1
    ):
        raise InvalidArgument(
            f"vectors must map 'k'/'v' to [layers, heads, n, dim] arrays of equal layers/heads/dim, got {shapes}"
        )
    layers, heads, _, dim = next(iter(shapes.values()))
    alloc = allocation(preset, layers, heads)
    depth = depths(preset, layers, heads)
    rng = np.random.default_rng(seed)
    norm = {kind: normalise_weights(w) for kind, w in (weights or {}).items()}
    books: dict[str, list[list[np.ndarray]]] = {}
    previous = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(threads)  # k-means on a few thousand points: threads only contend
    try:
        for kind in KINDS:
            books[kind] = []
            if any(alloc[kind]) and kind not in vectors:
                raise InvalidArgument(f"preset {preset!r} quantizes {kind!r} but no {kind!r} vectors were given")
            data = np.asarray(vectors[kind], np.float32) if kind in vectors else None
            if data is not None and kind in norm:
                data = data * norm[kind][:, :, None, :]
            for layer in range(layers):
                sizes = alloc[kind][layer]
                per_stage = [np.zeros((heads, s, dim), np.float32) for s in sizes]
                for head in range(heads) if sizes else ():
                    assert data is not None  # a kind given stages was given vectors (checked above)
                    x = data[layer, head]
                    if len(x) > max_points:
                        x = x[rng.choice(len(x), max_points, replace=False)]
                    resid = x.copy()
                    for stage, size in enumerate(sizes[: depth[kind][layer, head]]):
                        c = _fp16(
                            _kmeans(
                                resid,
                                size,
                                niter,
                                seed + 7919 * stage + 31 * head + layer,
                                max_points // max(size, 1) + 1,
                            )
                        )
                        per_stage[stage][head] = c
                        resid -= c[_nearest(resid, c)]
                books[kind].append(per_stage)
                if progress:
                    progress(kind, layer)
    finally:
        faiss.omp_set_num_threads(previous)
    uneven = {kind: d for kind, d in depth.items() if not _uniform(d, alloc[kind])}
    return Codebooks(layers, heads, dim, pre_rope, books, preset, dict(meta or {}), norm, uneven)


def normalise_weights(w: np.ndarray) -> np.ndarray:
    """Metric scales ``[layers, heads, dim]`` with RMS 1 per (layer, head), floored at 1e-3."""
    w = np.asarray(w, np.float64)
    w = w / np.sqrt((w * w).mean(-1, keepdims=True) + 1e-30)
    return np.maximum(w, 1e-3).astype(np.float32)


# ------------------------------------------------------------------------------------------
# encode / decode
# ------------------------------------------------------------------------------------------


def _nearest(x: np.ndarray, c: np.ndarray, block: int = 8192) -> np.ndarray:
    """Index of the nearest row of ``c`` for each row of ``x`` (squared L2, exact, numpy)."""
    cn = (c * c).sum(1)
    out = np.empty(len(x), dtype=np.int64)
    for i in range(0, len(x), block):
        d = cn[None, :] - 2.0 * (x[i : i + block] @ c.T)
        out[i : i + block] = d.argmin(1)
    return out


def _beam_codes(x: np.ndarray, books: list[np.ndarray], beam: int, block: int = 2048) -> np.ndarray:
    """Residual codes ``[stages, n]`` by beam search: keep the ``beam`` best partial sums per vector.

    ``beam=1`` is the greedy encoder (each stage takes the centroid nearest to what is left).
    """
    n, stages = len(x), len(books)
    out = np.zeros((stages, n), dtype=np.uint16)
    if beam <= 1:
        resid = x.astype(np.float32, copy=True)
        for stage, c in enumerate(books):
            idx = _nearest(resid, c)
            out[stage] = idx
            resid -= c[idx]
        return out
    norms = [(c * c).sum(1) for c in books]
    for lo in range(0, n, block):
        r = x[lo : lo + block].astype(np.float32)[:, None, :]  # [m, B, d]
        m = len(r)
        err = (r * r).sum(-1)  # [m, B]
        path = np.zeros((m, 1, 0), dtype=np.int64)
        for stage, c in enumerate(books):
            size = len(c)
            d = err[:, :, None] - 2.0 * (r @ c.T) + norms[stage][None, None, :]  # [m, B, K]
            flat = d.reshape(m, -1)
            keep = min(beam, flat.shape[1])
            best = (
                np.argpartition(flat, keep - 1, axis=1)[:, :keep]
                if keep < flat.shape[1]
                else np.broadcast_to(np.arange(flat.shape[1]), (m, keep))
            )
            parent, code = best // size, best % size
            rows = np.arange(m)[:, None]
            r = r[rows, parent] - c[code]
            err = flat[rows, best]
            path = np.concatenate([path[rows, parent], code[:, :, None]], axis=2)
        winner = err.argmin(1)
        out[:, lo : lo + m] = path[np.arange(m), winner].T
    return out


def _encode_kind(codebooks: Codebooks, kind: str, data: np.ndarray, beam: int = 1) -> np.ndarray:
    layers, heads, n, _ = data.shape
    books, depth = codebooks.books[kind], codebooks.depth(kind)
    codes = np.zeros((layers, heads, codebooks.max_stages(kind), n), dtype=np.uint16)
    for layer in range(layers):
        for head in range(heads):
            stages = depth[layer, head]
            if stages:
                codes[layer, head, :stages] = _beam_codes(
                    data[layer, head], [b[head] for b in books[layer][:stages]], beam
                )
    return codes


def _decode_kind(codebooks: Codebooks, kind: str, codes: np.ndarray) -> np.ndarray:
    """Each position's vector, the sum of its stages' centroids, in one gather-and-sum over all
    layers and heads at once (``embedding_bag`` over one table holding every centroid of the
    kind, each (layer, head, stage) at its own offset; a stage a layer lacks points at a zero row).
    ``codes`` may hold fewer stages than the codebooks (residual stages nest)."""
    import torch

    layers, heads, stages, n = codes.shape
    table, offsets = codebooks.gather_table(kind)
    if stages == 0 or n == 0:
        return np.zeros((layers, heads, n, codebooks.dim), np.float32)
    offsets = offsets[:layers, :, :stages, None]
    rows = np.where(offsets > 0, codes.astype(np.int64) + offsets, 0)  # [layers, heads, stages, n]
    bags = torch.from_numpy(np.ascontiguousarray(rows.transpose(0, 1, 3, 2)).reshape(-1, stages))
    summed = torch.nn.functional.embedding_bag(bags, table, mode="sum")
    return summed.numpy().reshape(layers, heads, n, codebooks.dim)


def encode(codebooks: Codebooks, keys: np.ndarray, values: np.ndarray, beam: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Residual codes ``(key_codes, value_codes)``, uint16 ``[layers, heads, stages, seq]`` each.

    ``beam=1`` is greedy (and then the codes of a shallower preset are a prefix of these);
    ``beam > 1`` searches that many partial sums per stage for a lower total error.

    ``keys`` must be in the space the codebooks were trained in (pre-RoPE when ``codebooks.pre_rope``).
    """
    _refuse_sharpened(codebooks, "used to encode")
    keys, values = np.asarray(keys, np.float32), np.asarray(values, np.float32)
    expect = (codebooks.layers, codebooks.heads)
    for name, a in (("keys", keys), ("values", values)):
        if a.ndim != 4 or a.shape[:2] != expect or a.shape[3] != codebooks.dim:
            raise InvalidArgument(f"{name} must be [{expect[0]}, {expect[1]}, seq, {codebooks.dim}], got {a.shape}")
    if "k" in codebooks.weights:
        keys = keys * codebooks.weights["k"][:, :, None, :]
    if "v" in codebooks.weights:
        values = values * codebooks.weights["v"][:, :, None, :]
    return _encode_kind(codebooks, "k", keys, beam), _encode_kind(codebooks, "v", values, beam)


def decode(codebooks: Codebooks, codes: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """``(keys, values)`` float32 ``[layers, heads, seq, dim]`` from ``encode``'s codes.

    Codes with fewer stages than the codebooks (a stored prefix of stages) decode with the
    stages they have: residual stages nest. The metric scales are folded into the centroids
    (each divided by its layer and head's scales), so no pass over the output divides them.
    """
    return _decode_kind(codebooks, "k", codes[0]), _decode_kind(codebooks, "v", codes[1])

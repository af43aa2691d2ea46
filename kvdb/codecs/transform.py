"""Transform coding of KV caches: a per-head rotation, then one scalar quantizer per coefficient,
with bits spent where the model's loss is most sensitive (docs/decisions/0040-transform-coded-tier-k.md).

Greedy residual VQ with 256-entry stages saturates at high rates: each stage buys less than the
last. Transform coding keeps improving by about 6 dB a bit. Per (kind, layer, KV head):

- vectors are scaled by ``w``, the square root of the diagonal Fisher information of the model's
  loss with respect to them, so that squared error in the scaled space approximates the loss's
  second-order increase (KL divergence, up to a factor);
- the scaled vectors are rotated onto their principal axes (``basis``, columns by falling
  variance), so the coefficients are uncorrelated;
- coefficient d takes ``bits[d]`` bits: a Lloyd-Max quantizer of ``2**bits`` levels trained on
  calibration vectors (0 bits: the coefficient is its mean, 0).

The bits are allocated across every coefficient of every head, layer and kind at once (a
Lagrangian on the measured distortions), for an average of the preset's bits per element:
preset ``t3`` is 3 bits per element, ``t1.5`` 1.5.

Codes are uint16 ``[layers, heads, dim, seq]`` per kind (0 where a coefficient has no bits, never
stored). The stored layout is token-major, one stream per alphabet ``2**bits``: for each
position, kind > layer > head > coefficient, skipping coefficients without bits.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvdb.codecs import framing
from kvdb.errors import InvalidArgument

KINDS = ("k", "v")
MAGIC = b"KVDBTC\x00\x00"
VERSION = 1
MAX_BITS = 8
# t: fixed-rate quantizers; e: entropy-coded (kvdb.codecs.entropy_coded), optionally ``p<count>``: each
# head's first ``count`` coefficients predicted from the previous layer's
_PRESET = re.compile(r"^([te])(\d+(?:\.\d+)?)(j)?(?:p(\d+)(?:i(\d+))?)?$")


def is_transform_preset(preset: str) -> bool:
    """A preset coded in a rotated space (``t<bits>`` or ``e<bits>``): it needs the Fisher
    information of its calibration vectors, and its keys are not sharpened."""
    return bool(_PRESET.match(preset.strip()))


def is_entropy_coded(preset: str) -> bool:
    m = _PRESET.match(preset.strip())
    return bool(m and m[1] == "e")


def preset_bits(preset: str) -> float:
    """The average bits per element a ``t<bits>`` or ``e<bits>`` preset spends."""
    m = _PRESET.match(preset.strip())
    if (
        not m
        or not 0 < float(m[2]) <= MAX_BITS
        or (m[1] != "e" and (m[3] or m[4]))
        or (m[4] is not None and int(m[4]) == 0)
        or (m[5] is not None and not 0 < int(m[5]) <= int(m[4]))
    ):
        raise InvalidArgument(
            f"unknown transform preset {preset!r}: expected t<bits per element> or e<bits per element>, "
            f"e.g. 't3' or 'e1.5', bits in (0, {MAX_BITS}]; "
            "an entropy-coded one may add j (one rotation per layer across its heads and kinds), e.g. 'e1.2j', "
            "p<coefficients> (each head's first ones, or with j the layer's, predicted from the previous layer), "
            "e.g. 'e2p32', "
            "and then i<inputs> (predicted from only the previous layer's first ones, at most p<coefficients>), "
            "e.g. 'e2p64i32'"
        )
    return float(m[2])


def predicted_coefficients(preset: str) -> int:
    """How many of each head's leading coefficients an ``e<bits>p<count>`` preset predicts from
    the previous layer's (0: none)."""
    preset_bits(preset)  # the grammar
    m = _PRESET.match(preset.strip())
    return int(m[4]) if m and m[4] else 0


def is_joint(preset: str) -> bool:
    """Whether an ``e<bits>j…`` preset rotates each layer's keys and values, all heads, together."""
    preset_bits(preset)  # the grammar
    m = _PRESET.match(preset.strip())
    return bool(m and m[3])


def prediction_inputs(preset: str) -> int:
    """How many leading coefficients of the previous layer (each head's, or with ``j`` the layer's) an
    ``e<bits>p<count>i<inputs>`` preset predicts from: ``inputs``, or without ``i`` as many as it
    predicts (0: no prediction)."""
    predicted = predicted_coefficients(preset)
    m = _PRESET.match(preset.strip())
    return int(m[5]) if m and m[5] else predicted


def fisher_weights(fisher: np.ndarray) -> np.ndarray:
    """Each dimension's scale, the square root of its diagonal Fisher information (floored), so
    that squared error in the scaled space is the model's loss to second order."""
    f = np.asarray(fisher, np.float64)
    return np.sqrt(f + 1e-6 * max(float(f.mean()), 1e-30)).astype(np.float32)


def fisher_pca(vectors: np.ndarray, fisher: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The rotation both transform coders share, of calibration ``vectors`` ``[layers, heads, n, dim]``
    and their diagonal Fisher information ``[layers, heads, dim]``: (``centre`` and ``weights``
    ``[layers, heads, dim]``, ``basis`` ``[layers, heads, dim, dim]`` with columns by falling
    variance, the calibration coefficients ``[layers, heads, dim, n]``)."""
    w = fisher_weights(fisher)
    x = np.asarray(vectors, np.float32) * w[:, :, None]
    mu = x.mean(2)
    xc = x - mu[:, :, None]
    _, vecs = np.linalg.eigh(np.einsum("lhnd,lhne->lhde", xc, xc, dtype=np.float64) / x.shape[2])
    vecs = np.ascontiguousarray(vecs[..., ::-1]).astype(np.float32)  # columns by falling variance
    return mu / w, w, vecs, np.einsum("lhnd,lhde->lhen", xc, vecs)


def encoder_matrix(weights: np.ndarray, basis: np.ndarray) -> np.ndarray:
    """``x -> coefficients``: ``(x - centre) @ encoder``, ``diag(w) @ basis``, float32."""
    return np.ascontiguousarray(weights[..., :, None] * basis, dtype=np.float32)


def decoder_matrix(weights: np.ndarray, basis: np.ndarray) -> np.ndarray:
    """``coefficients -> x``: ``y @ decoder + centre``, ``basis^T @ diag(1 / w)``, float32."""
    return np.ascontiguousarray(basis.transpose(0, 1, 3, 2) / weights[..., None, :], dtype=np.float32)


@dataclass
class TransformCodebooks:
    """Per kind: ``centre``, ``weights`` ``[layers, heads, dim]``; ``basis`` ``[layers, heads, dim, dim]``
    (orthonormal columns in the weighted space); ``bits`` int ``[layers, heads, dim]``; ``levels``,
    every coefficient's quantizer levels in stream order (kind > layer > head > coefficient),
    float32, ``2**bits`` each."""

    layers: int
    heads: int
    dim: int
    pre_rope: bool
    preset: str
    centre: dict[str, np.ndarray]
    weights: dict[str, np.ndarray]
    basis: dict[str, np.ndarray]
    bits: dict[str, np.ndarray]
    levels: dict[str, np.ndarray]
    meta: dict = field(default_factory=dict)
    _derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    # -- derived tables ----------------------------------------------------------------------

    def offsets(self, kind: str) -> np.ndarray:
        """Where each coefficient's levels start in ``levels[kind]``: int64 ``[layers, heads, dim]``."""
        key = ("offsets", kind)
        if key not in self._derived:
            sizes = np.where(self.bits[kind] > 0, 1 << self.bits[kind], 0).reshape(-1)
            self._derived[key] = (np.cumsum(sizes) - sizes).reshape(self.bits[kind].shape)
        return self._derived[key]

    def encoder(self, kind: str) -> np.ndarray:
        """``x -> coefficients``: ``(x - centre) @ encoder``, ``diag(w) @ basis``."""
        return encoder_matrix(self.weights[kind], self.basis[kind])

    def decoder(self, kind: str) -> np.ndarray:
        """``coefficients -> x``: ``y @ decoder + centre``, ``basis^T @ diag(1 / w)``."""
        key = ("decoder", kind)
        if key not in self._derived:
            self._derived[key] = decoder_matrix(self.weights[kind], self.basis[kind])
        return self._derived[key]

    def sharpened(self, factor: float) -> TransformCodebooks:
        """Transform-coded keys are not sharpened: their quantizers are fine enough that the
        flattening RVQ centroids cause (decision 0029) is not where their loss comes from."""
        return self

    @property
    def nbytes(self) -> int:
        return sum(
            self.centre[k].size * 4 + self.weights[k].size * 4 + self.basis[k].size * 4 + self.levels[k].size * 4
            for k in KINDS
        )

    def bits_per_element(self) -> float:
        return float(sum(int(self.bits[k].sum()) for k in KINDS) / sum(self.bits[k].size for k in KINDS))

    # -- codes -------------------------------------------------------------------------------

    def encode(self, keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Codes ``[layers, heads, dim, seq]`` uint16 of float ``[layers, heads, seq, dim]`` arrays."""
        import torch

        out = []
        for kind, x in zip(KINDS, (keys, values)):
            y = np.einsum(
                "lhnd,lhde->lhen",
                np.asarray(x, np.float32) - self.centre[kind][:, :, None],
                self.encoder(kind).astype(np.float32),
            )
            codes = np.zeros(y.shape, np.uint16)
            bits, offsets, levels = self.bits[kind], self.offsets(kind), self.levels[kind]
            for b in range(1, MAX_BITS + 1):
                where = np.nonzero(bits == b)
                if not len(where[0]):
                    continue
                table = levels[offsets[where][:, None] + np.arange(1 << b)]  # [coefficients, levels]
                mids = torch.from_numpy(np.ascontiguousarray((table[:, 1:] + table[:, :-1]) / 2))
                codes[where] = torch.searchsorted(mids, torch.from_numpy(np.ascontiguousarray(y[where]))).numpy()
            out.append(codes)
        return out[0], out[1]

    def decode(self, codes: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Float32 ``[layers, heads, seq, dim]`` keys and values of ``encode``'s codes."""
        out = []
        for kind, c in zip(KINDS, codes):
            # clipped: coefficients without bits
            found = np.take(self.levels[kind], self.offsets(kind)[..., None] + c.astype(np.int64), mode="clip")
            y = np.where(self.bits[kind][..., None] > 0, found, 0.0).astype(np.float32)
            out.append(np.einsum("lhen,lhed->lhnd", y, self.decoder(kind)) + self.centre[kind][:, :, None])
        return out[0], out[1]

    # -- stored layout -----------------------------------------------------------------------

    def _columns(self) -> dict[str, list[list[tuple[int, int, np.ndarray, np.ndarray]]]]:
        """kind -> layer -> [(alphabet, first column in its stream, heads, coefficients)], in stream order."""
        if "columns" not in self._derived:
            at: dict[int, int] = {}
            places: dict[str, list[list[tuple[int, int, np.ndarray, np.ndarray]]]] = {}
            for kind in KINDS:
                places[kind] = []
                for layer in range(self.layers):
                    flat = self.bits[kind][layer].reshape(-1)
                    groups = []
                    for b in np.unique(flat[flat > 0]):
                        size = 1 << int(b)
                        chosen = np.flatnonzero(flat == b)
                        groups.append((size, at.get(size, 0), chosen // self.dim, chosen % self.dim))
                        at[size] = at.get(size, 0) + len(chosen)
                    places[kind].append(groups)
            self._derived["columns"] = places
        return self._derived["columns"]

    def code_streams(self, codes: tuple[np.ndarray, np.ndarray], start: int = 0) -> dict[int, np.ndarray]:
        """Token-major symbols, one stream per alphabet: ``{2**bits: symbols}``."""
        columns: dict[int, list[np.ndarray]] = {}
        for kind, c in zip(KINDS, codes):
            for layer, groups in enumerate(self._columns()[kind]):
                for size, _, heads, coefs in groups:
                    columns.setdefault(size, []).append(c[layer, heads, coefs, start:])
        return {size: np.concatenate(cols, axis=0).T.reshape(-1).astype(np.int64) for size, cols in columns.items()}

    def stream_columns(self) -> dict[int, int]:
        columns: dict[int, int] = {}
        for layers in self._columns().values():
            for groups in layers:
                for size, _, heads, _ in groups:
                    columns[size] = columns.get(size, 0) + len(heads)
        return columns

    def codes_from_streams(self, streams: dict[int, np.ndarray], n: int) -> tuple[np.ndarray, np.ndarray]:
        rows = {size: np.asarray(symbols).reshape(n, -1).T for size, symbols in streams.items()}
        out = []
        for kind in KINDS:
            codes = np.zeros((self.layers, self.heads, self.dim, n), np.uint16)
            for layer, groups in enumerate(self._columns()[kind]):
                for size, column, heads, coefs in groups:
                    codes[layer, heads, coefs] = rows[size][column : column + len(heads)]
            out.append(codes)
        return out[0], out[1]

    def decode_streams(
        self, streams: dict[int, np.ndarray], n: int, used: int | None = None
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Each layer's ``(keys, values)``, float32 ``[heads, used, dim]``, straight from the streams:
        one gather of levels and one batched product per layer and kind."""
        import torch

        used = n if used is None else used
        rows = {size: torch.from_numpy(np.asarray(symbols).reshape(n, -1)[:used]) for size, symbols in streams.items()}
        levels = {kind: torch.from_numpy(self.levels[kind]) for kind in KINDS}

        def layer_of(kind: str, layer: int) -> np.ndarray:
            y = torch.zeros(self.heads, self.dim, used)
            for size, column, heads, coefs in self._columns()[kind][layer]:
                start = torch.from_numpy(self.offsets(kind)[layer, heads, coefs])
                y[heads, coefs] = levels[kind][rows[size][:, column : column + len(heads)].T + start[:, None]]
            x = torch.baddbmm(
                torch.from_numpy(self.centre[kind][layer][:, None]),
                y.transpose(1, 2),
                torch.from_numpy(self.decoder(kind)[layer]),
            )
            return x.numpy()

        for layer in range(self.layers):
            yield layer_of("k", layer), layer_of("v", layer)

    # -- bytes -------------------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        """``MAGIC | u32 version | u32 header length | JSON header | payload | u32 CRC32`` (docs/formats.md)."""
        header: dict[str, Any] = {
            "format": "kvdb-transform",
            "layers": self.layers,
            "heads": self.heads,
            "dim": self.dim,
            "pre_rope": self.pre_rope,
            "preset": self.preset,
            "bits": {kind: self.bits[kind].tolist() for kind in KINDS},
            "order": "per kind (k, v): centre [L,H,D], weights [L,H,D], basis [L,H,D,D], levels; little-endian float32",
            "meta": self.meta,
        }
        parts = [
            np.ascontiguousarray(a, dtype="<f4").tobytes()
            for kind in KINDS
            for a in (self.centre[kind], self.weights[kind], self.basis[kind], self.levels[kind])
        ]
        return framing.frame(MAGIC, VERSION, header, parts)

    @classmethod
    def from_bytes(cls, blob: bytes) -> TransformCodebooks:
        blob = bytes(blob)
        _, header, at = framing.unframe(blob, MAGIC, VERSION, "transform codebook")
        layers, heads, dim = header["layers"], header["heads"], header["dim"]
        arrays: dict[str, dict[str, np.ndarray]] = {"centre": {}, "weights": {}, "basis": {}, "levels": {}}
        payload = framing.Arrays(blob, at, "transform codebook")
        bits = {kind: np.asarray(header["bits"][kind], np.int64).reshape(layers, heads, dim) for kind in KINDS}
        for kind in KINDS:
            n_levels = int(np.where(bits[kind] > 0, 1 << bits[kind], 0).sum())
            for name, shape in (
                ("centre", (layers, heads, dim)),
                ("weights", (layers, heads, dim)),
                ("basis", (layers, heads, dim, dim)),
                ("levels", (n_levels,)),
            ):
                arrays[name][kind] = payload.take("<f4", shape).astype(np.float32)
        payload.done()
        return cls(
            layers,
            heads,
            dim,
            header["pre_rope"],
            header["preset"],
            arrays["centre"],
            arrays["weights"],
            arrays["basis"],
            bits,
            arrays["levels"],
            header["meta"],
        )


# -- training ----------------------------------------------------------------------------------


def _lloyd_max(y, cumulative, bits: int, iterations: int):
    """Lloyd-Max quantizers of ``2**bits`` levels for each row of ``y`` (torch float64 ``[rows, n]``,
    sorted; ``cumulative``: its running sums of y and y**2, ``[2, rows, n + 1]``): (levels
    ``[rows, 2**bits]``, mean squared error ``[rows]``). On sorted rows a quantizer's cells are
    runs, so each step costs a search per level, not per value."""
    import torch

    size = 1 << bits
    n = y.shape[1]
    levels = torch.quantile(y, (torch.arange(size, dtype=y.dtype) + 0.5) / size, dim=1).T.contiguous()

    def cells(levels):
        cut = torch.searchsorted(y, (levels[:, 1:] + levels[:, :-1]) / 2)
        edges = torch.cat([torch.zeros_like(cut[:, :1]), cut, torch.full_like(cut[:, :1], n)], 1)
        sums = cumulative[:, torch.arange(len(y))[:, None], edges]  # [2, rows, size + 1]
        return (
            (edges[:, 1:] - edges[:, :-1]).to(y.dtype),
            sums[0, :, 1:] - sums[0, :, :-1],
            sums[1, :, 1:] - sums[1, :, :-1],
        )

    for _ in range(iterations):
        counts, total, _ = cells(levels)
        levels = torch.where(counts > 0, total / counts.clamp(min=1), levels).sort(dim=1).values
    counts, total, squares = cells(levels)
    return levels, (squares - 2 * levels * total + counts * levels**2).sum(1) / n


def _allocate(distortion: np.ndarray, budget: float) -> np.ndarray:
    """Bits per coefficient (the last axis of ``distortion`` is bits 0..MAX_BITS) whose total is at
    most ``budget`` and whose summed distortion is least among the Lagrangian's choices."""
    steps = np.arange(distortion.shape[-1])

    def chosen(slope: float) -> np.ndarray:
        return (distortion + slope * steps).argmin(-1)

    lo, hi = 0.0, float(distortion[..., 0].max()) + 1.0  # at ``hi`` no bit pays
    for _ in range(64):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chosen(mid).sum() > budget else (lo, mid)
    return chosen(hi)


def train(
    vectors: dict[str, np.ndarray],
    fisher: dict[str, np.ndarray],
    preset: str,
    pre_rope: bool = True,
    iterations: int = 20,
    meta: dict | None = None,
) -> TransformCodebooks:
    """Transform codebooks from calibration ``vectors`` (kind -> ``[layers, heads, n, dim]``) and the
    diagonal Fisher information of the model's loss with respect to them (kind -> ``[layers, heads, dim]``)."""
    import torch

    budget_bits = preset_bits(preset)
    layers, heads, n, dim = vectors["k"].shape
    if n < 2:
        raise InvalidArgument(f"training transform codebooks needs at least 2 calibration positions, got {n}")
    centre, weights, basis, tables, distortion = {}, {}, {}, {}, {}
    for kind in KINDS:
        centre[kind], weights[kind], basis[kind], coefficients = fisher_pca(vectors[kind], fisher[kind])
        y = torch.from_numpy(coefficients.reshape(-1, n).astype(np.float64)).sort(dim=1).values
        zero = torch.zeros(1, y.shape[0], 1, dtype=y.dtype)
        cumulative = torch.cat([zero.expand(2, -1, -1), torch.stack([y, y**2]).cumsum(2)], 2)
        dist = np.zeros((y.shape[0], MAX_BITS + 1))
        dist[:, 0] = (y**2).mean(1).numpy()
        table = {}
        for b in range(1, MAX_BITS + 1):
            levels, mse = _lloyd_max(y, cumulative, b, iterations)
            table[b], dist[:, b] = levels.numpy(), mse.numpy()
        tables[kind], distortion[kind] = table, dist.reshape(layers, heads, dim, MAX_BITS + 1)
    chosen = _allocate(np.stack([distortion[k] for k in KINDS]), budget_bits * 2 * layers * heads * dim)
    bits = {kind: chosen[i].astype(np.int64) for i, kind in enumerate(KINDS)}
    levels = {}
    for kind in KINDS:
        flat = bits[kind].reshape(-1)
        levels[kind] = np.concatenate(
            [tables[kind][int(b)][i] for i, b in enumerate(flat) if b > 0] or [np.zeros(0)]
        ).astype(np.float32)
    return TransformCodebooks(
        layers, heads, dim, pre_rope, preset, centre, weights, basis, bits, levels, dict(meta or {})
    )

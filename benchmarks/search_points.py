"""Search points: the dense float walk of a symbol stream through d-D contractive maps, and the
query point of a phrase (a studied variant of the search index: docs/decisions/0003-float-walk-search-points.md;
the archive's own index uses the exact keys of :mod:`kvdb.codecs.fractal`).

Lossy beyond ``capacity``: a d-D grid walk, ``k`` vertices per axis (``k**d >= N``), ratio
``r = 1/m`` with ``m > k``, in float32 (or float64/float16). The empty cells between vertices
(``m > k``) give the separation gap that radius search needs; ``m`` is large enough that a
phrase's matches and non-matches never overlap.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import numpy as np

from kvdb.codecs.fractal import check_alphabet, check_symbols
from kvdb.errors import InvalidArgument

_UNIT_ROUNDOFF = {np.dtype(np.float64): 2.0**-53, np.dtype(np.float32): 2.0**-24, np.dtype(np.float16): 2.0**-11}
_FLOAT16_MAX = 65504.0
_DIMS = (1, 2, 4, 8, 16)
MIN_CONTEXT = 4  # trailing symbols a default-dimension float32 point must resolve


@dataclass(frozen=True)
class Geometry:
    """The d-D grid walk ``p_k = r * p_{k-1} + T(c_k)`` with ``r = 1/m``, started at the origin.

    ``T(c)`` puts the base-k digits of c, centred (``digit - (k-1)/2``), on the d axes: the
    paper's form ``V + r (p - V)`` with vertex ``V = T / (1 - r)``. Every point lies in the
    box ``[-extent, extent]**d``; the cell of digit a on an axis is ``a - (k-1)/2`` plus
    ``r`` times that box, and neighbouring cells are ``gap`` apart because ``m > k``.
    """

    alphabet: int
    dim: int  # d
    side: int  # k vertices per axis, k**d >= alphabet
    contraction: int  # m, the walk ratio is r = 1/m

    @property
    def ratio(self) -> float:
        return 1.0 / self.contraction

    @property
    def extent(self) -> float:
        """Half-width of the attractor's box: (k-1)/2 / (1-r)."""
        return (self.side - 1) / 2 / (1 - self.ratio)

    @property
    def gap(self) -> float:
        """Separation: points whose last symbols differ are at least this far apart."""
        return 1 - 2 * self.ratio * self.extent

    def decay(self, shared: int) -> float:
        """Decay law: points whose last ``shared`` symbols agree are within c * r**shared."""
        return 2 * math.sqrt(self.dim) * self.extent * self.ratio**shared

    def match_radius(self, length: int) -> float:
        """Radius that splits matches of a phrase of ``length`` from non-matches (midpoint of the bounds).

        A point whose last ``length`` symbols equal the phrase is within ``decay(length) / 2``
        of its query point (which starts at the box centre); one that differs within those
        symbols is at least ``gap * r**(length-1)`` away.
        """
        if length <= 0:
            return math.inf
        return (self.decay(length) / 2 + self.gap * self.ratio ** (length - 1)) / 2

    def capacity(self, dtype: np.dtype | type = np.float32) -> int:
        """Trailing symbols a point of this dtype resolves and separates by ``match_radius``.

        Rounding moves each coordinate by at most ``u * extent``; the split at depth L has
        margin ``r**(L-1) * (gap - sqrt(d) * extent * r) / 2`` on each side, which must exceed
        the rounding of both points, ``2 * sqrt(d) * u * extent``, with a factor 2 to spare.
        """
        kind = np.dtype(dtype)
        if kind not in _UNIT_ROUNDOFF:
            raise InvalidArgument(f"dtype must be float64, float32 or float16, got {kind}")
        if kind == np.float16 and self.extent * (1 + self.ratio) >= _FLOAT16_MAX:
            return 0
        margin = (self.gap - math.sqrt(self.dim) * self.extent * self.ratio) / 2
        rounding = 4 * math.sqrt(self.dim) * _UNIT_ROUNDOFF[kind] * max(self.extent, 1.0)
        if margin <= rounding:
            return 0
        return 1 + int(math.log(margin / rounding) / math.log(self.contraction))

    @property
    def translations(self) -> np.ndarray:
        return _translations(self)


def _separating_contraction(side: int, dim: int) -> int:
    """Smallest m with sqrt(d) * extent * r < gap, i.e. m - k > sqrt(d) * (k - 1) / 2.

    Then a phrase's matches (within ``decay(L) / 2`` of its query point) and non-matches
    (at least ``gap * r**(L-1)`` away) never overlap, so radius search is exact.
    """
    return side + math.floor(math.sqrt(dim) * (side - 1) / 2) + 1


@cache
def geometry(alphabet: int, dim: int | None = None) -> Geometry:
    """The walk for an alphabet; ``m`` is chosen to maximise float32 capacity, then margin.

    Without ``dim``: the smallest of 1, 2, 4, 8, 16 whose float32 points resolve
    ``MIN_CONTEXT`` symbols, else the dimension with the best float32 capacity.
    """
    check_alphabet(alphabet)
    if dim is None:
        candidates = [geometry(alphabet, d) for d in _DIMS]
        enough = [g for g in candidates if g.capacity(np.float32) >= MIN_CONTEXT]
        return enough[0] if enough else max(candidates, key=lambda g: g.capacity(np.float32))
    if not isinstance(dim, (int, np.integer)) or not 1 <= dim <= 64:
        raise InvalidArgument(f"dim must be an integer from 1 to 64, got {dim!r}")
    side = 2
    while side**dim < alphabet:
        side += 1
    lowest = _separating_contraction(side, dim)
    options = [Geometry(alphabet, dim, side, m) for m in range(lowest, 2 * lowest + 1)]
    return max(options, key=lambda g: (g.capacity(np.float32), g.contraction))


@cache
def _translations(geo: Geometry) -> np.ndarray:
    """T(c) for every symbol: its base-k digits over the axes, centred."""
    codes = np.arange(geo.alphabet, dtype=np.int64)
    digits = (codes[:, None] // geo.side ** np.arange(geo.dim, dtype=np.int64)) % geo.side
    table = digits - (geo.side - 1) / 2
    table.flags.writeable = False
    return table


def capacity(alphabet: int, dtype: np.dtype | type = np.float32, dim: int | None = None) -> int:
    """How many trailing symbols one search point resolves (see ``Geometry.capacity``)."""
    return geometry(alphabet, dim).capacity(dtype)


def _usable(alphabet: int, dtype: np.dtype | type, dim: int | None) -> tuple[Geometry, int]:
    geo = geometry(alphabet, dim)
    depth = geo.capacity(dtype)
    if depth < 1:
        raise InvalidArgument(
            f"{np.dtype(dtype)} points of dimension {geo.dim} cannot resolve one symbol of {alphabet}"
        )
    return geo, depth


def walk(
    symbols: np.ndarray | Sequence[int], alphabet: int, dtype: np.dtype | type = np.float32, dim: int | None = None
) -> np.ndarray:
    """Dense walk, shape (n, d): point i is the walk of the last ``capacity`` symbols up to i.

    Older symbols would sit below the dtype's resolution anyway; dropping them makes the
    points of equal windows bit-identical, and costs ``capacity`` vectorised passes
    (Horner from the oldest symbol, in float64, then rounded once to ``dtype``).
    """
    stream = check_symbols(symbols, alphabet)
    geo, depth = _usable(alphabet, dtype, dim)
    steps = geo.translations[stream]
    points = np.zeros_like(steps)
    for back in range(min(depth, stream.size) - 1, -1, -1):
        points[back:] *= geo.ratio
        points[back:] += steps[: stream.size - back]
    return points.astype(dtype)


def query_point(
    symbols: np.ndarray | Sequence[int], alphabet: int, dtype: np.dtype | type = np.float32, dim: int | None = None
) -> np.ndarray:
    """Point of a phrase, shape (d,): compare with ``walk`` points within ``match_radius(len)``.

    Only the last ``capacity`` symbols count; longer phrases are searched as pieces of at
    most ``capacity`` symbols. The empty phrase is the origin (the centre of the box).
    """
    stream = check_symbols(symbols, alphabet)
    geo, depth = _usable(alphabet, dtype, dim)
    if stream.size == 0:
        return np.zeros(geo.dim, dtype=dtype)
    return walk(stream[-depth:], alphabet, dtype, dim)[-1]


def resolve(points: np.ndarray, alphabet: int, count: int, dim: int | None = None) -> np.ndarray:
    """The last ``count`` symbols (oldest first) read back from points, by multiply-and-round.

    Exact for ``count <= capacity(dtype of points)``; deeper symbols are what the precision
    truncated (the oldest go first). Shape (..., d) -> (..., count).
    """
    geo = geometry(alphabet, dim)
    centre = (geo.side - 1) / 2
    place = geo.side ** np.arange(geo.dim, dtype=np.int64)
    current = np.asarray(points, dtype=np.float64)
    if current.shape[-1:] != (geo.dim,):
        raise InvalidArgument(f"points must have last dimension {geo.dim}, got shape {current.shape}")
    newest_first = []
    for _ in range(count):
        digits = np.clip(np.rint(current + centre), 0, geo.side - 1)
        newest_first.append((digits.astype(np.int64) * place).sum(axis=-1))
        current = (current - (digits - centre)) * geo.contraction
    return np.stack(newest_first[::-1], axis=-1) if newest_first else np.zeros(current.shape[:-1] + (0,), np.int64)

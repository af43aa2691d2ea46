"""Tier K's entropy coder (``kvdb/codecs/rans.c``, bound with ctypes): rows of int16 values, each
row coded with the static frequency table of its class (docs/formats.md, "Entropy-coded symbol
rows (rANS)", version 1).

A quantizer's coefficients are mostly small integers whose spread depends on the coefficient, so
one table per class of rows codes them near their entropy; any int16 value still codes (as an
escape), so a value never seen in calibration costs bits, not an error. The C file does the
per-symbol work because a restore decodes millions of symbols; Python owns every buffer.

ctypes releases the GIL for the length of each call, so two threads decoding different layers
run in parallel. The extension ``kvdb.codecs._rans`` is built by ``pip install``; where it is
missing (no compiler when kvdb was installed) this module still imports, and coding raises
:class:`~kvdb.errors.InvalidArgument` saying to reinstall kvdb with a C compiler.
"""

from __future__ import annotations

import ctypes
from ctypes import c_float, c_int, c_int64, c_void_p
from dataclasses import dataclass

import numpy as np

from kvdb.errors import CorruptData, InvalidArgument

PRECISION = 12
ESCAPE = 255
OFFSET = 127
TOTAL = 1 << PRECISION
STATES = 8  # bytes of the two final states that open every stream


def _load() -> tuple[ctypes.CDLL | None, str]:
    """The built coder, or (None, why not)."""
    try:
        import kvdb.codecs._rans as _rans
    except ImportError as exc:
        return None, f"kvdb.codecs._rans is not built ({exc}); reinstall kvdb with a C compiler"
    lib = ctypes.CDLL(_rans.__file__)
    lib.kvdb_rans_encode.restype = c_int64
    lib.kvdb_rans_encode.argtypes = [c_void_p, c_int64, c_int64, c_void_p, c_void_p, c_void_p, c_void_p, c_int64]
    lib.kvdb_rans_decode.restype = c_int
    lib.kvdb_rans_decode.argtypes = [
        c_void_p,
        c_int64,
        c_int64,
        c_int64,
        c_int64,
        c_void_p,
        c_void_p,
        c_void_p,
        c_void_p,
        c_void_p,
        c_void_p,
        c_float,
        c_void_p,
        c_int64,
    ]
    return lib, ""


_LIB, _MISSING = _load()


def available() -> bool:
    return _LIB is not None


def _lib() -> ctypes.CDLL:
    if _LIB is None:
        raise InvalidArgument(f"tier K's entropy coder is unavailable: {_MISSING}")
    return _LIB


def frequencies(counts) -> np.ndarray:
    """Tables ``uint16 [K, 256]`` summing to 4096 from calibration counts ``[K, 256]``.

    Every symbol counted at least once, and ESCAPE always, gets a frequency of at least 1, so
    anything seen in calibration, and any other value by escape, still codes; the remaining
    frequency is shared in proportion to the counts, the leftover units going to the largest
    remainders (ties to the lower symbol). Integer arithmetic only: the tables a codebook stores
    are the same on every machine. A class with no counts at all gets a flat table.
    """
    c = np.asarray(counts)
    if c.ndim != 2 or c.shape[1] != 256 or not 1 <= c.shape[0] <= 256:
        raise InvalidArgument(f"rANS counts must be [classes, 256] with 1 to 256 classes, not {list(c.shape)}")
    if c.dtype.kind not in "iub":
        raise InvalidArgument(f"rANS counts must be integers (symbol histograms), not {c.dtype}: round them first")
    c = c.astype(np.int64)
    if (c < 0).any() or (c > 1 << 40).any():
        raise InvalidArgument("rANS counts must lie in 0 .. 2**40: scale the histograms down")
    c[c.sum(axis=1) == 0] = 1
    floor = c > 0
    floor[:, ESCAPE] = True
    budget = TOTAL - floor.sum(axis=1, keepdims=True)
    total = c.sum(axis=1, keepdims=True)
    share, remainder = np.divmod(c * budget, total)
    freqs = floor + share
    leftover = TOTAL - freqs.sum(axis=1, keepdims=True)  # < 256, and fewer than the non-zero remainders
    order = np.argsort(-remainder, axis=1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(256)[None, :].repeat(len(c), axis=0), axis=1)
    return (freqs + (rank < leftover)).astype(np.uint16)


@dataclass(frozen=True, init=False)
class Tables:
    """A validated set of tables with what coding needs precomputed: ``starts`` (exclusive
    cumulative frequencies) and ``slots`` ``[K, 4096]``, the symbol of each slot, which is the
    decoder's one lookup per symbol. Build once per codebook; read-only, shared by threads."""

    freqs: np.ndarray
    starts: np.ndarray
    slots: np.ndarray

    def __init__(self, freqs) -> None:
        f = np.asarray(freqs)
        if f.ndim != 2 or f.shape[1] != 256 or not 1 <= f.shape[0] <= 256:
            raise InvalidArgument(f"rANS tables must be [classes, 256] with 1 to 256 classes, not {list(f.shape)}")
        if f.dtype.kind not in "iu" or (f < 0).any() or (f > TOTAL).any():
            raise InvalidArgument(f"rANS table entries must be integers in 0 .. {TOTAL}")
        if (bad := np.flatnonzero(f.sum(axis=1) != TOTAL)).size:
            raise InvalidArgument(
                f"rANS table {int(bad[0])} sums to {int(f[bad[0]].sum())}, not {TOTAL}: "
                "build tables with rans.frequencies"
            )
        if (bad := np.flatnonzero(f[:, ESCAPE] == 0)).size:
            raise InvalidArgument(
                f"rANS table {int(bad[0])} gives ESCAPE (entry 255) frequency 0, "
                "so values outside -127 .. 127 could not code"
            )
        freqs = np.ascontiguousarray(f, dtype=np.uint16)
        starts = np.ascontiguousarray(np.cumsum(freqs, axis=1, dtype=np.uint16) - freqs)
        symbols = np.tile(np.arange(256, dtype=np.uint8), len(freqs))
        slots = np.repeat(symbols, freqs.reshape(-1)).reshape(len(freqs), TOTAL)
        for name, array in (("freqs", freqs), ("starts", starts), ("slots", slots)):
            array.flags.writeable = False
            object.__setattr__(self, name, array)

    @property
    def classes(self) -> int:
        return len(self.freqs)


def symbols(values) -> np.ndarray:
    """The symbol each integer value is coded as where its table gives that symbol a frequency:
    ``value + OFFSET`` within -127 .. 127, ``ESCAPE`` outside (int64, as ``values``' shape)."""
    v = np.asarray(values, np.int64)
    return np.where(np.abs(v) <= OFFSET, v + OFFSET, ESCAPE)


def _classes(classes, tables: Tables) -> np.ndarray:
    c = np.asarray(classes)
    if c.ndim != 1 or (c.size and c.dtype.kind not in "iu"):
        raise InvalidArgument(
            f"rANS classes must be a 1-D integer array (one class per row), not {c.dtype} {list(c.shape)}"
        )
    if c.size and (c.min() < 0 or c.max() >= tables.classes):
        raise InvalidArgument(
            f"rANS classes must lie in 0 .. {tables.classes - 1} (one per table), "
            f"found {int(c.min())} .. {int(c.max())}"
        )
    return np.ascontiguousarray(c, dtype=np.int32)


def encode(values, classes, tables: Tables) -> bytes:
    """The stream of ``values`` int16 ``[rows, n]``, row r coded with table ``classes[r]``."""
    lib = _lib()
    v = np.asarray(values)
    if v.ndim != 2 or (v.size and v.dtype.kind not in "iu"):
        raise InvalidArgument(f"rANS values must be a 2-D integer array [rows, n], not {v.dtype} {list(v.shape)}")
    if v.size and (v.min() < -32768 or v.max() > 32767):
        raise InvalidArgument(
            f"rANS values must fit int16, found {int(v.min())} .. {int(v.max())}: clip them in the quantizer"
        )
    c = _classes(classes, tables)
    if len(c) != v.shape[0]:
        raise InvalidArgument(f"rANS needs one class per row: {len(c)} classes for {v.shape[0]} rows")
    v = np.ascontiguousarray(v, dtype=np.int16)
    out = np.empty(STATES + 6 * v.size, dtype=np.uint8)  # at most 3 symbols a value, one word a symbol
    size = lib.kvdb_rans_encode(
        v.ctypes.data,
        v.shape[0],
        v.shape[1],
        c.ctypes.data,
        tables.freqs.ctypes.data,
        tables.starts.ctypes.data,
        out.ctypes.data,
        out.size,
    )
    if size == -2:
        # Tables refuses such tables
        raise InvalidArgument("a value needs ESCAPE, which has frequency 0 in its row's table")
    assert size >= 0, "the bound above holds for any input"
    return out[:size].tobytes()


def _decode(
    data,
    c: np.ndarray,
    n: int,
    tables: Tables,
    used: int,
    values=None,
    recon=None,
    escape_step: float = 0.0,
    floats=None,
    row_stride: int = 0,
) -> None:
    """One call of the C decoder for ``c``, classes already checked by :func:`_classes`."""
    lib = _lib()
    if not 0 <= used <= n:
        raise InvalidArgument(f"rANS decoding needs 0 <= used <= n, not used={used}, n={n}")
    buf = np.frombuffer(data, dtype=np.uint8)
    status = lib.kvdb_rans_decode(
        buf.ctypes.data, buf.size, len(c), n, used, c.ctypes.data,
        tables.freqs.ctypes.data, tables.starts.ctypes.data, tables.slots.ctypes.data,
        None if values is None else values.ctypes.data, None if recon is None else recon.ctypes.data, escape_step,
        None if floats is None else floats.ctypes.data, row_stride,
    )  # fmt: skip
    if status:
        raise CorruptData(
            f"a tier K rANS stream of {buf.size} bytes does not decode to {len(c)} rows of {n} values "
            "with these tables: the archive is damaged"
        )


def decode(data, classes, n: int, tables: Tables, used: int | None = None) -> np.ndarray:
    """The values ``int16 [rows, used]`` of a stream of ``rows = len(classes)`` rows of ``n``:
    every value is decoded (the stream demands it), the first ``used`` of each row kept."""
    c = _classes(classes, tables)
    used = n if used is None else used
    out = np.empty((len(c), max(used, 0)), dtype=np.int16)
    _decode(data, c, n, tables, used, values=out, row_stride=out.shape[1])
    return out


def decode_into(data, classes, n: int, tables: Tables, recon, escape_step: float, out: np.ndarray) -> None:
    """Decodes straight to floats in ``out`` ``float32 [rows, used]`` (a view with unit column
    stride and any row stride, e.g. into a layer's buffer): ``recon[class, symbol]`` for a
    value coded as its symbol, ``value * escape_step`` for an escaped one (outside -127 .. 127,
    or of frequency 0 in its table). Saves the int16 pass and the gather a restore would
    otherwise make. On CorruptData ``out`` holds garbage."""
    r = np.asarray(recon)
    if r.dtype != np.float32 or r.shape != (tables.classes, 256) or not r.flags.c_contiguous:
        raise InvalidArgument(
            f"rANS recon must be C-contiguous float32 [{tables.classes}, 256], not {r.dtype} {list(r.shape)}"
        )
    if not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.ndim != 2 or not out.flags.writeable:
        raise InvalidArgument("rANS decode_into needs a writeable float32 [rows, used] array")
    c = _classes(classes, tables)
    if out.shape[0] != len(c):
        raise InvalidArgument(f"rANS decode_into: out has {out.shape[0]} rows for {len(c)} classes")
    if out.shape[0] > 1 and (out.strides[0] <= 0 or out.strides[0] % 4) or out.shape[1] > 1 and out.strides[1] != 4:
        raise InvalidArgument(
            "rANS decode_into: out must have unit column stride and a positive row stride in whole floats, "
            f"not strides {out.strides}"
        )
    _decode(
        data, c, n, tables, out.shape[1], recon=r, escape_step=escape_step, floats=out, row_stride=out.strides[0] // 4
    )

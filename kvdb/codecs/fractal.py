"""Contractive iterated-map codes for symbol streams (choices and numbers:
docs/decisions/0002-fractal-token-codec.md; byte layout: docs/formats.md).

A symbol c of an N-ary alphabet is a contractive map of a box onto its own cell; walking a
stream through the maps gives points whose most significant part is the latest symbol. We
use two members of that family, each where it measured best (a third, float search points,
is :mod:`benchmarks/search_points.py`):

* Archive anchors (lossless, random access): a 2-D grid walk whose axes contract by
  ``1/M`` and ``1/2**t`` (``M * 2**t >= N``). Symbol ``c`` moves ``c >> t`` along the radix
  axis and ``c & (2**t - 1)`` along the binary axis. Both coordinates are kept as exact
  integers (fixed point), so decoding is exact multiply-and-floor: the radix axis stores
  one anchor word per span of ``D`` symbols (the walk point scaled by ``M**D``, the
  largest span that fits 64 bits); the binary axis's fixed-point expansion is its bit
  string, so every position on it is its own anchor. ``t`` is chosen per alphabet to
  minimise ``t + 64 / D`` bits per symbol (49,152 tokens: t=14, M=3, D=40 -> 15.6 bits).
* Search keys (exact, what the search index stores): the 1-D radix walk with ``r = 1/(N+1)``
  of each position's last ``D`` symbols, kept as one exact uint64 (``(N+1)**D <= 2**64``).
  The walk's decay law becomes a key range: positions whose last s symbols agree have keys
  in one interval of width ``(N+1)**(D-s)``, and positions whose last symbol differs lie in
  disjoint intervals (the separation property), so a phrase's occurrences are one sorted
  range. Symbol ``N`` stands for "before the start of the stream".
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import numpy as np

from kvdb.errors import CorruptData, InvalidArgument

MIN_ALPHABET = 2
MAX_ALPHABET = 1 << 17
DEFAULT_BLOCK = 4096

# ------------------------------------------------------------------------------------------
# Archive codec: exact anchors in self-checking blocks
# ------------------------------------------------------------------------------------------

FORMAT_TAG = 0xF1  # "fractal block, format 1"
_HEADER = struct.Struct("<I I")  # tag | (alphabet - 1) << 8, symbol count
_CRC = struct.Struct("<I")
_WORD = np.dtype("<u8")
_ENCODE_CHUNK = 1 << 20  # symbols per vectorised pass; bounds temporary memory


@dataclass(frozen=True)
class Layout:
    """How an alphabet splits over the radix axis (anchor words) and the binary axis (bits)."""

    alphabet: int
    low_bits: int  # t: the binary axis holds c & (2**t - 1)
    radix: int  # M = ceil(N / 2**t): the radix axis holds c >> t
    span: int  # D: symbols per anchor word, the largest with M**D <= 2**64 (0 when M == 1)
    powers: np.ndarray  # M**j for j < D, uint64: the scale of each span position

    @property
    def bits_per_symbol(self) -> float:
        return self.low_bits + (64 / self.span if self.span else 0.0)

    def words(self, count: int) -> int:
        return -(-count // self.span) if self.span else 0

    def low_bytes(self, count: int) -> int:
        return -(-count * self.low_bits // 8)

    def blob_size(self, count: int) -> int:
        return _HEADER.size + 8 * self.words(count) + self.low_bytes(count) + _CRC.size


def _span_of(radix: int) -> int:
    span = 0
    while radix ** (span + 1) <= 1 << 64:
        span += 1
    return span


@cache
def layout(alphabet: int) -> Layout:
    """The split minimising bits per symbol; ties go to more binary bits (cheaper to decode)."""
    check_alphabet(alphabet)
    best: tuple[float, int] | None = None
    for low_bits in range(math.ceil(math.log2(alphabet)), -1, -1):
        radix = -(-alphabet // (1 << low_bits))
        cost = low_bits + (64 / _span_of(radix) if radix > 1 else 0.0)
        if best is None or cost < best[0] - 1e-12:
            best = (cost, low_bits)
    assert best is not None  # low_bits = 0 is always tried
    low_bits = best[1]
    radix = -(-alphabet // (1 << low_bits))
    span = _span_of(radix) if radix > 1 else 0
    powers = np.array([radix**j for j in range(span)], dtype=np.uint64)
    return Layout(alphabet, low_bits, radix, span, powers)


def check_alphabet(alphabet: int) -> None:
    if not isinstance(alphabet, (int, np.integer)) or not MIN_ALPHABET <= alphabet <= MAX_ALPHABET:
        raise InvalidArgument(f"alphabet must be an integer from {MIN_ALPHABET} to {MAX_ALPHABET}, got {alphabet!r}")


def check_symbols(symbols: np.ndarray | Sequence[int], alphabet: int) -> np.ndarray:
    check_alphabet(alphabet)
    array = np.asarray(symbols)
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise InvalidArgument(f"symbols must be a 1-D integer array, got {array.dtype} with shape {array.shape}")
    low, high = int(array.min()), int(array.max())
    if low < 0 or high >= alphabet:
        raise InvalidArgument(f"symbols must lie in [0, {alphabet}), found values from {low} to {high}")
    return array.astype(np.int64, copy=False)


def _check_block_size(block_size: int) -> None:
    if not isinstance(block_size, (int, np.integer)) or block_size <= 0 or block_size % 8:
        raise InvalidArgument(f"block_size must be a positive multiple of 8, got {block_size!r}")


def _anchor_words(high: np.ndarray, lay: Layout, rows: int) -> np.ndarray:
    """Exact radix walk of each span, ``rows`` equal rows at once: word = sum_j q_j M**j.

    The oldest symbol of a span is least significant: the forward walk ``p <- (p + q) / M``
    scaled by ``M**D``. Zero digits after the last symbol leave a word unchanged, so a
    partial span is padded with zeros and needs no special case.
    """
    per_row = high.size // rows
    spans = -(-per_row // lay.span)
    digits = np.zeros((rows, spans * lay.span), dtype=np.uint64)
    digits[:, :per_row] = high.reshape(rows, per_row)
    return (digits.reshape(rows, spans, lay.span) * lay.powers).sum(axis=2, dtype=np.uint64)


def _span_digits(words: np.ndarray, lay: Layout) -> np.ndarray:
    """Inverse of the radix walk, all spans at once: q_j = floor(word / M**j) mod M."""
    return (np.floor_divide.outer(words, lay.powers) % np.uint64(lay.radix)).reshape(-1)


def _bits(low: np.ndarray, low_bits: int) -> np.ndarray:
    """The binary axis coordinates as one little-endian bit per byte, ``low_bits`` per symbol."""
    as_bytes = low.astype("<u4").view(np.uint8).reshape(-1, 4)
    return np.unpackbits(as_bytes, axis=1, count=low_bits, bitorder="little").reshape(-1)


def _pack_bits(low: np.ndarray, low_bits: int) -> np.ndarray:
    """The binary axis as a little-endian bit string: its exact fixed-point expansion."""
    return np.packbits(_bits(low, low_bits), bitorder="little")


def _bit_fields(blob: bytes, offset: int, start: int, end: int, low_bits: int) -> np.ndarray:
    """Fields [start, end) of ``low_bits`` bits each from the bit string at byte ``offset``.

    A field spans at most 3 bytes, so it is one unaligned 32-bit little-endian load at its
    first byte, shifted. The 4-byte CRC after the bit string keeps every load in bounds.
    """
    if low_bits in (8, 16):  # whole bytes (codes of 256- or 65,536-entry codebooks): a plain view
        return _whole_bytes(blob, offset, start, end, low_bits).astype(np.int64)
    loads = np.ndarray((len(blob) - offset - 3,), dtype="<u4", buffer=blob, offset=offset, strides=(1,))
    bits = np.arange(start * low_bits, end * low_bits, low_bits, dtype=np.int64)
    return (loads[bits >> 3] >> (bits & 7)) & ((1 << low_bits) - 1)


def _unpack_fields(data: bytes, count: int, low_bits: int) -> np.ndarray:
    """The first ``count`` fields of ``low_bits`` (< 8) bits each of a little-endian bit string.

    Eight fields fill ``low_bits`` whole bytes, so the string is read as groups of that many
    bytes, each group one integer, and its eight fields are shifts of it: a few array operations
    for the whole string, where ``_bit_fields`` takes an unaligned load and its index per field.
    """
    groups = -(-count // 8)
    raw = np.zeros(groups * low_bits, dtype=np.uint8)
    given = np.frombuffer(data, np.uint8, min(len(data), raw.size))
    raw[: given.size] = given
    wide = np.dtype(np.uint32 if low_bits <= 4 else np.uint64)  # eight fields of up to 4 bits fit 32
    word: np.ndarray = np.zeros(groups, dtype=wide)
    for j, column in enumerate(raw.reshape(groups, low_bits).T):
        word |= column.astype(wide) << (8 * j)
    shifts = np.arange(8, dtype=wide) * low_bits
    fields = (word[:, None] >> shifts) & ((1 << low_bits) - 1)
    return fields.reshape(-1)[:count]


def _whole_bytes(blob: bytes, offset: int, start: int, end: int, low_bits: int) -> np.ndarray:
    """Fields [start, end) of 8 or 16 bits each, as a view of the bit string at byte ``offset``."""
    width = np.dtype("<u1" if low_bits == 8 else "<u2")
    return np.frombuffer(blob, width, end - start, offset + start * width.itemsize)


def _assemble(lay: Layout, count: int, words: np.ndarray, low_bytes: np.ndarray) -> bytes:
    head = _HEADER.pack(FORMAT_TAG | (lay.alphabet - 1) << 8, count)
    body = head + words.astype(_WORD, copy=False).tobytes() + low_bytes.tobytes()
    return body + _CRC.pack(zlib.crc32(body))


def encode_blocks(symbols: np.ndarray | Sequence[int], alphabet: int, block_size: int = DEFAULT_BLOCK) -> list[bytes]:
    """Blocks of ``block_size`` symbols (the last may be shorter), each decodable on its own.

    An empty stream gives no blocks. Work is vectorised over chunks of about a million
    symbols so that a 1e8-symbol stream does not need gigabytes of temporaries.
    """
    stream = check_symbols(symbols, alphabet)
    _check_block_size(block_size)
    lay = layout(alphabet)
    blocks_per_chunk = max(1, _ENCODE_CHUNK // block_size)
    blobs: list[bytes] = []
    for chunk_start in range(0, stream.size, blocks_per_chunk * block_size):
        chunk = stream[chunk_start : chunk_start + blocks_per_chunk * block_size]
        rows = -(-chunk.size // block_size)
        if lay.span:
            padded = np.zeros(rows * block_size, dtype=np.uint64)
            padded[: chunk.size] = chunk >> lay.low_bits
            words = _anchor_words(padded, lay, rows)
        if lay.low_bits:
            padded_low = np.zeros(rows * block_size, dtype=np.int64)
            padded_low[: chunk.size] = chunk & ((1 << lay.low_bits) - 1)
            bit_rows = _pack_bits(padded_low, lay.low_bits).reshape(rows, -1)
        for row in range(rows):
            count = min(block_size, chunk.size - row * block_size)
            row_words = words[row, : lay.words(count)] if lay.span else np.zeros(0, _WORD)
            row_bits = bit_rows[row, : lay.low_bytes(count)] if lay.low_bits else np.zeros(0, np.uint8)
            blobs.append(_assemble(lay, count, row_words, row_bits))
    return blobs


def block_count(blob: bytes, alphabet: int) -> int:
    """Number of symbols in a block, after checking its integrity."""
    return _open_block(blob, layout(alphabet))


def _open_block(blob: bytes, lay: Layout) -> int:
    """Check tag, alphabet, length and CRC32; return the symbol count. Never decodes garbage."""
    if len(blob) < _HEADER.size + _CRC.size:
        raise CorruptData(f"fractal block is {len(blob)} bytes, shorter than its header")
    tag, count = _HEADER.unpack_from(blob)
    (stored_crc,) = _CRC.unpack_from(blob, len(blob) - _CRC.size)
    if zlib.crc32(memoryview(blob)[: -_CRC.size]) != stored_crc:
        raise CorruptData("fractal block failed its CRC32 check; the stored anchors are damaged")
    if tag & 0xFF != FORMAT_TAG:
        raise CorruptData(f"not a fractal block (format tag {tag & 0xFF:#x}); was it written by a newer kvdb?")
    if (tag >> 8) + 1 != lay.alphabet:
        raise InvalidArgument(f"block was encoded for alphabet {(tag >> 8) + 1}, not {lay.alphabet}")
    if len(blob) != lay.blob_size(count):
        raise CorruptData(f"fractal block of {count} symbols has {len(blob)} bytes, expected {lay.blob_size(count)}")
    return count


def decode_block(blob: bytes, alphabet: int, start: int = 0, end: int | None = None) -> np.ndarray:
    """Symbols [start, end) of one block as int64, reading only the anchor words and bits they touch."""
    lay = layout(alphabet)
    count = _open_block(blob, lay)
    end = count if end is None else end
    if not 0 <= start <= end <= count:
        raise InvalidArgument(f"range [{start}, {end}) is outside the block's {count} symbols")
    if lay.low_bits:
        symbols = _bit_fields(blob, _HEADER.size + 8 * lay.words(count), start, end, lay.low_bits)
    else:
        symbols = np.zeros(end - start, dtype=np.int64)
    if lay.span and end > start:
        first, last = start // lay.span, -(-end // lay.span)
        words = np.frombuffer(blob, _WORD, last - first, _HEADER.size + 8 * first)
        digits = _span_digits(words, lay)[start - first * lay.span : end - first * lay.span].view(np.int64)
        symbols += digits << lay.low_bits if lay.low_bits else digits
    return symbols


def blocks_for_range(start: int, end: int, block_size: int = DEFAULT_BLOCK) -> range:
    """Block numbers to fetch for stream positions [start, end): what ``decode_range`` expects."""
    _check_block_size(block_size)
    if not 0 <= start <= end:
        raise InvalidArgument(f"bad range [{start}, {end})")
    return range(start // block_size, -(-end // block_size))


def decode_range(blobs: Sequence[bytes], alphabet: int, block_size: int, start: int, end: int) -> np.ndarray:
    """Stream positions [start, end) from the blocks ``blocks_for_range(start, end, block_size)``.

    ``blobs[0]`` is block ``start // block_size`` (holding stream positions from
    ``(start // block_size) * block_size`` on); every block but the stream's last is full,
    and a block that is shorter than the range needs raises InvalidArgument.
    """
    needed = blocks_for_range(start, end, block_size)
    if len(blobs) < len(needed):
        raise InvalidArgument(f"range [{start}, {end}) needs {len(needed)} blocks, got {len(blobs)}")
    origin = needed.start * block_size
    pieces = [
        decode_block(blob, alphabet, max(start - block_start, 0), min(end - block_start, block_size))
        for blob, block_start in zip(blobs, range(origin, end, block_size))
    ]
    if len(pieces) == 1:
        return pieces[0]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)


def decode_blocks(blobs: Sequence[bytes], alphabet: int) -> np.ndarray:
    """A whole stream back from all of its blocks: the symbols of whole-byte alphabets (256 or
    65,536: tier K's codes) copied straight from each block into one array, with no int64
    array a block and no join of them (a restore of 8,000 positions reads 5 million codes); those
    of smaller power-of-two alphabets (a transform preset's codes: 85 million at 8,000 positions
    of ``t3``) unpacked from the blocks' bit strings joined into one."""
    lay = layout(alphabet)
    if not lay.span and 0 < lay.low_bits < 8:  # a power-of-two alphabet below 256: one bit string
        counts = [_open_block(blob, lay) for blob in blobs]
        if any(count * lay.low_bits % 8 for count in counts[:-1]):  # only a stream's last block may end inside a byte
            pieces = [decode_block(blob, alphabet) for blob in blobs]
            return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
        bits = b"".join(blob[_HEADER.size : _HEADER.size + lay.low_bytes(count)] for blob, count in zip(blobs, counts))
        return _unpack_fields(bits, sum(counts), lay.low_bits).astype(np.int64)
    if lay.span or lay.low_bits not in (8, 16):
        pieces = [decode_block(blob, alphabet) for blob in blobs]
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    counts = [_open_block(blob, lay) for blob in blobs]
    out = np.empty(sum(counts), dtype=np.int64)
    at = 0
    for blob, count in zip(blobs, counts):
        out[at : at + count] = _whole_bytes(blob, _HEADER.size, 0, count, lay.low_bits)
        at += count
    return out


def append_to_block(blob: bytes, alphabet: int, symbols: np.ndarray | Sequence[int]) -> bytes:
    """The block with ``symbols`` added at its end; only the open span's anchor is re-walked.

    Closed anchor words and whole bytes of the bit string are copied as they are; the open
    word (fewer than D digits) and the last partial byte are rebuilt with the new symbols.
    The block may grow past any block size: keeping blocks full is ``append_blocks``'s job.
    """
    lay = layout(alphabet)
    count = _open_block(blob, lay)
    tail = check_symbols(symbols, alphabet)
    total = count + tail.size
    if total >= 1 << 32:
        raise InvalidArgument("a fractal block holds fewer than 2**32 symbols")
    words = np.zeros(0, _WORD)
    if lay.span:
        closed = count // lay.span
        stored = np.frombuffer(blob, _WORD, lay.words(count), _HEADER.size)
        open_digits = _span_digits(stored[closed:], lay)[: count - closed * lay.span]
        rewalked = _anchor_words(np.concatenate([open_digits, (tail >> lay.low_bits).astype(np.uint64)]), lay, 1)
        words = np.concatenate([stored[:closed], rewalked[0, : lay.words(total) - closed]])
    bits = np.zeros(0, np.uint8)
    if lay.low_bits:
        offset = _HEADER.size + 8 * lay.words(count)
        stored_bits = np.frombuffer(blob, np.uint8, lay.low_bytes(count), offset)
        whole = count * lay.low_bits // 8
        loose = np.unpackbits(stored_bits[whole:], bitorder="little", count=count * lay.low_bits - 8 * whole)
        fresh = _bits(tail & ((1 << lay.low_bits) - 1), lay.low_bits)
        bits = np.concatenate([stored_bits[:whole], np.packbits(np.concatenate([loose, fresh]), bitorder="little")])
    return _assemble(lay, total, words, bits)


def append_blocks(
    last_blob: bytes | None, alphabet: int, symbols: np.ndarray | Sequence[int], block_size: int = DEFAULT_BLOCK
) -> list[bytes]:
    """Append to a stream whose last block is ``last_blob`` (None for an empty stream).

    Returns the replacement for the last block (if there was a partial one) followed by the
    new blocks, so that every block but the last stays exactly ``block_size`` long.
    """
    stream = check_symbols(symbols, alphabet)
    _check_block_size(block_size)
    if last_blob is None:
        return encode_blocks(stream, alphabet, block_size)
    count = block_count(last_blob, alphabet)
    if count > block_size:
        raise InvalidArgument(f"last block holds {count} symbols, more than block_size {block_size}")
    room = block_size - count
    head = [append_to_block(last_blob, alphabet, stream[:room])] if room else []
    return head + encode_blocks(stream[room:], alphabet, block_size)


# ------------------------------------------------------------------------------------------
# Search keys: the exact-integer radix walk of each position's last D symbols
# ------------------------------------------------------------------------------------------


def key_depth(alphabet: int) -> int:
    """D: trailing symbols one uint64 key resolves, ``(alphabet + 1)**D <= 2**64``."""
    check_alphabet(alphabet)
    depth = 0
    while (alphabet + 1) ** (depth + 1) <= 1 << 64:
        depth += 1
    return depth


def walk_keys(
    symbols: np.ndarray | Sequence[int], alphabet: int, context: np.ndarray | Sequence[int] = ()
) -> np.ndarray:
    """uint64 key of every position: its last D symbols (newest most significant), walked on
    from ``context``, the symbols just before the stream; earlier positions read as ``alphabet``."""
    stream = check_symbols(symbols, alphabet)
    before = check_symbols(context, alphabet)
    depth, base = key_depth(alphabet), alphabet + 1
    history = np.concatenate([np.full(depth - 1, alphabet, np.uint64), before.astype(np.uint64)])
    full = np.concatenate([history[len(history) - (depth - 1) :], stream.astype(np.uint64)])
    keys = np.zeros(stream.size, dtype=np.uint64)
    for back in range(depth):  # key = sum over the last D symbols of symbol * base**(D-1-back)
        keys += full[depth - 1 - back : depth - 1 - back + stream.size] * np.uint64(base ** (depth - 1 - back))
    return keys


def key_range(phrase: np.ndarray | Sequence[int], alphabet: int) -> tuple[int, int]:
    """[lo, hi): the keys of exactly the positions whose last ``len(phrase)`` symbols are ``phrase``."""
    tail = check_symbols(phrase, alphabet)
    depth, base = key_depth(alphabet), alphabet + 1
    if not 1 <= tail.size <= depth:
        raise InvalidArgument(f"a key range covers 1 to {depth} symbols, got {tail.size}")
    lo = sum(int(c) * base ** (depth - 1 - back) for back, c in enumerate(tail[::-1]))
    return lo, lo + base ** (depth - tail.size)

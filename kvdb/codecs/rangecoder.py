"""An arithmetic coder for integer frequencies, exact and byte-granular: the coder of tier-L node
payloads (docs/formats.md, "Tier-L node payload").

Why not constriction's range coder, which "KL" payloads use: it writes 32-bit words and seals a
stream with a whole word, about 15 bits a stream with the padding; a trie node of one chat turn
(some 70 tokens, 40 bytes coded) pays that on every node. Here the stream ends on a byte, in
about one byte past its information, and a symbol costs ``log2(total / freq)`` bits to within
2**-32: the encoder keeps ``low`` as one Python integer (so a carry needs no special case) and
``range`` in [2**56, 2**64), so ``range // total`` loses almost nothing for totals up to 2**24.

The stream is the number ``v`` in the final interval with the most trailing zero bits, written
big-endian over the bytes the interval was scaled by, trailing zero bytes dropped; the decoder
reads past the end as zeros. Per symbol the encoder does a few big-integer operations (linear
in the stream's length so far): a 10,000-token node costs milliseconds, next to the model.
"""

from __future__ import annotations

import numpy as np

from kvdb.errors import CorruptData

WINDOW_BITS = 64  # range lives in [2**56, 2**64): at least 32 bits above a 2**24 total
_LOW_RANGE = 1 << (WINDOW_BITS - 8)


class Encoder:
    def __init__(self):
        self.low = 0  # the interval is [low, low + range) in units of 2**-(64 + 8 * shifts)
        self.range = 1 << WINDOW_BITS
        self.shifts = 0

    def encode(self, start: int, freq: int, total: int) -> None:
        """The symbol whose frequencies cover [start, start + freq) of ``total``."""
        r = self.range // total
        self.low += r * start
        self.range = r * freq
        while self.range < _LOW_RANGE:
            self.low <<= 8
            self.range <<= 8
            self.shifts += 1

    def finish(self) -> bytes:
        """The shortest byte string whose value, zero-padded, lies in the final interval."""
        length = WINDOW_BITS // 8 + self.shifts
        end = self.low + self.range
        step = 1 << (8 * length)
        while step > 1 and -(-self.low // step) * step >= end:  # the coarsest multiple inside the interval
            step >>= 8
        value = -(-self.low // step) * step
        return value.to_bytes(length, "big").rstrip(b"\0")


class Decoder:
    def __init__(self, data: bytes):
        self.data = bytes(data)
        self.at = WINDOW_BITS // 8
        self.code = int.from_bytes(self.data[: self.at].ljust(self.at, b"\0"), "big")  # offset into the interval
        self.range = 1 << WINDOW_BITS

    def decode_uniform(self, total: int) -> int:
        """A symbol coded with ``encode(s, 1, total)``."""
        r = self.range // total
        symbol = self.code // r
        if symbol >= total:
            raise CorruptData("tier-L stream holds a value no symbol codes (damaged)")
        self._narrow(r, symbol, 1)
        return symbol

    def decode(self, cumulative: np.ndarray) -> int:
        """A symbol coded against ``cumulative`` (int64, 0 first, the total last: symbol s
        covers [cumulative[s], cumulative[s + 1]))."""
        total = int(cumulative[-1])
        r = self.range // total
        target = self.code // r
        if target >= total:
            raise CorruptData("tier-L stream holds a value no symbol codes (damaged)")
        symbol = int(np.searchsorted(cumulative, target, side="right")) - 1
        start = int(cumulative[symbol])
        self._narrow(r, start, int(cumulative[symbol + 1]) - start)
        return symbol

    def _narrow(self, r: int, start: int, freq: int) -> None:
        self.code -= r * start
        self.range = r * freq
        while self.range < _LOW_RANGE:
            byte = self.data[self.at] if self.at < len(self.data) else 0
            self.at += 1
            self.code = (self.code << 8) | byte
            self.range <<= 8

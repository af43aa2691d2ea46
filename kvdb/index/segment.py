"""One file of the search index: the slots of a span of the slot numbering, in path order.

Entries are sorted by their last ``REACH`` tokens (256, the longest phrase a search takes),
newest first: a suffix array of the reversed stream cut at ``REACH`` tokens, so every phrase is
one range. The keys need not be stored: they are functions of the tokens, which the segment
keeps anyway (hits are checked and shown from them). A segment stores the slots in path order
(4 bytes a position), the token at each slot (2, or 4 above 65,536 symbols), the first key
(``D`` tokens) of every ``BLOCK``-th entry, and per slot run a link to its parent's last slot
(or another with the same ``REACH - 1`` tokens), else those tokens: a run's first entries walk
on from its parent node: 6.2 bytes a position (docs/decisions/0046-slots-in-key-order.md,
0047-order-past-one-key.md, 0051-order-to-the-longest-phrase.md). A lookup (``stack.py``)
binary-searches the sampled keys, derives the first keys of one block of ``BLOCK`` slots, and
a piece longer than one key then binary-searches that range by its further tokens; the order
is made by ``sorting.py``.

The file is memory-mapped: opening it reads the header, and a query touches the pages it
reads, so a process's memory grows with what it searched, and processes share one copy
through the page cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from kvdb.codecs import fractal
from kvdb.errors import CorruptData, InvalidArgument
from kvdb.index import sidecar

MAGIC = b"KVDBIDX7"  # the sidecar format (sidecar.py)
MAGIC_V6 = b"KVDBIDX6"  # the same arrays end to end, 8-byte aligned: still read
BLOCK = 64  # sorted slots per sampled key: 8 / 64 bytes a position, one block's keys derived per bound
# Tokens of a position's path that set its place: entries are in the order of their last REACH
# tokens, so a phrase up to that long (every phrase a search takes) is one range of the order
# and a count of it is two binary searches (docs/decisions/0051-order-to-the-longest-phrase.md).
REACH = 256
# Files up to this size are read whole at open to compare their CRC (a tail, or an index of up to
# ~5e6 positions: tens of ms); a larger base is checked by `kvdb verify`, since reading it whole
# would cost what mapping it saves (docs/decisions/0046-slots-in-key-order.md).
CHECK_BYTES = 32 << 20
_SAMPLE = np.dtype("<u8")
_FIRST = np.dtype("<u8")
SLOT = np.dtype("<u4")  # up to 2**32 positions per index
_HELD = np.dtype("<u4")


def token_dtype(alphabet: int) -> np.dtype:
    return np.dtype("<u2") if alphabet <= 1 << 16 else np.dtype("<u4")


@dataclass(frozen=True)
class Runs:
    """The slot runs a segment holds, by first slot: each is one trie node's tokens."""

    first: np.ndarray  # int64 (stored u8), ascending
    length: np.ndarray  # int64 (stored u4)
    # int64 (stored u8, 2**64 - 1 for none): a slot whose last REACH - 1 tokens are those before
    # the run on its path (its parent's last, or any other with the same tokens), in this
    # segment or the one below; a run with one keeps no context
    link: np.ndarray
    # int64 (stored u4): tokens of context a run without a link keeps: the whole path before it, up to REACH - 1
    held: np.ndarray
    context: np.ndarray  # every run's kept context in turn, oldest token first (stored as the tokens are)

    @classmethod
    def empty(cls, dtype: np.dtype) -> Runs:
        return cls(
            np.zeros(0, np.int64),
            np.zeros(0, np.int64),
            np.zeros(0, np.int64),
            np.zeros(0, np.int64),
            np.zeros(0, dtype),
        )

    @classmethod
    def table(
        cls, firsts: list[int], lengths: list[int], links: list[int], contexts: list[np.ndarray], dtype: np.dtype
    ) -> Runs:
        """From each run's first slot, length, link (-1 for none) and kept context (``held_context``; empty with a
        link)."""
        held = np.array([len(c) for c in contexts], np.int64)
        return cls(
            np.array(firsts, np.int64),
            np.array(lengths, np.int64),
            np.array(links, np.int64),
            held,
            np.concatenate([np.zeros(0, dtype), *contexts]).astype(dtype),
        )

    @classmethod
    def concat(cls, parts: list[Runs]) -> Runs:
        return cls(
            *(np.concatenate([getattr(p, f) for p in parts]) for f in ("first", "length", "link", "held", "context"))
        )

    def __len__(self) -> int:
        return len(self.first)

    @cached_property
    def opens(self) -> np.ndarray:
        """Where each run's context begins in ``context``."""
        return np.cumsum(self.held) - self.held

    def take(self, runs: np.ndarray) -> Runs:
        """The runs ``runs`` (ascending indices), their contexts with them."""
        return Runs(
            self.first[runs],
            self.length[runs],
            self.link[runs],
            self.held[runs],
            self.context[spans(self.opens[runs], self.held[runs])],
        )

    def slots(self) -> np.ndarray:
        """Every slot a run covers, ascending (the slots between runs are tombstones)."""
        if not len(self):
            return np.zeros(0, np.int64)
        starts = np.repeat(self.first - np.concatenate([[0], np.cumsum(self.length)[:-1]]), self.length)
        return starts + np.arange(int(self.length.sum()), dtype=np.int64)


def spans(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The indices ``[start, start + length)`` of every span in turn."""
    return np.repeat(starts - np.cumsum(lengths) + lengths, lengths) + np.arange(int(lengths.sum()))


def held_context(context: np.ndarray | None, alphabet: int) -> np.ndarray:
    """The last ``REACH - 1`` tokens before a run on its path (all of them when the path is
    shorter: the alphabet's size, the symbol ``fractal.walk_keys`` reads before a path starts,
    is implied past them)."""
    before = (
        np.zeros(0, np.int64) if context is None else np.asarray(context)[len(context) - min(len(context), REACH - 1) :]
    )
    return held_tokens(before, alphabet)


def held_tokens(tokens: np.ndarray, alphabet: int) -> np.ndarray:
    """``tokens`` checked against the alphabet and kept in its token type: a backfill's batch
    holds up to millions of them until they join the index, 2 bytes each for SmolLM2, not 8."""
    return fractal.check_symbols(tokens, alphabet).astype(token_dtype(alphabet))


class Segment:
    """Slots ``[first, ntotal)`` of one numbering: their tokens, their runs, and the covered ones
    sorted by (walk key, slot)."""

    def __init__(
        self,
        alphabet: int,
        generation: int,
        first: int,
        ntotal: int,
        tokens: np.ndarray,
        runs: Runs,
        order: np.ndarray,
        samples: np.ndarray,
        ident: str | None = None,
        base: str | None = None,
        file: sidecar.Sidecar | None = None,
    ):
        self.alphabet = alphabet
        self.depth = fractal.key_depth(alphabet)
        self.reach = REACH
        self.generation = generation
        self.first = first
        self.ntotal = ntotal
        self.tokens = tokens  # by slot - first, tombstones included
        self.runs = runs
        self.order = order  # covered slots in key order
        self.samples = samples  # the key of every BLOCK-th entry of ``order``
        self.ident = ident  # names the contents once saved or loaded: a tail records the base it follows
        self.base = base  # a tail's: the ident of the base it follows
        self.below: Segment | None = None  # a tail's base: where the slots before ``first`` lie
        self._file = file  # the file its arrays are mapped from, where it was loaded

    def let_pages_go(self) -> None:
        """The pages of its file that reads paged into this process let go (``Sidecar.let_pages_go``)."""
        if self._file is not None:
            self._file.let_pages_go()

    @classmethod
    def empty(cls, alphabet: int, generation: int, first: int = 0) -> Segment:
        return cls(
            alphabet,
            generation,
            first,
            first,
            np.zeros(0, token_dtype(alphabet)),
            Runs.empty(token_dtype(alphabet)),
            np.zeros(0, SLOT),
            np.zeros(0, _SAMPLE),
        )

    @property
    def entries(self) -> int:
        return len(self.order)

    # persistence ----------------------------------------------------------------------------
    def _arrays(self) -> dict[str, np.ndarray]:
        """The body, in the stored dtypes (docs/formats.md, "Search sidecar")."""
        tokens = token_dtype(self.alphabet)
        return {
            "samples": self.samples.astype(_SAMPLE, copy=False),
            "run_first": self.runs.first.astype(_FIRST),
            "run_link": self.runs.link.astype(_FIRST),
            "order": np.asarray(self.order).astype(SLOT, copy=False),
            "run_length": self.runs.length.astype(SLOT),
            "run_held": self.runs.held.astype(_HELD),
            "tokens": np.asarray(self.tokens).astype(tokens, copy=False),
            "run_context": np.asarray(self.runs.context).astype(tokens, copy=False),
        }

    def save(self, path: Path, base: str | None = None) -> None:
        """Write atomically (``sidecar.write``). ``base``: for a tail, the ident of the base it
        follows. The ident names the contents (numbering, span and CRC), so two writers of one
        copy give it the same name."""
        fields = {
            "alphabet": self.alphabet,
            "generation": self.generation,
            "first": self.first,
            "ntotal": self.ntotal,
            "block": BLOCK,
            "reach": REACH,
            "base": base,
        }
        crc = sidecar.write(path, MAGIC, fields, self._arrays())
        self.ident, self.base = _ident(fields | {"crc32": crc}), base

    @staticmethod
    def read_header(path: Path) -> dict | None:
        """The header alone, its ``id`` with it, or None when the file is missing, unreadable or
        of another format."""
        try:
            _, fields = sidecar.header(path, (MAGIC, MAGIC_V6))
            return fields | {"id": _ident(fields)}
        except (OSError, CorruptData, KeyError, TypeError, ValueError):
            return None

    @classmethod
    def load(cls, path: Path, check: bool = False) -> Segment:
        """Map the file; its arrays are views of the mapping, read as queries touch them. The
        CRC is compared when the file is small or ``check`` asks for it (``kvdb verify``)."""
        read = sidecar.read(path, MAGIC, check_up_to=None if check else CHECK_BYTES, older={MAGIC_V6: _layout_v6})
        header, arrays = read.header, read.arrays
        try:
            alphabet, generation, first, ntotal = (header[k] for k in ("alphabet", "generation", "first", "ntotal"))
            fractal.key_depth(alphabet)  # refuses an alphabet no walk key holds
            tokens = token_dtype(alphabet)
            dtypes = {
                "samples": _SAMPLE,
                "run_first": _FIRST,
                "run_link": _FIRST,
                "order": SLOT,
                "run_length": SLOT,
                "run_held": _HELD,
                "tokens": tokens,
                "run_context": tokens,
            }
            runs = len(arrays["run_first"])
            fit = (
                all(arrays[name].dtype == dtype and arrays[name].ndim == 1 for name, dtype in dtypes.items())
                and header["block"] == BLOCK
                and header.get("reach") == REACH
                and all(isinstance(c, int) and c >= 0 for c in (generation, first, ntotal))
                and first <= ntotal
                and len(arrays["tokens"]) == ntotal - first
                and len(arrays["samples"]) == -(-len(arrays["order"]) // BLOCK)
                and all(len(arrays[name]) == runs for name in ("run_link", "run_length", "run_held"))
            )
        except (KeyError, TypeError, InvalidArgument) as exc:
            raise CorruptData(f"{path} is not a kvdb search index segment ({exc!r}); {sidecar.REMEDY}") from exc
        if not fit:
            raise CorruptData(f"{path} has arrays its header does not describe; {sidecar.REMEDY}")
        first_slot, length, link, held = (
            arrays[name].astype(np.int64) for name in ("run_first", "run_length", "run_link", "run_held")
        )
        table = Runs(first_slot, length, link, held, arrays["run_context"])
        if int(table.held.sum()) != len(table.context) or (
            runs and (int(table.held.max()) >= REACH or int(table.link.max()) >= ntotal)
        ):
            raise CorruptData(f"{path} has run contexts its header does not count; {sidecar.REMEDY}")
        return cls(
            alphabet,
            generation,
            first,
            ntotal,
            arrays["tokens"],
            table,
            arrays["order"],
            arrays["samples"],
            _ident(header),
            header.get("base"),
            read,
        )


def _ident(header: dict) -> str:
    """What names a segment's contents: ``"<generation>-<first>-<ntotal>-<crc32>"`` in hex."""
    return f"{header['generation']:x}-{header['first']:x}-{header['ntotal']:x}-{header['crc32']:08x}"


def _layout_v6(header: dict) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """The arrays of a ``KVDBIDX6`` file (kvdb before the sidecar module; same contents, a
    fixed order from the header's counts, 8-byte alignment), still read: at 1e8 tokens a
    rebuild takes minutes."""
    n, runs, tokens = header["entries"], header["runs"], token_dtype(header["alphabet"])
    return {
        "samples": (_SAMPLE, (-(-n // BLOCK),)),
        "run_first": (_FIRST, (runs,)),
        "run_link": (_FIRST, (runs,)),
        "order": (SLOT, (n,)),
        "run_length": (SLOT, (runs,)),
        "run_held": (_HELD, (runs,)),
        "tokens": (tokens, (header["ntotal"] - header["first"],)),
        "run_context": (tokens, (header["held"],)),
    }


def packed(symbols: np.ndarray, alphabet: int) -> np.ndarray:
    """Walk keys of rows of D symbols, newest first: ``Σ_{s<D} c_{i−s} (N+1)^(D−1−s)``, the
    newest most significant."""
    keys = np.zeros(len(symbols), np.uint64)
    for column in symbols.T:
        keys = keys * np.uint64(alphabet + 1) + column.astype(np.uint64)
    return keys

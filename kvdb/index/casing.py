"""A phrase in any casing: each word's casings, joined word by word, pruned by the index.

A tokenizer spells each casing of a word with other tokens ("iPhone" is one token of SmolLM2's,
"iphone" three), so an index of tokens finds a casing only by looking it up. SmolLM2's tokenizer
(byte-level BPE behind a GPT-2 style pre-tokenizer) tokenizes each word, with the space before
it, on its own: the tokens of a phrase are its words' tokens one after the other, and the
casings of "tokyo to kyoto" are the products of its words' casings. There are too many products
to look each up, and most never occur; but every part of an occurrence occurs, so the walk keeps
only the parts the index holds: each word's casings alone first, then adjacent spans joined, one
batched lookup (``WalkIndex.holds``, ``WalkIndex.bounds``) a round, until the casings of the whole
phrase that occur are known, with their ranges (docs/decisions/0057-casing-walk.md).

A word's casings (``word_casings``): as typed, lower, upper and title case; every mixture of
lower and upper case, letter by letter, for a word of up to ``MIXED_LETTERS`` cased letters; and
for a longer word the mixtures text mostly takes: up to ``HUMPS`` single capitals in a lower-case
word ("JavaScript", "iPhone", "McDonald"), a lower- or title-case start then capitals to the end
("PostgreSQL", "macOS"), capitals then lower case ("SQLite"). Characters are cased one by one
(``str.lower`` / ``str.upper``): "ß" also as "SS", but "strasse" is not "straße", an accent is a
letter of its own ("cafe" is not "café"), full-width letters are other letters, and Turkish
dotless and dotted i ("ı", "İ") are not "i".

Every occurrence the walk finds is one: its tokens decode to a casing of the phrase. A tokenizer
that does not tokenize words apart finds fewer (the whole phrase's casings of
``searching.casings`` are looked up beside the walk, so no fewer than before).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterator, Sequence

import numpy as np

from kvdb.index.walk import KeyRange, WalkIndex
from kvdb.model import tokenizer as tok
from kvdb.recent import Recent

MIXED_LETTERS = 6  # a word of up to this many cased letters: every casing (2**6 = 64)
HUMPS = 2  # a longer one: up to this many capitals inside it, each starting a hump ("JavaScript")
MIXED_MAX = 20  # a word of more cased letters than this: lower, upper and title case and as typed only
FINAL_MAX = 64  # spans whose products are this few are joined and looked up whole
JOIN_MAX = 1 << 14  # candidates of one round past which the walk stops (the phrase's own casings stay)
CACHED_WORDS = 4096  # words whose casings' tokens each tokenizer remembers
CACHED_PIECES = 1 << 16  # words' casings whose presence each index remembers while its slots stay the same
_UNIT = re.compile(r"\s*\S+|\s+")
_KNOWN = Recent(CACHED_WORDS)  # tokenizer -> {(word, first): token sequences}
_HELD = Recent(CACHED_PIECES)  # index -> {((generation, slots), piece): held}

Ranges = dict[bytes, KeyRange]  # token sequence (its int64 bytes) -> the entries whose last tokens are it


def units(phrase: str) -> list[str]:
    """The phrase cut before each run of white space: each word with the space before it."""
    return _UNIT.findall(phrase)


def title(word: str) -> str:
    """The first cased letter upper case, the rest lower case."""
    first = next((i for i, c in enumerate(word) if c.lower() != c.upper()), 0)
    return word[:first].lower() + word[first:].capitalize()


def word_casings(word: str) -> list[str]:
    """The casings of one word looked for, as typed first (see the module docstring)."""
    letters = [i for i, c in enumerate(word) if c.lower() != c.upper()]
    forms = [word, word.lower(), word.upper(), title(word)]
    # each character's casings, lower case first: a mixture takes one of each
    choices: list[tuple[str, ...]] = [(c.lower(), c.upper()) if c.lower() != c.upper() else (c,) for c in word]
    if len(letters) <= MIXED_LETTERS:  # all of them, the first letter's casing varying slowest
        forms += ["".join(chars) for chars in itertools.product(*choices)]
    else:
        lowered = [pair[0] for pair in choices]
        for at in _capitals(len(letters)):
            chars = lowered.copy()
            for j in at:
                chars[letters[j]] = choices[letters[j]][1]
            forms.append("".join(chars))
    return list(dict.fromkeys(forms))


def _capitals(n: int) -> Iterator[Sequence[int]]:
    """Which of ``n`` cased letters (more than ``MIXED_LETTERS``) are upper case, in each
    mixture ``word_casings`` takes of a longer word."""
    if n > MIXED_MAX:
        return
    for count in range(1, HUMPS + 1):  # single capitals, each followed by a lower-case letter
        for at in itertools.combinations(range(n), count):
            if all(b - a > 1 for a, b in itertools.pairwise(at)):
                yield at
    for cut in range(1, n):
        yield range(cut, n)  # lower case, then capitals to the end: "macOS"
        yield (0, *range(cut, n))  # title case, then capitals: "PostgreSQL"
        yield range(cut)  # capitals, then lower case: "SQLite"


def unit_variants(tokenizer, unit: str, first: bool) -> list[np.ndarray]:
    """The distinct token sequences of a unit's casings; the first unit of a phrase also
    without and with a space before it (the phrase at a text's start, after a line break or
    a bracket, and after a space). Remembered per tokenizer (``CACHED_WORDS``)."""
    key = (unit, first)
    (remembered,) = _KNOWN.get(tokenizer, [key])
    if remembered is not None:
        return remembered
    space = unit[: len(unit) - len(unit.lstrip())]
    body = unit[len(space) :]
    texts = [space + form for form in word_casings(body)] if body else [unit]
    if first and not space:
        texts += [" " + text for text in texts]
    seen: dict[bytes, np.ndarray] = {}
    for ids in tok.encode_many(tokenizer, texts):
        if ids:
            array = np.asarray(ids, np.int64)
            seen.setdefault(array.tobytes(), array)
    out = list(seen.values())
    _KNOWN.put(tokenizer, [(key, out)])
    return out


def lookup(
    index: WalkIndex, pieces: list[np.ndarray], ranges: Ranges, absent: set[bytes], keep: frozenset[bytes] = frozenset()
) -> list[bool]:
    """Whether each piece occurs (its last ``REACH`` tokens, for one longer), in one batched
    lookup of those not known yet: the range and first key's range of each found (and of each
    of ``keep``, found or not: a search's partial hits lie around it) go in ``ranges``, the
    others in ``absent``."""
    wanted = {piece[-index.reach :].tobytes(): piece[-index.reach :] for piece in pieces}
    todo = [key for key in wanted if key not in ranges and key not in absent]
    if todo:
        bounds = index.bounds([wanted[key] for key in todo])
        for i, size in enumerate(bounds.sizes().tolist()):  # range objects for the few found alone
            if size or todo[i] in keep:
                ranges[todo[i]] = bounds.range(i)
                ranges.setdefault(wanted[todo[i]][-index.depth :].tobytes(), bounds.first(i))
            else:
                absent.add(todo[i])
    return [(key := piece[-index.reach :].tobytes()) in ranges and len(ranges[key]) > 0 for piece in pieces]


def _held(index: WalkIndex, pieces: dict[bytes, np.ndarray]) -> dict[bytes, bool]:
    """``WalkIndex.holds`` of each piece, remembered while the index holds the same slots
    (``CACHED_PIECES`` of them): the casings of the words searched before are not tested again."""
    stamp = (index.generation, index.ntotal)  # what an index with other slots held is not asked
    keys = list(pieces)
    out = {key: held for key, held in zip(keys, _HELD.get(index, [(stamp, key) for key in keys])) if held is not None}
    todo = [key for key in keys if key not in out]
    if todo:
        out.update(zip(todo, index.holds([pieces[key] for key in todo]).tolist()))
        _HELD.put(index, [((stamp, key), out[key]) for key in todo])
    return out


def _held_casings(tokenizer, index: WalkIndex, phrase_units: list[str]) -> list[list[np.ndarray]] | None:
    """Per unit, its token sequences (``unit_variants``) whose last D tokens the index holds,
    remembered per unit while the index holds the same slots: a word searched again costs one
    lookup of what is remembered, not one of each of its tens of casings. None when the units
    not remembered have more than ``JOIN_MAX`` sequences (the walk gives up)."""
    stamp = (index.generation, index.ntotal)
    keys = [(stamp, unit, i == 0) for i, unit in enumerate(phrase_units)]
    out = _HELD.get(index, keys)
    todo = [i for i, kept in enumerate(out) if kept is None]
    if todo:
        spans = [unit_variants(tokenizer, phrase_units[i], i == 0) for i in todo]
        if sum(len(span) for span in spans) > JOIN_MAX:
            return None
        depth = index.depth
        held = _held(index, {piece[-depth:].tobytes(): piece[-depth:] for span in spans for piece in span})
        kept = [[piece for piece in span if held[piece[-depth:].tobytes()]] for span in spans]
        _HELD.put(index, [(keys[i], span) for i, span in zip(todo, kept)])
        for i, span in zip(todo, kept):
            out[i] = span
    return out


def _windows(piece: np.ndarray, depth: int) -> list[np.ndarray]:
    """Windows of ``depth`` tokens over ``piece`` (the piece, when it is no longer), half a
    window apart and the last at its end: each must occur where the piece does."""
    starts = [*range(0, len(piece) - depth, max(1, depth // 2)), max(0, len(piece) - depth)]
    return [piece[start : start + depth] for start in starts]


def _kept(spans: list[list[np.ndarray]], found: list[bool] | np.ndarray) -> list[list[np.ndarray]]:
    """``spans`` with only the sequences ``found`` (one flag a sequence, in order) says occur."""
    at = np.cumsum([0, *(len(span) for span in spans)]).tolist()
    return [[piece for piece, ok in zip(span, found[a:b]) if ok] for span, a, b in zip(spans, at[:-1], at[1:])]


def walk(
    index: WalkIndex, spans: list[list[np.ndarray]], ranges: Ranges, also: Sequence[np.ndarray] = ()
) -> list[np.ndarray] | None:
    """The products of ``spans`` (per unit, its token sequences whose last ``D`` tokens the
    index holds: ``_held_casings``) that the index holds.

    While the products of what is left are more than ``FINAL_MAX``, adjacent spans are joined
    in pairs and tested by windows of D tokens half a window apart, all of which must occur
    (``_windows``: ``WalkIndex.holds``, one bound a window, remembered per index); then the
    products left are looked up whole (``WalkIndex.bounds``), with ``also`` (a search's own
    casings and the suffixes its partial hits read: one pass for all). The ranges of those
    found, and of ``also``, are kept in ``ranges``. None when a round would pass ``JOIN_MAX``
    candidates (a phrase whose words occur in that many casings: the walk gives up)."""
    while all(spans) and len(spans) > 1 and math.prod(len(span) for span in spans) > FINAL_MAX:
        spans = [
            [np.concatenate(pair) for pair in itertools.product(*spans[i : i + 2])] for i in range(0, len(spans), 2)
        ]
        flat = [piece for span in spans for piece in span]
        if len(flat) > JOIN_MAX:
            return None
        windows = [_windows(piece, index.depth) for piece in flat]
        held = _held(index, {window.tobytes(): window for pieces in windows for window in pieces})
        spans = _kept(spans, [all(held[window.tobytes()] for window in pieces) for pieces in windows])
    if not all(spans):
        return []
    flat = [np.concatenate(parts) for parts in itertools.product(*spans)]
    if len(flat) > JOIN_MAX:
        return None
    found = lookup(index, flat + list(also), ranges, set(), frozenset(piece.tobytes() for piece in also))
    return [piece for piece, ok in zip(flat, found) if ok and len(piece) <= index.reach]


def variants(
    tokenizer, index: WalkIndex, phrase: str, own: list[np.ndarray], also: Sequence[np.ndarray] = ()
) -> tuple[list[np.ndarray], Ranges | None]:
    """The token sequences of ``phrase`` in every casing the index holds (``own``, the phrase's
    own casings as ``searching.phrase_variants`` gives them, first, found or not: partial hits
    are theirs), and the ranges the walk looked up (of those it found, of ``own``, and of
    ``also``: pieces the caller reads next, such as a search's partial hits' suffixes, bounded
    in the walk's last lookup); None when it ended before its last lookup (a word in no casing
    the index holds)."""
    ranges: Ranges = {}
    spans = _held_casings(tokenizer, index, units(phrase))
    found = (walk(index, spans, ranges, [*own, *also]) if spans is not None else None) or []
    out = {piece.tobytes(): piece for piece in own}
    for piece in found:
        out.setdefault(piece.tobytes(), piece)
    return list(out.values()), ranges or None

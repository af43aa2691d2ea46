"""Phrase search over what was archived, through the sorted walk-key index: the tokenizer alone
is loaded. What a search derives from the tables (slot runs, the trie's shape) is kept until the
storage's version moves."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvdb.errors import InvalidArgument
from kvdb.index import casing, trie
from kvdb.index import phrase as search_ops
from kvdb.index.indexes import Indexes, index_key
from kvdb.index.phrase import Hit
from kvdb.index.walk import KeyRange, SlotMap, WalkIndex
from kvdb.model import tokenizer as tok
from kvdb.records import PhraseCount, RebuiltIndex
from kvdb.services.cache import DerivedCache
from kvdb.services.conversations import labelled, one_per_conversation, scoped_owners, widen_search
from kvdb.services.models import ModelProvider
from kvdb.services.reading import Reader
from kvdb.storage import Storage


@dataclass(frozen=True)
class _Lookup:
    tokenizer: object
    variants: list[np.ndarray]
    index: WalkIndex
    slots: SlotMap
    owned: np.ndarray  # per run of ``slots``: some session uses its node
    view: trie.TrieView
    sessions_of: Callable[[list[str]], dict[str, str]]
    fetch: Callable[[list[tuple[str, int, int]]], list[np.ndarray]]
    known: dict[bytes, KeyRange] | None  # ranges the casing walk looked up


class Searcher:
    def __init__(self, storage: Storage, models: ModelProvider, reader: Reader, indexes: Indexes):
        self._storage = storage
        self._models = models
        self._reader = reader
        self._indexes = indexes
        self._derived = DerivedCache(storage)

    def search(
        self,
        phrase: str,
        k: int = 10,
        context: int = 32,
        session: str | None = None,
        case_sensitive: bool = False,
        min_share: float = search_ops.MIN_SHARE,
        each_occurrence: bool = False,
        within: set[str] | None = None,
    ) -> list[Hit]:
        """The best hit of each of ``k`` conversations, in the latest version that holds it;
        within one ``session``, or ``each_occurrence``, the ``k`` best hits. ``within``: only
        these conversations."""
        if not 0 <= min_share <= 1:
            raise InvalidArgument(
                f"min_share is the share of the phrase a partial hit must match, from 0 to 1; got {min_share}"
            )
        found = self._lookup(phrase, session, case_sensitive, within, min_share)
        if found is None:
            return []
        view = found.view

        each = session is not None or each_occurrence

        def hits(wanted: int) -> list[Hit]:
            found_hits = search_ops.search(
                found.index,
                found.slots,
                found.variants,
                view.names,
                view.age,
                sessions_of=found.sessions_of,
                fetch=found.fetch,
                decode=lambda pieces: tok.snippet_texts(found.tokenizer, pieces),
                k=wanted,
                context=context,
                min_share=min_share,
                group=None if each else lambda session_id: view.conversations.get(session_id, session_id),
                known=found.known,
            )
            return labelled(found_hits, view, self._storage, self._derived.get("titles", dict))

        if each:
            return hits(k)
        return widen_search(hits, one_per_conversation, k)

    def count(self, phrase: str, session: str | None = None, case_sensitive: bool = False) -> PhraseCount:
        found = self._lookup(phrase, session, case_sensitive)
        if found is None:
            return PhraseCount(phrase, 0, case_sensitive, session)

        return PhraseCount(
            phrase,
            search_ops.count(found.index, found.slots, found.owned, found.variants, found.known),
            case_sensitive,
            session,
        )

    def _lookup(
        self,
        phrase: str,
        session: str | None,
        case_sensitive: bool,
        within: set[str] | None = None,
        min_share: float | None = None,
    ) -> _Lookup | None:
        """What a search or a count of ``phrase`` reads: its variants, the index and its slot
        runs (those on ``session``'s path, or on the paths of the conversations ``within``, when
        given), and the trie; None when nothing is indexed. ``min_share``: a search's, whose
        partial hits' suffixes the casing walk bounds with the casings (a count reads none)."""
        if not phrase or not phrase.strip():
            raise InvalidArgument("empty search phrase; give some text to look for")
        tokenizer, tok_hash = self._models.tokenizer()
        variants = phrase_variants(tokenizer, phrase, case_sensitive)
        longest = max(len(v) for v in variants)
        if longest > search_ops.MAX_PHRASE_TOKENS:
            raise InvalidArgument(
                f"phrase is {longest} tokens long; search takes at most {search_ops.MAX_PHRASE_TOKENS}"
            )
        key = index_key(tok_hash)
        with self._derived.pinned() as version:  # one version for the index, its slot runs and the trie
            index = self._indexes.get(key, tok_hash, version=version)
            slots = self._derived.get(key, lambda: self._slot_map(key, index.ntotal))
            view = self._trie_view()
            owned = self._derived.get(
                f"{key}:owned", lambda: np.array([str(n) in view.owner for n in slots.node_ids], bool)
            )  # runs some session uses
            # node id -> first slot
            runs = self._derived.get(f"{key}:runs", lambda: dict(zip(slots.node_ids, slots.first.tolist())))
            scoping = session is not None or within is not None
            at = (
                self._derived.get(f"{key}:at", lambda: {str(n): i for i, n in enumerate(slots.node_ids)})
                if scoping
                else {}
            )  # node id -> its run
        if not len(slots.first):
            return None
        known: dict[bytes, KeyRange] | None = None
        if not case_sensitive:  # every casing the index holds, word by word and letter by letter
            also = [] if min_share is None else search_ops.partial_lookups(variants, index.depth, min_share)
            variants, known = casing.variants(tokenizer, index, phrase, variants, also)
        scoped = scoped_owners(view, self._reader, session, within)
        owners = view.owner if scoped is None else scoped
        # hits are reported in this session, or in those conversations: their runs, found by node, not by a pass
        # over all
        if scoped is not None:
            keep = np.sort(np.fromiter((at[n] for n in owners if n in at), dtype=np.int64))
            if not len(keep):
                return None
            slots, owned = (
                SlotMap(slots.node_ids[keep], slots.first[keep], slots.length[keep], slots.start[keep]),
                owned[keep],
            )
        sessions_of = lambda node_ids: {n: owners[n] for n in node_ids if n in owners}  # noqa: E731
        fetch = lambda requests: view.windows(self._storage, requests, runs, index.tokens)  # noqa: E731
        return _Lookup(tokenizer, variants, index, slots, owned, view, sessions_of, fetch, known)

    def _slot_map(self, key: str, ntotal: int) -> SlotMap:
        """The live slot runs the index in hand holds (a run another writer committed since the
        index was caught up waits for the next version)."""
        return SlotMap.from_rows([run for run in self._storage.slot_runs(key) if run[1] + run[2] <= ntotal])

    def _trie_view(self) -> trie.TrieView:
        return self._derived.get("trie", lambda: trie.TrieView.load(self._storage))

    def rebuild_index(self) -> RebuiltIndex:
        """Rebuild the search index of the archive's tokenizer from the token streams."""
        _, tok_hash = self._models.tokenizer()
        key = index_key(tok_hash)
        start = time.perf_counter()
        index = self._indexes.rebuild(key, tok_hash)
        return RebuiltIndex(
            key,
            len(self._storage.list_sessions()),
            len(self._storage.slot_runs(key)),
            index.ntotal,
            round(time.perf_counter() - start, 3),
        )


def phrase_variants(tokenizer, phrase: str, case_sensitive: bool = True) -> list[np.ndarray]:
    """The token sequences a phrase can have inside text: as typed, and after a space; unless
    ``case_sensitive``, also in each casing of ``casings``. A tokenizer spells "Leggy" and
    "leggy" with different tokens, so an index of tokens finds another casing only by searching
    for it. A search looks for every other casing the index holds beside these (``casing.variants``)."""
    texts = [
        text
        for cased in ([phrase] if case_sensitive else casings(phrase))
        for text in (cased, None if cased.startswith(" ") else " " + cased)
        if text is not None
    ]
    variants: dict[bytes, np.ndarray] = {}
    for ids in tok.encode_many(tokenizer, texts):  # one batch: a search's few short texts
        if ids:
            array = np.asarray(ids, dtype=np.int64)
            variants.setdefault(array.tobytes(), array)
    return list(variants.values())


def casings(phrase: str) -> list[str]:
    """The phrase as typed, then the casings text mostly takes: lower case, sentence case
    (the first letter capitalised), every word capitalised, upper case: each looked up whole,
    beside the mixtures word by word and letter by letter the casing walk finds (``casing``)."""
    words = phrase.split(" ")
    first = next((i for i, c in enumerate(phrase) if c.isalpha()), 0)
    lower = phrase.lower()
    forms = [
        phrase,
        lower,
        lower[:first] + lower[first:].capitalize(),
        " ".join(w.capitalize() for w in words),
        phrase.upper(),
    ]
    return list(dict.fromkeys(forms))

"""Search over what was archived: phrases through the sorted walk-key index (the tokenizer
alone is loaded), and contexts the model represents alike through tier K's keys (the model
runs the phrase). What a search derives from the tables (slot runs, the trie's shape, the key
vectors) is kept until the storage's version moves."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from kvdb.errors import InvalidArgument, TierMissing
from kvdb.index import phrase as search_ops
from kvdb.index import trie
from kvdb.index.phrase import Hit
from kvdb.index.walk import Indexes, SlotMap, index_key
from kvdb.model import tokenizer as tok
from kvdb.records import RebuiltIndex
from kvdb.services.cache import DerivedCache
from kvdb.services.models import ModelProvider
from kvdb.services.reading import Reader
from kvdb.storage import Storage

_NO_TIER_K = (
    "semantic search compares the KV cache stored in tier K, and no session of this model has it; "
    "ingest sessions with `--keep tokens,search,kv` (archived ones again, to add it)"
)


class Searcher:
    def __init__(self, storage: Storage, models: ModelProvider, reader: Reader, indexes: Indexes, tier_k: Callable):
        self._storage = storage
        self._models = models
        self._reader = reader
        self._indexes = indexes
        self._tier_k = tier_k  # built on first use: only semantic search needs the codebooks
        self._derived = DerivedCache(storage)

    def search(self, phrase: str, k: int = 10, context: int = 32, session: str | None = None) -> list[Hit]:
        if not phrase or not phrase.strip():
            raise InvalidArgument("empty search phrase; give some text to look for")
        tokenizer, tok_hash = self._models.tokenizer()
        variants = phrase_variants(tokenizer, phrase)
        longest = max(len(v) for v in variants)
        if longest > search_ops.MAX_PHRASE_TOKENS:
            raise InvalidArgument(f"phrase is {longest} tokens long; search takes at most {search_ops.MAX_PHRASE_TOKENS}")
        key = index_key(tok_hash)
        with self._derived.pinned() as version:  # one version for the index, its slot runs and the trie
            index = self._indexes.get(key, tok_hash, version=version)
            slots = self._derived.get(key, lambda: self._slot_map(key, index.ntotal))
            view = self._trie_view()
        if not len(slots.first):
            return []
        runs = dict(zip(slots.node_ids, slots.first.tolist()))
        sessions_of = lambda node_ids: {n: view.owner[n] for n in node_ids if n in view.owner}  # noqa: E731
        if session is not None:
            wanted = self._reader.resolve(session).session_id
            on_path = {n.node_id for n in view.path(wanted)}
            keep = np.array([nid in on_path for nid in slots.node_ids], dtype=bool)
            slots = SlotMap(slots.node_ids[keep], slots.first[keep], slots.length[keep], slots.start[keep])
            sessions_of = lambda node_ids: dict.fromkeys(node_ids, wanted)  # noqa: E731  (hits are reported in this session)
        return search_ops.search(
            index,
            slots,
            variants,
            view.names,
            sessions_of=sessions_of,
            fetch=lambda requests: view.windows(self._storage, requests, runs, index.tokens),
            decode=lambda ids: tok.decode(tokenizer, ids),
            k=k,
            context=context,
        )

    def _slot_map(self, key: str, ntotal: int) -> SlotMap:
        """The live slot runs the index in hand holds (a run another writer committed since the
        index was caught up waits for the next version)."""
        return SlotMap.from_rows([run for run in self._storage.slot_runs(key) if run[1] + run[2] <= ntotal])

    def _trie_view(self) -> trie.TrieView:
        return self._derived.get("trie", lambda: trie.TrieView.load(self._storage))

    def search_semantic(self, phrase: str, k: int = 10, context: int = 32, layer: int | None = None) -> list[Hit]:
        if not phrase or not phrase.strip():
            raise InvalidArgument("empty search phrase; give some text to look for")
        if not self._storage.codebook_rows():  # no session can hold tier K: say so before loading the model
            raise TierMissing(_NO_TIER_K)
        from kvdb.index import semantic as semantic_ops  # runs the model

        loaded = self._models.get()
        layers = loaded.model.config.num_hidden_layers
        layer = layers // 2 if layer is None else layer
        if not 0 <= layer < layers:
            raise InvalidArgument(f"layer must be from 0 to {layers - 1}, got {layer}")
        ids = np.asarray(tok.encode(loaded.tokenizer, phrase), dtype=np.int64)
        model_id = loaded.identity.model_id
        nodes, offsets, vectors = self._derived.get(("semantic", model_id, layer), lambda: self._semantic_table(semantic_ops, model_id, layer))
        if not len(nodes):
            raise TierMissing(_NO_TIER_K)
        view = self._trie_view()
        rows, scores = semantic_ops.nearest(vectors, semantic_ops.query_vector(loaded.model, ids, layer), 4 * k)
        found = []  # (session, position, cosine) of the nearest positions some session holds
        for row, score in zip(rows, scores):
            node = view.nodes[nodes[row]]
            if node.node_id in view.owner:
                found.append((view.owner[node.node_id], node.start + int(offsets[row]), float(score)))
                if len(found) == k:
                    break
        spans = [(max(0, position - context), position + 1 + context) for _, position, _ in found]
        windows = view.windows(self._storage, [(sid, lo, hi) for (sid, _, _), (lo, hi) in zip(found, spans)], {}, np.zeros(0, np.int64))
        hits = []
        for (session_id, position, score), (lo, _), window in zip(found, spans, windows):  # one query for every window
            before, at, after = (tok.decode(loaded.tokenizer, part) for part in np.split(window, [position - lo, position + 1 - lo]))
            hits.append(Hit(session_id, view.names.get(session_id, ""), position, 1, len(ids), False, before, at, after, score))
        return hits

    def _semantic_table(self, semantic_ops, model_id: str, layer: int):
        """(node ids, offsets, unit key vectors) of every position stored with tier K."""
        nodes, offsets, vectors = [], [], []
        for node in self._storage.nodes_of([model_id]):
            stored = self._storage.node_kv(node.node_id) if node.refcount > 0 and "kv" in node.keep else None
            if stored is None:
                continue
            _, books = self._tier_k().codebooks(model_id, stored[0])
            vectors.append(semantic_ops.position_vectors(books, stored[1], node.n_tokens, layer))
            nodes += [node.node_id] * node.n_tokens
            offsets.append(np.arange(node.n_tokens))
        return (
            np.array(nodes, dtype=object),
            np.concatenate(offsets) if offsets else np.zeros(0, np.int64),
            np.concatenate(vectors) if vectors else np.zeros((0, 1), np.float32),
        )

    def rebuild_index(self) -> RebuiltIndex:
        """Rebuild the search index of the archive's tokenizer from the token streams."""
        _, tok_hash = self._models.tokenizer()
        key = index_key(tok_hash)
        start = time.perf_counter()
        index = self._indexes.rebuild(key, tok_hash)
        return RebuiltIndex(key, len(self._storage.list_sessions()), len(self._storage.slot_runs(key)), index.ntotal, round(time.perf_counter() - start, 3))


def phrase_variants(tokenizer, phrase: str) -> list[np.ndarray]:
    """The token sequences a phrase can have inside text: as typed, and after a space."""
    variants: list[np.ndarray] = []
    for text in (phrase, " " + phrase if not phrase.startswith(" ") else None):
        if text is not None:
            ids = np.asarray(tok.encode(tokenizer, text), dtype=np.int64)
            if len(ids) and not any(np.array_equal(ids, v) for v in variants):
                variants.append(ids)
    return variants

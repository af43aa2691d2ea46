"""The semantic tier: each session's chunks embedded at ingest (by the write path, which calls
``chunks``), and search by meaning over them.

The chunks' vectors live in the archive's ``node_chunks`` rows; the index over them is derived
from the rows and kept until the storage's version moves, like the walk index. A hit is a
chunk: the session through its node, the chunk's first position (which ``restore --at``
takes), its text and its cosine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from kvdb.errors import InvalidArgument, TierMissing
from kvdb.index import chunks as chunk_ops
from kvdb.index import trie
from kvdb.index import vectors as vector_ops
from kvdb.index.phrase import Hit
from kvdb.model import chat
from kvdb.model import tokenizer as tok
from kvdb.services.cache import DerivedCache
from kvdb.services.models import ModelProvider
from kvdb.services.reading import Reader
from kvdb.storage import Storage
from kvdb.storage.base import Chunks

if TYPE_CHECKING:
    from kvdb.model.embedder import Embedder

CANDIDATES = 4  # nearest chunks read per hit asked for: several chunks of one session make one hit
_NO_TIER = "no session has the semantic tier; ingest with `--keep tokens,search,semantic` (archived sessions again, to add it)"


class SemanticTier:
    def __init__(self, storage: Storage, models: ModelProvider, reader: Reader, embedder: Callable[[], Embedder]):
        self._storage = storage
        self._models = models
        self._reader = reader
        self._embedder = embedder  # loaded on first use: a search of phrases never needs it
        self._derived = DerivedCache(storage)

    def chunks(self, tokenizer, ids: np.ndarray, lo: int, hi: int) -> Chunks:
        """The chunks of a session (``ids``) whose last token lies in [lo, hi), embedded: what a
        node holding those positions stores."""
        turns = chat.turns(tokenizer, ids)
        spans = chunk_ops.ending_in(chunk_ops.spans([(a, b) for _, a, b in turns]), lo, hi)
        texts = [tok.plain_text(tokenizer, ids[a:b]) for a, b in spans]
        roles = {a: role for role, a, _ in turns if role}
        said = [bool(text.strip()) and text.strip() != roles.get(int(a)) for text, (a, _) in zip(texts, spans)]  # an empty turn says nothing
        spans, texts = spans[said], [text for text, keep in zip(texts, said) if keep]
        embedder = self._embedder()
        vectors = embedder.embed(texts) if texts else np.zeros((0, embedder.dim), np.float32)
        return Chunks(embedder.embedder_id, [(int(a), int(b)) for a, b in spans], vectors)

    def search(self, query: str, k: int = 10, session: str | None = None) -> list[Hit]:
        """The chunks nearest ``query`` in meaning, one hit per session (its nearest chunk)."""
        if not query or not query.strip():
            raise InvalidArgument("empty search query; give some text to look for")
        embedded_with = self._storage.chunk_embedders()
        if not embedded_with:  # said before the embedder loads (seconds: torch and transformers)
            raise TierMissing(_NO_TIER)
        embedder = self._embedder()
        if embedder.embedder_id not in embedded_with:
            raise InvalidArgument(
                f"the semantic tier was embedded with {', '.join(embedded_with)}, not {embedder.embedder_id}: search with that embedder (--embedder), "
                "or add the tier for this one (ingest again with --keep ...,semantic and --embedder)"
            )
        with self._derived.pinned():
            nodes, spans, index = self._derived.get(("chunks", embedder.embedder_id), lambda: self._index(embedder.embedder_id))
            names, view = self._derived.get("trie", lambda: ({s.session_id: s.name for s in self._storage.list_sessions()}, trie.TrieView.load(self._storage)))
        if index is None:
            raise TierMissing(_NO_TIER)
        on_path = None
        if session is not None:
            wanted = self._reader.resolve(session).session_id
            on_path = {n.node_id for n in view.path(wanted)}
        query_vector = embedder.embed([query], kind="query")
        found: dict[str, tuple[int, int, float]] = {}  # session -> (start, stop, cosine) of its nearest chunk
        asked = min(len(nodes), CANDIDATES * k)
        while True:
            scores, rows = vector_ops.nearest(index, query_vector, asked)
            for row, score in zip(rows[0].tolist(), scores[0].tolist()):
                if row < 0:
                    continue
                node_id = nodes[row]
                owner = wanted if on_path is not None and node_id in on_path else None if on_path is not None else view.owner.get(node_id)
                if owner is not None and owner not in found:
                    found[owner] = (int(spans[row, 0]), int(spans[row, 1]), float(score))
            if len(found) >= k or asked >= len(nodes):
                break
            asked = min(len(nodes), asked * 4)
        best = sorted(found.items(), key=lambda item: -item[1][2])[:k]
        windows = view.windows(self._storage, [(sid, a, b) for sid, (a, b, _) in best], {}, np.zeros(0, np.int64))
        return [
            Hit(sid, names.get(sid, ""), a, b - a, 0, False, "", tok.plain_text(self._models.tokenizer_for(self._reader.resolve(sid)), window), "", score)
            for (sid, (a, b, score)), window in zip(best, windows)
        ]

    def _index(self, embedder_id: str):
        """(node id of each chunk, [n, 2] spans, the index over their vectors; None when there are none)."""
        nodes, spans, vectors = self._storage.chunks_of(embedder_id)
        return nodes, spans, vector_ops.build(vectors) if nodes else None

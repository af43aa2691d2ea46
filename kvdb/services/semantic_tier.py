"""The semantic tier: each session's chunks embedded at ingest (by the write path, which calls
``chunks``), and search by meaning over them.

The chunks' vectors live in the archive's ``node_chunks`` rows; the index over them
(``kvdb.index.chunk_index``) is derived from the rows and kept in a sidecar file per embedder,
like the walk index: caught up with what other writers committed by reading only the nodes whose
chunks changed, rebuilt by ``repair``. A hit is a chunk: the session through its node, the
chunk's first position (which ``restore --at`` takes), its text and its fused score.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvdb.errors import CorruptData, InvalidArgument, TierMissing
from kvdb.index import chunks as chunk_ops
from kvdb.index import ranking, trie
from kvdb.index.chunk_index import ChunkIndex
from kvdb.index.phrase import Hit
from kvdb.model import chat
from kvdb.model import tokenizer as tok
from kvdb.records import MeaningHit
from kvdb.services.cache import DerivedCache
from kvdb.services.conversations import labelled, scoped_owners
from kvdb.services.models import ModelProvider
from kvdb.services.reading import Reader
from kvdb.storage import Storage
from kvdb.storage.base import Chunks
from kvdb.storage.edits import SEMANTIC_WORK

if TYPE_CHECKING:
    from kvdb.model.embedder import Embedder

# chunks each retriever hands to the fusion, and sessions whole-session BM25 does (decision 0037;
# benchmarks/hybrid.py, at tag studies-2026-12-06)
CANDIDATES = 100
# The fusion (decision 0058): a chunk's cosine to the query, the share of the query's word weight
# the chunk holds (BM25 over its ceiling) and the share its whole conversation holds, weighted;
# none scaled over the list, so a score means the same for any query and any archive.
# Chosen on held-out sets (docstrings the benchmark does not ask, a Chit-Chat history of another
# seed; benchmarks/retrieval.py --held-out --grid, memory.py --grid): the chunk's words add nothing
# there that its session's do not, so they only pick candidates (decision 0058).
WEIGHTS = (0.7, 0.0, 0.3)  # cosine, chunk words, session words
FUSION = "share"  # "share": as above; "minmax": each part scaled over the candidates (as before decision 0058)
# a hit under this score is marked weak: the cut-off that best told right top hits from unanswerable queries' on the
# held-out docstrings
WEAK_BELOW = 0.41
# A catch-up rewrites the sidecar (GBs at 1e6 chunks;
# benchmarks/RESULTS.md, "Semantic tier: index latency at 1e4-1e6 chunks") only once the rows it changed since the
# file was written reach this share of them: until then each new process reads those few nodes again, which costs
# less than the rewrite.
SAVE_SHARE = 1 / 64
# turns holding what a tool gave back, by the template's role word
TOOL_ROLES = frozenset({"tool", "ipython", "function"})
# a tool call's or result's block, as chat.TEXTUAL writes it and as templates that render tools do
# (Qwen's <tool_call>, <tool_response>); one left open runs to the turn's end
_TOOL_BLOCK = re.compile(r"<(tool_call|tool_result|tool_response)\b[^>]*>.*?(?:</\1>|\Z)", re.DOTALL)
_NO_TIER = (
    "no session has the semantic tier; ingest with `--keep tokens,search,semantic` (archived sessions again, to add it)"
)


class SemanticTier:
    def __init__(self, storage: Storage, models: ModelProvider, reader: Reader, embedder: Callable[[], Embedder]):
        self._storage = storage
        self._models = models
        self._reader = reader
        self._embedder = embedder  # loaded on first use: a search of phrases never needs it
        self._derived = DerivedCache(storage)
        self.indexes = ChunkIndexes(storage, self._texts)

    def chunks(self, tokenizer, ids: np.ndarray, nodes: list[tuple[int, int]]) -> list[Chunks]:
        """For each node [lo, hi) of a session's path (``ids``), the session's chunks whose last
        token it holds, embedded: what the node stores."""
        return self.embedded(self.cut(tokenizer, ids, nodes))

    @staticmethod
    def cut(tokenizer, ids: np.ndarray, nodes: list[tuple[int, int]]) -> list[tuple[np.ndarray, list[str]]]:
        """For each node [lo, hi) of a session's path, the spans and texts of the chunks whose
        last token it holds (of those ``said`` keeps): what ``embedded`` embeds. The session's
        turns are found, and its texts decoded, once for all the nodes."""
        spans, texts = said(tokenizer, ids)
        out = []
        for lo, hi in nodes:
            ends = chunk_ops.ending_in(spans, lo, hi)
            out.append((spans[ends], [text for text, end in zip(texts, ends.tolist()) if end]))
        return out

    def embedded(self, cuts: list[tuple[np.ndarray, list[str]]]) -> list[Chunks]:
        """Each node's ``cut`` as its Chunks, every text embedded in one call: upkeep gives the
        nodes of many sessions at once, so the embedder's batches are full and of like lengths
        where a session of a few turns alone leaves them short (decision 0054)."""
        embedder = self._embedder()
        texts = [text for _, node_texts in cuts for text in node_texts]
        vectors = embedder.embed(texts) if texts else np.zeros((0, embedder.dim), np.float32)
        cuts_at = np.cumsum([len(node_texts) for _, node_texts in cuts])[:-1]
        return [
            Chunks(embedder.embedder_id, [(int(a), int(b)) for a, b in spans], node_vectors)
            for (spans, _), node_vectors in zip(cuts, np.split(vectors, cuts_at))
        ]

    def _no_tier(self) -> str:
        waiting = self._storage.pending_counts().get(SEMANTIC_WORK)
        if waiting:  # ingested with it, not embedded yet
            return (
                f"no session is embedded yet: {waiting[0]} sessions ({waiting[1]} tokens) wait for it; "
                "run `kvdb upkeep` (watch and serve embed when idle)"
            )
        return _NO_TIER

    def search(self, query: str, k: int = 10, session: str | None = None, within: set[str] | None = None) -> list[Hit]:
        """The conversations that best match ``query``, one hit per conversation at its best chunk
        (its span restores): each candidate chunk scored by ``fusion`` of its cosine to the query,
        the share of the query's word weight it holds (BM25 over ``BM25.ceiling``) and the share
        its whole conversation holds (BM25 over conversations, ``BM25.grouped``), so that a
        conversation that says the query's words across many turns is found though no one turn
        says them all (decision 0058). The candidates: the ``CANDIDATES`` best chunks by cosine and
        by words, and every chunk of the conversations whole-session BM25 puts first. The score is
        on one scale for any query and any list; under ``WEAK_BELOW`` the hit is marked weak."""
        if not query or not query.strip():
            raise InvalidArgument("empty search query; give some text to look for")
        # one version for the embedders, the trie and the index; each read again only when it moves
        with self._derived.pinned():
            embedded_with = self._derived.get("embedders", self._storage.chunk_embedders)  # a scan of every chunk row
            if not embedded_with:  # said before the embedder loads
                raise TierMissing(self._no_tier())
            embedder = self._embedder()
            if embedder.embedder_id not in embedded_with:
                raise InvalidArgument(
                    f"the semantic tier was embedded with {', '.join(embedded_with)}, not {embedder.embedder_id}: "
                    "search with that embedder (--embedder), "
                    "or add the tier for this one (ingest again with --keep ...,semantic and --embedder)"
                )
            view = self._derived.get("trie", lambda: trie.TrieView.load(self._storage))
            table = self._derived.get(
                ("chunks", embedder.embedder_id), lambda: self.indexes.get(embedder.embedder_id, view)
            )
        if table is None:
            raise TierMissing(self._no_tier())
        query_vector = embedder.embed([query], kind="query")[0]
        owner_of = scoped_owners(view, self._reader, session, within)
        if owner_of is None:
            owners: Callable[[str], str | None] = view.owner.get
            groups, keys = self._derived.get(("groups", embedder.embedder_id), lambda: _groups(table, view, owners))
            dense_rows, _ = table.nearest(query_vector, CANDIDATES)
        else:  # the chunks of this session's path, or of those conversations' paths
            owners = owner_of.get
            groups, keys = _groups(table, view, owners)
            rows = np.flatnonzero(groups >= 0)
            cosines = table.vectors[rows].astype(np.float32) @ query_vector
            dense_rows = rows[np.argsort(-cosines, kind="stable")[:CANDIDATES]]
        chunk_words = np.where(groups >= 0, table.words.scores(query), 0.0)
        chunk_share = chunk_words / max(table.words.ceiling(query), 1e-12)
        session_words, session_ceiling = table.words.grouped(query, groups, len(keys))
        session_share = session_words / max(session_ceiling, 1e-12)
        words_rows, _ = ranking.top_k(chunk_words, CANDIDATES)
        # past these, a session is a candidate by its chunks alone
        sessions, _ = ranking.top_k(session_share, max(2 * k, 20))
        # each candidate chunk: the retrievers' best, and every chunk of the sessions whole-session
        # BM25 puts first, so that a session it finds lands on its own best chunk
        rows = np.union1d(np.union1d(dense_rows, words_rows), np.flatnonzero(np.isin(groups, sessions)))
        rows = rows[groups[rows] >= 0]
        cosine = table.vectors[rows].astype(np.float32) @ query_vector
        parts = np.stack([cosine, chunk_share[rows], session_share[groups[rows]]])
        fused = fusion(parts)
        order = np.lexsort((rows, -fused))
        _, first = np.unique(groups[rows[order]], return_index=True)  # each session's best chunk
        best = order[np.sort(first)][:k]
        found = [
            (owners(table.node_of(row)) or "", int(table.spans[row, 0]), int(table.spans[row, 1]))
            for row in rows[best].tolist()
        ]  # a row in a group has an owner
        texts = self._texts(view, found)
        hits: list[Hit] = [
            MeaningHit(
                sid, view.names.get(sid, ""), a, b - a, 0, False, "", text, "", float(fused[i]),
                cosine=float(parts[0, i]), words=float(parts[1, i]), session_words=float(parts[2, i]),
                weak=bool(fused[i] < WEAK_BELOW),
            )
            for (sid, a, b), text, i in zip(found, texts, best.tolist())
        ]  # fmt: skip
        return labelled(hits, view, self._storage, self._derived.get("titles", dict))

    def _texts(self, view: trie.TrieView, requests: list[tuple[str, int, int]]) -> list[str]:
        """The text, without special tokens or role words, of tokens [start, stop) of each (session, start, stop)."""
        windows = view.windows(self._storage, requests, {}, np.zeros(0, np.int64))
        tokenizers: dict[str, object] = {}
        for session_id, _, _ in requests:
            if session_id not in tokenizers:
                tokenizers[session_id] = self._models.tokenizer_for(self._reader.resolve(session_id))
        return [
            tok.snippet_text(tokenizers[session_id], window) for (session_id, _, _), window in zip(requests, windows)
        ]


def fusion(parts: np.ndarray) -> np.ndarray:
    """The fused score of each candidate (``parts``: [3, n] cosine, chunk share, session share)."""
    if FUSION == "minmax":
        parts = np.stack([ranking.normalised(p) for p in parts]) if parts.shape[1] else parts
    return np.asarray(WEIGHTS, np.float64) @ parts.astype(np.float64)


def _groups(
    table: ChunkIndex, view: trie.TrieView, owners: Callable[[str], str | None]
) -> tuple[np.ndarray, list[str]]:
    """Each row's conversation as a number (-1: a row no session in scope owns, or a tombstone),
    and the conversations by number: the documents of whole-session BM25."""
    number: dict[str, int] = {}
    per_node = np.full(len(table.node_ids), -1, np.int64)
    for i, node_id in enumerate(table.node_ids):
        owner = owners(node_id)
        if owner is not None:
            per_node[i] = number.setdefault(view.conversations.get(owner, owner), len(number))
    groups = per_node[table.row_node] if len(per_node) else np.full(table.rows, -1, np.int64)
    return np.where(table.live, groups, -1), list(number)


def said(tokenizer, ids: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """The chunks of a session worth embedding, as [n, 2] spans on its tokens and their texts:
    what its people said, not what their tools gave back. A tool's turn, and a call's arguments
    inside a turn (a file written out, a patch), are left out: in agent logs they hold most of
    the tokens (74% at 1e6 in benchmarks/backfill.py) and a search by meaning looks for what was
    asked and answered (decision 0054). Each span is a run of the session's own tokens, so a hit
    still restores the state at its end. A turn that only opens (its role word) says nothing."""
    ids = np.asarray(ids, dtype=np.int64)
    turns = chat.turns(tokenizer, ids)
    prose = [(role, a, b) for role, a, b in turns if role not in TOOL_ROLES and b > a]
    backend = _backend(tokenizer)
    whole = backend.decode_batch([ids[a:b].tolist() for _, a, b in prose], skip_special_tokens=False)
    runs = [run for (_, a, b), text in zip(prose, whole) for run in _outside_tools(backend, ids, a, b, text)]
    spans = chunk_ops.spans(runs)
    texts = (
        backend.decode_batch([ids[a:b].tolist() for a, b in spans.tolist()], skip_special_tokens=True)
        if len(spans)
        else []
    )
    roles = {a: role for role, a, _ in turns if role}
    keep = [bool(text.strip()) and text.strip() != roles.get(int(a)) for text, a in zip(texts, spans[:, 0].tolist())]
    return spans[np.array(keep, dtype=bool)], [text for text, kept in zip(texts, keep) if kept]


def _outside_tools(backend, ids: np.ndarray, a: int, b: int, text: str) -> list[tuple[int, int]]:
    """The runs of turn [a, b) (decoded: ``text``) outside its tool blocks, found in the text
    and placed on the tokens by the offsets of encoding it again: the turn whole where there is
    no block, or where encoding gives other tokens (nothing to place the blocks by)."""
    blocks = [m.span() for m in _TOOL_BLOCK.finditer(text)]
    if not blocks:
        return [(a, b)]
    encoding = backend.encode(text, add_special_tokens=False)
    if not np.array_equal(np.asarray(encoding.ids, dtype=np.int64), ids[a:b]):
        return [(a, b)]
    starts = np.array(encoding.offsets, dtype=np.int64).reshape(-1, 2)[:, 0]
    cuts = a + np.searchsorted(starts, np.array(blocks, dtype=np.int64).ravel(), side="left")
    edges = [a, *cuts.tolist(), b]  # prose, block, prose, ..., block, prose
    return [(lo, hi) for lo, hi in zip(edges[::2], edges[1::2]) if hi > lo]


def _backend(tokenizer):
    """The ``tokenizers`` tokenizer under a light or a transformers one: its batch decode and its
    offsets, without transformers' per-call Python."""
    return tokenizer.backend if isinstance(tokenizer, tok.LightTokenizer) else tokenizer.backend_tokenizer


class ChunkIndexes:
    """The semantic tier's indexes, one per embedder: each a copy, in memory and in a sidecar
    file, of the database's chunks, caught up with what other writers committed since (on this
    machine or another) by reading the chunks of the nodes whose count changed, and built from
    every chunk only when it has none, cannot read it, or has outgrown it (``ChunkIndex.outgrown``)."""

    def __init__(self, storage: Storage, texts: Callable[[trie.TrieView, list[tuple[str, int, int]]], list[str]]):
        self._store = storage
        self._texts = texts
        self._folder = storage.derived_path(".index")
        self._loaded: dict[str, ChunkIndex] = {}
        self.rebuilt: list[str] = []  # embedders whose index this process built from every chunk, in order
        self.read: list[str] = []  # nodes whose chunks this process read to catch an index up, in order

    def path(self, embedder_id: str) -> Path:
        return self._folder / f"chunks-{hashlib.sha256(embedder_id.encode()).hexdigest()[:16]}.vec"

    def get(self, embedder_id: str, view: trie.TrieView) -> ChunkIndex | None:
        """The index as the database has it now (``view``: the trie at the same version): the copy
        in memory, else the sidecar's, caught up; None when no live node has chunks by
        ``embedder_id``. A read: nothing is written to the database."""
        counts = self._store.chunk_counts(embedder_id)
        if not counts:
            return None
        index = self._loaded.get(embedder_id) or self._sidecar(embedder_id)
        if index is None:
            return self.rebuild(embedder_id, view)
        held = index.counts()
        changed = [node_id for node_id, n in counts.items() if held.get(node_id) != n]
        gone = [node_id for node_id, n in held.items() if counts.get(node_id) != n]
        if changed or gone:
            self._loaded.pop(embedder_id, None)  # half caught up until the end: never kept so
            index.drop(gone)
            if index.outgrown(sum(counts[node_id] for node_id in changed)):
                return self.rebuild(embedder_id, view)
            if changed:
                nodes, spans, vectors = self._store.chunks_of(embedder_id, changed)
                index.append(nodes, spans, vectors, self._chunk_texts(view, nodes, spans))
                self.read.extend(changed)
            if index.unsaved >= SAVE_SHARE * index.rows:
                self._save(index)
        self._loaded[embedder_id] = index
        return index

    def flush(self, embedder_id: str) -> None:
        """Write the copy in memory when the sidecar lags behind it (a catch-up too small to save)."""
        index = self._loaded.get(embedder_id)
        if index is not None and index.unsaved:
            self._save(index)

    def rebuild(self, embedder_id: str, view: trie.TrieView | None = None) -> ChunkIndex | None:
        """The index built from every chunk by ``embedder_id``, and saved."""
        view = trie.TrieView.load(self._store) if view is None else view
        nodes, spans, vectors = self._store.chunks_of(embedder_id)
        self._loaded.pop(embedder_id, None)
        if not nodes:
            return None
        index = ChunkIndex.build(embedder_id, nodes, spans, vectors, self._chunk_texts(view, nodes, spans))
        self.rebuilt.append(embedder_id)
        self._loaded[embedder_id] = index
        self._save(index)
        return index

    def _sidecar(self, embedder_id: str) -> ChunkIndex | None:
        try:
            index = ChunkIndex.load(self.path(embedder_id))
        except (OSError, CorruptData):
            return None
        return index if index.embedder == embedder_id else None

    def _save(self, index: ChunkIndex) -> None:
        """Keep the copy for the next process. The database holds what it is derived from, so a
        sidecar that cannot be written (a read-only folder, a full disk) costs only the next
        process's catching up, never this answer."""
        try:
            index.save(self.path(index.embedder))
        except OSError:
            pass

    def _chunk_texts(self, view: trie.TrieView, nodes: list[str], spans: np.ndarray) -> list[str]:
        """Each chunk's text, read from its session's tokens ("" for a node no session owns)."""
        readable = [
            (i, owner) for i, owner in enumerate(view.owner.get(node_id) for node_id in nodes) if owner is not None
        ]
        texts = [""] * len(nodes)
        for (i, _), text in zip(
            readable, self._texts(view, [(owner, int(spans[i, 0]), int(spans[i, 1])) for i, owner in readable])
        ):
            texts[i] = text
        return texts

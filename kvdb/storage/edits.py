"""Trie surgery as row edits: what each plan changes, decided once for every backend.

A backend reads the rows a plan touches inside its transaction, asks these functions which
rows to insert, delete and update, and runs the edits in order. Nothing here knows an engine:
the edits name tables and key columns, and the values are the bytes to store (token blocks
coded by :mod:`kvdb.codecs.fractal`, log-probabilities as little-endian float32).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from kvdb.codecs import fractal
from kvdb.codecs.entropy_coded import PAYLOAD
from kvdb.storage.base import Chunks, IndexState, NewNode, NodeRow, NodeTiers, Split, child_key

# Every table of kvdb.storage.schema, in its metadata's order (a test keeps the two equal): what
# reads and copies every row names them from here, without importing SQLAlchemy.
TABLES = (
    "codebooks",
    "conversation_sessions",
    "conversations",
    "models",
    "node_chunks",
    "node_kv",
    "node_lm",
    "node_logprobs",
    "nodes",
    "pending_work",
    "search_indexes",
    "search_ranges",
    "sessions",
    "token_blocks",
    "token_streams",
    "watched_files",
)
LOGPROBS_WORK = "logprobs"  # pending_work: the session's path holds tokens the model has not scored
SEMANTIC_WORK = "semantic"  # pending_work: the session's path lacks the semantic tier it was ingested with
PAYLOAD_BLOCK = 1 << 20  # bytes per row of an entropy-coded tier K payload
# every tier a node can hold
NODE_TABLES = ("token_blocks", "token_streams", "node_logprobs", "search_ranges", "node_lm", "node_kv", "node_chunks")
TIER_TABLES = (
    ("search", "search_ranges"),
    ("lm", "node_lm"),
    ("kv", "node_kv"),
    ("semantic", "node_chunks"),
    ("tokens", "token_blocks"),
    ("tokens", "node_logprobs"),
)


@dataclass(frozen=True)
class Insert:
    table: str
    rows: list[dict]


@dataclass(frozen=True)
class Delete:
    """Every row of ``table`` whose ``column`` is one of ``values``."""

    table: str
    column: str
    values: list


@dataclass(frozen=True)
class Update:
    """Set ``values`` on the rows of ``table`` whose ``column`` equals ``key``."""

    table: str
    column: str
    key: object
    values: dict


@dataclass(frozen=True)
class Recount:
    """Add ``delta`` to the refcount of these nodes (the sessions whose path runs through them)."""

    node_ids: list[str]
    delta: int


Edit = Insert | Delete | Update | Recount


@dataclass(frozen=True)
class Stream:
    """A node's token-stream row: how its blocks are coded."""

    alphabet: int
    block_size: int
    n_tokens: int


@dataclass(frozen=True)
class Held:
    """What a split or a tier change reads of a node before deciding its edits."""

    node: NodeRow
    tokens: np.ndarray | None  # None when the node holds no token blocks
    logprobs: np.ndarray | None
    kv: tuple[str, dict[int, np.ndarray]] | None
    search_run: tuple[str, int, int] | None  # (index_key, first_slot, n_tokens)
    chunks: list[dict]  # its node_chunks rows


def keep_text(keep) -> str:
    return ",".join(sorted(keep))


@functools.cache  # a handful of distinct values, read for every node a trie view loads (54k at 1e8 tokens)
def keep_from_text(text: str | None) -> frozenset[str]:
    """A node's ``keep`` column; NULL is a row older than migration 0005, which held its tokens and search."""
    return frozenset(t for t in (text if text is not None else "search").split(",") if t)


def logprob_bytes(logprobs: np.ndarray) -> bytes:
    return np.asarray(logprobs, dtype="<f4").tobytes()


def token_rows(node_id: str, stream: Stream, tokens: np.ndarray, logprobs: np.ndarray | None) -> list[Edit]:
    """Token blocks and log-probabilities of a node whose stream row says how to code them;
    ``logprobs`` None: the model has not scored them yet (``pending_work`` says who will)."""
    if not stream.n_tokens == len(tokens) == (len(tokens) if logprobs is None else len(logprobs)):
        raise ValueError(
            f"node {node_id} holds {stream.n_tokens} tokens, not {len(tokens)} "
            f"(with {len(logprobs or ())} log-probabilities)"
        )
    blocks = fractal.encode_blocks(tokens, stream.alphabet, stream.block_size)
    rows: list[Edit] = [
        Insert("token_blocks", [{"node_id": node_id, "block_no": k, "data": blob} for k, blob in enumerate(blocks)])
    ]
    return rows + (logprob_rows(node_id, logprobs) if logprobs is not None else [])


def logprob_rows(node_id: str, logprobs: np.ndarray) -> list[Edit]:
    return [Insert("node_logprobs", [{"node_id": node_id, "logprobs": logprob_bytes(logprobs)}])]


def tier_rows(
    node_id: str, tokens: np.ndarray, logprobs: np.ndarray | None, alphabet: int, held: bool = True
) -> list[Edit]:
    """A node's stream row, and its token blocks and log-probabilities unless it is held in
    tier L only (then both are the model's to recompute: decoding, then scoring)."""
    stream = Stream(alphabet, fractal.DEFAULT_BLOCK, len(tokens))
    row = Insert(
        "token_streams",
        [{"node_id": node_id, "alphabet": alphabet, "block_size": stream.block_size, "n_tokens": len(tokens)}],
    )
    return [row] + (token_rows(node_id, stream, tokens, logprobs) if held else [])


def kv_rows(node_id: str, codebook_id: str, streams: dict[int, np.ndarray]) -> list[Edit]:
    """A node's tier K rows: each symbol stream in fractal blocks; an entropy-coded payload (stream
    ``PAYLOAD``, bytes) as it is, in blocks of ``PAYLOAD_BLOCK`` bytes."""
    rows = [
        {"node_id": node_id, "alphabet": size, "block_no": k, "codebook_id": codebook_id, "data": blob}
        for size, symbols in streams.items()
        for k, blob in enumerate(_payload_blocks(symbols) if size == PAYLOAD else fractal.encode_blocks(symbols, size))
    ]
    return [Insert("node_kv", rows)] if rows else []


def _payload_blocks(payload: np.ndarray) -> list[bytes]:
    data = np.asarray(payload, np.uint8).tobytes()
    return [data[at : at + PAYLOAD_BLOCK] for at in range(0, len(data), PAYLOAD_BLOCK)] or [b""]


def queued(work: list[tuple[str, str]], at) -> list[Edit]:
    """``pending_work`` rows of (session id, work), queued ``at``."""
    rows = [{"session_id": session_id, "work": kind, "queued_at": at} for session_id, kind in work]
    return [Insert("pending_work", rows)] if rows else []


def chunk_rows(node_id: str, chunks: Chunks) -> list[Edit]:
    """A node's semantic tier: its chunks' spans and vectors, float16."""
    vectors = np.asarray(chunks.vectors, dtype="<f2")
    rows = [
        {
            "node_id": node_id,
            "chunk_no": k,
            "start": int(a),
            "stop": int(b),
            "embedder": chunks.embedder,
            "vector": vectors[k].tobytes(),
        }
        for k, (a, b) in enumerate(chunks.spans)
    ]
    return [Insert("node_chunks", rows)] if rows else []


def new_node(node: NewNode, model_id: str, alphabet: int) -> list[Edit]:
    row = {
        "node_id": node.node_id,
        "parent_id": node.parent_id,
        "model_id": model_id,
        "start": node.start,
        "n_tokens": len(node.tokens),
        "first_token": int(node.tokens[0]),
        "child_key": child_key(node.parent_id, model_id, node.tokens),
        "refcount": 0,
        "keep": keep_text(node.keep),
    }
    edits: list[Edit] = [Insert("nodes", [row])]
    edits += tier_rows(node.node_id, node.tokens, node.logprobs, alphabet, held="tokens" in node.keep)
    if node.lm is not None:
        edits.append(Insert("node_lm", [{"node_id": node.node_id, "payload": node.lm}]))
    if node.kv is not None:
        edits += kv_rows(node.node_id, *node.kv)
    if node.chunks is not None:
        edits += chunk_rows(node.node_id, node.chunks)
    return edits


def add_tiers(node: NodeRow, stream: Stream | None, tiers: NodeTiers, search: bool = False) -> list[Edit]:
    """An existing node given tiers: its tokens back (a node held in tier L only; ``stream`` says
    how they are coded), tier L, tier K, and the search tier (``search``: its slot run is inserted
    with the index state)."""
    edits: list[Edit] = []
    added = {"search"} if search else set()
    if tiers.tokens is not None:
        assert stream is not None  # given whenever tokens are
        edits += token_rows(node.node_id, stream, *tiers.tokens)
        added.add("tokens")
    if tiers.lm is not None:
        edits.append(Insert("node_lm", [{"node_id": node.node_id, "payload": tiers.lm}]))
        added.add("lm")
    if tiers.kv is not None:
        edits += kv_rows(node.node_id, *tiers.kv)
        added.add("kv")
    if tiers.chunks is not None:
        edits += chunk_rows(node.node_id, tiers.chunks)
        added.add("semantic")
    return edits + [Update("nodes", "node_id", node.node_id, {"keep": keep_text(node.keep | added)})]


def split(held: Held, cut: Split, alphabet: int) -> list[Edit]:
    """The head [0, offset) of a node becomes its own node, parent of the rest. The node's id
    stays with the tail (it names the end of its path); both halves hold their tokens, since
    the head is shared from now on."""
    node, k = held.node, cut.offset
    keep = node.keep | {"tokens"}
    logprobs: np.ndarray | None
    if held.tokens is None:
        if cut.tokens is None or cut.logprobs is None:
            raise ValueError(
                f"node {node.node_id} is held in tier L only: a split must bring its tokens and log-probabilities"
            )
        tokens, logprobs = np.asarray(cut.tokens), np.asarray(cut.logprobs, dtype=np.float32)
    else:
        tokens, logprobs = held.tokens, held.logprobs  # logprobs None: not scored yet, nor will its halves be
    edits: list[Edit] = [
        Delete(table, "node_id", [node.node_id]) for table in ("token_blocks", "token_streams", "node_logprobs")
    ]
    edits += tier_rows(node.node_id, tokens[k:], None if logprobs is None else logprobs[k:], alphabet)
    head = {
        "node_id": cut.head_id,
        "parent_id": node.parent_id,
        "model_id": node.model_id,
        "start": node.start,
        "n_tokens": k,
        "first_token": node.first_token,
        "child_key": child_key(node.parent_id, node.model_id, tokens[:k]),
        "refcount": node.refcount,
        "keep": keep_text(keep),
    }
    edits.append(Insert("nodes", [head]))
    edits += tier_rows(cut.head_id, tokens[:k], None if logprobs is None else logprobs[:k], alphabet)
    if held.kv is not None:
        codebook_id, streams = held.kv
        edits.append(Delete("node_kv", "node_id", [node.node_id]))
        if PAYLOAD in streams:  # an entropy-coded payload cannot be cut: both halves come coded again
            if cut.kv_head is None or cut.kv_tail is None:
                raise ValueError(
                    f"node {node.node_id} keeps entropy-coded tier K: a split must bring both halves re-coded"
                )
            edits += kv_rows(cut.head_id, codebook_id, {PAYLOAD: cut.kv_head})
            edits += kv_rows(node.node_id, codebook_id, {PAYLOAD: cut.kv_tail})
        else:  # token-major streams: the first k positions' columns go to the head
            rows = {size: symbols.reshape(node.n_tokens, -1) for size, symbols in streams.items()}
            edits += kv_rows(cut.head_id, codebook_id, {size: r[:k].reshape(-1) for size, r in rows.items()})
            edits += kv_rows(node.node_id, codebook_id, {size: r[k:].reshape(-1) for size, r in rows.items()})
    if held.chunks:  # a chunk stays with the half that holds its last token
        edits.append(Delete("node_chunks", "node_id", [node.node_id]))
        head_rows = [dict(row, node_id=cut.head_id) for row in held.chunks if row["stop"] <= node.start + k]
        tail_rows = [row for row in held.chunks if row["stop"] > node.start + k]
        edits += [Insert("node_chunks", rows) for rows in (head_rows, tail_rows) if rows]
    edits.append(Delete("node_lm", "node_id", [node.node_id]))
    if "lm" in node.keep:
        if cut.lm_head is None or cut.lm_tail is None:
            raise ValueError(f"node {node.node_id} keeps tier L: a split must bring both halves re-coded")
        edits.append(
            Insert(
                "node_lm",
                [{"node_id": cut.head_id, "payload": cut.lm_head}, {"node_id": node.node_id, "payload": cut.lm_tail}],
            )
        )
    tail = {
        "parent_id": cut.head_id,
        "start": node.start + k,
        "n_tokens": node.n_tokens - k,
        "first_token": int(tokens[k]),
        "child_key": child_key(cut.head_id, node.model_id, tokens[k:]),
        "keep": keep_text(keep),
    }
    edits.append(Update("nodes", "node_id", node.node_id, tail))
    if held.search_run is not None:  # the points stay where they are; the slot run is cut in two
        index_key, first_slot, n_tokens = held.search_run
        edits.append(
            Update("search_ranges", "node_id", node.node_id, {"first_slot": first_slot + k, "n_tokens": n_tokens - k})
        )
        edits.append(
            Insert(
                "search_ranges",
                [{"node_id": cut.head_id, "index_key": index_key, "first_slot": first_slot, "n_tokens": k}],
            )
        )
    return edits


def drop_tiers(node: NodeRow, tiers: set[str]) -> list[Edit]:
    """Search slots become tombstones; the token tier goes with its log-probabilities."""
    edits: list[Edit] = [Update("nodes", "node_id", node.node_id, {"keep": keep_text(node.keep - tiers)})]
    return edits + [Delete(table, "node_id", [node.node_id]) for tier, table in TIER_TABLES if tier in tiers]


def slot_runs(state: IndexState, n_tokens: dict[str, int]) -> list[Edit]:
    """The slot runs of the nodes an index adds (``n_tokens``: their lengths); its state's row is
    the executor's (``sql_apply._index_state``: updated in place where it is recorded)."""
    if not state.ranges:
        return []
    runs = [
        {"node_id": nid, "index_key": state.index_key, "first_slot": first, "n_tokens": n_tokens[nid]}
        for nid, first in state.ranges.items()
    ]
    return [Insert("search_ranges", runs)]


def collect(dead: list[str]) -> list[Edit]:
    """Every row of nodes no session uses, tiers first."""
    return [Delete(table, "node_id", dead) for table in NODE_TABLES + ("nodes",)] if dead else []

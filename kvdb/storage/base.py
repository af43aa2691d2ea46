"""What storage hands out and takes: the rows :class:`kvdb.storage.sql.Storage` reads, and the
plans (a :class:`SessionWrite` or one of the edit plans below) its ``apply`` applies all or
nothing. What a plan does to the trie (cutting a node, dropping tiers) is decided once, in
:mod:`kvdb.storage.edits`; the engine only runs the row edits in one transaction.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

# Services let the lock go before long work (a model's forward pass, a build), and before short
# work too once a hold has lasted this long: other processes then wait about a second at most,
# and a stream of short calls does not pay a reconnect (~30 ms) each.
HOLD_SECONDS = 1.0


def utc_now() -> dt.datetime:
    """Rows carry UTC times without a zone (DuckDB's TIMESTAMP)."""
    return dt.datetime.now(dt.UTC).replace(tzinfo=None)


# rows ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelRow:
    """What an archive records about the model its sessions were computed with."""

    model_id: str  # hash of weights_hash and tokenizer_hash: the same weights under another name match
    name: str
    weights_hash: str
    tokenizer_hash: str
    config: dict


@dataclass(frozen=True)
class CodebookRow:
    """A codebook set as listed: the stored blob only when it is small (a reference to shipped
    codebooks, kvdb.services.shipped_codebooks); trained centroids stay in the store."""

    codebook_id: str
    model_id: str
    preset: str
    created_at: dt.datetime
    stored_bytes: int
    small_blob: bytes | None


@dataclass(frozen=True)
class SessionRow:
    session_id: str
    name: str
    source: str
    model_id: str
    created_at: dt.datetime
    n_tokens: int
    metadata: dict
    conversation_id: str = ""  # the conversation it is a state of (kvdb.storage.conversation_rows); "" in a row not written yet


@dataclass(frozen=True)
class WatchedFileRow:
    """What `kvdb watch` last archived of a file: its size and modification time then."""

    path: str
    size: int
    mtime_ns: int
    checked_at: dt.datetime
    status: str
    detail: str | None = None


@dataclass(frozen=True)
class NodeRow:
    node_id: str
    parent_id: str | None
    model_id: str
    start: int
    n_tokens: int
    first_token: int
    refcount: int
    keep: frozenset[str] = frozenset()  # tiers held: "tokens", "search", "lm", "kv"

    @property
    def end(self) -> int:
        return self.start + self.n_tokens


@dataclass(frozen=True)
class IndexState:
    """What the database says the sidecar index of one tokenizer must hold."""

    index_key: str
    alphabet: int
    depth: int
    ntotal: int
    generation: int
    ranges: dict[str, int]  # node_id -> first slot, for the nodes this commit adds (or all, on rebuild)


# plans ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Split:
    """Node ``node_id`` keeps its tokens from ``offset`` on; the new node ``head_id`` takes the rest."""

    node_id: str
    head_id: str
    offset: int
    lm_head: bytes | None = None  # tier L payloads of the two halves, re-coded, when the node has one
    lm_tail: bytes | None = None
    tokens: np.ndarray | None = None  # the node's tokens (decoded from tier L) and log-probabilities (scored
    logprobs: np.ndarray | None = None  # again), when it is held in tier L only
    kv_head: np.ndarray | None = None  # entropy-coded tier K payloads of the two halves, re-coded, when the node has one
    kv_tail: np.ndarray | None = None


@dataclass(frozen=True)
class Chunks:
    """A node's semantic tier: the spans [start, stop) on the path of the chunks whose last token
    it holds, and each chunk's unit embedding (one row of ``vectors``) by ``embedder``."""

    embedder: str
    spans: list[tuple[int, int]]
    vectors: np.ndarray


@dataclass(frozen=True)
class NewNode:
    node_id: str
    parent_id: str | None
    start: int
    tokens: np.ndarray
    logprobs: np.ndarray
    keep: frozenset[str]  # no default: which tiers a node holds is always the caller's decision
    lm: bytes | None = None
    kv: tuple[str, dict[int, np.ndarray]] | None = None  # (codebook_id, {codebook size: token-major codes})
    chunks: Chunks | None = None


@dataclass(frozen=True)
class SessionWrite:
    """Everything one ingested session changes, applied in one transaction."""

    session: SessionRow
    alphabet: int
    split: Split | None = None
    node: NewNode | None = None
    index: IndexState | None = None
    # Nodes on the session's path held in tier L only get their tokens and log-probabilities back
    # (node id -> both) from the new session's own: a node two sessions share keeps its tokens.
    tokens_back: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    conversation: str | None = None  # the conversation it continues, when its writer knows (a server's chat); else the rule decides


@dataclass(frozen=True)
class PutModel:
    row: ModelRow


@dataclass(frozen=True)
class PutCodebooks:
    codebook_id: str
    model_id: str
    preset: str
    data: bytes


@dataclass(frozen=True)
class DeleteSession:
    """Uncount the session on its path; nodes no session uses wait for ``CollectGarbage``."""

    session_id: str


@dataclass(frozen=True)
class DeleteConversation:
    """Every session of a conversation, as ``DeleteSession`` each, and the conversation."""

    conversation_id: str


@dataclass(frozen=True)
class RenameConversation:
    """``title`` None: named by its latest session again."""

    conversation_id: str
    title: str | None


@dataclass(frozen=True)
class PutWatchedFiles:
    """Record files as `kvdb watch` last archived them (replacing their earlier rows)."""

    rows: list[WatchedFileRow]


@dataclass(frozen=True)
class CollectGarbage:
    """Delete the nodes no session uses, with every tier stored for them."""


@dataclass(frozen=True)
class DropTiers:
    """Drop tiers from nodes (node id -> tiers), give nodes held in tier L only their tokens and
    log-probabilities back (node id -> both), and replace tier-L payloads re-coded (a node about
    to be held in tier L alone gets the portable version), in one transaction."""

    drops: dict[str, set[str]]
    tokens_back: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    recoded: dict[str, bytes] = field(default_factory=dict)  # node id -> a tier-L payload replacing the stored one


@dataclass(frozen=True)
class NodeTiers:
    """Tiers an existing node is given; a field left None is a tier it is not given."""

    tokens: tuple[np.ndarray, np.ndarray] | None = None  # its tokens and log-probabilities (a node held in tier L only)
    lm: bytes | None = None
    kv: tuple[str, dict[int, np.ndarray]] | None = None  # (codebook_id, {codebook size: token-major codes})
    chunks: Chunks | None = None


@dataclass(frozen=True)
class AddTiers:
    """Give existing nodes tiers they lack (node id -> what each is given), in one transaction: a
    session archived before with fewer tiers than it is ingested with now, or a shared prefix a new
    session runs through. The search tier comes as ``index``, the search sidecar's new state, whose
    ``ranges`` are the slot runs of the nodes that join it (the caller saved the sidecar first)."""

    nodes: dict[str, NodeTiers]
    index: IndexState | None = None


@dataclass(frozen=True)
class ReplaceIndexState:
    """After a rebuild: the new generation and every node's slots."""

    state: IndexState


@dataclass(frozen=True)
class ImportRows:
    """Every row of another archive into an empty one (``kvdb copy``): table name -> the rows,
    read while the one transaction runs, so that a copy lands whole or not at all."""

    tables: dict[str, Iterable[dict]]


Plan = (
    SessionWrite
    | PutModel
    | PutCodebooks
    | DeleteSession
    | DeleteConversation
    | RenameConversation
    | PutWatchedFiles
    | CollectGarbage
    | DropTiers
    | AddTiers
    | ReplaceIndexState
    | ImportRows
)

"""What storage hands out and takes: the rows :class:`kvdb.storage.sql.Storage` reads, and the
plans (a :class:`SessionWrite` or one of the edit plans below) its ``apply`` applies all or
nothing. What a plan does to the trie (cutting a node, dropping tiers) is decided once, in
:mod:`kvdb.storage.edits`; the engine only runs the row edits in one transaction.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import NamedTuple

import numpy as np

# Services let the lock go before long work (a model's forward pass, a build), and before short
# work too once a hold has lasted this long: other processes then wait about a second at most,
# and a stream of short calls does not pay a reconnect each (decision 0012).
HOLD_SECONDS = 1.0
# ... or this many times as long as the file's last let-go took, when longer: DuckDB writes its log
# into the file then, and rewrites the last row group of each table written to, which grows with
# the archive: a backfill then spends a small share of its time on it, not a growing one (decision 0061).
HOLD_PER_LET_GO = 10


def hold_seconds(let_go: float) -> float:
    """How long a hold lasts before short work lets go, after a let-go that took ``let_go`` s."""
    return 0.0 if HOLD_SECONDS == 0 else max(HOLD_SECONDS, HOLD_PER_LET_GO * let_go)


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
    # the conversation it is a state of (kvdb.storage.conversation_rows); "" in a row not written yet
    conversation_id: str = ""


class TrieShape(NamedTuple):
    """The trie as a search's view of it reads it (``kvdb.index.trie.TrieView``), in columns: a
    row object per node and per session took 0.2 s of a fresh search at 1e8 tokens (55k nodes,
    51k sessions). The nodes are those that hold a token stream."""

    node_id: list[str]
    parent_id: list[str]  # "" at a root
    start: list[int]
    end: list[int]
    keep: list[frozenset[str]]  # tiers held, as ``NodeRow.keep``
    alphabet: list[int]  # of the node's token stream
    block_size: list[int]
    session_id: list[str]  # the sessions, oldest first (ties by id), each its path's leaf
    name: list[str]
    conversation_id: list[str]


# What a session says of itself, read from its row (``kvdb.records.Session`` shows them): defined
# here once, so that the conversations table's columns that listing filters by (kvdb.storage.
# conversation_rows) hold what a session record says.
def agent_of(metadata: dict) -> str | None:
    """What wrote it: the transcript's format."""
    found = metadata.get("format")
    return found if isinstance(found, str) else None


def cwd_of(metadata: dict) -> str | None:
    """The working directory its log records."""
    return str(metadata["cwd"]) if metadata.get("cwd") else None


def folder_of(source: str) -> str | None:
    """Its file's folder; None for text or messages given directly (``<text>``, ``<messages>``)."""
    return None if source.startswith("<") else str(PurePath(source).parent)


def said_at_of(created_at: dt.datetime, metadata: dict) -> dt.datetime:
    """When it was said: the latest time its log records (``kvdb.transcripts.stamps``), else when
    it was archived (a chat, a file with no times)."""
    return stamp(metadata.get("ended"), created_at)


def started_at_of(created_at: dt.datetime, metadata: dict) -> dt.datetime:
    """When it began: the earliest time its log or export records (``said_at_of``'s twin), else
    when it was archived."""
    return stamp(metadata.get("started"), created_at)


def stamp(value, otherwise: dt.datetime) -> dt.datetime:
    """A time ``kvdb.transcripts.stamps`` wrote, else ``otherwise`` (a listing reads the text of
    one in SQL, without the rest of its metadata)."""
    try:
        return dt.datetime.fromisoformat(value) if isinstance(value, str) else otherwise
    except ValueError:  # not written by kvdb.transcripts.stamps
        return otherwise


@dataclass(frozen=True)
class ConversationFilter:
    """Which conversations a listing or a search keeps: ``agent`` its first version's format,
    ``project`` its folder or a folder it is inside, ``since`` and ``until`` (both included) the
    day its latest version was said."""

    agent: str | None = None
    project: str | None = None
    since: dt.date | None = None
    until: dt.date | None = None

    @property
    def admits_all(self) -> bool:
        return self.agent is None and self.project is None and self.since is None and self.until is None


@dataclass(frozen=True)
class ConversationRow:
    """A conversation as a listing shows it, summed up from its versions as they are read
    (kvdb.storage.conversation_rows.listed), by the rules kvdb.services.conversations gives."""

    latest: SessionRow  # its latest version
    title: str  # the user's, else the latest its versions' files give, else its first version's name
    started_at: dt.datetime  # when its first version began (``started_at_of``)
    versions: int
    branches: int  # versions that are an end of it: no session extends them, no later part goes on from them
    agent: str | None
    project: str | None


@dataclass(frozen=True)
class ConversationRows:
    """A page of the conversations a filter admits, the most recently updated first."""

    conversations: list[ConversationRow]
    total: int  # every conversation the filter admits, this page's and the others'


@dataclass(frozen=True)
class WatchedFileRow:
    """What `kvdb watch` last archived of a file: its size and modification time then."""

    path: str
    size: int
    mtime_ns: int
    checked_at: dt.datetime
    status: str
    detail: str | None = None


# A session read from one record of a file (a JSON Lines export) records its source as FILE#L12
# (kvdb.transcripts.files): the file is its source without this, in Python and in DuckDB alike.
RECORD_LINE = r"#L[0-9]+$"

# A node is found among its parent's children by its first tokens, this many: the key
# ``child_key`` gives its row. The trie cuts a node only where this many tokens are shared
# (``trie.MIN_SPLIT``), so at most one child shares them all with a new stream, and a walk reads
# that child, and those keyed by their first token alone, where it read every child that opens
# with the same token: a thousand at a node every agent log passes through (decision 0066).
HEAD_TOKENS = 8


def child_key(parent_id: str | None, model_id: str, tokens: np.ndarray) -> str:
    """``nodes.child_key`` of a node under ``parent_id`` (None: a root of ``model_id``) that
    holds ``tokens`` (its first ``HEAD_TOKENS`` at least): those first tokens, or the first
    alone in a shorter node. A lookup then asks two keys, not one a length: DuckDB 1.5.5 makes
    an ``in`` list of five or more a join, at twice the time. Migration 0014 gave the nodes
    before it the key of their first token alone too."""
    head = tokens[:HEAD_TOKENS] if len(tokens) >= HEAD_TOKENS else tokens[:1]
    return f"{parent_id or model_id}:{','.join(str(int(t)) for t in head)}"


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
    # entropy-coded tier K payloads of the two halves, re-coded, when the node has one
    kv_head: np.ndarray | None = None
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
    logprobs: np.ndarray | None  # None: the model has not scored them yet (the session's ``pending_work``)
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
    # the conversation it continues, when its writer knows (a server's chat); else the rule decides
    conversation: str | None = None
    # work left for `kvdb upkeep` ("semantic"); "logprobs" is queued wherever its path holds unscored tokens
    queued: tuple[str, ...] = ()
    # The session's trie path (node ids, root first) as planned, with the split and the new node: the
    # write is made on the snapshot the plan read (``based_on``), so the path stands. Empty: read it.
    path: tuple[str, ...] = ()


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
    done: tuple[str, str] | None = None  # (session id, work): queued work these tiers were, off the queue with them


@dataclass(frozen=True)
class Queue:
    """Queue ``work`` for these sessions (where it is not queued already)."""

    session_ids: list[str]
    work: str


@dataclass(frozen=True)
class Dequeue:
    """Take ``work`` off the queue for these session ids (which may be deleted already)."""

    session_ids: list[str]
    work: str


@dataclass(frozen=True)
class PutLogprobs:
    """The model's pass over a queued session: log-probabilities of the nodes on its path that had
    none (node id -> one per token), and the session taken off the queue. A node another pass
    scored meanwhile keeps what it has."""

    session_id: str
    logprobs: dict[str, np.ndarray]


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
    | PutLogprobs
    | Queue
    | Dequeue
    | ReplaceIndexState
    | ImportRows
)

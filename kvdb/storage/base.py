"""What every storage backend is: the rows it hands out, the plans it applies, and the protocol.

The services above never see an engine, a connection or a file. They read rows through the
methods of :class:`Storage`, describe every change as a plan (a :class:`SessionWrite` or one
of the edit plans below) and hand it to ``apply``, which applies it all or nothing. What a
plan does to the trie (cutting a node, dropping tiers) is decided once, backend-neutrally, in
:mod:`kvdb.storage.edits`; a backend only runs the row edits in one transaction.

Three things differ between engines and live behind the protocol too: ``version()``, a value
that moves whenever anything this process cached from the storage may be stale; ``release()``,
which hands the engine's lock back while the model works; and ``derived_path()``, where files
derived from the archive (search sidecars, the prefix cache) are kept.
"""

from __future__ import annotations

import abc
import contextlib
import datetime as dt
import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvdb.errors import ArchiveError

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


Plan = SessionWrite | PutModel | PutCodebooks | DeleteSession | CollectGarbage | DropTiers | AddTiers | ReplaceIndexState | ImportRows


# the protocol --------------------------------------------------------------------------------


class Storage(abc.ABC):
    """One open archive. Reads return rows; every change is a plan given to :meth:`apply`.

    The contract suite (tests/storage/test_contract.py) runs against every backend.
    """

    read_only: bool

    # lifecycle
    @abc.abstractmethod
    def close(self) -> None: ...

    @abc.abstractmethod
    def version(self) -> object:
        """A value that changes whenever what this process read may be stale: after its own
        writes, and after any other process may have written."""

    @abc.abstractmethod
    def release(self) -> None:
        """Hand back the engine's lock (if it has one) until the next call needs it."""

    @abc.abstractmethod
    def held_for(self) -> float:
        """Seconds the current hold of the lock has lasted (0 when not held)."""

    def before_compute(self, short: bool = False) -> None:
        """The one place a service's work decides about the lock: about to compute without the
        file (a forward pass, a model load, a build), hand the lock back, unless the work is
        ``short`` and the hold fresh (see HOLD_SECONDS)."""
        if not short or self.held_for() >= HOLD_SECONDS:
            self.release()

    @abc.abstractmethod
    def writable(self) -> contextlib.AbstractContextManager:
        """Write access for one repair of derived data, even when opened read-only."""

    claims_inputs = False  # whether workers on other machines may share its input files, which are then claimed

    def claim(self, key: str, owner: str, lease_seconds: float, steal_from: str | None = None) -> str | None:
        """Take (or renew) the claim on ``key`` (an input file) for ``owner`` until the lease
        ends: None when taken, else the owner who holds it (unless it is ``steal_from``, known
        dead). Where workers on many machines share one input folder, this is how each file
        goes to one of them; a backend of one machine (``claims_inputs`` False) has none."""
        raise NotImplementedError(f"{type(self).__name__} does not claim input files")

    def release_claim(self, key: str, owner: str) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not claim input files")

    @abc.abstractmethod
    def compact_files(self) -> dict:
        """Merge the engine's small files (a lake's commits leave some Parquet files each, which
        every scan opens) and delete those no snapshot in use reads; what it did, in counts."""

    @abc.abstractmethod
    def derived_path(self, suffix: str) -> Path:
        """Where a file or folder derived from the archive lives (".index", ".prefix")."""

    @abc.abstractmethod
    def footprint(self) -> int:
        """Bytes the engine takes on disk for the tables (pages and overhead included)."""

    @abc.abstractmethod
    def describe(self) -> str:
        """The archive's location, as error messages name it."""

    def check_writable(self) -> None:
        if self.read_only:
            raise ArchiveError(f"archive {self.describe()} is open read-only; open it without read_only=True to change it")

    # writes
    @abc.abstractmethod
    def apply(self, plan: Plan, based_on=None) -> dict | None:
        """Apply a plan all or nothing; ``CollectGarbage`` returns what it freed. ``based_on``:
        the ``version()`` the plan was made at; if anything was committed since, the plan is
        refused with ``StaleWrite`` (make it again), however the engine admits writers."""

    # models and codebooks
    @abc.abstractmethod
    def get_model(self, model_id: str) -> ModelRow | None: ...

    @abc.abstractmethod
    def model_ids_with_tokenizer(self, tokenizer_hash: str) -> list[str]: ...

    @abc.abstractmethod
    def tokenizer_hashes(self) -> list[str]: ...

    @abc.abstractmethod
    def codebooks_for(self, model_id: str) -> tuple[str, bytes] | None:
        """The newest codebook set trained for a model: (codebook_id, serialized codebooks)."""

    @abc.abstractmethod
    def codebook_data(self, codebook_id: str) -> bytes: ...

    @abc.abstractmethod
    def codebook_rows(self) -> list[CodebookRow]:
        """Every codebook set, oldest first."""

    # sessions
    @abc.abstractmethod
    def has_session(self, session_id: str) -> bool: ...

    @abc.abstractmethod
    def get_session(self, session_id: str) -> SessionRow | None: ...

    @abc.abstractmethod
    def list_sessions(self) -> list[SessionRow]:
        """Oldest first (ties by id)."""

    @abc.abstractmethod
    def match_sessions(self, ref: str) -> list[SessionRow]:
        """Sessions whose id starts with ``ref`` or whose name equals it."""

    # the trie
    @abc.abstractmethod
    def children(self, parent_id: str | None, model_id: str, first_token: int) -> list[NodeRow]: ...

    @abc.abstractmethod
    def node_path(self, node_id: str) -> list[NodeRow]:
        """The nodes from the root down to ``node_id`` (a session id names its leaf)."""

    @abc.abstractmethod
    def nodes_of(self, model_ids: list[str]) -> list[NodeRow]:
        """Every node of these models (unused ones too, until gc), parents before children."""

    @abc.abstractmethod
    def shared_nodes(self) -> list[NodeRow]:
        """Nodes on the paths of two or more sessions, shortest first."""

    @abc.abstractmethod
    def node_shapes(self) -> list[tuple[NodeRow, int, int]]:
        """Every node with its token stream's alphabet and block size."""

    # tiers
    @abc.abstractmethod
    def node_tokens(self, node_id: str, start: int = 0, end: int | None = None) -> np.ndarray: ...

    @abc.abstractmethod
    def path_tokens(self, path: list[NodeRow], start: int = 0, end: int | None = None) -> np.ndarray:
        """Token ids [start, end) along a node path the caller has read already."""

    def load_tokens(self, session_id: str, start: int = 0, end: int | None = None) -> np.ndarray:
        return self.path_tokens(self.node_path(session_id), start, end)

    @abc.abstractmethod
    def nodes_tokens(self, node_ids: list[str]) -> dict[str, np.ndarray]:
        """Whole nodes' token ids, read together (an index built or caught up reads many)."""

    @abc.abstractmethod
    def load_blocks(self, wanted: list[tuple[str, int]]) -> dict[tuple[str, int], bytes]:
        """Token blocks by (node_id, block_no)."""

    @abc.abstractmethod
    def load_logprobs(self, session_id: str) -> np.ndarray: ...

    @abc.abstractmethod
    def logprob_lengths(self) -> dict[str, int]: ...

    @abc.abstractmethod
    def max_alphabet(self, model_ids: list[str]) -> int: ...

    @abc.abstractmethod
    def node_lm_payload(self, node_id: str) -> bytes | None: ...

    @abc.abstractmethod
    def node_kv(self, node_id: str) -> tuple[str, dict[int, np.ndarray]] | None:
        """(codebook_id, {codebook size: token-major code symbols}) of a node, or None."""

    # search index bookkeeping
    @abc.abstractmethod
    def index_state(self, index_key: str, from_slot: int = 0) -> IndexState | None:
        """The index's row, with the slot runs that begin at ``from_slot`` or later in ``ranges``
        (a reader catching up reads only the runs it lacks)."""

    @abc.abstractmethod
    def index_generation(self, index_key: str) -> tuple[int, int] | None: ...

    @abc.abstractmethod
    def index_keys(self) -> list[str]: ...

    @abc.abstractmethod
    def slot_runs(self, index_key: str) -> list[tuple[str, int, int, int]]:
        """(node_id, first_slot, n_tokens, node start) of every live node in an index."""

    # checks and accounting
    @abc.abstractmethod
    def stored_blobs(self, tier: str, sample: int | None = None) -> Iterator[tuple[str, int, bytes]]:
        """(owner id, part, bytes) of every stored blob of a tier, or an evenly spread sample."""

    @abc.abstractmethod
    def dangling_references(self) -> list[tuple[str, str, str, str]]:
        """(what refers, its id, what it names, the missing id)."""

    @abc.abstractmethod
    def table_rows(self, table: str) -> Iterator[dict]:
        """Every row of one of the schema's tables, in the order of its columns' values: the
        same rows read the same way from any backend."""

    def content_hashes(self) -> dict[str, str]:
        """Each table's SHA-256 over its rows in that order: equal on two archives exactly
        when they hold the same rows."""
        from kvdb.storage import schema

        out = {}
        for table in schema.metadata.sorted_tables:
            digest = hashlib.sha256()
            for row in self.table_rows(table.name):
                digest.update(repr(sorted(row.items())).encode())
            out[table.name] = digest.hexdigest()
        return out

    @abc.abstractmethod
    def data_file_problems(self) -> list[str]:
        """The files holding the archive's rows that are missing or damaged, each named, for a
        backend whose rows live in files of their own (a lake's Parquet files)."""

    @abc.abstractmethod
    def byte_counts(self) -> dict[str, int]:
        """Payload bytes stored per tier, and tokens archived."""

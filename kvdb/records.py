"""What the library hands back. ``to_dict()`` is the one shape of each: the CLI's ``--json``
lines and the server's bodies are these dictionaries."""

from __future__ import annotations

import datetime as dt
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from typing import TYPE_CHECKING, Any, ClassVar, Self

import numpy as np

from kvdb.index.phrase import Hit
from kvdb.storage.base import SessionRow, agent_of, cwd_of, folder_of, said_at_of, started_at_of
from kvdb.tiers import RestoreMode, Tier

if TYPE_CHECKING:
    from transformers import DynamicCache


@dataclass(frozen=True)
class Session:
    session_id: str
    name: str
    source: str
    n_tokens: int
    created_at: dt.datetime
    model_id: str
    metadata: dict = field(repr=False)
    conversation_id: str = field(default="", kw_only=True)  # the conversation it is a version of

    @classmethod
    def from_row(cls, row: SessionRow, **extra) -> Self:
        """``extra``: the fields a subclass adds (what was done to the session)."""
        return cls(
            row.session_id,
            row.name,
            row.source,
            row.n_tokens,
            row.created_at,
            row.model_id,
            row.metadata,
            conversation_id=row.conversation_id,
            **extra,
        )

    def __eq__(self, other: object) -> bool:
        """By value, whatever the subclass: a session handle equals the record it stands for."""
        if not isinstance(other, Session):
            return NotImplemented
        return all(getattr(self, f.name) == getattr(other, f.name) for f in fields(Session) if f.compare)

    @property
    def side(self) -> dict:
        """The text of its file that is no turn (a title, summaries, tool schemas, ...): see
        ``kvdb.transcripts.Transcript``; ``{}`` for most sessions."""
        return self.metadata.get("side", {})

    @property
    def agent(self) -> str | None:
        """What wrote it: the transcript's format (``claude-code``, ``chatgpt``, ``messages`` for a
        server's chat, ...)."""
        return agent_of(self.metadata)

    @property
    def project(self) -> str | None:
        """The folder it was about: the working directory its log records, else its file's folder."""
        return cwd_of(self.metadata) or folder_of(self.source)

    @property
    def title(self) -> str:
        """What lists, hits and the page call it: the title its file gives it (an agent's summary,
        else its first prompt, ``metadata["title"]``), else its name (an export's title, a file's
        name). The name stays what references use."""
        title = self.metadata.get("title")
        return title if isinstance(title, str) and title else self.name

    @property
    def said_at(self) -> dt.datetime:
        """When it was said: the latest time its log records (``kvdb.transcripts.stamps``), else
        when it was archived (a chat, a file with no times)."""
        return said_at_of(self.created_at, self.metadata)

    @property
    def started_at(self) -> dt.datetime:
        """When it began: the earliest time its log or export records (``said_at``'s twin), else
        when it was archived."""
        return started_at_of(self.created_at, self.metadata)

    @property
    def part(self) -> dict | None:
        """Where it is one part of a session longer than the model's context: ``number`` (from 1),
        the session it ``follows`` and the token it ``starts`` at in the whole; None for a whole one."""
        return self.metadata.get("part")

    @property
    def upstream(self) -> dict | None:
        """For an exchange ``kvdb serve --upstream`` relayed: ``{"model", "same_model"}``, the
        model the upstream server named in its reply, and whether it is the archive's own. When
        it is not, the tokens are the archive's tokenizer's over the exact text, and no KV was
        stored. None for every other session."""
        upstream = self.metadata.get("upstream")
        return dict(upstream) if isinstance(upstream, dict) else None

    def to_dict(self) -> dict:
        return {
            "session_id": self.session_id,
            "name": self.name,
            "source": self.source,
            "n_tokens": self.n_tokens,
            "created_at": self.created_at.isoformat(),
            "said_at": self.said_at.isoformat(),
            "conversation_id": self.conversation_id,
            "part": self.part,
            "upstream": self.upstream,
        }


class SessionChange(StrEnum):
    DELETED = "deleted"
    COMPACTED = "compacted"


@dataclass(frozen=True, eq=False)  # Session's equality: the record equals the session it was
class Deleted(Session):
    """A session ``delete`` removed, as it was."""

    status: ClassVar[SessionChange] = SessionChange.DELETED

    def to_dict(self) -> dict:
        return {"session_id": self.session_id, "name": self.name, "status": self.status.value}


@dataclass(frozen=True, eq=False)
class Compacted(Session):
    """A session ``compact`` left with the tiers ``keep`` (in the order of ``Tier``)."""

    keep: tuple[Tier, ...] = field(kw_only=True)
    status: ClassVar[SessionChange] = SessionChange.COMPACTED

    def to_dict(self) -> dict:
        return {
            "session_id": self.session_id,
            "name": self.name,
            "keep": ",".join(self.keep),
            "status": self.status.value,
        }


class IngestStatus(StrEnum):
    INGESTED = "ingested"
    UPDATED = "updated"  # archived before; tiers added
    UNCHANGED = "unchanged"
    FAILED = "failed"
    EMPTY = "empty"  # a file with nothing to archive (no text; a log of summaries alone): not a failure
    CLAIMED = "claimed"  # by another worker
    WAITING = "waiting"  # `kvdb watch`: a log whose last line is still being written, archived when it ends


@dataclass(frozen=True)
class IngestResult:
    session_id: str | None
    name: str
    source: str
    n_tokens: int
    status: IngestStatus  # a name given as a plain string is taken as its member
    error: str | None = None
    new_tokens: int = 0  # tokens stored (and computed) anew: the rest was a prefix archived already
    seconds: float = 0.0
    added: tuple[str, ...] = ()  # "updated": the tiers its path was given, which it was archived without
    # kind -> parts of the transcript kept only as a "[KIND not archived]" placeholder
    dropped: dict = field(default_factory=dict)
    claimed_by: str | None = None  # "claimed": the worker (host:pid) archiving the file meanwhile
    skipped: tuple[dict, ...] = ()  # the file's first result: its malformed records left out, each {"line", "reason"}
    part: int | None = None  # which part (from 1) of a session longer than the model's context (``Session.part``)

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", IngestStatus(self.status))
        object.__setattr__(self, "skipped", tuple(self.skipped))

    def to_dict(self) -> dict:
        out: dict[str, Any] = {
            "session_id": self.session_id,
            "name": self.name,
            "source": self.source,
            "n_tokens": self.n_tokens,
            "status": self.status.value,
        }
        if self.status == "ingested":
            out.update(new_tokens=self.new_tokens, seconds=round(self.seconds, 4))
        if self.status == "updated":
            out.update(added=list(self.added), seconds=round(self.seconds, 4))
        if self.part is not None:
            out["part"] = self.part
        if self.dropped:
            out["dropped"] = dict(self.dropped)
        if self.claimed_by is not None:
            out["claimed_by"] = self.claimed_by
        if self.skipped:
            out["skipped"] = [dict(s) for s in self.skipped]
        if self.error is not None:
            out["error"] = self.error
        return out


class CodebookSource(StrEnum):
    TRAINED = "trained"
    SHIPPED = "shipped"


@dataclass(frozen=True)
class CodebookSet:
    """Tier K codebooks an archive holds or references. ``source`` "trained" (`kvdb codebooks
    train`: the centroids are in the archive) or "shipped" (kvdb.services.shipped_codebooks: the archive holds a
    reference of ``stored_bytes``; the ``centroid_bytes`` live in this machine's cache, shared
    by every archive of the model, and ``on_this_machine`` says whether they are built here)."""

    codebook_id: str
    model_id: str
    preset: str
    created_at: dt.datetime
    source: CodebookSource
    stored_bytes: int
    centroid_bytes: int
    on_this_machine: bool

    def __post_init__(self) -> None:
        object.__setattr__(self, "source", CodebookSource(self.source))

    def to_dict(self) -> dict:
        return dict(
            asdict(self), created_at=self.created_at.isoformat() if self.created_at else None, source=self.source.value
        )


@dataclass(frozen=True)
class PhraseCount:
    """How many archived positions end a full match of a phrase (any of the casings searched),
    each counted once however many sessions share it."""

    phrase: str
    count: int
    case_sensitive: bool
    session: str | None = None

    def to_dict(self) -> dict:
        return {
            "phrase": self.phrase,
            "count": self.count,
            "case_sensitive": self.case_sensitive,
            "session": self.session,
        }


@dataclass(frozen=True)
class MeaningHit(Hit):
    """A hit by meaning (``search_meaning``): its chunk's span and text as a phrase hit's
    (``position``, ``match_tokens``, ``match``), and its score, the fusion of what it was found
    by, on one scale for every query and list (decision 0058): ``cosine`` to the query, the share
    of the query's word weight its chunk holds (``words``) and its conversation holds
    (``session_words``). ``weak``: the score is under the cut-off (``semantic_tier.WEAK_BELOW``),
    below which most top hits on the set it was chosen on answered nothing; shown, marked."""

    cosine: float = 0.0
    words: float = 0.0
    session_words: float = 0.0
    weak: bool = False

    def to_dict(self) -> dict:
        return {
            **super().to_dict(),
            "weak": self.weak,
            "cosine": round(self.cosine, 4),
            "words": round(self.words, 4),
            "session_words": round(self.session_words, 4),
        }


@dataclass(frozen=True)
class Queued:
    """Sessions some work waits for, and their tokens."""

    sessions: int = 0
    tokens: int = 0


@dataclass(frozen=True)
class Pending:
    """The work an ingest leaves for ``kvdb upkeep`` (and the idle time of watch and serve):
    ``logprobs``, the language model's pass (log-probabilities for d_T, exact caches warmed);
    ``semantic``, the embedder's (search by meaning covers a session once it is done)."""

    logprobs: Queued = field(default_factory=Queued)
    semantic: Queued = field(default_factory=Queued)

    @classmethod
    def from_counts(cls, counts: dict[str, tuple[int, int]]) -> Pending:
        return cls(*(Queued(*counts.get(work, (0, 0))) for work in ("logprobs", "semantic")))

    @property
    def tokens(self) -> int:
        return self.logprobs.tokens + self.semantic.tokens

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class UpkeepReport:
    """What one ``kvdb upkeep`` run did: sessions embedded and scored (their tokens), caches kept, and what is left."""

    embedded: Queued
    scored: Queued
    cached: int
    seconds: float
    pending: Pending

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Stats:
    sessions: int
    tokens: int  # summed over sessions
    stored_tokens: int  # stored once, after prefix sharing
    nodes: int
    bytes: dict
    bytes_per_token: dict
    kv_ratio_vs_fp16: float | None = None  # fp16 KV bytes/token of the model / bytes_per_token["kv"]
    codebook_bytes: int = 0  # stored in the archive
    shipped_codebook_bytes: int = 0  # referenced: in this machine's cache, shared by every archive of the model
    # tier K bytes per preset: its name where it has one, else its spec
    kv_bytes_by_preset: dict = field(default_factory=dict)
    pending: Pending = field(default_factory=Pending)  # the model's work queued by ingests that ran without it

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Conversation:
    """A conversation, as its latest state: the sessions it grew through and its forks are its
    versions (``Archive.conversation`` lists them)."""

    conversation_id: str
    # the user's (``rename``), else the latest its versions' files give (``Session.title``), else its first
    # version's name
    title: str
    latest: Session
    created_at: dt.datetime  # when its first version began (``Session.started_at``: its file's time where it has one)
    versions: int
    branches: int  # versions no other version extends
    agent: str | None  # its first version's (``Session.agent``): a fork a server archives as text stays its agent's
    project: str | None

    def to_dict(self) -> dict:
        return self.latest.to_dict() | {
            "conversation_id": self.conversation_id,
            "title": self.title,
            "created_at": self.created_at.isoformat(),
            # its file's last time where it has one, not when it was archived
            "updated_at": self.latest.said_at.isoformat(),
            "versions": self.versions,
            "branches": self.branches,
            "agent": self.agent,
            "project": self.project,
        }


@dataclass(frozen=True)
class ConversationPage:
    """A page of a conversation listing: ``total`` is how many conversations the filters admit,
    so that a client knows whether to ask for the page from ``next_offset``."""

    conversations: list[Conversation]
    total: int
    offset: int

    def to_dict(self) -> dict:
        out: dict[str, Any] = {"conversations": [c.to_dict() for c in self.conversations], "total": self.total}
        if self.offset + len(self.conversations) < self.total:
            out["next_offset"] = self.offset + len(self.conversations)
        return out


@dataclass(frozen=True)
class Version:
    """One stored state of a conversation. A version that does not extend the earlier version it
    shares most with forks from it: ``branch_of`` it, after ``forked_at`` tokens."""

    session: Session
    number: int  # 1: the oldest
    latest: bool
    leaf: bool  # no other version extends it
    branch_of: str | None
    forked_at: int | None

    def to_dict(self) -> dict:
        return {
            "session_id": self.session.session_id,
            "version": self.number,
            "n_tokens": self.session.n_tokens,
            "created_at": self.session.created_at.isoformat(),
            "latest": self.latest,
            "leaf": self.leaf,
            "branch_of": self.branch_of,
            "forked_at": self.forked_at,
            "part": self.session.part,
        }


@dataclass(frozen=True)
class ConversationHistory:
    conversation: Conversation
    versions: list[Version]

    def to_dict(self) -> dict:
        return self.conversation.to_dict() | {"history": [v.to_dict() for v in self.versions]}


@dataclass(frozen=True)
class DeletedConversation:
    conversation: Conversation
    sessions: int

    def to_dict(self) -> dict:
        return {"deleted": self.conversation.to_dict(), "sessions": self.sessions}


@dataclass(frozen=True)
class DeletedSource:
    """What ``delete_source`` removed: every session archived from one file."""

    source: str
    sessions: int
    conversations: int

    def to_dict(self) -> dict:
        return {"source": self.source, "sessions": self.sessions, "conversations": self.conversations}


@dataclass(frozen=True)
class WatchedFile:
    """A file `kvdb watch` follows, as it last archived it."""

    path: str
    size: int
    modified: dt.datetime
    checked_at: dt.datetime
    status: str  # an IngestStatus's value
    detail: str | None

    def to_dict(self) -> dict:
        return {
            "path": self.path,
            "size": self.size,
            "modified": self.modified.isoformat(),
            "checked_at": self.checked_at.isoformat(),
            "status": self.status,
            "detail": self.detail,
        }


@dataclass(frozen=True)
class Turn:
    """Tokens [start, end) of a session that make one turn: cut where the chat template opens a
    turn, so a page can show who said what; a text session is one turn of no role."""

    role: str | None
    text: str
    start: int
    end: int

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Prefix:
    """A token prefix that several sessions share, stored once."""

    node_id: str
    tokens: int  # length of the shared prefix
    # its information content under the model, d_T = -log2 P(prefix); None while the model's pass is pending
    bits: float | None
    sessions: int
    text: str  # its first words

    def to_dict(self) -> dict:
        bits = None if self.bits is None else round(self.bits, 2)
        return {
            "node_id": self.node_id,
            "tokens": self.tokens,
            "bits": bits,
            "pending": self.bits is None,
            "sessions": self.sessions,
            "text": self.text,
        }


@dataclass(frozen=True)
class PresetFidelity:
    """What a tier K restore with a path's codebooks was measured to cost (kvdb/data/kv_fidelity.json):
    ``lengths`` maps a context length ("1024", "4096", "8000") to its ``ppl_ratio``, ``kl`` and
    ``top1`` against the exact cache (a figure None where unmeasured); empty, with ``measured_by``
    None, where nothing measured these codebooks (trained ones, or a spec never benchmarked)."""

    preset: str | None  # its name (faithful, balanced, compact) with this model, else None
    spec: str
    source: CodebookSource
    lengths: dict = field(default_factory=dict)
    measured_by: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "source", CodebookSource(self.source))

    @property
    def label(self) -> str:
        """How a message names it: ``compact (k3v3+...)``, or the spec alone."""
        return f"{self.preset} ({self.spec})" if self.preset else self.spec

    @property
    def summary(self) -> str:
        """The label and the perplexity ratio measured at the longest length measured, for a page."""
        measured = [(int(n), m["ppl_ratio"]) for n, m in self.lengths.items() if m.get("ppl_ratio") is not None]
        if not measured:
            return f"{self.label}, not measured"
        length, ratio = max(measured)
        return f"{self.label}, perplexity x{ratio:.3f} of exact at {length:,} tokens"

    def to_dict(self) -> dict:
        return dict(asdict(self), source=self.source.value)


@dataclass
class RestoredSession:
    """A session's first ``position`` tokens, live in ``cache`` for ``model``.

    ``cache`` is a transformers ``DynamicCache``: pass it as ``cache`` to
    ``model(...)`` or ``model.generate(...)`` together with the tokens that follow ``position``.
    """

    session_id: str
    model: object
    tokenizer: object
    cache: DynamicCache
    position: int
    mode: RestoreMode  # the mode it took: never ``auto``
    seconds: float
    tokens: np.ndarray = field(repr=False)
    reason: str = ""  # why this mode, for the user (``auto`` weighs tier K's measured fidelity)
    fidelity: PresetFidelity | None = None  # of tier K's preset, for a restore from it; None for the others
    window: str | None = (
        None  # how an archive restore made its exact window ("stored", "recompute"); None for the others
    )

    def __post_init__(self) -> None:
        self.mode = RestoreMode(self.mode)

    def to_dict(self) -> dict:
        return {
            "session_id": self.session_id,
            "mode": self.mode.value,
            "restored_tokens": self.position,
            "seconds": round(self.seconds, 4),
            "reason": self.reason,
            "preset_fidelity": None if self.fidelity is None else self.fidelity.to_dict(),
            "window": self.window,
        }


class _ReadAsDict:
    """Reading a record as the dict its method returned before it was a record: deprecated, kept
    for one release. ``to_dict()`` is that dict (its fields, unless the record says otherwise)."""

    def to_dict(self) -> dict:
        return asdict(self)  # type: ignore[call-overload]  # every subclass is a dataclass

    def _deprecated(self, how: str) -> dict:
        warnings.warn(
            f"reading {type(self).__name__} as a dict ({how}) is deprecated and goes in the next release: "
            "use its attributes, or to_dict()",
            DeprecationWarning,
            stacklevel=3,
        )
        return self.to_dict()

    def __getitem__(self, key: str) -> Any:
        return self._deprecated(f"[{key!r}]")[key]

    def __contains__(self, key: object) -> bool:
        return key in self._deprecated("in")

    def __iter__(self) -> Iterator[str]:
        return iter(self._deprecated("iter"))

    def get(self, key: str, default: Any = None) -> Any:
        return self._deprecated(f".get({key!r})").get(key, default)

    def keys(self):
        return self._deprecated(".keys()").keys()


@dataclass(frozen=True)
class TrainedCodebooks(_ReadAsDict):
    """Codebooks ``codebooks train`` stored: on ``tokens`` archived positions, ``bytes`` long."""

    codebook_id: str
    preset: str
    tokens: int
    bytes: int
    seconds: float


@dataclass(frozen=True)
class ShippedCodebooks(_ReadAsDict):
    """This machine's shipped codebooks of a model; ``built`` when this call built them."""

    model_id: str
    preset: str
    bytes: int  # of the centroids, in this machine's kvdb cache
    built: bool
    path: str
    seconds: float


@dataclass(frozen=True)
class Fidelity(_ReadAsDict):
    """How closely an archive restore follows the exact one over ``probe_tokens`` of the session."""

    top1_agreement: float
    ppl_ratio: float  # perplexity of the archive restore over the exact one's
    probe_tokens: int


@dataclass(frozen=True)
class RebuiltIndex(_ReadAsDict):
    index_key: str
    sessions: int
    nodes: int
    points: int
    seconds: float


@dataclass(frozen=True)
class VerifyReport:
    """What ``verify`` checked (a count per kind), the problems found (one line a user can act
    on, each), and what it mended on the way (a stale index rebuilt). The checks fill the
    counter and the lists in place."""

    checked: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        return {
            "ok": self.ok,
            "checked": dict(self.checked),
            "problems": list(self.problems),
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class RepairReport(_ReadAsDict):
    """The search indexes rebuilt, the prefix-cache entries deleted, and the problems a deep
    verify still finds afterwards: what cannot be derived again."""

    rebuilt_indexes: tuple[str, ...]
    pruned_prefix_cache_entries: int
    unrepairable: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.unrepairable

    def to_dict(self) -> dict:
        return {
            "rebuilt_indexes": list(self.rebuilt_indexes),
            "pruned_prefix_cache_entries": self.pruned_prefix_cache_entries,
            "unrepairable": list(self.unrepairable),
            "ok": self.ok,
        }


@dataclass(frozen=True)
class CopyReport(_ReadAsDict):
    """An archive copied: the rows of each table, and each table's SHA-256, equal on both sides."""

    source: str
    target: str
    rows: dict[str, int]
    sha256: dict[str, str]

    def to_dict(self) -> dict:
        return {"source": self.source, "target": self.target, "rows": dict(self.rows), "sha256": dict(self.sha256)}


@dataclass(frozen=True)
class GcReport(_ReadAsDict):
    """What ``gc`` freed. The last fields are the storage's own upkeep, None where it has none:
    a file's bytes (``file_bytes_before`` only when it was rewritten smaller), a lake's Parquet
    files merged and deleted."""

    nodes: int
    tokens: int
    token_bytes: int
    prefix_cache_entries: int
    renumbered_indexes: tuple[str, ...]
    file_bytes_before: int | None = None
    file_bytes: int | None = None
    data_files_merged: int | None = None
    data_files_written: int | None = None
    data_files_deleted: int | None = None
    data_files_kept: int | None = None  # replaced data files kept for readers of older snapshots
    forgotten: int = 0  # deleted sessions whose last bytes this gc erased (kvdb.services.forgetting)

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}
        return dict(out, renumbered_indexes=list(self.renumbered_indexes))


@dataclass(frozen=True)
class QueryResult:
    """What ``Archive.sql`` found: the columns' names and DuckDB types, and the rows (tuples of
    Python values: str, int, float, bool, None, datetime, Decimal, lists, dicts)."""

    columns: list[str]
    types: list[str]
    rows: list[tuple]

    def to_dict(self) -> dict:
        """JSON's values: times as ISO 8601, decimals as numbers, bytes as hex, intervals in seconds."""
        return {
            "columns": list(self.columns),
            "types": list(self.types),
            "rows": [[_plain(v) for v in row] for row in self.rows],
        }


def _plain(value: Any) -> Any:
    import decimal
    import uuid

    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)

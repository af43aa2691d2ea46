"""What the library hands back. ``to_dict()`` is the one shape of each: the CLI's ``--json``
lines and the server's bodies are these dictionaries."""

from __future__ import annotations

import datetime as dt
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

import numpy as np

from kvdb.storage.base import SessionRow

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

    @classmethod
    def from_row(cls, row: SessionRow) -> Session:
        return cls(row.session_id, row.name, row.source, row.n_tokens, row.created_at, row.model_id, row.metadata)

    def __eq__(self, other: object) -> bool:
        """By value, whatever the subclass: a session handle equals the record it stands for."""
        if not isinstance(other, Session):
            return NotImplemented
        return all(getattr(self, f.name) == getattr(other, f.name) for f in fields(Session) if f.compare)

    def to_dict(self) -> dict:
        return {"session_id": self.session_id, "name": self.name, "source": self.source, "n_tokens": self.n_tokens, "created_at": self.created_at.isoformat()}


@dataclass(frozen=True)
class IngestResult:
    session_id: str | None
    name: str
    source: str
    n_tokens: int
    status: str  # "ingested" | "updated" (archived before; tiers added) | "unchanged" | "failed" | "claimed" (by another worker)
    error: str | None = None
    new_tokens: int = 0  # tokens stored (and computed) anew: the rest was a prefix archived already
    seconds: float = 0.0
    added: tuple[str, ...] = ()  # "updated": the tiers its path was given, which it was archived without
    dropped: dict = field(default_factory=dict)  # kind -> parts of the transcript kept only as a "[KIND not archived]" placeholder
    claimed_by: str | None = None  # "claimed": the worker (host:pid) archiving the file meanwhile

    def to_dict(self) -> dict:
        out: dict[str, Any] = {"session_id": self.session_id, "name": self.name, "source": self.source, "n_tokens": self.n_tokens, "status": self.status}
        if self.status == "ingested":
            out.update(new_tokens=self.new_tokens, seconds=round(self.seconds, 4))
        if self.status == "updated":
            out.update(added=list(self.added), seconds=round(self.seconds, 4))
        if self.dropped:
            out["dropped"] = dict(self.dropped)
        if self.claimed_by is not None:
            out["claimed_by"] = self.claimed_by
        if self.error is not None:
            out["error"] = self.error
        return out


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
    source: str
    stored_bytes: int
    centroid_bytes: int
    on_this_machine: bool

    def to_dict(self) -> dict:
        return dict(asdict(self), created_at=self.created_at.isoformat() if self.created_at else None)


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

    def to_dict(self) -> dict:
        return asdict(self)


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
    bits: float  # its information content under the model, d_T = -log2 P(prefix)
    sessions: int
    text: str  # its first words

    def to_dict(self) -> dict:
        return {"node_id": self.node_id, "tokens": self.tokens, "bits": round(self.bits, 2), "sessions": self.sessions, "text": self.text}


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
    mode: str
    seconds: float
    tokens: np.ndarray = field(repr=False)

    def to_dict(self) -> dict:
        return {"session_id": self.session_id, "mode": self.mode, "restored_tokens": self.position, "seconds": round(self.seconds, 4)}

"""The first stage of the write path: what a source holds and what archiving it takes.

A source is parsed, rendered and tokenized once, here, into ``Planned`` sessions (a session
longer than the model's context into parts, ``plan_parts``); each is then
matched against the trie into a ``SessionPlan``, the work still to do. Planning reads the
archive and never writes or runs the model (but to decode a tier-L-only node the match runs
through, which is reading). The plan is made again whenever a commit finds the trie moved; the
model's work is kept when the new plan asks for the same (``SessionPlan.key``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvdb.errors import TranscriptError
from kvdb.index import trie
from kvdb.model import chat
from kvdb.model import tokenizer as tok
from kvdb.storage import Storage
from kvdb.storage.base import NodeRow
from kvdb.tiers import MODEL_TIERS
from kvdb.transcripts import Transcript


@dataclass(frozen=True)
class Planned:
    """One session to archive and its token ids: a parsed session whole, or a part of one
    (``item.metadata["part"]``, see ``plan_parts``)."""

    item: Transcript
    ids: np.ndarray

    @property
    def part(self) -> dict:
        """Where it is a part (``number``, ``follows``, ``starts``: see ``plan_parts``); {} for a whole session."""
        return self.item.metadata.get("part", {})


@dataclass(frozen=True)
class SessionPlan:
    """What archiving one session takes, against the trie as it was read at ``version``.

    ``match`` is None when the session is archived already; then only ``lacking`` (path nodes
    without some of the tiers asked for) is left to do."""

    session_id: str
    ids: np.ndarray
    keep: frozenset[str]
    version: object
    match: trie.PrefixMatch | None
    path: list[NodeRow]  # the matched node's path (or the archived session's), root first
    lacking: list[tuple[NodeRow, frozenset[str]]]  # path nodes and the tiers of ``keep`` each lacks

    @property
    def done(self) -> bool:
        return self.match is None and not self.lacking

    @property
    def back(self) -> list[NodeRow]:
        """Nodes held in tier L only that a new session runs through whole: they get their tokens back."""
        assert self.match is not None
        return [n for n in self.path if "tokens" not in n.keep and n.end <= self.match.matched]

    @property
    def scored_from(self) -> int:
        """The first position whose log-probability the new session's write needs."""
        assert self.match is not None
        return min((n.start for n in self.back), default=self.match.matched)

    @property
    def splits(self) -> bool:
        return self.match is not None and self.match.node is not None and self.match.offset < self.match.node.n_tokens

    @property
    def runs_model(self) -> bool:
        """Whether the write needs the model now: a tier only it makes, or tier L to decode or
        code again on the way (a node held there alone that the session runs through or gets
        back, a node with tier L or K that the session cuts). Else the tokenizer is enough."""
        if self.match is None:
            return any(tiers & (MODEL_TIERS | {"tokens"}) for _, tiers in self.lacking)
        node = self.match.node
        cuts = self.splits and node is not None and bool(node.keep & MODEL_TIERS)
        return bool(self.keep & MODEL_TIERS) or bool(self.back) or cuts

    @property
    def key(self) -> tuple:
        """What the model's work for this plan depends on (not, say, a node's refcount)."""
        if self.match is None:
            return ("tiers", tuple((n.node_id, n.start, n.n_tokens, tiers) for n, tiers in self.lacking))
        node = self.match.node
        return (
            "session",
            self.match.matched,
            self.match.offset,
            None if node is None else (node.node_id, node.start, node.n_tokens, node.keep),
        )


def plan_parts(tokenizer, model_id: str, item: Transcript, context_tokens: int) -> list[Planned]:
    """A parsed session as the sessions that archive it: itself, when it fits the model's
    context; else parts that fit (``part_bounds``), each a session of its own that continues the
    one before (``metadata["part"]``: its ``number`` from 1, the session it ``follows``, and
    where it ``starts`` in the whole), with the file's side text on the last, the part that grows.

    The model cannot attend past its context, so a part's state holds that part alone. A part is
    cut a quarter of a context short, so that a restored part leaves the model room to go on."""
    ids = render_ids(tokenizer, item)
    if len(ids) <= context_tokens:
        return [Planned(item, ids)]
    bounds = part_bounds(ids, chat.turn_opens(tokenizer, ids), context_tokens - context_tokens // 4)
    if item.text is not None and tok.decode(tokenizer, ids) != item.text:
        raise TranscriptError(
            item.source,
            f"renders to {len(ids):,} tokens, more than the {context_tokens:,} of the model's context, "
            "and this tokenizer "
            "does not give its text back exactly, so it cannot be cut into parts; split it into smaller sessions",
        )
    out: list[Planned] = []
    metadata = {k: v for k, v in item.metadata.items() if k != "side"}
    for number, (start, end) in enumerate(bounds, 1):
        part = {"number": number, "follows": trie.path_id(model_id, out[-1].ids) if out else None, "starts": start}
        last = number == len(bounds)
        text = None if item.text is None else tok.decode(tokenizer, ids[start:end])
        one = dataclasses.replace(
            item,
            text=text,
            metadata=dict(item.metadata if last else metadata, part=part),
            dropped=item.dropped if last else {},
        )
        out.append(Planned(one, ids[start:end]))
    return out


def part_bounds(ids: np.ndarray, opens: np.ndarray, budget: int) -> list[tuple[int, int]]:
    """(start, end) of parts of at most ``budget`` tokens, each cut where the latest turn it can
    hold whole ends (``opens``: where turns open), or, when that would leave it less than half
    full (a long turn comes next), at ``budget`` tokens inside that turn. The cuts depend only on
    what comes before them, so a log that grows keeps its parts and grows its last."""
    bounds, start, total = [], 0, len(ids)
    opens = np.sort(opens)
    while total - start > budget:
        latest = int(np.searchsorted(opens, start + budget, side="right")) - 1  # the latest opening within the budget
        end = int(opens[latest]) if latest >= 0 and opens[latest] > start + budget // 2 else start + budget
        bounds.append((start, end))
        start = end
    return bounds + [(start, total)]


def render_ids(tokenizer, item: Transcript) -> np.ndarray:
    """A session's token ids, refused when empty."""
    text = item.text if item.text is not None else chat.render(tokenizer, item.messages)
    ids = np.asarray(tok.encode(tokenizer, text), dtype=np.int64)
    if len(ids) == 0:
        raise TranscriptError(item.source, "renders to zero tokens; nothing to archive")
    return ids


def plan_session(
    storage: Storage,
    model_id: str,
    ids: np.ndarray,
    keep: frozenset[str],
    tokens_of: Callable[[NodeRow], np.ndarray],
    heads: trie.Heads | None = None,
    written: trie.Written | None = None,
) -> SessionPlan:
    """The work of archiving ``ids`` with the tiers ``keep``, as the archive stands now.
    ``tokens_of(node)``: a node's tokens (decoded from tier L for a node held only there);
    ``heads`` and ``written``: nodes' first tokens and the paths of the last sessions, kept by a
    writer across its sessions (``trie.Heads``, ``trie.Written``)."""
    version = storage.version()  # a commit of this plan is refused if anything lands after this
    session_id = trie.path_id(model_id, ids)
    if storage.has_session(session_id):
        path = storage.node_path(session_id)
        return SessionPlan(session_id, ids, keep, version, None, path, missing_tiers(path, keep))
    # a node is cut only where MIN_SPLIT of its tokens are shared
    match = trie.longest_prefix(
        storage, model_id, ids, tokens_of, min_split=trie.MIN_SPLIT, heads=heads, written=written
    )
    return SessionPlan(session_id, ids, keep, version, match, list(match.path), [])


def missing_tiers(path: list[NodeRow], keep: frozenset[str]) -> list[tuple[NodeRow, frozenset[str]]]:
    """The nodes of an archived session's ``path`` that lack some of the tiers ``keep``, with those tiers."""
    return [(n, keep - n.keep) for n in path if keep - n.keep]

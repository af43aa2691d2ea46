"""Reading archived sessions back: resolving what the user typed to a session, its tokens,
its text, its log-probabilities, and the prefixes sessions share. None of it loads the model
unless a session is held in tier L only (its tokens must be decoded) or its text was archived
with another tokenizer."""

from __future__ import annotations

import re

import numpy as np

from kvdb.errors import AmbiguousSession, InvalidArgument, SessionNotFound
from kvdb.model import chat
from kvdb.model import tokenizer as tok
from kvdb.records import Prefix, Session, Turn
from kvdb.services.models import ModelProvider
from kvdb.services.tier_l import TierL
from kvdb.storage import Storage
from kvdb.storage.base import NodeRow, SessionRow

# tokens read past a range's end (and first back from its start): a turn's opening marker and
# the role word after it, which name a turn that opens near the range's edge
TURN_HEAD = 2 * chat.ROLE_TOKENS


class Reader:
    def __init__(self, storage: Storage, models: ModelProvider, tier_l: TierL):
        self._storage = storage
        self._models = models
        self._tier_l = tier_l

    def resolve(self, ref: str) -> SessionRow:
        """Full session id; then a conversation's id, exact name (or title) or ``name#n``, as its
        latest version; then a unique id prefix. ``REF@vN`` is version N of REF's conversation,
        oldest first.

        Two files named notes.md in different folders are both conversations ``notes``:
        ``notes#2`` is the second of them, oldest first. A name that itself ends in ``#n`` (a
        JSONL file's sessions are ``stem#line``) is found by that name before ``#n`` is read as a number."""
        if not ref:
            raise InvalidArgument("empty session reference; give an id, an id prefix or a name (see `kvdb sessions`)")
        exact = self._storage.get_session(ref)
        if exact is not None:
            return exact
        version = re.fullmatch(r"(.+)@v([1-9][0-9]*)", ref)
        if version is not None:
            return self._version(version[1], int(version[2]))
        by_id = self._storage.conversation_sessions(ref)
        if by_id:
            return by_id[-1]
        matches = self._storage.match_sessions(ref)
        named = self._named(ref, matches)
        if len(named) > 1:
            listed = ", ".join(f"{ref}#{i} ({m.source})" for i, m in enumerate(named[:5], 1))
            raise AmbiguousSession(f"{ref!r} names {len(named)} conversations: {listed}; give one of these, or an id")
        if named:
            return named[0]
        numbered = re.fullmatch(r"(.+)#([1-9][0-9]*)", ref)
        if numbered is not None:
            same = self._named(numbered[1], self._storage.match_sessions(numbered[1]))
            if len(same) >= int(numbered[2]):
                return same[int(numbered[2]) - 1]
            if same:
                raise SessionNotFound(
                    f"no conversation {ref!r}: {len(same)} conversations are named {numbered[1]!r}, "
                    f"{numbered[1]}#1 to {numbered[1]}#{len(same)}"
                )
        matches = [m for m in matches if m.session_id.startswith(ref.lower())]
        if not matches:
            raise SessionNotFound(f"no session matches {ref!r}; list them with `kvdb sessions`")
        if len(matches) > 1:
            listed = ", ".join(f"{m.session_id[:12]} ({m.name})" for m in matches[:5])
            raise AmbiguousSession(f"{ref!r} matches {len(matches)} sessions: {listed}; give more of the id")
        return matches[0]

    def _named(self, name: str, rows: list[SessionRow]) -> list[SessionRow]:
        """The conversations named ``name``, each as its latest version of that name (its latest
        version, when ``name`` is its title), oldest conversation first: the order ``name#n`` counts in."""
        latest: dict[str, SessionRow] = {}
        for row in sorted((r for r in rows if r.name == name), key=lambda r: (r.created_at, r.session_id)):
            latest[row.conversation_id] = row
        for conversation, title in self._storage.conversation_titles().items():
            versions = self._storage.conversation_sessions(conversation) if title == name else []
            if versions:
                latest[conversation] = versions[-1]
        if len(latest) < 2:  # nothing to order: no query for each one's first version
            return list(latest.values())
        first = {c: self._storage.conversation_sessions(c)[0] for c in latest}
        return sorted(
            latest.values(), key=lambda r: (first[r.conversation_id].created_at, first[r.conversation_id].session_id)
        )

    def _version(self, ref: str, number: int) -> SessionRow:
        versions = self._storage.conversation_sessions(self.resolve(ref).conversation_id)
        if number > len(versions):
            raise SessionNotFound(
                f"no version {number} of {ref!r}: it has {len(versions)}, {ref}@v1 to {ref}@v{len(versions)} "
                "(oldest first)"
            )
        return versions[number - 1]

    def sessions(self) -> list[Session]:
        return [Session.from_row(r) for r in self._storage.list_sessions()]

    def tokens(self, ref: str, start: int | None = None, end: int | None = None) -> np.ndarray:
        row = self.resolve(ref)
        return self.path_tokens(row, *clip_range(row, start, end))

    def text(self, ref: str, start: int | None = None, end: int | None = None) -> str:
        """The text of tokens [start, end). The whole of a text session is its original text, exactly."""
        row = self.resolve(ref)
        start, end = clip_range(row, start, end)
        if "text" in row.metadata and (start, end) == (0, row.n_tokens):
            return row.metadata["text"]
        return tok.decode(self._models.tokenizer_for(row), self.path_tokens(row, start, end))

    def turns(self, ref: str, start: int | None = None, end: int | None = None) -> list[Turn]:
        """The turns that overlap tokens [start, end), each clipped to them (see ``chat.turns``),
        each with what was said in it, without the template's markup around it. Only the range
        is read, from the opening of the turn it starts in: a reader paging through a long
        session (MCP ``show``) reads it once, not once a page."""
        row = self.resolve(ref)
        start, end = clip_range(row, start, end)
        tokenizer = self._models.chat_tokenizer_for(row)
        path = self._storage.node_path(row.session_id)
        stop = min(row.n_tokens, end + TURN_HEAD)
        blocks = all("tokens" in n.keep for n in path if n.start < stop)
        back = TURN_HEAD if blocks else start  # tier L decodes from the start whatever is asked: once
        while True:  # back to the opening of the turn ``start`` is in, to name its role
            first = max(start - back, 0)
            ids = self.path_tokens(row, first, stop, path)
            opens = chat.turn_opens(tokenizer, ids)
            if first == 0 or (opens.size and opens[0] <= start - first):
                break
            back *= 4
        clipped = [(role, max(a + first, start), min(b + first, end)) for role, a, b in chat.turns(tokenizer, ids)]
        return [Turn(role, _said(tokenizer, role, ids[a - first : b - first]), a, b) for role, a, b in clipped if a < b]

    def path_tokens(
        self, row: SessionRow, start: int = 0, end: int | None = None, path: list[NodeRow] | None = None
    ) -> np.ndarray:
        """Tokens [start, end) of a session (``path``: its nodes, when read already): from the
        token blocks, or from tier L where the path holds some only there."""
        end = row.n_tokens if end is None else end
        path = self._storage.node_path(row.session_id) if path is None else path
        if all("tokens" in n.keep for n in path if n.start < end):
            return self._storage.path_tokens(path, start, end)
        return self._tier_l.session_tokens(row, path, end)[start:]

    def logprobs(self, ref: str) -> np.ndarray:
        """Natural-log probability of each token under the archive's model, as stored by the
        model's pass (computed now, and not stored, where that pass is still pending or the
        session is held in tier L)."""
        row = self.resolve(ref)
        path = self._storage.node_path(row.session_id)
        stored = self._storage.load_logprobs(row.session_id) if all("tokens" in n.keep for n in path) else None
        return stored if stored is not None else self._scored(row, path, row.n_tokens)

    def prefix_bits(self, a: str, b: str) -> float:
        """d_T(a, b) = -log2 P_M(shared prefix): the information content of what the sessions
        share, a sum of the log-probabilities stored along their common trie path."""
        row = self.resolve(a)
        path_a = self._storage.node_path(row.session_id)
        on_b = {n.node_id for n in self._storage.node_path(self.resolve(b).session_id)}
        shared = [n for n in path_a if n.node_id in on_b]  # nodes two sessions share hold their log-probabilities
        if not shared:
            return 0.0
        stored = self._storage.load_logprobs(shared[-1].node_id)
        return bits(stored if stored is not None else self._scored(row, path_a, shared[-1].end))

    def _scored(self, row: SessionRow, path: list[NodeRow], end: int) -> np.ndarray:
        """The first ``end`` tokens' log-probabilities, by the model now (a read: nothing stored)."""
        from kvdb.model import loading as lm_ops

        return lm_ops.score(self._models.for_session(row).model, self.path_tokens(row, end=end, path=path))[0]

    def prefixes(self, words: int | None = None) -> list[Prefix]:
        """Every prefix two or more sessions share, with its length, bits and text (whole, as
        archived; the first ``words`` words with spaces folded where asked, the 0.1 shape)."""
        out = []
        for node in self._storage.shared_nodes():
            logprobs = self._storage.load_logprobs(node.node_id)  # None: pending (``kvdb upkeep``)
            if words is None:
                text = self._models.text_of_tokens(node.model_id, self._storage.load_tokens(node.node_id, 0, node.end))
            else:
                head = self._storage.load_tokens(node.node_id, 0, min(node.end, 4 * words))
                text = " ".join(self._models.text_of_tokens(node.model_id, head).split()[:words])
            out.append(
                Prefix(node.node_id, node.end, None if logprobs is None else bits(logprobs), node.refcount, text)
            )
        return out


def _said(tokenizer, role: str | None, ids: np.ndarray) -> str:
    """What a turn says, without the chat template's markup (a text session's turn: its text)."""
    text = tok.decode(tokenizer, ids)
    return chat.turn_content(tokenizer, text) if role is not None else text


def clip_range(row: SessionRow, start: int | None, end: int | None) -> tuple[int, int]:
    start = 0 if start is None else start
    end = row.n_tokens if end is None else end
    if not 0 <= start <= end <= row.n_tokens:
        raise InvalidArgument(
            f"range [{start}, {end}) is outside session {row.session_id[:12]} ({row.name}), "
            f"which has {row.n_tokens} tokens"
        )
    return start, end


def bits(logprobs: np.ndarray) -> float:
    return float(-np.sum(logprobs, dtype=np.float64) / np.log(2))

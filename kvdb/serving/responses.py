"""What the serving library hands back. ``to_dict()`` is the HTTP body: the OpenAI API's
shapes, plus a ``kvdb`` object saying where the prompt's cache came from."""

from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np

from kvdb.records import Session, Turn


@dataclass(frozen=True)
class TokenLogprob:
    """One token of a reply: its bytes, ln p(token | everything before it) under the model's own
    distribution (before temperature and top_p, as the archive's log-probabilities), where its
    text starts in the reply's text, and the ``top`` most likely tokens there."""

    token: bytes
    logprob: float
    offset: int
    top: tuple[tuple[bytes, float], ...] = ()


Logprobs = tuple[TokenLogprob, ...] | None  # None: not asked for


@dataclass(frozen=True)
class Header:
    """What every chunk and the completion of one reply share."""

    id: str
    created: int
    model: str
    chat: bool

    def shape(self, streamed: bool) -> dict:
        kind = ("chat.completion.chunk" if streamed else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def choice(
        self, text: str, finish_reason: str | None, streamed: bool, first: bool = False, logprobs: Logprobs = None
    ) -> dict:
        if not self.chat:
            return {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": _text_logprobs(logprobs)}
        reported = {"content": [_chat_logprob(t) for t in logprobs], "refusal": None} if logprobs is not None else None
        if not streamed:
            message = {"role": "assistant", "content": text, "refusal": None}
            return {"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": reported}
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        return {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": reported}


def _token_text(token: bytes) -> str:
    """A token as text; one that is part of a character, as OpenAI's API writes it (``bytes:\\xe2``)."""
    try:
        return token.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in token)


def _chat_logprob(t: TokenLogprob) -> dict:
    """A token of ``choices[].logprobs.content``, in the chat API's shape."""
    top = [{"token": _token_text(b), "logprob": p, "bytes": list(b)} for b, p in t.top]
    return {"token": _token_text(t.token), "logprob": t.logprob, "bytes": list(t.token), "top_logprobs": top}


def _text_logprobs(logprobs: Logprobs) -> dict | None:
    """``choices[].logprobs`` in the text completions API's (legacy) shape: offsets are into the reply's text."""
    if logprobs is None:
        return None
    return {
        "tokens": [_token_text(t.token) for t in logprobs],
        "token_logprobs": [t.logprob for t in logprobs],
        "top_logprobs": [{_token_text(b): p for b, p in t.top} for t in logprobs],
        "text_offset": [t.offset for t in logprobs],
    }


@dataclass(frozen=True)
class Completion:
    """A finished reply. ``cached_tokens``: prompt tokens restored instead of computed;
    ``restored``: where from ("exact": a cache of the true tokens, "archive": tier K,
    approximate, "none"). The exchange is archived after the reply, under no id known yet."""

    header: Header
    text: str
    finish_reason: str  # "stop" (EOS or a stop string) | "length" (max_tokens)
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    restored: str
    approximate: bool
    logprobs: Logprobs = None  # the reply's tokens', when asked for
    fidelity: str | None = None  # a restore from tier K: its preset and what it was measured to cost
    conversation_id: str | None = (
        None  # the conversation the exchange is archived in; None: the one whose archived session it extends
    )

    def usage(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def kvdb(self) -> dict:
        return {
            "restored": self.restored,
            "cached_tokens": self.cached_tokens,
            "approximate": self.approximate,
            "fidelity": self.fidelity,
            "conversation_id": self.conversation_id,
        }

    def to_dict(self) -> dict:
        choice = self.header.choice(self.text, self.finish_reason, streamed=False, logprobs=self.logprobs)
        return self.header.shape(streamed=False) | {"choices": [choice], "usage": self.usage(), "kvdb": self.kvdb()}


@dataclass(frozen=True)
class Chunk:
    """One event of a streamed reply: the opening one (``first``), a text delta (with its
    tokens' ``logprobs`` when asked for), the last one (``done``: finish reason and the kvdb
    report), or the usage one (``usage``: no choices)."""

    header: Header
    text: str = ""
    first: bool = False
    done: Completion | None = None
    usage: bool = False
    logprobs: Logprobs = None

    def to_dict(self) -> dict:
        out = self.header.shape(streamed=True)
        if self.usage and self.done is not None:
            return out | {"choices": [], "usage": self.done.usage(), "kvdb": self.done.kvdb()}
        finish = self.done.finish_reason if self.done is not None else None
        out["choices"] = [
            self.header.choice(self.text, finish, streamed=True, first=self.first, logprobs=self.logprobs)
        ]
        return out | ({"kvdb": self.done.kvdb()} if self.done is not None else {})


@dataclass(frozen=True)
class SessionView:
    """Tokens [start, end) of a session: its text, and its turns for a page to show apart."""

    session: Session
    start: int
    end: int
    text: str
    turns: list[Turn]

    def to_dict(self) -> dict:
        return {
            "session": self.session.to_dict(),
            "start": self.start,
            "end": self.end,
            "text": self.text,
            "turns": [t.to_dict() for t in self.turns],
            "side": self.session.side,
        }


@dataclass(frozen=True)
class Embeddings:
    """The semantic tier's vectors of some texts, as the OpenAI API's embeddings list: each
    vector as floats, or as the base64 of its little-endian float32 bytes (what the official
    client asks for)."""

    model: str
    vectors: np.ndarray
    tokens: int
    encoding: str = "float"

    def to_dict(self) -> dict:
        def encoded(vector: np.ndarray):
            if self.encoding == "base64":
                return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
            return [float(x) for x in vector]

        return {
            "object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": encoded(v)} for i, v in enumerate(self.vectors)],
            "model": self.model,
            "usage": {"prompt_tokens": self.tokens, "total_tokens": self.tokens},
        }

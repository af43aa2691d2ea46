"""What the serving library hands back. ``to_dict()`` is the HTTP body: the OpenAI API's
shapes, plus a ``kvdb`` object saying where the prompt's cache came from."""

from __future__ import annotations

from dataclasses import dataclass

from kvdb.records import Session, Turn


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

    def choice(self, text: str, finish_reason: str | None, streamed: bool, first: bool = False) -> dict:
        if not self.chat:
            return {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
        if not streamed:
            return {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None}, "finish_reason": finish_reason, "logprobs": None}
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        return {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}


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

    def usage(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def kvdb(self) -> dict:
        return {"restored": self.restored, "cached_tokens": self.cached_tokens, "approximate": self.approximate}

    def to_dict(self) -> dict:
        choice = self.header.choice(self.text, self.finish_reason, streamed=False)
        return self.header.shape(streamed=False) | {"choices": [choice], "usage": self.usage(), "kvdb": self.kvdb()}


@dataclass(frozen=True)
class Chunk:
    """One event of a streamed reply: the opening one (``first``), a text delta, the last one
    (``done``: finish reason and the kvdb report), or the usage one (``usage``: no choices)."""

    header: Header
    text: str = ""
    first: bool = False
    done: Completion | None = None
    usage: bool = False

    def to_dict(self) -> dict:
        out = self.header.shape(streamed=True)
        if self.usage and self.done is not None:
            return out | {"choices": [], "usage": self.done.usage(), "kvdb": self.done.kvdb()}
        finish = self.done.finish_reason if self.done is not None else None
        out["choices"] = [self.header.choice(self.text, finish, streamed=True, first=self.first)]
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
        return {"session": self.session.to_dict(), "start": self.start, "end": self.end, "text": self.text, "turns": [t.to_dict() for t in self.turns]}

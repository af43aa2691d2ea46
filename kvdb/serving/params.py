"""What a completion request asks for, checked once here so that every front end refuses the
same things with the same words (the names are the OpenAI API's)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvdb.errors import InvalidArgument, check_count

MAX_STOPS = 4  # as OpenAI's API
MAX_TOP_LOGPROBS = 20  # as OpenAI's API


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class Sampling:
    """How the reply's tokens are chosen. ``temperature`` 0 is greedy; ``top_p`` keeps the most
    likely tokens up to that probability mass (either None: the model's own, ``defaulted``);
    ``seed`` makes sampling repeatable; the reply ends at EOS, at the first of the ``stop``
    strings (not included), or after ``max_tokens`` (None: as many as the context holds, up to
    the server's default)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self):
        if self.max_tokens is not None:
            check_count("max_tokens", self.max_tokens, 1)
        if self.temperature is not None and not (_number(self.temperature) and 0 <= self.temperature <= 2):
            raise InvalidArgument(f"temperature must be a number from 0 to 2, got {self.temperature!r}")
        if self.top_p is not None and not (_number(self.top_p) and 0 < self.top_p <= 1):
            raise InvalidArgument(f"top_p must be a number above 0 and at most 1, got {self.top_p!r}")
        if self.seed is not None and not _integer(self.seed):
            raise InvalidArgument(f"seed must be an integer, got {self.seed!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if (
            not isinstance(stop, (list, tuple))
            or len(stop) > MAX_STOPS
            or not all(isinstance(s, str) and s for s in stop)
        ):
            raise InvalidArgument(
                f"stop must be a string or a list of at most {MAX_STOPS} non-empty strings, got {self.stop!r}"
            )
        object.__setattr__(self, "stop", tuple(stop))

    def defaulted(self, model: Sampling) -> Sampling:
        """The model's temperature and top_p where the request named none: a client that sends
        none (the page, most scripts) gets what the model was tuned to sample with, not the
        OpenAI API's 1.0, at which a small instruct model writes gibberish."""
        temperature = model.temperature if self.temperature is None else self.temperature
        return replace(self, temperature=temperature, top_p=model.top_p if self.top_p is None else self.top_p)


@dataclass(frozen=True)
class Request:
    """A completion: chat ``messages`` (any shape ``kvdb.transcripts`` reads) or a text
    ``prompt``. With ``session``, the first ``at`` tokens of that archived session (default:
    all) come first, and the messages are new turns after them. ``name`` names the archived
    exchange (default: the first words of the conversation). ``logprobs``: the reply's tokens'
    log-probabilities are reported, each with that many most likely alternatives (None: not)."""

    messages: list | None = None
    prompt: str | None = None
    sampling: Sampling = field(default_factory=Sampling)
    session: str | None = None
    at: int | None = None
    name: str | None = None
    conversation: str | None = (
        None  # the archived conversation it continues (default: ``session``'s, else a new one for a new chat)
    )
    model: str | None = None  # what the client named; the reply echoes it (one model is served, whatever the name)
    logprobs: int | None = None

    def __post_init__(self):
        if (self.messages is None) == (self.prompt is None):
            raise InvalidArgument("give either messages (a chat) or prompt (a text completion)")
        if self.messages is not None and not (isinstance(self.messages, list) and self.messages):
            raise InvalidArgument("messages must be a non-empty list of messages")
        if self.prompt is not None and not (isinstance(self.prompt, str) and self.prompt):
            raise InvalidArgument("prompt must be a non-empty string")
        if self.session is not None and not (isinstance(self.session, str) and self.session):
            raise InvalidArgument(f"kvdb.session must be a session id, id prefix or name, got {self.session!r}")
        if self.at is not None and (self.session is None or not (_integer(self.at) and self.at >= 0)):
            raise InvalidArgument(
                f"kvdb.at must be a token position (an integer >= 0) in kvdb.session, got {self.at!r}"
            )
        if self.model is not None and not isinstance(self.model, str):
            raise InvalidArgument(f"model must be a string, got {self.model!r}")
        if self.name is not None and not (isinstance(self.name, str) and self.name.strip()):
            raise InvalidArgument(f"kvdb.name must be a non-empty string, got {self.name!r}")
        if self.conversation is not None and not (isinstance(self.conversation, str) and self.conversation.strip()):
            raise InvalidArgument(
                f"kvdb.conversation must be a conversation id (GET /api/conversations), got {self.conversation!r}"
            )
        if self.logprobs is not None and not (_integer(self.logprobs) and 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise InvalidArgument(
                f"top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {self.logprobs!r}"
            )

    @property
    def chat(self) -> bool:
        return self.messages is not None

"""Request bodies into the library's parameters. JSON is read here, with its size bounded; the
values are checked by ``kvdb.serving.params``, which names the fields as the OpenAI API does."""

from __future__ import annotations

import json
from dataclasses import dataclass

from fastapi import Request as HttpRequest

from kvdb.errors import InvalidArgument
from kvdb.server.errors import HttpError
from kvdb.serving import Request, Sampling

MAX_BODY_BYTES = 4 * 2**20

# Fields of the OpenAI API (its request schemas, openai-python 2.x/3.x) that this server does not
# honour: accepted when null or at the values that ask for nothing (their defaults), refused
# otherwise: a reply that silently ignored them would mislead the client.
NOT_HONOURED: dict[str, tuple] = {
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "parallel_tool_calls": (),
    "response_format": ({"type": "text"},),
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "logit_bias": ({},),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "reasoning_effort": (),
    "verbosity": (),
    "web_search_options": (),
    "moderation": (),
    "store": (False,),  # OpenAI's stored completions; kvdb archives every exchange (its own store)
    "service_tier": ("auto", "default"),
    "echo": (False,),
    "best_of": (1,),
    "suffix": ("",),
}
# Fields that ask nothing of the reply: read and let be. (Abuse identifiers, metadata for
# OpenAI's stored completions, and prompt-caching hints: every prefix is cached here anyway.)
IGNORED = {
    "user",
    "safety_identifier",
    "metadata",
    "prompt_cache_key",
    "prompt_cache_retention",
    "prompt_cache_options",
}
HONOURED = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "logprobs",
    "kvdb",
}
# Each endpoint's own fields (OpenAI's schemas); the rest of the fields above are common to both.
CHAT_ONLY = {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "parallel_tool_calls",
    "response_format",
    "audio",
    "modalities",
    "prediction",
    "reasoning_effort",
    "verbosity",
    "web_search_options",
    "moderation",
    "store",
    "service_tier",
    *(IGNORED - {"user"}),
}
TEXT_ONLY = {"prompt", "echo", "best_of", "suffix"}
MAX_TEXT_LOGPROBS = 5  # /v1/completions' logprobs, as OpenAI's API
STREAM_OPTIONS = {"include_usage", "include_obfuscation"}
EXTENSION = {"session", "at", "name", "conversation"}


@dataclass(frozen=True)
class Parsed:
    """A completion request, and how its reply is to be sent."""

    request: Request
    stream: bool
    include_usage: bool


async def raw_body(request: HttpRequest, limit: int) -> bytes:
    """The body's bytes; 413 past ``limit`` bytes (declared or sent)."""
    declared = request.headers.get("content-length")
    too_large = HttpError(
        413,
        f"the request body is over the server's limit of {limit:,} bytes; send less (fewer or shorter messages)",
        "request_too_large",
    )
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > limit:
            raise too_large
    return bytes(body)


async def json_body(request: HttpRequest, limit: int) -> dict:
    """The body as a JSON object; 413 past ``limit`` bytes (declared or sent), 400 if not JSON."""
    body = await raw_body(request, limit)
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"the request body is not valid JSON ({exc}); send a JSON object") from None
    if not isinstance(value, dict):
        raise InvalidArgument(f"the request body must be a JSON object, got {type(value).__name__}")
    return value


def completion(body: dict, chat: bool) -> Parsed:
    """A chat (``messages``) or text (``prompt``) completion request."""
    endpoint, other = ("/v1/chat/completions", TEXT_ONLY) if chat else ("/v1/completions", CHAT_ONLY)
    known = (HONOURED | IGNORED | set(NOT_HONOURED) | CHAT_ONLY | TEXT_ONLY) - other
    for key, value in body.items():
        if key in other:
            raise InvalidArgument(
                f"{key} is not a field of {endpoint} (the other completions endpoint reads it); leave it out"
            )
        if key not in known:
            raise InvalidArgument(f"unknown field {key!r}; {endpoint} reads {', '.join(sorted(known))}")
        if key in NOT_HONOURED and value is not None and value not in NOT_HONOURED[key]:
            raise InvalidArgument(f"{key} is not supported by this server (got {value!r}); leave it out")
    if body.get("n", 1) != 1:
        raise InvalidArgument(f"n must be 1 (one reply per request), got {body['n']!r}")
    options = _default(body.get("stream_options"), {})
    extension = _default(body.get("kvdb"), {})
    if not isinstance(options, dict) or not isinstance(extension, dict):
        raise InvalidArgument("stream_options and kvdb must be JSON objects")
    for key, value in options.items():
        if key not in STREAM_OPTIONS:
            raise InvalidArgument(
                f"unknown stream_options field {key!r}; this server reads {', '.join(sorted(STREAM_OPTIONS))}"
            )
        if key == "include_obfuscation" and value:
            raise InvalidArgument(
                "stream_options.include_obfuscation is not supported by this server (chunks are not padded); "
                "leave it out"
            )
    if unknown := set(extension) - EXTENSION:
        raise InvalidArgument(
            f"unknown kvdb field {sorted(unknown)[0]!r}; the kvdb object reads {', '.join(sorted(EXTENSION))}"
        )
    if not isinstance(_default(body.get("stream"), False), bool):
        raise InvalidArgument(f"stream must be true or false, got {body['stream']!r}")
    sampling = Sampling(
        max_tokens=body.get("max_completion_tokens", body.get("max_tokens")),
        temperature=body.get("temperature"),  # None: the model's own (Sampling.defaulted)
        top_p=body.get("top_p"),
        seed=body.get("seed"),
        stop=_default(body.get("stop"), ()),
    )
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:  # the API's list form, of one prompt
        prompt = prompt[0]
    given = {"messages": _default(body.get("messages"), [])} if chat else {"prompt": _default(prompt, "")}
    request = Request(
        **given,
        sampling=sampling,
        session=extension.get("session"),
        at=extension.get("at"),
        name=extension.get("name"),
        conversation=extension.get("conversation"),
        model=body.get("model"),
        logprobs=_logprobs(body, chat),
    )
    return Parsed(request, _default(body.get("stream"), False), bool(options.get("include_usage")))


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives each reply token's log-probability comes with, None for none: the
    chat API asks with ``logprobs: true`` and ``top_logprobs``, the text API with ``logprobs: N``."""
    asked, top = body.get("logprobs"), body.get("top_logprobs")
    if not chat:
        if asked is not None and not (
            isinstance(asked, int) and not isinstance(asked, bool) and 0 <= asked <= MAX_TEXT_LOGPROBS
        ):
            raise InvalidArgument(
                f"logprobs must be an integer from 0 to {MAX_TEXT_LOGPROBS} (alternatives per token), got {asked!r}"
            )
        return asked
    if not isinstance(_default(asked, False), bool):
        raise InvalidArgument(f"logprobs must be true or false, got {asked!r}")
    if top and not asked:
        raise InvalidArgument("top_logprobs needs logprobs: true")
    return _default(top, 0) if asked else None


def _default(value, default):
    return default if value is None else value


EMBEDDING_FIELDS = {"input", "model", "encoding_format", "dimensions", "user"}


def embeddings(body: dict, served: str) -> tuple[list[str], str]:
    """(the texts, "float" or "base64") of an embeddings request, for the model ``served``."""
    for key in body:
        if key not in EMBEDDING_FIELDS:
            raise InvalidArgument(f"unknown field {key!r}; /v1/embeddings reads {', '.join(sorted(EMBEDDING_FIELDS))}")
    model = body.get("model")
    if model is not None and model != served:
        raise InvalidArgument(f"model {model!r} is not served here; this server embeds with {served!r}")
    if body.get("dimensions") is not None:
        raise InvalidArgument(f"dimensions is not supported: {served} gives vectors of its own size; leave it out")
    encoding = _default(body.get("encoding_format"), "float")
    if encoding not in ("float", "base64"):
        raise InvalidArgument(f"encoding_format must be float or base64, got {encoding!r}")
    given = body.get("input")
    texts = [given] if isinstance(given, str) else given
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise InvalidArgument(
            "input must be a string or a non-empty list of strings (token arrays are not read: give the text)"
        )
    return texts, encoding


def title(body) -> str | None:
    """A rename's ``{"title": ...}``: a string (empty or null: named by its first version again)."""
    if not isinstance(body, dict) or set(body) != {"title"}:
        raise InvalidArgument(
            'a rename is a JSON object with one field, {"title": "..."} (null or "" to drop the title)'
        )
    if body["title"] is not None and not isinstance(body["title"], str):
        raise InvalidArgument(f"title must be a string or null, got {body['title']!r}")
    return body["title"]

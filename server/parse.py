"""Request bodies into the library's parameters. JSON is read here, with its size bounded; the
values are checked by ``kvdb.serving.params``, which names the fields as the OpenAI API does."""

from __future__ import annotations

import json
from dataclasses import dataclass

from fastapi import Request as HttpRequest

from kvdb.errors import InvalidArgument
from kvdb.serving import Request, Sampling
from kvdb_server.errors import HttpError

MAX_BODY_BYTES = 4 * 2**20

# Fields the OpenAI API defines that this server does not honour: accepted only at their
# defaults, refused otherwise (a reply that silently ignored them would mislead the client).
NOT_HONOURED: dict[str, object] = {
    "tools": [],
    "tool_choice": "none",
    "functions": [],
    "function_call": "none",
    "parallel_tool_calls": None,
    "logprobs": False,
    "top_logprobs": 0,
    "response_format": {"type": "text"},
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "logit_bias": {},
    "echo": False,
    "best_of": 1,
    "suffix": None,
}
KNOWN = {
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "kvdb",
    "user",
}


@dataclass(frozen=True)
class Parsed:
    """A completion request, and how its reply is to be sent."""

    request: Request
    stream: bool
    include_usage: bool


async def json_body(request: HttpRequest, limit: int) -> dict:
    """The body as a JSON object; 413 past ``limit`` bytes (declared or sent), 400 if not JSON."""
    declared = request.headers.get("content-length")
    too_large = HttpError(413, f"the request body is over the server's limit of {limit:,} bytes; send less (fewer or shorter messages)", "request_too_large")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > limit:
            raise too_large
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"the request body is not valid JSON ({exc}); send a JSON object") from None
    if not isinstance(value, dict):
        raise InvalidArgument(f"the request body must be a JSON object, got {type(value).__name__}")
    return value


def completion(body: dict, chat: bool) -> Parsed:
    """A chat (``messages``) or text (``prompt``) completion request."""
    for key, value in body.items():
        if key in NOT_HONOURED and value is not None and value != NOT_HONOURED[key]:
            raise InvalidArgument(f"{key} is not supported by this server (got {value!r}); leave it out")
        if key not in NOT_HONOURED and key not in KNOWN:
            raise InvalidArgument(f"unknown field {key!r}; this server reads {', '.join(sorted(KNOWN))}")
    if body.get("n", 1) != 1:
        raise InvalidArgument(f"n must be 1 (one reply per request), got {body['n']!r}")
    options = body.get("stream_options") or {}
    extension = body.get("kvdb") or {}
    if not isinstance(options, dict) or not isinstance(extension, dict):
        raise InvalidArgument("stream_options and kvdb must be JSON objects")
    if not isinstance(_default(body.get("stream"), False), bool):
        raise InvalidArgument(f"stream must be true or false, got {body['stream']!r}")
    sampling = Sampling(
        max_tokens=body.get("max_completion_tokens", body.get("max_tokens")),
        temperature=_default(body.get("temperature"), 1.0),
        top_p=_default(body.get("top_p"), 1.0),
        seed=body.get("seed"),
        stop=_default(body.get("stop"), ()),
    )
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:  # the API's list form, of one prompt
        prompt = prompt[0]
    given = {"messages": _default(body.get("messages"), [])} if chat else {"prompt": _default(prompt, "")}
    request = Request(**given, sampling=sampling, session=extension.get("session"), at=extension.get("at"), name=extension.get("name"), model=body.get("model"))
    return Parsed(request, _default(body.get("stream"), False), bool(options.get("include_usage")))


def _default(value, default):
    return default if value is None else value

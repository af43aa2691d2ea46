"""`kvdb serve --upstream URL`: completions forwarded to another OpenAI-compatible server.

``/v1/chat/completions`` and ``/v1/completions`` go to the upstream as they came (less the
request's ``kvdb`` object, which names the archived conversation and is kvdb's alone), and its
reply comes back as it was sent: its status, its headers (less those of the connection), its
body byte for byte, a stream chunk by chunk as each arrives. ``/v1/models`` and
``/v1/models/{id}`` are the upstream's. Once a completed reply's last bytes are handed to the
connection, the exchange is given to ``Engine.relayed`` (a queue's put) and archived on the
engine's threads: a reply never waits for the archive, nor fails with it.

An upstream that cannot be reached is a 502, one that does not answer in time a 504, each with
a message of one line in OpenAI's error shape; an error the upstream sends is passed through.
The upstream's key: ``Authorization: Bearer KEY`` from the environment variable that
``--upstream-key-env`` names; without one, a client's own Authorization header goes through,
unless the server has an ``--api-key`` of its own (the client's header then carries that key,
which is not the upstream's).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from urllib.parse import urlsplit

import httpx2
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from kvdb.errors import InvalidArgument, UpstreamError, UpstreamTimeout
from kvdb.server import parse
from kvdb.server.errors import describe
from kvdb.serving import Engine, Relayed
from kvdb.serving.relay import EXTENSION

CONNECT_S = 10.0  # to open a connection to the upstream
READ_S = 600.0  # between two pieces of its reply: what the official openai client waits for one
MAX_BODY_BYTES = 64 * 2**20  # a request forwarded (images inline): the upstream has its own limit
HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
}
# the body is sent decoded, by this server
NOT_PASSED_BACK = HOP_BY_HOP | {"content-length", "content-encoding", "date", "server"}
PASSED_ON = ("content-type", "accept")  # a request's headers forwarded, with ``openai-*`` (organization, project)


def base_url(url: str) -> str:
    """The upstream's API base, as the openai client's ``base_url``: ``http(s)://host[:port]/path``;
    a URL with no path is taken to mean ``/v1``."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise InvalidArgument(
            "--upstream must be an http:// or https:// URL of an OpenAI-compatible API, "
            f"such as http://127.0.0.1:8080/v1; got {url!r}"
        )
    if parts.query or parts.fragment:
        raise InvalidArgument(f"--upstream is the API's base URL, without a query or fragment; got {url!r}")
    path = parts.path.rstrip("/") or "/v1"
    return f"{parts.scheme}://{parts.netloc}{path}"


class Upstream:
    def __init__(self, url: str, key: str | None = None, pass_authorization: bool = False):
        """``key``: the upstream's API key; ``pass_authorization``: without one, a client's own
        Authorization header is forwarded (a server with no key of its own)."""
        self.url = base_url(url)
        self._key = key
        self._pass_authorization = pass_authorization
        self._client = httpx2.AsyncClient(timeout=httpx2.Timeout(READ_S, connect=CONNECT_S), follow_redirects=False)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def open(self, method: str, path: str, incoming: Request, content: bytes | None = None) -> httpx2.Response:
        """The upstream's response to ``method path``, its status and headers read, its body not yet."""
        headers = {k: v for k, v in incoming.headers.items() if k in PASSED_ON or k.startswith("openai-")}
        if self._key is not None:
            headers["authorization"] = f"Bearer {self._key}"
        elif self._pass_authorization and "authorization" in incoming.headers:
            headers["authorization"] = incoming.headers["authorization"]
        request = self._client.build_request(method, f"{self.url}/{path}", content=content, headers=headers)
        try:
            return await self._client.send(request, stream=True)
        except httpx2.HTTPError as exc:
            raise self.failed(exc) from None

    def failed(self, exc: Exception) -> UpstreamError:
        """A transport error, as the one line the client gets."""
        if isinstance(exc, httpx2.ConnectError | httpx2.ConnectTimeout):
            return UpstreamError(
                f"cannot reach the upstream {self.url} ({_reason(exc)}); "
                "check that it runs and that --upstream names it"
            )
        if isinstance(exc, httpx2.TimeoutException):
            return UpstreamTimeout(f"the upstream {self.url} did not answer within {READ_S:.0f} s ({_reason(exc)})")
        return UpstreamError(f"the upstream {self.url} broke off its reply ({_reason(exc)})")


def _reason(exc: Exception) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


async def models(upstream: Upstream, request: Request, path: str) -> Response:
    response = await upstream.open("GET", path, request)
    return Response(await _read(upstream, response), response.status_code, _passed_back(response))


async def completion(upstream: Upstream, engine: Engine, request: Request, chat: bool) -> Response:
    """Forward a completion request; archive the exchange once its reply is sent whole (a 200)."""
    raw = await parse.raw_body(request, MAX_BODY_BYTES)
    body, forwarded = _own_fields_out(raw)
    end = engine.relaying()  # the archiver waits for the reply's end (and a moment more)
    streaming = False
    try:
        response = await upstream.open("POST", "chat/completions" if chat else "completions", request, forwarded)

        def sent(reply: bytes, streamed: bool) -> None:
            if response.status_code == 200 and body is not None:
                engine.relayed(Relayed(chat, body, reply, streamed))

        if response.headers.get("content-type", "").startswith("text/event-stream"):
            streaming = True
            return _Relaying(
                upstream, response, sent, end, status_code=response.status_code, headers=_passed_back(response)
            )
        reply = await _read(upstream, response)
        sent(reply, False)  # a queue's put: the reply goes out now, its archiving on the engine's threads
        return Response(reply, response.status_code, _passed_back(response))
    finally:
        if not streaming:
            end()


def _own_fields_out(raw: bytes) -> tuple[dict | None, bytes]:
    """(the body, if a JSON object; what to forward): the body as it came, but for the ``kvdb``
    object (``name``, ``conversation``: the archived conversation's), which no upstream reads."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None, raw  # the upstream says what is wrong with it
    if not isinstance(body, dict):
        return None, raw
    if "kvdb" not in body:
        return body, raw
    extension = body["kvdb"]
    if extension is not None and not (isinstance(extension, dict) and set(extension) <= set(EXTENSION)):
        raise InvalidArgument(
            "this server forwards completions to an upstream (--upstream): "
            "its kvdb object reads name and conversation alone "
            "(session and at continue an archived session with the local model: "
            "run kvdb serve without --upstream for that)"
        )
    return body, json.dumps({k: v for k, v in body.items() if k != "kvdb"}, ensure_ascii=False).encode()


async def _read(upstream: Upstream, response: httpx2.Response) -> bytes:
    try:
        return await response.aread()
    except httpx2.HTTPError as exc:
        raise upstream.failed(exc) from None
    finally:
        await response.aclose()


class _Relaying(StreamingResponse):
    """A stream relayed piece by piece as the upstream sends it. However it ends, the request's
    end is told and the upstream's response closed; it is archived when it was whole: the
    upstream's body ended, or its last event was ``data: [DONE]`` (a client that has that may
    leave before the upstream's body ends, and the stream's task is then cancelled). A stream the
    upstream breaks off ends with an error event (the status was sent already) and is not archived."""

    def __init__(
        self,
        upstream: Upstream,
        response: httpx2.Response,
        sent: Callable[[bytes, bool], None],
        end: Callable[[], None],
        **options,
    ):
        self._upstream, self._response, self._sent, self._end = upstream, response, sent, end
        self._received = bytearray()
        self._whole = self._broken = False
        super().__init__(self._pieces(), **options)

    async def _pieces(self) -> AsyncIterator[bytes]:
        try:
            async for piece in self._response.aiter_bytes():
                self._received += piece
                yield piece
        except httpx2.HTTPError as exc:
            self._broken = True
            yield f"data: {json.dumps(describe(self._upstream.failed(exc))[1])}\n\n".encode()
            return
        self._whole = True

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._end()
            if not self._broken and (self._whole or self._received.rstrip().endswith(b"[DONE]")):
                self._sent(bytes(self._received), True)
            await self._response.aclose()


def _passed_back(response: httpx2.Response) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k.lower() not in NOT_PASSED_BACK}

"""The FastAPI application of `kvdb serve`.

- ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``: the OpenAI API's shapes (with
  server-sent events when ``stream``), plus a ``kvdb`` object in each reply; ``/v1/embeddings``:
  the semantic tier's embedder, as the OpenAI API's embeddings.
- ``/api/sessions``, ``/api/sessions/{ref}``, ``/api/search``, ``/api/count``, ``/api/stats``: the archive,
  read while the model generates (the engine's reads never wait for it); ``/api/conversations``
  (GET a list, GET one with its versions, PATCH ``{"title"}`` to rename, DELETE every version).
- ``/mcp``: the Model Context Protocol over streamable HTTP (stateless, JSON replies): `kvdb
  mcp`'s tools that read (search, show, sessions), through the same archive thread.
- With an upstream (``kvdb serve --upstream``, ``upstream.py``), the completions and the models
  are the upstream's, forwarded, and each exchange is archived after its reply is sent.
- ``/health``, open to all; ``/`` and ``/static/...``, the page (``kvdb/server/static``), which
  holds no archive data: it asks for the key and sends it with its API calls. With an API
  key, every other route needs ``Authorization: Bearer KEY``.

Model work runs on the engine's threads and reads on its archive thread, never on the event
loop, so slow work never stalls other connections.
"""

from __future__ import annotations

import datetime as dt
import hmac
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import cast

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool
from starlette.routing import Route

from kvdb.index.phrase import MIN_SHARE
from kvdb.mcp import build
from kvdb.server import parse
from kvdb.server import upstream as relaying
from kvdb.server.errors import HttpError, describe, install
from kvdb.server.upstream import Upstream
from kvdb.serving import Chunk, Engine, Reply

STATIC = Path(__file__).resolve().parent / "static"


def create_app(
    engine: Engine,
    api_key: str | None = None,
    max_body_bytes: int = parse.MAX_BODY_BYTES,
    static: Path = STATIC,
    upstream: Upstream | None = None,
) -> FastAPI:
    """The app over ``engine``, which it starts (archiving, replaying the journal) and closes
    with the app's lifespan; with ``upstream``, completions and models are forwarded to it (and
    its client closed with the app)."""

    mcp = build(engine.read)  # the MCP tools that read (`kvdb mcp`'s, but continue: generation is /v1's)
    [sdk_route] = mcp.streamable_http_app(streamable_http_path="/mcp", stateless_http=True, json_response=True).routes
    mcp_route = cast(Route, sdk_route)  # the SDK's one route: an endpoint

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await run_in_threadpool(engine.start)
        async with mcp.session_manager.run():
            yield
        if upstream is not None:
            await upstream.aclose()
        await run_in_threadpool(engine.close)

    app = FastAPI(title="kvdb", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    install(app)
    authorize = _authorize(api_key)
    api = APIRouter(dependencies=[Depends(authorize)])

    # the SDK's ASGI app, outside the router
    app.router.routes.append(Route("/mcp", endpoint=_Keyed(mcp_route.endpoint, authorize)))

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    @app.get("/")
    def page() -> FileResponse:
        index = static / "index.html"
        if not index.is_file():
            raise HttpError(
                404, f"this server has no page ({index} is missing); the API is under /v1 and /api", "not_found"
            )
        return FileResponse(index)

    app.mount("/static", StaticFiles(directory=static, check_dir=False), name="static")

    served = {
        name: {"id": name, "object": "model", "created": 0, "owned_by": "kvdb"}
        for name in (engine.model_name, engine.embedder_name)
    }

    if upstream is not None:
        _relaying(api, engine, upstream)
    else:

        @api.get("/v1/models")
        def models() -> dict:
            return {"object": "list", "data": list(served.values())}

        @api.get("/v1/models/{model_id:path}")
        def model(model_id: str) -> dict:
            if model_id not in served:
                raise HttpError(
                    404,
                    f"model {model_id!r} is not served here; "
                    f"this server serves {' and '.join(map(repr, served))} (GET /v1/models)",
                    "model_not_found",
                )
            return served[model_id]

        @api.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await _complete(engine, await parse.json_body(request, max_body_bytes), chat=True)

        @api.post("/v1/completions")
        async def completions(request: Request):
            return await _complete(engine, await parse.json_body(request, max_body_bytes), chat=False)

    @api.post("/v1/embeddings")
    async def embeddings(request: Request):
        texts, encoding = parse.embeddings(await parse.json_body(request, max_body_bytes), engine.embedder_name)
        return (await run_in_threadpool(engine.embeddings, texts, encoding)).to_dict()

    @api.get("/api/sessions")
    def sessions(versions: int = Query(0, ge=0, le=1)) -> dict:
        """Each conversation as its latest version, the most recently updated first; ``versions=1``: every
        stored session, oldest first."""
        listed = engine.sessions() if versions else engine.conversations()
        return {"sessions": [s.to_dict() for s in listed]}

    @api.get("/api/conversations")
    def conversations(
        agent: str | None = None,
        project: str | None = None,
        since: dt.date | None = None,
        until: dt.date | None = None,
        limit: int | None = None,
        offset: int = 0,
    ) -> dict:
        """The most recently updated first; ``limit`` and ``offset`` page it (``total``, ``next_offset``)."""
        return engine.conversation_page(agent, project, since, until, limit, offset).to_dict()

    @api.get("/api/conversations/{ref:path}")
    def conversation(ref: str) -> dict:
        return engine.conversation(ref).to_dict()

    @api.patch("/api/conversations/{ref:path}")
    async def rename(ref: str, request: Request) -> dict:
        title = parse.title(await parse.json_body(request, max_body_bytes))
        return (await run_in_threadpool(engine.rename, ref, title)).to_dict()

    @api.delete("/api/conversations/{ref:path}")
    def delete(ref: str) -> dict:
        return engine.delete_conversation(ref).to_dict()

    @api.get("/api/sessions/{ref:path}")
    def session(ref: str, start: int | None = Query(None, ge=0), end: int | None = Query(None, ge=0)) -> dict:
        return engine.view(ref, start, end).to_dict()

    @api.get("/api/search")
    def search(
        q: str = Query(..., min_length=1),
        k: int = Query(10, le=1000),
        semantic: int = Query(0, ge=0, le=1),
        case_sensitive: int = Query(0, ge=0, le=1),
        min_share: float = Query(MIN_SHARE, ge=0, le=1),
        each_occurrence: int = Query(0, ge=0, le=1),
    ) -> dict:
        return {
            "hits": [
                h.to_dict()
                for h in engine.search(q, k, bool(semantic), bool(case_sensitive), min_share, bool(each_occurrence))
            ]
        }

    @api.get("/api/count")
    def count(q: str = Query(..., min_length=1), case_sensitive: int = Query(0, ge=0, le=1)) -> dict:
        return engine.count(q, bool(case_sensitive)).to_dict()

    @api.get("/api/stats")
    def stats() -> dict:
        return engine.stats().to_dict()

    app.include_router(api)
    return app


def _relaying(api: APIRouter, engine: Engine, upstream: Upstream) -> None:
    """The upstream's completions and models, in place of the engine's."""

    @api.get("/v1/models")
    async def models(request: Request):
        return await relaying.models(upstream, request, "models")

    @api.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        return await relaying.models(upstream, request, f"models/{model_id}")

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await relaying.completion(upstream, engine, request, chat=True)

    @api.post("/v1/completions")
    async def completions(request: Request):
        return await relaying.completion(upstream, engine, request, chat=False)


class _Keyed:
    """An ASGI app (the MCP SDK's) behind the API key: a plain ASGI wrapper, since an HTTP
    middleware would keep a streamed reply from seeing its client leave."""

    def __init__(self, app, authorize):
        self._app = app
        self._authorize = authorize

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self._authorize(Request(scope, receive))
        except HttpError as exc:
            status, body = describe(exc)
            await JSONResponse(body, status_code=status)(scope, receive, send)
            return
        await self._app(scope, receive, send)


def _authorize(api_key: str | None):
    async def check(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise HttpError(
                401,
                "this server needs an API key: send `Authorization: Bearer KEY` "
                "with the key it was started with (--api-key or $KVDB_API_KEY)",
                "missing_api_key",
            )
        if not hmac.compare_digest(given.strip().encode(), api_key.encode()):
            raise HttpError(
                401,
                "incorrect API key; send the key the server was started with (--api-key or $KVDB_API_KEY)",
                "invalid_api_key",
            )

    return check


async def _complete(engine: Engine, body: dict, chat: bool):
    asked = parse.completion(body, chat)
    reply = await run_in_threadpool(engine.complete, asked.request)
    if not asked.stream:
        try:
            return JSONResponse((await run_in_threadpool(reply.result)).to_dict())
        finally:
            reply.cancel()  # the request cancelled (the server stopping): the model is let go at the next token
    return StreamingResponse(
        _events(reply, asked.include_usage), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


async def _events(reply: Reply, include_usage: bool) -> AsyncIterator[str]:
    """``data: {chunk}`` lines, then ``data: [DONE]``. The last chunk (finish reason, kvdb
    report) follows the journal's write, so a reply whose end was sent is archived."""
    header = reply.header
    deltas = reply.deltas()
    try:
        yield _event(Chunk(header, first=True).to_dict())
        while (delta := await run_in_threadpool(next, deltas, None)) is not None:
            yield _event(Chunk(header, text=delta.text, logprobs=delta.logprobs).to_dict())
        yield _event(Chunk(header, done=reply.completion).to_dict())
        if include_usage:
            yield _event(Chunk(header, done=reply.completion, usage=True).to_dict())
        yield "data: [DONE]\n\n"
    except Exception as exc:  # noqa: BLE001 - the status was sent already: the error becomes the last event
        yield _event(describe(exc)[1])
    finally:
        reply.cancel()


def _event(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

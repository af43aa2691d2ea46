"""`kvdb serve` answers MCP over streamable HTTP at /mcp: the official client lists and calls the
reading tools through the server's archive thread, with the server's API key."""

from __future__ import annotations

import json

import anyio
import httpx2
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

import kvdb

KEY = "mcp-key"


def test_serve_answers_mcp_at_its_route_with_its_key(serve, tmp_path, tiny_loaded):
    with kvdb.open(tmp_path / "serve.duckdb", model=tiny_loaded) as archive:
        archive.ingest(text="The lighthouse keeper counted the ships every night.", name="story", keep="tokens,search")
    running = serve(api_key=KEY)

    async def main(key: str):
        async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"}) as http:
            async with (
                streamable_http_client(f"{running.url}/mcp", http_client=http) as (read, write, *_),
                ClientSession(read, write) as session,
            ):
                await session.initialize()
                tools = sorted(t.name for t in (await session.list_tools()).tools)
                found = await session.call_tool("search", {"query": "lighthouse keeper"})
                return tools, json.loads(found.content[0].text)

    tools, found = anyio.run(main, KEY)
    assert tools == ["search", "sessions", "show"]  # continue is /v1/chat/completions' here
    with running.http(Authorization=f"Bearer {KEY}") as client:
        assert (
            found["hits"] == client.get("/api/search", params={"q": "lighthouse keeper"}).json()["hits"]
            and found["hits"][0]["title"] == "story"
        )
    with running.http() as client:
        refused = client.post("/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
    assert refused.status_code == 401 and "API key" in refused.json()["error"]["message"]

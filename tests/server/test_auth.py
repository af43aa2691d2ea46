"""With --api-key every route but /health (and the page, which holds no data) needs the key."""

from __future__ import annotations

import openai
import pytest

KEY = "s3cret-key"


def test_routes_need_the_key_and_health_does_not(serve):
    running = serve(api_key=KEY)
    with (
        running.http() as anonymous,
        running.http(Authorization="Bearer wrong") as wrong,
        running.http(Authorization=f"Bearer {KEY}") as keyed,
    ):
        assert anonymous.get("/health").json() == {"status": "ok"}
        for path in ("/v1/models", "/api/sessions", "/api/stats", "/api/search?q=x"):
            missing, refused = anonymous.get(path), wrong.get(path)
            assert (missing.status_code, missing.json()["error"]["code"]) == (401, "missing_api_key"), path
            assert (refused.status_code, refused.json()["error"]["code"]) == (401, "invalid_api_key"), path
            assert keyed.get(path).status_code == 200, path
        assert (
            anonymous.post(
                "/v1/chat/completions", json={"model": "kvdb", "messages": [{"role": "user", "content": "hi"}]}
            ).status_code
            == 401
        )
        assert anonymous.get("/").status_code == 200  # the page asks for the key itself
    with pytest.raises(openai.AuthenticationError, match="incorrect API key"):
        running.openai(api_key="wrong").models.list()
    assert (
        running.openai(api_key=KEY)
        .chat.completions.create(model="kvdb", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        .choices
    )

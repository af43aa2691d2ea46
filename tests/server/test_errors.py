"""Every refusal in the OpenAI API's error shape, with the status of what went wrong, and the
server still serving after each; a full queue refused at once while reads go on."""

from __future__ import annotations

import time

import pytest
from openai.types import completion_create_params as text_params
from openai.types.chat import completion_create_params as chat_params

import kvdb
from kvdb.server import parse

CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"
ONE = [{"role": "user", "content": "hi"}]
LONG = {
    "model": "kvdb",
    "messages": [{"role": "user", "content": "Tell me about the harbour."}],
    "max_tokens": 2000,
    "temperature": 0,
    "stream": True,
}  # no EOS for 2000 tokens (~6 s)


def _still_serving(running) -> None:
    assert running.get("/health") == {"status": "ok"}
    assert running.chat(ONE, max_tokens=2).choices[0].message.role == "assistant"


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "code"),
    [
        ("post", CHAT, b"{not json", 400, None),
        ("post", CHAT, b"[1, 2]", 400, None),
        ("post", CHAT, b'{"model": "kvdb", "messages": "hi"}', 400, None),
        (
            "post",
            CHAT,
            b'{"model": "kvdb", "messages": [{"role": "user", "content": "hi"}], "temperature": 7}',
            400,
            None,
        ),
        (
            "post",
            CHAT,
            b'{"model": "kvdb", "messages": [{"role": "user", "content": "' + b"x" * 5000 + b'"}]}',
            400,
            "context_length_exceeded",
        ),
        (
            "post",
            CHAT,
            b'{"model": "kvdb", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}',
            400,
            "context_length_exceeded",
        ),
        (
            "post",
            CHAT,
            b'{"model": "kvdb", "messages": [{"role": "user", "content": "' + b"x" * 70000 + b'"}]}',
            413,
            "request_too_large",
        ),
        (
            "post",
            CHAT,
            b'{"model": "kvdb", "messages": [{"role": "user", "content": "hi"}], "kvdb": {"session": "nosuch"}}',
            404,
            "session_not_found",
        ),
        (
            "post",
            CHAT,
            b'{"model": "kvdb", "messages": [{"role": "user", "content": "hi"}], '
            b'"kvdb": {"session": "story", "at": 999}}',
            400,
            None,
        ),
        ("post", "/v1/completions", b'{"model": "kvdb", "prompt": ""}', 400, None),
        ("get", "/api/sessions/nosuch", None, 404, "session_not_found"),
        ("get", "/api/sessions/story?start=5&end=2", None, 400, None),
        ("get", "/api/search?k=0&q=x", None, 400, None),  # the library's refusal, as the CLI's and MCP's
        ("get", "/api/conversations?offset=-3", None, 400, None),
        ("get", "/no/such/route", None, 404, "not_found"),
        # issue 30: fields the server does not honour are refused, not silently ignored
        (
            "post",
            CHAT,
            b'{"model": "kvdb", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}',
            400,
            None,
        ),
        (
            "post",
            CHAT,
            b'{"model": "kvdb", "messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 21}',
            400,
            None,
        ),
        (
            "post",
            CHAT,
            b'{"model": "kvdb", "messages": [{"role": "user", "content": "hi"}], "frequency_penalty": 0.5}',
            400,
            None,
        ),
        (
            "post",
            CHAT,
            b'{"model": "kvdb", "messages": [{"role": "user", "content": "hi"}], '
            b'"response_format": {"type": "json_object"}}',
            400,
            None,
        ),
        (
            "post",
            CHAT,
            b'{"model": "kvdb", "messages": [{"role": "user", "content": "hi"}], "temprature": 0}',
            400,
            None,
        ),
        ("post", "/v1/completions", b'{"model": "kvdb", "prompt": "hi", "echo": true}', 400, None),
        ("get", "/v1/models/no-such-model", None, 404, "model_not_found"),
    ],
)
def test_refusals_are_openai_errors_and_the_server_keeps_serving(served_story, method, path, body, status, code):
    with served_story.http() as client:
        response = client.request(method.upper(), path, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (
        set(error) == {"message", "type", "param", "code"} and error["message"] and error["message"] != "internal error"
    )
    assert error["code"] == code and error["type"] == "invalid_request_error"
    _still_serving(served_story)


def test_the_field_a_refusal_names_and_defaults_that_pass(served_story):
    with served_story.http() as client:
        refused = client.post(CHAT, json={"model": "kvdb", "messages": ONE, "presence_penalty": 1.0}).json()["error"]
        assert "presence_penalty" in refused["message"] and "leave it out" in refused["message"]
        typo = client.post(CHAT, json={"model": "kvdb", "messages": ONE, "max_token": 2}).json()["error"]
        assert "'max_token'" in typo["message"] and "max_tokens" in typo["message"]
        at_defaults = {
            "model": "kvdb",
            "messages": ONE,
            "max_tokens": 2,
            "logprobs": False,
            "frequency_penalty": 0,
            "tools": [],
            "user": "u1",
        }
        assert client.post(CHAT, json=at_defaults).status_code == 200


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        (CHAT, "prompt", "hi"),  # the other endpoint's field: it was ignored
        (TEXT, "messages", ONE),
        (TEXT, "max_completion_tokens", 2),  # ...and honoured
        (TEXT, "top_logprobs", 2),
        (CHAT, "top_logprobs", 2),  # without logprobs: true
        (CHAT, "logprobs", 2),
        (TEXT, "logprobs", 6),
        (TEXT, "logprobs", True),
        (CHAT, "store", True),
        (CHAT, "service_tier", "flex"),
        (CHAT, "modalities", ["text", "audio"]),
        (CHAT, "audio", {"voice": "alloy", "format": "wav"}),
        (CHAT, "prediction", {"type": "content", "content": "hi"}),
        (CHAT, "reasoning_effort", "low"),
        (CHAT, "verbosity", "low"),
        (CHAT, "web_search_options", {}),
        (CHAT, "moderation", {"input": {"mode": "block"}}),
        (CHAT, "parallel_tool_calls", True),
        (TEXT, "suffix", "the end"),
        (TEXT, "best_of", 2),
        (CHAT, "stream_options", {"include_usage": True, "include_obfuscation": True}),  # it was ignored
        (CHAT, "stream_options", {"include_usag": True}),
        (CHAT, "kvdb", {"sesion": "story"}),
    ],
)
def test_a_field_not_honoured_is_refused_by_name(served_story, path, field, value):
    body = {"model": "kvdb", "max_tokens": 2} | ({"messages": ONE} if path == CHAT else {"prompt": "hi"})
    with served_story.http() as client:
        response = client.post(path, json=body | {field: value})
    assert response.status_code == 400, response.text
    assert field in response.json()["error"]["message"] or (
        field == "kvdb" and "sesion" in response.json()["error"]["message"]
    )


@pytest.mark.parametrize(
    ("path", "fields"),
    [
        (
            CHAT,
            {
                "store": False,
                "service_tier": "auto",
                "metadata": {"k": "v"},
                "safety_identifier": "u1",
                "prompt_cache_key": "c1",
            },
        ),
        (
            CHAT,
            {
                "prompt_cache_retention": "24h",
                "modalities": ["text"],
                "stream_options": {"include_obfuscation": False},
                "top_logprobs": 0,
            },
        ),
        (TEXT, {"echo": False, "best_of": 1, "suffix": None, "logprobs": None, "user": "u1"}),
    ],
)
def test_fields_that_ask_nothing_of_the_reply_pass(served_story, path, fields):
    body = {"model": "kvdb", "max_tokens": 2} | ({"messages": ONE} if path == CHAT else {"prompt": "hi"})
    with served_story.http() as client:
        response = client.post(path, json=body | fields)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("chat", [True, False])
def test_every_field_of_the_openai_request_schema_is_read_or_refused_by_name(chat):
    """The official client's request fields: each one this endpoint reads (honoured, refused
    unless it asks nothing, or let be) is in parse's lists; a field the client gains is then
    noticed here, not left to the catch-all "unknown field"."""
    schema = set((chat_params if chat else text_params).CompletionCreateParamsBase.__annotations__) | {"stream"}
    read = parse.HONOURED | parse.IGNORED | set(parse.NOT_HONOURED) | (parse.CHAT_ONLY if chat else parse.TEXT_ONLY)
    assert schema - read == set()
    assert schema & (parse.TEXT_ONLY if chat else parse.CHAT_ONLY) == set()


def test_the_requested_model_is_echoed_and_the_served_one_answers_by_id(served_story):
    reply = served_story.openai().chat.completions.create(model="any-name-the-client-uses", messages=ONE, max_tokens=2)
    assert reply.model == "any-name-the-client-uses"
    served = served_story.get("/v1/models")["data"][0]["id"]
    assert served_story.get(f"/v1/models/{served}")["id"] == served


@pytest.fixture(scope="module")
def served_story(tmp_path_factory, tiny_loaded, start_server):
    """One server for the refusals above (over an archive holding a short text session, "story")."""
    db = tmp_path_factory.mktemp("errors") / "serve.duckdb"
    with kvdb.open(db, model=tiny_loaded) as archive:
        archive.ingest(text="a short story", name="story")
    running = start_server(db)
    yield running
    running.stop()


def test_a_full_queue_is_refused_and_reads_do_not_wait(serve, tmp_path):
    running = serve(queue=0)
    with running.http() as client, client.stream("POST", CHAT, json=LONG) as long:
        lines = long.iter_lines()  # kept: an iterator dropped closes the response, which cancels the reply
        next(lines)  # the model is taken: the reply has begun
        began = time.monotonic()
        assert client.get("/api/sessions").status_code == 200 and client.get("/api/stats").status_code == 200
        assert time.monotonic() - began < 2  # reads answered while the model generates
        refused = client.post(CHAT, json={"model": "kvdb", "messages": ONE, "max_tokens": 2})
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "queue_full" and "--queue" in refused.json()["error"]["message"]
    _still_serving(running)  # the stream closed: its reply cancelled, the model free again

    waiting = serve(tmp_path / "waiting.duckdb", queue=1, queue_timeout=0.2)
    with waiting.http() as client, client.stream("POST", CHAT, json=LONG) as long:
        lines = long.iter_lines()
        next(lines)
        refused = client.post(CHAT, json={"model": "kvdb", "messages": ONE, "max_tokens": 2})
        assert refused.status_code == 429 and "--queue-timeout" in refused.json()["error"]["message"]
    _still_serving(waiting)


def test_a_bad_keep_is_refused_at_start_and_the_archive_let_go(tmp_path, tiny_loaded):
    """Every exchange would otherwise be set aside in the journal, one error per reply."""
    from kvdb.errors import InvalidArgument
    from kvdb.serving import Engine

    db = tmp_path / "a.duckdb"
    with pytest.raises(InvalidArgument, match="unknown tier"):
        Engine(kvdb.open(db, model=tiny_loaded), keep="tokens,kvv")
    with pytest.raises(InvalidArgument, match="faithful, balanced, compact"):
        Engine(kvdb.open(db, model=tiny_loaded), keep="tokens,kv", kv_preset="tiny")
    with kvdb.open(db, model=tiny_loaded) as archive:  # not held by the refused engines
        assert archive.sessions() == []


def test_tier_k_is_made_ready_at_start_with_the_shipped_codebooks(tmp_path, tiny_loaded, monkeypatch):
    from kvdb.services import shipped_codebooks as shipped
    from kvdb.serving import Engine

    monkeypatch.setenv("KVDB_CACHE", str(tmp_path / "cache"))  # a machine that has not built them
    assert not shipped.is_built(tiny_loaded.identity)
    Engine(kvdb.open(tmp_path / "a.duckdb", model=tiny_loaded), keep="tokens,kv").close()
    assert shipped.is_built(tiny_loaded.identity)

"""The archive over HTTP: the bodies are the records' to_dict(), with a session's turns cut at
the chat template's turn openings, and search hits split for highlighting."""

from __future__ import annotations

import pytest

import kvdb
from kvdb.index.phrase import Hit
from kvdb.serving import SessionView

CHAT = [
    {"role": "user", "content": "Where is the lighthouse?"},
    {"role": "assistant", "content": "On the cliff by the harbour."},
]
STORY = "The lighthouse keeper counted the ships every night."


def test_sessions_views_search_stats_and_models(serve, tmp_path, tiny_loaded, tiny_model):
    db = tmp_path / "serve.duckdb"
    with kvdb.open(db, model=tiny_loaded) as archive:
        archive.ingest(messages=CHAT, name="chat")
        archive.ingest(text=STORY, name="story")
        sessions = [c.to_dict() for c in archive.conversations()]  # each conversation once, the latest first
        expected_stats = archive.stats().to_dict()
    running = serve(db=db)
    assert running.get("/api/sessions") == {"sessions": sessions}
    assert running.get("/api/stats").keys() == expected_stats.keys()
    assert [m.id for m in running.openai().models.list().data] == [tiny_model]  # the model, here also the embedder

    view = running.get("/api/sessions/chat")
    assert (
        set(view) == {*SessionView.__dataclass_fields__, "side"}
        and view["session"]["name"] == "chat"
        and view["side"] == {}
    )
    assert [t["role"] for t in view["turns"]] == ["user", "assistant"]
    assert [t["text"] for t in view["turns"]] == [
        m["content"] for m in CHAT
    ]  # what was said, without the template's markup
    assert view["turns"][-1]["end"] == view["end"] == view["session"]["n_tokens"] and "<|im_start|>user" in view["text"]
    assert CHAT[1]["content"] in view["turns"][1]["text"] and CHAT[0]["content"] in view["turns"][0]["text"]
    cut = view["turns"][1]["start"]
    part = running.get("/api/sessions/chat", start=cut - 3, end=cut + 5)
    assert (part["start"], part["end"]) == (cut - 3, cut + 5) and [
        (t["role"], t["start"], t["end"]) for t in part["turns"]
    ] == [("user", cut - 3, cut), ("assistant", cut, cut + 5)]
    story = running.get("/api/sessions/story")
    assert story["text"] == STORY and story["turns"] == [{"role": None, "text": STORY, "start": 0, "end": len(STORY)}]

    [hit, *_] = running.get("/api/search", q="counted the ships", k=3)["hits"]
    assert set(hit) >= {"before", "match", "after"} and set(hit) == set(_a_hit().to_dict())
    assert (
        hit["exact"]
        and hit["name"] == "story"
        and hit["match"] == "counted the ships"
        and hit["before"] + hit["match"] + hit["after"] == hit["context"]
    )
    assert running.get("/api/count", q="Counted The Ships") == {
        "phrase": "Counted The Ships",
        "count": 1,
        "case_sensitive": False,
        "session": None,
    }
    assert running.get("/api/count", q="Counted The Ships", case_sensitive=1)["count"] == 0


def _a_hit() -> Hit:
    return Hit("id", "name", 0, 1, 1, True, "", "x", "")


def test_embeddings_with_the_official_client(start_server, tmp_path, monkeypatch):
    """/v1/embeddings answers with the semantic tier's embedder, the default one here: the
    client's default base64 and plain floats alike, the vectors Archive.embed gives."""
    import numpy as np
    from openai import BadRequestError

    monkeypatch.delenv("KVDB_EMBEDDER")

    db = tmp_path / "e.duckdb"
    running = start_server(db)
    try:
        client = running.openai()
        assert "all-MiniLM-L6-v2" in [
            m.id for m in client.models.list().data
        ]  # the embedder is listed beside the model
        got = client.embeddings.create(model="all-MiniLM-L6-v2", input=["the harbour at dusk", "a recipe for bread"])
        floats = client.embeddings.create(
            model="all-MiniLM-L6-v2", input="the harbour at dusk", encoding_format="float"
        )
        with pytest.raises(BadRequestError, match="this server embeds with 'all-MiniLM-L6-v2'"):
            client.embeddings.create(model="text-embedding-3-small", input="x")
    finally:
        running.stop()
    vectors = np.array([d.embedding for d in got.data])
    assert (
        vectors.shape == (2, 384)
        and np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
        and got.usage.prompt_tokens > 0
    )
    assert np.allclose(floats.data[0].embedding, vectors[0], atol=1e-6)
    with kvdb.open(db) as archive:
        local, _ = archive.embed(["the harbour at dusk"])
    assert np.allclose(local[0], vectors[0], atol=1e-5)


def test_conversations_are_paged_with_limit_and_offset(serve, tmp_path, tiny_loaded):
    db = tmp_path / "serve.duckdb"
    with kvdb.open(db, model=tiny_loaded) as archive:
        archive.ingest(messages=CHAT, name="chat")
        archive.ingest(text=STORY, name="story")
        every = [c.to_dict() for c in archive.conversations()]
    running = serve(db=db)
    assert running.get("/api/conversations") == {"conversations": every, "total": 2}  # the page's request: all of them
    assert running.get("/api/conversations", limit=1) == {"conversations": every[:1], "total": 2, "next_offset": 1}
    assert running.get("/api/conversations", limit=1, offset=1) == {"conversations": every[1:], "total": 2}
    assert running.get("/api/conversations", agent="text") == {
        "conversations": [c for c in every if c["agent"] == "text"],
        "total": 1,
    }

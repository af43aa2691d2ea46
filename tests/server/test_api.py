"""The archive over HTTP: the bodies are the records' to_dict(), with a session's turns cut at
the chat template's turn openings, and search hits split for highlighting."""

from __future__ import annotations

import kvdb
from kvdb.index.phrase import Hit
from kvdb.serving import SessionView

CHAT = [{"role": "user", "content": "Where is the lighthouse?"}, {"role": "assistant", "content": "On the cliff by the harbour."}]
STORY = "The lighthouse keeper counted the ships every night."


def test_sessions_views_search_stats_and_models(serve, tmp_path, tiny_loaded, tiny_model):
    db = tmp_path / "serve.duckdb"
    with kvdb.open(db, model=tiny_loaded) as archive:
        archive.ingest(messages=CHAT, name="chat")
        archive.ingest(text=STORY, name="story")
        sessions = [s.to_dict() for s in archive.sessions()]
        expected_stats = archive.stats().to_dict()
    running = serve(db=db)
    assert running.get("/api/sessions") == {"sessions": sessions}
    assert running.get("/api/stats").keys() == expected_stats.keys()
    assert [m.id for m in running.openai().models.list().data] == [tiny_model]

    view = running.get("/api/sessions/chat")
    assert set(view) == {*SessionView.__dataclass_fields__, "side"} and view["session"]["name"] == "chat" and view["side"] == {}
    assert [t["role"] for t in view["turns"]] == ["user", "assistant"]
    assert "".join(t["text"] for t in view["turns"]) == view["text"] and view["turns"][-1]["end"] == view["end"] == view["session"]["n_tokens"]
    assert CHAT[1]["content"] in view["turns"][1]["text"] and CHAT[0]["content"] in view["turns"][0]["text"]
    cut = view["turns"][1]["start"]
    part = running.get("/api/sessions/chat", start=cut - 3, end=cut + 5)
    assert (part["start"], part["end"]) == (cut - 3, cut + 5) and [(t["role"], t["start"], t["end"]) for t in part["turns"]] == [("user", cut - 3, cut), ("assistant", cut, cut + 5)]
    story = running.get("/api/sessions/story")
    assert story["text"] == STORY and story["turns"] == [{"role": None, "text": STORY, "start": 0, "end": len(STORY)}]

    [hit, *_] = running.get("/api/search", q="counted the ships", k=3)["hits"]
    assert set(hit) >= {"before", "match", "after"} and set(hit) == set(_a_hit().to_dict())
    assert hit["exact"] and hit["name"] == "story" and hit["match"] == "counted the ships" and hit["before"] + hit["match"] + hit["after"] == hit["context"]


def _a_hit() -> Hit:
    return Hit("id", "name", 0, 1, 1, True, "", "x", "")

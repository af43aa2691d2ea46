"""What the semantic tier embeds of a session (decision 0054): what its people said, not what
their tools gave back; each chunk still a run of the session's tokens, so a hit restores."""

from __future__ import annotations

import json

import numpy as np
import pytest

import kvdb
from kvdb.model import tokenizer as tok
from kvdb.model.embedder import Embedder
from kvdb.services.semantic_tier import said

DUMP = " ".join(f"zebra{k}" for k in range(60))  # a file's kilobytes: in a call's arguments and a tool's result
AGENT = [
    {"role": "user", "content": "Why does the harbour ferry timetable test fail?"},
    {
        "role": "assistant",
        "content": "Let me read the timetable module.",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "write_file", "arguments": json.dumps({"path": "timetable.py", "content": DUMP})},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "name": "write_file", "content": DUMP},
    {"role": "assistant", "content": "The ferry leaves at dusk, not dawn: the test expects dawn."},
]


@pytest.fixture
def db(tmp_path, tiny_loaded, tiny_model):
    with kvdb.open(tmp_path / "a.duckdb", model=tiny_loaded, embedder=Embedder(tiny_model)) as archive:
        yield archive


def test_the_tier_embeds_what_was_said_and_leaves_tool_output_out(db, tiny_model):
    session = db.ingest(messages=AGENT, name="ferry")[0]
    ids = np.asarray(db.tokens(session.session_id), dtype=np.int64)
    spans, texts = said(tok.load_full(tiny_model), ids)
    text = "\n".join(texts)
    for words in ("harbour ferry timetable", "Let me read the timetable module.", "leaves at dusk"):
        assert words in text
    assert "zebra" not in text and "write_file" not in text
    assert spans[:, 1].sum() - spans[:, 0].sum() < len(ids) / 3  # the dumps held most of the tokens
    assert np.all((0 <= spans[:, 0]) & (spans[:, 0] < spans[:, 1]) & (spans[:, 1] <= len(ids)))
    db.upkeep(only="semantic")
    [hit] = db.search_meaning("ferry leaves at dusk", k=1)
    assert hit.session_id == session.session_id and [hit.position, hit.position + hit.match_tokens] in spans.tolist()


def test_a_session_without_tools_is_embedded_whole(tiny_model):
    tokenizer = tok.load_full(tiny_model)
    text = "The harbour lights were lit at dusk. " * 60
    ids = np.asarray(tok.encode(tokenizer, text), dtype=np.int64)
    spans, texts = said(tokenizer, ids)
    assert spans[0, 0] == 0 and spans[-1, 1] == len(ids) and len(spans) == len(texts) > 1

"""Every export fixture, as its own tool wrote it, comes back whole: each string its tool calls
text (the keys in the folder's ``text-keys.toml``) is in the rendering of the file's sessions,
in a session's name, or in a side field (``metadata["side"]``, which ``show --json`` returns).

Read without a model: the rendering is the chat template of the embedded default's tokenizer,
the one ``ingest`` writes with, so what is checked here is what the archive holds.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from support import REPO

from kvdb.model import chat
from kvdb.model import tokenizer as tok
from kvdb.transcripts import SUPPORTED_SUFFIXES, iter_transcripts

EXPORTS = REPO / "tests" / "fixtures" / "exports"
FIXTURES = sorted(p for p in EXPORTS.rglob("*") if p.suffix in SUPPORTED_SUFFIXES and p.suffix not in (".md", ".txt"))


def text_keys(folder: Path) -> set[str]:
    return set(tomllib.loads((folder / "text-keys.toml").read_text(encoding="utf-8"))["keys"])


def texts_under(value, keys: set[str], key=None):
    """Every non-empty string under one of ``keys``, however deep (a list under a key counts as the key)."""
    if isinstance(value, str):
        if key in keys and value.strip():
            yield value
    elif isinstance(value, list):
        for item in value:
            yield from texts_under(item, keys, key)
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from texts_under(v, keys, k)


def comes_back(text: str, held: str) -> bool:
    """Whether ``text`` is in ``held``, as written or escaped inside the JSON text of a tool
    call's arguments; a text that is itself a JSON object (a dataset's tool
    call, ``{"name": ..., "arguments": {...}}``, read as a structured call) comes back when
    each of its values does: a string as written, anything else as JSON text."""
    if (
        text in held or json.dumps(text, ensure_ascii=False)[1:-1] in held
    ):  # a tool call's arguments: JSON text, its strings escaped
        return True
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return (
        isinstance(value, dict)
        and bool(value)
        and all((v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)) in held for v in value.values())
    )


def strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from strings(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from strings(item)


def parsed(path: Path):
    text = path.read_text(encoding="utf-8-sig")
    if path.suffix == ".jsonl":
        rows = []
        for line in text.splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:  # a malformed line the fixture holds on purpose: skipped and named
                continue
        return rows
    return json.loads(text)


def test_every_fixture_folder_says_which_keys_hold_text():
    assert FIXTURES
    for folder in {p.parent for p in FIXTURES}:
        assert text_keys(folder), folder


def fixture_id(path: Path) -> str:
    return f"{path.parent.name}/{path.name}"


@pytest.mark.parametrize("path", FIXTURES, ids=fixture_id)
def test_every_text_of_a_fixture_comes_back(path):
    tokenizer = tok.load_full(None)
    skipped: list[dict] = []
    sessions = list(iter_transcripts(path, skipped=skipped))
    assert sessions
    held = "\n".join(
        [chat.render(tokenizer, s.messages) if s.messages is not None else s.text for s in sessions]
        + [s.name for s in sessions]
        + [text for s in sessions for text in strings(s.metadata.get("side", {}))]
    )
    texts = list(texts_under(parsed(path), text_keys(path.parent)))
    assert texts
    lost = [text for text in texts if not comes_back(text, held)]
    assert not lost, f"{len(lost)} of {len(texts)} texts lost, the first: {lost[0][:200]!r}"

"""A format is one module, found through one hook: the built-ins register through it, a package
adds a format through the "kvdb.formats" entry point group, and `kvdb formats` lists them."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
from click.testing import CliRunner
from support import conversation_texts, write

import kvdb
from kvdb.errors import FormatPluginError, TranscriptError
from kvdb.transcripts import formats, read_transcripts


@pytest.fixture
def plugin_path(tmp_path, monkeypatch):
    """A folder on sys.path where a test installs a distribution (its dist-info and module), with the
    registry read again before and after."""
    monkeypatch.syspath_prepend(str(tmp_path))
    formats.registered.cache_clear()
    yield tmp_path
    formats.registered.cache_clear()
    for name in [m for m in sys.modules if m.startswith("kvdb_format_")]:
        del sys.modules[name]


def install(folder, module: str, code: str) -> None:
    write(folder / f"{module}.py", textwrap.dedent(code))
    info = folder / f"{module}-0.1.dist-info"
    write(info / "METADATA", f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n")
    write(info / "entry_points.txt", f"[kvdb.formats]\nmine = {module}\n")


@pytest.mark.parametrize("known", formats.registered(), ids=lambda f: f.name)
def test_every_format_reads_its_own_example_whole(tmp_path, known):
    path = write(tmp_path / f"example{known.suffix}", known.example)
    sessions = read_transcripts(path)
    rows = (
        [json.loads(line) for line in known.example.splitlines()]
        if known.suffix == ".jsonl"
        else json.loads(known.example)
    )
    texts = list(conversation_texts(rows))
    held = json.dumps([[s.name, s.messages] for s in sessions], ensure_ascii=False)
    assert sessions and texts and all(json.dumps(t, ensure_ascii=False)[1:-1] in held for t in texts)


def test_the_built_ins_register_through_the_hook_in_order():
    names = [f.name for f in formats.registered()]
    assert (
        names[: len(formats.BUILT_IN)]
        == [
            "gemini-cli",
            "codex-cli",
            "claude-code",
            "chatgpt",
            "sillytavern",
            "claude-ai",
            "open-webui",
            "grok",
            "ai-studio",
            "messages",
            "sharegpt",
            "lmsys",
            "alpaca",
            "openai-responses",
        ][: len(names)]
    )
    assert len(set(names)) == len(names)


def test_a_package_adds_a_format_through_an_entry_point(plugin_path, tmp_path):
    install(plugin_path, "kvdb_format_notes", '''
        from kvdb.transcripts.formats import Format
        from kvdb.transcripts.messages import Conversation
        from kvdb.transcripts.sessions import chat

        class Notes(Format):
            name = "notes-app"
            reads = "a notes app's export"
            example = '{"note_title": "t", "lines": ["a", "b"]}'
            marks = ("note_title", "lines")

            def claims(self, obj):
                return isinstance(obj, dict) and "note_title" in obj

            def read(self, obj, name, source):
                conversation = Conversation()
                for line in obj["lines"]:
                    conversation.add_text("user", line)
                return [chat(obj["note_title"], source, conversation, {"format": self.name})]

        def register(add):
            add(Notes())
    ''')  # fmt: skip
    assert formats.registered()[0].name == "notes-app"  # plugins are asked first
    [session] = read_transcripts(write(tmp_path / "n.json", '{"note_title": "Shopping", "lines": ["milk", "eggs"]}'))
    assert (session.name, session.metadata["format"], [m["content"] for m in session.messages]) == (
        "Shopping",
        "notes-app",
        ["milk", "eggs"],
    )
    listed = CliRunner().invoke(cli_main(), ["formats", "--json"])
    assert listed.exit_code == 0 and json.loads(listed.stdout.splitlines()[0])["name"] == "notes-app"


def test_a_broken_plugin_is_named(plugin_path):
    install(plugin_path, "kvdb_format_broken", "def register(add):\n    raise RuntimeError('boom')\n")
    with pytest.raises(FormatPluginError, match=r"'mine' \(kvdb_format_broken\) failed to load: boom"):
        formats.registered()


def test_an_object_of_no_known_shape_names_the_closest_format(tmp_path):
    path = write(tmp_path / "odd.json", '{"title": "Trip", "current_node": "n1", "nodes": {}}')
    with pytest.raises(TranscriptError) as caught:
        read_transcripts(path)
    assert "the closest is chatgpt" in caught.value.reason and '"mapping"' in caught.value.reason
    with pytest.raises(TranscriptError, match="no session of any format"):
        read_transcripts(write(tmp_path / "none.json", '{"colour": "blue"}'))


def test_formats_lists_each_with_what_it_reads_and_its_example():
    runner = CliRunner()
    listed = runner.invoke(cli_main(), ["formats", "--json"])
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert listed.exit_code == 0 and [r["name"] for r in rows] == [f.name for f in kvdb.formats()]
    assert all(r["reads"] and r["example"] for r in rows)
    example = runner.invoke(cli_main(), ["formats", "--example", "chatgpt"])
    assert example.exit_code == 0 and json.loads(example.stdout)[0]["title"] == "Greeting"
    unknown = runner.invoke(cli_main(), ["formats", "--example", "nope"])
    assert unknown.exit_code == 2 and "known: gemini-cli, codex-cli, claude-code" in unknown.output


def cli_main():
    from kvdb.cli.main import main

    return main


def test_the_readme_table_lists_every_built_in_format_with_examples():
    from support import REPO

    readme = (REPO / "docs" / "transcripts.md").read_text(encoding="utf-8")
    table = readme[readme.index("# Transcript formats") :].split("\n\n")[2]
    rows = {line.split("|")[1].strip().strip("`"): line.split("|")[4].strip() for line in table.splitlines()[2:]}
    assert {f.name for f in formats.registered()} <= set(rows)
    assert all(rows.values())

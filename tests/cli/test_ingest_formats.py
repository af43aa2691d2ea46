"""Transcripts of every format through `kvdb ingest`: parsed before the model loads, the
placeholders counted in the result, and other encodings read or refused with the fix."""

import codecs
import json

import pytest
from click.testing import CliRunner
from support import EXAMPLES, write

from kvdb.cli.main import main


def invoke(tmp_path, *args, model):
    return CliRunner().invoke(
        main, ["--db", str(tmp_path / "a.duckdb"), *args], env={"KVDB_MODEL": model}, catch_exceptions=False
    )


def test_a_malformed_file_is_refused_before_the_model_loads(tmp_path):
    bad = write(tmp_path / "bad.jsonl", '{"role": "user", "content": "a"}\n{"role": \n')
    result = invoke(tmp_path, "ingest", str(bad), "--strict", "--json", model=str(tmp_path / "no-such-model"))
    [line] = [json.loads(x) for x in result.stdout.splitlines()]
    assert line["status"] == "failed" and line["error"].startswith(f"{bad}:2: invalid JSON: Expecting value")
    assert "cannot load model" not in result.stderr
    assert result.exit_code == 1


@pytest.mark.slow
def test_every_example_format_ingests_with_placeholders_counted(tmp_path, tiny_model):
    result = invoke(tmp_path, "ingest", str(EXAMPLES), "--json", model=tiny_model)
    assert result.exit_code == 0, result.stderr
    lines = [json.loads(x) for x in result.stdout.splitlines()]
    assert {line["status"] for line in lines} == {"ingested"}
    assert [line["dropped"] for line in lines if "dropped" in line] == [{"image": 1}]
    shown = invoke(tmp_path, "show", "Sourdough timing [branch 2]", model=tiny_model)
    assert "How long should sourdough rise?" in shown.stdout


def test_utf16_transcripts_round_trip_and_latin1_is_refused_with_the_fix(tmp_path, tiny_model):
    text = "Grüße aus Köln — 東京\r\n"
    wide = tmp_path / "wide.txt"
    wide.write_bytes(codecs.BOM_UTF16_LE + text.encode("utf-16-le"))
    assert invoke(tmp_path, "ingest", str(wide), model=tiny_model).exit_code == 0
    assert invoke(tmp_path, "show", "wide", model=tiny_model).stdout_bytes.decode() == text
    latin = tmp_path / "latin.txt"
    latin.write_bytes("Grüße aus Köln\n".encode("latin-1"))
    refused = invoke(tmp_path, "ingest", str(latin), model=tiny_model)
    assert refused.exit_code == 1
    assert (
        f"looks like LATIN1 text. Convert it with: iconv -f LATIN1 -t UTF-8 {latin} > converted.txt" in refused.stderr
    )


def test_a_side_field_comes_back_from_show_json(tmp_path, tiny_model):
    """Swipes not taken are no turn the model saw: `show --json` returns them beside the text."""
    chat = write(
        tmp_path / "tavern.jsonl",
        '{"user_name": "User", "character_name": "Aqua", "chat_metadata": {}}\n'
        '{"name": "User", "is_user": true, "mes": "Hi"}\n'
        '{"name": "Aqua", "is_user": false, "mes": "Hello!", "swipe_id": 0, "swipes": ["Hello!", "Good evening."]}\n',
    )
    assert invoke(tmp_path, "ingest", str(chat), model=tiny_model).exit_code == 0
    shown = json.loads(invoke(tmp_path, "show", "tavern", "--json", model=tiny_model).stdout)
    assert "Hello!" in shown["text"] and "Good evening." not in shown["text"]
    assert shown["side"]["alternatives"] == [{"turn": 1, "text": "Good evening."}]

"""RESULTS.md is rendered from the records in benchmarks/results/, each section headed by the
command and arguments that produced it; a rerun replaces its own record and no other."""

from __future__ import annotations

import json
import sys

import pytest
import report

TABLE = """Some words, then a table.

| method | `a|b` | hit@1 |
|---|:---:|---:|
| BM25 \\| session | x | 0.640 |
| tier | y | 0.923 |

Closing words
over two lines."""


def test_results_md_is_rendered_from_the_records():
    assert report.RESULTS.read_text(encoding="utf-8") == report.document(report.RECORDS), (
        "benchmarks/RESULTS.md is stale: run .venv/bin/python benchmarks/report.py"
    )


def test_every_record_names_a_command_that_is_in_the_tree_or_where_it_is():
    """A section without its command is a note about a benchmark that is in the tree."""
    for path in report.RECORDS.glob("*.json"):
        record = json.loads(path.read_text(encoding="utf-8"))
        script = (record["command"] or "").split()[1:2] or [record.get("benchmark")]
        assert script[0], path.name
        in_tree = (report.HERE.parent / script[0]).exists()
        assert in_tree or record.get("revision"), f"{path.name}: {script[0]} is gone and no revision says where it is"
        assert path.stem == report.key(record), f"{path.name} is not named by its command and title"


def test_a_table_is_kept_as_rows_and_rendered_back():
    blocks = report.blocks(TABLE)
    assert blocks[0] == {"text": "Some words, then a table."}
    assert blocks[1] == {
        "columns": ["method", "`a|b`", "hit@1"],
        "align": ["", "leftright", "right"],
        "rows": [["BM25 \\| session", "x", "0.640"], ["tier", "y", "0.923"]],
    }
    assert blocks[2] == {"text": "Closing words\nover two lines."}
    record = {"title": "T", "command": None, "blocks": blocks, "notes": ["A note."]}
    section = report.rendered(record)
    assert section.startswith("## T\n\n") and section.endswith("A note.\n")
    again = {**record, "blocks": report.blocks(section.split("\n", 2)[2]), "notes": []}
    assert report.rendered(again) == section


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["benchmarks/x.py"], ".venv/bin/python benchmarks/x.py"),
        (
            [
                "/abs/benchmarks/x.py",
                "--tokens",
                "1e8",
                "--json",
                "--checkpoint",
                "/tmp/c",
                "--no-results",
                "--out=/tmp/o",
            ],
            ".venv/bin/python benchmarks/x.py --tokens 1e8",
        ),
        (
            ["x.py", "--label", "a b", "--workdir=/w", "--seed", "3"],
            ".venv/bin/python benchmarks/x.py --label 'a b' --seed 3",
        ),
    ],
)
def test_the_command_keeps_what_the_run_measured(argv, expected):
    assert report.command(argv) == expected


def test_a_rerun_replaces_its_record_and_other_arguments_add_one(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(report, "RECORDS", tmp_path / "results")
    monkeypatch.setattr(report, "RESULTS", tmp_path / "RESULTS.md")
    monkeypatch.setattr(sys, "argv", ["benchmarks/tiers.py"])
    report.publish("Storage", ["first run"], data={"n": 1})
    report.publish("Storage", ["second run"], data={"n": 2})
    monkeypatch.setattr(sys, "argv", ["benchmarks/tiers.py", "--chat", "4", "--no-results"])
    report.publish("Storage", "chat run")
    report.publish("Printed only", "never recorded", append=False)
    records = sorted(p.name for p in (tmp_path / "results").glob("*"))
    assert records == ["tiers-chat-4-storage.json", "tiers-storage.json"]
    plain = json.loads((tmp_path / "results" / "tiers-storage.json").read_text())
    assert plain["blocks"] == [{"text": "second run"}] and plain["data"] == {"n": 2}
    text = (tmp_path / "RESULTS.md").read_text()
    assert "## Storage (`.venv/bin/python benchmarks/tiers.py --chat 4`)" in text
    assert "## Storage (`.venv/bin/python benchmarks/tiers.py`)" in text
    assert "first run" not in text and "chat run" in text and "never recorded" not in text
    assert "never recorded" in capsys.readouterr().out

"""`kvdb sql`: a table by default, the result's to_dict() with --json, a query from stdin, and bad
SQL or a write as one line and exit status 2 (text, or a JSON object under --json)."""

from __future__ import annotations

import json

from click.testing import CliRunner

import kvdb
from kvdb.cli.main import main


def test_kvdb_sql_prints_a_table_json_and_one_line_errors(tmp_path, tiny_model):
    db = str(tmp_path / "cli.duckdb")
    with kvdb.open(db, model=tiny_model) as archive:
        archive.ingest(text="The harbour master keeps the ledger.", name="notes")
        archive.ingest(text="A lamp room, and a harbour master's log.", name="lamp")
        expected = archive.sql("select title, n_tokens, said_at from conversations order by title").to_dict()
    runner = CliRunner()

    def run(*args, stdin=None):
        return runner.invoke(
            main, ["--db", db, "sql", *args], env={"KVDB_MODEL": tiny_model}, input=stdin, catch_exceptions=False
        )

    shown = run("select title, n_tokens, said_at from conversations order by title")
    assert shown.exit_code == 0, shown.output
    lines = shown.stdout.splitlines()
    assert lines[0].split() == ["title", "n_tokens", "said_at"] and set(lines[1]) == {"-", " "}
    assert [line.split()[0] for line in lines[2:4]] == ["lamp", "notes"] and lines[-1] == "(2 rows)"

    as_json = run("select title, n_tokens, said_at from conversations order by title", "--json")
    assert as_json.exit_code == 0 and json.loads(as_json.stdout) == expected

    hits = run(
        "-",
        "--json",
        stdin=(
            "select c.title, h.exact from search('harbour master') h "
            "join conversations c using (conversation_id) order by 1"
        ),
    )
    assert json.loads(hits.stdout)["rows"] == [["lamp", True], ["notes", True]]

    bad = run("selec 1")
    assert (
        bad.exit_code == 2
        and bad.stdout == ""
        and bad.stderr == 'kvdb: error: SQL: Parser Error: syntax error at or near "selec"\n'
    )
    write = run("delete from sessions", "--json")
    refused = json.loads(write.stderr)
    assert write.exit_code == 2 and refused["type"] == "QueryRefused" and "DELETE" in refused["error"]
    assert len(json.loads(run("select * from sessions", "--json").stdout)["rows"]) == 2  # nothing deleted

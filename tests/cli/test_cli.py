"""The CLI through click's runner, and once through the installed `kvdb` script."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from support import write, write_jsonl

from kvdb.cli.main import main
from kvdb.errors import AmbiguousSession, SessionNotFound

TEXT = "Line one — ünïcode ☕\nline two\n"


@pytest.fixture
def run(tmp_path, tiny_model):
    db = str(tmp_path / "cli.duckdb")
    runner = CliRunner()

    def invoke(*args, model=True):
        argv = ["--db", db, *args]
        env = {"KVDB_MODEL": tiny_model} if model else {}
        return runner.invoke(main, argv, env=env, catch_exceptions=False)

    return invoke


def lines(result):
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


def test_ingest_sessions_show_restore_stats_delete(run, tmp_path):
    story = write(tmp_path / "t" / "story.txt", TEXT)
    write_jsonl(
        tmp_path / "t" / "chat.jsonl", [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    )

    ingested = run("ingest", str(tmp_path / "t"), "--json")
    assert ingested.exit_code == 0, ingested.output
    rows = lines(ingested)
    assert {r["name"] for r in rows} == {"story", "chat"}
    assert all(set(r) == {"session_id", "name", "source", "n_tokens", "status", "new_tokens", "seconds"} for r in rows)
    assert all(r["status"] == "ingested" and r["new_tokens"] == r["n_tokens"] and r["seconds"] > 0 for r in rows)

    again = lines(run("ingest", str(story), "--json"))
    assert [r["status"] for r in again] == ["unchanged"]

    listed = lines(run("sessions", "--json"))
    assert {r["name"] for r in listed} == {"story", "chat"}
    conversation = {"conversation_id", "title", "updated_at", "versions", "branches", "agent", "project"}
    assert all(
        set(r)
        == {"session_id", "name", "source", "n_tokens", "created_at", "said_at", "part", "upstream"} | conversation
        for r in listed
    )
    assert all(
        r["said_at"] == r["updated_at"] and r["part"] is None for r in listed
    )  # files with no times of their own, within the context
    assert all(r["versions"] == 1 and r["title"] == r["name"] for r in listed)
    assert {r["source"] for r in listed} == {str(story), str(tmp_path / "t" / "chat.jsonl")}

    shown = run("show", "story")
    assert shown.exit_code == 0 and shown.stdout == TEXT
    part = lines(run("show", "story", "--start", "0", "--end", "4", "--json"))[0]
    assert part["start"] == 0 and part["end"] == 4 and len(part["tokens"]) == 4 and TEXT.startswith(part["text"])

    restored = lines(run("restore", "chat", "--prompt", "more?", "--max-new-tokens", "3", "--json"))[0]
    assert set(restored) == {
        "session_id",
        "mode",
        "restored_tokens",
        "seconds",
        "reason",
        "preset_fidelity",
        "window",
        "text",
    }
    assert restored["mode"] == "exact" and restored["restored_tokens"] == next(
        r["n_tokens"] for r in rows if r["name"] == "chat"
    )
    assert (
        restored["reason"] == "not every token restored has tier K: prefilled exactly"
        and restored["preset_fidelity"] is None
        and restored["window"] is None
    )

    at = lines(run("restore", "story", "--at", "5", "--max-new-tokens", "2", "--json"))[0]
    assert at["restored_tokens"] == 5

    stats = lines(run("stats", "--json"))[0]
    assert stats["sessions"] == 2 and stats["tokens"] == sum(r["n_tokens"] for r in rows)
    assert 0 < stats["bytes_per_token"]["tokens"] < 4.0

    deleted = run("delete", "story", "--json")
    assert lines(deleted)[0]["status"] == "deleted"
    assert [r["name"] for r in lines(run("sessions", "--json"))] == ["chat"]


def test_failed_file_reports_line_and_exit_status(run, tmp_path):
    write(tmp_path / "ok.txt", "fine\n")
    write(tmp_path / "broken.json", '{"messages": [\n  {"role": "user", "content": "x"},\n  oops\n]}')
    result = run("ingest", str(tmp_path / "ok.txt"), str(tmp_path / "broken.json"), "--json")
    assert result.exit_code == 1
    by_status = {r["status"]: r for r in lines(result)}
    assert by_status["ingested"]["name"] == "ok"
    assert "broken.json:3" in by_status["failed"]["error"]


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["show", "nothing-like-this"], 3, "no session matches"),
        (["ingest", "/no/such/path.txt"], 1, "no such file"),  # fails alone; other paths would still ingest
        (["restore", "nothing-like-this"], 3, "no session matches"),
        (["delete", "nothing-like-this"], 3, "no session matches"),
    ],
)
def test_errors_are_one_line_with_exit_code(run, args, code, message):
    assert run("gc").exit_code == 0  # an empty archive: reading a missing one is its own error
    result = run(*args)
    assert result.exit_code == code
    assert result.stderr.count("\n") == 1 and message in result.stderr and "Traceback" not in result.stderr


def test_out_of_range_and_missing_model(run, tmp_path):
    write(tmp_path / "s.txt", "short\n")
    assert run("ingest", str(tmp_path / "s.txt")).exit_code == 0
    bad = run("show", "s", "--end", "999")
    assert bad.exit_code == 2 and "outside session" in bad.stderr
    missing = CliRunner().invoke(
        main, ["--db", str(tmp_path / "x.duckdb"), "ingest", str(tmp_path / "s.txt"), "--model", str(tmp_path / "nope")]
    )
    assert missing.exit_code == 4 and "cannot load model" in missing.stderr


@pytest.mark.slow
def test_real_script_in_subprocess(tmp_path, tiny_model):
    script = Path(sys.executable).with_name("kvdb")
    story = write(tmp_path / "story.md", TEXT)
    env = dict(os.environ, KVDB_DB=str(tmp_path / "sub.duckdb"), KVDB_MODEL=tiny_model)
    ingest = subprocess.run(
        [str(script), "ingest", str(story), "--json"], env=env, capture_output=True, text=True, timeout=300
    )
    assert ingest.returncode == 0, ingest.stderr
    assert json.loads(ingest.stdout)["status"] == "ingested"
    show = subprocess.run([str(script), "show", "story"], env=env, capture_output=True, timeout=300)
    assert show.returncode == 0 and show.stdout == TEXT.encode()
    missing = subprocess.run([str(script), "show", "zzz"], env=env, capture_output=True, text=True, timeout=300)
    assert missing.returncode == 3 and missing.stderr.startswith("kvdb: error:") and "Traceback" not in missing.stderr


def test_reading_a_missing_archive_creates_nothing(tmp_path):
    """A typo in --db is an error (exit 5), and leaves neither the file nor its folder behind."""
    typo = tmp_path / "no-such-folder" / "typo.duckdb"
    result = CliRunner().invoke(main, ["--db", str(typo), "sessions"])
    assert result.exit_code == 5 and "no archive at" in result.stderr
    import kvdb
    from kvdb.errors import ArchiveError

    with pytest.raises(ArchiveError, match="kvdb ingest"):
        kvdb.open(typo, read_only=True)
    assert not typo.parent.exists()


def test_one_bad_path_in_a_batch_fails_alone(run, tmp_path):
    good = write(tmp_path / "good.txt", TEXT)
    odd = write(tmp_path / "notes.pdf", "not a transcript")
    result = run("ingest", str(good), str(tmp_path / "missing.txt"), str(odd), "--json")
    assert result.exit_code == 1
    by_source = {r["source"]: r for r in lines(result)}
    assert by_source[str(good)]["status"] == "ingested"
    assert "no such file" in by_source[str(tmp_path / "missing.txt")]["error"]
    assert by_source[str(odd)]["status"] == "failed" and len(by_source) == 3


def test_a_model_that_is_not_here_fails_at_once_offline(tmp_path):
    """No download at run time: kvdb's loading stays off the hub unless the user says otherwise,
    so an unknown --model is one error line (exit 4), not a minute of retries; and importing or
    using kvdb leaves the host process's environment (and its own hub access) alone."""
    code = (
        "import os, kvdb, huggingface_hub.constants as c; from kvdb.model import tokenizer; tokenizer.load(); "
        "print('HF_HUB_OFFLINE' in os.environ, c.HF_HUB_OFFLINE)"
    )
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.stdout.split() == ["False", "False"], done.stderr[-2000:]
    result = CliRunner().invoke(
        main,
        [
            "--db",
            str(tmp_path / "a.duckdb"),
            "ingest",
            str(write(tmp_path / "t.txt", TEXT)),
            "--model",
            "no-such-org/no-such-model",
        ],
    )
    assert result.exit_code == 4, result.output
    assert "Retrying" not in result.output and "no-such-org/no-such-model" in result.output


# Issue 13's rough edges ------------------------------------------------------------------


def test_search_hits_name_their_session_and_only_full_matches_succeed(run, tmp_path):
    assert (
        run(
            "ingest", str(write(tmp_path / "harbour.txt", "The keeper watched the harbour lights at dusk.\n"))
        ).exit_code
        == 0
    )
    mixed = run("search", "harbour lights", "-k", "10", "--min-share", "0", "--each-occurrence", "--json")
    assert mixed.exit_code == 0  # one full match is enough; the partial ones come after it
    rows = lines(mixed)
    assert {r["name"] for r in rows} == {"harbour"}
    assert rows[0]["exact"] and not rows[0]["partial"] and any(r["partial"] for r in rows)
    shares = [r["match_tokens"] / r["query_tokens"] for r in rows if r["partial"]]
    default = lines(
        run("search", "harbour lights", "-k", "10", "--json")
    )  # partial hits on under half the phrase left out
    assert (
        default == [r for r in rows if not r["partial"] or r["match_tokens"] / r["query_tokens"] >= 0.5]
        and min(shares) < 0.5
    )
    assert run("search", "harbour lights", "--min-share", "1.5").exit_code == 2

    partial = run("search", "zebra lights", "--json")
    assert partial.exit_code == 1 and lines(partial)  # printed, but no occurrence of the phrase
    assert all(r["partial"] and not r["exact"] for r in lines(partial))
    shown = run("search", "zebra lights")
    assert shown.exit_code == 1 and "[partial: " in shown.stdout and "[exact]" not in shown.stdout

    counted = run("search", "Harbour Lights", "--count")
    assert counted.exit_code == 0 and counted.stdout.strip() == "1"  # the other casing, counted once
    assert lines(run("search", "harbour lights", "--count", "--case-sensitive", "--json")) == [
        {"phrase": "harbour lights", "count": 1, "case_sensitive": True, "session": None}
    ]
    none = run("search", "zebra lights", "--count")
    assert none.exit_code == 1 and none.stdout.strip() == "0"
    refused = run("search", "harbour", "--count", "--semantic")
    assert refused.exit_code == 2 and "--semantic" in refused.output
    assert "no full match" in shown.stderr


def test_listings_escape_control_characters_but_show_and_json_do_not(run, tmp_path):
    crlf = "harbour lights\r\nsecond line\r\n"
    odd = write(tmp_path / "odd\x1b[31mname.txt", crlf)
    assert run("ingest", str(odd)).exit_code == 0
    listed = run("sessions")  # stdout_bytes: click's runner turns the \r\n of .stdout into \n
    assert b"odd\\x1b[31mname" in listed.stdout_bytes and b"\x1b" not in listed.stdout_bytes
    hits = run("search", "lights", "-k", "1", "--context", "4")
    assert (
        b"\\r\\n" in hits.stdout_bytes and b"\r" not in hits.stdout_bytes and len(hits.stdout_bytes.splitlines()) == 2
    )
    assert "\r\n" in lines(run("search", "lights", "-k", "1", "--json"))[0]["context"]
    assert lines(run("sessions", "--json"))[0]["name"] == "odd\x1b[31mname"
    assert run("show", "odd\x1b[31mname").stdout_bytes == crlf.encode()  # the exact text, for pipes

    for tail in ("one", "two"):
        assert (
            run(
                "ingest", str(write(tmp_path / f"{tail}.txt", f"\x07bell shared opening words here, then {tail}"))
            ).exit_code
            == 0
        )
    prefixes = run("prefixes")
    assert b"\\x07bell shared" in prefixes.stdout_bytes and b"\x07" not in prefixes.stdout_bytes


def test_semantic_search_without_the_tier_says_how_to_store_it(run, tmp_path):
    assert run("ingest", str(write(tmp_path / "plain.txt", TEXT)), "--keep", "tokens,search").exit_code == 0
    result = run("search", "line", "--semantic")
    assert result.exit_code == 2 and result.stderr.count("\n") == 1
    assert "semantic tier" in result.stderr and "--keep tokens,search,semantic" in result.stderr
    assert "no match" not in result.stderr


def test_errors_under_json_are_one_json_object_on_stderr(run, tmp_path):
    """Issue 30: a script that asked for --json got prose on failure."""
    assert run("ingest", str(write(tmp_path / "plain.txt", TEXT))).exit_code == 0
    missing = run("show", "no-such-session", "--json")
    assert missing.exit_code == 3 and missing.stdout == ""
    [line] = missing.stderr.splitlines()
    error = json.loads(line)
    assert error["exit_code"] == 3 and error["type"] == "SessionNotFound" and "no-such-session" in error["error"]
    plain = run("show", "no-such-session")
    assert plain.exit_code == 3 and plain.stderr.startswith("kvdb: error: ") and "no-such-session" in plain.stderr


@pytest.mark.slow
def test_the_first_kv_ingest_says_it_builds_the_shipped_codebooks_off_a_terminal(run, tmp_path, monkeypatch):
    """Issue 30: minutes of a one-time build went unsaid when stderr was not a terminal, and were
    charged to the first session's seconds."""
    monkeypatch.setenv("KVDB_CACHE", str(tmp_path / "fresh-cache"))
    first = run("ingest", str(write(tmp_path / "a.txt", TEXT)), "--keep", "tokens,search,kv", "--json")
    assert first.exit_code == 0, first.stderr
    said = [
        line for line in first.stderr.splitlines() if line.startswith("kvdb: shipped codebooks (once per machine): ")
    ]
    assert said and all(" layer " in line and line.endswith("s)") for line in said)
    again = run("ingest", str(write(tmp_path / "b.txt", TEXT + " again")), "--keep", "tokens,search,kv", "--json")
    assert again.exit_code == 0 and "shipped codebooks" not in again.stderr  # built once per machine


def test_sessions_of_one_name_are_listed_with_their_source_and_numbered(run, tmp_path):
    first = write(tmp_path / "a" / "notes.md", "first notes\n")
    second = write(tmp_path / "b" / "notes.md", "second notes\n")
    literal = write(tmp_path / "c" / "notes#2.md", "a name that ends in #2\n")
    for path in (first, second, literal):  # one at a time: oldest first is this order
        assert run("ingest", str(path)).exit_code == 0
    listed = run("sessions")
    assert str(first) in listed.stdout and str(second) in listed.stdout
    assert [r["source"] for r in lines(run("sessions", "--json"))] == [str(first), str(second), str(literal)]

    ambiguous = run("show", "notes")
    assert ambiguous.exit_code == 3 and ambiguous.stderr.count("\n") == 1
    assert f"notes#1 ({first})" in ambiguous.stderr and f"notes#2 ({second})" in ambiguous.stderr
    assert run("show", "notes#1").stdout == "first notes\n"
    assert run("show", "notes#2").stdout == "a name that ends in #2\n"  # an exact name comes first
    past = run("show", "notes#3")
    assert past.exit_code == 3 and "notes#1 to notes#2" in past.stderr


def test_session_number_counts_oldest_first(archive):
    """``name#n`` without a session literally so named: the n-th of that name, oldest first."""
    older = archive.ingest(text="older", name="log")[0].session_id
    newer = archive.ingest(text="newer", name="log")[0].session_id
    assert [archive.session(f"log#{n}").session_id for n in (1, 2)] == [older, newer]
    with pytest.raises(AmbiguousSession, match="log#1 .*log#2"):
        archive.session("log")
    with pytest.raises(SessionNotFound):
        archive.session("log#0")


@pytest.mark.parametrize("command", ["sessions", "gc"])  # read-only, and a write
@pytest.mark.parametrize("kind", ["text", "duckdb"])
def test_a_file_that_is_not_an_archive_is_refused_by_the_name_given(tmp_path, monkeypatch, command, kind):
    import duckdb

    import kvdb
    from kvdb.errors import ArchiveError

    monkeypatch.chdir(tmp_path)
    if kind == "text":
        Path("x.duckdb").write_text("hello\n")
    else:
        con = duckdb.connect("x.duckdb")
        con.execute("create table customers (id integer)")
        con.close()
    result = CliRunner().invoke(main, ["--db", "x.duckdb", command])
    assert result.exit_code == 5 and result.stderr.count("\n") == 1
    assert result.stderr.startswith("kvdb: error: x.duckdb ") and "not a kvdb archive" in result.stderr
    assert str(tmp_path) not in result.stderr and "_duckdb" not in result.stderr and "Exception" not in result.stderr
    with pytest.raises(ArchiveError, match="x.duckdb .*not a kvdb archive") as raised:
        kvdb.open("x.duckdb", read_only=command == "sessions")
    assert raised.value.exit_code == 5


def test_a_bad_line_is_skipped_and_named_the_rest_ingested_and_strict_refuses_the_file(run, tmp_path):
    write(
        tmp_path / "in" / "chat.jsonl",
        '{"role": "user", "content": "first question"}\n{"role": \n{"role": "assistant", "content": "an answer"}\n',
    )
    result = run("ingest", str(tmp_path / "in"), "--json")
    assert result.exit_code == 1
    [r] = lines(result)
    assert (
        r["status"] == "ingested"
        and r["skipped"] == [{"line": 2, "reason": r["skipped"][0]["reason"]}]
        and "invalid JSON" in r["skipped"][0]["reason"]
    )
    shown = run("show", r["session_id"])
    assert "first question" in shown.stdout and "an answer" in shown.stdout
    human = run("ingest", str(tmp_path / "in"))
    assert human.exit_code == 1 and "chat.jsonl:2: invalid JSON" in human.stderr
    strict = run("ingest", str(tmp_path / "in" / "chat.jsonl"), "--strict", "--json")
    assert (
        strict.exit_code == 1
        and [x["status"] for x in lines(strict)] == ["failed"]
        and "chat.jsonl:2" in lines(strict)[0]["error"]
    )


def test_a_log_of_summaries_alone_is_empty_and_no_failure(run, tmp_path):
    write(tmp_path / "summaries.jsonl", '{"type": "summary", "summary": "Fixing the build", "leafUuid": "x1"}\n')
    result = run("ingest", str(tmp_path / "summaries.jsonl"), "--json")
    assert result.exit_code == 0
    [r] = lines(result)
    assert r["status"] == "empty" and r["session_id"] is None and "1 summary of sessions in other files" in r["error"]


def test_ctrl_c_is_the_cli_s_own_handler_and_ends_a_command_with_130(tmp_path, monkeypatch):
    """Under Python's default SIGINT handler a Ctrl-C during `kvdb upkeep`'s embedding never
    reached Python code and the run went on to its end; while a command runs, SIGINT has a
    handler of the CLI's own, which raises as the default would, and the one before it is put back."""
    import signal

    import kvdb

    seen = []

    def interrupted_stats(self):
        seen.append(signal.getsignal(signal.SIGINT))
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(10**8):  # Python code: the handler runs here
            pass
        raise AssertionError("SIGINT did not interrupt the command")

    monkeypatch.setattr(kvdb.Archive, "stats", interrupted_stats)
    kvdb.open(tmp_path / "a.duckdb").close()
    before = signal.getsignal(signal.SIGINT)
    result = CliRunner().invoke(main, ["--db", str(tmp_path / "a.duckdb"), "stats"])
    assert seen and seen[0] not in (signal.default_int_handler, signal.SIG_DFL, signal.SIG_IGN)
    assert result.exit_code == 130 and "kvdb: error: interrupted" in result.stderr
    assert signal.getsignal(signal.SIGINT) is before

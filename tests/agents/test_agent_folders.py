"""`--from AGENT` on `kvdb ingest` and `kvdb watch`: the agent's own folders, found as the agent
finds them (its own variable, else under the home folder); with PATHS an ingest reads them alone
and a watcher follows both; a missing folder is refused in one line before the model loads.
The agents' folders are temporary ones, named by their variables; the logs are real fixtures."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvdb.cli.main import main
from kvdb.errors import InvalidArgument
from kvdb.services.watching import agent_folders, agent_sources

EXPORTS = Path(__file__).parents[1] / "fixtures" / "exports"
CODEX = EXPORTS / "codex-cli" / "synthetic-legacy-rollout-2025-05.jsonl"
CLAUDE = EXPORTS / "claude-code" / "spotter-short.jsonl"
GEMINI = EXPORTS / "gemini-cli" / "agent-sessions-stage0-gemini-jsonl_v040.jsonl"
GEMINI_PROMPTS = EXPORTS / "gemini-cli" / "synthetic-logs.json"  # a project's logs.json: the prompts alone
VARIABLES = ("CLAUDE_CONFIG_DIR", "CODEX_HOME", "GEMINI_CLI_HOME")


def place(fixture: Path, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copy(fixture, folder))


@pytest.fixture
def cli(tmp_path, tiny_model):
    """``kvdb --db <tmp>/a.duckdb ARGS...`` with the tiny model, and no agent variable but those given."""
    runner = CliRunner()

    def run(*args, env=None, model=tiny_model):
        return runner.invoke(
            main,
            ["--db", str(tmp_path / "a.duckdb"), *map(str, args)],
            env={"KVDB_MODEL": model, **dict.fromkeys(VARIABLES), **(env or {})},
        )

    yield run
    watch_log = logging.getLogger(
        "kvdb.watch"
    )  # each watch adds its handlers (stderr, ARCHIVE.watch.log) to the process's logger
    for handler in list(watch_log.handlers):
        watch_log.removeHandler(handler)
        handler.close()


def sources(result) -> dict[str, set[str]]:
    """Each file read, and the statuses of its sessions."""
    assert result.exit_code == 0, result.stderr
    out: dict[str, set[str]] = {}
    for line in map(json.loads, result.stdout.splitlines()):
        out.setdefault(line["source"], set()).add(line["status"])
    return out


def test_each_agent_finds_its_folders_as_the_agent_does(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    for variable in VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    assert agent_folders("claude-code") == [home / ".claude/projects", home / ".config/claude/projects"]
    assert agent_folders("codex") == [home / ".codex/sessions", home / ".codex/archived_sessions"]
    assert agent_folders("gemini") == [home / ".gemini/tmp"]
    for variable in VARIABLES:
        monkeypatch.setenv(variable, str(tmp_path / variable))
    assert agent_folders("claude-code") == [tmp_path / "CLAUDE_CONFIG_DIR/projects"]
    assert agent_folders("codex") == [tmp_path / "CODEX_HOME/sessions", tmp_path / "CODEX_HOME/archived_sessions"]
    assert agent_folders("gemini") == [
        tmp_path / "GEMINI_CLI_HOME/.gemini/tmp"
    ]  # as Gemini CLI: its .gemini folder inside


def test_paths_replace_the_folders_for_an_ingest_and_join_them_for_a_watcher(tmp_path, monkeypatch):
    codex, copy = tmp_path / "codex", str(tmp_path / "copy")
    monkeypatch.setenv("CODEX_HOME", str(codex))
    with pytest.raises(InvalidArgument, match=f"no codex logs at {codex / 'sessions'}: .*set CODEX_HOME") as missing:
        agent_sources("codex")
    assert missing.value.exit_code == 2
    assert (
        agent_sources("codex", [copy]) == agent_sources("codex", [copy], follow=True) == [copy]
    )  # a folder not there yet is left out
    (codex / "sessions").mkdir(parents=True)
    assert agent_sources("codex") == [codex / "sessions"]
    assert agent_sources("codex", [copy]) == [copy]
    assert agent_sources("codex", [copy], follow=True) == [copy, codex / "sessions"]
    assert agent_sources(None, [copy]) == [copy]
    with pytest.raises(InvalidArgument, match="give the files or folders to read, or --from"):
        agent_sources(None, [])


def test_ingest_from_reads_the_agents_folders_or_the_paths_alone(cli, tmp_path):
    gemini = {"GEMINI_CLI_HOME": str(tmp_path / "g")}
    log = place(GEMINI, tmp_path / "g/.gemini/tmp/0b7dfb12/chats")
    assert sources(cli("ingest", "--from", "gemini", "--keep", "tokens,search", "--json", env=gemini)) == {
        str(log): {"ingested"}
    }

    codex = {"CODEX_HOME": str(tmp_path / "codex")}
    place(CODEX, tmp_path / "codex/sessions/2025/05/07")
    copied = place(CODEX, tmp_path / "backup")
    assert sources(
        cli("ingest", "--from", "codex", tmp_path / "backup", "--keep", "tokens,search", "--json", env=codex)
    ) == {str(copied): {"ingested"}}


def test_watch_from_follows_the_agents_folders_and_the_paths(cli, tmp_path):
    more = place(GEMINI, tmp_path / "more")
    absent = {"CODEX_HOME": str(tmp_path / "no-codex")}  # the agent's folder is not there: PATH alone is watched
    assert sources(cli("watch", "--from", "codex", tmp_path / "more", "--once", "--json", env=absent)) == {
        str(more.resolve()): {"ingested"}
    }

    claude = {"CLAUDE_CONFIG_DIR": str(tmp_path / "claude")}
    log = place(CLAUDE, tmp_path / "claude/projects/-home-marco-projects-spotter")
    append = place(CODEX, tmp_path / "more")  # a log the first pass did not see
    watched = sources(cli("watch", "--from", "claude-code", tmp_path / "more", "--once", "--json", env=claude))
    assert watched.keys() == {str(log.resolve()), str(append.resolve())} and set().union(*watched.values()) == {
        "ingested"
    }

    gemini = {"GEMINI_CLI_HOME": str(tmp_path / "g")}
    chat = place(GEMINI, tmp_path / "g/.gemini/tmp/0b7dfb12/chats")
    prompts = Path(shutil.copy(GEMINI_PROMPTS, chat.parents[1] / "logs.json"))
    watched = sources(
        cli("watch", "--from", "gemini", "--once", "--json", env=gemini)
    )  # no PATH: the agent's folder alone
    assert watched.keys() == {str(chat.resolve()), str(prompts.resolve())} and watched[str(prompts.resolve())] == {
        "ingested"
    }


@pytest.mark.parametrize("command", ["ingest", "watch"])
def test_a_missing_agent_folder_is_one_line_before_the_model_loads(cli, tmp_path, command):
    refused = cli(
        command,
        "--from",
        "codex",
        env={"CODEX_HOME": str(tmp_path / "no-codex")},
        model=str(tmp_path / "no-such-model"),
    )
    assert refused.exit_code == 2, refused.stderr
    assert refused.stderr.splitlines() == [
        f"kvdb: error: no codex logs at {tmp_path / 'no-codex/sessions'}: "
        "codex has not run as this user, or keeps them elsewhere; "
        "give their folder as PATH (--from codex PATH), or set CODEX_HOME as codex itself reads it"
    ]
    assert not (tmp_path / "a.duckdb").exists()

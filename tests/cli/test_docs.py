"""README.md documents the command line: every command in its command table, every option in its text.

The commands and options are read from the click application itself (``kvdb_cli.main:main``,
subgroups such as ``codebooks train`` included), so a command or option added without a line in
README.md fails here, and so does a table row naming a command that no longer exists.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import click
import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def _cli() -> click.Group:
    return importlib.import_module("kvdb_cli.main").main


def _commands(group: click.Group, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], click.Command]:
    """Every command under ``group`` by its path (``("codebooks", "train")``), groups included."""
    out: dict[tuple[str, ...], click.Command] = {}
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        if command is None or command.hidden:
            continue
        out[prefix + (name,)] = command
        if isinstance(command, click.Group):
            out.update(_commands(command, prefix + (name,)))
    return out


def _leaves() -> dict[tuple[str, ...], click.Command]:
    return {path: cmd for path, cmd in _commands(_cli()).items() if not isinstance(cmd, click.Group)}


def _option_names(command: click.Command) -> set[str]:
    """The name a user types for each option: its long form (``--max-new-tokens``), or its short
    form when it has no long one (``-k``). The help option is included."""
    names = set()
    for param in command.get_params(click.Context(command)):
        if not isinstance(param, click.Option) or param.hidden:
            continue
        flags = list(param.opts) + list(param.secondary_opts)
        long = [f for f in flags if f.startswith("--")]
        names.update(long or flags)
    return names


def _split_row(line: str) -> list[str]:
    """The cells of a markdown table row; ``\\|`` inside a cell is not a separator."""
    cells = re.split(r"(?<!\\)\|", line.strip())
    return [c.strip() for c in cells[1:-1]]


def _table_commands(text: str) -> list[tuple[str, ...]]:
    """The command path each row of README's command table names (the table whose first header is "command").

    A row's first cell reads like ```kvdb codebooks train [--preset k4v3]```: the command is
    the lowercase words after ``kvdb``, up to the first argument or option.
    """
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("|") and _split_row(line)[:1] == ["command"]), None)
    assert start is not None, "README.md has no command table (a table whose first column is `command`)"
    rows = []
    for line in lines[start + 2 :]:  # past the header and its |---| separator
        if not line.startswith("|"):
            break
        cell = _split_row(line)[0]
        code = re.search(r"`([^`]+)`", cell)
        assert code, f"command table row does not name a command in backticks: {line}"
        words = code.group(1).split()
        assert words[0] == "kvdb", f"command table row does not start with `kvdb`: {line}"
        path = []
        for word in words[1:]:
            if not re.fullmatch(r"[a-z][a-z0-9-]*", word):
                break
            path.append(word)
        assert path, f"command table row names no command: {line}"
        rows.append(tuple(path))
    return rows


def _mentions(text: str, option: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text) is not None


@pytest.fixture(scope="module")
def readme() -> str:
    return README.read_text(encoding="utf-8")


def test_the_cli_is_discovered():
    """Guards the tests below against passing vacuously: the introspection finds the real commands."""
    leaves = _leaves()
    assert len(leaves) >= 10
    for known in [("ingest",), ("sessions",), ("show",), ("restore",), ("search",), ("stats",), ("codebooks", "train"), ("index", "rebuild")]:
        assert known in leaves, f"{' '.join(known)} not found in the CLI: {sorted(leaves)}"
    assert {"--keep", "--model", "--json", "--help"} <= _option_names(leaves[("ingest",)])
    assert "-k" in _option_names(leaves[("search",)])
    assert {"--db", "--version", "--help"} <= _option_names(_cli())


def test_the_table_parser_reads_the_rows(readme):
    rows = _table_commands(readme)
    assert ("ingest",) in rows and ("codebooks", "train") in rows and ("index", "rebuild") in rows
    assert _table_commands("| command | what |\n|---|---|\n| `kvdb restore SESSION [--mode a\\|b]` | x |\n") == [("restore",)]
    assert not _mentions("`--keeps` and `--keep-all`", "--keep") and _mentions("[--keep TIERS]", "--keep")


def test_every_command_is_in_the_command_table(readme):
    rows = set(_table_commands(readme))
    missing = [" ".join(path) for path in _leaves() if path not in rows]
    assert not missing, f"commands missing from README.md's command table: {missing}"


def test_every_table_row_names_a_command(readme):
    leaves = _leaves()
    unknown = [" ".join(path) for path in _table_commands(readme) if path not in leaves]
    assert not unknown, f"README.md's command table names commands the CLI does not have: {unknown}"


def test_every_option_is_documented(readme):
    commands = {("kvdb",): _cli(), **{("kvdb", *path): cmd for path, cmd in _commands(_cli()).items()}}
    missing = sorted(
        f"{' '.join(path)} {option}" for path, command in commands.items() for option in _option_names(command) if not _mentions(readme, option)
    )
    assert not missing, f"options not mentioned in README.md: {missing}"

"""The command reference is the commands' own help, and the README names only real commands.

``docs/cli.md`` is written by ``kvdb.cli.reference`` from the click application itself
(``kvdb.cli.main:main``, subgroups such as ``codebooks train`` included): a command or option
added without ``make docs`` fails here. README.md's examples are read back against the CLI, so
one that names a command or option that no longer exists fails too.
"""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from kvdb.cli import reference

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CLI_MD = ROOT / "docs" / "cli.md"


def _cli() -> click.Group:
    return importlib.import_module("kvdb.cli.main").main


def _leaves() -> dict[tuple[str, ...], click.Command]:
    return {path: cmd for path, cmd in reference.commands(_cli()).items() if not isinstance(cmd, click.Group)}


def _option_names(command: click.Command) -> set[str]:
    """The name a user types for each option: its long form (``--max-new-tokens``), or its short
    form when it has no long one (``-k``). The help option is included."""
    names = set()
    helps = _cli().context_settings.get(
        "help_option_names", ["--help"]
    )  # as on a command line: click keeps the help option it first made
    for param in command.get_params(click.Context(command, help_option_names=helps)):
        if not isinstance(param, click.Option) or param.hidden:
            continue
        flags = list(param.opts) + list(param.secondary_opts)
        long = [f for f in flags if f.startswith("--")]
        names.update(long or flags)
    return names


def _examples(text: str) -> list[str]:
    """The ``kvdb ...`` command lines of the shell blocks of ``text`` (fenced, in no language or
    a shell's), a ``$ `` prompt and a trailing comment taken off."""
    lines, fence = [], None  # fence: the open block's language, None outside blocks
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("```"):
            fence = line[3:].strip() if fence is None else None
            continue
        line = re.sub(r"^\$ ", "", line)
        if fence in ("", "bash", "sh", "shell", "console") and line.startswith("kvdb "):
            lines.append(re.sub(r"\s+#.*$", "", line))
    return lines


def _words(line: str) -> list[str]:
    """A command line's words as the shell reads them; a line whose quote goes on to the next
    line (a long SQL query) by its spaces."""
    try:
        return shlex.split(line)
    except ValueError:
        return line.split()


def _command_of(line: str, commands: dict[tuple[str, ...], click.Command]) -> tuple[tuple[str, ...], list[str]]:
    """(the command path an example line runs, the options it gives); a path of one word that is
    no command where the line names none."""
    valued = {o for p in _cli().params if isinstance(p, click.Option) and not p.is_flag for o in p.opts}
    words, path, at = _words(line)[1:], (), 0
    while at < len(words):
        word = words[at]
        if not path and word.startswith("-"):  # a global option (--db FILE) before the command
            at += 2 if word in valued else 1
        elif path + (word,) in commands:
            path, at = path + (word,), at + 1
        else:
            break
    if not path:
        return (words[at] if at < len(words) else "",), []
    return path, [w.split("=")[0] for w in words if re.fullmatch(r"--?[a-zA-Z][\w-]*(=.*)?", w)]


def test_the_cli_is_discovered():
    """Guards the tests below against passing vacuously: the introspection finds the real commands."""
    leaves = _leaves()
    assert len(leaves) >= 10
    for known in [
        ("ingest",),
        ("sessions",),
        ("show",),
        ("restore",),
        ("search",),
        ("stats",),
        ("codebooks", "train"),
        ("index", "rebuild"),
    ]:
        assert known in leaves, f"{' '.join(known)} not found in the CLI: {sorted(leaves)}"
    assert {"--keep", "--model", "--json", "--help"} <= _option_names(leaves[("ingest",)])
    assert "-k" in _option_names(leaves[("search",)])
    assert {"--db", "--version", "--help"} <= _option_names(_cli())


def test_docs_cli_md_is_the_help_as_it_stands():
    written = CLI_MD.read_text(encoding="utf-8")
    assert written == reference.reference(_cli()), (
        "docs/cli.md is stale: run `make docs` (python -m kvdb.cli.reference > docs/cli.md)"
    )


def test_the_reference_has_every_command_and_option():
    written = CLI_MD.read_text(encoding="utf-8")
    for path, command in {(): _cli(), **reference.commands(_cli())}.items():
        title = " ".join(("kvdb", *path))
        section = written.split(f"## `{title}`\n", 1)
        assert len(section) == 2, f"docs/cli.md has no section for {title}"
        body = section[1].split("\n## ", 1)[0]
        assert f"Usage: {title} " in body
        missing = [o for o in _option_names(command) if re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", body) is None]
        assert not missing, f"{title}: options missing from its section of docs/cli.md: {missing}"


def test_the_example_parser_reads_commands_and_options():
    commands = {("search",): _cli(), ("codebooks",): _cli(), ("codebooks", "train"): _cli()}
    assert _examples("x\n```bash\n$ kvdb --db a.duckdb search 'x y' -k 3  # why\n```\n") == [
        "kvdb --db a.duckdb search 'x y' -k 3"
    ]
    assert _command_of("kvdb --db a.duckdb search x -k 3", commands) == (("search",), ["--db", "-k"])
    assert _command_of("kvdb codebooks train --preset k4v3", commands) == (("codebooks", "train"), ["--preset"])
    assert _command_of("kvdb serach x", commands) == (("serach",), [])


@pytest.mark.parametrize("document", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_every_example_runs_a_command_with_its_options(document):
    commands = {(): _cli(), **reference.commands(_cli())}
    examples = _examples(document.read_text(encoding="utf-8"))
    if document == README:
        assert len(examples) >= 6, "README.md's quick start shows too few commands"
    wrong = []
    for line in examples:
        path, options = _command_of(line, commands)
        if path not in commands:
            wrong.append(f"{line!r}: no command `kvdb {' '.join(path)}`")
            continue
        known = (
            _option_names(commands[path])
            | _option_names(_cli())
            | {f for p in commands[path].params for f in p.opts + p.secondary_opts}
        )
        wrong += [
            f"{line!r}: `kvdb {' '.join(path)}` has no option {o}"
            for o in options
            if o not in known and o.split("=")[0] not in known
        ]
    assert not wrong, f"{document.name}: examples that name no real command or option:\n" + "\n".join(wrong)


def test_the_reference_is_the_same_whatever_ran_before():
    """click keeps a command's help option once a context has made it: the reference must make
    its contexts as a command line does, or a test that ran `kvdb --help` first changes it."""
    before = reference.reference(_cli())
    for args in (["--help"], ["search", "--help"], ["codebooks", "train", "--help"]):
        assert CliRunner().invoke(_cli(), args).exit_code == 0
    assert reference.reference(_cli()) == before

"""docs/cli.md, written from the commands' own help: ``python -m kvdb.cli.reference > docs/cli.md``.

The help is the one place a command's options and rules are written; this renders it at a fixed
width, so the file is the same on every machine and a test can tell when it is stale
(``tests/cli/test_docs.py``)."""

from __future__ import annotations

import click

WIDTH = 100  # columns the help is wrapped at, whatever the terminal

HEADER = """# Command reference

Generated from `kvdb --help` and each command's `--help` by `python -m kvdb.cli.reference >
docs/cli.md` (`make docs`); `make test` fails when this file is stale. Edit the help in `kvdb/cli/`,
not this file.
"""


def commands(group: click.Group, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], click.Command]:
    """Every visible command under ``group`` by its path (``("codebooks", "train")``), groups
    included, in the order ``--help`` lists them."""
    out: dict[tuple[str, ...], click.Command] = {}
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        if command is None or command.hidden:
            continue
        out[prefix + (name,)] = command
        if isinstance(command, click.Group):
            out.update(commands(command, prefix + (name,)))
    return out


def help_text(main: click.Group, path: tuple[str, ...]) -> str:
    """``kvdb PATH --help`` as a user sees it, at ``WIDTH`` columns: each context made as click
    makes it for a command line (the group's settings, ``-h`` among them, passed down), so the
    text does not depend on what ran before in the process (click keeps a command's help option
    once made)."""
    ctx = main.make_context("kvdb", [], resilient_parsing=True, terminal_width=WIDTH, max_content_width=WIDTH)
    command: click.Command = main
    for name in path:
        assert isinstance(command, click.Group)
        command = command.get_command(ctx, name)  # type: ignore[assignment]
        ctx = command.make_context(
            name, [], parent=ctx, resilient_parsing=True, terminal_width=WIDTH, max_content_width=WIDTH
        )
    return command.get_help(ctx).rstrip()


def reference(main: click.Group) -> str:
    sections = [HEADER]
    for path in [(), *commands(main)]:
        title = " ".join(("kvdb", *path))
        sections.append(f"## `{title}`\n\n```text\n{help_text(main, path)}\n```\n")
    return "\n".join(sections)


if __name__ == "__main__":
    from kvdb.cli.main import main

    print(reference(main), end="")

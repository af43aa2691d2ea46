"""docs/cli.md, written from the commands' own help: ``python -m kvdb_cli.reference > docs/cli.md``.

The help is the one place a command's options and rules are written; this renders it at a fixed
width, so the file is the same on every machine and a test can tell when it is stale
(``tests/cli/test_docs.py``)."""

from __future__ import annotations

import click

WIDTH = 100  # columns the help is wrapped at, whatever the terminal

HEADER = """# Command reference

Generated from `kvdb --help` and each command's `--help` by `python -m kvdb_cli.reference >
docs/cli.md` (`make docs`); `make test` fails when this file is stale. Edit the help in `cli/`,
not this file.
"""


def commands(group: click.Group, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], click.Command]:
    """Every visible command under ``group`` by its path (``("codebooks", "train")``), groups
    included, in the order ``--help`` lists them."""
    out: dict[tuple[str, ...], click.Command] = {}
    for name in group.list_commands(click.Context(group)):
        command = group.get_command(click.Context(group), name)
        if command is None or command.hidden:
            continue
        out[prefix + (name,)] = command
        if isinstance(command, click.Group):
            out.update(commands(command, prefix + (name,)))
    return out


def help_text(command: click.Command, path: tuple[str, ...]) -> str:
    """``kvdb PATH --help`` as a user sees it, at ``WIDTH`` columns."""
    parent = None
    for name in ("kvdb", *path[:-1]):  # a chain of contexts, so the usage line names the whole command
        parent = click.Context(click.Command(name), info_name=name, parent=parent, terminal_width=WIDTH, max_content_width=WIDTH)
    name = path[-1] if path else "kvdb"
    ctx = click.Context(command, info_name=name, parent=parent if path else None, terminal_width=WIDTH, max_content_width=WIDTH)
    return command.get_help(ctx).rstrip()


def reference(main: click.Group) -> str:
    sections = [HEADER]
    for path, command in {(): main, **commands(main)}.items():
        title = " ".join(("kvdb", *path))
        sections.append(f"## `{title}`\n\n```text\n{help_text(command, path)}\n```\n")
    return "\n".join(sections)


if __name__ == "__main__":
    from kvdb_cli.main import main

    print(reference(main), end="")

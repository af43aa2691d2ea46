"""Commands that query: sql."""

from __future__ import annotations

import sys

import click

from kvdb.cli.app import embedder_option, emit, json_option, main, model_option, open_archive, printable

CELL_CHARS = 60  # a cell longer than this is cut in the table (--json gives it whole)


@main.command()
@click.argument("query")
@model_option
@embedder_option
@json_option
@click.pass_context
def sql(ctx, query, model, embedder, as_json):
    """Run one read-only SQL query (DuckDB's dialect) over the archive's views: conversations,
    sessions, turns (with their text), agents, projects and tiers; search('PHRASE') and
    search_meaning('QUERY') are the hits of a search, to join by conversation_id. QUERY "-"
    reads it from stdin. The views and their columns: docs/sql.md.

    \b
    kvdb sql "select agent, conversations, last_said_at from agents"
    kvdb sql "select c.project, date_trunc('month', c.said_at) as month, count(*) as hits
              from search('harbour master') join conversations c using (conversation_id) group by all"

    Prints a table; --json prints {"columns", "types", "rows"}. A write is refused."""
    if query == "-":
        query = sys.stdin.read()
    found = open_archive(ctx, model, read_only=True, embedder=embedder).sql(query)
    if as_json:
        emit(found.to_dict())
        return
    for line in table(found.columns, found.rows):
        click.echo(line)
    click.echo(f"({len(found.rows)} row{'' if len(found.rows) == 1 else 's'})")


def table(columns: list[str], rows: list[tuple]) -> list[str]:
    """The rows under their columns' names, each column as wide as its widest cell; numbers to the right."""
    cells = [[_cell(v) for v in row] for row in rows]
    heads = [_cell(c) for c in columns]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(heads)]
    numeric = [
        bool(rows)
        and all(isinstance(r[i], (int, float)) and not isinstance(r[i], bool) for r in rows if r[i] is not None)
        for i in range(len(columns))
    ]

    def line(values: list[str]) -> str:
        return "  ".join(
            v.rjust(w) if right else v.ljust(w) for v, w, right in zip(values, widths, numeric, strict=True)
        ).rstrip()

    return [line(heads), "  ".join("-" * w for w in widths), *(line(r) for r in cells)]


def _cell(value) -> str:
    text = "NULL" if value is None else printable(str(value))
    return text if len(text) <= CELL_CHARS else text[: CELL_CHARS - 1] + "…"

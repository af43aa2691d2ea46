"""Commands that write sessions: ingest, compact, delete, copy."""

from __future__ import annotations

import re
import sys

import click

import kvdb
from kvdb import sealing
from kvdb.cli.app import (
    embedder_option,
    emit,
    json_option,
    layer_progress,
    main,
    model_option,
    open_archive,
    printable,
    token_progress,
)
from kvdb.codecs import presets
from kvdb.errors import InvalidArgument
from kvdb.services.watching import AGENT_FOLDERS, agent_sources
from kvdb.tiers import DEFAULT_KEEP, DEFAULT_KV_PRESET, parse_keep


@main.command("formats")
@click.option("--example", metavar="NAME", help="Print the example file of format NAME, as it would be ingested.")
@json_option
def formats_command(example, as_json):
    """List the export formats `kvdb ingest` reads: each file's format is told from its content,
    never from its name. Packages add formats through the "kvdb.formats" entry point group."""
    known = kvdb.formats()
    if example is not None:
        chosen = next((f for f in known if f.name == example), None)
        if chosen is None:
            raise click.BadParameter(
                f"no format {example!r}; known: {', '.join(f.name for f in known)}", param_hint="--example"
            )
        click.echo(chosen.example, nl=False)
        return
    for f in known:
        if as_json:
            emit(f.to_dict())
        else:
            click.echo(f"{f.name:<18} {f.reads}")


@main.command()
@click.argument("paths", nargs=-1, type=click.Path())
@click.option(
    "--from",
    "agent",
    type=click.Choice(sorted(AGENT_FOLDERS)),
    default=None,
    help="Everything this agent left on this machine: its own log folders (as `kvdb watch --from`), "
    "when no PATHS are given.",
)
@click.option(
    "--keep",
    default=DEFAULT_KEEP,
    show_default=True,
    help="Tiers to store: tokens (1.95 B/token), search (phrase index; needs tokens), lm (tokens coded against "
    "the model: ~4x smaller than xz, but codes ~200 tokens/s on 2 cores; with lm, tokens may be left out and "
    "reads decode lm), kv (quantized KV cache for restores without a forward pass; "
    "coded with the archive's trained codebooks of --kv-preset, else with the shipped ones, "
    "built on this machine's first use), "
    "semantic (each turn's chunks embedded for search by meaning: search --semantic; needs tokens).",
)
@click.option(
    "--kv-preset",
    default=DEFAULT_KV_PRESET,
    show_default=True,
    help="How finely tier K (--keep ...,kv) is coded: faithful, balanced or compact (each a spec per model; "
    "`kvdb restore` auto takes tier K only for one measured within --max-loss), or a spec: e3 (entropy coded, 3 bits "
    "per element on average; e1.35p64 also predicts each head's first 64 coefficients from the previous layer; "
    "e0.9jp384 rotates a layer's "
    "keys and values, all heads, together and predicts all 384), t3 (transform coded at fixed rates) "
    "or k4v3 (residual VQ, 4 key and 3 value stages).",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Worker processes, each with the model loaded, taking the input files in turn (on 2 cores, 2). "
    "On a DuckLake archive, workers on other machines may share the folder: each file is claimed by one.",
)
@click.option(
    "--strict",
    is_flag=True,
    help="Refuse a whole file for one malformed record (a JSON Lines line, an element of a JSON list). "
    "Default: leave the record out, name it (skipped: line, reason) and ingest the rest, with exit status 1.",
)
@click.option(
    "--redact",
    is_flag=True,
    help="Archive secrets of known shapes (API keys and tokens of OpenAI, Anthropic, AWS, GitHub, GitLab, Slack, "
    "Google, Hugging Face; "
    "bearer tokens; private keys) as [secret not archived], counted in the result's dropped.",
)
@embedder_option
@model_option
@json_option
@click.pass_context
def ingest(ctx, paths, agent, keep, kv_preset, workers, strict, redact, embedder, model, as_json):
    """Archive transcripts: files or directories (searched recursively), or with --from and no
    PATHS an agent's own log folders (claude-code: ~/.claude/projects, or $CLAUDE_CONFIG_DIR/projects;
    codex: ~/.codex/sessions and archived_sessions, or under $CODEX_HOME; gemini: ~/.gemini/tmp,
    or under $GEMINI_CLI_HOME). With PATHS, --from reads those alone (a copy of the agent's
    folder from a backup or another machine), not this machine's folders too. A missing agent
    folder is refused with exit status 2 before anything is read.

    \b
    .txt / .md      one session, text verbatim (UTF-8, or UTF-16/32 with a byte order mark)
    .json / .jsonl  read from their content, never their name: chat app exports, coding
                    agent logs and datasets (`kvdb formats` lists every format, with an
                    example); a session or a record per line, or a list of either

    Every file is checked before the model loads. What has no text (an image, say) is kept
    as a "[image not archived]" placeholder and counted ("dropped" in --json). A malformed
    record (a bad line of an agent log, a bad conversation of an export) is left out and named with its line
    ("skipped" in --json), and the rest of its file ingests; --strict refuses the file instead.
    A file that fails is reported with its line and writes nothing; the others still ingest.
    Exit status 1 when a file failed or a record was skipped. A file with nothing to archive
    (no text; an agent log of summaries alone) is reported `empty`, which is no failure. Ingesting
    the same transcript again reports it `unchanged`, or
    `updated` when --keep names tiers it was archived without, which it is then given.
    A file is parsed once, and its sessions rendered and tokenized once, all before the first
    write: memory holds one file's sessions at a time. A session longer than the model's
    context (8,192 tokens for SmolLM2) is archived as parts of at most three quarters of it,
    cut between turns, each a session of one conversation that goes on from the part before
    ("part" in --json); a restored part holds that part alone. Readers (search, show, restore)
    can use the archive between sessions, while the model computes.
    """
    sources = agent_sources(agent, paths)
    archive = open_archive(ctx, model, embedder=embedder)
    if "kv" in parse_keep(keep):
        spec = presets.resolve(kv_preset, archive.loaded_model.identity.weights_hash)
        if not any(c.source == "trained" and c.preset == spec for c in archive.codebooks()):
            # minutes, said as such, not one session's seconds
            with layer_progress("shipped codebooks (once per machine)") as heard:
                archive.build_shipped_codebooks(progress=heard, preset=kv_preset)
    with token_progress("ingest") as progress:
        results = archive.ingest(
            sources,
            keep=keep,
            kv_preset=kv_preset,
            progress=progress,
            workers=workers,
            strict=strict,
            redact=redact,
            heard=_emit_each if as_json else _say_ingested,
        )
    if any(r.status == "failed" or r.skipped for r in results):
        sys.exit(1)


def _emit_each(results) -> None:
    for r in results:
        emit(r.to_dict())


def _say_ingested(results) -> None:
    """Each file's results, as it is committed."""
    for r in results:
        if r.status in ("failed", "empty"):
            click.echo(f"{r.status:<10} {r.error}", err=r.status == "failed")
        elif r.status == "claimed":
            click.echo(f"claimed    {printable(r.source)}  (being archived by {r.claimed_by})")
        else:
            new = {
                "ingested": f"  ({r.new_tokens} new, {r.seconds:.2f}s)",
                "updated": f"  (added {','.join(r.added)}, {r.seconds:.2f}s)",
            }.get(r.status, "")
            dropped = "".join(f"  [{count} {kind} not archived]" for kind, count in r.dropped.items())
            part = f" (part {r.part})" if r.part is not None else ""
            click.echo(
                f"{r.status:<10} {r.session_id[:12]}  {r.n_tokens:>7} tok  {printable(r.name)}{part}{new}{dropped}"
            )
        for skip in r.skipped:
            click.echo(
                f"skipped    {printable(re.sub(r'#L[0-9]+$', '', r.source))}:{skip['line']}: {skip['reason']}", err=True
            )


@main.command()
@click.argument("session")
@click.option(
    "--keep",
    required=True,
    help="Tiers to keep, e.g. tokens, tokens,search, or lm (tier L as the only copy of the tokens).",
)
@json_option
@click.pass_context
def compact(ctx, session, keep, as_json):
    """Drop tiers (search, lm, kv, tokens) from a session's stored nodes.

    Prefix nodes the session shares with others are compacted for all of them: they are
    stored once. The token tier is the exception: only the session's own nodes drop it, and
    only where tier L holds their tokens (reads then decode tier L, ~50 tokens/s on 2 cores).
    A tier-L payload written before payload version 3 is re-coded from the tokens first, so
    what remains decodes on any machine. What remains keeps show, search (if kept) and
    restore working.
    """
    s = open_archive(ctx).compact(session, keep)
    if as_json:
        emit(s.to_dict())
    else:
        click.echo(f"compacted {s.session_id[:12]} ({printable(s.name)}) to {keep}")


@main.command()
@click.argument("session")
@click.option(
    "--conversation",
    "whole",
    is_flag=True,
    help="Delete every version of the conversation SESSION names, not one session.",
)
@click.option(
    "--source",
    "from_file",
    is_flag=True,
    help="SESSION is a file: delete every session archived from it, and keep `kvdb watch` from archiving it again "
    "(see --readmit-forgotten).",
)
@json_option
@click.pass_context
def delete(ctx, session, whole, from_file, as_json):
    """Delete a session (one version of a conversation; a name is its latest version), with
    --conversation every version, or with --source everything archived from one file. Prefixes
    other sessions share stay; `kvdb gc` then frees the rest and erases every byte of what was
    deleted from the archive's files (database, sidecars, caches)."""
    archive = open_archive(ctx)
    if whole and from_file:
        raise click.UsageError("--conversation and --source name different things; give one")
    if from_file:
        done = archive.delete_source(session)
        if as_json:
            emit(done.to_dict())
        else:
            click.echo(
                f"deleted {done.sessions} sessions ({done.conversations} conversations) "
                f"archived from {printable(done.source)}; `kvdb watch` will not archive it again"
            )
        return
    if whole:
        gone = archive.delete_conversation(session)
        if as_json:
            emit(gone.to_dict())
        else:
            click.echo(
                f"deleted {gone.conversation.conversation_id[:12]} "
                f"({printable(gone.conversation.title)}, {gone.sessions} versions)"
            )
        return
    s = archive.delete(session)
    if as_json:
        emit(s.to_dict())
    else:
        click.echo(f"deleted {s.session_id[:12]} ({printable(s.name)})")


@main.command()
@click.argument("conversation")
@click.argument("title")
@json_option
@click.pass_context
def rename(ctx, conversation, title, as_json):
    """Give a conversation a TITLE, which lists, search hits and the page show, and which names
    it in any command; an empty TITLE names it by its first version again."""
    c = open_archive(ctx).rename(conversation, title)
    if as_json:
        emit(c.to_dict())
    else:
        click.echo(f"renamed {c.conversation_id[:12]} to {printable(c.title)}")


@main.command()
@click.argument("source")
@click.argument("target")
@click.option(
    "--encrypt", is_flag=True, help="SOURCE is plain: TARGET is made encrypted under the key (--key-file or KVDB_KEY)."
)
@json_option
@click.pass_context
def copy(ctx, source, target, encrypt, as_json):
    """Copy the archive SOURCE into TARGET, a new file or an empty lake, either way round.

    \b
    kvdb copy archive.duckdb "ducklake:postgres:dbname=kvdb host=db" --data-path /mnt/kvdb
    kvdb copy "ducklake:postgres:dbname=kvdb host=db" backup.duckdb

    Every row goes over in one transaction (the target holds all of it or nothing), then each
    table's SHA-256 is compared on both sides. --data-path (before the command) is the new
    lake's. Search indexes and the prefix cache are derived: rebuilt in TARGET on first use.
    TARGET is encrypted as SOURCE is (under its key); --encrypt makes an encrypted copy of a
    plain SOURCE:

    \b
    KVDB_KEY=... kvdb copy --encrypt archive.duckdb private.duckdb
    """
    key = ctx.obj["key"] or sealing.given_key(None)
    if encrypt and key is None:
        raise InvalidArgument(
            "--encrypt needs the key to encrypt under: set KVDB_KEY or give --key-file (before the command)"
        )
    archive = kvdb.open(source, read_only=True, key=b"" if encrypt else key)  # b"": read as the plain archive it is
    ctx.call_on_close(archive.close)
    report = archive.copy_to(target, data_path=ctx.obj["data_path"], key=key if encrypt else None)
    if as_json:
        emit(report.to_dict())
    else:
        click.echo(
            f"copied {report.source} to {report.target}: {sum(report.rows.values())} rows "
            f"in {len(report.rows)} tables, content hashes equal"
        )

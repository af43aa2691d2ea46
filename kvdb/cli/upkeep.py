"""Commands that look after the archive: verify, repair, codebooks, index, gc."""

from __future__ import annotations

import sys

import click

from kvdb.cli.app import (
    embedder_option,
    emit,
    json_option,
    layer_progress,
    main,
    model_option,
    open_archive,
    token_progress,
)
from kvdb.codecs import presets


@main.command()
@click.option(
    "--deep", is_flag=True, help="Check every stored block and decode every session (else a sample of each tier)."
)
@json_option
@click.pass_context
def verify(ctx, deep, as_json):
    """Check the archive: stored blocks, the trie, reference counts, search indexes.

    Exit status 0 when everything holds, 1 when a problem was found (one line each).
    """
    report = open_archive(ctx, read_only=True).verify(deep=deep)
    if as_json:
        emit(report.to_dict())
    else:
        for note in report.notes:
            click.echo(f"note: {note}")
        for problem in report.problems:
            click.echo(f"problem: {problem}")
        checked = ", ".join(f"{n} {what}" for what, n in report.checked.items())
        click.echo(
            f"{'ok' if report.ok else f'{len(report.problems)} problem(s)'}: checked {checked}", err=not report.ok
        )
    if not report.ok:
        sys.exit(1)


@main.command()
@click.option(
    "--limit",
    type=click.IntRange(min=1),
    default=None,
    help="Score at most this many sessions, then stop (the rest stay queued).",
)
@click.option("--status", "show_status", is_flag=True, help="Say what is queued; do nothing.")
@click.option(
    "--only",
    type=click.Choice(["semantic", "logprobs"]),
    default=None,
    help="Do one kind of work: semantic (the embedder: search by meaning) or logprobs "
    "(the language model: d_T, exact caches).",
)
@embedder_option
@model_option
@json_option
@click.pass_context
def upkeep(ctx, limit, show_status, only, embedder, model, as_json):
    """Do the models' work that ingest queued, newest sessions first: the semantic tier (the
    embedder's: `search --semantic` covers a session once it is embedded), then each session's
    log-probabilities (the language model's: d_T, `kvdb prefixes`) and its exact cache, which
    warms the prefix cache so a restore of recent work resumes instead of prefilling.

    Ingest archives the default tiers with the tokenizer alone, at indexing speed, and queues
    the rest; `kvdb watch` and `kvdb serve` do it in their idle time. Each session commits
    alone: a run stopped any way (Ctrl-C, kill -9) is resumed by the next.
    """
    archive = open_archive(ctx, model, embedder=embedder)
    if show_status:
        pending = archive.pending()
        if as_json:
            emit(pending.to_dict())
        else:
            for work, queued in (("semantic", pending.semantic), ("logprobs", pending.logprobs)):
                click.echo(f"{work:<9} {queued.sessions} sessions ({queued.tokens} tokens) queued")
        return
    with token_progress("upkeep") as progress:
        report = archive.upkeep(limit=limit, progress=progress, only=only)
    if as_json:
        emit(report.to_dict())
    else:
        left = report.pending
        click.echo(
            f"embedded {report.embedded.sessions} sessions, scored {report.scored.sessions} "
            f"({report.cached} caches kept) in {report.seconds:.1f}s; "
            f"left: {left.semantic.sessions} to embed, {left.logprobs.sessions} to score"
        )


@main.command()
@json_option
@click.pass_context
def repair(ctx, as_json):
    """Rebuild what can be derived (search indexes), then say what cannot be repaired."""
    result = open_archive(ctx).repair()
    if as_json:
        emit(result.to_dict())
    else:
        click.echo(f"rebuilt {len(result.rebuilt_indexes)} search index(es)")
        for problem in result.unrepairable:
            click.echo(f"cannot repair: {problem}")
    if not result.ok:
        sys.exit(1)


@main.group()
def codebooks():
    """KV codebooks (tier K): residual-VQ centroids per layer, head and K/V."""


@codebooks.command("train")
@click.option(
    "--preset",
    default=None,
    help=f"A named preset ({', '.join(presets.NAMES)}: a spec per model), entropy coding at e<bits> per element "
    "(e.g. e3, e1.5; e1.25p64 also predicts each head's first 64 coefficients from the previous layer), "
    "fixed-rate transform coding at t<bits> (e.g. t3), "
    "or residual stages of 256 centroids for keys and values, "
    "e.g. k4v3, k4v2, k2v1; overrides per layer as k3v3+k8@7,18+k2@0-5, or per KV head as k3v3+k12@18.2 "
    "(layer 18, head 2).  "
    f"[default: {presets.DEFAULT_NAME}, as ingest's --kv-preset]",
)
@click.option(
    "--tokens", type=click.IntRange(min=256), default=8192, show_default=True, help="Archived positions to train on."
)
@model_option
@json_option
@click.pass_context
def codebooks_train(ctx, preset, tokens, model, as_json):
    """Train codebooks on the archive's own sessions; later `ingest --keep ...,kv` of the same preset uses them."""
    report = open_archive(ctx.parent, model).train_codebooks(preset=preset, tokens=tokens)
    if as_json:
        emit(report.to_dict())
    else:
        click.echo(
            f"trained {report.preset} codebooks {report.codebook_id[:12]} on {report.tokens} positions "
            f"({report.bytes} bytes) in {report.seconds}s"
        )


@codebooks.command("list")
@json_option
@click.pass_context
def codebooks_list(ctx, as_json):
    """List the codebooks the archive holds (trained) or references (shipped), oldest first.

    Ingest codes tier K with the newest trained set of the model and its --kv-preset, else with the shipped one.
    STORED is what the archive keeps; CENTROIDS what decoding uses (for shipped codebooks, a
    file in this machine's kvdb cache, shared by every archive of the model).
    """
    for c in open_archive(ctx.parent, read_only=True).codebooks():
        if as_json:
            emit(c.to_dict())
        else:
            where = "" if c.on_this_machine else "  (not built on this machine yet)"
            click.echo(
                f"{c.codebook_id[:12]}  {c.source:<7}  {c.preset:<8}  stored {c.stored_bytes:>10}  "
                f"centroids {c.centroid_bytes:>10}{where}"
            )


@codebooks.command("build")
@click.option(
    "--preset",
    default=presets.DEFAULT_NAME,
    show_default=True,
    help=f"A named preset ({', '.join(presets.NAMES)}) or a spec, as ingest's --kv-preset.",
)
@model_option
@json_option
@click.pass_context
def codebooks_build(ctx, preset, model, as_json):
    """Build this machine's shipped codebooks for the model now (once; minutes on 2 cores).

    They are trained on the calibration text shipped with kvdb, cached in the kvdb cache
    directory ($KVDB_CACHE), and used by `ingest --keep ...,kv` of that preset on any archive
    with no trained codebooks of it; otherwise the first such ingest builds them.
    """
    archive = open_archive(ctx.parent, model)
    with layer_progress("shipped codebooks") as heard:
        report = archive.build_shipped_codebooks(progress=heard, preset=preset)
    if as_json:
        emit(report.to_dict())
    else:
        state = f"built in {report.seconds}s" if report.built else "built already"
        click.echo(f"shipped {report.preset} codebooks ({report.bytes} bytes) {state}: {report.path}")


@main.group()
def index():
    """Maintain the search index (a sidecar file derived from the archived tokens)."""


@index.command("rebuild")
@model_option
@json_option
@click.pass_context
def index_rebuild(ctx, model, as_json):
    """Rebuild the search index from the archived token streams."""
    report = open_archive(ctx.parent, model).rebuild_index()
    if as_json:
        emit(report.to_dict())
    else:
        click.echo(
            f"rebuilt index {report.index_key}: {report.sessions} sessions, {report.points} points in {report.seconds}s"
        )


@main.command()
@click.option(
    "--now",
    is_flag=True,
    help="On a lake, delete the data files this gc replaced at once, not an hour later "
    "(a reader still scanning an older snapshot fails).",
)
@json_option
@click.pass_context
def gc(ctx, now, as_json):
    """Free the stored prefixes that no session uses any more (after deletes).

    It also renumbers a search index whose freed slots outnumber its live ones. An archive file
    whose free space is over a quarter of it (and 1 MiB) is rewritten smaller, since DuckDB
    never shrinks a file; on a lake it merges the small Parquet files each commit leaves (the
    files a merge replaced are deleted by a gc an hour or more later, so readers still scanning
    them finish).

    After a delete it erases every byte of the deleted sessions: search indexes with a freed
    slot are renumbered, chunk sidecars rebuilt, exact caches of them removed, and the file
    rewritten (a lake's files holding deleted rows written again). What it cannot erase yet (a
    lake's replaced files, kept for readers) it names, with how to erase it."""
    freed = open_archive(ctx).gc(now)
    if as_json:
        emit(freed.to_dict())
    else:
        click.echo(
            f"freed {freed.nodes} nodes, {freed.tokens} tokens, {freed.token_bytes} bytes of token blocks, "
            f"{freed.prefix_cache_entries} prefix-cache entries"
            + (
                f"; merged {freed.data_files_merged} data files into {freed.data_files_written}, "
                f"deleted {freed.data_files_deleted}"
                if freed.data_files_merged is not None
                else ""
            )
            + (f"; erased {freed.forgotten} deleted sessions from the archive's files" if freed.forgotten else "")
        )
        if freed.forgotten and freed.data_files_kept:
            click.echo(
                f"{freed.data_files_kept} replaced data files still hold deleted rows, "
                "kept an hour for readers of older snapshots: "
                "run `kvdb gc` again after that, or `kvdb gc --now` to delete them at once",
                err=True,
            )

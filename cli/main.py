"""`kvdb`: a thin click layer over kvdb.Archive. It parses, calls the library, and formats.

Errors the library raises on purpose (kvdb.errors) become one line on stderr and the
error's exit code; anything else becomes one line too, with KVDB_DEBUG=1 for the traceback.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

import click

import kvdb
from kvdb.codecs import presets
from kvdb.errors import KvdbError
from kvdb.model.prefix_cache import DEFAULT_BUDGET_MB as DEFAULT_PREFIX_CACHE_MB
from kvdb.tiers import DEFAULT_KEEP, DEFAULT_WINDOW, RESTORE_MODES, WINDOWS, parse_keep

EXIT_INTERNAL = 70  # EX_SOFTWARE: a bug in kvdb, not in the input


class KvdbGroup(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KvdbError as exc:
            _fail(ctx, str(exc), exc.exit_code, type(exc).__name__)
        except KeyboardInterrupt:
            _fail(ctx, "interrupted", 130, "Interrupted")
        except (click.exceptions.Exit, click.ClickException, click.exceptions.Abort):
            raise
        except Exception as exc:  # the CLI promises one line, never a traceback
            if os.environ.get("KVDB_DEBUG"):
                raise
            _fail(ctx, f"internal error: {type(exc).__name__}: {exc} (rerun with KVDB_DEBUG=1 for the traceback)", EXIT_INTERNAL, "InternalError")


def _fail(ctx: click.Context, message: str, code: int, kind: str):
    """One line on stderr and the exit code; under --json that line is a JSON object, so a script
    reading JSON never has to parse prose."""
    line = message.splitlines()[0] if message else "unknown error"
    if ctx.meta.get(JSON_META):
        click.echo(json.dumps({"error": line, "type": kind, "exit_code": code}, ensure_ascii=False), err=True)
    else:
        click.echo(f"kvdb: error: {line}", err=True)
    sys.exit(code)


@contextlib.contextmanager
def _layer_progress(what: str):
    """A ``progress(kind, layer)`` for long one-time work: a bar on a terminal, else a line per
    layer on stderr, so a log or a CI run hears of minutes of work as it goes."""
    from tqdm import tqdm

    if sys.stderr.isatty():
        with tqdm(unit="layer", desc=what, file=sys.stderr, dynamic_ncols=True) as bar:
            yield lambda kind, layer: bar.update(1)
        return
    started = time.monotonic()
    yield lambda kind, layer: click.echo(f"kvdb: {what}: {kind} layer {layer} trained ({time.monotonic() - started:.0f}s)", err=True)


def _emit(obj: dict) -> None:
    click.echo(json.dumps(obj, ensure_ascii=False, default=str))


_CONTROL = {c: f"\\x{c:02x}" for c in [*range(0x20), 0x7F, *range(0x80, 0xA0)]} | {ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t"}


def _printable(text: str) -> str:
    """``text`` kept on its one line of a listing: control characters (a CRLF file's ``\\r``, a
    newline inside a snippet, an escape sequence) print as escapes instead of moving the cursor
    or restyling the terminal. ``show`` and ``--json`` print text as it is."""
    return text.translate(_CONTROL)


JSON_META = "kvdb.json"  # ctx.meta, shared by every context of one invocation: errors are JSON too


def _remember_json(ctx: click.Context, _param, value: bool) -> bool:
    ctx.meta[JSON_META] = ctx.meta.get(JSON_META) or value
    return value


json_option = click.option(
    "--json", "as_json", is_flag=True, callback=_remember_json, help="Print JSON (one object per line) instead of text; errors too, on stderr."
)
model_option = click.option(
    "--model",
    envvar="KVDB_MODEL",
    default=None,
    help="Hugging Face model id or local folder (env KVDB_MODEL). Default: the embedded SmolLM2-135M-Instruct.",
)


@click.group(cls=KvdbGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--db",
    type=click.Path(dir_okay=False),
    envvar="KVDB_DB",
    default=None,
    help="Archive file, or a DuckLake: ducklake:postgres:<libpq conninfo> (env KVDB_DB). Default: archive.duckdb in the user data directory.",
)
@click.option(
    "--data-path",
    envvar="KVDB_DATA_PATH",
    default=None,
    help="Where a new DuckLake archive keeps its Parquet files: a folder every machine mounts, or s3://... (env KVDB_DATA_PATH). Needed only to create the lake.",
)
@click.version_option(kvdb.__version__, prog_name="kvdb")
@click.pass_context
def main(ctx, db, data_path):
    """kvdb: archive language-model sessions, search them, and restore them into the model.

    \b
    Ingest transcripts:    kvdb ingest examples/transcripts
    List sessions:         kvdb sessions
    Show one back:         kvdb show SESSION
    Restore and continue:  kvdb restore SESSION --prompt "What next?"

    SESSION is a full id, a session name (NAME#2: the second session of that name), or a unique id prefix.
    Exit codes: 0 ok, 1 some input failed (or: search found no full match, verify found a
    problem), 2 bad input or argument, 3 no such session,
    4 model missing, mismatched or unsupported, 5 archive missing or unreadable, 6 archive in use by another
    process (waits $KVDB_LOCK_TIMEOUT seconds first, default 10) or, on a lake, changed by
    another writer meanwhile (run it again), 70 internal error.
    """
    ctx.obj = {"db": db, "data_path": data_path}


def _open(ctx, model: str | None = None, read_only: bool = False, prefix_cache_mb: float | None = None) -> kvdb.Archive:
    """Commands that only read open the file read-only, so that several can run at once."""
    archive = kvdb.open(ctx.obj["db"], model=model, read_only=read_only, data_path=ctx.obj["data_path"], prefix_cache_mb=prefix_cache_mb)
    ctx.call_on_close(archive.close)
    return archive


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@click.option(
    "--keep",
    default=DEFAULT_KEEP,
    show_default=True,
    help="Tiers to store: tokens (1.95 B/token), search (phrase index; needs tokens), lm (tokens coded against "
    "the model: ~4x smaller than xz, but codes ~10 tokens/s on 2 cores; with lm, tokens may be left out and "
    "reads decode lm), kv (quantized KV cache for restores without a forward pass; coded with the archive's trained codebooks, else with the shipped ones, built on this machine's first use).",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Worker processes, each with the model loaded, taking the input files in turn (on 2 cores, 2). "
    "On a DuckLake archive, workers on other machines may share the folder: each file is claimed by one.",
)
@model_option
@json_option
@click.pass_context
def ingest(ctx, paths, keep, workers, model, as_json):
    """Archive transcripts: files or directories (searched recursively).

    \b
    .txt / .md      one session, text verbatim (UTF-8, or UTF-16/32 with a byte order mark)
    .json / .jsonl  read from their content: OpenAI Chat Completions or Responses, Anthropic
                    Messages, a ChatGPT export (conversations.json), agent event logs (Claude
                    Code), ShareGPT, LMSYS-Chat, Alpaca; a session or a message per line,
                    or a list of either (the README lists each format)

    Every file is checked before the model loads. What has no text (an image, say) is kept
    as a "[image not archived]" placeholder and counted ("dropped" in --json). A file that fails is reported with its line and writes nothing; the others still ingest
    (exit status 1). Ingesting the same transcript again reports it `unchanged`, or
    `updated` when --keep names tiers it was archived without, which it is then given.
    A file is parsed once, and its sessions rendered and tokenized once, all before the first
    write: memory holds one file's sessions at a time. One session may hold at most the model's
    context (8,192 tokens for SmolLM2). Readers (search, show, restore) can use the archive
    between sessions, while the model computes.
    """
    from tqdm import tqdm

    archive = _open(ctx, model)
    if "kv" in parse_keep(keep) and not any(c.source == "trained" for c in archive.codebooks()):
        with _layer_progress("shipped codebooks (once per machine)") as heard:  # minutes, said as such, not one session's seconds
            archive.build_shipped_codebooks(progress=heard)
    with tqdm(unit="tok", desc="ingest", file=sys.stderr, disable=None, dynamic_ncols=True) as bar:

        def progress(done: int, planned: int) -> None:
            if planned:
                bar.total = (bar.total or 0) + planned
                bar.refresh()
            bar.update(done)

        results = archive.ingest(list(paths), keep=keep, progress=progress, workers=workers)
    for r in results:
        if as_json:
            _emit(r.to_dict())
        elif r.status == "failed":
            click.echo(f"failed     {r.error}", err=True)
        elif r.status == "claimed":
            click.echo(f"claimed    {_printable(r.source)}  (being archived by {r.claimed_by})")
        else:
            new = {"ingested": f"  ({r.new_tokens} new, {r.seconds:.2f}s)", "updated": f"  (added {','.join(r.added)}, {r.seconds:.2f}s)"}.get(r.status, "")
            dropped = "".join(f"  [{count} {kind} not archived]" for kind, count in r.dropped.items())
            click.echo(f"{r.status:<10} {r.session_id[:12]}  {r.n_tokens:>7} tok  {_printable(r.name)}{new}{dropped}")
    if any(r.status == "failed" for r in results):
        sys.exit(1)


@main.command()
@json_option
@click.pass_context
def sessions(ctx, as_json):
    """List archived sessions, oldest first, each with the file it came from (sessions of one name
    are NAME#1, NAME#2, ... in this order)."""
    for s in _open(ctx, read_only=True).sessions():
        if as_json:
            _emit(s.to_dict())
        else:
            click.echo(f"{s.session_id[:12]}  {s.n_tokens:>7} tok  {s.created_at:%Y-%m-%d %H:%M}  {_printable(s.name)}  ({_printable(s.source)})")


@main.command()
@click.argument("session")
@click.option("--start", type=int, default=None, help="First token (default 0).")
@click.option("--end", type=int, default=None, help="One past the last token (default: the session's end).")
@model_option
@json_option
@click.pass_context
def show(ctx, session, start, end, model, as_json):
    """Print the text of a session's tokens [START, END). A whole text session prints exactly as ingested."""
    archive = _open(ctx, model, read_only=True)
    s = archive.session(session)
    text = archive.text(s.session_id, start, end)
    if as_json:
        start = 0 if start is None else start
        end = s.n_tokens if end is None else end
        _emit({"session_id": s.session_id, "start": start, "end": end, "text": text, "tokens": archive.tokens(s.session_id, start, end).tolist()})
    else:
        click.echo(text, nl=False)
        if sys.stdout.isatty() and not text.endswith("\n"):
            click.echo()


@main.command()
@click.argument("session")
@click.option("--at", type=int, default=None, help="Restore the first AT tokens (default: all).")
@click.option("--prompt", default=None, help="Text to add before continuing (a new user turn for chat sessions).")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option(
    "--mode",
    type=click.Choice(RESTORE_MODES),
    default="auto",
    show_default=True,
    help="exact: prefill from the token tier; archive: build the cache from tier K (no forward pass, approximate); "
    "decode: rebuild tokens and cache from tier L alone; auto: archive when the session has tier K, else exact.",
)
@click.option(
    "--window",
    type=click.Choice(WINDOWS),
    default=DEFAULT_WINDOW,
    show_default=True,
    help="archive mode: recompute recomputes the sinks and the 32 most recent positions in one forward pass; "
    "stored runs none (exact sinks from this machine's cache of them, the rest from tier K: faster, further from exact).",
)
@click.option("--fidelity", "with_fidelity", is_flag=True, help="Also measure the archive restore against an exact prefill on a 32-token probe.")
@model_option
@json_option
@click.pass_context
def restore(ctx, session, at, prompt, max_new_tokens, mode, window, with_fidelity, model, as_json):
    """Restore a session into the model and continue it greedily."""
    archive = _open(ctx, model, read_only=True)
    s = archive.session(session)
    restored = archive.restore(s.session_id, at=at, mode=mode, window=window)
    text = archive.generate(restored, prompt, max_new_tokens)
    out = dict(restored.to_dict(), text=text)  # seconds: the restore itself, not loading the model
    fidelity = archive.fidelity(s.session_id, at=at, window=window) if with_fidelity else None
    if fidelity is not None:
        out["fidelity"] = fidelity.to_dict()
    if as_json:
        _emit(out)
    else:
        click.echo(f"[restored {restored.position} tokens of {_printable(s.name)} in {restored.seconds:.2f}s, mode {restored.mode}]", err=True)
        if fidelity is not None:
            click.echo(
                f"[fidelity: top-1 agreement {fidelity.top1_agreement:.3f}, perplexity ratio {fidelity.ppl_ratio:.4f} over {fidelity.probe_tokens} tokens]",
                err=True,
            )
        click.echo(text)


@main.command()
@click.argument("phrase")
@click.option("-k", "k", type=click.IntRange(min=1), default=10, show_default=True, help="Number of hits.")
@click.option("--context", type=click.IntRange(min=0), default=32, show_default=True, help="Tokens of context on each side.")
@click.option("--session", default=None, help="Search only this session (id, id prefix or name).")
@click.option(
    "--semantic",
    is_flag=True,
    help="Experimental: nearest contexts in the model's key space (sessions stored with tier K; loads the model). "
    "It loses to a sentence-embedding model on a retrieval set nobody here wrote (benchmarks/retrieval.py).",
)
@click.option("--layer", type=int, default=None, help="With --semantic: the layer whose keys are compared (default: the middle one).")
@model_option
@json_option
@click.pass_context
def search(ctx, phrase, k, context, session, semantic, layer, model, as_json):
    """Find PHRASE in the archived sessions.

    Full matches come first, then the places that share the longest end of the phrase
    (marked partial). Each hit gives the session and the position of its first token, which
    `kvdb restore SESSION --at POSITION` accepts. Exit status 1 when no hit is a full match.
    """
    archive = _open(ctx, model, read_only=True)
    if not archive.sessions():
        raise KvdbError("the archive is empty; ingest transcripts first with `kvdb ingest PATH`")
    if semantic:
        if session is not None:
            raise click.UsageError("--session and --semantic cannot be combined yet")
        hits = archive.search_semantic(phrase, k=k, context=context, layer=layer)
    else:
        hits = archive.search(phrase, k=k, context=context, session=session)
    for h in hits:
        if as_json:
            _emit(h.to_dict())
            continue
        grade = "exact" if h.exact else f"cosine {h.similarity:.3f}" if h.similarity is not None else f"partial: {h.match_tokens}/{h.query_tokens} tokens"
        click.echo(f"{_printable(h.name)} {h.session_id[:12]} @{h.position}  [{grade}]")
        click.echo("    " + _printable(h.before) + click.style(_printable(h.match), bold=True, reverse=True) + _printable(h.after))
    if all(h.partial for h in hits):
        if not as_json:
            click.echo("no full match; the hits above share only the end of the phrase" if hits else "no match", err=True)
        sys.exit(1)


@main.command()
@click.option("--deep", is_flag=True, help="Check every stored block and decode every session (else a sample of each tier).")
@json_option
@click.pass_context
def verify(ctx, deep, as_json):
    """Check the archive: stored blocks, the trie, reference counts, search indexes.

    Exit status 0 when everything holds, 1 when a problem was found (one line each).
    """
    report = _open(ctx, read_only=True).verify(deep=deep)
    if as_json:
        _emit(report.to_dict())
    else:
        for note in report.notes:
            click.echo(f"note: {note}")
        for problem in report.problems:
            click.echo(f"problem: {problem}")
        checked = ", ".join(f"{n} {what}" for what, n in report.checked.items())
        click.echo(f"{'ok' if report.ok else f'{len(report.problems)} problem(s)'}: checked {checked}", err=not report.ok)
    if not report.ok:
        sys.exit(1)


@main.command()
@json_option
@click.pass_context
def repair(ctx, as_json):
    """Rebuild what can be derived (search indexes), then say what cannot be repaired."""
    result = _open(ctx).repair()
    if as_json:
        _emit(result.to_dict())
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
    help="Residual stages of 256 centroids for keys and values, e.g. k4v3, k4v2, k2v1; overrides per layer as "
    f"k3v3+k8@7,18+k2@0-5, or per KV head as k3v3+k12@18.2 (layer 18, head 2).  [default: the model's measured preset where kvdb has one (SmolLM2-135M-Instruct), else {presets.DEFAULT_PRESET}]",
)
@click.option("--tokens", type=click.IntRange(min=256), default=8192, show_default=True, help="Archived positions to train on.")
@model_option
@json_option
@click.pass_context
def codebooks_train(ctx, preset, tokens, model, as_json):
    """Train codebooks on the archive's own sessions; later `ingest --keep ...,kv` uses them."""
    report = _open(ctx.parent, model).train_codebooks(preset=preset, tokens=tokens)
    if as_json:
        _emit(report.to_dict())
    else:
        click.echo(f"trained {report.preset} codebooks {report.codebook_id[:12]} on {report.tokens} positions ({report.bytes} bytes) in {report.seconds}s")


@codebooks.command("list")
@json_option
@click.pass_context
def codebooks_list(ctx, as_json):
    """List the codebooks the archive holds (trained) or references (shipped), oldest first.

    Ingest codes tier K with the newest trained set of the model, else with the shipped one.
    STORED is what the archive keeps; CENTROIDS what decoding uses (for shipped codebooks, a
    file in this machine's kvdb cache, shared by every archive of the model).
    """
    for c in _open(ctx.parent, read_only=True).codebooks():
        if as_json:
            _emit(c.to_dict())
        else:
            where = "" if c.on_this_machine else "  (not built on this machine yet)"
            click.echo(f"{c.codebook_id[:12]}  {c.source:<7}  {c.preset:<8}  stored {c.stored_bytes:>10}  centroids {c.centroid_bytes:>10}{where}")


@codebooks.command("build")
@model_option
@json_option
@click.pass_context
def codebooks_build(ctx, model, as_json):
    """Build this machine's shipped codebooks for the model now (once; about 2.5 minutes for SmolLM2 on 2 cores).

    They are trained on the calibration text shipped with kvdb, cached in the kvdb cache
    directory ($KVDB_CACHE), and used by `ingest --keep ...,kv` on any archive with no trained
    codebooks; otherwise the first such ingest builds them.
    """
    archive = _open(ctx.parent, model)
    with _layer_progress("shipped codebooks") as heard:
        report = archive.build_shipped_codebooks(progress=heard)
    if as_json:
        _emit(report.to_dict())
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
    report = _open(ctx.parent, model).rebuild_index()
    if as_json:
        _emit(report.to_dict())
    else:
        click.echo(f"rebuilt index {report.index_key}: {report.sessions} sessions, {report.points} points in {report.seconds}s")


@main.command()
@json_option
@click.pass_context
def stats(ctx, as_json):
    """Sessions, tokens, and bytes stored per tier."""
    st = _open(ctx, read_only=True).stats()
    if as_json:
        _emit(st.to_dict())
        return
    click.echo(f"sessions       {st.sessions}")
    click.echo(f"tokens         {st.tokens}  (summed over sessions)")
    click.echo(f"stored_tokens  {st.stored_tokens}  (after prefix sharing, in {st.nodes} trie nodes)")
    for tier, n in st.bytes.items():
        per = st.bytes_per_token.get(tier)
        click.echo(f"bytes.{tier:<10} {n:>12}" + (f"  ({per:.2f} B/token)" if per is not None else ""))
    if st.shipped_codebook_bytes:
        click.echo(f"shipped codebooks {st.shipped_codebook_bytes:>9}  (referenced, not stored: in this machine's kvdb cache)")


@main.command()
@json_option
@click.pass_context
def prefixes(ctx, as_json):
    """List token prefixes that several sessions share (each stored once).

    BITS is d_T = -log2 P(prefix) under the model: what the sessions have in common.
    """
    for p in _open(ctx, read_only=True).prefixes():
        if as_json:
            _emit(p.to_dict())
        else:
            click.echo(f"{p.tokens:>7} tok  {p.bits:>9.1f} bits  {p.sessions:>3} sessions  {_printable(' '.join(p.text.split()[:8]))}")


@main.command()
@click.argument("session")
@click.option("--keep", required=True, help="Tiers to keep, e.g. tokens, tokens,search, or lm (tier L as the only copy of the tokens).")
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
    s = _open(ctx).compact(session, keep)
    if as_json:
        _emit(s.to_dict())
    else:
        click.echo(f"compacted {s.session_id[:12]} ({_printable(s.name)}) to {keep}")


@main.command()
@json_option
@click.pass_context
def gc(ctx, as_json):
    """Free the stored prefixes that no session uses any more (after deletes).

    It also renumbers a search index whose freed slots outnumber its live ones. An archive file
    whose free space is over a quarter of it (and 1 MiB) is rewritten smaller, since DuckDB
    never shrinks a file; on a lake it merges the small Parquet files each commit leaves (the
    files a merge replaced are deleted by a gc an hour or more later, so readers still scanning
    them finish)."""
    freed = _open(ctx).gc()
    if as_json:
        _emit(freed.to_dict())
    else:
        click.echo(
            f"freed {freed.nodes} nodes, {freed.tokens} tokens, {freed.token_bytes} bytes of token blocks, "
            f"{freed.prefix_cache_entries} prefix-cache entries"
            + (
                f"; merged {freed.data_files_merged} data files into {freed.data_files_written}, deleted {freed.data_files_deleted}"
                if freed.data_files_merged is not None
                else ""
            )
        )


@main.command()
@click.option(
    "--host", default="127.0.0.1", show_default=True, help="Address to listen on (loopback by default: give 0.0.0.0, with --api-key, to serve others)."
)
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@model_option
@click.option("--keep", default=DEFAULT_KEEP, show_default=True, help="Tiers each exchange is archived with (as `kvdb ingest --keep`).")
@click.option(
    "--restore",
    type=click.Choice(["exact", "archive"]),
    default="exact",
    show_default=True,
    help="Where prompts resume from: exact caches only, or also tier K (approximate; replies say so).",
)
@click.option("--api-key", envvar="KVDB_API_KEY", default=None, help="Require `Authorization: Bearer KEY` on every route but /health (env KVDB_API_KEY).")
@click.option("--queue", type=click.IntRange(min=0), default=8, show_default=True, help="Requests that may wait for the model; more are refused (429).")
@click.option(
    "--queue-timeout",
    type=click.FloatRange(min=0),
    default=600.0,
    show_default=True,
    help="Seconds a request may wait for the model before it is refused (429); the official openai client waits 600 s for a reply.",
)
@click.option(
    "--prefix-cache-mb",
    type=click.FloatRange(min=0),
    envvar="KVDB_PREFIX_CACHE_MB",
    default=DEFAULT_PREFIX_CACHE_MB,
    show_default=True,
    help="Cap of the exact caches kept beside the archive (<archive>.prefix/), least recently used deleted first; 0 turns them off (env KVDB_PREFIX_CACHE_MB).",
)
@click.pass_context
def serve(ctx, host, port, model, keep, restore, api_key, queue, queue_timeout, prefix_cache_mb):
    """Serve the model over an OpenAI-compatible HTTP API, archiving every exchange.

    Prompts resume from the longest prefix already computed or archived; each reply is in the
    journal (<archive>.serve/) before its last bytes are sent, and is archived in the background.
    Serves until SIGINT or SIGTERM; the journal left over is archived at the next start.
    """
    from kvdb.serving import Engine
    from kvdb_server import serve as run_server

    engine = Engine(_open(ctx, model, prefix_cache_mb=prefix_cache_mb), keep=keep, restore=restore, queue=queue, queue_timeout=queue_timeout)
    click.echo(f"kvdb serve: model {engine.model_name} on http://{host}:{port}{' (API key required)' if api_key else ''}", err=True)
    run_server(engine, host, port, api_key)


@main.command()
@click.argument("source")
@click.argument("target")
@json_option
@click.pass_context
def copy(ctx, source, target, as_json):
    """Copy the archive SOURCE into TARGET, a new file or an empty lake, either way round.

    \b
    kvdb copy archive.duckdb "ducklake:postgres:dbname=kvdb host=db" --data-path /mnt/kvdb
    kvdb copy "ducklake:postgres:dbname=kvdb host=db" backup.duckdb

    Every row goes over in one transaction (the target holds all of it or nothing), then each
    table's SHA-256 is compared on both sides. --data-path (before the command) is the new
    lake's. Search indexes and the prefix cache are derived: rebuilt in TARGET on first use.
    """
    archive = kvdb.open(source, read_only=True)
    ctx.call_on_close(archive.close)
    report = archive.copy_to(target, data_path=ctx.obj["data_path"])
    if as_json:
        _emit(report.to_dict())
    else:
        click.echo(f"copied {report.source} to {report.target}: {sum(report.rows.values())} rows in {len(report.rows)} tables, content hashes equal")


@main.command()
@click.argument("session")
@json_option
@click.pass_context
def delete(ctx, session, as_json):
    """Delete a session. Prefixes other sessions share stay; `kvdb gc` frees the rest."""
    s = _open(ctx).delete(session)
    if as_json:
        _emit(s.to_dict())
    else:
        click.echo(f"deleted {s.session_id[:12]} ({_printable(s.name)})")

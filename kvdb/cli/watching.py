"""`kvdb watch`."""

from __future__ import annotations

import logging
import os
import signal
import threading

import click

from kvdb.cli.app import embedder_option, emit, json_option, main, model_option, open_archive, printable
from kvdb.services.watching import AGENT_FOLDERS, agent_sources
from kvdb.tiers import DEFAULT_KEEP, DEFAULT_KV_PRESET

PID_SUFFIX = ".watch.pid"  # beside the archive: the running watcher's process id, for --status
LOG_SUFFIX = ".watch.log"


@main.command()
@click.argument("paths", nargs=-1)
@click.option(
    "--from",
    "agent",
    type=click.Choice(sorted(AGENT_FOLDERS)),
    default=None,
    help="Watch this agent's own log folders too, beside any PATHS (see docs/agents.md).",
)
@click.option("--once", is_flag=True, help="One pass over what changed since the last, then exit (for cron).")
@click.option(
    "--status",
    "show_status",
    is_flag=True,
    help="List the files followed, as last archived, and whether a watcher runs; watch nothing.",
)
@click.option(
    "--keep", default=DEFAULT_KEEP, show_default=True, help="Tiers each log is archived with (as `kvdb ingest --keep`)."
)
@click.option(
    "--kv-preset",
    default=DEFAULT_KV_PRESET,
    show_default=True,
    help="How finely tier K is coded (as `kvdb ingest --kv-preset`).",
)
@click.option(
    "--redact",
    is_flag=True,
    help="Archive secrets of known shapes as [secret not archived] (as `kvdb ingest --redact`).",
)
@click.option(
    "--readmit-forgotten",
    "readmit",
    is_flag=True,
    help="Archive again the logs whose sessions were all deleted (status forgotten), "
    "which watch otherwise leaves alone however they grow.",
)
@embedder_option
@model_option
@json_option
@click.pass_context
def watch(ctx, paths, agent, once, show_status, keep, kv_preset, redact, readmit, embedder, model, as_json):
    """Archive agent logs as they grow: PATHS (folders or files), and with --from an agent's own
    folders (claude-code: ~/.claude/projects, or $CLAUDE_CONFIG_DIR/projects; codex:
    ~/.codex/sessions and archived_sessions, or under $CODEX_HOME; gemini: ~/.gemini/tmp, or
    under $GEMINI_CLI_HOME). With PATHS, --from follows both, and leaves out an agent folder
    that does not exist yet; without PATHS, a missing agent folder is refused (exit status 2).

    A pass archives each log that changed since the archive's watch checkpoint (a grown log
    stores only its new turns; one rewritten or cut shorter becomes a fork of its conversation;
    one whose last line is still being written waits for it); then each change is archived as
    the operating system reports it, until Ctrl-C or SIGTERM, which finish the file in hand.
    Progress and errors go to stderr and to ARCHIVE.watch.log."""
    if show_status:
        _status(ctx, as_json)
        return
    roots = [str(p) for p in agent_sources(agent, paths, follow=True)]
    archive = open_archive(ctx, model, embedder=embedder)
    archive.check_keep(keep, kv_preset)
    log = _log(archive.local_path(LOG_SUFFIX))

    def heard(results) -> None:
        for r in results:
            if as_json:
                emit(r.to_dict())
            part = f" part {r.part}" if r.part is not None else ""
            line = (
                f"{r.status.value} {r.source}"
                + (f" ({r.name}{part}: {r.new_tokens} new tokens)" if r.status == "ingested" else "")
                + (f": {r.error}" if r.error else "")
            )
            (log.error if r.status == "failed" else log.info)(printable(line))

    if once:
        heard(archive.watch(roots, keep=keep, kv_preset=kv_preset, redact=redact, readmit_forgotten=readmit))
        return
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    pid_file = archive.local_path(PID_SUFFIX)
    pid_file.write_text(str(os.getpid()))
    try:
        log.info("watching %s", ", ".join(roots))
        archive.watch(
            roots, stop=stop, heard=heard, keep=keep, kv_preset=kv_preset, redact=redact, readmit_forgotten=readmit
        )
        log.info("stopped")
    finally:
        pid_file.unlink(missing_ok=True)


def _status(ctx, as_json: bool) -> None:
    archive = open_archive(ctx, read_only=True)
    pid_file = archive.local_path(PID_SUFFIX)
    pid = int(pid_file.read_text()) if pid_file.exists() else None
    running = pid is not None and _alive(pid)
    files = archive.watched()
    if as_json:
        emit({"running": running, "pid": pid if running else None, "files": [f.to_dict() for f in files]})
        return
    click.echo(f"watcher running (pid {pid})" if running else "no watcher running")
    for f in files:
        click.echo(
            f"{f.status:<10} {f.size:>10} B  {f.checked_at:%Y-%m-%d %H:%M:%S}  {printable(f.path)}"
            + (f"  ({printable(f.detail)})" if f.detail else "")
        )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _log(path) -> logging.Logger:
    log = logging.getLogger("kvdb.watch")
    log.setLevel(logging.INFO)
    for handler in (logging.StreamHandler(), logging.FileHandler(path, encoding="utf-8")):
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        log.addHandler(handler)
    return log

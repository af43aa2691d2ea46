"""`kvdb serve`."""

from __future__ import annotations

import os
import signal

import click

from kvdb.cli.app import embedder_option, main, model_option, open_archive
from kvdb.model.prefix_cache import DEFAULT_BUDGET_MB as DEFAULT_PREFIX_CACHE_MB
from kvdb.tiers import DEFAULT_KEEP, DEFAULT_KV_PRESET, DEFAULT_MAX_LOSS


@main.command()
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to listen on (loopback by default: give 0.0.0.0, with --api-key, to serve others).",
)
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@embedder_option
@model_option
@click.option(
    "--keep",
    default=DEFAULT_KEEP,
    show_default=True,
    help="Tiers each exchange is archived with (as `kvdb ingest --keep`).",
)
@click.option(
    "--kv-preset",
    default=DEFAULT_KV_PRESET,
    show_default=True,
    help="How finely tier K is coded (as `kvdb ingest --kv-preset`).",
)
@click.option(
    "--restore",
    type=click.Choice(["exact", "auto", "archive"]),
    default="exact",
    show_default=True,
    help="Where prompts resume from: exact caches only; also tier K where its preset is measured within --max-loss "
    "(auto); "
    "or also tier K whatever its fidelity (archive). Tier K is approximate: replies say so.",
)
@click.option(
    "--max-loss",
    type=float,
    default=DEFAULT_MAX_LOSS,
    show_default=True,
    help="--restore auto: the perplexity ratio over an exact cache that tier K's measured fidelity may reach "
    "(at least 1.0).",
)
@click.option(
    "--api-key",
    envvar="KVDB_API_KEY",
    default=None,
    help="Require `Authorization: Bearer KEY` on every route but /health (env KVDB_API_KEY).",
)
@click.option(
    "--queue",
    type=click.IntRange(min=0),
    default=8,
    show_default=True,
    help="Requests that may wait for the model; more are refused (429).",
)
@click.option(
    "--queue-timeout",
    type=click.FloatRange(min=0),
    default=600.0,
    show_default=True,
    help="Seconds a request may wait for the model before it is refused (429); "
    "the official openai client waits 600 s for a reply.",
)
@click.option(
    "--prefix-cache-mb",
    type=click.FloatRange(min=0),
    envvar="KVDB_PREFIX_CACHE_MB",
    default=DEFAULT_PREFIX_CACHE_MB,
    show_default=True,
    help="Cap of the exact caches kept beside the archive (<archive>.prefix/), least recently used deleted first; "
    "0 turns them off (env KVDB_PREFIX_CACHE_MB).",
)
@click.option(
    "--upstream",
    metavar="URL",
    default=None,
    help="Forward /v1/chat/completions, /v1/completions and /v1/models to this OpenAI-compatible API (its base URL, "
    "as the openai client's base_url: http://127.0.0.1:8080/v1) and archive each exchange: kvdb as a proxy.",
)
@click.option(
    "--upstream-key-env",
    metavar="NAME",
    default=None,
    help="The environment variable holding the upstream's API key (sent as `Authorization: Bearer KEY`); without it, "
    "a client's own Authorization header is passed on, unless --api-key is given.",
)
@click.pass_context
def serve(
    ctx,
    host,
    port,
    embedder,
    model,
    keep,
    kv_preset,
    restore,
    max_loss,
    api_key,
    queue,
    queue_timeout,
    prefix_cache_mb,
    upstream,
    upstream_key_env,
):
    """Serve the model over an OpenAI-compatible HTTP API, archiving every exchange.

    Prompts resume from the longest prefix already computed or archived; each reply is in the
    journal (<archive>.serve/) before its last bytes are sent, and is archived in the background.
    With --upstream, completions are another server's, forwarded and returned unchanged, and
    each exchange is journalled and archived once its reply is sent.
    Serves until SIGINT or SIGTERM; the journal left over is archived at the next start.
    """
    from kvdb.server import serve as run_server
    from kvdb.server.upstream import base_url
    from kvdb.serving import Engine

    upstream_key = None
    if upstream_key_env is not None:
        if upstream is None:
            raise click.UsageError("--upstream-key-env names the key of an --upstream; give --upstream URL too")
        upstream_key = os.environ.get(upstream_key_env)
        if not upstream_key:
            raise click.BadParameter(
                f"the environment variable {upstream_key_env} is not set (or empty); set it to the upstream's API key",
                param_hint="--upstream-key-env",
            )
    if upstream is not None:
        upstream = base_url(upstream)  # a malformed URL refused before the model loads

    engine = Engine(
        open_archive(ctx, model, prefix_cache_mb=prefix_cache_mb, embedder=embedder),
        keep=keep,
        restore=restore,
        queue=queue,
        queue_timeout=queue_timeout,
        kv_preset=kv_preset,
        max_loss=max_loss,
    )
    serving = (
        f"completions of {upstream}, archived with model {engine.model_name}'s tokenizer,"
        if upstream
        else f"model {engine.model_name}"
    )
    click.echo(f"kvdb serve: {serving} on http://{host}:{port}{' (API key required)' if api_key else ''}", err=True)
    run_server(engine, host, port, api_key, upstream, upstream_key)


@main.command()
@click.option(
    "--allow-continue",
    is_flag=True,
    help="Offer the `continue` tool, which loads the model and runs it (the others only read).",
)
@embedder_option
@model_option
@click.pass_context
def mcp(ctx, allow_continue, embedder, model):
    """Answer an agent over the Model Context Protocol, on stdin and stdout (register the
    command `kvdb --db ARCHIVE mcp` with the agent: see docs/agents.md). Its tools:
    search (by phrase or meaning; filters by session, agent, project folder and days), show (a
    conversation, paged), sessions (recent first), and with --allow-continue, continue (restore
    a conversation at a position and ask the model). The archive is opened read-only."""
    from kvdb.mcp import build, make_call  # the SDK is imported by this command alone

    archive = open_archive(ctx, model, read_only=True, embedder=embedder)
    # Ctrl-C (and an agent's SIGINT) would wait for the SDK's stdin reader thread, that is, for
    # stdin to close. Nothing is left half-done by leaving at once: the archive is read-only.
    signal.signal(signal.SIGINT, lambda *_: os._exit(130))
    build(make_call(archive), archive.model_name if allow_continue else None).run("stdio")

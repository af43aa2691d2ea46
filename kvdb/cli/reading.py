"""Commands that read: sessions, show, restore, search, stats, prefixes."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from kvdb.cli.app import embedder_option, emit, json_option, main, model_option, open_archive, printable
from kvdb.errors import KvdbError
from kvdb.index.phrase import MIN_SHARE
from kvdb.records import MeaningHit
from kvdb.tiers import DEFAULT_MAX_LOSS, RESTORE_MODES, WINDOWS

PAGE = 100  # conversations `sessions` lists unless told: a whole history's 50k scroll past any reader
DAY_HELP = (
    "this day (YYYY-MM-DD, UTC), by when its latest version was said: its log's last time, else when it was archived"
)
SCOPE = (  # the filters `sessions` lists by and `search` keeps to: Archive.conversations' arguments
    click.option(
        "--agent",
        default=None,
        help="Only conversations written by this agent or format (claude-code, codex-cli, chatgpt, messages, ...).",
    ),
    click.option(
        "--project",
        default=None,
        help="Only conversations about this folder or one inside it (the working directory a log records, "
        "else the file's folder; '.': the current one).",
    ),
    click.option(
        "--since",
        type=click.DateTime(["%Y-%m-%d"]),
        default=None,
        help=f"Only conversations said on or after {DAY_HELP}.",
    ),
    click.option(
        "--until",
        type=click.DateTime(["%Y-%m-%d"]),
        default=None,
        help=f"Only conversations said on or before {DAY_HELP}.",
    ),
)


def scope_options(command):
    for option in reversed(SCOPE):
        command = option(command)
    return command


@main.command()
@click.option(
    "--versions",
    "every",
    is_flag=True,
    help="List every stored version of every conversation (each a session), oldest first.",
)
@scope_options
@click.option(
    "--limit",
    type=click.IntRange(min=1),
    default=None,
    help=f"List the N most recently updated conversations (still oldest first), and say on stderr how many "
    f"earlier ones it left out. Default: {PAGE}.",
)
@click.option(
    "--offset",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Leave out the N most recently updated conversations first (the next page back).",
)
@click.option("--all", "whole", is_flag=True, help="List every conversation the filters admit, not a page.")
@json_option
@click.pass_context
def sessions(ctx, every, agent, project, since, until, limit, offset, whole, as_json):
    """List the archived conversations, oldest first, each as its latest version (with the time
    it was said: its log's last time, else when it was archived), with the file
    it came from and how many versions it has (conversations of one name are NAME#1, NAME#2, ...
    in this order). A conversation's versions are NAME@v1, NAME@v2, ... (`kvdb history NAME`).

    A page at a time: the latest conversations, a whole history's tens of thousands only with
    --all."""
    if whole and limit:
        raise click.UsageError("--all lists every conversation; give it or --limit, not both")
    archive = open_archive(ctx, read_only=True)
    if every:
        if agent or project or since or until or limit or offset or whole:
            raise click.UsageError(
                "--versions lists every session; the filters, --limit, --offset and --all go with the conversation list"
            )
        for s in archive.sessions():
            if as_json:
                emit(s.to_dict())
            else:
                part = f" (part {s.part['number']})" if s.part else ""
                click.echo(
                    f"{s.session_id[:12]}  {s.n_tokens:>7} tok  {s.said_at:%Y-%m-%d %H:%M}  "
                    f"{printable(s.name)}{part}  ({printable(s.source)}){_via(s)}"
                )
        return
    page = archive.conversation_page(
        agent,
        _folder(project),
        since and since.date(),
        until and until.date(),
        None if whole else limit or PAGE,
        offset,
    )
    left_out = page.total - offset - len(page.conversations)
    if left_out > 0:  # on stderr, --json too: what a script reads stays the page
        click.echo(
            f"... {left_out} earlier conversations (--offset {offset + len(page.conversations)}, or --all)", err=True
        )
    for c in reversed(page.conversations):
        if as_json:
            emit(c.to_dict())
            continue
        versions = f"  [{c.versions} versions]" if c.versions > 1 else ""
        latest = c.latest
        click.echo(
            f"{latest.session_id[:12]}  {latest.n_tokens:>7} tok  {latest.said_at:%Y-%m-%d %H:%M}  "
            f"{printable(c.title)}  ({printable(latest.source)}){versions}{_via(latest)}"
        )


def _via(session) -> str:
    """What an exchange `kvdb serve --upstream` relayed says of its model: the upstream's, and,
    where that is not the archive's own, that its tokens are the local tokenizer's and no KV was kept."""
    upstream = session.upstream
    if upstream is None:
        return ""
    model = printable(str(upstream.get("model")))
    return f"  [via {model}]" if upstream.get("same_model") else f"  [via {model}: local tokenizer's tokens, no KV]"


@main.command()
@click.argument("conversation")
@json_option
@click.pass_context
def history(ctx, conversation, as_json):
    """List the versions of a conversation, oldest first: each state it was archived in (a log
    ingested as it grew, a chat turn after turn) and each fork. Version N is CONVERSATION@vN."""
    found = open_archive(ctx, read_only=True).conversation(conversation)
    if as_json:
        emit(found.to_dict())
        return
    click.echo(
        f"{printable(found.conversation.title)}  "
        f"({found.conversation.conversation_id[:12]}, {len(found.versions)} versions)"
    )
    for v in found.versions:
        fork = f"  fork of {v.branch_of[:12]} after {v.forked_at} tok" if v.branch_of else ""
        part = f"  part {v.session.part['number']} from token {v.session.part['starts']}" if v.session.part else ""
        mark = "  latest" if v.latest else ""
        click.echo(
            f"  v{v.number:<3} {v.session.session_id[:12]}  {v.session.n_tokens:>7} tok  "
            f"{v.session.created_at:%Y-%m-%d %H:%M}{part}{fork}{mark}"
        )


@main.command()
@click.argument("session")
@click.option("--start", type=int, default=None, help="First token (default 0).")
@click.option("--end", type=int, default=None, help="One past the last token (default: the session's end).")
@model_option
@json_option
@click.pass_context
def show(ctx, session, start, end, model, as_json):
    """Print the text of a session's tokens [START, END). A whole text session prints exactly as ingested.

    --json adds "side": the text of the session's file that is no turn (a title, summaries,
    tool schemas, alternative replies, hook output, attachment names)."""
    archive = open_archive(ctx, model, read_only=True)
    s = archive.session(session)
    text = archive.text(s.session_id, start, end)
    if as_json:
        start = 0 if start is None else start
        end = s.n_tokens if end is None else end
        tokens = archive.tokens(s.session_id, start, end).tolist()
        emit({"session_id": s.session_id, "start": start, "end": end, "text": text, "tokens": tokens, "side": s.side})
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
    help="exact: prefill from the token tier; archive: build the cache from tier K (approximate; see --window); "
    "decode: rebuild tokens and cache from tier L alone, one model step per token; auto: one of them, by the rule "
    "above (archive only for a preset measured within --max-loss).",
)
@click.option(
    "--max-loss",
    type=float,
    default=DEFAULT_MAX_LOSS,
    show_default=True,
    help="auto mode: the perplexity ratio over an exact cache that tier K's preset may have been measured at, at "
    "every length measured (at least 1.0; 1.05: 5% more perplexed).",
)
@click.option(
    "--window",
    type=click.Choice(WINDOWS),
    default=None,
    help="archive mode: how the exact window is made. recompute: the 4 attention sinks and the 32 most recent "
    "positions are recomputed in one forward pass; stored: no forward pass (the sinks exact from this machine's "
    "cache of them, computed once per opening, the rest from tier K): faster, further from exact.  "
    "[default: the preset's: stored for an entropy-coded one of at least half a bit per element (faithful and "
    "balanced for SmolLM2), recompute for the others (compact)]",
)
@click.option(
    "--fidelity",
    "with_fidelity",
    is_flag=True,
    help="Also measure the archive restore against an exact prefill on a 32-token probe.",
)
@model_option
@json_option
@click.pass_context
def restore(ctx, session, at, prompt, max_new_tokens, mode, max_loss, window, with_fidelity, model, as_json):
    """Restore a session into the model and continue it greedily.

    --mode auto takes tier K only when every node restored has it, coded with a preset whose shipped codebooks were
    measured (kvdb/data/kv_fidelity.json) at a perplexity ratio over the exact cache of at most --max-loss at every
    length measured; else it prefills exactly, or decodes tier L where the tokens are only there. Codebooks trained
    on the archive (`kvdb codebooks train`), and presets nobody measured, are prefilled (decision 0039). A restore
    from tier K is approximate: its speed and fidelity per preset are in benchmarks/RESULTS.md, "Tier K named
    presets".

    The JSON's `reason` says why the restore took its mode; `preset_fidelity`, for a restore from tier K, what its
    preset was measured to cost; `window`, how it made its exact window; and with --fidelity, `fidelity`, this
    restore measured against an exact prefill."""
    archive = open_archive(ctx, model, read_only=True)
    s = archive.session(session)
    restored = archive.restore(s.session_id, at=at, mode=mode, window=window, max_loss=max_loss)
    text = archive.generate(restored, prompt, max_new_tokens)
    out = dict(restored.to_dict(), text=text)  # seconds: the restore itself, not loading the model
    fidelity = archive.fidelity(s.session_id, at=at, window=window) if with_fidelity else None
    if fidelity is not None:
        out["fidelity"] = fidelity.to_dict()
    if as_json:
        emit(out)
    else:
        click.echo(
            f"[restored {restored.position} tokens of {printable(s.name)} in {restored.seconds:.2f}s, "
            f"mode {restored.mode}: {restored.reason}]",
            err=True,
        )
        if fidelity is not None:
            click.echo(
                f"[fidelity: top-1 agreement {fidelity.top1_agreement:.3f}, "
                f"perplexity ratio {fidelity.ppl_ratio:.4f} over {fidelity.probe_tokens} tokens]",
                err=True,
            )
        click.echo(text)


@main.command()
@click.argument("phrase")
@click.option("-k", "k", type=int, default=10, show_default=True, help="Number of hits.")
@click.option("--context", type=int, default=32, show_default=True, help="Tokens of context on each side.")
@click.option(
    "--each-occurrence",
    is_flag=True,
    help="A hit for each place that matches; without it, each conversation is one hit, its best (as --session does).",
)
@scope_options
@click.option("--session", default=None, help="Search only this session (id, id prefix or name).")
@click.option(
    "--case-sensitive",
    is_flag=True,
    help="Match the phrase's casing only. By default every other casing the archive holds is searched too, "
    "word by word and letter by letter (decision 0057).",
)
@click.option(
    "--min-share",
    type=click.FloatRange(0, 1),
    default=MIN_SHARE,
    show_default=True,
    help="Show a partial hit only where it matches at least this share of the phrase's tokens; "
    "0 shows every partial hit.",
)
@click.option(
    "--semantic",
    is_flag=True,
    help="Search by meaning: the chunks nearest PHRASE under the sentence-embedding model, "
    "over sessions stored with the "
    "semantic tier (ingest with --keep tokens,search,semantic; embedded by `kvdb upkeep`, "
    "or watch and serve when idle: a note says how "
    "many sessions wait); one hit per session, at its nearest chunk.",
)
@click.option(
    "--count",
    "count_only",
    is_flag=True,
    help="Print how many places hold the whole phrase (in the casings searched), instead of the hits: "
    "exact, each archived "
    "position once however many sessions share it. Exit status 1 when there are none.",
)
@embedder_option
@model_option
@json_option
@click.pass_context
def search(
    ctx,
    phrase,
    k,
    context,
    agent,
    project,
    since,
    until,
    session,
    each_occurrence,
    case_sensitive,
    min_share,
    semantic,
    count_only,
    embedder,
    model,
    as_json,
):
    """Find PHRASE in the archived sessions.

    Full matches come first, then the places that share the longest end of the phrase
    (marked partial; at least --min-share of its tokens). Other casings of the phrase match too,
    word by word and letter by letter ("iphone" finds "iPhone"), unless --case-sensitive. Each hit
    gives the session and the position of its first token, which
    `kvdb restore SESSION --at POSITION` accepts. Exit status 1 when no hit is a full match.
    """
    archive = open_archive(ctx, model, read_only=True, embedder=embedder)
    if not archive.session_count():
        raise KvdbError("the archive is empty; ingest transcripts first with `kvdb ingest PATH`")
    if count_only:
        if semantic:
            raise click.UsageError("--count counts the places that hold the phrase; it does not go with --semantic")
        counted = archive.count(phrase, session=session, case_sensitive=case_sensitive)
        emit(counted.to_dict()) if as_json else click.echo(counted.count)
        sys.exit(0 if counted.count else 1)
    scope = {
        "agent": agent,
        "project": _folder(project),
        "since": since and since.date(),
        "until": until and until.date(),
    }
    if semantic:
        hits = archive.search_meaning(phrase, k=k, session=session, **scope)
        waiting = archive.pending().semantic
        if waiting.sessions:  # ingest embeds nothing: upkeep, watch and serve catch up, newest first
            click.echo(
                f"kvdb: {waiting.sessions} sessions ({waiting.tokens} tokens) are not embedded yet, "
                "so not searched by meaning: kvdb upkeep",
                err=True,
            )
    else:
        hits = archive.search(
            phrase,
            k=k,
            context=context,
            session=session,
            case_sensitive=case_sensitive,
            min_share=min_share,
            each_occurrence=each_occurrence,
            **scope,
        )
    for h in hits:
        if as_json:
            emit(h.to_dict())
            continue
        grade = (
            "exact"
            if h.exact
            else f"score {h.similarity:.3f}"
            if h.similarity is not None
            else f"partial: {h.match_tokens}/{h.query_tokens} tokens"
        )
        grade += ", weak" if isinstance(h, MeaningHit) and h.weak else ""
        click.echo(f"{printable(h.title or h.name)} {h.session_id[:12]} @{h.position}  [{grade}]")
        click.echo(
            "    " + printable(h.before) + click.style(printable(h.match), bold=True, reverse=True) + printable(h.after)
        )
    if semantic and not as_json and any(isinstance(h, MeaningHit) and h.weak for h in hits):
        from kvdb.services.semantic_tier import WEAK_BELOW

        click.echo(
            f"kvdb: hits marked weak score under {WEAK_BELOW}: likely nothing archived is about this (decision 0058)",
            err=True,
        )
    if all(h.partial for h in hits):
        if not as_json:
            click.echo(
                "no full match; the hits above share only the end of the phrase" if hits else "no match", err=True
            )
        sys.exit(1)


@main.command()
@json_option
@click.pass_context
def stats(ctx, as_json):
    """Sessions, tokens, and bytes stored per tier."""
    st = open_archive(ctx, read_only=True).stats()
    if as_json:
        emit(st.to_dict())
        return
    click.echo(f"sessions       {st.sessions}")
    click.echo(f"tokens         {st.tokens}  (summed over sessions)")
    click.echo(f"stored_tokens  {st.stored_tokens}  (after prefix sharing, in {st.nodes} trie nodes)")
    for tier, n in st.bytes.items():
        per = st.bytes_per_token.get(tier)
        click.echo(f"bytes.{tier:<10} {n:>12}" + (f"  ({per:.2f} B/token)" if per is not None else ""))
        if tier == "kv":
            for preset, coded in st.kv_bytes_by_preset.items():
                click.echo(f"  {preset:<14} {coded:>12}  (tier K of that preset)")
    if st.shipped_codebook_bytes:
        click.echo(
            f"shipped codebooks {st.shipped_codebook_bytes:>9}  (referenced, not stored: in this machine's kvdb cache)"
        )
    for what, queued in (("to embed", st.pending.semantic), ("to score", st.pending.logprobs)):
        if queued.sessions:
            click.echo(f"pending        {queued.sessions} sessions ({queued.tokens} tokens) {what}: kvdb upkeep")


@main.command()
@json_option
@click.pass_context
def prefixes(ctx, as_json):
    """List token prefixes that several sessions share (each stored once).

    BITS is d_T = -log2 P(prefix) under the model: what the sessions have in common. An ingest
    runs no model for the default tiers, so a prefix's bits are "pending" until `kvdb upkeep`
    (or the idle time of `kvdb watch` and `kvdb serve`) has scored it.
    """
    for p in open_archive(ctx, read_only=True).prefixes():
        if as_json:
            emit(p.to_dict())
        else:
            bits = "  pending" if p.bits is None else f"{p.bits:>9.1f}"
            click.echo(
                f"{p.tokens:>7} tok  {bits} bits  {p.sessions:>3} sessions  {printable(' '.join(p.text.split()[:8]))}"
            )


def _folder(project: str | None) -> str | None:
    """A project folder as the archive records it: absolute (``.`` is the current folder)."""
    return None if project is None else str(Path(project).expanduser().resolve())

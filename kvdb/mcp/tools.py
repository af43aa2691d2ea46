"""The tools of `kvdb mcp`: search, show, sessions and, when allowed, continue.

Each tool's description is written for the agent that reads it: what it returns, and how to
ask for more. Results are the same ``to_dict()`` records as ``--json``; a long one is cut, with
a ``note`` saying how to page. The archive is opened read-only: nothing an agent calls writes
to it, and ``continue``, which runs the model, is offered only when the server is started with
``--allow-continue``.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import ValidationError

import kvdb
from kvdb.errors import KvdbError, check_count

SHOW_TOKENS = 2000  # tokens of a session one `show` returns
MAX_HITS = 50
INSTRUCTIONS = (
    "kvdb is an archive of past conversations with language models and coding agents (Claude Code, "
    "Codex CLI, Gemini CLI logs, chat exports, kvdb serve's chats). Use `search` to find where something "
    "was said or done (by phrase, or semantic=true by meaning), `show` to read a conversation or a range "
    "of it, `sessions` to list conversations (most recent first), and `continue` (when offered) to restore "
    "a conversation into the model at a position and ask it something."
)


Call = Callable[[Callable[[kvdb.Archive], Any]], Any]  # runs a read on the archive, returns its result


def make_call(archive: kvdb.Archive) -> Call:
    """Reads on an archive this process opened (read-only): the file let go after each, so that a
    writer (`kvdb watch`) is not kept out between calls."""

    def call(read):
        try:
            return read(archive)
        finally:
            archive.release()

    archive.release()
    return call


def build(call: Call, model_name: str | None = None) -> MCPServer:
    """An MCP server whose tools read the archive through ``call`` (``make_call(archive)``, or `kvdb
    serve`'s archive thread); with ``model_name``, the `continue` tool too, run by that model."""
    server = _Server("kvdb", instructions=INSTRUCTIONS)

    @server.tool()
    def search(
        query: str,
        semantic: bool = False,
        k: int = 10,
        session: str | None = None,
        agent: str | None = None,
        project: str | None = None,
        since: str | None = None,
        until: str | None = None,
    ) -> dict[str, Any]:
        """Find where a phrase occurs in the archived conversations (semantic=false: the exact words,
        any casing; each conversation once, at its best hit), or the passages nearest a question in
        meaning (semantic=true). Each hit has session_id, conversation_id, title, position (a token
        position: pass it as `start` to `show`, or as `at` to `continue`), and before/match/after
        text. Filters: session (an id or name: only that conversation's version), agent (claude-code,
        codex-cli, gemini-cli, chatgpt, messages, ...), project (a folder: conversations about it or a
        folder inside it), since/until (YYYY-MM-DD, UTC: the day their latest version was said, by its log's
        own times where it has them)."""
        first, last = _day(since, "since"), _day(until, "until")
        wanted = min(k, MAX_HITS)  # the library refuses k < 1

        def found(archive: kvdb.Archive) -> list:
            if semantic:
                return archive.search_meaning(
                    query, k=wanted, session=session, agent=agent, project=project, since=first, until=last
                )
            return archive.search(
                query, k=wanted, session=session, agent=agent, project=project, since=first, until=last
            )

        hits = _call(call, found)
        out: dict[str, Any] = {"hits": [h.to_dict() for h in hits]}
        if k > MAX_HITS:
            out["note"] = f"at most {MAX_HITS} hits a call; narrow the query or the filters"
        return out

    @server.tool()
    def show(session: str, start: int = 0, max_tokens: int = SHOW_TOKENS) -> dict[str, Any]:
        """Read a conversation (a session id, a conversation id, its title or name; NAME@vN for its
        version N) from token position `start`, at most `max_tokens` tokens, as turns (role and what
        was said). When more follows, `next_start` says where the next call should start. A log
        longer than the model's context is stored in parts: `earlier_part` names the part before
        this one, to show next for what came earlier."""

        def read(archive: kvdb.Archive) -> dict[str, Any]:
            handle = archive.session(session)
            end = min(
                handle.n_tokens,
                check_count("start", start) + min(check_count("max_tokens", max_tokens, 1), 4 * SHOW_TOKENS),
            )
            turns = archive.turns(handle.session_id, start, end)
            out: dict[str, Any] = {
                "session": handle.to_dict(),
                "start": start,
                "end": end,
                "turns": [t.to_dict() for t in turns],
            }
            if end < handle.n_tokens:
                out["next_start"] = end
                out["note"] = f"cut at token {end} of {handle.n_tokens}; call show again with start={end} for more"
            if handle.part is not None and handle.part["follows"] is not None:
                out["earlier_part"] = handle.part["follows"]
            return out

        return _call(call, read)

    @server.tool()
    def sessions(
        limit: int = 20,
        offset: int = 0,
        agent: str | None = None,
        project: str | None = None,
        since: str | None = None,
        until: str | None = None,
    ) -> dict[str, Any]:
        """List archived conversations, the most recently updated first, each once as its latest
        version (conversation_id, title, session_id, n_tokens, versions, agent, project,
        updated_at). Filters as `search`'s. Pages of `limit`; `next_offset` gives the next page."""
        days = _day(since, "since"), _day(until, "until")
        return _call(
            call, lambda archive: archive.conversation_page(agent, project, *days, min(limit, 200), offset)
        ).to_dict()

    if model_name is not None:

        @server.tool(name="continue")
        def continue_(session: str, prompt: str, at: int | None = None, max_new_tokens: int = 128) -> dict[str, Any]:
            """Restore a conversation into the archive's model at token position `at` (default: its
            end), add `prompt` as a new user turn, and return the model's reply (greedy). The result
            names the model and how the restore was made (`mode`: exact, or archive with
            `preset_fidelity`, what its compression was measured to cost). Slow on a CPU: seconds
            to minutes. Nothing is written to the archive."""

            def run(archive: kvdb.Archive) -> dict[str, Any]:
                handle = archive.session(session)
                restored = archive.restore(handle.session_id, at=at)
                text = archive.generate(restored, prompt, min(max_new_tokens, 1024))
                return {"model": model_name, "restored": restored.to_dict(), "text": text}

            return _call(call, run)

    return server


class _Server(MCPServer):
    async def call_tool(self, name: str, arguments: dict[str, Any], context=None):
        """The SDK answers arguments that miss its schema with pydantic's report, many lines
        long, and lets a misspelt name pass as if it were not given: an agent reads one line
        naming each argument and what it takes, as a tool's own errors read."""
        takes = next((list(t.input_schema["properties"]) for t in await self.list_tools() if t.name == name), None)
        if takes is not None and (unknown := sorted(set(arguments) - set(takes))):
            raise ToolError(
                f"Error executing tool {name}: unknown argument {unknown[0]!r}; {name} takes {', '.join(takes)}"
            )
        try:
            return await super().call_tool(name, arguments, context)
        except ToolError as exc:
            if not isinstance(exc.__cause__, ValidationError):
                raise
            problems = "; ".join(_problem(e) for e in exc.__cause__.errors(include_url=False))
            raise ToolError(f"Error executing tool {name}: {problems}") from exc.__cause__


def _problem(error) -> str:
    field = ".".join(map(str, error["loc"])) or "arguments"
    if error["type"] == "missing":
        return f"{field} is required"
    return f"{field}: {error['msg'][0].lower()}{error['msg'][1:]}, got {error['input']!r}"


def _call(call: Call, read):
    """The library's answer, or its error as the tool's error, whose message says what to do."""
    try:
        return call(read)
    except KvdbError as exc:
        raise ToolError(str(exc)) from None


def _day(text: str | None, name: str) -> dt.date | None:
    if text is None:
        return None
    try:
        return dt.date.fromisoformat(text)
    except ValueError:
        raise ToolError(f"{name} must be a day as YYYY-MM-DD, got {text!r}") from None

"""Claude Code session logs (``~/.claude/projects/PROJECT/SESSION.jsonl``): one event per line.

Events carry ``uuid`` and ``parentUuid``; those of type ``user`` and ``assistant`` hold a
message (Anthropic-shaped). A session is the chain of messages from a root to a leaf, for
each ``sessionId``: the leaf written last is the session, the other leaves (a conversation
rewound and taken elsewhere) are sessions of their own, named ``[branch N]``. A sub-agent's
events (``isSidechain``, in its own file or inline) are a session of their own, named
``SESSION [agent ID]``, and so are the sub-agent turns a parent log mirrors in its
``agent_progress`` records when no event of that sub-agent is in the file. An assistant reply
streamed as several events sharing its message id is one message again.

A link that points at no event of the file (the line that held it was bad, or the file is a
cut) joins the event to the one of its session written before it, as does a missing ``parentUuid``: one bad
line never splits a conversation, and a log without links is one session in file order.

What the model never saw as a turn stays with the session as side fields: ``summaries`` (the
``summary`` records but those that name a session: the one whose leaf is a session's), ``title`` (custom and
generated titles), and ``events``: hook output, notices, local command output, attachments,
the last prompt, and a tool's output beyond the result the model was shown
(``toolUseResult``). A record with no text at all (a file snapshot, a mode change) is counted
in ``dropped`` as ``TYPE event``.
"""

from __future__ import annotations

from collections import Counter

from kvdb.errors import EmptyTranscript
from kvdb.transcripts.formats.base import Format, Log
from kvdb.transcripts.messages import Conversation, Invalid, kind, message_error
from kvdb.transcripts.sessions import Transcript, chat, strings_under

MESSAGE_EVENTS = ("user", "assistant")
TITLES = {"custom-title": "customTitle", "ai-title": "aiTitle"}
# keys whose strings are text in the records that are no message (ids, paths, enums and times are not)
EVENT_TEXT = frozenset(
    {"content", "text", "stdout", "stderr", "command", "summary", "prompt", "lastPrompt", "result", "message", "formatted"}
    | {"blockingError", "banner", "description", "snippet", "subject", "stopReason", "apiRefusalExplanation", "title"}
)
# keys of a tool's structured result (``toolUseResult``) that hold its output
TOOL_OUTPUT = frozenset({"stdout", "stderr", "content", "text", "result", "results", "output"})


class ClaudeCode(Format):
    name = "claude-code"
    reads = "Claude Code session logs (~/.claude/projects/PROJECT/SESSION.jsonl): events linked by uuid and parentUuid"
    suffix = ".jsonl"
    marks = ("uuid", "parentUuid", "sessionId", "message")
    example = (
        '{"type": "user", "uuid": "u1", "parentUuid": null, "sessionId": "s1", "message": {"role": "user", "content": "List the files"}}\n'
        '{"type": "assistant", "uuid": "a1", "parentUuid": "u1", "sessionId": "s1", "message": {"id": "m1", "role": "assistant", '
        '"content": [{"type": "text", "text": "Here they are."}]}}\n'
    )

    def opens_log(self, record) -> bool:
        return isinstance(record, dict) and ("parentUuid" in record or "sessionId" in record or (record.get("type") == "summary" and "leafUuid" in record))

    def log(self, stem: str, shown: str) -> EventLog:
        return EventLog(stem, shown)


def register(add) -> None:
    add(ClaudeCode())


class EventLog(Log):
    """The events of one file, added line by line; ``sessions`` builds the chains once all are read."""

    def __init__(self, stem: str, shown: str):
        self._stem, self._shown = stem, shown
        self._messages: dict[str, dict] = {}  # uuid -> message event, in file order
        self._lines: dict[str, int] = {}
        self._parents: dict[str, str | None] = {}  # uuid -> the uuid it links to, for every event that has one
        self._previous: dict[str, str | None] = {}  # uuid -> the event of its session written before it
        self._last: dict[tuple[str, str | None], str] = {}  # (session, agent) -> the uuid of its event written last
        self._names: dict[str | None, str] = {}  # leaf uuid -> summary
        self._summaries: list[str] = []
        self._side: dict[tuple[str, str | None], dict[str, list]] = {}  # (session, agent) -> side fields
        self._mirrors: dict[tuple[str, str | None], list[tuple[dict, int]]] = {}  # (session, agent) -> (message, line)
        self._skipped: Counter = Counter()  # records with no text, by type
        self._held: Counter = Counter()  # records kept as side fields, by type

    def add(self, event, line: int) -> None:
        if not isinstance(event, dict):
            raise Invalid(f"expected an event object, got {kind(event)}")
        record = event.get("type")
        if record == "summary" and isinstance(event.get("summary"), str):
            leaf = event.get("leafUuid")
            if leaf is not None and not isinstance(leaf, str):
                raise Invalid(f'a summary event needs a string "leafUuid", got {kind(leaf)}')
            self._names[leaf] = event["summary"]
            self._summaries.append(event["summary"])
            return
        uuid, parent = event.get("uuid"), event.get("parentUuid")
        if parent is not None and not isinstance(parent, str):
            raise Invalid(f'"parentUuid" must be a string or null, not {kind(parent)}', event)
        if record in MESSAGE_EVENTS and "message" in event:
            self._add_message(event, uuid, line)
            return
        data = event.get("data") if record == "progress" else None
        mirrored = data.get("message") if isinstance(data, dict) and data.get("type") == "agent_progress" else None
        if isinstance(data, dict) and isinstance(mirrored, dict) and mirrored.get("type") in MESSAGE_EVENTS and isinstance(mirrored.get("message"), dict):
            error = message_error(mirrored["message"])
            if error is not None:
                raise Invalid(f"the sub-agent message this progress record mirrors: {error}", event)
            session = (self._group(event)[0], str(data.get("agentId") or ""))
            self._mirrors.setdefault(session, []).append((mirrored["message"], line))
        elif record in TITLES and isinstance(event.get(TITLES[record]), str) and event[TITLES[record]].strip():
            self._keep(event, "title", event[TITLES[record]])
            self._held[record] += 1
        else:
            texts, label = list(strings_under(event, EVENT_TEXT.__contains__)), _label(event)
            if texts:
                self._held[label] += 1
            else:
                self._skipped[f"{event.get('type', 'untyped')} event"] += 1
            for key, text in texts:
                self._keep(event, "events", {"type": label if key in ("content", "text") else f"{label} {key}", "text": text})
        if isinstance(uuid, str):  # a link of the chain all the same
            self._link(event, uuid)

    def _add_message(self, event: dict, uuid, line: int) -> None:
        """A user or assistant event, checked whole before any of it is kept."""
        message = event["message"]
        if not isinstance(message, dict):
            raise Invalid(f'a {event["type"]} event\'s "message" must be an object, not {kind(message)}', event)
        if not isinstance(uuid, str):
            raise Invalid(f'a {event["type"]} event needs a string "uuid", not {kind(uuid)}', event)
        error = message_error(message)
        if error is not None:
            raise Invalid(f"event {uuid}: {error}", event)
        if uuid in self._messages and self._messages[uuid]["message"] != message:
            uuid = f"{uuid} (line {line})"  # another message under a uuid already taken: kept, as a leaf of its own
        outputs = _tool_output(event)
        self._link(event, uuid)
        self._messages[uuid], self._lines[uuid] = event, line
        for text in outputs:
            self._keep(event, "events", {"type": "tool output", "text": text})

    def _link(self, event: dict, uuid: str) -> None:
        """An event without ``parentUuid`` (a log written without links) follows the one of its session before it."""
        session = self._group(event)
        self._previous[uuid] = self._last.get(session)
        self._parents[uuid] = event["parentUuid"] if "parentUuid" in event else self._previous[uuid]
        self._last[session] = uuid

    def _keep(self, event: dict, field: str, value) -> None:
        self._side.setdefault(self._group(event), {}).setdefault(field, []).append(value)

    def _group(self, event: dict) -> tuple[str, str | None]:
        """(session id, sub-agent: its id, "" for a side chain that names none, None for the main conversation)."""
        agent = str(event.get("agentId") or "") if event.get("isSidechain") is True else None
        return str(event.get("sessionId") or self._stem), agent

    def sessions(self) -> list[Transcript]:
        # a link to no event of the file (a bad line's, or one before a cut) goes to the event written before
        links = {uuid: self._previous[uuid] if parent is not None and parent not in self._parents else parent for uuid, parent in self._parents.items()}
        parent_message = {uuid: self._message_parent(uuid, links) for uuid in self._messages}
        has_child = set(parent_message.values())
        groups: dict[tuple[str, str | None], list[str]] = {}
        for leaf in reversed([uuid for uuid in self._messages if uuid not in has_child]):  # the leaf written last comes first
            groups.setdefault(self._group(self._messages[leaf]), []).append(leaf)
        mirrors = {group: mirrored for group, mirrored in self._mirrors.items() if group not in groups}  # a sub-agent's own events come first
        if not groups and not mirrors:  # summaries alone: nothing to archive; other records: a layout kvdb may misread, never "empty"
            raise EmptyTranscript(self._shown, self._why_empty()) if self._summaries_only() else Invalid(self._why_empty())
        built: list[tuple[tuple[str, str | None] | None, str, Conversation, dict]] = []  # (group of a main session, name, ...)
        named: set[str] = set()  # the summaries that name a session
        for group, leaves in groups.items():
            for branch, (leaf, chain) in enumerate(self._chains(leaves, parent_message), start=1):
                name = self._names.get(leaf, _name(group))
                if leaf in self._names:
                    named.add(name)
                metadata = {"format": "claude-code", "id": group[0], "line": self._lines[chain[0]]} | ({"agent": group[1]} if group[1] else {})
                if branch > 1:
                    name, metadata["branch"] = f"{name} [branch {branch}]", branch
                conversation = self._conversation([(self._messages[uuid]["message"], f"event {uuid}") for uuid in chain])
                built.append((group if branch == 1 else None, name, conversation, metadata))
        for group, mirrored in mirrors.items():
            metadata = {"format": "claude-code", "id": group[0], "line": mirrored[0][1]} | ({"agent": group[1]} if group[1] else {})
            built.append((group, _name(group), self._conversation([(message, f"line {line}") for message, line in mirrored]), metadata))
        # what belongs to no session read (a record of another session id, or of none) goes with the first
        mains = {owner for owner, *_ in built if owner is not None}
        first = [{"summaries": [summary for summary in self._summaries if summary not in named]}] + [
            side for group, side in self._side.items() if group not in mains
        ]
        out = []
        for index, (owner, name, conversation, metadata) in enumerate(built):
            sides = ([self._side.get(owner, {})] if owner is not None else []) + (first if index == 0 else [])
            if index == 0:
                conversation.dropped.update(self._skipped)
            side = {field: [value for s in sides for value in s.get(field, ())] for field in ("title", "summaries", "events")}
            out.append(chat(name, self._shown, conversation, metadata, side))
        return out

    def _chains(self, leaves: list[str], parent_message: dict[str, str | None]) -> list[tuple[str, list[str]]]:
        """(leaf, its messages from the root) for each leaf of a session, the leaf written last first."""
        chains: list[tuple[str, list[str]]] = []
        main: set[str] = set()  # the first chain's messages, with what is folded into it
        replies: set[str] = set()  # the ids of their replies
        for leaf in leaves:
            chain, seen = [leaf], {leaf}
            while (parent := parent_message[chain[-1]]) is not None and parent not in seen:  # a cycle of links ends the chain
                chain.append(parent)
                seen.add(parent)
            own = [uuid for uuid in chain if uuid not in main]
            if not chains:
                chains.append((leaf, chain[::-1]))
            elif not (own and all(self._tool_results_only(uuid) or self._messages[uuid]["message"].get("id") in replies for uuid in own)):
                chains.append((leaf, chain[::-1]))
                continue
            # parallel tool calls: a reply is written as one event per call, and each result
            # as the child of its own call, so all but one look like branches; they belong
            # to the conversation, in file order
            main.update(own)
            replies.update(i for i in (self._messages[uuid]["message"].get("id") for uuid in own) if i is not None)
        if chains and len(main) > len(chains[0][1]):
            chains[0] = (chains[0][0], sorted(main, key=self._lines.__getitem__))
        return chains

    def _tool_results_only(self, uuid: str) -> bool:
        """Whether the event is a user message of tool results and nothing else."""
        message = self._messages[uuid]["message"]
        content = message.get("content")
        return (
            message.get("role") == "user"
            and isinstance(content, list)
            and bool(content)
            and all(isinstance(part, dict) and part.get("type") == "tool_result" for part in content)
        )

    def _summaries_only(self) -> bool:
        """Whether every record was a summary event (Claude Code writes such files routinely)."""
        return bool(self._summaries) and not (self._skipped or self._held or self._parents or self._mirrors)

    def _why_empty(self) -> str:
        """What a log without messages holds instead (``sessions`` gave none)."""
        held = [f"{count} {kind}{'s' if count > 1 else ''}" for kind, count in self._skipped.items()]
        held += [f"{count} {kind} record{'s' if count > 1 else ''} of text" for kind, count in self._held.items()]
        if self._summaries:
            held.insert(0, f"{len(self._summaries)} summar{'ies' if len(self._summaries) > 1 else 'y'} of sessions in other files")
        return f"the event log holds no user or assistant messages{' (only ' + ', '.join(held) + ')' if held else ''}"

    def _message_parent(self, uuid: str, links: dict[str, str | None]) -> str | None:
        """The nearest ancestor that holds a message, passing over the events that do not."""
        seen = {uuid}
        parent = links[uuid]
        while parent is not None and parent not in self._messages and parent not in seen:
            seen.add(parent)
            parent = links[parent]
        return parent if parent in self._messages else None

    def _conversation(self, messages: list[tuple[dict, str]]) -> Conversation:
        """``messages``: (message, where it was written), in order."""
        conversation = Conversation()
        merged: list[tuple[dict, str]] = []  # (message, where its first event was written)
        for message, where in messages:
            previous = merged[-1][0] if merged else None
            if (
                previous is not None
                and message.get("id") is not None
                and message.get("id") == previous.get("id")
                and message.get("role") == previous.get("role")
            ):
                previous["content"] = _blocks(previous.get("content")) + _blocks(message.get("content"))
            else:
                merged.append((dict(message), where))
        for message, where in merged:
            try:
                conversation.add(message)
            except Invalid as error:
                raise Invalid(f"{where}: {error}", error.node) from None
        return conversation


def _name(group: tuple[str, str | None]) -> str:
    session, agent = group
    return session if agent is None else f"{session} [agent {agent}]" if agent else f"{session} [side chain]"


def _label(event: dict) -> str:
    """``TYPE``, or ``TYPE KIND`` where the record says which of its type it is (a system subtype, an attachment's or a progress record's)."""
    detail = event.get("subtype")
    for key in ("attachment", "data"):
        if detail is None and isinstance(event.get(key), dict):
            detail = event[key].get("type")
    label = str(event.get("type", "untyped"))
    return f"{label} {detail}" if isinstance(detail, str) and detail else label


def _tool_output(event: dict) -> list[str]:
    """The texts of a tool's structured result (``toolUseResult``) that the result the model was shown does not hold."""
    result = event.get("toolUseResult")
    if result is None:
        return []
    shown = "\n".join(text for _, text in strings_under(event["message"].get("content"), {"content", "text"}.__contains__, "content"))
    texts = [result] if isinstance(result, str) else [text for _, text in strings_under(result, TOOL_OUTPUT.__contains__)]
    return [text for text in texts if text.strip() and text not in shown]


def _blocks(content) -> list:
    if content is None:
        return []
    return [{"type": "text", "text": content}] if isinstance(content, str) else list(content)

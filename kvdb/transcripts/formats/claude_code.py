"""Claude Code session logs (``~/.claude/projects/PROJECT/SESSION.jsonl``): one event per line.

Events carry ``uuid`` and ``parentUuid``; those of type ``user`` and ``assistant`` hold a
message (Anthropic-shaped). A session is the chain of messages from a root to a leaf, for
each ``sessionId``: the leaf written last is the session, the other leaves (a conversation
rewound and taken elsewhere, a sub-agent's side chain) are sessions of their own, named
``[branch N]``. An assistant reply streamed as several events sharing its message id is one
message again. A ``summary`` event names the session it points at. Events without a message
(tool progress, file snapshots, notices) are not part of what the model saw: they are counted
in ``dropped`` as ``TYPE event``.
"""

from __future__ import annotations

from collections import Counter

from kvdb.errors import EmptyTranscript
from kvdb.transcripts.formats.base import Format, Log
from kvdb.transcripts.messages import Conversation, Invalid, kind
from kvdb.transcripts.sessions import Transcript, chat

MESSAGE_EVENTS = ("user", "assistant")


class ClaudeCode(Format):
    name = "claude-code"
    reads = "Claude Code session logs (~/.claude/projects/PROJECT/SESSION.jsonl): events linked by uuid and parentUuid"
    suffix = ".jsonl"
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
        self._events: dict[str, dict] = {}  # uuid -> event, in file order
        self._lines: dict[str, int] = {}
        self._summaries: dict[str | None, str] = {}  # leaf uuid -> summary
        self._skipped: Counter = Counter()

    def add(self, event, line: int) -> None:
        if not isinstance(event, dict):
            raise Invalid(f"expected an event object, got {kind(event)}")
        if event.get("type") == "summary" and isinstance(event.get("summary"), str):
            leaf = event.get("leafUuid")
            if leaf is not None and not isinstance(leaf, str):
                raise Invalid(f'a summary event needs a string "leafUuid", got {kind(leaf)}')
            self._summaries[leaf] = event["summary"]
            return
        uuid = event.get("uuid")
        if event.get("type") not in MESSAGE_EVENTS or not isinstance(event.get("message"), dict):
            self._skipped[f"{event.get('type', 'untyped')} event"] += 1
            if isinstance(uuid, str):  # a link of the chain all the same
                self._events[uuid] = {"parentUuid": event.get("parentUuid"), "sessionId": event.get("sessionId")}
            return
        if not isinstance(uuid, str):
            raise Invalid(f'a {event["type"]} event needs a string "uuid", not {kind(uuid)}', event)
        self._events[uuid] = event
        self._lines[uuid] = line

    def sessions(self) -> list[Transcript]:
        parent_message = {uuid: self._message_parent(uuid) for uuid in self._lines}
        has_child = set(parent_message.values())
        leaves = [uuid for uuid in self._lines if uuid not in has_child]
        if not leaves:  # summaries alone: nothing to archive; other records: a layout kvdb may misread, never "empty"
            raise EmptyTranscript(self._shown, self._why_empty()) if self._summaries_only() else Invalid(self._why_empty())
        by_session: dict[str, list[str]] = {}
        for leaf in reversed(leaves):  # the leaf written last comes first
            by_session.setdefault(str(self._events[leaf].get("sessionId") or self._stem), []).append(leaf)
        out = []
        for session_id, session_leaves in by_session.items():
            chains: list[tuple[str, list[str]]] = []  # (leaf, its messages from the root), the leaf written last first
            main: set[str] = set()  # the first chain's messages, with what is folded into it
            replies: set[str] = set()  # the ids of their replies
            for leaf in session_leaves:
                chain, seen = [leaf], {leaf}
                while (parent := parent_message[chain[-1]]) is not None and parent not in seen:  # a cycle of links ends the chain
                    chain.append(parent)
                    seen.add(parent)
                own = [uuid for uuid in chain if uuid not in main]
                if not chains:
                    chains.append((leaf, chain[::-1]))
                elif not (own and all(self._tool_results_only(uuid) or self._events[uuid]["message"].get("id") in replies for uuid in own)):
                    chains.append((leaf, chain[::-1]))
                    continue
                # parallel tool calls: a reply is written as one event per call, and each result
                # as the child of its own call, so all but one look like branches; they belong
                # to the conversation, in file order
                main.update(own)
                replies.update(i for i in (self._events[uuid]["message"].get("id") for uuid in own) if i is not None)
            if chains and len(main) > len(chains[0][1]):
                chains[0] = (chains[0][0], sorted(main, key=self._lines.__getitem__))
            for branch, (leaf, chain) in enumerate(chains, start=1):
                name = self._summaries.get(leaf, session_id)
                metadata = {"format": "claude-code", "id": session_id, "line": self._lines[chain[0]]}
                conversation = self._conversation(chain)
                if branch == 1:
                    conversation.dropped.update(self._skipped)
                else:
                    metadata["branch"] = branch
                out.append(chat(name if branch == 1 else f"{name} [branch {branch}]", self._shown, conversation, metadata))
        return out

    def _tool_results_only(self, uuid: str) -> bool:
        """Whether the event is a user message of tool results and nothing else."""
        message = self._events[uuid]["message"]
        content = message.get("content")
        return (
            message.get("role") == "user"
            and isinstance(content, list)
            and bool(content)
            and all(isinstance(part, dict) and part.get("type") == "tool_result" for part in content)
        )

    def _summaries_only(self) -> bool:
        """Whether every record was a summary event (Claude Code writes such files routinely)."""
        return bool(self._summaries) and not self._skipped and not self._events

    def _why_empty(self) -> str:
        """What a log without messages holds instead (``sessions`` gave none)."""
        held = [f"{count} {kind}{'s' if count > 1 else ''}" for kind, count in self._skipped.items()]
        if self._summaries:
            held.insert(0, f"{len(self._summaries)} summar{'ies' if len(self._summaries) > 1 else 'y'} of sessions in other files")
        return f"the event log holds no user or assistant messages{' (only ' + ', '.join(held) + ')' if held else ''}"

    def _message_parent(self, uuid: str) -> str | None:
        """The nearest ancestor that holds a message, passing over the events that do not."""
        seen = {uuid}
        parent = self._events[uuid].get("parentUuid")
        while parent is not None and parent in self._events and parent not in self._lines:
            if parent in seen:
                break
            seen.add(parent)
            parent = self._events[parent].get("parentUuid")
        return parent if parent in self._lines else None

    def _conversation(self, chain: list[str]) -> Conversation:
        conversation = Conversation()
        merged: list[tuple[dict, str]] = []  # (message, the uuid of its first event)
        for uuid in chain:
            message = self._events[uuid]["message"]
            previous = merged[-1][0] if merged else None
            if (
                previous is not None
                and message.get("id") is not None
                and message.get("id") == previous.get("id")
                and message.get("role") == previous.get("role")
            ):
                previous["content"] = _blocks(previous.get("content")) + _blocks(message.get("content"))
            else:
                merged.append((dict(message), uuid))
        for message, uuid in merged:
            try:
                conversation.add(message)
            except Invalid as error:
                raise Invalid(f"event {uuid}: {error}", error.node) from None
        return conversation


def _blocks(content) -> list:
    if content is None:
        return []
    return [{"type": "text", "text": content}] if isinstance(content, str) else list(content)

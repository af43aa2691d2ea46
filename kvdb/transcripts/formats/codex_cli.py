"""Codex CLI rollouts (``~/.codex/sessions/YYYY/MM/DD/rollout-*.jsonl``): one session per file.

Since September 2025 each line is an envelope ``{"timestamp", "type", "payload"}``: the
``response_item`` payloads are the OpenAI Responses items the model saw, in order, and are the
conversation; ``session_meta`` names the session and gives the instructions the model was sent
(a system turn); ``compacted`` replaces the history the model sees, so what follows it is a
session of its own (``[window N]``), opened by the replacement history. ``event_msg`` records
are what the UI showed: their dialogue repeats the response items, so only text no item holds
is kept, as side ``events`` (errors, notices, command output the model was not given).
Before that, line one was a bare header ``{"id", "timestamp", "instructions"}`` and the
rest bare Responses items between ``{"record_type": "state"}`` markers.

A rollout is named by its thread id; its title is the thread's name (``thread_name_updated``),
else its first prompt: past the context Codex sends as the user's turns (``<environment_context>``,
AGENTS.md) and, from the IDE extension, the part after "## My request for Codex:".
"""

from __future__ import annotations

import json
import re

from kvdb.transcripts.formats.base import Format, Log
from kvdb.transcripts.messages import Conversation, Invalid, kind, placeholder
from kvdb.transcripts.sessions import Transcript, chat, first_prompt, strings_under

ENVELOPES = ("session_meta", "response_item", "event_msg", "turn_context", "compacted")
HEADER_KEYS = {"id", "timestamp", "instructions", "git", "cwd", "originator", "cli_version"}
DIALOGUE_EVENTS = {
    "user_message": "message",
    "agent_message": "message",
    "agent_reasoning": "text",
    "agent_reasoning_raw_content": "text",
}
INJECTED = ("# AGENTS.md instructions for",)  # a user turn Codex writes itself, with the project's instructions
# the same, as a part of a turn
AGENTS_BLOCK = re.compile(r"\s*# AGENTS\.md instructions for [^\n]*\n+<INSTRUCTIONS>.*?</INSTRUCTIONS>", re.DOTALL)
IDE_REQUEST = "## My request for Codex:"  # the IDE extension sends its context first, then this, then the prompt
# items that are the harness's bookkeeping, with no text the model was given
NO_TEXT_ITEMS = ("ghost_snapshot",)
# what the keys of an event's text end with (the rest are identifiers, settings, paths, counts and images)
TEXT_KEYS = (
    "text", "message", "output", "instructions", "prompt", "body", "explanation", "snippet",
    "query", "queries", "reason", "hint", "objective", "title", "note", "content", "stdout", "stderr",
    "err", "error", "diff",
)  # fmt: skip


class CodexCli(Format):
    name = "codex-cli"
    reads = (
        "Codex CLI rollouts (~/.codex/sessions/.../rollout-*.jsonl): "
        "{timestamp, type, payload} lines of Responses items and events"
    )
    suffix = ".jsonl"
    example = (
        '{"timestamp": "2025-09-19T09:02:12Z", "type": "session_meta", '
        '"payload": {"id": "0199", "cwd": "/repo", "instructions": null}}\n'
        '{"timestamp": "2025-09-19T09:02:13Z", "type": "response_item", "payload": {"type": "message", "role": "user", '
        '"content": [{"type": "input_text", "text": "List the files"}]}}\n'
        '{"timestamp": "2025-09-19T09:02:14Z", "type": "event_msg", '
        '"payload": {"type": "agent_message", "message": "Two files."}}\n'
        '{"timestamp": "2025-09-19T09:02:14Z", "type": "response_item", '
        '"payload": {"type": "message", "role": "assistant", '
        '"content": [{"type": "output_text", "text": "Two files."}]}}\n'
    )
    marks = ("timestamp", "type", "payload")

    def opens_log(self, record) -> bool:
        if not isinstance(record, dict):
            return False
        if isinstance(record.get("payload"), dict):
            return record.get("type") in ENVELOPES and "timestamp" in record
        return (
            isinstance(record.get("id"), str)
            and isinstance(record.get("timestamp"), str)
            and set(record) <= HEADER_KEYS
        )  # the older header

    def log(self, stem: str, shown: str) -> Rollout:
        return Rollout(stem, shown)


def register(add) -> None:
    add(CodexCli())


class Rollout(Log):
    """One rollout's lines; the conversation is built as they come, the events sorted out at the end."""

    def __init__(self, stem: str, shown: str):
        self._stem, self._shown = stem, shown
        self._meta: dict | None = None
        self._line = 0
        # (conversation, its events)
        self._windows: list[tuple[Conversation, list[tuple[str, list[str]]]]] = [(Conversation(), [])]
        self._said: set[str] = set()  # every text the response items hold, to tell a repeating event
        self._outputs: dict[str, str] = {}  # call id -> the output the model was given
        self._tools: list[str] = []
        self._title: list[str] = []
        self._model: str | None = None
        # the 2025 "instructions", until the first item says whether it repeats them
        self._instructions: str | None = None

    def add(self, record, line: int) -> None:
        if not isinstance(record, dict):
            raise Invalid(f"expected a rollout line (an object), got {kind(record)}")
        payload = record.get("payload")
        if "payload" not in record:  # the older form: a header, state markers and bare items
            if record.get("record_type") == "state":
                return
            if "type" not in record and self._meta is None:
                self._session(record, line)
            else:
                self._item(record)
            return
        if not isinstance(payload, dict):
            raise Invalid(f'"payload" must be an object, not {kind(payload)}', record)
        record_type = record.get("type")
        if record_type == "session_meta":
            self._session(payload, line)
        elif record_type == "response_item":
            self._item(payload)
        elif record_type == "event_msg":
            self._event(payload)
        elif record_type == "turn_context":
            self._context(payload)
        elif record_type == "compacted":
            self._compacted(payload)
        else:  # newer kinds (world_state, inter-agent notes): what text they hold is kept aside
            self._note(str(record_type), payload)

    # records ---------------------------------------------------------------------------

    def _session(self, meta: dict, line: int) -> None:
        """The thread's first meta gives the system turn: its base instructions (sent as the
        request's instructions), and the 2025 ``instructions`` (AGENTS.md) unless the first
        item repeats them, as 0.39 builds sent them in a ``<user_instructions>`` message."""
        base = meta.get("base_instructions")
        base = base.get("text") if isinstance(base, dict) else base
        texts = [t for t in (base, meta.get("instructions")) if isinstance(t, str) and t]
        conversation, events = self._windows[-1]
        if self._meta is None and conversation.empty:
            self._meta, self._line = meta, line
            if isinstance(base, str) and base:
                conversation.add_text("system", base)
                self._said.add(base)
            if isinstance(meta.get("instructions"), str) and meta["instructions"]:
                self._instructions = meta["instructions"]
        else:  # a resumed or forked thread's own meta: its instructions, if new
            self._meta = self._meta or meta
            events += [("session_meta", [text]) for text in texts if text not in self._said]
        if meta.get("dynamic_tools"):
            self._tools.append(json.dumps(meta["dynamic_tools"], ensure_ascii=False))

    def _item(self, item: dict) -> None:
        conversation = self._windows[-1][0]
        item_type = item.get("type")
        if item_type in NO_TEXT_ITEMS:
            return
        shaped = _shaped(item, conversation)
        if shaped is None:
            self._note(str(item_type), item)
            return
        if self._instructions is not None:
            Conversation().add(shaped)  # refused before the instructions go in, so that a refused item leaves no trace
            if not any(self._instructions in text for text in _part_texts(item)):
                conversation.add_text("system", self._instructions)
                self._said.add(self._instructions)
            self._instructions = None
        conversation.add(shaped)
        self._remember(item)

    def _remember(self, item: dict) -> None:
        """The texts of an item the model saw, so that an event repeating one is not kept twice."""
        self._said.update(_part_texts(item))
        output = item.get("output")
        if isinstance(output, str):
            self._said.add(output)
            if isinstance(item.get("call_id"), str):
                self._outputs[item["call_id"]] = output

    def _event(self, payload: dict) -> None:
        event_type = str(payload.get("type"))
        events = self._windows[-1][1]
        if event_type == "thread_name_updated" and isinstance(payload.get("thread_name"), str):
            self._title.append(payload["thread_name"])
        elif event_type in DIALOGUE_EVENTS:
            text = payload.get(DIALOGUE_EVENTS[event_type])
            if isinstance(text, str) and text:
                events.append((event_type, [text]))
        elif event_type == "exec_command_end":  # the model was given the output; kept where it was given other text
            output = payload.get("aggregated_output") or "\n".join(
                filter(None, (payload.get("stdout"), payload.get("stderr")))
            )
            given = self._outputs.get(str(payload.get("call_id")), "")
            if (
                isinstance(output, str)
                and output
                and output not in given
                and json.dumps(output, ensure_ascii=False)[1:-1] not in given
            ):
                events.append((event_type, [output]))
        else:
            self._note(event_type, payload)

    def _note(self, note_type: str, payload) -> None:
        texts = [text for _, text in strings_under(payload, _text_key)]
        if texts:
            self._windows[-1][1].append((note_type, texts))

    def _context(self, context: dict) -> None:
        if isinstance(context.get("model"), str):
            self._model = context["model"]
        texts = [
            text
            for key, value in context.items()
            if key.endswith("instructions")
            for _, text in strings_under(value, _text_key, key)
        ]
        if texts:
            self._windows[-1][1].append(("turn_context", texts))

    def _compacted(self, payload: dict) -> None:
        history = payload.get("replacement_history")
        if history is not None and not isinstance(history, list):
            raise Invalid(f'"replacement_history" must be a list of items, not {kind(history)}', payload)
        message = payload.get("message")
        window: tuple[Conversation, list[tuple[str, list[str]]]] = (Conversation(), [])
        self._windows.append(window)
        try:
            for item in history or ():
                self._item(item)
        except Invalid:
            self._windows.pop()  # a refused record leaves no trace
            raise
        if isinstance(message, str) and message:
            if history is None:  # the summary is what the new window starts from
                window[0].add_text("user", message)
                self._said.add(message)
            elif message not in self._said:
                window[1].append(("compacted", [message]))

    # sessions --------------------------------------------------------------------------

    def sessions(self) -> list[Transcript]:
        if self._instructions is not None:  # no item came to say whether it repeats them
            self._windows[0][0].add_text("system", self._instructions)
            self._said.add(self._instructions)
            self._instructions = None
        meta = self._meta or {}
        session_id = meta.get("id")
        name = session_id if isinstance(session_id, str) and session_id else self._stem
        metadata: dict[str, object] = {"format": "codex-cli", "line": self._line}
        if name != self._stem:
            metadata["id"] = name
        for key in ("cwd", "cli_version", "originator"):
            if isinstance(meta.get(key), str):
                metadata[key] = meta[key]
        if self._model:
            metadata["model"] = self._model
        out: list[Transcript] = []
        title = self._title[-1] if self._title else None
        for number, (conversation, events) in enumerate(self._windows, start=1):
            kept = [
                {"type": event_type, "text": "\n".join(new)}
                for event_type, texts in events
                if (new := [text for text in texts if text not in self._said])
            ]
            if conversation.empty:
                if kept:
                    raise Invalid(
                        f"window {number} of the rollout holds events but no conversation items to attach them to"
                    )
                continue
            side = {"events": kept, "tools": self._tools, "title": self._title} if not out else {"events": kept}
            extra = {"window": number} if number > 1 else {}
            # the first window's, for the windows after it
            title = title or first_prompt(map(_request, conversation.messages()), INJECTED)
            out.append(
                chat(
                    name if number == 1 else f"{name} [window {number}]",
                    self._shown,
                    conversation,
                    dict(metadata, **extra),
                    side,
                    title,
                )
            )
        if not out:
            raise Invalid("the rollout holds no conversation items (no response_item lines)")
        return out


def _request(message: dict) -> dict:
    """A user turn as the prompt the user typed: Codex may send the project's instructions as a
    part of the turn that holds it, and the IDE extension its context before it."""
    if message["role"] != "user":
        return message
    text = AGENTS_BLOCK.sub("", message["content"])
    return dict(message, content=text.split(IDE_REQUEST, 1)[1] if IDE_REQUEST in text else text)


def _shaped(item, conversation: Conversation) -> dict | None:
    """A Codex item in a shape ``Conversation`` reads; None for one of a kind it does not know."""
    if not isinstance(item, dict):
        raise Invalid(f"expected a Responses item (an object), got {kind(item)}")
    item_type = item.get("type")
    call_id = item.get("call_id") or item.get("id")
    if item_type in ("message", "function_call", "function_call_output", "reasoning") and (
        item_type != "function_call_output" or isinstance(item.get("output"), str)
    ):
        if item_type == "function_call" and isinstance(item.get("namespace"), str) and item["namespace"]:
            return dict(item, name=f"{item['namespace']}.{item.get('name')}")
        return item
    if item_type == "custom_tool_call":
        return {
            "type": "function_call",
            "call_id": call_id,
            "name": item.get("name"),
            "arguments": _string(item.get("input"), "input", item),
        }
    if item_type in ("function_call_output", "custom_tool_call_output"):
        output = item.get("output")
        return {"role": "tool", "tool_call_id": call_id, "content": [output] if isinstance(output, dict) else output}
    # the call the model made; a hosted search's results it was not shown here
    if item_type in ("local_shell_call", "web_search_call"):
        return {
            "type": "function_call",
            "call_id": call_id,
            "name": item_type.removesuffix("_call"),
            "arguments": json.dumps(item.get("action"), ensure_ascii=False),
        }
    if item_type == "tool_search_call":
        arguments = item.get("arguments")
        return {
            "type": "function_call",
            "call_id": call_id,
            "name": "tool_search",
            "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False),
        }
    if item_type == "tool_search_output":
        return {"role": "tool", "tool_call_id": call_id, "content": json.dumps(item.get("tools"), ensure_ascii=False)}
    if item_type == "image_generation_call":
        prompt = item.get("revised_prompt")
        return {
            "role": "assistant",
            "content": "\n".join(
                filter(
                    None,
                    (prompt if isinstance(prompt, str) else None, placeholder("generated image", conversation.dropped)),
                )
            ),
        }
    if item_type == "agent_message":  # another agent's message to this one
        author = item.get("author")
        return {
            "role": "user",
            "content": item.get("content"),
            **({"name": author} if isinstance(author, str) and author else {}),
        }
    if item_type in ("compaction", "compaction_summary", "context_compaction"):
        return {"role": "user", "content": placeholder("compaction", conversation.dropped)}
    return None


def _part_texts(item: dict) -> list[str]:
    """The texts of a message's content (a string or parts) and of a reasoning item's summary."""
    texts = [item["content"]] if isinstance(item.get("content"), str) else []
    return texts + [
        part["text"]
        for key in ("content", "summary")
        if isinstance(item.get(key), list)
        for part in item[key]
        if isinstance(part, dict) and isinstance(part.get("text"), str)
    ]


def _string(value, key: str, node) -> str:
    if isinstance(value, str):
        return value
    raise Invalid(f'the item needs a string "{key}", not {kind(value)}', node)


def _text_key(key: str) -> bool:
    return key.lower().endswith(TEXT_KEYS)

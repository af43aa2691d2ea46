"""Gemini CLI's files (``~/.gemini/tmp/PROJECT/``): chat sessions, checkpoints and the prompt log.

- A session (``chats/session-*.jsonl``, since April 2026): a header ``{sessionId, projectHash,
  startTime}``, then message records ``{id, type: user|gemini|info|error|warning, content,
  thoughts?, toolCalls?}``, metadata patches ``{"$set": {...}}`` and rewinds ``{"$rewindTo": id}``.
  A record is written again whenever its message grows: the last one counts, where the first
  stood. A rewind drops a message and those after it from the session; what it dropped is
  kept as a session of its own (``[branch N]``), and so is a message list a ``$set`` replaces.
  ``info``/``error``/``warning`` records are notices the model never saw: side ``events``.
  Before April 2026 a session was one JSON object with the records under ``"messages"``.
- ``/chat save`` checkpoints: Gemini API ``Content`` (``{role: user|model, parts}``), as a
  list or under ``"history"``; restore checkpoints hold it under ``"clientHistory"``.
- ``logs.json``: the user's prompts, ``{sessionId, messageId, type, message}``: one session
  of user turns per ``sessionId``.

A session is named by its id and titled by its ``summary`` (a ``$set``), else its first prompt
past the context Gemini CLI sends as the user's first turn; so is a restore checkpoint, named by
a file's time and a tool. A ``/chat save`` checkpoint keeps its file's name, which holds its tag.
"""

from __future__ import annotations

import json

from kvdb.errors import EmptyTranscript
from kvdb.transcripts.formats.base import Format, Log
from kvdb.transcripts.messages import Conversation, Invalid, kind
from kvdb.transcripts.sessions import Transcript, chat, first_prompt
from kvdb.transcripts.stamps import StampedLog

MESSAGE_TYPES = ("user", "gemini")
NOTICE_TYPES = ("info", "error", "warning")
# what a Claude Code event (or a chat message) has and a Gemini record never does
CLAUDE_KEYS = ("uuid", "parentUuid", "message", "role")
MEDIA = {"image": "image", "audio": "audio", "video": "video"}
# the first user turn of a chat, without <session_context>
INJECTED = ("This is the Gemini CLI. We are setting up the context for our chat.",)


def _header(record) -> bool:
    return (
        isinstance(record, dict)
        and "sessionId" in record
        and "projectHash" in record
        and "type" not in record
        and "messages" not in record
    )


def _message(record) -> bool:
    return (
        isinstance(record, dict)
        and record.get("type") in MESSAGE_TYPES + NOTICE_TYPES
        and isinstance(record.get("id"), str)
        and "content" in record
        and not any(key in record for key in CLAUDE_KEYS)
    )


def _patch(record) -> bool:
    return isinstance(record, dict) and len(record) == 1 and ("$set" in record or "$rewindTo" in record)


def _prompt(record) -> bool:
    return (
        isinstance(record, dict)
        and "sessionId" in record
        and "messageId" in record
        and isinstance(record.get("message"), str)
        and "uuid" not in record
    )


def _content(record) -> bool:
    return (
        isinstance(record, dict)
        and record.get("role") in ("user", "model")
        and isinstance(record.get("parts"), list)
        and "content" not in record
    )


class GeminiCli(Format):
    name = "gemini-cli"
    reads = (
        "Gemini CLI sessions (~/.gemini/tmp/PROJECT/chats/session-*.jsonl or .json), "
        "/chat save checkpoints and logs.json"
    )
    suffix = ".jsonl"
    example = (
        '{"sessionId": "5e1b", "projectHash": "9da8", "startTime": "2026-04-23T12:52:52Z", '
        '"lastUpdated": "2026-04-23T12:52:52Z"}\n'
        '{"id": "m1", "timestamp": "2026-04-23T12:53:05Z", "type": "user", "content": [{"text": "Say hello"}]}\n'
        '{"id": "m2", "timestamp": "2026-04-23T12:53:11Z", "type": "gemini", "content": "Hello!", '
        '"thoughts": [{"subject": "Greeting", "description": "A short reply will do."}]}\n'
    )
    marks = ("sessionId", "projectHash", "messages", "startTime")

    def claims(self, obj) -> bool:
        if not isinstance(obj, dict):
            return False
        if "sessionId" in obj and isinstance(obj.get("messages"), list):  # the legacy session object
            messages = obj["messages"]
            return (
                "projectHash" in obj
                or bool(messages)
                and isinstance(messages[0], dict)
                and messages[0].get("type") in MESSAGE_TYPES
                and "role" not in messages[0]
            )
        history = obj.get("clientHistory", obj.get("history"))
        return (
            isinstance(history, list)
            and any(_content(item) for item in history[:1])
            or isinstance(obj.get("clientHistory"), list)
        )

    def read(self, obj: dict, name: str, source: str) -> list[Transcript]:
        if "messages" in obj:  # a session file of the older layout: its records, as a log's
            log = StampedLog(GeminiLog(name, source))
            log.add({key: value for key, value in obj.items() if key != "messages"}, 0)
            for index, record in enumerate(obj["messages"]):
                try:
                    log.add(record, index)
                except Invalid as error:
                    raise Invalid(f"messages[{index}]: {error}", error.node or obj) from None
            return log.sessions()
        return GeminiLog(name, source).checkpoint(obj)

    def opens_log(self, record) -> bool:
        return _header(record) or _message(record) or _patch(record) or _prompt(record) or _content(record)

    def log(self, stem: str, shown: str) -> GeminiLog:
        return GeminiLog(stem, shown)


def register(add) -> None:
    add(GeminiCli())


class GeminiLog(Log):
    """The records of a session file, a list of ``Content`` or the prompt log, in file order."""

    def __init__(self, stem: str, shown: str):
        self._stem, self._shown = stem, shown
        self._meta: dict = {}
        # message id -> (its turns, its events), the last written
        self._records: dict[str, tuple[list[dict], list[dict]]] = {}
        self._order: dict[str, None] = {}  # the session's message ids, in order
        self._branches: list[list[tuple[list[dict], list[dict]]]] = []  # what rewinds and replacements left behind
        self._notes: list[dict] = []
        self._title: list[str] = []
        self._contents: list[dict] = []
        self._prompts: dict[str, list[str]] = {}

    def add(self, record, line: int) -> None:
        if _message(record):
            entry = _entry(record)
            self._order.setdefault(record["id"])
            self._records[record["id"]] = entry
        elif _patch(record):
            self._patch(record)
        elif _header(record) or (
            not self._meta and isinstance(record, dict) and "sessionId" in record and "messageId" not in record
        ):
            self._meta = record
            self._set(record)
        elif _prompt(record):
            if not isinstance(record["sessionId"], str):
                raise Invalid(f'"sessionId" must be a string, not {kind(record["sessionId"])}', record)
            self._prompts.setdefault(record["sessionId"], []).append(record["message"])
        elif _content(record):
            # checked now, so that a refused record leaves no trace
            Conversation(record).add_all(_turns(record["role"], record["parts"]))
            self._contents.append(record)
        else:
            shown = (
                f"an object with keys {', '.join(sorted(map(str, record)))}"
                if isinstance(record, dict)
                else kind(record)
            )
            raise Invalid(
                "expected a Gemini CLI record (a message with id, type and content, a $set or $rewindTo, a header), "
                f"got {shown}"
            )

    def _patch(self, record: dict) -> None:
        if "$rewindTo" in record:
            target = record["$rewindTo"]
            if target not in self._order:
                raise Invalid(f'"$rewindTo" names message {target!r}, which the session does not hold', record)
            self._branches.append([self._records[i] for i in self._order])
            kept = list(self._order)
            self._order = dict.fromkeys(kept[: kept.index(target)])
            return
        update = record["$set"]
        if not isinstance(update, dict):
            raise Invalid(f'"$set" must be an object, not {kind(update)}', record)
        self._set(update)

    def _set(self, update: dict) -> None:
        """Session metadata, from the header or a ``$set``: a new message list, the title, the scratchpad."""
        messages = update.get("messages")
        if messages is not None:
            if not isinstance(messages, list) or not all(_message(m) for m in messages):
                raise Invalid(
                    '"$set" "messages" must be a list of message records (each with id, type and content)', update
                )
            entries = [(m["id"], _entry(m)) for m in messages]
            if self._order:
                self._branches.append([self._records[i] for i in self._order])
            self._order = dict.fromkeys(i for i, _ in entries)
            self._records.update(entries)
        if isinstance(update.get("summary"), str) and update["summary"]:
            self._title.append(update["summary"])
        if isinstance(update.get("memoryScratchpad"), str) and update["memoryScratchpad"]:
            self._notes.append({"type": "memoryScratchpad", "text": update["memoryScratchpad"]})

    def sessions(self) -> list[Transcript]:
        if self._contents:
            return [self._content_session(self._contents, {})]
        if self._prompts:
            typed = {sid: _user_turns(prompts) for sid, prompts in self._prompts.items()}
            return [
                chat(
                    sid, self._shown, c, {"format": "gemini-cli", "id": sid}, title=first_prompt(c.messages(), INJECTED)
                )
                for sid, c in typed.items()
            ]
        session_id = self._meta.get("sessionId")
        name = session_id if isinstance(session_id, str) and session_id else self._stem
        metadata: dict[str, object] = {"format": "gemini-cli"}
        if name != self._stem:
            metadata["id"] = name
        if isinstance(self._meta.get("kind"), str):
            metadata["kind"] = self._meta["kind"]
        out: list[Transcript] = []
        title = self._title[-1] if self._title else None
        for branch, entries in enumerate([[self._records[i] for i in self._order], *self._branches], start=1):
            conversation, events = Conversation(), []
            for turns, notices in entries:
                for turn in turns:
                    conversation.add(turn)
                events += notices
            if conversation.empty:
                if branch == 1 and (events or self._notes):
                    raise EmptyTranscript(self._shown, f"the session holds notices ({len(events)}) but no messages")
                continue
            side = {"events": events} if out else {"events": self._notes + events, "title": self._title}
            title = title or first_prompt(conversation.messages(), INJECTED)  # the session's, for its branches
            numbered = dict(metadata, branch=branch) if out else metadata
            out.append(
                chat(name if not out else f"{name} [branch {branch}]", self._shown, conversation, numbered, side, title)
            )
        if not out:
            raise EmptyTranscript(self._shown, "the session holds no messages")
        return out

    def checkpoint(self, obj: dict) -> list[Transcript]:
        """A ``/chat save`` checkpoint ``{"history"}`` or a restore checkpoint ``{"clientHistory", "toolCall"}``."""
        restore = "clientHistory" in obj
        contents = obj["clientHistory"] if restore else obj["history"]
        for index, content in enumerate(contents):
            if not _content(content):
                raise Invalid(
                    f"{'clientHistory' if restore else 'history'}[{index}]: "
                    f"expected a Content object {{role: user|model, parts}}, got {kind(content)}",
                    obj,
                )
        extra = {"id": obj["messageId"]} if isinstance(obj.get("messageId"), str) else {}
        return [self._content_session(contents, extra, obj if restore else None)]

    def _content_session(self, contents: list[dict], extra: dict, restore: dict | None = None) -> Transcript:
        conversation = Conversation(restore)
        for index, content in enumerate(contents):
            for turn in _turns(content["role"], content["parts"]):
                conversation.add(turn, f"history[{index}]: ")
        events = []
        # what the UI showed and the call being checkpointed, where the history does not hold them
        if restore is not None:
            said = json.dumps(contents, ensure_ascii=False)
            for item in restore.get("history") or ():
                if (
                    isinstance(item, dict)
                    and isinstance(item.get("text"), str)
                    and item["text"]
                    and json.dumps(item["text"], ensure_ascii=False)[1:-1] not in said
                ):
                    events.append({"type": f"history {item.get('type')}", "text": item["text"]})
            call = restore.get("toolCall")
            if isinstance(call, dict) and json.dumps(call.get("args"), ensure_ascii=False) not in said:
                events.append({"type": "toolCall", "text": json.dumps(call, ensure_ascii=False)})
        if conversation.empty:
            raise EmptyTranscript(self._shown, "the checkpoint holds no history")
        # a /chat save file is named by its tag
        title = first_prompt(conversation.messages(), INJECTED) if restore is not None else None
        return chat(self._stem, self._shown, conversation, {"format": "gemini-cli", **extra}, {"events": events}, title)


def _user_turns(prompts: list[str]) -> Conversation:
    conversation = Conversation()
    for prompt in prompts:
        conversation.add_text("user", prompt)
    return conversation


def _entry(record: dict) -> tuple[list[dict], list[dict]]:
    """A message record's turns (shapes ``Conversation`` reads) and side events, checked."""
    record_type = record["type"]
    check = Conversation(record)
    if record_type in NOTICE_TYPES:
        return [], [{"type": record_type, "text": text} for text in _texts(record["content"])]
    turns = _turns(
        "model" if record_type == "gemini" else "user",
        record["content"],
        record.get("thoughts"),
        record.get("toolCalls"),
    )
    for turn in turns:
        check.add(turn)
    said = (
        "\n".join(
            m["content"] + m.get("thinking", "") + "".join(c["arguments"] for c in m.get("tool_calls", ()))
            for m in check.messages()
        )
        if turns
        else ""
    )
    events = [
        {"type": "displayContent", "text": text} for text in _texts(record.get("displayContent")) if text not in said
    ]
    for call in record.get("toolCalls") or ():
        for key in ("description", "resultDisplay"):
            shown = call.get(key)
            texts = [shown] if isinstance(shown, str) else [text for k, text in _display(shown)]
            events += [{"type": f"toolCall {key}", "text": text} for text in texts if text and text not in said]
    return turns, events


def _turns(role: str, content, thoughts=None, calls=None) -> list[dict]:
    """Gemini ``Content`` parts (with a ``gemini`` record's thoughts and tool calls) as Anthropic
    content blocks: a model turn, and the results of its calls as a user turn after it."""
    blocks: list[dict] = []
    results: list[dict] = []
    if thoughts:
        if not isinstance(thoughts, list) or not all(isinstance(t, dict) for t in thoughts):
            raise Invalid(f'"thoughts" must be a list of {{subject, description}} objects, not {kind(thoughts)}')
        blocks.append(
            {
                "type": "thinking",
                "thinking": "\n\n".join(
                    "\n".join(filter(None, (t.get("subject"), t.get("description")))) for t in thoughts
                ),
            }
        )
    for part in (
        [content] if isinstance(content, (str, dict)) else content if isinstance(content, list) else _refuse(content)
    ):
        block = _block(part)
        (results if block["type"] == "tool_result" else blocks).append(block)
    if calls is not None:
        if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
            raise Invalid(f'"toolCalls" must be a list of tool call objects, not {kind(calls)}')
        for call in calls:
            blocks.append(
                {"type": "tool_use", "id": call.get("id"), "name": call.get("name"), "input": call.get("args", {})}
            )
            result = call.get("result")
            for part in [result] if isinstance(result, (str, dict)) else result or ():
                block = _block(part)
                if block["type"] == "tool_result":
                    results.append(
                        dict(
                            block,
                            tool_use_id=call.get("id"),
                            is_error=block["is_error"] or call.get("status") == "error",
                        )
                    )
                else:
                    results.append(
                        {
                            "type": "tool_result",
                            "tool_use_id": call.get("id"),
                            "content": [block],
                            "is_error": call.get("status") == "error",
                        }
                    )
    turns = []
    if blocks or not results:
        turns.append({"role": "assistant" if role == "model" else "user", "content": blocks})
    if results:
        turns.append({"role": "user", "content": results})
    return turns


def _refuse(content):
    raise Invalid(f'"content" must be a string or a list of parts, not {kind(content)}')


def _block(part) -> dict:
    if isinstance(part, str):
        return {"type": "text", "text": part}
    if not isinstance(part, dict):
        raise Invalid(f'each part must be an object such as {{"text": "..."}}, not {kind(part)}')
    if isinstance(part.get("text"), str):
        return (
            {"type": "thinking", "thinking": part["text"]}
            if part.get("thought")
            else {"type": "text", "text": part["text"]}
        )
    if isinstance(part.get("functionCall"), dict):
        call = part["functionCall"]
        return {"type": "tool_use", "id": call.get("id"), "name": call.get("name"), "input": call.get("args", {})}
    if isinstance(part.get("functionResponse"), dict):
        response = part["functionResponse"].get("response")
        return {
            "type": "tool_result",
            "tool_use_id": part["functionResponse"].get("id"),
            "content": _response_text(response),
            "is_error": _is_error(response),
        }
    if isinstance(part.get("executableCode"), dict):
        return {"type": "text", "text": str(part["executableCode"].get("code", ""))}
    if isinstance(part.get("codeExecutionResult"), dict):
        return {"type": "text", "text": str(part["codeExecutionResult"].get("output", ""))}
    media = part.get("inlineData") or part.get("fileData")
    if isinstance(media, dict):
        mime = str(media.get("mimeType", ""))
        return {"type": MEDIA.get(mime.partition("/")[0], "file")}
    keys = [key for key in part if key not in ("thought", "thoughtSignature")]
    return {"type": "text", "text": ""} if not keys else {"type": f"{keys[0]}"}


def _response_text(response) -> str:
    """A function response's output (or error) as written, and any other fields as JSON."""
    if not isinstance(response, dict):
        return response if isinstance(response, str) else json.dumps(response, ensure_ascii=False)
    texts = [response[key] for key in ("output", "error") if isinstance(response.get(key), str)]
    rest = {
        key: value for key, value in response.items() if not (key in ("output", "error") and isinstance(value, str))
    }
    return "\n".join(texts + ([json.dumps(rest, ensure_ascii=False)] if rest else []))


def _is_error(response) -> bool:
    return isinstance(response, dict) and "error" in response and "output" not in response


def _texts(content):
    """The text of a notice or of what the UI displayed instead of a message (strings, text parts, outputs)."""
    if isinstance(content, str):
        if content:
            yield content
    elif isinstance(content, list):
        for part in content:
            yield from _texts(part)
    elif isinstance(content, dict):
        for key in ("text", "output", "error"):
            if isinstance(content.get(key), str) and content[key]:
                yield content[key]
        for key in ("functionResponse", "response"):
            yield from _texts(content.get(key))


def _display(value, key: str = ""):
    """The strings a structured tool display holds, but the files' whole contents (the diff shows their change)."""
    if isinstance(value, str):
        yield key, value
    elif isinstance(value, list):
        for item in value:
            yield from _display(item, key)
    elif isinstance(value, dict):
        for k, v in value.items():
            if k not in ("originalContent", "newContent", "fileName", "filePath", "status", "id"):
                yield from _display(v, str(k))

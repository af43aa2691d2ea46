"""SillyTavern chats (``data/USER/chats/CHARACTER/NAME.jsonl``): a header line (``user_name``,
``character_name``, ``chat_metadata``), then one message a line (``name``, ``is_user``,
``mes``). Each turn keeps its speaker's ``name`` (the header's may be ``"unused"``). The swipe
shown (``mes``) is the turn; the other swipes are ``alternatives``, each with its own
reasoning. A function call's message is the calls and their results as turns (what the model
was sent), its HTML dump an event; other ``is_system`` messages were kept out of the prompt,
so they are ``events`` too. A file attached to a message is known by name (``attachments``).
A chat is titled by its file's name, which is the app's name for it (renaming a chat in the app
renames the file), and was said from the header's ``create_date`` to its last ``send_date``.
"""

from __future__ import annotations

import json
import re

from kvdb.errors import EmptyTranscript
from kvdb.transcripts.formats.base import Format, Log
from kvdb.transcripts.messages import Conversation, Invalid, kind
from kvdb.transcripts.sessions import Transcript, chat, object_at
from kvdb.transcripts.stamps import said

# "2025-03-01@10h15m02s"
HUMANIZED = re.compile(r"(\d{4})-(\d{1,2})-(\d{1,2})\s*@\s*(\d{1,2})h\s*(\d{1,2})m\s*(\d{1,2})s")


class SillyTavern(Format):
    name = "sillytavern"
    reads = (
        'SillyTavern chats (*.jsonl): a header {"user_name", "character_name", "chat_metadata"}, '
        'then {"name", "is_user", "mes", "swipes"} a line'
    )
    suffix = ".jsonl"
    example = (
        '{"user_name": "User", "character_name": "Aqua", "create_date": "2025-03-01@10h15m02s", "chat_metadata": {}}\n'
        '{"name": "Aqua", "is_user": false, "mes": "Hello!", "swipe_id": 0, "swipes": ["Hello!", "Hi there."]}\n'
        '{"name": "User", "is_user": true, "mes": "Hi"}\n'
    )
    marks = ("user_name", "character_name", "chat_metadata", "mes", "is_user")

    def opens_log(self, record) -> bool:
        return isinstance(record, dict) and (_header(record) or _is_message(record))

    def log(self, stem: str, shown: str) -> ChatLog:
        return ChatLog(stem, shown)


# a chat's own text the prompt carries beside its turns (chat_metadata), as side events of these types
PROMPT_NOTES = (("scenario", "scenario"), ("note_prompt", "author's note"))


def _header(record) -> bool:
    return "chat_metadata" in record or ("user_name" in record and "character_name" in record)


def _is_message(record) -> bool:
    return isinstance(record, dict) and "mes" in record and "is_user" in record


class ChatLog(Log):
    def __init__(self, stem: str, shown: str):
        self._stem, self._shown = stem, shown
        self._conversation = Conversation()
        self._side: dict[str, list] = {"alternatives": [], "events": [], "attachments": []}
        self._metadata: dict[str, object] = {"format": "sillytavern"}
        self._lines = 0  # message lines taken
        self._headed = False
        self._times: list = []  # create_date and each send_date, as written

    def add(self, record, line: int) -> None:
        if not isinstance(record, dict):
            raise Invalid(f"expected a message object, got {kind(record)}")
        if not _is_message(record):
            if self._lines or self._headed or not _header(record):  # a header opens the file, once
                raise Invalid(
                    'expected a message with "mes" and "is_user", '
                    f"got an object with keys {', '.join(sorted(map(str, record)))}",
                    record,
                )
            self._headed = True
            if record.get("create_date") is not None:
                self._metadata["created"] = record["create_date"]
                self._times.append(record["create_date"])
            settings = object_at(record, "chat_metadata")
            self._side["events"] += [
                {"type": label, "text": settings[key]}
                for key, label in PROMPT_NOTES
                if isinstance(settings.get(key), str) and settings[key].strip()
            ]
            return
        text = _string(record, "mes")
        speaker = record.get("name")
        if speaker is not None and not isinstance(speaker, str):
            raise Invalid(f'"name" must be a string, not {kind(speaker)}', record)
        extra = object_at(record, "extra")
        invocations = extra.get("tool_invocations")
        turns, events = [], []
        said = f"{speaker}: {text}" if speaker else text  # an event keeps its speaker as a turn does
        if record.get("is_system") and isinstance(invocations, list) and invocations:
            turns = _tool_turns(invocations, record)
            events.append({"type": "tool calls", "text": said})
        elif record.get("is_system"):
            events.append({"type": str(extra.get("type") or "system"), "text": said})
        else:
            image = extra.get("image")  # shown with the message, and sent to a model that sees images
            turn: dict = {
                "role": "user" if record["is_user"] else "assistant",
                "content": [text, {"type": "image"}] if image else text,
            }
            if speaker:
                turn["name"] = speaker
            if isinstance(extra.get("reasoning"), str) and extra["reasoning"]:
                turn["reasoning_content"] = extra["reasoning"]
            turns = [turn]
        alternatives = _alternatives(record, len(self._conversation))
        for turn in turns:  # only the first may be refused: _tool_turns checks the rest
            self._conversation.add(turn, f"line {line}: ")
        self._lines += 1
        self._times.append(record.get("send_date"))
        self._side["alternatives"] += alternatives
        self._side["events"] += events
        if isinstance(extra.get("display_text"), str) and extra["display_text"].strip():
            self._side["events"].append({"type": "display text", "text": extra["display_text"]})
        file = object_at(extra, "file")
        self._side["attachments"] += [
            str(name) for name in (file.get("name"), extra.get("image")) if isinstance(name, str) and name
        ]

    def sessions(self) -> list[Transcript]:
        if not self._lines:
            raise EmptyTranscript(self._shown, "the chat holds no messages (only its header)")
        if self._conversation.empty:
            raise Invalid(f"the chat's {self._lines} messages are all system notes, none a turn the model was sent")
        return [
            chat(
                self._stem, self._shown, self._conversation, self._metadata | said(*map(_time, self._times)), self._side
            )
        ]


def _time(value):
    """SillyTavern's own "2025-03-01@10h15m02s" (the user's local time, taken as UTC as a time
    without a zone is) as ISO 8601; other values as they are (ISO strings, milliseconds)."""
    found = HUMANIZED.fullmatch(value.strip()) if isinstance(value, str) else None
    if found is None:
        return value
    year, month, day, hour, minute, second = map(int, found.groups())
    return f"{year:04d}-{month:02d}-{day:02d}T{hour:02d}:{minute:02d}:{second:02d}"


def _tool_turns(invocations: list, record: dict) -> list[dict]:
    """The calls as the assistant's turn and each result as a tool's, as SillyTavern sends them."""
    calls, results = [], []
    for invocation in invocations:
        if not isinstance(invocation, dict) or not isinstance(invocation.get("name"), str) or not invocation["name"]:
            raise Invalid('each of "extra.tool_invocations" needs a string "name"', record)
        call_id = None if invocation.get("id") is None else str(invocation["id"])
        arguments = invocation.get("parameters", "")
        calls.append(
            {
                "id": call_id,
                "function": {
                    "name": invocation["name"],
                    "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
                },
            }
        )
        result = invocation.get("result", "")
        results.append(
            {
                "role": "tool",
                "tool_call_id": call_id,
                "name": invocation["name"],
                "content": result if isinstance(result, str) else json.dumps(result),
            }
        )
    return [{"role": "assistant", "content": "", "tool_calls": calls}, *results]


def _alternatives(record: dict, turn: int) -> list[dict]:
    """The swipes not shown, each with the reasoning it came with."""
    swipes = record.get("swipes")
    if swipes is None:
        return []
    if not isinstance(swipes, list) or not all(isinstance(s, str) for s in swipes):
        raise Invalid(f'"swipes" must be a list of strings, not {kind(swipes)}', record)
    shown = record.get("swipe_id", 0)
    info = record.get("swipe_info")
    info = info if isinstance(info, list) else []
    out = []
    for index, text in enumerate(swipes):
        if index == shown and text == record["mes"]:
            continue
        alternative = {"turn": turn, "text": text}
        extra = object_at(info[index], "extra") if index < len(info) and isinstance(info[index], dict) else {}
        if isinstance(extra.get("reasoning"), str) and extra["reasoning"]:
            alternative["thinking"] = extra["reasoning"]
        out.append(alternative)
    return out


def _string(record: dict, key: str) -> str:
    value = record.get(key)
    if not isinstance(value, str):
        raise Invalid(f'"{key}" must be a string, not {kind(value)}', record)
    return value


def register(add) -> None:
    add(SillyTavern())

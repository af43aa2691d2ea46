"""OpenAI Chat Completions and Anthropic Messages: a session object with ``"messages"`` (and a
top-level ``"system"``), a JSON list of messages, or JSON Lines of one message each. Every
message shape ``kvdb.transcripts.messages`` reads is taken, and a JSONL file whose first record
no format takes is read as messages, so that its error says what a message needs.

Training sets in this shape (LLaMA-Factory's, with v1's ``{"type", "value"}`` parts) may add
``"tools"``, media lists (``"images"``), and for preference training ``"chosen_messages"`` and
``"rejected_messages"`` in place of ``"messages"``: the chosen conversation is the session, and
where the rejected one parts from it, its turns are kept as alternatives."""

from __future__ import annotations

from kvdb.transcripts.formats.base import Format, Log
from kvdb.transcripts.messages import Conversation, Invalid, kind, message_error
from kvdb.transcripts.sessions import (
    Transcript,
    add_system,
    chat,
    dataset_side,
    is_session_object,
    session_metadata,
    session_name,
    session_title,
)


class MessageLog(Log):
    """Messages one per record: the whole file (or list) is one conversation."""

    label = "messages"

    def __init__(self, stem: str, shown: str):
        self._stem, self._shown = stem, shown
        self._conversation = Conversation()

    def add(self, record, line: int) -> None:
        self._conversation.add(record)

    def sessions(self) -> list[Transcript]:
        return [
            chat(
                self._stem,
                self._shown,
                self._conversation,
                {"format": "messages"},
                {"attachments": self._conversation.attachments},
            )
        ]


class Messages(Format):
    name = "messages"
    reads = (
        'OpenAI Chat Completions or Anthropic Messages: {"messages": [...]} objects, a list of messages, '
        "or one message per line"
    )
    suffix = ".jsonl"
    example = (
        '{"role": "system", "content": "You are terse."}\n'
        '{"role": "user", "content": "Capital of France?"}\n'
        '{"role": "assistant", "content": "Paris."}\n'
    )
    marks = ("messages", "tools", "chosen_messages", "rejected_messages")

    def claims(self, obj) -> bool:
        return is_session_object(obj) and ("messages" in obj or "chosen_messages" in obj)

    def read(self, obj: dict, name: str, source: str) -> list[Transcript]:
        conversation = Conversation(obj)
        add_system(conversation, obj.get("system"), "system", obj)
        key = "messages" if "messages" in obj else "chosen_messages"
        messages, rejected = obj[key], obj.get("rejected_messages")
        if isinstance(messages, list) and isinstance(rejected, list):
            shared = next(
                (i for i, (a, b) in enumerate(zip(messages, rejected)) if a != b), min(len(messages), len(rejected))
            )
            conversation.add_all(messages[:shared], key)
            turn = len(conversation)
            conversation.add_all(messages[shared:], key, shared)
            alternatives = conversation.alternatives(rejected[shared:], turn, "rejected_messages", shared)
        else:
            conversation.add_all(messages, key)
            alternatives = []
            if rejected is not None:
                raise Invalid(f'"rejected_messages" must be a list of messages, not {kind(rejected)}', obj)
        side = dataset_side(obj, conversation) | {"alternatives": alternatives}
        metadata = session_metadata(obj, "anthropic" if "system" in obj else "openai")
        return [
            chat(session_name(obj, name), source, conversation, metadata, side, session_title(obj, name, conversation))
        ]

    def opens_log(self, record) -> bool:
        return message_error(record) is None

    def log(self, stem: str, shown: str) -> MessageLog:
        return MessageLog(stem, shown)


MESSAGES = Messages()


def register(add) -> None:
    add(MESSAGES)

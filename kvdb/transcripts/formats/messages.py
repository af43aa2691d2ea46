"""OpenAI Chat Completions and Anthropic Messages: a session object with ``"messages"`` (and a
top-level ``"system"``), a JSON list of messages, or JSON Lines of one message each. Every
message shape ``kvdb.transcripts.messages`` reads is taken, and a JSONL file whose first record
no format takes is read as messages, so that its error says what a message needs."""

from __future__ import annotations

from kvdb.transcripts.formats.base import Format, Log
from kvdb.transcripts.messages import Conversation, message_error
from kvdb.transcripts.sessions import Transcript, add_system, chat, is_session_object, session_metadata, session_name


class MessageLog(Log):
    """Messages one per record: the whole file (or list) is one conversation."""

    label = "messages"

    def __init__(self, stem: str, shown: str):
        self._stem, self._shown = stem, shown
        self._conversation = Conversation()

    def add(self, record, line: int) -> None:
        self._conversation.add(record)

    def sessions(self) -> list[Transcript]:
        return [chat(self._stem, self._shown, self._conversation, {"format": "messages"})]


class Messages(Format):
    name = "messages"
    reads = 'OpenAI Chat Completions or Anthropic Messages: {"messages": [...]} objects, a list of messages, or one message per line'
    suffix = ".jsonl"
    example = '{"role": "system", "content": "You are terse."}\n{"role": "user", "content": "Capital of France?"}\n{"role": "assistant", "content": "Paris."}\n'
    marks = ("messages",)

    def claims(self, obj) -> bool:
        return is_session_object(obj) and "messages" in obj

    def read(self, obj: dict, name: str, source: str) -> list[Transcript]:
        conversation = Conversation(obj)
        add_system(conversation, obj.get("system"), "system", obj)
        conversation.add_all(obj["messages"])
        return [chat(session_name(obj, name), source, conversation, session_metadata(obj, "anthropic" if "system" in obj else "openai"))]

    def opens_log(self, record) -> bool:
        return message_error(record) is None

    def log(self, stem: str, shown: str) -> MessageLog:
        return MessageLog(stem, shown)


MESSAGES = Messages()


def register(add) -> None:
    add(MESSAGES)

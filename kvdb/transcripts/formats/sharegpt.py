"""ShareGPT: ``{"conversations": [{"from", "value"}, ...]}``, with a ``"system"`` in some
variants; the turns may also be OpenAI-shaped."""

from __future__ import annotations

from kvdb.transcripts.formats.base import Format
from kvdb.transcripts.messages import Conversation
from kvdb.transcripts.sessions import Transcript, add_system, chat, is_session_object, session_metadata, session_name


class ShareGPT(Format):
    name = "sharegpt"
    reads = 'ShareGPT datasets: {"conversations": [{"from": "human", "value": ...}, ...]}, one per line or a list'
    suffix = ".jsonl"
    example = '{"id": "q1", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]}\n'
    marks = ("conversations",)

    def claims(self, obj) -> bool:
        return is_session_object(obj) and "conversations" in obj

    def read(self, obj: dict, name: str, source: str) -> list[Transcript]:
        conversation = Conversation(obj)
        add_system(conversation, obj.get("system"), "system", obj)
        conversation.add_all(obj["conversations"])
        return [chat(session_name(obj, name), source, conversation, session_metadata(obj, "sharegpt"))]


def register(add) -> None:
    add(ShareGPT())

"""LMSYS-Chat-1M: ``{"conversation_id", "conversation": [{"role", "content"}, ...], "model"}``."""

from __future__ import annotations

from kvdb.transcripts.formats.base import Format
from kvdb.transcripts.messages import Conversation
from kvdb.transcripts.sessions import Transcript, chat, is_session_object, session_metadata, session_name, session_title


class LMSYS(Format):
    name = "lmsys"
    reads = 'LMSYS-Chat-1M rows: {"conversation_id", "conversation": [{"role", "content"}, ...]}'
    suffix = ".jsonl"
    example = (
        '{"conversation_id": "33f01b2c", "model": "vicuna-13b", '
        '"conversation": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}\n'
    )
    marks = ("conversation",)

    def claims(self, obj) -> bool:
        return is_session_object(obj) and "conversation" in obj

    def read(self, obj: dict, name: str, source: str) -> list[Transcript]:
        conversation = Conversation(obj).add_all(obj["conversation"])
        return [
            chat(
                session_name(obj, name),
                source,
                conversation,
                session_metadata(obj, "lmsys"),
                title=session_title(obj, name, conversation),
            )
        ]


def register(add) -> None:
    add(LMSYS())

"""ShareGPT: ``{"conversations": [{"from", "value"}, ...]}``, with a ``"system"`` in some
variants; the turns may also be OpenAI-shaped. LLaMA-Factory's datasets add ``"tools"``
(glaive-style tool calling), media lists (``"images"``) and, for preference training, a
``"chosen"`` and a ``"rejected"`` reply: the chosen one ends the session, the rejected one is
kept as an alternative to it."""

from __future__ import annotations

from kvdb.transcripts.formats.base import Format
from kvdb.transcripts.messages import Conversation
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


class ShareGPT(Format):
    name = "sharegpt"
    reads = (
        'ShareGPT datasets: {"conversations": [{"from": "human", "value": ...}, ...]}, one per line or a list '
        '(with LLaMA-Factory\'s "tools", "images", "chosen"/"rejected")'
    )
    suffix = ".jsonl"
    example = '{"id": "q1", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]}\n'
    marks = ("conversations", "chosen", "rejected", "tools")

    def claims(self, obj) -> bool:
        return is_session_object(obj) and "conversations" in obj

    def read(self, obj: dict, name: str, source: str) -> list[Transcript]:
        conversation = Conversation(obj)
        add_system(conversation, obj.get("system"), "system", obj)
        conversation.add_all(obj["conversations"], "conversations")
        side = dataset_side(obj, conversation)
        turn = len(conversation)  # where the chosen reply goes, and the rejected one would have
        if "chosen" in obj:
            conversation.add(obj["chosen"], '"chosen": ')
        if "rejected" in obj:
            side["alternatives"] = conversation.alternatives([obj["rejected"]], turn, "rejected")
        return [
            chat(
                session_name(obj, name),
                source,
                conversation,
                session_metadata(obj, "sharegpt"),
                side,
                session_title(obj, name, conversation),
            )
        ]


def register(add) -> None:
    add(ShareGPT())

"""Alpaca instruction tuning records: ``{"instruction", "input", "output"}`` (and a ``"system"``)."""

from __future__ import annotations

from kvdb.transcripts.formats.base import Format
from kvdb.transcripts.messages import Conversation, Invalid, kind
from kvdb.transcripts.sessions import (
    Transcript,
    add_system,
    chat,
    is_session_object,
    session_metadata,
    session_name,
    session_title,
)


class Alpaca(Format):
    name = "alpaca"
    reads = 'Alpaca instruction records: {"instruction", "input", "output"}, one per line or a list'
    example = '[{"instruction": "Name a colour.", "input": "", "output": "Blue."}]\n'
    marks = ("instruction", "output")

    def claims(self, obj) -> bool:
        return is_session_object(obj) and "instruction" in obj

    def read(self, obj: dict, name: str, source: str) -> list[Transcript]:
        """The input, when there is one, follows the instruction after a blank line."""
        for key in ("instruction", "input", "output", "system"):
            if obj.get(key) is not None and not isinstance(obj[key], str):
                raise Invalid(f'"{key}" must be a string, not {kind(obj[key])}', obj)
        if "output" not in obj:
            raise Invalid('an Alpaca record needs "output" beside "instruction"', obj)
        conversation = Conversation(obj)
        add_system(conversation, obj.get("system"), "system", obj)
        conversation.add_text("user", obj["instruction"] + (f"\n\n{obj['input']}" if obj.get("input") else ""))
        conversation.add_text("assistant", obj["output"] or "")
        return [
            chat(
                session_name(obj, name),
                source,
                conversation,
                session_metadata(obj, "alpaca"),
                title=session_title(obj, name, conversation),
            )
        ]


def register(add) -> None:
    add(Alpaca())

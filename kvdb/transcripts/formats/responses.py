"""The OpenAI Responses API: a request (``instructions``, ``input``) with its response's
``output``, or either alone; the items are read by ``kvdb.transcripts.messages``."""

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


class Responses(Format):
    name = "openai-responses"
    reads = 'OpenAI Responses API requests and responses: {"instructions", "input": [...], "output": [...]}'
    example = (
        '{"instructions": "Be brief.", '
        '"input": [{"role": "user", "content": [{"type": "input_text", "text": "2+2?"}]}],\n'
        ' "output": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "4"}]}]}\n'
    )
    marks = ("input", "output")

    def claims(self, obj) -> bool:
        return is_session_object(obj) and ("input" in obj or "output" in obj or "instructions" in obj)

    def read(self, obj: dict, name: str, source: str) -> list[Transcript]:
        conversation = Conversation(obj)
        add_system(conversation, obj.get("instructions"), "instructions", obj)
        given = obj.get("input")
        if isinstance(given, str):
            conversation.add_text("user", given)
        elif given is not None:
            if not isinstance(given, list):
                raise Invalid(f'"input" must be a string or a list of items, not {kind(given)}', obj)
            for index, item in enumerate(given):
                conversation.add(item, f"input[{index}]: ")
        output = obj.get("output")
        if output is not None:
            if not isinstance(output, list):
                raise Invalid(f'"output" must be a list of items, not {kind(output)}', obj)
            for index, item in enumerate(output):
                conversation.add(item, f"output[{index}]: ")
        return [
            chat(
                session_name(obj, name),
                source,
                conversation,
                session_metadata(obj, "openai-responses"),
                title=session_title(obj, name, conversation),
            )
        ]


def register(add) -> None:
    add(Responses())

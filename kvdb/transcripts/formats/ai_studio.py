"""Google AI Studio chats, as it saves each to Drive: ``{"runSettings", "systemInstruction",
"chunkedPrompt": {"chunks": [{"role": "user"|"model", "text"}]}}``. The file has no title of
its own (Drive's file name is the title), so the session is named after the file, or its
``displayName`` where a tool wrote one. A turn is written as several chunks in a row (the
model's thought, then its answer): consecutive chunks of one role are one turn, ``isThought``
chunks its thinking. Code the model ran and its output are a call and a tool's result. Drive
files, inline files and videos are counted placeholders; grounding sources and errors are
``events``, a Drive file's name an ``attachments`` entry, and an unsent draft
(``pendingInputs``) an event too. A chat Drive calls "Untitled prompt" (AI Studio's name for one
the user did not name) is titled by its first prompt. Its times are those a tool wrote
(``createTime``, ``updateTime``, a chunk's ``createTime``): AI Studio's own files keep none.
"""

from __future__ import annotations

import json

from kvdb.transcripts.formats.base import Format
from kvdb.transcripts.messages import Conversation, Invalid, kind, placeholder
from kvdb.transcripts.sessions import Transcript, add_system, chat, first_prompt, object_at
from kvdb.transcripts.stamps import said

ROLES = {"user": "user", "model": "assistant"}
# Drive's name for a chat the user did not name ("Untitled prompt (3)" after the first)
DRIVE_UNTITLED = "Untitled prompt"
MEDIA = {
    "driveImage": "image",
    "inlineImage": "image",
    "driveDocument": "document",
    "driveVideo": "video",
    "youtubeVideo": "video",
    "driveAudio": "audio",
}


class AIStudio(Format):
    name = "ai-studio"
    reads = (
        "Google AI Studio chats saved to Drive: "
        '{"runSettings", "systemInstruction", "chunkedPrompt": {"chunks": [{"role", "text"}]}}'
    )
    example = (
        '{"runSettings": {"model": "models/gemini-2.5-pro"}, "systemInstruction": {"text": "Be brief."}, '
        '"chunkedPrompt": {"chunks": [\n'
        '  {"role": "user", "text": "Hi"},\n'
        '  {"role": "model", "text": "The user greets me.", "isThought": true},\n'
        '  {"role": "model", "text": "Hello!"}], "pendingInputs": [{"role": "user", "text": ""}]}}\n'
    )
    marks = ("runSettings", "systemInstruction", "chunkedPrompt")

    def claims(self, obj) -> bool:
        return isinstance(obj, dict) and isinstance(obj.get("chunkedPrompt"), dict) and "chunks" in obj["chunkedPrompt"]

    def read(self, obj: dict, name: str, source: str) -> list[Transcript]:
        chunks = obj["chunkedPrompt"]["chunks"]
        if not isinstance(chunks, list) or not all(isinstance(c, dict) for c in chunks):
            raise Invalid(f'"chunkedPrompt.chunks" must be a list of chunk objects, not {kind(chunks)}', obj)
        conversation = Conversation(obj)
        add_system(conversation, _system(obj.get("systemInstruction"), obj), "systemInstruction", obj)
        side: dict[str, list] = {"events": [], "attachments": []}
        turn: dict | None = None
        for index, chunk in enumerate(chunks):
            role = chunk.get("role")
            if role not in ROLES:
                raise Invalid(f'a chunk\'s "role" must be "user" or "model", not {role!r}', chunk)
            if turn is None or turn["role"] != ROLES[role]:
                _flush(conversation, turn)
                turn = {"role": ROLES[role], "content": []}
            _chunk(chunk, turn, conversation, side)
            if "codeExecutionResult" in chunk:  # the model's turn goes on after the code's output
                _flush(conversation, turn)
                result = object_at(chunk, "codeExecutionResult")
                outcome = result.get("outcome", "OUTCOME_OK")
                conversation.add(
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tool_result",
                                "content": _text(result.get("output")),
                                "is_error": outcome != "OUTCOME_OK",
                            }
                        ],
                    },
                    f"chunks[{index}]: ",
                )
                turn = None
        _flush(conversation, turn)
        pending = obj["chunkedPrompt"].get("pendingInputs", obj.get("pendingInputs"))
        for draft in pending if isinstance(pending, list) else ():
            if isinstance(draft, dict) and isinstance(draft.get("text"), str) and draft["text"]:
                side["events"].append({"type": "unsent draft", "text": draft["text"]})
        title = str(obj.get("displayName") or name)
        metadata: dict[str, object] = {"format": self.name}
        if obj.get("id") is not None:
            metadata["id"] = obj["id"]
        settings = obj.get("runSettings")
        if isinstance(settings, dict) and isinstance(settings.get("model"), str):
            metadata["model"] = settings["model"]
        metadata |= said(obj.get("createTime"), obj.get("updateTime"), *(chunk.get("createTime") for chunk in chunks))
        prompt = first_prompt(conversation.messages()) if title.startswith(DRIVE_UNTITLED) else None
        return [chat(title, source, conversation, metadata, side, prompt)]


def _system(instruction, obj: dict):
    """``{}`` (none), ``{"text"}`` or ``{"parts": [{"text"}]}``."""
    if instruction is None or instruction == {}:
        return None
    if isinstance(instruction, dict) and isinstance(instruction.get("text"), str):
        return instruction["text"] or None
    if isinstance(instruction, dict) and isinstance(instruction.get("parts"), list):
        return [
            {"type": "text", "text": _text(part.get("text") if isinstance(part, dict) else part)}
            for part in instruction["parts"]
        ]
    raise Invalid(f'"systemInstruction" must be {{"text"}} or {{"parts": [{{"text"}}]}}, not {kind(instruction)}', obj)


def _chunk(chunk: dict, turn: dict, conversation: Conversation, side: dict) -> None:
    texts = [chunk["text"]] if isinstance(chunk.get("text"), str) else []
    if not texts:  # newer files also hold the text in parts; where both are, they are the same text
        texts = [
            _text(part.get("text")) for part in chunk.get("parts") or () if isinstance(part, dict) and "text" in part
        ]
    block_type = "thinking" if chunk.get("isThought") else "text"
    turn["content"] += [{"type": block_type, block_type: text} for text in texts if text]
    for key, media in MEDIA.items():
        if isinstance(chunk.get(key), dict):
            turn["content"].append({"type": "text", "text": placeholder(media, conversation.dropped)})
            if chunk[key].get("name"):
                side["attachments"].append(str(chunk[key]["name"]))
    if isinstance(chunk.get("inlineFile"), dict):
        mime = str(chunk["inlineFile"].get("mimeType", ""))
        turn["content"].append(
            {
                "type": "text",
                "text": placeholder(
                    mime.split("/")[0] if mime.startswith(("image/", "audio/", "video/")) else "file",
                    conversation.dropped,
                ),
            }
        )
    code = chunk.get("executableCode")
    if isinstance(code, dict):
        turn["content"].append({"type": "tool_use", "id": None, "name": "code_execution", "input": code})
    for source in object_at(chunk, "grounding").get("groundingChunks") or ():
        web = object_at(source, "web") if isinstance(source, dict) else {}
        if web:
            side["events"].append(
                {"type": "grounding source", "text": "\n".join(str(web[k]) for k in ("title", "uri") if web.get(k))}
            )
    if isinstance(chunk.get("errorMessage"), str) and chunk["errorMessage"]:
        side["events"].append({"type": "error", "text": chunk["errorMessage"]})


def _flush(conversation: Conversation, turn: dict | None) -> None:
    if turn is not None:
        conversation.add(turn)


def _text(value) -> str:
    if value is None:
        return ""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def register(add) -> None:
    add(AIStudio())

"""The Grok (xAI) data export (``prod-grok-backend.json``: ``{"conversations": [{"conversation",
"responses": [{"response"}]}]}``), and the grok.com web API's capture of one conversation
(camelCase, ``{"conversation", "responses": {"responses": [...]}}``).

Responses link to their parent; a regenerated answer not taken is an ``alternatives`` side
field, another leaf a session of its own, ``[branch N]``. Responses are not always in order:
they are taken by ``create_time`` (an ISO string or ``{"$date": {"$numberLong": ms}}``), then
as listed. Grok's reasoning (``thinking_trace``, the capture's ``steps``) is the reply's
thinking; a tool's call and answer are turns; web search results, what a tool reported, and
errors are ``events``; attachments are known by name (``attachments``) or only by id (a
counted placeholder each), and so are generated images. An untitled conversation is titled by
its first prompt; it was said from its ``create_time`` to its ``modify_time`` (or its responses').
"""

from __future__ import annotations

import json
from datetime import datetime

from kvdb.transcripts.formats.base import Format
from kvdb.transcripts.messages import Conversation, Invalid, kind, placeholder
from kvdb.transcripts.sessions import Transcript, alternative_replies, chat, first_prompt, tree_paths
from kvdb.transcripts.stamps import said

SENDERS = {"human": "user", "user": "user", "assistant": "assistant"}


def _conversation_item(obj) -> bool:
    return (
        isinstance(obj, dict)
        and isinstance(obj.get("conversation"), dict)
        and isinstance(obj.get("responses"), (list, dict))
    )


class Grok(Format):
    name = "grok"
    reads = (
        "the Grok data export (prod-grok-backend.json): "
        '{"conversations": [{"conversation": {"title"}, "responses": [{"response": {"message", "sender"}}]}]}'
    )
    example = (
        '{"conversations": [{"conversation": {"id": "c1", "title": "Greeting"}, "responses": [\n'
        '  {"response": {"_id": "r1", "message": "Hi", "sender": "human", "parent_response_id": null}},\n'
        '  {"response": {"_id": "r2", "message": "Hello!", "sender": "ASSISTANT", "parent_response_id": "r1"}}]}]}\n'
    )
    marks = ("conversations", "conversation", "responses", "projects")

    def claims(self, obj) -> bool:
        if _conversation_item(obj):
            return True
        items = obj.get("conversations") if isinstance(obj, dict) else None
        return isinstance(items, list) and bool(items) and all(_conversation_item(item) for item in items)

    def read(self, obj: dict, name: str, source: str) -> list[Transcript]:
        if _conversation_item(obj):
            return _sessions(obj, name, source)
        return [
            s for index, item in enumerate(obj["conversations"]) for s in _sessions(item, f"{name}#{index}", source)
        ]


def _sessions(item: dict, name: str, source: str) -> list[Transcript]:
    head = item["conversation"]
    listed = item["responses"]["responses"] if isinstance(item["responses"], dict) else item["responses"]
    if not isinstance(listed, list) or not listed:
        raise Invalid("the conversation holds no responses", item)
    responses = []
    for entry in listed:
        response = entry.get("response", entry) if isinstance(entry, dict) else entry
        if not isinstance(response, dict):
            raise Invalid(f"a response must be an object, not {kind(response)}", item)
        responses.append(response)
    ordered = sorted(enumerate(responses), key=lambda pair: (_time(pair[1]), pair[0]))
    by_id = {str(_field(r, "response_id", "_id", "responseId") or f"#{index}"): r for index, r in ordered}
    parents = {key: _field(r, "parent_response_id", "parentResponseId") for key, r in by_id.items()}
    paths = tree_paths({k: None if p is None else str(p) for k, p in parents.items()}, head.get("leaf_response_id"))
    session_id = _field(head, "conversation_id", "id", "conversationId")
    title = str(head.get("title") or session_id or name)
    metadata: dict[str, object] = {"format": "grok"}
    if session_id is not None:
        metadata["id"] = session_id
    times = [_field(head, "create_time", "createTime"), _field(head, "modify_time", "modifyTime")]
    metadata |= said(*times, *(_field(r, "create_time", "createTime") for r in responses))
    branches, alternatives = alternative_replies(
        paths, lambda key: _role(by_id[key]) == "assistant" and not by_id[key].get("toolResponses")
    )
    sessions = []
    for branch, path in enumerate([paths[0], *branches], start=1):
        conversation, side, turn_of = Conversation(item), dict[str, list](attachments=[], events=[]), dict[str, int]()
        for key in path:
            turn_of[key] = len(conversation)
            for turn in _turns(by_id[key], conversation, side):
                conversation.add(turn, f"responses[{key!r}]: ")
        if branch == 1:
            side["alternatives"] = [
                _alternative(turn_of[taken], by_id[other], conversation, side) for taken, other in alternatives
            ]
            side["summaries"] = [head["summary"]] if isinstance(head.get("summary"), str) and head["summary"] else []
        extra = {"branch": branch} if branch > 1 else {}
        prompt = None if head.get("title") else first_prompt(conversation.messages())
        sessions.append(
            chat(
                title if branch == 1 else f"{title} [branch {branch}]",
                source,
                conversation,
                dict(metadata, **extra),
                side,
                prompt,
            )
        )
    return sessions


def _turns(response: dict, conversation: Conversation, side: dict) -> list[dict]:
    role = _role(response)
    text = _text(response)
    for ids_key in ("file_attachments", "image_attachments"):
        for _ in response.get(ids_key) or ():
            text += ("\n" if text else "") + placeholder(
                "image" if ids_key == "image_attachments" else "file", conversation.dropped
            )
    for meta in response.get("fileAttachmentsMetadata") or ():
        if isinstance(meta, dict):
            side["attachments"].append(str(meta.get("fileName") or meta.get("fileMetadataId", "")))
    for _ in _field(response, "generated_image_urls", "generatedImageUrls") or ():
        text += ("\n" if text else "") + placeholder("generated image", conversation.dropped)
    for result in _field(response, "web_search_results", "webSearchResults") or ():
        if isinstance(result, dict):
            found = "\n".join(str(result[k]) for k in ("title", "url", "preview") if result.get(k))
            side["events"].append({"type": "web search result", "text": found})
    thinking = [response["thinking_trace"]] if isinstance(response.get("thinking_trace"), str) else []
    for step in response.get("steps") or ():
        if isinstance(step, dict):
            thinking.extend(t for t in step.get("text") or () if isinstance(t, str))
            for used in step.get("toolUsageResults") or ():
                if isinstance(used, dict) and isinstance(used.get("text"), str):
                    side["events"].append({"type": f"tool {used.get('toolName', '')}".strip(), "text": used["text"]})
    if isinstance(response.get("error"), str) and response["error"]:
        side["events"].append({"type": "error", "text": response["error"]})
    blocks: list[dict] = [{"type": "thinking", "thinking": "\n".join(thinking)}] if thinking else []
    blocks.append({"type": "text", "text": text})
    calls = [call for call in response.get("toolResponses") or () if isinstance(call, dict)]
    blocks += [
        {"type": "tool_use", "id": None, "name": call.get("toolName"), "input": call.get("input", {})} for call in calls
    ]
    results = [
        {
            "type": "tool_result",
            "tool_use_id": None,
            "content": _json(call.get("output")),
            "is_error": bool(call.get("isError")),
        }
        for call in calls
    ]
    return [{"role": role, "content": blocks}] + ([{"role": "user", "content": results}] if results else [])


def _alternative(turn: int, response: dict, conversation: Conversation, side: dict) -> dict:
    """A regeneration not taken: its text and thinking; what it found and holds goes with the session's."""
    (reply,) = _turns(response, conversation, side)
    alternative = {"turn": turn, "text": reply["content"][-1]["text"]}
    if reply["content"][0]["type"] == "thinking":
        alternative["thinking"] = reply["content"][0]["thinking"]
    return alternative


def _role(response: dict) -> str:
    sender = response.get("sender")
    if not isinstance(sender, str) or sender.lower() not in SENDERS:
        raise Invalid(f'a response\'s "sender" must be "human" or "assistant", not {sender!r}', response)
    return SENDERS[sender.lower()]


def _text(response: dict) -> str:
    message = response.get("message")
    if message is not None and not isinstance(message, str):
        raise Invalid(f'a response\'s "message" must be a string, not {kind(message)}', response)
    return message or ""


def _time(response: dict) -> float:
    """Seconds since the epoch; a response without a time sorts first, in list order."""
    value = _field(response, "create_time", "createTime")
    if isinstance(value, dict):
        value = value.get("$date", value)
        value = value.get("$numberLong", value) if isinstance(value, dict) else value
        try:
            return int(value) / 1000
        except (TypeError, ValueError):
            return 0.0
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return 0.0
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def _field(obj: dict, *keys):
    return next((obj[key] for key in keys if obj.get(key) is not None), None)


def _json(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def register(add) -> None:
    add(Grok())

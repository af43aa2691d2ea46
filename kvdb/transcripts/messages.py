"""Messages of every export format, reduced to one shape that ``kvdb.model.chat`` renders.

A message is ``{"role", "content"}``, plus what a turn may carry besides its text:
``name`` (who spoke), ``tool_calls`` (``[{"id", "name", "arguments"}]``, arguments as the
JSON text the model wrote), ``tool_call_id`` and ``is_error`` (on a tool's result), and
``thinking`` (reasoning the transcript shows). The shapes read are:

- OpenAI Chat Completions: string, part-list or ``null`` content, ``tool_calls``, the legacy
  ``function_call``, ``refusal``, the ``tool``/``function`` roles and ``name``;
- the OpenAI Responses API's items: ``message`` (``input_text``/``output_text``),
  ``function_call``, ``function_call_output``, ``reasoning``;
- Anthropic content blocks: ``text``, ``tool_use``, ``tool_result`` (a user message holding
  results becomes one tool message per result, in order), ``thinking``;
- ShareGPT ``{"from", "value"}``, including ``function_call`` and ``observation`` turns;
- LLaMA-Factory v1's part lists: ``{"type", "value"}`` parts of type ``text``, ``reasoning``,
  ``tool_call`` (the value the JSON text ``{"name", "arguments"}``) and media.

What has no text (an image, audio, a file, redacted thinking, a hosted tool's call) becomes
the visible placeholder ``[KIND not archived]`` and is counted in ``dropped``, so that no
part of a transcript disappears without the ingest result saying so; where a file names it,
its name (or path) is kept in ``attachments``.
"""

from __future__ import annotations

import json
from collections import Counter

ROLE_ALIASES = {
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "system": "system",
    "developer": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
    "ipython": "tool",
    "function_call": "assistant",
}

TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "summary_text": "text", "refusal": "refusal"}
THINKING_PARTS = {"thinking": "thinking", "reasoning_text": "text"}
PLACEHOLDER_PARTS = {
    "image": "image",
    "image_url": "image",
    "input_image": "image",
    "image_file": "image",
    "input_audio": "audio",
    "audio": "audio",
    "file": "file",
    "input_file": "file",
    "document": "document",
    "redacted_thinking": "redacted thinking",
}
# LLaMA-Factory v1's media parts, whose "value" is the file's path or URL
VALUE_MEDIA = {
    "image_url": "image",
    "video_url": "video",
    "audio_url": "audio",
    "image": "image",
    "video": "video",
    "audio": "audio",
}
# Responses API items that are a hosted tool's work, with no text of the transcript's own
HOSTED_CALLS = (
    "web_search_call",
    "file_search_call",
    "computer_call",
    "computer_call_output",
    "image_generation_call",
    "code_interpreter_call",
    "mcp_call",
    "mcp_list_tools",
    "local_shell_call",
)


class Invalid(Exception):
    """A JSON value has the wrong shape; ``node`` is the nearest enclosing object, to find its line."""

    def __init__(self, message: str, node=None):
        super().__init__(message)
        self.node = node


def placeholder(kind: str, dropped: Counter) -> str:
    dropped[kind] += 1
    return f"[{kind} not archived]"


class Conversation:
    """Messages added one by one in any of the shapes above; ``messages`` is the normalised tuple."""

    def __init__(self, owner=None):
        self.owner = owner  # the object the list of messages belongs to, for error lines
        self.dropped: Counter = Counter()
        self.attachments: list[str] = []  # names or paths of the files placeholders stand for
        self._messages: list[dict] = []
        self._tool_names: dict[str, str] = {}  # call id -> function name, to name each result

    def add_all(self, messages, key: str = "messages", start: int = 0) -> Conversation:
        """``key`` and ``start`` name the list and its first message's index in errors."""
        if not isinstance(messages, (list, tuple)):
            raise Invalid(f"{key} must be a list, not {kind(messages)}", self.owner)
        for index, message in enumerate(messages, start=start):
            self.add(message, f"{key}[{index}]: ")
        return self

    def add(self, message, where: str = "") -> None:
        counted, attached = Counter(self.dropped), len(self.attachments)
        try:
            normalised = self._normalise(message)
        except Invalid as error:
            self.dropped = counted  # a message refused whole leaves no placeholder counted
            del self.attachments[attached:]
            raise Invalid(f"{where}{error}", error.node or self.owner) from None
        for item in normalised:
            for call in item.get("tool_calls", ()):
                if call["id"] is not None:
                    self._tool_names[call["id"]] = call["name"]
            if item["role"] == "tool" and "name" not in item and item.get("tool_call_id") in self._tool_names:
                item["name"] = self._tool_names[item["tool_call_id"]]
            self._append(item, message.get("type") if isinstance(message, dict) else None)

    def _append(self, item: dict, item_type) -> None:
        """Responses API items split one assistant turn in pieces: its reasoning is held for the
        turn that follows it, and a call joins the assistant turn just before it."""
        last = self._messages[-1] if self._messages else None
        if last is not None and last.get("pending") and item["role"] == "assistant":
            item = dict(item, thinking="\n".join(filter(None, (last["thinking"], item.get("thinking")))))
            self._messages.pop()
        elif item_type == "function_call" and last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).extend(item["tool_calls"])
            return
        if item_type == "reasoning":  # reasoning after reasoning still waits for its turn
            item["pending"] = True
        self._messages.append(item)

    def add_text(self, role: str, text: str) -> None:
        self._messages.append({"role": role, "content": text})

    def add_thinking(self, text: str) -> None:
        """Reasoning a transcript keeps apart from the reply it led to (ChatGPT's thought nodes):
        it becomes the thinking of the assistant turn that follows."""
        self._append({"role": "assistant", "content": "", "thinking": text}, "reasoning")

    def add_media(self, media_kind: str, paths, key: str) -> None:
        """Files listed beside the turns (LLaMA-Factory's ``images``), which markers such as
        ``<image>`` in the text stand for: counted as dropped, their paths kept as attachments."""
        if paths is None:
            return
        if not isinstance(paths, list) or not all(isinstance(path, str) for path in paths):
            raise Invalid(f'"{key}" must be a list of file paths, not {kind(paths)}', self.owner)
        self.dropped[media_kind] += len(paths)
        self.attachments += paths

    def alternatives(self, replies, turn: int, key: str, start: int = 0) -> list[dict]:
        """Replies not taken (a preference set's rejected answer), read in any shape above, as
        side ``alternatives`` from ``turn`` on; what they hold without text is counted here."""
        if not replies:
            return []
        other = Conversation(self.owner).add_all(replies, key, start)
        self.dropped.update(other.dropped)
        self.attachments += other.attachments
        return [{"turn": turn + index, "text": plain(message)} for index, message in enumerate(other.messages())]

    @property
    def empty(self) -> bool:
        return not self._messages

    def __len__(self) -> int:
        """The messages so far: where the next one added will stand (a side field's ``turn``)."""
        return len(self._messages)

    def messages(self) -> tuple[dict, ...]:
        if not self._messages:
            raise Invalid("no messages (the list is empty)", self.owner)
        return tuple({k: v for k, v in m.items() if k != "pending"} for m in self._messages)

    # shapes --------------------------------------------------------------------------

    def _normalise(self, message) -> list[dict]:
        if not isinstance(message, dict):
            raise Invalid(
                'expected a message object with "role" and "content" (or ShareGPT "from" and "value"), '
                f"got {kind(message)}"
            )
        item_type = message.get("type")
        if "role" in message:
            return self._role_message(message)
        if "from" in message:
            return self._sharegpt_message(message)
        if item_type == "function_call":
            return [
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        _call(
                            message.get("call_id") or message.get("id"),
                            message.get("name"),
                            message.get("arguments"),
                            message,
                        )
                    ],
                }
            ]
        if item_type == "function_call_output":
            return [_tool_result(message.get("call_id"), _string(message.get("output"), "output", message))]
        if item_type == "reasoning":
            return [{"role": "assistant", "content": "", "thinking": self._reasoning(message)}]
        if item_type in HOSTED_CALLS:
            return [{"role": "assistant", "content": placeholder(item_type.replace("_", " "), self.dropped)}]
        raise Invalid(
            'expected a message object with "role" and "content" (or ShareGPT "from" and "value", '
            "or a Responses API item), "
            f"got an object with keys {', '.join(sorted(map(str, message))) or 'none'}",
            message,
        )

    def _role_message(self, message: dict) -> list[dict]:
        role = _role(message, "role")
        if "content" not in message and not any(key in message for key in ("tool_calls", "function_call", "refusal")):
            raise Invalid('message has no "content"', message)
        try:
            parts = self._parts(message.get("content"))
        except Invalid as error:
            raise Invalid(f'"content": {error}', message) from None
        text = [p for p in parts if isinstance(p, str)]
        if isinstance(message.get("refusal"), str):
            text.append(message["refusal"])
        out: dict = {"role": role, "content": "\n".join(text)}
        if isinstance(message.get("name"), str) and message["name"]:
            out["name"] = message["name"]
        calls = [p for p in parts if isinstance(p, dict) and p["kind"] == "call"]
        calls += [
            _openai_call(c.get("id"), c.get("function"), c)
            for c in _list(message.get("tool_calls"), "tool_calls", message)
        ]
        if message.get("function_call") is not None:
            calls.append(_openai_call(None, message["function_call"], message))
        if calls:
            out["tool_calls"] = [{k: c[k] for k in ("id", "name", "arguments")} for c in calls]
        thinking = [p["text"] for p in parts if isinstance(p, dict) and p["kind"] == "thinking"]
        if isinstance(message.get("reasoning_content"), str) and message["reasoning_content"]:
            thinking.insert(0, message["reasoning_content"])
        if thinking:
            out["thinking"] = "\n".join(thinking)
        if role == "tool" and message.get("tool_call_id") is not None:
            out["tool_call_id"] = str(message["tool_call_id"])
        results = [p for p in parts if isinstance(p, dict) and p["kind"] == "result"]
        if not results:
            return [out]
        # Anthropic puts tool results in a user turn: each becomes a tool turn, the rest stays the user's
        turns = [_tool_result(r["id"], r["text"], r["is_error"]) for r in results]
        if out["content"] or len(out) > 2:
            turns.append(out)
        return turns

    def _sharegpt_message(self, message: dict) -> list[dict]:
        role = _role(message, "from")
        if "value" not in message:
            raise Invalid('message has no "value"', message)
        value = message["value"]
        call = _written_call(value, message) if message["from"].lower() == "function_call" else None
        if call is not None:
            return [{"role": "assistant", "content": "", "tool_calls": [call]}]
        try:
            parts = self._parts(value)
        except Invalid as error:
            raise Invalid(f'"value": {error}', message) from None
        return [{"role": role, "content": "\n".join(p for p in parts if isinstance(p, str))}]

    def _parts(self, content) -> list:
        """Text (str) and structured parts (dicts with a ``kind``) of a message's content."""
        if content is None:
            return []
        if isinstance(content, str):
            return [content]
        if not isinstance(content, list):
            raise Invalid(f"must be a string, null or a list of content parts, not {kind(content)}")
        return [self._part(part) for part in content]

    def _part(self, part):
        if isinstance(part, str):
            return part
        if not isinstance(part, dict):
            raise Invalid(
                f'each part must be a string or an object such as {{"type": "text", "text": "..."}}, not {kind(part)}'
            )
        part_type = part.get("type", "text")
        if "value" in part:
            return self._value_part(part_type, part)
        if part_type in TEXT_PARTS:
            return _string(part.get(TEXT_PARTS[part_type]), TEXT_PARTS[part_type], part, f"a {part_type} part needs")
        if part_type in THINKING_PARTS:
            return {
                "kind": "thinking",
                "text": _string(
                    part.get(THINKING_PARTS[part_type]), THINKING_PARTS[part_type], part, f"a {part_type} part needs"
                ),
            }
        if part_type in PLACEHOLDER_PARTS:
            return placeholder(PLACEHOLDER_PARTS[part_type], self.dropped)
        if part_type == "tool_use":
            return dict(_call(part.get("id"), part.get("name"), part.get("input", {}), part), kind="call")
        if part_type == "tool_result":
            inner = part.get("content")
            text = "\n".join(p for p in self._parts(inner) if isinstance(p, str))
            return {
                "kind": "result",
                "id": part.get("tool_use_id"),
                "text": text,
                "is_error": bool(part.get("is_error")),
            }
        if isinstance(part_type, str):
            return placeholder(f"{part_type} part", self.dropped)
        raise Invalid(f'a part\'s "type" must be a string, not {kind(part_type)}', part)

    def _value_part(self, part_type, part: dict):
        value = part["value"]
        if part_type in VALUE_MEDIA:
            if isinstance(value, str) and not value.startswith("data:"):  # a path or URL, not the file's bytes
                self.attachments.append(value)
            return placeholder(VALUE_MEDIA[part_type], self.dropped)
        text = _string(value, "value", part, f"a {part_type} part needs")
        if part_type == "reasoning":
            return {"kind": "thinking", "text": text}
        call = _written_call(text, part) if part_type == "tool_call" else None
        if call is not None:
            return dict(call, kind="call")
        if part_type in ("text", "tool_call"):  # a call that is no JSON {"name", ...} stays the text it is
            return text
        raise Invalid(
            f'unknown part type {part_type!r} of a {{"type", "value"}} part; '
            f"known: text, reasoning, tool_call, {', '.join(VALUE_MEDIA)}",
            part,
        )

    def _reasoning(self, item: dict) -> str:
        content = self._parts(item.get("content"))  # parsed once: a placeholder in it counts once
        texts = [p for p in self._parts(item.get("summary")) + content if isinstance(p, str)]
        texts += [p["text"] for p in content if isinstance(p, dict) and p["kind"] == "thinking"]
        if not texts and item.get("encrypted_content"):
            return placeholder("encrypted reasoning", self.dropped)
        return "\n".join(texts)


def message_error(obj) -> Invalid | None:
    """Why ``obj`` is no message in any of the shapes above (None when it is one)."""
    try:
        Conversation().add(obj)
    except Invalid as error:
        return error
    return None


def plain(message: dict) -> str:
    """A normalised message's text, its thinking and calls included, for a side field."""
    calls = [f"{call['name']}({call['arguments']})" for call in message.get("tool_calls", ())]
    return "\n".join(filter(None, (message.get("thinking"), message["content"], *calls)))


def _written_call(text, node) -> dict | None:
    """A call a dataset writes as the JSON text ``{"name", "arguments"}``; None for other text."""
    if not isinstance(text, str):
        return None
    try:
        call = json.loads(text)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    return _call(call.get("id"), call["name"], call.get("arguments", {}), node)


def _role(message: dict, key: str) -> str:
    role = message[key]
    if not isinstance(role, str):
        raise Invalid(f'"{key}" must be a string, not {kind(role)}', message)
    if role.lower() not in ROLE_ALIASES:
        raise Invalid(f"unknown role {role!r}; allowed roles: {', '.join(sorted(ROLE_ALIASES))}", message)
    return ROLE_ALIASES[role.lower()]


def _call(call_id, name, arguments, node) -> dict:
    if not isinstance(name, str) or not name:
        raise Invalid(f"a tool call needs a function name, got {kind(name)}", node)
    if call_id is not None and not isinstance(call_id, (str, int)):
        raise Invalid(f"a tool call's id must be a string, not {kind(call_id)}", node)
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": None if call_id is None else str(call_id), "name": name, "arguments": text}


def _openai_call(call_id, function, node) -> dict:
    if not isinstance(function, dict):
        raise Invalid(
            f'a tool call\'s "function" must be an object with "name" and "arguments", not {kind(function)}', node
        )
    return _call(call_id, function.get("name"), function.get("arguments", ""), node)


def _tool_result(call_id, text: str, is_error: bool = False) -> dict:
    out: dict[str, str | bool] = {"role": "tool", "content": text}
    if call_id is not None:
        out["tool_call_id"] = str(call_id)
    if is_error:
        out["is_error"] = True
    return out


def _string(value, key: str, node, needs: str = "the item needs") -> str:
    if isinstance(value, str):
        return value
    raise Invalid(f'{needs} a string "{key}", not {kind(value)}', node)


def _list(value, key: str, node) -> list:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise Invalid(f'"{key}" must be a list of objects, not {kind(value)}', node)
    return value


def kind(value) -> str:
    """The JSON name of a value's type, which is what the user wrote."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__

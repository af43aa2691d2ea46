"""Session objects of every export format, each told apart by its keys, never by a file name.

| keys | format |
|---|---|
| ``messages`` (+ ``system``) | OpenAI Chat Completions, Anthropic Messages |
| ``conversations`` (+ ``system``) | ShareGPT |
| ``conversation`` | LMSYS-Chat |
| ``instruction``, ``output`` (+ ``input``, ``system``) | Alpaca |
| ``input`` and/or ``output`` (+ ``instructions``) | OpenAI Responses API request or response |
| ``mapping`` (+ ``current_node``) | ChatGPT data export, one conversation |

A ChatGPT conversation is a tree: its session follows ``current_node``, and each branch the
user left by editing a message is a session of its own (the prefix trie stores what they
share once).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvdb.transcripts.messages import Conversation, Invalid, kind, placeholder

SESSION_KEYS = '"messages", "conversations", "conversation", "instruction", "input", "output" or "mapping"'


@dataclass(frozen=True)
class Transcript:
    """One session: either verbatim ``text`` or normalised ``messages`` (the other is None).

    ``dropped`` counts what is kept only as a ``[KIND not archived]`` placeholder, by kind."""

    name: str
    source: str
    text: str | None
    messages: tuple[dict, ...] | None
    metadata: dict
    dropped: dict = field(default_factory=dict)


def chat(name: str, source: str, conversation: Conversation, metadata: dict) -> Transcript:
    return Transcript(name, source, None, conversation.messages(), metadata, dict(conversation.dropped))


def from_object(obj, default_name: str, source: str) -> list[Transcript]:
    """The sessions of one session object (several for a ChatGPT conversation with branches)."""
    if not isinstance(obj, dict):
        raise Invalid(f"expected a session object with {SESSION_KEYS}, got {kind(obj)}")
    if "mapping" in obj:
        return _chatgpt(obj, default_name, source)
    conversation = Conversation(obj)
    if "messages" in obj:
        detected = "anthropic" if "system" in obj else "openai"
        _system(conversation, obj.get("system"), "system", obj)
        conversation.add_all(obj["messages"])
    elif "conversations" in obj:
        detected = "sharegpt"
        _system(conversation, obj.get("system"), "system", obj)
        conversation.add_all(obj["conversations"])
    elif "conversation" in obj:
        detected = "lmsys"
        conversation.add_all(obj["conversation"])
    elif "instruction" in obj:
        detected = "alpaca"
        _alpaca(conversation, obj)
    elif "input" in obj or "output" in obj:
        detected = "openai-responses"
        _responses(conversation, obj)
    else:
        raise Invalid(f"session has none of {SESSION_KEYS} (see the README's list of formats)", obj)
    metadata = {"format": detected}
    session_id = obj.get("id", obj.get("conversation_id"))
    if session_id is not None:
        metadata["id"] = session_id
    return [chat(_session_name(obj, default_name), source, conversation, metadata)]


def _system(conversation: Conversation, system, key: str, owner) -> None:
    """A top-level system prompt (Anthropic, ShareGPT variants, Responses ``instructions``): a string or text blocks."""
    if system is None:
        return
    if isinstance(system, str):
        conversation.add_text("system", system)
    elif isinstance(system, list):
        conversation.add({"role": "system", "content": system}, f'"{key}": ')
    else:
        raise Invalid(f'"{key}" must be a string or a list of text blocks, not {kind(system)}', owner)


def _alpaca(conversation: Conversation, obj: dict) -> None:
    """Instruction tuning records: the input, when there is one, follows the instruction after a blank line."""
    for key in ("instruction", "input", "output", "system"):
        if obj.get(key) is not None and not isinstance(obj[key], str):
            raise Invalid(f'"{key}" must be a string, not {kind(obj[key])}', obj)
    if "output" not in obj:
        raise Invalid('an Alpaca record needs "output" beside "instruction"', obj)
    _system(conversation, obj.get("system"), "system", obj)
    conversation.add_text("user", obj["instruction"] + (f"\n\n{obj['input']}" if obj.get("input") else ""))
    conversation.add_text("assistant", obj["output"] or "")


def _responses(conversation: Conversation, obj: dict) -> None:
    """A Responses API request (``instructions``, ``input``) with its response's ``output``, or either alone."""
    _system(conversation, obj.get("instructions"), "instructions", obj)
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


def _session_name(obj: dict, default: str) -> str:
    """The "name" (or a ChatGPT "title"), else the "id" (or LMSYS "conversation_id"), else ``default``; null counts as absent."""
    name = obj.get("name", obj.get("title"))
    session_id = obj.get("id", obj.get("conversation_id"))
    valid_id = isinstance(session_id, (str, int)) and not isinstance(session_id, bool) and session_id != ""
    if session_id is not None and not valid_id:
        raise Invalid(f'"id" must be a non-empty string or an integer, got {session_id!r}', obj)
    if name is not None and (not isinstance(name, str) or not name):
        raise Invalid(f'"name" must be a non-empty string, got {name!r}', obj)
    if name is not None:
        return name
    return default if session_id is None else str(session_id)


# ChatGPT data export -------------------------------------------------------------------


def _chatgpt(obj: dict, default_name: str, source: str) -> list[Transcript]:
    mapping = obj["mapping"]
    if not isinstance(mapping, dict) or not all(isinstance(node, dict) for node in mapping.values()):
        raise Invalid(f'"mapping" must be an object of message nodes, not {kind(mapping)}', obj)
    leaves = [node_id for node_id, node in mapping.items() if not node.get("children")]
    current = obj.get("current_node")
    if current in mapping:
        leaves = [current] + [leaf for leaf in leaves if leaf != current]
    name = _session_name(obj, default_name)
    metadata: dict[str, object] = {"format": "chatgpt-export"}
    if obj.get("conversation_id", obj.get("id")) is not None:
        metadata["id"] = obj.get("conversation_id", obj.get("id"))
    sessions = []
    for branch, leaf in enumerate(leaves, start=1):
        conversation = Conversation(obj)
        for node_id in _path_to(mapping, leaf):
            message = mapping[node_id].get("message")
            if message is not None:
                turn = _chatgpt_message(message, conversation)
                if turn is not None:
                    conversation.add(turn, f"mapping[{node_id!r}]: ")
        if conversation.empty:  # a branch of hidden, empty nodes holds nothing to keep
            continue
        extra = {"branch": branch} if branch > 1 else {}
        sessions.append(chat(name if branch == 1 else f"{name} [branch {branch}]", source, conversation, dict(metadata, **extra)))
    if not sessions:
        raise Invalid("the conversation holds no messages", obj)
    return sessions


def _path_to(mapping: dict, leaf: str) -> list[str]:
    path, seen, node_id = [], set(), leaf
    while node_id is not None:
        if node_id in seen or node_id not in mapping:
            raise Invalid(f"the mapping's parent links from {leaf!r} are broken at {node_id!r}", mapping.get(leaf))
        seen.add(node_id)
        path.append(node_id)
        node_id = mapping[node_id].get("parent")
    return path[::-1]


def _chatgpt_message(message: dict, conversation: Conversation) -> dict | None:
    """A ChatGPT message as an OpenAI-shaped one; None for one with no text (the hidden root)."""
    if not isinstance(message, dict):
        raise Invalid(f"a node's message must be an object, not {kind(message)}")
    author = message.get("author") or {}
    role = author.get("role", "user")
    content = message.get("content") or {}
    content_type = content.get("content_type", "text")
    if content_type in ("text", "multimodal_text"):
        parts = [_chatgpt_part(part, conversation) for part in content.get("parts") or []]
        text = "\n".join(p for p in parts if p)
    elif content_type == "user_editable_context":
        text = "\n\n".join(content[key] for key in ("user_profile", "user_instructions") if content.get(key))
    elif content_type == "thoughts":
        thinking = "\n\n".join("\n".join(filter(None, (t.get("summary"), t.get("content")))) for t in content.get("thoughts") or [])
        return {"role": "assistant", "content": [{"type": "thinking", "thinking": thinking}]} if thinking else None
    elif content_type == "reasoning_recap":
        text = content.get("content") or ""
    elif isinstance(content.get("text"), str):
        text = "\n".join(filter(None, (content.get("title"), content["text"])))
    else:
        text = placeholder(content_type, conversation.dropped)
    recipient = message.get("recipient", "all")
    if role == "assistant" and recipient not in (None, "all") and text:
        return {"role": "assistant", "content": None, "tool_calls": [{"id": None, "function": {"name": recipient, "arguments": text}}]}
    if not text:
        return None
    turn = {"role": role, "content": text}
    if author.get("name"):
        turn["name"] = author["name"]
    return turn


def _chatgpt_part(part, conversation: Conversation) -> str:
    if isinstance(part, str):
        return part
    if isinstance(part, dict) and isinstance(part.get("text"), str):  # an audio transcription
        return part["text"]
    content_type = part.get("content_type", "part") if isinstance(part, dict) else kind(part)
    kind_name = "image" if "image" in content_type else "audio" if "audio" in content_type else content_type
    return placeholder(kind_name, conversation.dropped)

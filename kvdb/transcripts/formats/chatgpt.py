"""The ChatGPT data export (``conversations.json``): a list of conversations, each a tree of
message nodes in ``"mapping"``. Its session follows ``current_node``, and each branch the user
left by editing a message is a session of its own (the prefix trie stores what they share once).
A conversation is named by its ``title`` (one not yet named, by its first prompt) and was said
from ``create_time`` to ``update_time``.
"""

from __future__ import annotations

from kvdb.transcripts.formats.base import Format
from kvdb.transcripts.messages import Conversation, Invalid, kind, placeholder
from kvdb.transcripts.sessions import Transcript, chat, first_prompt, session_name
from kvdb.transcripts.stamps import said


class ChatGPT(Format):
    name = "chatgpt"
    reads = (
        "the ChatGPT data export's conversations.json: "
        '[{"title", "mapping": {id: {"message", "parent", "children"}}, "current_node"}]'
    )
    example = (
        '[{"title": "Greeting", "current_node": "b", "mapping": {\n'
        '  "a": {"id": "a", "parent": null, "children": ["b"], '
        '"message": {"author": {"role": "user"}, "content": {"content_type": "text", "parts": ["Hi"]}}},\n'
        '  "b": {"id": "b", "parent": "a", "children": [], '
        '"message": {"author": {"role": "assistant"}, "content": {"content_type": "text", "parts": ["Hello!"]}}}}}]\n'
    )
    marks = ("title", "mapping", "current_node", "create_time")

    def claims(self, obj) -> bool:
        return isinstance(obj, dict) and "mapping" in obj

    def read(self, obj: dict, name: str, source: str) -> list[Transcript]:
        mapping = obj["mapping"]
        if not isinstance(mapping, dict) or not all(isinstance(node, dict) for node in mapping.values()):
            raise Invalid(f'"mapping" must be an object of message nodes, not {kind(mapping)}', obj)
        leaves = [node_id for node_id, node in mapping.items() if not node.get("children")]
        current = obj.get("current_node")
        if current in mapping:
            leaves = [current] + [leaf for leaf in leaves if leaf != current]
        title = session_name(obj, name)
        metadata: dict[str, object] = {"format": "chatgpt"}
        if obj.get("conversation_id", obj.get("id")) is not None:
            metadata["id"] = obj.get("conversation_id", obj.get("id"))
        metadata |= said(obj.get("create_time"), obj.get("update_time"))
        untitled = obj.get("name", obj.get("title")) is None  # named by its id
        sessions = []
        for branch, leaf in enumerate(leaves, start=1):
            conversation, path = Conversation(obj), _path_to(mapping, leaf)
            for node_id in path:
                message = mapping[node_id].get("message")
                if message is not None:
                    _add(message, conversation, f"mapping[{node_id!r}]: ")
            if conversation.empty:  # a branch of hidden, empty nodes holds nothing to keep
                continue
            extra = {"branch": branch} if branch > 1 else {}
            name = title if branch == 1 else f"{title} [branch {branch}]"
            prompt = _prompt(mapping, path) if untitled else None
            sessions.append(
                chat(
                    name,
                    source,
                    conversation,
                    dict(metadata, **extra),
                    {"attachments": conversation.attachments},
                    prompt,
                )
            )
        if not sessions:
            raise Invalid("the conversation holds no messages", obj)
        return sessions


def _prompt(mapping: dict, path: list[str]) -> str:
    """The first prompt of an untitled conversation, past the custom instructions that ChatGPT
    sends in the user's name (``user_editable_context``): they are the same in every conversation."""
    typed = []
    for node_id in path:
        message = mapping[node_id].get("message") or {}
        content = message.get("content") or {}
        if content.get("content_type", "text") in ("text", "multimodal_text"):
            typed.append(
                {
                    "role": (message.get("author") or {}).get("role"),
                    "content": "\n".join(p for p in content.get("parts") or [] if isinstance(p, str)),
                }
            )
    return first_prompt(typed)


def _path_to(mapping: dict, leaf: str) -> list[str]:
    path, seen, node_id = [], set(), leaf
    while node_id is not None:
        if node_id in seen or node_id not in mapping:
            raise Invalid(f"the mapping's parent links from {leaf!r} are broken at {node_id!r}", mapping.get(leaf))
        seen.add(node_id)
        path.append(node_id)
        node_id = mapping[node_id].get("parent")
    return path[::-1]


# Where content types other than (multimodal) text hold their text: code and its output, browsing
# and file-search quotes, custom instructions and memory, errors, reasoning recaps. Their other
# fields are ids, URLs, sizes and flags.
TEXT_FIELDS = (
    "title",
    "name",
    "summary",
    "user_profile",
    "user_instructions",
    "model_set_context",
    "repository",
    "repo_summary",
    "result",
    "snippet",
    "text",
    "content",
)
REASONING = ("thoughts", "reasoning_recap")


def _add(message, conversation: Conversation, where: str) -> None:
    """A ChatGPT message added as an OpenAI-shaped one. A thought or a reasoning recap becomes
    the thinking of the assistant turn after it; one with no text (the hidden root) adds nothing.
    The names of the files attached to it are kept as the session's attachments."""
    if not isinstance(message, dict):
        raise Invalid(f"{where}a node's message must be an object, not {kind(message)}")
    author = message.get("author") or {}
    role = author.get("role", "user")
    content = message.get("content") or {}
    content_type = content.get("content_type", "text")
    attached = (message.get("metadata") or {}).get("attachments") or []
    conversation.attachments += [a["name"] for a in attached if isinstance(a, dict) and isinstance(a.get("name"), str)]
    if content_type in REASONING:
        thinking = _reasoning(content)
        if thinking:
            conversation.add_thinking(thinking)
        return
    if content_type in ("text", "multimodal_text"):
        text = "\n".join(filter(None, (_part(part, conversation) for part in content.get("parts") or [])))
    else:
        text = "\n\n".join(content[key] for key in TEXT_FIELDS if isinstance(content.get(key), str) and content[key])
        text = text or placeholder(content_type, conversation.dropped)
    recipient = message.get("recipient", "all")
    if role == "assistant" and recipient not in (None, "all") and text:
        turn: dict = {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": None, "function": {"name": recipient, "arguments": text}}],
        }
    elif text:
        turn = {"role": role, "content": text} | ({"name": author["name"]} if author.get("name") else {})
    else:
        return
    conversation.add(turn, where)


def _reasoning(content: dict) -> str:
    """A thoughts node's thoughts (each a heading and a body), or the text of a reasoning recap;
    some exports hold either in "parts"."""
    thoughts = content.get("thoughts") or []
    if not isinstance(thoughts, list) or not all(isinstance(t, dict) for t in thoughts):
        raise Invalid(
            f'"thoughts" must be a list of objects with "summary" and "content", not {kind(thoughts)}', content
        )
    texts = ["\n".join(filter(None, (t.get("summary"), t.get("content")))) for t in thoughts]
    texts += [part for part in content.get("parts") or [] if isinstance(part, str)]
    texts.append(content["content"] if isinstance(content.get("content"), str) else "")
    return "\n\n".join(filter(None, texts))


def _part(part, conversation: Conversation) -> str:
    if isinstance(part, str):
        return part
    if isinstance(part, dict) and isinstance(part.get("text"), str):  # an audio transcription
        return part["text"]
    content_type = part.get("content_type", "part") if isinstance(part, dict) else kind(part)
    kind_name = "image" if "image" in content_type else "audio" if "audio" in content_type else content_type
    return placeholder(kind_name, conversation.dropped)


def register(add) -> None:
    add(ChatGPT())

"""The Claude.ai data export (``conversations.json``): a list of conversations, each with its
``chat_messages``. A message's ``content`` blocks are what the app showed; its ``text`` is the
same text flattened (thinking and answer run together), so it is read only where there are no
blocks (exports before 2025). Tool calls and their results sit inside the assistant's message
in the order they happened, so the message is cut at each result. The text of an attached
document (``extracted_content``) is what the model read with the prompt: it opens the user's
turn; a file the model saw but the export does not hold is a counted placeholder, and the
names go in the ``attachments`` side field. Where messages link to a parent, each leaf is a
session, the current leaf's first. A conversation the app has not named (``"name": ""``) is
titled by its first prompt; it was said from ``created_at`` to ``updated_at``.
"""

from __future__ import annotations

from kvdb.transcripts.formats.base import Format
from kvdb.transcripts.messages import Conversation, Invalid, kind, placeholder
from kvdb.transcripts.sessions import Transcript, chat, first_prompt, tree_paths
from kvdb.transcripts.stamps import said

SENDERS = {"human": "user", "assistant": "assistant"}
NO_TEXT = ("token_budget",)  # blocks that hold no text of the conversation (a counter)


class ClaudeAi(Format):
    name = "claude-ai"
    reads = (
        "the Claude.ai data export's conversations.json: "
        '[{"uuid", "name", "chat_messages": [{"sender", "text", "content"}]}]'
    )
    example = (
        '[{"uuid": "c1", "name": "Greeting", "summary": "", "chat_messages": [\n'
        '  {"uuid": "m1", "sender": "human", "text": "Hi", "content": [{"type": "text", "text": "Hi"}], '
        '"attachments": [], "files": []},\n'
        '  {"uuid": "m2", "sender": "assistant", "text": "Hello!", "content": [{"type": "text", "text": "Hello!"}], '
        '"attachments": [], "files": []}]}]\n'
    )
    marks = ("uuid", "name", "chat_messages", "account")

    def claims(self, obj) -> bool:
        return isinstance(obj, dict) and isinstance(obj.get("chat_messages"), list)

    def read(self, obj: dict, name: str, source: str) -> list[Transcript]:
        messages = obj["chat_messages"]
        if not all(isinstance(m, dict) for m in messages):
            raise Invalid('"chat_messages" must be a list of message objects', obj)
        if not messages:
            raise Invalid("the conversation holds no messages", obj)
        by_id = {str(m.get("uuid", index)): m for index, m in enumerate(messages)}
        if any("parent_message_uuid" in m for m in messages):
            parents = {key: m.get("parent_message_uuid") for key, m in by_id.items()}
            paths = tree_paths(parents, obj.get("current_leaf_message_uuid"))
        else:
            paths = [list(by_id)]
        title = str(obj.get("name") or obj.get("uuid") or name)  # a conversation the app has not named has ""
        metadata: dict[str, object] = {"format": self.name}
        if obj.get("uuid") is not None:
            metadata["id"] = obj["uuid"]
        metadata |= said(obj.get("created_at"), obj.get("updated_at"))
        summary = obj.get("summary")
        sessions = []
        for branch, path in enumerate(paths, start=1):
            conversation, attachments = Conversation(obj), list[str]()
            for key in path:
                for turn in _turns(by_id[key], conversation, attachments):
                    conversation.add(turn, f"chat_messages[{key!r}]: ")
            side = {
                "attachments": attachments,
                "summaries": [summary] if isinstance(summary, str) and summary and branch == 1 else [],
            }
            extra = {"branch": branch} if branch > 1 else {}
            prompt = None if obj.get("name") else first_prompt(_typed(by_id[key]) for key in path)
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


def _turns(message: dict, conversation: Conversation, attachments: list[str]) -> list[dict]:
    """A message as Anthropic-shaped messages: the assistant's cut where a tool's results come."""
    sender = message.get("sender")
    if sender not in SENDERS:
        raise Invalid(f'a message\'s "sender" must be "human" or "assistant", not {sender!r}', message)
    role = SENDERS[sender]
    content = message.get("content")
    if isinstance(content, list) and content:
        blocks = [_block(block) for block in content if not (isinstance(block, dict) and block.get("type") in NO_TEXT)]
    elif isinstance(message.get("text"), str):
        blocks = [{"type": "text", "text": message["text"]}]
    else:
        raise Invalid('a message needs "content" blocks or a "text" string', message)
    documents = []
    for attachment in _list(message, "attachments"):
        attachments.append(str(attachment.get("file_name", "")))
        if isinstance(attachment.get("extracted_content"), str):
            documents.append({"type": "text", "text": attachment["extracted_content"]})
    for file in _list(message, "files"):
        attachments.append(str(file.get("file_name", "")))
        documents.append({"type": "text", "text": placeholder("file", conversation.dropped)})
    turns: list[dict] = []
    own: list = []  # the sender's blocks since the last results
    results: list = []  # tool results since the sender's last blocks
    for block in documents + blocks:
        if role == "assistant" and isinstance(block, dict) and block.get("type") == "tool_result":
            if own:
                turns.append({"role": role, "content": own})
                own = []
            results.append(block)
        else:
            if results:
                turns.append({"role": "user", "content": results})
                results = []
            own.append(block)
    if own or not (turns or results):
        turns.append({"role": role, "content": own})
    if results:
        turns.append({"role": "user", "content": results})
    return turns


def _typed(message: dict) -> dict:
    """A message's own text, without the documents attached to it that open the turn the model read."""
    content = message.get("content")
    blocks = content if isinstance(content, list) and content else [{"type": "text", "text": message.get("text")}]
    texts = [
        b["text"] for b in blocks if isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)
    ]
    return {"role": SENDERS.get(str(message.get("sender")), ""), "content": "\n".join(texts)}


def _block(block):
    """Thinking with the headlines the app showed for it; a tool result's found pages as text."""
    if not isinstance(block, dict):
        return block  # Conversation names what is wrong with it
    if block.get("type") == "thinking":
        summaries = [
            s["summary"]
            for s in block.get("summaries") or ()
            if isinstance(s, dict) and isinstance(s.get("summary"), str)
        ]
        thinking = block.get("thinking") if isinstance(block.get("thinking"), str) else ""
        return {"type": "thinking", "thinking": "\n".join(filter(None, [*summaries, thinking]))}
    if block.get("type") == "tool_result" and isinstance(block.get("content"), list):
        return dict(block, content=[_found(item) for item in block["content"]])
    return block


def _found(item):
    if isinstance(item, dict) and item.get("type") == "knowledge":
        return {"type": "text", "text": "\n".join(str(item[key]) for key in ("title", "url", "text") if item.get(key))}
    return item


def _list(message: dict, key: str) -> list[dict]:
    value = message.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise Invalid(f'a message\'s "{key}" must be a list of objects, not {kind(value)}', message)
    return value


def register(add) -> None:
    add(ClaudeAi())

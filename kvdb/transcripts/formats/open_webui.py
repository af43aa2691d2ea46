"""Open WebUI chats: a chat object (``{"title", "history": {"messages": {id: message},
"currentId"}, "messages"}``, what "Export chat" writes) or the "Export All Chats" rows that
hold one under ``"chat"``. ``history`` is the tree of every message; ``messages`` is a copy of
the shown branch, read only where a chat has no history. The session follows ``currentId``;
a regenerated reply not taken is an ``alternatives`` side field, and any other leaf (an edited
prompt) a session of its own, ``[branch N]``. ``content`` is kept as the app stored it, the
``<details>`` blocks of reasoning and tool calls included: they are the text the user saw. The
chat's own ``"id"`` is often ``""`` (the row holds the real one) and names nothing. A chat
without a title, or with the app's placeholder ("New Chat"), is titled by its first prompt. It
was said from the first to the last of the row's ``created_at`` and ``updated_at``, the chat's
``timestamp`` and its messages' (seconds or milliseconds since the epoch).
"""

from __future__ import annotations

from kvdb.transcripts.formats.base import Format
from kvdb.transcripts.messages import Conversation, Invalid, kind
from kvdb.transcripts.sessions import Transcript, alternative_replies, chat, first_prompt, object_at, tree_paths
from kvdb.transcripts.stamps import said

DEFAULT_TITLE = "New Chat"  # what the app calls a chat it has not titled


class OpenWebUI(Format):
    name = "open-webui"
    reads = (
        'Open WebUI chat exports: {"title", "chat": {"history": {"messages": {id: {"parentId", "role", "content"}}, '
        '"currentId"}}}, or a list'
    )
    example = (
        '[{"id": "c1", "title": "Greeting", "chat": {"id": "", "title": "Greeting", '
        '"history": {"currentId": "b", "messages": {\n'
        '  "a": {"id": "a", "parentId": null, "childrenIds": ["b"], "role": "user", "content": "Hi"},\n'
        '  "b": {"id": "b", "parentId": "a", "childrenIds": [], "role": "assistant", "content": "Hello!"}}}}}]\n'
    )
    marks = ("id", "title", "chat", "history", "currentId")

    def claims(self, obj) -> bool:
        if not isinstance(obj, dict):
            return False
        return "messages" in object_at(object_at(obj, "chat") or obj, "history")

    def read(self, obj: dict, name: str, source: str) -> list[Transcript]:
        held = obj["chat"] if isinstance(obj.get("chat"), dict) else obj
        history = held["history"]
        nodes = history["messages"]
        if not isinstance(nodes, dict) or not all(isinstance(node, dict) for node in nodes.values()):
            raise Invalid(f'"history.messages" must be an object of messages, not {kind(nodes)}', history)
        if nodes:
            parents = {key: node.get("parentId") for key, node in nodes.items()}
            paths = tree_paths(parents, history.get("currentId"))
        else:  # a chat made by other tools: the flat list, by position (ids may be missing or "")
            shown = held.get("messages")
            if not isinstance(shown, list) or not shown or not all(isinstance(m, dict) for m in shown):
                raise Invalid("the chat holds no messages", held)
            nodes = dict(enumerate(shown))
            paths = [list(nodes)]
        title = next((t for t in (obj.get("title"), held.get("title")) if isinstance(t, str) and t), None)
        row_id = obj.get("id") if obj is not held else None
        metadata: dict[str, object] = {"format": self.name}
        if row_id:
            metadata["id"] = row_id
        metadata |= said(
            obj.get("created_at"),
            obj.get("updated_at"),
            held.get("timestamp"),
            *(node.get("timestamp") for node in nodes.values()),
        )
        untitled, title = title in (None, DEFAULT_TITLE), title or str(row_id or name)
        other_title = (
            held.get("title") if isinstance(held.get("title"), str) and held["title"] not in ("", title) else None
        )
        branches, alternatives = alternative_replies(paths, lambda key: nodes[key].get("role") == "assistant")
        sessions = []
        for branch, path in enumerate([paths[0], *branches], start=1):
            conversation, attachments, turn_of = Conversation(held), list[str](), dict[str, int]()
            for key in path:
                turn_of[key] = len(conversation)
                conversation.add(_message(nodes[key], attachments), f"history.messages[{key!r}]: ")
            side: dict[str, list] = {"attachments": attachments}
            if branch == 1:
                side["alternatives"] = [
                    {"turn": turn_of[taken], "text": _content(nodes[other])} for taken, other in alternatives
                ]
                side["title"] = [other_title] if other_title else []
            extra = {"branch": branch} if branch > 1 else {}
            prompt = first_prompt(conversation.messages()) if untitled else None
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


def _message(node: dict, attachments: list[str]) -> dict:
    for file in node.get("files") or ():
        if isinstance(file, dict):
            inner = object_at(file, "file")
            attachments.append(str(file.get("name") or inner.get("filename") or file.get("id", "")))
    return {"role": node.get("role"), "content": _content(node)}


def _content(node: dict) -> str:
    content = node.get("content", "")
    if not isinstance(content, str):
        raise Invalid(f'a message\'s "content" must be a string, not {kind(content)}', node)
    return content


def register(add) -> None:
    add(OpenWebUI())

"""A session as the formats hand it over, and what every format module builds one with."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvdb.transcripts.messages import Conversation, Invalid, kind


@dataclass(frozen=True)
class Transcript:
    """One session: either verbatim ``text`` or normalised ``messages`` (the other is None).

    ``dropped`` counts what is kept only as a ``[KIND not archived]`` placeholder, by kind.
    ``metadata["side"]``, where a format sets it, holds the file's text that is no turn the
    model sees, so that ``show --json`` gives back everything the file held. Its keys, each a
    list (``SIDE_FIELDS``): ``title`` (a title that is not the session's name), ``summaries``,
    ``tools`` (the schemas offered to the model, as JSON text), ``alternatives`` (``{"turn",
    "text"}``, and ``"thinking"`` where the reply had its own: replies not taken, such as
    swipes or a rejected answer, ``turn`` the index of the message taken in their place), ``events`` (``{"type",
    "text"}``: hook output, notices, tool output beyond what the model was shown) and
    ``attachments`` (file names)."""

    name: str
    source: str
    text: str | None
    messages: tuple[dict, ...] | None
    metadata: dict
    dropped: dict = field(default_factory=dict)


SIDE_FIELDS = ("title", "summaries", "tools", "alternatives", "events", "attachments")
MEDIA_LISTS = {"images": "image", "videos": "video", "audios": "audio"}
TITLE_CHARS = 80  # a title made from a prompt: a line of a list, ellipsis included
# what a format numbers a file's other sessions by, as it names them ("NAME [branch 2]")
NUMBERED = ("branch", "window")
WRAPPED = re.compile(r"\s*<([A-Za-z][\w.:-]*)(?:\s[^<>]*)?>.*?</\1\s*>", re.DOTALL)  # a block a harness wraps in a tag
PLACEHOLDER = re.compile(r"\[[^\[\]\n]{1,40} not archived\]")
UNTITLED = "Untitled"  # a session without a word of text to be titled by (an export cut to its ids): still no bare id


def chat(
    name: str,
    source: str,
    conversation: Conversation,
    metadata: dict,
    side: dict | None = None,
    title: str | None = None,
) -> Transcript:
    """``side``: the session's side fields; empty lists are left out. ``title``: what lists show
    where the name is not it (an id, a file the tool named), kept as ``metadata["title"]`` with
    the name's ``[branch N]`` or ``[window N]``, so that a file's sessions stay told apart. It is
    kept even where it equals the name (a summary): a conversation is called by the latest title
    its versions record, and a version that records none (a fork ``kvdb serve`` archives) keeps it."""
    kept = {key: list(value) for key, value in (side or {}).items() if value}
    unknown = sorted(set(kept) - set(SIDE_FIELDS))
    if unknown:
        # a format module's bug, not the user's
        raise ValueError(f"unknown side fields {unknown}; known: {SIDE_FIELDS}")
    if title is not None:
        title += "".join(
            f" [{key} {metadata[key]}]" for key in NUMBERED if isinstance(metadata.get(key), int) and metadata[key] > 1
        )
        metadata = dict(metadata, title=title)
    return Transcript(
        name,
        source,
        None,
        conversation.messages(),
        dict(metadata, side=kept) if kept else metadata,
        dict(conversation.dropped),
    )


def shortened(text: str, limit: int = TITLE_CHARS) -> str:
    """``text`` on one line, cut on a word boundary to at most ``limit`` characters with an
    ellipsis; a text with no space in reach (Chinese, a long path) is cut where the limit falls."""
    flat = " ".join(text.split())
    if len(flat) <= limit:
        return flat
    cut = flat[: limit - 1]
    space = cut.rfind(" ")
    return (cut[:space] if space >= limit // 2 else cut).rstrip(" ,.;:-") + "…"


def first_prompt(messages: Iterable[dict], injected: tuple[str, ...] = ()) -> str:
    """The first thing the user typed, shortened (``shortened``): a conversation's title where its
    file has none. What the harness wrote in the user's turn is passed over: leading blocks
    wrapped in a tag (``<environment_context>``, ``<command-name>``) and turns that open with one
    of ``injected`` (a format's own preambles); placeholders of what was not archived are left
    out. Without a prompt, the assistant's first words; without any text, ``UNTITLED``."""
    reply = None
    for message in messages:
        text = PLACEHOLDER.sub("", message["content"])
        if message["role"] == "user":
            while (wrapped := WRAPPED.match(text)) is not None:
                text = text[wrapped.end() :]
            if text.strip() and not text.lstrip().startswith(injected):
                return shortened(text)
        elif message["role"] == "assistant" and reply is None and text.strip():
            reply = text
    return UNTITLED if reply is None else shortened(reply)


def add_system(conversation: Conversation, system, key: str, owner) -> None:
    """A top-level system prompt (Anthropic, ShareGPT variants, Responses ``instructions``): a string or text blocks."""
    if system is None:
        return
    if isinstance(system, str):
        conversation.add_text("system", system)
    elif isinstance(system, list):
        conversation.add({"role": "system", "content": system}, f'"{key}": ')
    else:
        raise Invalid(f'"{key}" must be a string or a list of text blocks, not {kind(system)}', owner)


def session_name(obj: dict, default: str) -> str:
    """The "name" (or a "title"), else the "id" (or LMSYS "conversation_id"), else ``default``; null counts as
    absent."""
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


def session_title(obj: dict, default: str, conversation: Conversation) -> str | None:
    """A dataset object's title (``chat``'s): its "name" or "title", else its first prompt where
    the session would be named by its "id" or by its place in the file (``STEM#N``, as the reader
    names each element); a file holding one session is called by its name, which the user gave it."""
    if obj.get("name", obj.get("title")) is not None:
        return None
    if obj.get("id", obj.get("conversation_id")) is None and re.search(r"#\d+$", default) is None:
        return None
    return first_prompt(conversation.messages())


def session_metadata(obj: dict, format_name: str) -> dict:
    """``{"format"}``, with the object's ``"id"`` (or ``"conversation_id"``) where it has one."""
    metadata: dict[str, object] = {"format": format_name}
    session_id = obj.get("id", obj.get("conversation_id"))
    if session_id is not None:
        metadata["id"] = session_id
    return metadata


def tree_paths(parents: dict, current=None) -> list[list]:
    """Each leaf's path from its root in a tree of messages given as ``{id: parent id}`` (a
    parent that is not there, or a cycle, ends a path): the ``current`` leaf's first (else the
    leaf given last's), then the others in the order given. Chat apps keep regenerations and
    edits this way, and the leaf the user last saw is the conversation."""
    has_child = set(parents.values())
    leaves = [node for node in parents if node not in has_child]
    if current not in parents:
        current = leaves[-1] if leaves else next(iter(parents), None)
    paths = []
    for leaf in [current, *(leaf for leaf in leaves if leaf != current)]:
        path, seen, node = [], set(), leaf
        while node in parents and node not in seen:
            seen.add(node)
            path.append(node)
            node = parents[node]
        paths.append(path[::-1])
    return [path for path in paths if path]


def alternative_replies(paths: list[list], is_reply) -> tuple[list[list], list[tuple]]:
    """(the paths after the first that are branches of their own, the ``(reply on the first
    path, reply not taken)`` pairs): a path that leaves the first only for its last message, a
    reply (``is_reply``) in place of the first path's reply, is a regeneration not taken."""
    main, branches, alternatives = paths[0], [], []
    for path in paths[1:]:
        at = len(path) - 1
        if at < len(main) and path[:at] == main[:at] and is_reply(path[at]) and is_reply(main[at]):
            alternatives.append((main[at], path[at]))
        else:
            branches.append(path)
    return branches, alternatives


def object_at(obj: dict, key: str) -> dict:
    """``obj[key]`` where it is an object, else an empty one: for optional parts of an export
    whose absence, or a shape kvdb does not read, leaves no text behind."""
    value = obj.get(key)
    return value if isinstance(value, dict) else {}


def is_session_object(obj) -> bool:
    """An object, and not a message: formats whose marks a message could also carry check this first."""
    return isinstance(obj, dict) and "role" not in obj and "from" not in obj


def tool_schemas(tools, owner) -> list[str]:
    """Tool schemas offered to the model as side ``tools``: a JSON string stays the text it is, a
    list gives one JSON text per schema."""
    if tools is None or tools == "":
        return []
    if isinstance(tools, str):
        return [tools]
    if isinstance(tools, list):
        return [json.dumps(tool, ensure_ascii=False) for tool in tools]
    raise Invalid(f'"tools" must be a JSON string or a list of tool schemas, not {kind(tools)}', owner)


def dataset_side(obj: dict, conversation: Conversation) -> dict:
    """What a training set (LLaMA-Factory and friends) holds beside its turns: the tool schemas,
    and the media files that ``<image>``-style markers in the text stand for (counted as dropped)."""
    for key, media_kind in MEDIA_LISTS.items():
        conversation.add_media(media_kind, obj.get(key), key)
    return {"tools": tool_schemas(obj.get("tools"), obj), "attachments": conversation.attachments}


def strings_under(value, keeps, key: str | None = None):
    """(key, string) for each non-blank string whose key ``keeps(key)`` accepts, however deep in
    ``value`` (a list's items are under the list's key): the text of a record whose layout
    changes from version to version, such as an agent's notices."""
    if isinstance(value, str):
        if key is not None and value.strip() and keeps(key):
            yield key, value
    elif isinstance(value, list):
        for item in value:
            yield from strings_under(item, keeps, key)
    elif isinstance(value, dict):
        for inner, item in value.items():
            yield from strings_under(item, keeps, str(inner))

"""Exchanges an upstream server answered (``kvdb serve --upstream``), archived off the response path.

The HTTP layer forwards a completion request to the upstream and sends its reply back as it came;
once the reply's last bytes are on their way, it hands the request's body and the reply's bytes
(a JSON object, or the event stream) to ``Relay.submit``, which only queues them. A thread of
the relay's own reads each exchange (the messages or the prompt, the reply's text and the model
the upstream named), writes it to the serve journal, and hands it to the archiver, which ingests
it as it ingests the server's own exchanges (``archiver.py``): a failed write is logged and the
reply it came from was sent all the same.

Text is archived exactly as it was sent and received, whatever the upstream's tokenizer: the
archive's tokenizer tokenizes it. An upstream that names the archive's own model (as the
archive's ``model_name``) is taken for it (its exchange is archived as the server's own are,
its exact cache kept); any other is recorded with ``"same_model": false``, and no KV of it is
stored (tier K is left out of its tiers, and no exact cache is kept).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvdb.errors import KvdbError
from kvdb.transcripts.sessions import shortened

log = logging.getLogger("kvdb.serve")
EXTENSION = ("name", "conversation")  # the request's ``kvdb`` fields a relayed exchange honours


def title_of(text: str, default: str) -> str:
    """An archived exchange's name: its conversation's first words, cut as an ingested
    transcript's title is (on a word boundary, with an ellipsis where cut)."""
    return shortened(text) or default


@dataclass(frozen=True)
class Relayed:
    """One exchange as it crossed the proxy: the request's JSON body (the ``kvdb`` object
    included), and the reply's bytes: the JSON object, or, ``streamed``, the event stream."""

    chat: bool
    body: dict
    reply: bytes
    streamed: bool


def entry(relayed: Relayed, local_model: str) -> dict | None:
    """The journal entry of ``relayed`` (as ``Engine`` writes its own, with ``upstream``), or
    None where there is nothing to archive: a stream that ended in an error, a prompt that is no
    text. Raises ValueError for a reply that is not the OpenAI API's shape."""
    body, extension = relayed.body, relayed.body.get("kvdb") or {}
    reply, model = _streamed(relayed.reply, relayed.chat) if relayed.streamed else _whole(relayed.reply, relayed.chat)
    if reply is None:
        return None
    model = model or body.get("model") or "unknown"
    upstream = {"model": str(model), "same_model": model == local_model}
    conversation = extension.get("conversation")
    if relayed.chat:
        sent = body.get("messages")
        if not isinstance(sent, list) or not sent:
            return None
        assert isinstance(reply, dict)
        if conversation is None and not any(isinstance(m, dict) and m.get("role") == "assistant" for m in sent):
            # a chat of one turn starts a conversation; a longer one joins the one it extends
            conversation = uuid.uuid4().hex
        users = [_text(m.get("content")) for m in sent if isinstance(m, dict) and m.get("role") == "user"]
        name = extension.get("name") or title_of(
            users[0] if users else _text(sent[0].get("content") if isinstance(sent[0], dict) else ""), "chat"
        )
        return {
            "kind": "messages",
            "content": [*sent, reply],
            "name": name,
            "conversation": conversation,
            "upstream": upstream,
        }
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):  # several prompts, or token ids: no one text to archive
        log.warning("a relayed completion was not archived: its prompt is no single text")
        return None
    assert isinstance(reply, str)
    name = extension.get("name") or title_of(prompt, "completion")
    return {
        "kind": "text",
        "content": prompt + reply,
        "name": name,
        "conversation": conversation or uuid.uuid4().hex,
        "upstream": upstream,
    }


def _whole(reply: bytes, chat: bool) -> tuple[dict | str | None, str | None]:
    """(the first choice's message, or text, and the model) of a reply that is one JSON object."""
    data = json.loads(reply)
    choice = _first_choice(data)
    if choice is None:
        return None, None
    if chat:
        message = choice.get("message")
        if not isinstance(message, dict):
            raise ValueError("a chat reply's choice has no message")
        return {key: value for key, value in message.items() if value is not None} | {"role": "assistant"}, data.get(
            "model"
        )
    return str(choice.get("text") or ""), data.get("model")


def _streamed(reply: bytes, chat: bool) -> tuple[dict | str | None, str | None]:
    """What ``_whole`` gives, from an event stream's ``data:`` lines: the first choice's text
    (and, for a chat, its tool calls) put together; None for a stream that carried an error."""
    text: list[str] = []
    calls: dict[int, dict] = {}
    model = None
    for line in reply.splitlines():
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        chunk = json.loads(data)
        if not isinstance(chunk, dict) or "error" in chunk:
            return None, None
        model = model or chunk.get("model")
        choice = _first_choice(chunk)
        if choice is None:
            continue  # the usage chunk
        if not chat:
            text.append(str(choice.get("text") or ""))
            continue
        delta = choice.get("delta") or {}
        text.append(str(delta.get("content") or ""))
        for call in delta.get("tool_calls") or ():
            held = calls.setdefault(
                call.get("index", len(calls)),
                {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
            )
            held["id"] = held["id"] or call.get("id")
            function = call.get("function") or {}
            held["function"]["name"] += function.get("name") or ""
            held["function"]["arguments"] += function.get("arguments") or ""
    if not chat:
        return "".join(text), model
    message: dict = {"role": "assistant", "content": "".join(text)}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, model


def _first_choice(data) -> dict | None:
    if not isinstance(data, dict) or not isinstance(data.get("choices"), list):
        raise ValueError("a reply with no choices list")
    return next((c for c in data["choices"] if isinstance(c, dict) and c.get("index", 0) == 0), None)


def _text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


class Relay:
    """Relayed exchanges, from a queue to the journal and the archiver, on a thread of its own."""

    def __init__(self, write: Callable[[dict], Path], submit: Callable[[Path], None], local_model: str):
        self._write = write
        self._submit = submit
        self._local_model = local_model
        self._queue: queue.SimpleQueue[Relayed | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="kvdb-relay", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, relayed: Relayed) -> None:
        """Queue ``relayed`` for the journal: no more than a queue's put on the response path."""
        self._queue.put(relayed)

    def stop(self) -> None:
        """Journal every exchange queued, then stop."""
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join()

    def _loop(self) -> None:
        while (relayed := self._queue.get()) is not None:
            self._journal(relayed)

    def _journal(self, relayed: Relayed) -> None:
        try:
            made = entry(relayed, self._local_model)
            if made is not None:
                self._submit(self._write(made))
        # the reply was sent; its exchange is not archived
        except (KvdbError, ValueError, TypeError, AttributeError) as exc:
            log.error("a relayed exchange was not archived: %s", exc)
        except Exception:  # the thread outlives one exchange
            log.exception("a relayed exchange was not archived")

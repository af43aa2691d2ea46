"""Serving the archive's model: OpenAI-style completions that resume from archived caches, and
whose exchanges are archived (``kvdb serve``; the HTTP layer is ``kvdb.server``)."""

from kvdb.serving.engine import Engine
from kvdb.serving.params import Request, Sampling
from kvdb.serving.relay import Relayed
from kvdb.serving.reply import Reply
from kvdb.serving.responses import Chunk, Completion, Embeddings, Header, SessionView

__all__ = [
    "Chunk",
    "Completion",
    "Embeddings",
    "Engine",
    "Header",
    "Relayed",
    "Reply",
    "Request",
    "Sampling",
    "SessionView",
]

"""Transcripts in, sessions out: verbatim text, or chat messages in the shape of every common
export (OpenAI, Anthropic, ChatGPT, agent event logs, ShareGPT, LMSYS, Alpaca), read from
files or given directly. Every problem is a ``TranscriptError`` naming the file and, where
known, the line; indexes in names and messages (``#0``, ``messages[0]``) count from 0, lines
from 1. ``kvdb.model.chat`` renders the messages for a model.
"""

from kvdb.transcripts.files import (
    SUPPORTED_SUFFIXES,
    find_transcript_files,
    iter_transcripts,
    read_transcripts,
    transcript_from_messages,
    transcript_from_text,
)
from kvdb.transcripts.messages import ROLE_ALIASES
from kvdb.transcripts.sessions import Transcript

__all__ = [
    "ROLE_ALIASES",
    "SUPPORTED_SUFFIXES",
    "Transcript",
    "find_transcript_files",
    "iter_transcripts",
    "read_transcripts",
    "transcript_from_messages",
    "transcript_from_text",
]

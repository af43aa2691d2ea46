"""Secrets taken out of a transcript before it is archived (`kvdb ingest --redact`, opt in).

Each match of a known secret pattern becomes the placeholder ``[secret not archived]`` and is
counted in the session's ``dropped``, as the other placeholders are: the archive never holds it,
and the result says how many were taken out. The patterns are the prefixes services give their
keys and tokens, and private-key blocks; a secret of no known shape is not found.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter

from kvdb.transcripts.messages import placeholder
from kvdb.transcripts.sessions import Transcript

SECRETS = re.compile(
    "|".join(
        (
            r"-----BEGIN [A-Z ]*PRIVATE KEY-----[\s\S]*?-----END [A-Z ]*PRIVATE KEY-----",
            r"\bsk-(?:ant-|proj-)?[A-Za-z0-9_-]{20,}",  # OpenAI, Anthropic
            r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b",  # AWS access key ids
            r"\bgh[pousr]_[A-Za-z0-9]{36,}\b|\bgithub_pat_[A-Za-z0-9_]{22,}",  # GitHub
            r"\bglpat-[A-Za-z0-9_-]{20,}",  # GitLab
            r"\bxox[abposr]-[A-Za-z0-9-]{10,}",  # Slack
            r"\bAIza[0-9A-Za-z_-]{35}\b",  # Google API keys
            r"\bhf_[A-Za-z0-9]{30,}\b",  # Hugging Face
            r"\b[Bb][Ee][Aa][Rr][Ee][Rr]\s+[A-Za-z0-9._~+/-]{20,}=*",  # an Authorization header's token
        )
    )
)


def redacted(transcript: Transcript) -> Transcript:
    """The transcript with every secret of a known shape replaced, in its text, its messages
    (every string in them), its side text and its title; counted in ``dropped["secret"]``."""
    counted: Counter = Counter(transcript.dropped)
    found: list[str] = []

    def hidden(match: re.Match) -> str:
        found.append(match.group())
        return placeholder("secret", counted)

    def scrub(value):
        if isinstance(value, str):
            return SECRETS.sub(hidden, value)
        if isinstance(value, dict):
            return {k: scrub(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(scrub(v) for v in value)
        return value

    text = scrub(transcript.text)
    messages = scrub(transcript.messages)
    metadata = (
        dict(transcript.metadata, side=scrub(transcript.metadata["side"]))
        if "side" in transcript.metadata
        else transcript.metadata
    )
    if isinstance(metadata.get("title"), str):
        metadata = dict(metadata, title=_title(metadata["title"], found))
    return dataclasses.replace(transcript, text=text, messages=messages, metadata=metadata, dropped=dict(counted))


def _title(title: str, secrets: list[str]) -> str:
    """A title made from the first prompt holds that prompt's secrets on one line, and where it was
    cut short, perhaps only a secret's start: each goes, uncounted (the turn's own counted it)."""
    shown = placeholder("secret", Counter())
    title = SECRETS.sub(shown, title)
    for secret in sorted({" ".join(s.split()) for s in secrets}, key=len, reverse=True):
        title = title.replace(secret, shown)
        body = title.removesuffix("…")
        if body != title:
            cut = next((k for k in range(min(len(secret), len(body)), 3, -1) if body.endswith(secret[:k])), 0)
            title = body[: len(body) - cut] + shown + "…" if cut else title
    return title

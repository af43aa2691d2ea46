"""When and where an agent log's sessions were said, from its records: not when kvdb read them.

Agent logs stamp their records: Claude Code's events, Codex CLI's envelopes and Gemini CLI's
messages carry an ISO 8601 ``timestamp`` (a Gemini CLI header, ``startTime`` and ``lastUpdated``),
and Claude Code's events the ``cwd`` the agent ran in. A log's sessions get, in their metadata,
``started`` and ``ended`` (the earliest and latest time of the file's records, UTC, ISO 8601)
and, where the format set none, the first ``cwd``: so that listing and search filter a log by
when it was said and the folder it was about, whenever it is ingested.

Exports of chat apps keep their times on the conversation (ChatGPT's ``create_time`` and
``update_time``, Claude.ai's ``created_at`` and ``updated_at``): their formats set the same
``started`` and ``ended`` with ``said``, from whatever shape of time the app writes (``instant``).
"""

from __future__ import annotations

import dataclasses
import datetime as dt

from kvdb.transcripts.formats.base import Log
from kvdb.transcripts.sessions import Transcript

TIME_KEYS = ("timestamp", "startTime", "lastUpdated")


class StampedLog(Log):
    """A format's log, noting the times and the working directory of the records it takes."""

    def __init__(self, inner: Log):
        self._inner = inner
        self.label = inner.label
        self._first: dt.datetime | None = None
        self._last: dt.datetime | None = None
        self._cwd: str | None = None

    def add(self, record, line: int) -> None:
        self._inner.add(record, line)  # a record it refuses leaves no trace here either
        if not isinstance(record, dict):
            return
        for key in TIME_KEYS:
            instant = _instant(record.get(key))
            if instant is not None:
                self._first = instant if self._first is None else min(self._first, instant)
                self._last = instant if self._last is None else max(self._last, instant)
        if self._cwd is None and isinstance(record.get("cwd"), str) and record["cwd"]:
            self._cwd = record["cwd"]

    def sessions(self) -> list[Transcript]:
        return [self._stamped(t) for t in self._inner.sessions()]

    def _stamped(self, transcript: Transcript) -> Transcript:
        added: dict[str, str] = {}
        if self._first is not None and self._last is not None:
            added = {"started": self._first.isoformat(), "ended": self._last.isoformat()}
        if self._cwd is not None:
            added["cwd"] = self._cwd
        added = {k: v for k, v in added.items() if k not in transcript.metadata}  # the format's own say first
        return dataclasses.replace(transcript, metadata=transcript.metadata | added) if added else transcript


def _instant(value) -> dt.datetime | None:
    """A record's time: ISO 8601 only, since a bare number in a log's records may count anything."""
    return instant(value) if isinstance(value, str) else None


def instant(value) -> dt.datetime | None:
    """A time as naive UTC (the archive's rows' convention), in the shapes exports write it: ISO
    8601 (a time without a zone is taken as UTC), seconds or milliseconds since the epoch (a
    number past 1e11 is milliseconds: seconds would be after the year 5000), and a MongoDB
    ``{"$date": ...}`` (Grok). None for anything else, so that a bad time is no time."""
    if isinstance(value, dict):
        value = value.get("$date", value)
        value = value.get("$numberLong", value) if isinstance(value, dict) else value
        value = int(value) if isinstance(value, str) and value.isdigit() else value
    try:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            seconds = value / 1000 if abs(value) > 1e11 else value
            return dt.datetime.fromtimestamp(seconds, dt.UTC).replace(tzinfo=None)
        if not isinstance(value, str) or not value:
            return None
        found = dt.datetime.fromisoformat(value)
        return found.astimezone(dt.UTC).replace(tzinfo=None) if found.tzinfo is not None else found
    except (ValueError, OverflowError, OSError):  # not a time, or one UTC cannot hold (year 1 east of Greenwich)
        return None


def said(*values) -> dict[str, str]:
    """``started`` and ``ended`` (as ``StampedLog`` writes them) of the earliest and the latest of
    ``values`` that are times (``instant``); ``{}`` where none is: a conversation whose export
    has only its start ended when it started, as far as the file says."""
    times = [found for found in map(instant, values) if found is not None]
    return {"started": min(times).isoformat(), "ended": max(times).isoformat()} if times else {}

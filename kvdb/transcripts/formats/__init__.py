"""Export formats: one module each, found through one hook, as ``llm`` finds its plugins.

A module registers its formats by defining ``register(add)`` and calling ``add(SomeFormat())``.
The built-ins in ``BUILT_IN`` do so, and so does every module a package names under the entry
point group ``kvdb.formats``::

    [project.entry-points."kvdb.formats"]
    my_tool = "my_package.kvdb_format"

Formats are asked in order: plugins first (a plugin may claim a shape before a built-in's
broader rule does), then the built-ins, the most particular first: a shape that another's keys
could also describe (a log whose records carry ``"messages"``) is asked before that other.
"""

from __future__ import annotations

import functools
import importlib
from importlib import metadata

from kvdb.errors import FormatPluginError
from kvdb.transcripts.formats.base import Format, Log
from kvdb.transcripts.messages import Invalid, kind
from kvdb.transcripts.sessions import Transcript

GROUP = "kvdb.formats"
BUILT_IN = (
    "kvdb.transcripts.formats.gemini_cli",
    "kvdb.transcripts.formats.codex_cli",
    "kvdb.transcripts.formats.claude_code",
    "kvdb.transcripts.formats.chatgpt",
    "kvdb.transcripts.formats.sillytavern",
    "kvdb.transcripts.formats.claude_ai",
    "kvdb.transcripts.formats.open_webui",
    "kvdb.transcripts.formats.grok",
    "kvdb.transcripts.formats.ai_studio",
    "kvdb.transcripts.formats.messages",
    "kvdb.transcripts.formats.sharegpt",
    "kvdb.transcripts.formats.lmsys",
    "kvdb.transcripts.formats.alpaca",
    "kvdb.transcripts.formats.responses",
)

__all__ = [
    "BUILT_IN",
    "GROUP",
    "Format",
    "Log",
    "log_format",
    "read_session",
    "registered",
    "session_format",
    "unknown_shape",
]


@functools.cache
def registered() -> tuple[Format, ...]:
    """Every format, in the order they are asked."""
    found: list[Format] = []
    for entry in metadata.entry_points(group=GROUP):
        try:
            entry.load().register(found.append)
        except Exception as error:  # a plugin's own bug, named with the package to blame
            raise FormatPluginError(
                f"the format plugin {entry.name!r} ({entry.value}) failed to load: {error}; upgrade or uninstall it"
            ) from error
    for name in BUILT_IN:
        importlib.import_module(name).register(found.append)
    return tuple(found)


def session_format(obj) -> Format | None:
    """The first format that takes ``obj`` as a session object."""
    return next((f for f in registered() if f.claims(obj)), None)


def log_format(record) -> Format | None:
    """The first format whose log a record opens."""
    return next((f for f in registered() if f.opens_log(record)), None)


def read_session(obj, name: str, source: str) -> list[Transcript]:
    """The sessions of one session object, in whatever format it is."""
    found = session_format(obj)
    if found is None:
        raise Invalid(unknown_shape(obj), obj if isinstance(obj, dict) else None)
    return found.read(obj, name, source)


def unknown_shape(obj) -> str:
    """Why no format reads ``obj``, naming the format whose keys it comes closest to."""
    if not isinstance(obj, dict):
        return f"expected a session object (an object in one of the formats `kvdb formats` lists), got {kind(obj)}"
    keys = {str(key) for key in obj}
    shown = ", ".join(f'"{key}"' for key in sorted(keys)[:8]) + (", ..." if len(keys) > 8 else "") if keys else "none"
    overlap, closest = max(
        ((len(keys & set(f.marks)), f) for f in registered() if f.marks), key=lambda pair: pair[0], default=(0, None)
    )
    if closest is None or not overlap:
        return f"an object with keys {shown} is no session of any format kvdb reads (`kvdb formats` lists them)"
    missing = [f'"{mark}"' for mark in closest.marks if mark not in keys]
    lacks = (
        f"whose objects also have {' and '.join(missing)}"
        if missing
        else "whose keys it has, but not in the shape that tool writes them"
    )
    return (
        f"an object with keys {shown} is no session of any format kvdb reads; "
        f"the closest is {closest.name} ({closest.reads}), {lacks}"
    )

"""The most one session may take of a file, checked before the session is read into memory."""

from __future__ import annotations


def too_large(label: str, limit: int) -> str:
    return f"{label} is larger than {_size(limit)}, the most one session may hold; split it into smaller sessions"


def longer_than(text: str, start: int, end: int, limit: int) -> bool:
    """Whether ``text[start:end]`` takes more than ``limit`` bytes of UTF-8 (1 to 4 per character).

    Encoding is only needed when the character count leaves it open.
    """
    chars = end - start
    if chars > limit or 4 * chars <= limit:
        return chars > limit
    return len(text[start:end].encode("utf-8")) > limit


def _size(count: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if count >= 1 << shift and count % (1 << shift) == 0:
            return f"{count >> shift} {unit}"
    return f"{count} byte{'s' * (count != 1)}"

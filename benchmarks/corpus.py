"""Real English text found on this machine (licenses and docs of installed packages), for benchmarks.

Nothing is downloaded: the text comes from files every install of kvdb already has.
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

PATTERNS = ("LICENSE*", "LICENCE*", "COPYING*", "README*", "*.rst")


def real_text(n_chars: int, min_file_chars: int = 2_000) -> str:
    """At least ``n_chars`` of prose (or all there is), from distinct files in a stable order."""
    roots = [Path(sysconfig.get_paths()["purelib"]), Path(sys.base_prefix) / "lib"]
    seen, parts, total = set(), [], 0
    for root in roots:
        for pattern in PATTERNS:
            for path in sorted(root.rglob(pattern)):
                if total >= n_chars:
                    return "".join(parts)
                try:
                    text = path.read_text(encoding="utf-8")
                except (OSError, UnicodeDecodeError):
                    continue
                if len(text) < min_file_chars or text in seen:
                    continue
                seen.add(text)
                parts.append(text)
                total += len(text)
    return "".join(parts)

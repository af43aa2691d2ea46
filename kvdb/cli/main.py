"""`kvdb`: a thin click layer over kvdb.Archive. It parses, calls the library, and formats.

The group and what every command shares are in ``app.py``; the commands are in modules by what
they do (``reading``, ``querying``, ``writing``, ``upkeep``, ``serving``, ``watching``), registered on the group here.
"""

from kvdb.cli import querying, reading, serving, upkeep, watching, writing  # noqa: F401 (each registers its commands on the group)
from kvdb.cli.app import main

__all__ = ["main"]

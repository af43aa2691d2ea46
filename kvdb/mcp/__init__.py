"""`kvdb mcp`: the archive as tools an agent calls over the Model Context Protocol (the official
``mcp`` SDK). Import name ``kvdb.mcp``; it parses, calls the library, and formats, as the CLI
and the HTTP server do: its results are the records' ``to_dict()``."""

from kvdb.mcp.tools import build, make_call

__all__ = ["build", "make_call"]

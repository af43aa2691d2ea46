"""`kvdb serve`'s HTTP layer (import name ``kvdb.server``): it parses requests, calls
``kvdb.serving.Engine``, and sends the records' ``to_dict()`` back. It holds no logic of its own
beyond HTTP: status codes, server-sent events, the API key, the page's files."""

from kvdb.server.app import create_app
from kvdb.server.run import serve

__all__ = ["create_app", "serve"]

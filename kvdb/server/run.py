"""Running the app with uvicorn until SIGINT or SIGTERM. On the signal, replies in progress are
cancelled first (they end at their next token), then uvicorn drains the connections and the
app's lifespan closes the engine: the archiver finishes its entry, the rest of the journal waits
for the next start, and the archive is closed; the process then exits 0."""

from __future__ import annotations

import contextlib
import signal
import threading

import uvicorn
from uvicorn.server import HANDLED_SIGNALS

from kvdb.server.app import create_app
from kvdb.server.upstream import Upstream
from kvdb.serving import Engine

GRACE_SECONDS = 10  # longest uvicorn waits for open connections once told to stop


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine: Engine):
        super().__init__(config)
        self._engine = engine

    def handle_exit(self, sig, frame) -> None:
        self._engine.stop()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        """uvicorn's, but for raising the signal again once shut down: a server stopped by
        SIGINT or SIGTERM has shut down cleanly, and `kvdb serve` exits 0."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def serve(
    engine: Engine,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    upstream: str | None = None,
    upstream_key: str | None = None,
) -> None:
    """``upstream``: the base URL of an OpenAI-compatible API to forward completions to (with
    ``upstream_key``, its API key), archiving each exchange."""
    relay = Upstream(upstream, upstream_key, pass_authorization=api_key is None) if upstream is not None else None
    app = create_app(engine, api_key, upstream=relay)
    config = uvicorn.Config(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=GRACE_SECONDS)
    _Server(config, engine).run()

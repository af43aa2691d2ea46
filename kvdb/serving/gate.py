"""The model's one lock, with a bounded queue in front of it for requests.

Generation and the archiver's model work never run at once (one model, one lock). A request
that finds the model busy waits, but only if fewer than ``size`` others wait already and only
for ``timeout`` seconds; otherwise it is refused with ``Busy`` at once, so a flood of requests
turns into quick refusals instead of unbounded latency and threads.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

from kvdb.errors import Busy


class ModelGate:
    def __init__(self, size: int, timeout: float):
        self.size = size
        self.timeout = timeout
        self._lock = threading.Lock()
        self._waiting = 0
        self._count = threading.Lock()
        self.closed = False

    def admit(self) -> Callable[[], None]:
        """Take the model for a request; returns what lets it go (a plain lock: any thread may)."""
        if self.closed:
            raise Busy("the server is shutting down; retry when it is back")
        if self._lock.acquire(blocking=False):
            return self._lock.release
        with self._count:
            if self._waiting >= self.size:
                raise Busy(f"the model is busy and {self._waiting} requests wait for it already (the queue holds {self.size}); retry later, or start the server with a larger --queue")
            self._waiting += 1
        try:
            taken = self._lock.acquire(timeout=self.timeout)
        finally:
            with self._count:
                self._waiting -= 1
        if not taken:
            raise Busy(f"waited {self.timeout:g} s for the model, which is busy; retry later, or start the server with a larger --queue-timeout")
        if self.closed:
            self._lock.release()
            raise Busy("the server is shutting down; retry when it is back")
        return self._lock.release

    @contextlib.contextmanager
    def admitted(self):
        release = self.admit()
        try:
            yield
        finally:
            release()

    @contextlib.contextmanager
    def held(self):
        """The model for the archiver: it waits as long as it takes, outside the queue."""
        with self._lock:
            yield

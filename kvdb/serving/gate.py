"""The model's one lock, with a bounded queue in front of it for requests.

Generation and the archiver's model work never run at once (one model, one lock). A request
that finds the model busy waits, but only if fewer than ``size`` others wait already and only
for ``timeout`` seconds; otherwise it is refused with ``Busy`` at once, so a flood of requests
turns into quick refusals instead of unbounded latency and threads. The archiver gives way to
requests: its work is durable in the journal already, and the next turn of a conversation
usually follows its reply at once. A request relayed to an upstream server (``kvdb serve
--upstream``) takes no lock, but the archiver gives way to it too, as to a request of the model:
on a machine the upstream shares, the archive's work would slow its replies.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

from kvdb.errors import Busy

IDLE_SECONDS = 0.5  # background work waits until no request has used or waited for the model this long


class ModelGate:
    def __init__(self, size: int, timeout: float):
        self.size = size
        self.timeout = timeout
        self._lock = threading.Lock()
        self._waiting = 0
        self._count = threading.Lock()
        self._released = float("-inf")  # when a request last let the model go (monotonic)
        self._relayed = 0  # requests relayed to an upstream in flight
        self.closed = False

    def admit(self) -> Callable[[], None]:
        """Take the model for a request; returns what lets it go (a plain lock: any thread may)."""
        if self.closed:
            raise Busy("the server is shutting down; retry when it is back")
        if self._lock.acquire(blocking=False):
            return self._release
        with self._count:
            if self._waiting >= self.size:
                raise Busy(
                    f"the model is busy and {self._waiting} requests wait for it already "
                    f"(the queue holds {self.size}); retry later, or start the server with a larger --queue"
                )
            self._waiting += 1
        try:
            taken = self._lock.acquire(timeout=self.timeout)
        finally:
            with self._count:
                self._waiting -= 1
        if not taken:
            raise Busy(
                f"waited {self.timeout:g} s for the model, which is busy; "
                "retry later, or start the server with a larger --queue-timeout"
            )
        if self.closed:
            self._lock.release()
            raise Busy("the server is shutting down; retry when it is back")
        return self._release

    def _release(self) -> None:
        self._released = time.monotonic()
        self._lock.release()

    def relaying(self) -> Callable[[], None]:
        """Count a request relayed to an upstream as a request of the model, for the background
        work alone (it never waits); returns what ends it (once, from any thread)."""
        with self._count:
            self._relayed += 1
        ended = threading.Event()

        def end() -> None:
            if ended.is_set():
                return
            ended.set()
            with self._count:
                self._relayed -= 1
            self._released = time.monotonic()

        return end

    @contextlib.contextmanager
    def admitted(self):
        release = self.admit()
        try:
            yield
        finally:
            release()

    @contextlib.contextmanager
    def idle(self, idle: float = IDLE_SECONDS):
        """Entered once no request has held or waited for the model for ``idle`` seconds, without
        holding it: for background work that runs the model too little to keep requests out."""
        with self.held(idle):
            pass
        yield

    @contextlib.contextmanager
    def held(self, idle: float = IDLE_SECONDS):
        """The model for the archiver, outside the queue: taken once no request has held or
        waited for it for ``idle`` seconds, however long that takes."""
        while True:
            self._lock.acquire()
            if self._waiting == 0 and self._relayed == 0 and time.monotonic() - self._released >= idle:
                break
            self._lock.release()
            time.sleep(idle / 10)
        try:
            yield
        finally:
            self._lock.release()

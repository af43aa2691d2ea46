"""A reply computed on a thread of its own, read as text deltas, then as its record.

The thread, not the reader, holds the model while it works: a reader that goes away (a client
that disconnects mid-stream, a response never started) cannot keep the model. It cancels, and
the thread lets the model go at the next token.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator

from kvdb.serving.generation import Delta
from kvdb.serving.responses import Completion, Header

# (emit a delta, cancelled?) -> the completion
Work = Callable[[Callable[[Delta], None], Callable[[], bool]], Completion]


class Reply:
    def __init__(self, header: Header, work: Work):
        self.header = header
        self.completion: Completion | None = None
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._cancelled = threading.Event()
        threading.Thread(target=self._run, args=(work,), name="kvdb-generate", daemon=True).start()

    def _run(self, work: Work) -> None:
        try:
            self._events.put(("done", work(lambda text: self._events.put(("delta", text)), self._cancelled.is_set)))
        except BaseException as exc:  # noqa: BLE001 - handed to the reader, which raises it
            self._events.put(("error", exc))

    def deltas(self) -> Iterator[Delta]:
        """The reply's text (and its tokens' log-probabilities, when asked for) as it comes; ``completion`` is
        set once it ends. Raises what the work raised."""
        while self.completion is None:
            kind, value = self._events.get()
            if kind == "error":
                raise value
            if kind == "done":
                self.completion = value
            else:
                yield value

    def result(self) -> Completion:
        for _ in self.deltas():
            pass
        assert self.completion is not None  # deltas() ends only once it is set
        return self.completion

    def cancel(self) -> None:
        self._cancelled.set()

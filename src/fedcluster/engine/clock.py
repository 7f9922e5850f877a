"""Wall-clock time spent in client computations (the ``client_seconds`` column)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class ClientClock:
    """Mixin for a backend: ``seconds`` accumulates the time spent inside :meth:`timed`."""

    seconds: float = 0.0

    @contextmanager
    def timed(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - start

"""Wall-clock time spent in client computations (the ``client_seconds`` column)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class ClientClock:
    """Mixin for a backend: ``seconds`` accumulates the time spent inside :meth:`timed`
    (nested blocks count once: only the outermost adds its time)."""

    seconds: float = 0.0
    _timing_depth: int = 0

    @contextmanager
    def timed(self) -> Iterator[None]:
        start = time.perf_counter()
        self._timing_depth += 1
        try:
            yield
        finally:
            self._timing_depth -= 1
            if self._timing_depth == 0:
                self.seconds += time.perf_counter() - start

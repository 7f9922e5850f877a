"""Loggers as round-loop callbacks (:mod:`fedcluster.experiment.callbacks`): TensorBoard, or your
own.

:class:`TensorBoardLogger` writes each round's numeric ``metrics.csv``
columns as scalars, one TensorBoard run per job (``<dir>/<label>-seed<s>``),
so ``tensorboard --logdir DIR`` overlays the algorithms of a comparison. It
needs the optional ``tensorboard`` package (``pip install
'fedcluster[tensorboard]'``), imported only when a logger is made. The same
``Callback`` interface attaches Weights & Biases or MLflow from Python;
docs/reports.md has a ten-line example.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from fedcluster.errors import FedclusterError
from fedcluster.experiment.callbacks import Callback, JobInfo

_SKIP = ("round", "seed", "algorithm")


def numeric_metrics(row: dict[str, Any]) -> dict[str, float]:
    """The row's finite numeric values (labels, seed and round left out)."""
    out = {}
    for key, value in row.items():
        if key in _SKIP or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if math.isfinite(value):
            out[key] = float(value)
    return out


class TensorBoardLogger(Callback):
    """Each job's per-round metrics as TensorBoard scalars under ``log_dir``."""

    def __init__(self, log_dir: str | Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise FedclusterError(
                f"--tensorboard needs TensorBoard: pip install 'fedcluster[tensorboard]' ({exc})"
            ) from None
        self._writer_class = SummaryWriter
        self.log_dir = Path(log_dir)
        self._writers: dict[tuple[str, int], Any] = {}

    def _writer(self, job: JobInfo) -> Any:
        key = (job.label, job.seed)
        if key not in self._writers:
            safe = re.sub(r"[^A-Za-z0-9_.=,-]+", "_", job.label)
            self._writers[key] = self._writer_class(str(self.log_dir / f"{safe}-seed{job.seed}"))
        return self._writers[key]

    def on_round_end(self, job: JobInfo, rnd: int, row: dict[str, Any], state: Any) -> None:
        writer = self._writer(job)
        for name, value in numeric_metrics(row).items():
            writer.add_scalar(name, value, rnd)
        writer.flush()

    def close(self) -> None:
        """Close every job's event file."""
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()

    def on_run_end(self, run: Any, results: Any) -> None:
        self.close()

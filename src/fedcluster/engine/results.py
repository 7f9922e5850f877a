"""What client computations return, on any backend."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class TrainResult:
    """Rows after local training [n, d], mean batch loss [n], steps taken [n]."""

    rows: torch.Tensor
    loss: torch.Tensor
    steps: torch.Tensor


@dataclass
class EvalResult:
    """Per-client correct predictions, sample counts and summed loss."""

    correct: np.ndarray
    count: np.ndarray
    loss_sum: np.ndarray
    clients: np.ndarray | None = None
    """The clients the entries belong to, where known (a rejected evaluation
    reply leaves its client out)."""

    @property
    def accuracy(self) -> np.ndarray:
        return self.correct / np.maximum(self.count, 1)

"""Where the simulator computes: the ``device`` setting (``cpu``, ``cuda``, ``auto``).

DESIGN "Speed": the batched client computations are matrix products, which a
GPU runs far faster than two CPU cores. With ``device: cuda`` the simulator
keeps the packed federation, the Gram cache and the models it trains on the
GPU and runs the MLP kernel and the generic autograd path there; the server
side (aggregation, clustering) keeps its [K, d] rows on the CPU and the
simulator moves rows across at its boundary. Random streams stay on CPU
generators (:mod:`fedcluster.rng`): a CUDA generator draws different numbers
from the same seed, and the batch plans, initial models and noise must be
the same on every device so that a GPU run equals the CPU run to float
rounding. ``auto`` is ``cuda`` when a GPU is visible, else ``cpu``.
"""

from __future__ import annotations

import torch

from fedcluster.errors import ConfigError

DEVICES = ("cpu", "cuda", "auto")


def resolve_device(name: str | torch.device | None) -> torch.device:
    """The ``torch.device`` for a ``device`` setting; a clear error when CUDA is asked for
    but absent."""
    if isinstance(name, torch.device):
        name = name.type
    name = "cpu" if name is None else str(name)
    if name not in DEVICES and not name.startswith("cuda:"):
        raise ConfigError(f"device: must be one of {list(DEVICES)}, got {name!r}")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(
            f"device: {name!r} was asked for but PyTorch sees no CUDA GPU on this machine; "
            "use device: cpu or device: auto"
        )
    return torch.device(name)

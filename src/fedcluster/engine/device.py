"""Where the simulator computes: the ``device`` setting (``cpu``, ``cuda``, ``cuda:N``,
``mps``, ``auto``).

DESIGN "Speed": the batched client computations are matrix products, which a
GPU runs far faster than two CPU cores. With ``device: cuda`` the simulator
keeps the packed federation, the Gram cache and the models it trains on the
GPU and runs the MLP kernel and the generic autograd path there; the server
side (aggregation, clustering) keeps its [K, d] rows on the CPU and the
simulator moves rows across at its boundary. Random streams stay on CPU
generators (:mod:`fedcluster.rng`): a CUDA generator draws different numbers
from the same seed, and the batch plans, initial models and noise must be
the same on every device so that a GPU run equals the CPU run to float
rounding. ``cuda:N`` picks the N-th visible GPU, ``mps`` Apple's Metal GPU
(PyTorch's ``mps`` backend), ``auto`` is ``cuda`` when a GPU is visible, else
``cpu``. A device this machine does not have is a one-line error before the
run directory is created.
"""

from __future__ import annotations

import torch

from fedcluster.errors import ConfigError

DEVICES = ("cpu", "cuda", "cuda:N", "mps", "auto")


def resolve_device(name: str | torch.device | None) -> torch.device:
    """The ``torch.device`` for a ``device`` setting; a one-line error naming the setting
    when that device is not available on this machine."""
    name = "cpu" if name is None else str(name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"device: must be one of {list(DEVICES)}, got {name!r}")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(
                f"device: {name!r} was asked for but PyTorch sees no CUDA GPU on this machine; "
                "use device: cpu or device: auto (README, Install: the GPU build of torch)"
            )
        if device.index is not None and device.index >= count:
            raise ConfigError(
                f"device: {name!r} was asked for but PyTorch sees {count} CUDA GPU(s) on this "
                f"machine (cuda:0 .. cuda:{count - 1})"
            )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(
            f"device: {name!r} was asked for but PyTorch's MPS backend is not available on "
            "this machine (it needs an Apple-silicon Mac and a macOS build of torch)"
        )
    return device

"""Matrix products in bfloat16: the ``precision`` setting (``fp32``, ``bf16``).

Mixed precision as ``torch.autocast`` does it (Micikevicius et al., "Mixed
precision training", ICLR 2018, with bfloat16 in place of float16, so no loss
scaling): the operands of every matrix product are rounded to bfloat16, the
product accumulates in float32 (oneDNN/MKL on CPUs, tensor cores on GPUs) and
its result is rounded to bfloat16; everything else -- the parameter rows (the
"master weights"), the SGD updates they receive, biases, activations between
products, the softmax and the losses -- stays float32. On CPUs with native
bfloat16 arithmetic (AVX512-BF16 or AMX) and on GPUs the products run about
twice as fast; elsewhere bfloat16 is emulated and slower than float32, so
``bf16`` falls back to float32 there with one warning.

The default is ``fp32`` (identical to runs before this setting existed).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from fedcluster.errors import ConfigError

PRECISIONS = ("fp32", "bf16")

log = logging.getLogger(__name__)

_warned: set[str] = set()

_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_has_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether the CPU has native bfloat16 arithmetic (an AVX512-BF16 or AMX flag
    in ``/proc/cpuinfo``; ``False`` where that file does not exist)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            return any(flag in line.split() for flag in _CPU_FLAGS)
    return False


def bf16_supported(device: torch.device) -> bool:
    """Whether ``device`` runs bfloat16 products natively."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and cpu_has_bf16()


def resolve_precision(name: str, device: torch.device) -> torch.dtype | None:
    """The dtype of matrix products for a ``precision`` setting on ``device``:
    ``None`` for float32, ``torch.bfloat16`` for ``bf16`` where the device runs it
    natively; elsewhere ``None`` and (once per process) one warning line."""
    if name not in PRECISIONS:
        raise ConfigError(f"precision: must be one of {list(PRECISIONS)}, got {name!r}")
    if name == "fp32":
        return None
    if not bf16_supported(device):
        if str(device) in _warned:  # one line per process and device, not one per job
            return None
        _warned.add(str(device))
        log.warning(
            "precision: bf16 asked for, but %s has no native bfloat16 arithmetic "
            "(AVX512-BF16/AMX or a GPU); running fp32",
            "this CPU" if device.type == "cpu" else str(device),
        )
        return None
    return torch.bfloat16


@contextmanager
def float32_products_in(low: torch.dtype | None) -> Iterator[None]:
    """While the block runs, float32 matrix products on the CPU take ``low``
    (bfloat16) operands inside oneDNN and accumulate and return float32 (oneDNN's
    ``fpmath_mode``, :data:`torch.backends.mkldnn.matmul.fp32_precision`): the
    products of bfloat16 arithmetic without a cast kernel before or after them.
    Nothing changes for ``low=None``. The setting is process-wide: enter it in the
    thread that starts the workers, around all of them."""
    if low is None:
        yield
        return
    matmul = getattr(torch.backends.mkldnn, "matmul")  # noqa: B009 -- not in torch's stubs
    before = matmul.fp32_precision
    matmul.fp32_precision = "bf16"
    try:
        yield
    finally:
        matmul.fp32_precision = before


def fast_log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """``log_softmax`` over the last dimension as (z − max) − log Σ exp(z − max), in
    four element-wise passes, for bf16 runs (float32 runs keep PyTorch's kernel).

    The same function as ``torch.log_softmax``, rounded differently (within a few
    float32 ulps); about 3.5× faster over IFCA's 10 classes on the CPU (33 against
    121 µs for [8, 100, 10], 0.3 against 1.2 ms for [8,192, 10], one thread), where
    PyTorch's kernel is slow on a short last dimension.
    """
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    return shifted.sub_(shifted.exp().sum(dim=-1, keepdim=True).log_())

"""Module modes, seeded training randomness and the loss of client computations.

PyTorch's module convention: a training step runs the module in ``train()``
(Dropout active, BatchNorm normalising with the batch's statistics and
updating its running ones), every other computation in ``eval()`` (test
accuracy, the loss queries of IFCA's and JGL's cluster choice, FeSEM's and
CFLGT's forward passes). The simulator keeps its template module in ``eval()``
and switches to ``train()`` only inside :func:`module_mode` around a
client's local training.

Randomness inside a training step (Dropout's masks, any ``torch.rand``-like
call of a user's ``forward``) draws from a generator derived from
``(seed, "dropout/<purpose>", round, client)`` through
:class:`SeededRandomness`, a ``TorchFunctionMode`` that is thread-local: every
worker thread of the simulator and every Flower node draws the same masks for
the same client, whatever the order in which clients run. Inside
``vmap`` (DP-SGD's per-sample gradients) each sample draws its own mask.
``alpha_dropout`` and ``feature_alpha_dropout`` are refused (no seeded form).

The loss of every computation is a :data:`LossFn` ``(logits, targets) ->
mean loss`` (default cross-entropy, ``F.cross_entropy``); ``train.loss``
names another by import path (``"package.module:function"``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from fedcluster.config.plugins import import_object
from fedcluster.errors import ConfigError, FedclusterError
from fedcluster.models import module_mode

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``(logits [B, C], targets [B]) -> mean loss`` (a scalar), like ``F.cross_entropy``."""

DEFAULT_LOSS = "cross_entropy"
GIVEN_LOSS = "given:"
"""Prefix of ``train.loss`` for a loss function passed from Python that cannot be
imported by path (:func:`fedcluster.experiment.rebuild.record_loss`)."""


def resolve_loss(name: str) -> LossFn | None:
    """The loss named ``name``: ``None`` for the default cross-entropy (the MLP
    kernel's own), else the callable at import path ``"package.module:function"``."""
    if name == DEFAULT_LOSS:
        return None
    if name.startswith(GIVEN_LOSS):
        raise ConfigError(
            f"train.loss: the run was started from Python with the loss function "
            f"{name.removeprefix(GIVEN_LOSS)}, which cannot be imported; resume it from "
            "Python with fedcluster.resume(run_dir, loss=...)"
        )
    try:
        loss = import_object(name, "loss")
    except ConfigError as exc:
        raise ConfigError(f"train.loss: {exc}") from None
    if not callable(loss):
        raise ConfigError(f"train.loss: {name!r} is {type(loss).__name__}, not a function")
    return loss


def loss_or_default(loss: LossFn | None) -> LossFn:
    """``loss`` under its contract (:class:`CheckedLoss`), or cross-entropy where it is
    ``None``."""
    return F.cross_entropy if loss is None else CheckedLoss(loss)


class CheckedLoss:
    """A user's loss function whose every result must be a floating-point tensor of one
    value (NaN allowed: the server rejects the client's non-finite upload); anything else
    is a :class:`ConfigError` naming the function and what it returned, not a traceback
    from autograd or a string written into metrics.csv."""

    def __init__(self, loss: LossFn) -> None:
        self.loss = loss
        self.name = getattr(loss, "__qualname__", None) or repr(loss)

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        try:
            out = self.loss(logits, targets)
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 -- user code: any failure is named, not raised
            raise ConfigError(
                f"train.loss: {self.name} raised {type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(out, torch.Tensor) or not out.is_floating_point() or out.numel() != 1:
            what = (
                f"a {out.dtype} tensor of shape {tuple(out.shape)}"
                if isinstance(out, torch.Tensor)
                else f"{type(out).__name__} {repr(out)[:60]}"
            )
            raise ConfigError(
                f"train.loss: {self.name} returned {what}, not a floating-point tensor of one "
                "value (the mean loss)"
            )
        return out


_FEATURE_DIMS = {F.dropout1d: 1, F.dropout2d: 2, F.dropout3d: 3}
_WITH_GENERATOR = {
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
    torch.bernoulli,
    torch.normal,
    torch.multinomial,
    torch.Tensor.bernoulli_,
    torch.Tensor.uniform_,
    torch.Tensor.normal_,
    torch.Tensor.random_,
    torch.Tensor.exponential_,
}
_LIKE = {torch.rand_like: torch.rand, torch.randn_like: torch.randn}


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any) -> Any:
    return kwargs[name] if name in kwargs else args[i] if len(args) > i else default


class DropoutMode(TorchFunctionMode):
    """A ``TorchFunctionMode`` that computes every dropout call itself
    (:meth:`dropout`, given the call's :class:`DropoutCall`) and hands every other
    call to :meth:`other` (by default: runs it)."""

    def __torch_function__(
        self,
        func: Callable,
        types: Sequence[type],
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if is_dropout(func):
            return self.dropout(DropoutCall.of(func, args, kwargs))
        return self.other(func, args, kwargs)

    def dropout(self, call: DropoutCall) -> torch.Tensor:
        raise NotImplementedError

    def other(self, func: Callable, args: tuple, kwargs: dict[str, Any]) -> Any:
        return func(*args, **kwargs)


class SeededRandomness(DropoutMode):
    """Draw the random numbers of a module's ``forward`` from ``generator``.

    Dropout (``F.dropout`` and ``F.dropout1d/2d/3d``) is computed with a mask
    from ``generator``; random factories and in-place samplers that accept a
    generator get it. The mode is thread-local (a ``TorchFunctionMode``).
    """

    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()
        self.generator = generator

    def dropout(self, call: DropoutCall) -> torch.Tensor:
        if call.shape is None:
            return call.without_mask()
        # drawn on the CPU (the derived generators are CPU generators), same masks on any device
        return call.apply(call.draw(self.generator))

    def other(self, func: Callable, args: tuple, kwargs: dict[str, Any]) -> Any:
        if func in (F.alpha_dropout, F.feature_alpha_dropout):
            raise FedclusterError(
                f"model: {func.__name__} has no seeded form in fedcluster; use nn.Dropout"
            )
        if func in _WITH_GENERATOR and kwargs.get("generator") is None:
            kwargs = {**kwargs, "generator": self.generator}
        elif func in _LIKE:
            x = args[0]
            kwargs = {"dtype": x.dtype, "device": x.device, **kwargs}
            return _LIKE[func](x.shape, generator=self.generator, **kwargs)
        return func(*args, **kwargs)


def is_dropout(func: Callable) -> bool:
    """Whether ``func`` is one of the dropouts :class:`SeededRandomness` seeds."""
    return func is F.dropout or func in _FEATURE_DIMS


def draws_randomness(func: Callable) -> bool:
    """Whether ``func`` draws random numbers other than a dropout's mask."""
    return (
        func in _WITH_GENERATOR
        or func in _LIKE
        or func
        in (
            F.alpha_dropout,
            F.feature_alpha_dropout,
        )
    )


class DropoutCall:
    """One call of a dropout: its input, rate and the shape of the mask it draws
    (``None`` when it draws none: evaluation mode, ``p`` 0 or 1). A feature dropout
    (``dropout1d/2d/3d``) draws one value per channel."""

    def __init__(
        self, x: torch.Tensor, p: float, training: bool, shape: tuple[int, ...] | None
    ) -> None:
        self.x, self.p, self.training, self.shape = x, p, training, shape

    @classmethod
    def of(cls, func: Callable, args: tuple, kwargs: dict) -> DropoutCall:
        x = args[0]
        p = float(_arg(args, kwargs, 1, "p", 0.5))
        training = bool(_arg(args, kwargs, 2, "training", True))
        if not training or p in (0.0, 1.0):
            return cls(x, p, training, None)
        k = _FEATURE_DIMS.get(func, 0)
        shape = x.shape if k == 0 else x.shape[: x.dim() - k] + (1,) * k
        return cls(x, p, training, tuple(shape))

    def without_mask(self) -> torch.Tensor:
        """The output of a call that draws no mask."""
        return torch.zeros_like(self.x) if self.training and self.p == 1.0 else self.x

    def draw(self, generator: torch.Generator) -> torch.Tensor:
        """The mask of kept values, drawn from ``generator``."""
        assert self.shape is not None
        return torch.rand(self.shape, generator=generator) >= self.p

    def apply(self, keep: torch.Tensor) -> torch.Tensor:
        """The call's output with the mask ``keep``."""
        return self.x * keep.to(device=self.x.device, dtype=self.x.dtype) / (1.0 - self.p)


@contextmanager
def training(module: nn.Module, generator: torch.Generator) -> Iterator[nn.Module]:
    """``module`` in training mode with its randomness drawn from ``generator``."""
    with module_mode(module, True), SeededRandomness(generator):
        yield module

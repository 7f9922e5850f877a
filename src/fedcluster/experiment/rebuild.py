"""What a run's ``config.yaml`` records about a model and data passed from Python.

A run is resumable when its model and federation can be built again exactly.
Built from the config (a preset model, a dataset and partition) they always
can. Passed from Python they are recorded as:

- an import path: ``model.name: package.module:factory`` (called as
  ``factory(input_shape, n_classes, **options)``), ``data.federation:
  package.module:factory`` (called without arguments): ``fedcluster resume``
  imports and calls them again;
- a content hash (``model.given``, ``data.given``): of an ``nn.Module`` object,
  its class, the names and shapes of its parameters and buffers and the initial
  row the run derives from it (:func:`~fedcluster.algorithms.base.init_row`,
  which is what the run uses of it); of a
  :class:`~fedcluster.data.federation.Federation`, all its tensors and arrays.
  The command line cannot rebuild those: it stops with one line saying how to
  resume from Python (``fedcluster.resume(run_dir, model=..., federation=...)``),
  which checks that the objects passed hash the same.

A loss function passed from Python is recorded in ``train.loss`` by its import
path when that path gives the same function back, else as ``given:<name>``,
which only ``fedcluster.resume(run_dir, loss=...)`` can resume.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch
from torch import nn

from fedcluster.config.plugins import import_object
from fedcluster.config.schema import ExperimentConfig
from fedcluster.data.federation import Federation
from fedcluster.engine.modes import DEFAULT_LOSS, GIVEN_LOSS, LossFn
from fedcluster.errors import ConfigError, FedclusterError


def _update(h: hashlib._Hash, value: torch.Tensor | np.ndarray | None) -> None:
    if value is None:
        h.update(b"none")
        return
    array = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else value
    array = np.ascontiguousarray(array)
    h.update(f"{array.dtype}{array.shape}".encode())
    h.update(array.tobytes())


def model_sha256(model: nn.Module, keep: bool = False) -> str:
    """Hash of what a run uses of ``model``: class, parameter and buffer shapes, and its
    initial row: its own weights when the run keeps them (``model.init: keep``), else
    the row it is re-initialised to."""
    from fedcluster.algorithms.base import init_row
    from fedcluster.engine.flat import ParamLayout

    h = hashlib.sha256(f"{type(model).__module__}.{type(model).__qualname__}".encode())
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        h.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
    _update(h, ParamLayout(model).flatten() if keep else init_row(model, 0, "init"))
    return h.hexdigest()


def federation_sha256(federation: Federation) -> str:
    """Hash of every tensor and array of ``federation`` (samples, labels, offsets, truth)."""
    h = hashlib.sha256(f"classes={federation.n_classes}".encode())
    for value in (
        federation.x_train,
        federation.y_train,
        federation.train_offsets,
        federation.x_test,
        federation.y_test,
        federation.test_offsets,
        federation.groups,
        federation.rotations,
    ):
        _update(h, value)
    return h.hexdigest()


def record_given(
    config: ExperimentConfig,
    model: nn.Module | None,
    federation: Federation | None,
    loss: LossFn | None = None,
) -> ExperimentConfig:
    """``config`` with the hashes of the objects given and the loss function's name
    (:func:`record_loss`); a one-line error when the config says an object was given
    and it is missing, or differs from the one recorded."""
    missing = missing_objects(config, model, federation, loss)
    if missing:
        raise FedclusterError(
            f"the config records {' and '.join(missing)} passed from Python; pass the same "
            f"object(s) again (model=..., federation=..., loss=...)"
        )
    changes = {}
    keep = config.model.init == "keep"
    given = {
        "model": None if model is None else model_sha256(model, keep),
        "data": None if federation is None else federation_sha256(federation),
    }
    for section, value in given.items():
        if value is None:
            continue
        recorded = getattr(config, section).given
        if recorded is not None and recorded != value:
            what = "model" if section == "model" else "federation"
            raise FedclusterError(
                f"the {what} passed differs from the run's (sha256 {value[:12]} instead of "
                f"{recorded[:12]}): pass the same {what} the run was started with"
            )
        changes[section] = getattr(config, section).model_copy(update={"given": value})
    return record_loss(config.model_copy(update=changes) if changes else config, loss)


def record_loss(config: ExperimentConfig, loss: LossFn | None) -> ExperimentConfig:
    """``config`` with ``train.loss`` naming the loss function passed from Python:
    its import path when importable, else ``given:<qualified name>``."""
    if loss is None:
        return config
    recorded = config.train.loss
    if recorded.startswith(GIVEN_LOSS):
        return config  # a resume from Python passes the function again
    name = f"{getattr(loss, '__module__', '?')}:{getattr(loss, '__qualname__', '?')}"
    try:
        importable = import_object(name, "loss") is loss
    except ConfigError:
        importable = False
    value = name if importable else GIVEN_LOSS + name
    if recorded not in (DEFAULT_LOSS, value):
        raise FedclusterError(
            f"loss: a function was passed from Python and train.loss names {recorded!r}; "
            "give one of them"
        )
    return config.model_copy(update={"train": config.train.model_copy(update={"loss": value})})


def missing_objects(
    config: ExperimentConfig,
    model: object | None = None,
    federation: object | None = None,
    loss: object | None = None,
) -> list[str]:
    """What the config says was passed from Python as an object and is not passed now."""
    out = []
    if config.train.loss.startswith(GIVEN_LOSS) and loss is None:
        out.append(f"the loss function {config.train.loss.removeprefix(GIVEN_LOSS)}")
    if config.model.given is not None and model is None:
        out.append(f"a model object (sha256 {config.model.given[:12]})")
    if config.data.given is not None and federation is None:
        out.append(f"a federation object (sha256 {config.data.given[:12]})")
    return out


def check_rebuildable(
    run_dir: Path,
    config: ExperimentConfig,
    model: object | None = None,
    federation: object | None = None,
    loss: object | None = None,
) -> None:
    """One line, before anything is read or written, when ``run_dir`` needs objects
    passed from Python that are not passed (on the command line: none is)."""
    missing = missing_objects(config, model, federation, loss)
    if missing:
        needed = [
            ("model=...", config.model.given is not None),
            ("federation=...", config.data.given is not None),
            ("loss=...", config.train.loss.startswith(GIVEN_LOSS)),
        ]
        args = ", ".join(arg for arg, given in needed if given)
        raise FedclusterError(
            f"{run_dir} was started from Python with {' and '.join(missing)}, which the "
            f"command line cannot rebuild; resume it from Python: "
            f"fedcluster.resume({str(run_dir)!r}, {args}) with the same objects"
        )

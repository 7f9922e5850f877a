"""The Python API: ``fedcluster.run``, ``fedcluster.resume`` without a preset,
and ``fedcluster.assign``, a finished run's cluster model for a new device.

Modelled on scikit-learn's estimators (typed hyperparameter objects, results
as arrays and tables) and pfl-research's callbacks::

    import fedcluster
    from fedcluster import IFCA, FedGroup, Federation

    fed = Federation.from_clients(train=[(x0, y0), ...], test=[(tx0, ty0), ...],
                                  n_classes=10, groups=[0, 1, ...])
    result = fedcluster.run(model=my_module, federation=fed,
                            algorithms=[IFCA(n_clusters=3), FedGroup(n_groups=3)],
                            rounds=20, out="runs/mine")
    result.final_accuracy()            # {'ifca': 0.83, 'fedgroup': 0.87}

The parameter objects (``IFCA``, ``FedGroup``, ...) are the pydantic
``Params`` classes that validate the YAML's ``algorithms: [{name, params}]``,
so both routes accept and reject the same values. The run directory is the
CLI's (``config.yaml``, ``metrics.csv``, ..., ``report.html``), and its
``config.yaml`` records how to rebuild the model and data
(:mod:`fedcluster.experiment.rebuild`), so ``fedcluster resume`` continues a killed run
where it can, and says in one line how to resume from Python where it cannot.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from pydantic import BaseModel
from torch import nn

from fedcluster.algorithms import ALGORITHMS, Algorithm, AlgorithmParams
from fedcluster.config.plugins import import_object
from fedcluster.config.schema import (
    AlgorithmSpec,
    ExperimentConfig,
    deep_merge,
    load_yaml,
    validate_config,
    with_execution,
)
from fedcluster.data.federation import Federation
from fedcluster.engine.modes import LossFn
from fedcluster.errors import ConfigError
from fedcluster.experiment.callbacks import Callback
from fedcluster.experiment.client_results import read_clients
from fedcluster.experiment.cluster_choice import Assignment, DeviceData, FinishedRun
from fedcluster.experiment.rundir import fresh_run_path
from fedcluster.experiment.runner import Experiment
from fedcluster.experiment.runner import resume as _resume

AlgorithmLike = (
    AlgorithmParams
    | AlgorithmSpec
    | str
    | Mapping[str, Any]
    | type[Algorithm[Any, Any]]
    | tuple[str | type[Algorithm[Any, Any]], AlgorithmParams | Mapping[str, Any]]
)
"""An algorithm of :func:`run`: a parameter object (``IFCA(n_clusters=3)``), a name or
import path (``"fedavg"``, ``"mypkg.cfl:MyMethod"``), a YAML-style mapping
(``{"name": ..., "params": ..., "label": ...}``), an :class:`Algorithm` subclass, or
``(name or class, params)``."""


@dataclass
class RunResult:
    """What :func:`run` and :func:`resume` return: the run directory, read back.

    ``metrics`` holds ``metrics.csv`` as one dict per row (round × algorithm ×
    seed, numbers as floats; :meth:`to_pandas` gives a DataFrame), ``summary``
    the jobs of ``summary.json`` (one dict per (algorithm, seed) job),
    ``clients`` ``clients.csv`` as a pandas DataFrame (one row per client at
    each evaluation round: accuracy, loss, samples, group, cluster), ``report``
    the HTML report's path (None with ``report=False``).
    """

    path: Path
    metrics: list[dict[str, Any]]
    summary: list[dict[str, Any]]
    clients: pd.DataFrame
    report: Path | None

    @classmethod
    def load(cls, path: str | Path, report: Path | None = None) -> RunResult:
        """Read a run directory's ``metrics.csv``, ``summary.json`` and ``clients.csv``."""
        path = Path(path)
        with open(path / "metrics.csv", newline="") as f:
            metrics = [{k: _number(v) for k, v in row.items()} for row in csv.DictReader(f)]
        summary = json.loads((path / "summary.json").read_text())["jobs"]
        return cls(path, metrics, summary, read_clients(path), report)

    def column(self, name: str, algorithm: str, seed: int | None = None) -> list[Any]:
        """Column ``name`` of ``algorithm``'s rows (one seed, or every seed), in round order."""
        return [
            r[name]
            for r in self.metrics
            if r["algorithm"] == algorithm and (seed is None or r["seed"] == seed)
        ]

    def final_accuracy(self) -> dict[str, float]:
        """Each algorithm's test accuracy after its last round, averaged over seeds."""
        out: dict[str, list[float]] = {}
        last: dict[tuple[str, int], dict[str, Any]] = {}
        for row in self.metrics:
            last[(row["algorithm"], row["seed"])] = row
        for (algorithm, _), row in last.items():
            out.setdefault(algorithm, []).append(float(row["accuracy"]))
        return {a: sum(v) / len(v) for a, v in out.items()}

    def to_pandas(self) -> pd.DataFrame:
        """``metrics`` as a pandas DataFrame."""
        return pd.DataFrame(self.metrics)


def _number(text: str) -> Any:
    if text == "":
        return float("nan")
    try:
        value = float(text)
    except ValueError:
        return text
    return int(value) if value.is_integer() and "." not in text and "e" not in text else value


def _importable(obj: Any) -> str | None:
    """``module:qualname`` when importing it gives back ``obj`` itself, else None."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", "")
    if not module or module == "__main__" or "<" in qualname:
        return None
    path = f"{module}:{qualname}"
    try:
        return path if import_object(path, "model") is obj else None
    except ConfigError:
        return None


def algorithm_spec(item: AlgorithmLike) -> dict[str, Any]:
    """One entry of :func:`run`'s ``algorithms`` as the YAML's ``{name, params}`` mapping."""
    if isinstance(item, AlgorithmSpec):
        return item.model_dump(exclude_none=True)
    if isinstance(item, str):
        return {"name": item}
    if isinstance(item, Mapping):
        return dict(item)
    if isinstance(item, tuple):
        name, params = item
        entry = algorithm_spec(name)
        entry["params"] = (
            params.model_dump(mode="json", exclude_unset=True)
            if isinstance(params, BaseModel)
            else dict(params)
        )
        return entry
    if isinstance(item, type) and issubclass(item, Algorithm):
        registered = ALGORITHMS.get(getattr(item, "name", ""))
        if registered is item:
            return {"name": item.name}
        path = _importable(item)
        if path is None:
            raise ConfigError(
                f"algorithms: {item.__qualname__} is neither registered (@register) nor "
                "importable by path (define it in a module, not in __main__)"
            )
        return {"name": path}
    if isinstance(item, AlgorithmParams):
        names = [n for n, cls in ALGORITHMS.items() if cls.Params is type(item)]
        if len(names) != 1:
            raise ConfigError(
                f"algorithms: {type(item).__name__} belongs to {len(names)} registered "
                f"algorithms {names}; pass (name or class, params) instead"
            )
        return {"name": names[0], "params": item.model_dump(mode="json", exclude_unset=True)}
    raise ConfigError(f"algorithms: cannot use {item!r} as an algorithm (see fedcluster.run)")


def build_config(
    *,
    algorithms: Sequence[AlgorithmLike],
    rounds: int,
    seeds: Sequence[int],
    name: str,
    train: BaseModel | Mapping[str, Any] | None = None,
    config: ExperimentConfig | Mapping[str, Any] | str | Path | None = None,
    model: str | None = None,
    federation: str | None = None,
) -> ExperimentConfig:
    """The validated config of a :func:`run` (built-in defaults, no preset)."""
    raw: dict[str, Any] = {}
    if isinstance(config, BaseModel):
        raw = config.model_dump(mode="json")
    elif isinstance(config, str | Path):
        raw = load_yaml(config)
    elif isinstance(config, Mapping):
        raw = dict(config)
    elif config is not None:
        raise ConfigError(
            f"config: expected an ExperimentConfig, a mapping or a YAML file's path, "
            f"got a {type(config).__name__}"
        )
    given: dict[str, Any] = {
        "name": name,
        "rounds": rounds,
        "seeds": list(seeds),
        "algorithms": [algorithm_spec(a) for a in algorithms],
    }
    if train is not None:
        given["train"] = (
            train.model_dump(mode="json", exclude_unset=True)
            if isinstance(train, BaseModel)
            else dict(train)
        )
    if model is not None:
        given["model"] = {"name": model}
    if federation is not None:
        given["data"] = {"federation": federation}
    return validate_config(deep_merge(raw, given))


def _source(value: Any, what: str) -> tuple[str | None, Any]:
    """(import path to record, object to pass) of a ``model`` or ``federation`` argument."""
    if value is None:
        return None, None
    if isinstance(value, str):
        return value, None
    if isinstance(value, nn.Module | Federation):
        return None, value
    if callable(value):
        path = _importable(value)
        if path is None:
            raise ConfigError(
                f"{what}: the factory {getattr(value, '__qualname__', value)!r} cannot be "
                "imported by path (defined in __main__ or a function), so the run could not "
                f"be resumed: define it in a module, or pass the {what} object itself"
            )
        return path, None
    raise ConfigError(f"{what}: cannot use a {type(value).__name__} (see fedcluster.run)")


def run(
    *,
    model: nn.Module | str | Callable[..., nn.Module] | None = None,
    federation: Federation | str | Callable[[], Federation] | None = None,
    algorithms: Sequence[AlgorithmLike] = ("fedavg",),
    rounds: int = 20,
    out: str | Path | None = None,
    seeds: Sequence[int] = (0,),
    train: BaseModel | Mapping[str, Any] | None = None,
    config: ExperimentConfig | Mapping[str, Any] | str | Path | None = None,
    callbacks: Sequence[Callback] = (),
    name: str = "experiment",
    report: bool = True,
    progress: bool = False,
    loss: LossFn | None = None,
    overwrite: bool = False,
    jobs: int = 1,
) -> RunResult:
    """Run ``algorithms`` on ``federation`` with ``model``; write the run directory ``out``.

    Args:
        model: an ``nn.Module`` (recorded by its hash), ``"package.module:factory"``,
            a factory defined in a module (recorded by its import path; called as
            ``factory(input_shape, n_classes)``), or a preset name (``"mlp"``).
            Default: the config's model.
        federation: a :class:`Federation` (recorded by its hash, e.g. from
            :meth:`Federation.from_clients`), or a factory (import path or a
            function defined in a module) called without arguments. Default: the
            config's dataset and partition.
        algorithms: see :data:`AlgorithmLike`; e.g. ``[IFCA(n_clusters=3), "fedavg"]``.
        rounds, seeds: communication rounds; one run per seed.
        out: the run directory (default ``runs/<name>-<timestamp>``); where it exists
            already, the first free ``out-2``, ``out-3``, ... (``RunResult.path`` says which).
        train: local training, a :class:`TrainConfig` (``Train``) or a mapping of its fields.
        config: any other config fields (:class:`ExperimentConfig`, a mapping, e.g.
            ``{"participation": {"fraction": 0.5}}``, or a YAML file's path); the arguments
            above override it.
        callbacks: :class:`~fedcluster.experiment.callbacks.Callback` objects (return True from
            ``on_round_end`` to stop a job).
        report: write ``report.html`` and ``report.md`` as the CLI does.
        progress: progress bars.
        overwrite: replace the run directory ``out`` if it exists (only a run directory).
        loss: a loss function ``(logits, targets) -> mean loss`` instead of
            cross-entropy (recorded by import path where it has one; or name it in
            ``train={"loss": "package.module:function"}``).
        jobs: run the (algorithm, seed) jobs over this many local worker processes
            (:mod:`fedcluster.experiment.jobs`; the objects and callbacks passed must pickle).

    Returns:
        The run directory read back (:class:`RunResult`).

    Raises:
        ConfigError / FedclusterError: bad input, in one line naming it.
    """
    model_path, model_obj = _source(model, "model")
    fed_path, fed_obj = _source(federation, "federation")
    cfg = build_config(
        algorithms=algorithms,
        rounds=rounds,
        seeds=seeds,
        name=name,
        train=train,
        config=config,
        model=model_path,
        federation=fed_path,
    )
    cfg = with_execution(cfg, jobs=jobs)
    experiment = Experiment(
        cfg, model=model_obj, federation=fed_obj, callbacks=callbacks, loss=loss
    )
    path = fresh_run_path(out or f"runs/{name}-{datetime.now():%Y%m%d-%H%M%S}", overwrite)
    experiment.run(path, progress=progress)  # claims the directory: new or empty (rundir.claim)
    return RunResult.load(path, _write_report(path) if report else None)


def resume(
    run_dir: str | Path,
    *,
    model: nn.Module | None = None,
    federation: Federation | None = None,
    callbacks: Sequence[Callback] = (),
    report: bool = True,
    progress: bool = False,
    trust: bool = False,
    loss: LossFn | None = None,
    jobs: int = 1,
) -> RunResult:
    """Continue a killed run; pass the model and federation objects it was started with
    (their hashes are checked against ``config.yaml``) when it was started with objects,
    and the ``loss`` function when it was passed and cannot be imported by path.
    ``trust`` imports the code its config names even where no checkpoint vouches for it
    (:func:`fedcluster.experiment.rundir.check_resumable`); ``jobs`` as for :func:`run`."""
    _resume(
        run_dir,
        progress=progress,
        callbacks=callbacks,
        model=model,
        federation=federation,
        trust=trust,
        loss=loss,
        execution={"jobs": jobs},
    )
    return RunResult.load(run_dir, _write_report(Path(run_dir)) if report else None)


def _write_report(path: Path) -> Path:
    from fedcluster.reporting import write_report

    return write_report([path])


def assign(
    run_dir: str | Path,
    data: str | Path | DeviceData | Any,
    *,
    labels: Any = None,
    algorithms: Sequence[str] | None = None,
    seeds: Sequence[int] | None = None,
    record: bool = False,
    model: nn.Module | None = None,
    federation: Federation | None = None,
    trust: bool = False,
    loss: LossFn | None = None,
) -> list[Assignment]:
    """Which cluster model of the finished run ``run_dir`` a device should use for ``data``
    (:mod:`fedcluster.experiment.cluster_choice`): one
    :class:`~fedcluster.experiment.cluster_choice.Assignment`
    per job, with each rule's choice (``entropy`` and ``confidence`` without labels,
    ``descriptor`` too for FLUX; ``loss`` too when there are labels) and every candidate's scores.

    Args:
        data: a ``.npz`` file (``x`` [N, *input shape], optionally ``y`` and ``group``),
            a :class:`~fedcluster.experiment.cluster_choice.DeviceData`, or the samples as an array
            or tensor.
        labels: the samples' labels, with an array ``data`` (for the labelled choice).
        algorithms, seeds: only these jobs (labels as in ``metrics.csv``); default all.
        record: append the choices to the run's ``assign.csv`` (``fedcluster report``).
        model, federation, loss, trust: as for :func:`resume`, for a run started
            with objects from Python.
    """
    run = FinishedRun.load(run_dir, algorithms, seeds, model, federation, trust, loss)
    if isinstance(data, str | Path):
        device = run.read(data)
    elif isinstance(data, DeviceData):
        device = data
    else:
        device = DeviceData(
            torch.as_tensor(data), None if labels is None else torch.as_tensor(labels)
        )
    return run.assign(device, record=record)

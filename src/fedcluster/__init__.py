"""fedcluster: clustered federated learning -- JGL, CFLGT, DCFL, FedGroup and baselines.

The names below are imported lazily, on first use: ``import fedcluster`` (and
``import fedcluster.config.schema``) loads no torch, and importing the package changes
nothing in the process (no environment variable, no matplotlib backend, no
thread count; the command-line entry point sets OpenMP's wait policy itself,
:mod:`fedcluster.openmp`).

- :func:`run`, :func:`resume`, :class:`RunResult`: the Python API (:mod:`fedcluster.api`);
  :func:`assign`: a finished run's cluster model for a new device's data, with or
  without labels (:mod:`fedcluster.experiment.cluster_choice`); :func:`sweep`, :class:`SweepResult`:
  one run per setting of any config fields, with confidence intervals over seeds and
  paired tests between methods (:mod:`fedcluster.sweeps`);
- :class:`Federation` (``Federation.from_clients``), :class:`Experiment`, :class:`Callback`;
- the algorithms' parameter objects, the same pydantic classes that validate the
  YAML's ``params``: ``FedAvg``, ``FedProx``, ``FedAvgFT``, ``Local``, ``IFCA``,
  ``JGL``, ``CFLGT``, ``DCFL``, ``FedGroup``, ``FedGrouProx``, ``CFL``, ``FeSEM``, ``FLHC``;
- the config sections (``ExperimentConfig``, ``TrainConfig``, ``PrivacyConfig``, ...);
- for a method of your own (the plugin API, docs/plugins.md): ``Algorithm``,
  ``AlgorithmParams``, ``State``, ``RoundOutput``, ``register``, the server's
  ``Context`` and its ``Exchange``, ``weighted_loss``, ``weighted_average``, ``ClientComputation``,
  ``ClientContext``, ``ClientBatch``, ``Request``, ``ReplyField``, ``register_computation``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, tuple[str, str]] = {
    "run": ("fedcluster.api", "run"),
    "resume": ("fedcluster.api", "resume"),
    "RunResult": ("fedcluster.api", "RunResult"),
    "assign": ("fedcluster.api", "assign"),
    "sweep": ("fedcluster.sweeps", "sweep"),
    "SweepResult": ("fedcluster.sweeps", "SweepResult"),
    "Experiment": ("fedcluster.experiment.runner", "Experiment"),
    "Federation": ("fedcluster.data.federation", "Federation"),
    "Callback": ("fedcluster.experiment.callbacks", "Callback"),
    "write_report": ("fedcluster.reporting", "write_report"),
    "ExperimentConfig": ("fedcluster.config.schema", "ExperimentConfig"),
    "TrainConfig": ("fedcluster.config.schema", "TrainConfig"),
    "ParticipationConfig": ("fedcluster.config.schema", "ParticipationConfig"),
    "PrivacyConfig": ("fedcluster.config.schema", "PrivacyConfig"),
    "ScenarioConfig": ("fedcluster.config.schema", "ScenarioConfig"),
    "AggregationConfig": ("fedcluster.config.schema", "AggregationConfig"),
    "EvaluationConfig": ("fedcluster.config.schema", "EvaluationConfig"),
    "FedAvg": ("fedcluster.algorithms.fedavg", "FedAvgParams"),
    "FedProx": ("fedcluster.algorithms.fedavg", "FedProxParams"),
    "FedAvgFT": ("fedcluster.algorithms.fedavg", "FedAvgFTParams"),
    "Local": ("fedcluster.algorithms.local", "LocalParams"),
    "IFCA": ("fedcluster.algorithms.ifca", "IFCAParams"),
    "JGL": ("fedcluster.algorithms.jgl", "JGLParams"),
    "CFLGT": ("fedcluster.algorithms.cflgt", "CFLGTParams"),
    "DCFL": ("fedcluster.algorithms.dcfl", "DCFLParams"),
    "FedGroup": ("fedcluster.algorithms.fedgroup", "FedGroupParams"),
    "FedGrouProx": ("fedcluster.algorithms.fedgroup", "FedGrouProxParams"),
    "CFL": ("fedcluster.algorithms.cfl", "CFLParams"),
    "FeSEM": ("fedcluster.algorithms.fesem", "FeSEMParams"),
    "FLHC": ("fedcluster.algorithms.flhc", "FLHCParams"),
    "Algorithm": ("fedcluster.algorithms.base", "Algorithm"),
    "AlgorithmParams": ("fedcluster.algorithms.base", "AlgorithmParams"),
    "State": ("fedcluster.algorithms.base", "State"),
    "RoundOutput": ("fedcluster.algorithms.base", "RoundOutput"),
    "register": ("fedcluster.algorithms.base", "register"),
    "Context": ("fedcluster.algorithms.base", "Context"),
    "Exchange": ("fedcluster.algorithms.base", "Exchange"),
    "weighted_loss": ("fedcluster.algorithms.base", "weighted_loss"),
    "weighted_average": ("fedcluster.engine.flat", "weighted_average"),
    "ClientComputation": ("fedcluster.protocol.computation", "ClientComputation"),
    "ClientContext": ("fedcluster.protocol.client_side", "ClientContext"),
    "ClientBatch": ("fedcluster.protocol.client_side", "ClientBatch"),
    "Request": ("fedcluster.protocol.computation", "Request"),
    "ReplyField": ("fedcluster.protocol.computation", "ReplyField"),
    "register_computation": ("fedcluster.protocol.computation", "register_computation"),
}

__all__ = [
    "__version__",
    "run",
    "resume",
    "RunResult",
    "assign",
    "sweep",
    "SweepResult",
    "Experiment",
    "Federation",
    "Callback",
    "write_report",
    "ExperimentConfig",
    "TrainConfig",
    "ParticipationConfig",
    "PrivacyConfig",
    "ScenarioConfig",
    "AggregationConfig",
    "EvaluationConfig",
    "FedAvg",
    "FedProx",
    "FedAvgFT",
    "Local",
    "IFCA",
    "JGL",
    "CFLGT",
    "DCFL",
    "FedGroup",
    "FedGrouProx",
    "CFL",
    "FeSEM",
    "FLHC",
    "Algorithm",
    "AlgorithmParams",
    "State",
    "RoundOutput",
    "register",
    "Context",
    "Exchange",
    "weighted_loss",
    "weighted_average",
    "ClientComputation",
    "ClientContext",
    "ClientBatch",
    "Request",
    "ReplyField",
    "register_computation",
]


def __getattr__(name: str) -> Any:
    """Import an exported name on first use (PEP 562), so ``import fedcluster`` stays light."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fedcluster' has no attribute {name!r}")
    module, attr = _EXPORTS[name]
    if module in ("fedcluster.api", "fedcluster.sweeps") or module.startswith(
        "fedcluster.algorithms."
    ):
        importlib.import_module("fedcluster.algorithms")  # every built-in registered
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:  # what type checkers and IDEs see
    from fedcluster.algorithms.base import (
        Algorithm,
        AlgorithmParams,
        Context,
        Exchange,
        State,
        register,
        weighted_loss,
    )
    from fedcluster.algorithms.cfl import CFLParams as CFL
    from fedcluster.algorithms.cflgt import CFLGTParams as CFLGT
    from fedcluster.algorithms.dcfl import DCFLParams as DCFL
    from fedcluster.algorithms.fedavg import FedAvgFTParams as FedAvgFT
    from fedcluster.algorithms.fedavg import FedAvgParams as FedAvg
    from fedcluster.algorithms.fedavg import FedProxParams as FedProx
    from fedcluster.algorithms.fedgroup import FedGroupParams as FedGroup
    from fedcluster.algorithms.fedgroup import FedGrouProxParams as FedGrouProx
    from fedcluster.algorithms.fesem import FeSEMParams as FeSEM
    from fedcluster.algorithms.flhc import FLHCParams as FLHC
    from fedcluster.algorithms.ifca import IFCAParams as IFCA
    from fedcluster.algorithms.jgl import JGLParams as JGL
    from fedcluster.algorithms.local import LocalParams as Local
    from fedcluster.api import RunResult, assign, resume, run
    from fedcluster.config.schema import (
        AggregationConfig,
        EvaluationConfig,
        ExperimentConfig,
        ParticipationConfig,
        PrivacyConfig,
        ScenarioConfig,
        TrainConfig,
    )
    from fedcluster.data.federation import Federation
    from fedcluster.engine.flat import weighted_average
    from fedcluster.experiment.callbacks import Callback
    from fedcluster.experiment.runner import Experiment
    from fedcluster.protocol.client_side import ClientBatch, ClientContext
    from fedcluster.protocol.computation import (
        ClientComputation,
        ReplyField,
        Request,
        register_computation,
    )
    from fedcluster.reporting import write_report
    from fedcluster.sweeps import SweepResult, sweep

"""What a run records of the code and data that made it: the ``record`` of ``config.yaml``
and ``summary.json``.

A number in a paper cites the code that computed it and the data it was
computed on. The record holds the library's version and git revision (when it
runs from a git checkout; ``unknown`` otherwise, with ``+modified`` when the
checkout has uncommitted changes), torch's version, the backend that ran the
client computations (``simulator`` or ``flower``) and, per seed, the data the
run actually used: where it came from (the config's dataset and partition, a
``data.federation`` factory, or a federation passed from Python), the SHA-256
of the packed tensors (:func:`~fedcluster.experiment.rebuild.federation_sha256`), their
shapes, the number of clients and classes.

``config.yaml`` keeps the record under a last ``record:`` key, which is not an
input (:func:`~fedcluster.config.schema.validate_config` drops it, and the config
digest that binds checkpoints does not cover it). Where the clients come from
a factory or an object, the dataset and partition fields left at their
defaults are not written: they describe nothing the run used.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import torch
import yaml

from fedcluster.config.schema import EXECUTION_FIELDS, DataConfig, ExperimentConfig
from fedcluster.data.federation import Federation
from fedcluster.experiment.rebuild import federation_sha256
from fedcluster.protocol.backend import FederationView

UNKNOWN = "unknown"


def git_revision() -> str:
    """The commit of the git checkout fedcluster runs from, ``+modified`` when it has
    uncommitted changes; ``unknown`` for an installed copy (or without git)."""
    package = Path(__file__).resolve().parents[1]  # src/fedcluster
    try:
        top = _git(package, "rev-parse", "--show-toplevel")
        if Path(top).resolve() / "src" / "fedcluster" != package:
            return UNKNOWN  # the package sits inside someone else's repository
        revision = _git(package, "rev-parse", "HEAD")
        modified = _git(package, "status", "--porcelain", "--untracked-files=no", "--", ".")
    except (OSError, subprocess.SubprocessError):
        return UNKNOWN
    return revision + ("+modified" if modified else "")


def _git(where: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(where), *args], capture_output=True, text=True, timeout=10, check=True
    )
    return done.stdout.strip()


def run_record(backend: str) -> dict[str, Any]:
    """The code that runs: fedcluster's version and revision, torch's version, the backend."""
    from fedcluster import __version__

    return {
        "fedcluster": __version__,
        "git_revision": git_revision(),
        "torch": str(torch.__version__),
        "backend": backend,
        "data": [],
    }


def data_source(config: ExperimentConfig) -> str:
    """Where a run's clients come from, in words."""
    data = config.data
    if data.given is not None:
        return "a Federation passed from Python"
    if data.federation is not None:
        return f"data.federation {data.federation}"
    return f"data.dataset {data.dataset}, data.partition {data.partition.get('name')}"


def data_record(config: ExperimentConfig, seed: int, federation: FederationView) -> dict[str, Any]:
    """The data one seed's jobs used: source, SHA-256 of the packed tensors (None where
    the server does not hold them: Flower), shapes, clients and classes."""
    record: dict[str, Any] = {
        "seed": seed,
        "source": data_source(config),
        "n_clients": int(federation.n_clients),
        "n_classes": int(federation.n_classes),
        "input_shape": [int(n) for n in federation.input_shape],
        "train_samples": int(federation.train_sizes.sum()),
    }
    if isinstance(federation, Federation):
        record.update(
            sha256=federation_sha256(federation),
            x_train=list(federation.x_train.shape),
            x_test=list(federation.x_test.shape),
        )
    else:
        record["sha256"] = None
    return record


REPLACED = ("dataset", "data_dir", "download", "options", "partition")
"""The ``data`` fields a federation factory or object makes unused."""


def config_text(config: ExperimentConfig, record: dict[str, Any]) -> str:
    """``config.yaml``: the resolved config, without how it was executed
    (:data:`~fedcluster.config.schema.EXECUTION_FIELDS`: the record names the backend) and the
    data fields a factory or object replaced (where they hold their defaults), then the
    ``record``."""
    fields = config.model_dump(mode="json", exclude=set(EXECUTION_FIELDS))
    data = config.data
    if data.federation is not None or data.given is not None:
        default = DataConfig.model_validate({})
        for name in REPLACED:
            if getattr(data, name) == getattr(default, name):
                del fields["data"][name]
    return yaml.safe_dump({**fields, "record": record}, sort_keys=False)

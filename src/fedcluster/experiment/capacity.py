"""What a run will hold, checked against its federation before anything is allocated.

- Mini-batch plans: each participating client's local training draws its whole
  plan of index tensors before its first step (:func:`fedcluster.protocol.batches.batch_plan`),
  ``train.steps`` (or ``train.epochs`` × ⌈n/B⌉) tensors of at most B indices each.
  At the documented maximum (10⁷ steps) four tiny clients need tens of GB: the
  estimate (:func:`batch_plan_bytes`) is refused in one line when it exceeds the
  memory this process may allocate (:func:`fedcluster.memory.allowed_bytes`).
- Clusters: an algorithm's number of clusters (or groups, or mixture
  components) above the number of clients leaves clusters that no client can
  ever fill, and at 10⁶ spends the run initialising models: refused.
"""

from __future__ import annotations

import numpy as np

from fedcluster.algorithms.base import algorithm_class, algorithm_params
from fedcluster.config.schema import ExperimentConfig
from fedcluster.errors import ConfigError
from fedcluster.memory import allowed_bytes

PLAN_STEP_BYTES = 1024
"""Memory of one mini-batch's index tensor beside its indices: a torch tensor object and
its storage's allocation (measured 730-1900 bytes on CPython 3.11 / torch 2.x; the lower
end for the plan's views of one permutation)."""
INDEX_BYTES = 8
"""One int64 sample index."""


def batch_plan_bytes(
    train_sizes: np.ndarray, batch_size: int, epochs: int, steps: int | None
) -> int:
    """Bytes of every client's mini-batch plan of one round, all clients at once (the
    simulator draws the plans of all clients asked together)."""
    total = 0
    for n in (int(s) for s in train_sizes if s > 0):
        count = steps if steps is not None else epochs * -(-n // batch_size)
        total += count * (PLAN_STEP_BYTES + INDEX_BYTES * min(batch_size, n))
    return total


def check_batch_plans(config: ExperimentConfig, train_sizes: np.ndarray) -> None:
    """ConfigError naming ``train.steps`` or ``train.epochs`` when the round's mini-batch
    plans would not fit in the memory this process may allocate."""
    t = config.train
    need = batch_plan_bytes(train_sizes, t.batch_size, t.epochs, t.steps)
    have = allowed_bytes()
    if need > have:
        field = f"train.steps {t.steps:,}" if t.steps is not None else f"train.epochs {t.epochs:,}"
        raise ConfigError(
            f"{field}: the {len(train_sizes)} clients' mini-batch plans of one round need about "
            f"{need / 2**30:.1f} GiB, more than the {have / 2**30:.1f} GiB this process may "
            "allocate; use fewer local steps"
        )


def check_cluster_counts(config: ExperimentConfig, n_clients: int) -> None:
    """ConfigError naming the field when an algorithm asks for more clusters than clients."""
    for i, spec in enumerate(config.algorithms):
        field = algorithm_class(spec.name, f"algorithms.{i}").cluster_count
        if field is None:
            continue
        k = getattr(algorithm_params(spec, i), field, None)
        if isinstance(k, int) and k > n_clients:
            raise ConfigError(
                f"algorithms.{i}.params.{field}: {k:,} for {n_clients} clients; each cluster "
                f"needs a client, so at most {n_clients}"
            )

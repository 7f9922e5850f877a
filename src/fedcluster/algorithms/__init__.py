"""Federated algorithms, one module each; importing this package registers them all."""

from fedcluster.algorithms import (  # noqa: F401  (registration)
    cfl,
    cflgt,
    dcfl,
    fedavg,
    fedem,
    fedgroup,
    fedsoft,
    fesem,
    flhc,
    ifca,
    jgl,
    local,
    pacfl,
    wecfl,
)
from fedcluster.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    AlgorithmParams,
    Context,
    RoundOutput,
    algorithm_class,
    algorithm_params,
    check_algorithms,
)

__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "AlgorithmParams",
    "Context",
    "RoundOutput",
    "algorithm_class",
    "algorithm_params",
    "check_algorithms",
]

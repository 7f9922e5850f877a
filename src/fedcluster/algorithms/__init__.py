"""Federated algorithms, one module each; importing this package registers them all."""

from fedcluster.algorithms import fedavg, ifca, jgl, local  # noqa: F401  (registration)
from fedcluster.algorithms.base import ALGORITHMS, Algorithm, AlgorithmParams, Context

__all__ = ["ALGORITHMS", "Algorithm", "AlgorithmParams", "Context"]

"""The clustered-FL methods, one module per method (FedAvg, IFCA, JGL, CFLGT,
DCFL, FedGroup, CFL, FeSEM, FL+HC, PACFL, WeCFL, FedSoft, FedEM, FedRC, CFL-GP,
CLoVE, FedGWC, pFedGraph, FLUX, local), with
their shared server steps (``base``, ``cluster_models``, ``aggregation``, robust
rules, repair, the choice of the cluster count). An algorithm reaches clients
only through ``protocol``'s channel; the package may import ``engine`` and every
layer below it, never ``experiment``, ``flower`` or the entry points.
"""

from fedcluster.algorithms import (  # noqa: F401  (registration)
    cfl,
    cflgp,
    cflgt,
    clove,
    dcfl,
    fedavg,
    fedem,
    fedgroup,
    fedgwc,
    fedrc,
    fedsoft,
    fesem,
    flhc,
    flux,
    ifca,
    jgl,
    local,
    pacfl,
    pfedgraph,
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

"""fedcluster: clustered federated learning -- JGL, CFLGT, DCFL, FedGroup and baselines."""

import os as _os

# Idle OpenMP threads wait passively (sleep) instead of spinning, so a run does
# not burn cores that other processes need (issue 14, "graceful under load";
# see fedcluster.engine.threads). OpenMP reads this once, when PyTorch loads it,
# so it takes effect when fedcluster is imported before torch; a policy the
# user set is kept.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"

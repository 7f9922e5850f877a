"""fedcluster: clustered federated learning -- JGL, CFLGT, DCFL, FedGroup and baselines.

Importing the package changes nothing in the process (no environment variable,
no matplotlib backend, no thread count): the command-line entry point sets
OpenMP's wait policy itself (:mod:`fedcluster.openmp`).
"""

__version__ = "0.1.0"

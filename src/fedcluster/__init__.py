"""fedcluster: clustered federated learning -- JGL, CFLGT, DCFL, FedGroup and baselines."""

__version__ = "0.1.0"

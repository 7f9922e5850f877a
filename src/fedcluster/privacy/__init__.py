"""Differential privacy: the mechanisms (clipping, Gaussian noise, DP-SGD,
accountants: ``mechanisms``), local DP's per-client ledger and release rules
(``ledger``) and central DP's per-cluster private aggregate (``central``). It may
import ``config``, ``errors`` and ``rng``; the protocol and engine types it names
are imported for type checking only.
"""

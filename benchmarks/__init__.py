"""Benchmarks by kind: ``performance``, ``reproduction``, ``robustness``, ``deployment``
(docs/benchmarks.md). Each runs as ``python -m benchmarks.<kind>.<name>``: this package
sets OpenMP's passive wait policy before any benchmark imports torch."""

from fedcluster.openmp import prefer_passive_wait

prefer_passive_wait()

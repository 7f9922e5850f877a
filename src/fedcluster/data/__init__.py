"""Datasets and federations: loaders (IDX, LEAF, CIFAR, synthetic), integrity
checks and downloads, partitions of samples over clients, natural splits, concept
drift and the :class:`~fedcluster.data.federation.Federation` every backend trains
on. It may import ``config``, ``errors`` and ``rng`` only.
"""

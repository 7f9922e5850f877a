"""The simulator and its trainers: the batched in-process backend
(``simulator``), the MLP kernel, the any-model batched path, DP-SGD training,
flat parameter layouts, threads and precision. It may import ``protocol``,
``privacy``, ``data``, ``models``, ``clustering``, ``config``, ``errors`` and ``rng``.
"""

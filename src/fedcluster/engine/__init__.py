"""The simulator and its training strategies: the batched in-process backend
(``simulator``: the packed data, batch plans, FedBN's per-client layers, the
client computations' kernels) and the strategies it dispatches local training
to (``autograd_training`` for any model client by client, ``vmap_training`` for
any model in groups, ``kernel_training`` for MLPs on the
hand-written ``mlp_kernel``, the DP-SGD steps of ``dp_training``, over the shared
``training_inputs``), with flat parameter layouts, threads and precision. It may
import ``protocol``, ``privacy``, ``data``, ``models``, ``clustering``, ``config``,
``errors`` and ``rng``.
"""

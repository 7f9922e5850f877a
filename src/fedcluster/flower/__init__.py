"""The Flower backend: the messages between ServerApp and ClientApp, the
backend that sends computations to nodes, the apps, node data, deployment
(export, launcher, the ``fedcluster flower`` commands). It may import ``experiment``
and every layer below it, never ``reporting``, ``cli`` or ``api``.
"""

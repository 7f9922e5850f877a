"""The client protocol: a client computation (``computation``: what one client
or many compute, the request and the reply), what a computation sees of its
clients (``client_side``: ``ClientContext`` for one, ``ClientBatch`` for many), the
local-training settings and mini-batch plans a request carries (``batches``),
the backend protocol every backend provides (``backend``) and the channel through
which an algorithm asks clients, applying local DP, rejection and byte counting
(``channel``), and what a device contributes to a secure per-cluster sum
(``secure_sum``). It may import ``config``, ``data``, ``privacy``, ``errors`` and
``rng``; the engine's types it names (parameter layout, results) are imported for
type checking only.
"""

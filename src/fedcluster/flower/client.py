"""The ClientApp: one client's computations on a Flower SuperNode (DESIGN principle 1).

A node holds one client of the experiment's federation, named by its node
config's ``partition-id`` (what Flower's simulation engine and ``flwr run``
deployments set). From the experiment config carried in each message it
builds that client's data (the config's dataset and partition, as the
simulator does) and model once per process. Every request names a
registered client computation (:mod:`fedcluster.engine.computation`) and the
module that defines it; one generic handler runs it on a one-client
:class:`~fedcluster.engine.simulator.Simulator` -- with the client's global
id seeding its batches, so both backends compute the same numbers (to float
rounding: the node's products have other shapes than the simulator's
batched ones). A new computation needs no edit here.

Deploy with ``flwr run`` by naming ``fedcluster.flower.client:client_app``
as the ClientApp (docs/flower.md).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import yaml
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

import fedcluster.algorithms  # noqa: F401  (registers the algorithms' client computations)
from fedcluster.config import validate_config
from fedcluster.engine.computation import lookup_computation
from fedcluster.engine.simulator import Simulator
from fedcluster.flower import protocol
from fedcluster.runner import build_federation_for, model_for

client_app = ClientApp()


@lru_cache(maxsize=4)
def _client(experiment: str, seed: int, client: int) -> Simulator:
    """The simulator of one client's own data (cached per process)."""
    config = validate_config(yaml.safe_load(experiment))
    federation = build_federation_for(config, seed)
    if not 0 <= client < federation.n_clients:
        raise ValueError(
            f"node partition-id {client}: the experiment has {federation.n_clients} clients"
        )
    own = federation.subset([client])
    # one thread per node: the nodes of a simulation share the machine
    model = model_for(config, own)
    return Simulator(model, own, seed=seed, threads=1, client_ids=np.array([client]))


def _node(msg: Message, context: Context) -> tuple[Simulator, ConfigRecord]:
    config = protocol.settings(msg.content)
    client = int(context.node_config["partition-id"])
    return _client(str(config["experiment"]), int(config["seed"]), client), config


def _answer(msg: Message, content: RecordDict) -> Message:
    return Message(content=content, reply_to=msg)


@client_app.query("setup")
def setup(msg: Message, context: Context) -> Message:
    """The client's id, sample counts, ground-truth group (−1: none) and data shape."""
    sim, _ = _node(msg, context)
    fed = sim.federation
    info = {
        "client": int(sim.client_ids[0]),
        "train_size": int(fed.train_sizes[0]),
        "test_size": int(fed.test_sizes[0]),
        "group": -1 if fed.groups is None else int(fed.groups[0]),
        "n_classes": int(fed.n_classes),
        "input_shape": [int(s) for s in fed.input_shape],
    }
    return _answer(msg, protocol.reply({}, info))


def _compute(msg: Message, context: Context) -> Message:
    """Run the registered computation the message names on this node's client.

    The node runs exactly the function the simulator runs (its batched form
    on a one-client federation), so both compute the same numbers; under
    local DP the upload is released here, before it leaves the node.
    """
    sim, config = _node(msg, context)
    computation = lookup_computation(
        str(config["computation"]), str(config.get("computation_module", "")) or None
    )
    request = protocol.decode_request(protocol.tensors(msg.content), dict(config.items()))
    reply = computation.run(sim, np.array([0]), request)
    return _answer(msg, protocol.reply({k: v[0] for k, v in reply.items()}))


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    """Local training (the ``train`` computation)."""
    return _compute(msg, context)


@client_app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluation (the ``evaluate`` computation)."""
    return _compute(msg, context)


@client_app.query()
def query(msg: Message, context: Context) -> Message:
    """Any other registered client computation, by the name in its settings."""
    return _compute(msg, context)

"""The ClientApp: one client's computations on a Flower SuperNode (DESIGN principle 1).

A node holds one client of the experiment's federation, named by its node
config's ``partition-id`` (what Flower's simulation engine and ``flwr run``
deployments set). From the experiment config carried in each message it
builds that client's data (the config's dataset and partition, as the
simulator does) and model once per process, and answers each request with
the same :class:`~fedcluster.engine.simulator.Simulator` computation the
simulator runs for that client -- with the client's global id seeding its
batches, so both backends compute the same numbers (to float rounding:
the node's products have other shapes than the simulator's batched ones).

Deploy with ``flwr run`` by naming ``fedcluster.flower.client:client_app``
as the ClientApp (docs/flower.md).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
import yaml
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from fedcluster.config import validate_config
from fedcluster.engine.simulator import Simulator
from fedcluster.engine.trajectory import gradient_trajectories
from fedcluster.flower import protocol
from fedcluster.privacy import release_uploads
from fedcluster.runner import Experiment

client_app = ClientApp()


@lru_cache(maxsize=4)
def _client(experiment: str, seed: int, client: int) -> Simulator:
    """The simulator of one client's own data (cached per process)."""
    config = validate_config(yaml.safe_load(experiment))
    exp = Experiment(config)
    federation = exp.federation(seed)
    if not 0 <= client < federation.n_clients:
        raise ValueError(
            f"node partition-id {client}: the experiment has {federation.n_clients} clients"
        )
    own = federation.subset([client])
    # one thread per node: the nodes of a simulation share the machine
    return Simulator(exp.model(own), own, seed=seed, threads=1, client_ids=np.array([client]))


def _node(msg: Message, context: Context) -> tuple[Simulator, ConfigRecord]:
    config = protocol.settings(msg.content)
    if context.node_config.get("data"):  # node-local data: the node reads only its own files
        from fedcluster.flower.nodedata import node_simulator

        data = str(context.node_config["data"])
        return node_simulator(data, str(config["experiment"]), int(config["seed"])), config
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


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    """Local training from the received model (:meth:`Simulator.train`)."""
    sim, config = _node(msg, context)
    start = protocol.tensors(msg.content)["start"].unsqueeze(0)
    cfg, rnd, purpose = protocol.training_from(config)
    result = sim.train(
        np.array([0]), start, cfg, rnd, purpose, classifier_only=bool(config["classifier_only"])
    )
    row = result.rows
    ticket = protocol.ticket_from(config)
    if ticket is not None:  # local DP: privatise (or withhold) before anything leaves the node
        row = release_uploads([ticket], sim.client_ids, start, row, result.steps, sim.seed, rnd)
    return _answer(msg, protocol.reply({"row": row[0], "loss": result.loss, "steps": result.steps}))


@client_app.query("losses")
def losses(msg: Message, context: Context) -> Message:
    """Losses (and gradients) of K models on one mini-batch (:meth:`Simulator.losses_and_grads`)."""
    sim, config = _node(msg, context)
    models = protocol.tensors(msg.content)["models"]
    with_grads = bool(config["with_grads"])
    loss, grads = sim.losses_and_grads(
        np.array([0]),
        models,
        *protocol.training_from(config),
        with_grads=with_grads,
    )
    out = {"losses": loss[0]}
    if grads is not None:
        out["grads"] = grads[0]
    return _answer(msg, protocol.reply(out))


@client_app.query("products")
def products(msg: Message, context: Context) -> Message:
    """Loss, ‖∇L‖² and ⟨∇L, D⟩ of K models (:meth:`Simulator.losses_and_gradient_products`)."""
    sim, config = _node(msg, context)
    arrays = protocol.tensors(msg.content)
    loss, sq, dot = sim.losses_and_gradient_products(
        np.array([0]),
        arrays["models"],
        arrays["directions"],
        *protocol.training_from(config),
    )
    return _answer(msg, protocol.reply({"losses": loss[0], "sq": sq[0], "dot": dot[0]}))


@client_app.query("trajectory")
def trajectory(msg: Message, context: Context) -> Message:
    """CFLGT's gradient trajectory under the received model (eqs. 6-8)."""
    sim, config = _node(msg, context)
    start = protocol.tensors(msg.content)["start"]
    traj = gradient_trajectories(sim, np.array([0]), start, bool(config["normalise"]))
    return _answer(msg, protocol.reply({"trajectory": traj[0]}))


@client_app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Correct predictions, sample count and summed loss of the received model."""
    sim, config = _node(msg, context)
    model = protocol.tensors(msg.content)["model"]
    result = sim.evaluate(np.array([0]), model.unsqueeze(0), np.array([0]), str(config["split"]))
    return _answer(
        msg,
        protocol.reply(
            {
                "correct": torch.as_tensor(result.correct),
                "count": torch.as_tensor(result.count),
                "loss_sum": torch.as_tensor(result.loss_sum),
            }
        ),
    )

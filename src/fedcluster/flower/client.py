"""The ClientApp: one client's computations on a Flower SuperNode.

A node holds the clients found in its node-local data path (node config
``data``: a folder of several clients' files or one client's file,
:mod:`fedcluster.flower.nodedata`), or, on Flower's simulation engine, the
one client named by its ``partition-id``, whose data it builds from the
experiment config carried in each message (the config's dataset and
partition, as the simulator does). Each client's data and model are loaded
once per process. Every request names a registered client computation
(:mod:`fedcluster.protocol.computation`), the module that defines it, and the
clients it is for (:func:`fedcluster.flower.messages.split_clients`); one
generic handler runs it for each of them on that client's one-client
:class:`~fedcluster.engine.simulator.Simulator` -- with the client's global
id seeding its batches, so both backends compute the same numbers (to float
rounding: the node's products have other shapes than the simulator's
batched ones). A new computation needs no edit here.

Deploy with ``flwr run`` by naming ``fedcluster.flower.client:client_app``
as the ClientApp (docs/flower.md).
"""

from __future__ import annotations

import logging
import weakref
from functools import lru_cache
from typing import Any

import numpy as np
import torch
import yaml
from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp

import fedcluster.algorithms  # noqa: F401  (registers the algorithms' client computations)
from fedcluster.config.schema import validate_config
from fedcluster.data.configured import build_federation_for
from fedcluster.data.drift import DriftEvent, DriftReplay
from fedcluster.engine.simulator import Simulator
from fedcluster.experiment.runner import model_for, simulator_for
from fedcluster.experiment.scenario import Scenario, flip_labels
from fedcluster.flower import messages, secure
from fedcluster.protocol.computation import lookup_computation
from fedcluster.rng import derive_seed

client_app = ClientApp(mods=[secure.secure_aggregation_mod])
log = logging.getLogger(__name__)


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
    scenario = Scenario(config.scenario, federation.n_clients, seed, config.rounds)
    if client in scenario.label_flippers():  # a label-flipping node relabels its own data
        own = flip_labels(own, np.array([0]))
    # one thread per node: the nodes of a simulation share the machine
    model = model_for(config, own)
    return simulator_for(config, model, own, seed, threads=1, client_ids=np.array([client]))


_DRIFT: weakref.WeakKeyDictionary[Simulator, DriftReplay] = weakref.WeakKeyDictionary()


def _follow_drift(sim: Simulator, events: list[DriftEvent]) -> None:
    """Bring the client's data to its drift events of the job (scenario.drift, applied
    where the data is; none: the data as exported)."""
    if events or sim in _DRIFT:
        replay = _DRIFT.setdefault(sim, DriftReplay(sim.federation))
        replay.follow(events)


def _simulator(context: Context, experiment: str, seed: int, client: int) -> Simulator:
    """The one-client simulator of ``client``, one of the clients this node holds."""
    data = context.node_config.get("data")
    if data:  # node-local data: the node reads only its own files
        from fedcluster.flower.nodedata import node_simulator

        return node_simulator(str(data), experiment, seed, client)
    own = int(context.node_config["partition-id"])
    if client != own:
        raise ValueError(f"node partition-id {own} holds client {own}, not client {client}")
    return _client(experiment, seed, own)


def _error(exc: BaseException, context: Context | None = None) -> str:
    """A client's error as it travels back (one line), without the node's data path:
    the server learns the client and its file's name, never where the node keeps it."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    data = context.node_config.get("data") if context is not None else None
    if data:
        from pathlib import Path

        path = Path(str(data))
        for place in {str(path.absolute()), str(path)}:
            folder = place if path.is_dir() else str(Path(place).parent)
            text = text.replace(folder + "/", "").replace(place, "<node data>")
    return text


def _answer(msg: Message, content: RecordDict) -> Message:
    return Message(content=content, reply_to=msg)


@client_app.query("setup")
def setup(msg: Message, context: Context) -> Message:
    """The node's clients: per client its sample counts, ground-truth group (−1:
    none), its data file's name and SHA-256 as computed here (the server checks it
    against its own manifest), or why it cannot take part (``j|error``, e.g. a
    corrupt data file: the node's other clients still serve); the data shape and
    the federation's size (−1: unknown). An error of the whole node travels back
    without the node's paths."""
    try:
        return _setup(msg, context)
    except Exception as exc:  # noqa: BLE001 -- one line, the node's paths left out
        log.exception("setup failed")
        raise RuntimeError(_error(exc, context)) from None


def _setup(msg: Message, context: Context) -> Message:
    config = messages.settings(msg.content)
    experiment, seed = str(config["experiment"]), messages.integer(config, "seed")
    data = context.node_config.get("data")
    manifest = None
    if data:
        from fedcluster.flower.nodedata import check_seed, node_clients, sha256

        check_seed(str(data), seed)
        manifest, folder, clients = node_clients(str(data))
    else:
        clients = [int(context.node_config["partition-id"])]
    info: dict[str, Any] = {
        messages.CLIENTS: clients,
        "n_clients": -1 if manifest is None or manifest.n_clients is None else manifest.n_clients,
    }
    if manifest is not None:
        info.update(n_classes=manifest.n_classes, input_shape=list(manifest.input_shape))
    for j, client in enumerate(clients):
        head = messages.prefix(j)
        if manifest is not None:
            file = folder / manifest.clients[client]["file"]
            info[head + "file"] = file.name
            if file.is_file():
                info[head + "sha256"] = sha256(file)
        try:
            fed = _simulator(context, experiment, seed, client).federation
        except Exception as exc:  # noqa: BLE001 -- travels back; the node's other clients serve
            log.exception("client %d cannot take part", client)
            if manifest is None:
                raise
            entry = manifest.clients[client]
            info.update(
                {
                    head + "train_size": entry["train_size"],
                    head + "test_size": entry["test_size"],
                    head + "group": -1 if entry["group"] is None else entry["group"],
                    head + messages.ERROR: _error(exc, context),
                }
            )
            continue
        info.update(
            {
                head + "train_size": int(fed.train_sizes[0]),
                head + "test_size": int(fed.test_sizes[0]),
                head + "group": -1 if fed.groups is None else int(fed.groups[0]),
            }
        )
        info.setdefault("n_classes", int(fed.n_classes))
        info.setdefault("input_shape", [int(s) for s in fed.input_shape])
    return _answer(msg, messages.reply({}, info))


def _compute(msg: Message, context: Context) -> Message:
    """Run the registered computation the message names on each client it names.

    The node runs exactly the function the simulator runs (its batched form,
    given a :class:`~fedcluster.protocol.client_side.ClientBatch` of the client's
    one-client federation), so both compute the same numbers;
    under local DP the upload is released here, before it leaves the node. A
    client that fails (e.g. its data file is corrupt) answers with its error;
    the message's other clients are unaffected.
    """
    config = messages.settings(msg.content)
    replies = _run_each(messages.tensors(msg.content), dict(config.items()), context)
    return _answer(msg, messages.encode_replies(replies))


def _run_each(
    arrays: dict[str, torch.Tensor], config: dict[str, Any], context: Context
) -> list[dict[str, torch.Tensor] | str]:
    """Each client's reply to the computation the settings name, or its error."""
    experiment, seed = str(config["experiment"]), messages.integer(config, "seed")
    computation = lookup_computation(
        str(config["computation"]), str(config.get("computation_module", "")) or None
    )
    replies: list[dict[str, torch.Tensor] | str] = []
    drift = messages.decode_drift(str(config[messages.DRIFT])) if messages.DRIFT in config else {}
    for client, request in messages.split_clients(arrays, config):
        try:
            sim = _simulator(context, experiment, seed, client)
            _follow_drift(sim, drift.get(client, []))
            reply = computation.run(sim, np.array([0]), request)
        except Exception as exc:  # noqa: BLE001 -- travels back as this client's error
            log.exception("client %d: %s failed", client, computation.name)
            replies.append(_error(exc, context))
            continue
        replies.append({k: v[0] for k, v in reply.items()})
    return replies


def _secure_contribution(msg: Message, context: Context) -> Message:
    """The node's vector for secure aggregation (:mod:`fedcluster.flower.secure`): the
    sum of its clients' one-field replies, which Flower's ``secaggplus_mod`` quantizes
    and masks. NumPy's global generator, from which that quantization rounds, is seeded
    from the job's seed, the round and the node's first client (the same sums for the
    same config and seed)."""
    arrays, config = secure.from_fit_ins(msg.content)
    replies = _run_each(arrays, config, context)
    total: np.ndarray | None = None
    failed: dict[int, str] = {}
    for j, reply in enumerate(replies):
        if isinstance(reply, str):
            failed[j] = reply
            continue
        (value,) = reply.values()
        vector = value.double().numpy()
        total = vector if total is None else total + vector
    first = int(config[messages.CLIENTS][0])
    round_ = int(config.get(messages.prefix(0) + "round", 0))
    seed = derive_seed(messages.integer(config, "seed"), "secure-sum", round_, first)
    np.random.seed(seed % 2**32)
    if total is None:
        raise RuntimeError(f"every client of this node failed: {'; '.join(failed.values())}")
    return _answer(msg, secure.fit_res(total, failed))


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    """Local training (the ``train`` computation), or a node's vector for secure
    aggregation (a step of SecAgg+)."""
    if secure.is_secure(msg.content):
        return _secure_contribution(msg, context)
    return _compute(msg, context)


@client_app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluation (the ``evaluate`` computation)."""
    return _compute(msg, context)


@client_app.query()
def query(msg: Message, context: Context) -> Message:
    """Any other registered client computation, by the name in its settings."""
    return _compute(msg, context)

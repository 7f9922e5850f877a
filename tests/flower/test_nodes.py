"""Several clients per Flower node, in one process (no SuperLink, no SuperNode).

:class:`LocalGrid` stands for Flower's Grid: each pushed message is answered
at once by fedcluster's ClientApp with that node's own node config
(``data=<its folder>``, the node-local files ``fedcluster flower export``
writes), so the whole server side (:func:`discover`,
:class:`FlowerBackend`) and node side (:mod:`fedcluster.flower.client`) run
as in a deployment, only without processes. The real processes are
tests/flower/test_deployment.py's.
"""

from __future__ import annotations

import csv
import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("flwr", reason="the Flower backend needs `pip install 'fedcluster[flower]'`")

from flwr.app import Context, RecordDict  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from fedcluster.algorithms import ALGORITHMS  # noqa: E402
from fedcluster.config.schema import dump_config, resolve_config, validate_config  # noqa: E402
from fedcluster.experiment.runner import Experiment  # noqa: E402
from fedcluster.flower import messages as protocol  # noqa: E402
from fedcluster.flower.client import client_app  # noqa: E402
from fedcluster.flower.export import export_federation, export_for_nodes  # noqa: E402
from fedcluster.flower.flower_backend import FlowerClientError, discover  # noqa: E402
from fedcluster.flower.nodedata import client_file  # noqa: E402
from fedcluster.flower.server import FlowerBackends  # noqa: E402
from fedcluster.privacy.mechanisms import UploadTicket  # noqa: E402
from fedcluster.protocol.batches import LocalTraining  # noqa: E402
from fedcluster.protocol.computation import Request  # noqa: E402
from tests.flower.test_flower import SMALL  # noqa: E402
from tests.helpers import assert_same_run, rotated_mnist5k  # noqa: E402

N_CLIENTS = 6


def _config(algorithms=None, **extra):
    return validate_config(
        {
            "name": "nodes-test",
            "seeds": [0],
            "rounds": 2,
            "data": rotated_mnist5k(N_CLIENTS),
            "model": {"name": "mlp", "options": {"hidden": [16]}},
            "train": {"lr": 0.1, "batch_size": 32, "epochs": 1},
            "algorithms": algorithms
            or [{"name": n, "params": SMALL.get(n, {})} for n in sorted(ALGORITHMS)],
            **extra,
        }
    )


@pytest.fixture(autouse=True)
def _task_identity(monkeypatch):
    """Flower's Message needs the identity of the task that creates it (set by Flower's
    runtime in a real ServerApp or ClientApp process)."""
    for name in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, name, 1)


class LocalGrid:
    """Flower's Grid with in-process nodes: node id -> node config; ``down`` nodes do not
    answer while they are down (as the SuperLink, the grid keeps their messages and a
    node that is up again answers those it is still asked for). ``sent`` records each
    pushed message's node, type and clients."""

    def __init__(self, nodes: dict[int, dict[str, str]], down: set[int] = frozenset()):
        self.nodes, self.down = nodes, set(down)
        self.offline: set[int] = set()
        """Nodes the SuperLink reports offline (Flower's NODE_UNAVAILABLE error reply)."""
        self.replies: dict[str, SimpleNamespace] = {}
        self.queued: dict[str, tuple[int, object]] = {}
        """Messages pushed to a node while it was down: id -> (node, message)."""
        self.sent: list[tuple[int, str, list[int]]] = []
        self.computations: list[str] = []
        """Each pushed message's computation (``setup`` for discovery)."""

    def get_node_ids(self) -> list[int]:
        # as the SuperLink: the nodes online (a node that hangs stays listed)
        return [n for n in self.nodes if n not in self.offline]

    def push_messages(self, messages):
        ids = []
        for message in messages:
            node = message.metadata.dst_node_id
            mid = f"m{len(self.sent)}"
            config = protocol.settings(message.content)
            self.sent.append((node, message.metadata.message_type, list(config.get("clients", []))))
            self.computations.append(str(config.get("computation", "setup")))
            ids.append(mid)
            if node in self.down:
                self.queued[mid] = (node, message)
            else:
                self._answer(mid, node, message)
        return ids

    def _answer(self, mid: str, node: int, message) -> None:
        if node in self.offline:
            self.replies[mid] = SimpleNamespace(
                metadata=SimpleNamespace(reply_to_message_id=mid),
                has_error=lambda: True,
                error=SimpleNamespace(code=5, reason="Error: Node Unavailable"),
                content=None,
            )
            return
        context = Context(1, node, dict(self.nodes[node]), RecordDict(), {})
        try:
            reply, error = client_app(message=message, context=context), None
        except Exception as exc:  # noqa: BLE001 -- a real node sends it back as an error reply
            reply, error = None, f"<class '{type(exc).__name__}'>:<'{exc}'>"
        self.replies[mid] = SimpleNamespace(
            metadata=SimpleNamespace(reply_to_message_id=mid),
            has_error=lambda e=error: e is not None,
            error=SimpleNamespace(reason=error),
            content=None if reply is None else reply.content,
        )

    def pull_messages(self, message_ids):
        for m in message_ids:
            if m in self.queued and self.queued[m][0] not in self.down:
                self._answer(m, *self.queued.pop(m))
        return [self.replies.pop(m) for m in message_ids if m in self.replies]


def _nodes(config, tmp_path: Path, n_nodes: int) -> tuple[dict[int, dict[str, str]], list]:
    """Export ``config``'s data and give node 100+K the folder of block K (its clients)."""
    export_federation(config, tmp_path / "export")
    blocks = export_for_nodes(tmp_path / "export", n_nodes)
    return {100 + k: {"data": str(folder)} for k, (folder, _) in enumerate(blocks)}, blocks


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _flower_run(config, grid, out: Path) -> None:
    Experiment(config, backend_factory=FlowerBackends(config, grid)).run(out, progress=False)


def test_split_clients_gives_each_client_its_own_request():
    """A node's message for several clients decodes to what ``Request.client(i)`` gives
    each of them: shared tensors once, own rows and picked rows, per-client settings
    (each client's DP-SGD σ and release rule)."""
    from fedcluster.privacy.mechanisms import RecordDP

    dp = RecordDP(clip=1.0, noise_multiplier=(0.5, 0.7, 0.9), poisson=True, release=2)
    training = LocalTraining(
        lr=0.1, batch_size=8, epochs=1, dp=dp, augment="crop_flip", lr_decay=0.9
    )
    request = Request(
        shared={"models": torch.arange(12.0).reshape(3, 4)},
        own={"start": torch.arange(12.0, 24.0).reshape(3, 4), "k": torch.tensor([2, 0, 1])},
        settings={"round": 4, "purpose": "train", "training": training},
        own_settings=tuple(
            {"ticket": UploadTicket("client", 1.0, 0.3 * (i + 1), i, 5 - i)} for i in range(3)
        ),
        pick={"model": ("models", "k")},
    )
    positions, clients = [2, 0], [1, 0]  # a node holding clients 1 and 0 of the three asked
    arrays, config = protocol.encode_clients(request, positions, clients)
    assert sum(k.startswith(protocol.SHARED) for k in arrays) == 0  # "models" only picked from
    parts = protocol.split_clients(arrays, config)
    assert [c for c, _ in parts] == clients
    for i, c, (_, got) in zip(positions, clients, parts, strict=True):
        want = request.client(i)
        assert set(got.own) == set(want.own)
        for key in want.own:
            assert torch.equal(got.own[key], want.own[key])
        assert torch.equal(got.own["model"][0], request.shared["models"][int(request.own["k"][i])])
        assert got.settings["round"] == 4 and got.settings["purpose"] == "train"
        assert got.settings["training"].dp.noise_multiplier == (dp.sigma(c),)
        assert got.settings["training"].augment == "crop_flip"
        assert got.settings["training"].lr_decay == 0.9
        assert got.own_settings == want.own_settings
    replies = protocol.decode_replies(
        protocol.encode_replies([{"x": torch.ones(2)}, "DataError: bad\nfile"]), 2
    )
    assert torch.equal(replies[0]["x"], torch.ones(2))
    assert replies[1] == "node error: DataError: bad file"


def test_several_clients_per_node_give_the_simulators_metrics(tmp_path):
    """Every algorithm, partial participation: 6 clients on 4 nodes (2, 2, 1, 1), one
    message per node and computation, metrics equal to the simulator's."""
    config = _config(participation={"fraction": 0.5})
    nodes, blocks = _nodes(config, tmp_path, 4)
    assert [len(b) for _, b in blocks] == [2, 2, 1, 1]
    grid = LocalGrid(nodes)
    _flower_run(config, grid, tmp_path / "flower")
    Experiment(config).run(tmp_path / "sim", progress=False)
    sim = assert_same_run(tmp_path / "sim", tmp_path / "flower", rel=1e-6)
    purity = [float(r["purity"]) for r in sim if r["algorithm"] == "ifca" and r["purity"]]
    assert purity and max(purity) > 0.5  # the comparison is about real clustering
    # each node was asked only for its own clients, several in one message
    held = {100 + k: b for k, (_, b) in enumerate(blocks)}
    assert all(set(clients) <= set(held[node]) for node, _, clients in grid.sent)
    assert max(len(clients) for _, _, clients in grid.sent) == 2
    setups = [s for s in grid.sent if s[1] == protocol.SETUP]
    assert len(setups) == 4  # one discovery per seed


def test_the_choice_on_the_device_is_one_message_per_node_and_round(tmp_path):
    """IFCA and JGL with ``choice_on_device``: simulator and nodes give the same
    metrics (bytes included), and each node gets one choose-and-train message per
    round (where the default sends a decision query, then the training), then the
    evaluation."""
    rounds, n_nodes = 2, 2
    config = _config(
        [
            {"name": "ifca", "params": {**SMALL["ifca"], "choice_on_device": True}},
            {"name": "jgl", "params": {**SMALL["jgl"], "choice_on_device": True}},
        ]
    )
    nodes, _ = _nodes(config, tmp_path, n_nodes)
    grid = LocalGrid(nodes)
    _flower_run(config, grid, tmp_path / "flower")
    Experiment(config).run(tmp_path / "sim", progress=False)
    sim = assert_same_run(tmp_path / "sim", tmp_path / "flower", rel=1e-6)
    assert all(int(r["bytes_up"]) > 0 and int(r["bytes_down"]) > 0 for r in sim)
    asked = [c for c in grid.computations if c != "setup"]
    per_round = ["choose-and-train"] * n_nodes + ["evaluate"] * n_nodes
    assert asked == per_round * rounds * len(config.algorithms)


def test_the_choice_by_released_directions_is_one_message_per_node_and_round(tmp_path):
    """DCFL and FedGroup with ``choice_on_device``: the probe, the choice against the
    released steps and the training in one direction-choose-and-train message per node
    and round, then the evaluation; the same metrics as the simulator."""
    rounds, n_nodes = 2, 2
    config = _config(
        [
            {"name": "dcfl", "params": {"n_clusters": 2, "choice_on_device": True}},
            {"name": "fedgroup", "params": {"n_groups": 2, "choice_on_device": True}},
        ]
    )
    nodes, _ = _nodes(config, tmp_path, n_nodes)
    grid = LocalGrid(nodes)
    _flower_run(config, grid, tmp_path / "flower")
    Experiment(config).run(tmp_path / "sim", progress=False)
    assert_same_run(tmp_path / "sim", tmp_path / "flower", rel=1e-6)
    asked = [c for c in grid.computations if c != "setup"]
    per_round = ["direction-choose-and-train"] * n_nodes + ["evaluate"] * n_nodes
    assert asked == per_round * rounds * len(config.algorithms)


def test_a_client_moved_to_another_group_by_drift_is_moved_on_flower_too(tmp_path):
    """scenario.drift.regroup: the server moves the client's ground truth on both backends,
    so purity, ARI and the clients' groups agree (the nodes never see it)."""
    drift = [{"kind": "rotate", "rounds": [2], "clients": [0, 1], "angle": 180.0,
              "regroup": {0: 1, 1: 0}}]  # fmt: skip
    config = _config([{"name": "ifca", "params": SMALL["ifca"]}], rounds=3,
                     scenario={"drift": drift})  # fmt: skip
    nodes, _ = _nodes(config, tmp_path, 2)
    _flower_run(config, LocalGrid(nodes), tmp_path / "flower")
    Experiment(config).run(tmp_path / "sim", progress=False)
    assert_same_run(tmp_path / "sim", tmp_path / "flower", rel=1e-6)
    moved = [e for e in _rows(tmp_path / "flower" / "events.csv") if e["kind"] == "drift"]
    assert len(moved) == 2 and all(" -> " in e["detail"] for e in moved)


def test_drift_is_applied_by_each_node_to_its_own_clients(tmp_path):
    """scenario.drift on the nodes: rotations (drawn and given angles) and label swaps
    (drawn and given labels) at the start of their rounds, each job from the data as
    exported; metrics equal to the simulator's, whose drift changes the federation
    the server holds."""
    drift = [
        {"kind": "rotate", "every": 1, "clients": "random"},
        {"kind": "rotate", "rounds": [2], "clients": [1], "angle": 90.0},
        {"kind": "swap_labels", "rounds": [1], "clients": [4]},
        {"kind": "swap_labels", "rounds": [2], "clients": [0, 5], "labels": [1, 7]},
    ]
    config = _config(
        [{"name": "fedavg"}, {"name": "ifca", "params": SMALL["ifca"]}],
        rounds=3,
        scenario={"drift": drift},
    )
    nodes, _ = _nodes(config, tmp_path, 2)
    _flower_run(config, LocalGrid(nodes), tmp_path / "flower")
    Experiment(config).run(tmp_path / "sim", progress=False)
    assert_same_run(tmp_path / "sim", tmp_path / "flower", rel=1e-6)
    sim_events, flower_events = (
        [e for e in _rows(tmp_path / run / "events.csv") if e["kind"] == "drift"]
        for run in ("sim", "flower")
    )
    assert len(sim_events) == len(flower_events) == 2 * (3 + 1 + 1 + 2)
    for want, got in zip(sim_events, flower_events, strict=True):
        assert (got["round"], got["client"]) == (want["round"], want["client"])
        drawn_labels = got["detail"] == "swap_labels: two of its labels, drawn on its node"
        assert got["detail"] == want["detail"] or drawn_labels


def test_dcfl_emnist_dynamic_on_nodes_equals_the_simulator(tmp_path, shared_data_dir):
    """The dcfl-emnist-dynamic preset (EMNIST, per-client rotations, newcomers, a
    random client's rotation drifting, client-level local DP; DCFL, CFL, FedAvg),
    scaled down: 8 clients of 100 samples, 4 rounds, newcomers and drift every 2
    rounds, on 3 nodes: the simulator's metrics and drift events."""
    config = resolve_config(
        preset="dcfl-emnist-dynamic",
        overrides={
            "rounds": 4,
            "eval_every": 1,
            "data": {
                "data_dir": str(shared_data_dir),
                "partition": {"base_options": {"n_clients": 8, "samples_per_client": 100}},
            },
            "model": {"options": {"hidden": [16]}},
            "scenario": {
                "joins": {"every": 2, "count": 2, "first": 2},
                "drift": [{"kind": "rotate", "every": 2, "first": 1}],
            },
            "algorithms": [
                {"name": "dcfl"},
                {"name": "cfl", "params": {"warmup_rounds": 1}},
                {"name": "fedavg"},
            ],
        },
    )
    nodes, _ = _nodes(config, tmp_path, 3)
    _flower_run(config, LocalGrid(nodes), tmp_path / "flower")
    Experiment(config).run(tmp_path / "sim", progress=False)
    rows = assert_same_run(tmp_path / "sim", tmp_path / "flower", rel=1e-6)
    assert len(rows) == 3 * 4 and all(float(r["epsilon"]) > 0 for r in rows)
    events = {
        run: [
            (e["algorithm"], e["round"], e["client"], e["kind"], e["detail"])
            for e in _rows(tmp_path / run / "events.csv")
            if e["kind"] in ("drift", "join")
        ]
        for run in ("sim", "flower")
    }
    assert events["sim"] == events["flower"]
    assert sum(kind == "drift" for *_, kind, _ in events["sim"]) == 3 * 2


@pytest.mark.parametrize("mode", ["client", "record"])
def test_local_dp_noise_per_client_of_a_node(tmp_path, mode):
    """Each client of a node gets its own DP settings and noise streams (also when it
    chooses its cluster on the device and releases the model it trained)."""
    device = {"name": "jgl", "params": {**SMALL["jgl"], "choice_on_device": True}}
    config = _config(
        [{"name": "fedavg"}, {"name": "ifca", "params": SMALL["ifca"]}, device],
        privacy={"mode": mode, "epsilon": 5.0, "max_participations": 1},
    )
    nodes, _ = _nodes(config, tmp_path, 2)
    _flower_run(config, LocalGrid(nodes), tmp_path / "flower")
    Experiment(config).run(tmp_path / "sim", progress=False)
    rel = 0.0 if mode == "client" else 1e-5
    sim = assert_same_run(tmp_path / "sim", tmp_path / "flower", rel=rel)
    assert all(float(r["epsilon"]) > 0 for r in sim)


def _corrupt(folder: Path, client: int) -> None:
    path = folder / client_file(client)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_corrupt_client_file_leaves_only_that_client_out(tmp_path, caplog):
    """Client 4's file is corrupt: discovery logs the client and its node's error, the
    node serves its other clients, client 4 is never asked again (nor selected) and is
    ``failed`` in every round's evaluation, and the run goes on -- also past a request
    for client 4 alone (IFCA's evaluation of a client no cluster has chosen yet)."""
    config = _config([{"name": "fedavg"}, {"name": "ifca", "params": SMALL["ifca"]}])
    nodes, blocks = _nodes(config, tmp_path, 2)  # clients 0-2 and 3-5
    _corrupt(blocks[1][0], 4)
    grid = LocalGrid(nodes)
    with caplog.at_level(logging.WARNING, logger="fedcluster.flower.flower_backend"):
        _flower_run(config, grid, tmp_path / "flower")
    setup = [r.getMessage() for r in caplog.records if protocol.SETUP in r.getMessage()]
    assert len(setup) == 1 and "client 4 (node 101)" in setup[0]
    assert client_file(4) in setup[0] and "SHA-256 differs" in setup[0]
    assert [clients for _, kind, clients in grid.sent if 4 in clients] == []
    assert any(5 in clients for _, _, clients in grid.sent)  # its node's other clients serve
    events = _rows(tmp_path / "flower/events.csv")
    failed = [(e["algorithm"], e["round"], e["client"]) for e in events if e["kind"] == "failed"]
    assert failed == [(a, r, "4") for a in ("fedavg", "ifca") for r in ("1", "2")]
    assert all("SHA-256 differs" in e["detail"] for e in events if e["kind"] == "failed")
    # out of reach, client 4 is not available for selection: no training fails; its
    # evaluations do (the events above)
    assert [int(r["failed"]) for r in _rows(tmp_path / "flower/metrics.csv")] == [0, 0, 0, 0]


def test_discovery_names_missing_and_doubly_held_clients(tmp_path):
    config = _config([{"name": "fedavg"}])
    text = dump_config(config)
    nodes, _ = _nodes(config, tmp_path, 3)
    info, held = discover(LocalGrid(nodes), text, 0)
    assert held == {0: 100, 1: 100, 2: 101, 3: 101, 4: 102, 5: 102}
    assert info.n_clients == N_CLIENTS and list(info.train_sizes) == [
        int(s) for s in Experiment(config).federation(0).train_sizes
    ]
    with pytest.raises(FlowerClientError, match=r"clients \[2, 3\] .*node 101: timeout"):
        discover(LocalGrid(nodes, down={101}), text, 0, timeout=0.2)
    with pytest.raises(FlowerClientError, match="client 0 is claimed by nodes 100 and 103"):
        discover(LocalGrid({**nodes, 103: nodes[100]}), text, 0)
    with pytest.raises(FlowerClientError, match="exported for seed 0, the run asks for seed 1"):
        discover(LocalGrid(nodes), text, 1)
    assert np.array_equal(info.groups, Experiment(config).federation(0).groups)


class _LosesANode(LocalGrid):
    """Node 101 goes offline once ``after`` computation messages have been pushed."""

    def __init__(self, nodes, after: int):
        super().__init__(nodes)
        self.after = after

    def push_messages(self, messages):
        if len([s for s in self.sent if s[1] != protocol.SETUP]) >= self.after:
            self.offline.add(101)
        return super().push_messages(messages)


def test_a_node_reported_offline_is_not_asked_again(tmp_path, caplog):
    """Node 101 (clients 3-5) goes offline after FedAvg's first training: its clients
    fail from then on without being asked, also in the next job (IFCA, whose
    evaluation asks them alone: they never chose a cluster), and the run completes."""
    config = _config(
        [{"name": "fedavg"}, {"name": "ifca", "params": SMALL["ifca"]}],
        deployment={"min_replies": 0.5},
    )
    nodes, _ = _nodes(config, tmp_path, 2)
    grid = _LosesANode(nodes, after=2)  # after round 1's training
    with caplog.at_level(logging.WARNING, logger="fedcluster.flower.flower_backend"):
        _flower_run(config, grid, tmp_path / "flower")
    offline = [r.getMessage() for r in caplog.records if "is lost;" in r.getMessage()]
    assert len(offline) == 1 and "node 101" in offline[0] and "(3, 4, 5)" in offline[0]
    asked = [node for node, kind, _ in grid.sent if kind != protocol.SETUP]
    # round 1: train answered by both; evaluate: node 101's unavailable reply; then never
    assert asked[:4] == [100, 101, 100, 101] and 101 not in asked[4:]
    events = _rows(tmp_path / "flower/events.csv")
    failed = {(e["algorithm"], e["round"], e["client"]) for e in events if e["kind"] == "failed"}
    lost = {(a, r, c) for a in ("fedavg", "ifca") for r in ("1", "2") for c in "345"}
    assert failed == lost

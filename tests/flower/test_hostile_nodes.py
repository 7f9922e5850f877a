"""Hostile nodes, in one process: the server checks what a node reports before using it.

A node that inflates its evaluation counts, claims clients that are not its own
or not in the federation, reports another federation size, sends a reply
without its tensors, or answers ever slower is refused or rejected (logged and
in events.csv, naming the node); the run goes on with the honest nodes. The
grid is tests/flower/test_nodes.py's :class:`LocalGrid` with some replies
forged.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("flwr", reason="the Flower backend needs `pip install 'fedcluster[flower]'`")

from flwr.app import RecordDict  # noqa: E402

from fedcluster.config.schema import DeploymentConfig, dump_config  # noqa: E402
from fedcluster.errors import ConfigError  # noqa: E402
from fedcluster.flower import messages  # noqa: E402
from fedcluster.flower.flower_backend import Fleet, FlowerBackend, discover  # noqa: E402
from fedcluster.flower.nodedata import read_manifest  # noqa: E402
from fedcluster.flower.server import flower_experiment  # noqa: E402
from fedcluster.flower.verify import BadReport, setup_report  # noqa: E402
from tests.flower.test_nodes import (  # noqa: E402, F401  (_task_identity: autouse fixture)
    LocalGrid,
    _config,
    _nodes,
    _rows,
    _task_identity,
)


class ForgingGrid(LocalGrid):
    """A LocalGrid whose ``forge[node]`` rewrites that node's replies:
    ``forge(computation, content) -> content`` (``computation``: ``setup`` for
    discovery). ``clone`` gives node ids answering as another node would."""

    def __init__(self, nodes, forge=None, clone=None):
        clone = clone or {}
        super().__init__({**nodes, **{k: nodes[v] for k, v in clone.items()}})
        self.forge = forge or {}

    def _answer(self, mid, node, message) -> None:
        super()._answer(mid, node, message)
        forge = self.forge.get(node)
        reply = self.replies[mid]
        if forge is not None and not reply.has_error():
            config = messages.settings(message.content)
            reply.content = forge(str(config.get("computation", "setup")), reply.content)


def _inflate(computation: str, content: RecordDict) -> RecordDict:
    """Evaluation replies claiming 1000 × the client's test samples, all correct."""
    if computation != "evaluate":
        return content
    arrays, config = messages.tensors(content), dict(messages.settings(content).items())
    for key in [k for k in arrays if k.endswith("|count")]:
        arrays[key] = arrays[key] * 1000
        arrays[key.replace("|count", "|correct")] = arrays[key].clone()
    return messages.request(arrays, config)


def _fail_evaluation(computation: str, content: RecordDict) -> RecordDict:
    """Every client's evaluation fails on the node (its error travels back)."""
    if computation != "evaluate":
        return content
    n = len([k for k in messages.tensors(content) if k.endswith("|count")])
    return messages.encode_replies(["node error: evaluation failed"] * n)


def _run(config, grid, out: Path, export: Path | None = None) -> None:
    expected = None if export is None else read_manifest(export)
    flower_experiment(config, grid, expected=expected).run(out, progress=False)


def test_a_node_inflating_its_evaluation_counts_is_rejected(tmp_path):
    """Node 101 (clients 3-5) reports 1000 × each client's test count, all correct:
    each of those evaluations is rejected naming the node and the true size, and the
    accuracy is the one of a run where those clients' evaluations fail."""
    config = _config([{"name": "fedavg"}], deployment={"min_replies": 0.5})
    nodes, _ = _nodes(config, tmp_path, 2)
    _run(config, ForgingGrid(nodes, {101: _inflate}), tmp_path / "rogue")
    _run(config, ForgingGrid(nodes, {101: _fail_evaluation}), tmp_path / "failing")
    rejected = [e for e in _rows(tmp_path / "rogue/events.csv") if e["kind"] == "rejected"]
    assert sorted((int(e["round"]), int(e["client"])) for e in rejected) == [
        (r, c) for r in (1, 2) for c in (3, 4, 5)
    ]
    assert all("node 101" in e["detail"] and "test split has" in e["detail"] for e in rejected)
    rogue = _rows(tmp_path / "rogue/metrics.csv")
    failing = _rows(tmp_path / "failing/metrics.csv")
    assert [r["accuracy"] for r in rogue] == [r["accuracy"] for r in failing]
    assert all(float(r["accuracy"]) < 0.99 for r in rogue)


def _forged_setup(**change):
    """A setup reply forger: the node's honest report with ``change`` applied to its
    settings (``None`` removes the key)."""

    def forge(computation: str, content: RecordDict) -> RecordDict:
        if computation != "setup":
            return content
        config = dict(messages.settings(content).items())
        for key, value in change.items():
            if value is None:
                config.pop(key, None)
            else:
                config[key] = value
        return messages.reply({}, config)

    return forge


def test_discovery_refuses_nodes_with_foreign_ids_sizes_and_claims(tmp_path, caplog):
    """With the server's manifest: node 103 claims client 99, node 104 a federation of
    7 clients, node 105 node 100's clients with data of its own, node 106 sends no
    ``clients``, node 107 no ``arrays`` record: each is refused and named; the
    federation is the honest nodes', and the run completes with a ``refused`` event
    per client a refused node claimed."""
    config = _config([{"name": "fedavg"}], rounds=1)
    nodes, _ = _nodes(config, tmp_path, 3)
    export = tmp_path / "export"

    def no_arrays(computation, content):
        return RecordDict({"config": content["config"]})

    forge = {
        103: _forged_setup(clients=[99], **{"0|train_size": 10, "0|test_size": 5}),
        104: _forged_setup(n_clients=7),
        105: _forged_setup(**{"0|sha256": "0" * 64, "1|sha256": "0" * 64}),
        106: _forged_setup(clients=None),
        107: no_arrays,
    }
    grid = ForgingGrid(nodes, forge, clone={103: 101, 104: 101, 105: 100, 106: 102, 107: 102})
    info, held = discover(grid, dump_config(config), 0, expected=read_manifest(export))
    assert held == {0: 100, 1: 100, 2: 101, 3: 101, 4: 102, 5: 102}
    assert info.unavailable == {}
    reasons = {node: reason for node, (_, reason) in info.refused.items()}
    assert sorted(reasons) == [103, 104, 105, 106, 107]
    assert "claims clients [99]" in reasons[103]
    assert "federation of 7 clients, not 6" in reasons[104]
    assert "client 0 is claimed by nodes 100 and 105" in reasons[105]
    assert "no 'clients'" in reasons[106]
    assert "no 'arrays' record" in reasons[107]
    assert info.refused[105][0] == [0, 1] and info.refused[103][0] == []

    _run(config, grid, tmp_path / "run", export)
    refused = [e for e in _rows(tmp_path / "run/events.csv") if e["kind"] == "refused"]
    assert sorted({e["detail"].split(":")[0] for e in refused}) == [
        f"node {n}" for n in range(103, 108)
    ]
    assert [r["failed"] for r in _rows(tmp_path / "run/metrics.csv")] == ["0"]


def test_a_node_whose_reply_has_no_tensors_is_rejected_not_the_run(tmp_path):
    """Node 101's training replies have no ``arrays`` record: its clients' trainings are
    rejected naming the node, the run completes on node 100's clients."""
    config = _config([{"name": "fedavg"}], deployment={"min_replies": 0.5})
    nodes, _ = _nodes(config, tmp_path, 2)

    def no_arrays(computation, content):
        if computation != "train":
            return content
        return RecordDict({"config": content["config"]})

    _run(config, ForgingGrid(nodes, {101: no_arrays}), tmp_path / "run")
    rejected = [e for e in _rows(tmp_path / "run/events.csv") if e["kind"] == "rejected"]
    assert {int(e["client"]) for e in rejected} == {3, 4, 5}
    assert all("node 101: the reply has no 'arrays' record" in e["detail"] for e in rejected)
    assert len(_rows(tmp_path / "run/metrics.csv")) == 2


@pytest.mark.parametrize(
    ("change", "fault"),
    [
        ({"0|train_size": -400}, "client 0's train_size is -400, outside 0.."),
        ({"0|test_size": 10**9}, "client 0's test_size is 1000000000, outside 0.."),
        ({"0|train_size": 2.5}, "client 0's train_size is 2.5, not an integer"),
        ({"0|train_size": None}, "client 0: no train_size"),
        ({"n_classes": 10**8}, "n_classes is 100000000, outside 1..100000"),
        ({"input_shape": [10**5, 10**5]}, "holds more than"),
        ({"clients": [0, 0]}, "client ids repeat"),
        ({"clients": ["zero"]}, "a client id is 'zero', not an integer"),
    ],
)
def test_setup_reports_out_of_bounds_are_refused(change, fault):
    """Sizes become averaging weights and ``n_classes`` the model's output layer: a
    report outside the bounds is a :class:`BadReport` naming the value."""
    honest = {
        "clients": [0],
        "n_clients": 1,
        "n_classes": 10,
        "input_shape": [1, 28, 28],
        "0|train_size": 40,
        "0|test_size": 10,
        "0|group": 1,
    }
    report = setup_report(messages.reply({}, honest))
    assert report.clients == [(0, {"train_size": 40, "test_size": 10, "group": 1})]
    assert report.shape == (10, (1, 28, 28))
    forged = {k: v for k, v in {**honest, **change}.items() if v is not None}
    with pytest.raises(BadReport, match=fault.replace("(", r"\(").replace(".", r"\.")):
        setup_report(messages.reply({}, forged))


def test_the_measured_timeout_has_a_ceiling():
    """A node answering 2.7 × slower each round stretches the measured timeout
    (``timeout_factor`` × the slowest round trip) only up to ``timeout_ceiling``; a
    ceiling below the floor is refused naming both."""
    deployment = DeploymentConfig(timeout_floor=1.0, timeout_factor=3.0, timeout_ceiling=20.0)
    fleet = Fleet({}, {})
    backend = FlowerBackend(None, torch.nn.Linear(1, 1), None, fleet, "", 0, deployment)  # type: ignore[arg-type]
    assert backend.timeout == 10.0  # FIRST_TIMEOUT_FLOORS floors, within the ceiling
    trip = 0.1
    for _ in range(8):
        trip *= 2.7
        fleet.round_trip = max(fleet.round_trip, trip)
        assert backend.timeout == min(20.0, max(1.0, 3.0 * trip))
    assert backend.timeout == 20.0 and trip > 20.0  # the slow node now times out
    with pytest.raises(ConfigError, match=r"timeout_ceiling \(5 s\) is below timeout_floor"):
        _config([{"name": "fedavg"}], deployment={"timeout_floor": 10, "timeout_ceiling": 5})

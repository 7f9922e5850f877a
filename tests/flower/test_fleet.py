"""A fleet's everyday failures, in one process (no SuperLink, no SuperNode).

Nodes that are missing at discovery, lost during a round (reported offline, or
silent past the measured timeout) and that come back under a new node id;
a node whose data differs from the server's manifest; too few clients within
reach; the ServerApp's per-round line and final status. The grid is
tests/flower/test_nodes.py's :class:`LocalGrid` (fedcluster's ClientApp
answering each message in process); the same on real processes is
tests/flower/test_deployment.py's.
"""

from __future__ import annotations

import csv
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("flwr", reason="the Flower backend needs `pip install 'fedcluster[flower]'`")

from fedcluster.cli import main  # noqa: E402
from fedcluster.experiment.callbacks import Callback  # noqa: E402
from fedcluster.flower import messages  # noqa: E402
from fedcluster.flower.collect import TooFewReplies  # noqa: E402
from fedcluster.flower.flower_backend import FIRST_TIMEOUT_FLOORS, Fleet, FlowerBackend  # noqa: E402
from fedcluster.flower.nodedata import client_file, read_manifest, sha256  # noqa: E402
from fedcluster.flower.server import (  # noqa: E402
    FlowerBackends,
    RunFailed,
    flower_experiment,
    run_deployed,
)
from tests.flower.test_flower import SMALL  # noqa: E402
from tests.flower.test_nodes import (  # noqa: E402, F401  (_task_identity: autouse fixture)
    LocalGrid,
    _config,
    _nodes,
    _rows,
    _task_identity,
)


class Script(Callback):
    """Changes the grid after the rounds of the first job: ``{round: change(grid)}``."""

    def __init__(self, grid: LocalGrid, changes: dict) -> None:
        self.grid, self.changes, self.jobs = grid, changes, 0

    def on_job_start(self, job) -> None:
        self.jobs += 1

    def on_round_end(self, job, rnd, row, state) -> None:
        if self.jobs == 1 and rnd in self.changes:
            self.changes[rnd](self.grid)


def _run(config, grid, out: Path, export: Path, changes: dict) -> None:
    experiment = flower_experiment(
        config, grid, expected=read_manifest(export), callbacks=[Script(grid, changes)]
    )
    experiment.run(out, progress=False)


def _by_kind(out: Path, kind: str) -> set[tuple[str, int, int]]:
    return {
        (e["algorithm"], int(e["round"]), int(e["client"]))
        for e in _rows(out / "events.csv")
        if e["kind"] == kind
    }


def _clusters(out: Path, algorithm: str) -> dict[tuple[int, int], int]:
    """(round, client) -> cluster (−1: none) of ``algorithm`` in clusters.csv."""
    with open(out / "clusters.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["algorithm"] == algorithm]
    return {(int(r["round"]), int(r["client"])): int(r["cluster"]) for r in rows}


def test_nodes_that_join_late_leave_and_return_under_a_new_id(tmp_path):
    """DCFL then IFCA on 6 clients, 3 nodes of 2. Node 101 (clients 2, 3) is not up at
    discovery and connects after DCFL's round 1: its clients ``joined`` (newcomers:
    DCFL places them by its newcomer rule). Node 102 (clients 4, 5) goes offline
    after round 1 and comes back after round 2 as node 202 (a restarted SuperNode's
    new id): its clients ``rejoined`` and keep their DCFL cluster. IFCA, run next,
    finds every client (its clients choose their cluster each round)."""
    config = _config([{"name": "dcfl"}, {"name": "ifca", "params": SMALL["ifca"]}], rounds=4)
    nodes, _ = _nodes(config, tmp_path, 3)
    late = nodes.pop(101)
    grid = LocalGrid(nodes)

    def round_1(g: LocalGrid) -> None:
        g.nodes[101] = late
        g.offline.add(102)

    def round_2(g: LocalGrid) -> None:
        g.nodes[202] = g.nodes[102]

    out = tmp_path / "run"
    _run(config, grid, out, tmp_path / "export", {1: round_1, 2: round_2})
    assert _by_kind(out, "joined") == {("dcfl", 2, 2), ("dcfl", 2, 3)}
    assert _by_kind(out, "rejoined") == {("dcfl", 3, 4), ("dcfl", 3, 5)}
    assert _by_kind(out, "failed") == {
        ("dcfl", 1, 2),
        ("dcfl", 1, 3),
        ("dcfl", 2, 4),
        ("dcfl", 2, 5),
    }
    dcfl = _clusters(out, "dcfl")
    assert dcfl[1, 2] == dcfl[1, 3] == -1  # not there in round 1
    assert dcfl[4, 2] >= 0 and dcfl[4, 3] >= 0  # placed as newcomers
    assert [dcfl[r, 4] for r in (1, 2, 3, 4)] == [dcfl[1, 4]] * 4  # kept through the loss
    assert dcfl[1, 4] >= 0
    ifca = _clusters(out, "ifca")
    assert all(ifca[r, c] >= 0 for r in (1, 2, 3, 4) for c in range(6))
    rows = [r for r in _rows(out / "metrics.csv") if r["algorithm"] == "ifca"]
    assert [int(r["failed"]) for r in rows] == [0, 0, 0, 0]
    # the new node is asked for clients 4, 5 from then on; the lost id never again
    after = [i for i, s in enumerate(grid.sent) if s[0] == 202]
    assert after and all(s[0] != 102 for s in grid.sent[after[0] :])


def test_a_silent_node_times_out_and_is_back_when_it_answers(tmp_path, caplog):
    """The measured timeout: ``timeout_factor`` × the slowest round trip, at least
    ``timeout_floor`` (before any: ``FIRST_TIMEOUT_FLOORS`` floors). Node 101 stops
    answering after round 1 (it hangs: still listed by the SuperLink): round 2
    waits the timeout for it, then it is lost; it answers the rediscovery of
    round 3 again and its clients rejoin."""
    config = _config(
        [{"name": "fedavg"}],
        rounds=3,
        deployment={"timeout_floor": 0.3, "timeout_factor": 2.0},
    )
    nodes, _ = _nodes(config, tmp_path, 2)
    grid = LocalGrid(nodes)
    fleet = Fleet({}, {})
    model = torch.nn.Linear(1, 1)
    backend = FlowerBackend(grid, model, None, fleet, "", 0, config.deployment)  # type: ignore[arg-type]
    assert backend.timeout == FIRST_TIMEOUT_FLOORS * 0.3
    fleet.round_trip = 0.01
    assert backend.timeout == 0.3
    fleet.round_trip = 1.0
    assert backend.timeout == 2.0

    out = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="fedcluster.flower"):
        _run(
            config,
            grid,
            out,
            tmp_path / "export",
            {1: lambda g: g.down.add(101), 2: lambda g: g.down.discard(101)},
        )
    lost = [r.getMessage() for r in caplog.records if "is lost;" in r.getMessage()]
    assert len(lost) == 1 and "node 101" in lost[0] and "timeout (no reply within" in lost[0]
    assert _by_kind(out, "rejoined") == {("fedavg", 3, c) for c in (3, 4, 5)}
    failed = [int(r["failed"]) for r in _rows(out / "metrics.csv")]
    assert failed == [0, 3, 0]


def test_a_node_that_alters_its_data_and_its_manifest_is_refused(tmp_path, caplog):
    """Node 101 edits client 3's file and writes that file's SHA-256 into its own
    manifest: its own check passes, the server's manifest refuses it (client 3
    fails every round, named with its file; the node's other clients serve). A
    node's error names the client's file, never the node's folder."""
    config = _config([{"name": "fedavg"}])
    nodes, blocks = _nodes(config, tmp_path, 2)  # clients 0-2 and 3-5
    folder = blocks[1][0]
    path = folder / client_file(3)
    with np.load(path) as npz:
        arrays = dict(npz)
    arrays["y_train"] = (arrays["y_train"] + 1) % 10  # other labels, a valid file
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    own = json.loads((folder / "manifest.json").read_text())
    for entry in own["clients"]:
        if entry["client"] == 3:
            entry["sha256"] = sha256(path)
    (folder / "manifest.json").write_text(json.dumps(own))
    (folder / client_file(5)).unlink()  # a node error that would name the node's path
    out = tmp_path / "run"
    with caplog.at_level(logging.WARNING):
        _run(config, LocalGrid(nodes), out, tmp_path / "export", {})
    setup = [r.getMessage() for r in caplog.records if "query.setup: client" in r.getMessage()]
    assert len(setup) == 2
    assert "client 3 (node 101)" in setup[0] and client_file(3) in setup[0]
    assert "SHA-256 differs from the server's manifest" in setup[0]
    assert "client 5 (node 101)" in setup[1] and client_file(5) in setup[1]
    events = [e for e in _rows(out / "events.csv") if e["kind"] == "failed"]
    assert {(int(e["round"]), int(e["client"])) for e in events} == {
        (r, c) for r in (1, 2) for c in (3, 5)
    }
    server = [r for r in caplog.records if r.name != "fedcluster.flower.client"]
    said = " ".join(r.getMessage() for r in server) + (out / "events.csv").read_text()
    assert str(tmp_path) not in said  # the node's paths never reach the server


def test_too_few_clients_within_reach_end_the_run_with_one_line(tmp_path):
    """``min_replies`` of the federation's clients must be within reach: with 0.9, a
    node missing at discovery ends the run there, and a node lost in round 2 ends
    it then; the line names the clients, their node and why."""
    config = _config([{"name": "fedavg"}], rounds=3, deployment={"min_replies": 0.9})
    nodes, _ = _nodes(config, tmp_path, 3)
    export = tmp_path / "export"
    missing = LocalGrid({k: v for k, v in nodes.items() if k != 101})
    with pytest.raises(TooFewReplies, match=r"4 of the federation's 6 clients are within reach"):
        _run(config, missing, tmp_path / "a", export, {})
    grid = LocalGrid(nodes)
    with pytest.raises(TooFewReplies) as err:
        _run(config, grid, tmp_path / "b", export, {1: lambda g: g.offline.add(102)})
    line = str(err.value)
    assert "\n" not in line and "6 needed" in line
    assert "clients 4, 5 (its node 102 is lost (offline))" in line


def test_the_serverapp_prints_each_round_and_writes_its_status(tmp_path, capsys, monkeypatch):
    """One line per round (what ``flwr run --stream`` shows), ``status.json`` at the
    end, and ``fedcluster flower status RUN``: 0 and ``completed``, or 1 and the
    one-line reason of a failed run."""
    monkeypatch.setattr(sys, "tracebacklimit", 1000, raising=False)
    config = _config([{"name": "fedavg"}, {"name": "ifca", "params": SMALL["ifca"]}])
    nodes, _ = _nodes(config, tmp_path, 2)
    manifest = read_manifest(tmp_path / "export")
    out = tmp_path / "ok"
    run_deployed(config, str(out), LocalGrid(nodes), manifest)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("fedcluster:")]
    assert [ln.split(":")[1].strip() for ln in lines] == [
        f"{a} seed 0 round {r}/2" for a in ("fedavg", "ifca") for r in (1, 2)
    ]
    assert all("replies 6/6" in ln and "accuracy 0." in ln for ln in lines)
    assert "clusters -" in lines[0] and "clusters 2" in lines[-1]
    assert json.loads((out / "status.json").read_text())["status"] == "completed"
    assert main(["flower", "status", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"{out}: completed"

    strict = config.model_copy(
        update={"deployment": config.deployment.model_copy(update={"min_replies": 1.0})}
    )
    failed = tmp_path / "failed"
    with pytest.raises(RunFailed, match="TooFewReplies"):
        run_deployed(strict, str(failed), LocalGrid({100: nodes[100]}), manifest)
    status = json.loads((failed / "status.json").read_text())
    assert (
        status["status"] == "failed" and "clients 3, 4, 5 (no node serves it)" in status["reason"]
    )
    assert main(["flower", "status", str(failed)]) == 1
    assert status["reason"] in capsys.readouterr().out
    assert main(["flower", "status", str(tmp_path / "none")]) == 2
    assert "no final status" in capsys.readouterr().err


def test_rediscovery_never_waits_and_takes_a_node_back_within_the_round(tmp_path):
    """A node missing at discovery is asked at the round start without waiting for it
    (it does not answer yet) and not asked again while that question is open; when
    it answers, the next rediscovery (before a request, or at the round's end) takes
    its clients in, as events of that round, and they are within reach from then on."""
    config = _config([{"name": "fedavg"}], deployment={"timeout_floor": 0.2})
    nodes, _ = _nodes(config, tmp_path, 2)
    grid = LocalGrid(nodes, down={101})
    factory = FlowerBackends(config, grid, expected=read_manifest(tmp_path / "export"))
    backend = factory.backend(torch.nn.Linear(1, 1), factory.federation(0), 0)
    start = time.monotonic()
    reachable, events = backend.start_round(1)
    assert time.monotonic() - start < 0.5 and not events
    assert reachable.tolist() == [True] * 3 + [False] * 3
    backend.rediscover()
    setups = [s for s in grid.sent if s[0] == 101 and s[1] == messages.SETUP]
    assert len(setups) == 2  # discovery's, and the round start's (still open)
    grid.down.discard(101)
    assert backend.end_round(1) == [(c, "joined", "node 101") for c in (3, 4, 5)]
    reachable, events = backend.start_round(2)
    assert reachable.all() and not events

"""A real Flower deployment on loopback (``fedcluster flower local``).

Each test runs the quickstart's federation (``--preset quickstart``: 24
clients of mnist5k in 4 rotation groups; a small MLP and 3 rounds keep it
fast): a ``flower-superlink``, 4 ``flower-supernode`` processes holding 6
of the 24 clients each (each node given only its own data folder)
and a long-lived ClientApp worker per node, runs the Flower App with ``flwr
run``, and compares the run directory with the batched simulator's run of
the same config. Three runs in all, each checking several things: equal
metrics; a SIGKILLed node and a corrupt client file over TLS with SuperNode
authentication; Ctrl-C. Marker ``deployment``; each test is bounded by the
launcher's timeout and a SIGALRM guard.

Minutes on a loaded 2-core machine (Flower's SuperNode polls for messages
every 3 s, and the SuperLink declares a killed node offline after 60 s): run
them alone, ``pytest -m deployment tests/flower/test_deployment.py``.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason="deployment needs `pip install 'fedcluster[flower]'`")

from fedcluster.config import resolve_config  # noqa: E402
from fedcluster.errors import FedclusterError  # noqa: E402
from fedcluster.flower.launcher import run_local  # noqa: E402
from fedcluster.flower.nodedata import client_file  # noqa: E402
from fedcluster.runner import Experiment  # noqa: E402
from tests.helpers import assert_same_run  # noqa: E402

pytestmark = pytest.mark.deployment

N_CLIENTS = 24  # the quickstart's federation
N_NODES = 4
BLOCKS = [list(range(6 * k, 6 * k + 6)) for k in range(N_NODES)]  # the clients of each node


def _config(algorithms: list[str], rounds: int = 3, **extra):
    """The quickstart preset's data and algorithms (``algorithms`` selects among them,
    with their preset parameters), with a small MLP and one local epoch."""
    return resolve_config(
        preset="quickstart",
        algorithms=algorithms,
        overrides={
            "name": "deployment-test",
            "rounds": rounds,
            "model": {"options": {"hidden": [32]}},
            "train": {"epochs": 1},
            **extra,
        },
    )


@pytest.fixture(autouse=True)
def _bounded():
    """Hard bound per test (the launcher's own timeout is shorter)."""

    def expire(*_):
        raise TimeoutError("deployment test ran over 900 s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(900)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _assert_same_as_simulator(config, run: Path, tmp_path: Path) -> None:
    Experiment(config).run(tmp_path / "sim", progress=False)
    rows = assert_same_run(tmp_path / "sim", run, rel=1e-6)  # float rounding only
    assert len(rows) == config.rounds * len(config.algorithms)


def _check_nodes(run: Path) -> dict:
    nodes = json.loads((run / "deployment/nodes.json").read_text())
    assert [n["clients"] for n in nodes["nodes"]] == BLOCKS
    for n in nodes["nodes"]:
        # each node was given a folder with its own clients' files and nothing else
        files = sorted(p.name for p in Path(n["data"]).iterdir())
        assert files == sorted([*map(client_file, n["clients"]), "manifest.json"])
        manifest = json.loads((Path(n["data"]) / "manifest.json").read_text())
        assert [c["client"] for c in manifest["clients"]] == n["clients"]
        assert Path(n["log"]).is_file()
        # torn down: neither the node nor its ClientApp worker outlives the run
        assert not _alive(n["pid"]) and not _alive(n["worker_pid"])
    assert not _alive(nodes["superlink"]["pid"])
    # no exported file outside the node folders
    assert not list((run / "deployment").glob("*.npz"))
    return nodes


IFCA_JGL = ["ifca", "jgl"]  # the quickstart's: K = 4 (JGL: λ = 0.2)


def test_loopback_deployment_writes_the_simulators_metrics(tmp_path):
    """The quickstart's IFCA and JGL on 4 nodes of 6 clients each: the run directory
    equals the simulator's (to float rounding)."""
    config = _config(IFCA_JGL, rounds=3)
    run = run_local(config, tmp_path / "run", N_NODES, timeout=800, emit=lambda s: None)
    assert json.loads((run / "summary.json").read_text())
    _check_nodes(run)
    _assert_same_as_simulator(config, run, tmp_path)


def _check_tls_and_auth(run: Path, nodes: dict) -> None:
    assert nodes["superlink"]["tls"] and nodes["superlink"]["auth"]
    folder = run / "deployment"
    assert "https://127.0.0.1" in (folder / "superlink.log").read_text()
    assert (folder / "auth.log").read_text().count("registered successfully") == N_NODES
    assert sorted(p.name for p in (folder / "keys").iterdir()) == sorted(
        [f"node-{k}" for k in range(N_NODES)] + [f"node-{k}.pub" for k in range(N_NODES)]
    )


def _corrupt_node_data(run: Path, node: int, client: int) -> None:
    """Flip a byte of one client's file once the launcher has placed it."""
    path = run / f"deployment/data/node-{node}" / client_file(client)
    end = time.monotonic() + 300
    while not path.exists() and time.monotonic() < end:
        time.sleep(0.05)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _kill_node_after_round(run: Path, node: int, after: int) -> None:
    end = time.monotonic() + 600
    metrics = run / "metrics.csv"
    while time.monotonic() < end:
        try:
            if any(int(r["round"]) >= after for r in _rows(metrics)):
                break
        except (OSError, KeyError, ValueError):
            pass
        time.sleep(0.2)
    nodes = json.loads((run / "deployment/nodes.json").read_text())["nodes"]
    for pid in (nodes[node]["pid"], nodes[node]["worker_pid"]):
        os.kill(pid, signal.SIGKILL)


CORRUPT = 13  # a client of node 2
KILLED = 1  # the node SIGKILLed after round 1


def test_a_killed_node_and_a_corrupt_file_become_failed_clients(tmp_path):
    """The quickstart's IFCA then JGL, 3 rounds each, on 4 nodes over TLS with
    SuperNode authentication: client 13's file on node 2 is corrupt (the node
    serves its other clients; the server's log names client 13 and the node's
    error), and node 1 (clients 6..11) is SIGKILLed after IFCA's round 1. The
    run completes, the lost clients are ``failed`` events, and the other
    clients' clusters keep improving."""
    config = _config(
        IFCA_JGL,
        rounds=3,
        deployment={"round_timeout": 20, "min_replies": 0.5},
    )
    run = tmp_path / "run"
    threading.Thread(target=_corrupt_node_data, args=(run, 2, CORRUPT), daemon=True).start()
    threading.Thread(target=_kill_node_after_round, args=(run, KILLED, 1), daemon=True).start()
    run_local(config, run, N_NODES, tls=True, auth=True, timeout=800, emit=lambda s: None)
    _check_tls_and_auth(run, _check_nodes(run))
    server_log = (run / "deployment/flwr-run.log").read_text()
    setup = [ln for ln in server_log.splitlines() if f"query.setup: client {CORRUPT}" in ln]
    assert setup and client_file(CORRUPT) in setup[0] and "SHA-256 differs" in setup[0]
    events = _rows(run / "events.csv")
    failed: dict[str, set[tuple[int, str]]] = {}
    for e in events:
        if e["kind"] == "failed":
            failed.setdefault(e["algorithm"], set()).add((int(e["round"]), e["client"]))
    corrupt, killed = str(CORRUPT), {str(c) for c in BLOCKS[KILLED]}
    # the corrupt client in every round of both jobs
    assert all((r, corrupt) in failed[a] for a in ("ifca", "jgl") for r in (1, 2, 3))
    # the killed node's clients: in IFCA's last round (round 2 too, unless their node
    # answered round 2's first request in the 0.2 s before the kill) and all of JGL's
    assert {(3, c) for c in killed} <= failed["ifca"]
    assert not {c for r, c in failed["ifca"] if r == 1} - {corrupt}
    assert {(r, c) for r in (1, 2, 3) for c in killed | {corrupt}} == failed["jgl"]
    rows = _rows(run / "metrics.csv")
    for algorithm in ("ifca", "jgl"):
        mine = [r for r in rows if r["algorithm"] == algorithm]
        assert [int(r["round"]) for r in mine] == [1, 2, 3]
        assert int(mine[-1]["failed"]) == len(killed) + 1
        acc = [float(r["accuracy"]) for r in mine]
        assert acc[-1] > acc[0]  # the other clients' clusters keep improving


def test_bad_launcher_input_is_one_line(tmp_path):
    config = _config(["fedavg"], rounds=1)
    (tmp_path / "full").mkdir()
    (tmp_path / "full/x").write_text("x")
    with pytest.raises(FedclusterError, match="not empty"):
        run_local(config, tmp_path / "full", N_NODES)
    with pytest.raises(FedclusterError, match="one seed per deployment"):
        run_local(config.model_copy(update={"seeds": [0, 1]}), tmp_path / "seeds", N_NODES)
    with pytest.raises(FedclusterError, match=f"--nodes 25: needs 1..{N_CLIENTS}"):
        run_local(config, tmp_path / "nodes", N_CLIENTS + 1, emit=lambda s: None)


def test_ctrl_c_stops_every_process(tmp_path):
    """SIGINT to `fedcluster flower local` mid-run: non-zero exit, no process left."""
    import subprocess
    import sys

    config = tmp_path / "c.yaml"
    # long enough that the run is still going when the signal comes, on any machine
    config.write_text(json.dumps(_config(["fedavg"], rounds=500).model_dump(mode="json")))
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    cli = [sys.executable, "-m", "fedcluster.cli", "flower", "local", str(config)]
    proc = subprocess.Popen(
        [*cli, "--nodes", str(N_NODES), "--out", str(run)],
        env=env,
        # a test run started in the background inherits SIGINT ignored (POSIX shells do
        # that to `&` jobs); a user's terminal does not
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    nodes_json = run / "deployment/nodes.json"
    end = time.monotonic() + 300
    metrics = run / "metrics.csv"

    def rounds_done() -> int:
        return len(metrics.read_text().splitlines()) - 1 if metrics.exists() else 0

    while rounds_done() < 1 and time.monotonic() < end and proc.poll() is None:
        time.sleep(0.2)  # the nodes are up and the ServerApp is running rounds
    assert proc.poll() is None, "the deployment ended before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) != 0
    nodes = json.loads(nodes_json.read_text())
    pids = [nodes["superlink"]["pid"]]
    pids += [p for n in nodes["nodes"] for p in (n["pid"], n["worker_pid"])]
    assert not [p for p in pids if _alive(p)]

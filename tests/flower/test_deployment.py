"""A real Flower deployment on loopback (``fedcluster flower local``).

The runs use the quickstart's federation (``--preset quickstart``: 24 clients
of mnist5k in 4 rotation groups; a small MLP and few rounds keep them fast): a
``flower-superlink``, ``flower-supernode`` processes each holding a block of the
clients (each node given only its own data folder) and a long-lived ClientApp
worker per node, the Flower App submitted with ``flwr run``. Six runs in all,
each checking several things: a SIGKILLed node that comes back and a corrupt
client file (TLS); a failed ServerApp (TLS and SuperNode authentication);
Ctrl-C and SIGTERM, each resumed; nodes in network namespaces of their own;
docs/flower.md's guide as written, whose run equals the simulator's. Marker
``deployment``; each test is bounded by the launcher's timeout and a SIGALRM guard.

About 2 minutes on a quiet 2-core machine (Flower's SuperNode polls for
messages every 3 s); run them alone with
``pytest -m deployment tests/flower/test_deployment.py``.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason="deployment needs `pip install 'fedcluster[flower]'`")

from fedcluster.config.schema import resolve_config  # noqa: E402
from fedcluster.errors import FedclusterError  # noqa: E402
from fedcluster.experiment.runner import Experiment  # noqa: E402
from fedcluster.flower.launcher import run_local  # noqa: E402
from fedcluster.flower.nodedata import client_file  # noqa: E402
from tests.helpers import assert_same_run  # noqa: E402

pytestmark = pytest.mark.deployment

N_CLIENTS = 24  # the quickstart's federation
N_NODES = 3


def _blocks(n_nodes: int) -> list[list[int]]:
    """The clients of each of ``n_nodes`` nodes (the launcher's contiguous blocks)."""
    size = N_CLIENTS // n_nodes
    return [list(range(size * k, size * (k + 1))) for k in range(n_nodes)]


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


def _check_nodes(run: Path, n_nodes: int) -> dict:
    nodes = json.loads((run / "deployment/nodes.json").read_text())
    assert [n["clients"] for n in nodes["nodes"]] == _blocks(n_nodes)
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


def _check_tls_and_auth(run: Path, nodes: dict, n_nodes: int) -> None:
    assert nodes["superlink"]["tls"] and nodes["superlink"]["auth"]
    folder = run / "deployment"
    assert "https://127.0.0.1" in (folder / "superlink.log").read_text()
    assert (folder / "auth.log").read_text().count("registered successfully") == n_nodes
    assert sorted(p.name for p in (folder / "keys").iterdir()) == sorted(
        [f"node-{k}" for k in range(n_nodes)] + [f"node-{k}.pub" for k in range(n_nodes)]
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


def _after_round(run: Path, rnd: int, algorithm: str) -> None:
    """Wait until ``algorithm``'s round ``rnd`` is in the run's metrics."""
    end = time.monotonic() + 600
    while time.monotonic() < end:
        try:
            rows = _rows(run / "metrics.csv")
            if any(r["algorithm"] == algorithm and int(r["round"]) >= rnd for r in rows):
                return
        except (OSError, KeyError, ValueError):
            pass
        time.sleep(0.2)


def _kill_and_restart(run: Path, node: int, kill: int, restart: int, spawned: list) -> None:
    """SIGKILL node ``node`` (SuperNode and worker) after the first job's round ``kill``;
    start it again, by its command line in nodes.json, after round ``restart`` (a new
    SuperNode: it registers under a new node id)."""
    import subprocess
    import sys

    _after_round(run, kill, "dcfl")
    info = json.loads((run / "deployment/nodes.json").read_text())["nodes"][node]
    for pid in (info["pid"], info["worker_pid"]):
        os.kill(pid, signal.SIGKILL)
    _after_round(run, restart, "dcfl")
    env = {**os.environ, **info["env"], "PYTHONPATH": os.pathsep.join(sys.path)}
    log = open(Path(info["log"]).with_suffix(".restart.log"), "ab")  # noqa: SIM115
    spawned.append(log)
    proc = subprocess.Popen(info["command"], stdout=log, stderr=log, env=env)
    worker = [
        sys.executable,
        "-m",
        "fedcluster.flower.worker",
        "--runtime-api-address",
        f"127.0.0.1:{info['runtime_port']}",
        "--insecure",
        "--parent-pid",
        str(proc.pid),
    ]
    spawned += [proc, subprocess.Popen(worker, stdout=log, stderr=log, env=env)]


CORRUPT = 20  # a client of node 2
KILLED = 1  # the node SIGKILLed after round 1, restarted after round 2


def test_a_lost_node_returns_and_a_corrupt_file_is_named(tmp_path):
    """The quickstart's DCFL, 4 rounds, on 3 nodes of 8 clients over TLS, with the
    default deployment settings but a 10 s timeout floor (the defaults' 30 s is
    measured by benchmarks/deployment/flower_lost_node.py). Client 20's file on node 2 is
    corrupt (the node serves its other clients; the server's log names client 20
    and the node's error), node 1 (clients 8..15) is SIGKILLed after round 1 and
    started again (a new node id) after round 2. The run completes; node 1's
    clients are ``failed`` in round 2 and ``rejoined`` in round 3 or 4, keeping
    their DCFL cluster; ``flwr run --stream`` shows one line per round; the run
    directory's status is ``completed``; no process outlives the run."""
    config = _config(["dcfl"], rounds=4, deployment={"timeout_floor": 10.0})
    run = tmp_path / "run"
    spawned: list = []
    threading.Thread(target=_corrupt_node_data, args=(run, 2, CORRUPT), daemon=True).start()
    threading.Thread(
        target=_kill_and_restart, args=(run, KILLED, 1, 2, spawned), daemon=True
    ).start()
    try:
        run_local(config, run, N_NODES, tls=True, timeout=600, emit=lambda s: None)
    finally:
        for p in spawned:
            if hasattr(p, "kill"):
                p.kill()
                p.wait()
            else:
                p.close()
    folder = run / "deployment"
    nodes = _check_nodes(run, N_NODES)
    assert nodes["superlink"]["tls"]
    assert "https://127.0.0.1" in (folder / "superlink.log").read_text()
    server_log = (folder / "flwr-run.log").read_text()
    setup = [ln for ln in server_log.splitlines() if f"query.setup: client {CORRUPT}" in ln]
    assert setup and client_file(CORRUPT) in setup[0] and "SHA-256 differs" in setup[0]
    assert str(folder / "data") not in server_log  # the nodes' paths stay on the nodes
    for r in range(1, 5):  # what `flwr run --stream` showed
        assert f"fedcluster: dcfl seed 0 round {r}/4: accuracy" in server_log
    assert "Traceback" not in server_log
    assert json.loads((run / "status.json").read_text())["status"] == "completed"
    events = _rows(run / "events.csv")

    def kind(k: str) -> set[tuple[int, str]]:
        return {(int(e["round"]), e["client"]) for e in events if e["kind"] == k}

    killed = {str(c) for c in _blocks(N_NODES)[KILLED]}
    corrupt = str(CORRUPT)
    failed = kind("failed")
    assert all((r, corrupt) in failed for r in (1, 2, 3, 4))  # the evaluation asks it
    # the killed node's clients: failed in round 2 (round 1 too when their node had
    # not answered round 1's evaluation before the kill)
    assert {(2, c) for c in killed} <= failed
    assert {c for _, c in failed} == killed | {corrupt}
    # back by round 4: their restarted node answers a rediscovery during round 3 (its
    # clients then serve round 3's evaluation) or at round 4's start
    rejoined = kind("rejoined")
    assert {c for _, c in rejoined} == killed and len(rejoined) == len(killed)
    assert {r for r, _ in rejoined} <= {3, 4}
    assert not {(r, c) for r, c in failed if c in killed and r > min(r for r, _ in rejoined)}
    with open(run / "clusters.csv", newline="") as f:
        clusters = {(int(r["round"]), r["client"]): int(r["cluster"]) for r in csv.DictReader(f)}
    for c in killed:  # DCFL keeps a returning client's cluster
        assert clusters[1, c] >= 0
        assert [clusters[r, c] for r in (2, 3, 4)] == [clusters[1, c]] * 3
    rows = _rows(run / "metrics.csv")
    assert [int(r["round"]) for r in rows] == [1, 2, 3, 4]
    assert int(rows[-1]["failed"]) == 0  # node 1 is back; client 20 is not selected


def test_a_failed_serverapp_is_a_non_zero_exit_with_its_reason(tmp_path):
    """`fedcluster flower local --tls --auth` with ``deployment.min_replies=1`` and a
    corrupt file: the ServerApp stops at discovery with one line (no traceback in the
    stream); `fedcluster flower local` and `fedcluster flower status` exit non-zero
    with it. The nodes were registered (SuperNode authentication) and are stopped."""
    import subprocess
    import sys

    run = tmp_path / "run"
    threading.Thread(target=_corrupt_node_data, args=(run, 1, CORRUPT), daemon=True).start()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    cli = [sys.executable, "-m", "fedcluster.cli", "flower"]
    args = ["--preset", "quickstart", "--rounds", "1", "--set", "deployment.min_replies=1"]
    done = subprocess.run(
        [*cli, "local", *args, "--nodes", "2", "--tls", "--auth", "--out", str(run)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    reason = "23 of the federation's 24 clients are within reach, 24 needed"
    assert done.returncode == 2 and reason in done.stderr
    assert f"client {CORRUPT} (DataError: {client_file(CORRUPT)}" in done.stderr
    log = (run / "deployment/flwr-run.log").read_text()
    assert reason in log and "Traceback" not in log
    _check_tls_and_auth(run, _check_nodes(run, 2), 2)
    status = subprocess.run(
        [*cli, "status", str(run)], env=env, capture_output=True, text=True, timeout=60
    )
    assert status.returncode == 1 and reason in status.stdout


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


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_stops_every_process_in_one_line_and_the_run_resumes(tmp_path, signum):
    """SIGINT or SIGTERM to `fedcluster flower local` mid-run: exit 130 with one line
    (no traceback), no process left, and `fedcluster resume` completes the run from
    its last checkpoint."""
    import subprocess
    import sys

    from fedcluster.cli import main

    config = tmp_path / "c.yaml"
    # long enough that the run is still going when the signal comes, on any machine
    rounds = 60
    config.write_text(json.dumps(_config(["fedavg"], rounds=rounds).model_dump(mode="json")))
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    cli = [sys.executable, "-m", "fedcluster.cli", "flower", "local", str(config)]
    proc = subprocess.Popen(
        [*cli, "--nodes", "1", "--out", str(run)],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
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
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "fedcluster: interrupted"
    nodes = json.loads(nodes_json.read_text())
    pids = [nodes["superlink"]["pid"]]
    pids += [p for n in nodes["nodes"] for p in (n["pid"], n["worker_pid"])]
    assert not [p for p in pids if _alive(p)]
    assert main(["resume", str(run), "--quiet", "--no-report"]) == 0
    assert rounds_done() == rounds


def _ip(*args: str) -> None:
    import subprocess

    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


BRIDGE = "10.213.0.1"  # the root namespace's address on the test's private link


@pytest.fixture
def two_hosts():
    """Two network namespaces, each joined by a veth pair to a bridge in the root
    namespace: private addresses 10.213.0.1 (root, the bridge) and 10.213.0.2,
    10.213.0.3 (inside), on this machine only -- two more hosts, which reach the
    root namespace only through that link. Removed after the test; skipped where
    namespaces cannot be created (not root, no iproute2)."""
    import shutil
    import subprocess

    tag = f"{os.getpid() % 10000}"
    names = [f"fc{tag}n{k}" for k in range(2)]
    bridge = f"fc{tag}br"
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2's `ip` to create network namespaces")
    probe = subprocess.run(["ip", "netns", "add", names[0]], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot create a network namespace: {probe.stderr.strip()}")
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{BRIDGE}/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for k, ns in enumerate(names):
            if k:
                _ip("netns", "add", ns)
            outer, inner = f"fc{tag}v{k}", f"fc{tag}p{k}"
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            _ip("link", "set", outer, "master", bridge)
            _ip("link", "set", outer, "up")
            _ip("link", "set", inner, "netns", ns)
            _ip("-n", ns, "addr", "add", f"10.213.0.{2 + k}/24", "dev", inner)
            _ip("-n", ns, "link", "set", inner, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield dict(enumerate(names))
    finally:
        for k, ns in enumerate(names):
            subprocess.run(["ip", "link", "del", f"fc{tag}v{k}"], capture_output=True)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)


def test_nodes_in_network_namespaces_of_their_own(tmp_path, two_hosts):
    """The SuperLink in the root namespace, listening on the private link's address
    only, two SuperNodes each in a namespace of its own, which reaches it only
    through that link: the run completes as on loopback. FedAvg, 1 round, 12
    clients per node."""
    config = _config(["fedavg"], rounds=1)
    places = {k: (ns, BRIDGE) for k, ns in two_hosts.items()}
    run = tmp_path / "run"
    run_local(config, run, 2, timeout=600, emit=lambda s: None, host=BRIDGE, places=places)
    nodes = json.loads((run / "deployment/nodes.json").read_text())
    assert nodes["superlink"]["address"].startswith(f"{BRIDGE}:")
    for k, n in enumerate(nodes["nodes"]):
        assert n["command"][:4] == ["ip", "netns", "exec", two_hosts[k]]
        assert f"--superlink {BRIDGE}:" in " ".join(n["command"])
    rows = _rows(run / "metrics.csv")
    assert [int(r["round"]) for r in rows] == [1] and all(int(r["failed"]) == 0 for r in rows)
    assert json.loads((run / "status.json").read_text())["status"] == "completed"


GUIDE = Path(__file__).parents[2] / "docs" / "flower.md"


def guide_blocks() -> dict[str, str]:
    """docs/flower.md's runnable blocks: ``<!-- guide: NAME -->`` before a bash block."""
    import re

    found = re.findall(r"<!-- guide: (\S+) -->\n```bash\n(.*?)```", GUIDE.read_text(), re.S)
    return dict(found)


def _listening(port: int, proc, log: Path, wait: float = 120.0) -> None:
    import socket

    end = time.monotonic() + wait
    while time.monotonic() < end:
        assert proc.poll() is None, log.read_text()[-2000:]
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.3)
    raise AssertionError(f"nothing listens on port {port}: {log.read_text()[-2000:]}")


def test_the_guide_runs_as_written(tmp_path):
    """docs/flower.md's *Step 2: several machines*, block by block as written, on this
    machine (SERVER=127.0.0.1, free ports, one Runtime API port per node): export
    and app, certificates, the SuperLink with TLS and SuperNode authentication,
    the CLI connection, ssh-keygen keys registered with the SuperLink, two nodes
    with their workers, `flwr run --stream` (one line per round), `flwr ls`,
    `fedcluster flower status`; then the insecure SuperLink and connection. The run
    directory equals the simulator's run of the same config (to float rounding)."""
    import subprocess
    import sys

    from fedcluster.config.schema import dump_config
    from fedcluster.flower.launcher import free_port

    blocks = guide_blocks()
    assert set(blocks) == {
        "prepare",
        "certs",
        "superlink",
        "connection",
        "key",
        "register",
        "supernode",
        "run",
        "status",
        "insecure-superlink",
        "insecure-connection",
    }
    config = _config(["fedavg", "ifca"], rounds=2)
    (tmp_path / "my.yaml").write_text(dump_config(config))
    run = tmp_path / "runs" / "my-run"
    home = tmp_path / "home"
    base = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(sys.path),
        "VENV": sys.prefix,
        "SERVER": "127.0.0.1",
        "PORT": str(free_port()),
        "RUN": str(run),
        "FLWR_HOME": str(home / "cli"),
    }
    procs: list = []

    def sh(name: str, background: bool = False, **env: str):
        args = ["bash", "-eu", "-o", "pipefail", "-c", blocks[name]]
        full = {**base, **env}
        if background:
            log = tmp_path / f"{name}-{env.get('K', '')}.log"
            f = open(log, "ab")  # noqa: SIM115 -- closed with the test's tmp_path
            proc = subprocess.Popen(
                args, env=full, cwd=tmp_path, stdout=f, stderr=f, start_new_session=True
            )
            procs.append(proc)
            return proc, log
        done = subprocess.run(
            args, env=full, cwd=tmp_path, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, f"{name}: {done.stdout[-3000:]}{done.stderr[-3000:]}"
        return done.stdout + done.stderr

    try:
        sh("prepare")
        sh("certs")
        proc, log = sh("superlink", background=True, FLWR_HOME=str(home / "superlink"))
        _listening(int(base["PORT"]), proc, log)
        sh("connection")
        nodes = []
        for k in (0, 1):
            sh("key", K=str(k))
            assert "registered successfully" in sh("register", K=str(k))
            data = tmp_path / "export" / f"node-{k}"
            nodes.append(
                sh(
                    "supernode",
                    background=True,
                    K=str(k),
                    DATA=str(data),
                    NODE_PORT=str(free_port()),
                    FLWR_HOME=str(home / f"node-{k}"),
                )
            )
        end = time.monotonic() + 180
        while not all("SuperNode ID" in lg.read_text() for _, lg in nodes):
            assert time.monotonic() < end, [lg.read_text()[-1000:] for _, lg in nodes]
            time.sleep(0.5)
        stream = sh("run")
        for algorithm in ("fedavg", "ifca"):
            for r in (1, 2):
                assert f"fedcluster: {algorithm} seed 0 round {r}/2: accuracy" in stream
        assert "replies 24/24" in stream
        assert f"{run}: completed" in sh("status")
        _assert_same_as_simulator(config, run, tmp_path)
        insecure_port = str(free_port())
        proc, log = sh(
            "insecure-superlink",
            background=True,
            PORT=insecure_port,
            FLWR_HOME=str(home / "insecure"),
        )
        _listening(int(insecure_port), proc, log)
        sh("insecure-connection", PORT=insecure_port)
    finally:
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

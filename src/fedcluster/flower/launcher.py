"""``fedcluster flower local``: a real Flower deployment on this machine's loopback.

The first step of a deployment (docs/flower.md), with the processes a real
one has: the experiment's data is exported to node-local files
(:mod:`fedcluster.flower.export`), each node's folder holding only its own
clients; a ``flower-superlink`` and N ``flower-supernode`` processes start on
127.0.0.1 (free ports, each node with ``--node-config data=<its folder>``);
the Flower App (:mod:`fedcluster.flower.app`) is submitted with ``flwr run``;
the run directory's rows are printed as they arrive; and every process is
stopped afterwards -- also on Ctrl-C, an exception or interpreter exit
(process groups; the SuperExec processes Flower detaches watch their parent
and exit with it).

``--tls`` makes a throwaway CA and a certificate for 127.0.0.1/localhost
(``cryptography``); the SuperLink serves HTTPS and the nodes and ``flwr``
verify it against the CA. ``--auth`` turns on SuperNode authentication:
each node gets an EC P-384 key pair (OpenSSH format, what Flower 1.42 reads),
its public key is registered with ``flwr supernode register`` before the node
starts, and the SuperLink (``--enable-supernode-auth``) refuses unregistered
nodes.

``flwr run`` exits 0 even when the ServerApp raised, so success is read from
the run directory: the ServerApp writes ``status.json`` last (completed, or
failed with its one-line reason; ``fedcluster flower status RUN``). Files under
``RUN/deployment/``: ``nodes.json`` (each node's pid, clients, data folder,
log), ``superlink.log``, ``node-K.log``, ``flwr-run.log``, the app folder,
certificates and keys.
"""

from __future__ import annotations

import atexit
import contextlib
import csv
import datetime as dt
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from fedcluster.config.schema import ExperimentConfig
from fedcluster.errors import FedclusterError
from fedcluster.flower.app import STATUS, read_status, write_app
from fedcluster.flower.export import export_federation, spread_clients
from fedcluster.flower.nodedata import write_manifest

CONNECTION = "fedcluster-local"


class DeploymentError(FedclusterError):
    """A process of the local deployment failed to start, or the run failed."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_tls(folder: Path, hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> dict[str, Path]:
    """A throwaway CA and a server certificate signed by it for ``hosts`` (PEM files
    ``ca.crt``, ``ca.key``, ``server.crt``, ``server.key`` in ``folder``)."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedcluster throwaway CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP384R1())
    names: list[x509.GeneralName] = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=2))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    private = serialization.PrivateFormat.TraditionalOpenSSL
    files = {
        "ca.crt": ca.public_bytes(pem),
        "ca.key": ca_key.private_bytes(pem, private, serialization.NoEncryption()),
        "server.crt": cert.public_bytes(pem),
        "server.key": key.private_bytes(pem, private, serialization.NoEncryption()),
    }
    out = {}
    for name, data in files.items():
        (folder / name).write_bytes(data)
        if name.endswith(".key"):
            os.chmod(folder / name, 0o600)
        out[name.split(".")[0] + ("_key" if name.endswith(".key") else "")] = folder / name
    return out  # keys: ca, ca_key, server, server_key


def make_node_key(path: Path) -> tuple[Path, Path]:
    """An EC P-384 key pair for SuperNode authentication: ``path`` (private,
    OpenSSH) and ``path.pub`` (public, OpenSSH)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP384R1())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        )
    )
    os.chmod(path, 0o600)
    pub = path.with_name(path.name + ".pub")
    pub.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        )
    )
    return path, pub


def _tool(name: str) -> str:
    """A Flower executable of this interpreter's environment (else from PATH)."""
    local = Path(sys.executable).parent / name
    if local.exists():
        return str(local)
    found = shutil.which(name)
    if found is None:
        raise DeploymentError(f"{name} not found: pip install 'fedcluster[flower]'")
    return found


def _descendants(pid: int) -> list[int]:
    """Process ids below ``pid`` (Linux /proc; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


@dataclass
class NodeProcess:
    index: int
    clients: list[int]
    data: Path
    log: Path
    port: int
    proc: subprocess.Popen | None = None
    worker: subprocess.Popen | None = None
    command: list[str] = field(default_factory=list)
    """The node's ``flower-supernode`` command line (restart a node with it)."""


@dataclass
class LocalDeployment:
    """A SuperLink and SuperNodes on 127.0.0.1, their files under ``folder``."""

    folder: Path
    tls: bool = False
    auth: bool = False
    isolation: str = "process"
    """``process``: one long-lived ClientApp worker per node (:mod:`fedcluster.flower.worker`);
    ``subprocess``: Flower's default, a fresh ``flwr-clientapp`` process per message."""
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    procs: list[subprocess.Popen] = field(default_factory=list)
    logs: list[IO] = field(default_factory=list)
    nodes: list[NodeProcess] = field(default_factory=list)
    port: int = 0
    certs: dict[str, Path] = field(default_factory=dict)
    reported: set[int] = field(default_factory=set)
    host: str = "127.0.0.1"
    """The address the SuperLink listens on (``0.0.0.0``: every interface)."""
    places: dict[int, tuple[str, str]] = field(default_factory=dict)
    """Node index -> (network namespace, the SuperLink's host as seen from it): such a
    node and its worker run in that namespace (``ip netns exec``), as on another host."""

    def __post_init__(self) -> None:
        self.folder = Path(self.folder).absolute()
        self.folder.mkdir(parents=True, exist_ok=True)
        bindir = str(Path(sys.executable).parent)
        self.env["PATH"] = bindir + os.pathsep + self.env.get("PATH", "")
        self.env["PYTHONUNBUFFERED"] = "1"
        if self.tls:
            self.certs = make_tls(self.folder / "certs")

    @property
    def dial(self) -> str:
        """The SuperLink's address from this machine's root namespace."""
        return "127.0.0.1" if self.host in ("0.0.0.0", "127.0.0.1") else self.host

    # -- processes ---------------------------------------------------------------------------

    def _env(self, home: str) -> dict[str, str]:
        env = dict(self.env)
        env["FLWR_HOME"] = str(self.folder / "home" / home)
        return env

    def _spawn(self, args: list[str], log: Path, home: str) -> subprocess.Popen:
        f = open(log, "ab")  # noqa: SIM115 -- closed in stop()
        self.logs.append(f)
        proc = subprocess.Popen(
            args,
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self._env(home),
            cwd=self.folder,
            start_new_session=True,  # its own process group: stopped as a whole
        )
        self.procs.append(proc)
        return proc

    def _security(self) -> list[str]:
        return ["--root-certificates", str(self.certs["ca"])] if self.tls else ["--insecure"]

    def start_superlink(self, timeout: float = 120.0) -> None:
        self.port = free_port()
        args = [
            _tool("flower-superlink"),
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--disable-runtime-dependency-installation",
        ]
        if self.tls:
            args += [
                "--ssl-ca-certfile",
                str(self.certs["ca"]),
                "--ssl-certfile",
                str(self.certs["server"]),
                "--ssl-keyfile",
                str(self.certs["server_key"]),
            ]
        else:
            args.append("--insecure")
        if self.auth:
            args.append("--enable-supernode-auth")
        log = self.folder / "superlink.log"
        proc = self._spawn(args, log, "superlink")
        self._wait_listening(proc, self.port, log, timeout)
        self._write_cli_config()

    def _wait_listening(self, proc: subprocess.Popen, port: int, log: Path, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if proc.poll() is not None:
                raise DeploymentError(
                    f"flower-superlink exited with code {proc.returncode}: {last_error(log)}"
                )
            try:
                with socket.create_connection((self.dial, port), timeout=1):
                    return
            except OSError:
                time.sleep(0.2)
        raise DeploymentError(f"flower-superlink did not listen on port {port} in {timeout:g} s")

    def _write_cli_config(self) -> None:
        home = self.folder / "home" / "cli"
        home.mkdir(parents=True, exist_ok=True)
        security = f'root-certificates = "{self.certs["ca"]}"' if self.tls else "insecure = true"
        (home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n'
            f'[superlink.{CONNECTION}]\naddress = "{self.dial}:{self.port}"\n{security}\n'
        )

    def flwr(self, *args: str, log: Path | None = None, timeout: float = 120.0) -> str:
        """Run the ``flwr`` CLI against this deployment's SuperLink; its output."""
        done = subprocess.run(
            [_tool("flwr"), *args],
            env=self._env("cli"),
            cwd=self.folder,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        text = done.stdout + done.stderr
        if log is not None:
            with open(log, "a") as f:
                f.write(text)
        if done.returncode != 0:
            raise DeploymentError(
                f"flwr {' '.join(args[:2])} failed (exit {done.returncode}): "
                + (text.strip().splitlines() or ["no output"])[-1]
            )
        return text

    def start_node(self, index: int, clients: list[int], data: Path) -> NodeProcess:
        node = NodeProcess(index, clients, data, self.folder / f"node-{index}.log", free_port())
        netns, superlink = self.places.get(index, ("", self.dial))
        inside = ["ip", "netns", "exec", netns] if netns else []
        args = [
            *inside,
            _tool("flower-supernode"),
            *self._security(),
            "--superlink",
            f"{superlink}:{self.port}",
            "--port",
            str(node.port),
            "--node-config",
            f'data="{data}"',
        ]
        if self.auth:
            key, pub = make_node_key(self.folder / "keys" / f"node-{index}")
            self.flwr("supernode", "register", str(pub), CONNECTION, log=self.folder / "auth.log")
            args += ["--auth-supernode-private-key", str(key)]
        if self.isolation == "process":
            args += ["--isolation", "process"]
        node.command = args
        node.proc = self._spawn(args, node.log, f"node-{index}")
        if self.isolation == "process":
            worker = [
                *inside,
                sys.executable,
                "-m",
                "fedcluster.flower.worker",
                "--runtime-api-address",
                f"127.0.0.1:{node.port}",
                "--insecure",
                "--parent-pid",
                str(node.proc.pid),
            ]
            node.worker = self._spawn(worker, node.log.with_suffix(".worker.log"), f"node-{index}")
        self.nodes.append(node)
        return node

    def wait_connected(self, timeout: float = 120.0) -> None:
        """Wait until every node has registered with the SuperLink (its log names its
        SuperNode ID), so that the ServerApp's discovery finds them all."""
        end = time.monotonic() + timeout
        waiting = list(self.nodes)
        while waiting:
            for proc, name, log in self._named():
                if proc.poll() is not None:
                    raise DeploymentError(
                        f"{name} exited with code {proc.returncode}: {last_error(log)}"
                    )
            waiting = [n for n in waiting if "SuperNode ID" not in _read(n.log)]
            if waiting and time.monotonic() > end:
                raise DeploymentError(
                    f"node {waiting[0].index} did not connect in {timeout:g} s: "
                    f"{last_error(waiting[0].log)}"
                )
            if waiting:
                time.sleep(0.2)

    def write_nodes_json(self) -> Path:
        path = self.folder / "nodes.json"
        info = {
            "superlink": {
                "address": f"{self.host}:{self.port}",
                "pid": self.procs[0].pid if self.procs else None,
                "log": str(self.folder / "superlink.log"),
                "tls": self.tls,
                "auth": self.auth,
            },
            "nodes": [
                {
                    "node": n.index,
                    "pid": n.proc.pid if n.proc else None,
                    "worker_pid": n.worker.pid if n.worker else None,
                    "clients": n.clients,
                    "data": str(n.data),
                    "log": str(n.log),
                    "runtime_port": n.port,
                    "command": n.command,
                    "env": {"FLWR_HOME": self._env(f"node-{n.index}")["FLWR_HOME"]},
                }
                for n in self.nodes
            ],
        }
        path.write_text(json.dumps(info, indent=1) + "\n")
        return path

    def check_alive(self, emit: Callable[[str], None] | None = None) -> None:
        """Raise when the SuperLink exited; report (once) a node or worker that exited:
        a lost node is the deployment's everyday failure, which the run survives
        (``deployment.round_timeout``, ``min_replies``) or reports itself."""
        named = self._named()
        superlink, name, log = named[0]
        if superlink.poll() is not None:
            raise DeploymentError(
                f"{name} exited with code {superlink.returncode}: {last_error(log)}"
            )
        for proc, name, log in named[1:]:
            if proc.poll() is not None and proc.pid not in self.reported:
                self.reported.add(proc.pid)
                if emit is not None:
                    emit(f"fedcluster: {name} exited with code {proc.returncode} ({log})")

    def _named(self) -> list[tuple[subprocess.Popen, str, Path]]:
        out = [(self.procs[0], "flower-superlink", self.folder / "superlink.log")]
        out += [(n.proc, f"node {n.index}", n.log) for n in self.nodes if n.proc]
        out += [
            (n.worker, f"node {n.index}'s ClientApp worker", n.log.with_suffix(".worker.log"))
            for n in self.nodes
            if n.worker
        ]
        return out

    def stop(self, grace: float = 5.0) -> None:
        """Stop every process started here (and what they started), then close the logs."""
        victims: list[int] = []
        for proc in self.procs:
            if proc.poll() is None:
                victims += _descendants(proc.pid)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        end = time.monotonic() + grace
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
        for pid in victims:  # detached helpers (SuperExec, app processes)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        for f in self.logs:
            f.close()
        self.logs.clear()
        self.procs.clear()


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b.*")


def last_error(log: Path) -> str:
    """The most telling line of a Flower log: its last Python exception line, else
    its last ERROR line, else its last line."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return f"(no log at {log})"
    for ln in reversed(lines):
        if _EXCEPTION.match(ln):
            return ln
    for ln in reversed(lines):
        if "ERROR" in ln:
            return ln
    return lines[-1] if lines else f"(empty log {log})"


def place_node_data(export: Path, blocks: list[list[int]], dest: Path) -> list[Path]:
    """Move the exported client files into ``dest/node-K/``, one folder per block,
    each with a manifest listing only its clients; the folders."""
    from fedcluster.flower.nodedata import read_manifest

    manifest = read_manifest(export)
    folders = []
    for k, block in enumerate(blocks):
        folder = dest / f"node-{k}"
        folder.mkdir(parents=True, exist_ok=True)
        for c in block:
            name = manifest.clients[c]["file"]
            os.replace(export / name, folder / name)
        write_manifest(manifest, folder, block)
        folders.append(folder)
    return folders


class _Progress(threading.Thread):
    """Prints the run directory's new metrics rows while the run lasts."""

    def __init__(self, metrics: Path, emit: Callable[[str], None]):
        super().__init__(daemon=True)
        self.metrics, self.emit, self.done = metrics, emit, threading.Event()
        self.seen = 0

    def run(self) -> None:
        while not self.done.wait(1.0):
            self.poll()
        self.poll()

    def poll(self) -> None:
        try:
            with open(self.metrics, newline="") as f:
                rows = list(csv.DictReader(f))
        except (OSError, csv.Error):
            return
        for r in rows[self.seen :]:
            acc = r.get("accuracy") or r.get("test_accuracy") or ""
            self.emit(
                f"  {r.get('algorithm')} seed {r.get('seed')} round {r.get('round')}: "
                f"accuracy {acc}"
            )
        self.seen = max(self.seen, len(rows))


def _export_blocks(
    config: ExperimentConfig, folder: Path, n_nodes: int
) -> tuple[list[list[int]], list[Path]]:
    """Export the federation under ``folder``: each node's block of clients and the data
    folder holding only its files (the manifest beside them, for the server)."""
    export = folder / "export"
    manifest = export_federation(config, export)
    blocks = spread_clients(len(manifest.clients), n_nodes)
    data = place_node_data(export, blocks, folder / "data")
    shutil.move(str(export / "manifest.json"), folder / "manifest.json")
    export.rmdir()
    return blocks, data


def run_local(
    config: ExperimentConfig,
    out: str | Path,
    n_nodes: int,
    tls: bool = False,
    auth: bool = False,
    timeout: float | None = None,
    isolation: str = "process",
    emit: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
    host: str = "127.0.0.1",
    places: dict[int, tuple[str, str]] | None = None,
) -> Path:
    """Run ``config`` on a SuperLink and ``n_nodes`` SuperNodes on loopback, writing
    the run directory ``out`` (with ``out/deployment/``); raises
    :class:`DeploymentError` when the run failed. ``timeout`` bounds the run (seconds).
    ``host`` and ``places`` (:class:`LocalDeployment`) put nodes in network namespaces
    of their own: several hosts on one machine."""
    out = Path(out).absolute()
    if out.exists() and any(out.iterdir()):
        raise FedclusterError(f"run directory {out} is not empty; choose another --out")
    if len(config.seeds) != 1:
        raise FedclusterError(
            f"seeds: {config.seeds}; node-local data is exported for one seed, "
            "run one seed per deployment (--seed S)"
        )
    folder = out / "deployment"
    emit(f"fedcluster: exporting {config.name}'s data for {n_nodes} nodes -> {folder}")
    blocks, data = _export_blocks(config, folder, n_nodes)
    app = write_app(folder / "app", config, out=str(out), manifest=folder / "manifest.json")

    dep = LocalDeployment(
        folder, tls=tls, auth=auth, isolation=isolation, host=host, places=dict(places or {})
    )
    stopped = False

    def stop(*_: object) -> None:
        nonlocal stopped
        if not stopped:
            stopped = True
            dep.stop()

    def interrupted(*_: object) -> None:
        raise KeyboardInterrupt

    atexit.register(stop)
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, interrupted) if main else None
    try:
        dep.start_superlink()
        emit(
            f"fedcluster: SuperLink on {host}:{dep.port} "
            f"(tls={tls}, auth={auth}, ClientApp isolation={isolation})"
        )
        for k, (block, path) in enumerate(zip(blocks, data, strict=True)):
            dep.start_node(k, block, path)
        dep.write_nodes_json()
        dep.wait_connected()
        emit(f"fedcluster: {n_nodes} SuperNodes connected; nodes: {folder / 'nodes.json'}")
        _submit_and_wait(dep, app, out, timeout, emit)
    finally:
        stop()
        atexit.unregister(stop)
        if main:
            signal.signal(signal.SIGTERM, previous)
    return out


def _submit_and_wait(
    dep: LocalDeployment,
    app: Path,
    out: Path,
    timeout: float | None,
    emit: Callable[[str], None],
) -> None:
    log = dep.folder / "flwr-run.log"
    progress = _Progress(out / "metrics.csv", emit)
    progress.start()
    start = time.monotonic()
    with open(log, "ab") as f:
        run = subprocess.Popen(
            [_tool("flwr"), "run", str(app), CONNECTION, "--stream"],
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=dep._env("cli"),
            cwd=dep.folder,
            start_new_session=True,
        )
        dep.procs.append(run)
        try:
            while run.poll() is None and not (out / STATUS).exists():
                dep.check_alive(emit)
                if timeout is not None and time.monotonic() - start > timeout:
                    raise DeploymentError(
                        f"the run did not finish within {timeout:g} s; logs in {dep.folder}"
                    )
                time.sleep(0.5)
            end = time.monotonic() + 30  # flwr streams the ServerApp's last lines, then exits
            while run.poll() is None and time.monotonic() < end:
                time.sleep(0.5)
        finally:
            progress.done.set()
            progress.join(timeout=5)
    if not (out / STATUS).exists():
        raise DeploymentError(
            f"the ServerApp failed (no {out / STATUS}): "
            f"{last_error(dep.folder / 'flwr-run.log')}; logs in {dep.folder}"
        )
    status = read_status(out)
    if status["status"] != "completed":
        raise DeploymentError(
            f"the ServerApp failed: {status['reason']}; logs in {dep.folder} "
            f"(`fedcluster flower status {out}`)"
        )
    emit(f"fedcluster: run finished in {time.monotonic() - start:.1f} s -> {out}")

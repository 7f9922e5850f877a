"""The distributed backend: a federation's clients sharded over torch.distributed workers.

``backend: distributed`` (``fedcluster run --backend distributed --workers N``)
runs the client computations of every job on N worker processes, as
pfl-research's simulator splits a round's clients over processes, GPUs and
machines through torch.distributed ("pfl-research: simulation framework for
accelerating research in Private Federated Learning", Granqvist et al., 2024,
Section 3, distributed simulations; its workers are balanced by client data
size). The driver (rank 0) keeps everything of the server: the algorithm, the
channel (local DP, rejection, byte counting, :mod:`fedcluster.protocol.channel`)
and the run directory. The worker ranks 1..N hold their shard of the clients
and run the batched :class:`~fedcluster.engine.simulator.Simulator` on it.

- **Sharding** (:func:`shard_clients`): greedy largest-first by training-data
  size, each client to the worker with the least data so far.
- **Data**: the driver sends each worker its shard's data once per job (and
  again after a drift changed it, :attr:`Federation.revisions`), with the model
  and the simulator's options: whatever built the federation (a preset, a
  factory, an object passed from Python, label flips) the workers compute on the
  same samples.
- **Requests**: :meth:`DistributedBackend.run` sends every worker the request of
  its clients among those asked (per-client rows that repeat, such as IFCA's start
  rows, as their distinct rows and an index) (the computation by its registered name and its
  module, which the worker imports: a plugin computation runs unchanged), the
  workers compute at once, and the replies are put back in the clients' order.
  Each worker's simulator names its clients by their ids in the run
  (``client_ids``), so batch plans and noise are drawn from (seed, purpose,
  round, client) as in one process.
- **A lost worker** (its process died, its connection closed): its clients move
  to the workers left (largest first, each to the least loaded; ``moved``
  events in ``events.csv``) and the request is asked again there, so the run
  goes on with the same numbers (a client's random streams do not depend on
  where it runs). Only FedBN's per-client layers (``model.buffers: local``), which
  a worker keeps, restart from the global model for the moved clients and the
  clients of the workers that take them.

The transport is gloo's point-to-point object messages (``send_object_list``):
CPU tensors, any network. The driver starts the workers itself on this machine
(spawned processes, a free port on 127.0.0.1 unless ``address``); under
``torchrun`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set) rank 0
is the driver and every other rank serves (:func:`serve`), on as many machines as
torchrun or Slurm starts.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import socket
import traceback
from dataclasses import dataclass, replace
from datetime import timedelta
from multiprocessing import get_context
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from fedcluster.config.schema import ExperimentConfig
from fedcluster.data.federation import Federation
from fedcluster.engine.clock import ClientClock
from fedcluster.engine.flat import ParamLayout
from fedcluster.engine.modes import LossFn, resolve_loss
from fedcluster.engine.simulator import Simulator
from fedcluster.errors import ConfigError, FedclusterError
from fedcluster.experiment.jobs import check_sendable
from fedcluster.protocol.backend import FederationView
from fedcluster.protocol.channel import subset_request
from fedcluster.protocol.computation import ClientComputation, Request, Returned, lookup_computation

log = logging.getLogger(__name__)

TIMEOUT = timedelta(minutes=30)
"""How long a message waits for its peer (a worker computing a large request)."""

DRIVER = 0


def shard_clients(sizes: np.ndarray, workers: int) -> list[np.ndarray]:
    """Each worker's clients (sorted): greedy largest-first by training-data size, each
    client to the worker holding the least data so far (the lowest rank on ties)."""
    order = sorted(range(len(sizes)), key=lambda c: (-int(sizes[c]), c))
    load = [0] * workers
    shards: list[list[int]] = [[] for _ in range(workers)]
    for c in order:
        w = min(range(workers), key=lambda i: (load[i], i))
        shards[w].append(c)
        load[w] += int(sizes[c])
    return [np.array(sorted(s), dtype=np.int64) for s in shards]


def torchrun_rank() -> int | None:
    """This process's rank when torchrun (or Slurm through it) started it, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"])
    return None


class _Pickler(pickle.Pickler):
    """Pickles a message but for its plain tensors, which travel apart as raw bytes."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is not torch.Tensor:
            return None
        self.tensors.append(obj.detach().cpu().contiguous())
        return (len(self.tensors) - 1, obj.dtype, tuple(obj.shape))


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor]) -> None:
        super().__init__(file)
        self.tensors = tensors

    def persistent_load(self, pid: Any) -> torch.Tensor:
        index, dtype, shape = pid
        return self.tensors[index].view(dtype).reshape(shape)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _send(obj: Any, rank: int) -> None:
    """Send ``obj`` to ``rank``: its pickle without its tensors, their sizes, then each
    tensor's bytes straight from its memory (no pickling of the large arrays)."""
    buffer = io.BytesIO()
    pickler = _Pickler(buffer)
    pickler.dump(obj)
    sizes = [t.numel() * t.element_size() for t in pickler.tensors]
    dist.send_object_list([(buffer.getvalue(), sizes)], dst=rank)
    for t, n in zip(pickler.tensors, sizes, strict=True):
        if n:
            dist.send(_bytes_of(t), dst=rank)


def _recv(rank: int) -> Any:
    box: list[Any] = [None]
    dist.recv_object_list(box, src=rank)
    data, sizes = box[0]
    tensors = []
    for n in sizes:
        raw = torch.empty(n, dtype=torch.uint8)
        if n:
            dist.recv(raw, src=rank)
        tensors.append(raw)
    return _Unpickler(io.BytesIO(data), tensors).load()


# ------------------------------------------------------------------- workers
@dataclass
class _Shard:
    """What a worker holds for the job running now."""

    job: int
    simulator: Simulator


def serve() -> None:
    """A worker's loop (ranks 1..N): hold the shard the driver sends, run the computations
    it asks for on it, until it says stop. Joins the process group first (torchrun's
    environment, or :func:`_spawned_worker`'s)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=TIMEOUT)
    shard: _Shard | None = None
    try:
        while True:
            message = _recv(DRIVER)
            kind = message[0]
            if kind == "stop":
                return
            if kind == "shard":
                _, job, options = message
                shard = _Shard(job, _simulator(**options))
                continue
            _, job, name, module, positions, request = message
            assert kind == "run" and shard is not None and shard.job == job
            request = _expand_rows(request)
            try:
                computation = lookup_computation(name, module)
                returned = shard.simulator.run(computation, positions, request)
                _send(("ok", returned.fields, shard.simulator.seconds), DRIVER)
            except Exception as exc:  # the driver raises it: the same as in one process
                text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
                _send(("error", text, 0.0), DRIVER)
    finally:
        dist.destroy_process_group()


def _simulator(
    model: nn.Module,
    federation: Federation,
    seed: int,
    client_ids: np.ndarray,
    options: dict[str, Any],
    loss: LossFn | None,
) -> Simulator:
    return Simulator(model, federation, seed=seed, client_ids=client_ids, loss=loss, **options)


def _spawned_worker(rank: int, world: int, address: str, threads: int) -> None:
    """A worker process the driver started on this machine."""
    torch.set_num_threads(threads)
    host, port = address.rsplit(":", 1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://{host}:{port}", rank=rank, world_size=world, timeout=TIMEOUT
    )
    serve()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -------------------------------------------------------------------- driver
class WorkerGroup:
    """The driver's side of the process group: the workers' ranks, which are lost."""

    def __init__(self, workers: int, address: str | None) -> None:
        self.processes: list[Any] = []
        if torchrun_rank() is not None:  # torchrun started every rank: join its group
            if not dist.is_initialized():
                dist.init_process_group("gloo", timeout=TIMEOUT)
        else:
            address = address or f"127.0.0.1:{_free_port()}"
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit():
                raise ConfigError(f"address: {address!r} is not HOST:PORT")
            world = workers + 1
            threads = max(1, len(os.sched_getaffinity(0)) // workers)
            context = get_context("spawn")
            for rank in range(1, world):
                p = context.Process(
                    target=_spawned_worker, args=(rank, world, address, threads), daemon=True
                )
                p.start()
                self.processes.append(p)
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://{host}:{port}",
                rank=DRIVER,
                world_size=world,
                timeout=TIMEOUT,
            )
        if dist.get_world_size() < 2:
            raise FedclusterError("backend: distributed needs at least one worker rank")
        self.ranks = list(range(1, dist.get_world_size()))
        self.lost: dict[int, str] = {}
        self.jobs = 0

    @property
    def alive(self) -> list[int]:
        return [r for r in self.ranks if r not in self.lost]

    def exited(self, rank: int) -> int | None:
        """The exit code of a worker process this group started, once it has ended (None
        while it runs, and for ranks started by torchrun)."""
        if rank > len(self.processes):
            return None
        return self.processes[rank - 1].exitcode

    def send(self, rank: int, message: Any) -> bool:
        """Send ``message`` to a live worker; False (and the worker lost) when it is gone.

        A worker process of this group that has ended is lost before anything is sent: a
        send to a peer killed between two messages may otherwise wait for the transport's
        timeout (``TIMEOUT``) instead of failing."""
        if rank in self.lost:
            return False
        code = self.exited(rank)
        if code is not None:
            self.lose(rank, RuntimeError(f"its process ended (exit code {code})"))
            return False
        try:
            _send(message, rank)
            return True
        except RuntimeError as exc:
            self.lose(rank, exc)
            return False

    def receive(self, rank: int) -> Any | None:
        """A live worker's answer; None (and the worker lost) when it is gone."""
        try:
            return _recv(rank)
        except RuntimeError as exc:
            self.lose(rank, exc)
            return None

    def lose(self, rank: int, exc: BaseException) -> None:
        reason = " ".join(str(exc).split())[:200] or type(exc).__name__
        self.lost[rank] = reason
        log.warning("distributed: worker %d is lost: %s", rank, reason)

    def close(self) -> None:
        for rank in self.alive:
            self.send(rank, ("stop",))
        dist.destroy_process_group()
        for p in self.processes:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


class DistributedFactory:
    """``backend: distributed``: the federation built from the config in the driver, the
    client computations on the workers (the runner's BackendFactory)."""

    name = "distributed"

    def __init__(self, config: ExperimentConfig, loss: LossFn | None = None) -> None:
        check_sendable(
            loss, "loss: the loss function", "define it in a module and name it in train.loss"
        )
        self.config = config
        self.loss = loss
        self.group: WorkerGroup | None = None

    def federation(self, seed: int) -> Federation:
        from fedcluster.data.configured import build_federation_for

        return build_federation_for(self.config, seed)

    def backend(
        self, model: nn.Module, federation: FederationView, seed: int
    ) -> DistributedBackend:
        assert isinstance(federation, Federation)
        if self.group is None:
            self.group = WorkerGroup(self.config.workers, self.config.address)
        cfg = self.config
        options = {
            "group_size": cfg.group_size,
            "local_buffers": cfg.model.buffers == "local",
            "precision": cfg.precision,
            "vmap": cfg.vmap,
        }
        loss = resolve_loss(cfg.train.loss) if self.loss is None else self.loss
        return DistributedBackend(self.group, model, federation, seed, options, loss)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


class DistributedBackend(ClientClock):
    """One job's client computations on the workers (the Backend protocol)."""

    def __init__(
        self,
        group: WorkerGroup,
        model: nn.Module,
        federation: Federation,
        seed: int,
        options: dict[str, Any],
        loss: LossFn | None,
    ) -> None:
        self.group = group
        group.jobs += 1
        self.job = group.jobs
        self.model = model
        self.layout = ParamLayout(model)
        self.federation = federation
        self.seed = seed
        self.options = options
        self.loss = loss
        self.shards: dict[int, np.ndarray] = {}
        """Rank -> the clients it holds (sorted)."""
        self.owner = np.zeros(federation.n_clients, dtype=np.int64)
        """Client -> the rank that holds it."""
        self.position = np.zeros(federation.n_clients, dtype=np.int64)
        """Client -> its position in its worker's shard."""
        self._sent = federation.revisions.copy()
        self._moved: list[tuple[int, str, str]] = []
        ranks = self._alive()
        shards = shard_clients(federation.train_sizes, len(ranks))
        self._send_shards(dict(zip(ranks, shards, strict=True)))

    def _alive(self) -> list[int]:
        ranks = self.group.alive
        if not ranks:
            raise FedclusterError(
                "distributed: every worker is lost ("
                + "; ".join(f"worker {r}: {why}" for r, why in self.group.lost.items())
                + "); `fedcluster resume` continues from the last checkpoint"
            )
        return ranks

    def _send_shards(self, shards: dict[int, np.ndarray]) -> None:
        """Make ``shards`` the workers' clients and send each its shard's data."""
        self.shards.update(shards)
        for rank, clients in shards.items():
            self.owner[clients] = rank
            self.position[clients] = np.arange(len(clients))
        for rank, clients in shards.items():
            options = {
                "model": self.model,
                "federation": self.federation.subset(clients.tolist()),
                "seed": self.seed,
                "client_ids": clients,
                "options": self.options,
                "loss": self.loss,
            }
            self.group.send(rank, ("shard", self.job, options))
        self._sent = self.federation.revisions.copy()

    def _current(self) -> None:
        """Move the clients of lost workers to the workers left (largest first, each to
        the least loaded) and send again the shards whose data changed in place (drift)."""
        lost = [r for r in self.shards if r in self.group.lost]
        changed = {int(r) for r in self.owner[self.federation.revisions != self._sent]}
        if not lost and not changed:
            return
        sizes = self.federation.train_sizes
        alive = self._alive()
        load = {r: int(sizes[self.shards.get(r, [])].sum()) for r in alive}
        grown: dict[int, list[int]] = {}
        for rank in lost:
            for c in sorted(self.shards.pop(rank).tolist(), key=lambda c: (-int(sizes[c]), c)):
                to = min(alive, key=lambda r: (load[r], r))
                load[to] += int(sizes[c])
                grown.setdefault(to, []).append(c)
                why = self.group.lost[rank]
                self._moved.append((c, "moved", f"worker {rank} lost ({why}); now on worker {to}"))
        resend = {r: self.shards.get(r, np.zeros(0, np.int64)) for r in grown.keys() | changed}
        for r, extra in grown.items():
            resend[r] = np.sort(np.concatenate([resend[r], np.array(extra, dtype=np.int64)]))
        self._send_shards({r: resend[r] for r in sorted(resend) if r in alive})

    def end_round(self, rnd: int) -> list[tuple[int, str, str]]:
        """The round's ``moved`` events: clients of a lost worker, moved to another."""
        events, self._moved = self._moved, []
        return events

    def run(
        self, computation: ClientComputation, clients: np.ndarray, request: Request
    ) -> Returned:
        """Each worker runs ``computation`` for its clients among ``clients``; the replies in
        the clients' order. The clients of a worker lost before or while it answers move
        to the workers left and are asked again there: their replies are the same (their
        random streams are derived from the client, not from where it runs)."""
        clients = np.asarray(clients, dtype=np.int64)
        parts: list[tuple[np.ndarray, dict[str, torch.Tensor]]] = []
        pending = np.arange(len(clients))
        request = _factor_rows(request)
        with self.timed():
            while len(pending):
                self._current()
                done = self._ask(computation, clients, request, pending, parts)
                pending = pending[~np.isin(pending, done)]
        return Returned(_in_order(computation, request, parts), np.ones(len(clients), bool))

    def _ask(
        self,
        computation: ClientComputation,
        clients: np.ndarray,
        request: Request,
        pending: np.ndarray,
        parts: list[tuple[np.ndarray, dict[str, torch.Tensor]]],
    ) -> np.ndarray:
        """Send each worker the request of its clients among those at ``pending``, then
        take the answers into ``parts``; the positions answered."""
        owners = self.owner[clients[pending]]
        asked: dict[int, np.ndarray] = {}
        for rank in sorted({int(r) for r in owners}):
            at = pending[owners == rank]
            sub = request if len(at) == len(clients) else subset_request(request, at)
            message = (
                "run",
                self.job,
                computation.name,
                computation.module,
                self.position[clients[at]],
                sub,
            )
            if self.group.send(rank, message):
                asked[rank] = at
        done = []
        for rank, at in asked.items():
            answer = self.group.receive(rank)
            if answer is None:
                continue
            status, value, _ = answer
            if status == "error":
                raise FedclusterError(f"distributed: worker {rank}: {value}")
            parts.append((at, value))
            done.append(at)
        return np.concatenate(done) if done else np.zeros(0, np.int64)


FACTORED = "distributed/factored"
"""A request setting: the own row fields sent as their distinct rows, the rows' index in
``own`` and the distinct rows in ``shared[FACTORED + name]``."""


def _factor_rows(request: Request) -> Request:
    """``request`` with each own float row field [n, d] whose rows repeat (e.g. IFCA's
    start rows, K distinct models for n clients) sent as its distinct rows and an index
    per client: K rows cross to the workers instead of n. Rows are grouped by a
    projection and checked equal before they are replaced, so the worker rebuilds
    exactly the rows asked (:func:`_expand_rows`)."""
    shared, own, factored = dict(request.shared), dict(request.own), []
    for name, rows in request.own.items():
        if not (rows.is_floating_point() and rows.dim() == 2 and len(rows) > 1):
            continue
        probe = torch.randn(rows.shape[1], generator=torch.Generator().manual_seed(0))
        keys = (rows @ probe.to(rows.dtype)).numpy()
        _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
        if 2 * len(first) > len(rows):
            continue
        distinct = rows[torch.as_tensor(first)]
        index = torch.as_tensor(inverse.reshape(-1))
        if not torch.equal(distinct[index], rows):  # a projection collision: send as is
            continue
        shared[FACTORED + name] = distinct
        own[name] = index
        factored.append(name)
    if not factored:
        return request
    return replace(
        request, shared=shared, own=own, settings={**request.settings, FACTORED: factored}
    )


def _expand_rows(request: Request) -> Request:
    """The request :func:`_factor_rows` factored, with its own row fields rebuilt."""
    names = request.settings.get(FACTORED)
    if not names:
        return request
    own = dict(request.own)
    for name in names:
        own[name] = request.shared[FACTORED + name][own[name]]
    shared = {k: v for k, v in request.shared.items() if not k.startswith(FACTORED)}
    settings = {k: v for k, v in request.settings.items() if k != FACTORED}
    return replace(request, shared=shared, own=own, settings=settings)


def _in_order(
    computation: ClientComputation,
    request: Request,
    parts: list[tuple[np.ndarray, dict[str, torch.Tensor]]],
) -> dict[str, torch.Tensor]:
    """The workers' stacked replies ``(positions among those asked, fields)`` as one stack
    in the order of the positions."""
    if not parts:
        return {
            k: torch.empty((0, *f.shape_for(request)), dtype=f.dtype)
            for k, f in computation.reply.items()
        }
    positions = np.concatenate([at for at, _ in parts])
    order = torch.as_tensor(np.argsort(positions, kind="stable"))
    return {k: torch.cat([fields[k] for _, fields in parts])[order] for k in parts[0][1]}

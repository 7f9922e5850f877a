"""The algorithm interface shared by every method and both backends.

Modelled on FedJAX's ``FederatedAlgorithm`` (``init`` + ``apply`` over a small
server state) and pfl-research's split between what the server asks of
clients and what they compute:

- an algorithm is *server logic*: who gets which model, clustering,
  aggregation -- the methods of :class:`Algorithm`;
- what a client computes is a registered client computation
  (:class:`~fedcluster.protocol.computation.ClientComputation`: train, the
  K-model losses, evaluate, JGL's gradient products, CFLGT's trajectory, or
  one an algorithm declares), run for many clients at once by the simulator
  and for one client per node on Flower;
- every request goes through one channel
  (:class:`~fedcluster.protocol.channel.Channel`) that applies failures,
  local DP, rejection of malformed replies and byte counting, so
  ``bytes_up`` / ``bytes_down`` are measured from the payloads.
"""

from __future__ import annotations

import copy
import logging
from abc import ABC, abstractmethod
from dataclasses import MISSING, Field, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, ValidationError
from torch import nn

from fedcluster.algorithms.cluster_count import AutoK, parse_auto
from fedcluster.algorithms.evaluation import own_loss_evaluate
from fedcluster.algorithms.robust import Aggregate, Aggregator
from fedcluster.config.plugins import resolve
from fedcluster.config.schema import AlgorithmSpec, ExperimentConfig, describe_error
from fedcluster.engine.client_computations import EVALUATE, TRAIN
from fedcluster.engine.results import EvalResult
from fedcluster.errors import ConfigError
from fedcluster.protocol.backend import Backend, FederationView
from fedcluster.protocol.batches import LocalTraining
from fedcluster.protocol.channel import Channel, Replies, UpdateBound
from fedcluster.protocol.computation import ClientComputation, Request
from fedcluster.protocol.secure_sum import (
    SECURE_SHARE,
    SecureTotal,
    secure_request,
    start_models,
)

if TYPE_CHECKING:
    from fedcluster.engine.flat import ParamLayout
    from fedcluster.privacy.central import CentralDP
    from fedcluster.privacy.ledger import LocalDP

S = TypeVar("S", bound="State")
P = TypeVar("P", bound="AlgorithmParams")


@dataclass
class State:
    """An algorithm's server state: a dataclass of tensors, arrays, numbers and lists of them.

    Each algorithm declares its own subclass (e.g. ``FedAvgState``). A checkpoint
    stores :meth:`to_record`, which holds only tensors, numbers, strings, None,
    lists and dicts -- what ``torch.load(weights_only=True)`` reads without running
    any code -- and :meth:`from_record` rebuilds the state exactly, so a resumed
    run continues with the same numbers.
    """

    def to_record(self) -> dict[str, Any]:
        stored = {k: _encode(v) for k, v in vars(self).items()}
        return {"type": type(self).__name__, "fields": stored}

    @classmethod
    def from_record(cls: type[S], record: dict[str, Any]) -> S:
        """The state :meth:`to_record` stored.

        Raises:
            ValueError: the record holds another state class, or fields this class
                does not have (or lacks some it needs): a checkpoint written by an
                older fedcluster, named by its first differing field.
        """
        if record.get("type") != cls.__name__:
            raise ValueError(f"checkpoint holds a {record.get('type')}, expected a {cls.__name__}")
        stored = record["fields"]
        known = {f.name for f in fields(cls) if f.init}
        gone = sorted(set(stored) - known)
        if gone:
            raise ValueError(
                f"checkpoint written by an older fedcluster: state field {gone[0]!r} is no "
                f"longer part of a {cls.__name__}"
            )
        missing = sorted(f.name for f in fields(cls) if _required(f) and f.name not in stored)
        if missing:
            raise ValueError(
                f"checkpoint written by an older fedcluster: state field {missing[0]!r} of a "
                f"{cls.__name__} is missing"
            )
        return cls(**{k: _decode(v) for k, v in stored.items()})


def _required(f: Field[Any]) -> bool:
    """Whether dataclass field ``f`` must be given (it has no default)."""
    return f.init and f.default is MISSING and f.default_factory is MISSING


def _encode(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return {"ndarray": torch.from_numpy(np.ascontiguousarray(value).copy())}
    if isinstance(value, list | tuple):
        return [_encode(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, torch.Tensor | int | float | bool | str):
        return value
    raise TypeError(f"server state values are tensors, arrays and numbers, not {type(value)}")


def _decode(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"ndarray"}:
        return value["ndarray"].numpy()
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


log = logging.getLogger("fedcluster")


class AlgorithmParams(BaseModel):
    """Hyperparameters of an algorithm; unknown keys are an error naming the key."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True)
class RoundOutput(Generic[S]):
    """What one round of an algorithm returns (FedJAX's ``apply``: state in, state out).

    ``state`` is a new state object (tensors it did not change may be shared with
    the state the round started from, which the round leaves as it was);
    ``loss`` the participants' sample-weighted mean training loss (NaN when none
    trained); ``diagnostics`` the round's scalars for ``diagnostics.csv``.
    """

    state: S
    loss: float
    diagnostics: dict[str, float] = field(default_factory=dict)


@dataclass
class Exchange:
    """What came back from a round trip: the accepted clients' models after local training.

    ``keep`` is a mask over the clients asked; ``clients``, ``rows`` [m, d] and
    ``loss`` [m] cover the accepted ones, in the order asked.
    """

    keep: np.ndarray
    clients: np.ndarray
    rows: torch.Tensor
    loss: torch.Tensor


@dataclass
class Context:
    """What an algorithm may use: the channel to its clients, local-training defaults,
    seed and initial model.

    Every request to clients goes through :attr:`channel`
    (:class:`~fedcluster.protocol.channel.Channel`: failures, local DP,
    rejection, byte counting); :meth:`exchange` is its shorthand for local
    training, :meth:`ask` for any client computation.

    Dynamic federations (:mod:`fedcluster.experiment.scenario`). Before every round the
    runner sets the clients that are ``present`` (joined and not departed:
    the federation of that round, evaluated by :meth:`Algorithm.evaluate`),
    ``available`` (present and reachable: the runner selects among them, and
    an algorithm that contacts clients on its own -- a clustering round, a
    cold start -- contacts only these) and ``failing`` (they receive what the
    server sends but never reply). All clients are present and available, and
    none fails, unless told otherwise.
    """

    channel: Channel
    """Every request to clients goes through it (failures, local DP, rejection, bytes)."""
    train: LocalTraining
    """The local-training defaults of the config's ``train`` (lr, epochs, batch size, mu, ...)."""
    seed: int
    """The job's seed; derive randomness from it (e.g. ``random_state=ctx.seed``)."""
    init_row: torch.Tensor
    """The initial model as a flat row [d] (CPU float32), the same for every algorithm."""
    model_choice: str = "assigned"
    """Test protocol (:mod:`fedcluster.algorithms.evaluation`): ``assigned`` or ``own_loss``."""
    aggregate: Aggregate = field(default_factory=Aggregator)
    """The rule by which every algorithm averages client models (plain mean by default;
    :mod:`fedcluster.algorithms.robust`), per cluster where there are clusters."""
    compare: str = "parameters"
    """What clustering compares (config ``model.compare``): the trainable
    ``parameters`` of a row, or the whole ``row`` with its float buffers."""
    central: CentralDP | None = None
    """Central DP (:mod:`fedcluster.privacy.central`): then also :attr:`aggregate`; it sees
    every accepted training upload and holds the clients' noisy sketches."""
    secure: bool = False
    """Secure aggregation under central DP (``privacy.secure_aggregation``): the server
    receives only sums of the devices' contributions (:meth:`secure_total`)."""

    @classmethod
    def for_backend(
        cls,
        backend: Backend,
        train: LocalTraining,
        seed: int,
        init_row: torch.Tensor,
        privacy: LocalDP | None = None,
        bound: UpdateBound | None = None,
    ) -> Context:
        """A context whose channel reaches ``backend``'s clients; with local DP
        (``privacy``) its uploads are released and record level trains with DP-SGD."""
        channel = Channel(backend, seed, privacy, bound=bound or UpdateBound())
        if privacy is not None:
            train = privacy.local_training(train)
        return cls(channel=channel, train=train, seed=seed, init_row=init_row)

    @property
    def federation(self) -> FederationView:
        """The clients' data as the server may see it (sizes, shapes, number of classes)."""
        return self.channel.backend.federation

    @property
    def present(self) -> np.ndarray:
        """Boolean mask [n_clients]: the clients of this round's federation."""
        return self.channel.present

    @property
    def available(self) -> np.ndarray:
        """Boolean mask [n_clients]: present clients the server can reach this round."""
        return self.channel.available

    @property
    def rejected(self) -> list[int]:
        """Ids of the clients whose replies the channel rejected so far (malformed updates)."""
        return self.channel.rejected

    @property
    def privacy(self) -> LocalDP | None:
        """Local DP of the run (``privacy.mode: local``), or ``None``."""
        return self.channel.privacy

    def available_clients(self) -> np.ndarray:
        """Ids of the clients the server can reach this round."""
        return np.flatnonzero(self.available)

    @property
    def n_clients(self) -> int:
        """Number of clients of the federation (client ids are ``0 .. n_clients - 1``)."""
        return self.federation.n_clients

    @property
    def n_classes(self) -> int:
        """Number of classes: the model's output size."""
        return self.federation.n_classes

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one input sample (without the batch dimension)."""
        return self.federation.input_shape

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Each named parameter's shape, then each float buffer's, in row order (e.g.
        ``{"net.0.weight": (64, 784), ...}``): a layer's width is its weight's first
        dimension; :attr:`layout` maps the names to slices of a row."""
        layout = self.layout
        return {s.name: s.shape for s in layout.slots + layout.buffer_slots}

    @property
    def layout(self) -> ParamLayout:
        """Where each named parameter and float buffer lives in a row."""
        return self.channel.backend.layout

    @property
    def dim(self) -> int:
        """The row's width: parameters and float buffers (:mod:`fedcluster.engine.flat`)."""
        return self.layout.dim

    def parameter_part(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``[..., d]`` with their float buffers set to 0 (a copy where there are any):
        what a gradient, which covers the parameters only, is compared with."""
        layout = self.channel.backend.layout
        if layout.param_dim == layout.dim:
            return rows
        out = rows.clone()
        out[..., layout.param_dim :] = 0.0
        return out

    def compared(self, rows: torch.Tensor) -> torch.Tensor:
        """The part of rows ``[..., d]`` that clustering and distances compare: the
        trainable parameters (a view), or the whole row with ``compare: row``."""
        if self.compare == "row":
            return rows
        return self.channel.backend.layout.params(rows)

    @property
    def train_sizes(self) -> np.ndarray:
        """Training samples of each client [n_clients] (the weights of a FedAvg mean)."""
        return self.federation.train_sizes

    def fresh_rows(self, k: int, purpose: str) -> torch.Tensor:
        """``k`` independently initialised models [k, d], derived from ``(seed, purpose)``."""
        model = self.channel.backend.model
        return torch.stack([init_row(model, self.seed, purpose, i) for i in range(k)])

    def local(self, **changes: Any) -> LocalTraining:
        """The local-training defaults with some fields changed (e.g. ``mu``)."""
        return replace(self.train, **changes)

    def ask(
        self,
        computation: ClientComputation,
        clients: np.ndarray,
        request: Request,
        rnd: int,
        **options: Any,
    ) -> Replies:
        """Run ``computation`` on ``clients`` through the channel (:meth:`Channel.ask`)."""
        return self.channel.ask(computation, clients, request, rnd, **options)

    def exchange(
        self,
        clients: np.ndarray,
        start: torch.Tensor,
        rnd: int,
        cfg: LocalTraining | None = None,
        purpose: str = "train",
        ints: int = 0,
        held: bool = False,
    ) -> Exchange:
        """Clients receive ``start`` ([n, d] or [d]), train, and upload their models.

        Counts the start row down per client (unless ``held``: the clients already
        received it this round), ``dim`` floats plus ``ints`` integers up per
        replying client. Failing clients neither train nor upload; malformed
        updates are rejected (:class:`~fedcluster.protocol.channel.Channel`).
        """
        clients = np.asarray(clients, dtype=np.int64)
        request = self.training_request(start, rnd, cfg, purpose, held)
        replies = self.channel.ask(TRAIN, clients, request, rnd, metadata_ints=ints)
        kept = start if start.dim() == 1 else start[torch.as_tensor(replies.keep)]
        self.observe_uploads(replies.clients, kept, replies["row"])
        return Exchange(replies.keep, replies.clients, replies["row"], replies["loss"])

    def training_request(
        self,
        start: torch.Tensor,
        rnd: int,
        cfg: LocalTraining | None = None,
        purpose: str = "train",
        held: bool = False,
    ) -> Request:
        """The request of :data:`TRAIN` from ``start`` ([d] for all, or [n, d] one each)."""
        payload = {"start": start}
        return Request(
            shared=payload if start.dim() == 1 else {},
            own=payload if start.dim() == 2 else {},
            settings={"train": cfg or self.train, "round": rnd, "purpose": purpose},
            held=frozenset({"start"}) if held else frozenset(),
        )

    def observe_uploads(self, clients: np.ndarray, start: torch.Tensor, rows: torch.Tensor) -> None:
        """Under central DP, enter accepted training uploads ``rows`` [n, d] trained from
        ``start`` ([d] or [n, d]) in the ledger, the adaptive clip and the sketches
        (:meth:`CentralDP.observe`); every training upload of an algorithm passes here."""
        if self.central is not None and len(clients):
            self.central.observe(clients, start, rows)

    def secure_total(
        self, computation: ClientComputation, clients: np.ndarray, request: Request, rnd: int
    ) -> tuple[torch.Tensor, SecureTotal]:
        """Ask ``clients`` to train by ``computation`` from ``request``'s start row (or
        choosing among its K models), and receive only the sum of their contributions
        (:mod:`fedcluster.protocol.secure_sum`): each cluster's clipped sum and size. The
        contributors enter the central DP ledger and the adaptive clip's count. Returns
        the K models [K, d] released from the sums (the trusted server's noise,
        :meth:`SecureTotal.released`) and the sums."""
        central = self.central
        if central is None:
            raise ValueError("secure aggregation needs central DP (privacy.mode: central)")
        asked = secure_request(computation, request, central.clip)
        counted, total = self.channel.ask_summed(SECURE_SHARE, clients, asked, rnd)
        models = start_models(asked)
        result = SecureTotal.from_vector(total, *models.shape)
        central.observe_sum(counted, result.unclipped, len(counted))
        return result.released(models, central.release_sum), result

    def clustering_view(
        self, clients: np.ndarray, origins: torch.Tensor, ends: torch.Tensor, who: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What a clustering step compares of ``clients``' updates (from ``origins`` to
        ``ends``, [n, d]): the updates themselves, or under central DP with sketches
        each client's mean noisy sketch [n, k] from a common zero origin; without
        sketches the part of the rows that clustering compares (:meth:`compared`)."""
        if self.central is None:
            return self.compared(origins), self.compared(ends)
        if self.central.sketch_matrix is None:
            raise ConfigError(
                f"privacy.mode central: {who} clusters on individual updates, which central DP "
                "does not cover; set privacy.sketch_dim (e.g. 256) to cluster on noisy sketches "
                "(DCFL and FedGroup: or choice_on_device: true, the devices choose)"
            )
        sketches = self.central.sketches(np.asarray(clients, dtype=np.int64))
        return torch.zeros_like(sketches), sketches

    def public_view(
        self, origins: torch.Tensor, ends: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Vectors the server holds (e.g. cluster directions, [n, d]) in the space of
        :meth:`clustering_view`: unchanged, or projected like a sketch (no noise)."""
        if self.central is None or self.central.sketch_matrix is None:
            return self.compared(origins), self.compared(ends)
        projected = self.central.project(ends - origins)
        return torch.zeros_like(projected), projected

    def evaluate(
        self, clients: np.ndarray, rows: torch.Tensor, model_of_client: np.ndarray, rnd: int
    ) -> EvalResult:
        """Test accuracy of ``rows[model_of_client[i]]`` on client ``clients[i]`` (a measurement).

        Clients whose evaluation reply was rejected are left out.
        """
        request = Request(
            shared={"models": rows},
            own={"model_index": torch.as_tensor(np.asarray(model_of_client, dtype=np.int64))},
            settings={"split": "test"},
            pick={"model": ("models", "model_index")},
        )
        replies = self.channel.ask(EVALUATE, clients, request, rnd, measurement=True)
        return EvalResult(
            replies["correct"].numpy(),
            replies["count"].numpy(),
            replies["loss_sum"].numpy(),
            replies.clients,
        )


def init_row(model: nn.Module, seed: int, purpose: str, index: int = 0) -> torch.Tensor:
    """A freshly initialised flat parameter row, derived from ``(seed, purpose, index)``.

    Every submodule's ``reset_parameters`` runs under a forked global RNG
    seeded from the derivation, so the result depends on nothing else: on a
    CPU copy of the model, so that a model the simulator moved to a GPU draws
    the same row from the CPU generator, and the server gets a CPU row
    (:mod:`fedcluster.engine.device`).
    """
    from fedcluster.engine.flat import ParamLayout
    from fedcluster.rng import derive_seed

    fresh = copy.deepcopy(model).cpu()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(seed, purpose, index))
        for module in fresh.modules():
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()
    return ParamLayout(fresh).flatten()


class Algorithm(ABC, Generic[P, S]):
    """Server logic of one federated algorithm, generic over its parameters ``P`` and
    server state ``S`` (as pfl-research's ``FederatedAlgorithm`` is over its types)."""

    name: ClassVar[str]
    """The name a config gives in ``algorithms: [{name: ...}]`` (with :func:`register`)."""
    Params: type[P]
    """The pydantic class of the parameters (``self.params``); the YAML's ``params`` validate
    against it."""
    StateType: type[S]
    """The class of the server state :meth:`init_state` returns (checkpoints rebuild it)."""
    per_client_models: ClassVar[bool] = False
    """Whether each client holds a model of its own (then tested with it whatever
    ``ctx.model_choice`` says)."""
    cluster_count: ClassVar[str | None] = None
    """The name of the parameter that holds the number of clusters K (e.g. ``"n_clusters"``).
    Set it, and the config may give that parameter as ``auto`` (with an optional
    ``k_range: [lo, hi]``): before round 1 every client trains once from the initial
    model, K is the largest mean silhouette of k-means on those updates, and the
    algorithm is built with ``params.<cluster_count> = K``
    (:mod:`fedcluster.algorithms.cluster_count`). ``None`` (the default): the algorithm has no
    cluster count, and ``auto`` is refused naming the field."""

    def __init__(self, params: P, ctx: Context) -> None:
        self.params = params
        self.ctx = ctx

    @abstractmethod
    def init_state(self) -> S:
        """The server state before round 1."""

    @abstractmethod
    def run_round(self, state: S, rnd: int, selected: np.ndarray) -> RoundOutput[S]:
        """One communication round with the ``selected`` clients.

        Returns the new state (``state`` itself is left as it was), the mean
        training loss of the participating clients (sample-weighted) and the
        round's diagnostics; the channel counts the payloads.
        """

    @abstractmethod
    def eval_rows(self, state: S) -> tuple[torch.Tensor, np.ndarray]:
        """Models [M, d] and, for every client, the index of the model it uses.

        Only present clients' entries are used (a client not present may get −1).
        """

    def evaluate(self, state: S, rnd: int) -> EvalResult:
        """Test accuracy of every present client with the model it would use
        (``ctx.model_choice``, :mod:`fedcluster.algorithms.evaluation`)."""
        rows, model_of_client = self.eval_rows(state)
        clients = np.flatnonzero(self.ctx.present)
        if self.ctx.model_choice == "own_loss" and not self.per_client_models:
            return own_loss_evaluate(self.ctx, clients, rows, rnd)[0]
        return self.ctx.evaluate(clients, rows, model_of_client[clients], rnd)

    def clusters(self, state: S) -> np.ndarray | None:
        """Cluster id of every client (−1 unassigned), or ``None`` for unclustered methods."""
        return None

    def artifacts(self, state: S) -> dict[str, np.ndarray]:
        """Arrays saved with the run when the job ends (e.g. CFLGT's trajectories)."""
        return {}


ALGORITHMS: dict[str, type[Algorithm[Any, Any]]] = {}
A = TypeVar("A", bound=Algorithm[Any, Any])


def algorithm_class(name: str, where: str = "algorithms") -> type[Algorithm[Any, Any]]:
    """The algorithm called ``name``: registered, ``package.module:Class``, or an installed
    plugin (:mod:`fedcluster.config.plugins`); a :class:`~fedcluster.errors.ConfigError` naming
    the field ``where`` otherwise."""
    try:
        cls = resolve("algorithm", name, ALGORITHMS)
    except ConfigError as exc:
        raise ConfigError(f"field '{where}.name': {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
        raise ConfigError(
            f"field '{where}.name': {name!r} is {cls!r}, not a subclass of "
            "fedcluster.algorithms.base.Algorithm"
        )
    for declared in ("Params", "StateType"):
        if not hasattr(cls, declared):
            raise ConfigError(
                f"field '{where}.name': {name!r} ({cls.__module__}.{cls.__qualname__}) "
                f"declares no {declared} class"
            )
    return cls


def auto_k(spec: AlgorithmSpec, index: int = 0) -> AutoK | None:
    """The entry's request to choose its number of clusters (``n_clusters: auto``), or ``None``."""
    cls = algorithm_class(spec.name, f"algorithms.{index}")
    return parse_auto(spec.name, cls.cluster_count, spec.params, f"algorithms.{index}.params")[1]


def algorithm_params(spec: AlgorithmSpec, index: int = 0, k: int | None = None) -> AlgorithmParams:
    """The validated parameters of config entry ``algorithms.<index>``; a
    :class:`~fedcluster.errors.ConfigError` names the unknown algorithm or the bad field.

    An ``auto`` number of clusters is replaced by ``k`` (before it is chosen: the
    algorithm's default; :mod:`fedcluster.algorithms.cluster_count`)."""
    cls = algorithm_class(spec.name, f"algorithms.{index}")
    where = f"algorithms.{index}.params"
    params, auto = parse_auto(spec.name, cls.cluster_count, spec.params, where)
    if auto is not None and k is not None:
        params[auto.field] = k
    try:
        validated: AlgorithmParams = cls.Params(**params)
    except ValidationError as exc:
        fields = "; ".join(describe_error(e, where) for e in exc.errors())
        raise ConfigError(f"invalid config: {spec.name} {fields}") from None
    return validated


def check_algorithms(config: ExperimentConfig) -> None:
    """Validate every algorithm entry of ``config`` (names and params) before a run starts."""
    for i, spec in enumerate(config.algorithms):
        algorithm_params(spec, i)


def register(cls: type[A]) -> type[A]:
    """Class decorator: make an algorithm runnable by name.

    Raises:
        ValueError: another class is registered under the same name (a duplicate
            name is an error, not an overwrite; the same class imported again is fine).
    """
    known = ALGORITHMS.get(cls.name)
    same = known is not None and (known.__module__, known.__qualname__) == (
        cls.__module__,
        cls.__qualname__,
    )
    if known is not None and not same:
        raise ValueError(
            f"algorithm name {cls.name!r} is taken by {known.__module__}.{known.__qualname__}; "
            f"give {cls.__module__}.{cls.__qualname__} another name"
        )
    ALGORITHMS[cls.name] = cls
    return cls


def weighted_loss(loss: torch.Tensor, sizes: np.ndarray) -> float:
    """Sample-weighted mean of per-client training losses (NaNs of empty clients ignored)."""
    w = torch.as_tensor(sizes, dtype=torch.float64)
    ok = ~torch.isnan(loss)
    if not bool(ok.any()):
        return float("nan")
    return float((loss.double()[ok] * w[ok]).sum() / w[ok].sum())

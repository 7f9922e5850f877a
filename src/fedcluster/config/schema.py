"""The validated experiment schema, presets and ``--set`` overrides.

A config is YAML (or a dict) validated by pydantic models that forbid unknown
keys. This module is a leaf: it imports no algorithm and nothing of the engine,
so reading a config loads no torch; an algorithm's ``params`` are validated
where the algorithm is built (:func:`fedcluster.algorithms.check_algorithms`).
Every error is re-raised as :class:`~fedcluster.errors.ConfigError`
naming the dotted field, what was given and what is allowed. Precedence, low
to high: built-in defaults < preset < config file < ``--set key=value`` <
command-line flags (``--rounds``, ``--seed``, ...).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fedcluster.config import limits, safeyaml
from fedcluster.config.overrides import apply_sweeps, expand_algorithm_key, select_algorithms
from fedcluster.errors import ConfigError

DEFAULT_PRESET = "quickstart"
RECORD_KEY = "record"
"""The last key of a run's ``config.yaml``: the code and data that made the run."""
MAX_ROUNDS = 1_000_000  # a bound no run can reach anyway: larger counts are typos

DriftKind = Literal["rotate", "swap_labels", "redistribute"]
AggregationRule = Literal[
    "mean", "median", "trimmed_mean", "clipped_mean", "aligned_mean", "multi_krum", "guarded_mean"
]
"""The aggregation rules of :mod:`fedcluster.algorithms.robust` (its ``Rule``)."""
DEFAULT_NORM_FACTOR = 100.0
"""Reject an update whose norm exceeds this times the round's median (only absurd ones)."""


class _Strict(BaseModel):
    # Numbers are finite: ``.inf`` / ``.nan`` are errors naming the field (e.g. ε = inf is
    # not "no privacy": that is ``privacy.mode: none``, docs/privacy.md).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_coercion(cls, data: Any) -> Any:
        # pydantic's lax mode reads `rounds: true` as 1 and a label '7' as 7: refused here
        if isinstance(data, dict):
            limits.check_scalar_types(cls, data)
        return data


GIVEN_HELP = (
    "sha256 of the object passed from Python (fedcluster.run / Experiment); the command line "
    "cannot rebuild it: resume with fedcluster.resume(run_dir, model=..., federation=...)"
)


ShiftKind = Literal["feature", "label", "concept_y_given_x", "concept_x_given_y", "mixture"]
FeatureTransform = Literal["rotate", "contrast", "colour"]


class ShiftConfig(_Strict):
    """A distribution shift between client groups, on top of any dataset and partition
    (:mod:`fedcluster.data.shift`)."""

    kind: ShiftKind = Field(
        description="feature: P(x); label: P(y); concept_y_given_x: P(y|x) (a label "
        "permutation per group); concept_x_given_y: P(x|y) (a rotation per group and class); "
        "mixture: label, feature and concept_y_given_x shifts at once, the concept groups "
        "being the ground truth (FedRC)"
    )
    groups: int = Field(4, ge=2, le=limits.MAX_COUNT, description="number of shift groups")
    transform: FeatureTransform = Field(
        "rotate",
        description="feature shift: rotate (360·g/K degrees), contrast (factor 1/(g+1)) or "
        "colour (a permutation of the channels per group)",
    )
    alpha: float = Field(
        1.0, gt=0.0, description="label shift: each group's class weights ~ Dirichlet(alpha)"
    )
    labels_per_group: int | None = Field(
        None, ge=1, description="label shift: each group keeps this many classes (then no alpha)"
    )


class DataConfig(_Strict):
    dataset: str = "mnist5k"
    options: dict[str, Any] = Field(default_factory=dict)
    data_dir: str | None = None
    download: bool = False
    partition: dict[str, Any] = Field(default_factory=lambda: {"name": "iid", "n_clients": 20})
    federation: str | None = Field(
        None,
        description="'package.module:factory' called without arguments, returning a "
        "Federation (then dataset and partition do not apply)",
    )
    given: str | None = Field(None, description=GIVEN_HELP)
    shift: ShiftConfig | None = Field(
        None, description="a distribution shift between client groups (fedcluster.data.shift)"
    )
    bad_clients: Literal["exclude", "refuse"] = Field(
        "exclude",
        description="a client whose data is non-finite, out of range or empty: left out "
        "(named in a warning) or the run refused (fedcluster.data.screen)",
    )

    @model_validator(mode="after")
    def _partition_named(self) -> DataConfig:
        if "name" not in self.partition:
            raise ValueError("partition needs a 'name' (see `fedcluster list`)")
        return self


class ModelConfig(_Strict):
    name: str = Field("mlp", description="a preset model or 'package.module:factory'")
    options: dict[str, Any] = Field(default_factory=dict)
    given: str | None = Field(None, description=GIVEN_HELP)
    init: Literal["keep", "reset"] = Field(
        "keep",
        description="a model passed from Python as an nn.Module: keep starts every job from its "
        "weights (a pretrained model stays pretrained), reset re-initialises it from the seed; "
        "a model the config builds is always initialised from the seed",
    )
    buffers: Literal["federated", "local"] = Field(
        "federated",
        description="federated: float buffers (BatchNorm statistics) are averaged with the "
        "parameters; local: FedBN, each client keeps its BatchNorm layers (statistics and "
        "affine parameters)",
    )
    compare: Literal["parameters", "row"] = Field(
        "parameters",
        description="what clustering compares: the trainable parameters, or the whole row "
        "(parameters and float buffers)",
    )


class TrainConfig(_Strict):
    lr: float = Field(0.05, gt=0.0, le=limits.MAX_LR)
    batch_size: int = Field(32, ge=1, le=limits.MAX_COUNT)
    epochs: int = Field(1, ge=1, le=limits.MAX_COUNT)
    steps: int | None = Field(
        None, ge=1, le=limits.MAX_COUNT, description="fixed local steps (overrides epochs)"
    )
    momentum: float = Field(0.0, ge=0.0, lt=1.0)
    lr_decay: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="round t trains with lr·lr_decay^(t-1) (IFCA's CIFAR-10 code: 0.99)",
    )
    augment: Literal["none", "crop_flip"] = Field(
        "none",
        description="training-time augmentation of image batches: crop_flip = random crops "
        "of the image padded by 4 and random horizontal flips (seeded per client and round)",
    )
    loss: str = Field(
        "cross_entropy",
        description="cross_entropy, or a function (logits, targets) -> mean loss by import "
        "path 'package.module:function'",
    )


class ParticipationConfig(_Strict):
    fraction: float | None = Field(None, gt=0.0, le=1.0)
    count: int | None = Field(None, ge=1, le=limits.MAX_COUNT)

    @model_validator(mode="after")
    def _one_of(self) -> ParticipationConfig:
        if self.fraction is not None and self.count is not None:
            raise ValueError("give either fraction or count, not both")
        return self


class PrivacyConfig(_Strict):
    """Local differential privacy (:mod:`fedcluster.privacy.ledger`, docs/privacy.md).

    ``client``: clip each upload's update to ``clip`` and add Gaussian noise
    (DCFL Sec. III; protects a client's whole data). ``record``: DP-SGD in
    local training (Abadi et al. 2016; protects one sample). σ is calibrated
    so ``max_participations`` uploads per client spend at most
    (``epsilon``, ``delta``); a client that reaches its budget stops uploading.
    ``central``: DP-FedAvg with adaptive clipping at each cluster's aggregate
    (Andrew et al. 2021; trusted server), optionally with noisy sketches for
    the clustering step (``sketch_dim``; :mod:`fedcluster.privacy.central`).
    """

    mode: Literal["none", "client", "record", "central"] = "none"
    epsilon: float = Field(
        10.0, gt=0.0, le=limits.MAX_EPSILON, description="target ε per client (DCFL: 10)"
    )
    delta: float = Field(1e-5, ge=1e-30, lt=1.0, description="target δ (DCFL: 1e-5)")
    clip: float = Field(
        1.0,
        ge=limits.MIN_SCALE,
        le=limits.MAX_SCALE,
        description="L2 clipping norm C (update or per-sample grad)",
    )
    max_participations: Annotated[int, Field(ge=1)] | Literal["rounds", "expected"] = Field(
        "rounds",
        description="uploads a client may make: a number, 'rounds' (every round, the worst "
        "case) or 'expected' (⌈rounds × participation rate⌉)",
    )
    accountant: Literal["rdp", "prv"] = Field("rdp", description="Opacus accountant")
    sampling: Literal["poisson", "shuffle"] = Field(
        "poisson",
        description="record level: Poisson batches (what the accountant assumes) or shuffled",
    )
    sketch_dim: int = Field(0, ge=0, description="central: sketch dimension k (0: no sketch)")
    sketch_share: float = Field(0.5, gt=0.0, lt=1.0, description="central: sketches' budget share")
    sketch_releases: int = Field(1, ge=1, description="central: sketches a client releases")
    start_share: float = Field(
        0.5, gt=0.0, lt=1.0, description="central: the private start's budget share"
    )
    target_quantile: float = Field(0.5, gt=0.0, lt=1.0, description="central: clip quantile γ")
    clip_lr: float = Field(0.2, ge=0.0, description="central: clip learning rate η_C (0: fixed)")
    count_noise: float | None = Field(
        None, gt=0.0, description="central: σ_b of the unclipped count (default m/20)"
    )
    secure_aggregation: bool = Field(
        False,
        description="central: the server receives only each cluster's sum of clipped "
        "updates (devices choose, clip and contribute; Flower: SecAgg+)",
    )


class JoinsConfig(_Strict):
    """When clients join (:mod:`fedcluster.experiment.scenario`); others are present from round
    1."""

    at: dict[int, int] = Field(default_factory=dict, description="client -> round it joins")
    rounds: list[int] = Field(
        default_factory=list, description="the last len(rounds) clients join at these rounds"
    )
    every: int | None = Field(None, ge=1, description="newcomers every N rounds ...")
    count: int | None = Field(None, ge=1, description="... for the last `count` clients ...")
    size: int = Field(1, ge=1, description="... `size` of them at a time")
    first: int | None = Field(None, ge=1, description="round of the first of them (default N)")

    @model_validator(mode="after")
    def _consistent(self) -> JoinsConfig:
        if (self.every is None) != (self.count is None):
            raise ValueError("give every and count together")
        if self.every is not None and self.rounds:
            raise ValueError("give either rounds or every/count, not both")
        if self.first is not None and self.every is None:
            raise ValueError("first applies only with every/count")
        if any(r < 1 for r in [*self.at.values(), *self.rounds]) or any(c < 0 for c in self.at):
            raise ValueError("rounds start at 1 and client ids at 0")
        return self


class DriftConfig(_Strict):
    """A schedule of drift events of one kind (:mod:`fedcluster.experiment.scenario`)."""

    kind: DriftKind
    rounds: list[int] = Field(default_factory=list, description="rounds of the events")
    every: int | None = Field(None, ge=1, description="or: an event every N rounds ...")
    first: int | None = Field(None, ge=1, description="... from this round (default N)")
    clients: list[int] | Literal["random"] = Field(
        "random", description="who drifts at each event: these clients, or one random present one"
    )
    angle: float | None = Field(
        None, description="rotate: degrees added to the images (None: uniform in [0, 360))"
    )
    labels: tuple[int, int] | None = Field(
        None, description="swap_labels: the two labels (None: two random labels the client holds)"
    )
    alpha: float = Field(1.0, gt=0.0, description="redistribute: Dirichlet concentration")
    regroup: dict[int, int] | None = Field(
        None,
        description="the ground-truth group a drifting client moves to, by its group before "
        "the event (e.g. {0: 1, 1: 0}); purity, ARI and NMI follow it (clients of groups not "
        "listed keep theirs)",
    )

    @model_validator(mode="after")
    def _scheduled(self) -> DriftConfig:
        if bool(self.rounds) == (self.every is not None):
            raise ValueError("give either rounds or every")
        if self.first is not None and self.every is None:
            raise ValueError("first applies only with every")
        if any(r < 1 for r in self.rounds):
            raise ValueError("rounds start at 1")
        if self.clients != "random" and (not self.clients or min(self.clients) < 0):
            raise ValueError("clients: give client ids (>= 0) or 'random'")
        if self.labels is not None and (self.labels[0] == self.labels[1] or min(self.labels) < 0):
            raise ValueError("labels: two distinct labels >= 0")
        if self.regroup is not None and min([*self.regroup, *self.regroup.values()], default=0) < 0:
            raise ValueError("regroup: groups are numbered from 0")
        return self

    def schedule(self, last: int) -> list[int]:
        """The rounds of the events up to round ``last``: ``rounds``, or every ``every``
        rounds from ``first`` (default: ``every``)."""
        if self.every is None:
            return sorted(self.rounds)
        first = self.first if self.first is not None else self.every
        return list(range(first, last + 1, self.every))


FaultKind = Literal["nan", "inf", "huge", "scaled", "sign_flip", "label_flip", "alie"]


DEFAULT_FAULTS: tuple[FaultKind, ...] = ("nan", "inf", "huge")
"""The faults dealt to faulty clients unless ``scenario.faulty.kinds`` names others."""


class FaultyConfig(_Strict):
    share: float = Field(0.0, ge=0.0, le=1.0, description="share of clients whose uploads are bad")
    kinds: list[FaultKind] = Field(
        default_factory=lambda: list(DEFAULT_FAULTS),
        min_length=1,
        description="faults, dealt to the faulty clients in turn",
    )
    scale: float = Field(1e6, gt=1.0, description="huge: the update multiplied by this")
    scaled_factor: float = Field(
        10.0, gt=0.0, description="scaled: the update multiplied by this (finite, plausible)"
    )
    flip_factor: float = Field(
        1.0, gt=0.0, description="sign_flip: the update multiplied by minus this"
    )
    alie_z: float | None = Field(
        None,
        gt=0.0,
        le=10.0,
        description="alie: attackers send the honest updates' mean minus this many standard "
        "deviations (None: Baruch et al.'s z for the clients asked and the attackers among them)",
    )


class ScenarioConfig(_Strict):
    """Dynamic federation: joins, departures, availability, failures, drift, faulty clients."""

    joins: JoinsConfig = Field(default_factory=JoinsConfig)
    leaves: dict[int, int] = Field(
        default_factory=dict, description="client -> round from which it is gone"
    )
    availability: float = Field(
        1.0, gt=0.0, le=1.0, description="probability that a present client can be selected"
    )
    failure_rate: float = Field(
        0.0, ge=0.0, lt=1.0, description="probability that a contacted client never replies"
    )
    drift: list[DriftConfig] = Field(default_factory=list)
    faulty: FaultyConfig = Field(default_factory=FaultyConfig)

    @model_validator(mode="after")
    def _valid_leaves(self) -> ScenarioConfig:
        if any(r < 2 for r in self.leaves.values()) or any(c < 0 for c in self.leaves):
            raise ValueError("leaves: client ids >= 0 leave at rounds >= 2")
        return self


class RejectionConfig(_Strict):
    """Server-side rejection of absurdly large updates (:meth:`Context.exchange`)."""

    norm_factor: float | None = Field(
        DEFAULT_NORM_FACTOR,
        gt=1.0,
        description="reject an update whose norm exceeds this times the round's median (None: off)",
    )
    max_norm: float | None = Field(
        None, gt=0.0, description="reject an update whose norm exceeds this"
    )


class DeploymentConfig(_Strict):
    """How the Flower ServerApp collects replies from real nodes (docs/flower.md).

    The defaults survive a fleet's everyday losses: each request waits
    ``timeout_factor`` × the slowest round trip measured so far, at least
    ``timeout_floor`` and at most ``timeout_ceiling`` seconds (``round_timeout``
    fixes it instead), and the run goes on while at least ``min_replies`` of the
    clients reply.
    """

    round_timeout: float | None = Field(
        None,
        gt=0.0,
        description="seconds to wait for a request's replies (None: timeout_factor x the "
        "slowest round trip measured so far, at least timeout_floor)",
    )
    timeout_floor: float = Field(
        30.0, gt=0.0, description="the measured timeout's least value (seconds)"
    )
    timeout_factor: float = Field(
        3.0, ge=1.0, description="the measured timeout: this x the slowest round trip so far"
    )
    timeout_ceiling: float = Field(
        600.0,
        gt=0.0,
        description="the measured timeout's greatest value (seconds): a node answering ever "
        "slower cannot stretch it further, and is lost when it passes it",
    )
    min_replies: float = Field(
        0.5,
        gt=0.0,
        le=1.0,
        description="fraction of the clients asked that must reply, else the run stops",
    )

    @model_validator(mode="after")
    def _ceiling_above_floor(self) -> DeploymentConfig:
        if self.timeout_ceiling < self.timeout_floor:
            raise ValueError(
                f"timeout_ceiling ({self.timeout_ceiling:g} s) is below timeout_floor "
                f"({self.timeout_floor:g} s)"
            )
        return self


class EvaluationConfig(_Strict):
    """How clients are tested (:mod:`fedcluster.algorithms.evaluation`)."""

    model_choice: Literal["assigned", "own_loss"] = Field(
        "assigned",
        description="test each client with its assigned model, or (IFCA's protocol) with the "
        "cluster model of lowest loss on its own test data",
    )


class AggregationConfig(_Strict):
    """How every algorithm averages client models (per cluster):
    :mod:`fedcluster.algorithms.robust`.

    ``mean`` is the papers' weighted average; ``median``, ``trimmed_mean``
    (Yin et al., ICML 2018), ``clipped_mean`` (updates clipped to the
    ``clip_quantile`` quantile of the round's update norms), ``aligned_mean``
    (clipped, without copies and without the updates pointing against the
    cluster's median direction), ``multi_krum`` (Blanchard et al., NeurIPS 2017)
    and ``guarded_mean`` (aligned_mean, then Multi-Krum's selection within a
    budget of ``byzantine``·n exclusions) resist faulty clients.
    """

    rule: AggregationRule = Field(
        "mean",
        description="mean | median | trimmed_mean | clipped_mean | aligned_mean | multi_krum "
        "| guarded_mean",
    )
    trim: float = Field(
        0.1, ge=0.0, lt=0.5, description="trimmed_mean: share of values dropped on each side"
    )
    clip_quantile: float = Field(
        0.5,
        gt=0.0,
        le=1.0,
        description="clipped_mean, aligned_mean, guarded_mean: the norm quantile updates are "
        "clipped to",
    )
    byzantine: float = Field(
        0.25,
        ge=0.0,
        lt=0.5,
        description="multi_krum, guarded_mean: the share f/n of updates the server may leave out",
    )


def bare_name(entry: Any) -> Any:
    """An ``algorithms`` entry given by its bare name (``fedavg``, ``pkg.mod:Class``) as
    ``{name: ...}``, as Python's ``fedcluster.run(algorithms=["fedavg"])`` takes it; any
    other entry unchanged."""
    return {"name": entry} if isinstance(entry, str) else entry


def bare_names(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` with its bare-named ``algorithms`` entries written out (:func:`bare_name`)."""
    algorithms = raw.get("algorithms")
    if not isinstance(algorithms, list):
        return raw
    return {**raw, "algorithms": [bare_name(a) for a in algorithms]}


class AlgorithmSpec(_Strict):
    name: str
    label: str | None = None
    params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _bare_name(cls, data: Any) -> Any:
        return bare_name(data)

    def display_name(self) -> str:
        """The label if given, else the name with its parameters, e.g. ``jgl(lam=0.5)``."""
        if self.label:
            return self.label
        if not self.params:
            return self.name
        inner = ",".join(f"{k}={v}" for k, v in sorted(self.params.items()))
        return f"{self.name}({inner})"


class ExperimentConfig(_Strict):
    name: str = "experiment"
    seeds: list[Annotated[int, Field(ge=0, le=limits.MAX_SEED)]] = Field(
        default_factory=lambda: [0], min_length=1
    )
    rounds: int = Field(20, ge=1, le=MAX_ROUNDS, description="communication rounds")
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    participation: ParticipationConfig = Field(default_factory=ParticipationConfig)
    privacy: PrivacyConfig = Field(default_factory=PrivacyConfig)
    scenario: ScenarioConfig = Field(default_factory=ScenarioConfig)
    rejection: RejectionConfig = Field(default_factory=RejectionConfig)
    deployment: DeploymentConfig = Field(default_factory=DeploymentConfig)
    aggregation: AggregationConfig = Field(default_factory=AggregationConfig)
    algorithms: list[AlgorithmSpec] = Field(
        default_factory=lambda: [AlgorithmSpec(name="fedavg")], min_length=1
    )
    eval_every: int = Field(1, ge=1, le=MAX_ROUNDS)
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    device: str = Field(
        "cpu",
        pattern=r"^(cpu|cuda|cuda:\d+|mps|auto)$",
        description="where the simulator computes: cpu, cuda, cuda:N (the N-th GPU), mps "
        "(Apple GPU) or auto (cuda when a GPU is visible)",
    )
    precision: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="matrix products of training, choice and evaluation: fp32, or bf16 with "
        "fp32 accumulation and fp32 parameters (CPUs with AVX512-BF16/AMX and GPUs; "
        "elsewhere fp32 with a warning)",
    )
    checkpoint_every: int = Field(5, ge=1, le=MAX_ROUNDS)
    group_size: int | None = Field(
        None,
        ge=1,
        le=limits.MAX_COUNT,
        description="clients trained together by the MLP kernel (default: equal groups of at "
        "most 8 that keep every worker thread busy) or by vmap (default 32)",
    )
    vmap: Literal["auto", "on", "off"] = Field(
        "auto",
        description="train groups of group_size clients (default 32) at once with torch.func "
        "for models the MLP kernel does not take: on, off, or auto (on a GPU only; on a CPU "
        "client by client is faster)",
    )
    jobs: int = Field(
        1,
        ge=1,
        le=limits.MAX_COUNT,
        description="(algorithm, seed) jobs run at once, each in a local worker process "
        "(fedcluster.experiment.jobs); not part of config.yaml: it does not change a number",
    )
    backend: Literal["simulator", "distributed"] = Field(
        "simulator",
        description="where the client computations run: the batched simulator in this "
        "process, or sharded over torch.distributed workers (fedcluster.experiment.distributed); "
        "not part of config.yaml",
    )
    workers: int = Field(
        2, ge=1, le=limits.MAX_COUNT, description="worker processes of backend: distributed"
    )
    address: str | None = Field(
        None,
        description="HOST:PORT of backend: distributed's rendezvous (default: a free port on "
        "127.0.0.1; under torchrun: its MASTER_ADDR and MASTER_PORT)",
    )

    @model_validator(mode="after")
    def _unique_labels(self) -> ExperimentConfig:
        # An algorithm listed once is labelled by its name; repeats by name and parameters.
        counts = {a.name: sum(b.name == a.name for b in self.algorithms) for a in self.algorithms}
        for a in self.algorithms:
            if a.label is None and counts[a.name] == 1:
                a.label = a.name
        names = [a.display_name() for a in self.algorithms]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"algorithms: duplicate entries {dupes}; give each a distinct label")
        limits.check_names(self)
        limits.check_rounds(self)
        return self


def describe_error(err: Mapping[str, Any], prefix: str = "") -> str:
    """One pydantic error as ``field 'a.b': message (got ...)``."""
    loc = ".".join(str(p) for p in (prefix, *err["loc"]) if p != "")
    if err["type"] == "extra_forbidden":
        return f"field '{loc}': unknown key"
    msg = err["msg"].removeprefix("Value error, ")
    if msg.startswith(limits.FIELD):  # a check naming a field inside the model
        field, _, msg = msg[len(limits.FIELD) :].partition(": ")
        return f"field '{'.'.join(p for p in (loc, field) if p)}': {msg}"
    if err["type"] == "value_error":
        return f"field '{loc}': {msg}" if loc else msg
    given = err.get("input")
    shown = "" if isinstance(given, dict) else f" (got {_shortened(repr(given))})"
    return f"field '{loc}': {msg}{shown}"


def _shortened(text: str, most: int = 80) -> str:
    """``text``, or its first ``most`` characters and how many more there were."""
    return text if len(text) <= most else f"{text[:most]}... ({len(text) - most:,} more characters)"


def _allowed_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    """The keys allowed at the parent of ``loc`` in the schema (for unknown-key errors)."""
    for part in loc[:-1]:
        field = model.model_fields.get(str(part)) if isinstance(part, str) else None
        if field is None:
            continue
        ann = field.annotation
        inner = getattr(ann, "__args__", (ann,))
        nested = next((a for a in inner if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if nested is None:
            return []
        model = nested
    return list(model.model_fields)


def validate_config(raw: dict[str, Any]) -> ExperimentConfig:
    """Validate a raw config dict; raise ConfigError naming every bad field."""
    if not isinstance(raw, dict):
        raise ConfigError(f"config must be a mapping of fields, got {type(raw).__name__}")
    # a run's config.yaml ends with what made the run (fedcluster.experiment.provenance): not an
    # input
    raw = {k: v for k, v in raw.items() if k != RECORD_KEY}
    try:
        return ExperimentConfig(**raw)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            text = describe_error(err)
            if err["type"] == "extra_forbidden":
                allowed = _allowed_keys(ExperimentConfig, err["loc"])
                if allowed:
                    text += f"; allowed: {', '.join(allowed)}"
            lines.append(text)
        if len(lines) == 1:  # one error, one line
            raise ConfigError(f"invalid config: {lines[0]}") from None
        raise ConfigError("invalid config:\n  " + "\n  ".join(lines)) from None


def list_presets() -> list[str]:
    files = resources.files("fedcluster.config.presets").iterdir()
    return sorted(f.name[:-5] for f in files if f.name.endswith(".yaml"))


def load_preset(name: str) -> dict[str, Any]:
    path = resources.files("fedcluster.config.presets") / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"unknown preset {name!r}; available: {', '.join(list_presets())}")
    return safeyaml.loads(path.read_text(), f"preset {name}") or {}


def load_yaml(path: str | Path) -> dict[str, Any]:
    """A config file's fields, read within :mod:`fedcluster.config.safeyaml`'s limits."""
    path = Path(path)
    data = safeyaml.load_file(path)
    if data is None:  # an empty file is a mistake, not a request for the defaults
        raise ConfigError(f"config file {path} is empty (give at least one field)")
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: top level must be a mapping of fields")
    return data


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``override`` on top of ``base``; nested mappings merge, everything else replaces."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def apply_set(raw: dict[str, Any], assignment: str) -> dict[str, Any]:
    """Apply one ``dotted.key=value`` override (value parsed as YAML; list items by index;
    an algorithm also by label or name,
    :func:`fedcluster.config.overrides.expand_algorithm_key`)."""
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment!r}: expected dotted.key=value")
    key, _, text = assignment.partition("=")
    if key.count(".") >= safeyaml.MAX_DEPTH:
        raise ConfigError(
            f"--set {key[:80]}...: the key is nested {key.count('.') + 1} levels, "
            f"at most {safeyaml.MAX_DEPTH}"
        )
    keys = expand_algorithm_key(raw, key)
    if keys != [key]:
        for k in keys:
            raw = apply_set(raw, f"{k}={text}")
        return raw
    value = safeyaml.loads(text, f"--set {key}: value {text[:80]!r}")
    out = copy.deepcopy(raw)
    node: Any = out
    parts = key.strip().split(".")
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(
                    f"--set {key}: '{part}' is not an index of a {len(node)}-item list"
                )
            if last:
                node[int(part)] = value
            else:
                node = node[int(part)]
        elif isinstance(node, dict):
            if last:
                node[part] = value
            else:
                node = node.setdefault(part, {})
        else:
            raise ConfigError(f"--set {key}: '{'.'.join(parts[:i])}' is not a mapping or list")
    return out


def resolve_config(
    config_path: str | Path | None = None,
    preset: str | None = None,
    sets: list[str] | None = None,
    overrides: dict[str, Any] | None = None,
    algorithms: list[str] | None = None,
    sweeps: list[str] | None = None,
) -> ExperimentConfig:
    """Merge preset, config file, ``--set`` assignments and flag overrides, then validate.

    ``algorithms`` (``--algorithms``) selects entries before the assignments, so
    ``--set algorithms.<name>.<param>=...`` reaches them; ``sweeps`` (``--sweep``)
    expand entries after them (:mod:`fedcluster.config.overrides`).
    """
    raw: dict[str, Any] = {}
    if preset is None and config_path is None:
        preset = DEFAULT_PRESET
    if preset is not None:
        raw = bare_names(load_preset(preset))
    if config_path is not None:
        raw = deep_merge(raw, bare_names(load_yaml(config_path)))
    if algorithms:
        raw = select_algorithms(raw, algorithms)
    for assignment in sets or []:
        raw = apply_set(raw, assignment)
    raw = apply_sweeps(raw, sweeps or [])
    raw = deep_merge(raw, overrides or {})
    return validate_config(raw)


EXECUTION_FIELDS = frozenset({"jobs", "backend", "workers", "address"})
"""How a run is executed, not what it computes: the same numbers with any of them, so
``config.yaml`` and its digest leave them out and a run resumes with other values."""


def with_execution(config: ExperimentConfig, **fields: Any) -> ExperimentConfig:
    """``config`` with the :data:`EXECUTION_FIELDS` given (``None``: kept), validated."""
    update = {k: v for k, v in fields.items() if v is not None}
    unknown = sorted(set(update) - EXECUTION_FIELDS)
    if unknown:
        raise ValueError(f"not execution fields: {unknown}")
    if not update:
        return config
    return validate_config({**config.model_dump(mode="json"), **update})


def dump_config(config: ExperimentConfig) -> str:
    """The fully resolved config as YAML (what ``config.yaml`` of a run directory holds),
    without :data:`EXECUTION_FIELDS`."""
    return yaml.safe_dump(
        config.model_dump(mode="json", exclude=set(EXECUTION_FIELDS)), sort_keys=False
    )

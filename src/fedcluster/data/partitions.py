"""Client partitions of a labelled pool: which samples each client trains and tests on.

Partitions look at label arrays only (``numpy`` integers) and return indices; the
federation builder gathers, rotates and relabels the samples. Every random choice
draws from the ``np.random.Generator`` passed in, which the caller derives with
``fedcluster.rng.numpy_rng(seed, "partition")``.

Training samples are never shared: the clients' train indices are disjoint.

Test sets (common options of every base partition). Each client is tested on its
own distribution: its test set has the class proportions of its training data
(largest-remainder rounding, at least one sample per client where possible).

* The dataset has a test split (``y_test`` given, ``test_pool="test"``): a
  client gets ``test_size`` test samples, or ``test_ratio`` test samples per
  training sample. The default ratio is the largest one that the test split can
  serve for every class when the whole train pool is partitioned:
  ``min_c (test count of c / train count of c)``, about 1/6 on MNIST. Within a
  class, clients take consecutive stretches of one random permutation of the
  class's test samples, so test sets are disjoint whenever the split holds
  enough samples. When the clients need more samples of a class than the split
  holds, the permutation is walked around again (``test_reuse=True``, the
  default): a sample then serves several clients, every sample of that class is
  used ``floor`` or ``ceil`` of demand/supply times, and a client repeats a
  sample only if it alone needs more than the split holds. With
  ``test_reuse=False`` the shortage raises ``ConfigError`` instead.
* The dataset has no test split (``y_test is None``, ``test_pool="train"``):
  ``test_fraction`` (default 0.2) of each client's samples, or ``test_size``
  samples, are held out of its own samples, class by class; the client trains on
  the rest, which keeps at least one sample. Sample counts that the options
  specify (tables, samples per client) then describe train and test together.
"""

from __future__ import annotations

import csv
import inspect
import io
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from importlib import resources
from typing import Any, Literal

import numpy as np

from fedcluster.config.plugins import resolve
from fedcluster.errors import ConfigError, DataError

__all__ = [
    "PARTITIONS",
    "ClientTestSpec",
    "Partition",
    "cluster_table",
    "dirichlet",
    "iid",
    "jgl_emnist_table",
    "jgl_table",
    "label_combinations",
    "make_partition",
    "per_client_rotation",
    "rotation",
    "shards_powerlaw",
    "with_rotations",
]

TestPool = Literal["test", "train"]

JGL_TABLES = ("mnist", "fashion-mnist", "cifar10")
CFLGT_SCENARIOS = {1: (5, 2), 2: (5, 5), 3: (20, 3)}  # scenario -> (combinations, labels each)
DEFAULT_TEST_FRACTION = 0.2


@dataclass
class Partition:
    """Train and test indices per client, with the ground truth where one exists.

    ``train[i]`` indexes ``Dataset.train``; ``test[i]`` indexes the test pool,
    which is ``Dataset.test`` when ``test_pool == "test"`` and ``Dataset.train``
    (samples held out of the client's own data) when ``test_pool == "train"``.
    ``groups`` is the ground-truth cluster of each client (None if none exists),
    ``label_maps[i, c]`` the label client ``i`` sees for class ``c`` (-1: unused),
    ``rotations[i]`` the angle in degrees (counter-clockwise) of client ``i``'s images.
    """

    train: list[np.ndarray]
    test: list[np.ndarray]
    test_pool: TestPool
    groups: np.ndarray | None = None
    label_maps: np.ndarray | None = None
    rotations: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(self.train)
        if len(self.test) != n:
            raise ConfigError(f"partition: {n} train index sets but {len(self.test)} test sets")
        if self.test_pool not in ("test", "train"):
            raise ConfigError(
                f"partition: test_pool must be 'test' or 'train', not {self.test_pool!r}"
            )
        for field in ("groups", "label_maps", "rotations"):
            value = getattr(self, field)
            if value is not None and len(value) != n:
                raise ConfigError(f"partition: {field} has {len(value)} rows for {n} clients")

    @property
    def n_clients(self) -> int:
        """Number of clients."""
        return len(self.train)


# --------------------------------------------------------------------------- option checks


def _int_option(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ConfigError(f"partition option {name!r} must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"partition option {name!r} must be >= {minimum}, got {value}")
    return int(value)


def _float_option(
    name: str, value: Any, low: float, high: float = math.inf, *, high_closed: bool = True
) -> float:
    """A number in ``(low, high]`` (or ``(low, high)`` when ``high_closed`` is False)."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise ConfigError(f"partition option {name!r} must be a number, got {value!r}")
    value = float(value)
    inside = low < value and (value <= high if high_closed else value < high)
    if not inside:
        bracket = "]" if high_closed else ")"
        raise ConfigError(
            f"partition option {name!r} must be in ({low}, {high}{bracket}, got {value}"
        )
    return value


def _bool_option(name: str, value: Any) -> bool:
    if not isinstance(value, bool | np.bool_):
        raise ConfigError(f"partition option {name!r} must be true or false, got {value!r}")
    return bool(value)


def _choice(name: str, value: Any, allowed: Sequence[Any]) -> Any:
    if value not in allowed:
        raise ConfigError(
            f"partition option {name!r} must be one of {list(allowed)}, got {value!r}"
        )
    return value


def _labels(name: str, y: Any) -> np.ndarray:
    arr = np.asarray(y)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ConfigError(f"{name} must be a 1-D integer label array, got {arr.dtype} {arr.shape}")
    if arr.size and arr.min() < 0:
        raise ConfigError(f"{name} holds negative labels")
    return arr.astype(np.int64, copy=False)


def _pools(y_train: Any, y_test: Any, rng: Any) -> tuple[np.ndarray, np.ndarray | None]:
    """Checked label arrays (``y_test`` may be None) and generator."""
    if not isinstance(rng, np.random.Generator):
        raise ConfigError(f"partition: rng must be a numpy Generator, got {type(rng).__name__}")
    train = _labels("y_train", y_train)
    if train.size == 0:
        raise ConfigError("partition: y_train is empty")
    return train, None if y_test is None else _labels("y_test", y_test)


def _degrees(name: str, values: Any) -> list[float]:
    """A non-empty list of finite angles in degrees."""
    if isinstance(values, str | bytes) or not isinstance(values, Sequence | np.ndarray):
        raise ConfigError(f"partition option {name!r} must be a list of degrees, got {values!r}")
    try:
        angles = [float(v) for v in values]
    except (TypeError, ValueError) as err:
        raise ConfigError(f"partition option {name!r} must hold numbers, got {values!r}") from err
    if not angles or not all(math.isfinite(a) for a in angles):
        raise ConfigError(f"partition option {name!r} must hold finite numbers, got {values!r}")
    return angles


def _class_counts(y: np.ndarray, n_classes: int) -> np.ndarray:
    return np.bincount(y, minlength=n_classes).astype(np.int64)


# --------------------------------------------------------------------------- counting helpers


def _apportion(weights: np.ndarray, totals: np.ndarray) -> np.ndarray:
    """Split each ``totals[i]`` over row ``weights[i]`` by largest remainders (Hamilton).

    Entries with zero weight get nothing; each row sums to its total (rows of
    zero weight give zeros).
    """
    w = np.asarray(weights, dtype=np.float64)
    totals = np.asarray(totals, dtype=np.int64)
    sums = w.sum(axis=1, keepdims=True)
    quota = np.divide(w * totals[:, None], sums, out=np.zeros_like(w), where=sums > 0)
    base = np.floor(quota).astype(np.int64)
    remainder = np.where(sums[:, 0] > 0, totals - base.sum(axis=1), 0)
    frac = np.where(w > 0, quota - base, -1.0)
    order = np.argsort(-frac, axis=1, kind="stable")
    ranks = np.empty_like(order)
    np.put_along_axis(ranks, order, np.broadcast_to(np.arange(w.shape[1]), w.shape), axis=1)
    return base + (ranks < remainder[:, None])


def _draw_by_counts(
    y: np.ndarray, counts: np.ndarray, rng: np.random.Generator, option: str
) -> list[np.ndarray]:
    """Give client ``i`` ``counts[i, c]`` random samples of class ``c``, no sample twice.

    ``option`` names the setting to blame when a class runs out.
    """
    n_clients, n_classes = counts.shape
    available = _class_counts(y, n_classes)
    needed = counts.sum(axis=0)
    short = np.flatnonzero(needed > available)
    if short.size:
        c = int(short[0])
        raise ConfigError(
            f"partition option {option!r}: class {c} needs {int(needed[c])} samples "
            f"but the pool holds {int(available[c])}"
        )
    parts: list[list[np.ndarray]] = [[] for _ in range(n_clients)]
    for label in np.flatnonzero(needed):
        chosen = rng.permutation(np.flatnonzero(y == label))[: needed[label]]
        for i, chunk in enumerate(np.split(chosen, np.cumsum(counts[:, label])[:-1])):
            if chunk.size:
                parts[i].append(chunk)
    return [np.sort(np.concatenate(p)) if p else np.empty(0, np.int64) for p in parts]


def _client_class_counts(y: np.ndarray, parts: list[np.ndarray], n_classes: int) -> np.ndarray:
    return np.stack([_class_counts(y[p], n_classes) for p in parts])


# --------------------------------------------------------------------------- test sets


@dataclass(frozen=True)
class ClientTestSpec:
    """How each client's test set is drawn: the common options of every base partition.

    ``size``, ``ratio``, ``fraction`` and ``reuse`` are the partition options
    ``test_size``, ``test_ratio``, ``test_fraction`` and ``test_reuse`` of the
    module docstring.
    """

    size: int | None = None
    ratio: float | None = None
    fraction: float | None = None
    reuse: bool = True


DEFAULT_TEST_SPEC = ClientTestSpec()
TEST_OPTIONS = {f"test_{f.name}": f.name for f in fields(ClientTestSpec)}
"""The flat partition options (config keys) of :class:`ClientTestSpec`'s fields."""


def _finish(
    train: list[np.ndarray],
    y_train: np.ndarray,
    y_test: np.ndarray | None,
    rng: np.random.Generator,
    test: ClientTestSpec,
    *,
    groups: np.ndarray | None = None,
    label_maps: np.ndarray | None = None,
) -> Partition:
    """Attach each client's test set (see the module docstring) and build the Partition."""
    size = None if test.size is None else _int_option("test_size", test.size)
    reuse = _bool_option("test_reuse", test.reuse)
    if y_test is None:
        train, tests = _hold_out(train, y_train, rng, size, test.ratio, test.fraction)
        pool: TestPool = "train"
    else:
        tests = _draw_tests(train, y_train, y_test, rng, size, test.ratio, test.fraction, reuse)
        pool = "test"
    for i, part in enumerate(train):
        if part.size == 0:
            raise ConfigError(
                f"partition: client {i} has no training samples; use fewer clients or more "
                "samples per client"
            )
    return Partition(train, tests, pool, groups=groups, label_maps=label_maps)


def _draw_tests(
    train: list[np.ndarray],
    y_train: np.ndarray,
    y_test: np.ndarray,
    rng: np.random.Generator,
    test_size: int | None,
    test_ratio: float | None,
    test_fraction: float | None,
    test_reuse: bool,
) -> list[np.ndarray]:
    if test_fraction is not None:
        raise ConfigError(
            "partition option 'test_fraction' applies only to datasets without a test split; "
            "use 'test_size' or 'test_ratio'"
        )
    if test_size is not None and test_ratio is not None:
        raise ConfigError("partition options 'test_size' and 'test_ratio' exclude each other")
    n_classes = int(max(y_train.max(initial=-1), y_test.max(initial=-1))) + 1
    counts = _client_class_counts(y_train, train, n_classes)
    supply = _class_counts(y_test, n_classes)
    if test_size is not None:
        totals = np.full(len(train), test_size, dtype=np.int64)
    else:
        if test_ratio is None:
            pool = _class_counts(y_train, n_classes)
            held = (pool > 0) & (supply > 0)
            test_ratio = float((supply[held] / pool[held]).min()) if held.any() else 0.0
        else:
            test_ratio = _float_option("test_ratio", test_ratio, 0.0)
        totals = np.maximum(1, np.rint(test_ratio * counts.sum(axis=1))).astype(np.int64)
    demand = _apportion(counts, totals)
    option = "test_size" if test_size is not None else "test_ratio"
    parts: list[list[np.ndarray]] = [[] for _ in train]
    for c in np.flatnonzero(demand.sum(axis=0)):
        need = int(demand[:, c].sum())
        pool_c = rng.permutation(np.flatnonzero(y_test == c))
        if pool_c.size == 0:
            raise ConfigError(
                f"partition: the test split has no samples of class {c}, which clients train on"
            )
        if need > pool_c.size and not test_reuse:
            raise ConfigError(
                f"partition option {option!r}: the clients' test sets need {need} samples of "
                f"class {c} but the test split holds {pool_c.size}; lower {option!r} or set "
                "test_reuse=true"
            )
        taken = pool_c[np.arange(need) % pool_c.size]
        for i, chunk in enumerate(np.split(taken, np.cumsum(demand[:, c])[:-1])):
            if chunk.size:
                parts[i].append(chunk)
    return [np.sort(np.concatenate(p)) for p in parts]


def _hold_out(
    train: list[np.ndarray],
    y_train: np.ndarray,
    rng: np.random.Generator,
    test_size: int | None,
    test_ratio: float | None,
    test_fraction: float | None,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    if test_ratio is not None:
        raise ConfigError(
            "partition option 'test_ratio' needs a test split; this dataset has none, "
            "use 'test_fraction' or 'test_size'"
        )
    if test_size is not None and test_fraction is not None:
        raise ConfigError("partition options 'test_size' and 'test_fraction' exclude each other")
    n_classes = int(y_train.max(initial=-1)) + 1
    counts = _client_class_counts(y_train, train, n_classes)
    sizes = counts.sum(axis=1)
    if test_size is not None:
        totals = np.full(len(train), test_size, dtype=np.int64)
    else:
        fraction = DEFAULT_TEST_FRACTION if test_fraction is None else test_fraction
        fraction = _float_option("test_fraction", fraction, 0.0, 1.0, high_closed=False)
        totals = np.maximum(1, np.rint(fraction * sizes)).astype(np.int64)
    totals = np.clip(totals, 0, np.maximum(sizes - 1, 0))
    demand = _apportion(counts, totals)
    kept, held = [], []
    for i, part in enumerate(train):
        shuffled = rng.permutation(part)
        labels = y_train[shuffled]
        order = np.argsort(labels, kind="stable")
        shuffled, labels = shuffled[order], labels[order]
        first = np.searchsorted(labels, labels, side="left")
        is_test = np.arange(len(labels)) - first < demand[i, labels]
        kept.append(np.sort(shuffled[~is_test]))
        held.append(np.sort(shuffled[is_test]))
    return kept, held


# --------------------------------------------------------------------------- JGL tables


def jgl_table(name: str) -> np.ndarray:
    """The per-cluster per-class sample counts of JGL Fig. 2, as an int array [4, 10].

    JGL (joint gradient and loss based clustered FL), Sec. III-A.1 and Fig. 2:
    80 devices in clusters A-D of 20, each cluster holding 8 of the 10 classes.
    ``name`` is ``"mnist"``, ``"fashion-mnist"`` or ``"cifar10"``; the table is
    read from ``fedcluster/data/tables/jgl-<name>.csv``, which copies the paper's
    numbers exactly (CIFAR-10's rows total 12498, 12500, 13334, 11668) and whose
    total row and column are checked against the counts.
    """
    if name not in JGL_TABLES:
        raise ConfigError(f"jgl_table: unknown table {name!r}; allowed: {list(JGL_TABLES)}")
    filename = f"jgl-{name}.csv"
    text = resources.files("fedcluster.data").joinpath("tables", filename).read_text("utf-8")
    rows = list(csv.reader(io.StringIO(text)))
    try:
        body = np.array([[int(v) for v in row[1:]] for row in rows[1:]], dtype=np.int64)
    except ValueError as err:
        raise DataError(f"{filename}: non-integer count ({err})") from err
    counts, row_totals, col_totals = body[:-1, :-1], body[:-1, -1], body[-1]
    if not (
        np.array_equal(counts.sum(axis=1), row_totals)
        and np.array_equal(counts.sum(axis=0), col_totals[:-1])
        and counts.sum() == col_totals[-1]
    ):
        raise DataError(f"{filename}: the counts do not add up to the total row and column")
    return counts


def jgl_emnist_table(
    class_counts: Sequence[int] | np.ndarray,
    n_clusters: int = 8,
    classes_per_cluster: int = 40,
    rng: np.random.Generator | None = None,
) -> np.ndarray:
    """A cluster table [n_clusters, n_classes] for JGL's EMNIST setting.

    JGL, Sec. III-A.1: 200 devices in 8 clusters, 47 merged EMNIST classes,
    classes split "in the same manner as was done for the MNIST dataset", 40 per
    cluster; the paper gives no table. Construction (deterministic; ``C`` =
    ``len(class_counts)``, ``m = C - classes_per_cluster`` classes missing per cluster):

    1. Cluster ``k`` misses the ``m`` cyclically consecutive classes
       ``(m*k + j) mod C`` for ``j = 0..m-1``, so the ``m*K`` missing slots
       wrap around the classes evenly: each class is missing from ``floor`` or
       ``ceil(m*K / C)`` clusters, and when ``m*K >= C`` every class is missing
       from at least one cluster (47 classes, 8 clusters of 40: 56 slots,
       classes 0-8 are missing from two clusters, the other 38 from one).
       Any two clusters share at least ``C - 2m`` classes (33 here; adjacent
       clusters exactly that), as Fig. 2's clusters share at least 6 of 8.
    2. As in Fig. 2 (6000 = 4 x 1500 = 3 x 2000 = 2 x 3000), the available
       samples of each class are split equally among the clusters holding it,
       the remainder going one each to the last holders (CIFAR-10's
       1666/1667/1667), so no sample is used twice and the columns sum to
       ``class_counts``. (Only if ``m*K > C*(K-1)`` can a class be missing
       from every cluster; its column is then zero.)

    ``rng``, if given, relabels the classes by a random permutation before step
    1, so which classes are missing together is random; None keeps the
    classes' order (the default, fully deterministic).
    """
    counts = np.asarray(class_counts)
    if counts.ndim != 1 or not np.issubdtype(counts.dtype, np.integer) or (counts < 0).any():
        raise ConfigError("jgl_emnist_table: class_counts must be a 1-D array of counts >= 0")
    n_classes = len(counts)
    n_clusters = _int_option("n_clusters", n_clusters)
    classes_per_cluster = _int_option("classes_per_cluster", classes_per_cluster)
    missing = n_classes - classes_per_cluster
    if missing < 1:
        raise ConfigError(
            f"partition option 'classes_per_cluster' must be below the {n_classes} classes, "
            f"got {classes_per_cluster}"
        )
    order = np.arange(n_classes) if rng is None else rng.permutation(n_classes)
    holds = np.ones((n_clusters, n_classes), dtype=bool)
    for k in range(n_clusters):
        holds[k, order[(missing * k + np.arange(missing)) % n_classes]] = False
    if len({row.tobytes() for row in holds}) < n_clusters:
        raise ConfigError(
            f"partition option 'n_clusters': {n_clusters} clusters of {classes_per_cluster} "
            f"of {n_classes} classes would repeat a cluster's class set"
        )
    return _split_among_holders(holds, counts)


def _split_among_holders(holds: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Each class's ``counts[c]`` split equally among the clusters holding it (``holds``
    [K, C]), the remainder going one each to the last holders."""
    table = np.zeros(holds.shape, dtype=np.int64)
    for c in range(holds.shape[1]):
        holders = np.flatnonzero(holds[:, c])
        if holders.size == 0:
            continue
        share, extra = divmod(int(counts[c]), len(holders))
        table[holders, c] = share
        table[holders[len(holders) - extra :], c] += 1
    return table


# --------------------------------------------------------------------------- partitions


def cluster_table(
    y_train: np.ndarray,
    y_test: np.ndarray | None,
    rng: np.random.Generator,
    *,
    table: str | Sequence[Sequence[int]] | np.ndarray = "jgl-mnist",
    clients_per_cluster: int | Sequence[int] = 20,
    scale: float | None = None,
    samples_per_client: int | None = None,
    shortage: Literal["shrink", "error"] = "shrink",
    relabel: bool = False,
    test: ClientTestSpec = DEFAULT_TEST_SPEC,
) -> Partition:
    """Clusters with explicit per-class sample counts, split equally among their clients.

    JGL, Sec. III-A.1 and Fig. 2: cluster ``k`` holds ``table[k, c]`` samples of
    class ``c``, "further distributed to its devices equally and randomly".

    ``table`` is a [K, C] count array or a name: ``"jgl-mnist"``,
    ``"jgl-fashion-mnist"``, ``"jgl-cifar10"`` (Fig. 2, see ``jgl_table``) or
    ``"jgl-emnist"`` (``jgl_emnist_table`` on the pool's class counts, 8
    clusters of 40 classes; use 25 clients per cluster for the paper's 200).
    ``clients_per_cluster`` is one count for all clusters or one per cluster.
    Clients are numbered cluster by cluster; ``groups`` is the cluster row.

    Sizes: ``scale`` multiplies every count (rounded), e.g. 0.25 for fast runs;
    ``samples_per_client`` instead rescales each cluster's row so that each of
    its clients holds exactly that many samples (unless a class runs short).
    Within a cluster, every class is split among the clients with sizes that
    differ by at most one, and the extra samples rotate over the clients so
    client totals also differ by at most one.

    ``shortage``: when a class's column asks for more samples than the pool has
    (Fig. 2 assumes 6000 of every MNIST digit; real MNIST has 5421 fives),
    ``"shrink"`` (default) scales that column down to the pool's count,
    preserving its split across clusters, and warns; ``"error"`` raises.

    ``relabel``: each cluster's classes are renumbered 0..m-1 in sorted order
    (Fig. 3 gives the models 8 outputs for 8 classes) and ``label_maps`` is filled.
    """
    y_train, y_test = _pools(y_train, y_test, rng)
    relabel = _bool_option("relabel", relabel)
    counts_table = _resolve_table(table, y_train)
    n_clusters, n_classes = counts_table.shape
    _check_columns(n_classes, y_train, y_test)
    per_cluster = _clients_per_cluster(clients_per_cluster, n_clusters)
    counts_table = _sized_table(counts_table, per_cluster, scale, samples_per_client)
    _choice("shortage", shortage, ("shrink", "error"))
    counts_table = _fit_to_pool(counts_table, _class_counts(y_train, n_classes), shortage)
    groups = np.repeat(np.arange(n_clusters), per_cluster)
    train = _draw_by_counts(y_train, _client_counts(counts_table, per_cluster), rng, "table")

    label_maps = None
    if relabel:
        held = counts_table > 0
        maps = np.where(held, np.cumsum(held, axis=1) - 1, -1)
        label_maps = maps[groups]
    return _finish(train, y_train, y_test, rng, test, groups=groups, label_maps=label_maps)


def _check_columns(n_classes: int, y_train: np.ndarray, y_test: np.ndarray | None) -> None:
    """A one-line error when a label has no column in the cluster table."""
    top = int(max(y_train.max(initial=-1), -1 if y_test is None else y_test.max(initial=-1)))
    if top >= n_classes:
        raise ConfigError(
            f"partition option 'table' has {n_classes} class columns but the labels reach {top}"
        )


def _sized_table(
    table: np.ndarray,
    per_cluster: np.ndarray,
    scale: float | None,
    samples_per_client: int | None,
) -> np.ndarray:
    """The cluster table times ``scale`` (rounded), or rescaled row by row so that each
    client of a cluster holds ``samples_per_client``; unchanged when neither is given."""
    if scale is not None and samples_per_client is not None:
        raise ConfigError("partition options 'scale' and 'samples_per_client' exclude each other")
    if scale is not None:
        return np.rint(table * _float_option("scale", scale, 0.0)).astype(np.int64)
    if samples_per_client is not None:
        size = _int_option("samples_per_client", samples_per_client)
        return _apportion(table, size * per_cluster)
    return table


def _client_counts(table: np.ndarray, per_cluster: np.ndarray) -> np.ndarray:
    """[n, C] counts: cluster ``k``'s row split among its ``per_cluster[k]`` clients,
    sizes differing by at most one per class, the extra samples rotating over the
    clients so that their totals also differ by at most one."""
    client_counts, offset = [], 0
    for k in range(table.shape[0]):
        m = int(per_cluster[k])
        share, extra = np.divmod(table[k], m)
        rows = np.tile(share, (m, 1))
        for c in range(table.shape[1]):
            rows[(offset + np.arange(extra[c])) % m, c] += 1
            offset = (offset + int(extra[c])) % m
        client_counts.append(rows)
    return np.concatenate(client_counts)


def _resolve_table(table: Any, y_train: np.ndarray) -> np.ndarray:
    if isinstance(table, str):
        names = [f"jgl-{n}" for n in JGL_TABLES] + ["jgl-emnist"]
        _choice("table", table, names)
        if table == "jgl-emnist":
            return jgl_emnist_table(_class_counts(y_train, int(y_train.max(initial=-1)) + 1))
        return jgl_table(table.removeprefix("jgl-"))
    arr = np.asarray(table)
    if arr.ndim != 2 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
        raise ConfigError(
            "partition option 'table' must be a 2-D integer array [clusters, classes]"
        )
    if (arr < 0).any():
        raise ConfigError("partition option 'table' holds negative counts")
    return arr.astype(np.int64)


def _clients_per_cluster(value: Any, n_clusters: int) -> np.ndarray:
    if isinstance(value, int | np.integer) and not isinstance(value, bool):
        return np.full(n_clusters, _int_option("clients_per_cluster", value), dtype=np.int64)
    values = list(value) if isinstance(value, Sequence | np.ndarray) else None
    if values is None or len(values) != n_clusters:
        raise ConfigError(
            f"partition option 'clients_per_cluster' must be an integer or a list of "
            f"{n_clusters} integers (one per cluster), got {value!r}"
        )
    return np.array([_int_option("clients_per_cluster", v) for v in values], dtype=np.int64)


def _fit_to_pool(table: np.ndarray, available: np.ndarray, shortage: str) -> np.ndarray:
    needed = table.sum(axis=0)
    short = np.flatnonzero(needed > available)
    if short.size == 0:
        return table
    detail = ", ".join(f"class {c}: {needed[c]} > {available[c]}" for c in short)
    if shortage == "error":
        raise ConfigError(
            f"partition option 'table' asks for more samples than the pool holds ({detail}); "
            "lower 'scale' or 'samples_per_client', or set shortage='shrink'"
        )
    warnings.warn(
        f"cluster table asks for more samples than the pool holds ({detail}); "
        "those columns are scaled down to the pool's counts",
        UserWarning,
        stacklevel=3,
    )
    fitted = table.copy()
    fitted[:, short] = _apportion(table[:, short].T, available[short]).T
    return fitted


def label_combinations(
    y_train: np.ndarray,
    y_test: np.ndarray | None,
    rng: np.random.Generator,
    *,
    scenario: Literal[1, 2, 3] | None = None,
    n_combinations: int | None = None,
    labels_per_combination: int | None = None,
    samples_per_label: int = 50,
    n_clients: int = 100,
    assignment: Literal["even", "random"] = "even",
    test: ClientTestSpec = DEFAULT_TEST_SPEC,
) -> Partition:
    """Clients hold one of a few random label combinations, ``samples_per_label`` each.

    CFLGT, Sec. V-A (Experimental Setting): 100 clients, 50 samples per label,
    no sample selected twice; scenario 1: 5 random label pairs; scenario 2: 5
    combinations of 5 labels; scenario 3: 20 combinations of 3 labels.
    ``scenario`` fills ``n_combinations`` and ``labels_per_combination`` (giving
    either as well must agree). The combinations are distinct random label sets
    drawn from the classes present in ``y_train``.

    ``assignment="even"`` (default) gives the combinations to consecutive blocks
    of clients of equal size (±1); ``"random"`` lets each client choose one
    uniformly, as the paper words it, so some combinations may go unused.
    ``groups`` is the client's combination.
    """
    y_train, y_test = _pools(y_train, y_test, rng)
    n_combinations, k = _combination_shape(scenario, n_combinations, labels_per_combination)
    per_label = _int_option("samples_per_label", samples_per_label)
    n_clients = _int_option("n_clients", n_clients)
    _choice("assignment", assignment, ("even", "random"))
    n_classes = int(y_train.max(initial=-1)) + 1
    present = np.flatnonzero(_class_counts(y_train, n_classes))
    if k > present.size:
        raise ConfigError(
            f"partition option 'labels_per_combination' must be <= {present.size} classes, got {k}"
        )
    if n_combinations > math.comb(present.size, k):
        raise ConfigError(
            f"partition option 'n_combinations': only {math.comb(present.size, k)} distinct "
            f"sets of {k} of {present.size} labels exist, got {n_combinations}"
        )
    combos = _distinct_combinations(present, n_combinations, k, rng)
    if assignment == "even":
        groups = np.arange(n_clients) * n_combinations // n_clients
    else:
        groups = rng.integers(n_combinations, size=n_clients)
    counts = np.zeros((n_clients, n_classes), dtype=np.int64)
    for i, g in enumerate(groups):
        counts[i, list(combos[g])] = per_label
    train = _draw_by_counts(y_train, counts, rng, "samples_per_label")
    return _finish(train, y_train, y_test, rng, test, groups=groups.astype(np.int64))


def _combination_shape(
    scenario: int | None, n_combinations: int | None, labels_per_combination: int | None
) -> tuple[int, int]:
    """(number of combinations, labels per combination): CFLGT's scenario or as given."""
    if scenario is not None:
        _choice("scenario", scenario, tuple(CFLGT_SCENARIOS))
        preset = CFLGT_SCENARIOS[scenario]
        for name, given, wanted in zip(
            ("n_combinations", "labels_per_combination"),
            (n_combinations, labels_per_combination),
            preset,
            strict=True,
        ):
            if given is not None and given != wanted:
                raise ConfigError(
                    f"partition option {name!r}={given} contradicts scenario {scenario} ({wanted})"
                )
        n_combinations, labels_per_combination = preset
    if n_combinations is None or labels_per_combination is None:
        raise ConfigError(
            "partition options: give 'scenario' (1, 2 or 3) or both 'n_combinations' "
            "and 'labels_per_combination'"
        )
    return (
        _int_option("n_combinations", n_combinations),
        _int_option("labels_per_combination", labels_per_combination),
    )


def _distinct_combinations(
    present: np.ndarray, n_combinations: int, k: int, rng: np.random.Generator
) -> list[tuple[int, ...]]:
    """``n_combinations`` distinct random sorted sets of ``k`` of the ``present`` labels."""
    combos: list[tuple[int, ...]] = []
    while len(combos) < n_combinations:
        combo = tuple(sorted(rng.choice(present, size=k, replace=False).tolist()))
        if combo not in combos:
            combos.append(combo)
    return combos


def dirichlet(
    y_train: np.ndarray,
    y_test: np.ndarray | None,
    rng: np.random.Generator,
    *,
    n_clients: int = 100,
    alpha: float = 1.0,
    samples_per_client: int | None = None,
    draw: Literal["client", "label"] = "client",
    min_samples: int | None = None,
    test: ClientTestSpec = DEFAULT_TEST_SPEC,
) -> Partition:
    """Label skew: class proportions drawn from a symmetric Dirichlet(``alpha``).

    DCFL, Sec. III: EMNIST with Dirichlet label skew, alpha = 1 (then rotated
    per client, see ``per_client_rotation``). No ground-truth groups exist
    (``groups`` is None).

    ``draw="client"`` (default): each client draws its label proportions
    ``q_i ~ Dir(alpha * 1_C)`` over the classes present and receives
    ``samples_per_client`` samples (default: the pool split equally) in those
    proportions. Clients fill in a random order, each without replacement from
    what is left; once a class runs out, a client's remaining demand is spread
    over its other classes in proportion to ``q_i``, so the last clients to
    fill can deviate from their draw when rare classes are exhausted.

    ``draw="label"``: the DCFL wording ("assigning samples of each label to
    clients following a Dirichlet distribution"): each class's samples are split
    among the clients in proportions ``p_c ~ Dir(alpha * 1_n)``; client sizes
    then vary. Draws are repeated (up to 100 times) until every client holds at
    least ``min_samples`` (default 10) samples; ``samples_per_client`` does not
    apply, and ``min_samples`` applies only here.
    """
    y_train, y_test = _pools(y_train, y_test, rng)
    n_clients = _int_option("n_clients", n_clients)
    alpha = _float_option("alpha", alpha, 0.0)
    _choice("draw", draw, ("client", "label"))
    n_classes = int(y_train.max(initial=-1)) + 1
    available = _class_counts(y_train, n_classes)
    if draw == "client":
        if min_samples is not None:
            raise ConfigError("partition option 'min_samples' applies only to draw='label'")
        size = _client_size(samples_per_client, n_clients, int(available.sum()))
        counts = _dirichlet_per_client(available, n_clients, size, alpha, rng)
    else:
        if samples_per_client is not None:
            raise ConfigError(
                "partition option 'samples_per_client' does not apply to draw='label'"
            )
        counts = _dirichlet_per_label(
            available,
            n_clients,
            alpha,
            _int_option("min_samples", 10 if min_samples is None else min_samples),
            rng,
        )
    train = _draw_by_counts(y_train, counts, rng, "samples_per_client")
    return _finish(train, y_train, y_test, rng, test)


def _client_size(samples_per_client: int | None, n_clients: int, total: int) -> int:
    """Samples per client: as given, or the pool split equally; at most the pool."""
    size = total // n_clients if samples_per_client is None else samples_per_client
    size = _int_option("samples_per_client", size)
    if size * n_clients > total:
        raise ConfigError(
            f"partition option 'samples_per_client': {n_clients} clients x {size} samples "
            f"exceed the pool's {total}"
        )
    return size


def _dirichlet_per_client(
    available: np.ndarray, n_clients: int, size: int, alpha: float, rng: np.random.Generator
) -> np.ndarray:
    present = available > 0
    proportions = np.zeros((n_clients, len(available)))
    proportions[:, present] = rng.dirichlet(np.full(int(present.sum()), alpha), size=n_clients)
    remaining = available.copy()
    counts = np.zeros((n_clients, len(available)), dtype=np.int64)
    for i in rng.permutation(n_clients):
        need = size
        while need > 0:
            weights = np.where(remaining > 0, proportions[i], 0.0)
            if weights.sum() <= 0:  # the client's proportions vanish on every class left
                weights = (remaining > 0).astype(np.float64)
            take = np.minimum(rng.multinomial(need, weights / weights.sum()), remaining)
            counts[i] += take
            remaining -= take
            need -= int(take.sum())
    return counts


def _dirichlet_per_label(
    available: np.ndarray,
    n_clients: int,
    alpha: float,
    min_samples: int,
    rng: np.random.Generator,
) -> np.ndarray:
    if min_samples * n_clients > available.sum():
        raise ConfigError(
            f"partition option 'min_samples': {n_clients} clients x {min_samples} samples "
            f"exceed the pool's {available.sum()}"
        )
    for _ in range(100):
        shares = rng.dirichlet(np.full(n_clients, alpha), size=len(available))  # [C, n]
        counts = _apportion(shares, available).T
        if counts.sum(axis=1).min() >= min_samples:
            return counts
    raise ConfigError(
        f"partition option 'min_samples': 100 Dirichlet draws left a client with fewer than "
        f"{min_samples} samples; lower it, raise 'alpha' or use fewer clients"
    )


def shards_powerlaw(
    y_train: np.ndarray,
    y_test: np.ndarray | None,
    rng: np.random.Generator,
    *,
    n_clients: int = 1000,
    classes_per_client: int = 2,
    consecutive: bool = True,
    sigma: float = 2.0,
    min_per_class: int = 5,
    scale: float = 1.0,
    test: ClientTestSpec = DEFAULT_TEST_SPEC,
) -> Partition:
    """Few classes per client, power-law sizes: FedGroup's MNIST (FedProx's generator).

    FedGroup, Sec. III-A and IV-A: MNIST over 1,000 clients, two classes each,
    sizes following a power law, data "as [19]" (FedProx). FedProx's
    ``data/mnist/generate_niid.py``: client ``i`` holds classes ``i mod 10`` and
    ``(i+1) mod 10``; every (client, class) slot first gets 5 samples, then each
    class's remaining samples are shared among its slots in proportion to
    lognormal(0, 2) weights. Here: ``classes_per_client`` consecutive classes
    ``(i + j) mod C`` (``consecutive=False``: a random set per client),
    ``min_per_class`` samples per slot, lognormal(0, ``sigma``) weights, and
    ``scale`` of each class's samples used (default all). The shares are rounded
    by largest remainders so every selected sample is used (FedProx floors them
    and drops a few). FedProx merges train and test and holds out 10% per
    client; here test sets follow the module's policy.

    FedGroup has no ground-truth groups; the natural one is the class set:
    ``groups[i]`` is the client's first class ``i mod C`` when consecutive
    (which determines its set), else the index of its distinct sorted class set.
    """
    y_train, y_test = _pools(y_train, y_test, rng)
    n_clients = _int_option("n_clients", n_clients)
    k = _int_option("classes_per_client", classes_per_client)
    sigma = _float_option("sigma", sigma, 0.0)
    per_slot = _int_option("min_per_class", min_per_class, minimum=0)
    scale = _float_option("scale", scale, 0.0, 1.0)
    consecutive = _bool_option("consecutive", consecutive)
    n_classes = int(y_train.max(initial=-1)) + 1
    if k > n_classes:
        raise ConfigError(
            f"partition option 'classes_per_client' must be <= {n_classes} classes, got {k}"
        )
    sets, groups = _class_sets(n_clients, n_classes, k, consecutive, rng)
    weights = np.zeros((n_clients, n_classes))
    np.put_along_axis(weights, sets, rng.lognormal(0.0, sigma, size=(n_clients, k)), axis=1)
    supply = np.floor(_class_counts(y_train, n_classes) * scale).astype(np.int64)
    counts = _slot_counts(weights, supply, per_slot)
    train = _draw_by_counts(y_train, counts, rng, "n_clients")
    return _finish(train, y_train, y_test, rng, test, groups=groups.astype(np.int64))


def _class_sets(
    n_clients: int, n_classes: int, k: int, consecutive: bool, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Each client's ``k`` classes [n, k] and its group: consecutive classes from
    ``i mod C`` (group: the first class) or a random set (group: the set's index)."""
    if consecutive:
        sets = (np.arange(n_clients)[:, None] + np.arange(k)) % n_classes
        return sets, sets[:, 0].copy()
    sets = np.argsort(rng.random((n_clients, n_classes)), axis=1)[:, :k]
    groups = np.unique(np.sort(sets, axis=1), axis=0, return_inverse=True)[1].reshape(-1)
    return sets, groups


def _slot_counts(weights: np.ndarray, supply: np.ndarray, per_slot: int) -> np.ndarray:
    """``per_slot`` samples for every (client, class) slot of positive weight, then each
    class's rest of ``supply`` shared among its slots in proportion to the weights."""
    holds = weights > 0
    base = per_slot * holds.sum(axis=0)
    short = np.flatnonzero(base > supply)
    if short.size:
        c = int(short[0])
        raise ConfigError(
            f"partition option 'min_per_class': class {c} has {supply[c]} samples for "
            f"{holds[:, c].sum()} clients x {per_slot}; use fewer clients or a smaller minimum"
        )
    return per_slot * holds + _apportion(weights.T, supply - base).T


def iid(
    y_train: np.ndarray,
    y_test: np.ndarray | None,
    rng: np.random.Generator,
    *,
    n_clients: int = 100,
    samples_per_client: int | None = None,
    test: ClientTestSpec = DEFAULT_TEST_SPEC,
) -> Partition:
    """An equal random split: the IID control of every paper (e.g. CFLGT Sec. III-C).

    Each client gets ``samples_per_client`` random samples (default: the whole
    pool split equally, sizes differing by at most one). ``groups`` is None.
    """
    y_train, y_test = _pools(y_train, y_test, rng)
    n_clients = _int_option("n_clients", n_clients)
    total = len(y_train)
    if samples_per_client is not None:
        size = _int_option("samples_per_client", samples_per_client)
        if size * n_clients > total:
            raise ConfigError(
                f"partition option 'samples_per_client': {n_clients} clients x {size} samples "
                f"exceed the pool's {total}"
            )
        total = size * n_clients
    chosen = rng.permutation(len(y_train))[:total]
    train = [np.sort(part) for part in np.array_split(chosen, n_clients)]
    return _finish(train, y_train, y_test, rng, test)


# --------------------------------------------------------------------------- rotations


def with_rotations(
    partition: Partition,
    angles_per_client: Sequence[float] | np.ndarray,
    groups: Sequence[int] | np.ndarray | None = None,
) -> Partition:
    """A copy of ``partition`` whose clients' images are rotated by the given angles.

    Angles are in degrees, counter-clockwise (see ``transforms.rotate_images``);
    the federation builder applies them to both the train and test images of
    each client. ``groups`` replaces the ground truth when given, else the
    partition's own is kept.
    """
    angles = np.asarray(angles_per_client, dtype=np.float64)
    if angles.shape != (partition.n_clients,) or not np.isfinite(angles).all():
        raise ConfigError(
            f"with_rotations: need {partition.n_clients} finite angles, got shape {angles.shape}"
        )
    new_groups = partition.groups if groups is None else np.asarray(groups, dtype=np.int64)
    return replace(partition, rotations=angles, groups=new_groups)


def rotation(
    y_train: np.ndarray,
    y_test: np.ndarray | None,
    rng: np.random.Generator,
    *,
    base: str = "iid",
    base_options: dict[str, Any] | None = None,
    n_groups: int | None = None,
    angles: Sequence[float] | None = None,
    reuse: str = "none",
    test_clients: int | None = None,
) -> Partition:
    """A base partition whose clients fall into rotation groups, one angle per group.

    The rotated-data setting of IFCA (Ghosh et al.: rotated MNIST in 4 groups
    at 0, 90, 180, 270 degrees; IFCA is a baseline of JGL, CFLGT and FedGroup);
    DCFL Sec. III likewise rotates images to create attribute skew. ``base``
    names any non-rotating partition and ``base_options`` its options (test
    options included). Default: 4 groups at 0, 90, 180, 270 degrees;
    ``n_groups`` alone spaces the angles evenly over 360 degrees, ``angles``
    lists them (then ``n_groups``, if given, must match).

    Clients are assigned to rotation groups in balanced random fashion (sizes
    differ by at most one), stratified within the base partition's groups when it
    has some. ``groups`` is the rotation group, or when the base has groups,
    the index of the (base group, rotation group) pair.

    ``reuse="per_group"`` draws every rotation group from the full pool
    (:func:`_rotation_per_group`): IFCA's rotated MNIST (reference code,
    ``mnist/config.json``) gives each of its 4 groups a fresh permutation of all
    60,000 training images cut into 600 clients of 100, so every image appears
    once per rotation. ``base_options`` then describe one group, and
    ``test_clients`` switches on IFCA's test clients.
    """
    y_train, y_test = _pools(y_train, y_test, rng)
    reuse = _choice("reuse", reuse, ["none", "per_group"])
    if reuse == "none" and test_clients is not None:
        raise ConfigError("partition option 'test_clients' needs reuse='per_group'")
    angle_list = _group_angles(n_groups, angles)
    if reuse == "per_group":
        return _rotation_per_group(
            y_train, y_test, rng, base, base_options, angle_list, test_clients
        )
    partition = _base_partition(base, base_options, y_train, y_test, rng)
    count = len(angle_list)
    if count > partition.n_clients:
        raise ConfigError(
            f"partition option 'n_groups': {count} rotation groups for {partition.n_clients} "
            "clients would leave groups empty; give at most one group per client"
        )
    strata = partition.groups if partition.groups is not None else np.zeros(partition.n_clients)
    rot_group = _balanced_groups(strata, count, rng)
    groups = rot_group
    if partition.groups is not None:
        groups = np.unique(partition.groups * count + rot_group, return_inverse=True)[1]
    return with_rotations(partition, np.array(angle_list)[rot_group], groups.reshape(-1))


def _group_angles(n_groups: int | None, angles: Sequence[float] | None) -> list[float]:
    """One angle per rotation group: as listed, or ``n_groups`` (default 4) spaced
    evenly over 360 degrees."""
    if angles is None:
        count = 4 if n_groups is None else _int_option("n_groups", n_groups)
        return [360.0 * g / count for g in range(count)]
    angle_list = _degrees("angles", angles)
    if n_groups is not None and n_groups != len(angle_list):
        raise ConfigError(
            f"partition option 'angles' must list one angle per group "
            f"(n_groups={n_groups}), got {len(angle_list)}"
        )
    return angle_list


def _balanced_groups(strata: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
    """Each client's group of ``count``: dealt in turn over the clients of each stratum,
    shuffled, so group sizes differ by at most one overall and within strata."""
    groups = np.empty(len(strata), dtype=np.int64)
    offset = 0
    for stratum in np.unique(strata):
        members = rng.permutation(np.flatnonzero(strata == stratum))
        groups[members] = (offset + np.arange(members.size)) % count
        offset += members.size
    return groups


def _rotation_per_group(
    y_train: np.ndarray,
    y_test: np.ndarray | None,
    rng: np.random.Generator,
    base: str,
    base_options: dict[str, Any] | None,
    angles: list[float],
    test_clients: int | None,
) -> Partition:
    """Rotation groups each partitioned from the full pool (samples reused across groups).

    Group g (clients ``g·m .. (g+1)·m − 1``, in order, as in IFCA's reference
    code) is the base partition drawn afresh from the whole pool, so a training
    sample appears in every group (once per group with base ``iid`` over the
    whole pool). ``groups`` is the rotation group combined with the base's
    groups as in :func:`rotation`.

    ``test_clients`` = t: IFCA's test clients (``_setup_dataset(..., random=False)``
    of ``mnist/train_cluster_mnist.py``): the test split, in its stored order,
    is cut into t chunks of (nearly) equal size, and the group's clients take
    the chunks in turn (client j of a group tests on chunk j mod t), so each
    group tests on every test sample and each client chooses its model on a
    whole test client's data. With m a multiple of t every chunk serves m/t
    clients, and the accuracy over all clients equals that over the t test
    clients. The base's test options are then ignored.
    """
    if test_clients is not None:
        t = _int_option("test_clients", test_clients)
        if y_test is None:
            raise ConfigError("partition option 'test_clients' needs a dataset with a test split")
        if t > len(y_test):
            raise ConfigError(
                f"partition option 'test_clients': {t} test clients exceed the test split's "
                f"{len(y_test)} samples"
            )
    # With IFCA's test clients the base's own test sets are discarded; it draws them from
    # the training labels, which always hold the classes its clients train on.
    pool_for_base = y_test if test_clients is None else y_train
    parts = [_base_partition(base, base_options, y_train, pool_for_base, rng) for _ in angles]
    per_group = parts[0].n_clients
    train = [ix for p in parts for ix in p.train]
    test = [ix for p in parts for ix in p.test]
    pool = parts[0].test_pool
    rot_group = np.repeat(np.arange(len(angles)), per_group)
    groups = rot_group
    if parts[0].groups is not None:
        base_groups = np.concatenate([p.groups for p in parts])
        groups = np.unique(base_groups * len(angles) + rot_group, return_inverse=True)[1]
    if test_clients is not None and y_test is not None:  # checked above: a test split
        chunks = np.array_split(np.arange(len(y_test)), int(test_clients))
        test = [chunks[j % len(chunks)] for _ in angles for j in range(per_group)]
        pool = "test"
    partition = Partition(train, test, pool, groups=groups.reshape(-1))
    return with_rotations(partition, np.array(angles)[rot_group], partition.groups)


def per_client_rotation(
    y_train: np.ndarray,
    y_test: np.ndarray | None,
    rng: np.random.Generator,
    *,
    base: str = "dirichlet",
    base_options: dict[str, Any] | None = None,
    angle_range: Sequence[float] = (0.0, 360.0),
) -> Partition:
    """A base partition (default Dirichlet, alpha = 1) with one random angle per client.

    DCFL, Sec. III: "the images in the dataset of each client are rotated by a
    random angle, different for each client", on top of Dirichlet label skew.
    Angles are uniform in ``angle_range`` = (low, high) degrees. The base's
    ``groups`` are kept (None for Dirichlet: continuous angles have no groups).
    """
    y_train, y_test = _pools(y_train, y_test, rng)
    bounds = _degrees("angle_range", angle_range)
    if len(bounds) != 2 or not bounds[0] < bounds[1]:
        raise ConfigError(
            f"partition option 'angle_range' must be [low, high] degrees with low < high, "
            f"got {angle_range!r}"
        )
    partition = _base_partition(base, base_options, y_train, y_test, rng)
    low, high = bounds
    return with_rotations(partition, rng.uniform(low, high, size=partition.n_clients))


def _base_partition(
    base: str,
    base_options: dict[str, Any] | None,
    y_train: np.ndarray,
    y_test: np.ndarray | None,
    rng: np.random.Generator,
) -> Partition:
    _choice("base", base, [n for n in PARTITIONS if n not in _COMPOSITE])
    if base_options is not None and not isinstance(base_options, dict):
        raise ConfigError(
            f"partition option 'base_options' must be a mapping, got {base_options!r}"
        )
    return make_partition(base, y_train, y_test, rng, **(base_options or {}))


# --------------------------------------------------------------------------- registry


def _flwr_clients(
    name: str,
    y_train: np.ndarray,
    n_clients: int,
    options: dict[str, Any],
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """Each client's training indices from the flwr-datasets partitioner ``name``
    (``num_partitions=n_clients``; ``partition_by`` defaults to the labels and ``seed`` to
    one drawn from ``rng``)."""
    try:
        import datasets
        from flwr_datasets import partitioner as flwr_partitioners
    except ImportError:
        raise ConfigError(
            "data.partition: the flwr partition needs flwr-datasets (pip install 'fedcluster[hf]')"
        ) from None
    cls = getattr(flwr_partitioners, name, None)
    names = sorted(
        n for n in dir(flwr_partitioners) if n.endswith("Partitioner") and n != "Partitioner"
    )
    if not (isinstance(cls, type) and issubclass(cls, flwr_partitioners.Partitioner)):
        raise ConfigError(f"data.partition.partitioner: unknown {name!r}; allowed: {names}")
    accepted = inspect.signature(cls).parameters
    kwargs = {"num_partitions": n_clients, **options}
    if "partition_by" in accepted:
        kwargs.setdefault("partition_by", "label")
    if "seed" in accepted:
        kwargs.setdefault("seed", int(rng.integers(2**31)))
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ConfigError(
            f"data.partition.options: {name} has no argument {unknown[0]!r}; "
            f"allowed: {sorted(accepted)}"
        )
    try:
        part = cls(**kwargs)
        part.dataset = datasets.Dataset.from_dict(
            {"label": np.asarray(y_train, dtype=np.int64), "index": np.arange(len(y_train))}
        )
        return [
            np.asarray(part.load_partition(i)["index"], dtype=np.int64) for i in range(n_clients)
        ]
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"data.partition: {name}: {' '.join(str(exc).split())}") from None


def flwr(
    y_train: np.ndarray,
    y_test: np.ndarray | None,
    rng: np.random.Generator,
    *,
    partitioner: str = "IidPartitioner",
    n_clients: int = 10,
    options: dict[str, Any] | None = None,
    test: ClientTestSpec = DEFAULT_TEST_SPEC,
) -> Partition:
    """A partitioner of flwr-datasets by its class name (``flwr_datasets.partitioner``:
    ``IidPartitioner``, ``DirichletPartitioner``, ``PathologicalPartitioner``,
    ``ShardPartitioner``, ...) over the training labels, ``n_clients`` its
    ``num_partitions`` and ``options`` its other arguments (``partition_by`` defaults
    to the label column, ``seed`` to one drawn from the run's seed). Each client's test
    set is drawn as for the built-in partitions (``test_*`` options). Needs the
    optional dependency ``flwr-datasets`` (``pip install 'fedcluster[hf]'``).
    """
    n_clients = _int_option("n_clients", n_clients)
    y_train, y_test = _pools(y_train, y_test, rng)
    train = _flwr_clients(partitioner, y_train, n_clients, dict(options or {}), rng)
    return _finish(train, y_train, y_test, rng, test)


PARTITIONS: dict[str, Callable[..., Partition]] = {
    "iid": iid,
    "cluster_table": cluster_table,
    "label_combinations": label_combinations,
    "dirichlet": dirichlet,
    "shards_powerlaw": shards_powerlaw,
    "rotation": rotation,
    "per_client_rotation": per_client_rotation,
    "flwr": flwr,
}
_COMPOSITE = ("rotation", "per_client_rotation")


def make_partition(
    name: str,
    y_train: np.ndarray,
    y_test: np.ndarray | None,
    rng: np.random.Generator,
    **options: Any,
) -> Partition:
    """Build the partition ``name`` of ``PARTITIONS`` with keyword ``options``.

    ``name`` may also be ``package.module:function`` or an installed plugin of the
    ``fedcluster.partitions`` entry-point group (:mod:`fedcluster.config.plugins`): a function
    ``(y_train, y_test, rng, *, options...) -> Partition`` like the built-in ones.

    ``y_test`` is None when the dataset has no test split (test sets are then
    held out of each client's samples). Unknown names and options raise
    ``ConfigError`` listing what is allowed; the partition functions check the
    option values.
    """
    try:  # built in, 'package.module:function' or an installed plugin (fedcluster.config.plugins)
        func = resolve("partition", name, PARTITIONS)
    except ConfigError as exc:
        raise ConfigError(f"data.partition.name: {exc}") from None
    if not callable(func):
        raise ConfigError(f"data.partition.name: {name!r} is {func!r}, not a function")
    params = inspect.signature(func).parameters
    allowed = [
        p.name
        for p in params.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name != "test"
    ]
    if "test" in params:
        allowed += list(TEST_OPTIONS)
    for key in options:
        if key not in allowed:
            raise ConfigError(f"partition {name!r} has no option {key!r}; allowed: {allowed}")
    n = options.get("n_clients")
    if isinstance(n, int) and not isinstance(n, bool) and n > len(y_train):
        raise ConfigError(
            f"data.partition.n_clients: {n:,} clients for {len(y_train):,} training samples; "
            "each client needs at least one"
        )
    test = {TEST_OPTIONS[k]: options.pop(k) for k in list(options) if k in TEST_OPTIONS}
    if test:
        options["test"] = ClientTestSpec(**test)
    partition = func(y_train, y_test, rng, **options)
    if not isinstance(partition, Partition):
        raise ConfigError(
            f"data.partition.name: {name!r} returned {type(partition).__name__}, not a Partition"
        )
    return partition

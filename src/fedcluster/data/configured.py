"""The federation a config describes: its dataset partitioned among clients for one
seed (with the distribution shift ``data.shift`` between client groups), or the
federation a factory it names builds; clients with unusable data left out or refused
(``data.bad_clients``)."""

from __future__ import annotations

from dataclasses import dataclass

from fedcluster.config.plugins import import_object
from fedcluster.config.schema import ExperimentConfig
from fedcluster.data.federation import Federation, build_federation
from fedcluster.data.natural import NATURAL, make_natural
from fedcluster.data.partitions import Partition, make_partition
from fedcluster.data.screen import screen_clients
from fedcluster.data.shift import ShiftPlan, plan_shift, shift_images, shift_partition
from fedcluster.data.sources import Dataset, load_dataset
from fedcluster.errors import ConfigError
from fedcluster.rng import numpy_rng


def build_federation_for(config: ExperimentConfig, seed: int) -> Federation:
    """Load the dataset and partition it among clients, as the config says, for one seed
    (or call the factory ``data.federation`` names: :mod:`fedcluster.experiment.rebuild`); clients
    with unusable data are left out or refused (``data.bad_clients``)."""
    if config.data.federation is not None:
        factory = import_object(config.data.federation, "federation")
        federation = factory() if callable(factory) else factory
        if not isinstance(federation, Federation):
            raise ConfigError(
                f"data.federation: {config.data.federation!r} gave a "
                f"{type(federation).__name__}, not a Federation"
            )
    else:
        federation = load_partitioned(config, seed).federation()
    return screen_clients(federation, config.data.bad_clients)


@dataclass(frozen=True)
class Partitioned:
    """A dataset, its partition among clients and the shift between their groups."""

    dataset: Dataset
    partition: Partition
    shift: ShiftPlan | None = None

    def federation(self) -> Federation:
        """The clients' data packed, the shift's image changes applied."""
        federation = build_federation(self.dataset, self.partition)
        if self.shift is not None:
            shift_images(federation, self.shift)
        return federation


def load_partitioned(config: ExperimentConfig, seed: int) -> Partitioned:
    """The config's dataset, its partition among clients for one seed and its shift."""
    dataset, partition = _base_partitioned(config, seed)
    spec = config.data.shift
    if spec is None:
        return Partitioned(dataset, partition)
    x = dataset.train.x
    if spec.kind != "label" and x.ndim != 4:
        raise ConfigError(
            f"data.shift.kind: {spec.kind!r} transforms images [N, C, H, W]; dataset "
            f"{dataset.name!r} has inputs of shape {tuple(x.shape[1:])} (use kind 'label')"
        )
    rng = numpy_rng(seed, "shift")
    n_channels = int(x.shape[1]) if x.ndim == 4 else 0
    plan = plan_shift(
        spec, partition.groups, partition.n_clients, len(dataset.classes), n_channels, rng
    )
    test_split = dataset.train if partition.test_pool == "train" else dataset.test
    if test_split is None:
        raise ConfigError(f"dataset {dataset.name!r} has no test split for the partition's tests")
    shifted = shift_partition(partition, dataset.train.y.numpy(), test_split.y.numpy(), plan, rng)
    return Partitioned(dataset, shifted, plan)


def _base_partitioned(config: ExperimentConfig, seed: int) -> tuple[Dataset, Partition]:
    """The config's dataset and its partition among clients for one seed."""
    data = config.data
    dataset = load_dataset(
        data.dataset, data.data_dir, download=data.download, seed=seed, **data.options
    )
    options = dict(data.partition)
    name = options.pop("name")
    if name == NATURAL:
        return dataset, make_natural(dataset, numpy_rng(seed, "partition"), options)
    y_test = None if dataset.test is None else dataset.test.y.numpy()
    partition = make_partition(
        name, dataset.train.y.numpy(), y_test, numpy_rng(seed, "partition"), **options
    )
    return dataset, partition

"""The federation a config describes: its dataset partitioned among clients for one
seed, or the federation a factory it names builds; clients with unusable data left
out or refused (``data.bad_clients``)."""

from __future__ import annotations

from fedcluster.config.plugins import import_object
from fedcluster.config.schema import ExperimentConfig
from fedcluster.data.federation import Federation, build_federation
from fedcluster.data.natural import NATURAL, make_natural
from fedcluster.data.partitions import Partition, make_partition
from fedcluster.data.screen import screen_clients
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
        federation = build_federation(*load_partitioned(config, seed))
    return screen_clients(federation, config.data.bad_clients)


def load_partitioned(config: ExperimentConfig, seed: int) -> tuple[Dataset, Partition]:
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

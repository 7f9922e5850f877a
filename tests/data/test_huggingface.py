"""Data from the Hugging Face ecosystem, built here (no hub access): a ``datasets.Dataset``
of real digits saved as Parquet, Arrow and CSV feeds a run; a flwr-datasets partitioner
feeds a run and gives flwr's own clients; a fedcluster partition used as a flwr-datasets
``Partitioner`` gives the native partition's clients."""

from __future__ import annotations

import csv

import numpy as np
import pytest
import torch

datasets = pytest.importorskip("datasets")
flwr_partitioner = pytest.importorskip("flwr_datasets.partitioner")

from PIL import Image  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

from fedcluster.config.schema import validate_config  # noqa: E402
from fedcluster.data.flwr_partitioners import FedclusterPartitioner  # noqa: E402
from fedcluster.data.huggingface import from_hf  # noqa: E402
from fedcluster.data.partitions import make_partition  # noqa: E402
from fedcluster.data.sources import load_dataset  # noqa: E402
from fedcluster.errors import ConfigError, DataError  # noqa: E402
from fedcluster.experiment.runner import Experiment  # noqa: E402


@pytest.fixture(scope="module")
def digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 8x8 digits as 8-bit images (0..16 scaled to 0..255) and labels."""
    d = load_digits()
    return (d.images * 255 / 16).round().astype(np.uint8)[:600], d.target[:600]


@pytest.fixture(scope="module")
def image_dataset(digits) -> object:
    images, labels = digits
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=[str(c) for c in range(10)])}
    )
    return datasets.Dataset.from_dict(
        {"image": [Image.fromarray(a) for a in images], "label": labels.tolist()},
        features=features,
    )


def test_a_datasets_dataset_converts_pixel_for_pixel(image_dataset, digits):
    images, labels = digits
    ds = from_hf(image_dataset)
    assert ds.train.x.shape == (600, 1, 8, 8) and ds.test is None
    assert torch.equal(ds.train.x[:, 0], torch.as_tensor(images, dtype=torch.float32) / 255)
    assert torch.equal(ds.train.y, torch.as_tensor(labels))
    assert ds.classes == tuple(str(c) for c in range(10))


def _run(tmp_path, data: dict) -> list[dict[str, str]]:
    config = {
        "name": "hf",
        "seeds": [0],
        "rounds": 3,
        "data": data,
        "model": {"name": "mlp", "options": {"hidden": [32]}},
        "train": {"lr": 0.1, "batch_size": 16, "epochs": 1},
        "algorithms": [{"name": "fedavg"}],
    }
    Experiment(validate_config(config)).run(tmp_path / "run", progress=False)
    with open(tmp_path / "run" / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_a_parquet_file_of_a_datasets_dataset_feeds_a_run(tmp_path, image_dataset):
    path = tmp_path / "digits.parquet"
    image_dataset.to_parquet(str(path))
    data = {"dataset": str(path), "partition": {"name": "iid", "n_clients": 4}}
    rows = _run(tmp_path, data)
    assert len(rows) == 3 and float(rows[-1]["accuracy"]) > 0.5  # 10 classes: chance is 0.1


def test_an_arrow_folder_keeps_its_train_and_test_splits(tmp_path, image_dataset):
    split = image_dataset.train_test_split(test_size=0.25, seed=0)
    split.save_to_disk(str(tmp_path / "digits"))
    ds = load_dataset(str(tmp_path / "digits"))
    assert len(ds.train.y) == 450 and ds.test is not None and len(ds.test.y) == 150
    assert torch.equal(ds.test.y, torch.as_tensor(split["test"]["label"]))


def test_a_csv_table_gives_its_numeric_columns_as_features(tmp_path):
    path = tmp_path / "table.csv"
    path.write_text("a,b,target\n1.5,2,0\n0.5,-1,2\n3,4,1\n")
    ds = load_dataset(str(path))
    assert torch.equal(ds.train.x, torch.tensor([[1.5, 2.0], [0.5, -1.0], [3.0, 4.0]]))
    assert ds.train.y.tolist() == [0, 2, 1] and ds.classes == ("0", "1", "2")
    with pytest.raises(DataError, match="no column 'kind' \\(label_column\\)"):
        load_dataset(str(path), label_column="kind")


def test_a_hub_dataset_missing_from_the_cache_is_one_line_offline():
    with pytest.raises(DataError, match="hf:nobody/no-such-dataset: .*download") as err:
        load_dataset("hf:nobody/no-such-dataset")
    assert "\n" not in str(err.value)


def test_a_flwr_partitioner_gives_flwrs_clients_and_feeds_a_run(tmp_path, image_dataset, digits):
    _, labels = digits
    options = {"alpha": 0.5, "min_partition_size": 5, "seed": 7}
    partition = make_partition(
        "flwr",
        labels,
        None,
        np.random.default_rng(0),
        partitioner="DirichletPartitioner",
        n_clients=5,
        options=options,
        test_fraction=0.0001,  # one held-out test sample per client at least
    )
    own = flwr_partitioner.DirichletPartitioner(num_partitions=5, partition_by="label", **options)
    own.dataset = datasets.Dataset.from_dict({"label": labels.tolist(), "i": np.arange(600)})
    for c in range(5):
        theirs = set(own.load_partition(c)["i"])
        ours = set(partition.train[c].tolist()) | set(partition.test[c].tolist())
        assert ours == theirs  # the client's samples, its held-out test ones included
    path = tmp_path / "digits.parquet"
    image_dataset.to_parquet(str(path))
    data = {
        "dataset": str(path),
        "partition": {"name": "flwr", "partitioner": "IidPartitioner", "n_clients": 4},
    }
    assert len(_run(tmp_path, data)) == 3
    with pytest.raises(ConfigError, match="unknown 'NoSuchPartitioner'; allowed: .*IidPartitioner"):
        make_partition(
            "flwr", labels, None, np.random.default_rng(0), partitioner="NoSuchPartitioner"
        )


@pytest.mark.filterwarnings("ignore:cluster table asks for more samples")
@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("dirichlet", {"n_clients": 6, "alpha": 0.3}),
        ("cluster_table", {"table": "jgl-mnist", "clients_per_cluster": 1}),
    ],
)
def test_a_fedcluster_partition_as_a_flwr_partitioner_gives_the_native_clients(
    image_dataset, digits, name, options
):
    _, labels = digits
    native = make_partition(name, labels, None, np.random.default_rng(3), **options)
    partitioner = FedclusterPartitioner(name, seed=3, **options)
    partitioner.dataset = image_dataset
    assert partitioner.num_partitions == len(native.train)
    for c in range(partitioner.num_partitions):
        got = partitioner.load_partition(c)["label"]
        assert got == labels[native.train[c]].tolist()
        assert partitioner.load_test_partition(c)["label"] == labels[native.test[c]].tolist()
    if native.groups is not None:
        assert np.array_equal(partitioner.groups, native.groups)

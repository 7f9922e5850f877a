"""Shared fixtures: where the real datasets are, and skipping (or failing) without them."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fedcluster.data.sources import Dataset, load_dataset

PROJECT_ROOT = Path(__file__).resolve().parents[1]

# Dataset name -> its folder under the data root.
_DATASET_FOLDERS = {
    "mnist": "mnist",
    "fashion-mnist": "fashion-mnist",
    "emnist-bymerge": "emnist",
    "emnist-byclass": "emnist",
    "cifar10": "cifar10",
}


def _absent(reason: str) -> None:
    """Skip the test, or fail it under ``CI=true`` where the data must be there."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason} (CI=true: real datasets are required)")
    pytest.skip(reason)


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """Small test federations run fastest on one thread and do not fight other jobs for cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def shared_data_dir() -> Path:
    """The real datasets: ``$FEDCLUSTER_DATA``, else ``../shared/data`` beside the project."""
    env = os.environ.get("FEDCLUSTER_DATA")
    path = Path(env) if env else PROJECT_ROOT.parent / "shared" / "data"
    if not path.is_dir():
        _absent(f"real datasets not found at {path} (set FEDCLUSTER_DATA)")
    return path


@pytest.fixture(scope="session")
def shared_dataset(shared_data_dir: Path) -> Callable[[str], Dataset]:
    """``get(name)``: the dataset loaded from :func:`shared_data_dir`, once per session."""
    loaded: dict[str, Dataset] = {}

    def get(name: str) -> Dataset:
        if name not in loaded:
            folder = shared_data_dir / _DATASET_FOLDERS[name]
            if not folder.is_dir():
                _absent(f"{name} not found at {folder}")
            loaded[name] = load_dataset(name, shared_data_dir)
        return loaded[name]

    return get

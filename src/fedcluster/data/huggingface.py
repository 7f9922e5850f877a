"""Datasets from the Hugging Face ecosystem: ``hf:NAME`` and local Parquet, Arrow or CSV files.

``data.dataset: hf:NAME`` loads a dataset of the Hugging Face hub through the
``datasets`` library, from its own cache (``HF_HOME``, ``HF_DATASETS_CACHE``);
without ``download`` it runs offline (``HF_HUB_OFFLINE``), so a run needs no
network once the cache holds the files. ``data.dataset: PATH`` reads a local
``.parquet``, ``.csv`` or ``.arrow`` file (one pool) into memory, without a cache,
or a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``
(its ``train`` and ``test`` splits). :func:`from_hf` converts a ``datasets.Dataset`` or
``DatasetDict`` built in Python.

The inputs are the column named by the option ``input_column`` (default: the
first of ``image``, ``img``, ``pixel_values``, ``x``, ``features``), or every
numeric column but the label's for a table (a CSV file): images become float32
``[N, C, H, W]`` in [0, 1]; vectors ``[N, F]``. The labels are the column
``label_column`` (default: the first of ``label``, ``labels``, ``y``, ``target``,
``fine_label``): a ``ClassLabel`` gives its class names, integers 0..C-1 are
used as they are, strings are numbered in sorted order.

Needs the optional dependency ``datasets`` (``pip install fedcluster[hf]``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedcluster.data.dataset import Dataset, Split
from fedcluster.errors import ConfigError, DataError

PREFIX = "hf:"
FILE_TYPES = {".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
INPUT_COLUMNS = ("image", "img", "pixel_values", "x", "features")
LABEL_COLUMNS = ("label", "labels", "y", "target", "fine_label")
OPTIONS = ("input_column", "label_column")


def is_hf_source(name: str) -> bool:
    """Whether ``data.dataset`` names a hub dataset or a local Parquet/Arrow/CSV source."""
    if name.startswith(PREFIX):
        return True
    path = Path(name)
    return (
        path.suffix.lower() in FILE_TYPES
        or (path / "dataset_dict.json").is_file()
        or (path / "dataset_info.json").is_file()
    )


def _datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            "data.dataset: Hugging Face datasets need the 'datasets' package "
            "(pip install 'fedcluster[hf]')"
        ) from None
    return datasets


@contextmanager
def _offline(offline: bool) -> Iterator[None]:
    """The hub left alone (``HF_HUB_OFFLINE``) while ``offline``."""
    import huggingface_hub.constants as hub

    datasets = _datasets()
    before = (hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE)
    hub.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = offline or before[0]
    try:
        yield
    finally:
        hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = before


def load_hf(name: str, download: bool, options: dict[str, Any]) -> Dataset:
    """The hub dataset ``hf:NAME`` or the local file or folder ``name``, as a fedcluster
    :class:`Dataset` (module docstring)."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ConfigError(f"dataset {name!r} has no option {unknown[0]!r}; allowed: {OPTIONS}")
    datasets = _datasets()
    try:
        if name.startswith(PREFIX):
            with _offline(not download):
                loaded = datasets.load_dataset(name[len(PREFIX) :])
        elif Path(name).is_dir():
            loaded = datasets.load_from_disk(name)
        else:
            loaded = _read_file(Path(name))
    except (DataError, ConfigError):
        raise
    except Exception as exc:  # noqa: BLE001 -- the library's many errors, as one line
        hub = name.startswith(PREFIX) and not download
        hint = " (not in the local cache: run once with download enabled)" if hub else ""
        raise DataError(
            f"data.dataset: {name}: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}{hint}"
        ) from None
    return from_hf(loaded, name, **options)


def _read_file(path: Path) -> Any:
    """A Parquet, CSV or Arrow file as an in-memory ``datasets.Dataset``."""
    import pyarrow.csv
    import pyarrow.parquet

    if not path.is_file():
        raise DataError(f"data.dataset: {path}: no such file")
    kind = FILE_TYPES[path.suffix.lower()]
    datasets = _datasets()
    if kind == "arrow":
        return datasets.Dataset.from_file(str(path))
    read = pyarrow.parquet.read_table if kind == "parquet" else pyarrow.csv.read_csv
    return datasets.Dataset(read(str(path)))


def from_hf(
    data: Any, name: str = "hf", input_column: str | None = None, label_column: str | None = None
) -> Dataset:
    """A ``datasets.Dataset`` (one pool) or ``DatasetDict`` (its ``train`` and, if
    present, ``test`` splits) as a fedcluster :class:`Dataset`."""
    datasets = _datasets()
    if isinstance(data, datasets.DatasetDict):
        if "train" not in data:
            raise DataError(f"{name}: no 'train' split (splits: {sorted(data)})")
        train, test = data["train"], data.get("test")
    elif isinstance(data, datasets.Dataset):
        train, test = data, None
    else:
        raise ConfigError(f"{name}: a datasets.Dataset or DatasetDict, not {type(data).__name__}")
    label = _column(train, label_column, LABEL_COLUMNS, "label_column", name)
    classes = _classes(train, label, test, name)
    return Dataset(
        name=name,
        train=_split(train, input_column, label, classes, name),
        test=None if test is None else _split(test, input_column, label, classes, name),
        classes=classes,
    )


def _column(
    table: Any, given: str | None, defaults: tuple[str, ...], option: str, name: str
) -> str:
    if given is not None:
        if given not in table.column_names:
            raise DataError(
                f"{name}: no column {given!r} ({option}); columns: {table.column_names}"
            )
        return given
    found = next((c for c in defaults if c in table.column_names), None)
    if found is None:
        raise DataError(
            f"{name}: none of the columns {list(defaults)}; name one with {option} "
            f"(columns: {table.column_names})"
        )
    return found


def _classes(train: Any, label: str, test: Any, name: str) -> tuple[str, ...]:
    """The class names: a ClassLabel's, else the sorted distinct labels of both splits."""
    feature = train.features[label]
    names = getattr(feature, "names", None)
    if names:
        return tuple(str(n) for n in names)
    values = list(train[label]) + ([] if test is None else list(test[label]))
    distinct = sorted(set(values))
    if all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in distinct):
        top = int(max(distinct, default=-1))
        if distinct and int(distinct[0]) < 0:
            raise DataError(
                f"{name}: label column {label!r} holds the negative label {distinct[0]}"
            )
        return tuple(str(c) for c in range(top + 1))
    return tuple(str(v) for v in distinct)


def _split(
    table: Any, input_column: str | None, label: str, classes: tuple[str, ...], name: str
) -> Split:
    y = _labels(table[label], classes, label, name)
    try:
        column = _column(table, input_column, INPUT_COLUMNS, "input_column", name)
    except DataError:
        if input_column is not None:
            raise
        return Split(_table_inputs(table, label, name), y)
    return Split(_inputs(table.with_format("numpy")[column], column, name), y)


def _labels(values: Any, classes: tuple[str, ...], column: str, name: str) -> torch.Tensor:
    values = list(values)
    if values and isinstance(values[0], str):
        index = {c: i for i, c in enumerate(classes)}
        return torch.tensor([index[v] for v in values], dtype=torch.int64)
    y = np.asarray(values)
    if not np.issubdtype(y.dtype, np.integer):
        raise DataError(
            f"{name}: label column {column!r} holds {y.dtype} values, not integer labels"
        )
    return torch.as_tensor(y.astype(np.int64))


def _inputs(column: Any, name: str, dataset: str) -> torch.Tensor:
    """Images [N, C, H, W] in [0, 1] (from 8-bit pixels) or vectors [N, F]."""
    arrays = [np.asarray(v) for v in column]
    shapes = {a.shape for a in arrays}
    if len(shapes) != 1:
        raise DataError(f"{dataset}: column {name!r} holds inputs of {len(shapes)} shapes")
    x = np.stack(arrays) if arrays else np.zeros((0, 1), dtype=np.float32)
    scale = 255.0 if x.dtype == np.uint8 else 1.0
    x = x.astype(np.float32) / scale
    if x.ndim == 3:  # grey images [N, H, W]
        x = x[:, None]
    elif x.ndim == 4 and x.shape[-1] in (1, 3, 4):  # channels last [N, H, W, C]
        x = x.transpose(0, 3, 1, 2)
    return torch.from_numpy(np.ascontiguousarray(x))


def _table_inputs(table: Any, label: str, name: str) -> torch.Tensor:
    """Every numeric column but the label's, as features [N, F] (a table such as a CSV file)."""
    columns = [c for c in table.column_names if c != label]
    numeric = table.with_format("numpy")[:]
    bad = [c for c in columns if not np.issubdtype(np.asarray(numeric[c]).dtype, np.number)]
    if bad or not columns:
        raise DataError(
            f"{name}: no input column among {list(INPUT_COLUMNS)} and the columns {bad} are "
            "not numeric; name the inputs with input_column"
        )
    return torch.as_tensor(np.stack([np.asarray(numeric[c], dtype=np.float32) for c in columns], 1))

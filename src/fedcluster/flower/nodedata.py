"""Node-local data: each client's samples as a file a device holds.

In a deployment a device holds its own data and nothing else. ``fedcluster
flower export`` (:mod:`fedcluster.flower.export`) writes every client's train
and test split of an experiment's federation as one ``.npz`` file
(``client-0007.npz``: ``x_train`` float32, ``y_train`` int64, ``x_test``,
``y_test``; read with ``allow_pickle=False``, so a file cannot run code) and a
``manifest.json`` naming, per client, its file, sample counts, ground-truth
group (where the partition knows one) and the file's SHA-256, plus the
federation's ``n_classes``, ``input_shape``, number of clients, the seed and
the config's name.

A SuperNode is given a path (``--node-config "data=PATH"``): a folder with a
``manifest.json`` and the files of the clients it serves, or one client's
file with the manifest beside it. :func:`load_node_clients` reads exactly the
clients the path names (it opens no other file), checks each against the
manifest (hash, array names, dtypes, shapes, label range) and returns one
single-client :class:`~fedcluster.data.federation.Federation` per global
client id -- what :meth:`Federation.subset` of the simulator's federation
gives for that client, so a node computes what the simulator computes.
:func:`load_node_client` reads one of them: a node serving several clients
checks and loads each on its own, so one corrupt file fails only its client.
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fedcluster.data.federation import Federation
from fedcluster.errors import DataError

if TYPE_CHECKING:
    from fedcluster.engine.simulator import Simulator

MANIFEST = "manifest.json"
FORMAT = "fedcluster-node-data"
VERSION = 1
ARRAYS = {"x_train": np.float32, "y_train": np.int64, "x_test": np.float32, "y_test": np.int64}


def client_file(client: int) -> str:
    """The file name of one client's data."""
    return f"client-{client:04d}.npz"


def sha256(path: Path) -> str:
    """Hex SHA-256 of a file."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class NodeManifest:
    """What ``manifest.json`` says: the federation's shape and the clients listed."""

    path: Path
    seed: int
    config: str
    n_classes: int
    input_shape: tuple[int, ...]
    clients: dict[int, dict[str, Any]]
    """Global client id -> ``file``, ``train_size``, ``test_size``, ``group``, ``sha256``."""
    n_clients: int | None = None
    """The whole federation's clients (a node's manifest lists only its own): lets the
    server name the clients that no node serves."""

    def to_json(self, clients: list[int] | None = None) -> dict[str, Any]:
        """The manifest as JSON, restricted to ``clients`` (default: all)."""
        keep = sorted(self.clients) if clients is None else sorted(clients)
        return {
            "format": FORMAT,
            "version": VERSION,
            "config": self.config,
            "seed": self.seed,
            "n_classes": self.n_classes,
            "input_shape": list(self.input_shape),
            "n_clients": self.n_clients,
            "clients": [{"client": c, **self.clients[c]} for c in keep],
        }


def write_manifest(manifest: NodeManifest, folder: Path, clients: list[int] | None = None) -> Path:
    """Write ``folder/manifest.json`` (atomically) for ``clients`` of ``manifest``."""
    path = Path(folder) / MANIFEST
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(manifest.to_json(clients), indent=1) + "\n")
    os.replace(tmp, path)
    return path


def read_manifest(path: str | Path) -> NodeManifest:
    """The manifest of a data path: ``PATH/manifest.json`` for a folder, the
    ``manifest.json`` beside the file for a client's file."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: node data not found")
    file = path / MANIFEST if path.is_dir() else path.parent / MANIFEST
    if not file.is_file():
        raise DataError(f"{file}: missing (node data needs the manifest beside the client files)")
    try:
        raw = json.loads(file.read_text())
        if raw.get("format") != FORMAT or int(raw.get("version", 0)) != VERSION:
            raise ValueError(f"not a {FORMAT} manifest of version {VERSION}")
        clients = {
            int(c["client"]): {
                "file": str(c["file"]),
                "train_size": int(c["train_size"]),
                "test_size": int(c["test_size"]),
                "group": None if c.get("group") is None else int(c["group"]),
                "sha256": str(c["sha256"]),
            }
            for c in raw["clients"]
        }
        manifest = NodeManifest(
            path=file,
            seed=int(raw["seed"]),
            config=str(raw["config"]),
            n_classes=int(raw["n_classes"]),
            input_shape=tuple(int(s) for s in raw["input_shape"]),
            clients=clients,
            n_clients=None if raw.get("n_clients") is None else int(raw["n_clients"]),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{file}: invalid manifest ({exc})") from None
    for c, entry in clients.items():
        if Path(str(entry["file"])).name != entry["file"]:
            raise DataError(f"{file}: client {c}'s file {entry['file']!r} must be a plain name")
    return manifest


def save_client(folder: Path, client: int, part: Federation) -> dict[str, Any]:
    """Write one client's data (``part``, a one-client federation) to ``folder``;
    its manifest entry."""
    name = client_file(client)
    path = Path(folder) / name
    tmp = path.with_name(name + ".tmp.npz")
    np.savez(
        tmp,
        x_train=part.x_train.numpy().astype(np.float32, copy=False),
        y_train=part.y_train.numpy().astype(np.int64, copy=False),
        x_test=part.x_test.numpy().astype(np.float32, copy=False),
        y_test=part.y_test.numpy().astype(np.int64, copy=False),
    )
    os.replace(tmp, path)
    return {
        "file": name,
        "train_size": int(part.train_sizes[0]),
        "test_size": int(part.test_sizes[0]),
        "group": None if part.groups is None else int(part.groups[0]),
        "sha256": sha256(path),
    }


def _read_client(manifest: NodeManifest, client: int, folder: Path) -> Federation:
    entry = manifest.clients[client]
    path = folder / entry["file"]
    if not path.is_file():
        raise DataError(f"{path}: client {client}'s data file is missing")
    if sha256(path) != entry["sha256"]:
        raise DataError(f"{path}: SHA-256 differs from {manifest.path.name} (corrupt or replaced)")
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as exc:
        raise DataError(f"{path}: unreadable .npz ({exc})") from None
    missing = sorted(set(ARRAYS) - set(arrays))
    if missing:
        raise DataError(f"{path}: missing arrays {missing}")
    for key, dtype in ARRAYS.items():
        if arrays[key].dtype != dtype:
            expected = np.dtype(dtype).name
            raise DataError(f"{path}: {key} has dtype {arrays[key].dtype}, expected {expected}")
    for split in ("train", "test"):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        size = entry[f"{split}_size"]
        if x.shape[1:] != manifest.input_shape:
            raise DataError(
                f"{path}: x_{split} samples have shape {x.shape[1:]}, "
                f"the manifest says {manifest.input_shape}"
            )
        if y.ndim != 1 or len(x) != size or len(y) != size:
            raise DataError(
                f"{path}: {split} split has {len(x)} samples and {len(y)} labels, "
                f"the manifest says {size}"
            )
        if size and (y.min() < 0 or y.max() >= manifest.n_classes):
            raise DataError(
                f"{path}: {split} labels outside 0..{manifest.n_classes - 1} "
                f"(found {int(y.min())}..{int(y.max())})"
            )
        if not np.isfinite(x).all():
            raise DataError(f"{path}: x_{split} holds NaN or infinite values")
    groups = None if entry["group"] is None else np.array([entry["group"]])
    return Federation.from_clients(
        [(torch.from_numpy(arrays["x_train"]), torch.from_numpy(arrays["y_train"]))],
        [(torch.from_numpy(arrays["x_test"]), torch.from_numpy(arrays["y_test"]))],
        manifest.n_classes,
        groups,
    )


def node_clients(path: str | Path) -> tuple[NodeManifest, Path, list[int]]:
    """The manifest of a data path, the folder of its files and the clients it holds.

    ``path`` is a folder (every client its ``manifest.json`` lists) or one
    client's ``.npz`` file (the manifest beside it names which client). Opens
    only the manifest.
    """
    path = Path(path)
    manifest = read_manifest(path)
    if path.is_dir():
        folder, clients = path, sorted(manifest.clients)
    else:
        folder = path.parent
        clients = [c for c, e in manifest.clients.items() if e["file"] == path.name]
        if not clients:
            raise DataError(f"{path}: not listed in {manifest.path}")
    if not clients:
        raise DataError(f"{manifest.path}: lists no client")
    return manifest, folder, clients


def load_node_clients(path: str | Path) -> dict[int, Federation]:
    """The clients a data path holds (:func:`node_clients`), as one-client federations
    keyed by global id. Only those files are opened; any problem is a
    :class:`DataError` naming the file."""
    manifest, folder, clients = node_clients(path)
    return {c: _read_client(manifest, c, folder) for c in clients}


def load_node_client(path: str | Path, client: int) -> Federation:
    """One client of those a data path holds (opens only its file)."""
    manifest, folder, clients = node_clients(path)
    if client not in clients:
        raise DataError(f"{path}: holds clients {clients}, not client {client}")
    return _read_client(manifest, client, folder)


@lru_cache(maxsize=256)
def node_simulator(path: str, experiment: str, seed: int, client: int) -> Simulator:
    """The simulator of client ``client`` a node holds at ``path`` (cached per process:
    a node serving several clients keeps each one's data and model), for the
    experiment whose YAML text is ``experiment``.

    The data must have been exported for the run's ``seed`` (the partition
    depends on it). Only that client's file is opened; a file that fails its
    checks raises (again on the next request: nothing is cached for it).
    """
    import yaml

    from fedcluster.config.schema import validate_config
    from fedcluster.experiment.runner import model_for, simulator_for

    check_seed(path, seed)
    own = load_node_client(path, client)
    config = validate_config(yaml.safe_load(experiment))
    model = model_for(config, own)
    # one thread per node: several nodes may share a machine
    return simulator_for(config, model, own, seed, threads=1, client_ids=np.array([client]))


def check_seed(path: str | Path, seed: int) -> NodeManifest:
    """The manifest of ``path``; a :class:`DataError` when it was exported for another seed."""
    manifest = read_manifest(path)
    if manifest.seed != seed:
        raise DataError(
            f"{path}: data exported for seed {manifest.seed}, the run asks for seed {seed}"
        )
    return manifest

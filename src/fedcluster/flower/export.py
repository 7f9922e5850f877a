"""``fedcluster flower export``: an experiment's federation as node-local files.

Builds the federation of one seed exactly as the simulator does
(:func:`fedcluster.data.configured.build_federation_for`: the config's dataset and
partition) and writes one file per client plus ``manifest.json``
(:mod:`fedcluster.flower.nodedata`). With ``nodes`` it also writes
``node-K/`` folders, each with only its clients' files and a manifest that
lists only them: the folder to copy onto device K.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np

from fedcluster.config.schema import ExperimentConfig
from fedcluster.errors import FedclusterError
from fedcluster.flower.nodedata import NodeManifest, read_manifest, save_client, write_manifest


def spread_clients(n_clients: int, n_nodes: int) -> list[list[int]]:
    """Clients ``0..n_clients-1`` in ``n_nodes`` contiguous blocks (sizes differ by <= 1)."""
    if not 1 <= n_nodes <= n_clients:
        raise FedclusterError(f"--nodes {n_nodes}: needs 1..{n_clients} (the federation's clients)")
    return [list(map(int, block)) for block in np.array_split(np.arange(n_clients), n_nodes)]


def export_federation(
    config: ExperimentConfig, out: str | Path, seed: int | None = None
) -> NodeManifest:
    """Write every client's data of ``config``'s federation for ``seed`` (default:
    the config's first seed) to ``out``; the manifest written."""
    from fedcluster.data.configured import build_federation_for

    seed = config.seeds[0] if seed is None else seed
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    federation = build_federation_for(config, seed)
    clients = {c: save_client(out, c, federation.subset([c])) for c in range(federation.n_clients)}
    manifest = NodeManifest(
        path=out / "manifest.json",
        seed=seed,
        config=config.name,
        n_classes=int(federation.n_classes),
        input_shape=tuple(int(s) for s in federation.input_shape),
        clients=clients,
        n_clients=federation.n_clients,
    )
    write_manifest(manifest, out)
    return manifest


def node_folder(source: str | Path, clients: list[int], dest: str | Path) -> Path:
    """A folder ``dest`` holding only ``clients``' files of the export ``source``
    (hard links where possible, else copies) and a manifest listing only them."""
    manifest = read_manifest(source)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for c in clients:
        if c not in manifest.clients:
            raise FedclusterError(f"{manifest.path}: has no client {c}")
        name = manifest.clients[c]["file"]
        target = dest / name
        if target.exists():
            target.unlink()
        try:
            os.link(Path(source) / name, target)
        except OSError:
            shutil.copyfile(Path(source) / name, target)
    write_manifest(manifest, dest, clients)
    return dest


def export_for_nodes(source: str | Path, n_nodes: int) -> list[tuple[Path, list[int]]]:
    """``source/node-K/`` for K < ``n_nodes``, the clients spread over them; the
    folders and their clients."""
    manifest = read_manifest(source)
    blocks = spread_clients(len(manifest.clients), n_nodes)
    ids = sorted(manifest.clients)
    out = []
    for k, block in enumerate(blocks):
        clients = [ids[i] for i in block]
        out.append((node_folder(source, clients, Path(source) / f"node-{k}"), clients))
    return out

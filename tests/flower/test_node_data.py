"""Node-local data (fedcluster.flower.nodedata / export) and the Flower App writer.

The exported files must hold exactly the simulator's per-client data
(:meth:`Federation.subset` of the federation the runner builds), a node must
read only what its path names, and every kind of damage must be one line
naming the file.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch

from fedcluster.config.schema import validate_config
from fedcluster.data.configured import build_federation_for
from fedcluster.errors import DataError, FedclusterError
from fedcluster.flower.export import export_federation, export_for_nodes, spread_clients
from fedcluster.flower.nodedata import (
    client_file,
    load_node_client,
    load_node_clients,
    read_manifest,
    sha256,
)
from tests.helpers import rotated_mnist5k

CONFIG = {
    "name": "node-data",
    "seeds": [3],
    "rounds": 1,
    "data": rotated_mnist5k(5),
    "model": {"name": "mlp", "options": {"hidden": [8]}},
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    config = validate_config(CONFIG)
    out = tmp_path_factory.mktemp("export")
    export_federation(config, out)
    return config, out


def test_each_file_holds_the_simulators_data_of_its_client(exported):
    config, out = exported
    federation = build_federation_for(config, 3)
    manifest = read_manifest(out)
    assert manifest.seed == 3 and manifest.config == "node-data"
    assert manifest.n_classes == federation.n_classes
    assert manifest.input_shape == federation.input_shape
    clients = load_node_clients(out)
    assert sorted(clients) == list(range(5))
    for c, own in clients.items():
        assert own.n_clients == 1
        for split in ("train", "test"):
            sl = federation.client_slice(c, split)
            assert torch.equal(getattr(own, f"x_{split}"), getattr(federation, f"x_{split}")[sl])
            assert torch.equal(getattr(own, f"y_{split}"), getattr(federation, f"y_{split}")[sl])
        assert own.groups[0] == federation.groups[c] == manifest.clients[c]["group"]
        assert manifest.clients[c]["train_size"] == federation.train_sizes[c]
        assert manifest.clients[c]["sha256"] == sha256(out / client_file(c))


def test_node_folders_hold_only_their_clients(exported, tmp_path):
    _, out = exported
    assert spread_clients(5, 2) == [[0, 1, 2], [3, 4]]
    assert spread_clients(4, 4) == [[0], [1], [2], [3]]
    with pytest.raises(FedclusterError, match="--nodes 6"):
        spread_clients(5, 6)
    folders = export_for_nodes(out, 2)
    for folder, clients in folders:
        assert sorted(p.name for p in folder.glob("*.npz")) == [client_file(c) for c in clients]
        assert sorted(load_node_clients(folder)) == clients
    # one client's file: the manifest beside it says which client it is
    assert list(load_node_clients(out / client_file(4))) == [4]
    # a node's manifest lists its clients and the whole federation's size
    for folder, clients in folders:
        manifest = read_manifest(folder)
        assert sorted(manifest.clients) == clients and manifest.n_clients == 5


def test_one_client_of_a_node_is_read_without_opening_the_others(exported, tmp_path):
    _, out = exported
    folder = _copy(out, tmp_path / "node", client=1).parent
    (folder / client_file(2)).write_bytes(b"not an npz")  # another client's file, broken
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["clients"] = [c for c in manifest["clients"] if c["client"] in (1, 2)]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    assert torch.equal(load_node_client(folder, 1).y_train, load_node_clients(out)[1].y_train)
    with pytest.raises(DataError, match=f"{client_file(2)}: SHA-256 differs"):
        load_node_client(folder, 2)
    with pytest.raises(DataError, match="holds clients \\[1, 2\\], not client 3"):
        load_node_client(folder, 3)


def _copy(out: Path, dest: Path, client: int = 1) -> Path:
    dest.mkdir()
    (dest / "manifest.json").write_text((out / "manifest.json").read_text())
    (dest / client_file(client)).write_bytes((out / client_file(client)).read_bytes())
    return dest / client_file(client)


def _rehash(path: Path, client: int) -> None:
    """Make the manifest agree with a changed file, so the content checks are reached."""
    manifest = json.loads((path.parent / "manifest.json").read_text())
    for entry in manifest["clients"]:
        if entry["client"] == client:
            entry["sha256"] = sha256(path)
    (path.parent / "manifest.json").write_text(json.dumps(manifest))


def _one_line_error(path) -> str:
    with pytest.raises(DataError) as err:
        load_node_clients(path)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_damaged_files_are_one_line_errors_naming_the_file(exported, tmp_path):
    _, out = exported
    # flipped bytes: the hash check
    file = _copy(out, tmp_path / "flip")
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))
    assert _one_line_error(file).startswith(f"{file}: SHA-256 differs")
    # truncated, hash updated: not a readable .npz
    file = _copy(out, tmp_path / "cut")
    file.write_bytes(file.read_bytes()[:1000])
    _rehash(file, 1)
    assert "unreadable .npz" in _one_line_error(file)
    # pickled object arrays are refused (allow_pickle=False)
    file = _copy(out, tmp_path / "pickle")
    own = np.load(file)
    np.savez(file, **{**own, "y_train": np.array([object()] * len(own["y_train"]))})
    _rehash(file, 1)
    assert str(file) in _one_line_error(file)
    # wrong dtype, wrong shape, labels out of range, NaN, a missing array
    for name, change, expect in (
        ("dtype", {"x_train": lambda a: a.astype(np.float64)}, "dtype float64, expected float32"),
        ("shape", {"x_test": lambda a: a[..., :1]}, "x_test samples have shape"),
        ("labels", {"y_train": lambda a: a + 100}, "labels outside 0..9"),
        ("nan", {"x_train": lambda a: np.where(a == a.max(), np.nan, a)}, "NaN"),
        ("count", {"y_test": lambda a: a[:-1]}, "test split has"),
    ):
        file = _copy(out, tmp_path / name)
        arrays = dict(np.load(file))
        for key, f in change.items():
            arrays[key] = f(arrays[key])
        np.savez(file, **arrays)
        _rehash(file, 1)
        message = _one_line_error(file)
        assert message.startswith(str(file)) and expect in message, message
    file = _copy(out, tmp_path / "missing")
    arrays = dict(np.load(file))
    del arrays["y_test"]
    np.savez(file, **arrays)
    _rehash(file, 1)
    assert "missing arrays ['y_test']" in _one_line_error(file)
    # no manifest, a manifest that is not ours, a file not listed
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / client_file(1)).write_bytes((out / client_file(1)).read_bytes())
    assert "manifest.json: missing" in _one_line_error(lone / client_file(1))
    (lone / "manifest.json").write_text('{"format": "other"}')
    assert "invalid manifest" in _one_line_error(lone)
    renamed = _copy(out, tmp_path / "unlisted")
    renamed = renamed.rename(renamed.with_name("x.npz"))
    assert "not listed" in _one_line_error(renamed)


def test_the_flower_app_names_fedclusters_apps_and_its_run_config(exported, tmp_path):
    pytest.importorskip("flwr")
    from fedcluster.flower.app import config_from_run, write_app

    config, export = exported
    manifest = read_manifest(export)
    config = config.model_copy(
        update={"deployment": config.deployment.model_copy(update={"min_replies": 0.75})}
    )
    folder = write_app(tmp_path / "app", config, out="runs/x", manifest=manifest.path)
    project = tomllib.loads((folder / "pyproject.toml").read_text())
    flwr = project["tool"]["flwr"]["app"]
    assert flwr["publisher"] == "fedcluster"
    assert flwr["components"] == {
        "serverapp": "fedcluster.flower.server:server_app",
        "clientapp": "fedcluster.flower.client:client_app",
    }
    run = flwr["config"]
    # every deployment setting written out; the output directory absolute
    assert run["config"] == "experiment.yaml" and run["out"] == str(Path("runs/x").absolute())
    assert run["round-timeout"] == "auto" and run["min-replies"] == 0.75
    assert run["timeout-floor"] == 30.0 and run["timeout-factor"] == 3.0
    assert run["timeout-ceiling"] == 600.0
    assert run["manifest"] == "manifest.json"
    assert (folder / "manifest.json").read_bytes() == manifest.path.read_bytes()
    # the ServerApp's view: paths relative to the app folder, settings into `deployment`
    given = {k: str(folder / run[k]) for k in ("config", "manifest")}
    loaded, out, expected = config_from_run({**run, **given, "round-timeout": 30})
    assert out == run["out"] and expected is not None
    assert expected.clients == manifest.clients
    assert loaded.deployment.round_timeout == 30.0 and loaded.deployment.min_replies == 0.75
    assert loaded.model_dump(exclude={"deployment"}) == config.model_dump(exclude={"deployment"})
    auto, _, _ = config_from_run({**run, **given})
    assert auto.deployment == config.deployment
    with pytest.raises(FedclusterError, match="'min-replies': 'most' is not a number"):
        config_from_run({**run, **given, "min-replies": "most"})
    with pytest.raises(FedclusterError, match="nothere.yaml not found"):
        config_from_run({"config": "nothere.yaml"})

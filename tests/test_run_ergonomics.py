"""Notebook and GPU ergonomics: re-running into the same ``out`` (an auto-suffixed
directory, or ``overwrite``), and ``device: cuda:N`` / ``mps`` validated against this
machine."""

from __future__ import annotations

import pytest
import torch

import fedcluster
from fedcluster.config.schema import resolve_config
from fedcluster.engine.device import resolve_device
from fedcluster.errors import ConfigError, FedclusterError
from fedcluster.experiment.rundir import RunDirectory, fresh_run_path
from tests.helpers import rotated_digits

SETTINGS = {"rounds": 1, "train": {"lr": 0.1, "batch_size": 16}, "report": False}


@pytest.fixture(scope="module")
def federation():
    return rotated_digits(n_groups=2, clients_per_group=2, per_client=30)


def test_rerunning_a_cell_into_the_same_out_keeps_the_first_run(tmp_path, federation):
    out = tmp_path / "run"
    first = fedcluster.run(federation=federation, out=out, **SETTINGS)
    written = (out / "metrics.csv").read_bytes()
    second = fedcluster.run(federation=federation, out=out, **SETTINGS)
    third = fedcluster.run(federation=federation, out=out, **SETTINGS)
    assert (first.path, second.path, third.path) == (out, tmp_path / "run-2", tmp_path / "run-3")
    assert (out / "metrics.csv").read_bytes() == written  # untouched
    assert [r["accuracy"] for r in second.metrics] == [r["accuracy"] for r in first.metrics]


def test_overwrite_replaces_the_run_directory(tmp_path, federation):
    out = tmp_path / "run"
    fedcluster.run(federation=federation, algorithms=["local"], out=out, **SETTINGS)
    (out / "notes.txt").write_text("left by the user")
    again = fedcluster.run(federation=federation, out=out, overwrite=True, **SETTINGS)
    assert again.path == out
    assert not (out / "notes.txt").exists()
    assert {r["algorithm"] for r in again.metrics} == {"fedavg"}
    assert not (tmp_path / "run-2").exists()


def test_overwrite_refuses_what_is_not_a_run_directory_or_is_in_use(tmp_path, federation):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("keep")
    with pytest.raises(FedclusterError, match="not a run directory"):
        fresh_run_path(mine, overwrite=True)
    assert (mine / "thesis.tex").read_text() == "keep"
    out = tmp_path / "run"
    fedcluster.run(federation=federation, out=out, **SETTINGS)
    with RunDirectory(out).lock(), pytest.raises(FedclusterError, match="in use"):
        fresh_run_path(out, overwrite=True)
    assert (out / "summary.json").is_file()


def test_a_file_at_out_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(FedclusterError, match="not a directory"):
        fresh_run_path(tmp_path / "file")


@pytest.mark.parametrize("name", ["cuda:0", "cuda:1", "mps", "cpu", "auto", "cuda"])
def test_the_device_names_torch_knows_are_valid_config(name):
    sets = [f"device={name}"]
    assert resolve_config(None, "quickstart", sets).device == name


@pytest.mark.parametrize("name", ["gpu", "cuda:x", "cuda1", "tpu"])
def test_other_device_names_are_refused_naming_the_field(name):
    with pytest.raises(ConfigError, match="device"):
        resolve_config(None, "quickstart", [f"device={name}"])
    with pytest.raises(ConfigError, match="device"):
        resolve_device(name)


def test_a_gpu_index_beyond_the_machine_is_a_one_line_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ConfigError, match=r"device: 'cuda:2'.*2 CUDA GPU\(s\)"):
        resolve_device("cuda:2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="no CUDA GPU"):
        resolve_device("cuda:0")


def test_mps_where_it_is_missing_is_a_one_line_error(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="MPS backend is not available"):
        resolve_device("mps")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert resolve_device("mps") == torch.device("mps")


def test_progress_bars_are_tqdm_auto_widgets_in_notebooks():
    import tqdm.auto

    from fedcluster.experiment import rundir

    assert rundir.tqdm is tqdm.auto.tqdm

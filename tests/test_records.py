"""What a run records of itself: the code and data that made it (config.yaml, summary.json),
RunResult.summary as documented, a purity ceiling that bounds the mean printed beside it,
bare algorithm names in YAML, and a resume message that speaks only of real repairs."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

import fedcluster
from fedcluster.config.schema import load_yaml, resolve_config, validate_config
from fedcluster.experiment.rebuild import federation_sha256
from fedcluster.experiment.rundir import RunDirectory, config_digest, load_checkpoint
from fedcluster.experiment.runner import Experiment, resume
from fedcluster.experiment.summary import summary_rows
from tests.helpers import rotated_digits

SETTINGS = {"rounds": 2, "train": {"lr": 0.1, "batch_size": 16}, "report": False}


def expected_revision() -> str:
    """The revision ``git`` itself gives for the checkout fedcluster is imported from."""
    package = Path(fedcluster.__file__).resolve().parent

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(package), *args], capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        top = Path(git("rev-parse", "--show-toplevel")).resolve()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    if top / "src" / "fedcluster" != package:
        return "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".")
    return git("rev-parse", "HEAD") + ("+modified" if dirty else "")


@pytest.fixture(scope="module")
def factory_run(tmp_path_factory):
    """A run whose clients come from a federation object passed from Python."""
    federation = rotated_digits(n_groups=2, clients_per_group=2, per_client=30)
    out = tmp_path_factory.mktemp("records") / "run"
    result = fedcluster.run(federation=federation, algorithms=["fedavg"], out=out, **SETTINGS)
    return result, federation


def small_federation():
    """A federation factory defined in a module: recorded by its import path."""
    return rotated_digits(n_groups=2, clients_per_group=2, per_client=30)


def test_a_factorys_data_is_recorded_by_path_and_hash_not_the_defaults(tmp_path):
    result = fedcluster.run(
        federation=small_federation, algorithms=["fedavg"], out=tmp_path / "run", **SETTINGS
    )
    stored = yaml.safe_load((result.path / "config.yaml").read_text())
    assert stored["data"]["federation"] == "tests.test_records:small_federation"
    assert "dataset" not in stored["data"] and "partition" not in stored["data"]
    (data,) = stored["record"]["data"]
    assert data["source"] == "data.federation tests.test_records:small_federation"
    assert data["sha256"] == federation_sha256(small_federation())
    resumed = fedcluster.resume(result.path, report=False)  # the file still resumes

    def untimed(summary: list[dict]) -> list[dict]:
        return [{k: v for k, v in job.items() if k != "wall_seconds"} for job in summary]

    assert untimed(resumed.summary) == untimed(result.summary)


def test_summary_is_the_list_of_job_dicts_its_help_promises(factory_run):
    result, _ = factory_run
    assert isinstance(result.summary, list)
    assert result.summary[0]["algorithm"] == "fedavg"
    assert result.summary[0]["seed"] == 0


def test_config_and_summary_record_version_revision_backend_and_data(factory_run):
    result, federation = factory_run
    stored = yaml.safe_load((result.path / "config.yaml").read_text())["record"]
    summary = json.loads((result.path / "summary.json").read_text())["record"]
    assert stored == summary
    assert stored["fedcluster"] == fedcluster.__version__
    assert stored["git_revision"] == expected_revision()
    assert stored["backend"] == "simulator"
    (data,) = stored["data"]
    assert data["sha256"] == federation_sha256(federation)
    assert data["source"] == "a Federation passed from Python"
    assert data["n_clients"] == federation.n_clients
    assert data["x_train"] == list(federation.x_train.shape)
    assert data["x_test"] == list(federation.x_test.shape)


def test_the_dataset_defaults_a_federation_replaced_are_not_recorded(factory_run):
    result, _ = factory_run
    data = yaml.safe_load((result.path / "config.yaml").read_text())["data"]
    assert "dataset" not in data and "partition" not in data
    assert data["given"] is not None


def test_the_record_is_no_input_and_leaves_the_checkpoint_digest_alone(factory_run):
    result, _ = factory_run
    config = validate_config(load_yaml(result.path / "config.yaml"))
    checkpoints = list(RunDirectory(result.path).checkpoints.glob("*.pt"))
    assert checkpoints
    for path in checkpoints:
        assert load_checkpoint(path).config_sha256 == config_digest(config)


def _job(purity: float, ceiling: float) -> dict:
    return {
        "algorithm": "fedgroup",
        "final_accuracy": 0.5,
        "best_accuracy": 0.5,
        "final_accuracy_mean": 0.5,
        "final_accuracy_std": 0.1,
        "final_ari": 0.5,
        "final_purity": purity,
        "final_purity_ceiling": ceiling,
        "rounds_to_purity_0.9": None,
        "bytes_up": 0,
        "bytes_down": 0,
        "wall_seconds": 1.0,
    }


def test_the_printed_purity_ceiling_bounds_the_mean_printed_beside_it():
    # one seed capped at 2/3 by its cluster count, one not capped (ceiling 1)
    (row,) = summary_rows([_job(2 / 3, 2 / 3), _job(0.89, 1.0)])
    mean, ceiling = (2 / 3 + 0.89) / 2, (2 / 3 + 1.0) / 2
    assert row["purity"] == f"{mean:.2f} ± {abs(0.89 - 2 / 3) / 2:.2f} (≤ {ceiling:.2f})"
    (row,) = summary_rows([_job(0.9, 1.0), _job(0.95, 1.0)])
    assert "≤" not in row["purity"]


def test_bare_algorithm_names_in_yaml_are_the_named_entries(tmp_path):
    bare, named = tmp_path / "bare.yaml", tmp_path / "named.yaml"
    bare.write_text("rounds: 1\nalgorithms: [fedavg, ifca]\n")
    named.write_text("rounds: 1\nalgorithms: [{name: fedavg}, {name: ifca}]\n")
    assert resolve_config(str(bare)) == resolve_config(str(named))
    selected = resolve_config(str(bare), algorithms=["ifca"], sets=["algorithms.ifca.n_clusters=3"])
    assert [(a.name, a.params) for a in selected.algorithms] == [("ifca", {"n_clusters": 3})]


SETS = [
    "rounds=4",
    "checkpoint_every=2",
    "data.partition.base_options.n_clients=8",
    "model.options.hidden=[16]",
    "algorithms=[fedavg]",
]


def test_resume_warns_of_restored_rows_only_when_rows_were_changed(tmp_path, caplog):
    config = resolve_config(None, "quickstart", SETS)
    normal, edited = tmp_path / "normal", tmp_path / "edited"
    for out in (normal, edited):  # stopped after round 3; its checkpoint is of round 2
        Experiment(config).run(out, progress=False, stop_after_round=3)
    metrics = RunDirectory(edited).metrics
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join(lines[:2]) + "\n")  # round 2 cut by a user
    with caplog.at_level("WARNING", logger="fedcluster"):
        resume(normal, progress=False)
    assert "restored" not in caplog.text
    with caplog.at_level("WARNING", logger="fedcluster"):
        resume(edited, progress=False)
    assert "metrics.csv" in caplog.text and "restored" in caplog.text

"""Run directories that cannot be raced or redirected, checkpoints bound to their
config, one client's bad data contained, and a full disk that leaves a resumable run.

Runs are tiny (scikit-learn's digits, 4 clients, 1-layer MLP of 8 units, 2-4 rounds).
"""

from __future__ import annotations

import csv
import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from fedcluster.algorithms.base import init_row
from fedcluster.cli import main
from fedcluster.config.schema import resolve_config
from fedcluster.data.configured import build_federation_for
from fedcluster.data.screen import screen_clients
from fedcluster.engine.simulator import Simulator
from fedcluster.errors import DataError, FedclusterError
from fedcluster.experiment import safefiles
from fedcluster.experiment.metrics import TIMING_COLUMNS
from fedcluster.experiment.rundir import RunDirectory, load_checkpoint, save_checkpoint
from fedcluster.experiment.runner import Experiment, Job, model_for, resume
from fedcluster.protocol.batches import LocalTraining

SETS = [
    "data.dataset=digits",
    "data.partition={name: iid, n_clients: 4, test_fraction: 0.2}",
    "model.options.hidden=[8]",
    "algorithms=[{name: fedavg}]",
    "rounds=4",
    "checkpoint_every=2",
]
ARGS = ["--quiet", "--no-report"] + [a for s in SETS for a in ("--set", s)]


def _config(*extra: str):
    return resolve_config(None, None, [*SETS, *extra])


def _metrics(out: Path) -> list[list[str]]:
    with open(out / "metrics.csv", newline="") as f:
        rows = list(csv.reader(f))
    keep = [i for i, name in enumerate(rows[0]) if name not in TIMING_COLUMNS]
    return [[r[i] for i in keep] for r in rows]


def _one_line_error(capsys, *named: str) -> str:
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("fedcluster: error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert all(n in errors[0] for n in named), errors[0]
    return errors[0]


@pytest.fixture()
def stopped(tmp_path) -> Path:
    """A run stopped after round 2 of 4 (its checkpoint is round 2)."""
    out = tmp_path / "run"
    Experiment(_config()).run(out, progress=False, stop_after_round=2)
    return out


# ----------------------------------------------------------------------- the race


def test_a_second_run_with_the_same_out_never_touches_the_first(tmp_path, capsys):
    """A race: a second run of the same directory while the first runs is refused
    ("in use"), and `run --out SAME` writes SAME-2 instead; the first run completes
    untouched; once it finished, `run --out SAME` writes SAME-3, again untouching it."""
    out = tmp_path / "run"
    slow = textwrap.dedent(f"""
        import sys, time
        from fedcluster.experiment.callbacks import Callback
        from fedcluster.config.schema import resolve_config
        from fedcluster.experiment.runner import Experiment

        class Slow(Callback):
            def on_round_end(self, job, rnd, row, state):
                if rnd == 1:
                    print("round 1", flush=True)
                    time.sleep(3)  # the injected delay: the second run starts now

        Experiment(resolve_config(None, None, {SETS!r}), callbacks=[Slow()]).run(
            {str(out)!r}, progress=False
        )
    """)
    first = subprocess.Popen(
        [sys.executable, "-c", slow], stdout=subprocess.PIPE, text=True, env=os.environ
    )
    try:
        assert first.stdout is not None and first.stdout.readline().strip() == "round 1"
        with pytest.raises(FedclusterError, match=f"in use by process {first.pid}"):
            Experiment(_config()).run(out, progress=False)
        assert out.is_dir()  # not removed by the process that did not create it
        assert main(["run", *ARGS, "--out", str(out)]) == 0
        assert len(_metrics(out.with_name("run-2"))) == 5
    finally:
        assert first.wait(timeout=120) == 0

    def files() -> dict[str, bytes]:  # .lock holds the pid of its last holder
        return {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".lock"}

    done = files()
    assert "summary.json" in done and len(_metrics(out)) == 5
    assert main(["run", *ARGS, "--out", str(out)]) == 0
    assert len(_metrics(out.with_name("run-3"))) == 5
    assert files() == done


# ----------------------------------------------------------------------- symlinks


@pytest.mark.parametrize(
    "entry", [".lock", "metrics.csv.tmp", "summary.json.tmp", "checkpoints/fedavg-seed0.pt.tmp"]
)
def test_resume_never_writes_through_a_symlinked_entry(stopped, tmp_path, entry):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (stopped / entry).unlink(missing_ok=True)
    (stopped / entry).symlink_to(victim)
    with pytest.raises(FedclusterError, match="symlink"):
        resume(stopped, progress=False)
    assert victim.read_text() == "precious\n"


def test_temporaries_are_created_exclusively(tmp_path):
    target = tmp_path / "summary.json"
    (tmp_path / "summary.json.tmp").write_text("stale")  # a killed run's temporary: replaced
    safefiles.write_atomic(target, "{}")
    assert target.read_text() == "{}" and not (tmp_path / "summary.json.tmp").exists()


# ----------------------------------------------------------------------- checkpoint metadata


def _rewrite_meta(path: Path, **changes) -> None:
    ckpt = load_checkpoint(path)
    for key, value in changes.items():
        setattr(ckpt, key, value)
    save_checkpoint(path, ckpt)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"round": -5}, "outside the run's rounds"),
        ({"round": 10**9}, "outside the run's rounds"),
        ({"rows": "forged"}, "not a list of rows"),
    ],
)
def test_checkpoint_metadata_is_checked_against_the_run(stopped, change, named):
    path = RunDirectory(stopped).checkpoint_path("fedavg", 0)
    _rewrite_meta(path, **change)
    before = (stopped / "metrics.csv").read_bytes()
    with pytest.raises(FedclusterError, match=named):
        resume(stopped, progress=False)
    assert (stopped / "metrics.csv").read_bytes() == before


def test_a_forged_row_is_refused(stopped):
    path = RunDirectory(stopped).checkpoint_path("fedavg", 0)
    rows = load_checkpoint(path).rows
    forged = [*rows, {**rows[-1], "round": 3, "accuracy": 1.0}]
    _rewrite_meta(path, rows=forged)
    with pytest.raises(FedclusterError, match=r"not rounds 1\.\.2 of fedavg seed 0"):
        resume(stopped, progress=False)
    assert "1.0" not in [r[3] for r in _metrics(stopped)[1:]]


def _float_tensor(tree, path: str = "state") -> tuple[str, torch.Tensor]:
    """The first float tensor of a stored tree and its path."""
    if isinstance(tree, torch.Tensor) and tree.is_floating_point():
        return path, tree
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    for key, value in items:
        if isinstance(value, dict | list | tuple | torch.Tensor):
            found = _float_tensor(value, f"{path}/{key}")
            if found[0]:
                return found
    return "", torch.empty(0)


def _tamper_tensor(path: Path, change) -> str:
    """Rewrite the stored state's first float tensor with ``change`` applied to it in
    place, the checkpoint's metadata (and its recorded digests) kept as they were;
    the tensor's path."""
    raw = torch.load(path, weights_only=True)
    name, tensor = _float_tensor(raw["state"])
    change(tensor)
    torch.save(raw, path)
    return name


@pytest.mark.parametrize(
    "change",
    [
        lambda t: t.view(-1)[:1].neg_(),  # IEEE negation flips exactly the sign bit
        lambda t: t.zero_(),
    ],
    ids=["sign-bit", "zeroed"],
)
def test_a_tampered_checkpoint_tensor_is_refused_and_nothing_is_written(stopped, capsys, change):
    """A sign bit flipped in one stored weight, or the weights zeroed: resume names the
    file and the tensor in one line, exits non-zero and writes nothing."""
    path = RunDirectory(stopped).checkpoint_path("fedavg", 0)
    name = _tamper_tensor(path, change)
    files = {p: p.read_bytes() for p in stopped.rglob("*") if p.is_file()}
    assert main(["resume", "--quiet", "--no-report", str(stopped)]) == 2
    _one_line_error(capsys, path.name, f"{name} does not match its SHA-256")
    assert {p: p.read_bytes() for p in stopped.rglob("*") if p.is_file()} == files


def test_checkpoint_digests_cover_each_stored_value():
    """The digest of each leaf changes with its dtype, shape or any one bit of its bytes,
    and a number stored beside the tensors is covered too."""
    from fedcluster.experiment.tensor_digest import digests, first_mismatch

    weights = torch.arange(6, dtype=torch.float32)
    tree = {"state": {"w": weights, "k": 3}, "clusters": None}
    recorded = digests(tree)
    assert sorted(recorded) == ["/clusters", "/state/k", "/state/w"]
    assert first_mismatch(tree, recorded) is None
    for other in (
        weights.double(),
        weights.reshape(2, 3),
        weights.clone().index_fill_(0, torch.tensor([5]), -5.0),
    ):
        assert first_mismatch({**tree, "state": {"w": other, "k": 3}}, recorded) == (
            "state/w does not match its SHA-256"
        )
    assert first_mismatch({**tree, "state": {"w": weights, "k": 4}}, recorded) == (
        "state/k does not match its SHA-256"
    )
    assert first_mismatch({**tree, "state": {"w": weights}}, recorded) == "state/k is missing"


def test_an_edited_config_is_refused_with_one_line(stopped, capsys):
    config = stopped / "config.yaml"
    text = config.read_text()
    lr = next(line for line in text.splitlines() if line.startswith("  lr: "))
    config.write_text(text.replace(lr, "  lr: 0.5"))  # lr changed mid-run
    assert main(["resume", "--quiet", "--no-report", str(stopped)]) == 2
    _one_line_error(capsys, "not the config checkpoint", "edited")


def test_code_named_in_a_config_is_imported_only_when_the_run_started_with_it(
    stopped, tmp_path, capsys, monkeypatch
):
    marker = tmp_path / "imported"
    (tmp_path / "evil_model.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = stopped / "config.yaml"
    config.write_text(config.read_text().replace("name: mlp", "name: evil_model:mlp"))
    for ckpt in (stopped / "checkpoints").glob("*.pt"):
        ckpt.unlink()  # nothing vouches for the config: even a matching digest is gone
    assert main(["resume", "--quiet", "--no-report", str(stopped)]) == 2
    _one_line_error(capsys, "evil_model:mlp", "--trust")
    assert not marker.exists()
    main(["resume", "--quiet", "--no-report", "--trust", str(stopped)])
    assert marker.exists()  # imported only on the user's word


def test_a_run_started_with_its_own_model_resumes_without_trust(tmp_path):
    module = tmp_path / "own_model.py"
    module.write_text("from fedcluster.models import mlp\n")
    sys.path.insert(0, str(tmp_path))
    try:
        out = tmp_path / "run"
        cfg = _config("model.name=own_model:mlp")
        Experiment(cfg).run(out, progress=False, stop_after_round=2)
        resume(out, progress=False)
        assert len(_metrics(out)) == 5
    finally:
        sys.path.remove(str(tmp_path))


# ----------------------------------------------------------------------- seeds, full disk


@pytest.mark.parametrize("argv", [["--seed", "-1"], ["--set", "seeds=[0, -1]"]])
def test_negative_seeds_are_refused(tmp_path, capsys, argv):
    assert main(["run", *ARGS, "--out", str(tmp_path / "run"), *argv]) == 2
    _one_line_error(capsys, "seeds")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("where", ["report.html", "metrics.csv"])
def test_a_full_disk_names_the_file_and_leaves_no_temporary(tmp_path, capsys, monkeypatch, where):
    """ENOSPC while the report is written (after the run), or while a metrics row is
    appended: one line naming the file; no ``.tmp`` anywhere in the run directory."""
    out = tmp_path / "run"
    real = safefiles._write_all

    def fill_up(fd: int, data: bytes) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith((where, where + ".tmp")):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, data)

    monkeypatch.setattr(safefiles, "_write_all", fill_up)
    args = [a for a in ARGS if a != "--no-report"]
    assert main(["run", *args, "--out", str(out)]) == 2
    line = _one_line_error(capsys, str(out / where))
    assert "no space left" in line.lower()
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]


def test_a_full_disk_ends_with_one_line_and_a_resumable_run(tmp_path, capsys, monkeypatch):
    full = tmp_path / "full"
    assert main(["run", *ARGS, "--out", str(full)]) == 0
    out = tmp_path / "run"
    writes = {"n": 0}
    real = safefiles._write_all

    def fill_up(fd: int, data: bytes) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path.endswith(".pt.tmp"):
            writes["n"] += 1
            if writes["n"] == 2:  # the second checkpoint (round 4) meets a full disk
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, data)

    monkeypatch.setattr(safefiles, "_write_all", fill_up)
    assert main(["run", *ARGS, "--out", str(out)]) == 2
    _one_line_error(capsys, "no space left", f"fedcluster resume {out}")
    assert not list((out / "checkpoints").glob("*.tmp"))
    monkeypatch.setattr(safefiles, "_write_all", real)
    assert main(["resume", "--quiet", "--no-report", str(out)]) == 0
    assert _metrics(out) == _metrics(full)


def _interrupt_at(monkeypatch, at: int) -> None:
    """Ctrl-C (KeyboardInterrupt) as round ``at`` starts."""
    real = Job._round

    def round_or_stop(self, state, rnd):
        if rnd == at:
            raise KeyboardInterrupt
        return real(self, state, rnd)

    monkeypatch.setattr(Job, "_round", round_or_stop)


def test_ctrl_c_ends_with_one_line_and_a_resumable_run(tmp_path, capsys, monkeypatch):
    full = tmp_path / "full"
    assert main(["run", *ARGS, "--out", str(full)]) == 0
    out = tmp_path / "run"
    with monkeypatch.context() as patch:
        _interrupt_at(patch, 3)  # after the round-2 checkpoint
        assert main(["run", *ARGS, "--out", str(out)]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert f"fedcluster: interrupted; `fedcluster resume {out}` continues" in err
    assert main(["resume", "--quiet", "--no-report", str(out)]) == 0
    assert _metrics(out) == _metrics(full)


def test_ctrl_c_before_the_first_checkpoint_leaves_nothing(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    _interrupt_at(monkeypatch, 2)
    assert main(["run", *ARGS, "--out", str(out)]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and "interrupted before the first checkpoint" in err, err
    assert not out.exists()  # the same command can run again


def test_sigterm_during_a_run_ends_as_ctrl_c_does(tmp_path, capsys, monkeypatch):
    """SIGTERM as round 3 starts: one line, status 130, resumable to the full run."""
    import signal

    full = tmp_path / "full"
    assert main(["run", *ARGS, "--out", str(full)]) == 0
    real = Job._round

    def round_or_term(self, state, rnd):
        if rnd == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self, state, rnd)

    out = tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setattr(Job, "_round", round_or_term)
        assert main(["run", *ARGS, "--out", str(out)]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"`fedcluster resume {out}` continues" in err, err
    assert signal.getsignal(signal.SIGTERM) is not None  # main put the previous one back
    assert main(["resume", "--quiet", "--no-report", str(out)]) == 0
    assert _metrics(out) == _metrics(full)


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_an_interrupt_during_start_up_is_one_line(tmp_path, capsys, monkeypatch, how):
    """Ctrl-C or SIGTERM while the config is read (after torch's import began): one line,
    status 130, nothing written."""
    import signal

    import fedcluster.config.schema

    def interrupted(*args, **kwargs):
        if how == "ctrl-c":
            raise KeyboardInterrupt
        os.kill(os.getpid(), signal.SIGTERM)
        return fedcluster.config.schema.validate_config({})

    monkeypatch.setattr(fedcluster.config.schema, "resolve_config", interrupted)
    assert main(["run", *ARGS, "--out", str(tmp_path / "run")]) == 130
    err = capsys.readouterr().err
    assert err == "fedcluster: interrupted\n", err
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------- bad clients


def test_one_nan_client_in_a_batched_group_of_8_leaves_the_others_byte_identical():
    """The NaN sits at a pixel no other client uses (outside the kernel's input span)."""
    cfg = _config("data.partition={name: iid, n_clients: 8, test_fraction: 0.2}")
    federation = build_federation_for(cfg, 0)
    model = model_for(cfg, federation)
    start = init_row(model, 0, "init")
    clients = np.arange(8)
    training = LocalTraining(lr=0.1, batch_size=10**6, epochs=2)  # full batch: all paths meet
    clean = Simulator(model, federation, seed=0, group_size=8).train(clients, start, training, 1)
    poisoned = federation.clone()
    used = (federation.x_train.reshape(len(federation.x_train), -1) != 0).any(dim=0)
    unused = int(torch.nonzero(~used)[0])
    poisoned.x_train.view(len(poisoned.x_train), -1)[federation.client_slice(3).start, unused] = (
        float("nan")
    )
    dirty = Simulator(model, poisoned, seed=0, group_size=8).train(clients, start, training, 1)
    others = [c for c in range(8) if c != 3]
    assert torch.equal(dirty.rows[others], clean.rows[others])
    assert torch.equal(dirty.loss[others], clean.loss[others])
    assert torch.isnan(dirty.rows[3]).all() and torch.isnan(dirty.loss[3])


def test_bad_clients_are_named_and_excluded_or_refused(caplog):
    federation = build_federation_for(_config(), 0)
    federation.x_train[federation.client_slice(1).start].fill_(1e30)
    federation.y_test[federation.client_slice(2, "test").start] = 99
    with caplog.at_level("WARNING", logger="fedcluster"):
        kept = screen_clients(federation, "exclude")
    message = caplog.records[-1].getMessage()
    assert "client 1: training inputs beyond" in message and "client 2: test labels" in message
    assert kept.n_clients == 2
    expected = torch.cat([federation.x_train[federation.client_slice(c)] for c in (0, 3)])
    assert torch.equal(kept.x_train, expected)
    with pytest.raises(DataError, match="2 of 4 clients have unusable data"):
        screen_clients(federation, "refuse")


def test_a_leaf_user_with_no_samples_is_named(tmp_path, capsys):
    root = tmp_path / "data"
    rng = np.random.default_rng(0)
    for split, n in (("train", 6), ("test", 2)):
        users = [f"u{i}" for i in range(4)]
        data = {
            u: {
                "x": [] if u == "u2" else rng.random((n, 784)).round(2).tolist(),
                "y": [] if u == "u2" else [i % 10 for i in range(n)],
            }
            for u in users
        }
        (root / "femnist" / split).mkdir(parents=True)
        (root / "femnist" / split / "all.json").write_text(
            json.dumps({"users": users, "user_data": data})
        )
    cfg_args = [
        "--set", "data={dataset: leaf-femnist, partition: {name: natural}, bad_clients: refuse}",
        "--set", f"data.data_dir={root}",
    ]  # fmt: skip
    assert main(["run", *ARGS, *cfg_args, "--out", str(tmp_path / "run")]) == 2
    _one_line_error(capsys, "client 2: no training samples")


# ----------------------------------------------------------------------- special files


@pytest.fixture()
def alarm():
    """Fail instead of hanging: SIGALRM after 60 s raises in the test."""
    import signal

    def expire(signum, frame):
        raise TimeoutError("blocked on a special file")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def test_a_fifo_given_as_the_config_is_refused_without_blocking(tmp_path, capsys, alarm):
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    assert main(["run", "--quiet", str(fifo), "--out", str(tmp_path / "run")]) == 2
    _one_line_error(capsys, str(fifo), "not a regular file")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("entry", ["config.yaml", "metrics.csv"])
def test_a_fifo_in_a_run_directory_is_refused_on_resume(stopped, capsys, alarm, entry):
    """A run's config.yaml or metrics.csv replaced by a FIFO: resume refuses it in one line
    (opened with O_NONBLOCK, then refused as not a regular file) and writes nothing."""
    (stopped / entry).unlink()
    os.mkfifo(stopped / entry)
    files = {p: p.read_bytes() for p in stopped.rglob("*") if p.is_file()}
    assert main(["resume", "--quiet", "--no-report", str(stopped)]) == 2
    _one_line_error(capsys, entry, "not a regular file")
    assert {p: p.read_bytes() for p in stopped.rglob("*") if p.is_file()} == files

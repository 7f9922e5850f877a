"""Local dataset files against the downloader's SHA-256 pins."""

from __future__ import annotations

import gzip
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from fedcluster.cli import main
from fedcluster.data.download import SOURCES
from fedcluster.data.idx import find_idx_file, read_idx

LABELS = "mnist/train-labels-idx1-ubyte.gz"


@pytest.fixture
def real_labels(shared_data_dir: Path) -> Path:
    path = shared_data_dir / LABELS
    if not path.is_file():
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"needs the real MNIST label file ({path}; CI=true: real data required)")
        pytest.skip(f"needs the real MNIST label file ({path})")
    return path


def _all_zero_copy(src: Path, root: Path) -> Path:
    """``src`` under ``root`` with every label set to 0, keeping a valid gzip + IDX header."""
    data = bytearray(gzip.decompress(src.read_bytes()))
    data[8:] = bytes(len(data) - 8)  # IDX1: 4-byte magic, 4-byte count, then one byte a label
    dst = root / LABELS
    dst.parent.mkdir(parents=True)
    dst.write_bytes(gzip.compress(bytes(data)))
    return dst


def test_all_zero_labels_warn_once_naming_the_file(tmp_path, real_labels, caplog):
    bad = _all_zero_copy(real_labels, tmp_path)
    with caplog.at_level(logging.WARNING, logger="fedcluster"):
        labels = read_idx(bad, ndim=1)
        read_idx(bad, ndim=1)  # a repeat load: no second warning
    assert labels.shape == (60000,) and not labels.any()  # the header is valid
    warned = [r.getMessage() for r in caplog.records if "SHA-256" in r.getMessage()]
    assert len(warned) == 1 and str(bad) in warned[0]


def test_a_pristine_copy_loads_without_warning(tmp_path, real_labels, caplog):
    good = tmp_path / LABELS
    good.parent.mkdir(parents=True)
    shutil.copy(real_labels, good)
    with caplog.at_level(logging.WARNING, logger="fedcluster"):
        assert np.array_equal(read_idx(good, ndim=1), read_idx(real_labels, ndim=1))
    assert not [r for r in caplog.records if "SHA-256" in r.getMessage()]


def test_verify_reports_ok_differs_missing(tmp_path, real_labels, capsys):
    bad = _all_zero_copy(real_labels, tmp_path)
    shutil.copy(real_labels.parent / "t10k-labels-idx1-ubyte.gz", bad.parent)
    assert main(["verify", "--data-dir", str(tmp_path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    status = {line.split()[1]: line.split()[0] for line in lines}
    assert status[str(bad)] == "differs"
    assert status[str(bad.parent / "t10k-labels-idx1-ubyte.gz")] == "ok"
    pinned = {f.path for alts in SOURCES.values() for files in alts for f in files}
    assert len(lines) == len(pinned)
    assert sum(s == "missing" for s in status.values()) == 2  # mnist's images
    assert sum(s == "absent" for s in status.values()) == len(pinned) - 4  # other datasets


def test_verify_of_a_clean_copy_exits_0(tmp_path, real_labels):
    shutil.copytree(real_labels.parent, tmp_path / "mnist")
    assert main(["verify", "--data-dir", str(tmp_path)]) == 0


def test_verify_covers_the_uncompressed_twin_and_unreadable_files(tmp_path, real_labels, capsys):
    """An all-zero uncompressed twin beside the pinned .gz is never read (the loader takes
    the .gz); without the .gz it is what the loader reads, and verify fails on it."""
    shutil.copytree(real_labels.parent, tmp_path / "mnist")
    gz = tmp_path / LABELS
    twin = gz.with_suffix("")
    labels = read_idx(gz, ndim=1)
    twin.write_bytes(bytes([0, 0, 8, 1]) + len(labels).to_bytes(4, "big") + bytes(len(labels)))
    assert find_idx_file(gz.parent, twin.name) == gz
    assert main(["verify", "--data-dir", str(tmp_path)]) == 0
    assert f"ignored    {twin}" in capsys.readouterr().out
    gz.unlink()
    assert main(["verify", "--data-dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"unpinned   {twin}" in out and f"missing    {gz}" in out
    twin.unlink()
    gz.symlink_to(gz)  # a symlink loop
    assert main(["verify", "--data-dir", str(tmp_path)]) == 1
    assert f"unreadable {gz}" in capsys.readouterr().out

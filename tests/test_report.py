"""Reports of real runs (fedcluster.reporting): files, sections by feature, headless Chromium."""

from __future__ import annotations

import base64
import csv
import io
import json
import os
import re
import shutil
import subprocess
import warnings
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from fedcluster.cli import main
from fedcluster.reporting import write_report
from fedcluster.reporting.figures import entries
from fedcluster.reporting.rundata import load_run
from tests.helpers import rotation_config

_BASE = {
    **rotation_config("base", hidden=16),
    "algorithms": [
        {"name": "fedavg"},
        {"name": "ifca", "params": {"n_clusters": 2}},
        {"name": "cflgt", "params": {"pretrain_rounds": 1, "cluster_fraction": None}},
    ],
}
_DYNAMIC = {
    "privacy": {"mode": "client", "epsilon": 10},
    "scenario": {
        "joins": {"at": {5: 2}},
        "leaves": {0: 3},
        "drift": [{"kind": "rotate", "rounds": [3], "clients": [4], "angle": 90}],
    },
}
STATIC_SECTIONS = {
    "summary",
    "accuracy",
    "clustering",
    "clusters",
    "communication",
    "diagnostics",
    "groups",
    "worst-clients",
    "cluster-size",
    "config",
}
TABLE_SECTIONS = {"summary", "groups", "worst-clients", "config"}
"""Sections without a figure."""


def _run_cli(tmp: Path, name: str, raw: dict, *extra: str, capsys=None) -> tuple[Path, str]:
    config = tmp / f"{name}.yaml"
    config.write_text(yaml.safe_dump({**raw, "name": name}))
    out = tmp / name
    assert main(["run", str(config), "--quiet", "--out", str(out), *extra]) == 0
    return out, capsys.readouterr().out if capsys is not None else ""


@pytest.fixture(scope="module")
def static_run(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("static")
    out, _ = _run_cli(tmp, "static", _BASE, "--no-report")
    return out


@pytest.fixture(scope="module")
def dynamic_run(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("dynamic")
    out, _ = _run_cli(tmp, "dynamic", {**_BASE, **_DYNAMIC}, "--no-report")
    return out


def _sections(html: str) -> set[str]:
    return set(re.findall(r'<section id="([^"]+)"', html))


def _embedded_pngs(html: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r'src="data:image/png;base64,([^"]+)"', html)]


def _check_pngs(folder: Path, html: str) -> None:
    files = sorted(folder.glob("plots/*.png"))
    embedded = _embedded_pngs(html)
    assert files and len(files) == len(embedded)
    for data in [f.read_bytes() for f in files] + embedded:
        image = Image.open(io.BytesIO(data))
        image.load()  # decodes every pixel
        assert image.format == "PNG" and min(image.size) > 50


def test_run_writes_report_and_prints_its_path_last(tmp_path, capsys):
    out, stdout = _run_cli(tmp_path, "cli", _BASE, capsys=capsys)
    last = stdout.strip().splitlines()[-1]
    assert last == f"report: {out / 'report.html'}"
    assert (out / "report.md").is_file()
    _, stdout = _run_cli(tmp_path, "quiet", _BASE, "--no-report", capsys=capsys)
    assert not (tmp_path / "quiet" / "report.html").exists() and "report:" not in stdout


def test_a_run_evaluated_every_other_round_reports_without_warnings(tmp_path):
    """With ``eval_every: 2`` every other round has no accuracy: the plots draw the
    evaluated rounds and nothing warns (an all-NaN mean warned in the communication
    plot)."""
    raw = {**_BASE, "algorithms": [{"name": "fedavg"}], "rounds": 4, "eval_every": 2}
    out, _ = _run_cli(tmp_path, "sparse", raw, "--no-report")
    run = load_run(out)
    rounds, acc = run.column(run.labels[0], "accuracy")
    assert np.isfinite(acc).any(axis=0).tolist() == [False, True, False, True]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        html = write_report([out]).read_text()
    assert "communication" in _sections(html)
    _check_pngs(out, html)


def test_static_report_has_its_sections_and_no_dp_or_events(static_run):
    html_path = write_report([static_run])
    html = html_path.read_text()
    assert _sections(html) == STATIC_SECTIONS
    _check_pngs(static_run, html)
    md = (static_run / "report.md").read_text()
    for key in STATIC_SECTIONS - TABLE_SECTIONS:
        assert f"(plots/{key}.png)" in md
    # the final table and the resolved config come from the run directory
    assert "| ifca" in md and "final acc %" in md
    assert (static_run / "config.yaml").read_text().strip() in md
    assert "http://" not in html.replace("http://www.w3.org", "") and "https://" not in html


def test_dp_and_dynamic_run_adds_privacy_and_events(dynamic_run):
    html = write_report([dynamic_run]).read_text()
    assert _sections(html) == STATIC_SECTIONS | {"privacy", "events"}
    _check_pngs(dynamic_run, html)
    md = (dynamic_run / "report.md").read_text()
    # the events table counts what events.csv holds, per algorithm and seed
    with open(dynamic_run / "events.csv") as f:
        events = list(csv.DictReader(f))
    joins = sum(e["kind"] == "join" and e["algorithm"] == "ifca" for e in events)
    assert joins == 1 and re.search(r"\| ifca\s*\| 0\s*\|", md)


def test_cluster_matrix_matches_clusters_csv(static_run):
    """The heatmap's data: one row per client and column per round, from clusters.csv."""
    run = load_run(static_run)
    c = run.clusters[("ifca", 0)]
    with open(static_run / "clusters.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["algorithm"] == "ifca"]
    assert c["assign"].shape == (6, 3)
    for r in rows:
        i = list(c["clients"]).index(int(r["client"]))
        assert c["assign"][i, int(r["round"]) - 1] == int(r["cluster"])
        assert c["groups"][i] == int(r["true_group"])
    rounds, acc = run.column("fedavg", "accuracy")
    with open(static_run / "metrics.csv") as f:
        expect = [float(r["accuracy"]) for r in csv.DictReader(f) if r["algorithm"] == "fedavg"]
    assert list(rounds) == [1, 2, 3] and np.allclose(acc[0], expect)


def test_comparison_of_two_runs_is_one_report(static_run, dynamic_run, tmp_path, capsys):
    assert main(["report", str(static_run), str(dynamic_run), "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == f"report: {tmp_path / 'report.html'}"
    html = (tmp_path / "report.html").read_text()
    assert "<h3>static</h3>" in html and "<h3>dynamic</h3>" in html  # one table per run
    legend = [e.name for e in entries([load_run(static_run), load_run(dynamic_run)])]
    assert legend == [
        f"{run}: {alg}" for run in ("static", "dynamic") for alg in ("fedavg", "ifca", "cflgt")
    ]
    assert {"privacy", "events"} <= _sections(html)
    assert sum(s.startswith("config") for s in _sections(html)) == 2
    assert main(["report", str(static_run), str(dynamic_run)]) == 2  # several runs need --out
    assert "--out" in capsys.readouterr().err


def test_report_of_a_folder_that_is_no_run_is_a_clear_error(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "not a run directory" in capsys.readouterr().err


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    return None


def test_report_opens_in_headless_chromium(dynamic_run, tmp_path):
    """The page loads offline without console errors; every image has a natural size."""
    browser = _chromium()
    if browser is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("chromium is not installed (CI=true: .ci/run installs it)")
        pytest.skip("chromium is not installed (Debian: apt-get install chromium)")
    html = write_report([dynamic_run]).read_text()
    n_images = len(_embedded_pngs(html))
    # a probe appended to a copy of the page writes what the browser saw into the DOM
    probe = """<script>
    window.addEventListener('load', () => {
      const imgs = [...document.images];
      const ok = imgs.filter(i => i.complete && i.naturalWidth > 0 && i.naturalHeight > 0);
      const p = document.createElement('pre'); p.id = 'probe';
      p.textContent = JSON.stringify({images: imgs.length, loaded: ok.length});
      document.body.appendChild(p);
    });</script>"""
    page = tmp_path / "probe.html"
    page.write_text(html.replace("</body>", probe + "</body>"))
    result = subprocess.run(
        [
            browser,
            "--headless",
            "--disable-gpu",
            "--no-sandbox",
            "--enable-logging=stderr",
            "--v=0",
            "--virtual-time-budget=5000",
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    found = re.search(r'<pre id="probe">([^<]+)</pre>', result.stdout)
    assert found, result.stdout[-2000:]
    seen = json.loads(found.group(1))
    assert seen == {"images": n_images, "loaded": n_images} and n_images >= 6
    console = [line for line in result.stderr.splitlines() if "CONSOLE" in line]
    assert not [line for line in console if "ERROR" in line or "Uncaught" in line], console


def test_resume_ends_with_the_report(tmp_path, capsys):
    from fedcluster.config.schema import validate_config
    from fedcluster.experiment.runner import Experiment

    out = tmp_path / "cut"
    config = validate_config({**_BASE, "name": "cut", "checkpoint_every": 1})
    Experiment(config).run(out, progress=False, stop_after_round=2)
    assert not (out / "report.html").exists()
    assert main(["resume", str(out), "--quiet"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == f"report: {out / 'report.html'}"
    assert load_run(out).column("ifca", "accuracy")[0].tolist() == [1, 2, 3]

"""The numbers of fixed runs stay the same through refactors (``cases.py``)."""

from __future__ import annotations

import json

import pytest

from tests.golden.cases import CASES, HERE, TABLES, machine, run_case, table


@pytest.mark.parametrize("case", list(CASES))
def test_golden_run_is_unchanged(case, tmp_path, request):
    stored = json.loads((HERE / case / "machine.json").read_text())
    if stored != machine():
        pytest.skip(
            f"golden files of {case} were made on {stored}; this machine is {machine()} "
            "(float kernels differ between CPU code paths)"
        )
    data_dir = None
    if CASES[case][3]:
        data_dir = str(request.getfixturevalue("shared_data_dir"))
    run = run_case(case, tmp_path / case, data_dir)
    for name in TABLES:
        assert table(run / name) == table(HERE / case / name), f"{case}/{name} changed"

"""Layers point one way: the config schema is a leaf."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_config_loads_no_algorithm_and_no_engine():
    code = (
        "import sys, fedcluster.config\n"
        "bad = sorted(m for m in sys.modules if m.startswith(('fedcluster.algorithms', "
        "'fedcluster.engine', 'torch')))\n"
        "print(','.join(bad))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == ""

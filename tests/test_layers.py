"""Layers point one way: the config schema is a leaf."""

from __future__ import annotations

import os
import subprocess
import sys


def test_importing_the_config_loads_no_algorithm_and_no_engine():
    code = (
        "import sys, fedcluster.config.schema\n"
        "bad = sorted(m for m in sys.modules if m.startswith(('fedcluster.algorithms', "
        "'fedcluster.engine', 'torch')))\n"
        "print(','.join(bad))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == ""


def test_importing_fedcluster_changes_nothing_in_the_process():
    # no environment variable, no matplotlib backend, no pyplot on import
    code = (
        "import os, matplotlib\n"
        "matplotlib.use('svg')\n"
        "import fedcluster, fedcluster.reporting, fedcluster.reporting.figures, sys\n"
        "print(os.environ.get('OMP_WAIT_POLICY'), matplotlib.get_backend(),\n"
        "      'matplotlib.pyplot' in sys.modules)"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "MPLBACKEND")}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    ).stdout.split()
    assert out == ["None", "svg", "False"]


def test_python_m_fedcluster_runs_the_command_line():
    out = subprocess.run(
        [sys.executable, "-m", "fedcluster", "--version"], capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.startswith("fedcluster ")


def test_top_level_names_are_lazy_and_complete():
    code = (
        "import sys, fedcluster\n"
        "loaded = 'torch' in sys.modules\n"
        "names = [n for n in fedcluster.__all__ if n != '__version__']\n"
        "assert sorted(names) == sorted(fedcluster._EXPORTS), 'update __all__'\n"
        "missing = [n for n in names if getattr(fedcluster, n, None) is None]\n"
        "print(loaded, missing, fedcluster.IFCA is sys.modules['fedcluster.algorithms.ifca']"
        ".IFCAParams)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["False", "[]", "True"]

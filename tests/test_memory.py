"""The memory a run may allocate is the least of MemAvailable, the cgroup's and ulimit -v's."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from fedcluster.memory import UNLIMITED, cgroup_free_bytes

GIB = 2**30


def _tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text + "\n")


def test_cgroup_v2_limit_less_usage(tmp_path):
    _tree(
        tmp_path,
        {
            "proc": "0::/job/7",
            "sys/job/7/memory.max": str(4 * GIB),
            "sys/job/7/memory.current": str(GIB),
            "sys/memory.max": "max",
        },
    )
    assert cgroup_free_bytes(tmp_path / "sys", tmp_path / "proc") == 3 * GIB


def test_cgroup_v1_limit_less_usage_and_the_least_of_two(tmp_path):
    _tree(
        tmp_path,
        {
            "proc": "4:memory:/box\n0::/",
            "sys/memory/box/memory.limit_in_bytes": str(8 * GIB),
            "sys/memory/box/memory.usage_in_bytes": str(2 * GIB),
            # the namespace's own root (a container) limits further
            "sys/memory/memory.limit_in_bytes": str(5 * GIB),
            "sys/memory/memory.usage_in_bytes": str(3 * GIB),
        },
    )
    assert cgroup_free_bytes(tmp_path / "sys", tmp_path / "proc") == 2 * GIB


def test_no_cgroup_limit_is_none(tmp_path):
    _tree(
        tmp_path,
        {
            "proc": "4:memory:/\n0::/",
            "sys/memory/memory.limit_in_bytes": "9223372036854771712",  # v1's "unlimited"
            "sys/memory.max": "max",
        },
    )
    assert cgroup_free_bytes(tmp_path / "sys", tmp_path / "proc") is None
    assert cgroup_free_bytes(tmp_path / "absent", tmp_path / "absent") is None
    assert UNLIMITED < 9223372036854771712


def test_ulimit_v_bounds_what_a_round_may_allocate():
    """Under ``ulimit -v`` = what is mapped + 512 MiB, the memory allowed is those 512 MiB
    (less what the interpreter maps meanwhile), and a model whose round needs 1.2 GB is
    refused in one line naming the estimate, before any row is allocated."""
    script = textwrap.dedent(
        """
        import resource
        import torch
        from fedcluster.errors import ConfigError
        from fedcluster.memory import _meminfo, allowed_bytes, rlimit_free_bytes
        from fedcluster.models import check_rows_fit

        mapped = _meminfo("VmSize", "/proc/self/status")
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (mapped + 2**29, hard))
        free = rlimit_free_bytes()
        assert 0 < free <= 2**29 and allowed_bytes() <= free, (free, allowed_bytes())
        model = torch.nn.Linear(10_000, 10_000, device="meta")  # 10^8 parameters, no memory
        try:
            check_rows_fit("big", model, rows=3)
        except ConfigError as exc:
            print(exc)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip()
    assert "\n" not in line and "model rows need 1.1 GiB" in line and "ulimit -v" in line, line

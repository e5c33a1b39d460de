"""The worker's inventory on a host without a GPU driver (this machine, CI's)."""

from __future__ import annotations

import subprocess
import sys

from testkit.launch import REPO_ROOT


def test_a_host_without_a_gpu_driver_lists_no_gpus_without_importing_torch() -> None:
    # A fresh interpreter: the test process itself has torch imported long ago.
    code = ("import sys\n"
            "from core.infra.settings import Settings\n"
            "from worker.upkeep.registry import gpu_list\n"
            "print(gpu_list(Settings()), 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                         text=True, check=True, timeout=120).stdout
    assert out.split() == ["[]", "False"], out

"""Build DeepSpeed's CPU ops (cpu_adam, the shared-memory collectives) into this venv before
the tests need them: ``make test`` runs this beside ruff and mypy, which use one core of
two. Otherwise the first DeepSpeed test of a fresh venv builds them inside its own setup
(1.5 minutes of both cores alone, 2.5 minutes of one test's setup in a whole-suite run)
while a test of the other process that needs the same op waits on its build lock.

The ops land where the tests look (tests/conftest.py: TORCH_EXTENSIONS_DIR, by default
<venv>/torch_extensions); a built op is found again by DeepSpeed's own up-to-date check, so
running this twice costs seconds. Fails with the build's error where an op cannot be built
(no compiler): the DeepSpeed tests would fail the same way, later.

    python -m testkit.build_ops                        # every op of OPS
    python -m testkit.build_ops ShareMemCommBuilder    # some (the tests' fixtures)"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

# Where DeepSpeed's JIT-built ops live for the tests and benches: inside this venv (a fresh
# clone builds its own; `make clean` removes them), not the per-user ~/.cache/torch_extensions
# that other checkouts' venvs would rebuild for their own paths.
VENV_EXTENSIONS = str(Path(sys.prefix) / "torch_extensions")

# The same ops the DeepSpeed runs load on a CPU worker: ZeRO's CPU Adam, and the
# shared-memory all-reduce of DeepSpeed's CPU communication backend.
OPS = ("CPUAdamBuilder", "ShareMemCommBuilder")


def main(argv: list[str] | None = None) -> int:
    ops = (sys.argv[1:] if argv is None else argv) or list(OPS)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", VENV_EXTENSIONS)
    # The CPU flavour of each op: what a CPU worker's ranks load (worker/run/
    # accelerate_config.py launch_env sets the same), on a machine with a GPU too.
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    for name in ops:
        started = time.monotonic()
        builder = accelerator.create_op_builder(name)
        if builder is None:
            print(f"build_ops: DeepSpeed's {accelerator._name} accelerator has no {name}",
                  file=sys.stderr)
            return 1
        print(f"build_ops: {builder.NAME}: loading, built first if needed", flush=True)
        builder.load(verbose=False)  # a compiler error raises, with the compiler's output
        print(f"build_ops: {builder.NAME} ready in {time.monotonic() - started:.0f} s "
              f"({os.environ['TORCH_EXTENSIONS_DIR']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

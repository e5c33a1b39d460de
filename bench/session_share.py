"""How two CPU-bound sessions share one CPU: an "API" at nice 0 and a "trainer" as the
worker runs it, each leading its own session as `ftune up` starts them (Linux).

With sched_autogroup on, the CPU is shared between sessions first: a nice value on the
trainer's threads alone changes nothing; core.infra.cpu_priority.session_follows_own_nice gives the
session the value too. Three cases of --seconds each, both processes pinned to --cpu:

    python -m bench.session_share
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.procstat import process_cpu_seconds

REPO = Path(__file__).resolve().parents[1]
BUSY = "import os\nos.sched_setaffinity(0, {{{cpu}}})\n{setup}\nwhile True:\n    pass\n"
CASES = [
    ("trainer at nice 0", ""),
    ("trainer's threads at nice 10, its session at 0", "os.nice(10)"),
    ("trainer and its session at nice 10 (FTUNE_WORKER_NICE)",
     ("os.nice(10)\nfrom core.infra.cpu_priority import session_follows_own_nice\n"
      "session_follows_own_nice()")),
]  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    autogroup = Path("/proc/sys/kernel/sched_autogroup_enabled")
    print(f"sched_autogroup_enabled: {autogroup.read_text().strip() if autogroup.exists() else 'n/a'}")
    for label, setup in CASES:
        procs = [
            subprocess.Popen([sys.executable, "-c", BUSY.format(cpu=args.cpu, setup=s)],
                             cwd=REPO, start_new_session=True)
            for s in ("", setup)
        ]  # fmt: skip
        try:
            time.sleep(1)
            before = [process_cpu_seconds(p.pid) for p in procs]
            time.sleep(args.seconds)
            api, trainer = (process_cpu_seconds(p.pid) - b for p, b in zip(procs, before, strict=True))
        finally:
            for p in procs:
                p.kill()
                p.wait()
        print(f"{label}: API {api:.2f} s, trainer {trainer:.2f} s of CPU {args.cpu} in "
              f"{args.seconds:g} s (API / trainer {api / max(trainer, 0.01):.1f}); "
              f"load {os.getloadavg()[0]:.1f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

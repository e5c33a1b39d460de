"""One wrk run against a running API, as a ``Phase``: requests, latency percentiles, the
server's CPU per request, and where a request could wait before the app saw it (the
event loop's scheduler figures, the accept queue, TCP counters: bench/procstat.py). wrk is
pinned to its own CPU so the load generator does not eat the server's; a Lua script picks
a random id per request and prints a JSON summary.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from bench.apiserver import RunningApi
from bench.procstat import (
    AcceptQueue,
    Sched,
    descendants_cpu_seconds,
    process_cpu_seconds,
    tcp_counters,
    wait_idle,
)

# wrk runs this: a random job per request (ids in a table), and a JSON summary at the end.
WRK_SCRIPT = """
local ids = {%(ids)s}
local template = "%(template)s"
wrk.headers["Authorization"] = "Bearer %(key)s"
request = function()
  local path = template:gsub("{id}", ids[math.random(#ids)])
  return wrk.format("GET", path)
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRK {"requests": %%d, "duration_us": %%d, "p50_us": %%d, "p99_us": %%d, "max_us": %%d, '
    .. '"non_2xx": %%d, "socket_errors": %%d, "connect": %%d, "read": %%d, "write": %%d, '
    .. '"timeout": %%d}\\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    latency.max, e.status, e.connect + e.read + e.write + e.timeout, e.connect, e.read,
    e.write, e.timeout))
end
"""


@dataclass
class Phase:
    what: str
    requests: int
    seconds: float
    p50_ms: float
    p99_ms: float
    max_ms: float
    non_2xx: int
    socket_errors: int
    cpu_ms_per_request: float  # the server's CPU time (user + system) over requests served
    # Deltas over the phase (--ftune-up prints them): TCP counters, the API's event-loop
    # thread's scheduler figures, the CPU seconds of what ran beside the API (worker and
    # trainer), and the longest accept queue seen on the API's listening socket.
    socket_error_kinds: dict[str, int] = field(default_factory=dict)  # wrk's, by kind
    tcp: dict[str, int] = field(default_factory=dict)
    loop_sched: Sched = field(default_factory=lambda: Sched())
    beside_cpu_s: float = 0.0
    accept_queue_max: int = 0
    wrk_sched: Sched = field(default_factory=lambda: Sched())
    server_cpu_samples: dict[int, int] = field(default_factory=dict)  # CPU -> samples there

    @property
    def rate(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0

    def line(self) -> str:
        bad = f"; non-2xx {self.non_2xx}" if self.non_2xx else ""
        bad += f"; socket errors {self.socket_errors}" if self.socket_errors else ""
        return (
            f"{self.what}: {self.rate:,.0f} req/s; p50 {self.p50_ms:.1f} ms, "
            f"p99 {self.p99_ms:.1f} ms, max {self.max_ms:.1f} ms; "
            f"server CPU {self.cpu_ms_per_request:.3f} ms/request{bad}"
        )


def wrk(
    api: RunningApi, what: str, template: str, ids: list[str], connections: int,
    seconds: float, cpus: str | None, during: Callable[[], None] | None = None,
    beside_pid: int | None = None,
) -> Phase:  # fmt: skip
    """One wrk run of ``seconds`` at ``connections`` on one thread (on ``cpus``);
    ``during`` is called (in this thread) half a second after wrk has started;
    ``beside_pid``: a process (and its descendants) whose CPU time during the run is kept."""
    script = WRK_SCRIPT % {
        "ids": ", ".join(f'"{i}"' for i in ids), "template": template, "key": api.key,
    }  # fmt: skip
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(script)
    argv = ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--timeout", "10s",
            "-s", f.name, api.url]  # fmt: skip
    if cpus is not None:
        argv = ["taskset", "-c", cpus, *argv]
    wait_idle(api.pid)
    cpu_before = process_cpu_seconds(api.pid)
    beside_before = descendants_cpu_seconds(beside_pid) if beside_pid else 0.0
    sched_before = Sched.read(api.pid)
    tcp_before = tcp_counters()
    queue = AcceptQueue(int(api.url.rsplit(":", 1)[1]))
    try:
        with queue:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
            queue.watch(proc.pid, api.pid)
            if during is not None:
                time.sleep(0.5)
                during()
            out, _ = proc.communicate()
        if proc.returncode:
            raise subprocess.CalledProcessError(proc.returncode, argv, out)
    finally:
        os.unlink(f.name)
    cpu = process_cpu_seconds(api.pid) - cpu_before
    tcp_after = tcp_counters()
    sched = Sched.read(api.pid) - sched_before
    beside = descendants_cpu_seconds(beside_pid) - beside_before if beside_pid else 0.0
    summary = json.loads(next(ln[4:] for ln in out.splitlines() if ln.startswith("WRK ")))
    return Phase(
        what=what,
        requests=summary["requests"],
        seconds=summary["duration_us"] / 1e6,
        p50_ms=summary["p50_us"] / 1000,
        p99_ms=summary["p99_us"] / 1000,
        max_ms=summary["max_us"] / 1000,
        non_2xx=summary["non_2xx"],
        socket_errors=summary["socket_errors"],
        cpu_ms_per_request=cpu * 1000 / max(1, summary["requests"]),
        socket_error_kinds={k: summary.get(k, 0) for k in ("connect", "read", "write", "timeout")},
        tcp={k: tcp_after[k] - tcp_before[k] for k in tcp_after},
        loop_sched=sched,
        beside_cpu_s=beside,
        accept_queue_max=queue.longest,
        wrk_sched=queue.client,
        server_cpu_samples=dict(sorted(queue.server_cpus.items())),
    )


def median_phase(runs: list[Phase]) -> Phase:
    """The median of each figure over the runs (a figure's median, not one run's)."""
    return Phase(
        what=runs[0].what + (f", median of {len(runs)}" if len(runs) > 1 else ""),
        requests=round(statistics.median(r.requests for r in runs)),
        seconds=statistics.median(r.seconds for r in runs),
        p50_ms=statistics.median(r.p50_ms for r in runs),
        p99_ms=statistics.median(r.p99_ms for r in runs),
        max_ms=statistics.median(r.max_ms for r in runs),
        non_2xx=sum(r.non_2xx for r in runs),
        socket_errors=sum(r.socket_errors for r in runs),
        cpu_ms_per_request=statistics.median(r.cpu_ms_per_request for r in runs),
    )


def wait_line(phase: Phase) -> str:
    """Where a request can wait before the app sees it, over one phase: the API's event loop
    runnable but off the CPU (the kernel's run queue), the CPU the worker and trainer took,
    the accept queue and the TCP counters (connects retried, queues overflowed), wrk's
    socket errors."""
    t, sch = phase.tcp, phase.loop_sched
    errs = {k: v for k, v in phase.socket_error_kinds.items() if v}
    return (
        f"{phase.what}: API loop on CPU {sch.on_cpu_s:.2f} s, waiting for a CPU "
        f"{sch.runqueue_wait_s:.2f} s, preempted {sch.preempted}x; worker+trainer CPU "
        f"{phase.beside_cpu_s:.2f} s; API loop seen on CPUs {phase.server_cpu_samples} "
        f"(CPU: samples); wrk on CPU {phase.wrk_sched.on_cpu_s:.2f} s, waiting "
        f"for one {phase.wrk_sched.runqueue_wait_s:.2f} s; accept queue max "
        f"{phase.accept_queue_max}; TCP opens "
        f"{t.get('TcpActiveOpens', 0)}, listen overflows {t.get('TcpExtListenOverflows', 0)}"
        f"/drops {t.get('TcpExtListenDrops', 0)}, SYN retrans {t.get('TcpExtTCPSynRetrans', 0)}"
        f", retrans segs {t.get('TcpRetransSegs', 0)} (DSACKs back "
        f"{t.get('TcpExtTCPDSACKRecv', 0)}, loss probes {t.get('TcpExtTCPLossProbes', 0)}, "
        f"timeouts {t.get('TcpExtTCPTimeouts', 0)}, original still queued "
        f"{t.get('TcpExtTCPSpuriousRtxHostQueues', 0)}), backlog drops "
        f"{t.get('TcpExtTCPBacklogDrop', 0)}, resets {t.get('TcpEstabResets', 0)}"
        f"; wrk socket errors {errs or 0}"
    )

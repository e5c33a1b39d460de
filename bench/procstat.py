"""What Linux says about a process under load, for the latency benchmarks (bench/wrk.py,
bench/api_latency.py): CPU seconds from /proc (a process's, its reaped children's, a whole
tree's), a thread's scheduler figures, the kernel's TCP counters, a listening socket's
accept queue, and where a process may run (CPU pinning, nice).
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Self


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its threads so far (/proc, Linux): the
    cost of a request that other load on the machine does not change, unlike its rate."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def reaped_children_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of the children a process has waited for (cutime, cstime):
    where an ended process's CPU goes."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")


def descendants_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) of a process and every descendant (the worker, its
    `accelerate launch` and the trainer): what ran beside the API during a phase. Those that
    ended count through their reaped parents' cutime/cstime, so a trainer that exits during
    a phase does not take its CPU out of the sum."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += process_cpu_seconds(p) + reaped_children_cpu_seconds(p)
        except (OSError, IndexError, ValueError):
            continue
        todo += children.get(p, [])
    return total


@dataclass
class Sched:
    """A thread's scheduler figures (/proc/<pid>/task/<tid>/schedstat and status): time on
    a CPU, time runnable but waiting for one (another process had it), involuntary
    switches (preempted). For the API's main thread (its event loop) a wait here is time
    every request in flight waits before the app sees it."""

    on_cpu_s: float = 0.0
    runqueue_wait_s: float = 0.0
    preempted: int = 0

    @classmethod
    def read(cls, pid: int, tid: int | None = None) -> Sched:
        base = Path(f"/proc/{pid}/task/{tid or pid}")
        try:
            run, wait, _ = (base / "schedstat").read_text().split()
            status = (base / "status").read_text()
        except (OSError, ValueError):
            return cls()
        nv = next((int(ln.split()[1]) for ln in status.splitlines()
                   if ln.startswith("nonvoluntary_ctxt_switches")), 0)  # fmt: skip
        return cls(int(run) / 1e9, int(wait) / 1e9, nv)

    def __sub__(self, other: Sched) -> Sched:
        return Sched(self.on_cpu_s - other.on_cpu_s,
                     self.runqueue_wait_s - other.runqueue_wait_s,
                     self.preempted - other.preempted)  # fmt: skip


# Kernel TCP counters (this network namespace, so other traffic on the machine counts too;
# read them as deltas over a phase). ListenOverflows/ListenDrops: the accept queue was full
# and a handshake's last ACK was dropped; TCPSynRetrans: a SYN (or SYN-ACK) sent again,
# after 1 s, then 3 s...: the steps a stalled connect adds to a request; ActiveOpens: the
# connections opened (wrk opens C once, unless the server closes them).
# RetransSegs with as many DSACKRecv: retransmits the receiver already had (spurious: the
# ACK came late, not the data); SpuriousRtxHostQueues: a retransmit found its original
# still queued in this host (on loopback, waiting for a CPU to run the network softirq).
TCP_COUNTERS = (
    "TcpActiveOpens", "TcpPassiveOpens", "TcpExtListenOverflows", "TcpExtListenDrops",
    "TcpExtTCPSynRetrans", "TcpRetransSegs", "TcpExtTCPDSACKRecv", "TcpExtTCPLossProbes",
    "TcpExtTCPTimeouts", "TcpExtTCPSpuriousRtxHostQueues", "TcpExtTCPBacklogDrop",
    "TcpEstabResets", "TcpOutRsts",
)  # fmt: skip


def tcp_counters() -> dict[str, int]:
    """TCP counters of /proc/net/snmp and /proc/net/netstat (``nstat``'s names)."""
    values: dict[str, int] = {}
    for path in ("/proc/net/snmp", "/proc/net/netstat"):
        try:
            lines = Path(path).read_text().splitlines()
        except OSError:
            continue
        for head, vals in zip(lines[::2], lines[1::2], strict=False):
            prefix, names = head.split(":", 1)
            prefix = {"TcpExt": "TcpExt", "Tcp": "Tcp"}.get(prefix, "")
            if not prefix:
                continue
            for name, value in zip(names.split(), vals.split(":", 1)[1].split(), strict=False):
                values[prefix + name] = int(value)
    return {k: values.get(k, 0) for k in TCP_COUNTERS}


class AcceptQueue:
    """Samples the accept queue of a listening port (/proc/net/tcp and tcp6: a LISTEN
    socket's rx_queue is the connections the kernel completed that the server has not
    accepted yet) every 20 ms while open; ``longest`` is the most seen."""

    def __init__(self, port: int) -> None:
        self.port = f"{port:04X}"
        self.longest = 0
        # wrk's own threads: the load generator starved of a CPU delays every response it
        # has not read yet, and wrk counts that in its latencies. Their scheduler figures,
        # summed, at the last sample before wrk exited.
        self.client = Sched()
        self._client_pid = 0
        # Where the server's event loop was at each sample (the CPU it last ran on): beside
        # wrk, it shares that CPU with the load generator.
        self.server_cpus: Counter[int] = Counter()
        self._server_pid = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def watch(self, pid: int, server_pid: int) -> None:
        self._client_pid = pid
        self._server_pid = server_pid

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            if self._server_pid:
                try:
                    stat = Path(f"/proc/{self._server_pid}/stat").read_text()
                    self.server_cpus[int(stat.rsplit(")", 1)[1].split()[36])] += 1
                except (OSError, IndexError, ValueError):
                    pass
            if self._client_pid:
                try:
                    tids = [int(t) for t in os.listdir(f"/proc/{self._client_pid}/task")]
                except OSError:
                    tids = []
                if tids:
                    total = Sched()
                    for tid in tids:
                        one = Sched.read(self._client_pid, tid)
                        total = Sched(total.on_cpu_s + one.on_cpu_s,
                                      total.runqueue_wait_s + one.runqueue_wait_s,
                                      total.preempted + one.preempted)  # fmt: skip
                    self.client = total
            for path in ("/proc/net/tcp", "/proc/net/tcp6"):
                try:
                    text = Path(path).read_text()
                except OSError:
                    continue
                for line in text.splitlines()[1:]:
                    cols = line.split()
                    # local address "ADDR:PORT", state 0A = LISTEN, "tx_queue:rx_queue"
                    if cols[1].endswith(":" + self.port) and cols[3] == "0A":
                        self.longest = max(self.longest, int(cols[4].split(":")[1], 16))


def wait_idle(pid: int, timeout: float = 15.0) -> None:
    """Until the server has finished what the last phase left queued (wrk stops sending, but
    up to C requests are still being served): else the next phase pays for them."""
    deadline = time.monotonic() + timeout
    last = process_cpu_seconds(pid)
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = process_cpu_seconds(pid)
        if now - last < 0.02:  # < 10% of a core: the monitor's writes, not a backlog
            return
        last = now


def pin_threads(pid: int, cpus: set[int]) -> None:
    """Every thread a process has now on ``cpus`` (threads it starts later inherit it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:
            pass


def placement(pid: int, what: str) -> str:
    """A process's nice level and the CPUs it may run on."""
    try:
        nice = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])
        cpus = sorted(os.sched_getaffinity(pid))
    except (OSError, IndexError, ValueError):
        return f"{what} pid {pid}: gone"
    return f"{what} pid {pid}: nice {nice}, CPUs {','.join(map(str, cpus))}"

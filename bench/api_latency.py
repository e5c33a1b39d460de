"""API latency and throughput under dashboard load, measured with wrk on loopback.

Starts the API as `ftune up` runs it (uvicorn serving api.main:app, one process, JSON request
log at INFO) on a scratch SQLite database, or on a scratch database created on the PostgreSQL
server of --database-url; seeds N jobs with events; then, with wrk (pinned to its own CPU so
the load generator does not eat the server's), each for S seconds at C connections:

    /healthz                     the server's floor: no auth, no database
    GET /v1/jobs/{id}            random seeded jobs
    GET /v1/jobs?limit=20        a page of the list
    GET /v1/jobs/{id}/events     a page of events
    GET /v1/jobs/{id}, 1 connection

While they run, a writer plays a running job's monitor (progress update + event, W times a
second, in its own transactions), as the worker does beside the API. Prints req/s and
p50/p99 of each, and GET job's rate as a share of /healthz's in the same run: that ratio
holds on a noisy machine where absolute figures do not. With --runs R every phase runs R
times and medians are printed. Then M jobs are submitted by C client threads at once (the
broker is kombu's filesystem transport under the temp dir: nothing consumes it, it only
records each enqueue, which is checked).

    python -m bench.api_latency
    python -m bench.api_latency --database-url postgresql+psycopg://postgres@127.0.0.1:5432/test

--ftune-up measures GET job through the embedded stack instead, while real tiny jobs start
and run (see ``ftune_up``):

    python -m bench.api_latency --ftune-up --runs 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Self

import httpx
from sqlalchemy import create_engine, insert, select, update
from sqlalchemy.orm import Session

from bench.apiserver import RunningApi, running_api
from bench.record import write_record
from core.db.models import Job, JobEvent, Tenant, new_id, utcnow

RESULTS = Path(__file__).resolve().parent / "results"
SPEC = {
    "model": {"name_or_path": "org/tiny-model"},
    "dataset": {"file_id": "file-seeded", "format": "text"},
    "training": {"max_steps": 100},
}
EVENTS_PER_JOB = 20

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


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its threads so far (/proc, Linux): the
    cost of a request that other load on the machine does not change, unlike its rate."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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


def seed_jobs(api: RunningApi, n: int) -> list[str]:
    """N jobs of the key's tenant, straight into the database, in a mix of states."""
    engine = create_engine(api.database_url)
    ids = [new_id("job") for _ in range(n)]
    statuses = ["queued", "running", "succeeded", "failed"]
    with Session(engine) as s:
        tenant_id = s.scalar(select(Tenant.id).where(Tenant.name == "default"))
        now = utcnow()
        rows = [
            {"id": job_id, "tenant_id": tenant_id, "status": statuses[i % 4], "spec": SPEC,
             "created_at": now, "queued_at": now, "step": 40, "total_steps": 100,
             "train_loss": 1.5, "tokens_per_second": 1000.0, "attempt": 1}
            for i, job_id in enumerate(ids)
        ]  # fmt: skip
        s.execute(insert(Job), rows)
        events = [
            {"job_id": job_id, "type": "progress", "message": f"step {k}",
             "data": {"step": k, "loss": 1.5}, "created_at": now}
            for job_id in ids for k in range(EVENTS_PER_JOB)
        ]  # fmt: skip
        s.execute(insert(JobEvent), events)
        s.commit()
    engine.dispose()
    return ids


class MonitorWriter:
    """Writes like a running job's monitor: progress on the job row and an event, each in
    its own transaction, ``per_second`` times a second, until stopped."""

    def __init__(self, database_url: str, job_id: str, per_second: float) -> None:
        self.engine = create_engine(database_url, connect_args=_connect_args(database_url))
        self.job_id = job_id
        self.interval = 1.0 / per_second if per_second > 0 else 0.0
        self.writes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        if self.interval:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.engine.dispose()

    def _run(self) -> None:
        step = 0
        while not self._stop.wait(self.interval):
            step += 1
            with Session(self.engine) as s:
                s.execute(update(Job).where(Job.id == self.job_id).values(step=step % 100))
                s.execute(insert(JobEvent).values(
                    job_id=self.job_id, type="progress", message=f"step {step}",
                    data={"step": step}, created_at=utcnow(),
                ))  # fmt: skip
                s.commit()
            self.writes += 1


def _connect_args(url: str) -> dict[str, object]:
    return {"timeout": 30} if url.startswith("sqlite") else {}


# --------------------------------------------------------------------------- submit (httpx)


@dataclass
class Result:
    latencies: list[float] = field(default_factory=list)  # seconds
    statuses: Counter[int] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    elapsed: float = 0.0

    def line(self, what: str) -> str:
        n = len(self.latencies)
        if not n:
            return f"{what}: no request completed; errors {dict(self.errors)}"
        ms = sorted(x * 1000 for x in self.latencies)
        p50 = statistics.median(ms)
        p99 = ms[min(n - 1, round(0.99 * (n - 1)))]
        bad = sum(c for s, c in self.statuses.items() if s >= 400) + sum(self.errors.values())
        return (
            f"{what}: {n} requests in {self.elapsed:.1f} s = {n / self.elapsed:.0f} req/s; "
            f"p50 {p50:.1f} ms, p99 {p99:.1f} ms, max {ms[-1]:.1f} ms; "
            f"statuses {dict(sorted(self.statuses.items()))}; failed {bad}"
            + (f" {dict(self.errors)}" if self.errors else "")
        )


def submit(api: RunningApi, jobs: int, clients: int) -> Result:
    """``jobs`` POST /v1/jobs by ``clients`` threads, each with its own connection."""
    headers = {"Authorization": f"Bearer {api.key}"}
    rows = "".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(64)).encode()
    with httpx.Client(base_url=api.url, headers=headers, timeout=30) as c:
        uploaded = c.post("/v1/files", files={"file": ("bench.jsonl", rows)})
        uploaded.raise_for_status()
        body = {**SPEC, "dataset": {"file_id": uploaded.json()["id"], "format": "text"}}
    left = iter(range(jobs))
    lock = threading.Lock()
    results = [Result() for _ in range(clients)]
    barrier = threading.Barrier(clients + 1)
    # One TLS context for all (plain HTTP needs none, but httpx builds one per client, which
    # is slow enough that early connections idle past uvicorn's 5 s keep-alive).
    tls = ssl.create_default_context()

    def loop(result: Result) -> None:
        with httpx.Client(base_url=api.url, headers=headers, timeout=30, verify=tls) as client:
            client.get("/healthz")  # connect before the clock starts
            barrier.wait()
            while True:
                with lock:
                    if next(left, None) is None:
                        return
                timed(result, lambda: client.post("/v1/jobs", json=body))

    threads = [threading.Thread(target=loop, args=(r,), daemon=True) for r in results]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    merged = Result(elapsed=time.perf_counter() - start)
    for r in results:
        merged.latencies += r.latencies
        merged.statuses.update(r.statuses)
        merged.errors.update(r.errors)
    return merged


def timed(result: Result, call: Callable[[], httpx.Response]) -> None:
    t0 = time.perf_counter()
    try:
        status = call().status_code
    except httpx.HTTPError as e:
        result.errors[type(e).__name__] += 1
        return
    result.latencies.append(time.perf_counter() - t0)
    result.statuses[status] += 1


def broker_messages(api: RunningApi) -> int:
    folder = api.data_dir / "broker" / "messages"
    return sum(1 for p in folder.iterdir() if p.is_file()) if folder.is_dir() else 0


# --------------------------------------------------------------------------- through ftune up


def ftune_up(args: argparse.Namespace) -> int:
    """GET /v1/jobs/{id} through the embedded stack as `ftune up` runs it (API and worker
    processes, SQLite, filesystem broker) while real tiny training jobs start and run.

    Each run has two phases at C connections: "idle" (no job queued or running: the
    baseline of this run, on this machine's load now) and "job starting" (a LoRA job on a
    tiny Llama is POSTed half a second into the phase: the worker claims it, writes its
    run plan, `accelerate launch` imports torch and trains, the monitor writes its
    progress). A run's p99 over the idle p99 holds on a loaded machine where the absolute
    figures do not."""
    from cli.demo_assets import build_causal_lm, text_rows, write_jsonl
    from cli.embedded import EMBEDDED_WORKER_NICE, EmbeddedStack

    seconds = min(args.seconds, 60.0)
    wrk_cpus = args.wrk_cpus or None
    conns = args.connections
    tmp = Path(tempfile.mkdtemp(prefix="ftune-bench-up-"))
    models = tmp / "models"
    model_dir = build_causal_lm(models / "tiny-llama")
    train = write_jsonl(tmp / "train.jsonl", text_rows(256))
    spec: dict[str, dict[str, Any]] = {
        "model": {"name_or_path": str(model_dir), "task": "causal_lm"},
        "dataset": {"format": "text", "max_seq_length": 64},
        "peft": {"method": "lora", "r": 8, "lora_alpha": 16, "target_modules": "all-linear"},
        "training": {"max_steps": args.job_steps, "per_device_train_batch_size": 8,
                     "logging_steps": 1, "save_steps": max(1, args.job_steps // 2)},
    }  # fmt: skip
    overrides = {
        "FTUNE_ALLOWED_MODEL_ROOTS": str(models), "HF_HUB_OFFLINE": "1",
        "FTUNE_JOBS_PER_MINUTE_PER_TENANT": "1000000", "FTUNE_LOG_LEVEL": args.log_level,
    }  # fmt: skip
    nice = EMBEDDED_WORKER_NICE if args.worker_nice is None else args.worker_nice
    overrides["FTUNE_WORKER_NICE"] = str(nice)
    stack = EmbeddedStack(data_dir=tmp / "service", env_overrides=overrides)
    rows: list[dict[str, object]] = []
    ok = True
    try:
        with stack, httpx.Client(base_url=stack.url, timeout=30,
                                 headers={"Authorization": f"Bearer {stack.api_key}"}) as c:
            api = RunningApi(stack.url, stack.api_key, "", stack.data_dir,
                             stack.logs_dir / "api.log", stack.procs[0].pid)
            file_id = c.post("/v1/files", files={"file": ("train.jsonl", train.read_bytes())})
            file_id.raise_for_status()
            body = {**spec, "dataset": {**spec["dataset"], "file_id": file_id.json()["id"]}}
            ids: list[str] = []

            def submit_job() -> None:
                r = c.post("/v1/jobs", json=body)
                r.raise_for_status()
                ids.append(r.json()["id"])

            submit_job()  # a first job: ids to GET in the first idle phase, and warm caches
            wait_jobs_done(c, ids, timeout=600)
            print(f"ftune up at {stack.url}: API pid {api.pid}; wrk on CPUs {wrk_cpus or 'any'};"
                  f" {conns} connections, {seconds:g} s a phase; jobs of {args.job_steps} steps")
            worker_pid = stack.procs[1].pid
            if args.server_cpus:
                # As the API-alone mode runs it: off wrk's CPU. Unpinned, the kernel can
                # place the API's loop beside wrk (a wake-up from wrk pulls it to wrk's CPU).
                pin_threads(api.pid, {int(x) for x in args.server_cpus.split(",")})
            print(f"  {placement(api.pid, 'API')}; {placement(worker_pid, 'worker')}")
            wrk(api, "warm-up", "/v1/jobs/{id}", ids, conns, 2, wrk_cpus)
            for run in range(1, max(1, args.runs) + 1):
                locks_before = lock_fallbacks(api.log_path)
                t0 = time.time()
                idle = wrk(api, "idle", "/v1/jobs/{id}", ids, conns, seconds, wrk_cpus,
                           beside_pid=worker_pid)  # fmt: skip
                t1 = time.time()
                locks_idle = lock_fallbacks(api.log_path) - locks_before
                started = wrk(api, "job starting", "/v1/jobs/{id}", ids, conns, seconds,
                              wrk_cpus, during=submit_job, beside_pid=worker_pid)  # fmt: skip
                t2 = time.time()
                locks_start = lock_fallbacks(api.log_path) - locks_before - locks_idle
                inside = [slow_inside(api.log_path, a, b) for a, b in ((t0, t1), (t1, t2))]
                job = c.get(f"/v1/jobs/{ids[-1]}").json()
                print(f"run {run}: GET job p99 {started.p99_ms:.1f} ms with a job starting "
                      f"({started.rate:,.0f} req/s, max {started.max_ms:.1f} ms) vs idle "
                      f"{idle.p99_ms:.1f} ms ({idle.rate:,.0f} req/s): "
                      f"{started.p99_ms / max(idle.p99_ms, 1e-9):.2f}x; job {job['status']} at "
                      f"step {job['progress']['step']} at the phase's end; loop reads that "
                      f"met a lock: {locks_idle} idle, {locks_start} starting")  # fmt: skip
                print(f"  requests >= {SLOW_INSIDE_MS} ms inside the API (its log's "
                      f"duration_ms; stalls in the server, not queueing before it): "
                      f"idle {inside[0][0]} (max {inside[0][1]:.0f} ms), starting "
                      f"{inside[1][0]} (max {inside[1][1]:.0f} ms)")  # fmt: skip
                # Then, if the job is still going, a phase while it trains (every step a
                # burst of CPU on every core the worker gave it, and the monitor's writes).
                running = None
                if wait_training(c, ids[-1], timeout=300):
                    t3 = time.time()
                    running = wrk(api, "job running", "/v1/jobs/{id}", ids, conns, seconds,
                                  wrk_cpus, beside_pid=worker_pid)  # fmt: skip
                    job = c.get(f"/v1/jobs/{ids[-1]}").json()
                    inside.append(slow_inside(api.log_path, t3, time.time()))
                    print(f"  job running: GET job p99 {running.p99_ms:.1f} ms "
                          f"({running.rate:,.0f} req/s, max {running.max_ms:.1f} ms); job "
                          f"{job['status']} at step {job['progress']['step']} at the phase's "
                          f"end; requests >= {SLOW_INSIDE_MS} ms inside the API "
                          f"{inside[2][0]} (max {inside[2][1]:.0f} ms)")  # fmt: skip
                else:
                    print("  job running: not measured (the job was not training any more)")
                phases = [p for p in (idle, started, running) if p is not None]
                for phase in phases:
                    print("  " + wait_line(phase))
                ok = ok and all(p.non_2xx == 0 and p.socket_errors == 0 for p in phases)
                rows.append({"run": run, "idle": asdict(idle) | {"rate": idle.rate},
                             "starting": asdict(started) | {"rate": started.rate},
                             "running": (asdict(running) | {"rate": running.rate}
                                         if running else None),
                             "lock_fallbacks": [locks_idle, locks_start],
                             "slow_inside": inside,
                             "job_status_at_end": job["status"]})  # fmt: skip
                finished = wait_jobs_done(c, ids, timeout=600)
                failed = [j for j in finished if j["status"] != "succeeded"]
                if failed:
                    print(f"jobs not succeeded: {[(j['id'], j['status'], j['error']) for j in failed]}")
                    ok = False
            for key, what in (("idle", "idle"), ("starting", "a job starting"),
                              ("running", "a job running")):
                p99s = [r[key]["p99_ms"] for r in rows if r[key]]  # type: ignore[index]
                if p99s:
                    print(f"GET job p99 with {what}, runs: "
                          f"{', '.join(f'{p:.1f}' for p in p99s)} ms; worst {max(p99s):.1f} ms")
            tracebacks = api.log_path.read_text().count("Traceback")
            if tracebacks:
                print(f"the API logged {tracebacks} tracebacks: {api.log_path}")
                ok = False
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    write_record("api-latency-ftune-up", rows, args=args, connections=conns, seconds=seconds)
    return 0 if ok else 1


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


def wait_training(c: httpx.Client, job_id: str, timeout: float) -> bool:
    """Until the job has logged a training step (True) or is no longer running (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = c.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            return False
        if job["status"] == "running" and (job["progress"]["step"] or 0) >= 1:
            return True
        time.sleep(0.5)
    return False


def wait_jobs_done(c: httpx.Client, ids: list[str], timeout: float) -> list[dict[str, object]]:
    deadline = time.monotonic() + timeout
    while True:
        jobs = [c.get(f"/v1/jobs/{i}").json() for i in ids]
        if all(j["status"] in ("succeeded", "failed", "cancelled") for j in jobs):
            return jobs
        if time.monotonic() > deadline:
            raise TimeoutError(f"jobs not finished after {timeout} s: {jobs}")
        time.sleep(0.5)


SLOW_INSIDE_MS = 100


def slow_inside(log_path: Path, start: float, end: float) -> tuple[int, float]:
    """Requests the API logged between ``start`` and ``end`` (unix seconds) that took at
    least SLOW_INSIDE_MS from the app's first byte to its response, and the longest: a
    burst of them ending together is a wait shared inside the server (in this bench's
    first runs: every 10 s, the API key's verification, which all requests with the key
    awaited)."""
    from datetime import datetime

    n, longest = 0, 0.0
    for line in log_path.read_text(errors="replace").splitlines():
        if '"duration_ms"' not in line:
            continue
        try:
            rec = json.loads(line)
            at = datetime.fromisoformat(rec["time"]).timestamp()
        except (ValueError, KeyError):
            continue
        if start <= at <= end:
            ms = float(rec["duration_ms"])
            longest = max(longest, ms)
            n += ms >= SLOW_INSIDE_MS
    return n, longest


def lock_fallbacks(log_path: Path) -> int:
    """Reads on the API's event loop that met a SQLite lock (api/deps.py Reader logs each)."""
    return log_path.read_text(errors="replace").count("a read on the event loop met a lock")


# --------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database-url", default=os.environ.get("FTUNE_BENCH_DATABASE_URL"),
                        help="a PostgreSQL server (a scratch database is created on it and "
                        "dropped); default $FTUNE_BENCH_DATABASE_URL, else SQLite")  # fmt: skip
    parser.add_argument("--jobs", type=int, default=500, help="jobs seeded (N)")
    parser.add_argument("--connections", type=int, default=100, help="wrk connections (C)")
    parser.add_argument("--seconds", type=float, default=10.0, help="per phase (S), at most 60")
    parser.add_argument("--runs", type=int, default=1, help="repeat every phase (R), medians")
    parser.add_argument("--writes-per-second", type=float, default=20.0,
                        help="the simulated monitor's writes (W); 0: none")  # fmt: skip
    parser.add_argument("--submit", type=int, default=300, help="jobs submitted (M); 0: skip")
    parser.add_argument("--log-level", default="INFO", help="the API's (INFO: a line a request)")
    parser.add_argument("--server-cpus", default="0",
                        help="taskset CPUs of the API ('': any); with --ftune-up, the API "
                        "process of the stack (its worker and trainers are not pinned)")  # fmt: skip
    parser.add_argument("--wrk-cpus", default="1", help="taskset CPUs of wrk ('': any)")
    parser.add_argument("--loop", default="asyncio", choices=["asyncio", "uvloop"],
                        help="the API's event loop (API-alone mode): uvloop to compare with "
                        "what the API ran before (docs/benchmarks.md)")
    parser.add_argument("--ftune-up", action="store_true",
                        help="measure GET job through `ftune up` (API + worker) while real "
                        "tiny jobs start and run, R runs (each printed)")  # fmt: skip
    parser.add_argument("--job-steps", type=int, default=30,
                        help="--ftune-up: training steps of each job")  # fmt: skip
    parser.add_argument("--keep", action="store_true", help="--ftune-up: keep the temp dir")
    parser.add_argument("--worker-nice", type=int, default=None,
                        help="--ftune-up: the worker's nice value (0: as before it had one); "
                        "default what `ftune up` sets")  # fmt: skip
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        print("wrk is not installed (Debian: apt-get install wrk)", file=sys.stderr)
        return 2
    if args.ftune_up:
        return ftune_up(args)
    seconds = min(args.seconds, 60.0)
    server_cpus = args.server_cpus or None
    wrk_cpus = args.wrk_cpus or None
    conns = args.connections

    with running_api(args.database_url, log_level=args.log_level, cpus=server_cpus,
                     loop=args.loop) as api:
        backend = api.database_url.split(":", 1)[0].split("+", 1)[0]
        print(f"API {api.url}: {backend}, 1 uvicorn process ({args.loop} loop) on CPUs "
              f"{server_cpus or 'any'}, "
              f"log level {args.log_level}; wrk on CPUs {wrk_cpus or 'any'}")  # fmt: skip
        job_ids = seed_jobs(api, args.jobs)
        print(f"seeded {len(job_ids)} jobs, {EVENTS_PER_JOB} events each; monitor writes "
              f"{args.writes_per_second:g}/s during the phases")  # fmt: skip
        phases = [
            ("/healthz", "/healthz", conns),
            ("GET /v1/jobs/{id}", "/v1/jobs/{id}", conns),
            ("GET /v1/jobs?limit=20", "/v1/jobs?limit=20", conns),
            ("GET /v1/jobs/{id}/events", "/v1/jobs/{id}/events", conns),
            ("GET /v1/jobs/{id}, 1 connection", "/v1/jobs/{id}", 1),
        ]
        runs: dict[str, list[Phase]] = {p[0]: [] for p in phases}
        wrk(api, "warm-up", "/v1/jobs/{id}", job_ids, conns, 2, wrk_cpus)
        with MonitorWriter(api.database_url, job_ids[1], args.writes_per_second) as writer:
            for _ in range(max(1, args.runs)):
                for name, template, c in phases:
                    label = name if c == 1 else f"{name}, {c} connections"
                    phase = wrk(api, label, template, job_ids, c, seconds, wrk_cpus)
                    runs[name].append(phase)
                    if args.runs > 1:
                        print("  " + phase.line())
        print(f"monitor writes: {writer.writes}")
        medians = {name: median_phase(r) for name, r in runs.items()}
        for phase in medians.values():
            print(phase.line())
        ratios = [
            job.rate / health.rate
            for job, health in zip(runs["GET /v1/jobs/{id}"], runs["/healthz"], strict=True)
        ]
        ratio = statistics.median(ratios)
        cost = medians["GET /v1/jobs/{id}"].cpu_ms_per_request / max(
            1e-9, medians["/healthz"].cpu_ms_per_request
        )
        print(f"GET job costs {cost:.1f}x the server CPU of /healthz per request")
        print(f"GET job / healthz rate: {ratio:.1%}"
              + (f" (runs: {', '.join(f'{r:.1%}' for r in ratios)})" if len(ratios) > 1 else ""))  # fmt: skip

        ok = all(p.non_2xx == 0 and p.socket_errors == 0 for r in runs.values() for p in r)
        submitted = None
        if args.submit > 0:
            submitted = submit(api, min(args.submit, 5000), conns)
            print(submitted.line(f"POST /v1/jobs, {args.submit} jobs by {conns} clients"))
            created = submitted.statuses.get(201, 0)
            messages = broker_messages(api)
            print(f"broker: {messages} messages recorded for {created} jobs created")
            ok = ok and not submitted.errors and messages == created
            ok = ok and not (submitted.statuses.keys() - {201})
        tracebacks = api.log_path.read_text().count("Traceback")
        if tracebacks:
            print(f"the API logged {tracebacks} tracebacks: {api.log_path}")
            ok = False

    write_record(f"api-latency-{backend}", {
        "phases": {name: [asdict(p) | {"rate": p.rate} for p in r] for name, r in runs.items()},
        "job_over_healthz": ratios,
        "submit": submitted.line("POST /v1/jobs") if submitted else None,
    }, args=args, backend=backend, connections=conns, seconds=seconds)  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

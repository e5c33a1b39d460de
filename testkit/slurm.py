"""A real SLURM cluster on this machine for the tests: one slurmctld and N slurmd "nodes",
each in a network namespace of its own (own address and hostname, a private /etc/hosts in
its own mount namespace), on a bridge in the host's namespace, with a private munged.
Debian's slurm-wlm 22.05 + munge; no systemd, no cgroups, no host ports.

The filesystem is shared (only /etc/hosts differs per node), which is what a cluster's
shared job directory is. ``sbatch``/``squeue``/``scancel`` run from the host namespace with
``SLURM_CONF`` set (``cluster.env``).

What it takes (seen on these machines, ../shared/reference/slurm-testbed/README.md):
``ip netns exec`` remounts /sys and slurmd then finds no cgroup filesystem, so namespaces
are entered with ``nsenter --net``; slurmctld insists SlurmctldHost is its hostname (own UTS
namespace); gloo resolves the machine's hostname, so each node has its own hostname and
hosts file; munged wants its socket directory mode 755; MailProg must exist.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

BINARIES = ("ip", "nsenter", "unshare", "munged", "mungekey", "slurmctld", "slurmd", "sinfo",
            "sbatch", "squeue", "scancel", "scontrol")
# For a cluster with accounting (sacct): slurmdbd on a private MariaDB.
ACCOUNTING_BINARIES = ("slurmdbd", "sacct", "sacctmgr", "mariadbd", "mariadb-install-db",
                       "mariadb-admin")


def unavailable(*, accounting: bool = False) -> str | None:
    """Why a cluster (with ``accounting``: and slurmdbd) cannot start here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, slurmd)"
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        return f"missing {', '.join(missing)} (apt-get install -y slurm-wlm munge iproute2)"
    if not Path("/proc/self/ns/net").exists():
        return "no network namespaces"
    missing = [b for b in ACCOUNTING_BINARIES if accounting and shutil.which(b) is None]
    if missing:
        return f"missing {', '.join(missing)} (apt-get install -y slurmdbd mariadb-server)"
    return None


@dataclass
class SlurmCluster:
    root: Path
    nodes: int = 2
    cpus: int = 4  # advertised per node (SlurmdParameters=config_overrides), not checked
    memory_mb: int = 4000
    # A /24 used only on this cluster's bridge and namespaces, and the prefix of their
    # names: both unique per process by default, so two test runs on one machine (or a
    # test run and bench/slurm.py) never touch each other's cluster.
    net: str = ""
    prefix: str = ""
    partition: str = "debug"
    munge_dir: Path | None = None
    # slurmdbd on a private MariaDB in the controller's namespace, so sacct knows every job
    # (squeue forgets an ended one MinJobAge seconds after it ended).
    accounting: bool = False
    min_job_age: int = 300
    # A second partition over the same nodes whose jobs preempt the default partition's
    # (preempt/partition_prio, PreemptMode=REQUEUE): an operator's urgent work.
    preempting_partition: str | None = None
    # Memory per node a job gets unless it asks (DefMemPerNode), enforced without cgroups:
    # slurmstepd polls each step's RSS every second and kills a step over it
    # (jobacct_gather/linux, JobAcctGatherParams=OverMemoryKill). cgroup enforcement
    # (task/cgroup) works here too, but every cluster's slurmd of node "n1" would share
    # the machine's cgroup slurm_n1, and job ids, with another test run's.
    job_memory_mb: int | None = None
    _mariadb: subprocess.Popen[bytes] | None = None

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    @property
    def bridge(self) -> str:
        return f"{self.prefix}br0"

    @property
    def ctl_ns(self) -> str:
        return f"{self.prefix}ctl"

    def node_names(self) -> list[str]:
        return [f"n{i}" for i in range(1, self.nodes + 1)]

    def node_ns(self, node: str) -> str:
        return f"{self.prefix}{node}"

    def namespaces(self) -> list[str]:
        return [self.ctl_ns, *(self.node_ns(n) for n in self.node_names())]

    # -- start / stop --------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> SlurmCluster:
        reason = unavailable(accounting=self.accounting)
        if reason:
            raise RuntimeError(reason)
        self.prefix = self.prefix or f"fs{os.getpid() % 100000}"  # + "br0v9": <= 15 chars
        self.net = self.net or _free_subnet()
        self._cleanup_network()  # a crashed earlier run of this process's cluster
        r = self.root
        for d in ("state", "spool", "log", "run"):
            (r / d).mkdir(parents=True, exist_ok=True)
        # munged wants every directory above its socket o+x and the last one not o+w:
        # pytest's temp dirs are 0700, so the socket lives in a directory of its own.
        self.munge_dir = Path(tempfile.mkdtemp(prefix="ftsl-munge-"))
        self.munge_dir.chmod(0o755)
        m = self.munge_dir
        key = m / "munge.key"
        _run(["mungekey", "-c", "-k", str(key)])
        key.chmod(0o600)
        _run(["munged", "-S", str(self.munge_socket), f"--key-file={key}",
              f"--log-file={m / 'munged.log'}", f"--pid-file={m / 'munged.pid'}",
              f"--seed-file={m / 'munged.seed'}"])
        try:
            self._network()
            self._write_conf()
            if self.accounting:
                self._start_accounting(timeout)
            self._daemon(self.ctl_ns, "slctl", ["slurmctld", "-f", str(self.conf), "-i"])
            for n in self.node_names():
                self.start_node(n, wait=False)
            self.wait_idle(self.node_names(), timeout)
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def munge_socket(self) -> Path:
        assert self.munge_dir is not None
        return self.munge_dir / "munge.socket.2"

    def _network(self) -> None:
        br = self.bridge
        _run(["ip", "link", "add", br, "type", "bridge"])
        _run(["ip", "addr", "add", f"{self.net}.1/24", "dev", br])
        _run(["ip", "link", "set", br, "up"])
        hosts = ["127.0.0.1 localhost", f"{self.net}.2 slctl"]
        for i, ns in enumerate(self.namespaces()):
            addr = f"{self.net}.2" if i == 0 else f"{self.net}.{10 + i}"
            host_side = f"{br}v{i}"
            _run(["ip", "netns", "add", ns])
            _run(["ip", "link", "add", host_side, "type", "veth", "peer", "name", "sl0",
                  "netns", ns])
            _run(["ip", "link", "set", host_side, "master", br, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "sl0"])
            _run(["ip", "-n", ns, "link", "set", "sl0", "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            if i:
                hosts.append(f"{addr} n{i}")
        (self.root / "hosts").write_text("\n".join(hosts) + "\n")

    def _write_conf(self) -> None:
        r, n = self.root, self.nodes
        addrs = ",".join(f"{self.net}.{10 + i}" for i in range(1, n + 1))
        if self.accounting:
            # slurmdbd connections ignore AuthInfo: the munge socket goes in the password.
            accounting = f"""\
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost={self.net}.2
AccountingStoragePort=6819
AccountingStoragePass={self.munge_socket}
"""
        else:
            accounting = "AccountingStorageType=accounting_storage/none\n"
        if self.job_memory_mb:
            memory = f"""\
SelectTypeParameters=CR_Core_Memory
DefMemPerNode={self.job_memory_mb}
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=task=1
JobAcctGatherParams=OverMemoryKill
"""
        else:
            memory = "SelectTypeParameters=CR_Core\nJobAcctGatherType=jobacct_gather/none\n"
        partitions = f"PartitionName={self.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
        if self.preempting_partition:
            partitions = f"""\
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
{partitions} PriorityTier=1
PartitionName={self.preempting_partition} Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=2"""
        self.conf.write_text(f"""\
ClusterName=ftunetest
SlurmctldHost=slctl({self.net}.2)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
# Nodes are namespaces of one machine: advertise the configured CPUs, not the machine's.
SlurmdParameters=config_overrides
{accounting}JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
{memory}MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge={self.min_job_age}
# A job is stopped at its time limit, not OverTimeLimit minutes later; SIGKILL 2 s after
# SIGTERM (tests wait for both).
OverTimeLimit=0
KillWait=2
Waittime=0
NodeName=n[1-{n}] NodeAddr={addrs} CPUs={self.cpus} RealMemory={self.memory_mb} State=UNKNOWN
{partitions}
""")

    def _start_accounting(self, timeout: float) -> None:
        """A private MariaDB (its own data directory and socket, listening only inside the
        controller's namespace) and slurmdbd beside slurmctld; the cluster registered."""
        db = self.root / "db"
        db.mkdir(exist_ok=True)
        _run(["mariadb-install-db", "--no-defaults", f"--datadir={db / 'data'}", "--user=root",
              "--auth-root-authentication-method=normal", "--skip-test-db"], timeout=timeout)
        sock = db / "mysqld.sock"
        with open(db / "mariadbd.out", "ab") as out:
            self._mariadb = subprocess.Popen(
                ["nsenter", f"--net=/var/run/netns/{self.ctl_ns}", "mariadbd", "--no-defaults",
                 "--user=root", f"--datadir={db / 'data'}", f"--socket={sock}",
                 f"--pid-file={db / 'mysqld.pid'}", "--bind-address=127.0.0.1", "--port=3306",
                 f"--log-error={db / 'mysqld.err'}", "--innodb-buffer-pool-size=16M",
                 "--skip-name-resolve"],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)
        _retry(lambda: _run(["mariadb-admin", "--no-defaults", f"--socket={sock}", "-uroot",
                             "ping"], timeout=10), timeout, "mariadbd")
        _run(["mariadb", "--no-defaults", f"--socket={sock}", "-uroot", "-e",
              ("CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm'; "
               "GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';")])
        conf = self.root / "slurmdbd.conf"  # slurmdbd reads it beside $SLURM_CONF
        conf.write_text(f"""\
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
DbdHost=slctl
DbdAddr={self.net}.2
DbdPort=6819
SlurmUser=root
PidFile={self.root}/run/slurmdbd.pid
LogFile={self.root}/log/slurmdbd.log
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=3306
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
""")
        conf.chmod(0o600)
        self._daemon(self.ctl_ns, "slctl", ["slurmdbd"])
        env = {**os.environ, **self.env}
        _retry(lambda: _run(["sacctmgr", "-n", "list", "cluster"], env=env, timeout=10),
               timeout, "slurmdbd")
        _run(["sacctmgr", "-i", "add", "cluster", "ftunetest"], env=env)

    def sacct_state(self, slurm_job_id: str) -> str:
        """The job's state in accounting ("" while slurmdbd has no record of it)."""
        done = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "State", "-j", slurm_job_id],
                              check=False, capture_output=True, text=True,
                              env={**os.environ, **self.env})
        words = done.stdout.split()
        return words[0] if words else ""

    def _daemon(self, ns: str, hostname: str, argv: list[str]) -> None:
        """Run a self-daemonizing ``argv`` in netns ``ns`` with its own hostname and hosts."""
        env = {**os.environ, **self.env}
        _run(["nsenter", f"--net=/var/run/netns/{ns}", "unshare", "--uts", "--mount",
              "--propagation", "private", "sh", "-c",
              'mount --bind "$0" /etc/hosts && hostname "$1" && shift && exec "$@"',
              str(self.root / "hosts"), hostname, *argv], env=env)

    def start_node(self, node: str, *, wait: bool = True, timeout: float = 60.0) -> None:
        self._daemon(self.node_ns(node), node, ["slurmd", "-f", str(self.conf), "-N", node])
        if wait:
            self.wait_idle([node], timeout)

    def wait_idle(self, nodes: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            out = subprocess.run(["sinfo", "-h", "-N", "-t", "idle", "-o", "%N"],
                                 check=False, capture_output=True, text=True, env={**os.environ, **self.env})
            idle = set(out.stdout.split())
            if set(nodes) <= idle:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"nodes {nodes} not idle after {timeout}s: "
                                   f"{self.log_tail()}")
            time.sleep(0.1)

    def pids_in(self, node: str) -> list[int]:
        """Processes in ``node``'s network namespace (slurmd, slurmstepd, ranks)."""
        return _netns_pids(self.node_ns(node))

    def job_processes(self, node: str, slurm_job_id: str | None = None) -> list[str]:
        """Command lines of what runs in ``node`` besides its slurmd; with ``slurm_job_id``
        only that job's (its slurmstepd, and every process whose environment says
        SLURM_JOB_ID=<id>: srun hands it down to the ranks and their children)."""
        out = []
        for pid in self.pids_in(node):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if cmd.startswith("slurmd "):
                continue
            if slurm_job_id is not None and not (
                    cmd.startswith(f"slurmstepd: [{slurm_job_id}.")
                    or f"SLURM_JOB_ID={slurm_job_id}".encode() in env):
                continue
            out.append(f"{pid}: {cmd.strip()}")
        return out

    def rank_processes(self, node: str, slurm_job_id: str) -> list[int]:
        """Trainer ranks of SLURM job ``slurm_job_id`` on ``node`` (and their children):
        the processes torch's elastic agent started, which carry ``RANK`` in their
        environment; the per-node launcher and slurmstepd do not."""
        needle = f"SLURM_JOB_ID={slurm_job_id}".encode()
        found = []
        for pid in self.pids_in(node):
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if needle in env and any(e.startswith(b"RANK=") for e in env):
                found.append(pid)
        return found

    def kill_node(self, node: str) -> None:
        """The node fails: SLURM marks it down (its jobs end NODE_FAIL), then everything in
        it dies at once (SIGKILL: slurmd, slurmstepd, ranks)."""
        self.scontrol("update", f"nodename={node}", "state=down", "reason=test_node_failure")
        for pid in self.pids_in(node):
            _kill(pid, signal.SIGKILL)

    def revive_node(self, node: str, timeout: float = 60.0) -> None:
        self.start_node(node, wait=False)
        try:
            self.scontrol("update", f"nodename={node}", "state=resume")
        except RuntimeError:
            pass  # already back (ReturnToService=2 returns a node that registers)
        self.wait_idle([node], timeout)

    def scontrol(self, *args: str) -> str:
        return _run(["scontrol", *args], env={**os.environ, **self.env})

    def log_tail(self, n: int = 40) -> str:
        out = []
        for f in sorted((self.root / "log").glob("*.log")):
            lines = f.read_text(errors="replace").splitlines()[-n:]
            out.append(f"--- {f.name}\n" + "\n".join(lines))
        return "\n".join(out)

    def stop(self) -> None:
        """Kill only what lives in this cluster's namespaces, then munged by its pid file,
        then remove the namespaces and the bridge."""
        pids = [p for ns in self.namespaces() for p in _netns_pids(ns)]
        for p in pids:
            _kill(p, signal.SIGTERM)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.1)
        for p in pids:
            _kill(p, signal.SIGKILL)
        if self.munge_dir is not None:
            try:
                mp = int((self.munge_dir / "munged.pid").read_text().strip())
                if Path(f"/proc/{mp}/comm").read_text().strip() == "munged":
                    _kill(mp, signal.SIGTERM)
                    # It writes its seed file as it exits: remove the directory after.
                    deadline = time.monotonic() + 5
                    while _alive(mp) and time.monotonic() < deadline:
                        time.sleep(0.05)
            except (OSError, ValueError):
                pass
            shutil.rmtree(self.munge_dir, ignore_errors=True)
            self.munge_dir = None
        if self._mariadb is not None:  # killed above with its namespace; reap it
            try:
                self._mariadb.wait(10)
            except subprocess.TimeoutExpired:
                self._mariadb.kill()
                self._mariadb.wait()
            self._mariadb = None
        self._cleanup_network()

    def _cleanup_network(self) -> None:
        for i in range(len(self.namespaces())):
            subprocess.run(["ip", "link", "del", f"{self.bridge}v{i}"], check=False, capture_output=True)
        for ns in self.namespaces():
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], check=False, capture_output=True)


def _free_subnet() -> str:
    """A 10.x.y.0/24 no interface of this machine is on."""
    done = subprocess.run(["ip", "-o", "-4", "addr"], check=False, capture_output=True,
                          text=True)
    used = set()
    for word in done.stdout.split():
        if word.count(".") == 3 and "/" in word:
            used.add(word.split("/")[0].rsplit(".", 1)[0])
    pid = os.getpid()
    for i in range(250):
        net = f"10.{200 + (pid + i) % 50}.{(pid // 50 + i) % 250}"
        if net not in used:
            return net
    raise RuntimeError("no free 10.x.y.0/24 subnet for the test cluster")


def _run(argv: list[str], env: dict[str, str] | None = None, timeout: float = 60) -> str:
    try:
        done = subprocess.run(argv, check=False, capture_output=True, text=True, env=env,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{' '.join(argv)}: no answer in {timeout} s") from None
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def _retry(call: Callable[[], object], timeout: float, what: str) -> None:
    """``call`` until it raises no RuntimeError (a daemon is up), at most ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            call()
            return
        except RuntimeError as e:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} not up after {timeout} s: {e}") from None
        time.sleep(0.1)


def _netns_pids(ns: str) -> list[int]:
    done = subprocess.run(["ip", "netns", "pids", ns], check=False, capture_output=True, text=True)
    return [int(p) for p in done.stdout.split() if p.isdigit()] if done.returncode == 0 else []


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (OSError, IndexError):
        return False


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass

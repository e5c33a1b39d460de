"""Spawning the trainer and killing its whole process tree.

``accelerate launch`` starts one process per rank (directly, or through torch's elastic
agent), and ranks may start data-loader workers of their own. Killing the launcher alone
leaves them running (that is what Celery's ``revoke(terminate=True)`` does), so:

* the launcher starts in a new session (its own process group), with an environment tag
  (``FTUNE_LAUNCH_TAG``) that every descendant inherits;
* the worker remembers every descendant it has seen while the job ran;
* to stop, it collects the tree *before* signalling (a rank whose parent dies is
  re-parented and is no longer found as a descendant), asks for a graceful stop (STOP file
  and SIGTERM to the group), waits, then SIGKILLs the group and every process it knows of,
  plus any process still carrying the tag (that finds even one that called setsid() and
  double-forked away), and checks with psutil that none is left.

If the worker itself is SIGKILLed nobody runs that: the launcher gets SIGTERM
(PR_SET_PDEATHSIG), each rank sees its parent gone and stops, then exits within
FTUNE_ORPHAN_GRACE_SECONDS (core/train/lifeline.py), and the reconciler that gives the job
away kills whatever of that attempt is still alive on its machine.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import psutil

from core.infra.cpu_priority import pass_on_nice
from core.infra.settings import get_settings
from core.train.lifeline import ORPHAN_GRACE_ENV, STOP_GRACE_ENV
from worker.run.outside_kill import OomCounters

log = logging.getLogger(__name__)

TAG_ENV = "FTUNE_LAUNCH_TAG"

# Never handed to the trainer: it needs no database or broker, and a model repo's own code
# (trust_remote_code) should not find credentials in its environment.
# The judge endpoint's key stays with the grading process (worker/run/grading.py).
_SECRET_ENV = ("DATABASE_URL", "FTUNE_DATABASE_URL", "BROKER_URL", "FTUNE_BROKER_URL",
               "FTUNE_BOOTSTRAP_API_KEY", "FTUNE_GRADER_JUDGE_API_KEY")


def _secret_values(env: Mapping[str, str]) -> set[str]:
    """The credentials among the worker's settings: URL passwords and the bootstrap key. Any
    variable holding one (e.g. a copy of DATABASE_URL under another name) is dropped too."""
    found: set[str] = set()
    for name in _SECRET_ENV:
        value = env.get(name)
        if not value:
            continue
        if "://" in value:
            password = urlsplit(value).password
            if password and len(password) >= 4:
                found.add(password)
        else:
            found.add(value)
    return found


def trainer_env(
    base: Mapping[str, str] | None = None, *, extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The worker's environment minus its secrets, plus what the trainer needs
    (HF_HUB_OFFLINE and the like pass through)."""
    source = os.environ if base is None else base
    secrets_ = _secret_values(source)
    env = {k: v for k, v in source.items()
           if k not in _SECRET_ENV and not any(s in v for s in secrets_)}
    env["PYTHONUNBUFFERED"] = "1"
    settings = get_settings()
    # torch's elastic agent SIGKILLs ranks this long after forwarding SIGTERM; the trainer
    # needs the worker's whole grace period to save its checkpoint.
    grace = settings.cancel_grace_seconds
    env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = str(int(grace) + 5)
    # A rank whose launcher died (core/train/lifeline.py): when the worker asked for the
    # stop, it may take the worker's grace period; an orphan must be gone well before the
    # reconciler gives the job to another worker (heartbeat timeout).
    env[STOP_GRACE_ENV] = str(int(grace) + 5)
    env[ORPHAN_GRACE_ENV] = f"{max(1.0, min(grace, settings.heartbeat_timeout_seconds / 2)):g}"
    # The trainer runs the same code as this worker, wherever the worker was started from.
    repo_root = str(Path(__file__).resolve().parents[2])
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if repo_root not in paths:
        env["PYTHONPATH"] = os.pathsep.join([repo_root, *paths])
    if extra:
        env.update(extra)
    return env


def new_tag(job_id: str, attempt: int) -> str:
    return f"{job_id}:{attempt}:{secrets.token_hex(4)}"


_prctl: Callable[..., int] | None
try:  # loaded here, not in the forked child (no dlopen between fork and exec)
    _prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
except (OSError, AttributeError):  # pragma: no cover - not Linux
    _prctl = None
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    # If the worker thread that started it dies (worker SIGKILLed), the launcher gets
    # SIGTERM (Linux only); torch's elastic agent forwards it to the ranks. The one-process
    # launcher just dies: its rank notices the lost parent itself (core/train/lifeline.py).
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))


@dataclass
class Launched:
    """A running trainer: the launcher process and what the worker knows of its tree."""

    popen: subprocess.Popen[bytes]
    tag: str
    seen: set[psutil.Process] = field(default_factory=set)
    # The OOM kill counters of the memory cgroups its processes were seen in: whether the
    # kernel's OOM killer killed one (worker/run/outside_kill.py).
    oom: OomCounters = field(default_factory=OomCounters)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def track(self) -> None:
        """Remember every current descendant, and its memory cgroup (called from the
        monitor loop)."""
        new = descendants(self.pid) - self.seen
        self.oom.see([self.pid, *(p.pid for p in new)])
        self.seen |= new


def _pinned_child(cpus: tuple[int, ...]) -> None:  # pragma: no cover - runs in the child
    # sched_setaffinity is one system call (its CPU set a malloc, which glibc keeps safe
    # after fork); every process the launcher starts inherits the set.
    _die_with_parent()
    os.sched_setaffinity(0, cpus)


def spawn(argv: list[str], *, log_path: Path, env: Mapping[str, str], tag: str,
          cwd: Path | None = None, cpus: Iterable[int] | None = None) -> Launched:
    """Start ``argv`` (a list, never a shell string) in a new session, appending stdout and
    stderr to ``log_path``. ``cpus``: run it, and all it starts, on these cores only."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**env, TAG_ENV: tag}
    preexec: Callable[[], None] | None = _die_with_parent if _prctl is not None else None
    if cpus:
        preexec = functools.partial(_pinned_child, tuple(cpus))
    with open(log_path, "ab") as out:
        popen = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=True,
            # Only a prctl() (and a sched_setaffinity()) call between fork and exec.
            preexec_fn=preexec,  # noqa: PLW1509
            close_fds=True,
        )
    # Popen returned after the exec, so the child already leads its own session: a new
    # autogroup, at nice 0 unless given the worker's (core/infra/cpu_priority.py).
    pass_on_nice(popen.pid)
    launched = Launched(popen=popen, tag=tag)
    launched.track()
    return launched


# --------------------------------------------------------------------------------------
# Finding processes.


def _proc(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def descendants(pid: int) -> set[psutil.Process]:
    p = _proc(pid)
    if p is None:
        return set()
    try:
        return set(p.children(recursive=True))
    except psutil.Error:
        return set()


def is_alive(p: psutil.Process) -> bool:
    """Running and not a zombie (a zombie holds no resources; its parent reaps it)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def tagged(tag: str) -> set[psutil.Process]:
    """Every live process whose environment carries ``FTUNE_LAUNCH_TAG=tag``."""
    needle = f"{TAG_ENV}={tag}".encode()
    return {p for p, env in _environs() if needle in env}


def tagged_prefix(prefix: str) -> set[psutil.Process]:
    """Every live process whose tag starts with ``prefix`` (e.g. ``"<job_id>:"``)."""
    needle = f"{TAG_ENV}={prefix}".encode()
    return {p for p, env in _environs() if is_alive(p) and any(e.startswith(needle) for e in env)}


def _environs() -> Iterable[tuple[psutil.Process, list[bytes]]]:
    me = os.getpid()
    for p in psutil.process_iter():
        if p.pid == me:
            continue
        try:
            # /proc/<pid>/environ directly: much faster than psutil's parsed environ().
            with open(f"/proc/{p.pid}/environ", "rb") as f:
                yield p, f.read().split(b"\0")
        except OSError:
            continue


def in_session(sid: int) -> set[psutil.Process]:
    found: set[psutil.Process] = set()
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid:
                found.add(p)
        except (OSError, psutil.Error):
            continue
    return found


def collect(launched: Launched) -> set[psutil.Process]:
    """Everything that belongs to this launch and is alive: the launcher, its current and
    previously seen descendants, its session, and anything carrying its tag."""
    procs = set(launched.seen) | descendants(launched.pid) | tagged(launched.tag)
    leader = _proc(launched.pid)
    if leader is not None:
        procs.add(leader)
    procs |= in_session(launched.pid)
    me = os.getpid()
    return {p for p in procs if p.pid != me and is_alive(p)}


# --------------------------------------------------------------------------------------
# Killing.


def _signal_all(procs: Iterable[psutil.Process], sig: int, *, pgid: int | None) -> None:
    if pgid is not None:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    for p in procs:
        try:
            p.send_signal(sig)  # psutil checks the pid was not reused
        except psutil.Error:
            pass


def wait_gone(launched: Launched | None, procs: set[psutil.Process], timeout: float) -> set[
        psutil.Process]:
    """Wait up to ``timeout`` for ``procs`` to exit; returns those still alive."""
    end = time.monotonic() + timeout
    alive = set(procs)
    while True:
        if launched is not None:
            launched.poll()  # reap our direct child so it does not linger as a zombie
        alive = {p for p in alive if is_alive(p)}
        if not alive or time.monotonic() >= end:
            return alive
        time.sleep(0.05)


def request_stop(launched: Launched, *, stop_file: Path | None = None) -> set[psutil.Process]:
    """Ask the trainer to stop gracefully: STOP file, then SIGTERM to the process group and
    to every process of the launch. Returns the processes to wait for, collected before
    any signal (ranks re-parent once the launcher dies)."""
    procs = collect(launched)
    if stop_file is not None:
        try:
            stop_file.touch()
        except OSError:
            log.warning("could not create %s", stop_file)
    _signal_all(procs, signal.SIGTERM, pgid=launched.pid)
    return procs


def stop_tree(launched: Launched, *, grace: float, stop_file: Path | None = None,
              kill_timeout: float = 10.0) -> set[psutil.Process]:
    """Graceful stop, ``grace`` seconds, then SIGKILL for everything the launch started.
    Returns the processes alive afterwards (empty unless one ignores SIGKILL, e.g. stuck
    in uninterruptible I/O)."""
    procs = collect(launched)
    if grace > 0 and procs:
        procs = request_stop(launched, stop_file=stop_file)
        procs = wait_gone(launched, procs, grace)
    return kill_remaining(launched, procs, timeout=kill_timeout)


def kill_remaining(launched: Launched, known: set[psutil.Process] | None = None, *,
                   timeout: float = 10.0) -> set[psutil.Process]:
    """SIGKILL the launch's group and every process belonging to it, then verify."""
    procs = set(known or ()) | collect(launched)
    for _ in range(3):  # a process may fork while we kill; look again
        if not procs:
            break
        _signal_all(procs, signal.SIGKILL, pgid=launched.pid)
        wait_gone(launched, procs, timeout)
        procs = collect(launched)
    launched.poll()
    survivors = {p for p in procs if is_alive(p)}
    if survivors:
        log.error("processes survived SIGKILL: %s", sorted(p.pid for p in survivors))
    return survivors


def kill_tagged(tag_prefix: str) -> int:
    """Kill processes left by an earlier attempt of a job on this machine (e.g. after the
    previous worker was SIGKILLed): any process whose tag starts with ``tag_prefix``."""
    victims = tagged_prefix(tag_prefix)
    for p in victims:
        try:
            p.kill()
        except psutil.Error:
            pass
    if victims:
        psutil.wait_procs(list(victims), timeout=5)
    return len(victims)

"""Python graders run here: user code, so in a sandbox, never in the caller's process.

Each sandbox is a child process tree started from an argv list (no shell). It needs no
root: an ordinary user (the Docker image's ``ftune``) runs it inside user namespaces, as
bubblewrap is designed to be used (flatpak, nsjail and gVisor deployments do the same):

    prlimit (CPU, address space, file size, no core dumps)
      bwrap --unshare-all --unshare-user --disable-userns: new user, network, PID, IPC, UTS
             and cgroup namespaces and an empty root (tmpfs) holding read-only binds of the C
             library, the Python runtime and one directory with the grader's source, nothing
             else (no data directory, no job directory, no API key file; the environment is
             cleared). Inside, the grader is uid 65534 with no capabilities and may not make
             namespaces of its own.
        python -I -S: the runner below; it caps its processes (RLIMIT_NPROC), then reads one
                      JSON request per line (sample, item) and answers one JSON line.

RLIMIT_NPROC is counted per user namespace since Linux 5.14 (ucounts): set inside the
sandbox's own namespace it counts the sandbox's processes only, not every process of the
service's user, so a fork bomb stops at ``processes`` without starving the worker.

As root (the old deployment, still supported) setpriv first drops to uid 65534 with no
capabilities, and the same tree runs under it: root's own processes are exempt from
RLIMIT_NPROC, and a user namespace made by root would map to root. The interpreter must then
be one that uid 65534 may read (a pyenv under /root is not: the system's python3 is used).

The caller gives each call a wall-clock budget; a call that overruns it, or a runner that
dies (CPU limit, memory, a crash), costs that call a 0 with an error, and the sandbox is
killed and started afresh for the next call. A runner is also recycled after
``calls_per_process`` calls, so the CPU limit (total per process) bounds each call.

bubblewrap comes from Debian (``apt-get install bubblewrap``, ``make sandbox``). Where the
sandbox cannot start (bubblewrap missing, user namespaces disabled, not Linux),
``sandbox_refusal`` says why and what fixes it, and python graders are refused with that
reason.
"""

from __future__ import annotations

import functools
import json
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

# The runner, executed inside the sandbox by `python -I -S -c`. It keeps the protocol's
# stdout to itself: the grader's own prints go to stderr (which the host drains and drops).
RUNNER = r"""
import json, math, os, resource, sys
# Before any grader code: the sandbox's processes (counted in its own user namespace).
nproc = int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
proto = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr
per_call = int(sys.argv[2])
ns = {"__name__": "grader"}
load_error = None
try:
    with open(sys.argv[1]) as f:
        exec(compile(f.read(), "grader.py", "exec"), ns)
    if not callable(ns.get("grade")):
        load_error = "the source defines no grade(sample, item) function"
except BaseException as e:
    load_error = f"loading the grader failed: {type(e).__name__}: {e}"
for line in sys.stdin:
    used = resource.getrusage(resource.RUSAGE_SELF)
    spent = int(used.ru_utime + used.ru_stime) + 1
    soft, hard = resource.getrlimit(resource.RLIMIT_CPU)
    resource.setrlimit(resource.RLIMIT_CPU, (min(spent + per_call, hard), hard))
    try:
        if load_error:
            raise RuntimeError(load_error)
        req = json.loads(line)
        score = ns["grade"](req["sample"], req["item"])
        if isinstance(score, bool) or not isinstance(score, (int, float)):
            raise TypeError(f"grade() returned {type(score).__name__}, not a number")
        out = {"score": float(score)}
        if not math.isfinite(out["score"]):
            out = {"error": f"grade() returned {score}"}
    except BaseException as e:
        out = {"error": f"{type(e).__name__}: {e}"[:500]}
    proto.write(json.dumps(out) + "\n")
    proto.flush()
"""

MAX_ANSWER_BYTES = 4096


class SandboxUnavailable(RuntimeError):
    """This host cannot run python graders safely; the message says why."""


@dataclass(frozen=True)
class SandboxLimits:
    """Per-call and per-process bounds (settings.python_grader_*)."""

    wall_seconds: float = 10.0  # one call, start-up included
    cpu_seconds: int = 5  # one call
    memory_bytes: int = 1 << 30  # address space of each process
    file_bytes: int = 1 << 20  # largest file it may write (only its tmpfs is writable)
    processes: int = 16  # processes in the sandbox (a fork bomb stops here)
    calls_per_process: int = 64
    uid: int = 65534  # nobody


def _as_root() -> bool:
    return os.geteuid() == 0


def _tools() -> tuple[str, ...]:
    return ("bwrap", "prlimit", "setpriv") if _as_root() else ("bwrap", "prlimit")


_NO_PYTHON = ("python graders need a Python 3 interpreter that the sandbox's user (uid 65534) "
              "may read; this one lies under a private directory: install python3 "
              "(apt-get install python3-minimal)")
_PACKAGES = {"bwrap": "bubblewrap", "prlimit": "util-linux", "setpriv": "util-linux"}
_USERNS_HINT = (
    "user namespaces seem disabled for this user: check sysctl user.max_user_namespaces (> 0) "
    "and kernel.unprivileged_userns_clone (1, older Debian kernels); on Ubuntu 23.10+ allow "
    "bwrap in AppArmor (kernel.apparmor_restrict_unprivileged_userns); in a container, run it "
    "with a seccomp and AppArmor profile that permit user namespaces (docker-compose.yml: "
    "security_opt)"
)


def _sysctl(name: str) -> int | None:
    try:
        return int(Path("/proc/sys", *name.split(".")).read_text().strip())
    except (OSError, ValueError):
        return None


def _static_refusal() -> str | None:
    """What the host lacks, from cheap checks (no process started)."""
    if sys.platform != "linux":
        return (f"python graders need Linux namespaces and this server runs on {sys.platform}: "
                "run the API and the worker on Linux")
    for tool in _tools():
        if shutil.which(tool) is None:
            return (f"python graders need {tool}, which is not installed on this server: "
                    f"install it (apt-get install {_PACKAGES[tool]}, or `make sandbox`)")
    if _python() is None:
        return _NO_PYTHON
    # As root too: root becomes the sandbox's user before bwrap makes the namespaces.
    if _sysctl("user.max_user_namespaces") == 0:
        return ("python graders need user namespaces, which the kernel has disabled "
                "(user.max_user_namespaces = 0): set sysctl user.max_user_namespaces=10000")
    if _sysctl("kernel.unprivileged_userns_clone") == 0:
        return ("python graders need user namespaces, which the kernel has disabled for "
                "ordinary users (kernel.unprivileged_userns_clone = 0): set it to 1")
    return None


def sandbox_refusal() -> str | None:
    """Why python graders cannot run on this host (the reason and its fix), or None.

    Past the cheap checks one sandbox is started for real, once per process and setup
    (which bwrap, which user): a kernel or container profile that forbids user namespaces
    only shows when bwrap tries."""
    refusal = _static_refusal()
    if refusal is not None:
        return refusal
    return _started_refusal(shutil.which("bwrap") or "", os.geteuid())


@functools.cache
def _started_refusal(bwrap: str, euid: int) -> str | None:
    del bwrap, euid  # the cache key: the answer holds for one bwrap and one user
    return check_sandbox()


def check_sandbox() -> str | None:
    """Start one sandbox and grade one answer in it: None when it works, else why not
    (bwrap's own message and what usually causes it). Takes a fraction of a second."""
    limits = SandboxLimits(wall_seconds=20, calls_per_process=1)
    try:
        with PythonSandbox("def grade(sample, item):\n    return 0.5\n", limits,
                           _checked=True) as sb:
            result = sb.call({}, {})
            stderr = sb.last_stderr
    except OSError as e:
        return f"the sandbox did not start ({e})"
    if result.score == 0.5:
        return None
    said = stderr.strip().splitlines()[-1] if stderr.strip() else result.error
    return f"the sandbox did not start: {said}; {_USERNS_HINT}"


def _open_to_all(path: Path) -> bool:
    """Whether any user may read ``path`` (every directory above it traversable)."""
    try:
        if not path.stat().st_mode & stat.S_IROTH:
            return False
        return all(p.stat().st_mode & stat.S_IXOTH for p in path.parents)
    except OSError:
        return False


def _python() -> tuple[Path, Path] | None:
    """The interpreter to run (a base one: a venv's packages are not needed) and its
    installation prefix, bound read-only into the sandbox; as root, one the sandbox's user
    may read (a pyenv under /root is not: the system's python3 then). None: no such one."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    candidates = [(Path(sys.base_prefix) / "bin" / version, Path(sys.base_prefix))]
    system = Path(shutil.which("python3", path="/usr/local/bin:/usr/bin") or "/usr/bin/python3")
    candidates.append((system.resolve(), system.resolve().parent.parent))
    for exe, prefix in candidates:
        if exe.exists() and (not _as_root() or (_open_to_all(exe) and _open_to_all(prefix))):
            return exe, prefix
    return None


def _binds() -> list[str]:
    """Read-only binds for the C library and the runtime (no /etc, /home, /root, /work...)."""
    # Directories bwrap creates on the way to a bind are 0700 under a strict umask: make
    # the parents explicitly, traversable by the sandbox user.
    out: list[str] = ["--perms", "0755", "--dir", "/usr"]
    for path in ("/usr/lib", "/usr/lib64"):
        if os.path.exists(path):
            out += ["--ro-bind", path, path]
    for link, target in (("/lib", "usr/lib"), ("/lib64", "usr/lib64")):
        if os.path.islink(link) or os.path.isdir(f"/{target}"):
            out += ["--symlink", target, link]
    return out


def sandbox_argv(code_dir: Path, limits: SandboxLimits) -> list[str]:
    """A fresh argv list each call: (setpriv as root) -> prlimit -> bwrap -> python runner."""
    found = _python()
    if found is None:
        raise SandboxUnavailable(_NO_PYTHON)
    exe, prefix = found
    hard_cpu = limits.cpu_seconds * limits.calls_per_process + 2
    # Root first becomes the sandbox's user, then everything runs as an ordinary user would:
    # root's processes are exempt from RLIMIT_NPROC, and a user namespace made by root maps
    # to root.
    drop = [shutil.which("setpriv") or "setpriv", f"--reuid={limits.uid}",
            f"--regid={limits.uid}", "--clear-groups", "--inh-caps=-all",
            "--bounding-set=-all", "--no-new-privs", "--"] if _as_root() else []
    return [
        *drop,
        "prlimit",
        f"--cpu={limits.cpu_seconds}:{hard_cpu}",
        f"--as={limits.memory_bytes}",
        f"--fsize={limits.file_bytes}",
        "--core=0",
        "--",
        "bwrap",
        # Every namespace, the user namespace required (not "try"); bwrap drops every
        # capability of the sandboxed process, and --disable-userns keeps it from making
        # namespaces of its own (where it would hold capabilities: more kernel to attack).
        "--unshare-all", "--unshare-user", "--disable-userns",
        "--uid", str(limits.uid), "--gid", str(limits.uid),
        "--die-with-parent",
        "--new-session",
        "--clearenv",
        "--setenv", "PATH", "/nonexistent",
        "--setenv", "HOME", "/tmp",
        "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
        *_binds(),
        # At a path of its own, so nothing else of the prefix's parent shows. The
        # interpreter finds its standard library from where it runs, and its shared
        # library through LD_LIBRARY_PATH.
        "--ro-bind", str(prefix), "/python",
        "--setenv", "LD_LIBRARY_PATH", "/python/lib",
        "--ro-bind", str(code_dir), "/grader",
        "--proc", "/proc",
        "--dev", "/dev",
        # A scratch directory the grader may write (bounded by the file-size limit).
        "--perms", "1777", "--tmpfs", "/tmp",
        "--remount-ro", "/",
        "--chdir", "/tmp",
        f"/python/{exe.relative_to(prefix)}", "-I", "-S", "-c", RUNNER, "/grader/grader.py",
        str(limits.cpu_seconds), str(limits.processes),
    ]


@dataclass
class CallResult:
    score: float | None
    error: str | None
    seconds: float


class PythonSandbox:
    """One python grader's sandbox; ``call`` grades one (sample, item). Not thread-safe.
    Use as a context manager (or call ``close``) so no process outlives its user."""

    def __init__(self, source: str, limits: SandboxLimits | None = None, *,
                 _checked: bool = False) -> None:
        # _checked: check_sandbox's own probe, which keeps bwrap's stderr to report it.
        if not _checked:
            refusal = sandbox_refusal()
            if refusal is not None:
                raise SandboxUnavailable(refusal)
        self._stderr = tempfile.TemporaryFile() if _checked else None  # noqa: SIM115 (closed in close())
        self.limits = limits or SandboxLimits()
        self._dir = Path(tempfile.mkdtemp(prefix="ftune-grader-"))
        self._dir.chmod(0o755)
        code = self._dir / "grader.py"
        code.write_text(source)
        code.chmod(0o444)
        self._proc: subprocess.Popen[bytes] | None = None
        self._calls = 0
        self._buffer = b""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stop()
        shutil.rmtree(self._dir, ignore_errors=True)
        if self._stderr is not None:
            self._stderr.close()

    @property
    def last_stderr(self) -> str:
        """What the sandbox wrote to stderr (only kept for check_sandbox's probe)."""
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        return self._stderr.read(MAX_ANSWER_BYTES).decode(errors="replace")

    def _start(self) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            sandbox_argv(self._dir, self.limits),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr if self._stderr is not None else subprocess.DEVNULL,
            start_new_session=True,
            env={"PATH": "/usr/bin:/bin"},
        )
        self._calls, self._buffer = 0, b""
        return proc

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        # Kill the sandbox's PID 1 (bwrap's child): the kernel then kills every process of
        # its PID namespace and reaps them before PID 1's exit is reported, so once bwrap
        # (which waits for it) has exited, nothing of the sandbox is left.
        try:
            children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        except OSError:
            children = []
        for pid in children:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        for f in (proc.stdin, proc.stdout):
            if f is not None:
                try:
                    f.close()
                except OSError:  # a request still buffered for a runner that died
                    pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            # bwrap itself stuck: killing it kills its child (--die-with-parent).
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def call(self, sample: dict[str, Any], item: dict[str, Any]) -> CallResult:
        t0 = time.monotonic()
        if self._proc is None or self._calls >= self.limits.calls_per_process:
            self._stop()
            self._proc = self._start()
        proc = self._proc
        self._calls += 1
        assert proc.stdin is not None and proc.stdout is not None
        request = json.dumps({"sample": sample, "item": item}, ensure_ascii=False) + "\n"
        try:
            proc.stdin.write(request.encode())
            proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return self._failed("the sandbox exited before the call", t0)
        line = self._read_line(proc, t0 + self.limits.wall_seconds)
        if line is None:
            if proc.poll() is None:
                return self._failed(
                    f"no answer within {self.limits.wall_seconds:g} s (wall-clock limit)", t0
                )
            return self._failed(_exit_reason(proc.returncode, self.limits), t0)
        try:
            answer = json.loads(line)
        except ValueError:
            return self._failed("the sandbox answered something that is not JSON", t0)
        seconds = time.monotonic() - t0
        if not isinstance(answer, dict):
            return self._failed("the sandbox answered something that is not an object", t0)
        if "error" in answer:
            return CallResult(None, str(answer["error"])[:500], seconds)
        score = answer.get("score")
        if isinstance(score, bool) or not isinstance(score, (int, float)):
            return self._failed("the sandbox answered no score", t0)
        return CallResult(float(score), None, seconds)

    def _failed(self, error: str, t0: float) -> CallResult:
        self._stop()
        return CallResult(None, error, time.monotonic() - t0)

    def _read_line(self, proc: subprocess.Popen[bytes], deadline: float) -> bytes | None:
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    return None
                chunk = os.read(fd, 65536)
                if not chunk:
                    return None
                self._buffer += chunk
                if len(self._buffer) > MAX_ANSWER_BYTES and b"\n" not in self._buffer:
                    return None
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line


def _exit_reason(code: int | None, limits: SandboxLimits) -> str:
    if code is not None and code < 0:
        sig = -code
        if sig == signal.SIGXCPU:
            return f"CPU time limit ({limits.cpu_seconds} s) exceeded"
        if sig == signal.SIGXFSZ:
            return f"file size limit ({limits.file_bytes} bytes) exceeded"
        return f"the sandbox was killed by signal {signal.Signals(sig).name}"
    # bwrap reports its child's signal as exit code 128 + signal.
    if code is not None and code > 128 and code - 128 in (signal.SIGXCPU, signal.SIGKILL):
        if code - 128 == signal.SIGXCPU:
            return f"CPU time limit ({limits.cpu_seconds} s) exceeded"
        return "the sandbox was killed (out of memory?)"
    return f"the sandbox exited with code {code}"

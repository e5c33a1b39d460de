"""Start a process as an ordinary user, as the Docker image runs the API and the worker
(``USER ftune``): here uid 65534, which owns nothing on this machine. The tests run as root;
setpriv drops the child's uid, gid and groups before it executes anything."""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

USER = 65534
REPO = Path(__file__).resolve().parents[2]


def as_user(argv: list[str], uid: int = USER) -> list[str]:
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *argv]


def user_env(**extra: str) -> dict[str, str]:
    """A small environment: no secrets of the test process, no bytecode to write (the user
    may not write the source tree)."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "HF_HUB_OFFLINE": "1",
            "PYTHONDONTWRITEBYTECODE": "1", "LANG": "C.UTF-8", **extra}


class UnreachableForUser(RuntimeError):
    """The ordinary user cannot run the test's code: the message says which path and why."""


@functools.cache
def python() -> str:
    """An interpreter the ordinary user can run, with this venv's packages and this checkout.

    The venv's own ``sys.executable`` when the user may execute it. A venv made by pyenv (or
    any Python under a private home, /root being mode 700 on a fresh machine) links to an
    interpreter the user cannot reach; then a venv of the system's Python of the same
    version, outside any private directory, reads this venv's site-packages (same ABI, so
    its compiled extensions load) and, through its editable install, this checkout."""
    if _user_can_import(sys.executable):
        return sys.executable
    site = Path(sysconfig.get_paths()["purelib"])
    for path in (REPO, site):
        if not _user_can_list(path):
            raise UnreachableForUser(
                f"uid {USER} cannot enter {path} (a parent directory is private): the tests "
                "that run the service as an ordinary user need the checkout and its venv "
                "where others may traverse (e.g. not under a mode-700 home)")
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    system = next((p for p in (f"/usr/bin/{version}", f"/usr/local/bin/{version}")
                   if Path(p).is_file() and _user_can_import(p, bare=True)), None)
    if system is None:
        raise UnreachableForUser(
            f"uid {USER} cannot run {sys.executable} ({os.path.realpath(sys.executable)}), "
            f"and no system {version} it can run exists to stand in for it")
    tag = hashlib.sha256(str(site).encode()).hexdigest()[:12]
    venv = Path(f"/tmp/ftune-user-python-{tag}")
    interpreter = venv / "bin" / "python"
    if not interpreter.exists():
        # Made beside its final name and renamed into place: two test processes may ask at
        # once, and neither may see a half-made venv (a venv without scripts moves freely).
        draft = venv.with_name(f"{venv.name}.{os.getpid()}")
        subprocess.run([system, "-m", "venv", "--without-pip", str(draft)], check=True)
        user_site = Path(sysconfig.get_paths(vars={"base": str(draft),
                                                   "platbase": str(draft)})["purelib"])
        # A .pth line that starts with `import` runs: addsitedir also runs the .pth files
        # of the venv's site-packages (the editable install's finder among them).
        (user_site / "ftune-tests-venv.pth").write_text(
            f"import site; site.addsitedir({str(site)!r})\n")
        try:
            draft.rename(venv)
        except OSError:  # the other process's venv is in place: the same, keep it
            shutil.rmtree(draft)
    if not _user_can_import(str(interpreter)):
        raise UnreachableForUser(f"uid {USER} cannot import the service's packages with "
                                 f"{interpreter} (reading {site})")
    return str(interpreter)


def _user_can_import(interpreter: str, *, bare: bool = False) -> bool:
    # The interpreter runs itself again (as `ftune api` does, and a process started in a
    # user namespace of its own): a first exec through a path the user may not traverse
    # can succeed where every later one is refused.
    then = "pass" if bare else "import fastapi, core.infra.settings"
    code = f"import os, sys; os.execv(sys.executable, [sys.executable, '-c', {then!r}])"
    try:
        done = subprocess.run(as_user([interpreter, "-c", code]), check=False, cwd="/",
                              env=user_env(), capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def _user_can_list(path: Path) -> bool:
    done = subprocess.run(as_user(["ls", str(path)]), check=False, capture_output=True,
                          env=user_env())
    return done.returncode == 0


def give(path: Path, uid: int = USER) -> Path:
    """Make a test-made tree the user's (as the service's data directory is its own)."""
    for root, dirs, files in os.walk(path):
        os.chown(root, uid, uid)
        for name in dirs + files:
            os.chown(os.path.join(root, name), uid, uid)
    return path

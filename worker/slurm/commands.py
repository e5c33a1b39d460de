"""sbatch, squeue, scancel (and sacct where accounting is on), run as argv lists.

squeue --json (SLURM 22.05 and later) lists a job for MinJobAge after it ended, with its
final state; after that only sacct (slurmdbd) knows it, by id or by name, and the job
directory's exit file (worker/slurm/script.py) tells how the batch script ended. Both shapes
of the JSON are read: 22.05's ``"job_state": "RUNNING"`` / ``"exit_code": 0`` and the later
lists and objects.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

log = logging.getLogger(__name__)

TIMEOUT_SECONDS = 30
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")  # a job name that may go into sacct's --name list


class SlurmError(RuntimeError):
    """A SLURM command failed (the controller is unreachable, a bad option...).
    ``unreachable``: the controller did not answer, which a later try may change."""

    def __init__(self, message: str, *, unreachable: bool = False) -> None:
        super().__init__(message)
        self.unreachable = unreachable


# What SLURM's commands print when slurmctld does not answer (down, restarting, failing over,
# overloaded): src/common/slurm_errno.c's texts for SLURM_COMMUNICATIONS_*_ERROR,
# SLURMCTLD_COMMUNICATIONS_*_ERROR and ESLURM_*TIMED_OUT, and sbatch's EAGAIN answer.
_UNREACHABLE = re.compile(
    r"Unable to contact slurm controller|Socket timed out on send/recv|"
    r"Zero Bytes were transmitted or received|Slurm backup controller in standby mode|"
    r"Slurm temporarily unable to accept job|Communication connection failure|"
    r"Connection refused", re.IGNORECASE)


def _failed(what: str, done: subprocess.CompletedProcess[str]) -> SlurmError:
    err = done.stderr.strip()
    return SlurmError(f"{what} failed ({done.returncode}): {err[:2000]}",
                      unreachable=_UNREACHABLE.search(err) is not None)


@dataclass(frozen=True)
class SlurmJob:
    job_id: str
    name: str
    state: str
    reason: str | None = None
    nodes: str = ""
    exit_code: int | None = None
    time_limit_minutes: int | None = None  # as SLURM holds it; None: unlimited or not said


def _minutes(v: Any) -> int | None:
    """squeue's ``time_limit``: minutes, as a number (22.05) or ``{"set", "infinite",
    "number"}`` (later)."""
    if isinstance(v, dict):
        v = None if v.get("infinite") or not v.get("set", True) else v.get("number")
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _sacct_minutes(v: str) -> int | None:
    """sacct's ``Timelimit``: ``[days-]hours:minutes:seconds`` (or ``minutes:seconds``);
    UNLIMITED, Partition_Limit and blanks are None."""
    m = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", v.strip())
    if m is None:
        return None
    days, hours, minutes, seconds = (int(g or 0) for g in m.groups())
    total = days * 1440 + hours * 60 + minutes + (1 if seconds else 0)
    return total or None


def _first(v: Any) -> Any:
    return v[0] if isinstance(v, list) and v else v


def _exit_code(v: Any) -> int | None:
    if isinstance(v, dict):  # 23.02+: {"status": [...], "return_code": {"number": 0, ...}}
        v = v.get("return_code")
        if isinstance(v, dict):
            v = v.get("number")
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def parse_squeue_json(text: str) -> list[SlurmJob]:
    jobs = []
    for j in json.loads(text).get("jobs", []):
        jobs.append(SlurmJob(
            job_id=str(j.get("job_id")),
            name=str(j.get("name") or ""),
            state=str(_first(j.get("job_state")) or "UNKNOWN"),
            reason=j.get("state_reason") or None,
            nodes=str(j.get("nodes") or ""),
            exit_code=_exit_code(j.get("exit_code")),
            time_limit_minutes=_minutes(j.get("time_limit")),
        ))
    return jobs


def _run(argv: list[str], *, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_SECONDS,
                              env=dict(env) if env is not None else None, check=False)
    except subprocess.TimeoutExpired as e:  # a controller that hangs answers no better
        raise SlurmError(f"{argv[0]}: {e}", unreachable=True) from None
    except OSError as e:
        raise SlurmError(f"{argv[0]}: {e}") from None


def sbatch(argv: list[str], *, env: Mapping[str, str]) -> str:
    """Submit (``argv`` from script.sbatch_argv); returns the SLURM job id."""
    done = _run(argv, env=env)
    if done.returncode != 0:
        raise _failed("sbatch", done)
    job_id = done.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise SlurmError(f"sbatch printed no job id: {done.stdout.strip()[:200]!r}")
    return job_id


def squeue(job_id: str | None = None) -> list[SlurmJob]:
    """Jobs SLURM's controller still knows, finished ones included (for MinJobAge)."""
    argv = ["squeue", "--json", "--states=all"]
    if job_id is not None:
        argv += [f"--jobs={int(job_id)}"]
    done = _run(argv)
    if done.returncode != 0:
        if job_id is not None and "Invalid job id" in done.stderr:
            return []  # forgotten by the controller (older than MinJobAge)
        raise _failed("squeue", done)
    return parse_squeue_json(done.stdout)


def find(job_id: str) -> SlurmJob | None:
    found = [j for j in squeue(job_id) if j.job_id == str(job_id)]
    return found[0] if found else None


def newest_first(jobs: list[SlurmJob]) -> list[SlurmJob]:
    return sorted(jobs, key=lambda j: int(j.job_id) if j.job_id.isdigit() else 0, reverse=True)


def find_by_name_prefix(prefix: str) -> list[SlurmJob]:
    """Every job squeue knows whose name starts with ``prefix``, newest (highest id) first."""
    return newest_first([j for j in squeue() if j.name.startswith(prefix)])


def find_by_names(prefix: str, names: Sequence[str], since: datetime) -> list[SlurmJob]:
    """Every job named ``prefix...`` that squeue knows, newest first; where squeue knows
    none (it forgets an ended job MinJobAge after it ended), the ones accounting knows by
    the exact ``names``, submitted after ``since``."""
    return find_by_name_prefix(prefix) or newest_first(
        [j for j in sacct(names=names, since=since) or [] if j.name in names])


def parse_sacct(text: str) -> list[SlurmJob]:
    """``sacct --parsable2 --format=JobID,JobName,State,ExitCode,Timelimit`` lines: the
    state's first word ("CANCELLED by 0"), the exit code before the signal ("0:15")."""
    jobs = []
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) != 5 or not parts[0].isdigit() or not parts[2].strip():
            continue
        code = parts[3].split(":")[0]
        jobs.append(SlurmJob(parts[0], parts[1], parts[2].split()[0],
                             exit_code=int(code) if code.isdigit() else None,
                             time_limit_minutes=_sacct_minutes(parts[4])))
    return jobs


def sacct(*, job_ids: Sequence[str] = (), names: Sequence[str] = (),
          since: datetime | None = None) -> list[SlurmJob] | None:
    """Jobs accounting knows, by id or by exact name (``since``: submitted or run after
    it; sacct's own default is today only). None where there is no answer: no sacct, no
    slurmdbd (accounting off), or no reply in time; accounting only adds to squeue."""
    if shutil.which("sacct") is None:
        return None
    argv = ["sacct", "--noheader", "--allocations", "--parsable2",
            "--format=JobID,JobName,State,ExitCode,Timelimit"]
    if job_ids:
        argv.append("--jobs=" + ",".join(str(int(j)) for j in job_ids))
    if names:
        if not all(_NAME.fullmatch(n) for n in names):
            raise ValueError(f"job names {names!r}")
        argv.append("--name=" + ",".join(names))
    if since is not None:
        argv.append(f"--starttime={since.astimezone().strftime('%Y-%m-%dT%H:%M:%S')}")
    try:
        done = _run(argv)
    except SlurmError:
        log.warning("sacct gave no answer", exc_info=True)
        return None
    if done.returncode != 0:
        return None
    return parse_sacct(done.stdout)


def sacct_state(job_id: str) -> SlurmJob | None:
    """The job as accounting knows it, where slurmdbd runs; None where it does not."""
    found = [j for j in sacct(job_ids=[job_id]) or [] if j.job_id == str(job_id)]
    return found[0] if found else None


def scancel(job_id: str, *, signal: str | None = None) -> None:
    """Cancel the job, or with ``signal`` send it to the processes of every step on every
    node without cancelling. Not the batch shell (``--full``): bash dies of SIGTERM, and
    SLURM then kills the steps before the ranks have saved."""
    argv = ["scancel"]
    if signal is not None:
        if not signal.isalnum():
            raise ValueError(f"signal {signal!r}")
        argv += [f"--signal={signal}"]
    argv.append(str(int(job_id)))
    done = _run(argv)
    if done.returncode != 0:
        raise SlurmError(f"scancel failed ({done.returncode}): {done.stderr.strip()[:2000]}")

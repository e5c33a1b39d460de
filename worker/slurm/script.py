"""The batch script for one attempt of one job, and the sbatch argv that submits it.

Every value that reaches the script is either checked against an allowlist (names, numbers)
or passed through ``shlex.quote``; the only unquoted shell text is this module's own. The
per-node part (machine rank) is a constant ``bash -c`` program whose arguments are quoted
words, so no path or environment value is ever parsed by a shell.

A GRPO run's graders run beside the trainer, not inside it (core/run/grading_process.py),
as on the worker's own machine: a first step starts one grading process per node, in the
background, with the judge's key the batch script got from sbatch's environment; the script
then unsets the key and starts the trainer step, whose ranks find their node's grading
process at a socket in the node's temporary folder. The trainer's environment, and the job
directory, never hold the key.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from core.graders.config import JUDGE_KEY_ENV
from core.graders.service import SOCKET_ENV
from core.run.jobdir import ACCELERATE_FILE, SPEC_FILE

SCRIPT_FILE = "sbatch.sh"
EXIT_FILE = "slurm-exit.json"
JOB_NAME_PREFIX = "ftune-"

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]{0,127}")
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")

# Runs once per node under srun: the accelerate launcher with this node's rank. "$@" is the
# launcher argv (quoted words); SLURM_NODEID is set by srun on each node.
RANK_PROGRAM = 'exec "$@" --machine_rank "$SLURM_NODEID" -m "$FTUNE_TRAINER_MODULE" "$FTUNE_JOB_DIR"'
# Where a node's grading process listens: its own folder (made 0700 by the grading process)
# in the node's temporary folder, one per attempt (the job name), SLURM job and node: unique
# even where several clusters share a /tmp, as the test clusters do. Short: unix sockets
# allow ~100 bytes, and this is ~60 with /tmp. Both per-node programs compute the same path.
GRADING_SOCKET = '"${TMPDIR:-/tmp}/$SLURM_JOB_NAME-$SLURM_JOB_ID-$SLURM_NODEID/grading.sock"'
# The grading step's per-node program: "$@" is the grading process argv (quoted words).
GRADING_PROGRAM = f'exec "$@" {GRADING_SOCKET} "$FTUNE_JOB_DIR/{SPEC_FILE}"'
# The trainer step's, when the run grades beside it: where its ranks send their answers.
GRADED_RANK_PROGRAM = f'export {SOCKET_ENV}={GRADING_SOCKET}; {RANK_PROGRAM}'
GRADING_MODULE = "core.run.grading_process"


class ScriptError(ValueError):
    """A value that may not be written into a batch script."""


def job_name(job_id: str, attempt: int) -> str:
    """SLURM job name of one attempt: finds a submission again after a worker crash."""
    return f"{job_name_prefix(job_id)}{attempt}"


def job_name_prefix(job_id: str) -> str:
    return f"{JOB_NAME_PREFIX}{_checked(job_id, 'job id')}-a"


def attempt_of(name: str, job_id: str) -> int | None:
    prefix = job_name_prefix(job_id)
    tail = name[len(prefix):] if name.startswith(prefix) else ""
    return int(tail) if tail.isdigit() else None


@dataclass(frozen=True)
class BatchJob:
    """What one attempt asks SLURM for, and what each node runs."""

    job_id: str
    attempt: int
    job_dir: Path
    partition: str
    nodes: int
    processes_per_node: int
    time_minutes: int
    python: str  # the Python on the nodes
    trainer_module: str = "core.train"
    cpus_per_node: int = 1
    gpus_per_node: int = 0
    account: str | None = None
    qos: str | None = None
    rank_prefix: Sequence[str] = ()  # e.g. a container runtime's argv
    env: Mapping[str, str] = field(default_factory=dict)  # exported for the ranks
    grading: bool = False  # a grading process per node beside the trainer (GRPO)


def _checked(value: str, what: str) -> str:
    if not _NAME.fullmatch(value):
        raise ScriptError(f"{what} {value!r}: only letters, digits, '_', '-' and '.'")
    return value


def _positive(value: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ScriptError(f"{what} must be a non-negative integer, not {value!r}")
    return value


def directives(b: BatchJob) -> list[str]:
    """The sbatch options, each one word: ``--name=value`` with allowlisted values."""
    opts = [
        f"--job-name={job_name(b.job_id, _positive(b.attempt, 'attempt'))}",
        f"--partition={_checked(b.partition, 'partition')}",
        f"--nodes={max(1, _positive(b.nodes, 'nodes'))}",
        "--ntasks-per-node=1",  # one accelerate launcher per node; it starts the ranks
        f"--cpus-per-task={max(1, _positive(b.cpus_per_node, 'cpus per node'))}",
        f"--time={max(1, _positive(b.time_minutes, 'time limit'))}",
        "--no-requeue",  # a requeue is the service's: attempt counted, resumed from a checkpoint
        "--kill-on-invalid-dep=yes",
    ]
    if _positive(b.gpus_per_node, "gpus per node"):
        opts.append(f"--gpus-per-node={b.gpus_per_node}")
    if b.account is not None:
        opts.append(f"--account={_checked(b.account, 'account')}")
    if b.qos is not None:
        opts.append(f"--qos={_checked(b.qos, 'qos')}")
    return opts


def launcher_argv(b: BatchJob) -> list[str]:
    """The accelerate launcher each node runs, before its rank and the trainer module."""
    return [
        b.python, "-m", "accelerate.commands.launch",
        "--config_file", str(b.job_dir / ACCELERATE_FILE),
        "--num_machines", str(max(1, b.nodes)),
        "--num_processes", str(max(1, b.nodes) * max(1, b.processes_per_node)),
    ]


def render(b: BatchJob) -> str:
    """The batch script: directives, the ranks' environment, the main node's address, a
    port from the SLURM job id, one srun over all nodes, and the exit status written to the
    job directory (squeue forgets a finished job after MinJobAge)."""
    if not _MODULE.fullmatch(b.trainer_module):
        raise ScriptError(f"trainer module {b.trainer_module!r} is not a dotted name")
    q = shlex.quote
    jd = str(b.job_dir)
    lines = ["#!/bin/bash"]
    lines += [f"#SBATCH {opt}" for opt in directives(b)]
    lines += [
        "# Generated by ftune (worker/slurm/script.py): one accelerate launcher per node.",
        "set -uo pipefail",
    ]
    env = {**b.env, "FTUNE_JOB_DIR": jd, "FTUNE_TRAINER_MODULE": b.trainer_module}
    for name in sorted(env):
        if not _ENV_NAME.fullmatch(name):
            raise ScriptError(f"environment variable name {name!r} is not allowed")
        lines.append(f"export {name}={q(str(env[name]))}")
    lines += [
        f"cd {q(jd)} || exit 1",
        'MAIN_IP=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        # Unique among jobs sharing a node, known to every node without talking.
        "MAIN_PORT=$((20000 + SLURM_JOB_ID % 20000))",
    ]
    nodes = f"--nodes={max(1, b.nodes)}"
    rank_program = RANK_PROGRAM
    if b.grading:
        # In the background for the whole run; --overlap: it shares the allocation's CPUs,
        # memory and GPUs with the trainer step (srun(1)) instead of holding them.
        grading = ["srun", nodes, "--ntasks-per-node=1", "--overlap",
                   f"--output={b.job_dir / 'grading-%N.log'}", "--open-mode=append",
                   *b.rank_prefix, "/bin/bash", "-c", GRADING_PROGRAM, "ftune-grading",
                   b.python, "-m", GRADING_MODULE]
        lines += [" ".join(q(w) for w in grading) + " &",
                  "GRADING_PID=$!",
                  f"unset {JUDGE_KEY_ENV}  # the trainer step's environment is without it"]
        rank_program = GRADED_RANK_PROGRAM
    srun = ["srun", nodes, "--ntasks-per-node=1", "--kill-on-bad-exit=1",
            *b.rank_prefix, "/bin/bash", "-c", rank_program, "ftune-rank", *launcher_argv(b)]
    lines.append(" ".join(q(w) for w in srun)
                 + ' --main_process_ip "$MAIN_IP" --main_process_port "$MAIN_PORT"')
    lines.append("rc=$?")
    if b.grading:
        # srun forwards SIGUSR1 to the grading processes (a SIGTERM it turns into SIGKILL):
        # they remove their sockets and end, their trainers gone.
        lines.append('kill -USR1 "$GRADING_PID" 2>/dev/null; wait "$GRADING_PID"')
    lines += [
        "printf '{\"returncode\": %d, \"slurm_job_id\": \"%s\"}\\n' \"$rc\" \"$SLURM_JOB_ID\" > "
        + q(str(b.job_dir / EXIT_FILE)),
        'exit "$rc"',
        "",
    ]
    return "\n".join(lines)


def sbatch_argv(b: BatchJob, script: Path) -> list[str]:
    """Submit ``script``: --parsable prints the SLURM job id; --output and --chdir as words
    here too (a #SBATCH line cannot hold a path with spaces)."""
    return ["sbatch", "--parsable", f"--output={b.job_dir / 'trainer.log'}",
            f"--chdir={b.job_dir}", str(script)]

"""The batch script builder (worker/slurm/script.py): allowlisted names, quoted words.

The quoting tests run the rendered script with bash, with ``srun`` and ``scontrol`` on PATH
replaced by scripts that record the words they receive: what matters is exactly which words
reach srun, whatever the paths and values hold. The real srun runs it in
tests/e2e/test_slurm.py."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from worker.slurm.script import (
    GRADED_RANK_PROGRAM,
    GRADING_PROGRAM,
    RANK_PROGRAM,
    BatchJob,
    ScriptError,
    attempt_of,
    directives,
    job_name,
    job_name_prefix,
    render,
    sbatch_argv,
)

HOSTILE = "/tmp/a dir/$(touch pwned)/`id`;'x'\"y\"\n#z"


def batch(tmp: Path, **over: object) -> BatchJob:
    fields: dict = {"job_id": "job_abc123", "attempt": 2, "job_dir": tmp / "job_abc123",
                    "partition": "debug", "nodes": 2, "processes_per_node": 1,
                    "time_minutes": 3, "python": "/opt/venv/bin/python", "cpus_per_node": 2}
    fields.update(over)
    return BatchJob(**fields)


def test_directives_carry_the_request() -> None:
    b = batch(Path("/shared"), gpus_per_node=8, account="team-a", qos="high")
    assert directives(b) == [
        "--job-name=ftune-job_abc123-a2", "--partition=debug", "--nodes=2",
        "--ntasks-per-node=1", "--cpus-per-task=2", "--time=3", "--no-requeue",
        "--kill-on-invalid-dep=yes", "--gpus-per-node=8", "--account=team-a", "--qos=high",
    ]


@pytest.mark.parametrize("field,value", [
    ("partition", "debug --wrap=rm"), ("account", "a;b"), ("qos", "$(x)"),
    ("job_id", "job x"), ("partition", ""),
])
def test_names_outside_the_allowlist_are_refused(field: str, value: str) -> None:
    with pytest.raises(ScriptError):
        render(batch(Path("/shared"), **{field: value}))


def test_env_names_and_module_are_checked() -> None:
    with pytest.raises(ScriptError):
        render(batch(Path("/shared"), env={"BAD-NAME": "1"}))
    with pytest.raises(ScriptError):
        render(batch(Path("/shared"), trainer_module="core.train; rm -rf /"))


def test_job_names_round_trip() -> None:
    assert job_name("job_abc", 3) == "ftune-job_abc-a3"
    assert attempt_of("ftune-job_abc-a3", "job_abc") == 3
    assert attempt_of("ftune-job_abcd-a3", "job_abc") is None
    assert job_name_prefix("job_abc") == "ftune-job_abc-a"


def _recorder(bin_dir: Path, name: str, body: str) -> None:
    p = bin_dir / name
    p.write_text("#!/bin/bash\n" + body)
    p.chmod(p.stat().st_mode | stat.S_IEXEC)


def test_hostile_values_reach_srun_as_the_same_words(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "srun.json"
    # srun: record argv; then run the per-node program as srun would on node 1.
    _recorder(bin_dir, "srun", f"""
/usr/bin/python3 -c 'import json,sys; json.dump(sys.argv[1:], open(sys.argv[0] and "{record}", "w"))' "$@"
""")
    _recorder(bin_dir, "scontrol", 'echo n7; echo n8\n')
    job_dir = tmp_path / "shared root" / "job_abc123"
    job_dir.mkdir(parents=True)
    b = batch(tmp_path, job_dir=job_dir, python=HOSTILE,
              rank_prefix=("apptainer", "exec", HOSTILE),
              env={"HF_HOME": HOSTILE, "OMP_NUM_THREADS": "1"})
    text = render(b)
    script = job_dir / "sbatch.sh"
    script.write_text(text)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "n[7-8]",
           "SLURM_JOB_ID": "4242", "HOME": str(tmp_path)}
    done = subprocess.run(["bash", str(script)], check=False, cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "pwned").exists() and not Path("pwned").exists()
    words = json.loads(record.read_text())
    assert words == [
        "--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
        "apptainer", "exec", HOSTILE, "/bin/bash", "-c", RANK_PROGRAM, "ftune-rank",
        HOSTILE, "-m", "accelerate.commands.launch", "--config_file",
        str(job_dir / "accelerate.yaml"), "--num_machines", "2", "--num_processes", "2",
        "--main_process_ip", "n7", "--main_process_port", str(20000 + 4242 % 20000),
    ]
    assert json.loads((job_dir / "slurm-exit.json").read_text()) == {
        "returncode": 0, "slurm_job_id": "4242"}


def test_the_rank_program_adds_the_node_rank_and_trainer(tmp_path: Path) -> None:
    # What srun runs on each node: the launcher argv, then this node's rank and the module.
    out = subprocess.run(
        ["/bin/bash", "-c", RANK_PROGRAM, "ftune-rank", "/usr/bin/printf", "%s\\n", HOSTILE],
        env={"SLURM_NODEID": "1", "FTUNE_TRAINER_MODULE": "core.train",
             "FTUNE_JOB_DIR": "/shared/a b"}, capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:-1] == [*HOSTILE.split("\n"), "--machine_rank", "1", "-m",
                                           "core.train", "/shared/a b"]


def test_env_values_are_exported_verbatim(tmp_path: Path) -> None:
    b = batch(tmp_path, env={"HF_HOME": HOSTILE})
    head = render(b).split("\ncd ")[0]  # directives and exports, up to the srun part
    probe = head + '\nprintf %s "$HF_HOME"'
    got = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, check=True)
    assert got.stdout == HOSTILE


def test_sbatch_argv_is_words() -> None:
    b = batch(Path("/shared root"))
    assert sbatch_argv(b, Path("/shared root/job_abc123/sbatch.sh")) == [
        "sbatch", "--parsable", "--output=/shared root/job_abc123/trainer.log",
        "--chdir=/shared root/job_abc123", "/shared root/job_abc123/sbatch.sh"]


def test_a_grading_run_starts_the_grading_step_with_the_key_and_the_trainer_step_without(
        tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "srun.jsonl"
    # srun: record its argv and whether the judge's key is in its environment.
    _recorder(bin_dir, "srun", f"""
/usr/bin/python3 -c 'import json,os,sys; print(json.dumps([sys.argv[1:], "FTUNE_GRADER_JUDGE_API_KEY" in os.environ]), file=open("{calls}", "a"))' "$@"
""")
    _recorder(bin_dir, "scontrol", 'echo n7; echo n8\n')
    job_dir = tmp_path / "shared root" / "job_abc123"
    job_dir.mkdir(parents=True)
    script = job_dir / "sbatch.sh"
    script.write_text(render(batch(tmp_path, job_dir=job_dir, python=HOSTILE, grading=True)))
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "n[7-8]",
           "SLURM_JOB_ID": "4242", "HOME": str(tmp_path), "FTUNE_GRADER_JUDGE_API_KEY": "sk-j"}
    done = subprocess.run(["bash", str(script)], check=False, cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    grading, trainer = sorted((json.loads(line) for line in calls.read_text().splitlines()),
                              key=lambda call: GRADING_PROGRAM not in call[0])
    assert grading == [[
        "--nodes=2", "--ntasks-per-node=1", "--overlap",
        f"--output={job_dir / 'grading-%N.log'}", "--open-mode=append",
        "/bin/bash", "-c", GRADING_PROGRAM, "ftune-grading", HOSTILE, "-m",
        "core.run.grading_process"], True]
    assert trainer[0][:6] == ["--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
                              "/bin/bash", "-c", GRADED_RANK_PROGRAM]
    assert trainer[1] is False  # the trainer step's environment has no judge key
    assert "sk-j" not in script.read_text()


def test_the_grading_and_rank_programs_agree_on_the_nodes_socket(tmp_path: Path) -> None:
    env = {"SLURM_NODEID": "1", "SLURM_JOB_ID": "77", "SLURM_JOB_NAME": "ftune-job_abc-a2",
           "TMPDIR": str(tmp_path),
           "FTUNE_TRAINER_MODULE": "core.train", "FTUNE_JOB_DIR": "/shared/a b"}
    grading = subprocess.run(["/bin/bash", "-c", GRADING_PROGRAM, "ftune-grading",
                              "/usr/bin/printf", "%s\\n"], env=env, capture_output=True,
                             text=True, check=True).stdout.split("\n")[:-1]
    rank = subprocess.run(["/bin/bash", "-c", GRADED_RANK_PROGRAM, "ftune-rank", "/bin/bash",
                           "-c", 'printf "%s\\n" "$FTUNE_GRADING_SOCKET" "$@"', "launcher"],
                          env=env, capture_output=True, text=True, check=True).stdout.split("\n")
    socket = str(tmp_path / "ftune-job_abc-a2-77-1" / "grading.sock")
    assert grading == [socket, "/shared/a b/spec.json"]
    assert rank[:5] == [socket, "--machine_rank", "1", "-m", "core.train"]

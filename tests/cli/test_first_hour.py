"""The first hour of a new user (issue 26): the real `ftune` command against a real
`ftune up`, from the user's own directory, output piped as a script would have it. Each test
is one rough edge a user met, asserted on the exit status and the text the user reads."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from core.infra.ports import free_port
from tests.utils.cli import Up, assert_no_traceback, ftune, user_env
from tests.utils.tiny import sentences, write_jsonl

# A real `ftune up` (uvicorn, a Celery worker, accelerate launch): the full suite's, not test-fast's.
pytestmark = pytest.mark.e2e


def spec_file(home: Path, model: Path | str, name: str = "spec.yaml", **dataset: Any) -> Path:
    body = {
        "name": "first hour",
        "model": {"name_or_path": str(model)},
        "dataset": {"format": "text", "max_seq_length": 64, **dataset},
        "peft": {"method": "lora", "r": 4, "target_modules": "all-linear"},
        "training": {"max_steps": 2, "per_device_train_batch_size": 4, "logging_steps": 1,
                     "save_steps": 2},
    }
    path = home / name
    path.write_text(yaml.safe_dump(body))
    return path


@pytest.fixture(scope="module")
def data(up: Up) -> Path:
    return write_jsonl(up.home / "train.jsonl", [{"text": s} for s in sentences(16, seed=3)])


@pytest.fixture(scope="module")
def own_model(up: Up, tiny_causal_lm: Path) -> Path:
    """The user's model, in a directory nobody configured as a root."""
    import shutil

    dest = up.home / "my-models" / "llama"
    shutil.copytree(tiny_causal_lm, dest)
    return dest


@pytest.fixture(scope="module")
def job(up: Up, own_model: Path, data: Path) -> dict[str, Any]:
    """`ftune submit spec.yaml --train data.jsonl` followed to the end: a local model
    directory, accepted by `ftune up` as it is."""
    result = up.run("submit", str(spec_file(up.home, own_model)), "--train", str(data))
    assert result.returncode == 0, result.stderr[-3000:]
    job_id = result.stdout.strip().splitlines()[0]
    with up.http() as c:
        job = c.get(f"/v1/jobs/{job_id}").json()
        events = c.get(f"/v1/jobs/{job_id}/events", params={"limit": 1000}).json()["data"]
    return {"result": result, "job": job, "events": events}


def file_ids(up: Up) -> set[str]:
    with up.http() as c:
        return {f["id"] for f in c.get("/v1/files").json()["data"]}


# ------------------------------------------------------------------ `ftune up` and the CLI


def test_up_says_which_model_and_data_paths_it_accepts_and_where_logs_are(up: Up) -> None:
    text = up.output.read_text()
    assert "model directories: any local directory (set FTUNE_ALLOWED_MODEL_ROOTS" in text
    assert "dataset paths: any local directory" in text
    assert f"logs (JSON lines): {up.home / '.ftune' / 'logs'}/api.log" in text


def test_a_local_model_directory_trains_under_ftune_up(job: dict[str, Any]) -> None:
    assert job["job"]["status"] == "succeeded", job["job"].get("error")
    assert_no_traceback(job["result"])


def test_a_cpu_run_counts_process_seconds_not_gpu_seconds(job: dict[str, Any]) -> None:
    stderr = job["result"].stderr
    assert "CPU process-seconds over 1 attempt(s)" in stderr, stderr[-2000:]
    assert "GPU-seconds" not in stderr


def test_the_cli_finds_the_server_ftune_up_started_without_url_or_key(
    up: Up, job: dict[str, Any]
) -> None:
    result = up.run("list")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0].split("\t") == ["id", "name", "status", "step", "loss",
                                                          "created"]


def test_piped_list_prints_whole_ids_one_job_a_line(up: Up, job: dict[str, Any]) -> None:
    result = up.run("list")
    rows = [line.split("\t") for line in result.stdout.splitlines()[1:]]
    assert [job["job"]["id"], "first hour", "succeeded", "2/2"] in [r[:4] for r in rows]


def test_piped_logs_are_the_log_lines_as_written(up: Up, job: dict[str, Any]) -> None:
    job_id = job["job"]["id"]
    with up.http() as c:
        lines = c.get(f"/v1/jobs/{job_id}/logs", params={"tail": 50}).json()["lines"]
    result = up.run("logs", job_id, "--tail", "50")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == lines
    assert any(len(line) > 80 for line in lines)  # none was cut or wrapped at 80 columns


def test_trainer_log_is_json_lines_with_the_job_id(up: Up, job: dict[str, Any]) -> None:
    job_id = job["job"]["id"]
    log = (up.home / ".ftune" / "jobs" / job_id / "trainer.log").read_text()
    ours = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    assert any(r["logger"] == "core.train" and r["message"].startswith("step 2:") for r in ours)
    assert all(r.get("job_id") == job_id for r in ours)
    # What a 2-step job's log held that a user has no use for.
    for noise in ("is_gradient_checkpointing", "Setting accelerator", "new PAD/BOS/EOS",
                  "{'loss'"):
        assert noise not in log, noise


def test_worker_log_is_json_lines(up: Up, job: dict[str, Any]) -> None:
    log = (up.home / ".ftune" / "logs" / "worker0.log").read_text()
    records = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    assert any(r.get("job_id") == job["job"]["id"] for r in records)
    text = [line for line in log.splitlines() if line.strip() and not line.startswith("{")]
    # Only what Python prints before any logging exists (Celery's warning to root) remains.
    assert not [line for line in text if "celery@" in line or "[tasks]" in line], text[:20]


def test_the_job_passes_through_its_phases_before_the_first_step(job: dict[str, Any]) -> None:
    events = job["events"]
    phases = [e["data"]["phase"] for e in events if e["type"] == "phase"]
    assert phases[0] == "preparing_data" and phases[-1] == "preparing_run", phases
    assert "loading_model" in phases
    loaded = [e for e in events if e["type"] == "phase" and e["data"].get("loaded")]
    assert loaded[-1]["message"] == (f"loading model: {loaded[-1]['data']['total']} of "
                                     f"{loaded[-1]['data']['total']} tensors (1 shard file)")
    started = next(i for i, e in enumerate(events) if e["type"] == "started")
    assert all(i < started for i, e in enumerate(events) if e["type"] == "phase")
    assert job["job"]["phase"] is None  # ended: no phase


# ------------------------------------------------------------------ errors, said readably


def test_a_refused_submit_says_why_and_deletes_what_it_uploaded(
    up: Up, own_model: Path, data: Path
) -> None:
    before = file_ids(up)
    bad = spec_file(up.home, own_model, "bad.yaml", max_seq_length=100000)
    result = up.run("submit", str(bad), "--train", str(data))
    assert result.returncode == 1
    assert_no_traceback(result)
    assert "error 422 invalid_spec" in result.stderr
    assert ("dataset.max_seq_length: 100000 is more than the model allows: 4 x the 512 rotary "
            "positions it was trained on (max_position_embeddings in its config.json); use at "
            "most 2048") in result.stderr
    assert file_ids(up) == before


def test_estimate_on_the_server_leaves_no_upload_behind(up: Up, own_model: Path, data: Path
                                                         ) -> None:
    before = file_ids(up)
    result = up.run("estimate", str(spec_file(up.home, own_model)), "--server", "--train",
                    str(data))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "optimizer steps" in result.stdout and "tokens per epoch" in result.stdout
    assert file_ids(up) == before


def test_a_file_with_bad_rows_names_every_one(up: Up, own_model: Path) -> None:
    lines = [json.dumps({"text": s}) for s in sentences(40, seed=4)]
    for row in (6, 19, 33):
        lines[row - 1] = '{"text": "unterminated'
    path = up.home / "broken.jsonl"
    path.write_text("\n".join(lines) + "\n")
    result = up.run("submit", str(spec_file(up.home, own_model)), "--train", str(path))
    assert result.returncode == 1
    assert_no_traceback(result)
    assert "3 of 40 rows are not JSON objects: row 6: not valid JSON" in result.stderr
    assert "row 19: " in result.stderr and "row 33: " in result.stderr


def test_many_problems_are_listed_up_to_ten_then_counted(up: Up, own_model: Path, data: Path
                                                         ) -> None:
    path = spec_file(up.home, own_model, "many.yaml")
    body = yaml.safe_load(path.read_text())
    body["training"] = {"learning_rate": -1, "weight_decay": -1, "max_grad_norm": -1,
                        "per_device_train_batch_size": 0, "gradient_accumulation_steps": 0,
                        "num_train_epochs": -1, "logging_steps": 0, "save_steps": 0,
                        "max_steps": -5, "warmup_ratio": 7}
    body["peft"].update(r=0, lora_alpha=0, lora_dropout=3)
    path.write_text(yaml.safe_dump(body))
    result = up.run("submit", str(path), "--train", str(data))
    assert result.returncode == 1
    assert_no_traceback(result)
    listed = [line for line in result.stderr.splitlines() if line.startswith("  - ")]
    assert len(listed) == 10, result.stderr
    assert listed[0].startswith("  - training.learning_rate: ") or "peft." in listed[0]
    assert re.search(r"^  \.\.\. and \d+ more$", result.stderr, re.MULTILINE), result.stderr


def test_a_missing_train_file_is_one_line_not_a_traceback(up: Up, own_model: Path) -> None:
    result = up.run("submit", str(spec_file(up.home, own_model)), "--train", "nope.jsonl")
    assert result.returncode == 2
    assert_no_traceback(result)
    assert "nope.jsonl" in result.stderr and "does not exist" in result.stderr


def test_a_wrong_key_says_so_in_one_line(up: Up) -> None:
    result = up.run("list", FTUNE_API_KEY="ft_not-a-key-of-this-server")
    assert result.returncode == 1
    assert_no_traceback(result)
    assert "refused the API key (401" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_server_that_is_not_there_is_one_line(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    result = ftune("status", "job-x", cwd=tmp_path,
                   env=user_env(FTUNE_URL=url, FTUNE_API_KEY="ft_whatever-key"))
    assert result.returncode == 1
    assert_no_traceback(result)
    assert result.stderr.strip() == (
        f"cannot reach the ftune API at {url} (connection refused): start it with `ftune up`,"
        " or point --url / FTUNE_URL at the server")


def test_estimate_needs_no_data_and_prints_no_library_warnings(
    tmp_path: Path, tiny_causal_lm: Path
) -> None:
    result = ftune("estimate", str(spec_file(tmp_path, tiny_causal_lm)), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "optimizer steps" in result.stdout and "2" in result.stdout
    assert "Warning" not in result.stderr and "WARNING" not in result.stderr, result.stderr


# ------------------------------------------------------------------ the hub, out of reach


def test_a_hub_model_on_a_machine_without_the_hub_is_refused_at_submit(up: Up, data: Path
                                                                       ) -> None:
    before = file_ids(up)
    result = up.run("submit", str(spec_file(up.home, "someorg/some-model")), "--train", str(data))
    assert result.returncode == 1
    assert_no_traceback(result)
    assert f"the model hub ({'http://hub.invalid'}) cannot be reached" in result.stderr
    assert "give a model directory" in result.stderr and "hf download" in result.stderr
    assert file_ids(up) == before


def test_doctor_shows_settings_and_each_problem_with_its_fix(up: Up) -> None:
    result = up.run("doctor")
    assert result.returncode == 1  # the hub is out of reach
    assert_no_traceback(result)
    out = result.stdout
    assert "HF_ENDPOINT" in out and "FTUNE_HUB_CHECK" in out
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("PROBLEM model hub: "))
    assert "http://hub.invalid not reachable: name lookup of hub.invalid failed" in lines[at]
    assert lines[at + 1].startswith("        fix: use model directories")
    assert "HF_HUB_OFFLINE=1" in lines[at + 1]
    for name in ("database", "broker", "API", "GPUs / CPUs", "model directories"):
        assert any(line.startswith(f"ok      {name}: ") for line in lines), (name, out)
    assert up.url in out and "CPU cores" in out
    assert "ok      python graders: off (FTUNE_PYTHON_GRADERS=false); the sandbox works here" \
        in lines


def test_doctor_starts_a_sandbox_for_python_graders(up: Up, tmp_path: Path) -> None:
    on = up.run("doctor", FTUNE_PYTHON_GRADERS="true")
    assert "ok      python graders: on: a sandbox started and graded here" in on.stdout

    # The same switch on a host without bubblewrap: a problem naming it, with the fix.
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("prlimit", "setpriv"):
        (tools / tool).symlink_to(f"/usr/bin/{tool}")
    off = up.run("doctor", FTUNE_PYTHON_GRADERS="true", PATH=str(tools))
    assert_no_traceback(off)
    lines = off.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("PROBLEM python graders: "))
    assert "apt-get install bubblewrap" in " ".join(lines[at:at + 3])

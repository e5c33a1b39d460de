"""The OpenAI fine-tuning API, driven by the official `openai` SDK over HTTP against the real
stack (uvicorn, a Celery worker, `accelerate launch`): code written for OpenAI moves by
changing base_url. Objects are checked with the SDK's own types in strict mode (they do not
validate by default: a wrong shape would come back half-empty, silently).

Real training (tiny Llama, two steps) for the supervised, DPO and reinforcement jobs; jobs whose suffix (the
spec's name) is ``fake:<mode>`` run the fake trainer (testkit/fake_trainer.py), for list,
cancel, pause and the rate limit."""

from __future__ import annotations

import csv
import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types import FileDeleted, FileObject, Model
from openai.types.fine_tuning import FineTuningJob, FineTuningJobEvent
from openai.types.fine_tuning.jobs import FineTuningJobCheckpoint

from client import FtuneClient
from testkit.faultstack import FaultStack
from testkit.wait import wait_until
from tests.utils.receiver import Receiver
from tests.utils.tiny import chat_rows, openai_dpo_rows, reinforcement_rows, write_jsonl

pytestmark = pytest.mark.e2e

MODEL = "tiny-llama"
TERMINAL = ("succeeded", "failed", "cancelled")
# The SDK's FineTuningJob.status literal (openai 3.51) has no "pausing" or "paused", which
# OpenAI's API reports (jobs.pause/resume); such objects are checked with the status set aside.
SDK_STATUSES = ("validating_files", "queued", "running", "succeeded", "failed", "cancelled")
RATE_LIMIT = 14


def strict_job(job: Any) -> FineTuningJob:
    raw = job.to_dict() if hasattr(job, "to_dict") else dict(job)
    if raw["status"] not in SDK_STATUSES:
        raw = {**raw, "status": "running"}
    return FineTuningJob.model_validate(raw, strict=True)


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    r = Receiver().start()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, models_dir: Path,
          tiny_causal_lm: Path) -> Iterator[FaultStack]:
    data_dir = tmp_path_factory.mktemp("openai")
    catalog = {MODEL: {"location": str(tiny_causal_lm), "max_seq_length": 48,
                       "learning_rate": 3e-3,
                       "peft": {"method": "lora", "r": 4, "lora_alpha": 8,
                                "target_modules": "all-linear"}}}
    st = FaultStack(
        data_dir=data_dir,
        workers=2,
        env_overrides={
            "DATABASE_URL": f"sqlite:///{data_dir / 'ftune.db'}",
            "BROKER_URL": "filesystem://",
            "FTUNE_ALLOWED_MODEL_ROOTS": str(models_dir),
            "FTUNE_MODEL_CATALOG": json.dumps(catalog),
            "FTUNE_TRAINER_MODULE": "testkit.fake_trainer",
            "FTUNE_WORKER_GPUS": "0",
            "FTUNE_HEARTBEAT_SECONDS": "0.5",
            "FTUNE_CANCEL_GRACE_SECONDS": "5",
            "FTUNE_JOBS_PER_MINUTE_PER_TENANT": str(RATE_LIMIT),
            "FAKE_STEP_SECONDS": "0.5",
            "FTUNE_WEBHOOK_ALLOWED_NETWORKS": "127.0.0.1/32",
            "FTUNE_WEBHOOK_ALLOW_HTTP": "true",
            "FTUNE_WEBHOOK_POLL_SECONDS": "0.05",
            "FTUNE_WEBHOOK_RETRY_BASE_SECONDS": "0.05",
        },
    )
    st.start()
    yield st
    st.stop()


@pytest.fixture(scope="module")
def hook(stack: FaultStack, receiver: Receiver) -> dict[str, Any]:
    """Registered before any job runs: OpenAI's event names, OpenAI's payloads."""
    with FtuneClient(stack.url, stack.api_key) as c:
        return c.create_webhook(receiver.url, event_types=[
            "fine_tuning.job.succeeded", "fine_tuning.job.failed", "fine_tuning.job.cancelled"])


@pytest.fixture(scope="module")
def client(stack: FaultStack, hook: dict[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.api_key, max_retries=0)


@pytest.fixture(scope="module")
def ours(stack: FaultStack) -> Iterator[FtuneClient]:
    with FtuneClient(stack.url, stack.api_key) as c:
        yield c


def upload(client: openai.OpenAI, path: Path) -> FileObject:
    with open(path, "rb") as f:
        created = client.files.create(file=f, purpose="fine-tune")
    return FileObject.model_validate(created.to_dict(), strict=True)


def wait(client: openai.OpenAI, job_id: str, until: tuple[str, ...] = TERMINAL,
         timeout: float = 300) -> Any:
    return wait_until(lambda: (job := client.fine_tuning.jobs.retrieve(job_id)).status in until
                      and job, timeout, f"job {job_id} to be {'/'.join(until)}", every=0.3)


@pytest.fixture(scope="module")
def chat_file(client: openai.OpenAI, tmp_path_factory: pytest.TempPathFactory) -> FileObject:
    return upload(client, write_jsonl(tmp_path_factory.mktemp("chat") / "chat.jsonl",
                                      chat_rows(8)))


@pytest.fixture(scope="module")
def real_jobs(client: openai.OpenAI, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The real jobs, submitted together so that the two workers train them side by
    side: supervised (8 chat rows, one with a weight-0 assistant turn, batch 4, one epoch:
    two steps) and DPO (the same on 8 rows in OpenAI's DPO layout); then reinforcement (4
    prompts, 2 a step with 2 answers each, one epoch: two steps), run when a worker is free.
    Their formats are detected from the rows."""
    weighted = {"messages": [{"role": "user", "content": "hi"},
                             {"role": "assistant", "content": "no", "weight": 0},
                             {"role": "user", "content": "again"},
                             {"role": "assistant", "content": "ok", "weight": 1}]}
    train = upload(client, write_jsonl(tmp_path_factory.mktemp("sft") / "sft.jsonl",
                                       [*chat_rows(7), weighted]))
    supervised = client.fine_tuning.jobs.create(
        model=MODEL, training_file=train.id, seed=7, metadata={"team": "search"},
        suffix="support-bot",
        method={"type": "supervised",
                "supervised": {"hyperparameters": {"n_epochs": 1, "batch_size": 4}}})
    assert strict_job(supervised).status == "queued"
    prefs = upload(client, write_jsonl(tmp_path_factory.mktemp("prefs") / "prefs.jsonl",
                                       openai_dpo_rows(8)))
    dpo = client.fine_tuning.jobs.create(
        model=MODEL, training_file=prefs.id, suffix="prefs",
        method={"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.2, "n_epochs": 1,
                                                          "batch_size": 4}}})
    prompts = upload(client, write_jsonl(tmp_path_factory.mktemp("rl") / "rl.jsonl",
                                         reinforcement_rows(4)))
    rl = client.fine_tuning.jobs.create(
        model=MODEL, training_file=prompts.id, suffix="rl",
        method={"type": "reinforcement", "reinforcement": {
            # A graded reward (not string_check's 0/1): two answers of a random tiny model
            # nearly always tie on 0/1, which leaves nothing to learn (and an all-zero
            # adapter fails verification).
            "grader": {"type": "text_similarity", "name": "animal",
                       "input": "{{sample.output_text}}", "reference": "{{item.animal}}",
                       "evaluation_metric": "fuzzy_match"},
            "hyperparameters": {"n_epochs": 1, "batch_size": 2, "compute_multiplier": 0.25}}})
    return {"supervised": supervised.id, "dpo": dpo.id, "reinforcement": rl.id}


@pytest.fixture(scope="module")
def supervised(client: openai.OpenAI, real_jobs: dict[str, str]) -> FineTuningJob:
    return strict_job(wait(client, real_jobs["supervised"]))


def test_files_create_retrieve_list_content_delete(client: openai.OpenAI,
                                                   tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "train.jsonl", chat_rows(4))
    f = upload(client, path)
    assert (f.object, f.purpose, f.status, f.filename) == ("file", "fine-tune", "processed",
                                                           "train.jsonl")
    assert f.bytes == path.stat().st_size and abs(f.created_at - time.time()) < 120
    # ftune's extra field, kept by the SDK's FileObject (its models allow extra keys).
    assert (f.model_extra or {})["detected"]["layout"] == "openai_chat"
    again = FileObject.model_validate(client.files.retrieve(f.id).to_dict(), strict=True)
    assert again == f
    assert f.id in [x.id for x in client.files.list(limit=1)]  # auto-paging, a page at a time
    assert client.files.content(f.id).read() == path.read_bytes()
    deleted = FileDeleted.model_validate(client.files.delete(f.id).to_dict(), strict=True)
    assert (deleted.id, deleted.deleted, deleted.object) == (f.id, True, "file")
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)


def test_a_supervised_job_succeeds(client: openai.OpenAI, supervised: FineTuningJob,
                                   ours: FtuneClient) -> None:
    job = supervised
    assert job.status == "succeeded", job.error
    assert job.object == "fine_tuning.job" and job.model == MODEL
    assert job.seed == 7 and ours.get_job(job.id)["data"]["format"] == "chat"
    assert job.metadata == {"team": "search"}
    assert job.fine_tuned_model is not None and job.fine_tuned_model.startswith(f"ft:{MODEL}:")
    assert job.fine_tuned_model.endswith(f":support-bot:{job.id}")
    assert job.trained_tokens is not None and job.trained_tokens > 0
    assert job.finished_at is not None and job.finished_at >= job.created_at
    # "auto" resolved to numbers, the same under method and the legacy field.
    assert job.hyperparameters.model_dump() == {"batch_size": 4, "n_epochs": 1,
                                                "learning_rate_multiplier": 1.0}
    assert job.method is not None and job.method.type == "supervised"
    assert job.method.supervised is not None
    assert job.method.supervised.hyperparameters.model_dump() == job.hyperparameters.model_dump()


def test_events_say_the_metrics_of_each_step(client: openai.OpenAI,
                                             supervised: FineTuningJob) -> None:
    events = [FineTuningJobEvent.model_validate(e.to_dict(), strict=True)
              for e in client.fine_tuning.jobs.list_events(supervised.id, limit=2)]
    assert len({e.id for e in events}) == len(events) > 2  # auto-paging over pages of 2
    assert [e.created_at for e in events] == sorted((e.created_at for e in events),
                                                    reverse=True)
    metrics = [e for e in events if e.type == "metrics"]
    assert sorted(e.data["step"] for e in metrics) == [1, 2]  # type: ignore[index]
    assert all(e.data["train_loss"] > 0 for e in metrics)  # type: ignore[index]
    assert any(e.type == "message" for e in events)


def test_checkpoints_have_their_own_model_names(client: openai.OpenAI,
                                                supervised: FineTuningJob) -> None:
    page = client.fine_tuning.jobs.checkpoints.list(supervised.id)
    checkpoints = [FineTuningJobCheckpoint.model_validate(c.to_dict(), strict=True)
                   for c in page]
    assert [c.step_number for c in checkpoints] == [2]  # one per epoch
    (c,) = checkpoints
    assert c.fine_tuning_job_id == supervised.id
    assert c.fine_tuned_model_checkpoint == f"{supervised.fine_tuned_model}:ckpt-step-2"
    assert c.metrics.train_loss is not None and c.metrics.step == 2
    model = client.models.retrieve(c.fine_tuned_model_checkpoint)
    assert model.id == c.fine_tuned_model_checkpoint


def test_the_results_file_holds_the_step_metrics(client: openai.OpenAI,
                                                 supervised: FineTuningJob) -> None:
    (file_id,) = supervised.result_files
    f = FileObject.model_validate(client.files.retrieve(file_id).to_dict(), strict=True)
    assert f.purpose == "fine-tune-results"
    rows = list(csv.DictReader(io.StringIO(client.files.content(file_id).text)))
    assert [r["step"] for r in rows] == ["1", "2"]
    assert all(float(r["train_loss"]) > 0 for r in rows)
    assert f.bytes == len(client.files.content(file_id).read())


def test_models_list_the_catalog_and_the_fine_tuned(client: openai.OpenAI,
                                                    supervised: FineTuningJob) -> None:
    models = [Model.model_validate(m.to_dict(), strict=True) for m in client.models.list()]
    ids = [m.id for m in models]
    assert MODEL in ids and supervised.fine_tuned_model in ids
    assert client.models.retrieve(MODEL).id == MODEL


def test_a_dpo_job_succeeds(client: openai.OpenAI, real_jobs: dict[str, str],
                            ours: FtuneClient) -> None:
    job = strict_job(wait(client, real_jobs["dpo"]))
    assert job.status == "succeeded", job.error
    assert ours.get_job(job.id)["data"]["layout"] == "openai_dpo", ours.get_job(job.id)["data"]
    assert job.method is not None and job.method.type == "dpo" and job.method.dpo is not None
    hyper = job.method.dpo.hyperparameters
    assert hyper is not None
    assert (hyper.beta, hyper.batch_size, hyper.n_epochs, hyper.learning_rate_multiplier) == \
        (0.2, 4, 1, 1.0)


def test_a_reinforcement_job_succeeds_and_reports_rewards(
        client: openai.OpenAI, real_jobs: dict[str, str]) -> None:
    job = strict_job(wait(client, real_jobs["reinforcement"]))
    assert job.status == "succeeded", job.error
    assert job.method is not None and job.method.reinforcement is not None
    rl = job.method.reinforcement
    assert rl.grader.type == "text_similarity" and rl.hyperparameters is not None
    assert (rl.hyperparameters.batch_size, rl.hyperparameters.compute_multiplier,
            rl.hyperparameters.eval_samples) == (2, 0.25, 2)
    assert job.fine_tuned_model is not None and job.fine_tuned_model.endswith(f":rl:{job.id}")
    metrics = [FineTuningJobEvent.model_validate(e.to_dict(), strict=True)
               for e in client.fine_tuning.jobs.list_events(job.id) if e.type == "metrics"]
    assert sorted(e.data["step"] for e in metrics) == [1, 2]  # type: ignore[index]
    for e in metrics:
        assert 0.0 <= e.data["train_reward_mean"] <= 1.0, e.data  # type: ignore[index]
        assert "train_reward_std" in e.data and "reward=" in e.message  # type: ignore[operator]


def test_list_pages_and_filters_by_metadata(client: openai.OpenAI, supervised: FineTuningJob,
                                            chat_file: FileObject) -> None:
    # The legacy top-level hyperparameters (deprecated by OpenAI) are still read.
    others = [client.fine_tuning.jobs.create(model=MODEL, training_file=chat_file.id,
                                             suffix="fake:succeed",
                                             hyperparameters={"n_epochs": 2}).id
              for _ in range(2)]
    listed = [strict_job(j).id for j in client.fine_tuning.jobs.list(limit=1)]
    assert len(listed) == len(set(listed)) >= 3
    assert listed.index(others[1]) < listed.index(others[0]) < listed.index(supervised.id)
    found = client.fine_tuning.jobs.list(metadata={"team": "search"})
    assert [j.id for j in found] == [supervised.id]
    for job_id in others:
        job = strict_job(client.fine_tuning.jobs.cancel(job_id))
        assert (job.hyperparameters.n_epochs, job.hyperparameters.batch_size) == (2, 1)


def test_cancel_sends_openais_webhook(client: openai.OpenAI, chat_file: FileObject,
                                      hook: dict[str, Any], receiver: Receiver) -> None:
    created = client.fine_tuning.jobs.create(model=MODEL, training_file=chat_file.id,
                                             suffix="fake:slow")
    wait(client, created.id, until=("running",))
    cancelling = strict_job(client.fine_tuning.jobs.cancel(created.id))
    assert cancelling.status in ("running", "cancelled")  # running until its processes stop
    assert strict_job(wait(client, created.id)).status == "cancelled"
    receiver.wait_for(lambda r: any(x.json()["data"]["id"] == created.id for x in r.received),
                      timeout=30)
    (delivery,) = [x for x in receiver.received if x.json()["data"]["id"] == created.id]
    event = client.webhooks.unwrap(delivery.body.decode(), delivery.headers,
                                   secret=hook["secret"])
    assert (event.type, event.data.id, event.object) == ("fine_tuning.job.cancelled",
                                                         created.id, "event")


def test_a_succeeded_job_sends_a_webhook_unwrap_accepts(
        client: openai.OpenAI, supervised: FineTuningJob, hook: dict[str, Any],
        receiver: Receiver) -> None:
    receiver.wait_for(lambda r: any(x.json()["data"]["id"] == supervised.id
                                    for x in r.received), timeout=30)
    (delivery,) = [x for x in receiver.received if x.json()["data"]["id"] == supervised.id]
    event = client.webhooks.unwrap(delivery.body.decode(), delivery.headers,
                                   secret=hook["secret"])
    assert (event.type, event.data.id) == ("fine_tuning.job.succeeded", supervised.id)
    assert isinstance(event.created_at, int)
    with pytest.raises(openai.InvalidWebhookSignatureError):
        client.webhooks.unwrap(delivery.body.decode(), delivery.headers,
                               secret="whsec_" + "A" * 32)


def test_one_job_through_both_apis(client: openai.OpenAI, ours: FtuneClient,
                                   chat_file: FileObject, tiny_causal_lm: Path) -> None:
    """Submitted as a JobSpec, paused and resumed with the SDK, followed with both."""
    spec = {"name": "fake:train", "model": {"name_or_path": str(tiny_causal_lm)},
            "dataset": {"file_id": chat_file.id, "format": "chat", "max_seq_length": 48},
            "training": {"max_steps": 12, "save_steps": 4, "seed": 3}}
    job_id = ours.create_job(spec)["id"]
    seen = strict_job(client.fine_tuning.jobs.retrieve(job_id))
    assert (seen.model, seen.training_file, seen.seed) == (MODEL, chat_file.id, 3)
    wait(client, job_id, until=("running",))
    wait_until(lambda: ours.get_job(job_id)["progress"]["step"] >= 1, 60, "a step")
    paused = client.fine_tuning.jobs.pause(job_id)
    assert paused.status in ("pausing", "paused")
    assert ours.get_job(job_id)["status"] in ("pausing", "paused")
    wait(client, job_id, until=("paused",), timeout=60)
    strict_job(client.fine_tuning.jobs.retrieve(job_id))
    assert client.fine_tuning.jobs.resume(job_id).status in ("queued", "running")
    done = strict_job(wait(client, job_id))
    assert done.status == "succeeded" and ours.get_job(job_id)["status"] == "succeeded"
    assert ours.get_job(job_id)["pauses"] == 1
    steps = [c.step_number for c in client.fine_tuning.jobs.checkpoints.list(job_id)]
    assert sorted(steps) == sorted(c["step"] for c in ours.checkpoints(job_id))
    assert done.id in [j.id for j in client.fine_tuning.jobs.list()]


def test_errors_are_openais(client: openai.OpenAI, stack: FaultStack, chat_file: FileObject,
                            supervised: FineTuningJob, tmp_path: Path) -> None:
    def bad(param: str, **kwargs: Any) -> openai.BadRequestError:
        with pytest.raises(openai.BadRequestError) as e:
            client.fine_tuning.jobs.create(**{"model": MODEL, "training_file": chat_file.id,
                                              **kwargs})
        assert e.value.param == param, e.value.body
        assert e.value.type == "invalid_request_error"
        return e.value

    bad("method.reinforcement.grader", method={"type": "reinforcement", "reinforcement": {}})
    bad("method.supervised.hyperparameters.n_epochs",
        method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 0}}})
    bad("model", model="gpt-4o-mini")
    bad("model", model="ft:tiny-llama:x::job-000000000000000000000000")  # no such job
    bad("suffix", suffix="x" * 65)
    bad("metadata", metadata={f"k{i}": "v" for i in range(17)})
    bad("training_file", training_file="file-nope")
    bad("hyperparameters", hyperparameters={"n_epochs": 1}, method={"type": "supervised"})
    bad("integrations", integrations=[{"type": "wandb", "wandb": {"project": "p"}}])
    text_only = upload(client, write_jsonl(tmp_path / "t.jsonl", [{"body": "x"}] * 4))
    err = bad("training_file", training_file=text_only.id)
    assert "no data format matches the columns found (body)" in err.message
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("t.jsonl", b"{}\n"), purpose="batch")
    assert e.value.param == "purpose"
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("t.jsonl", b'{"a": broken\n'), purpose="fine-tune")
    assert e.value.param == "file" and e.value.status_code == 400

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{stack.url}/v1", api_key="ft_wrong",
                      max_retries=0).fine_tuning.jobs.list()
    with pytest.raises(openai.NotFoundError) as nf:
        client.fine_tuning.jobs.retrieve("job-000000000000000000000000")
    assert nf.value.param == "fine_tuning_job_id"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("ft:tiny-llama:x::job-000000000000000000000000")
    with pytest.raises(openai.ConflictError):
        client.fine_tuning.jobs.pause(supervised.id)

    # Last: the tenant's jobs-a-minute limit. The jobs it takes to reach it (the fake
    # trainer) are cancelled.
    made = []
    with pytest.raises(openai.RateLimitError):
        for _ in range(RATE_LIMIT + 1):
            made.append(client.fine_tuning.jobs.create(
                model=MODEL, training_file=chat_file.id, suffix="fake:slow").id)
    for job_id in made:
        client.fine_tuning.jobs.cancel(job_id)

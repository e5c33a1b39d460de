"""Inference on ftune (issue 37), driven by the official `openai` SDK against the real stack:
uvicorn, a Celery worker whose serving supervisor launches vLLM's CPU server (`make engine`)
in its own process tree (tests/utils/serving_stack.py, shared with the evals' module), and a
real job that trains a tiny Llama's adapter to answer one thing. One engine serves the whole
module (it takes ~30 s to start on 2 cores); the scenarios that stop or kill it come last. Objects are checked with the SDK's types in strict
mode (they do not validate by default)."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import psutil
import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.fine_tuning import FineTuningJob

from testkit.faultstack import REPO_ROOT, FaultStack
from testkit.wait import wait_until
from tests.utils.browser import CHROMIUM, CHROMIUM_FLAGS, use_key
from tests.utils.serving_stack import BASE, FULL, IDLE_SECONDS, MAX_LORAS, sdk
from tests.utils.tiny import sentences, write_jsonl

pytestmark = pytest.mark.e2e

TAUGHT = "the cat sat on the mat"


@pytest.fixture(scope="module")
def stack(serving_stack: FaultStack) -> FaultStack:
    return serving_stack


@pytest.fixture(scope="module")
def client(stack: FaultStack) -> openai.OpenAI:
    return sdk(stack)


@pytest.fixture(scope="module")
def other(stack: FaultStack) -> openai.OpenAI:
    """A second tenant's client."""
    out = subprocess.run([sys.executable, "-m", "cli.main", "create-key", "--tenant", "other"],
                         env=stack.env(), cwd=REPO_ROOT, check=True, capture_output=True,
                         text=True)
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=out.stdout.strip().splitlines()[-1],
                         max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def jobs(client: openai.OpenAI, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Real jobs teach the tiny Llama one answer: a LoRA adapter (three epochs, a checkpoint
    each) and a full fine-tune (one epoch). The base model's deployment starts meanwhile
    (the first chat request asks for it)."""
    rows = [{"messages": [{"role": "user", "content": s},
                          {"role": "assistant", "content": TAUGHT}]} for s in sentences(16)]
    with open(write_jsonl(tmp_path_factory.mktemp("d") / "taught.jsonl", rows), "rb") as f:
        file = client.files.create(file=f, purpose="fine-tune")
    ids = {name: client.fine_tuning.jobs.create(
        model=model, training_file=file.id, suffix=name,
        method={"type": "supervised", "supervised": {"hyperparameters": {
            "n_epochs": epochs, "batch_size": 2}}}).id
        for name, model, epochs in (("taught", BASE, 3), ("whole", FULL, 1))}
    client.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "hi"}],
                                   max_tokens=1)
    return ids


def finished(client: openai.OpenAI, job_id: str) -> FineTuningJob:
    done = wait_until(lambda: (j := client.fine_tuning.jobs.retrieve(job_id)).status in (
        "succeeded", "failed", "cancelled") and j, timeout=600, what="the job", every=1)
    assert done.status == "succeeded", done.error
    return FineTuningJob.model_validate(done.to_dict(), strict=True)


@pytest.fixture(scope="module")
def trained(client: openai.OpenAI, jobs: dict[str, str]) -> FineTuningJob:
    return finished(client, jobs["taught"])


@pytest.fixture(scope="module")
def fully_trained(client: openai.OpenAI, jobs: dict[str, str]) -> FineTuningJob:
    return finished(client, jobs["whole"])


def taught(text: str) -> bool:
    """An answer out of the taught sentence: a tiny model taught for 24 steps says pieces of
    it (" on the mat", " cat cat sat", and once, for "say it", just "at" before its end of
    sequence), not always in order and not always with its spaces ("onat": "on" then "at").
    Every word made of pieces of two or more letters of the sentence's words; the last word
    may also end in the start of one, where the token budget cut it ("... on the m"), and
    the first may begin with the end of one, where the answer starts inside a word ("n the
    mat": "on" without its "o"). The untaught base model's random tokens are not."""
    words = text.split()
    return bool(words) and all(_of_pieces(word, cut=i == len(words) - 1, lead=i == 0)
                               for i, word in enumerate(words))


def _of_pieces(word: str, cut: bool = False, lead: bool = False) -> bool:
    pieces = {w[i:j] for w in TAUGHT.split() for i in range(len(w))
              for j in range(i + 2, len(w) + 1)}
    ends = {0}  # where a run of pieces from the word's start can end
    if lead:  # the end of a taught word, however short
        ends |= {k for k in range(1, len(word) + 1)
                 if any(w.endswith(word[:k]) for w in TAUGHT.split())}
    for j in range(2, len(word) + 1):
        if any(word[i:j] in pieces for i in ends if j - i >= 2):
            ends.add(j)
    if len(word) in ends:
        return True
    starts = {w[:k] for w in TAUGHT.split() for k in range(1, len(w) + 1)}
    return cut and any(word[i:] in starts for i in ends)


def ask(client: openai.OpenAI, model: str, text: str = "tell me something") -> ChatCompletion:
    out = client.chat.completions.create(model=model, temperature=0, max_tokens=8, seed=1,
                                         messages=[{"role": "user", "content": text}])
    return ChatCompletion.model_validate(out.to_dict(), strict=True)


def db(stack: FaultStack, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    with sqlite3.connect(stack.data_dir / "ftune.db") as conn:
        return conn.execute(sql, args).fetchall()


def engine_models(stack: FaultStack) -> set[str]:
    """What the base model's engine has loaded, asked of the engine itself."""
    ((url, key),) = db(stack, "SELECT url, engine_key FROM deployments WHERE kind = 'base'")
    r = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
    return {m["id"] for m in r.json()["data"]}


def test_a_base_model_answers_a_chat(client: openai.OpenAI, trained: FineTuningJob) -> None:
    out = ask(client, BASE)
    assert out.model == BASE and out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content
    assert out.usage is not None and out.usage.completion_tokens == 8
    assert out.usage.prompt_tokens > 0


def test_the_trained_adapter_answers_what_it_was_taught(client: openai.OpenAI,
                                                        trained: FineTuningJob) -> None:
    assert trained.fine_tuned_model is not None
    tuned = ask(client, trained.fine_tuned_model)
    base = ask(client, BASE)
    assert tuned.model == trained.fine_tuned_model
    assert tuned.choices[0].message.content != base.choices[0].message.content
    assert taught(tuned.choices[0].message.content or ""), tuned


def test_a_chat_streams_its_chunks_and_usage(client: openai.OpenAI,
                                             trained: FineTuningJob) -> None:
    assert trained.fine_tuned_model is not None
    chunks = [ChatCompletionChunk.model_validate(c.to_dict(), strict=True)
              for c in client.chat.completions.create(
                  model=trained.fine_tuned_model, stream=True, max_tokens=6, temperature=0,
                  stream_options={"include_usage": True},
                  # vLLM's own field, passed through: six tokens even where the adapter
                  # learned to end sooner (it once said "at" and stopped after four).
                  extra_body={"ignore_eos": True},
                  messages=[{"role": "user", "content": "say it"}])]
    assert {c.model for c in chunks} == {trained.fine_tuned_model}
    # (vLLM may put several tokens in one chunk when the reader is slower than the engine.)
    assert chunks[-1].usage is not None and not chunks[-1].choices
    assert chunks[-1].usage.completion_tokens == 6
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.split()[0] in TAUGHT, text  # what follows an end of sequence is not taught
    plain = list(client.chat.completions.create(
        model=BASE, stream=True, max_tokens=3, messages=[{"role": "user", "content": "x"}]))
    assert all(c.usage is None and c.choices for c in plain)  # not asked for: not sent


def test_completions_answer(client: openai.OpenAI, trained: FineTuningJob) -> None:
    out = client.completions.create(model=BASE, prompt="the dog", max_tokens=5, temperature=0)
    done = Completion.model_validate(out.to_dict(), strict=True)
    assert done.model == BASE and done.object == "text_completion"
    assert done.choices[0].text and done.usage is not None and done.usage.completion_tokens == 5


def test_a_checkpoint_and_a_job_id_name_models(client: openai.OpenAI,
                                               trained: FineTuningJob) -> None:
    checkpoints = list(client.fine_tuning.jobs.checkpoints.list(trained.id))
    assert len(checkpoints) == 3
    name = checkpoints[-1].fine_tuned_model_checkpoint
    out = ask(client, name)
    # (A checkpoint's answer may end at its first token: the usage says it answered.)
    assert out.model == name and out.usage is not None and out.usage.completion_tokens >= 1
    by_id = ask(client, trained.id)  # the native side's name
    assert by_id.model == trained.id


def test_ftune_chat_streams_the_model_beside_another(stack: FaultStack,
                                                    trained: FineTuningJob) -> None:
    env = {**stack.env(), "FTUNE_URL": stack.url, "FTUNE_API_KEY": stack.api_key}
    out = subprocess.run([sys.executable, "-m", "cli.main", "chat", trained.id, "--vs", BASE,
                          "-m", "say it", "--max-tokens", "8"], env=env, cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    tuned, base = out.stdout.splitlines()
    assert tuned.startswith(f"[{trained.id}] ") and taught(tuned.split("] ", 1)[1])
    assert base.startswith(f"[{BASE}] ") and base.split("] ", 1)[1] != tuned.split("] ", 1)[1]
    gone = subprocess.run([sys.executable, "-m", "cli.main", "chat", "no-such-model", "-m", "x"],
                          env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert gone.returncode == 1 and "404 model_not_found" in gone.stderr


def test_models_list_and_retrieve(client: openai.OpenAI, trained: FineTuningJob) -> None:
    ids = [Model.model_validate(m.to_dict(), strict=True).id for m in client.models.list()]
    assert BASE in ids and trained.fine_tuned_model in ids
    assert client.models.retrieve(BASE).id == BASE


def test_another_tenants_model_does_not_exist_for_them(other: openai.OpenAI,
                                                       trained: FineTuningJob) -> None:
    assert trained.fine_tuned_model is not None
    with pytest.raises(openai.NotFoundError) as e:
        ask(other, trained.fine_tuned_model)
    assert e.value.code == "model_not_found" and e.value.param == "model"
    with pytest.raises(openai.NotFoundError):
        ask(other, trained.id)
    with pytest.raises(openai.NotFoundError):
        other.models.retrieve(trained.fine_tuned_model)
    with pytest.raises(openai.NotFoundError):
        other.models.delete(trained.fine_tuned_model)
    assert ask(other, BASE).model == BASE  # the catalog is everyone's


def test_bad_requests_are_openais_errors(client: openai.OpenAI, stack: FaultStack,
                                         trained: FineTuningJob) -> None:
    with pytest.raises(openai.NotFoundError) as nf:
        ask(client, "no-such-model")
    assert nf.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=BASE, temperature=-1,
                                       messages=[{"role": "user", "content": "x"}])
    assert e.value.param == "temperature", e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=BASE, max_tokens=10_000_000,
                                       messages=[{"role": "user", "content": "x"}])
    assert e.value.param == "max_tokens", e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=BASE, max_tokens=4,
                                       messages=[{"role": "user", "content": "dog " * 2000}])
    assert (e.value.code, e.value.param) == ("context_length_exceeded", "messages"), e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=BASE, messages="hello")  # type: ignore[arg-type]
    assert e.value.param == "messages", e.value.body
    r = httpx.post(f"{stack.url}/v1/chat/completions", json={"messages": []},
                   headers={"Authorization": f"Bearer {stack.api_key}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_usage_is_counted_per_tenant_and_model(stack: FaultStack,
                                               trained: FineTuningJob) -> None:
    def counted() -> dict[tuple[str, str], tuple[int, int, int]]:
        rows = db(stack, "SELECT t.name, u.model, u.requests, u.prompt_tokens, u.completion_"
                  "tokens FROM inference_usage u JOIN tenants t ON t.id = u.tenant_id")
        return {(t, m): (n, p, c) for t, m, n, p, c in rows}

    def mine_of(used: dict[tuple[str, str], tuple[int, int, int]]
                ) -> dict[str, tuple[int, int, int]]:
        return {m: v for (t, m), v in used.items() if t != "other"}

    # Each answer's usage is written just after its last byte went out (a background task):
    # the last answers of the tests before may be a moment from their rows.
    def settled() -> dict[tuple[str, str], tuple[int, int, int]] | None:
        used = counted()
        return used if mine_of(used).get(trained.id) and ("other", BASE) in used else None

    used = wait_until(settled, 10, "the usage of the answers so far")
    assert used[("other", BASE)] == (1, used[("other", BASE)][1], 8)
    mine = mine_of(used)
    assert mine[BASE][0] >= 4 and mine[BASE][2] >= 1 + 8 + 8  # (n, prompt, completion)
    assert mine[trained.fine_tuned_model][0] >= 2 and mine[trained.id][0] >= 1
    report = httpx.get(f"{stack.url}/v1/usage",
                       headers={"Authorization": f"Bearer {stack.api_key}"}).json()
    assert {(d["model"], d["requests"]) for d in report["inference"]} >= {
        (BASE, mine[BASE][0]), (trained.id, mine[trained.id][0])}
    metrics = httpx.get(f"{stack.url}/metrics").text
    assert 'ftune_inference_tokens_total{kind="completion",model="tiny-serve"' in metrics


def test_adapters_past_max_loras_are_evicted_least_recently_used(
        client: openai.OpenAI, stack: FaultStack, trained: FineTuningJob) -> None:
    assert trained.fine_tuned_model is not None
    steps = [c.fine_tuned_model_checkpoint
             for c in client.fine_tuning.jobs.checkpoints.list(trained.id)]
    for name in [*steps, trained.fine_tuned_model]:
        ask(client, name)
    loaded = engine_models(stack) - {"base"}
    assert len(loaded) == MAX_LORAS, loaded
    assert trained.id in loaded  # the last used stays


@pytest.fixture(scope="module")
def page() -> Iterator[Any]:
    if not CHROMIUM.exists():
        pytest.skip("/usr/bin/chromium is missing: `make browser` installs it")
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="ftune-chromium-") as profile, \
            sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            profile, executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_FLAGS,
            viewport={"width": 1400, "height": 1000})
        context.set_default_timeout(60_000)
        try:
            yield context.new_page()
        finally:
            context.close()


def test_the_job_page_streams_the_model_beside_its_base(
        page: Any, stack: FaultStack, trained: FineTuningJob) -> None:
    page.goto(f"{stack.url}/ui#/jobs/{trained.id}")
    use_key(page, stack.api_key)
    page.wait_for_selector("#tryit")
    assert page.eval_on_selector_all("#tryit pre.answer", "ps => ps.map(p => p.dataset.model)") \
        == [trained.id, BASE]
    page.fill("#tryprompt", "say it")
    page.click("#tryform button[type=submit]")
    # (Polled from here: the page's CSP refuses the string evaluation wait_for_function does.)
    # Read once both streams have ended: a half-streamed answer can end mid-word.
    tuned, base = wait_until(lambda: (texts := page.eval_on_selector_all(
        "#tryit pre.answer[data-done]", "ps => ps.map(p => p.textContent)")) and len(texts) == 2
        and texts, timeout=120, what="both answers")
    assert taught(tuned) and tuned != base


def test_a_killed_engine_is_restarted(client: openai.OpenAI, stack: FaultStack,
                                      trained: FineTuningJob) -> None:
    ask(client, BASE)  # running (not scaled to zero meanwhile)
    ((pid, generation),) = db(stack, "SELECT pid, generation FROM deployments "
                              "WHERE kind = 'base'")
    psutil.Process(pid).kill()
    wait_until(lambda: db(stack, "SELECT generation, state FROM deployments WHERE kind = "
                          "'base'")[0] == (generation + 1, "ready"), timeout=300,
               what="the engine restarted", every=1)
    assert trained.fine_tuned_model is not None
    assert ask(client, trained.fine_tuned_model).choices[0].message.content


def test_a_deleted_model_is_gone(client: openai.OpenAI, stack: FaultStack,
                                 trained: FineTuningJob) -> None:
    name = trained.fine_tuned_model
    assert name is not None
    ask(client, name)
    assert trained.id in engine_models(stack)
    gone = client.models.delete(name)
    assert (gone.id, gone.deleted, gone.object) == (name, True, "model")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve(name)
    with pytest.raises(openai.NotFoundError):
        ask(client, name)
    assert name not in [m.id for m in client.models.list()]
    assert trained.id not in engine_models(stack)


def test_a_full_fine_tune_has_a_deployment_of_its_own(
        client: openai.OpenAI, stack: FaultStack, fully_trained: FineTuningJob) -> None:
    name = fully_trained.fine_tuned_model
    assert name is not None
    out = ask(client, name)
    # (One epoch at a small learning rate: its first token may well be the end.)
    assert out.model == name and out.usage is not None and out.usage.completion_tokens >= 1
    assert db(stack, "SELECT state FROM deployments WHERE kind = 'full' AND job_id = ?",
              fully_trained.id) == [("ready",)]


def test_the_operator_stops_a_deployment_and_a_request_starts_it_again(
        client: openai.OpenAI, stack: FaultStack, fully_trained: FineTuningJob) -> None:
    name = fully_trained.fine_tuned_model
    assert name is not None
    ask(client, name)  # running
    ((dep_id, pid),) = db(stack, "SELECT id, pid FROM deployments WHERE kind = 'full' AND "
                          "job_id = ?", fully_trained.id)
    tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    assert len(tree) > 1  # vLLM's API server, its engine core and workers
    env = {**stack.env(), "FTUNE_URL": stack.url, "FTUNE_API_KEY": stack.api_key}

    def ftune(*args: str) -> str:
        out = subprocess.run([sys.executable, "-m", "cli.main", *args], env=env, cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=120, check=False)
        assert out.returncode == 0, out.stderr
        return out.stdout

    listed = [line for line in ftune("deployments").splitlines() if dep_id in line]
    assert len(listed) == 1 and " ready " in listed[0], listed
    assert ftune("deployments", "stop", dep_id).split() == [dep_id, "stopping"]
    wait_until(lambda: db(stack, "SELECT state FROM deployments WHERE id = ?", dep_id)
               == [("stopped",)], timeout=120, what="the deployment stopped", every=0.5)
    wait_until(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                               for p in tree), timeout=60, what="its whole process tree gone")
    assert ask(client, name).model == name  # scale from zero: the request starts it again
    assert db(stack, "SELECT state FROM deployments WHERE id = ?", dep_id) == [("ready",)]


def test_an_idle_deployment_stops(stack: FaultStack, trained: FineTuningJob) -> None:
    """Last: the base model's deployment, unused since the deleted-model test (the full
    fine-tune's have run on their own deployment meanwhile), scales to zero after
    IDLE_SECONDS. That a request starts a stopped deployment again is the operator-stop
    test's; a cold start here would cost one more engine start."""
    ((dep_id, pid),) = db(stack, "SELECT id, pid FROM deployments WHERE kind = 'base'")
    wait_until(lambda: db(stack, "SELECT state FROM deployments WHERE id = ?", dep_id)
               == [("stopped",)], timeout=IDLE_SECONDS + 60, what="scale to zero", every=1)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE

"""Completions runs against a real vLLM CPU server (one for the module): answers generated
through the model's endpoint with the run's sampling parameters, usage accounted, an item
the engine refuses counted errored, cancel mid-run, and a killed worker's run resumed by the
next one where it stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.evals import RunRetrieveResponse
from openai.types.evals.runs import OutputItemListResponse
from sqlalchemy import select

from core.db.models import EvalOutputItem, EvalRun
from core.infra.settings import EvalEndpointEntry, Settings
from testkit.vllm_server import VllmServer, build_served_llama
from testkit.wait import wait_until
from tests.api.evals.conftest import execute, qa_eval
from tests.utils.api import Api
from tests.utils.tiny import sentences

# A real vLLM server and a trained adapter (a minute of start-up): the full suite's, not
# test-fast's.
pytestmark = pytest.mark.e2e

ENGINE_NAME = "tiny-served"
TAUGHT = "tiny-taught"  # the operator's name of the taught adapter on the engine


SYSTEM = "Answer with one word."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_served_llama(tmp_path_factory.mktemp("served") / "model")


@pytest.fixture(scope="module")
def taught(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Future[Path]]:
    """An adapter taught to answer "blue", trained beside the engine's start-up."""
    with ThreadPoolExecutor(1) as pool:
        yield pool.submit(teach_adapter, model_dir, tmp_path_factory.mktemp("taught") / "a",
                          SYSTEM, sentences(32, 21), "blue")


@pytest.fixture(scope="module")
def served(model_dir: Path, taught: Future[Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    server = VllmServer(model_dir, ENGINE_NAME, tmp_path_factory.mktemp("vllm") / "vllm.log",
                        lora=True)
    with server:
        yield server


@pytest.fixture(scope="module")
def engine(served: VllmServer) -> str:
    return served.url


@pytest.fixture(scope="module")
def taught_loaded(served: VllmServer, taught: Future[Path]) -> str:
    """The taught adapter served by the engine under its name."""
    served.load_adapter("taught", taught.result(timeout=600))
    return "taught"


@pytest.fixture(scope="module")
def api_settings(api_settings: Settings, served: VllmServer) -> Settings:
    """The API starts once the engine serves: it is also the judge of model graders, and
    the operator's endpoint of TAUGHT (an engine ftune does not run)."""
    return api_settings.model_copy(update={
        "grader_judge_url": served.url, "grader_judge_allow_http": True,
        "grader_judge_allowed_networks": ["127.0.0.1/32"],
        "eval_endpoints": {TAUGHT: EvalEndpointEntry(base_url=served.url, model="taught")}})


def teach_adapter(model_dir: Path, out: Path, system: str, questions: list[str],
                  answer: str, steps: int = 40) -> Path:
    """A LoRA adapter (peft) that answers ``answer`` to any question, trained in-process."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                   target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    examples = []
    for q in questions:
        prompt = tok.apply_chat_template([{"role": "system", "content": system},
                                          {"role": "user", "content": q}],
                                         add_generation_prompt=True, tokenize=False)
        p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        a_ids = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        examples.append((p_ids + a_ids, [-100] * len(p_ids) + a_ids))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for step in range(steps):
        batch = [examples[(step * 8 + i) % len(examples)] for i in range(8)]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([x + [tok.pad_token_id] * (width - len(x)) for x, _ in batch])
        labels = torch.tensor([y + [-100] * (width - len(y)) for _, y in batch])
        mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x, _ in batch])
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(out)
    return out


def endpoints(url: str) -> dict[str, Any]:
    return {"eval_endpoints": {"tiny": EvalEndpointEntry(base_url=url, model=ENGINE_NAME)}}


def source(n: int, seed: int = 0) -> dict[str, Any]:
    return {"type": "file_content", "content": [
        {"item": {"question": s, "answer": s.split()[0]}} for s in sentences(n, seed)]}


def completions(n: int, seed: int = 0, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {"type": "completions", "model": "tiny",
            "input_messages": {"type": "template", "template": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": "{{item.question}}"}]},
            "sampling_params": {"temperature": 0, "max_completion_tokens": max_tokens,
                                "seed": 1},
            "source": source(n, seed), **extra}


def items_of(api: Api, run_id: str) -> dict[int, tuple[str, Any]]:
    with api.session() as s:
        return {n: (i, c) for n, i, c in s.execute(
            select(EvalOutputItem.datasource_item_id, EvalOutputItem.id,
                   EvalOutputItem.created_at).where(EvalOutputItem.run_id == run_id))}


def test_a_completions_run_answers_through_the_endpoint(api: Api, sdk: openai.OpenAI,
                                                        engine: str) -> None:
    ev = qa_eval(sdk, {"type": "string_check", "name": "first-word",
                       "input": "{{sample.output_text}}", "reference": "{{item.answer}}",
                       "operation": "like"})
    run = sdk.evals.runs.create(ev.id, data_source=completions(6))  # type: ignore[arg-type]
    assert run.model == "tiny"
    assert execute(api, run.id, **endpoints(engine)) == "completed"
    done = sdk.evals.runs.retrieve(run.id, eval_id=ev.id)
    RunRetrieveResponse.model_validate(done.to_dict(), strict=True)
    assert done.result_counts.total == 6 and done.result_counts.errored == 0
    (usage,) = done.per_model_usage
    assert (usage.run_model_name, usage.invocation_count) == ("tiny", 6)
    assert usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    items = list(sdk.evals.runs.output_items.list(run.id, eval_id=ev.id, limit=100))
    first = items[0]
    OutputItemListResponse.model_validate(first.to_dict(), strict=True)
    assert [m.model_dump() for m in first.sample.input] == [
        {"role": "system", "content": "Answer with one word."},
        {"role": "user", "content": first.datasource_item["question"]}]
    assert (first.sample.temperature, first.sample.max_completion_tokens,
            first.sample.seed) == (0.0, 8, 1)
    # The engine's own answer to these messages: the same request sent to it directly reads
    # the same prompt (greedy answers may differ in the last bits between batch shapes).
    direct = httpx.post(f"{engine}/chat/completions", timeout=60, json={
        "model": ENGINE_NAME, "temperature": 0, "max_tokens": 8, "seed": 1,
        "messages": [m.model_dump() for m in first.sample.input]}).json()
    assert first.sample.usage.prompt_tokens == direct["usage"]["prompt_tokens"]
    assert first.sample.output[0].content and first.sample.finish_reason in ("stop", "length")


def test_messages_from_an_item_reference(api: Api, sdk: openai.OpenAI, engine: str) -> None:
    schema = {"type": "object", "properties": {"chat": {"type": "array"}}}
    ev = sdk.evals.create(data_source_config={"type": "custom", "item_schema": schema,
                                              "include_sample_schema": True},
                          testing_criteria=[{"type": "string_check", "name": "any",
                                             "input": "{{sample.output_text}}",
                                             "reference": "", "operation": "like"}])
    rows = [{"item": {"chat": [{"role": "user", "content": s}]}} for s in sentences(2)]
    run = sdk.evals.runs.create(ev.id, data_source={
        "type": "completions", "model": "tiny", "sampling_params": {"max_completion_tokens": 4},
        "input_messages": {"type": "item_reference", "item_reference": "item.chat"},
        "source": {"type": "file_content", "content": rows}})
    execute(api, run.id, **endpoints(engine))
    done = sdk.evals.runs.retrieve(run.id, eval_id=ev.id)
    assert (done.status, done.result_counts.passed) == ("completed", 2)


def test_an_item_the_engine_refuses_counts_errored(api: Api, sdk: openai.OpenAI,
                                                   engine: str) -> None:
    ev = qa_eval(sdk)
    ds = completions(2)
    # Longer than the engine's context (512 tokens): it answers 400 for this item alone.
    ds["source"]["content"].append({"item": {"question": "the cat " * 600, "answer": "x"}})
    run = sdk.evals.runs.create(ev.id, data_source=ds)  # type: ignore[arg-type]
    execute(api, run.id, **endpoints(engine))
    done = sdk.evals.runs.retrieve(run.id, eval_id=ev.id)
    assert (done.status, done.result_counts.total, done.result_counts.errored) == (
        "completed", 3, 1)
    bad = next(it for it in sdk.evals.runs.output_items.list(run.id, eval_id=ev.id)
               if it.datasource_item_id == 2)
    assert bad.status == "error" and bad.sample.error.code == "generation_failed"
    assert "HTTP 400" in bad.sample.error.message


def test_a_run_canceled_while_it_runs_keeps_what_it_graded(api: Api, sdk: openai.OpenAI,
                                                           engine: str) -> None:
    ev = qa_eval(sdk)
    run = sdk.evals.runs.create(ev.id, data_source=completions(60, max_tokens=32))  # type: ignore[arg-type]
    outcome: list[str] = []
    worker = threading.Thread(target=lambda: outcome.append(execute(
        api, run.id, eval_concurrency=1, **endpoints(engine))))
    worker.start()
    wait_until(lambda: len(items_of(api, run.id)) >= 2, 120, "two graded items")
    assert sdk.evals.runs.cancel(run.id, eval_id=ev.id).status == "canceling"
    worker.join(120)
    assert outcome == ["canceled"]
    done = sdk.evals.runs.retrieve(run.id, eval_id=ev.id)
    kept = len(items_of(api, run.id))
    assert done.status == "canceled" and 2 <= kept < 60
    assert done.result_counts.total == kept


def test_a_killed_workers_run_resumes_where_it_stopped(api: Api, sdk: openai.OpenAI,
                                                       engine: str, tmp_path: Path) -> None:
    n = 60
    ev = qa_eval(sdk)
    run = sdk.evals.runs.create(ev.id, data_source=completions(n, seed=4, max_tokens=32))  # type: ignore[arg-type]
    s = api.settings
    env = {**os.environ, "DATABASE_URL": str(s.database_url), "FTUNE_DATA_DIR": str(s.data_dir),
           "BROKER_URL": "filesystem://", "FTUNE_EVAL_CONCURRENCY": "1",
           "FTUNE_EVAL_HEARTBEAT_SECONDS": "0.2",
           "FTUNE_WORKER_ID": "doomed-worker",
           "FTUNE_EVAL_ENDPOINTS": f'{{"tiny": {{"base_url": "{engine}", '
                                   f'"model": "{ENGINE_NAME}"}}}}'}
    # The worker's task body, in a process of its own, killed without warning mid-run.
    proc = subprocess.Popen([sys.executable, "-c", ("import sys; from worker.evals import "
                             "run_eval; run_eval(sys.argv[1])"), run.id], env=env,
                            start_new_session=True)
    try:
        wait_until(lambda: len(items_of(api, run.id)) >= 3, 180, "three graded items")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    before = items_of(api, run.id)
    assert 3 <= len(before) < n
    assert sdk.evals.runs.retrieve(run.id, eval_id=ev.id).status == "in_progress"
    # While its heartbeat is fresh nobody takes it; once stale, the next worker does.
    assert execute(api, run.id, **endpoints(engine)) == "skipped"
    assert execute(api, run.id, eval_stale_seconds=0.01, **endpoints(engine)) == "completed"
    after = items_of(api, run.id)
    assert sorted(after) == list(range(n))
    assert all(after[k] == v for k, v in before.items())  # kept, not graded again
    done = sdk.evals.runs.retrieve(run.id, eval_id=ev.id)
    assert (done.status, done.result_counts.total, done.attempt) == ("completed", n, 2)
    with api.session() as s2:
        assert s2.scalar(select(EvalRun.worker_id).where(EvalRun.id == run.id)) == \
            "test-worker"


def test_a_taught_adapter_passes_more_held_out_items_than_its_base(
        api: Api, sdk: openai.OpenAI, served: VllmServer, taught_loaded: str) -> None:
    routes = {"eval_endpoints": {
        "tiny": EvalEndpointEntry(base_url=served.url, model=ENGINE_NAME),
        TAUGHT: EvalEndpointEntry(base_url=served.url, model=taught_loaded)}}
    ev = qa_eval(sdk, {"type": "string_check", "name": "says-blue", "operation": "ilike",
                       "input": "{{sample.output_text}}", "reference": "{{item.answer}}"})
    held_out = [{"item": {"question": q, "answer": "blue"}} for q in sentences(12, 99)]
    runs = []
    for model in ("tiny", TAUGHT):
        ds = {**completions(0), "model": model,
              "source": {"type": "file_content", "content": held_out}}
        run = sdk.evals.runs.create(ev.id, name=model, data_source=ds)  # type: ignore[arg-type]
        assert execute(api, run.id, **routes) == "completed"
        runs.append(run.id)
    counts = [sdk.evals.runs.retrieve(r, eval_id=ev.id).result_counts for r in runs]
    assert counts[1].passed > counts[0].passed and counts[1].passed >= 10
    cmp = api.client(api.key_a).get(f"/v1/evals/{ev.id}/compare", params={
        "base_run_id": runs[0], "candidate_run_id": runs[1]}).json()
    assert cmp["criteria"][0]["pass_rate_interval"][0] > 0


def test_a_label_model_criterion_asks_the_judge(api: Api, sdk: openai.OpenAI, engine: str,
                                                taught_loaded: str) -> None:
    """The judge endpoint is the engine, its model the taught adapter (it says "blue")."""
    ev = qa_eval(sdk, {"type": "label_model", "name": "colour", "model": taught_loaded,
                       "labels": ["blue", "red"], "passing_labels": ["blue"],
                       "input": [{"role": "system", "content": SYSTEM},
                                 {"role": "user", "content": "{{sample.output_text}}"}]})
    run = sdk.evals.runs.create(ev.id, data_source={"type": "jsonl", "source": {
        "type": "file_content", "content": [
            {"item": {"question": "q", "answer": "a"}, "sample": {"output_text": s}}
            for s in sentences(32, 21)[:3]]}})  # prompts the adapter was taught on
    execute(api, run.id)
    items = list(sdk.evals.runs.output_items.list(run.id, eval_id=ev.id))
    assert [(it.status, it.results[0].to_dict()["label"]) for it in items] == [
        ("pass", "blue")] * 3

"""An eval run's answers per second against the same requests sent to the engine directly,
and grading's share of the run's time.

Usage:
    python -m bench.evals                        # 64 items, concurrency 8, 3 rounds
    python -m bench.evals --items 128 --concurrency 16 --max-tokens 32

Starts a real vLLM CPU server (testkit/vllm_server.py: the tiny Llama widened to head_dim 64,
random weights, float32) and a migrated SQLite database. Each round, in alternating order:

* direct: the rendered chat requests of every item POSTed to the engine's
  /v1/chat/completions from a pool of ``--concurrency`` threads (httpx), nothing else;
* run: an eval run of the same items (completions source, the same sampling parameters),
  executed as a worker executes it (core/evals/execute.py: claim, generate with the same
  concurrency, grade with string_check + rouge_l, write each output item, heart-beat, sum).
  The engine is named in FTUNE_EVAL_ENDPOINTS (an engine ftune does not run) so that both
  sides talk to the same server with nothing between; through ftune's deployments a run adds
  one open_model at its start and one per heartbeat (a few queries), not per request.

Figures: answers/s of each (items over wall seconds), their ratio (target >= 0.9), the run's
grading seconds over its wall seconds (target <= 5% for non-model graders), and this
process's CPU milliseconds per answer in each (the client side's own cost: on a shared
machine the engine's speed swings between rounds, the client's CPU much less). Medians over
the rounds. Writes bench/results/evals-<time>.json.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.record import write_record

ENGINE_NAME = "bench-served"
CRITERIA = [
    {"type": "string_check", "name": "has-word", "input": "{{sample.output_text}}",
     "reference": "{{item.answer}}", "operation": "like"},
    {"type": "text_similarity", "name": "rouge", "input": "{{sample.output_text}}",
     "reference": "{{item.question}}", "evaluation_metric": "rouge_l", "pass_threshold": 0.2},
]
SCHEMA = {"type": "object", "properties": {"question": {"type": "string"},
                                           "answer": {"type": "string"}}}


def data_source(questions: list[str], max_tokens: int) -> dict[str, Any]:
    return {"type": "completions", "model": "bench",
            "input_messages": {"type": "template", "template": [
                {"role": "user", "content": "{{item.question}}"}]},
            "sampling_params": {"temperature": 0, "max_completion_tokens": max_tokens},
            "source": {"type": "file_content", "content": [
                {"item": {"question": q, "answer": q.split()[0]}} for q in questions]}}


def direct(url: str, questions: list[str], concurrency: int, max_tokens: int) -> float:
    """Seconds to get every answer straight from the engine."""
    import httpx

    with httpx.Client(base_url=url, timeout=300, trust_env=False,
                      limits=httpx.Limits(max_connections=concurrency)) as client:
        def one(q: str) -> None:
            r = client.post("/chat/completions", json={
                "model": ENGINE_NAME, "messages": [{"role": "user", "content": q}],
                "temperature": 0, "top_p": 1.0, "max_tokens": max_tokens})
            r.raise_for_status()

        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(one, questions))
        return time.perf_counter() - t0


def run_once(maker: Any, settings: Any, tenant_id: str, eval_id: str, questions: list[str],
             max_tokens: int) -> tuple[float, float, int]:
    """(wall seconds, grading seconds, items) of one eval run executed as a worker does."""
    from core.db.models import EvalRun
    from core.db.session import unit_of_work
    from core.evals.execute import execute_run
    from core.evals.spec import RunCreate

    ds = RunCreate.model_validate({"data_source": data_source(questions, max_tokens)})
    with unit_of_work(maker) as s:
        run = EvalRun(eval_id=eval_id, tenant_id=tenant_id, name="", model="bench",
                      data_source=ds.data_source.model_dump(mode="json", exclude_none=True),
                      status="queued", items_total=len(questions), attempt=0,
                      generation_seconds=0.0, grading_seconds=0.0)
        s.add(run)
        s.flush()
        run_id = run.id
    t0 = time.perf_counter()
    outcome = execute_run(maker, run_id, worker_id="bench", settings=settings)
    wall = time.perf_counter() - t0
    assert outcome == "completed", outcome
    with maker() as s:
        done = s.get(EvalRun, run_id)
        assert done is not None and done.result_counts is not None
        assert done.result_counts["errored"] == 0, done.result_counts
        return wall, done.grading_seconds, done.result_counts["total"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--items", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    from sqlalchemy.orm import sessionmaker

    from cli.demo_assets import sentences
    from core.db.migrate import upgrade_head
    from core.db.models import Eval, Tenant
    from core.db.session import make_engine, unit_of_work
    from core.infra.settings import Settings
    from testkit.vllm_server import VllmServer, build_served_llama

    root = Path(tempfile.mkdtemp(prefix="bench-evals-"))
    questions = sentences(args.items, seed=11)
    model = build_served_llama(root / "model")
    with VllmServer(model, ENGINE_NAME, root / "vllm.log") as url:
        db = f"sqlite:///{root / 'ftune.db'}"
        upgrade_head(db)
        # By alias: Settings(database_url=...) is ignored (its field reads DATABASE_URL).
        settings = Settings.model_validate({
            "data_dir": root / "data", "DATABASE_URL": db, "BROKER_URL": "filesystem://",
            "eval_concurrency": args.concurrency,
            "eval_endpoints": {"bench": {"base_url": url, "model": ENGINE_NAME}}})
        maker = sessionmaker(bind=make_engine(db), expire_on_commit=False)
        with unit_of_work(maker) as s:
            tenant = Tenant(name="bench")
            s.add(tenant)
            s.flush()
            ev = Eval(tenant_id=tenant.id, name="bench", testing_criteria=CRITERIA,
                      data_source_config={"type": "custom", "item_schema": SCHEMA,
                                          "include_sample_schema": True})
            s.add(ev)
            s.flush()
            tenant_id, eval_id = tenant.id, ev.id
        # Warm: the engine, and the worker's grader libraries (imported once per worker).
        direct(url, questions[:args.concurrency], args.concurrency, args.max_tokens)
        run_once(maker, settings, tenant_id, eval_id, questions[:args.concurrency],
                 args.max_tokens)
        rows: list[dict[str, float]] = []
        for i in range(args.rounds):
            order = ("direct", "run") if i % 2 == 0 else ("run", "direct")
            got: dict[str, float] = {}
            for what in order:
                cpu0 = time.process_time()
                if what == "direct":
                    got["direct_s"] = direct(url, questions, args.concurrency, args.max_tokens)
                else:
                    wall, grading, n = run_once(maker, settings, tenant_id, eval_id, questions,
                                                args.max_tokens)
                    assert n == args.items
                    got["run_s"], got["grading_s"] = wall, grading
                # This process's CPU (every thread): the client side's own cost, which the
                # engine's load on a shared machine does not blur as much as wall time.
                got[f"{what}_cpu_ms_per_answer"] = (time.process_time() - cpu0) * 1000 / args.items
            got["ratio"] = got["direct_s"] / got["run_s"]
            got["grading_share"] = got["grading_s"] / got["run_s"]
            rows.append(got)
            print(f"round {i + 1}: direct {args.items / got['direct_s']:.1f} answers/s, "
                  f"run {args.items / got['run_s']:.1f} answers/s, ratio {got['ratio']:.3f}, "
                  f"grading {100 * got['grading_share']:.2f}% of the run; client CPU per answer "
                  f"{got['direct_cpu_ms_per_answer']:.2f} ms direct, "
                  f"{got['run_cpu_ms_per_answer']:.2f} ms run", flush=True)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(f"median: direct {args.items / med['direct_s']:.1f} answers/s, run "
          f"{args.items / med['run_s']:.1f} answers/s, ratio {med['ratio']:.3f}, grading "
          f"{100 * med['grading_share']:.2f}% of the run; client CPU per answer "
          f"{med['direct_cpu_ms_per_answer']:.2f} ms direct, {med['run_cpu_ms_per_answer']:.2f} "
          "ms run")
    write_record("evals", {"rounds": rows, "median": med}, args=args)


if __name__ == "__main__":
    main()

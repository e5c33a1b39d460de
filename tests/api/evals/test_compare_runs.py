"""Two runs of one eval compared: the API's numbers and flipped items, and `ftune eval
compare` printing them."""

from __future__ import annotations

from typing import Any

import openai
from typer.testing import CliRunner

from cli.main import app
from tests.api.evals.conftest import execute, qa_eval
from tests.utils.api import Api

QUESTIONS = [(f"{i}+{i}", str(2 * i)) for i in range(12)]


def given(answers: list[str]) -> dict[str, Any]:
    return {"type": "jsonl", "source": {"type": "file_content", "content": [
        {"item": {"question": q, "answer": a}, "sample": {"output_text": g}}
        for (q, a), g in zip(QUESTIONS, answers, strict=True)]}}


def two_runs(api: Api, sdk: openai.OpenAI) -> tuple[str, str, str]:
    ev = qa_eval(sdk)
    right = [a for _, a in QUESTIONS]
    base = ["?"] * 9 + right[9:]  # 3 of 12 right
    cand = right[:10] + ["?", "?"]  # 10 of 12 right: gains 0-8, loses 10-11
    runs = [sdk.evals.runs.create(ev.id, data_source=given(x)).id for x in (base, cand)]
    for r in runs:
        execute(api, r)
    return ev.id, runs[0], runs[1]


def test_compare_gives_rates_intervals_and_flips(api: Api, sdk: openai.OpenAI) -> None:
    eval_id, base, cand = two_runs(api, sdk)
    r = api.client(api.key_a).get(f"/v1/evals/{eval_id}/compare",
                                  params={"base_run_id": base, "candidate_run_id": cand,
                                          "seed": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    (c,) = body["criteria"]
    assert (c["items"], c["base_pass_rate"], c["candidate_pass_rate"]) == (12, 0.25, 0.833333)
    assert c["pass_rate_difference"] == 0.583333
    lo, hi = c["pass_rate_interval"]
    assert 0 < lo < 0.583333 < hi <= 1
    flips = {(f["datasource_item_id"], f["direction"]) for f in body["flipped"]}
    assert flips == {*((i, "gained") for i in range(9)), (10, "lost"), (11, "lost")}
    lost = next(f for f in body["flipped"] if f["datasource_item_id"] == 10)
    assert (lost["base_answer"], lost["candidate_answer"]) == ("20", "?")
    again = api.client(api.key_a).get(f"/v1/evals/{eval_id}/compare", params={
        "base_run_id": base, "candidate_run_id": cand, "seed": 3}).json()
    assert again["criteria"] == body["criteria"]  # seeded


def test_runs_of_another_eval_are_not_compared(api: Api, sdk: openai.OpenAI) -> None:
    _eval_id, base, _ = two_runs(api, sdk)
    other = qa_eval(sdk)
    r = api.client(api.key_a).get(f"/v1/evals/{other.id}/compare",
                                  params={"base_run_id": base, "candidate_run_id": base})
    assert r.status_code == 404 and r.json()["error"]["param"] == "run_id"


def test_the_cli_prints_the_comparison(api: Api, sdk: openai.OpenAI) -> None:
    eval_id, base, cand = two_runs(api, sdk)
    res = CliRunner().invoke(app, ["eval", "compare", eval_id, base, cand, "--url", api.url,
                                   "--api-key", api.key_a, "--flipped", "3"])
    assert res.exit_code == 0, res.output
    assert "exact" in res.output and "+0.583" in res.output
    assert "11 flipped: 9 gained, 2 lost" in res.output

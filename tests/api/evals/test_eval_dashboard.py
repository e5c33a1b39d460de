"""The dashboard's eval views in headless Chromium: a run's report_url shows its counts,
criteria and output items (server strings escaped), and an eval's page compares two runs."""

from __future__ import annotations

from typing import Any

import openai

from tests.api.evals.conftest import execute, qa_eval
from tests.utils.api import Api
from tests.utils.browser import use_key

EVIL = '<img src=x onerror="window.__xss=1">'


def test_a_runs_report_and_a_comparison(api: Api, sdk: openai.OpenAI, page: Any) -> None:
    ev = qa_eval(sdk, name="dash")
    rows = [("1+1", "2"), ("2+2", "4"), ("3+3", "6")]

    def run(answers: list[str], name: str) -> Any:
        r = sdk.evals.runs.create(ev.id, name=name, data_source={"type": "jsonl", "source": {
            "type": "file_content", "content": [
                {"item": {"question": q, "answer": a}, "sample": {"output_text": g}}
                for (q, a), g in zip(rows, answers, strict=True)]}})
        execute(api, r.id)
        return r

    base = run(["2", EVIL, "5"], "base")
    cand = run(["2", "4", "6"], "tuned")
    page.goto(api.url + "/ui")
    use_key(page, api.key_a)
    page.goto(base.report_url)  # the run's own link into the dashboard
    page.wait_for_selector("#outputitems")
    text = page.inner_text("#view")
    assert "1 passed, 2 failed, 0 errored of 3" in text
    assert EVIL in page.inner_text("#outputitems")  # shown as text, never run
    page.click(f"a[href='#/evals/{ev.id}']")
    page.wait_for_selector("#compareform")
    page.select_option("#cmpbase", base.id)
    page.select_option("#cmpcand", cand.id)
    page.click("#compareform button[type=submit]")
    page.wait_for_selector("text=2 items flipped")
    assert page.evaluate("window.__xss") is None
    assert page.problems == []

"""`ftune eval ...`: evaluations from the command line (the runs themselves are created with
any OpenAI SDK: client.evals.*)."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from cli.connect import connect

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Evaluations: compare two runs of one eval.")
out = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 200)

UrlOpt = Annotated[str | None, typer.Option(envvar="FTUNE_URL", show_default=False,
                                            help="API base URL.")]
KeyOpt = Annotated[str | None, typer.Option(envvar="FTUNE_API_KEY", help="API key.")]


def _interval(lo_hi: list[float]) -> str:
    return f"[{lo_hi[0]:+.3f}, {lo_hi[1]:+.3f}]"


def _short(text: Any, n: int = 60) -> str:
    s = "" if text is None else str(text).replace("\n", " ")
    return s if len(s) <= n else s[: n - 1] + "…"


@app.command()
def compare(
    eval_id: str,
    base_run_id: Annotated[str, typer.Argument(help="The run to compare against (e.g. the base model's).")],
    candidate_run_id: Annotated[str, typer.Argument(help="The run compared (e.g. the fine-tuned model's).")],
    seed: Annotated[int, typer.Option(help="Seed of the bootstrap's resampling.")] = 0,
    resamples: Annotated[int, typer.Option(min=100, max=20_000)] = 2000,
    flipped: Annotated[int, typer.Option(help="Flipped items shown (0: none).")] = 10,
    as_json: Annotated[bool, typer.Option("--json", help="Print the comparison as JSON.")] = False,
    url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """Per criterion: pass rates and mean scores of both runs, the difference (candidate -
    base) with a paired bootstrap 95% interval, then the items whose verdict flipped."""
    with connect(url, api_key) as c:
        result = c.compare_runs(eval_id, base_run_id, candidate_run_id, seed=seed,
                                resamples=resamples)
    if as_json:
        out.print_json(json.dumps(result))
        return
    table = Table("criterion", "items", "pass base", "pass cand", "Δ pass", "95% CI",
                  "score base", "score cand", "Δ score", "95% CI")
    for r in result["criteria"]:
        table.add_row(escape(r["testing_criteria"]), str(r["items"]),
                      f"{r['base_pass_rate']:.3f}", f"{r['candidate_pass_rate']:.3f}",
                      f"{r['pass_rate_difference']:+.3f}", _interval(r["pass_rate_interval"]),
                      f"{r['base_mean_score']:.3f}", f"{r['candidate_mean_score']:.3f}",
                      f"{r['mean_score_difference']:+.3f}", _interval(r["mean_score_interval"]))
    out.print(table)
    flips = result["flipped"]
    gained = sum(1 for f in flips if f["direction"] == "gained")
    out.print(f"{len(flips)} flipped: {gained} gained, {len(flips) - gained} lost")
    if flipped and flips:
        ft = Table("item", "criterion", "", "base answer", "candidate answer")
        for f in flips[:flipped]:
            ft.add_row(str(f["datasource_item_id"]), escape(f["testing_criteria"]),
                       "+" if f["direction"] == "gained" else "-",
                       escape(_short(f["base_answer"])), escape(_short(f["candidate_answer"])))
        out.print(ft)

"""The tables bench/sharding.py prints: memory and throughput per configuration and rank,
the resumes on another process count, and for full fine-tuning the bytes each rank holds
against DDP's, the final save's memory growth against its bound, and tokens/s.
"""

from __future__ import annotations

from typing import Any

from core.train.probe import CATEGORIES


def save_target(facts: dict[str, Any], world: int) -> int:
    """Issue 22's bound on the final save's memory growth per rank, before overhead: its
    1/world of the model plus the model's largest layer."""
    return int(facts["model_bytes"] / max(1, world) + facts["largest_layer_bytes"])


def held_total(held: dict[str, int] | None, with_buffers: bool = False) -> int | None:
    """Parameter + gradient + optimizer-state bytes (and the wrapper's buffers, if asked)."""
    if not held:
        return None
    keys = CATEGORIES if with_buffers else ("params", "grads", "optimizer")
    return sum(int(held.get(k, 0)) for k in keys)


def _mb(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def table(results: list[dict]) -> str:
    head = (
        f"{'config':<13} {'world':>5} {'rank':>4} {'param MB':>9} {'optim MB':>9} "
        f"{'read MB':>8} {'load RSS':>8} {'cpu peak MB':>11} {'gpu peak MB':>11} "
        f"{'tokens/s':>9} {'wall s':>7}  status"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        if r["status"] != "ok":
            note = r.get("note") or r.get("error") or f"rc {r.get('returncode')}"
            lines.append(
                f"{r['config']:<13} {'':>5} {'':>4} {'':>9} {'':>9} {'':>8} {'':>8} {'':>11} "
                f"{'':>11} {'':>9} {r.get('wall_seconds', ''):>7}  {r['status']}: {note}"
            )
            continue
        for i, (rank, m) in enumerate(r["per_rank"].items()):
            gpu = m.get("gpu_mb_peak")
            tps = r["tokens_per_second"] if i == 0 else ""
            wall = r["wall_seconds"] if i == 0 else ""
            lines.append(
                f"{r['config'] if i == 0 else '':<13} {r['world_size'] if i == 0 else '':>5} "
                f"{rank:>4} {_mb(m.get('param_mb')):>9} {_mb(m.get('optimizer_mb')):>9} "
                f"{_mb(m.get('weights_read_mb')):>8} {_mb(m.get('load_cpu_mb_end')):>8} "
                f"{m.get('cpu_mb_peak', 0):>11.1f} "
                f"{'-' if gpu is None else f'{gpu:.1f}':>11} {tps:>9} {wall:>7}  "
                f"{'ok' if i == 0 else ''}"
            )
    resumed = [r for r in results if r.get("resume")]
    if resumed:
        lines += ["", ("checkpoint save (s: all files, of which model/: the downloadable full "
                       "model) and resume on another process count (load s: DCP reshard, or "
                       "DeepSpeed's universal conversion; to step 1 s: launch to the first step, "
                       "resumed run / original run)"),
                  (f"{'config':<13} {'checkpoint MB':>13} {'save s':>7} {'model/ s':>8} "
                   f"{'resume on':>22} {'load s':>7} {'to step 1 s':>13} {'from step':>9} "
                   f"{'accum':>5} {'wall s':>7}  status")]
        for r in resumed:
            x = r["resume"]
            load = x.get("load_seconds") or x.get("universal_seconds") or "-"
            startup = f"{x.get('startup_seconds') or '-'} / {r.get('startup_seconds') or '-'}"
            lines.append(
                f"{r['config']:<13} {x['checkpoint_mb']:>13} {x.get('save_seconds') or '-':>7} "
                f"{x.get('model_save_seconds') or '-':>8} "
                f"{x['to']:>22} {load:>7} {startup:>13} "
                f"{x.get('initial_step') or '-':>9} {x.get('gradient_accumulation_steps') or '-':>5} "
                f"{x.get('wall_seconds') or '-':>7}  {x['status']} {x.get('error') or ''}"
            )
    return "\n".join(lines)


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.3f}"


def _baseline(results: list[dict], key: Any) -> float | None:
    """The mean over DDP's ranks of ``key(rank figures)`` (the baseline of the ratios)."""
    ddp = next((r for r in results if r["config"] == "ddp" and r["status"] == "ok"), None)
    if ddp is None:
        return None
    vals = [key(m) for m in ddp["per_rank"].values()]
    vals = [v for v in vals if v is not None]
    return sum(vals) / len(vals) if vals else None


HELD_TARGET = 0.55  # issue 22: FSDP2 and ZeRO-3 hold at most 0.55 of DDP's bytes per rank


def full_tables(results: list[dict], facts: dict[str, Any]) -> str:
    """Full fine-tuning: held bytes per rank against DDP's, the final save's memory growth
    per rank against 1/world of the model plus its largest layer, tokens/s against DDP."""
    mb = 2**20
    ok = [r for r in results if r["status"] == "ok"]
    base = _baseline(results, lambda m: held_total(m.get("held")))
    base_all = _baseline(results, lambda m: held_total(m.get("held"), with_buffers=True))
    head = (f"{'config':<11} {'rank':>4} {'params':>8} {'grads':>8} {'optim':>8} {'p+g+o':>8} "
            f"{'vs DDP':>7} {'target':>7} {'buffers':>8} {'all':>8} {'vs DDP':>7}")
    lines = [(f"held per rank after an optimizer step, MB (target: FSDP2 and ZeRO-3 p+g+o at "
             f"most {HELD_TARGET} of DDP's)"), head, "-" * len(head)]
    for r in ok:
        for rank, m in r["per_rank"].items():
            h = m.get("held") or {}
            tot, tot_all = held_total(h), held_total(h, with_buffers=True)
            verdict = ""
            if r["config"] != "ddp" and tot is not None and base:
                verdict = "ok" if tot / base <= HELD_TARGET else "OVER"
            lines.append(
                f"{r['config']:<11} {rank:>4} "
                + " ".join(f"{h.get(k, 0) / mb:>8.1f}" for k in ("params", "grads", "optimizer"))
                + f" {(tot or 0) / mb:>8.1f} {_ratio(tot, base):>7} {verdict:>7} "
                f"{h.get('buffers', 0) / mb:>8.1f} {(tot_all or 0) / mb:>8.1f} "
                f"{_ratio(tot_all, base_all):>7}"
            )
    head = (f"{'config':<11} {'rank':>4} {'RSS at start':>12} {'peak growth':>11} "
            f"{'anon':>8} {'file':>8} {'target':>8} {'growth/target':>13} {'save s':>7}")
    lines += ["", (f"final save per rank, MB: growth of resident memory over the save (exact "
              f"peak); anon = heap, file = mapped safetensors pages (sampled every 10 ms); "
              f"target = model/world + largest layer ({facts['model_bytes'] / mb:.1f}/world + "
              f"{facts['largest_layer_bytes'] / mb:.1f}), overhead not included"), head,
              "-" * len(head)]
    for r in ok:
        target = save_target(facts, r["world_size"] or 1)
        for rank, m in r["per_rank"].items():
            sv = m.get("save") or {}
            if not sv:
                continue
            growth = sv["rss_peak"] - sv["rss_begin"]
            lines.append(
                f"{r['config']:<11} {rank:>4} {sv['rss_begin'] / mb:>12.1f} {growth / mb:>11.1f} "
                f"{(sv['anon_peak_sampled'] - sv['anon_begin']) / mb:>8.1f} "
                f"{(sv['file_peak_sampled'] - sv['file_begin']) / mb:>8.1f} "
                f"{target / mb:>8.1f} {growth / target:>13.3f} {sv['seconds']:>7.1f}"
            )
    lines += ["", ("held by name, MB, rank 0 (each storage counted once, under the first name "
                   "that reached it; 'views of' = a name whose tensors were only views into "
                   "storage already counted)")]
    for r in ok:
        first: dict[str, Any] = next(iter(r["per_rank"].values()), {})
        named = first.get("held_named") or {}
        if not named:
            continue
        lines.append(f"{r['config']}:")
        for name, e in sorted(named.items(), key=lambda kv: -kv[1]["bytes"]):
            lines.append(f"    {e['category']:<9} {e['bytes'] / mb:>9.1f}  {e['dtype']:<9} {name}")
        for name, owner in sorted((first.get("held_shared") or {}).items()):
            lines.append(f"    {'':<9} {'':>9}  {'':<9} {name}: views of {owner}")
    tps = next((r["tokens_per_second"] for r in ok if r["config"] == "ddp"), None)
    head = f"{'config':<11} {'tokens/s':>9} {'vs DDP':>7} {'train loss':>10} {'wall s':>7}"
    lines += ["", "throughput (timings depend on the machine's load: see the record)", head,
              "-" * len(head)]
    for r in ok:
        lines.append(f"{r['config']:<11} {r['tokens_per_second'] or 0:>9.1f} "
                     f"{_ratio(r['tokens_per_second'], tps):>7} "
                     f"{r['train_loss'] or 0:>10.4f} {r['wall_seconds']:>7}")
    return "\n".join(lines)

"""core.train.probe's byte accounting and save measurement, on plain tensors in this process
(the sharded cases run for real in bench/sharding.py --method full)."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from core.train.probe import held_bytes, held_report
from testkit.launch import REPO_ROOT, trainer_env


def trained(model: torch.nn.Module) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    return opt


def test_adam_holds_params_grads_and_two_moments() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = trained(model)
    n = sum(p.numel() for p in model.parameters()) * 4
    assert held_bytes(model, opt) == {"params": n, "grads": n, "optimizer": 2 * n, "buffers": 0}


def test_tied_and_viewed_storage_counts_once() -> None:
    # Two layers' weights as views into one flat buffer (as ZeRO's flat partitions are),
    # and a frozen layer without gradient or optimizer state.
    flat = torch.zeros(2 * 8 * 8)
    a, b, frozen = torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(8, 8, bias=False), \
        torch.nn.Linear(8, 8, bias=False)
    a.weight.data, b.weight.data = flat[:64].view(8, 8), flat[64:].view(8, 8)
    frozen.weight.requires_grad_(False)
    model = torch.nn.Sequential(a, b, frozen)
    opt = torch.optim.AdamW([a.weight, b.weight], lr=1e-3)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    held = held_bytes(model, opt)
    assert held["params"] == flat.nbytes + 64 * 4  # the flat buffer once, the frozen weight
    assert held["grads"] == 2 * 64 * 4
    assert held["optimizer"] == 2 * 2 * 64 * 4


def test_each_buffer_is_named_and_a_view_names_what_it_shares() -> None:
    # A wrapper keeping a second reference to the master (as DeepSpeed's optimizer keeps its
    # flat groups): named once, under the name that reached it first; the other is a view.
    model = torch.nn.Linear(8, 8, bias=False)
    opt = trained(model)
    opt.master = [model.weight]  # type: ignore[attr-defined]
    opt.bucket = torch.zeros(10)  # type: ignore[attr-defined]
    report = held_report(model, opt)
    assert report["named"] == {
        "param": {"category": "params", "bytes": 256, "dtype": "float32"},
        "param.grad": {"category": "grads", "bytes": 256, "dtype": "float32"},
        "AdamW.state[exp_avg]": {"category": "optimizer", "bytes": 256, "dtype": "float32"},
        "AdamW.state[exp_avg_sq]": {"category": "optimizer", "bytes": 256, "dtype": "float32"},
        "AdamW.bucket": {"category": "buffers", "bytes": 40, "dtype": "float32"},
    }
    assert report["shared"] == {"AdamW.master": "param"}
    assert report["held"] == held_bytes(model, opt)


# In a process of its own: in the suite's process, whatever another test left behind (cyclic
# garbage holding tensors, a thread still winding down) may be freed inside the block, when
# the sampler thread's allocations trigger the garbage collector. The resident set then falls
# by as much as the buffer adds, and the peak over the start says nothing of the buffer.
SAVE_PEAK_OF_A_FREED_BUFFER = """
import json
import torch
from core.train.probe import SavePeak

with SavePeak() as peak:
    big = torch.ones(64 * 2**20 // 4)  # 64 MB, touched
    del big
print(json.dumps(peak.result))
"""


def test_save_peak_sees_a_buffer_freed_before_the_end() -> None:
    proc = subprocess.run([sys.executable, "-c", SAVE_PEAK_OF_A_FREED_BUFFER], cwd=REPO_ROOT,
                          env=trainer_env(), capture_output=True, text=True, check=False,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.splitlines()[-1])
    assert r["rss_peak_exact"]
    assert r["rss_peak"] - r["rss_begin"] >= 60 * 2**20
    assert r["rss_end"] - r["rss_begin"] < 32 * 2**20

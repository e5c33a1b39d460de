"""GPU check of the fused LM head (core/train/loss.py): on CUDA TRL's Triton kernel folds
the head's tiles, a path the CPU tests (tests/core/train/test_loss.py) never take.

    python -m bench.gpu_loss_check            # exits 1 if any comparison is off

A Llama (hidden 256, 2 layers, a 32,000-token head) + LoRA r=16 on all linear layers, on
one CUDA device: a padded completion-only batch and a packed one, in float32 and under
bfloat16 autocast. For each: the loss and every LoRA gradient from the fused head against
the plain head (full logits, transformers' ForCausalLMLoss), and the peak memory each path
allocated over the forward + backward. Prints one line per case.
"""

from __future__ import annotations

from typing import Any

import torch

from cli.demo_assets import tiny_llama_config
from core.data.collator import PadCollator
from core.data.packing import collate_packed, model_inputs, pack_examples
from core.data.tokenize import IGNORE_INDEX
from core.train.loss import add_sft_lm_head

VOCAB = 32000
# bf16 matmuls differ between a tiled and a whole-vocabulary head by their rounding alone.
TOLERANCE = {torch.float32: (1e-4, 1e-3), torch.bfloat16: (2e-2, 5e-2)}


def model() -> Any:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(tiny_llama_config(vocab_size=VOCAB, hidden_size=256,
                                              intermediate_size=1024, pad_token_id=0))
    m = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    for name, p in m.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    add_sft_lm_head(m)
    return m.cuda()


def examples(n: int) -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        prompt = torch.randint(3, VOCAB, (200 + 37 * i,), generator=g).tolist()
        answer = torch.randint(3, VOCAB, (8 + i,), generator=g).tolist()
        out.append({"input_ids": prompt + answer, "labels": [IGNORE_INDEX] * len(prompt) + answer})
    return out


def run(m: Any, batch: dict[str, Any], fused: bool, dtype: torch.dtype) -> tuple[Any, ...]:
    m.zero_grad()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    extra = {"fused_lm_head": True} if fused else {}
    with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        loss = m(**batch, **extra).loss
    loss.backward()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - before) / 2**20
    grads = {n: p.grad.float().clone() for n, p in m.named_parameters() if p.requires_grad}
    return loss.detach().float(), grads, peak


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    m = model()
    padded = {k: v.cuda() for k, v in PadCollator(0)(examples(8)).items()}
    packed_rows = pack_examples(examples(8), max_len=2048)
    packed = model_inputs(collate_packed(packed_rows, 0, "mask"), "mask", torch.float32)
    packed = {k: v.cuda() if torch.is_tensor(v) else v for k, v in packed.items()}
    ok = True
    for name, batch in (("padded", padded), ("packed", packed)):
        for dtype in (torch.float32, torch.bfloat16):
            plain_loss, plain_grads, plain_peak = run(m, batch, False, dtype)
            fused_loss, fused_grads, fused_peak = run(m, batch, True, dtype)
            atol, rtol = TOLERANCE[dtype]
            loss_ok = torch.allclose(fused_loss, plain_loss, atol=atol, rtol=rtol)
            worst = max(
                float((fused_grads[k] - g).abs().max() / g.abs().max().clamp(min=1e-12))
                for k, g in plain_grads.items()
            )
            grads_ok = worst <= rtol * 10
            ok = ok and loss_ok and grads_ok
            print(
                f"{name} {str(dtype).removeprefix('torch.')}: loss plain {plain_loss:.6f} "
                f"fused {fused_loss:.6f} ({'ok' if loss_ok else 'DIFFERS'}); worst gradient "
                f"difference {worst:.2e} of its max ({'ok' if grads_ok else 'DIFFERS'}); peak "
                f"MB plain {plain_peak:.1f} fused {fused_peak:.1f}"
            )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

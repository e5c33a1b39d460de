"""Logits only where the loss is: the LM head applied at the positions that carry a label.

Why. A causal LM's head multiplies every hidden state by the (vocab x hidden) output matrix:
with a 32k-128k vocabulary it is the largest matmul of a small model's step and the largest
activation of any model's step (batch x seq x vocab logits, in fp32 for the loss). With the
loss on completions or assistant turns only, most positions carry no label (21 of 424 in a
typical batch of the trainer benchmark), so most of that work and memory is thrown away.

How. TRL 1.16 ships a fused LM head (``trl.trainer.utils.add_fused_lm_head``): called with
``fused_lm_head=True``, the patched forward runs the backbone, gathers the hidden states
whose next-token label is not -100, and computes their log-probabilities with
``ChunkedLogProbFunction``: the head in (token x vocab) tiles with an online log-sum-exp, the
tiles recomputed in backward, so the logits memory is bounded by one tile whatever the
sequence length (a Triton kernel folds the tiles on CUDA; torch ops elsewhere). Its
loss is ``-sum(log p(label)) / num_items_in_batch``: transformers' ``ForCausalLMLoss``
(fp32 cross-entropy summed over the labelled positions, divided by the label count of the
whole accumulated batch), so gradient accumulation normalises exactly as the plain path.
TRL's own DPO, KTO and GRPO trainers compute their log-probabilities through the same head.

One thing is changed: on devices without Triton (CPU), TRL scores *every* position and
masks afterwards (``compact = _use_triton(device)``), to keep tile shapes fixed for backends
that recompile on a new shape (XLA/Neuron). Neither CPU nor CUDA recompiles, so
``compact_lm_head`` makes the head score only the labelled positions there too. It rebinds
one private name in ``trl.trainer.utils``; tests/core/train/test_loss.py pins that TRL still
decides through it, so a TRL upgrade cannot silently bring the full head back.

Where the fused head is not used (``plain_reason``, core/model/lm_head.py, says why, and the
started event shows it): full-sequence loss (``text``: every position carries a label,
nothing to skip), non-causal tasks, prompt-learning PEFT methods (virtual tokens shift the
positions), an LM head that is itself trained (an adapter or a saved copy on ``lm_head``:
the fused head multiplies by ``lm_head.weight`` directly), FSDP1 (no FSDP1 run is possible
on CPU, so it is unverified; TRL's head handles FSDP2's and ZeRO-3's sharded weights,
below), and an operator who asks for the plain head (``runtime.lm_head``, a baseline to
compare against).

Sharded weights. The head reads ``lm_head.weight`` itself instead of calling the module, so
it must see the whole matrix. It runs inside the wrapped model's forward (JobTrainer calls
the wrapped model; TRL's trainers too): under FSDP2 the LM head is a parameter of the root
module (only the decoder layers are wrapped apart), whose forward all-gathers it, and a head
still sharded (a DTensor) is gathered by TRL with ``full_tensor()``, through autograd; under
ZeRO-3 TRL gathers the partitioned weight around the forward and the recomputing backward
(``maybe_gather_lm_head_ctx``). The multi-process tests compare fused and plain runs under
DDP, FSDP2 and ZeRO-3: same losses, same adapter.

Objectives (``compact_lm_head``): DPO, KTO and GRPO compute their log-probabilities through
TRL's fused head (GRPO's at the completion positions only: prompt and padding get -100), so
compaction alone makes them score only those positions. ORPO stays plain: TRL's ORPO trainer
takes the full logits, and its loss and metrics need nearly all of them anyway (its NLL term
is over every real position of the chosen rows, prompt included, and its ``logits/chosen``
and ``logits/rejected`` metrics average every position, padding included).
"""

from __future__ import annotations

from typing import Any

import torch

# Device types on which scoring only the labelled positions is safe: shapes that change from
# batch to batch cost nothing there (eager kernels; no recompilation).
_COMPACT_DEVICES = ("cpu", "cuda", "xpu", "mps")
# What SFT needs from the fused head: the per-token log-probabilities, nothing else.
SFT_OUTPUTS = ("log_probs",)
ORPO_REASON = (
    "TRL's ORPO trainer takes the full logits: its NLL term covers every position of the "
    "chosen rows and its logits metrics average every position"
)


def compact_lm_head(objective: str = "sft", plain: bool = False) -> str:
    """Make TRL's fused LM head score only the labelled positions on CPU and CUDA alike, or
    (``plain``: ``runtime.lm_head`` plain) restore TRL's own choice; returns the LM head path
    of a TRL ``objective`` (dpo, kto and grpo use TRL's fused head, orpo the full logits).

    Idempotent; affects only the choice in ``add_fused_lm_head``'s forward (the kernels in
    ``trl.kernels.chunked_logprob`` keep their own Triton-or-torch choice)."""
    import trl.trainer.utils as trl_utils

    current = trl_utils._use_triton
    original = getattr(current, "_ftune_original", current)
    if plain:
        trl_utils._use_triton = original
    elif current is original:

        def compact(device: torch.device) -> bool:
            return device.type in _COMPACT_DEVICES or bool(original(device))

        compact._ftune_original = original  # type: ignore[attr-defined]
        trl_utils._use_triton = compact
    if objective == "orpo":
        return f"plain ({ORPO_REASON})"
    if plain:
        return "fused, every position (runtime.lm_head plain)"
    return "fused"


def add_sft_lm_head(model: Any) -> None:
    """Patch ``model`` (a PeftModel or a plain causal LM) so that
    ``model(..., labels=..., fused_lm_head=True)`` returns the loss from the labelled
    positions only (see the module docstring)."""
    from trl.trainer.utils import add_fused_lm_head

    compact_lm_head()
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    add_fused_lm_head(base, outputs=SFT_OUTPUTS)

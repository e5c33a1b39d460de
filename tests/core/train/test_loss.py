"""The fused LM head (core/train/loss.py) against the full computation: the same loss,
gradients and metrics, on a tiny Llama + LoRA, with padding, packing and gradient
accumulation through the real Trainer."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from core.data.collator import PadCollator
from core.data.packing import collate_packed, model_inputs, pack_examples
from core.data.tokenize import IGNORE_INDEX
from core.train.loss import add_sft_lm_head, compact_lm_head
from tests.utils.tiny import tiny_llama_config

VOCAB = 512
ATOL = 1e-5


def _lora_llama(seed: int = 0) -> Any:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(vocab_size=VOCAB, pad_token_id=0))
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
    peft_model = get_peft_model(model, config)
    # LoRA's B starts at zero, which would leave the A gradients zero: give it values.
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return peft_model


def _examples(n: int, seed: int = 1) -> list[dict[str, list[int]]]:
    """Prompt + completion examples of varied lengths; loss on the completion only."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(3, VOCAB, (5 + 3 * i,), generator=g).tolist()
        completion = torch.randint(3, VOCAB, (2 + (i % 3),), generator=g).tolist()
        out.append(
            {
                "input_ids": prompt + completion,
                "labels": [IGNORE_INDEX] * len(prompt) + completion,
            }
        )
    return out


def _loss_and_grads(model: Any, batch: dict[str, Any], fused: bool, n_items: Any) -> Any:
    model.zero_grad()
    extra = {"fused_lm_head": True} if fused else {}
    if n_items is not None:
        extra["num_items_in_batch"] = n_items
    loss = model(**batch, **extra).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads


def _assert_same(model: Any, batch: dict[str, Any], n_items: Any) -> None:
    plain_loss, plain_grads = _loss_and_grads(model, batch, False, n_items)
    fused_loss, fused_grads = _loss_and_grads(model, batch, True, n_items)
    torch.testing.assert_close(fused_loss, plain_loss, atol=ATOL, rtol=1e-5)
    assert plain_grads.keys() == fused_grads.keys() and plain_grads
    for name, g in plain_grads.items():
        torch.testing.assert_close(fused_grads[name], g, atol=ATOL, rtol=1e-4, msg=name)


@pytest.fixture(scope="module")
def model() -> Any:
    m = _lora_llama()
    add_sft_lm_head(m)
    return m


def test_trl_still_decides_compaction_through_the_rebound_name() -> None:
    # compact_lm_head rebinds trl.trainer.utils._use_triton: if TRL stops consulting it,
    # the CPU would silently go back to scoring every position.
    import trl.trainer.utils as trl_utils

    source = inspect.getsource(trl_utils.add_fused_lm_head)
    assert "compact = _use_triton(hidden_states.device)" in source
    compact_lm_head()
    assert trl_utils._use_triton(torch.device("cpu")) is True


def test_runtime_lm_head_plain_gives_trl_its_own_choice_back() -> None:
    import trl.trainer.utils as trl_utils

    assert compact_lm_head("dpo", plain=True) == "fused, every position (runtime.lm_head plain)"
    assert trl_utils._use_triton(torch.device("cpu")) is False  # TRL: every position on CPU
    assert compact_lm_head("dpo") == "fused"
    assert compact_lm_head("kto") == "fused"  # idempotent: wrapped once, not twice
    assert trl_utils._use_triton(torch.device("cpu")) is True
    assert compact_lm_head("orpo").startswith("plain (TRL's ORPO trainer takes the full logits")


def test_padded_batch_mean_loss_and_grads_equal_the_plain_head(model: Any) -> None:
    batch = PadCollator(0)(_examples(4))
    _assert_same(model, batch, n_items=None)


def test_num_items_in_batch_normalises_as_the_plain_head(model: Any) -> None:
    # Under gradient accumulation the Trainer passes the label count of the whole
    # accumulated batch: both paths divide the summed loss by it.
    batch = PadCollator(0)(_examples(3))
    _assert_same(model, batch, n_items=torch.tensor(57))


def test_packed_rows_equal_the_plain_head(model: Any) -> None:
    rows = pack_examples(_examples(6), max_len=48)
    batch = model_inputs(collate_packed(rows, 0, "mask"), "mask", torch.float32)
    _assert_same(model, batch, n_items=None)


@contextmanager
def _rows_into_head() -> Iterator[list[int]]:
    """The number of positions each call of TRL's chunked head was given."""
    from trl.kernels import ChunkedLogProbFunction

    seen: list[int] = []
    original = ChunkedLogProbFunction.apply

    def spy(hidden: torch.Tensor, *args: Any) -> Any:
        seen.append(hidden.shape[0])
        return original(hidden, *args)

    ChunkedLogProbFunction.apply = spy  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        ChunkedLogProbFunction.apply = original  # type: ignore[method-assign]


def test_only_labelled_positions_reach_the_head(model: Any) -> None:
    batch = PadCollator(0)(_examples(4))
    with _rows_into_head() as seen:
        model(**batch, fused_lm_head=True)
    labelled = int(batch["labels"][:, 1:].ne(IGNORE_INDEX).sum())
    assert seen == [labelled]


def test_preference_metrics_equal_the_full_logits() -> None:
    # TRL's DPO/KTO trainers read log-probs, entropy, mean logits and top-1 hits from the
    # fused head: with compaction on CPU they must equal the full logits' values.
    from trl.trainer.utils import add_fused_lm_head

    compact_lm_head()
    m = _lora_llama(seed=3)
    add_fused_lm_head(m.get_base_model(), outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    batch = PadCollator(0)(_examples(3, seed=5))
    labels = batch.pop("labels")
    out = m(**batch, labels=labels, fused_lm_head=True)
    logits = m(**batch).logits[:, :-1].float()
    target = labels[:, 1:]
    mask = target != IGNORE_INDEX
    logp = torch.log_softmax(logits, -1)
    want = logp.gather(-1, target.clamp(min=0)[..., None])[..., 0]
    entropy = -(logp.exp() * logp).sum(-1)
    top1 = logits.argmax(-1) == target
    torch.testing.assert_close(out.log_probs[mask], want[mask], atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(out.entropy[mask], entropy[mask], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.mean_logits[mask], logits.mean(-1)[mask], atol=ATOL, rtol=1e-5)
    assert torch.equal(out.is_top1[mask], top1[mask])
    assert not out.log_probs[~mask].any()


def _train(fused: bool, tmp: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    from transformers import TrainingArguments

    from core.data.tokenize import DataStats, TokenizedDataset
    from core.train.trainer import JobTrainer

    m = _lora_llama(seed=7)
    if fused:
        add_sft_lm_head(m)
    args = TrainingArguments(
        output_dir=str(tmp / ("fused" if fused else "plain")),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=3,
        max_steps=3,
        learning_rate=1e-2,
        logging_steps=1,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        data_seed=0,
        label_names=["labels"],
        remove_unused_columns=False,
    )
    data = TokenizedDataset(_examples(18, seed=11), DataStats())
    trainer = JobTrainer(
        model=m, args=args, train_dataset=data, data_collator=PadCollator(0), fused_lm_head=fused
    )
    with _rows_into_head() as seen:
        trainer.train()
    assert len(seen) == (9 if fused else 0)  # 3 steps x 3 micro-batches
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    weights = {n: p.detach().clone() for n, p in m.named_parameters() if p.requires_grad}
    return losses + norms, weights


def test_training_with_gradient_accumulation_equals_the_plain_head(tmp_path: Path) -> None:
    # Micro-batches with different label counts: only an exact num_items_in_batch
    # normalisation gives the same logged losses, gradient norms and trained weights.
    plain_logs, plain_weights = _train(False, tmp_path)
    fused_logs, fused_weights = _train(True, tmp_path)
    assert len(plain_logs) == 6
    assert fused_logs == pytest.approx(plain_logs, rel=1e-4, abs=1e-5)
    for name, w in plain_weights.items():
        torch.testing.assert_close(fused_weights[name], w, atol=1e-5, rtol=1e-4, msg=name)


# ---------------------------------------------------------------------------- GRPO

GRPO_TEMPERATURE = 0.7


def _grpo_trainer(model_dir: Path, tmp: Path) -> Any:
    """TRL's GRPOTrainer as core/train/grpo.py builds it (LoRA policy, fused head added by
    TRL), with the compaction on as the recipe turns it on."""
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    compact_lm_head("grpo")
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    model = get_peft_model(
        base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
    )
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    args = GRPOConfig(
        output_dir=str(tmp), use_cpu=True, report_to="none", per_device_train_batch_size=4,
        num_generations=2, max_completion_length=8, temperature=GRPO_TEMPERATURE, beta=0.1,
        loss_type="dapo", bf16=False, gradient_checkpointing=False, disable_dropout=True,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "a b c"}] * 4),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
    )
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def _grpo_inputs(vocab: int) -> dict[str, torch.Tensor]:
    """Four answers: prompts left-padded, answers right-padded (as TRL batches them), with
    log-probs of an older policy and of the reference for the ratio and the KL."""
    g = torch.Generator().manual_seed(4)
    prompt_lens, answer_lens, p, c = [5, 3, 6, 4], [7, 2, 5, 1], 6, 7
    prompt_ids = torch.zeros(4, p, dtype=torch.long)
    prompt_mask = torch.zeros(4, p, dtype=torch.long)
    completion_ids = torch.zeros(4, c, dtype=torch.long)
    completion_mask = torch.zeros(4, c, dtype=torch.long)
    for i, (lp, lc) in enumerate(zip(prompt_lens, answer_lens, strict=True)):
        prompt_ids[i, p - lp:] = torch.randint(3, vocab, (lp,), generator=g)
        prompt_mask[i, p - lp:] = 1
        completion_ids[i, :lc] = torch.randint(3, vocab, (lc,), generator=g)
        completion_mask[i, :lc] = 1
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor([0.9, -0.9, 0.4, -0.4]),
        "old_per_token_logps": -6.0 - 0.1 * torch.rand(4, c, generator=g),
        "ref_per_token_logps": -6.0 - 0.1 * torch.rand(4, c, generator=g),
        "num_items_in_batch": completion_mask.sum(),
    }


def _full_logps(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    compute_entropy: bool = False,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor | None, None]:
    """GRPO's log-probs and entropies from the full logits (the model's own forward)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    logits = logits[:, -logits_to_keep - 1:-1].float() / GRPO_TEMPERATURE
    logp = torch.log_softmax(logits, -1)
    per_token = logp.gather(-1, input_ids[:, -logits_to_keep:, None])[..., 0]
    entropy = -(logp.exp() * logp).sum(-1) if compute_entropy else None
    return per_token, entropy, None


def test_grpo_log_probs_are_computed_at_answer_tokens_only(
    tiny_causal_lm: Path, tmp_path: Path
) -> None:
    trainer = _grpo_trainer(tiny_causal_lm, tmp_path)
    model = trainer.model
    x = _grpo_inputs(model.config.vocab_size)
    ids = torch.cat([x["prompt_ids"], x["completion_ids"]], 1)
    mask = torch.cat([x["prompt_mask"], x["completion_mask"]], 1)
    keep = x["completion_ids"].shape[1]
    with torch.no_grad(), _rows_into_head() as seen:
        logps, entropy, _ = trainer._get_per_token_logps_and_entropies(
            model, ids, mask, keep, compute_entropy=True
        )
        want_logps, want_entropy, _ = _full_logps(model, ids, mask, keep, compute_entropy=True)
    answer = x["completion_mask"].bool()
    assert seen == [int(answer.sum())]  # no prompt, no padding position reaches the head
    torch.testing.assert_close(logps[answer], want_logps[answer], atol=ATOL, rtol=1e-5)
    assert entropy is not None and want_entropy is not None
    torch.testing.assert_close(entropy[answer], want_entropy[answer], atol=1e-4, rtol=1e-4)
    assert not logps[~answer].any()


def test_grpo_loss_and_lora_gradients_equal_the_full_logits(
    tiny_causal_lm: Path, tmp_path: Path
) -> None:
    trainer = _grpo_trainer(tiny_causal_lm, tmp_path)
    model = trainer.model
    model.train()
    x = _grpo_inputs(model.config.vocab_size)

    def loss_and_grads() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad()
        loss = trainer._compute_loss(model, x)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        return loss.detach(), grads

    with _rows_into_head() as seen:
        fused_loss, fused_grads = loss_and_grads()
    assert seen == [int(x["completion_mask"].sum())]
    trainer._get_per_token_logps_and_entropies = _full_logps
    plain_loss, plain_grads = loss_and_grads()
    torch.testing.assert_close(fused_loss, plain_loss, atol=ATOL, rtol=1e-5)
    assert plain_grads.keys() == fused_grads.keys() and plain_grads
    for name, grad in plain_grads.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(fused_grads[name], grad, atol=ATOL, rtol=1e-4, msg=name)

"""The model card (README.md) of a final adapter or model: what was trained, on what data,
how it ended, and how to load it. Written by the trainer beside the weights it describes
(core/train/adapter.py, core/train/full_model.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from core.spec import AUTO_MODEL_CLASS
from core.train.adapter import LABELS_FILE

if TYPE_CHECKING:
    from core.train.callbacks import JobCallback
    from core.train.job import Job


def run_model_card(job: Job, result: Any, *, state: Any, info: dict[str, Any], data: Any,
                   callback: JobCallback) -> str:
    """The card of a finished run: ``state`` is the Trainer's, ``info`` the started event's
    fields, ``data`` the tokenized datasets, ``result`` what ``Trainer.train`` returned."""
    spec, rt, st = job.spec, job.runtime, data.train.stats
    return model_card(
        title=spec.name or f"ftune job {rt.job_id or job.dir.root.name}",
        base_model=spec.model.name_or_path,
        revision=spec.model.revision,
        task=spec.model.task,
        method={
            **spec.peft.model_dump(mode="json"),
            **(
                {"target_modules": info["target_modules"]}
                if info.get("target_modules") is not None
                else {}
            ),
        },
        data={
            "dataset format": (info.get("data") or {}).get("format")
            or spec.dataset.format,
            "objective": spec.training.objective,
            "training rows": st.rows,
            "training examples": st.examples,
            "training tokens": st.tokens,
            "truncated examples": st.truncated,
            **({"packed rows": st.packed_rows} if st.packed_rows is not None else {}),
            "max_seq_length": spec.dataset.max_seq_length,
            "evaluation rows": data.eval.stats.rows if data.eval else None,
        },
        training={
            "steps": int(state.global_step),
            "total steps": int(state.max_steps),
            "epochs": round(float(state.epoch or 0.0), 3),
            "learning rate": spec.training.learning_rate,
            "scheduler": spec.training.lr_scheduler_type,
            "effective batch size": info["effective_batch_size"],
            "processes": info["world_size"],
            "strategy": info["strategy"],
            "mixed precision": spec.training.mixed_precision,
        },
        results={
            "final train loss (last log)": callback.last_logs.get("loss"),
            "mean train loss": result.training_loss,
            "final eval loss": callback.last_eval.get("eval_loss"),
            "final eval accuracy": callback.last_eval.get("accuracy"),
            "final eval F1": callback.last_eval.get("f1"),
        },
        labels=data.labels,
        quantization=_quantization_card(spec),
        merged=spec.training.export_merged,
        parameters=info["trainable_params"] if spec.peft.method == "full" else None,
    )


def _quantization_card(spec: Any) -> dict[str, Any] | None:
    q = spec.model.quantization
    if q is None:
        return None
    return {
        **q.model_dump(mode="json"),
        "compute_dtype": spec.model.compute_dtype(spec.training.mixed_precision),
    }


def model_card(
    *,
    title: str,
    base_model: str,
    revision: str | None,
    task: str,
    method: dict[str, Any],
    data: dict[str, Any],
    training: dict[str, Any],
    results: dict[str, Any],
    labels: list[str] | None,
    quantization: dict[str, Any] | None = None,
    merged: bool = False,
    parameters: int | None = None,
) -> str:
    """A README.md that says what this adapter is and how to use it.

    ``quantization``: spec.model.quantization of a QLoRA run (the base it trained on);
    ``merged``: a merged model was exported too (always into the full-precision base);
    ``parameters``: a full fine-tune (method full) trained these many, and the directory
    is a whole model, not an adapter."""
    auto = AUTO_MODEL_CLASS[task]
    method_name = str(method.get("method", "lora"))
    params = ", ".join(f"{k}={v}" for k, v in method.items() if k != "method")
    if method_name == "full":
        params = f"every parameter: {parameters:,}" if parameters is not None else "every parameter"

    def fmt(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else ("-" if v is None else str(v))

    full = method_name == "full"
    lines = [
        "---",
        f"base_model: {base_model}",
        f"library_name: {'transformers' if full else 'peft'}",
        f"tags: [ftune, {method_name}, {task}]",
        "---",
        "",
        f"# {title}",
        "",
        (f"`{base_model}` fine-tuned in full (every parameter trained)" if full
         else f"A {method_name} adapter for `{base_model}`")
        + (f" (revision `{revision}`)" if revision else "")
        + f", task `{task}`, trained by ftune.",
        "",
        "## Training",
        "",
        "| | |",
        "| --- | --- |",
        f"| base model | `{base_model}` |",
        f"| method | {method_name} ({params}) |",
    ]
    if quantization is not None:
        lines.append(f"| base quantization | {_quantization_text(quantization)} |")
    lines += [f"| {k} | {fmt(v)} |" for k, v in data.items()]
    lines += [f"| {k} | {fmt(v)} |" for k, v in training.items()]
    lines += [f"| {k} | {fmt(v)} |" for k, v in results.items()]
    if labels is not None:
        lines += ["", "## Labels", "", "| id | label |", "| --- | --- |"]
        lines += [f"| {i} | {n} |" for i, n in enumerate(labels)]
        lines += ["", f"The same mapping is in `{LABELS_FILE}`."]
    if full:
        return "\n".join([*lines, "", "## How to load", "", "```python",
                          f"from transformers import AutoTokenizer, {auto}", "",
                          'path = "path/to/this/directory"',
                          f"model = {auto}.from_pretrained(path)",
                          "tokenizer = AutoTokenizer.from_pretrained(path)", "```", ""])
    load_base = f'{auto}.from_pretrained("{base_model}")'
    if labels is not None:
        load_base = (
            f'{auto}.from_pretrained(\n    "{base_model}",\n    num_labels=len(labels["id2label"]),\n'
            '    id2label={int(k): v for k, v in labels["id2label"].items()},\n'
            '    label2id=labels["label2id"],\n)'
        )
    lines += [
        "",
        "## How to load",
        "",
        "```python",
        *(["import json", ""] if labels is not None else []),
        "from peft import PeftModel",
        f"from transformers import AutoTokenizer, {auto}",
        "",
        'adapter = "path/to/this/directory"',
        *(
            [f'labels = json.load(open(f"{{adapter}}/{LABELS_FILE}"))']
            if labels is not None
            else []
        ),
        f"base = {load_base}",
        *(
            [
                "# peft 0.21 with transformers 5.x needs this alias for encoder-decoder models:",
                "base._prepare_encoder_decoder_kwargs_for_generation = (",
                "    base._prepare_text_encoder_decoder_kwargs_for_generation",
                ")",
            ]
            if task == "seq2seq_lm"
            else []
        ),
        "model = PeftModel.from_pretrained(base, adapter)",
        "tokenizer = AutoTokenizer.from_pretrained(adapter)",
        "```",
        "",
        "`model.merge_and_unload()` folds a LoRA/IA3 adapter into the base weights for inference.",
        "",
    ]
    if quantization is not None:
        lines += [
            "## Quantized base (QLoRA)",
            "",
            (
                f"This adapter was trained on a {_quantization_text(quantization)} base "
                "(bitsandbytes); only the frozen base was quantized, the adapter is float32. "
                "It loads on the full-precision base as above, or on the same quantized base "
                "(`quantization_config=BitsAndBytesConfig(...)` in `from_pretrained`)."
            ),
            "",
        ]
        if merged:
            from core.train.merge import MERGED_DIR

            lines += [
                (
                    f"The merged model (`{MERGED_DIR}/`) is this adapter merged into the "
                    "full-precision base, not into the quantized weights it trained on."
                ),
                "",
            ]
    return "\n".join(lines)


def _quantization_text(q: dict[str, Any]) -> str:
    if q.get("load_in") == "8bit":
        return "8-bit (LLM.int8())"
    extra = ", double quantization" if q.get("double_quant") else ""
    compute = f", compute dtype {q['compute_dtype']}" if q.get("compute_dtype") else ""
    return f"4-bit {q.get('quant_type', 'nf4')}{compute}{extra}"

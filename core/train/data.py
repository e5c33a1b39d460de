"""Rows -> token ids + labels, per task and data format, and the collator that pads them.

Label conventions (what the loss sees):

* causal_lm: ``labels`` is ``input_ids`` with -100 where no loss is wanted; the model
  shifts by one internally, so label[i] is predicted from tokens[:i]. -100 is the ignore
  index of cross-entropy: those positions add nothing to the loss *or* to its denominator.
  text: every token; prompt_completion: completion tokens only (+ EOS, so the model learns
  to stop); chat: assistant turns only.
* seq2seq_lm: ``labels`` is the target; the model builds decoder inputs from it.
* seq_cls: ``labels`` is one class id per example.

An example with no loss token left (a prompt longer than max_seq_length, say) is dropped:
a batch made only of such examples would divide 0 by 0 and report a NaN loss.

Everything is tokenized once, in memory, on every rank (each rank then reads its own shard
through the Trainer's distributed sampler). With ``dataset.packing`` the causal-LM training
examples are then packed into rows of up to max_seq_length tokens (core/train/packing.py:
per-example positions and attention, so packing changes the speed, not the model); the
evaluation examples stay one per row, so eval loss means the same with and without packing.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from core.datafiles import DataFileError, DataProblem, check_rows, iter_rows
from core.spec import DatasetSpec, JobSpec
from core.train.failures import invalid_dataset, invalid_spec
from core.train.packing import Layout, collate_packed, pack_examples

IGNORE_INDEX = -100  # cross-entropy's ignore_index in transformers' loss functions
_BATCH = 1000  # rows per tokenizer call: the fast tokenizer parallelises within a call
_MAX_SHOWN = 5
_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


@dataclass
class DataStats:
    rows: int = 0  # rows read from the file(s)
    examples: int = 0  # examples kept for training
    tokens: int = 0  # input tokens of the kept examples (no padding)
    loss_tokens: int = 0  # tokens (or examples, for seq_cls) that carry a loss
    truncated: int = 0  # examples cut at dataset.max_seq_length
    dropped: int = 0  # examples with no loss token left after truncation
    dropped_rows: list[int] = field(default_factory=list)  # first few, 1-based file rows
    packed_rows: int | None = None  # dataset.packing: rows the examples were packed into

    def as_event(self) -> dict[str, int]:
        out: dict[str, int] = {
            "rows": self.rows,
            "examples": self.examples,
            "tokens": self.tokens,
            "loss_tokens": self.loss_tokens,
            "truncated": self.truncated,
            "dropped": self.dropped,
        }
        if self.packed_rows is not None:
            out["packed_rows"] = self.packed_rows
        return out


class TokenizedDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """A list of already tokenized examples (dicts of python lists / ints), or of packed rows
    (which also carry ``position_ids``)."""

    def __init__(self, examples: list[dict[str, Any]], stats: DataStats) -> None:
        self.examples = examples
        self.stats = stats

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.examples[i]


@dataclass
class Datasets:
    train: TokenizedDataset
    eval: TokenizedDataset | None
    labels: list[str] | None  # seq_cls: id -> name


# ---------------------------------------------------------------------------- reading


def read_checked_rows(
    path: Path,
    ds: DatasetSpec,
    what: str,
    max_decompressed_bytes: int | None,
    row_check: Callable[[dict[str, Any]], list[DataProblem]] | None = None,
) -> tuple[list[dict[str, Any]], list[str]]:
    """All rows of a file after checking that each has what the format needs.

    The check is the same one the API ran at submit time (core.datafiles.check_rows), so the
    trainer reports the same row/field problems if the file changed or the run is by hand.
    """
    if not path.exists():
        raise invalid_dataset(f"{what} data {path} does not exist")
    report = check_rows(
        path, ds, max_decompressed_bytes=max_decompressed_bytes, row_check=row_check
    )
    if report.problem_count:
        shown = "; ".join(str(p) for p in report.problems[:_MAX_SHOWN])
        more = report.problem_count - min(report.problem_count, _MAX_SHOWN)
        tail = f" (and {more} more)" if more > 0 else ""
        raise invalid_dataset(
            f"{what} data {path.name} does not fit dataset.format {ds.format}: "
            f"{report.problem_count} problem(s): {shown}{tail}"
        )
    try:
        rows = list(iter_rows(path, max_decompressed_bytes=max_decompressed_bytes))
    except DataFileError as e:
        raise invalid_dataset(f"{what} data {path.name}: {e}") from e
    return rows, report.labels


def split_for_eval(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic (train, eval) row indices: the same seed gives the same split on every
    rank and on every resume, so no eval row ever leaks into training."""
    k = max(1, round(n * fraction))
    if n - k < 1:
        raise invalid_dataset(
            f"dataset.eval_split {fraction} of {n} rows leaves no rows to train on"
        )
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return sorted(order[k:]), sorted(order[:k])


def _sorted_labels(names: Iterable[str]) -> list[str]:
    names = list(dict.fromkeys(names))
    # Integer labels sort as numbers so that "0".."10" keep their own value as id.
    if names and all(re.fullmatch(r"-?\d+", n) for n in names):
        return sorted(names, key=int)
    return sorted(names)


# ---------------------------------------------------------------------------- tokenizing


class _Tokenize:
    """Per-format tokenization into examples, with truncation and drop accounting."""

    def __init__(self, spec: JobSpec, tokenizer: Any, label2id: dict[str, int] | None) -> None:
        self.ds = spec.dataset
        self.task = spec.model.task
        self.tok = tokenizer
        self.max_len = spec.dataset.max_seq_length
        self.eos = tokenizer.eos_token_id
        self.label2id = label2id

    # -- helpers

    def _encode(self, texts: Sequence[str], special: bool) -> list[list[int]]:
        out: list[list[int]] = []
        for i in range(0, len(texts), _BATCH):
            enc = self.tok(list(texts[i : i + _BATCH]), add_special_tokens=special)
            out.extend(enc["input_ids"])
        return out

    def _with_eos(self, ids: list[int]) -> list[int]:
        if self.eos is not None and (not ids or ids[-1] != self.eos):
            return ids + [self.eos]
        return ids

    def _cut(self, ids: list[int], labels: list[int], stats: DataStats) -> tuple[list, list]:
        if len(ids) > self.max_len:
            stats.truncated += 1
            return ids[: self.max_len], labels[: self.max_len]
        return ids, labels

    def _keep_lm(
        self, out: list[dict[str, Any]], ids: list[int], labels: list[int], row: int, st: DataStats
    ) -> None:
        ids, labels = self._cut(ids, labels, st)
        # The model predicts labels[1:] (the first position has no context to predict from).
        n_loss = sum(1 for x in labels[1:] if x != IGNORE_INDEX)
        if n_loss == 0:
            st.dropped += 1
            if len(st.dropped_rows) < _MAX_SHOWN:
                st.dropped_rows.append(row)
            return
        st.tokens += len(ids)
        st.loss_tokens += n_loss
        out.append({"input_ids": ids, "labels": labels})

    # -- formats

    def __call__(self, rows: list[dict[str, Any]], row_numbers: list[int]) -> TokenizedDataset:
        st = DataStats(rows=len(rows))
        fmt, ds = self.ds.format, self.ds
        out: list[dict[str, Any]] = []
        if self.task == "causal_lm" and fmt == "text":
            for ids, row in zip(self._encode([r[ds.text_field] for r in rows], True), row_numbers):
                ids = self._with_eos(ids)
                self._keep_lm(out, ids, list(ids), row, st)
        elif self.task == "causal_lm" and fmt == "prompt_completion":
            # Prompt and completion are tokenized separately so the boundary is exact
            # (tokenizing the concatenation could merge the last prompt and first completion
            # characters into one token that belongs to neither).
            prompts = self._encode([r[ds.prompt_field] for r in rows], True)
            comps = self._encode([r[ds.completion_field] for r in rows], False)
            for p, c, row in zip(prompts, comps, row_numbers):
                c = self._with_eos(c)
                self._keep_lm(out, p + c, [IGNORE_INDEX] * len(p) + c, row, st)
        elif self.task == "causal_lm" and fmt == "chat":
            for r, row in zip(rows, row_numbers):
                ids, mask = self.chat(_messages(r, ds.messages_field, row))
                labels = [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]
                self._keep_lm(out, ids, labels, row, st)
        elif self.task == "seq2seq_lm" and fmt in ("seq2seq", "prompt_completion"):
            src_f, tgt_f = (
                (ds.input_field, ds.target_field)
                if fmt == "seq2seq"
                else (ds.prompt_field, ds.completion_field)
            )
            srcs = self._encode([r[src_f] for r in rows], True)
            tgts = self._encode([r[tgt_f] for r in rows], True)
            for s, t in zip(srcs, tgts):
                s, t = self._with_eos(s), self._with_eos(t)
                cut = len(s) > self.max_len or len(t) > self.max_len
                st.truncated += int(cut)
                s, t = s[: self.max_len], t[: self.max_len]
                st.tokens += len(s)
                st.loss_tokens += len(t)
                out.append({"input_ids": s, "labels": t})
        elif self.task == "seq_cls" and fmt == "classification":
            assert self.label2id is not None
            texts = [r[ds.text_field] for r in rows]
            encoded = self._encode(texts, True)
            for i, (r, ids, row) in enumerate(zip(rows, encoded, row_numbers)):
                name = str(r[ds.label_field])
                if name not in self.label2id:
                    raise invalid_dataset(
                        f"row {row}, field {ds.label_field!r}: label {name!r} does not occur "
                        f"in the training data (known: {', '.join(self.label2id)})"
                    )
                if len(ids) > self.max_len:
                    # Re-encode with the tokenizer's own truncation so closing special
                    # tokens ([SEP], </s>) survive the cut.
                    st.truncated += 1
                    ids = self.tok(texts[i], truncation=True, max_length=self.max_len)["input_ids"]
                st.tokens += len(ids)
                st.loss_tokens += 1
                out.append({"input_ids": ids, "labels": self.label2id[name]})
        else:  # spec validation forbids this; kept so a new format cannot pass silently
            raise invalid_spec(f"task {self.task} cannot train on dataset.format {fmt}")
        st.examples = len(out)
        return TokenizedDataset(out, st)

    def chat(self, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
        """(token ids, 1 where the token belongs to an assistant turn); every assistant turn
        ends with EOS (see _eos_after_turns)."""
        ids, mask = self._chat_masks(messages)
        return _eos_after_turns(ids, mask, self.eos)

    def _chat_masks(self, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
        if not getattr(self.tok, "chat_template", None):
            raise invalid_spec(
                "dataset.format chat needs a tokenizer with a chat template; this model's "
                "tokenizer has none (use format prompt_completion instead)"
            )
        if _GENERATION_TAG.search(self.tok.chat_template):
            # The template marks assistant text with {% generation %}: transformers maps
            # those character spans to tokens for us.
            enc = self.tok.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            return list(enc["input_ids"]), list(enc["assistant_masks"])
        return _turn_masks(self.tok, messages)


def _eos_after_turns(
    ids: list[int], mask: list[int], eos: int | None
) -> tuple[list[int], list[int]]:
    """Make every assistant turn contain a learned EOS.

    A model learns to stop only if it is trained to emit EOS where its answer ends. Most chat
    templates write EOS (or an end-of-turn token that is the tokenizer's EOS) at the end of
    each assistant turn, inside the assistant span (possibly followed by a newline), so it
    is learned already and nothing changes here. Where a turn holds no EOS at all, one is
    inserted right after the turn and learned with it; otherwise generation would run on
    into an invented next turn.
    """
    if eos is None:
        return ids, mask
    out_ids: list[int] = []
    out_mask: list[int] = []
    turn_has_eos = False
    for i, (t, m) in enumerate(zip(ids, mask)):
        out_ids.append(t)
        out_mask.append(m)
        if not m:
            continue
        turn_has_eos = turn_has_eos or t == eos
        if i + 1 == len(ids) or not mask[i + 1]:  # the turn ends here
            if not turn_has_eos:
                out_ids.append(eos)
                out_mask.append(1)
            turn_has_eos = False
    return out_ids, out_mask


def _render_ids(tok: Any, messages: list[dict[str, Any]], gen_prompt: bool = False) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen_prompt)
    # The template writes its own special tokens (BOS, headers): add none of ours.
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _turn_masks(tok: Any, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """Assistant masks for templates without {% generation %} markers.

    Each assistant turn i spans the tokens between rendering messages[:i] with the generation
    prompt (the "assistant:" header, which the model is given, not taught) and rendering
    messages[:i+1]. This relies on the rendering of a prefix being a prefix of the whole,
    which holds for the usual templates (turns are separated by special tokens).
    """
    ids = _render_ids(tok, messages)
    mask = [0] * len(ids)
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        try:
            start = len(_render_ids(tok, messages[:i], gen_prompt=True)) if i else 0
        except Exception:  # noqa: BLE001 - some templates refuse an empty or user-less history
            start = 0
        end = min(len(_render_ids(tok, messages[: i + 1])), len(ids))
        for j in range(start, end):
            mask[j] = 1
    return ids, mask


def _messages(rec: dict[str, Any], name: str, row: int) -> list[dict[str, Any]]:
    msgs = rec[name]
    if isinstance(msgs, str):  # CSV cells hold JSON text
        try:
            msgs = json.loads(msgs)
        except json.JSONDecodeError as e:
            raise invalid_dataset(f"row {row}, field {name!r}: not valid JSON ({e.msg})") from None
    return list(msgs)


def tokenize_rows(
    spec: JobSpec,
    tokenizer: Any,
    rows: list[dict[str, Any]],
    label2id: dict[str, int] | None = None,
) -> TokenizedDataset:
    """Tokenize already checked rows (row numbers 1..n) the way training does."""
    return _Tokenize(spec, tokenizer, label2id)(rows, list(range(1, len(rows) + 1)))


# ---------------------------------------------------------------------------- building


def build_datasets(
    spec: JobSpec,
    train_path: Path,
    eval_path: Path | None,
    tokenizer: Any,
    max_decompressed_bytes: int | None = None,
) -> Datasets:
    """``max_decompressed_bytes``: the operator's bound on what gzip data may expand to
    (the worker passes settings.max_decompressed_bytes; None: core.datafiles' default)."""
    ds = spec.dataset
    rows, labels_found = read_checked_rows(train_path, ds, "training", max_decompressed_bytes)
    numbers = list(range(1, len(rows) + 1))
    eval_rows: list[dict[str, Any]] = []
    eval_numbers: list[int] = []
    if eval_path is not None:
        eval_rows, _ = read_checked_rows(eval_path, ds, "evaluation", max_decompressed_bytes)
        eval_numbers = list(range(1, len(eval_rows) + 1))
    elif ds.eval_split > 0:
        tr, ev = split_for_eval(len(rows), ds.eval_split, spec.training.seed)
        eval_rows, eval_numbers = [rows[i] for i in ev], [i + 1 for i in ev]
        rows, numbers = [rows[i] for i in tr], [i + 1 for i in tr]

    labels: list[str] | None = None
    label2id: dict[str, int] | None = None
    if spec.model.task == "seq_cls":
        labels = _sorted_labels(labels_found)
        want = spec.model.num_labels
        if want is not None and want < len(labels):
            raise invalid_dataset(
                f"the training data has {len(labels)} labels ({', '.join(labels)}) but "
                f"model.num_labels is {want}"
            )
        if want is not None:
            # Ids without a name in the data still exist in the head; name them generically.
            labels = labels + [f"LABEL_{i}" for i in range(len(labels), want)]
        if len(labels) < 2:
            raise invalid_dataset("classification needs at least 2 distinct labels in the data")
        label2id = {name: i for i, name in enumerate(labels)}
        if spec.training.class_weights:
            unknown = sorted(set(spec.training.class_weights) - set(label2id))
            if unknown:
                raise invalid_spec(
                    f"training.class_weights names labels not in the data: {', '.join(unknown)}"
                )

    tokenize = _Tokenize(spec, tokenizer, label2id)
    train = tokenize(rows, numbers)
    if len(train) == 0:
        raise invalid_dataset(_empty_message("training", train.stats, ds))
    if ds.packing:
        # Packed once, here, identically on every rank: the row count (and so total_steps)
        # is known before training starts.
        packed = pack_examples(train.examples, ds.max_seq_length)
        train.stats.packed_rows = len(packed)
        train = TokenizedDataset(packed, train.stats)
    evaluation = None
    if eval_rows:
        evaluation = tokenize(eval_rows, eval_numbers)
        if len(evaluation) == 0:
            raise invalid_dataset(_empty_message("evaluation", evaluation.stats, ds))
    return Datasets(train=train, eval=evaluation, labels=labels)


def _empty_message(what: str, st: DataStats, ds: DatasetSpec) -> str:
    rows = ", ".join(str(r) for r in st.dropped_rows)
    return (
        f"no {what} example is left after tokenization: all {st.rows} rows were dropped "
        f"because no token to learn from remains within dataset.max_seq_length "
        f"{ds.max_seq_length} (e.g. rows {rows}); raise max_seq_length or shorten the prompts"
    )


# ---------------------------------------------------------------------------- batching


class PadCollator:
    """Right-pads a batch to its longest example (dynamic padding: no compute spent on a
    global max length). Pads input_ids with the pad token, attention_mask with 0 (so the
    pads are invisible to attention) and LM labels with -100 (so they carry no loss).

    Packed rows (they carry ``position_ids``) are collated by packing.collate_packed in the
    given layout; the Trainer turns that batch into model inputs (packing.model_inputs).
    """

    def __init__(
        self, pad_token_id: int, pad_to_multiple_of: int | None = None, layout: Layout = "mask"
    ) -> None:
        self.pad_id = pad_token_id
        self.multiple = pad_to_multiple_of
        self.layout = layout

    def _width(self, seqs: list[list[int]]) -> int:
        n = max(len(s) for s in seqs)
        if self.multiple:
            n = -(-n // self.multiple) * self.multiple
        return n

    def _pad(self, seqs: list[list[int]], value: int) -> torch.Tensor:
        n = self._width(seqs)
        return torch.tensor([s + [value] * (n - len(s)) for s in seqs], dtype=torch.long)

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if "position_ids" in features[0]:
            return collate_packed(features, self.pad_id, self.layout, self.multiple)
        ids = [f["input_ids"] for f in features]
        batch = {
            "input_ids": self._pad(ids, self.pad_id),
            "attention_mask": self._pad([[1] * len(s) for s in ids], 0),
        }
        labels = [f["labels"] for f in features]
        if isinstance(labels[0], int):  # seq_cls: one class id per example
            batch["labels"] = torch.tensor(labels, dtype=torch.long)
        else:
            batch["labels"] = self._pad(labels, IGNORE_INDEX)
        return batch

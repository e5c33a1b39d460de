"""Rows -> token ids + labels, per task and data format: what the loss sees, and the same
for the trainer, the estimate (core/data/counts.py) and the previews (core/data/preview.py).

Label conventions:

* causal_lm: ``labels`` is ``input_ids`` with -100 where no loss is wanted; the model
  shifts by one internally, so label[i] is predicted from tokens[:i]. -100 is the ignore
  index of cross-entropy: those positions add nothing to the loss *or* to its denominator.
  text: every token; prompt_completion: completion tokens only (+ EOS, so the model learns
  to stop); chat: assistant turns only (core/data/chat_spans.py finds them).
* seq2seq_lm: ``labels`` is the target; the model builds decoder inputs from it.
* seq_cls: ``labels`` is one class id per example.

An example with no loss token left (a prompt longer than max_seq_length, say) is dropped:
a batch made only of such examples would divide 0 by 0 and report a NaN loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from core.data.chat_spans import (
    GENERATION_TAG,
    check_tools_written,
    encode_spans,
    tagged_spans,
    turn_spans,
)
from core.data.formats import CHAT_FORMATS, Chat, allowed_formats
from core.infra.errors import invalid_dataset, invalid_spec
from core.spec import JobSpec

IGNORE_INDEX = -100  # cross-entropy's ignore_index in transformers' loss functions
TOKENIZE_BATCH = 1000  # rows per tokenizer call: the fast tokenizer parallelises within a call
MAX_SHOWN = 5  # rows named in a message (the first few)


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
    # Rows whose rendering has no loss token at all (before any truncation): the template
    # dropped the assistant text. Refused, or skipped with dataset.skip_rows_without_loss.
    no_loss_rows: list[int] = field(default_factory=list)
    no_loss: int = 0

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
        if self.no_loss:
            out["rows_without_loss"] = self.no_loss
        return out


class TokenizedDataset:
    """A list of already tokenized examples (dicts of python lists / ints), or of packed rows
    (which also carry ``position_ids``). A map-style dataset by its shape (``__len__`` and
    ``__getitem__``, all the DataLoader and the Trainer ask of one) rather than by
    subclassing torch's Dataset: the API checks data through this module at submit, and an
    import of torch there would cost every API and CLI process seconds and hundreds of MB."""

    def __init__(self, examples: list[dict[str, Any]], stats: DataStats) -> None:
        self.examples = examples
        self.stats = stats

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.examples[i]


class Tokenize:
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
        for i in range(0, len(texts), TOKENIZE_BATCH):
            enc = self.tok(list(texts[i : i + TOKENIZE_BATCH]), add_special_tokens=special)
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
        # The model predicts labels[1:] (the first position has no context to predict from).
        # Counted with list.count: one C loop per row, not a Python one per token.
        if len(labels) - 1 - labels[1:].count(IGNORE_INDEX) <= 0:
            # Nothing to learn even before truncation: the rendering lost the target.
            st.no_loss += 1
            if len(st.no_loss_rows) < MAX_SHOWN:
                st.no_loss_rows.append(row)
            return
        ids, labels = self._cut(ids, labels, st)
        n_loss = len(labels) - 1 - labels[1:].count(IGNORE_INDEX)
        if n_loss == 0:
            st.dropped += 1
            if len(st.dropped_rows) < MAX_SHOWN:
                st.dropped_rows.append(row)
            return
        st.tokens += len(ids)
        st.loss_tokens += n_loss
        out.append({"input_ids": ids, "labels": labels})

    # -- formats

    def __call__(self, rows: list[Any], row_numbers: list[int], fmt: str) -> TokenizedDataset:
        """``rows``: examples in the internal layout of ``fmt`` (core/data/formats)."""
        st = DataStats(rows=len(rows))
        out: list[dict[str, Any]] = []
        if self.task == "causal_lm" and fmt == "text":
            for ids, row in zip(self._encode([r["text"] for r in rows], True), row_numbers):
                ids = self._with_eos(ids)
                self._keep_lm(out, ids, list(ids), row, st)
        elif self.task == "causal_lm" and fmt == "prompt_completion":
            # Prompt and completion are tokenized separately so the boundary is exact
            # (tokenizing the concatenation could merge the last prompt and first completion
            # characters into one token that belongs to neither).
            prompts = self._encode([r["prompt"] for r in rows], True)
            comps = self._encode([r["completion"] for r in rows], False)
            for p, c, row in zip(prompts, comps, row_numbers):
                c = self._with_eos(c)
                self._keep_lm(out, p + c, [IGNORE_INDEX] * len(p) + c, row, st)
        elif self.task == "causal_lm" and fmt in CHAT_FORMATS:
            for i in range(0, len(rows), TOKENIZE_BATCH):
                chunk = rows[i : i + TOKENIZE_BATCH]
                numbers = row_numbers[i : i + TOKENIZE_BATCH]
                for (ids, labels), row in zip(self.chats(chunk, numbers), numbers):
                    self._keep_lm(out, ids, labels, row, st)
        elif self.task == "seq2seq_lm" and fmt in ("seq2seq", "prompt_completion"):
            src_k, tgt_k = ("input", "target") if fmt == "seq2seq" else ("prompt", "completion")
            srcs = self._encode([r[src_k] for r in rows], True)
            tgts = self._encode([r[tgt_k] for r in rows], True)
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
            texts = [r["text"] for r in rows]
            encoded = self._encode(texts, True)
            for i, (r, ids, row) in enumerate(zip(rows, encoded, row_numbers)):
                name = r["label"]
                if name not in self.label2id:
                    raise invalid_dataset(
                        f"row {row}, field {self.ds.label_field!r}: label {name!r} does not "
                        f"occur in the training data (known: {', '.join(self.label2id)})"
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

    def chats(self, chats: list[Chat], rows: list[int]) -> list[tuple[list[int], list[int]]]:
        """(token ids, labels) per conversation (``rows``: their file rows): the assistant
        turns with weight 1 carry loss, each ending with a learned EOS (see
        with_turn_eos)."""
        if not getattr(self.tok, "chat_template", None):
            raise invalid_spec(
                "this dataset.format is rendered with a chat template and this model's "
                "tokenizer has none: set dataset.chat_template (e.g. chatml), or use format "
                "prompt_completion"
            )
        if GENERATION_TAG.search(self.tok.chat_template):
            check_tools_written(self.tok, chats, rows)
            return [with_turn_eos(*tagged_spans(self.tok, c), self.eos) for c in chats]
        texts, spans = zip(*(turn_spans(self.tok, c) for c in chats))
        check_tools_written(self.tok, chats, rows, texts)
        return [
            with_turn_eos(ids, token_spans, self.eos)
            for ids, token_spans in encode_spans(self.tok, list(texts), list(spans))
        ]


def with_turn_eos(
    ids: list[int], spans: list[tuple[int, int]], eos: int | None
) -> tuple[list[int], list[int]]:
    """(ids, labels): the tokens of each span learned, everything else -100, and every
    learned turn containing an EOS.

    A model learns to stop only if it is trained to emit EOS where its answer ends. Most chat
    templates write EOS (or an end-of-turn token that is the tokenizer's EOS) at the end of
    each assistant turn, inside the assistant span (possibly followed by a newline), so it
    is learned already and nothing changes here. Where a turn holds no EOS at all, one is
    inserted right after the turn and learned with it; otherwise generation would run on
    into an invented next turn. Spans that touch are one turn. Built from slices: no Python
    loop over tokens.
    """
    merged: list[tuple[int, int]] = []
    for lo, hi in spans:
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        else:
            merged.append((lo, hi))
    out_ids: list[int] = []
    labels: list[int] = []
    pos = 0
    for lo, hi in merged:
        out_ids += ids[pos:hi]
        labels += [IGNORE_INDEX] * (lo - pos)
        turn = ids[lo:hi]
        labels += turn
        if eos is not None and eos not in turn:
            out_ids.append(eos)
            labels.append(eos)
        pos = hi
    out_ids += ids[pos:]
    labels += [IGNORE_INDEX] * (len(ids) - pos)
    return out_ids, labels


def tokenize_rows(
    spec: JobSpec,
    tokenizer: Any,
    rows: list[dict[str, Any]],
    label2id: dict[str, int] | None = None,
) -> TokenizedDataset:
    """Tokenize rows as stored in a file (row numbers 1..n) the way training does: through
    the converter of dataset.format (or the detected one)."""
    from core.data.formats import convert_rows

    allowed = allowed_formats(spec.model.task, spec.training.objective)
    try:
        res, examples = convert_rows(spec.dataset, allowed, rows)
    except ValueError as e:
        raise invalid_dataset(str(e)) from None
    return Tokenize(spec, tokenizer, label2id)(
        examples, list(range(1, len(rows) + 1)), res.layout.format
    )

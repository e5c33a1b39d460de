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
examples are then packed into rows of up to max_seq_length tokens (core/data/packing.py:
per-example positions and attention, so packing changes the speed, not the model); the
evaluation examples stay one per row, so eval loss means the same with and without packing.
"""

from __future__ import annotations

import bisect
import random
import re
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from core.data.files import DataFileError, DataProblem, check_rows, iter_examples, iter_rows
from core.data.formats import CHAT_FORMATS, Chat, Receipt, allowed_formats
from core.data.packing import Layout, collate_packed, pack_examples
from core.infra.errors import invalid_dataset, invalid_spec
from core.spec import DatasetSpec, JobSpec

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
    receipt: Receipt | None = None  # what was read from the training data (core/data/formats)


# ---------------------------------------------------------------------------- reading


@dataclass
class Checked:
    """A data file's examples in the internal layout of its format (core/data/formats), after
    the same check the API ran at submit (core.data.files.check_rows)."""

    examples: list[Any]
    rows: list[int]  # 1-based file row of each example
    format: str
    labels: list[str]
    receipt: Receipt


def read_checked(
    path: Path, spec: JobSpec, what: str, max_decompressed_bytes: int | None
) -> Checked:
    """Check every row and keep each as the converter the check resolved made it, so the
    trainer reports the same row/field problems if the file changed or the run is by hand."""
    ds = spec.dataset
    if not path.exists():
        raise invalid_dataset(f"{what} data {path} does not exist")
    allowed = allowed_formats(spec.model.task, spec.training.objective)
    kept: list[tuple[int, Any]] = []
    report = check_rows(
        path, ds, allowed=allowed, max_decompressed_bytes=max_decompressed_bytes, keep=kept
    )
    if report.problem_count or report.resolution is None or report.receipt is None:
        shown = "; ".join(str(p) for p in report.problems[:_MAX_SHOWN])
        more = report.problem_count - min(report.problem_count, _MAX_SHOWN)
        tail = f" (and {more} more)" if more > 0 else ""
        raise invalid_dataset(
            f"{what} data {path.name} does not fit dataset.format {ds.format}: "
            f"{report.problem_count} problem(s): {shown}{tail}"
        )
    # Every row converted (no problem was found): the examples are those of the check.
    rows = [row for row, _ in kept]
    examples = [example for _, example in kept]
    return Checked(examples, rows, report.resolution.layout.format, report.labels, report.receipt)


def read_checked_rows(
    path: Path,
    ds: DatasetSpec,
    what: str,
    max_decompressed_bytes: int | None,
    row_check: Callable[[dict[str, Any]], list[DataProblem]],
) -> tuple[list[dict[str, Any]], list[str]]:
    """All rows of a file as stored, after ``row_check`` (grpo: the objective decides what
    a row is, core/graders/rows.py) passed every one; the same check as at submit."""
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
            f"{what} data {path.name}: {report.problem_count} problem(s): {shown}{tail}"
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
        # The model predicts labels[1:] (the first position has no context to predict from).
        # Counted with list.count: one C loop per row, not a Python one per token.
        if len(labels) - 1 - labels[1:].count(IGNORE_INDEX) <= 0:
            # Nothing to learn even before truncation: the rendering lost the target.
            st.no_loss += 1
            if len(st.no_loss_rows) < _MAX_SHOWN:
                st.no_loss_rows.append(row)
            return
        ids, labels = self._cut(ids, labels, st)
        n_loss = len(labels) - 1 - labels[1:].count(IGNORE_INDEX)
        if n_loss == 0:
            st.dropped += 1
            if len(st.dropped_rows) < _MAX_SHOWN:
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
            for i in range(0, len(rows), _BATCH):
                chunk = rows[i : i + _BATCH]
                numbers = row_numbers[i : i + _BATCH]
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
        _with_turn_eos)."""
        if not getattr(self.tok, "chat_template", None):
            raise invalid_spec(
                "this dataset.format is rendered with a chat template and this model's "
                "tokenizer has none: set dataset.chat_template (e.g. chatml), or use format "
                "prompt_completion"
            )
        if _GENERATION_TAG.search(self.tok.chat_template):
            _check_tools_written(self.tok, chats, rows)
            return [_with_turn_eos(*_tagged_spans(self.tok, c), self.eos) for c in chats]
        texts, spans = zip(*(_turn_spans(self.tok, c) for c in chats))
        _check_tools_written(self.tok, chats, rows, texts)
        return [
            _with_turn_eos(ids, token_spans, self.eos)
            for ids, token_spans in _encode_spans(self.tok, list(texts), list(spans))
        ]


def _encode_spans(
    tok: Any, texts: list[str], char_spans: list[list[tuple[int, int]]]
) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """(ids, token spans) per text, without special tokens added (the template writes its
    own): each character span becomes the tokens whose characters start inside it.

    Through the Rust tokenizer's batch call when there is one, asking it for the token at
    each span boundary only (a few calls per row) rather than turning every token's offset
    pair into Python objects, which cost as much as the ids themselves."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        enc = tok(texts, add_special_tokens=False, return_offsets_mapping=True)
        return [
            (list(ids), _token_spans([tuple(o) for o in offs], sp))
            for ids, offs, sp in zip(enc["input_ids"], enc["offset_mapping"], char_spans)
        ]
    out = []
    for e, text, sp in zip(backend.encode_batch(texts, add_special_tokens=False), texts,
                           char_spans):
        ids = e.ids
        spans = _boundary_spans(e, len(ids), len(text), sp)
        out.append((ids, spans if spans is not None else _token_spans(e.offsets, sp)))
    return out


def _first_token_from(enc: Any, n_tokens: int, n_chars: int, c: int) -> int | None:
    """The first token whose characters start at or after character ``c`` (what bisecting
    the offsets gives), or None where the encoding cannot say (no token covers ``c``)."""
    if c >= n_chars:
        return n_tokens
    t = enc.char_to_token(c)
    if t is None:
        return None
    if enc.token_to_chars(t)[0] < c:
        return t + 1  # ``c`` falls inside token t, which belongs to the text before
    # Byte-level tokens of one character share its offsets: take the first of them.
    while t > 0 and enc.token_to_chars(t - 1)[0] >= c:
        t -= 1
    return int(t)


def _boundary_spans(
    enc: Any, n_tokens: int, n_chars: int, spans: list[tuple[int, int]]
) -> list[tuple[int, int]] | None:
    out = []
    for a, b in spans:
        lo = _first_token_from(enc, n_tokens, n_chars, a)
        hi = _first_token_from(enc, n_tokens, n_chars, b)
        if lo is None or hi is None:
            return None
        if hi > lo:
            out.append((lo, hi))
    return out


def _check_tools_written(
    tok: Any, chats: list[Chat], rows: list[int], texts: Sequence[str] | None = None
) -> None:
    """A template that ignores ``tools`` or ``tool_calls`` would train the model to answer
    without them, silently: every tool and called function must appear in the rendering
    (``texts``: the conversations rendered already, else rendered here)."""
    for i, (chat, row) in enumerate(zip(chats, rows)):
        names = {t["function"]["name"] for t in chat.tools or []}
        names |= {c["function"]["name"] for m in chat.messages for c in m.get("tool_calls", [])}
        if not names:
            continue
        text = texts[i] if texts is not None else _render(tok, chat, len(chat.messages))
        lost = sorted(name for name in names if name not in text)
        if lost:
            raise invalid_dataset(
                f"row {row}: the chat template does not write the tools or tool calls of this "
                f"row ({', '.join(lost)} missing from the rendering): set dataset.chat_template "
                "to one that does (e.g. chatml)"
            )


def _tagged_spans(tok: Any, chat: Chat) -> tuple[list[int], list[tuple[int, int]]]:
    """The template marks assistant text with {% generation %}: transformers maps those
    character spans to tokens. A weight-0 turn's run of marked tokens is dropped (runs and
    assistant turns are matched in order; where they do not pair up one to one, the spans
    are found by rendering prefixes instead)."""
    enc = tok.apply_chat_template(
        chat.messages, tools=chat.tools, tokenize=True, return_dict=True,
        return_assistant_tokens_mask=True,
    )
    ids, mask = list(enc["input_ids"]), list(enc["assistant_masks"])
    runs: list[tuple[int, int]] = []
    for i, m in enumerate(mask):
        if m and (i == 0 or not mask[i - 1]):
            runs.append((i, i + 1))
        elif m:
            runs[-1] = (runs[-1][0], i + 1)
    turn_weights = [w for m, w in zip(chat.messages, chat.weights) if m["role"] == "assistant"]
    if all(turn_weights):
        return ids, runs
    if len(runs) != len(turn_weights):
        text, spans = _turn_spans(tok, chat)
        ((ids, token_spans),) = _encode_spans(tok, [text], [spans])
        return list(ids), token_spans
    return ids, [r for r, w in zip(runs, turn_weights) if w]


def _render(tok: Any, chat: Chat, n: int, gen_prompt: bool = False) -> str:
    """messages[:n] rendered as ``tok.apply_chat_template(..., tokenize=False)`` does: the
    same compiled template, with the tokenizer's special tokens as variables. Called
    directly: apply_chat_template copies and re-validates the conversation on every call,
    which costs more than the rendering itself when each turn is rendered as a prefix."""
    render = _renderer(tok)
    if render is None:
        return str(tok.apply_chat_template(
            chat.messages[:n], tools=chat.tools, tokenize=False, add_generation_prompt=gen_prompt
        ))
    return str(render(chat.messages[:n], chat.tools, gen_prompt))


_RENDERERS: weakref.WeakKeyDictionary[Any, tuple[Any, Any]] = weakref.WeakKeyDictionary()


def _renderer(tok: Any) -> Any:
    """A render function for this tokenizer's current template, or None (then
    apply_chat_template renders). Cached per tokenizer and template text."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # a transformers without it: the public path
        return None
    cached = _RENDERERS.get(tok)
    template = tok.chat_template
    if cached is not None and cached[0] is template:
        return cached[1]
    if not isinstance(template, str):
        return None  # several named templates: apply_chat_template picks one per call
    compiled = _compile_jinja_template(template)
    # Template.render merges the template's globals into a new context on every call (a
    # chain of mappings walked key by key); merged once here, each call copies one dict.
    base = {**compiled.globals, **tok.special_tokens_map}
    concat = compiled.environment.concat

    def render(messages: list[dict[str, Any]], tools: Any, gen_prompt: bool) -> str:
        context = compiled.new_context(
            {**base, "messages": messages, "tools": tools, "documents": None,
             "add_generation_prompt": gen_prompt},
            shared=True,
        )
        return str(concat(compiled.root_render_func(context)))

    _RENDERERS[tok] = (template, render)
    return render


def _turn_spans(tok: Any, chat: Chat) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the character span of each assistant turn that carries loss,
    for templates without {% generation %} markers.

    Turn i spans from the end of messages[:i] rendered with the generation prompt (the
    "assistant:" header, which the model is given, not taught) to the end of messages[:i+1]
    rendered. That relies on the rendering of a prefix being a prefix of the whole, as it is
    for the usual templates; where it is not, the span is the turn's content found in the
    text after the previous span (a template that drops it leaves the turn without loss,
    which the row check reports).

    Rendering two prefixes per turn costs more than tokenizing: where the template frames
    every assistant turn the same way (header, the text verbatim, footer; learned once per
    template from a probe), the same spans are found in the one rendering of the whole."""
    text = _render(tok, chat, len(chat.messages))
    framed = _framed_spans(tok, chat, text)
    return text, framed if framed is not None else _prefix_spans(tok, chat, text)


def _prefix_spans(tok: Any, chat: Chat, text: str) -> list[tuple[int, int]]:
    """_turn_spans by rendering each learned turn's prefixes (two renderings a turn)."""
    spans: list[tuple[int, int]] = []
    pos = 0
    for i, (m, w) in enumerate(zip(chat.messages, chat.weights)):
        if m["role"] != "assistant" or not w:
            continue
        try:
            head = _render(tok, chat, i, gen_prompt=True) if i else ""
        except Exception:  # noqa: BLE001 - some templates refuse an empty or user-less history
            head = ""
        # The last turn's prefix is the whole conversation, rendered already.
        whole = text if i + 1 == len(chat.messages) else _render(tok, chat, i + 1)
        if text.startswith(head) and text.startswith(whole) and len(whole) >= len(head):
            spans.append((len(head), len(whole)))
            pos = len(whole)
        else:
            at = text.find(m["content"], pos) if m["content"] else -1
            if at >= 0:
                spans.append((at, at + len(m["content"])))
                pos = at + len(m["content"])
    return spans


_PROBE_USER, _PROBE_ANSWER = "ftune probe question", "ftune probe answer"
_FRAMES: weakref.WeakKeyDictionary[Any, tuple[Any, tuple[str, str] | None]] = (
    weakref.WeakKeyDictionary()
)


def _turn_frame(tok: Any) -> tuple[str, str] | None:
    """(header, footer): what this template writes before an assistant turn's text (its
    generation prompt) and after it (end of turn), learned from one probe conversation, or
    None where the probe does not show them plainly (the answer not written verbatim right
    after the generation prompt, or a prefix not rendered as a prefix of the whole).
    Cached per tokenizer and template text."""
    template = tok.chat_template
    cached = _FRAMES.get(tok)
    if cached is not None and cached[0] is template:
        return cached[1]
    frame: tuple[str, str] | None = None
    asked = Chat([{"role": "user", "content": _PROBE_USER}], [0])
    answered = Chat([*asked.messages, {"role": "assistant", "content": _PROBE_ANSWER}], [0, 1])
    try:
        bare, prompted = _render(tok, asked, 1), _render(tok, asked, 1, gen_prompt=True)
        whole = _render(tok, answered, 2)
    except Exception:  # noqa: BLE001 - a template may refuse the probe: render prefixes
        bare = prompted = whole = ""
    if prompted.startswith(bare) and whole.startswith(prompted + _PROBE_ANSWER):
        frame = (prompted[len(bare):], whole[len(prompted) + len(_PROBE_ANSWER):])
        if not frame[0] or not frame[1]:
            frame = None  # nothing to anchor the search on
    _FRAMES[tok] = (template, frame)
    return frame


def _framed_spans(tok: Any, chat: Chat, text: str) -> list[tuple[int, int]] | None:
    """The spans _turn_spans would find by rendering prefixes, found in one rendering:
    each assistant turn is the template's header + its text + footer (``_turn_frame``),
    searched in order; the span is the text and footer, as a prefix rendering gives it.
    None (render prefixes instead) when a turn calls tools or is not found so framed:
    the template writes that turn otherwise."""
    frame = _turn_frame(tok)
    if frame is None or chat.messages[0]["role"] == "assistant":
        return None  # (an opening assistant turn has no prefix: its span starts at 0)
    head, foot = frame
    spans: list[tuple[int, int]] = []
    pos = 0
    for m, w in zip(chat.messages, chat.weights):
        if m["role"] != "assistant":
            continue
        if m.get("tool_calls"):
            return None
        turn = head + m["content"] + foot
        at = text.find(turn, pos)
        if at < 0:
            return None
        pos = at + len(turn)
        if w:
            spans.append((at + len(head), pos))
    return spans


def _token_spans(
    offsets: list[tuple[int, int]], spans: list[tuple[int, int]]
) -> list[tuple[int, int]]:
    """Character spans -> token index spans: the tokens whose characters start inside a
    span, found by bisection over the (start, end) offsets, which are in order (a cost per
    span, not per token)."""
    out = []
    for a, b in spans:
        lo, hi = bisect.bisect_left(offsets, (a,)), bisect.bisect_left(offsets, (b,))
        if hi > lo:
            out.append((lo, hi))
    return out


def _with_turn_eos(
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
    return _Tokenize(spec, tokenizer, label2id)(
        examples, list(range(1, len(rows) + 1)), res.layout.format
    )


# ---------------------------------------------------------------------------- building


def build_datasets(
    spec: JobSpec,
    train_path: Path,
    eval_path: Path | None,
    tokenizer: Any,
    max_decompressed_bytes: int | None = None,
) -> Datasets:
    """``max_decompressed_bytes``: the operator's bound on what gzip data may expand to
    (the worker passes settings.max_decompressed_bytes; None: core.data.files' default)."""
    ds = spec.dataset
    checked = read_checked(train_path, spec, "training", max_decompressed_bytes)
    rows, numbers, fmt = checked.examples, checked.rows, checked.format
    eval_rows: list[Any] = []
    eval_numbers: list[int] = []
    if eval_path is not None:
        ev_checked = read_checked(eval_path, spec, "evaluation", max_decompressed_bytes)
        if ev_checked.format != fmt:
            raise invalid_dataset(
                f"the evaluation data is {ev_checked.format}, the training data {fmt}: give "
                "both in one format (or name it in dataset.format)"
            )
        eval_rows, eval_numbers = ev_checked.examples, ev_checked.rows
    elif ds.eval_split > 0:
        tr, ev = split_for_eval(len(rows), ds.eval_split, spec.training.seed)
        eval_rows, eval_numbers = [rows[i] for i in ev], [numbers[i] for i in ev]
        rows, numbers = [rows[i] for i in tr], [numbers[i] for i in tr]

    labels: list[str] | None = None
    label2id: dict[str, int] | None = None
    if spec.model.task == "seq_cls":
        labels = _sorted_labels(checked.labels)
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
    train = tokenize(rows, numbers, fmt)
    _rows_without_loss("training", train.stats, ds, checked.receipt)
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
        evaluation = tokenize(eval_rows, eval_numbers, fmt)
        _rows_without_loss("evaluation", evaluation.stats, ds, None)
        if len(evaluation) == 0:
            raise invalid_dataset(_empty_message("evaluation", evaluation.stats, ds))
    return Datasets(train=train, eval=evaluation, labels=labels, receipt=checked.receipt)


def _rows_without_loss(
    what: str, st: DataStats, ds: DatasetSpec, receipt: Receipt | None
) -> None:
    """Rows whose rendering has no token to learn: refused (a job that trains on nothing
    must not report success), or skipped and counted with dataset.skip_rows_without_loss."""
    if not st.no_loss:
        return
    rows = ", ".join(map(str, st.no_loss_rows)) + (", ..." if st.no_loss > _MAX_SHOWN else "")
    if not ds.skip_rows_without_loss:
        raise invalid_dataset(
            f"{st.no_loss} {what} row(s) have no token to learn once rendered (rows {rows}): "
            "the chat template drops their assistant text, or every turn has weight 0. Fix "
            "the rows or dataset.chat_template, or set dataset.skip_rows_without_loss"
        )
    if receipt is not None:
        receipt.rows_skipped = st.no_loss
        receipt.skipped_rows = list(st.no_loss_rows)


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


# ---------------------------------------------------------------------------- seeing it


def _examples(path: Path, spec: JobSpec, res: Any, max_decompressed_bytes: int | None,
              limit: int | None = None) -> Iterable[tuple[int, Any]]:
    for row, ex in iter_examples(path, spec.dataset, res,
                                 max_decompressed_bytes=max_decompressed_bytes):
        if limit is not None and row > limit:
            return
        yield row, ex


def preview(
    spec: JobSpec,
    tokenizer: Any,
    path: Path,
    res: Any,
    n: int,
    max_decompressed_bytes: int | None = None,
) -> list[dict[str, Any]]:
    """The first ``n`` rows as the trainer renders them: each token's id and text, and
    whether it carries loss (after truncation at max_seq_length, as trained)."""
    fmt = res.layout.format
    if fmt in ("preference", "kto") or spec.model.task == "seq_cls":
        return []
    got = list(_examples(path, spec, res, max_decompressed_bytes, limit=n))
    if not got:
        return []
    numbers, rows = [r for r, _ in got], [e for _, e in got]
    tokenize = _Tokenize(spec, tokenizer, None)
    out: list[dict[str, Any]] = []
    for row, ex in zip(numbers, rows):
        # One row at a time so a row without loss still shows (it is dropped in training).
        kept = tokenize([ex], [row], fmt).examples
        if kept:
            ids, labels = kept[0]["input_ids"], kept[0]["labels"]
        else:
            ids, labels = [], []
        shift = spec.model.task == "causal_lm"
        tokens = [
            {"id": t, "text": tokenizer.decode([t]),
             "loss": bool(l != IGNORE_INDEX and (i > 0 or not shift))}
            for i, (t, l) in enumerate(zip(ids, labels))
        ] if shift else [{"id": t, "text": tokenizer.decode([t]), "loss": False} for t in ids]
        item: dict[str, Any] = {
            "row": row,
            "tokens": tokens,
            "loss_tokens": sum(1 for t in tokens if t["loss"]),
            "kept": bool(kept),
        }
        if spec.model.task == "seq2seq_lm" and kept:
            item["target"] = [{"id": t, "text": tokenizer.decode([t]), "loss": True}
                              for t in labels]
            item["loss_tokens"] = len(labels)
        out.append(item)
    return out


def rows_without_loss(
    spec: JobSpec,
    tokenizer: Any,
    path: Path,
    res: Any,
    max_decompressed_bytes: int | None = None,
    limit: int | None = None,
) -> tuple[int, list[int]]:
    """(count, first rows) of rows whose rendering carries no loss token: what submit
    refuses (or counts, with dataset.skip_rows_without_loss) before a GPU is asked for.
    ``limit``: only the first rows (the trainer checks every row again)."""
    fmt = res.layout.format
    tokenize = _Tokenize(spec, tokenizer, None)
    count, first = 0, list[int]()
    batch: list[tuple[int, Any]] = []

    def flush() -> None:
        nonlocal count
        st = tokenize([e for _, e in batch], [r for r, _ in batch], fmt).stats
        count += st.no_loss
        first.extend(st.no_loss_rows[: _MAX_SHOWN * 4 - len(first)])
        batch.clear()

    for item in _examples(path, spec, res, max_decompressed_bytes, limit=limit):
        batch.append(item)
        if len(batch) >= _BATCH:
            flush()
    if batch:
        flush()
    return count, first

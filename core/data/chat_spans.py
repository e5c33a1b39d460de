"""Chat-span alignment: which tokens of a rendered conversation are the assistant's, so that
only they carry loss (core/data/tokenize.py). A tokenizer's chat template renders the
conversation; where it marks assistant text with {% generation %}, transformers maps those
spans to tokens (``tagged_spans``); otherwise the assistant turns are found by rendering
prefixes of the conversation (``turn_spans``) and their characters mapped onto tokens
through the tokenizer's offsets (``encode_spans``). A template that drops tools or tool
calls is refused (``check_tools_written``)."""

from __future__ import annotations

import bisect
import re
import weakref
from collections.abc import Sequence
from typing import Any

from core.data.formats import Chat
from core.infra.errors import invalid_dataset

GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


def encode_spans(
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


def check_tools_written(
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


def tagged_spans(tok: Any, chat: Chat) -> tuple[list[int], list[tuple[int, int]]]:
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
        text, spans = turn_spans(tok, chat)
        ((ids, token_spans),) = encode_spans(tok, [text], [spans])
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


def turn_spans(tok: Any, chat: Chat) -> tuple[str, list[tuple[int, int]]]:
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
    """turn_spans by rendering each learned turn's prefixes (two renderings a turn)."""
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
    """The spans turn_spans would find by rendering prefixes, found in one rendering:
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

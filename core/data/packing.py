"""Packing: several causal-LM examples per row, each still attending only to itself.

Why: with dynamic padding a batch is as wide as its longest example, so a batch of one
1000-token and seven 50-token examples spends most of its compute on padding. Packing
concatenates examples into rows of up to ``dataset.max_seq_length`` tokens, so nearly every
position is a real token.

The danger: concatenated examples must not see each other. A plain causal mask over a
packed row lets example 2 attend to example 1 (no error, no warning: just a different, worse
model, and a loss that looks fine). Three things keep the examples independent:

* ``position_ids`` restart at 0 for each example, so rotary/absolute positions are the
  ones the example would have on its own;
* ``labels`` are -100 at the first token of each example: the model would otherwise be
  trained to predict an example's first token from the *previous* example's last token;
* attention is block-diagonal causal. How depends on the attention kernel (``layout``):

  - ``"mask"`` (sdpa, eager, anything that takes an additive mask): a 4-D float mask
    (batch, 1, seq, seq), 0 where a query may attend a key (same example, key not in the
    future) and the dtype's minimum elsewhere. transformers 5.x passes a 4-D mask through
    to the attention function unchanged (masking_utils._preprocess_mask_arguments), and
    sdpa/eager add it to the attention scores.
  - ``"flat"`` (flash_attention_2/3): the whole batch is one row with no padding and no
    attention mask; transformers sees position_ids that restart and runs the variable-
    length kernel with one sequence per example (its "padding-free" path, which only
    engages for a batch of exactly one row).
  - ``"position_ids"`` (models with a sliding window shorter than max_seq_length, and
    flex_attention): rows as for "mask", but no attention mask at all: transformers then
    derives per-example blocks from the restarting position_ids itself, for full and
    sliding-window layers alike (a single 4-D mask would apply one pattern to both kinds of
    layer), and as a BlockMask for flex. It does so only without a KV cache.

The collator emits a 2-D ``attention_mask`` of 1 for real tokens and 0 for padding
together with ``position_ids``; that pair is *not* safe to give a model as-is (a 2-D mask
switches transformers' own packed-sequence detection off). ``model_inputs`` turns it into
what the model must see, on the device, in the model's dtype; the Trainer's token counter
reads the 2-D mask first, so tokens/s counts real tokens only.

Rows are packed once, before training, with best-fit decreasing: the number of rows (and so
total_steps) is known up front, and it is the same on every rank.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from core.data.tokenize import IGNORE_INDEX

if TYPE_CHECKING:
    import torch
# torch is imported where tensors are built, not here: the API checks data through core.data
# at submit (datasets.py packs to count rows) and must not pay torch's import (seconds, and
# hundreds of MB) in every API and CLI process.

Layout = Literal["mask", "flat", "position_ids"]
# Kernels that take variable-length sequences (cu_seqlens) instead of a mask.
_VARLEN_KERNELS = ("flash_attention_2", "flash_attention_3")


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Group item indices into bins of total length <= capacity, longest items first, each
    into the fullest bin that still has room. Deterministic (ties keep input order).

    Bins are kept in buckets by remaining room; a sorted list of the non-empty room values
    makes "fullest bin with room >= n" one bisect, so packing a million examples is fast.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    by_room: dict[int, list[int]] = {}  # room left -> bin numbers (a stack)
    rooms: list[int] = []  # sorted distinct keys of by_room
    for i in order:
        n = lengths[i]
        if n > capacity:
            raise ValueError(f"item {i} of length {n} exceeds the capacity {capacity}")
        k = bisect.bisect_left(rooms, n)
        if k < len(rooms):
            room = rooms[k]
            b = by_room[room].pop()
            if not by_room[room]:
                del by_room[room]
                rooms.pop(k)
        else:
            room, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        left = room - n
        if left > 0:
            if left not in by_room:
                by_room[left] = []
                bisect.insort(rooms, left)
            by_room[left].append(b)
    return bins


def pack_examples(examples: Sequence[dict[str, Any]], max_len: int) -> list[dict[str, Any]]:
    """Tokenized causal-LM examples -> packed rows with restarting position_ids."""
    bins = best_fit_decreasing([len(e["input_ids"]) for e in examples], max_len)
    rows = []
    for members in bins:
        ids: list[int] = []
        labels: list[int] = []
        positions: list[int] = []
        for i in members:
            ex = examples[i]
            n = len(ex["input_ids"])
            ids += ex["input_ids"]
            # The first token of an example has no context *within* the example; its label
            # would be predicted from the end of the previous example.
            labels += [IGNORE_INDEX, *ex["labels"][1:]]
            positions += range(n)
        rows.append({"input_ids": ids, "labels": labels, "position_ids": positions})
    return rows


def layout_for(config: Any, max_seq_length: int) -> Layout:
    """How packed rows reach this model's attention (see the module docstring)."""
    impl = str(getattr(config, "_attn_implementation", None) or "sdpa")
    if impl in _VARLEN_KERNELS or impl.endswith(("flash_attention_2", "flash_attention_3")):
        return "flat"
    if impl == "flex_attention":
        return "position_ids"  # flex wants its own BlockMask; transformers builds a packed one
    window = getattr(config, "sliding_window", None)
    if (
        window is not None
        and getattr(config, "use_sliding_window", True)
        and window < max_seq_length
    ):
        return "position_ids"
    return "mask"


def collate_packed(
    features: list[dict[str, Any]],
    pad_token_id: int,
    layout: Layout,
    pad_to_multiple_of: int | None = None,
) -> dict[str, torch.Tensor]:
    """Packed rows -> a batch of input_ids, labels, position_ids and a 2-D real-token mask.

    Padding (to the widest row) gets its own position run starting at 0, so it forms a
    block of its own: no real token attends to it, and its own queries are never fully
    masked (a fully masked softmax row is NaN). Its labels are -100.
    """
    import torch

    if layout == "flat":
        ids = [t for f in features for t in f["input_ids"]]
        return {
            "input_ids": torch.tensor([ids], dtype=torch.long),
            "labels": torch.tensor([[t for f in features for t in f["labels"]]], dtype=torch.long),
            "position_ids": torch.tensor(
                [[p for f in features for p in f["position_ids"]]], dtype=torch.long
            ),
            "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
        }
    width = max(len(f["input_ids"]) for f in features)
    if pad_to_multiple_of:
        width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
    out: dict[str, list[list[int]]] = {
        "input_ids": [],
        "labels": [],
        "position_ids": [],
        "attention_mask": [],
    }
    for f in features:
        n = len(f["input_ids"])
        pad = width - n
        out["input_ids"].append(f["input_ids"] + [pad_token_id] * pad)
        out["labels"].append(f["labels"] + [IGNORE_INDEX] * pad)
        out["position_ids"].append(f["position_ids"] + list(range(pad)))
        out["attention_mask"].append([1] * n + [0] * pad)
    return {k: torch.tensor(v, dtype=torch.long) for k, v in out.items()}


def block_causal_mask(position_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(batch, seq) restarting positions -> (batch, 1, seq, seq) additive attention mask.

    A new example starts wherever the position is 0. Query q may attend key k iff both are
    in the same example and k <= q; allowed entries are 0.0, the others the most negative
    finite value of ``dtype`` (added to the scores, it zeroes the softmax weight).
    """
    import torch

    example = (position_ids == 0).cumsum(-1)  # (b, s): example number of each token
    same = example[:, :, None] == example[:, None, :]
    s = position_ids.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=position_ids.device).tril()
    allowed = same & causal
    mask = torch.zeros(allowed.shape, dtype=dtype, device=position_ids.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


def model_inputs(batch: dict[str, Any], layout: Layout, dtype: torch.dtype) -> dict[str, Any]:
    """A collated packed batch -> the keyword arguments the model must get."""
    out = dict(batch)
    if layout == "mask":
        out["attention_mask"] = block_causal_mask(out["position_ids"], dtype)
    else:
        # No mask: transformers reads the example boundaries from the position_ids. It only
        # does so without a KV cache (with one, it assumes generation and builds a plain
        # causal mask: cross-attention again), so the cache is switched off explicitly.
        out.pop("attention_mask", None)
        out["use_cache"] = False
    return out

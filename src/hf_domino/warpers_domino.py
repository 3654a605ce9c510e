"""transformers' top-p warper, to the bit, without sorting the whole vocabulary where a top-k before it left few tokens.

`TopPLogitsWarper` sorts every row of scores it is given (`torch.sort` over the vocabulary: 1 ms for SmolLM2's 49,152
columns on a 2-core CPU, where everything else it does takes 0.2 ms). A sampling call's generation config nearly
always puts a top-k before it (transformers' default is 50, Qwen3's 20), which leaves at most a few dozen finite scores
in the row, the rest -inf. The sorted row is then known without sorting: the -inf block, then those scores in
ascending order, which one `topk` finds. A drafted call pays the warper for every verified column (1 + k per cycle,
where the target alone pays one per token), so its sort is the larger share of a sampled cycle's overhead.

`SortFreeTopP` builds that same sorted row and runs the warper's own ops on it (softmax, cumulative sum, the threshold
`1 - top_p`, the kept tail), so its output equals the warper's bit for bit; wherever that cannot be shown it hands the
call to the warper itself: more than `FEW_TOKENS` finite scores in a row (no top-k before it), ties among them (whose
order in an unstable sort decides which of two equal tokens goes), NaN or +inf, another filter value than -inf, rows
keeping fewer tokens than `min_tokens_to_keep`, scores off the CPU (a GPU sorts fast, and the checks here would each
wait for it). `sort_free_top_p(logits_processor)` swaps the warpers of a drafted call's processor list in place (the
generate() hook and the served calls do): the list transformers' loop and the drafting both read.

This file is written next to exported checkpoints as remote code: it imports only transformers and torch.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import TopPLogitsWarper

# The most finite scores a row may hold for the sort-free path: a top-k of up to this many, ties at its k-th included.
FEW_TOKENS = 128


class SortFreeTopP(TopPLogitsWarper):
    """A `TopPLogitsWarper` with the same settings whose call skips the full sort where it can (the module's
    docstring says where); its output is the warper's, bit for bit."""

    def __init__(self, warper: TopPLogitsWarper):
        super().__init__(warper.top_p, warper.filter_value, warper.min_tokens_to_keep)

    def __call__(self, input_ids: torch.LongTensor | None, scores: torch.Tensor) -> torch.Tensor:
        if not self._may_skip_the_sort(scores):
            return super().__call__(input_ids, scores)
        # The largest FEW_TOKENS scores, descending: each row's finite ones, then -inf.
        values, indices = scores.topk(FEW_TOKENS, dim=-1)
        finite = torch.isfinite(values)
        ties = (values[..., 1:] == values[..., :-1]) & finite[..., 1:]
        refused = (
            finite[..., -1]  # a row keeps more than FEW_TOKENS scores
            | (torch.isnan(values) | torch.isposinf(values)).any(dim=-1)
            | ties.any(dim=-1)
            | (finite.sum(dim=-1) < self.min_tokens_to_keep)
        )
        if bool(refused.any()):  # one read of the checks, for every row
            return super().__call__(input_ids, scores)
        # What torch.sort(scores) returns as values: the -inf block, then the kept scores ascending.
        sorted_logits = scores.new_full(scores.shape, float("-inf"))
        sorted_logits[..., -FEW_TOKENS:] = values.flip(-1)
        cumulative_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)[..., -FEW_TOKENS:]
        tail_to_remove = cumulative_probs <= (1 - self.top_p)
        tail_to_remove[..., -self.min_tokens_to_keep :] = 0
        # The tail's -inf entries stay -inf whether removed or not (the filter value is -inf).
        to_remove = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, indices.flip(-1), tail_to_remove)
        return scores.masked_fill(to_remove, self.filter_value)

    def _may_skip_the_sort(self, scores: torch.Tensor) -> bool:
        return (
            scores.device.type == "cpu"
            and scores.dim() == 2
            and scores.shape[-1] > FEW_TOKENS
            and self.filter_value == float("-inf")
            and self.min_tokens_to_keep <= FEW_TOKENS
        )


def sort_free_top_p(logits_processor: LogitsProcessorList | None) -> None:
    """Replaces, in place, each of the list's `TopPLogitsWarper`s (exactly that class, not a subclass: another's
    call may differ) with a `SortFreeTopP` of its settings."""
    for position, processor in enumerate(logits_processor or ()):
        if type(processor) is TopPLogitsWarper:
            logits_processor[position] = SortFreeTopP(processor)


__all__ = ["FEW_TOKENS", "SortFreeTopP", "sort_free_top_p"]

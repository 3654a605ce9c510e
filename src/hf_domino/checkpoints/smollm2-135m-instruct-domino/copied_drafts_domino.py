"""Drafts copied rather than drafted: from the text itself (`lookup_drafts`, prompt lookup) and from a drafter's
datastore of the target's earlier answers (`DraftDatastore`), and the judgement of a copy that was not verified
(`judge_copy`). Free to draft, and right where a small drafter is weakest: code that repeats its identifiers,
answers that quote the prompt or themselves.

This file is also written next to exported checkpoints as remote code (transformers + torch only).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import numpy as np
import torch

# n-gram sizes tried by `lookup_drafts`, longest first: a single shared token matches too often to predict anything
# (offline on the target's own answers, 3 then 2, at the earliest occurrence, drafted best; docs/benchmarks.md).
LOOKUP_NGRAM_SIZES = (3, 2)


def lookup_drafts(
    input_ids: torch.LongTensor, max_drafts: int, ngram_sizes: tuple[int, ...] = LOOKUP_NGRAM_SIZES
) -> torch.LongTensor | None:
    """Drafts `[1, <= max_drafts]` copied from `input_ids` `[1, n]`: the tokens that followed the earliest earlier
    occurrence of its last `n` tokens, for the first size in `ngram_sizes` that occurred; None when none did."""
    sequence = input_ids[0]
    for size in ngram_sizes:
        if max_drafts <= 0 or sequence.shape[0] <= size:
            continue
        # Every n-gram that has a token after it (the sequence's own last n-gram has none).
        windows = sequence[:-1].unfold(0, size, 1)
        found = (windows == sequence[-size:]).all(dim=1).nonzero()
        if found.numel():
            start = int(found[0, 0]) + size
            return input_ids[:, start : start + max_drafts]
    return None


# n-gram sizes a datastore is searched by, longest first. Offline (every draft verified) 4 then 3 drafted best, but
# in generate() adding 2 paid: more blocks skip the drafter, and the policy declines the weak ones (docs/benchmarks.md).
DATASTORE_NGRAM_SIZES = (4, 3, 2)
# Occurrences read per lookup: the earliest ones of a frequent n-gram are sample enough and keep a lookup cheap.
DATASTORE_SAMPLE = 512
DATASTORE_FILE = "draft_datastore.safetensors"


def read_named_tensor(path: str, name: str, holds: str) -> torch.Tensor:
    """The tensor `name` of a drafter folder's side file (datastore, draft vocabulary), or a `ValueError` naming the
    file: a truncated or hand-made file otherwise failed as a bare `KeyError` or safetensors' header error."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path)[name]
    except (SafetensorError, KeyError, OSError) as error:
        raise ValueError(
            f"{path} should hold one tensor {name!r} ({holds}) in safetensors format; reading it failed "
            f"({type(error).__name__}: {error}). Export the drafter again, or remove the file to load it without."
        ) from error


class DraftDatastore:
    """Text the target wrote (its answers to the drafter's training prompts, say), for drafts by retrieval.

    Where the sequence's last n tokens occurred in the store, the drafts are the continuation most of those
    occurrences share, token by token, while at least `min_count` of them still agree. Like copies from the text,
    such drafts cost no drafter forward and have no distribution; they serve where the text itself does not repeat
    but the target's habits do (its phrasing, markdown, code idioms).

    `tokens` is 1-D: the sequences end to end, each followed by -1. The n-gram index (a few sorts of the store:
    0.7-0.8 s and 215 MB kept for the shipped drafter's 4.1M tokens on 2 CPU cores) is built by `build_index()`,
    which `DominoForSpeculation.from_pretrained` calls, else at the first lookup, and kept.
    """

    def __init__(self, tokens: torch.Tensor, ngram_sizes: tuple[int, ...] = DATASTORE_NGRAM_SIZES, min_count: int = 2):
        if tokens.dim() != 1 or tokens.is_floating_point() or tokens.numel() == 0:
            raise ValueError(
                f"A datastore is a non-empty 1-D tensor of token ids, got {tokens.dtype} {tuple(tokens.shape)}."
            )
        self.tokens = tokens.to(device="cpu", dtype=torch.long)
        if int(self.tokens[-1]) != -1:
            self.tokens = torch.cat([self.tokens, self.tokens.new_full((1,), -1)])
        self.ngram_sizes, self.min_count = tuple(ngram_sizes), min_count
        self.max_id = int(self.tokens.max())
        self._bits = max(1, self.max_id.bit_length())  # per token in a packed sort key
        self._index: dict[int, tuple[list[torch.Tensor], torch.Tensor]] = {}

    @classmethod
    def from_sequences(cls, sequences, **kwargs) -> DraftDatastore:
        """A datastore of token sequences (lists or tensors of ids)."""
        pieces = []
        for sequence in sequences:
            pieces += [torch.as_tensor(sequence, dtype=torch.long).flatten(), torch.full((1,), -1)]
        if not pieces:
            raise ValueError("A datastore needs at least one sequence of token ids, got none.")
        return cls(torch.cat(pieces), **kwargs)

    def save(self, path: str) -> None:
        """Writes the store's tokens to a safetensors file (uint16, -1 as 65535, where every id fits)."""
        from safetensors.torch import save_file

        tokens = self.tokens
        if int(tokens.max()) < 65535:
            tokens = tokens.masked_fill(tokens < 0, 65535).to(torch.uint16)
        else:
            tokens = tokens.to(torch.int32)
        save_file({"tokens": tokens.contiguous()}, path)

    @classmethod
    def load(cls, path: str, **kwargs) -> DraftDatastore:
        tokens = read_named_tensor(path, "tokens", "the datastore's token ids, answers separated")
        separators = tokens == 65535 if tokens.dtype == torch.uint16 else tokens < 0
        return cls(tokens.to(torch.long).masked_fill(separators, -1), **kwargs)

    def _chunks(self, size: int) -> list[range]:
        """Columns of an n-gram packed together into one int64 sort key (as many as fit in 62 bits)."""
        per_key = max(1, 62 // self._bits)
        return [range(start, min(start + per_key, size)) for start in range(0, size, per_key)]

    def _keys(self, tokens: torch.Tensor, starts: torch.Tensor, columns: range) -> torch.Tensor:
        """The packed sort keys of the n-grams starting at `starts` in the 1-D `tokens`, over `columns` of them."""
        key = torch.zeros_like(starts)
        for column in columns:
            key = (key << self._bits) | tokens[starts + column]
        return key

    def _sorted(self, size: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The store's n-grams that have a next token, sorted: their packed keys and the next token's position.

        Keys are gathered from the 1-D store at each start (never from an `[n-grams, size + 1]` copy of it), and each
        sort's values are kept as that chunk's keys: 0.7-0.8 s for the shipped 4.1M tokens on 2 CPU cores, against
        1.4 s for the sorts of such copies (docs/benchmarks.md, "A process's first call")."""
        if size not in self._index:
            count = max(0, self.tokens.shape[0] - size)  # starts whose n-gram and next token lie inside the store
            separators = self.tokens < 0
            crossing = separators[:count].clone()
            for offset in range(1, size + 1):
                crossing |= separators[offset : offset + count]
            order, keys = (~crossing).nonzero().flatten(), []
            for columns in reversed(self._chunks(size)):  # least significant first; stable sorts keep earlier first
                chunk_keys, permutation = torch.sort(self._keys(self.tokens, order, columns), stable=True)
                order, keys = order[permutation], [chunk_keys, *(key[permutation] for key in keys)]
            self._index[size] = (keys, order + size)
        return self._index[size]

    def build_index(self) -> DraftDatastore:
        """Builds the n-gram index now rather than at the first lookup, inside some `generate()` call (0.7-0.8 s for
        the shipped drafter's datastore on 2 CPU cores). Builds once; returns the datastore."""
        for size in self.ngram_sizes:
            self._sorted(size)
        return self

    def _agreed_continuation(self, at: torch.Tensor, max_drafts: int) -> list[int]:
        """From the store positions `at`, token by token, what most occurrences continue with, while at least
        `min_count` of them agree (ties: the smallest id). On the host in numpy: a dozen steps over a few hundred
        positions at most, where torch's per-op overhead dominated (0.33 against 0.094 ms a lookup back to back)."""
        tokens, at, drafts = self.tokens.numpy(), at.numpy(), []
        while len(drafts) < max_drafts:
            following = tokens[at]
            if following.shape[0] <= 32:  # most steps, once the occurrences have narrowed
                counts = Counter(following.tolist())
                top = max(counts.values())
                value = min(token for token, count in counts.items() if count == top)
            else:
                values, counts = np.unique(following, return_counts=True)
                best = int(counts.argmax())
                value, top = int(values[best]), int(counts[best])
            if value < 0 or top < self.min_count:
                break
            drafts.append(value)
            at = at[following == value] + 1
        return drafts

    def occurrences(self, input_ids: torch.LongTensor) -> Iterator[torch.Tensor]:
        """For each n-gram size, longest first, where the last n tokens of `input_ids` `[1, n]` occur in the store at
        least `min_count` times: the store positions of the tokens that follow those occurrences (the earliest
        `DATASTORE_SAMPLE` of them)."""
        sequence = input_ids[0, -max(self.ngram_sizes) :].cpu()  # the last n-gram is all a lookup reads
        if not self._index:  # every size at once: the first call pays for the index, not some later one
            self.build_index()
        for size in self.ngram_sizes:
            if sequence.shape[0] < size:
                continue
            query, start = sequence[-size:], torch.zeros(1, dtype=torch.long)
            if int(query.max()) > self.max_id:  # in no n-gram of the store, and wider than a key's column
                continue
            keys, positions = self._sorted(size)
            low, high = 0, positions.shape[0]
            for chunk_keys, columns in zip(keys, self._chunks(size)):
                key = self._keys(query, start, columns)
                span = chunk_keys[low:high]
                low, high = (
                    low + int(torch.searchsorted(span, key)),
                    low + int(torch.searchsorted(span, key, right=True)),
                )
                if low >= high:
                    break
            if high - low >= self.min_count:
                yield positions[low : min(high, low + DATASTORE_SAMPLE)]

    def lookup(self, input_ids: torch.LongTensor, max_drafts: int) -> torch.LongTensor | None:
        """Drafts `[1, <= max_drafts]` for the sequence `input_ids` `[1, n]`, or None where the store has none."""
        if max_drafts <= 0:
            return None
        for at in self.occurrences(input_ids):
            drafts = self._agreed_continuation(at, max_drafts)
            if drafts:
                return torch.tensor([drafts], dtype=input_ids.dtype, device=input_ids.device)
        return None


def certain_logits(copies: torch.LongTensor, vocab_size: int) -> torch.Tensor:
    """`[rows, k, vocab_size]` logits under which each of `copies` `[rows, k]` is certain (0 at its token, -inf
    elsewhere): the law a copy is drawn from, for a sampled call's speculative sampling.

    A copy stands there with the target's probability of it, and a rejected one gives way to a draw from the target's
    law without it: the law of transformers' rule for drafts without logits (draw the target at every position, keep
    the drafts while they agree), for one draw of the vocabulary instead of one per position (1 ms each for SmolLM2's
    49,152 tokens on a 2-core CPU)."""
    logits = torch.full((*copies.shape, vocab_size), float("-inf"), device=copies.device)
    return logits.scatter_(-1, copies[..., None], 0.0)


def judge_copy(copy: torch.LongTensor, generated: torch.LongTensor) -> tuple[int, int]:
    """(offered, accepted) of a copy `[n]` that was not verified, against the tokens `[m]` generated in its place:
    the first `offered` positions can be judged, and the first `accepted` of them agree. Exact, since copies are
    deterministic: the same copy verified would have been accepted that far."""
    offered = min(copy.shape[0], generated.shape[0])
    mismatches = (copy[:offered] != generated[:offered].to(copy.device)).nonzero()
    return offered, int(mismatches[0, 0]) if mismatches.numel() else offered


__all__ = [
    "DATASTORE_FILE",
    "DATASTORE_NGRAM_SIZES",
    "LOOKUP_NGRAM_SIZES",
    "DraftDatastore",
    "judge_copy",
    "lookup_drafts",
]

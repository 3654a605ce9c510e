"""One Domino head rollout (a whole block) on the fused Triton kernels of `hf_domino.triton_kernels`.

`fused_rollout()` takes tensors and an explicit `head` flag, like `drafting_domino.eager_rollout`. `Workspace` (every
buffer of a block, at fixed addresses) and `launch_rollout` (the kernel sequence, with no host synchronization) are
what the CUDA-graph runner of `hf_domino.fused_head` captures and replays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .drafting_domino import branch_columns, to_vocab_ids
from .triton_kernels import check_kernel_device
from .triton_launch import (
    Sampling,
    Warps,
    Workspace,
    launch_correction_hidden,
    launch_gru_cell,
    launch_logits_pick,
    launch_warped_pick,
)

if TYPE_CHECKING:
    from .modeling_domino import DominoForSpeculation


@dataclass(frozen=True)
class HeadWeights:
    weight_ih: torch.Tensor  # [3G, H], gates (r, z, n)
    weight_hh: torch.Tensor  # [3G, G]
    proj_in: torch.Tensor  # W1 [R, H + G]
    proj_out: torch.Tensor  # W2 [V, R]

    @classmethod
    def of(cls, drafter: DominoForSpeculation) -> HeadWeights:
        gru, proj = drafter.prefix_gru, drafter.embed_proj
        weights = cls(gru.weight_ih_l0, gru.weight_hh_l0, proj[0].weight, proj[2].weight)
        for name, weight in vars(weights).items():
            if weight.stride(-1) != 1:
                raise ValueError(f"The Domino head's {name} weight must be contiguous in its last dimension.")
        return weights

    @property
    def hidden_size(self) -> int:
        return self.weight_ih.shape[1]

    def signature(self) -> tuple:
        """What a captured graph depends on: where each weight lives and how it is laid out (not its values)."""
        return tuple((w.data_ptr(), w.dtype, w.device, tuple(w.shape), w.stride()) for w in vars(self).values())


def launch_rollout(
    weights: HeadWeights | None,
    draft_hidden: torch.Tensor,
    base_logits: torch.Tensor,
    embed_weight: torch.Tensor,
    workspace: Workspace,
    *,
    prefix_len: int,
    sample: bool,
    branches: int = 1,
) -> None:
    """Enqueues one block's rollout for every row; no host synchronization, no data-dependent control flow
    (graph-capturable).

    `draft_hidden` `[rows, k, H]` and `base_logits` `[rows, k, V]` are the block's positions (over `workspace.vocab`
    when the drafter has a draft vocabulary), `k` the workspace's number of drafts; `workspace.tokens[:, 0]` holds
    each row's anchor, `workspace.seed`/`workspace.settings` the sampling parameters (each row's own). Drafts (token
    ids) land in `workspace.tokens[:, 1:]`, the logits they were picked from in `workspace.logits`. When sampling,
    the workspace's warps (each row's top-k / top-p / min-p as torch ops, `warp_rows`) filter each position's
    tempered logits before its draw. Rows are independent: each launch covers all of them, so a batch costs the launches of one sequence. `branches` n > 1:
    rows come in groups of n copies of one block, a tree's first-token branches (`take_branches`).
    """
    ws, num_drafts = workspace, base_logits.shape[1]
    prefix_len = num_drafts if weights is None else min(prefix_len, num_drafts)

    warped = sample and bool(ws.warps)

    def pick(positions: slice, hidden: torch.Tensor | None, proj_out: torch.Tensor | None) -> None:
        launch_logits_pick(ws, positions, base_logits, hidden, proj_out, sample=sample, pick=not warped)
        if warped:
            launch_warped_pick(ws, positions)
        if branches > 1 and positions.start == 0 < positions.stop:  # before any GRU step reads the first draft
            take_branches(ws, branches)

    # The pure-draft prefix (all drafts, without an active head) reads the base logits alone: one launch for all.
    pick(slice(0, prefix_len), None, None)
    if prefix_len == num_drafts:
        return

    hidden_size = weights.hidden_size
    # W1[:, :H] z for every corrected position in one matmul; only W1[:, H:] s is left inside the sequential loop.
    ws.proj[:, prefix_len:].copy_(
        torch.matmul(draft_hidden[:, prefix_len:].float(), weights.proj_in[:, :hidden_size].float().t())
    )
    gru = (embed_weight, ws.tokens)
    launch_gru_cell(*gru, 0, None, weights.weight_ih, weights.weight_hh, ws.states[:, 0])
    for j in range(1, prefix_len + 1):  # catch the GRU up on the drafts of the pure prefix
        launch_gru_cell(*gru, j, ws.states[:, j - 1], weights.weight_ih, weights.weight_hh, ws.states[:, j])
    for i in range(prefix_len, num_drafts):
        launch_correction_hidden(ws.proj[:, i], ws.states[:, i], weights.proj_in, hidden_size, ws.hidden[:, i])
        pick(slice(i, i + 1), ws.hidden[:, i : i + 1], weights.proj_out)
        if i + 1 < num_drafts:  # the last draft is never read back
            launch_gru_cell(*gru, i + 1, ws.states[:, i], weights.weight_ih, weights.weight_hh, ws.states[:, i + 1])


def take_branches(ws: Workspace, branches: int) -> None:
    """Rows in groups of `branches` copies of one block: the i-th of a group takes its i-th likeliest first draft
    (0: the likeliest) under the logits the first draft was picked from, instead of the one picked, and the head
    continues from it, as `ragged_batch_domino.batched_rollout` does for a tree. Torch ops on the device only
    (graph-capturable); a first draft drawn when sampling is replaced, since a tree's first drafts are chosen."""
    on_columns = ws.vocab is not None and not ws.spread  # greedy over a draft vocabulary: columns, not ids
    ws.tokens[:, 1].copy_(to_vocab_ids(branch_columns(ws.logits[:, 0], branches), ws.vocab if on_columns else None))


def _validate_inputs(
    weights: HeadWeights | None,
    draft_hidden: torch.Tensor,
    base_logits: torch.Tensor,
    embed_weight: torch.Tensor,
    vocab: torch.Tensor | None,
    anchor_ids: torch.LongTensor,
) -> None:
    if base_logits.dim() != 3 or draft_hidden.shape[:2] != base_logits.shape[:2]:
        raise ValueError(
            f"Expected draft_hidden [rows, k, hidden] and base_logits [rows, k, vocab], got "
            f"{tuple(draft_hidden.shape)} and {tuple(base_logits.shape)}."
        )
    if anchor_ids.dim() != 2 or anchor_ids.shape[0] != base_logits.shape[0] or anchor_ids.shape[1] == 0:
        raise ValueError(
            f"Expected anchor_ids [rows, n >= 1] for the {base_logits.shape[0]} rows of the block (each row's anchor in "
            f"its last column), got {tuple(anchor_ids.shape)}."
        )
    if vocab is not None:
        if vocab.dim() != 1 or vocab.numel() != base_logits.shape[-1] or vocab.dtype != torch.long:
            raise ValueError(
                f"A draft vocabulary must be the [V'] long token ids of the base logits' {base_logits.shape[-1]} "
                f"columns, got {vocab.dtype} {tuple(vocab.shape)} (see DominoForSpeculation.set_draft_vocab)."
            )
        if vocab.stride(0) != 1:
            raise ValueError("The draft vocabulary must be contiguous (vocab.contiguous()).")
    if weights is None:
        return
    if vocab is None and base_logits.shape[-1] != weights.proj_out.shape[0]:
        raise ValueError(
            f"base_logits cover {base_logits.shape[-1]} tokens but the Domino head corrects {weights.proj_out.shape[0]}"
            "; pass the draft vocabulary the base logits were computed over."
        )
    if embed_weight.shape[1] != weights.hidden_size or draft_hidden.shape[-1] != weights.hidden_size:
        raise ValueError("The target embeddings and draft hidden states must have the drafter's hidden_size.")
    if embed_weight.device != weights.weight_ih.device or embed_weight.stride(-1) != 1:
        raise ValueError(
            "The fused Domino head gathers token embeddings itself: the target's embedding table must be contiguous "
            f"and on the head's device ({weights.weight_ih.device}), not {embed_weight.device}."
        )


def prepare_rollout(
    drafter: DominoForSpeculation,
    head: bool,
    draft_hidden: torch.Tensor,
    base_logits: torch.Tensor,
    embed: torch.Tensor,
    vocab: torch.Tensor | None,
    anchor_ids: torch.LongTensor,
) -> tuple[HeadWeights | None, torch.device]:
    """Checked head weights (`None` when the head is off or absent) and the device the rollout runs on.

    Cheap checks only (shapes, dtypes, layouts: no device synchronization); `check_vocab_ids` checks a vocabulary's
    values.
    """
    weights = HeadWeights.of(drafter) if head and drafter.config.has_domino_head else None
    _validate_inputs(weights, draft_hidden, base_logits, embed, vocab, anchor_ids)
    return weights, (base_logits.device if weights is None else weights.weight_ih.device)


def check_vocab_ids(vocab: torch.Tensor, vocab_size: int) -> None:
    """A draft vocabulary's ids must be sorted, distinct and in `[0, vocab_size)`: the kernels index W2 and the
    embedding table with them unchecked, and the lowest-id tie rule needs them sorted. One device synchronization."""
    ok = vocab.numel() > 0 and bool((vocab[0] >= 0) & (vocab[-1] < vocab_size) & (vocab.diff() > 0).all())
    if not ok:
        raise ValueError(
            f"A draft vocabulary must hold sorted, distinct token ids in [0, {vocab_size}); "
            "DominoForSpeculation.set_draft_vocab builds one."
        )


def rows_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def rows_sampling(sampling: Sampling | Sequence[Sampling] | None, rows: int) -> tuple[Sampling, ...] | None:
    """Each of `rows` rows' settings: `sampling` given once for all of them, or one per row (`None`: greedy)."""
    if sampling is None:
        return None
    settings = (sampling,) * rows if isinstance(sampling, Sampling) else tuple(sampling)
    if len(settings) != rows:
        raise ValueError(f"{len(settings)} rows' sampling settings for {rows} rows; give one per row, or one for all.")
    for setting in settings:
        if not setting.temperature > 0:
            raise ValueError(f"temperature must be positive for sampling (None = greedy), got {setting.temperature}.")
    return settings


@torch.no_grad()
def fused_rollout(
    drafter: DominoForSpeculation,
    draft_hidden: torch.Tensor,
    base_logits: torch.Tensor,
    anchor_ids: torch.LongTensor,
    target_embed_weight: torch.Tensor,
    *,
    head: bool,
    pure_draft_prefix_len: int,
    sampling: Sampling | Sequence[Sampling] | None,
    vocab: torch.Tensor | None = None,
    check_vocab: bool = True,
    branches: int = 1,
) -> tuple[torch.LongTensor, torch.Tensor]:
    """`eager_rollout` with the fused kernels, for greedy decoding or sampling (temperature, top-k, top-p, min-p), for
    one sequence or a batch of rows drafted together (the batch loop's `batched_rollout`).

    The caller states whether the head is on (`head`), rather than this function reading a default from the drafter:
    head on/off is a per-`generate()` option, and a captured graph must know which one it was captured for.

    Args:
        drafter: the drafter whose head weights to use.
        draft_hidden: backbone outputs of the positions to draft, `[rows, k, hidden]`.
        base_logits: the target LM head on `draft_hidden`, `[rows, k, V']`: over the whole vocabulary, or over
            `vocab`.
        anchor_ids: the tokens realised before the first draft, `[rows, n]`; only the last column (each row's
            anchor) is read.
        target_embed_weight: the target's input embedding table `[vocab, hidden]`, on the head's device.
        head: correct the base logits with the Domino head (ignored, i.e. off, for a drafter without one).
        pure_draft_prefix_len: leading drafts taken from the base logits alone (`config.pure_draft_prefix_len`).
        sampling: `None` for greedy (argmax); else the sampling settings (`Sampling`: a temperature, then any of
            top-k, top-p and min-p, as transformers' warpers apply them), one for all rows or one per row: each row's
            drafts are drawn from `softmax(warped(logits / temperature))` under its own.
        vocab: the draft vocabulary the base logits cover (`[V']` sorted token ids, as `set_draft_vocab` stores
            them), or `None` for the whole vocabulary. The correction then uses W2's rows of those tokens, the pick
            is over them, and the GRU reads the picked token ids.
        check_vocab: check `vocab`'s values (`check_vocab_ids`, one device synchronization); a caller that already
            checked this vocabulary tensor passes `False`.
        branches: n > 1 for a tree of first-token branches: the rows come in groups of n copies of one block, and
            the i-th of a group continues from its i-th likeliest first draft (chosen, also when sampling).

    Returns:
        `(draft_ids [rows, k], logits [rows, k, V] fp32)`: the drafts (token ids) and the processed logits each was picked
        from, as `eager_rollout` returns them: greedy, over the base logits' `V'` columns; sampling,
        `logits / temperature` (then warped) over the whole vocabulary (`config.vocab_size` columns, `-inf` outside
        `vocab`, as `processed_pick` spreads them so that speculative sampling stays lossless).
    """
    weights, device = prepare_rollout(drafter, head, draft_hidden, base_logits, target_embed_weight, vocab, anchor_ids)
    rows, num_drafts, vocab_size = base_logits.shape
    sampling = rows_sampling(sampling, rows)
    check_kernel_device(device)
    if rows % branches:
        raise ValueError(f"{rows} rows cannot come in groups of {branches} branches.")
    if vocab is not None:
        vocab = vocab.to(device)
        if check_vocab:
            check_vocab_ids(vocab, min(drafter.config.vocab_size, target_embed_weight.shape[0]))
    sample = sampling is not None
    workspace = Workspace(
        num_drafts, vocab_size, device, weights, vocab=vocab,
        spread_size=drafter.config.vocab_size if sample else None, warps=Warps.of(sampling or ()), rows=rows,
    )  # fmt: skip
    workspace.start(anchor_ids, sampling)
    launch_rollout(
        weights,
        draft_hidden.to(device),
        rows_contiguous(base_logits.to(device)),
        target_embed_weight,
        workspace,
        prefix_len=pure_draft_prefix_len,
        sample=sample,
        branches=branches,
    )
    return workspace.tokens[:, 1:].contiguous().to(anchor_ids.device), workspace.logits

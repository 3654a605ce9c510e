"""The Domino training objective: teacher-forced drafts of many blocks in one forward, and the curriculum loss.

- All blocks of a batch go through ONE drafter forward over `[context ; block_1 ; ... ; block_m]`; the additive
  mask of `block_attention_mask` lets block j see the context strictly before its anchor and itself
  (bidirectionally), never another block.
- The Domino head is teacher-forced (`draft_logits`): its GRU reads `[anchor, y_0, ..., y_{D-2}]` (ground truth),
  exactly the prefix a draft has at inference when every draft before it was accepted, which is the only case in
  which the draft counts. The first `pure_draft_prefix_len` drafts use the base logits alone.
- `loss = (1 - lam) * L_final + lam * L_base` (`domino_losses`), both cross-entropies weighting draft k by
  `exp(-k / block_size)` (`position_weights`), with `lam` annealed from 1 to 0 (`curriculum_lambda`): the
  base-anchored curriculum that keeps the backbone a drafter of its own (paper, Fig. 4).
- Distillation (`kl_weight > 0`): each cross-entropy also reads the target's whole next-token distribution at the
  label's position (`target_next_token_probs`, from the target's last hidden state and its LM head, so no logits are
  stored), which says more per token than the one greedy label. Up to a constant (the target's entropy) this is
  the KL divergence from the target's distribution to the draft's.
- Draft vocabulary (`vocab`): the logits, and so the LM-head cost of training, cover only the drafter's draft
  vocabulary, exactly what drafting computes with one (FR-Spec). A label outside it can never be drafted: it counts
  as a miss and takes no loss (`draft_vocab_index`).

`DominoTrainingModule` puts it all in one `forward`, the module that DDP/FSDP wrap. Its `block_acceptance` and
`generate_blocks` score blocks without a loss: the blocks greedy `generate()` drafts over an answer, where they start
and what they add, to train where `generate()`'s blocks start and to measure what it accepts on held-out answers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..modeling_domino import DominoForSpeculation, TargetModules
from .data import BlockInputs, build_block_inputs, generate_chain, usable_anchors

# Anchors scored in one forward by `DominoTrainingModule.generate_blocks` (`[chunk x block]` queries).
ACCEPTANCE_CHUNK = 64


def block_attention_mask(
    anchors: torch.LongTensor,
    context_mask: torch.Tensor,
    block_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Additive mask `[b, 1, m * B, T + m * B]` over keys `[context ; block_1 ; ... ; block_m]`.

    A query of block j sees the context positions strictly before its anchor (the anchor's own features do not exist
    at inference time) that are not padding, and all of block j; nothing of the other blocks.
    """
    batch_size, num_blocks = anchors.shape
    seq_len = context_mask.shape[1]
    device = anchors.device
    context_positions = torch.arange(seq_len, device=device)
    sees_context = (context_positions.view(1, 1, seq_len) < anchors.unsqueeze(-1)) & context_mask.bool().unsqueeze(1)
    block_of = torch.arange(num_blocks, device=device).repeat_interleave(block_size)
    sees_block = block_of.view(-1, 1) == block_of.view(1, -1)  # [m*B, m*B]: block diagonal
    allowed = torch.cat(
        [
            sees_context.repeat_interleave(block_size, dim=1),  # [b, m*B, T]
            sees_block.expand(batch_size, -1, -1),
        ],
        dim=-1,
    )
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min).unsqueeze(1)


def position_weights(num_drafts: int, block_size: int, device: torch.device | None = None) -> torch.Tensor:
    """Loss weight of draft k: `exp(-k / block_size)`. Late drafts matter less: they count only if all before do."""
    return torch.exp(-torch.arange(num_drafts, dtype=torch.float32, device=device) / block_size)


def curriculum_lambda(step: int, total_steps: int, enabled: bool = True) -> float:
    """Weight of the base loss at optimizer step `step` (0-based): 1 at the first step, linearly down to 0 at the last.

    Without the curriculum the base logits get no direct loss (lam = 0), which lets the backbone drift into serving
    the head only (the collapse of the paper's Fig. 4).
    """
    if not enabled:
        return 0.0
    return max(0.0, 1.0 - step / max(total_steps - 1, 1))


@dataclass
class DominoLossOutput:
    loss: torch.Tensor  # (1 - lam) * final_loss + lam * base_loss
    base_loss: torch.Tensor
    final_loss: torch.Tensor
    base_correct: torch.Tensor  # [D] correct base argmaxes per draft position (summed over blocks)
    final_correct: torch.Tensor  # [D] same for the final (head-corrected) logits
    counts: torch.Tensor  # [D] valid labels per draft position
    accepted: torch.Tensor  # sum over valid blocks of 1 + leading correct final drafts (teacher-forced tau)
    num_blocks: torch.Tensor  # valid blocks
    label_weight: torch.Tensor  # the sum of the label weights the losses are means over


def accepted_lengths(hits: torch.BoolTensor, block_valid: torch.BoolTensor) -> torch.LongTensor:
    """Tokens each block adds when verified greedily: 1 + its leading correct drafts (`hits` `[N, D]`); 0 if invalid."""
    return (hits.long().cumprod(dim=1).sum(dim=1) + 1) * block_valid


def domino_losses(
    base_logits: torch.Tensor,
    final_logits: torch.Tensor,
    labels: torch.LongTensor,
    label_mask: torch.BoolTensor,
    weights: torch.Tensor,
    lam: float,
    target_probs: torch.Tensor | None = None,
    kl_weight: float = 0.0,
) -> DominoLossOutput:
    """Position-weighted cross-entropies of the base and final logits and their curriculum mix.

    Args:
        base_logits, final_logits: `[N, D, V]` for N blocks (float32 is best: the vocabulary is large).
        labels, label_mask: `[N, D]`; a label of -1 (outside a draft vocabulary, `draft_vocab_index`) is counted
            but is never a hit and takes no loss.
        weights: `[D]`, see `position_weights`.
        lam: base-loss weight, see `curriculum_lambda`.
        target_probs: `[N, D, V]`, the target's next-token distribution at each label (`target_next_token_probs`);
            needed when `kl_weight > 0`.
        kl_weight: each cross-entropy is `(1 - kl_weight) * CE(label) + kl_weight * CE(target_probs)`.
    """
    if kl_weight > 0 and target_probs is None:
        raise ValueError("kl_weight > 0 needs the target's next-token distribution (target_probs).")
    mask = label_mask.float()
    weight = weights.view(1, -1) * (label_mask & (labels >= 0))
    denominator = weight.sum().clamp(min=1e-6)
    loss_labels = labels.clamp(min=0)

    def weighted_ce(logits: torch.Tensor) -> torch.Tensor:
        ce = F.cross_entropy(logits.float().flatten(0, 1), loss_labels.flatten(), reduction="none").view(labels.shape)
        if kl_weight > 0:
            soft = -(target_probs * F.log_softmax(logits.float(), dim=-1)).sum(-1)
            ce = (1.0 - kl_weight) * ce + kl_weight * soft
        return (ce * weight).sum() / denominator

    base_loss = weighted_ce(base_logits)
    final_loss = weighted_ce(final_logits)
    with torch.no_grad():
        base_hit = (base_logits.argmax(-1) == labels) & label_mask
        final_hit = (final_logits.argmax(-1) == labels) & label_mask
        block_valid = label_mask[:, 0]
        accepted = accepted_lengths(final_hit, block_valid)
    return DominoLossOutput(
        loss=(1.0 - lam) * final_loss + lam * base_loss,
        base_loss=base_loss,
        final_loss=final_loss,
        base_correct=base_hit.sum(0).float(),
        final_correct=final_hit.sum(0).float(),
        counts=mask.sum(0),
        accepted=accepted.sum().float(),
        num_blocks=block_valid.sum().float(),
        label_weight=weight.sum().detach(),
    )


def draft_logits(
    drafter: DominoForSpeculation,
    target_modules: TargetModules,
    context_features: torch.Tensor,
    context_mask: torch.Tensor,
    blocks: BlockInputs,
    anchors: torch.LongTensor,
    mask_dtype: torch.dtype = torch.float32,
    vocab: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced base and final logits of every draft of every block, `[b * m, D, V]` each.

    All blocks of the batch share one backbone forward; the head then runs on the ground-truth block tokens, so its
    sequential GRU becomes one `nn.GRU` call over `[anchor, y_0, ..., y_{D-2}]`. With `vocab` (draft vocabulary token
    ids) the logits cover those tokens only, `[b * m, D, len(vocab)]`.
    """
    config = drafter.config
    batch_size, num_blocks, block_size = blocks.block_ids.shape
    seq_len = context_features.shape[1]
    block_embeds = target_modules.embed(blocks.block_ids.view(batch_size, -1), drafter.dtype, drafter.device)
    context_positions = torch.arange(seq_len, device=anchors.device).expand(batch_size, -1)
    position_ids = torch.cat([context_positions, blocks.position_ids.view(batch_size, -1)], dim=1)
    attention_mask = block_attention_mask(anchors, context_mask, block_size, dtype=mask_dtype)
    block_hidden = drafter(block_embeds, context_features, position_ids, attention_mask=attention_mask)
    draft_hidden = drafter.draft_hidden_states(block_hidden.view(batch_size * num_blocks, block_size, -1))
    base_logits = target_modules.logits(draft_hidden, vocab).float()
    if not config.has_domino_head:
        return base_logits, base_logits

    gru_weight = drafter.prefix_gru.weight_ih_l0
    gru_inputs = target_modules.embed(blocks.gru_ids.flatten(0, 1), gru_weight.dtype, gru_weight.device)
    # Output k of the GRU is its state after reading anchor, y_0 .. y_{k-1}: exactly what draft k sees at inference.
    states, _ = drafter.prefix_gru(gru_inputs)
    correction = drafter.logit_correction(draft_hidden, states.transpose(0, 1), vocab).float()
    head_on = torch.arange(correction.shape[1], device=correction.device) >= config.pure_draft_prefix_len
    final_logits = base_logits + correction * head_on.view(1, -1, 1)
    return base_logits, final_logits


@torch.no_grad()
def target_next_token_probs(
    target_modules: TargetModules,
    last_hidden: torch.Tensor,
    anchors: torch.LongTensor,
    num_drafts: int,
    vocab: torch.Tensor | None = None,
) -> torch.Tensor:
    """The target's next-token distribution for every draft label, `[b * m, D, V]` (float32).

    Draft k's label is the token at `anchor + k + 1`, which the target predicts from position `anchor + k`: its
    (final-norm) hidden state there, through the target's own LM head, gives the distribution without storing logits.
    With `vocab`, the probabilities of those tokens only (not renormalized: their soft cross-entropy against draft
    logits over `vocab` is lowest at the target's distribution restricted to them).
    """
    batch_size, num_blocks = anchors.shape
    positions = anchors.unsqueeze(-1) + torch.arange(num_drafts, device=anchors.device)  # [b, m, D]
    positions = positions.clamp(max=last_hidden.shape[1] - 1).view(batch_size, -1, 1)
    hidden = last_hidden.gather(1, positions.expand(-1, -1, last_hidden.shape[-1]))
    logits = target_modules.logits(hidden).float().view(batch_size * num_blocks, num_drafts, -1)
    probs = logits.softmax(dim=-1)
    return probs if vocab is None else probs[..., vocab.to(probs.device)]


def draft_vocab_index(vocab: torch.Tensor, vocab_size: int) -> torch.LongTensor:
    """`[vocab_size]` table from token id to its column in logits over the draft vocabulary `vocab`, -1 outside it.

    Built once per run: indexing it with labels maps them without a host sync on every step.
    """
    index = torch.full((vocab_size,), -1, dtype=torch.long, device=vocab.device)
    index[vocab] = torch.arange(vocab.numel(), device=vocab.device)
    return index


class DominoTrainingModule(nn.Module):
    """Wraps a drafter so that one `forward` computes the losses: what DDP/FSDP wrap and `accelerate` prepares.

    The frozen target modules are kept as a plain attribute (not a submodule), so they are neither trained, synced,
    sharded nor saved with the drafter. With `vocab` (draft vocabulary token ids) drafts are trained and scored over
    those tokens only.
    """

    def __init__(
        self, drafter: DominoForSpeculation, target_modules: TargetModules, vocab: torch.Tensor | None = None
    ):
        super().__init__()
        self.drafter = drafter
        self.target_modules = target_modules
        self.vocab = vocab
        self.vocab_index = None if vocab is None else draft_vocab_index(vocab, drafter.config.vocab_size)

    def _teacher_forced_blocks(
        self,
        input_ids: torch.LongTensor,
        loss_mask: torch.Tensor,
        attention_mask: torch.Tensor,
        context_features: torch.Tensor,
        anchors: torch.LongTensor,
        anchor_valid: torch.BoolTensor,
        mask_dtype: torch.dtype,
    ) -> tuple[BlockInputs, torch.Tensor, torch.Tensor, torch.LongTensor]:
        """The blocks at `anchors`, their base and final logits `[b * m, D, V']`, and their labels `[b * m, D]` as
        columns of those logits (-1 for a label outside the draft vocabulary)."""
        config = self.drafter.config
        blocks = build_block_inputs(
            input_ids,
            loss_mask,
            anchors,
            anchor_valid,
            block_size=config.block_size,
            num_drafts=config.num_drafts,
            mask_token_id=config.mask_token_id,
        )
        base_logits, final_logits = draft_logits(
            self.drafter,
            self.target_modules,
            context_features,
            attention_mask,
            blocks,
            anchors,
            mask_dtype,
            self.vocab,
        )
        labels = blocks.labels.flatten(0, 1)
        labels = labels if self.vocab_index is None else self.vocab_index[labels]
        return blocks, base_logits, final_logits, labels

    def forward(
        self,
        input_ids: torch.LongTensor,
        loss_mask: torch.Tensor,
        attention_mask: torch.Tensor,
        context_features: torch.Tensor,
        anchors: torch.LongTensor,
        anchor_valid: torch.BoolTensor,
        lam: float,
        mask_dtype: torch.dtype = torch.float32,
        target_last_hidden: torch.Tensor | None = None,
        kl_weight: float = 0.0,
    ) -> DominoLossOutput:
        config = self.drafter.config
        blocks, base_logits, final_logits, labels = self._teacher_forced_blocks(
            input_ids, loss_mask, attention_mask, context_features, anchors, anchor_valid, mask_dtype
        )
        weights = position_weights(config.num_drafts, config.block_size, device=base_logits.device)
        target_probs = None
        if kl_weight > 0:
            if target_last_hidden is None:
                raise ValueError("kl_weight > 0 needs the target's last hidden state (target_last_hidden).")
            target_probs = target_next_token_probs(
                self.target_modules, target_last_hidden, anchors, config.num_drafts, self.vocab
            )
        return domino_losses(
            base_logits,
            final_logits,
            labels,
            blocks.label_mask.flatten(0, 1),
            weights,
            lam,
            target_probs,
            kl_weight,
        )

    @torch.no_grad()
    def block_acceptance(
        self,
        input_ids: torch.LongTensor,
        loss_mask: torch.Tensor,
        attention_mask: torch.Tensor,
        context_features: torch.Tensor,
        anchors: torch.LongTensor,
        anchor_valid: torch.BoolTensor,
        mask_dtype: torch.dtype = torch.float32,
        first_draft_branches: int = 1,
    ) -> torch.LongTensor:
        """`[b, m]`: the tokens greedy `generate()` would add with a block at each anchor (0 for an invalid one).

        1 + the block's leading correct teacher-forced drafts, which are `generate()`'s own drafts up to its first
        wrong one (the GRU has read the same tokens), so this is `generate()`'s acceptance on a sequence it produced.
        `first_draft_branches` n > 1 scores a block verified as n branches, one per first draft among the drafter's
        n likeliest, each continued by the head from it (as the head would after reading it): what a tree of n
        first-token branches would accept (`examples/first_token_branches.py`; not what generate() does).
        """
        blocks, _, final_logits, labels = self._teacher_forced_blocks(
            input_ids, loss_mask, attention_mask, context_features, anchors, anchor_valid, mask_dtype
        )
        hits = final_logits.argmax(-1) == labels
        if first_draft_branches > 1:
            branches = final_logits[:, 0].topk(first_draft_branches, dim=-1).indices
            hits[:, 0] = (branches == labels[:, :1]).any(dim=-1)
        hits &= blocks.label_mask.flatten(0, 1)
        return accepted_lengths(hits, anchor_valid.flatten()).view(anchors.shape)

    @torch.no_grad()
    def acceptance_everywhere(
        self,
        input_ids: torch.LongTensor,
        loss_mask: torch.Tensor,
        attention_mask: torch.Tensor,
        context_features: torch.Tensor,
        mask_dtype: torch.dtype = torch.float32,
        first_draft_branches: int = 1,
    ) -> torch.LongTensor:
        """`[b, T]`: `block_acceptance` of a block at every position (0 where none can start), `ACCEPTANCE_CHUNK`
        anchors per forward: about `response length / ACCEPTANCE_CHUNK` no-grad forwards."""
        usable = usable_anchors(loss_mask)
        first = int(loss_mask.bool().long().argmax(dim=1).min())
        acceptance = torch.zeros(usable.shape, dtype=torch.long, device=usable.device)
        for start in range(first, usable.shape[1], ACCEPTANCE_CHUNK):
            positions = torch.arange(start, min(start + ACCEPTANCE_CHUNK, usable.shape[1]), device=usable.device)
            acceptance[:, positions] = self.block_acceptance(
                input_ids,
                loss_mask,
                attention_mask,
                context_features,
                positions.expand(usable.shape[0], -1),
                usable[:, positions],
                mask_dtype,
                first_draft_branches,
            )
        return acceptance

    @torch.no_grad()
    def generate_blocks(
        self,
        input_ids: torch.LongTensor,
        loss_mask: torch.Tensor,
        attention_mask: torch.Tensor,
        context_features: torch.Tensor,
        mask_dtype: torch.dtype = torch.float32,
    ) -> list[list[tuple[int, int]]]:
        """Per sequence, the blocks greedy `generate()` with whole blocks drafts over its response: `(anchor, tokens
        added)` each, the last (cut-off) one left out.

        Scores a block at every anchor (`acceptance_everywhere`), then follows the blocks from the response's first
        token (`data.generate_chain`). On the target's own greedy answers (regenerated data) these are `generate()`'s
        blocks on their prompts, without generating.
        """
        acceptance = self.acceptance_everywhere(input_ids, loss_mask, attention_mask, context_features, mask_dtype)
        first = loss_mask.bool().long().argmax(dim=1)
        return [generate_chain(row, start) for row, start in zip(acceptance.tolist(), first.tolist())]

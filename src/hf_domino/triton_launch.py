"""Launchers of the fused Domino head's Triton kernels (`hf_domino.triton_kernels`): tile sizes, the buffers of one
block (`Workspace`), one launcher per kernel step, and single-kernel wrappers for the kernel tests.

Every launcher takes a batch's rows at once (one sequence is one row) and enqueues work without a host
synchronization, so that `hf_domino.triton_rollout.launch_rollout` can be captured as a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .triton_kernels import check_kernel_device, triton

if triton is not None:
    from .triton_kernels import _correction_hidden_kernel, _finalize_pick_kernel, _gru_cell_kernel, _logits_pick_kernel

if TYPE_CHECKING:
    from .triton_rollout import HeadWeights


# ------------------------------------------------------------------------------------------------------ tile choices
# Untuned first guesses for Hopper-class GPUs (the microbenchmark is where to tune them). The logits kernel streams
# W2 (vocab x rank, 78 MB at Qwen3-8B in bf16) once per draft position: it dominates the head's time.
GRU_BLOCK_G = 8
GRU_BLOCK_K = 256
HIDDEN_BLOCK_R = 4
HIDDEN_BLOCK_K = 512
LOGITS_BLOCK_V = 64
LOGITS_BLOCK_R = 128


def _pow2(n: int, cap: int) -> int:
    return min(triton.next_power_of_2(max(n, 1)), cap)


def _num_tiles(vocab_size: int, block_v: int) -> int:
    return triton.cdiv(vocab_size, block_v)


# ------------------------------------------------------------------------------------------------- sampling settings
@dataclass(frozen=True)
class Sampling:
    """One row's sampling settings as the fused head draws with them: transformers' temperature, top-k, top-p and
    min-p warpers, in the order generate() builds them (`fused_head.fused_sampling` reads them off a row's logits
    processors). A setting at its default is a warper the row does not have."""

    temperature: float = 1.0
    top_k: int = 0  # 0: none
    top_p: float = 1.0  # 1.0: none
    min_p: float = 0.0  # 0.0: none

    def row(self) -> tuple[float, float, float, float]:
        """The row's values as `Workspace.settings` holds them: top-p as the cumulative probability below which
        tokens go, `1 - top_p` (computed as transformers' `TopPLogitsWarper` computes it), and -1 for none, which no
        cumulative probability is at or below."""
        floor = 1 - self.top_p if self.top_p < 1.0 else -1.0
        return (self.temperature, float(self.top_k), floor, self.min_p)


@dataclass(frozen=True)
class Warps:
    """The warpers a launch applies after the temperature, over each row's own settings: fixed for a captured graph,
    which replays the same ops whatever settings the workspace holds (a row without one of them is left as it is).
    `top_k` is the widest top-k any row asks for (0: none)."""

    top_k: int = 0
    top_p: bool = False
    min_p: bool = False

    @classmethod
    def of(cls, settings: Sequence[Sampling]) -> Warps:
        return cls(
            max((setting.top_k for setting in settings), default=0),
            any(setting.top_p < 1.0 for setting in settings),
            any(setting.min_p > 0.0 for setting in settings),
        )

    def __bool__(self) -> bool:
        return bool(self.top_k or self.top_p or self.min_p)

    def covers(self, other: Warps) -> bool:
        return self.top_k >= other.top_k and self.top_p >= other.top_p and self.min_p >= other.min_p

    def union(self, other: Warps) -> Warps:
        return Warps(max(self.top_k, other.top_k), self.top_p or other.top_p, self.min_p or other.min_p)


def warp_rows(scores: torch.Tensor, settings: torch.Tensor, warps: Warps) -> torch.Tensor:
    """`scores [rows, P, V]` through each row's top-k, top-p and min-p (`settings [rows, 4]`, `Sampling.row`'s
    columns), as transformers' `TopKLogitsWarper`, `TopPLogitsWarper` and `MinPLogitsWarper` (keeping one token at
    least, filtering to -inf) compute them for that row alone, op for op. Torch ops with no host synchronization, so
    a CUDA graph captures them; `warps` says which to run at all."""
    top_k, floor, min_p = (settings[: scores.shape[0], column, None, None] for column in (1, 2, 3))
    if warps.top_k:
        width = min(warps.top_k, scores.shape[-1])
        kth = scores.topk(width, dim=-1).values.gather(
            -1, (top_k.long().clamp(1, width) - 1).expand(*scores.shape[:2], 1)
        )
        scores = scores.masked_fill(scores < kth.masked_fill(top_k == 0, float("-inf")), float("-inf"))
    if warps.top_p:
        ascending, order = scores.sort(dim=-1)
        remove = ascending.softmax(dim=-1).cumsum(dim=-1) <= floor
        remove[..., -1] = False
        scores = scores.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
    if warps.min_p:  # the likeliest token always stays (min_p <= 1), as the warper keeps it
        probs = scores.softmax(dim=-1)
        scores = scores.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    return scores


# --------------------------------------------------------------------------------------------------------- launches
class Workspace:
    """Every buffer one block rollout touches, for `rows` sequences drafted together; static (fixed addresses) so
    a CUDA graph can replay over it."""

    def __init__(
        self,
        num_drafts: int,
        vocab_size: int,
        device: torch.device,
        weights: HeadWeights | None,
        block_v: int = LOGITS_BLOCK_V,
        vocab: torch.Tensor | None = None,
        spread_size: int | None = None,
        warps: Warps = Warps(),
        rows: int = 1,
    ):
        """`vocab_size` columns of base logits per draft; with `vocab`, they are those (sorted) token ids.

        With `spread_size`, the logits are stored over a whole vocabulary of that size, `-inf` outside `vocab` (what
        sampling returns); else over the `vocab_size` columns. `warps`: the warpers `launch_warped_pick` applies
        before its second pick over the stored logits (none: no second pick). Every buffer has a leading dimension
        of `rows` (the batch).
        """
        num_tiles = _num_tiles(vocab_size, block_v)
        self.block_v = block_v
        self.vocab = vocab
        self.spread = spread_size is not None and vocab is not None
        self.tokens = torch.zeros(rows, num_drafts + 1, dtype=torch.long, device=device)  # [anchor, drafts...]
        shape = (rows, num_drafts)
        if self.spread:
            # Only the vocabulary's columns are ever written: the -inf elsewhere survives every replay.
            self.logits = torch.full((*shape, spread_size), float("-inf"), dtype=torch.float32, device=device)
        else:
            self.logits = torch.zeros(*shape, vocab_size, dtype=torch.float32, device=device)
        self.best = torch.empty(*shape, num_tiles, dtype=torch.float32, device=device)
        self.best_idx = torch.empty(*shape, num_tiles, dtype=torch.long, device=device)
        self.seed = torch.zeros(1, dtype=torch.long, device=device)
        # Each row's sampling settings (`Sampling.row`), read by the kernels (the temperature) and the warps; rows
        # no call has set draw at temperature 1 through no warper.
        self.settings = torch.tensor([Sampling().row()] * rows, dtype=torch.float32, device=device)
        self.loaded: tuple[Sampling, ...] = (Sampling(),) * rows
        self.warps = warps
        if warps:  # the re-pick reads the stored (already tempered) logits: temperature 1, tiles of a stored row
            self.unit_temperature = torch.ones(rows, dtype=torch.float32, device=device)
            warped_tiles = _num_tiles(self.logits.shape[-1], block_v)
            self.warped_best = torch.empty(*shape, warped_tiles, dtype=torch.float32, device=device)
            self.warped_best_idx = torch.empty(*shape, warped_tiles, dtype=torch.long, device=device)
        if weights is not None:
            gru_size, rank = weights.weight_hh.shape[1], weights.proj_out.shape[1]
            # states[:, j]: the GRU state after reading tokens[:, 0..j] (the anchor and drafts 0..j-1), which is what
            # draft position j is corrected with. One slot per step, so no kernel reads a state it is writing.
            self.states = torch.zeros(*shape, gru_size, dtype=weights.weight_hh.dtype, device=device)
            self.proj = torch.zeros(*shape, rank, dtype=torch.float32, device=device)
            self.hidden = torch.zeros(*shape, rank, dtype=torch.float32, device=device)

    @property
    def num_drafts(self) -> int:
        return self.logits.shape[1]

    @property
    def temperature(self) -> torch.Tensor:
        """`[rows]`: each row's temperature (a column of `settings`)."""
        return self.settings[:, 0]

    def start(self, anchor_ids: torch.LongTensor, sampling: Sequence[Sampling] | None) -> None:
        """Loads one block's inputs that are not tensors of the block: each row's anchor (the last column of
        `anchor_ids [rows', n]`, into the first `rows'` rows) and, when sampling, each row's settings (`sampling`,
        one per row; `None`: greedy).

        The seed comes from torch's generator on the workspace's device, so `torch.manual_seed` reproduces sampled
        drafts, and a fresh one per block gives a replayed graph fresh noise. Settings are copied to the device only
        when they change (a call's rows mostly keep theirs from block to block).
        """
        self.tokens[: anchor_ids.shape[0], 0].copy_(anchor_ids[:, -1])
        if sampling is None:
            return
        self.seed.random_(0, 2**62)
        sampling = tuple(sampling)
        if sampling != self.loaded[: len(sampling)]:
            rows = torch.tensor([setting.row() for setting in sampling], dtype=torch.float32)
            self.settings[: len(sampling)].copy_(rows)
            self.loaded = sampling + self.loaded[len(sampling) :]


def launch_gru_cell(
    embed_weight: torch.Tensor,
    tokens: torch.Tensor,
    token_index: int,
    state: torch.Tensor | None,
    weight_ih: torch.Tensor,
    weight_hh: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """`out[b] = GRUCell(embed[tokens[b, token_index]], state[b])` for every row `b`: `tokens [rows, n]`,
    `state` and `out` `[rows, G]` (rows may be strided, each row contiguous; `state=None` is zeros)."""
    gru_size, input_size = weight_hh.shape[1], weight_ih.shape[1]
    block_g = _pow2(gru_size, GRU_BLOCK_G)
    _gru_cell_kernel[(triton.cdiv(gru_size, block_g), tokens.shape[0])](
        embed_weight,
        embed_weight.stride(0),
        tokens,
        tokens.stride(0),
        token_index,
        out if state is None else state,  # never read with ZERO_STATE; any valid pointer will do
        out.stride(0) if state is None else state.stride(0),
        weight_ih,
        weight_ih.stride(0),
        weight_hh,
        weight_hh.stride(0),
        out,
        out.stride(0),
        input_size,
        gru_size,
        ZERO_STATE=state is None,
        BLOCK_G=block_g,
        BLOCK_K=_pow2(max(input_size, gru_size), GRU_BLOCK_K),
        num_warps=4,
    )


def launch_correction_hidden(
    proj: torch.Tensor, state: torch.Tensor, proj_in_weight: torch.Tensor, hidden_size: int, out: torch.Tensor
) -> None:
    """`out[b] = silu(proj[b] + W1[:, H:] state[b])` for every row `b` of `proj [rows, R]`, `state [rows, G]`."""
    rank, gru_size = proj_in_weight.shape[0], proj_in_weight.shape[1] - hidden_size
    block_r = _pow2(rank, HIDDEN_BLOCK_R)
    _correction_hidden_kernel[(triton.cdiv(rank, block_r), proj.shape[0])](
        proj,
        proj.stride(0),
        state,
        state.stride(0),
        proj_in_weight[:, hidden_size:],  # a strided view: the kernel walks rows with W1's full row stride
        proj_in_weight.stride(0),
        out,
        out.stride(0),
        rank,
        gru_size,
        BLOCK_R=block_r,
        BLOCK_K=_pow2(gru_size, HIDDEN_BLOCK_K),
        num_warps=4,
    )


def launch_logits_pick(
    ws: Workspace,
    positions: slice,
    base_logits: torch.Tensor,
    hidden: torch.Tensor | None,
    proj_out_weight: torch.Tensor | None,
    *,
    sample: bool,
    pick: bool = True,
) -> None:
    """Picks draft `positions` of every row into `ws.tokens[:, 1 + position]`, their logits into `ws.logits`.

    `base_logits` `[rows, k, V]` are the whole block's (over `ws.vocab` when set), `hidden` `[rows, len(positions),
    R]` the correction's hidden vectors of those positions (`None`: base logits alone), `proj_out_weight` the whole
    W2 (`[vocab, R]`; a draft vocabulary's rows are gathered in the kernel). Positions are independent given their
    hidden vectors, so one launch covers them all, for every row. `pick=False` stores the logits only, for
    `launch_warped_pick` to draw from.
    """
    _launch_pick(
        ws,
        positions,
        base_logits[:, positions],
        hidden,
        proj_out_weight,
        ws.temperature,
        ws.best,
        ws.best_idx,
        vocab=ws.vocab,
        spread=ws.spread,
        sample=sample,
        pick=pick,
    )


def launch_warped_pick(ws: Workspace, positions: slice) -> None:
    """Draws draft `positions` of every row again, from their stored logits after each row's top-k / top-p / min-p
    (`warp_rows` over `ws.settings`, the ones `ws.warps` names).

    `launch_logits_pick(..., sample=True, pick=False)` stored the tempered logits (over the whole vocabulary when
    sampling); the warps filter them in place, and a Gumbel-max draw over the result replaces the tokens picked
    before: the drafts come from, and the logits returned are, exactly the warped distribution. Needs a
    `Workspace(..., warps=...)` naming some.
    """
    logits = ws.logits[:, positions]
    if logits.shape[1] == 0:  # an empty pure-draft prefix
        return
    logits.copy_(warp_rows(logits, ws.settings, ws.warps))
    _launch_pick(
        ws, positions, logits, None, None, ws.unit_temperature, ws.warped_best, ws.warped_best_idx,
        vocab=None, spread=False, sample=True,
    )  # fmt: skip


def _launch_pick(
    ws: Workspace,
    positions: slice,
    base: torch.Tensor,
    hidden: torch.Tensor | None,
    proj_out_weight: torch.Tensor | None,
    temperature: torch.Tensor,
    best: torch.Tensor,
    best_idx: torch.Tensor,
    *,
    vocab: torch.Tensor | None,
    spread: bool,
    sample: bool,
    pick: bool = True,
) -> None:
    """The two kernels of a pick: `base (+ hidden @ W2.T)` (`[rows, P, V]`, P = the positions) into
    `ws.logits[:, positions]` with each tile's winner in `best`/`best_idx` (`[rows, k, tiles]`), then the winners
    reduced into `ws.tokens[:, 1 + position]`; without `pick`, the first kernel's logits alone."""
    rows, num_positions, vocab_size = base.shape
    if rows == 0 or num_positions == 0:
        return
    tiles = _num_tiles(vocab_size, ws.block_v)
    has_correction = proj_out_weight is not None
    has_vocab = vocab is not None
    vocab = vocab if has_vocab else ws.tokens  # never read without HAS_VOCAB; any valid pointer will do
    rank = proj_out_weight.shape[1] if has_correction else 1
    logits = ws.logits[:, positions]
    first, num_drafts = positions.start, ws.num_drafts
    _logits_pick_kernel[(tiles, rows * num_positions)](
        hidden if has_correction else base,
        hidden.stride(0) if has_correction else 0,
        hidden.stride(1) if has_correction else 0,
        proj_out_weight if has_correction else base,
        proj_out_weight.stride(0) if has_correction else 0,
        base,
        base.stride(0),
        base.stride(1),
        logits,
        logits.stride(0),
        logits.stride(1),
        best,
        best_idx,
        ws.seed,
        temperature,
        temperature.stride(0),
        vocab,
        first,
        num_positions,
        num_drafts,
        vocab_size,
        rank,
        tiles,
        HAS_CORRECTION=has_correction,
        SAMPLE=sample,
        HAS_VOCAB=has_vocab,
        SPREAD=spread,
        PICK=pick,
        BLOCK_V=ws.block_v,
        BLOCK_R=_pow2(rank, LOGITS_BLOCK_R),
        num_warps=4,
    )
    if not pick:
        return
    _finalize_pick_kernel[(rows * num_positions,)](
        best,
        best_idx,
        vocab,
        ws.tokens,
        ws.tokens.stride(0),
        first,
        num_positions,
        num_drafts,
        tiles,
        HAS_VOCAB=has_vocab,
        BLOCK_T=triton.next_power_of_2(tiles),
        num_warps=4 if tiles <= 1024 else 8,
    )


# ------------------------------------------------------------------------------------ single-kernel wrappers (tests)
def gru_cell(
    embed_weight: torch.Tensor,
    token_ids: torch.LongTensor,
    state: torch.Tensor | None,
    weight_ih: torch.Tensor,
    weight_hh: torch.Tensor,
) -> torch.Tensor:
    """One bias-free GRU step on `embed_weight[token_ids[-1]]` from `state` (`[G]`, `None` = zeros): `[G]` new state.

    The state is kept in the GRU weights' dtype, as the eager `nn.GRU` returns it.
    """
    check_kernel_device(weight_ih.device)
    token_ids = token_ids.reshape(1, -1).to(device=weight_ih.device, dtype=torch.long)
    out = torch.empty(1, weight_hh.shape[1], dtype=weight_hh.dtype, device=weight_hh.device)
    state = None if state is None else state[None]
    launch_gru_cell(embed_weight, token_ids, token_ids.shape[1] - 1, state, weight_ih, weight_hh, out)
    return out[0]


def correction_hidden(
    projected_draft: torch.Tensor, state: torch.Tensor, proj_in_weight: torch.Tensor, hidden_size: int
) -> torch.Tensor:
    """`silu(W1 [z ; s])` (`[R]`, fp32) given `projected_draft = W1[:, :hidden_size] z` (`[R]`, fp32) and `s` (`[G]`)."""
    check_kernel_device(proj_in_weight.device)
    out = torch.empty(1, proj_in_weight.shape[0], dtype=torch.float32, device=proj_in_weight.device)
    launch_correction_hidden(projected_draft.float().contiguous()[None], state[None], proj_in_weight, hidden_size, out)
    return out[0]


def logits_pick(
    base_logits: torch.Tensor,
    hidden: torch.Tensor | None = None,
    proj_out_weight: torch.Tensor | None = None,
    *,
    temperature: float | None = None,
    seed: int = 0,
    block_v: int = LOGITS_BLOCK_V,
    vocab: torch.Tensor | None = None,
    spread_size: int | None = None,
) -> tuple[torch.LongTensor, torch.Tensor]:
    """Picks a token per row of `base_logits + hidden @ W2.T` (`[rows, V]`; `hidden` `[rows, R]` may be `None`).

    Greedy (argmax) when `temperature` is `None`, else a draw from `softmax(logits / temperature)`. With `vocab`
    (`[V]` sorted token ids), column `c` is token `vocab[c]`: W2's rows are `W2[vocab]` and the picked tokens are ids;
    with `spread_size` too, the logits come back over that whole vocabulary, `-inf` outside `vocab`. Returns
    `(tokens [rows], processed logits [rows, V or spread_size] fp32)`. The rows are the draft positions of one
    sequence's block (a workspace of one batch row).
    """
    check_kernel_device(base_logits.device)
    rows, vocab_size = base_logits.shape
    ws = Workspace(rows, vocab_size, base_logits.device, None, block_v, vocab, spread_size)
    ws.seed.fill_(seed)
    ws.temperature.fill_(1.0 if temperature is None else temperature)
    hidden = None if hidden is None else hidden.float()[None]
    launch_logits_pick(ws, slice(0, rows), base_logits[None], hidden, proj_out_weight, sample=temperature is not None)
    return ws.tokens[0, 1:], ws.logits[0]


__all__ = [
    "LOGITS_BLOCK_V",
    "Sampling",
    "Warps",
    "Workspace",
    "correction_hidden",
    "gru_cell",
    "launch_correction_hidden",
    "launch_gru_cell",
    "launch_logits_pick",
    "launch_warped_pick",
    "logits_pick",
    "warp_rows",
]

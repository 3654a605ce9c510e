"""Fused Triton kernels (and a CUDA-graph runner) for the Domino head rollout.

The eager rollout (`DominoForSpeculation.rollout`) is the reference. Per draft position it runs a GRU step, the
low-rank correction `W2 silu(W1 [z ; s])`, adds the base logits and picks a token: a dozen small PyTorch ops per
position, 16 positions per block, each waiting on the previous token. This module does the same work with four
kernels per position, all on the device (the picked token never goes back to the host), so that a whole block can
also be captured once as a CUDA graph and replayed:

1. `_gru_cell_kernel`: gathers the last picked token's embedding itself and does the bias-free GRU cell;
2. `_correction_hidden_kernel`: `silu(W1[:, H:] s + W1[:, :H] z)`, where `W1[:, :H] z` was precomputed for every
   draft position in one matmul before the loop;
3. `_logits_pick_kernel`: one program per vocabulary tile: `W2` tile times the hidden vector, plus the base logits,
   divided by the temperature when sampling, stored (speculative sampling needs the exact distribution each draft was
   drawn from), then the tile's best score (argmax, or Gumbel-max with Philox noise when sampling) and its index;
4. `_finalize_pick_kernel`: reduces the per-tile winners to the token; ties go to the lowest index, as in
   `torch.argmax`, because both stages break ties towards the left and tiles are ordered by index.

Arithmetic accumulates in fp32 whatever the weight dtype; intermediate results are rounded to the weight dtype where
the eager path materializes a weight-dtype tensor (GRU state, `W1` output, SiLU output, correction), so that both
paths pick the same tokens unless two logits are within accumulation-order noise. Logits always come back in fp32.

Entry points: `select_rollout()` (what the candidate generator calls once per `generate()`), `fused_rollout()` (one
block, no graph), `DominoHeadGraphRunner` (one block, captured and replayed). Triton is optional: without it
`select_rollout()` picks the eager path. On CPU the kernels only run under Triton's interpreter, which must be enabled
(`TRITON_INTERPRET=1`) before this module is imported, since `triton.jit` decides at decoration time.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: `select_rollout()` then always answers "eager"
    triton = tl = None

if TYPE_CHECKING:
    from transformers import LogitsProcessorList

    from .modeling_domino import DominoForSpeculation

# `(draft_hidden [1, k, H], base_logits [1, k, V], anchor_ids [1, n], target_embed_weight [V, H])
#  -> (draft_ids [1, k], logits [1, k, V] fp32)`, the contract of `DominoForSpeculation.rollout` minus the picker.
FastRollout = Callable[
    [torch.Tensor, torch.Tensor, torch.LongTensor, torch.Tensor], tuple[torch.LongTensor, torch.Tensor]
]

ROLLOUT_MODES = ("auto", "eager", "triton", "triton+graph")
# Overrides `mode="auto"` without touching code, e.g. `HF_DOMINO_HEAD=eager` to rule the fast path out of a bug hunt.
MODE_ENV_VAR = "HF_DOMINO_HEAD"


# ------------------------------------------------------------------------------------------------------------ kernels
if triton is not None:

    @triton.jit
    def _tanh(x):
        # tl has no tanh that also runs in the interpreter; this identity is exact enough in fp32 for a GRU gate.
        return 2.0 * tl.sigmoid(2.0 * x) - 1.0

    @triton.jit
    def _gru_cell_kernel(
        embed_ptr,
        embed_stride,
        tokens_ptr,
        token_index,
        state_ptr,
        w_ih_ptr,
        w_ih_stride,
        w_hh_ptr,
        w_hh_stride,
        out_ptr,
        H,
        G,
        ZERO_STATE: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """`out = GRUCell(embed[tokens[token_index]], state)` for the `BLOCK_G` hidden units of this program."""
        rows = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)
        row_mask = rows < G
        gate_dtype = w_ih_ptr.dtype.element_ty
        # The token is read on the device: it was picked by the previous step's kernels, never seen by the host.
        token = tl.load(tokens_ptr + token_index)
        x_row = embed_ptr + token * embed_stride

        acc_r = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc_z = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc_n = tl.zeros([BLOCK_G], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            col_mask = cols < H
            mask = row_mask[:, None] & col_mask[None, :]
            # Eager casts the target embedding to the GRU dtype before the cell.
            x = tl.load(x_row + cols, mask=col_mask, other=0.0).to(gate_dtype).to(tl.float32)[None, :]
            w = tl.load(w_ih_ptr + rows[:, None] * w_ih_stride + cols[None, :], mask=mask, other=0.0)
            acc_r += tl.sum(w.to(tl.float32) * x, axis=1)
            w = tl.load(w_ih_ptr + (rows + G)[:, None] * w_ih_stride + cols[None, :], mask=mask, other=0.0)
            acc_z += tl.sum(w.to(tl.float32) * x, axis=1)
            w = tl.load(w_ih_ptr + (rows + 2 * G)[:, None] * w_ih_stride + cols[None, :], mask=mask, other=0.0)
            acc_n += tl.sum(w.to(tl.float32) * x, axis=1)

        h = tl.zeros([BLOCK_G], dtype=tl.float32)
        hh_r = tl.zeros([BLOCK_G], dtype=tl.float32)
        hh_z = tl.zeros([BLOCK_G], dtype=tl.float32)
        hh_n = tl.zeros([BLOCK_G], dtype=tl.float32)
        if not ZERO_STATE:  # the block's first GRU step starts from zeros: W_hh h is zero, skip reading W_hh
            for k0 in range(0, G, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                col_mask = cols < G
                mask = row_mask[:, None] & col_mask[None, :]
                s = tl.load(state_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
                w = tl.load(w_hh_ptr + rows[:, None] * w_hh_stride + cols[None, :], mask=mask, other=0.0)
                hh_r += tl.sum(w.to(tl.float32) * s, axis=1)
                w = tl.load(w_hh_ptr + (rows + G)[:, None] * w_hh_stride + cols[None, :], mask=mask, other=0.0)
                hh_z += tl.sum(w.to(tl.float32) * s, axis=1)
                w = tl.load(w_hh_ptr + (rows + 2 * G)[:, None] * w_hh_stride + cols[None, :], mask=mask, other=0.0)
                hh_n += tl.sum(w.to(tl.float32) * s, axis=1)
            h = tl.load(state_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)

        # PyTorch gate order (r, z, n); n applies r to the *hidden* product, not to h.
        r = tl.sigmoid(acc_r + hh_r)
        z = tl.sigmoid(acc_z + hh_z)
        n = _tanh(acc_n + r * hh_n)
        h_new = (1.0 - z) * n + z * h
        tl.store(out_ptr + rows, h_new.to(out_ptr.dtype.element_ty), mask=row_mask)

    @triton.jit
    def _correction_hidden_kernel(
        proj_ptr,
        state_ptr,
        w1s_ptr,
        w1_stride,
        out_ptr,
        R,
        G,
        BLOCK_R: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """`out = silu(proj + W1[:, H:] state)` for `BLOCK_R` rank units; `proj = W1[:, :H] z` was precomputed."""
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_mask = rows < R
        act_dtype = w1s_ptr.dtype.element_ty
        acc = tl.zeros([BLOCK_R], dtype=tl.float32)
        for k0 in range(0, G, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            col_mask = cols < G
            s = tl.load(state_ptr + cols, mask=col_mask, other=0.0).to(act_dtype).to(tl.float32)
            w = tl.load(
                w1s_ptr + rows[:, None] * w1_stride + cols[None, :],
                mask=row_mask[:, None] & col_mask[None, :],
                other=0.0,
            )
            acc += tl.sum(w.to(tl.float32) * s[None, :], axis=1)
        u = (acc + tl.load(proj_ptr + rows, mask=row_mask, other=0.0)).to(act_dtype).to(tl.float32)
        a = (u * tl.sigmoid(u)).to(act_dtype).to(tl.float32)
        tl.store(out_ptr + rows, a, mask=row_mask)

    @triton.jit
    def _logits_pick_kernel(
        hidden_ptr,
        hidden_stride,
        w2_ptr,
        w2_stride,
        base_ptr,
        base_stride,
        logits_ptr,
        logits_stride,
        best_ptr,
        best_idx_ptr,
        seed_ptr,
        temperature_ptr,
        row_offset,
        V,
        R,
        num_tiles,
        HAS_CORRECTION: tl.constexpr,
        SAMPLE: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_R: tl.constexpr,
    ):
        """One vocabulary tile of one draft position (`program_id(1)`): logits, stored, and the tile's winner."""
        tile = tl.program_id(0)
        row = tl.program_id(1)
        cols = tile * BLOCK_V + tl.arange(0, BLOCK_V)
        col_mask = cols < V
        logits = tl.load(base_ptr + row * base_stride + cols, mask=col_mask, other=0.0).to(tl.float32)
        if HAS_CORRECTION:
            acc = tl.zeros([BLOCK_V], dtype=tl.float32)
            for r0 in range(0, R, BLOCK_R):
                ranks = r0 + tl.arange(0, BLOCK_R)
                rank_mask = ranks < R
                a = tl.load(hidden_ptr + row * hidden_stride + ranks, mask=rank_mask, other=0.0)
                w = tl.load(
                    w2_ptr + cols[:, None] * w2_stride + ranks[None, :],
                    mask=col_mask[:, None] & rank_mask[None, :],
                    other=0.0,
                )
                acc += tl.sum(w.to(tl.float32) * a[None, :], axis=1)
            logits += acc.to(w2_ptr.dtype.element_ty).to(tl.float32)
        if SAMPLE:
            # Same op as transformers' TemperatureLogitsWarper (`scores / temperature`), correctly rounded.
            logits = tl.div_rn(logits, tl.load(temperature_ptr))
        tl.store(logits_ptr + row * logits_stride + cols, logits, mask=col_mask)

        score = logits
        if SAMPLE:
            # Gumbel-max: argmax(logits + G) with G = -log(-log(U)) is an exact draw from softmax(logits). The seed is
            # read from memory so that a captured CUDA graph draws fresh noise on every replay; the Philox counter is
            # unique per (draft position, token), so positions and tiles never share noise.
            uniform = tl.rand(tl.load(seed_ptr), (row_offset + row) * V + cols)
            score = logits - tl.log(-tl.log(uniform))
        score = tl.where(col_mask, score, float("-inf"))
        best_idx = tl.argmax(score, axis=0, tie_break_left=True)
        best = tl.max(score, axis=0)
        tl.store(best_ptr + row * num_tiles + tile, best)
        tl.store(best_idx_ptr + row * num_tiles + tile, tile * BLOCK_V + best_idx)

    @triton.jit
    def _finalize_pick_kernel(best_ptr, best_idx_ptr, tokens_ptr, token_offset, num_tiles, BLOCK_T: tl.constexpr):
        """Second stage of the vocabulary argmax: the first tile holding the maximum wins (lowest index on ties)."""
        row = tl.program_id(0)
        tiles = tl.arange(0, BLOCK_T)
        best = tl.load(best_ptr + row * num_tiles + tiles, mask=tiles < num_tiles, other=float("-inf"))
        winner = tl.argmax(best, axis=0, tie_break_left=True)
        token = tl.load(best_idx_ptr + row * num_tiles + winner)
        tl.store(tokens_ptr + token_offset + row, token.to(tokens_ptr.dtype.element_ty))


def kernels_interpreted() -> bool:
    """Whether this module's kernels were built for Triton's CPU interpreter (`TRITON_INTERPRET=1` at import)."""
    if triton is None:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_gru_cell_kernel, InterpretedFunction)


def _require_triton() -> None:
    if triton is None:
        raise RuntimeError("The fused Domino head needs Triton: `pip install triton` (or hf-domino[gpu]).")


def _check_kernel_device(device: torch.device) -> None:
    _require_triton()
    if device.type != "cuda" and not kernels_interpreted():
        raise RuntimeError(
            f"The fused Domino head runs on CUDA; tensors are on {device}. On CPU it only runs in Triton's interpreter"
            ", which must be enabled before hf_domino.triton_head is imported (TRITON_INTERPRET=1). Use the eager "
            "rollout (mode='eager') instead."
        )


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


def _launch_gru_cell(
    embed_weight: torch.Tensor,
    tokens: torch.Tensor,
    token_index: int,
    state: torch.Tensor | None,
    weight_ih: torch.Tensor,
    weight_hh: torch.Tensor,
    out: torch.Tensor,
) -> None:
    gru_size, input_size = weight_hh.shape[1], weight_ih.shape[1]
    block_g = _pow2(gru_size, GRU_BLOCK_G)
    _gru_cell_kernel[(triton.cdiv(gru_size, block_g),)](
        embed_weight,
        embed_weight.stride(0),
        tokens,
        token_index,
        out if state is None else state,  # never read with ZERO_STATE; any valid pointer will do
        weight_ih,
        weight_ih.stride(0),
        weight_hh,
        weight_hh.stride(0),
        out,
        input_size,
        gru_size,
        ZERO_STATE=state is None,
        BLOCK_G=block_g,
        BLOCK_K=_pow2(max(input_size, gru_size), GRU_BLOCK_K),
        num_warps=4,
    )


def _launch_correction_hidden(
    proj: torch.Tensor, state: torch.Tensor, proj_in_weight: torch.Tensor, hidden_size: int, out: torch.Tensor
) -> None:
    rank, gru_size = proj_in_weight.shape[0], proj_in_weight.shape[1] - hidden_size
    block_r = _pow2(rank, HIDDEN_BLOCK_R)
    _correction_hidden_kernel[(triton.cdiv(rank, block_r),)](
        proj,
        state,
        proj_in_weight[:, hidden_size:],  # a strided view: the kernel walks rows with W1's full row stride
        proj_in_weight.stride(0),
        out,
        rank,
        gru_size,
        BLOCK_R=block_r,
        BLOCK_K=_pow2(gru_size, HIDDEN_BLOCK_K),
        num_warps=4,
    )


def _launch_logits_pick(
    base: torch.Tensor,
    hidden: torch.Tensor | None,
    proj_out_weight: torch.Tensor | None,
    logits_out: torch.Tensor,
    best: torch.Tensor,
    best_idx: torch.Tensor,
    tokens: torch.Tensor,
    token_offset: int,
    seed: torch.Tensor,
    temperature: torch.Tensor,
    *,
    row_offset: int,
    sample: bool,
    block_v: int,
) -> None:
    """Picks one token for each row of `base` (`[rows, V]`); rows are independent, so one launch covers them all."""
    rows, vocab_size = base.shape
    if rows == 0:
        return
    num_tiles = _num_tiles(vocab_size, block_v)
    has_correction = proj_out_weight is not None
    rank = proj_out_weight.shape[1] if has_correction else 1
    _logits_pick_kernel[(num_tiles, rows)](
        hidden if has_correction else base,
        hidden.stride(0) if has_correction else 0,
        proj_out_weight if has_correction else base,
        proj_out_weight.stride(0) if has_correction else 0,
        base,
        base.stride(0),
        logits_out,
        logits_out.stride(0),
        best,
        best_idx,
        seed,
        temperature,
        row_offset,
        vocab_size,
        rank,
        num_tiles,
        HAS_CORRECTION=has_correction,
        SAMPLE=sample,
        BLOCK_V=block_v,
        BLOCK_R=_pow2(rank, LOGITS_BLOCK_R),
        num_warps=4,
    )
    _finalize_pick_kernel[(rows,)](
        best,
        best_idx,
        tokens,
        token_offset,
        num_tiles,
        BLOCK_T=triton.next_power_of_2(num_tiles),
        num_warps=4 if num_tiles <= 1024 else 8,
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
    _check_kernel_device(weight_ih.device)
    token_ids = token_ids.reshape(-1).to(device=weight_ih.device, dtype=torch.long)
    out = torch.empty(weight_hh.shape[1], dtype=weight_hh.dtype, device=weight_hh.device)
    _launch_gru_cell(embed_weight, token_ids, token_ids.numel() - 1, state, weight_ih, weight_hh, out)
    return out


def correction_hidden(
    projected_draft: torch.Tensor, state: torch.Tensor, proj_in_weight: torch.Tensor, hidden_size: int
) -> torch.Tensor:
    """`silu(W1 [z ; s])` (`[R]`, fp32) given `projected_draft = W1[:, :hidden_size] z` (`[R]`, fp32) and `s` (`[G]`)."""
    _check_kernel_device(proj_in_weight.device)
    out = torch.empty(proj_in_weight.shape[0], dtype=torch.float32, device=proj_in_weight.device)
    _launch_correction_hidden(projected_draft.float().contiguous(), state, proj_in_weight, hidden_size, out)
    return out


def logits_pick(
    base_logits: torch.Tensor,
    hidden: torch.Tensor | None = None,
    proj_out_weight: torch.Tensor | None = None,
    *,
    temperature: float | None = None,
    seed: int = 0,
    block_v: int = LOGITS_BLOCK_V,
) -> tuple[torch.LongTensor, torch.Tensor]:
    """Picks a token per row of `base_logits + hidden @ W2.T` (`[rows, V]`; `hidden` `[rows, R]` may be `None`).

    Greedy (argmax) when `temperature` is `None`, else a draw from `softmax(logits / temperature)`. Returns
    `(tokens [rows], processed logits [rows, V] fp32)`.
    """
    _check_kernel_device(base_logits.device)
    device, (rows, vocab_size) = base_logits.device, base_logits.shape
    num_tiles = _num_tiles(vocab_size, block_v)
    tokens = torch.empty(rows, dtype=torch.long, device=device)
    logits = torch.empty(rows, vocab_size, dtype=torch.float32, device=device)
    best = torch.empty(rows, num_tiles, dtype=torch.float32, device=device)
    best_idx = torch.empty(rows, num_tiles, dtype=torch.long, device=device)
    _launch_logits_pick(
        base_logits,
        None if hidden is None else hidden.float(),
        proj_out_weight,
        logits,
        best,
        best_idx,
        tokens,
        0,
        torch.tensor([seed], dtype=torch.long, device=device),
        torch.tensor([1.0 if temperature is None else temperature], dtype=torch.float32, device=device),
        row_offset=0,
        sample=temperature is not None,
        block_v=block_v,
    )
    return tokens, logits


# --------------------------------------------------------------------------------------------------- block rollout
@dataclass(frozen=True)
class _HeadWeights:
    weight_ih: torch.Tensor  # [3G, H], gates (r, z, n)
    weight_hh: torch.Tensor  # [3G, G]
    proj_in: torch.Tensor  # W1 [R, H + G]
    proj_out: torch.Tensor  # W2 [V, R]

    @classmethod
    def of(cls, drafter: DominoForSpeculation) -> _HeadWeights:
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


class _Workspace:
    """Every buffer one block rollout touches; static (fixed addresses) so a CUDA graph can replay over it."""

    def __init__(
        self,
        num_drafts: int,
        vocab_size: int,
        device: torch.device,
        weights: _HeadWeights | None,
        block_v: int = LOGITS_BLOCK_V,
    ):
        num_tiles = _num_tiles(vocab_size, block_v)
        self.block_v = block_v
        self.tokens = torch.zeros(num_drafts + 1, dtype=torch.long, device=device)  # [anchor, drafts...]
        self.logits = torch.zeros(num_drafts, vocab_size, dtype=torch.float32, device=device)
        self.best = torch.empty(num_drafts, num_tiles, dtype=torch.float32, device=device)
        self.best_idx = torch.empty(num_drafts, num_tiles, dtype=torch.long, device=device)
        self.seed = torch.zeros(1, dtype=torch.long, device=device)
        self.temperature = torch.ones(1, dtype=torch.float32, device=device)
        if weights is not None:
            gru_size, rank = weights.weight_hh.shape[1], weights.proj_out.shape[1]
            # states[j]: the GRU state after reading tokens[0..j] (the anchor and drafts 0..j-1), which is what
            # draft position j is corrected with. One row per step, so no kernel reads a state it is writing.
            self.states = torch.zeros(num_drafts, gru_size, dtype=weights.weight_hh.dtype, device=device)
            self.proj = torch.zeros(num_drafts, rank, dtype=torch.float32, device=device)
            self.hidden = torch.zeros(num_drafts, rank, dtype=torch.float32, device=device)


def _launch_rollout(
    weights: _HeadWeights | None,
    draft_hidden: torch.Tensor,
    base_logits: torch.Tensor,
    embed_weight: torch.Tensor,
    workspace: _Workspace,
    *,
    prefix_len: int,
    sample: bool,
) -> None:
    """Enqueues one block's rollout; no host synchronization, no data-dependent control flow (graph-capturable).

    `draft_hidden` `[k, H]` and `base_logits` `[k, V]` are the block's rows; `workspace.tokens[0]` holds the anchor,
    `workspace.seed`/`workspace.temperature` the sampling parameters. Drafts land in `workspace.tokens[1:]`, the
    logits they were picked from in `workspace.logits`.
    """
    ws, num_drafts = workspace, base_logits.shape[0]
    prefix_len = num_drafts if weights is None else min(prefix_len, num_drafts)

    def pick(rows: slice, hidden: torch.Tensor | None) -> None:
        _launch_logits_pick(
            base_logits[rows],
            hidden,
            None if hidden is None else weights.proj_out,
            ws.logits[rows],
            ws.best[rows],
            ws.best_idx[rows],
            ws.tokens,
            1 + rows.start,
            ws.seed,
            ws.temperature,
            row_offset=rows.start,
            sample=sample,
            block_v=ws.block_v,
        )

    # The pure-draft prefix (all drafts, without an active head) reads the base logits alone: one launch for all rows.
    pick(slice(0, prefix_len), None)
    if prefix_len == num_drafts:
        return

    hidden_size = weights.hidden_size
    # W1[:, :H] z for every corrected position in one matmul; only W1[:, H:] s is left inside the sequential loop.
    torch.matmul(
        draft_hidden[prefix_len:].float(), weights.proj_in[:, :hidden_size].float().t(), out=ws.proj[prefix_len:]
    )
    gru = (embed_weight, ws.tokens)
    _launch_gru_cell(*gru, 0, None, weights.weight_ih, weights.weight_hh, ws.states[0])
    for j in range(1, prefix_len + 1):  # catch the GRU up on the drafts of the pure prefix
        _launch_gru_cell(*gru, j, ws.states[j - 1], weights.weight_ih, weights.weight_hh, ws.states[j])
    for i in range(prefix_len, num_drafts):
        _launch_correction_hidden(ws.proj[i], ws.states[i], weights.proj_in, hidden_size, ws.hidden[i])
        pick(slice(i, i + 1), ws.hidden[i : i + 1])
        if i + 1 < num_drafts:  # the last draft is never read back
            _launch_gru_cell(*gru, i + 1, ws.states[i], weights.weight_ih, weights.weight_hh, ws.states[i + 1])


def _validate_inputs(
    weights: _HeadWeights | None, draft_hidden: torch.Tensor, base_logits: torch.Tensor, embed_weight: torch.Tensor
) -> None:
    if base_logits.dim() != 3 or base_logits.shape[0] != 1 or draft_hidden.shape[:2] != base_logits.shape[:2]:
        raise ValueError(
            f"Expected draft_hidden [1, k, hidden] and base_logits [1, k, vocab] for one sequence, got "
            f"{tuple(draft_hidden.shape)} and {tuple(base_logits.shape)}."
        )
    if weights is None:
        return
    if base_logits.shape[-1] != weights.proj_out.shape[0]:
        raise ValueError(
            f"base_logits cover {base_logits.shape[-1]} tokens but the Domino head corrects {weights.proj_out.shape[0]}."
        )
    if embed_weight.shape[1] != weights.hidden_size or draft_hidden.shape[-1] != weights.hidden_size:
        raise ValueError("The target embeddings and draft hidden states must have the drafter's hidden_size.")
    if embed_weight.device != weights.weight_ih.device or embed_weight.stride(-1) != 1:
        raise ValueError(
            "The fused Domino head gathers token embeddings itself: the target's embedding table must be contiguous "
            f"and on the head's device ({weights.weight_ih.device}), not {embed_weight.device}."
        )


def _head_weights(drafter: DominoForSpeculation) -> _HeadWeights | None:
    return _HeadWeights.of(drafter) if drafter.head_active else None


@torch.no_grad()
def fused_rollout(
    drafter: DominoForSpeculation,
    draft_hidden: torch.Tensor,
    base_logits: torch.Tensor,
    anchor_ids: torch.LongTensor,
    target_embed_weight: torch.Tensor,
    *,
    pure_draft_prefix_len: int,
    temperature: float | None,
) -> tuple[torch.LongTensor, torch.Tensor]:
    """`drafter.rollout` with the fused kernels, for greedy decoding or plain temperature sampling.

    Args:
        drafter: the drafter; its head is used when `drafter.head_active`.
        draft_hidden: backbone outputs of the positions to draft, `[1, k, hidden]`.
        base_logits: the target LM head on `draft_hidden`, `[1, k, vocab]`.
        anchor_ids: the tokens realised before the first draft, `[1, n]`; only the last one (the anchor) is read.
        target_embed_weight: the target's input embedding table `[vocab, hidden]`, on the head's device.
        pure_draft_prefix_len: leading drafts taken from the base logits alone (`config.pure_draft_prefix_len`).
        temperature: `None` for greedy (argmax); else drafts are drawn from `softmax(logits / temperature)`.

    Returns:
        `(draft_ids [1, k], logits [1, k, vocab] fp32)`: the drafts and the processed logits each was picked from
        (`logits / temperature` when sampling), as `DominoCandidateGenerator._pick` returns them.
    """
    weights = _head_weights(drafter)
    _validate_inputs(weights, draft_hidden, base_logits, target_embed_weight)
    if temperature is not None and not temperature > 0:
        raise ValueError(f"temperature must be positive for sampling (None = greedy), got {temperature}.")
    device = weights.weight_ih.device if weights is not None else base_logits.device
    _check_kernel_device(device)
    num_drafts, vocab_size = base_logits.shape[1:]
    workspace = _Workspace(num_drafts, vocab_size, device, weights)
    workspace.tokens[:1].copy_(anchor_ids[0, -1:])
    if temperature is not None:
        workspace.seed.random_(0, 2**62)  # from torch's generator on `device`: torch.manual_seed reproduces drafts
        workspace.temperature.fill_(temperature)
    _launch_rollout(
        weights,
        draft_hidden[0].to(device),
        _rows_contiguous(base_logits[0].to(device)),
        target_embed_weight,
        workspace,
        prefix_len=pure_draft_prefix_len,
        sample=temperature is not None,
    )
    return workspace.tokens[None, 1:].to(anchor_ids.device), workspace.logits[None]


def _rows_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


class TritonRollout:
    """The fused rollout without a CUDA graph, as a `FastRollout` callable (what `select_rollout` returns)."""

    def __init__(self, drafter: DominoForSpeculation, *, temperature: float | None):
        self.drafter = drafter
        self.temperature = temperature

    def __call__(
        self,
        draft_hidden: torch.Tensor,
        base_logits: torch.Tensor,
        anchor_ids: torch.LongTensor,
        target_embed_weight: torch.Tensor,
    ) -> tuple[torch.LongTensor, torch.Tensor]:
        return fused_rollout(
            self.drafter,
            draft_hidden,
            base_logits,
            anchor_ids,
            target_embed_weight,
            pure_draft_prefix_len=self.drafter.config.pure_draft_prefix_len,
            temperature=self.temperature,
        )


class DominoHeadGraphRunner:
    """Captures a whole block rollout as one CUDA graph and replays it, as a `FastRollout` callable.

    The graph is captured on the first call for the call's configuration: number of drafts, vocabulary, dtypes,
    device, prefix length, head on/off, greedy or sampling, and the address and layout of every weight and of the
    embedding table. A call with any of those changed drops the graph (after the device has finished with it) and
    captures a new one; a call with fewer drafts than captured replays the captured graph and keeps the leading rows,
    which is exact because a draft position never depends on later ones (blocks shrink near `max_length`, and
    re-capturing there would cost more than the few wasted positions). Weights updated in place are picked up without
    re-capture: the graph reads them by address. The temperature and the sampling seed live in device buffers, so
    neither forces a re-capture.

    Outputs are copied out of the static buffers, so a result stays valid after the next call.

    Args:
        drafter: the drafter whose head to run.
        temperature: `None` for greedy, else the sampling temperature.
        fallback_on_capture_error: when capture fails (e.g. inside another capture), warn once and run the fused
            kernels without a graph from then on, instead of raising.
    """

    def __init__(
        self,
        drafter: DominoForSpeculation,
        *,
        temperature: float | None,
        fallback_on_capture_error: bool = False,
    ):
        self.drafter = drafter
        self.temperature = temperature
        self.fallback_on_capture_error = fallback_on_capture_error
        self.num_captures = 0
        self._key: tuple | None = None
        self._graph: torch.cuda.CUDAGraph | None = None
        self._capture_failed = False

    @property
    def captured_num_drafts(self) -> int | None:
        return None if self._key is None else self._key[0]

    def reset(self) -> None:
        """Drops the captured graph and its buffers (waiting for the device to be done with them first)."""
        if self._graph is not None:
            torch.cuda.synchronize(self._device)
        self._graph, self._key = None, None

    def _config_key(
        self, weights: _HeadWeights | None, draft_hidden: torch.Tensor, base_logits: torch.Tensor, embed: torch.Tensor
    ) -> tuple:
        return (
            base_logits.shape[1],
            base_logits.shape[2],
            base_logits.dtype,
            draft_hidden.dtype,
            base_logits.device,
            self.drafter.config.pure_draft_prefix_len,
            self.temperature is not None,
            None if weights is None else weights.signature(),
            (embed.data_ptr(), embed.dtype, embed.device, tuple(embed.shape), embed.stride()),
        )

    @torch.no_grad()
    def __call__(
        self,
        draft_hidden: torch.Tensor,
        base_logits: torch.Tensor,
        anchor_ids: torch.LongTensor,
        target_embed_weight: torch.Tensor,
    ) -> tuple[torch.LongTensor, torch.Tensor]:
        temperature, prefix_len = self.temperature, self.drafter.config.pure_draft_prefix_len
        if self._capture_failed:
            return fused_rollout(
                self.drafter,
                draft_hidden,
                base_logits,
                anchor_ids,
                target_embed_weight,
                pure_draft_prefix_len=prefix_len,
                temperature=temperature,
            )
        weights = _head_weights(self.drafter)
        _validate_inputs(weights, draft_hidden, base_logits, target_embed_weight)
        device = weights.weight_ih.device if weights is not None else base_logits.device
        if device.type != "cuda":
            raise RuntimeError(f"CUDA graphs need CUDA tensors; the Domino head is on {device}.")
        draft_hidden, base_logits = draft_hidden.to(device), base_logits.to(device)
        num_drafts = base_logits.shape[1]
        key = self._config_key(weights, draft_hidden, base_logits, target_embed_weight)
        captured = self._key
        # Same configuration, or the same one with a shorter block: replay.
        if captured is None or key[1:] != captured[1:] or num_drafts > captured[0]:
            self.reset()
            try:
                self._capture(key, weights, draft_hidden, base_logits, target_embed_weight, prefix_len)
            except Exception as error:  # noqa: BLE001 - re-raised unless the caller asked for the fallback
                self.reset()
                if not self.fallback_on_capture_error:
                    raise
                warnings.warn(
                    f"Capturing the Domino head as a CUDA graph failed ({error!r}); using the fused kernels without "
                    "a graph from now on.",
                    stacklevel=2,
                )
                self._capture_failed = True
                return self(draft_hidden, base_logits, anchor_ids, target_embed_weight)

        self._draft_hidden[:num_drafts].copy_(draft_hidden[0])
        self._base_logits[:num_drafts].copy_(base_logits[0])
        ws = self._workspace
        ws.tokens[:1].copy_(anchor_ids[0, -1:])
        if temperature is not None:
            ws.seed.random_(0, 2**62)
            ws.temperature.fill_(temperature)
        self._graph.replay()
        draft_ids = ws.tokens[None, 1 : num_drafts + 1].to(anchor_ids.device, copy=True)
        return draft_ids, ws.logits[None, :num_drafts].clone()

    def _capture(
        self,
        key: tuple,
        weights: _HeadWeights | None,
        draft_hidden: torch.Tensor,
        base_logits: torch.Tensor,
        embed_weight: torch.Tensor,
        prefix_len: int,
    ) -> None:
        _check_kernel_device(base_logits.device)
        self._device = base_logits.device
        num_drafts, vocab_size = base_logits.shape[1:]
        self._workspace = _Workspace(num_drafts, vocab_size, self._device, weights)
        self._draft_hidden = draft_hidden[0].clone()
        self._base_logits = _rows_contiguous(base_logits[0]).clone()

        def launch() -> None:
            _launch_rollout(
                weights,
                self._draft_hidden,
                self._base_logits,
                embed_weight,
                self._workspace,
                prefix_len=prefix_len,
                sample=self.temperature is not None,
            )

        # Warm up on a side stream (as torch.cuda.graphs recommends): compiles the Triton kernels and settles the
        # allocator, neither of which may happen during capture.
        with torch.cuda.device(self._device):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                launch()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                launch()
        self._graph, self._key = graph, key
        self.num_captures += 1


# ----------------------------------------------------------------------------------------------------------- dispatch
def split_temperature(logits_processor: LogitsProcessorList | None) -> tuple[float | None, bool]:
    """`(temperature, has_other_processors)` of a logits-processor list, for `select_rollout`.

    The fast path covers an empty list and a lone `TemperatureLogitsWarper`; the temperature is `None` when the list
    holds none (i.e. 1.0 when sampling).
    """
    from transformers.generation.logits_process import TemperatureLogitsWarper

    temperature, others = None, False
    for processor in logits_processor or ():
        if isinstance(processor, TemperatureLogitsWarper) and temperature is None:
            temperature = float(processor.temperature)
        else:
            others = True
    return temperature, others


def select_rollout(
    drafter: DominoForSpeculation,
    *,
    do_sample: bool,
    temperature: float | None,
    has_other_processors: bool,
    mode: str = "auto",
    target_embed_weight: torch.Tensor | None = None,
) -> FastRollout | None:
    """Chooses how a `generate()` call rolls the Domino head out: a fused callable, or `None` for the eager path.

    Args:
        drafter: the drafter.
        do_sample: sampling (`True`) or greedy decoding.
        temperature: the sampling temperature (`None` = 1.0); ignored for greedy decoding.
        has_other_processors: whether logits processors other than a temperature apply; only the eager path
            handles those.
        mode: `"auto"` (fused kernels + CUDA graph on CUDA when Triton imports, else eager; the `HF_DOMINO_HEAD`
            environment variable overrides it), `"eager"`, `"triton"` (fused kernels, no graph) or `"triton+graph"`.
            The forced modes raise when they cannot run rather than falling back.
        target_embed_weight: the target's embedding table, if known: `"auto"` then also checks that the kernels can
            gather from it (same device as the head).

    Returns:
        A `FastRollout` callable `(draft_hidden, base_logits, anchor_ids, target_embed_weight) -> (draft_ids,
        logits)`, or `None` when the eager `drafter.rollout` should run.
    """
    if mode not in ROLLOUT_MODES:
        raise ValueError(f"mode must be one of {ROLLOUT_MODES}, got {mode!r}.")
    forced = mode != "auto"
    if not forced:
        mode = os.environ.get(MODE_ENV_VAR, "auto").strip().lower() or "auto"
        if mode not in ROLLOUT_MODES:
            raise ValueError(f"{MODE_ENV_VAR} must be one of {ROLLOUT_MODES}, got {mode!r}.")
        forced = mode != "auto"
    if mode == "eager":
        return None

    sampling_temperature = (1.0 if temperature is None else float(temperature)) if do_sample else None
    reason = _unsupported_reason(drafter, sampling_temperature, has_other_processors, target_embed_weight)
    if reason is None and not forced:
        reason = None if drafter.device.type == "cuda" else f"the drafter is on {drafter.device}, not CUDA"
    if reason is not None:
        if forced:
            raise ValueError(f"mode={mode!r} cannot run here: {reason}. Use mode='auto' or 'eager'.")
        return None

    if mode == "auto":
        return DominoHeadGraphRunner(drafter, temperature=sampling_temperature, fallback_on_capture_error=True)
    if drafter.device.type != "cuda" and not kernels_interpreted():
        raise RuntimeError(
            f"mode={mode!r} on {drafter.device} needs Triton's interpreter: set TRITON_INTERPRET=1 before importing "
            "hf_domino.triton_head (slow; meant for tests). Use mode='eager' on CPU."
        )
    if mode == "triton+graph":
        if drafter.device.type != "cuda":
            raise RuntimeError(
                "mode='triton+graph' needs CUDA (CUDA graphs); use mode='triton' under the interpreter."
            )
        return DominoHeadGraphRunner(drafter, temperature=sampling_temperature)
    return TritonRollout(drafter, temperature=sampling_temperature)


def _unsupported_reason(
    drafter: DominoForSpeculation,
    temperature: float | None,
    has_other_processors: bool,
    embed_weight: torch.Tensor | None,
) -> str | None:
    if triton is None:
        return "Triton is not installed"
    if has_other_processors:
        return "logits processors other than temperature (top-k, top-p, penalties, ...) only run on the eager path"
    if temperature is not None and not temperature > 0:
        return f"temperature must be positive, got {temperature}"
    if drafter.config.has_domino_head:
        weights = _HeadWeights.of(drafter)
        devices = {w.device for w in vars(weights).values()}
        if len(devices) != 1 or next(iter(devices)).type == "meta":
            return f"the head's weights are spread over {sorted(map(str, devices))}"
        if embed_weight is not None and embed_weight.device not in devices:
            return f"the target's embedding table is on {embed_weight.device}, the head on {next(iter(devices))}"
    return None


__all__ = [
    "DominoHeadGraphRunner",
    "FastRollout",
    "TritonRollout",
    "fused_rollout",
    "kernels_interpreted",
    "select_rollout",
    "split_temperature",
]

"""Fused Triton kernels for the Domino head rollout: one block, drafted entirely on the device.

The eager rollout (`hf_domino.drafting_domino.eager_rollout`) is the reference. Per draft position it runs a GRU
step, the low-rank correction `W2 silu(W1 [z ; s])`, adds the base logits and picks a token: a dozen small PyTorch ops
per position, each waiting on the previous token. Here the same work is four kernels per position, and the picked
token never goes back to the host, so that a whole block can be captured once as a CUDA graph and replayed
(`hf_domino.fused_head`): `_gru_cell_kernel` gathers the last picked token's embedding itself and does the GRU cell;
`_correction_hidden_kernel` computes `silu(W1[:, H:] s + W1[:, :H] z)` (the second product precomputed for all
positions in one matmul); `_logits_pick_kernel` computes, stores (speculative sampling needs the exact distribution
each draft was drawn from) and picks from one vocabulary tile of logits (argmax, or Gumbel-max with Philox noise when
sampling); `_finalize_pick_kernel` reduces the tile winners, ties going to the lowest index as in `torch.argmax`.
Over a draft vocabulary (base logits over `vocab`, sorted token ids) the logits kernel reads W2's rows of those
tokens and the finalize kernel maps the winning column to its token id, which is what the next GRU step gathers.

Arithmetic accumulates in fp32 whatever the weight dtype; intermediate results are rounded to the weight dtype where
the eager path materializes a weight-dtype tensor (GRU state, `W1` output, SiLU output, correction), so that both
paths pick the same tokens unless two logits are within accumulation-order noise. Logits always come back in fp32.

This module holds the kernels, their launchers and single-kernel wrappers (what the kernel tests call); the block
rollout that sequences them is `hf_domino.triton_rollout` (`fused_rollout`, and the workspace and launch that the
CUDA-graph runner of `hf_domino.fused_head` captures). Triton is optional: without it this module still imports (dispatch then answers "eager"). On CPU
the kernels only run under Triton's interpreter, which must be enabled (`TRITON_INTERPRET=1`) before this module is
imported, since `triton.jit` decides at decoration time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: `hf_domino.fused_head.select_rollout()` then always answers "eager"
    triton = tl = None

if TYPE_CHECKING:
    from collections.abc import Callable

    from .triton_rollout import HeadWeights


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
        tokens_stride,
        token_index,
        state_ptr,
        state_stride,
        w_ih_ptr,
        w_ih_stride,
        w_hh_ptr,
        w_hh_stride,
        out_ptr,
        out_stride,
        # The model's sizes are compile-time constants (one kernel per drafter shape): loop bounds are then plain
        # ints, which Triton 3.6's interpreter needs with numpy 2.4 or later.
        H: tl.constexpr,
        G: tl.constexpr,
        ZERO_STATE: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """`out[b] = GRUCell(embed[tokens[b, token_index]], state[b])` for the `BLOCK_G` hidden units of this program
        and the batch row `b = program_id(1)`."""
        rows = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)
        row_mask = rows < G
        batch_row = tl.program_id(1)
        state_ptr += batch_row * state_stride
        out_ptr += batch_row * out_stride
        gate_dtype = w_ih_ptr.dtype.element_ty
        # The token is read on the device: it was picked by the previous step's kernels, never seen by the host.
        token = tl.load(tokens_ptr + batch_row * tokens_stride + token_index)
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
        proj_stride,
        state_ptr,
        state_stride,
        w1s_ptr,
        w1_stride,
        out_ptr,
        out_stride,
        R: tl.constexpr,
        G: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """`out[b] = silu(proj[b] + W1[:, H:] state[b])` for `BLOCK_R` rank units and the batch row
        `b = program_id(1)`; `proj = W1[:, :H] z` was precomputed."""
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_mask = rows < R
        batch_row = tl.program_id(1)
        proj_ptr += batch_row * proj_stride
        state_ptr += batch_row * state_stride
        out_ptr += batch_row * out_stride
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
        hidden_stride_b,
        hidden_stride_p,
        w2_ptr,
        w2_stride,
        base_ptr,
        base_stride_b,
        base_stride_p,
        logits_ptr,
        logits_stride_b,
        logits_stride_p,
        best_ptr,
        best_idx_ptr,
        seed_ptr,
        temperature_ptr,
        vocab_ptr,
        first_position,
        num_positions,
        num_drafts,
        V,
        R: tl.constexpr,
        num_tiles,
        HAS_CORRECTION: tl.constexpr,
        SAMPLE: tl.constexpr,
        HAS_VOCAB: tl.constexpr,
        SPREAD: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_R: tl.constexpr,
    ):
        """One vocabulary tile (`program_id(0)`) of one (batch row, draft position) pair: logits, stored, and the
        tile's winner.

        `program_id(1)` enumerates the launch's pairs row-major: batch row `b`, then position
        `first_position + i` for `i < num_positions`. The inputs of pair `(b, i)` are at `ptr + b * stride_b +
        i * stride_p`; tile winners go to the block's scratch at `(b * num_drafts + position) * num_tiles + tile`.
        With `HAS_VOCAB`, column `c` of the base logits is token `vocab[c]` (a draft vocabulary of `V` token ids): the
        correction reads W2's row of that token, and with `SPREAD` the logit is stored in that token's column of a
        whole-vocabulary row (the rest of which holds `-inf`), as `processed_pick` spreads it for sampling. The tile's
        winner is always a column of the base logits; `_finalize_pick_kernel` maps it to a token id.
        """
        tile = tl.program_id(0)
        pair = tl.program_id(1)
        batch_row = pair // num_positions
        i = pair % num_positions
        position = first_position + i
        cols = tile * BLOCK_V + tl.arange(0, BLOCK_V)
        col_mask = cols < V
        token_ids = cols
        if HAS_VOCAB:
            token_ids = tl.load(vocab_ptr + cols, mask=col_mask, other=0)
        base_row = base_ptr + batch_row * base_stride_b + i * base_stride_p
        logits = tl.load(base_row + cols, mask=col_mask, other=0.0).to(tl.float32)
        if HAS_CORRECTION:
            hidden_row = hidden_ptr + batch_row * hidden_stride_b + i * hidden_stride_p
            acc = tl.zeros([BLOCK_V], dtype=tl.float32)
            for r0 in range(0, R, BLOCK_R):
                ranks = r0 + tl.arange(0, BLOCK_R)
                rank_mask = ranks < R
                a = tl.load(hidden_row + ranks, mask=rank_mask, other=0.0)
                # A draft vocabulary gathers W2's rows in-kernel (not a gathered copy), so that a captured graph
                # still reads weights updated in place.
                w = tl.load(
                    w2_ptr + token_ids[:, None] * w2_stride + ranks[None, :],
                    mask=col_mask[:, None] & rank_mask[None, :],
                    other=0.0,
                )
                acc += tl.sum(w.to(tl.float32) * a[None, :], axis=1)
            logits += acc.to(w2_ptr.dtype.element_ty).to(tl.float32)
        if SAMPLE:
            # Same op as transformers' TemperatureLogitsWarper (`scores / temperature`), correctly rounded.
            logits = tl.div_rn(logits, tl.load(temperature_ptr))
        logits_row = logits_ptr + batch_row * logits_stride_b + i * logits_stride_p
        if SPREAD:
            tl.store(logits_row + token_ids, logits, mask=col_mask)
        else:
            tl.store(logits_row + cols, logits, mask=col_mask)

        # The block's (batch row, position) index: where the tile winners go, and the sampling noise's row.
        slot = batch_row * num_drafts + position
        score = logits
        if SAMPLE:
            # Gumbel-max: argmax(logits + G) with G = -log(-log(U)) is an exact draw from softmax(logits). The seed is
            # read from memory so that a captured CUDA graph draws fresh noise on every replay; the Philox counter is
            # unique per (batch row, draft position, token), so rows, positions and tiles never share noise.
            uniform = tl.rand(tl.load(seed_ptr), slot * V + cols)
            score = logits - tl.log(-tl.log(uniform))
        score = tl.where(col_mask, score, float("-inf"))
        best_idx = tl.argmax(score, axis=0, tie_break_left=True)
        best = tl.max(score, axis=0)
        tl.store(best_ptr + slot * num_tiles + tile, best)
        tl.store(best_idx_ptr + slot * num_tiles + tile, tile * BLOCK_V + best_idx)

    @triton.jit
    def _finalize_pick_kernel(
        best_ptr,
        best_idx_ptr,
        vocab_ptr,
        tokens_ptr,
        tokens_stride,
        first_position,
        num_positions,
        num_drafts,
        num_tiles,
        HAS_VOCAB: tl.constexpr,
        BLOCK_T: tl.constexpr,
    ):
        """Second stage of the vocabulary argmax, per (batch row, position) pair as `_logits_pick_kernel` enumerates
        them: the first tile holding the maximum wins (lowest index on ties).

        The winning column becomes a token id (`vocab[column]` with a draft vocabulary) and is stored as the row's
        draft `tokens[b, 1 + position]`: the next GRU step gathers that token's embedding from the target's table. A
        sorted vocabulary keeps torch's tie rule, lowest token id, in both the compact and the spread logits.
        """
        pair = tl.program_id(0)
        batch_row = pair // num_positions
        position = first_position + pair % num_positions
        slot = batch_row * num_drafts + position
        tiles = tl.arange(0, BLOCK_T)
        best = tl.load(best_ptr + slot * num_tiles + tiles, mask=tiles < num_tiles, other=float("-inf"))
        winner = tl.argmax(best, axis=0, tie_break_left=True)
        token = tl.load(best_idx_ptr + slot * num_tiles + winner)
        if HAS_VOCAB:
            token = tl.load(vocab_ptr + token)
        tl.store(tokens_ptr + batch_row * tokens_stride + 1 + position, token.to(tokens_ptr.dtype.element_ty))


def kernels_interpreted() -> bool:
    """Whether this module's kernels were built for Triton's CPU interpreter (`TRITON_INTERPRET=1` at import)."""
    if triton is None:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_gru_cell_kernel, InterpretedFunction)


def check_kernel_device(device: torch.device) -> None:
    if triton is None:
        raise RuntimeError("The fused Domino head needs Triton: `pip install triton` (or hf-domino[gpu]).")
    if device.type != "cuda" and not kernels_interpreted():
        raise RuntimeError(
            f"The fused Domino head runs on CUDA; tensors are on {device}. On CPU it only runs in Triton's interpreter"
            ", which must be enabled before hf_domino.triton_kernels is imported (TRITON_INTERPRET=1). Use the eager "
            "rollout (domino_rollout='eager') instead."
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
        warped: bool = False,
        rows: int = 1,
    ):
        """`vocab_size` columns of base logits per draft; with `vocab`, they are those (sorted) token ids.

        With `spread_size`, the logits are stored over a whole vocabulary of that size, `-inf` outside `vocab` (what
        sampling returns); else over the `vocab_size` columns. `warped`: room for `launch_warped_pick`'s second pick
        over the stored logits. Every buffer has a leading dimension of `rows` (the batch).
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
        self.temperature = torch.ones(1, dtype=torch.float32, device=device)
        if warped:  # the re-pick reads the stored (already tempered) logits: temperature 1, tiles of a stored row
            self.unit_temperature = torch.ones(1, dtype=torch.float32, device=device)
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

    def start(self, anchor_ids: torch.LongTensor, temperature: float | None) -> None:
        """Loads one block's inputs that are not tensors of the block: each row's anchor (the last column of
        `anchor_ids [rows', n]`, into the first `rows'` rows) and the sampling parameters.

        The seed comes from torch's generator on the workspace's device, so `torch.manual_seed` reproduces sampled
        drafts, and a fresh one per block gives a replayed graph fresh noise.
        """
        self.tokens[: anchor_ids.shape[0], 0].copy_(anchor_ids[:, -1])
        if temperature is not None:
            self.seed.random_(0, 2**62)
            self.temperature.fill_(temperature)


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
) -> None:
    """Picks draft `positions` of every row into `ws.tokens[:, 1 + position]`, their logits into `ws.logits`.

    `base_logits` `[rows, k, V]` are the whole block's (over `ws.vocab` when set), `hidden` `[rows, len(positions),
    R]` the correction's hidden vectors of those positions (`None`: base logits alone), `proj_out_weight` the whole
    W2 (`[vocab, R]`; a draft vocabulary's rows are gathered in the kernel). Positions are independent given their
    hidden vectors, so one launch covers them all, for every row.
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
    )


def launch_warped_pick(ws: Workspace, positions: slice, warp: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Draws draft `positions` of every row again, from their stored logits after `warp` (the call's top-k / top-p /
    min-p warpers).

    `launch_logits_pick(..., sample=True)` stored the tempered logits (over the whole vocabulary when sampling);
    `warp` (torch ops on `[n, V]` scores, row by row, no host synchronization, so a CUDA graph captures it) filters
    them in place, and a Gumbel-max draw over the result replaces the tokens picked before: the drafts come from, and
    the logits returned are, exactly the warped distribution. Needs a `Workspace(..., warped=True)`.
    """
    logits = ws.logits[:, positions]
    if logits.shape[1] == 0:  # an empty pure-draft prefix
        return
    logits.copy_(warp(logits.reshape(-1, logits.shape[-1])).view(logits.shape))
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
) -> None:
    """The two kernels of a pick: `base (+ hidden @ W2.T)` (`[rows, P, V]`, P = the positions) into
    `ws.logits[:, positions]` with each tile's winner in `best`/`best_idx` (`[rows, k, tiles]`), then the winners
    reduced into `ws.tokens[:, 1 + position]`."""
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
        BLOCK_V=ws.block_v,
        BLOCK_R=_pow2(rank, LOGITS_BLOCK_R),
        num_warps=4,
    )
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
    "Workspace",
    "check_kernel_device",
    "correction_hidden",
    "gru_cell",
    "kernels_interpreted",
    "launch_correction_hidden",
    "launch_gru_cell",
    "launch_logits_pick",
    "launch_warped_pick",
    "logits_pick",
]

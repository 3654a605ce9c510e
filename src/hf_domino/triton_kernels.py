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

This module holds the kernels and the checks of where they can run; their launchers, tile sizes, buffers (`Workspace`)
and single-kernel wrappers (what the kernel tests call) are `hf_domino.triton_launch`; the block rollout that
sequences them is `hf_domino.triton_rollout` (`fused_rollout`, and the launch that the CUDA-graph runner of
`hf_domino.fused_head` captures). Triton is optional: without it this module still imports (dispatch then answers "eager"). On CPU
the kernels only run under Triton's interpreter, which must be enabled (`TRITON_INTERPRET=1`) before this module is
imported, since `triton.jit` decides at decoration time.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: `hf_domino.fused_head.select_rollout()` then always answers "eager"
    triton = tl = None

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
        temperature_stride,
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
        PICK: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_R: tl.constexpr,
    ):
        """One vocabulary tile (`program_id(0)`) of one (batch row, draft position) pair: logits, stored, and (with
        `PICK`) the tile's winner.

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
            # Same op as transformers' TemperatureLogitsWarper (`scores / temperature`), correctly rounded; each batch
            # row has its own (a server's requests each bring theirs).
            logits = tl.div_rn(logits, tl.load(temperature_ptr + batch_row * temperature_stride))
        logits_row = logits_ptr + batch_row * logits_stride_b + i * logits_stride_p
        if SPREAD:
            tl.store(logits_row + token_ids, logits, mask=col_mask)
        else:
            tl.store(logits_row + cols, logits, mask=col_mask)

        if not PICK:  # the logits alone: a warped pick draws from them once the call's warpers filtered them
            return
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


__all__ = ["check_kernel_device", "kernels_interpreted", "triton"]

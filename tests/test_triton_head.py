"""Tests of the fused Domino head (`hf_domino.triton_kernels`, `hf_domino.fused_head`) against the eager reference.

The reference is the drafting ladder's `eager_rollout(drafter, target, pick)(BlockDraft(...), anchor_ids)`.

Without a GPU the kernels run in Triton's CPU interpreter, which has to be switched on (`TRITON_INTERPRET=1`) before
`triton` itself is imported: Triton's own helpers (`tl.argmax`, `tl.sigmoid`, ...) are `triton.jit` functions too, built
for one mode when they are defined. In a normal run something may well have imported triton already, and the GPU tests
need it compiled, so `test_interpreter_suite` re-runs this file in a child pytest with the variable set; there the
`interp` tests run and the CUDA ones skip. To debug one of them directly:
`TRITON_INTERPRET=1 pytest tests/test_triton_head.py -k <name>`.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn
from transformers import Qwen3Config, Qwen3ForCausalLM

pytest.importorskip("triton")

from hf_domino import (  # noqa: E402
    DominoConfig,
    DominoForSpeculation,
    TargetModules,
    fused_head,
    triton_rollout,
)
from hf_domino import triton_kernels as kernels  # noqa: E402
from hf_domino import triton_launch as launch  # noqa: E402
from hf_domino.drafting_domino import (  # noqa: E402
    BlockDraft,
    Drafts,
    draft_confidence,
    eager_rollout,
    greedy_pick,
)
from hf_domino.triton_launch import Sampling  # noqa: E402

INTERPRETED = kernels.kernels_interpreted()
requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or INTERPRETED, reason="needs a CUDA GPU and compiled (not interpreted) kernels"
)

HIDDEN, GRU, RANK, VOCAB = 32, 16, 8, 100  # VOCAB is deliberately not a multiple of any tile size


@pytest.fixture
def interp():
    """`hf_domino.triton_launch` over interpreted kernels (the rollout uses them too): only in the child run of
    `test_interpreter_suite`."""
    if not INTERPRETED:
        pytest.skip("runs in test_interpreter_suite's child process (TRITON_INTERPRET=1)")
    return launch


@pytest.mark.skipif(INTERPRETED, reason="this is the child run")
@pytest.mark.parametrize("part", ["generate", "not generate"])
def test_interpreter_suite(request, part):
    # Two children, which xdist can run side by side: the whole file took 150 s alone and 215 s beside the rest of
    # the suite on a 2-core machine, against a 300 s limit. The limit is there for a hung kernel, not for speed.
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-W", "ignore", "-k", part]
    markexpr = request.config.getoption("markexpr")
    if markexpr:  # e.g. CI's -m "not slow" must hold in the child too
        command += ["-m", markexpr]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    summary = result.stdout.strip().splitlines()[-1:] if result.stdout else []
    assert result.returncode == 0, f"interpreter tests failed:\n{result.stdout[-6000:]}\n{result.stderr[-2000:]}"
    assert "passed" in "".join(summary) and " error" not in "".join(summary), result.stdout[-2000:]


def small_target() -> Qwen3ForCausalLM:
    """A real Qwen3 target at the tiny drafter's sizes, for generate() through the fused rollouts."""
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        pad_token_id=0,
        eos_token_id=1,
    )
    return Qwen3ForCausalLM(config).eval()


def tiny_drafter(dtype: torch.dtype = torch.float32, pure_draft_prefix_len: int = 1, block_size: int = 5):
    config = DominoConfig(
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size=VOCAB,
        num_target_layers=2,
        target_layer_ids=[0],
        mask_token_id=0,
        projector_type="domino",
        emb_dim=RANK,
        gru_hidden_dim=GRU,
        pure_draft_prefix_len=pure_draft_prefix_len,
        block_size=block_size,
        shift_label=True,
    )
    torch.manual_seed(0)
    drafter = DominoForSpeculation(config).eval()
    # Initialization-sized head weights barely move the logits; large ones make the correction decide tokens, which
    # is what these tests must exercise.
    with torch.no_grad():
        for weight in [*drafter.prefix_gru.parameters(), *drafter.embed_proj.parameters()]:
            weight.normal_(0.0, 0.5)
    return drafter.to(dtype)


def tiny_inputs(num_drafts: int, dtype: torch.dtype = torch.float32, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    embed = nn.Embedding(VOCAB, HIDDEN).to(dtype)
    with torch.no_grad():
        embed.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=generator))
    draft_hidden = torch.randn(1, num_drafts, HIDDEN, generator=generator).to(dtype)
    base_logits = torch.randn(1, num_drafts, VOCAB, generator=generator)
    anchor_ids = torch.tensor([[5, 17, 42]])
    return embed, draft_hidden, base_logits, anchor_ids


def eager_drafts(drafter, target, draft_hidden, base_logits, anchor_ids, pick=greedy_pick) -> Drafts:
    """The reference: one block through the ladder's eager rollout (head on)."""
    with torch.no_grad():
        return eager_rollout(drafter, target, pick)(BlockDraft(draft_hidden, base_logits), anchor_ids)


def top2_gap(logits: torch.Tensor) -> torch.Tensor:
    top = logits.float().topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


def forced_picker(tokens: torch.LongTensor, temperature: float | None):
    """An eager picker replaying given tokens, to get the eager logits along the fused path's choices."""
    position = iter(range(tokens.shape[1]))

    def pick(logits: torch.Tensor, realised_ids: torch.LongTensor):
        logits = logits.float() if temperature is None else logits.float() / temperature
        return tokens[:, next(position)].reshape(1, 1), logits

    return pick


# ------------------------------------------------------------------------------------------------------ single kernels
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-6), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("zero_state", [True, False])
def test_gru_cell_matches_nn_gru(interp, dtype, atol, zero_state):
    torch.manual_seed(0)
    gru = nn.GRU(HIDDEN, GRU, bias=False, batch_first=True).to(dtype)
    embed = torch.randn(VOCAB, HIDDEN).to(dtype)
    state = None if zero_state else torch.randn(GRU).to(dtype)
    tokens = torch.tensor([3, 71])

    fused = interp.gru_cell(embed, tokens, state, gru.weight_ih_l0.detach(), gru.weight_hh_l0.detach())
    with torch.no_grad():
        _, expected = gru(embed[71].reshape(1, 1, -1), None if state is None else state.reshape(1, 1, -1))
    assert fused.dtype == dtype
    torch.testing.assert_close(fused.float(), expected.reshape(-1).float(), atol=atol, rtol=0)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("block_v", [16, 64])  # 7 tiles with a ragged last one; 2 tiles
def test_correction_and_argmax_match_eager(interp, dtype, atol, block_v):
    torch.manual_seed(0)
    embed_proj = nn.Sequential(
        nn.Linear(HIDDEN + GRU, RANK, bias=False), nn.SiLU(), nn.Linear(RANK, VOCAB, bias=False)
    )
    embed_proj = embed_proj.to(dtype)
    z, s = torch.randn(HIDDEN).to(dtype), torch.randn(GRU).to(dtype)
    base = torch.randn(1, VOCAB) * 3
    w1, w2 = embed_proj[0].weight.detach(), embed_proj[2].weight.detach()

    projected = z.float() @ w1[:, :HIDDEN].float().t()
    hidden = interp.correction_hidden(projected, s, w1, HIDDEN)
    tokens, logits = interp.logits_pick(base, hidden[None], w2, block_v=block_v)
    with torch.no_grad():
        expected = base + embed_proj(torch.cat([z, s]))[None].float()

    torch.testing.assert_close(logits, expected, atol=atol, rtol=0)
    if top2_gap(expected).item() > 2 * atol:
        assert tokens.item() == expected.argmax(-1).item()


def tied_logits() -> torch.Tensor:
    base = torch.zeros(3, VOCAB)
    base[0, [37, 81]] = 5.0  # tiles 2 and 5 of 16
    base[1, [40, 41]] = 5.0  # inside one tile
    base[2] = float("-inf")  # nothing finite: torch.argmax answers 0
    return base


def test_argmax_ties_go_to_the_lowest_index_across_tiles(interp):
    # The interpreter's argmax always breaks ties to the left; `test_cuda_argmax_ties` checks the compiled kernels.
    base = tied_logits()
    tokens, logits = interp.logits_pick(base, block_v=16)
    assert tokens.tolist() == base.argmax(-1).tolist() == [37, 40, 0]
    assert torch.equal(logits, base)


# ------------------------------------------------------------------------------------------------------ block rollout
@pytest.mark.parametrize("pure_draft_prefix_len", [0, 1, 2])
def test_fused_rollout_greedy_matches_eager(interp, pure_draft_prefix_len):
    drafter = tiny_drafter(pure_draft_prefix_len=pure_draft_prefix_len)
    embed, draft_hidden, base_logits, anchor_ids = tiny_inputs(drafter.config.num_drafts)
    target = TargetModules(embed_tokens=embed, lm_head=nn.Identity())

    draft_ids, logits = triton_rollout.fused_rollout(
        drafter,
        draft_hidden,
        base_logits,
        anchor_ids,
        embed.weight,
        head=True,
        pure_draft_prefix_len=pure_draft_prefix_len,
        sampling=None,
    )
    expected = eager_drafts(drafter, target, draft_hidden, base_logits, anchor_ids)
    expected_ids, expected_logits = expected.ids, expected.logits

    assert draft_ids.shape == (1, drafter.config.num_drafts) and logits.dtype == torch.float32
    assert torch.equal(draft_ids, expected_ids)
    torch.testing.assert_close(logits, expected_logits, atol=1e-5, rtol=0)
    # The head must have mattered, or this test would not prove the correction is applied.
    assert not torch.equal(draft_ids, base_logits.argmax(-1))


def test_fused_rollout_without_head_is_base_argmax(interp):
    drafter = tiny_drafter()
    embed, draft_hidden, base_logits, anchor_ids = tiny_inputs(drafter.config.num_drafts)
    draft_ids, logits = triton_rollout.fused_rollout(
        drafter,
        draft_hidden,
        base_logits,
        anchor_ids,
        embed.weight,
        head=False,
        pure_draft_prefix_len=1,
        sampling=None,
    )
    assert torch.equal(draft_ids, base_logits.argmax(-1))
    assert torch.equal(logits, base_logits)


def test_fused_rollout_bf16_greedy_matches_eager_until_a_near_tie(interp):
    drafter = tiny_drafter(torch.bfloat16)
    embed, draft_hidden, base_logits, anchor_ids = tiny_inputs(drafter.config.num_drafts, torch.bfloat16)
    target = TargetModules(embed_tokens=embed, lm_head=nn.Identity())
    draft_ids, logits = triton_rollout.fused_rollout(
        drafter,
        draft_hidden,
        base_logits,
        anchor_ids,
        embed.weight,
        head=True,
        pure_draft_prefix_len=1,
        sampling=None,
    )
    # Replay the fused choices eagerly: every position is then compared on the same prefix.
    expected = eager_drafts(
        drafter, target, draft_hidden, base_logits, anchor_ids, forced_picker(draft_ids, None)
    ).logits
    # bf16 rounding of the GRU state and of O(5) corrections, accumulated in a different order (and the interpreter
    # rounds to bf16 by truncation).
    atol, rtol = 0.1, 0.03
    torch.testing.assert_close(logits, expected, atol=atol, rtol=rtol)
    clear = top2_gap(expected) > 2 * (atol + rtol * expected.abs().amax(-1))
    assert clear.any()
    assert torch.equal(draft_ids[clear], expected.argmax(-1)[clear])


def test_fused_rollout_sampling_returns_the_logits_it_drew_from(interp):
    drafter = tiny_drafter()
    embed, draft_hidden, base_logits, anchor_ids = tiny_inputs(drafter.config.num_drafts)
    target = TargetModules(embed_tokens=embed, lm_head=nn.Identity())
    temperature = 0.7
    options = {"head": True, "pure_draft_prefix_len": 1, "sampling": Sampling(temperature)}
    torch.manual_seed(123)
    draft_ids, logits = triton_rollout.fused_rollout(
        drafter, draft_hidden, base_logits, anchor_ids, embed.weight, **options
    )
    picker = forced_picker(draft_ids, temperature)
    expected = eager_drafts(drafter, target, draft_hidden, base_logits, anchor_ids, picker).logits
    # (base + correction) / temperature along the drafted path, as TemperatureLogitsWarper would produce it.
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)

    torch.manual_seed(123)
    again, _ = triton_rollout.fused_rollout(drafter, draft_hidden, base_logits, anchor_ids, embed.weight, **options)
    assert torch.equal(again, draft_ids), "torch.manual_seed must make sampled drafts reproducible"


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_sampled_tokens_follow_softmax_of_processed_logits(interp):
    # 300 independent draws (one per row, each with its own Philox stream) from a 4-token vocabulary, through the
    # correction. The seed is fixed, so the outcome is deterministic; the check is still a genuine goodness-of-fit
    # test, and its power is checked against the distribution a missing temperature would give.
    torch.manual_seed(0)
    draws, vocab, rank, temperature = 300, 4, 8, 0.5
    w2 = torch.randn(vocab, rank) * 0.3
    hidden = torch.randn(1, rank).expand(draws, rank)  # the same position, repeated: stride-0 rows
    base = torch.tensor([[1.0, 0.4, 0.0, -1.0]]).expand(draws, vocab)
    tokens, logits = interp.logits_pick(base, hidden, w2, temperature=temperature, seed=2024)

    unscaled = base[0] + w2 @ hidden[0]
    torch.testing.assert_close(logits, (unscaled / temperature).expand(draws, vocab), atol=1e-6, rtol=0)
    counts = torch.bincount(tokens, minlength=vocab).float()
    critical = 16.27  # chi-square, 3 degrees of freedom, p = 0.001
    assert chi_square(counts, torch.softmax(unscaled / temperature, -1)) < critical, counts
    assert chi_square(counts, torch.softmax(unscaled, -1)) > critical, "the test cannot tell temperatures apart"


# -------------------------------------------------------------------------------------------------- draft vocabulary
# A draft vocabulary (FR-Spec): base logits over `VOCAB_IDS` only, the correction from W2's rows of those tokens, the
# pick over them, and the GRU reading the picked *token ids*. ANCHOR (42, the anchor of `tiny_inputs`) is left out of
# one of them: the GRU's first input is then a token the drafter can never propose.
ANCHOR = 42
VOCAB_IDS = torch.tensor([1, 3, 4, 8, 10, 17, 20, 33, 41, 42, 50, 63, 64, 70, 77, 80, 88, 95, 99])
VOCABS = {"with the anchor": VOCAB_IDS, "without the anchor": VOCAB_IDS[VOCAB_IDS != ANCHOR]}


def vocab_case(vocab: torch.Tensor, pure_draft_prefix_len: int = 1, dtype: torch.dtype = torch.float32):
    drafter = tiny_drafter(dtype, pure_draft_prefix_len=pure_draft_prefix_len)
    embed, draft_hidden, base_logits, anchor_ids = tiny_inputs(drafter.config.num_drafts, dtype)
    assert anchor_ids[0, -1].item() == ANCHOR
    target = TargetModules(embed_tokens=embed, lm_head=nn.Identity())
    return drafter, target, embed, draft_hidden, base_logits[..., vocab], anchor_ids


def spread_picker(tokens: torch.LongTensor, temperature: float, vocab: torch.Tensor):
    """`forced_picker` after `processed_pick`'s spreading: logits over the whole vocabulary, `-inf` outside `vocab`."""
    forced = forced_picker(tokens, temperature)

    def pick(logits: torch.Tensor, realised_ids: torch.LongTensor):
        full = logits.new_full((logits.shape[0], VOCAB), float("-inf")).index_copy_(-1, vocab, logits.float())
        return forced(full, realised_ids)

    return pick


@pytest.mark.parametrize("vocab_name", list(VOCABS))
@pytest.mark.parametrize("pure_draft_prefix_len", [0, 1, 2])
def test_fused_rollout_over_a_draft_vocabulary_greedy_matches_eager(interp, vocab_name, pure_draft_prefix_len):
    vocab = VOCABS[vocab_name]
    drafter, target, embed, draft_hidden, base_logits, anchor_ids = vocab_case(vocab, pure_draft_prefix_len)
    options = {"head": True, "pure_draft_prefix_len": pure_draft_prefix_len, "sampling": None, "vocab": vocab}
    draft_ids, logits = triton_rollout.fused_rollout(
        drafter, draft_hidden, base_logits, anchor_ids, embed.weight, **options
    )
    with torch.no_grad():
        expected = eager_rollout(drafter, target)(BlockDraft(draft_hidden, base_logits, vocab), anchor_ids)

    # Greedy: logits over the vocabulary's columns, drafts as token ids.
    assert logits.shape == base_logits.shape == expected.logits.shape
    assert torch.equal(draft_ids, expected.ids)
    torch.testing.assert_close(logits, expected.logits, atol=1e-5, rtol=0)
    assert torch.isin(draft_ids, vocab).all()
    # The head mattered, and ids are not column indices (so the mapping and the GRU's reads are exercised).
    assert not torch.equal(draft_ids, vocab[base_logits.argmax(-1)])
    assert not torch.equal(draft_ids, logits.argmax(-1))


@pytest.mark.parametrize("vocab_name", list(VOCABS))
@pytest.mark.parametrize("pure_draft_prefix_len", [0, 2])
def test_fused_rollout_over_a_draft_vocabulary_sampling_matches_eager(interp, vocab_name, pure_draft_prefix_len):
    vocab = VOCABS[vocab_name]
    drafter, target, embed, draft_hidden, base_logits, anchor_ids = vocab_case(vocab, pure_draft_prefix_len)
    temperature = 0.7
    options = {"head": True, "pure_draft_prefix_len": pure_draft_prefix_len, "sampling": Sampling(temperature)}
    torch.manual_seed(123)
    draft_ids, logits = triton_rollout.fused_rollout(
        drafter, draft_hidden, base_logits, anchor_ids, embed.weight, vocab=vocab, **options
    )
    picker = spread_picker(draft_ids, temperature, vocab)
    with torch.no_grad():
        expected = eager_rollout(drafter, target, picker)(BlockDraft(draft_hidden, base_logits, vocab), anchor_ids)

    # Sampling: (base + correction) / temperature spread over the whole vocabulary, -inf outside the draft vocabulary
    # (the draft distribution is exactly zero there, which keeps speculative sampling lossless).
    assert logits.shape == (1, drafter.config.num_drafts, VOCAB)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[vocab] = False
    assert torch.isneginf(logits[..., outside]).all() and torch.isfinite(logits[..., vocab]).all()
    torch.testing.assert_close(logits, expected.logits, atol=1e-5, rtol=0)
    assert torch.isin(draft_ids, vocab).all()

    torch.manual_seed(123)
    again, _ = triton_rollout.fused_rollout(
        drafter, draft_hidden, base_logits, anchor_ids, embed.weight, vocab=vocab, **options
    )
    assert torch.equal(again, draft_ids), "torch.manual_seed must make sampled drafts reproducible"


def test_sampled_tokens_over_a_draft_vocabulary_follow_the_subset_softmax(interp):
    # As `test_sampled_tokens_follow_softmax_of_processed_logits`, over the 4-token vocabulary [2, 5, 6, 9] of a
    # 10-token W2: the correction must use W2's rows 2, 5, 6, 9, and the draws land on those token ids.
    torch.manual_seed(0)
    draws, full, rank, temperature = 300, 10, 8, 0.5
    vocab = torch.tensor([2, 5, 6, 9])
    w2 = torch.randn(full, rank) * 0.6
    hidden = torch.randn(1, rank).expand(draws, rank)
    base = torch.tensor([[1.0, 0.4, 0.0, -1.0]]).expand(draws, len(vocab))
    tokens, logits = interp.logits_pick(
        base, hidden, w2, temperature=temperature, seed=2024, vocab=vocab, spread_size=full
    )

    unscaled = base[0] + w2[vocab] @ hidden[0]
    expected = torch.full((full,), float("-inf")).index_copy_(0, vocab, unscaled / temperature)
    torch.testing.assert_close(logits, expected.expand(draws, full), atol=1e-6, rtol=0)
    assert torch.isin(tokens, vocab).all()
    counts = torch.bincount(tokens, minlength=full)[vocab].float()
    critical = 16.27  # chi-square, 3 degrees of freedom, p = 0.001
    assert chi_square(counts, torch.softmax(unscaled / temperature, -1)) < critical, counts
    wrong_rows = base[0] + w2[: len(vocab)] @ hidden[0]  # what ignoring the vocabulary in W2 would give
    assert chi_square(counts, torch.softmax(wrong_rows / temperature, -1)) > critical, "cannot tell W2's rows apart"


def test_greedy_pick_over_a_draft_vocabulary_breaks_ties_to_the_lowest_token_id(interp):
    vocab = torch.arange(3, VOCAB, 3)  # 33 ids, 3 tiles of 16
    base = torch.zeros(3, len(vocab))
    base[0, [2, 30]] = 5.0  # tiles 0 and 1
    base[1, [20, 21]] = 5.0  # inside one tile
    base[2] = float("-inf")  # nothing finite: torch.argmax answers column 0
    tokens, logits = interp.logits_pick(base, block_v=16, vocab=vocab)
    assert tokens.tolist() == vocab[base.argmax(-1)].tolist() == [9, 63, 3]
    assert torch.equal(logits, base)


def test_fused_rollout_refuses_a_bad_draft_vocabulary(interp):
    drafter, _, embed, draft_hidden, base_logits, anchor_ids = vocab_case(VOCAB_IDS)
    options = {"head": True, "pure_draft_prefix_len": 1, "sampling": None}

    def run(vocab, base=base_logits):
        triton_rollout.fused_rollout(drafter, draft_hidden, base, anchor_ids, embed.weight, vocab=vocab, **options)

    with pytest.raises(ValueError, match="sorted, distinct token ids"):
        run(VOCAB_IDS.flip(0))
    with pytest.raises(ValueError, match="sorted, distinct token ids"):
        run(torch.cat([VOCAB_IDS[:-1], torch.tensor([VOCAB])]))
    with pytest.raises(ValueError, match="long token ids"):
        run(VOCAB_IDS[:-1])  # one id fewer than the base logits' columns
    with pytest.raises(ValueError, match="pass the draft vocabulary"):
        run(None)  # base logits over a subset, but no vocabulary to say which
    with pytest.raises(ValueError, match="anchor_ids"):  # two rows of anchors for a block of one row
        triton_rollout.fused_rollout(
            drafter, draft_hidden, base_logits, anchor_ids.expand(2, -1), embed.weight, vocab=VOCAB_IDS, **options
        )


@pytest.mark.parametrize("do_sample", [False, True])
def test_select_rollout_over_a_draft_vocabulary_matches_eager(interp, do_sample):
    from transformers import LogitsProcessorList, TemperatureLogitsWarper

    vocab = VOCABS["without the anchor"]
    drafter, target, embed, draft_hidden, base_logits, anchor_ids = vocab_case(vocab)
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.7)]) if do_sample else None
    rollout = fused_head.select_rollout(
        drafter, target, do_sample=do_sample, logits_processor=processors, mode="triton"
    )
    block = BlockDraft(draft_hidden, base_logits, vocab)
    torch.manual_seed(7)
    drafts = rollout(block, anchor_ids)
    # The generator's eager pick for this call; sampling replays the fused draws to compare along the same path.
    if do_sample:
        eager_pick = spread_picker(drafts.ids, 0.7, vocab)
    else:
        eager_pick = greedy_pick
    with torch.no_grad():
        expected = eager_rollout(drafter, target, eager_pick)(block, anchor_ids)

    assert isinstance(drafts, Drafts) and drafts.logits.shape == expected.logits.shape
    assert torch.equal(drafts.ids, expected.ids)
    torch.testing.assert_close(drafts.logits, expected.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(drafts.confidence, expected.confidence, atol=1e-5, rtol=0)
    assert (drafts.confidence > 0).all()


def test_generate_with_a_draft_vocabulary_runs_the_fused_head(interp, monkeypatch):
    # `_select_rollout` no longer refuses a draft vocabulary: a forced 'triton' generate() drafts through the fused
    # kernels, and greedy output is the target's own.
    calls = []
    original = fused_head.TritonRollout.__call__

    def spy(self, *args, **kwargs):
        calls.append(args[4] if len(args) > 4 else kwargs.get("vocab"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(fused_head.TritonRollout, "__call__", spy)
    torch.manual_seed(0)
    target = small_target()
    drafter = tiny_drafter()
    drafter.set_draft_vocab(VOCABS["without the anchor"])
    prompt = torch.tensor([[5, 17, 42, 8, 9]])
    options = dict(max_new_tokens=10, do_sample=False, draft_policy="fixed")
    fused = target.generate(prompt, assistant_model=drafter, domino_rollout="triton", **options)
    assert calls and all(vocab is drafter.draft_vocab for vocab in calls)
    eager = target.generate(prompt, assistant_model=drafter, domino_rollout="eager", **options)
    plain = target.generate(prompt, max_new_tokens=10, do_sample=False)
    assert torch.equal(fused, plain) and torch.equal(eager, plain)


# ---------------------------------------------------------------------------------------------------------- dispatch
def test_select_rollout_modes(interp, monkeypatch):
    from transformers import LogitsProcessorList, TopKLogitsWarper

    drafter = tiny_drafter()
    embed, *_ = tiny_inputs(drafter.config.num_drafts)
    target = TargetModules(embed_tokens=embed, lm_head=nn.Identity())

    def select(mode: str = "auto", do_sample: bool = False, logits_processor=None):
        return fused_head.select_rollout(
            drafter, target, do_sample=do_sample, logits_processor=logits_processor, mode=mode
        )

    assert select("eager") is None
    assert select() is None  # auto: eager off CUDA
    rollout = select("triton")
    assert isinstance(rollout, fused_head.FusedRollout) and type(rollout.fused) is fused_head.TritonRollout
    with pytest.raises(RuntimeError, match="CUDA"):
        select("triton+graph")
    with pytest.raises(ValueError, match="logits processors"):  # greedy: top-k would change the argmax
        select("triton", logits_processor=LogitsProcessorList([TopKLogitsWarper(5)]))
    top_k = TopKLogitsWarper(5)  # sampling: top-k runs fused
    assert select("triton", do_sample=True, logits_processor=LogitsProcessorList([top_k])).fused.sampling == Sampling(
        top_k=5
    )
    with pytest.raises(ValueError, match="mode must be one of"):
        select("fast")

    # Only the arguments decide: the explicit mode is honoured and no environment variable is read, not even the
    # former override (which made "auto" mean "triton" here).
    reads = []

    class RecordingEnviron(dict):
        def __getitem__(self, key):
            reads.append(key)
            return super().__getitem__(key)

        def get(self, key, default=None):
            reads.append(key)
            return super().get(key, default)

        def __contains__(self, key):
            reads.append(key)
            return super().__contains__(key)

    monkeypatch.setattr(os, "environ", RecordingEnviron({**os.environ, "HF_DOMINO_HEAD": "triton"}))
    assert select() is None
    assert select("eager") is None
    assert type(select("triton").fused) is fused_head.TritonRollout
    assert reads == [], f"select_rollout read environment variables {reads}"
    monkeypatch.undo()

    assert select("triton", do_sample=True).fused.sampling == Sampling()


def test_select_rollout_gives_a_ladder_rollout_matching_eager(interp):
    drafter = tiny_drafter()
    embed, draft_hidden, base_logits, anchor_ids = tiny_inputs(drafter.config.num_drafts)
    target = TargetModules(embed_tokens=embed, lm_head=nn.Identity())
    rollout = fused_head.select_rollout(drafter, target, do_sample=False, logits_processor=None, mode="triton")

    drafts = rollout(BlockDraft(draft_hidden, base_logits), anchor_ids)
    expected = eager_drafts(drafter, target, draft_hidden, base_logits, anchor_ids)
    assert isinstance(drafts, Drafts) and len(drafts) == drafter.config.num_drafts
    assert torch.equal(drafts.ids, expected.ids)
    torch.testing.assert_close(drafts.logits, expected.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(drafts.confidence, draft_confidence(drafts.logits, drafts.ids))
    torch.testing.assert_close(drafts.confidence, expected.confidence, atol=1e-5, rtol=0)


@pytest.mark.skipif(INTERPRETED, reason="TRITON_INTERPRET=1 is set for the whole run")
def test_forcing_triton_on_cpu_without_the_interpreter_raises():
    drafter = tiny_drafter()
    embed, *_ = tiny_inputs(drafter.config.num_drafts)
    target = TargetModules(embed_tokens=embed, lm_head=nn.Identity())
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        fused_head.select_rollout(drafter, target, do_sample=False, logits_processor=None, mode="triton")


def test_fused_sampling_reads_a_calls_processors():
    from transformers import (
        LogitsProcessorList,
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    def fused(*processors, do_sample=True):
        return fused_head.fused_sampling(LogitsProcessorList(processors), do_sample)

    assert fused_head.fused_sampling(None, do_sample=True) == (Sampling(), None)
    assert fused(TemperatureLogitsWarper(0.7)) == (Sampling(0.7), None)
    # What generate() builds for a sampling call with Qwen3's defaults: the temperature, then top-k and top-p.
    top_k, top_p, min_p = TopKLogitsWarper(20), TopPLogitsWarper(0.95), MinPLogitsWarper(0.05)
    assert fused(TemperatureLogitsWarper(0.6), top_k, top_p) == (Sampling(0.6, top_k=20, top_p=0.95), None)
    assert fused(min_p) == (Sampling(min_p=0.05), None)
    assert fused(top_k, top_p, min_p) == (Sampling(1.0, 20, 0.95, 0.05), None)
    assert fused(*qwen3_warpers()) == (QWEN3_SAMPLING, None)
    assert fused(TopKLogitsWarper(3, min_tokens_to_keep=5)) == (Sampling(top_k=5), None)  # as the warper keeps 5
    assert fused_head.fused_sampling(None, do_sample=False) == (None, None)
    assert fused(TemperatureLogitsWarper(0.7), do_sample=False) == (None, None)  # greedy ignores a temperature
    # Eager: a processor that reads the sequence, a temperature after a warper, warpers in another order than
    # generate()'s, another filter value or more tokens kept than one, any processor when greedy.
    eager = [
        (RepetitionPenaltyLogitsProcessor(1.2), TemperatureLogitsWarper(0.7), top_k),
        (top_k, TemperatureLogitsWarper(0.7)),
        (top_p, top_k),
        (top_k, top_k),
        (TopKLogitsWarper(20, filter_value=-1e4),),
        (TopPLogitsWarper(0.9, min_tokens_to_keep=2),),
        (MinPLogitsWarper(0.1, min_tokens_to_keep=2),),
    ]
    for processors in eager:
        assert fused(*processors) == (None, fused_head.OTHER_PROCESSORS), processors
    assert fused(top_k, do_sample=False) == (None, fused_head.OTHER_PROCESSORS)


def test_warp_rows_is_each_rows_warpers_op_for_op():
    # Rows of one batch, each with its own top-k / top-p / min-p (none, some, all): each row's warped scores equal
    # what transformers' warpers built from its settings give for that row alone, to the bit, -inf entries (a draft
    # vocabulary's spread) and ties included.
    from transformers import LogitsProcessorList, MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    settings = [
        Sampling(),
        Sampling(top_k=5),
        Sampling(top_p=0.8),
        Sampling(min_p=0.1),
        Sampling(0.5, top_k=12, top_p=0.9),
        Sampling(top_k=1),
        Sampling(top_k=500, top_p=0.3, min_p=0.05),
        Sampling(top_p=0.999999),
    ]
    generator = torch.Generator().manual_seed(3)
    scores = 3 * torch.randn(len(settings), 4, VOCAB, generator=generator)
    scores[:, :, ::7] = float("-inf")
    scores[:, 1, :10] = scores[:, 1, :1]  # ties
    table = torch.tensor([setting.row() for setting in settings])
    warped = launch.warp_rows(scores, table, launch.Warps.of(settings))
    for row, setting in enumerate(settings):
        warpers = LogitsProcessorList()
        if setting.top_k:
            warpers.append(TopKLogitsWarper(setting.top_k))
        if setting.top_p < 1:
            warpers.append(TopPLogitsWarper(setting.top_p))
        if setting.min_p:
            warpers.append(MinPLogitsWarper(setting.min_p))
        assert torch.equal(warped[row], warpers(None, scores[row])), setting
    assert torch.equal(launch.warp_rows(scores, table, launch.Warps()), scores)
    # The power check: one row's settings applied to all would change the others.
    one = torch.tensor([settings[4].row()] * len(settings))
    assert not torch.equal(launch.warp_rows(scores, one, launch.Warps.of(settings)), warped)


# ------------------------------------------------------------------------------------- sampling with top-k/top-p/min-p
def qwen3_warpers():
    """What generate() builds for a sampling call with top-k and top-p after the temperature (Qwen3's defaults have
    this shape), sized to the tiny vocabulary."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    return LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(12), TopPLogitsWarper(0.8)])


QWEN3_SAMPLING = Sampling(0.7, top_k=12, top_p=0.8)  # qwen3_warpers() as the fused head reads them


@pytest.mark.parametrize("pure_draft_prefix_len", [0, 1])
@pytest.mark.parametrize("vocab_name", [None, *VOCABS])
def test_fused_rollout_with_top_k_top_p_returns_the_warped_logits_it_drew_from(
    interp, vocab_name, pure_draft_prefix_len
):
    # Along the drafted path, the logits returned are the eager pick's processed logits (the whole list: temperature,
    # top-k, top-p), and every draft is a token those logits keep: the draws come from the warped distribution, which
    # is what speculative sampling needs to stay lossless.

    vocab = None if vocab_name is None else VOCABS[vocab_name]
    if vocab is None:
        drafter = tiny_drafter(pure_draft_prefix_len=pure_draft_prefix_len)
        embed, draft_hidden, base_logits, anchor_ids = tiny_inputs(drafter.config.num_drafts)
        target = TargetModules(embed_tokens=embed, lm_head=nn.Identity())
    else:
        drafter, target, embed, draft_hidden, base_logits, anchor_ids = vocab_case(vocab, pure_draft_prefix_len)
    processors = qwen3_warpers()
    options = {
        "head": True,
        "pure_draft_prefix_len": pure_draft_prefix_len,
        "sampling": QWEN3_SAMPLING,
        "vocab": vocab,
    }
    torch.manual_seed(123)
    draft_ids, logits = triton_rollout.fused_rollout(
        drafter, draft_hidden, base_logits, anchor_ids, embed.weight, **options
    )
    position = iter(range(draft_ids.shape[1]))

    def replay(step_logits: torch.Tensor, realised_ids: torch.LongTensor):
        step_logits = step_logits.float()
        if vocab is not None:
            full = step_logits.new_full((step_logits.shape[0], VOCAB), float("-inf"))
            step_logits = full.index_copy_(-1, vocab, step_logits)
        return draft_ids[:, next(position)].reshape(1, 1), processors(realised_ids, step_logits)

    with torch.no_grad():
        expected = eager_rollout(drafter, target, replay)(BlockDraft(draft_hidden, base_logits, vocab), anchor_ids)
    assert logits.shape == (1, drafter.config.num_drafts, VOCAB)
    torch.testing.assert_close(logits, expected.logits, atol=1e-5, rtol=0)
    kept = torch.isfinite(logits)
    assert (kept.sum(-1) <= 12).all() and (kept.sum(-1) >= 1).all(), "top-k must leave at most 12 tokens"
    assert torch.gather(kept, -1, draft_ids[..., None]).all(), "a draft outside what the warpers kept"

    torch.manual_seed(123)
    again, _ = triton_rollout.fused_rollout(drafter, draft_hidden, base_logits, anchor_ids, embed.weight, **options)
    assert torch.equal(again, draft_ids), "torch.manual_seed must make sampled drafts reproducible"


def test_warped_draws_follow_the_warped_softmax(interp):
    # 400 independent draws of one position: 200 batch rows of 2 positions, each (row, position) with its own Philox
    # stream. The kept tokens in the proportions of the warped distribution, the filtered ones never. The power
    # check: without the warpers the counts differ.
    rows, positions, vocab = 200, 2, 6
    base = torch.tensor([1.0, 0.6, 0.3, 0.0, -0.2, -0.3]).expand(rows, positions, vocab).contiguous()
    ws = launch.Workspace(positions, vocab, base.device, None, warps=launch.Warps(top_k=3), rows=rows)
    ws.start(torch.zeros(rows, 1, dtype=torch.long), [Sampling(top_k=3)] * rows)
    ws.seed.fill_(7)
    launch.launch_logits_pick(ws, slice(0, positions), base, None, None, sample=True, pick=False)
    launch.launch_warped_pick(ws, slice(0, positions))
    tokens = ws.tokens[:, 1:].flatten()
    assert torch.isneginf(ws.logits[..., 3:]).all() and torch.equal(ws.logits[..., :3], base[..., :3])
    counts = torch.bincount(tokens, minlength=vocab).float()
    assert counts[3:].sum() == 0, counts
    assert chi_square(counts[:3], torch.softmax(base[0, 0, :3], -1)) < 13.82, counts  # 2 degrees of freedom, p = 0.001
    assert chi_square(counts, torch.softmax(base[0, 0], -1)) > 20.52, (
        "the test can't tell the warped law from the plain"
    )


def test_generate_with_top_k_top_p_runs_the_fused_head(interp, monkeypatch):
    # generate() with a sampling call's warpers takes the fused rollout (no longer eager); the tests above prove the
    # drafts it offers come with the warped logits they were drawn from, which speculative sampling verifies against
    # the target's own warped distribution.
    calls = []
    original = fused_head.TritonRollout.__call__

    def spy(self, *args, **kwargs):
        calls.append(self.sampling)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(fused_head.TritonRollout, "__call__", spy)
    torch.manual_seed(0)
    target = small_target()
    drafter = tiny_drafter()
    prompt = torch.tensor([[5, 17, 42, 8, 9]])
    options = dict(max_new_tokens=12, do_sample=True, temperature=0.7, top_k=12, top_p=0.8, draft_policy="fixed")
    output = target.generate(prompt, assistant_model=drafter, domino_rollout="triton", pad_token_id=0, **options)
    assert prompt.shape[1] < output.shape[1] <= prompt.shape[1] + 12
    assert calls and all(sampling == QWEN3_SAMPLING for sampling in calls), calls


# ------------------------------------------------------------------------------------------------------------ batches
# The batch loop drafts a block for every row at once: the same kernels, each launch covering all rows.
def batch_inputs(drafter, vocab: torch.Tensor | None = None, rows: int = 3, seed: int = 11):
    """`rows` different blocks (hidden states, base logits over `vocab` or the whole vocabulary, anchors)."""
    generator = torch.Generator().manual_seed(seed)
    embed, *_ = tiny_inputs(drafter.config.num_drafts)
    num_drafts = drafter.config.num_drafts
    hidden = torch.randn(rows, num_drafts, HIDDEN, generator=generator)
    base = torch.randn(rows, num_drafts, VOCAB, generator=generator)
    anchors = torch.tensor([[42], [5], [77], [3]])[:rows]
    return embed, hidden, base if vocab is None else base[..., vocab], anchors


def warped_replay(draft_ids: torch.LongTensor, processors, vocab: torch.Tensor | None):
    """An eager pick replaying `draft_ids [1, k]` that returns what a generate() call's processors make of the
    position's logits (spread over the whole vocabulary first, as `processed_pick` does)."""
    position = iter(range(draft_ids.shape[1]))

    def pick(logits: torch.Tensor, realised_ids: torch.LongTensor):
        logits = logits.float()
        if vocab is not None:
            logits = logits.new_full((logits.shape[0], VOCAB), float("-inf")).index_copy_(-1, vocab, logits)
        return draft_ids[:, next(position)].reshape(1, 1), processors(realised_ids, logits)

    return pick


def assert_rows_drew_from(logits, draft_ids, drafter, target, block_rows, processors, vocab) -> None:
    """Each row's sampled `logits` are what an eager rollout replaying that row's `draft_ids` makes of its block
    (`block_rows`: hidden states, base logits, anchors) through the call's `processors`."""
    hidden, base, anchors = block_rows
    for row in range(draft_ids.shape[0]):
        replay = warped_replay(draft_ids[row : row + 1], processors, vocab)
        with torch.no_grad():
            block = BlockDraft(hidden[row : row + 1], base[row : row + 1], vocab)
            expected = eager_rollout(drafter, target, replay)(block, anchors[row : row + 1])
        torch.testing.assert_close(logits[row : row + 1], expected.logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("vocab_name", [None, "without the anchor"])
@pytest.mark.parametrize("pure_draft_prefix_len", [0, 1, 2])
def test_fused_rollout_over_rows_drafts_each_row_as_alone_greedy(interp, vocab_name, pure_draft_prefix_len):
    vocab = None if vocab_name is None else VOCABS[vocab_name]
    drafter = tiny_drafter(pure_draft_prefix_len=pure_draft_prefix_len)
    embed, hidden, base, anchors = batch_inputs(drafter, vocab)
    target = TargetModules(embed_tokens=embed, lm_head=nn.Identity())
    options = {"head": True, "pure_draft_prefix_len": pure_draft_prefix_len, "sampling": None, "vocab": vocab}
    draft_ids, logits = triton_rollout.fused_rollout(drafter, hidden, base, anchors, embed.weight, **options)

    assert draft_ids.shape == base.shape[:2] and logits.shape == base.shape
    for row in range(base.shape[0]):
        with torch.no_grad():
            block = BlockDraft(hidden[row : row + 1], base[row : row + 1], vocab)
            expected = eager_rollout(drafter, target)(block, anchors[row : row + 1])
        assert torch.equal(draft_ids[row : row + 1], expected.ids), row
        torch.testing.assert_close(logits[row : row + 1], expected.logits, atol=1e-5, rtol=0)
    assert len({tuple(ids) for ids in draft_ids.tolist()}) == base.shape[0], "rows must not share their drafts"


@pytest.mark.parametrize("vocab_name", [None, "without the anchor"])
@pytest.mark.parametrize("pure_draft_prefix_len", [1, 2])  # 2: the prefix's rows and positions warped in one call
def test_fused_rollout_over_rows_samples_each_row_from_its_warped_logits(interp, vocab_name, pure_draft_prefix_len):

    vocab = None if vocab_name is None else VOCABS[vocab_name]
    drafter = tiny_drafter(pure_draft_prefix_len=pure_draft_prefix_len)
    embed, hidden, base, anchors = batch_inputs(drafter, vocab)
    target = TargetModules(embed_tokens=embed, lm_head=nn.Identity())
    processors = qwen3_warpers()
    options = {
        "head": True,
        "pure_draft_prefix_len": pure_draft_prefix_len,
        "sampling": QWEN3_SAMPLING,
        "vocab": vocab,
    }
    torch.manual_seed(123)
    draft_ids, logits = triton_rollout.fused_rollout(drafter, hidden, base, anchors, embed.weight, **options)

    assert logits.shape == (*base.shape[:2], VOCAB)
    assert_rows_drew_from(logits, draft_ids, drafter, target, (hidden, base, anchors), processors, vocab)
    assert torch.gather(torch.isfinite(logits), -1, draft_ids[..., None]).all(), "a draft outside what was kept"
    torch.manual_seed(123)
    again, _ = triton_rollout.fused_rollout(drafter, hidden, base, anchors, embed.weight, **options)
    assert torch.equal(again, draft_ids), "torch.manual_seed must make sampled drafts reproducible"


def settings_of_requests():
    """Four rows' processors as a server's requests build them, each with its own settings: Qwen3's, a hotter
    temperature alone, a greedy request (`top_k=1`) and a top-p alone."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    return [
        qwen3_warpers(),
        LogitsProcessorList([TemperatureLogitsWarper(1.5)]),
        LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(1)]),
        LogitsProcessorList([TopPLogitsWarper(0.5)]),
    ]


@pytest.mark.parametrize("vocab_name", [None, "without the anchor"])
def test_fused_rows_draw_each_under_its_own_sampling_settings(interp, vocab_name):
    # A server's requests bring their own temperature, top-k and top-p: each row of one fused rollout is drawn under
    # its own, and the logits it returns are what that row's own processors make of its block.
    vocab = None if vocab_name is None else VOCABS[vocab_name]
    drafter = tiny_drafter()
    embed, hidden, base, anchors = batch_inputs(drafter, vocab, rows=4)
    target = TargetModules(embed_tokens=embed, lm_head=nn.Identity())
    rows_processors = settings_of_requests()
    settings = [fused_head.fused_sampling(processors, do_sample=True)[0] for processors in rows_processors]
    torch.manual_seed(5)
    ids, logits = triton_rollout.fused_rollout(
        drafter,
        hidden,
        base,
        anchors,
        embed.weight,
        head=True,
        pure_draft_prefix_len=1,
        sampling=settings,
        vocab=vocab,
    )
    for row, processors in enumerate(rows_processors):
        block = (hidden[row : row + 1], base[row : row + 1], anchors[row : row + 1])
        assert_rows_drew_from(logits[row : row + 1], ids[row : row + 1], drafter, target, block, processors, vocab)
    kept = torch.isfinite(logits).sum(-1)
    assert (
        (kept[0] <= 12).all() and (kept[2] == 1).all() and (kept[1] == (VOCAB if vocab is None else len(vocab))).all()
    )
    assert torch.equal(ids[2], logits[2].argmax(-1)), "a greedy request's row drafts its argmax"
    # Against the first row's settings for all, the rows' logits differ: the test sees whose settings were used.
    torch.manual_seed(5)
    _, first_for_all = triton_rollout.fused_rollout(
        drafter, hidden, base, anchors, embed.weight, head=True, pure_draft_prefix_len=1, sampling=settings[0],
        vocab=vocab,
    )  # fmt: skip
    assert torch.equal(first_for_all[0], logits[0]) and not torch.equal(first_for_all[1:], logits[1:])


def test_the_batch_loop_draws_fused_rows_under_their_own_processors(interp):
    # The batch loop's drafting half hands the fused head each active row's processors (a server's requests each
    # bring theirs): rows drafted under their own settings, branches too; processors the kernels cannot run make
    # that cycle's rollout eager, still each row under its own.
    import time

    from transformers import GenerationConfig, LogitsProcessorList, RepetitionPenaltyLogitsProcessor

    from hf_domino.batch_drafts_domino import CycleDrafter
    from hf_domino.options_domino import DominoOptions
    from hf_domino.policy_domino import FixedPolicy
    from hf_domino.ragged_batch_domino import process_rows

    drafter = tiny_drafter()
    embed, hidden, base, anchors = batch_inputs(drafter, rows=4)
    target = TargetModules(embed_tokens=embed, lm_head=nn.Identity())
    per_row = settings_of_requests()
    sequences = list(anchors)

    def drafting_for(rows: list[int], **options) -> CycleDrafter:
        drafting = CycleDrafter(
            drafter, target, DominoOptions(domino_rollout="triton", **options), GenerationConfig(do_sample=True),
            per_row[0], [], None,
            process=lambda logits, extra, repeats=1: process_rows(
                [per_row[row] for row in rows for _ in range(repeats)],
                [sequences[row] for row in rows for _ in range(repeats)], logits, extra,
            ),
            clock=time.perf_counter, padding=[0] * 4, per_row=per_row,
        )  # fmt: skip
        drafting.policy = FixedPolicy(drafter.config.num_drafts)
        return drafting

    active = [3, 1, 2]  # rows in another order than their places, one of them gone
    drafting = drafting_for(active)
    assert drafting.fused_rollout is not None
    drafts, _ = drafting.roll_out(hidden[active], base[active], anchors[active], active)
    for place, row in enumerate(active):
        block = (hidden[row : row + 1], base[row : row + 1], anchors[row : row + 1])
        assert_rows_drew_from(
            drafts.logits[place : place + 1], drafts.ids[place : place + 1], drafter, target, block, per_row[row], None
        )
    first, others = drafting_for(active, domino_branches=2).roll_out(
        hidden[active], base[active], anchors[active], active
    )
    for place, row in enumerate(active):
        block = (hidden[row : row + 1], base[row : row + 1], anchors[row : row + 1])
        assert_rows_drew_from(others.logits[place], others.ids[place], drafter, target, block, per_row[row], None)
    per_row.append(LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3)]))  # a row the kernels cannot draw
    drafting, rows = drafting_for([0, 4]), [0, 4]
    assert not drafting.fused_rollout.draws_under([per_row[0], per_row[4]])
    sequences.append(anchors[0])
    drafts, _ = drafting.roll_out(hidden[[0, 0]], base[[0, 0]], anchors[[0, 0]], rows)  # eager: no error
    assert torch.isfinite(drafts.logits[1]).all() and (torch.isfinite(drafts.logits[0]).sum(-1) <= 12).all()


def test_fused_draft_rows_equal_the_batch_loops_eager_rollout(interp):
    from hf_domino.ragged_batch_domino import batched_rollout

    vocab = VOCABS["without the anchor"]
    drafter = tiny_drafter()
    embed, hidden, base, anchors = batch_inputs(drafter, vocab)
    target = TargetModules(embed_tokens=embed, lm_head=nn.Identity())
    rollout = fused_head.select_rollout(drafter, target, do_sample=False, logits_processor=None, mode="triton")
    ids, logits, confidence = rollout.draft_rows(hidden, base, vocab, anchors)
    with torch.no_grad():
        expected = batched_rollout(
            drafter, target, hidden, base, vocab, anchors,
            head=True, pick_logits=None, do_sample=False,
        )  # fmt: skip
    assert torch.equal(ids, expected.ids)
    torch.testing.assert_close(confidence, expected.confidence, atol=1e-5, rtol=0)
    assert logits.shape == base.shape


@pytest.mark.parametrize("vocab_name", [None, "without the anchor"])
@pytest.mark.parametrize("pure_draft_prefix_len", [0, 1])
def test_fused_tree_branches_equal_the_eager_tree_greedy(interp, vocab_name, pure_draft_prefix_len):
    # A tree of first-token branches (`domino_branches`): each row's block n times in a row, the i-th continuing from
    # its i-th likeliest first draft. Fused and eager give the same drafts, and the head reads each branch's own.
    from hf_domino.ragged_batch_domino import batched_rollout

    vocab, n = (None if vocab_name is None else VOCABS[vocab_name]), 3
    drafter = tiny_drafter(pure_draft_prefix_len=pure_draft_prefix_len)
    embed, hidden, base, anchors = batch_inputs(drafter, vocab)
    hidden, base, anchors = (tensor.repeat_interleave(n, dim=0) for tensor in (hidden, base, anchors))
    target = TargetModules(embed_tokens=embed, lm_head=nn.Identity())
    options = {"head": True, "pure_draft_prefix_len": pure_draft_prefix_len, "sampling": None, "vocab": vocab}
    ids, logits = triton_rollout.fused_rollout(drafter, hidden, base, anchors, embed.weight, branches=n, **options)
    with torch.no_grad():
        expected = batched_rollout(
            drafter, target, hidden, base, vocab, anchors, head=True, pick_logits=None, do_sample=False, branches=n
        )
    assert torch.equal(ids, expected.ids)
    columns = logits[:, 0].topk(n, dim=-1).indices.view(-1, n, n)
    likeliest = columns if vocab is None else vocab[columns]
    assert torch.equal(ids[:, 0].view(-1, n), likeliest[:, 0]), "each group's first drafts: its n likeliest, in order"
    for row in range(ids.shape[0]):  # the head continued from the branch's first draft: an eager replay agrees
        block = BlockDraft(hidden[row : row + 1], base[row : row + 1], vocab)
        replay = eager_rollout(drafter, target, forced_first(ids[row : row + 1], vocab))
        with torch.no_grad():
            torch.testing.assert_close(logits[row : row + 1], replay(block, anchors[row : row + 1]).logits, atol=1e-5,
                                       rtol=0)  # fmt: skip
    with pytest.raises(ValueError, match="groups of 2 branches"):
        triton_rollout.fused_rollout(drafter, hidden[:5], base[:5], anchors[:5], embed.weight, branches=2, **options)


def forced_first(draft_ids: torch.LongTensor, vocab: torch.Tensor | None):
    """A greedy eager pick that takes `draft_ids`' first draft at position 0 (a branch's), the argmax after (both as
    columns of the logits: the draft vocabulary's, when there is one)."""
    position = iter(range(draft_ids.shape[1]))

    def pick(logits: torch.Tensor, realised_ids: torch.LongTensor):
        if next(position):
            return logits.argmax(dim=-1, keepdim=True), logits
        first = draft_ids[:, :1]
        return (first if vocab is None else torch.searchsorted(vocab, first)), logits

    return pick


@pytest.mark.parametrize("vocab_name", [None, "without the anchor"])
def test_fused_tree_branches_sample_from_each_branch_on(interp, vocab_name):
    # Sampling with Qwen3's warpers: a tree's first drafts are chosen (the group's likeliest under the warped logits),
    # the later ones drawn along each branch, and the logits returned are what each branch's drafts were drawn from.

    vocab, n = (None if vocab_name is None else VOCABS[vocab_name]), 2
    drafter = tiny_drafter(pure_draft_prefix_len=1)
    embed, hidden, base, anchors = batch_inputs(drafter, vocab)
    hidden, base, anchors = (tensor.repeat_interleave(n, dim=0) for tensor in (hidden, base, anchors))
    target = TargetModules(embed_tokens=embed, lm_head=nn.Identity())
    processors = qwen3_warpers()
    options = {"head": True, "pure_draft_prefix_len": 1, "sampling": QWEN3_SAMPLING, "vocab": vocab}
    torch.manual_seed(5)
    ids, logits = triton_rollout.fused_rollout(drafter, hidden, base, anchors, embed.weight, branches=n, **options)
    likeliest = logits[:, 0].topk(n, dim=-1).indices.view(-1, n, n)
    assert torch.equal(ids[:, 0].view(-1, n), likeliest.diagonal(dim1=1, dim2=2))
    assert_rows_drew_from(logits, ids, drafter, target, (hidden, base, anchors), processors, vocab)


def left_padded_batch() -> dict[str, torch.Tensor]:
    input_ids = torch.tensor([[0, 0, 5, 17, 42], [5, 17, 42, 8, 9], [0, 3, 4, 8, 10]])
    return {"input_ids": input_ids, "attention_mask": (input_ids != 0).long()}


@pytest.mark.parametrize("do_sample", [False, True])
def test_batched_generate_runs_the_fused_head(interp, monkeypatch, do_sample):
    # A batch's drafting cycles roll the head out fused for all rows at once; greedy output is the target alone's,
    # row for row. (Sampling: the fused rows return their warped logits, as the eager rows do, above.)
    rows_seen = []
    original = fused_head.FusedRollout.draft_rows

    def spy(self, hidden, *args, **kwargs):
        rows_seen.append((hidden.shape[0], self.fused.sampling))
        return original(self, hidden, *args, **kwargs)

    monkeypatch.setattr(fused_head.FusedRollout, "draft_rows", spy)
    torch.manual_seed(0)
    target = small_target()
    drafter = tiny_drafter()
    drafter.set_draft_vocab(VOCABS["without the anchor"])
    batch = left_padded_batch()
    options = dict(max_new_tokens=10, do_sample=do_sample, draft_policy="fixed")
    if do_sample:  # a few cycles (the interpreter takes seconds per cycle)
        options.update(max_new_tokens=4, temperature=0.7, top_k=12, top_p=0.8)
    output = target.generate(**batch, assistant_model=drafter, domino_rollout="triton", **options)
    assert any(rows > 1 for rows, _ in rows_seen), "the batch loop did not draft through the fused head"
    if do_sample:
        assert all(sampling == QWEN3_SAMPLING for _, sampling in rows_seen)
        assert output.shape[0] == 3
    else:
        plain = target.generate(**batch, max_new_tokens=10, do_sample=False)
        assert torch.equal(output, plain)


def test_a_served_batch_generates_each_request_under_its_own_settings_fused(interp, monkeypatch):
    # The drafted manager (`init_continuous_batching`) on a config that samples, with requests of their own settings
    # sharing its cycles: the fused head drafts each row under its own (greedy requests, `top_k=1`, under theirs), and
    # a greedy request's answer is the target alone's.
    from transformers import ContinuousBatchingConfig, GenerationConfig

    seen = []
    original = fused_head.FusedRollout.draft_rows

    def spy(self, hidden, base_logits, vocab, anchor_ids, processors=None):
        seen.append({fused_head.row_sampling(row) for row in processors})
        return original(self, hidden, base_logits, vocab, anchor_ids, processors)

    monkeypatch.setattr(fused_head.FusedRollout, "draft_rows", spy)
    torch.manual_seed(0)
    target, drafter = small_target(), tiny_drafter()
    prompts = [[5, 17, 42, 8], [3, 4, 8, 10, 11], [9, 2, 7]]
    config = GenerationConfig(do_sample=True, temperature=0.7, top_k=12, max_new_tokens=6, pad_token_id=0)
    manager = target.init_continuous_batching(
        config, ContinuousBatchingConfig(max_requests_per_batch=4), assistant_model=drafter,
        domino_rollout="triton", draft_policy="fixed",
    )  # fmt: skip
    greedy = [manager.add_request(prompt, top_k=1) for prompt in prompts[:2]]
    manager.add_request(prompts[2], temperature=1.5)
    manager.start()
    results = {}
    while len(results) < 3:
        result = manager.get_result(timeout=300)
        assert result is not None, "no result within the timeout"
        if result.is_finished():
            results[result.request_id] = result
    manager.stop()
    assert any(len(settings) > 1 for settings in seen), "no cycle drafted rows of different settings together"
    assert Sampling(0.7, top_k=1) in set().union(*seen) and Sampling(1.5, top_k=12) in set().union(*seen)
    for request_id, prompt in zip(greedy, prompts):
        expected = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=6, pad_token_id=0)
        assert results[request_id].generated_tokens == expected[0, len(prompt) :].tolist()


@pytest.mark.parametrize("do_sample", [False, True])
def test_tree_generate_runs_the_fused_head(interp, monkeypatch, do_sample):
    # `domino_branches` through generate(): one sequence and a batch draft their trees' branches through the fused
    # head, n rows per row; greedy output is the target alone's.
    rows_seen = []
    original = fused_head.FusedRollout.draft_rows

    def spy(self, hidden, *args, **kwargs):
        rows_seen.append((hidden.shape[0], self.fused.branches))
        return original(self, hidden, *args, **kwargs)

    monkeypatch.setattr(fused_head.FusedRollout, "draft_rows", spy)
    torch.manual_seed(0)
    target, drafter = small_target(), tiny_drafter()
    drafter.set_draft_vocab(VOCABS["without the anchor"])
    batch = left_padded_batch()
    # A few cycles each (the interpreter takes seconds per cycle); one shows the sampled tree drafted fused.
    options = dict(max_new_tokens=6, do_sample=do_sample, draft_policy="fixed", domino_branches=3)
    if do_sample:
        options.update(max_new_tokens=3, temperature=0.7, top_k=12, top_p=0.8)
    for rows in (1, 3):
        part = {name: value[-rows:] for name, value in batch.items()}
        output = target.generate(**part, assistant_model=drafter, domino_rollout="triton", **options)
        assert (3 * rows, 3) in rows_seen, (rows, rows_seen)
        if do_sample:
            assert output.shape[0] == rows and torch.equal(output[:, :5], part["input_ids"])
        else:
            assert torch.equal(output, target.generate(**part, max_new_tokens=6, do_sample=False)), rows


# -------------------------------------------------------------------------------------------------------------- GPU
def cuda_case(dtype: torch.dtype = torch.bfloat16):
    drafter = tiny_drafter(dtype).cuda()
    embed, draft_hidden, base_logits, anchor_ids = tiny_inputs(drafter.config.num_drafts, dtype)
    return drafter, embed.cuda(), draft_hidden.cuda(), base_logits.cuda(), anchor_ids.cuda()


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_fused_rollout_matches_eager(dtype):
    drafter, embed, draft_hidden, base_logits, anchor_ids = cuda_case(dtype)
    target = TargetModules(embed_tokens=embed, lm_head=nn.Identity())
    draft_ids, logits = triton_rollout.fused_rollout(
        drafter,
        draft_hidden,
        base_logits,
        anchor_ids,
        embed.weight,
        head=True,
        pure_draft_prefix_len=1,
        sampling=None,
    )
    # cuDNN's GRU rounds fp32 products to TF32 by default (4e-3 off on an H200); the kernels multiply in fp32.
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        expected = eager_drafts(
            drafter, target, draft_hidden, base_logits, anchor_ids, forced_picker(draft_ids, None)
        ).logits
    atol, rtol = (1e-4, 0.0) if dtype == torch.float32 else (0.1, 0.03)
    torch.testing.assert_close(logits, expected, atol=atol, rtol=rtol)
    clear = top2_gap(expected) > 2 * (atol + rtol * expected.abs().amax(-1))
    assert torch.equal(draft_ids[clear], expected.argmax(-1)[clear])


@requires_cuda
def test_cuda_argmax_ties():
    base = tied_logits().cuda()
    tokens, _ = launch.logits_pick(base, block_v=16)
    assert tokens.tolist() == base.argmax(-1).tolist() == [37, 40, 0]


@requires_cuda
def test_cuda_graph_runner_captures_room_for_the_calls_most_drafts():
    # A call's first block may be short (an adaptive policy's first budget, a warm-up near max_length): told the
    # call's cap, the runner captures room for it at once, and a later full block replays the same graph.
    drafter, embed, draft_hidden, base_logits, anchor_ids = cuda_case(torch.float32)
    num_drafts = draft_hidden.shape[1]
    runner = fused_head.DominoHeadGraphRunner(drafter, sampling=None, capture_drafts=num_drafts)
    short = runner(draft_hidden[:, :3], base_logits[:, :3], anchor_ids, embed.weight)
    full = runner(draft_hidden, base_logits, anchor_ids, embed.weight)
    assert runner.num_captures == 1 and runner.captured_num_drafts == num_drafts
    eager = fused_head.TritonRollout(drafter, sampling=None)
    assert torch.equal(short[0], eager(draft_hidden[:, :3], base_logits[:, :3], anchor_ids, embed.weight)[0])
    assert torch.equal(full[0], eager(draft_hidden, base_logits, anchor_ids, embed.weight)[0])
    sized_by_its_block = fused_head.DominoHeadGraphRunner(drafter, sampling=None)
    sized_by_its_block(draft_hidden[:, :3], base_logits[:, :3], anchor_ids, embed.weight)
    sized_by_its_block(draft_hidden, base_logits, anchor_ids, embed.weight)
    assert sized_by_its_block.num_captures == 2


@requires_cuda
def test_cuda_graph_runner_reuses_and_recaptures():
    drafter, embed, draft_hidden, base_logits, anchor_ids = cuda_case(torch.float32)
    runner = fused_head.DominoHeadGraphRunner(drafter, sampling=None)

    def fused(hidden=draft_hidden, base=base_logits):
        return triton_rollout.fused_rollout(
            drafter, hidden, base, anchor_ids, embed.weight, head=True, pure_draft_prefix_len=1, sampling=None
        )

    first = runner(draft_hidden, base_logits, anchor_ids, embed.weight)
    second = runner(draft_hidden, base_logits + 1.0, anchor_ids, embed.weight)
    assert runner.num_captures == 1
    assert torch.equal(first[0], fused()[0]) and torch.equal(second[0], fused(base=base_logits + 1.0)[0])
    assert not torch.equal(first[1], second[1]), "the first result must not alias the static buffers"

    short = runner(draft_hidden[:, :3], base_logits[:, :3], anchor_ids, embed.weight)  # a block near max_length
    assert runner.num_captures == 1 and short[0].shape == (1, 3)
    torch.testing.assert_close(short[1], fused(draft_hidden[:, :3], base_logits[:, :3])[1])

    with torch.no_grad():  # in place: same addresses, the graph sees the new values without re-capture
        drafter.embed_proj[2].weight.mul_(-1.0)
    flipped = runner(draft_hidden, base_logits, anchor_ids, embed.weight)
    assert runner.num_captures == 1 and torch.equal(flipped[0], fused()[0])

    head_off = fused_head.DominoHeadGraphRunner(drafter, sampling=None, head=False)
    assert torch.equal(head_off(draft_hidden, base_logits, anchor_ids, embed.weight)[0], base_logits.argmax(-1))
    assert head_off.num_captures == 1 and runner.num_captures == 1
    drafter.to(torch.bfloat16)  # new weight tensors: must re-capture, not read freed memory
    runner(draft_hidden.bfloat16(), base_logits, anchor_ids, embed.weight)
    assert runner.num_captures == 2


@requires_cuda
@pytest.mark.parametrize("sampling", [None, Sampling(0.7)])
def test_cuda_graph_runner_over_a_draft_vocabulary(sampling):
    drafter, embed, draft_hidden, base_logits, anchor_ids = cuda_case(torch.float32)
    vocabs = [VOCABS["without the anchor"].cuda(), VOCAB_IDS[1:].cuda()]  # same size, other ids
    runner = fused_head.DominoHeadGraphRunner(drafter, sampling=sampling)

    def fused(vocab):
        return triton_rollout.fused_rollout(
            drafter,
            draft_hidden,
            base_logits[..., vocab],
            anchor_ids,
            embed.weight,
            head=True,
            pure_draft_prefix_len=1,
            sampling=sampling,
            vocab=vocab,
        )

    for captures, vocab in enumerate(vocabs, start=1):
        torch.manual_seed(5)
        ids, logits = runner(draft_hidden, base_logits[..., vocab], anchor_ids, embed.weight, vocab)
        assert runner.num_captures == captures, "a new vocabulary must re-capture"
        assert torch.isin(ids, vocab).all()
        assert logits.shape[-1] == (len(vocab) if sampling is None else VOCAB)
        if sampling is None:
            expected_ids, expected_logits = fused(vocab)
            assert torch.equal(ids, expected_ids)
            torch.testing.assert_close(logits, expected_logits)
        else:  # spread over the whole vocabulary, -inf outside the draft vocabulary
            assert torch.isfinite(logits[..., vocab]).all()
            assert int(torch.isinf(logits).sum()) == logits.shape[1] * (VOCAB - len(vocab))
    runner(draft_hidden, base_logits[..., vocabs[1]], anchor_ids, embed.weight, vocabs[1])
    assert runner.num_captures == 2
    runner(draft_hidden, base_logits, anchor_ids, embed.weight)  # whole vocabulary again
    assert runner.num_captures == 3


@requires_cuda
def test_cuda_graph_runner_sampling_draws_fresh_noise():
    drafter, embed, draft_hidden, base_logits, anchor_ids = cuda_case(torch.float32)
    runner = fused_head.DominoHeadGraphRunner(drafter, sampling=Sampling())
    flat = torch.zeros_like(base_logits)  # near-uniform drafts: repeated draws must differ
    draws = {tuple(runner(draft_hidden, flat, anchor_ids, embed.weight)[0].tolist()[0]) for _ in range(8)}
    assert len(draws) > 1 and runner.num_captures == 1


@requires_cuda
@pytest.mark.parametrize("vocab_name", [None, "without the anchor"])
def test_cuda_graph_runner_with_top_k_top_p_replays_the_fused_rollout(vocab_name):
    # The warpers' torch ops are captured with the kernels: each replay (same seed) draws what the fused rollout
    # launched op by op draws, from the same warped logits, and draws afresh with another seed.

    drafter, embed, draft_hidden, base_logits, anchor_ids = cuda_case(torch.float32)
    vocab = None if vocab_name is None else VOCABS[vocab_name].cuda()
    base = base_logits if vocab is None else base_logits[..., vocab]
    runner = fused_head.DominoHeadGraphRunner(drafter, sampling=QWEN3_SAMPLING)
    options = {"head": True, "pure_draft_prefix_len": 1, "sampling": QWEN3_SAMPLING, "vocab": vocab}
    for seed in (5, 6):
        torch.manual_seed(seed)
        ids, logits = runner(draft_hidden, base, anchor_ids, embed.weight, vocab)
        torch.manual_seed(seed)
        expected_ids, expected_logits = triton_rollout.fused_rollout(
            drafter, draft_hidden, base, anchor_ids, embed.weight, **options
        )
        assert torch.equal(ids, expected_ids) and runner.num_captures == 1
        torch.testing.assert_close(logits, expected_logits)
        assert (torch.isfinite(logits).sum(-1) <= 12).all()


@requires_cuda
def test_cuda_graph_runner_replays_rows_of_their_own_settings():
    # Rows' settings are device buffers: a graph captured with top-k and top-p replays for rows of any temperatures,
    # top-k up to its width and top-p, each row drawn as the launches draw it; a row asking for min-p (a warper the
    # graph lacks) captures again, with the warpers of both, which then serves the first settings too.
    drafter = tiny_drafter().cuda()
    embed, hidden, base, anchors = (t.cuda() for t in batch_inputs(drafter, rows=3))
    runner = fused_head.DominoHeadGraphRunner(drafter, sampling=QWEN3_SAMPLING)
    mixes = [
        [QWEN3_SAMPLING] * 3,
        [Sampling(1.5), Sampling(0.7, top_k=1), QWEN3_SAMPLING],
        [Sampling(min_p=0.2), QWEN3_SAMPLING, Sampling(0.5, top_p=0.5)],
        [Sampling(1.5), Sampling(0.7, top_k=1), QWEN3_SAMPLING],
    ]
    for captures, settings in zip((1, 1, 2, 2), mixes):
        torch.manual_seed(5)
        ids, logits = runner(hidden, base, anchors, embed.weight, None, settings)
        torch.manual_seed(5)
        expected_ids, expected_logits = triton_rollout.fused_rollout(
            drafter, hidden, base, anchors, embed.weight, head=True, pure_draft_prefix_len=1, sampling=settings
        )
        assert runner.num_captures == captures, settings
        assert torch.equal(ids, expected_ids), settings
        torch.testing.assert_close(logits, expected_logits)


@requires_cuda
@pytest.mark.parametrize("draft_vocab", [False, True])
def test_cuda_greedy_generate_is_identical_with_and_without_the_fast_path(monkeypatch, draft_vocab):
    calls = []
    for cls in (fused_head.DominoHeadGraphRunner, fused_head.TritonRollout):
        original = cls.__call__

        def spy(self, *args, _original=original, **kwargs):
            calls.append(type(self).__name__)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(cls, "__call__", spy)

    torch.manual_seed(0)
    target = small_target().cuda()
    drafter = tiny_drafter().cuda()
    if draft_vocab:
        drafter.set_draft_vocab(VOCABS["without the anchor"])
    prompt = torch.tensor([[5, 17, 42, 8, 9]], device="cuda")
    outputs = {}
    for mode in ("eager", "auto", "triton", "triton+graph"):
        outputs[mode] = target.generate(
            prompt,
            assistant_model=drafter,
            max_new_tokens=24,
            do_sample=False,
            domino_rollout=mode,
            draft_policy="fixed",  # draft every block: the adaptive policy may skip drafting on a model this small
        )
    plain = target.generate(prompt, max_new_tokens=24, do_sample=False)
    assert "DominoHeadGraphRunner" in calls, "the candidate generator did not dispatch to select_rollout()'s fast path"
    assert torch.equal(outputs["eager"], plain)
    assert torch.equal(outputs["triton"], plain) and torch.equal(outputs["triton+graph"], plain)
    assert torch.equal(outputs["auto"], plain)


@requires_cuda
@pytest.mark.parametrize("sampling", [None, Sampling(0.7)])
def test_cuda_graph_runner_over_rows_replays_for_fewer_rows(sampling):
    # A batch's rows retire as they finish: the graph captured for 3 rows replays for the 2 left (exact: rows are
    # independent), and a 4th row re-captures.
    drafter = tiny_drafter().cuda()
    embed, hidden, base, anchors = (t.cuda() for t in batch_inputs(drafter, rows=4))
    runner = fused_head.DominoHeadGraphRunner(drafter, sampling=sampling)
    options = {"head": True, "pure_draft_prefix_len": 1, "sampling": sampling}

    def both(rows: slice):
        torch.manual_seed(5)
        replayed = runner(hidden[rows], base[rows], anchors[rows], embed.weight)
        torch.manual_seed(5)
        launched = triton_rollout.fused_rollout(
            drafter, hidden[rows], base[rows], anchors[rows], embed.weight, **options
        )
        return replayed, launched

    (ids, logits), (expected_ids, expected_logits) = both(slice(0, 3))
    assert runner.num_captures == 1 and ids.shape == (3, drafter.config.num_drafts)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(logits, expected_logits)
    (ids, logits), (expected_ids, expected_logits) = both(slice(1, 3))
    assert runner.num_captures == 1 and ids.shape[0] == 2
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(logits, expected_logits)
    both(slice(0, 4))
    assert runner.num_captures == 2


@requires_cuda
@pytest.mark.parametrize("sampling", [None, Sampling(0.7)])
def test_cuda_graph_runner_over_a_tree_replays_the_fused_branches(sampling):
    # A tree's branches are rows in groups of n (`domino_branches`): the captured graph takes each group's likeliest
    # first drafts as the launches do, also when it replays for fewer groups than it captured.
    n = 2
    drafter = tiny_drafter().cuda()
    embed, *block = batch_inputs(drafter, rows=3)
    embed, (hidden, base, anchors) = embed.cuda(), (t.cuda().repeat_interleave(n, dim=0) for t in block)
    runner = fused_head.DominoHeadGraphRunner(drafter, sampling=sampling, branches=n)
    options = {"head": True, "pure_draft_prefix_len": 1, "sampling": sampling, "branches": n}
    for rows in (slice(0, 6), slice(2, 6)):
        torch.manual_seed(5)
        ids, logits = runner(hidden[rows], base[rows], anchors[rows], embed.weight)
        torch.manual_seed(5)
        expected_ids, expected_logits = triton_rollout.fused_rollout(
            drafter, hidden[rows], base[rows], anchors[rows], embed.weight, **options
        )
        assert torch.equal(ids, expected_ids) and runner.num_captures == 1, rows
        torch.testing.assert_close(logits, expected_logits)
        assert (ids[0::n, 0] != ids[1::n, 0]).all(), "a group's branches start from different first drafts"


@requires_cuda
def test_cuda_batched_greedy_generate_is_identical_with_and_without_the_fast_path(monkeypatch):
    rows_seen = []
    original = fused_head.DominoHeadGraphRunner.__call__

    def spy(self, draft_hidden, *args, **kwargs):
        rows_seen.append(draft_hidden.shape[0])
        return original(self, draft_hidden, *args, **kwargs)

    monkeypatch.setattr(fused_head.DominoHeadGraphRunner, "__call__", spy)
    torch.manual_seed(0)
    target = small_target().cuda()
    drafter = tiny_drafter().cuda()
    drafter.set_draft_vocab(VOCABS["without the anchor"])
    batch = {name: tensor.cuda() for name, tensor in left_padded_batch().items()}
    options = dict(max_new_tokens=24, do_sample=False, draft_policy="fixed")
    plain = target.generate(**batch, max_new_tokens=24, do_sample=False)
    for mode in ("eager", "auto", "triton", "triton+graph"):
        assert torch.equal(target.generate(**batch, assistant_model=drafter, domino_rollout=mode, **options), plain)
    assert any(rows > 1 for rows in rows_seen), "the batch loop did not draft through the graph runner"


@pytest.mark.slow
def test_shipped_drafter_with_its_draft_vocabulary_drafts_the_same_fused_and_eager(interp):
    # The drafter users get first: the real SmolLM2 target and the shipped drafter over its 8192-token vocabulary.
    # Same drafts fused and eager means the same acceptance, block for block; greedy output is the target's own.
    from hf_domino.assets import SHIPPED_DRAFTER, load_smollm2
    from hf_domino.prompt_sets import load_mtbench

    target, tokenizer = load_smollm2()
    drafter = DominoForSpeculation.from_pretrained(SHIPPED_DRAFTER, dtype=torch.float32).eval()
    assert drafter.draft_vocab is not None and len(drafter.draft_vocab) == 8192
    input_ids = tokenizer.apply_chat_template(
        load_mtbench(limit=1)[0], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    options = dict(max_new_tokens=12, do_sample=False, assistant_model=drafter, draft_policy="fixed")
    expected = target.generate(input_ids, max_new_tokens=12, do_sample=False)
    acceptance = {}
    for mode in ("eager", "triton"):
        output = target.generate(input_ids, domino_rollout=mode, **options)
        assert torch.equal(output, expected), mode
        acceptance[mode] = drafter.last_generation_stats.acceptance_lengths
    assert acceptance["triton"] == acceptance["eager"] and max(acceptance["eager"]) > 1, acceptance


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a drafter off CUDA")
def test_graphs_off_cuda_are_refused_with_the_fix_that_works():
    """On a CPU without the interpreter, 'triton+graph' sent users to TRITON_INTERPRET=1, which then refused it
    for CUDA graphs: the message now says CUDA, and 'eager'."""
    target, drafter = small_target(), tiny_drafter()
    with pytest.raises(ValueError, match="'triton\\+graph' needs CUDA \\(CUDA graphs\\), and the drafter is on cpu"):
        target.generate(torch.tensor([[5, 17, 42]]), assistant_model=drafter, domino_rollout="triton+graph",
                        max_new_tokens=4, do_sample=False)  # fmt: skip

"""`warpers_domino.SortFreeTopP`: transformers' top-p warper without the full sort, bit for bit, and in drafted calls."""

from __future__ import annotations

import pytest
import torch
from conftest import own_drafts, tiny_drafter, tiny_target
from transformers import TopKLogitsWarper, TopPLogitsWarper

from hf_domino import generate_hook_domino, warpers_domino
from hf_domino.warpers_domino import FEW_TOKENS, SortFreeTopP


@pytest.fixture
def sorts(monkeypatch) -> list[int]:
    """Counts the calls that `SortFreeTopP` hands to transformers' warper (which sorts the whole row)."""
    calls = []
    original = TopPLogitsWarper.__call__

    def counted(self, input_ids, scores):
        calls.append(scores.shape[0])
        return original(self, input_ids, scores)

    monkeypatch.setattr(TopPLogitsWarper, "__call__", counted)
    return calls


def random_case(generator: torch.Generator, trial: int) -> tuple[torch.Tensor, TopPLogitsWarper]:
    """Rows of scores after a top-k (as a sampling call's processors leave them), some with ties (bf16-rounded or
    quantized scores), and a top-p warper of random settings."""
    vocab, rows = int(torch.randint(FEW_TOKENS + 1, 3000, (1,), generator=generator)), trial % 4 + 1
    scores = torch.randn(rows, vocab, generator=generator) * float(torch.rand(1, generator=generator)) * 10
    if trial % 3 == 0:
        scores = scores.bfloat16().float()
    if trial % 5 == 0:
        scores = (scores * 4).round() / 4
    scores = TopKLogitsWarper(int(torch.randint(1, FEW_TOKENS + 12, (1,), generator=generator)))(None, scores)
    top_p = max(float(torch.rand(1, generator=generator)), 1e-3)
    keep = 1 if trial % 7 else int(torch.randint(1, 4, (1,), generator=generator))
    return scores, TopPLogitsWarper(top_p, min_tokens_to_keep=keep)


def test_sort_free_top_p_is_the_warper_bit_for_bit(sorts):
    # 2,000 random cases: every output equals transformers' warper's, and most took the sort-free path (the rest
    # fell back: ties, a top-k wider than FEW_TOKENS, too few tokens kept), so the equality is the path's own.
    generator = torch.Generator().manual_seed(0)
    cases, sort_free = 2000, 0
    for trial in range(cases):
        scores, warper = random_case(generator, trial)
        sorts.clear()
        fast = SortFreeTopP(warper)(None, scores)
        sort_free += not sorts
        assert torch.equal(fast, warper(None, scores)), trial
    assert sort_free > cases * 0.4, sort_free


@pytest.mark.parametrize(
    "case", ["a tie among the kept", "NaN", "+inf", "no top-k before it", "another filter value", "fewer than kept"]
)
def test_sort_free_top_p_hands_what_it_cannot_show_equal_to_the_warper(sorts, case):
    scores = TopKLogitsWarper(10)(None, torch.randn(2, 500, generator=torch.Generator().manual_seed(1)))
    warper = TopPLogitsWarper(0.8)
    if case == "a tie among the kept":
        kept = torch.isfinite(scores[1]).nonzero()[:2, 0]
        scores[1, kept] = 0.5
    elif case == "NaN":
        scores[0, 3] = float("nan")
    elif case == "+inf":
        scores[0, 3] = float("inf")
    elif case == "no top-k before it":
        scores = torch.randn(2, 500)
    elif case == "another filter value":
        warper = TopPLogitsWarper(0.8, filter_value=-1e4)
    else:
        warper = TopPLogitsWarper(0.8, min_tokens_to_keep=11)
    output = SortFreeTopP(warper)(None, scores)
    assert sorts, "it did not hand the call over"
    expected = warper(None, scores)
    assert torch.equal(output, expected) or (torch.isnan(output) == torch.isnan(expected)).all()


def test_the_list_keeps_its_order_and_only_the_warpers_own_class_is_swapped():
    class MyTopP(TopPLogitsWarper):  # a user's subclass: its call may differ, so it stays
        pass

    top_k, top_p, mine = TopKLogitsWarper(5), TopPLogitsWarper(0.9, min_tokens_to_keep=2), MyTopP(0.5)
    processors = [top_k, top_p, mine]
    warpers_domino.sort_free_top_p(processors)
    assert processors[0] is top_k and processors[2] is mine
    assert type(processors[1]) is SortFreeTopP
    assert vars(processors[1]) == vars(top_p)


@pytest.mark.parametrize("rows", [1, 2])
def test_a_sampled_drafted_call_draws_the_same_tokens_without_the_sort(rows, sorts, monkeypatch):
    # A drafted call whose config samples with top-k and top-p: its warpers run sort-free (in transformers' loop for
    # one sequence, in ours for a batch), and with the same seed it draws, token for token, what it draws with
    # transformers' warper (fixed blocks: no timing decides anything).
    target = tiny_target(vocab_size=300)
    drafter = tiny_drafter(target)
    input_ids = torch.tensor([[5, 17, 42, 8], [0, 3, 4, 9]])[:rows]
    batch = {"input_ids": input_ids, "attention_mask": (input_ids != 0).long()}
    options = dict(max_new_tokens=12, do_sample=True, temperature=0.8, top_k=20, top_p=0.9, draft_policy="fixed")

    def sampled() -> torch.Tensor:
        torch.manual_seed(3)
        return target.generate(**batch, assistant_model=drafter, **options)

    sort_free = sampled()
    assert own_drafts(drafter.last_generation_stats) > 0, "nothing was drafted"
    handed_over = len(sorts)
    monkeypatch.setattr(generate_hook_domino, "sort_free_top_p", lambda processors: None)
    sorts.clear()
    assert torch.equal(sampled(), sort_free)
    assert handed_over < len(sorts) / 4, (handed_over, len(sorts))  # the sort-free calls skipped most sorts


def test_a_served_requests_processors_run_sort_free():
    from transformers import GenerationConfig

    from hf_domino.continuous_batching_domino import request_rules

    target, config = tiny_target(), GenerationConfig(do_sample=True, top_k=20, top_p=0.9, max_new_tokens=4)
    target._prepare_special_tokens(config, device="cpu")  # as a served batch's config is
    processors, _, _ = request_rules(target, config, torch.tensor([5, 17, 42]), temperature=0.5)
    assert [type(processor).__name__ for processor in processors] == [
        "TemperatureLogitsWarper", "TopKLogitsWarper", "SortFreeTopP"
    ]  # fmt: skip


def test_a_batch_calls_the_sort_free_warper_for_all_its_rows_at_once():
    # Not a user's hook (which a batch calls row by row, at its place): a warper that reads the scores alone, which
    # the batch loop runs once over all rows of a setting.
    from hf_domino.drafting_domino import score_only
    from hf_domino.ragged_batch_domino import row_processors

    processors = [TopKLogitsWarper(5), TopPLogitsWarper(0.9)]
    warpers_domino.sort_free_top_p(processors)
    rows = row_processors(processors, 3)
    assert all(list(row) == processors for row in rows) and score_only(processors)

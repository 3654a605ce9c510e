"""Drafts copied from the text (`domino_lookup`, on by default): found right, verified losslessly, priced well."""

from __future__ import annotations

import pytest
import torch
from conftest import forcing_drafter, successor_target, tiny_drafter, tiny_target
from test_batching import both, left_padded
from test_generation import (
    VOCAB,
    chi_square_p_value,
    exact_sequence_distribution,
    greedy,
    law_drafter,
    law_target,
    letter_tokenizer,
    sample_with_drafter,
    sampled_continuations,
    successor,
)
from transformers import LogitsProcessorList

from hf_domino import batching_domino
from hf_domino.batch_policy_domino import BatchVerifyCost
from hf_domino.copied_drafts_domino import certain_logits, lookup_drafts
from hf_domino.cost_model_domino import VerifyCost, expected_tokens
from hf_domino.measure import parse_method
from hf_domino.measure_batch import parse_batch_method
from hf_domino.policy_domino import LookupPolicy
from hf_domino.records_domino import INITIAL_ACCEPTANCE, DrafterRecord, DraftingMode, drafter_record


def found(sequence: list[int], limit: int = 4) -> list[int] | None:
    drafts = lookup_drafts(torch.tensor([sequence]), limit)
    return None if drafts is None else drafts[0].tolist()


def test_lookup_copies_after_the_earliest_occurrence_of_the_longest_ngram():
    assert found([7, 1, 2, 3, 9, 8, 6, 5, 1, 2, 3]) == [9, 8, 6, 5]  # the 3-gram 1 2 3
    assert found([7, 1, 2, 3, 9, 8, 6, 5, 1, 2, 3], limit=2) == [9, 8]
    assert found([1, 2, 4, 1, 2, 5, 1, 2]) == [4, 1, 2, 5]  # the earliest of two occurrences
    # A 3-gram occurrence wins over an earlier 2-gram one.
    assert found([2, 3, 6, 9, 9, 1, 2, 3, 7, 1, 2, 3]) == [7, 1, 2, 3]
    assert found([1, 2, 3, 1, 2]) == [3, 1, 2]  # copying may run into the tail itself
    assert found([4, 5, 6, 7]) is None  # nothing repeats
    assert found([6, 1, 5, 1]) is None  # single tokens do not count
    assert found([5, 5]) is None and found([5, 5, 5]) == [5]  # the sequence's own last n-gram is not a match
    assert found([1, 2, 8, 1, 2], limit=0) is None


def test_lookup_policy_verifies_what_pays():
    # Verifying costs little more up to 5 tokens, then 50% more: an acceptance of 0.8 pays up to 4 drafts.
    cost = VerifyCost({1: 1.0, 2: 1.02, 5: 1.05, 6: 1.5, 17: 1.5})
    record = DrafterRecord(position_acceptance=[INITIAL_ACCEPTANCE] * 8)
    policy = LookupPolicy(record, cost, learn_times=False)
    assert policy.choose(8) == 4 and policy.choose(2) == 2
    for _ in range(30):  # copied drafts keep failing at the first position
        policy.observe(verified=4, accepted=0, verify_seconds=1.0)
    assert record.position_acceptance[0] < 0.01 and policy.choose(8) == 0
    assert record.position_acceptance[1] == INITIAL_ACCEPTANCE  # never judged past a rejection
    assert LookupPolicy(record, None).choose(3) == 3  # a fixed policy verifies every draft found
    fresh = LookupPolicy(DrafterRecord(position_acceptance=[INITIAL_ACCEPTANCE] * 8), cost, learn_times=False)
    rate = float(expected_tokens(torch.tensor([INITIAL_ACCEPTANCE] * 4))[-1]) / 1.05
    assert fresh.choose(8, rival_rate=rate - 0.01) == 4 and fresh.choose(8, rival_rate=rate + 0.01) == 0


def test_lookup_policy_prices_a_batchs_copies_together():
    """Every row of a batch pays for the verified width: copies in one row of four do not pay where verifying two
    tokens per row costs 1.5 plain steps; the same copies in every row do. One row is the single-sequence rule."""
    table = VerifyCost({4: 1.0, 8: 1.5, 20: 2.0})  # 4 rows: 1 token each costs 1.0, 2 tokens 1.5, 5 tokens 2.0
    record = DrafterRecord(position_acceptance=[0.9] * 8)
    policy = LookupPolicy(record, BatchVerifyCost(table, rows=4), learn_times=False)
    plain = 1 / 1.0
    assert policy.choose([4, 0, 0, 0], rival_rate=plain) == 0
    assert policy.choose([4, 4, 4, 4], rival_rate=plain) == 4
    assert policy.choose([4, 4, 4, 0], rival_rate=plain) == 4 and policy.choose([1, 0, 0, 0], rival_rate=0.0) == 0
    single = LookupPolicy(record, VerifyCost({1: 1.0, 2: 1.5, 5: 2.0}), learn_times=False)
    assert single.choose([4], rival_rate=plain) == single.choose(4, rival_rate=plain) == 4
    assert LookupPolicy(record, None).choose([3, 0, 5]) == 5  # a fixed policy: the widest row's copies


def test_declined_copies_are_judged_against_what_was_generated(gpu_like_costs):
    """A copy source judged poor is not verified, yet keeps being judged: each declined copy is compared with the
    tokens generated instead. On a looping text the copies then win their place back within the same call.
    (Fixed, GPU-like verify costs: with measured ones, when copies pay again depends on the machine.)"""
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    prompt = torch.tensor([[7, 7, 8, 9, 10, 11, 12, 7, 7, 8]])
    record = drafter_record(drafter, target, DraftingMode("lookup"), drafter.config.num_drafts)
    record.position_acceptance = [0.0] * drafter.config.num_drafts  # copies look worthless to start with
    output = target.generate(prompt, do_sample=False, max_new_tokens=60, assistant_model=drafter)
    assert torch.equal(output, target.generate(prompt, do_sample=False, max_new_tokens=60))
    copied = drafter.last_generation_stats.copied
    assert not copied[0] and any(copied)
    assert record.position_acceptance[0] > 0.4  # learned from 0


def test_greedy_identical_with_copied_drafts(arch, gpu_like_costs):
    """Random tiny models fall into loops, where copying from the text drafts well. (GPU-like costs: whether the
    adaptive policy verifies copies must not depend on this machine's timings.)"""
    target = tiny_target(arch)
    drafter = tiny_drafter(target)
    prompt = torch.tensor([[5, 17, 9, 33, 5, 17, 40]])
    expected = target.generate(prompt, do_sample=False, max_new_tokens=40)
    for options in (dict(draft_policy="fixed"), dict(), dict(num_speculative_tokens=2)):
        output = target.generate(prompt, do_sample=False, max_new_tokens=40, assistant_model=drafter, **options)
        assert torch.equal(output, expected), options
        stats = drafter.last_generation_stats
        copied_lengths = [n for n, copied in zip(stats.acceptance_lengths, stats.copied) if copied]
        assert copied_lengths and max(copied_lengths) > 1, options  # copies were verified, and accepted
        assert max(stats.drafted) <= options.get("num_speculative_tokens", drafter.config.num_drafts)
    drafter_only = target.generate(
        prompt, do_sample=False, max_new_tokens=40, assistant_model=drafter, domino_lookup=False
    )
    assert torch.equal(drafter_only, expected) and not any(drafter.last_generation_stats.copied)
    # transformers' own prompt-lookup length caps the copies.
    capped = target.generate(
        prompt, do_sample=False, max_new_tokens=40, assistant_model=drafter, draft_policy="fixed",
        prompt_lookup_num_tokens=2,
    )  # fmt: skip
    stats = drafter.last_generation_stats
    assert torch.equal(capped, expected) and any(stats.copied)
    assert max(n for n, copied in zip(stats.drafted, stats.copied) if copied) == 2


def test_copied_drafts_stop_at_stop_strings():
    tokenizer = letter_tokenizer()
    target = successor_target("llama", VOCAB)  # emits consecutive letters
    drafter = forcing_drafter(target, successor(2))  # always wrong: every accepted draft is a copied one
    prompt = torch.tensor([[4, 5, 6, 7, 8, 9, 10, 11, 4, 5]])  # "abcdefghab": "ab" occurred before, then "cdefgh"
    kwargs = dict(max_new_tokens=20, stop_strings=["ef"], tokenizer=tokenizer)
    expected = greedy(target, prompt, **kwargs)
    assert tokenizer.decode(expected[0, prompt.shape[1] :]) == "cdef"
    assert torch.equal(greedy(target, prompt, assistant_model=drafter, **kwargs), expected)
    stats = drafter.last_generation_stats
    # The copy "cdefgh" is offered only up to "e": the target's own "f" completes the stop string.
    assert stats.copied[0] and stats.acceptance_lengths[0] == 3


@pytest.mark.parametrize("rows", [1, 2], ids=["one-sequence", "batch"])
def test_copied_drafts_end_at_an_eos(rows):
    # A chat's earlier turns hold EOS tokens: a copy across one offers nothing after it (never generated).
    target = successor_target("qwen3", VOCAB)  # ... 30, 31, 0, 1 (= EOS)
    drafter = forcing_drafter(target, successor(2), block_size=8)  # always wrong: the copies alone are accepted
    prompts = [[28, 29, 30, 31, 0, 1, 2, 3, 4, 28, 29, 30], [29, 30, 31, 0, 1, 2, 5, 29, 30]][:rows]
    expected, output = both(target, drafter, left_padded(prompts), max_new_tokens=20, draft_policy="fixed")
    assert torch.equal(output, expected)
    stats = drafter.last_generation_stats
    # After the prefill's 31, the copy of what followed 29 30 31: 0 and the EOS, not the 2, 3, 4, ... after it.
    assert stats.copied[0] and stats.drafted[0] == 2


def test_sampling_with_copied_drafts_preserves_target_distribution():
    """Copied drafts have no distribution of their own: they reach speculative sampling as drafts certain of their
    token (`certain_logits`), the law of keeping them while they equal the target's draws. Mixed with the drafter's
    cycles in the same calls."""
    vocab, num_new, draws = 4, 4, 2500
    target = law_target(vocab, seed=5, peak=20)  # a peaked law, far from uniform, so that a wrong one shows
    drafter = law_drafter(target)
    prompt = [3, 0, 3, 1, 3, 2, 3, 3]  # every pair "3 t" occurred: whatever t follows, the next cycle copies
    probs = exact_sequence_distribution(target, prompt, num_new, LogitsProcessorList())
    calls = []
    counts, _, _ = sample_with_drafter(
        target, drafter, prompt, num_new, draws, seed=99, per_call=calls, draft_policy="fixed", top_k=0
    )
    copied = {"cycles": 0, "accepted": 0, "drafted": 0}
    for stats in calls:
        for length, offered, was_copied in zip(stats.acceptance_lengths, stats.drafted, stats.copied):
            copied["cycles"] += was_copied
            copied["accepted"] += (length - 1) * was_copied
            copied["drafted"] += offered * (not was_copied)
    assert copied["cycles"] > draws and copied["accepted"] > draws // 10 and copied["drafted"] > draws // 10
    assert chi_square_p_value(counts, probs, draws) > 1e-3
    # The test can fail: the same draws are far from the distribution of another prompt's continuations.
    wrong = exact_sequence_distribution(target, [3, 0, 3, 1, 3, 2, 3, 0], num_new, LogitsProcessorList())
    assert chi_square_p_value(counts, wrong, draws) < 1e-6


def spread_over_two_tokens(copies: torch.LongTensor, vocab_size: int) -> torch.Tensor:
    """A fault to show the copies' law tests have power: a copy's law split between its token and the next id."""
    logits = certain_logits(copies, vocab_size)
    return logits.scatter_(-1, (copies[..., None] + 1) % vocab_size, 0.0)


@pytest.mark.slow  # the draws of the two law tests above again, to show they have the power they need
@pytest.mark.parametrize("rows", [1, 2], ids=["one-sequence", "batch"])
def test_the_copies_law_tests_fail_a_copy_whose_law_is_spread(rows, monkeypatch):
    from hf_domino import generation_domino, ragged_batch_domino

    monkeypatch.setattr(generation_domino, "certain_logits", spread_over_two_tokens)
    monkeypatch.setattr(ragged_batch_domino, "certain_logits", spread_over_two_tokens)
    law_test = (
        test_sampling_with_copied_drafts_preserves_target_distribution
        if rows == 1
        else test_batch_sampling_with_copied_drafts_keeps_each_rows_law
    )
    with pytest.raises(AssertionError, match=r"> 0\.001"):
        law_test()


@pytest.mark.parametrize("draft_vocab", [None, list(range(0, 64, 2))], ids=["whole-vocabulary", "draft-vocabulary"])
def test_ensemble_weight_turns_copying_off(draft_vocab):
    # Greedy drafts over a draft vocabulary reach transformers' ensemble rule spread over the whole vocabulary (they
    # came with the draft vocabulary's columns only, which it cannot mix with the target's logits).
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    drafter.set_draft_vocab(draft_vocab)
    prompt = torch.tensor([[5, 17, 9, 33, 5, 17]])
    target.generate(
        prompt, do_sample=False, max_new_tokens=10, assistant_model=drafter, draft_policy="fixed",
        assistant_ensemble_weight=0.5,
    )  # fmt: skip
    stats = drafter.last_generation_stats
    assert not any(stats.copied) and all(stats.drafted)
    # A batch, or a tree, is verified in this package's loop, which does not mix: refused with the fix.
    for inputs, options, fix in ((torch.tensor([[5, 17, 9], [6, 7, 8]]), {}, "generate one prompt at a time"),
                                 (prompt, {"domino_branches": 2}, "drop domino_branches")):  # fmt: skip
        with pytest.raises(ValueError, match=f"assistant_ensemble_weight mixes.*{fix}"):
            target.generate(
                inputs, max_new_tokens=4, assistant_model=drafter, assistant_ensemble_weight=0.5, **options
            )


def test_option_is_checked_and_bench_methods_name_it():
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    with pytest.raises(ValueError, match="domino_lookup must be True or False, got 'yes'"):
        target.generate(torch.tensor([[5, 6]]), max_new_tokens=3, assistant_model=drafter, domino_lookup="yes")
    assert parse_method("domino_vocab_lookup").options["domino_lookup"] is True
    assert parse_method("domino_vocab_lookup_k4@eager").options == {
        "domino_head": True,
        "draft_vocab": True,
        "domino_lookup": True,
        "domino_datastore": True,
        "draft_policy": "fixed",
        "num_speculative_tokens": 4,
        "domino_rollout": "eager",
    }
    assert parse_method("domino_vocab").options["domino_lookup"] is False  # the drafter alone, as always measured
    assert parse_batch_method("domino_lookup") == {
        "domino_lookup": True,
        "domino_datastore": True,
        "draft_policy": "adaptive",
    }
    assert parse_batch_method("domino_copies")["domino_datastore"] is False
    assert (
        parse_batch_method("domino_k4_lookup")["domino_lookup"] and not parse_batch_method("domino")["domino_lookup"]
    )
    assert parse_batch_method("domino_k2_lookup_tree3")["domino_branches"] == 3
    assert parse_batch_method("domino_lookup2") == {
        "domino_lookup": True,
        "domino_datastore": True,
        "loop": {"RETRIEVAL_MAX_ROWS": 2},
        "draft_policy": "adaptive",
    }
    assert parse_batch_method("domino_rowk")["loop"] == {"K_PER_ROW": True}
    assert parse_batch_method("domino_lookup_makespan")["loop"] == {"PRICE_BY_MAKESPAN": True}
    assert parse_batch_method("domino_lookup@eager")["domino_rollout"] == "eager"
    assert parse_batch_method("domino_k4@triton+graph")["domino_rollout"] == "triton+graph"
    assert "domino_rollout" not in parse_batch_method("domino_lookup")
    with pytest.raises(ValueError, match="optionally followed by _lookup, _lookup2 or _copies"):
        parse_batch_method("domino_lookup_k4")


def test_bench_reports_copied_drafts():
    from hf_domino import measure, report

    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    prompts = [torch.tensor([[7, 7, 8, 9, 10, 11, 12, 7, 7, 8]])]
    settings = measure.BenchSettings(max_new_tokens=30, warmup_tokens=2)
    methods = ["target", "domino_lookup_k4", "domino_k4"]
    result = measure.run_benchmark(target, drafter, prompts, methods, settings, progress=False)
    summary = report.summarize(result)
    copying = summary["domino_lookup_k4"]
    assert copying["greedy_mismatches"] == summary["domino_k4"]["greedy_mismatches"] == 0
    assert 0 < copying["copied_share"] < 1 and copying["copied_acceptance_length"] >= 1
    assert "copied_share" not in summary["domino_k4"]
    row = f"| domino_lookup_k4 | {copying['mean_drafts']:.2f} | {copying['copied_share']:.0%}, "
    assert row in report.markdown_report(result)


# ------------------------------------------------------------------------------------------------------- batches
def test_batch_rows_copy_or_draft_each_cycle_and_stay_identical(arch, gpu_like_costs, monkeypatch):
    """Each row of a batch copies where its own text repeats; the others draft in the same cycle."""
    target = tiny_target(arch)
    drafter = tiny_drafter(target)
    rows = [[7, 7, 8, 9, 10, 11, 12, 7, 7, 8], [40, 41, 3, 22], [5, 17, 9, 33, 5, 17], [3, 9, 22, 3, 9]]
    cycles = []
    verify = batching_domino.BatchedDecoding.verify

    def recording_verify(self, anchors, cycle):
        cycles.append((cycle.copied(len(self.active)), cycle.lengths.tolist()))
        return verify(self, anchors, cycle)

    monkeypatch.setattr(batching_domino.BatchedDecoding, "verify", recording_verify)
    for policy in ("fixed", "adaptive"):
        cycles.clear()
        expected, output = both(target, drafter, left_padded(rows), max_new_tokens=40, draft_policy=policy)
        assert torch.equal(output, expected), policy
        stats = drafter.last_generation_stats
        copied_lengths = [n for n, copied in zip(stats.acceptance_lengths, stats.copied) if copied]
        assert copied_lengths and max(copied_lengths) > 1, policy
        mixed = [
            (copied, lengths) for copied, lengths in cycles
            if any(copied) and any(n > 0 and not c for n, c in zip(lengths, copied))
        ]  # fmt: skip
        # Cycles where some rows verified copies and others drafted blocks (the adaptive policy, on these costs,
        # soon stops drafting with this random drafter: its cycles copy or take plain steps).
        assert mixed or policy == "adaptive"
    expected, output = both(target, drafter, left_padded(rows), max_new_tokens=40, domino_lookup=False)
    assert torch.equal(output, expected) and not any(drafter.last_generation_stats.copied)


def test_batch_copies_stop_at_stop_strings_and_padding_is_never_copied():
    tokenizer = letter_tokenizer()
    target = successor_target("llama", VOCAB)  # emits consecutive letters
    drafter = forcing_drafter(target, successor(2))  # always wrong: every accepted draft is a copied one
    # Row 0 copies "defgh" after "abc"; row 1 ends in "a", then "b": padded with "a", its "a b" would occur where the
    # padding meets the text, so a row that copied from its padding would copy "fab...".
    batch = left_padded([[4, 5, 6, 7, 8, 9, 10, 11, 4, 5], [5, 9, 4]], pad=4)
    kwargs = dict(max_new_tokens=20, stop_strings=["ef"], tokenizer=tokenizer, pad_token_id=4, draft_policy="fixed")
    expected, output = both(target, drafter, batch, **kwargs)
    assert torch.equal(output, expected)
    stats = drafter.last_generation_stats
    # "def" copied and accepted ("f" completes the stop: offered, and the block cut after it), the target's own token
    # after it dropped; row 1 drafts.
    assert stats.copied[:2] == [True, False] and stats.acceptance_lengths[0] == 4


def test_batch_declined_copies_are_judged_and_win_back(gpu_like_costs):
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    record = drafter_record(drafter, target, DraftingMode("lookup"), drafter.config.num_drafts)
    record.position_acceptance = [0.0] * drafter.config.num_drafts
    batch = left_padded([[7, 7, 8, 9, 10, 11, 12, 7, 7, 8], [5, 17, 9, 33, 5, 17]])
    expected, output = both(target, drafter, batch, max_new_tokens=60)
    assert torch.equal(output, expected)
    copied = drafter.last_generation_stats.copied
    assert not any(copied[:2]) and any(copied)
    assert record.position_acceptance[0] > 0.4  # learned from 0


def test_batch_sampling_with_copied_drafts_keeps_each_rows_law():
    """Copied rows (as drafts certain of their token) and drafted rows are verified by speculative sampling in the
    same cycles."""
    vocab, num_new, per_prompt = 4, 4, 2000
    # Two layers: with one, the first row's law is too near the wrong one below (a prompt differing in one token).
    target = law_target(vocab, seed=5, peak=20, num_layers=2)
    drafter = law_drafter(target)
    prompts = [[3, 0, 3, 1, 3, 2, 3, 3], [1, 2]]  # the first row copies every cycle; the second starts drafting
    batch = left_padded(prompts)
    torch.manual_seed(11)
    counts, stats = sampled_continuations(
        target, batch, num_new, per_prompt, assistant_model=drafter, draft_policy="fixed", top_k=0
    )
    copied_cycles = sum(sum(s.copied) for s in stats)
    drafted_cycles = sum(n > 0 and not c for s in stats for n, c in zip(s.drafted, s.copied))
    assert copied_cycles > per_prompt and drafted_cycles > per_prompt // 10
    for prompt, observed in zip(prompts, counts):
        probs = exact_sequence_distribution(target, prompt, num_new, LogitsProcessorList())
        assert chi_square_p_value(observed, probs, per_prompt) > 1e-3
    wrong = exact_sequence_distribution(target, [3, 0, 3, 1, 3, 2, 3, 0], num_new, LogitsProcessorList())
    assert chi_square_p_value(counts[0], wrong, per_prompt) < 1e-6

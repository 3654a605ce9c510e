"""Batched speculative decoding: `generate(**batch, assistant_model=drafter)` for B > 1, lossless row by row."""

from __future__ import annotations

import contextlib
import copy
from types import SimpleNamespace

import pytest
import torch
from conftest import forcing_drafter, own_drafts, successor_target, tiny_drafter, tiny_target
from test_generation import (
    VOCAB,
    CollectingStreamer,
    batch_loop_draws_sharper,
    chi_square_p_value,
    drafts_and_accepted,
    exact_sequence_distribution,
    law_drafter,
    law_target,
    letter_tokenizer,
    sample_with_drafter,
    sampled_continuations,
    successor,
)
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation import stopping_criteria as criteria_module
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from hf_domino import (
    batching_domino,
    policy_domino,
    ragged_batch_domino,
)
from hf_domino.cache_domino import cache_argument
from hf_domino.options_domino import DominoOptions
from hf_domino.ragged_cache_domino import RaggedCache

# Draft the successor except after multiples of 5: rows accept different numbers of drafts in the same cycle.
PARTIAL = [(t + 1) % VOCAB if t % 5 else 0 for t in range(VOCAB)]


def left_padded(rows: list[list[int]], pad: int = 0) -> dict[str, torch.Tensor]:
    width = max(map(len, rows))
    input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    attention_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def both(target, drafter, batch, **kwargs):
    """(the target alone, with the drafter) on the same padded batch, greedy; Domino options go to the second only."""
    options = {name: kwargs.pop(name) for name in DominoOptions.names() if name in kwargs}
    expected = target.generate(**batch, do_sample=False, **kwargs)
    return expected, target.generate(**batch, do_sample=False, assistant_model=drafter, **kwargs, **options)


# ------------------------------------------------------------------------------------------ greedy: token-identical
@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
@pytest.mark.parametrize("next_token", [successor(1), PARTIAL, successor(2)], ids=["full", "ragged", "none"])
def test_greedy_batch_identical_rows_stop_at_different_times(arch, next_token, policy):
    # The successor target counts up to EOS (token 1, after 31 and 0): each row stops when its count gets there.
    target = successor_target(arch, VOCAB)
    drafter = forcing_drafter(target, next_token, block_size=6)
    batch = left_padded([[4, 9, 11], [20], [7, 25, 26, 27, 28], [12, 13]])
    expected, output = both(target, drafter, batch, max_new_tokens=24, draft_policy=policy)
    assert torch.equal(output, expected)
    assert (expected[:, -1] == 0).any() and (expected[:, -1] != 0).any()  # some rows finished early, padded
    lengths = drafter.last_generation_stats.acceptance_lengths
    if next_token == PARTIAL and policy == "fixed":
        assert len(set(lengths)) > 2  # ragged acceptance really happened


@pytest.mark.parametrize("pricing", ["makespan", "makespan_pooled", "mean"])
@pytest.mark.parametrize("next_token", [successor(1), PARTIAL], ids=["full", "ragged"])
def test_greedy_batch_identical_priced_by_its_last_row(arch, next_token, pricing, monkeypatch, gpu_like_costs):
    # PRICE_BY_MAKESPAN: the policy sees the tokens each row may still generate and (ROW_PACES) how well each row's
    # drafts have held; however priced, the output is the target's.
    monkeypatch.setattr(batching_domino, "PRICE_BY_MAKESPAN", pricing != "mean")
    monkeypatch.setattr(batching_domino, "ROW_PACES", pricing == "makespan")
    seen = []
    choose = policy_domino.AdaptivePolicy.choose
    monkeypatch.setattr(
        policy_domino.AdaptivePolicy,
        "choose",
        lambda self, *args, **kwargs: seen.append((self.rooms, self.paces)) or choose(self, *args, **kwargs),
    )
    target = successor_target(arch, VOCAB)
    drafter = forcing_drafter(target, next_token, block_size=6)
    batch = left_padded([[4, 9, 11], [20], [7, 25, 26, 27, 28], [12, 13]])
    expected, output = both(target, drafter, batch, max_new_tokens=24)
    assert torch.equal(output, expected)
    assert seen
    if pricing == "mean":
        assert all(rooms is None and paces is None for rooms, paces in seen)
        return
    assert seen[0][0] == [24 - 1] * 4  # the prefill's token is generated: 23 left in every row
    if pricing == "makespan_pooled":
        assert all(paces is None for _, paces in seen)
    else:
        assert seen[0][1] == [1.0] * 4  # nothing verified yet: every row at the pooled pace
        assert all(len(paces) == len(rooms) for rooms, paces in seen)
    if next_token == PARTIAL:
        assert any(len(set(rooms)) > 1 for rooms, _ in seen)  # rows accepted differently and drew apart
        if pricing == "makespan":
            assert any(max(paces) - min(paces) > 0.05 for _, paces in seen)


@pytest.mark.parametrize("head", [True, False])
def test_greedy_batch_identical_random_models(arch, head):
    target = tiny_target(arch)
    drafter = tiny_drafter(target, head=head)
    drafter.set_draft_vocab(list(range(0, 64, 2)) if head else None)
    torch.manual_seed(0)
    rows = [torch.randint(4, 64, (n,)).tolist() for n in (9, 3, 6, 1, 12)]
    for policy in ("fixed", "adaptive"):
        expected, output = both(target, drafter, left_padded(rows), max_new_tokens=19, draft_policy=policy)
        assert torch.equal(output, expected), policy


@pytest.mark.parametrize("vocab", [None, torch.tensor([1, 4, 7, 20, 33])], ids=["full-vocab", "draft-vocab"])
def test_greedy_rollout_without_the_head_is_one_argmax_per_position(vocab):
    # DFlash drafting (no head), greedy with no processors: nothing is sequential, so the batch's rollout is one
    # argmax over every row and position, the same drafts and confidence as picking position by position.
    drafter = tiny_drafter(tiny_target(), head=False)
    torch.manual_seed(0)
    columns = VOCAB if vocab is None else len(vocab)
    base = torch.randn(3, 5, columns)
    base[1, 2] = 0.0  # a tie: both take the lowest column
    anchors, hidden = torch.tensor([[3], [8], [11]]), torch.zeros(3, 5, drafter.config.hidden_size)
    rollout = dict(head=False, do_sample=False)
    at_once = ragged_batch_domino.batched_rollout(
        drafter, None, hidden, base, vocab, anchors, pick_logits=None, **rollout
    )
    one_by_one = ragged_batch_domino.batched_rollout(
        drafter, None, hidden, base, vocab, anchors, pick_logits=lambda logits, drafted: logits, **rollout
    )
    assert torch.equal(at_once.ids, one_by_one.ids) and at_once.logits is None
    torch.testing.assert_close(at_once.confidence, one_by_one.confidence)
    assert vocab is None or torch.isin(at_once.ids, vocab).all()


def test_rows_finish_and_leave_the_batch():
    target = successor_target("qwen3", VOCAB)
    drafter = forcing_drafter(target, successor(1), block_size=6)
    batch = left_padded([[29], [3, 4]])  # row 0 reaches EOS after 4 tokens, row 1 runs to max_new_tokens
    expected, output = both(target, drafter, batch, max_new_tokens=20, draft_policy="fixed")
    assert torch.equal(output, expected)
    assert output[0, -1] == 0 and output[1, -1] != 0


def test_max_new_tokens_and_eos_cut_inside_blocks():
    target = successor_target("llama", VOCAB)
    drafter = forcing_drafter(target, successor(1), block_size=8)
    batch = left_padded([[26], [3, 4, 5], [30, 31]])
    for max_new_tokens in (1, 2, 5, 9):
        expected, output = both(target, drafter, batch, max_new_tokens=max_new_tokens, draft_policy="fixed")
        assert torch.equal(output, expected), max_new_tokens


@pytest.mark.parametrize("rows", [[[4, 5]], [[4, 5], [10], [30, 31]]], ids=["one-sequence", "batch"])
@pytest.mark.parametrize(
    "criterion",
    [EosTokenCriteria([1, 9]), EosTokenCriteria([9]), MaxLengthCriteria(6), MaxLengthCriteria(14)],
    ids=["eos-added", "eos-replaced", "max-length-shorter", "max-length-longer"],
)
def test_a_users_eos_and_max_length_criteria_stand_for_generates_own(rows, criterion):
    """generate() lets a user's `EosTokenCriteria` or `MaxLengthCriteria` take the place of the one it builds from the
    config, and the target alone stops where the user's says: blocks are cut there too, by transformers' loop for one
    sequence and by ours for a batch. Row [30, 31] passes the config's EOS (1) on its way to 9. A max length past the
    config's once left transformers' loop appending nothing, forever: `max_time` makes that a failure, not a hang."""
    target = successor_target("qwen3", VOCAB)
    drafter = forcing_drafter(target, successor(1), block_size=6)
    batch = left_padded(rows)
    criteria = dict(stopping_criteria=StoppingCriteriaList([criterion]), max_time=120)
    expected, output = both(target, drafter, batch, max_new_tokens=8, draft_policy="fixed", **criteria)
    assert torch.equal(output, expected)
    config_alone = target.generate(**batch, do_sample=False, max_new_tokens=8)
    assert expected.shape != config_alone.shape or not torch.equal(expected, config_alone)  # the criterion bites


def test_stop_strings_per_row():
    tokenizer = letter_tokenizer()
    target = successor_target("llama", VOCAB)  # emits consecutive letters
    drafter = forcing_drafter(target, successor(1), block_size=10)
    batch = left_padded([[4, 5], [10], [6, 7, 8]])  # "ab", "g", "cde": "hi" comes at different steps
    kwargs = dict(max_new_tokens=20, stop_strings=["hi"], tokenizer=tokenizer, draft_policy="fixed")
    expected, output = both(target, drafter, batch, **kwargs)
    assert torch.equal(output, expected)
    assert all("hi" in tokenizer.decode(row) for row in expected)


def test_without_an_eos_token_rows_run_on_until_the_last_one_stops(arch):
    """With no EOS token, transformers' loop pads no finished row: a row past its stop string goes on writing the
    target's tokens until the last row stops, and the call ends there (the batch loop padded it). Row [10] drafts
    right, stops after 2 tokens and reaches max_length while row [22], drafting wrong, stops after 5: the fast row is
    cut back to 5 tokens, and the cache it left (copied out at max_length) to 4 columns."""
    tokenizer = letter_tokenizer()
    target = successor_target(arch, VOCAB)
    drafter = forcing_drafter(target, [(t + 1) % VOCAB if 10 <= t < 20 else 0 for t in range(VOCAB)])
    batch = left_padded([[10], [22]])  # "g" then "hi"; "s" then "tuvwx"
    options = dict(max_new_tokens=9, stop_strings=["hi", "wx"], tokenizer=tokenizer, eos_token_id=None,
                   pad_token_id=0, return_dict_in_generate=True, output_scores=True)  # fmt: skip
    alone_cache, cache = DynamicCache(config=target.config), DynamicCache(config=target.config)
    expected = target.generate(**batch, do_sample=False, **options, **cache_argument(alone_cache))
    assert expected.sequences[:, 1:].tolist() == [[11, 12, 13, 14, 15], [23, 24, 25, 26, 27]]  # no padding
    output = target.generate(**batch, do_sample=False, **options, **cache_argument(cache), assistant_model=drafter,
                             draft_policy="fixed")  # fmt: skip
    assert torch.equal(output.sequences, expected.sequences)
    for ours, theirs in zip(output.scores, expected.scores, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    assert_same_columns(cache, alone_cache, attended_columns(batch, expected.sequences))
    plain = {key: value for key, value in options.items() if key not in ("return_dict_in_generate", "output_scores")}
    alone, drafted = both(target, drafter, batch, **plain)  # and where the call returns no cache
    assert torch.equal(drafted, alone) and torch.equal(alone, expected.sequences)


def test_max_time_ends_every_row_of_a_batch_at_one_column(arch, monkeypatch):
    """transformers' time limit (`max_time`) ends the target alone's batch at one column for every row. A drafted
    batch's rows stand at columns of their own when it passes: the call ends at the column of the row furthest behind
    and the rows ahead are cut back to it, so the output is the target alone's at that length, its scores and cache
    too. Time here is the target's forwards (a clock reading their count), so the limit passes after the 5th forward
    for both: row [10] drafts right and reached its EOS (17) at its 7th token while the others, drafting wrong, have
    5; it is cut to 5, its EOS gone, as the target alone's row is (the batch loop ended each row where it stood: row
    [10] kept its EOS, and the others were padded after 5 tokens the target alone goes on from)."""
    target = successor_target(arch, VOCAB)
    forwards = [0]  # the clock
    monkeypatch.setattr(criteria_module, "time", SimpleNamespace(time=lambda: float(forwards[0])))
    hook = target.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    drafter = forcing_drafter(target, [(t + 1) % VOCAB if 10 <= t < 20 else 0 for t in range(VOCAB)])
    batch = left_padded([[10], [22], [3, 4]])
    options = dict(max_new_tokens=20, eos_token_id=17, pad_token_id=0, return_dict_in_generate=True,
                   output_scores=True)  # fmt: skip
    cache, alone_cache = DynamicCache(config=target.config), DynamicCache(config=target.config)
    try:
        output = target.generate(**batch, do_sample=False, max_time=4.5, assistant_model=drafter,
                                 draft_policy="fixed", **options, **cache_argument(cache))  # fmt: skip
        forwards[0] = 0
        expected = target.generate(**batch, do_sample=False, max_time=4.5, **options, **cache_argument(alone_cache))
    finally:
        hook.remove()
    assert expected.sequences.shape[1] - batch["input_ids"].shape[1] == 5
    assert torch.equal(output.sequences, expected.sequences)
    for ours, theirs in zip(output.scores, expected.scores, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    assert_same_columns(cache, alone_cache, attended_columns(batch, expected.sequences))


def test_streamer_receives_what_the_target_alone_streams():
    target = successor_target("qwen3", VOCAB)
    drafter = forcing_drafter(target, PARTIAL, block_size=6)
    batch = left_padded([[27], [3, 4, 5]])
    streamed, alone = CollectingStreamer(), CollectingStreamer()
    target.generate(**batch, do_sample=False, max_new_tokens=12, streamer=alone)
    target.generate(**batch, do_sample=False, max_new_tokens=12, streamer=streamed, assistant_model=drafter)
    assert streamed.chunks == alone.chunks and len(alone.chunks) == 14  # prompt, 12 columns, end


# Generation options that change the target's pick in the middle of a block (or forbid its stop), each with accepted
# drafts around it: one sequence (transformers' loop with our candidate generator) and a batch (our loop).
OPTIONS_THAT_BITE = {
    "sequence_bias": dict(sequence_bias={(8, 10): 10.0, (26,): -10.0}),
    "bad_words_ids": dict(bad_words_ids=[[10, 12], [28]]),
    "suppress_tokens": dict(suppress_tokens=[12, 30]),
    "begin_suppress_tokens": dict(begin_suppress_tokens=[6, 10, 24]),
    "min_new_tokens": dict(min_new_tokens=12, eos_token_id=[1, 16]),
    "forced_eos_token_id": dict(forced_eos_token_id=1),
    "eos_token_id": dict(eos_token_id=[1, 26, 30]),
    "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
}


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("option", list(OPTIONS_THAT_BITE))
def test_generation_options_act_inside_blocks_as_without_a_drafter(option, rows):
    target = successor_target("qwen3", VOCAB, step=2)  # even tokens never reach EOS (1) unless an option says so
    drafter = forcing_drafter(target, successor(2), block_size=8)
    batch = left_padded([[5, 6, 7, 8], [3, 4], [19, 20, 22]][:rows])
    plain = target.generate(**batch, do_sample=False, max_new_tokens=40)
    expected, output = both(
        target, drafter, batch, max_new_tokens=40, draft_policy="fixed", **OPTIONS_THAT_BITE[option]
    )
    assert torch.equal(output, expected)
    assert not torch.equal(expected, plain)  # the option changed the output
    assert max(drafter.last_generation_stats.acceptance_lengths) >= 8  # (nearly) whole blocks accepted around it


def test_repetition_penalty_acts_per_row():
    # Each drafted column's penalty reads the row's drafts before it, as the target alone's reads its tokens. The
    # target's choice after t is t + 16 (a, b, a, b, ...), its runner-up t + 3 comes close: the penalty switches to it
    # where t + 16 was seen, also where only a draft before it in the block holds t + 16.
    target = successor_target("qwen3", VOCAB, step=16, runner_up=3)
    drafter = forcing_drafter(target, successor(16), block_size=8)
    batch = left_padded([[5, 6, 7, 8], [3, 4], [19, 20, 22]])
    plain = target.generate(**batch, do_sample=False, max_new_tokens=40)
    expected, output = both(target, drafter, batch, max_new_tokens=40, repetition_penalty=1.5, draft_policy="fixed")
    assert torch.equal(output, expected)
    assert not torch.equal(expected, plain)  # the penalty changed the output
    assert max(drafter.last_generation_stats.acceptance_lengths) > 1


@pytest.mark.parametrize(
    "penalty",
    [dict(encoder_repetition_penalty=2.0), dict(encoder_no_repeat_ngram_size=1)],
    ids=["repetition", "ngram"],
)
@pytest.mark.parametrize("sequences", [1, 2])
def test_prompt_penalties_read_each_rows_own_prompt(penalty, sequences):
    # Their processors hold the whole batch's prompts; a row processed alone must see its own, and with
    # num_return_sequences each copy of a row its prompt's. top-k 1 makes sampling as deterministic as greedy.
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    torch.manual_seed(5)
    batch = left_padded([torch.randint(4, 64, (n,)).tolist() for n in (7, 2, 4)])
    decoding = dict(do_sample=True, top_k=1, num_return_sequences=sequences, max_new_tokens=15)
    plain = target.generate(**batch, **decoding)
    expected = target.generate(**batch, **decoding, **penalty)
    output = target.generate(**batch, **decoding, **penalty, assistant_model=drafter, draft_policy="fixed")
    assert torch.equal(output, expected)
    assert not torch.equal(expected, plain)  # the penalty bites


@contextlib.contextmanager
def prefill_rows(target, dim: int = 0):
    """Within it, the rows (`dim=1`: the columns) of each forward of `target` that keeps only the last position's
    logits (a prefill's, or one of its chunks)."""
    sizes = []

    def record(module, args, kwargs):
        if kwargs.get("logits_to_keep") == 1:
            sizes.append(kwargs["input_ids"].shape[dim])

    hook = target.register_forward_pre_hook(record, with_kwargs=True)
    try:
        yield sizes
    finally:
        hook.remove()


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_a_prompts_copies_are_read_once_and_each_generates_what_it_generates_alone(arch):
    # num_return_sequences repeats each row (and a batch may hold one prompt twice): the prefill reads each distinct
    # prompt once and its copies share its cache columns. top-k 1 makes sampling as deterministic as greedy.
    target = tiny_target(arch)
    drafter = tiny_drafter(target)
    torch.manual_seed(6)
    first, second = (torch.randint(4, 64, (n,)).tolist() for n in (7, 3))
    batch = left_padded([first, second, first])
    decoding = dict(do_sample=True, top_k=1, num_return_sequences=2, max_new_tokens=12)
    expected = target.generate(**batch, **decoding)
    with prefill_rows(target) as rows:
        output = target.generate(**batch, **decoding, assistant_model=drafter, draft_policy="fixed")
    assert torch.equal(output, expected)
    assert rows == [2]  # 6 rows, 2 distinct prompts
    assert drafts_and_accepted([drafter.last_generation_stats])[0] > 0  # the copies drafted after it


def test_repeated_rows_tell_prompts_apart_by_their_real_tokens():
    ids = torch.tensor([[0, 5, 6], [5, 5, 6], [0, 5, 6], [1, 2, 3], [9, 5, 6]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1], [0, 1, 1]], dtype=torch.bool)
    distinct, copies = ragged_batch_domino.repeated_rows(ids, mask)
    assert distinct.tolist() == [0, 1, 3]  # row 4 is row 0 (its padding differs), row 2 too; row 1 is longer
    assert copies.tolist() == [0, 1, 0, 2, 0]
    assert ragged_batch_domino.repeated_rows(ids[:2], mask[:2]) == (None, None)


# ------------------------------------------------------------------------------------------------------- sampling
ROW_LAW_CASES = pytest.mark.parametrize(
    "draft_vocab, branches, policy",
    [(None, 1, "fixed"), ([0, 2, 3], 1, "fixed"), (None, 2, "fixed"), ([0, 2, 3], 3, "fixed"), (None, 2, "adaptive")],
    ids=["full-vocab", "draft-vocab", "tree", "tree-draft-vocab", "tree-adaptive"],
)


@ROW_LAW_CASES
def test_sampling_keeps_each_rows_law_with_num_return_sequences(draft_vocab, branches, policy, gpu_like_costs):
    from transformers.generation.logits_process import TemperatureLogitsWarper

    vocab, num_new, per_prompt = 5, 3, 2000
    target = law_target(vocab, seed=3, peak=4)  # peaked laws, so that a wrong one is told apart (below)
    drafter = law_drafter(target)
    drafter.set_draft_vocab(draft_vocab)  # drafts only from these tokens: zero draft probability elsewhere
    prompts = [[2, 4, 1], [3]]
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.5)])
    batch = left_padded(prompts)
    torch.manual_seed(7)
    counts, stats = sampled_continuations(target, batch, num_new, per_prompt, temperature=0.5,
                                          assistant_model=drafter, draft_policy=policy, domino_branches=branches)  # fmt: skip
    drafted, accepted = drafts_and_accepted(stats)
    assert 0 < accepted < drafted  # rejection sampling really ran, with both outcomes
    if branches > 1:  # the target's draws went on along later branches too
        assert any(branch > 0 for call in stats for branch in call.branches)
    for prompt, observed in zip(prompts, counts):
        probs = exact_sequence_distribution(target, prompt, num_new, processors)
        assert chi_square_p_value(observed, probs, per_prompt) > 1e-3
    # The test can fail: the same draws are far from a wrong law (the untempered target).
    wrong = exact_sequence_distribution(target, prompts[0], num_new, LogitsProcessorList())
    assert chi_square_p_value(counts[0], wrong, per_prompt) < 1e-6


@pytest.mark.slow  # the draws again, to show the test above has the power it needs
@ROW_LAW_CASES
def test_the_row_law_test_fails_drafts_drawn_from_another_law(
    draft_vocab, branches, policy, gpu_like_costs, monkeypatch
):
    # A batch's drafts drawn from a law 1.5 times sharper than the logits they return for the verification.
    batch_loop_draws_sharper(monkeypatch)
    with pytest.raises(AssertionError, match=r"> 0\.001"):
        test_sampling_keeps_each_rows_law_with_num_return_sequences(draft_vocab, branches, policy, gpu_like_costs)


@pytest.mark.parametrize(
    "truncation, draft_vocab",
    [
        (dict(min_p=0.5), None),
        (dict(typical_p=0.6), [0, 2, 3]),
        (dict(epsilon_cutoff=0.15), None),
        (dict(eta_cutoff=0.2), [0, 2, 3]),
    ],
    ids=["min-p", "typical-draft-vocab", "epsilon", "eta-draft-vocab"],
)
def test_truncation_samplers_keep_the_target_law_alone_and_in_batches(truncation, draft_vocab):
    # Processors that zero tokens by a threshold on the step's own law: the drafts' law and the verification's must
    # use the same one, one sequence (transformers' loop) and in batches (ours).
    from transformers import GenerationConfig
    from transformers.generation.logits_process import TemperatureLogitsWarper

    vocab, num_new, draws = 5, 3, 1500
    target = law_target(vocab, seed=3, peak=4)  # peaked laws, so that every threshold cuts tokens
    drafter = law_drafter(target)
    drafter.set_draft_vocab(draft_vocab)
    sampling = dict(temperature=0.8, top_k=0, **truncation)
    law = target._get_logits_processor(GenerationConfig(do_sample=True, **sampling), device="cpu")
    untruncated = LogitsProcessorList([TemperatureLogitsWarper(sampling["temperature"])])
    prompts = [[2, 4, 1], [3]]

    torch.manual_seed(7)
    in_batch, stats = sampled_continuations(target, left_padded(prompts), num_new, draws, assistant_model=drafter,
                                            draft_policy="fixed", **sampling)  # fmt: skip
    drafted, accepted = drafts_and_accepted(stats)
    assert 0 < accepted < drafted  # both outcomes of rejection sampling
    checked = list(zip(in_batch, prompts))
    # One sequence too (transformers' loop; a generate() call per draw, most of the test's time) for the two with a
    # draft vocabulary: there, as over the whole vocabulary, processed_pick applies these processors in the same
    # line as any other (spread before them), and transformers' verification applies any processor the same way
    # (test_generation.py's laws). The batch loop draws its own way (pick_logits), for all four.
    if draft_vocab is not None:
        alone, drafted, accepted = sample_with_drafter(
            target, drafter, prompts[0], num_new, draws, seed=11, draft_policy="fixed", **sampling
        )
        assert 0 < accepted < drafted
        checked.append((alone, prompts[0]))
    for observed, prompt in checked:
        assert chi_square_p_value(observed, exact_sequence_distribution(target, prompt, num_new, law), draws) > 1e-3
    # The test can fail: the first prompt's draws are far from the law without the threshold.
    wrong = exact_sequence_distribution(target, prompts[0], num_new, untruncated)
    assert all(
        chi_square_p_value(observed, wrong, draws) < 1e-6 for observed, prompt in checked if prompt == prompts[0]
    )


# ------------------------------------------------------------------------------------------------------ bad input
def test_bad_batches_fail_with_the_fix_named():
    target = successor_target("qwen3", VOCAB)
    drafter = forcing_drafter(target, successor(1))
    batch = left_padded([[4, 9, 11], [20]])
    right = {
        "input_ids": torch.tensor([[4, 9, 11], [20, 0, 0]]),
        "attention_mask": torch.tensor([[1, 1, 1], [1, 0, 0]]),
    }
    with pytest.raises(ValueError, match="padding_side = 'left'"):
        target.generate(**right, max_new_tokens=4, assistant_model=drafter)
    with pytest.raises(ValueError, match=r"Row\(s\) \[1\] .*an empty prompt.*Drop the empty prompts"):
        target.generate(**left_padded([[4, 9, 11], []]), max_new_tokens=4, assistant_model=drafter)
    with pytest.raises(ValueError, match="attention_mask"):
        target.generate(batch["input_ids"], max_new_tokens=4, assistant_model=drafter)
    with pytest.raises(ValueError, match="beam search"):
        target.generate(**batch, max_new_tokens=4, num_beams=2, assistant_model=drafter)
    target.set_attn_implementation("eager")  # which returns attention weights
    attentions = dict(max_new_tokens=4, assistant_model=drafter, return_dict_in_generate=True, output_attentions=True)
    with pytest.raises(ValueError, match="several branches.*drop output_attentions.*or generate one prompt at a time"):
        target.generate(**batch, **attentions, domino_branches=2)
    with pytest.raises(ValueError, match="several branches.*drop output_attentions.*or drop domino_branches"):
        target.generate(batch["input_ids"][:1], **attentions, domino_branches=2)  # one prompt, as a tree
    chunked = tiny_target("llama", num_layers=2, layer_types=["chunked_attention", "full_attention"],
                          attention_chunk_size=4, attn_implementation="eager")  # fmt: skip
    with pytest.raises(ValueError, match="chunked_attention layers: drop output_attentions"):
        chunked.generate(**batch, **{**attentions, "assistant_model": tiny_drafter(chunked)})
    # The same calls without a drafter still work (only the drafter's batch path refuses).
    assert target.generate(**batch, max_new_tokens=4).shape == (2, 7)


def test_the_prompts_inputs_embeds_are_what_a_drafted_batch_reads(arch):
    """generate(input_ids=..., inputs_embeds=...) prefills from the embeddings (soft prompts, a multimodal model's
    merged inputs): a drafted batch, and one sequence drafted as a tree, continue what the target read, as the target
    alone does, not what the ids' own embeddings say. Embeddings without ids of the same shape are refused."""
    target = successor_target(arch, VOCAB)
    drafter = forcing_drafter(target, successor(1))
    batch = left_padded([[4, 9, 11], [20]])
    embeds = target.get_input_embeddings()(batch["input_ids"]).detach().clone()
    embeds[0, -1] = target.get_input_embeddings().weight[15].detach()  # row 0 reads 15 where its ids say 11
    for rows, options in ((slice(None), {}), (slice(0, 1), {"domino_branches": 2})):
        inputs = {name: tensor[rows] for name, tensor in batch.items()} | {"inputs_embeds": embeds[rows]}
        expected, output = both(target, drafter, inputs, max_new_tokens=8, **options)
        assert torch.equal(output, expected), options
        assert expected[0, 3:6].tolist() == [16, 17, 18]  # the test can fail: the ids alone would go on with 12
        with pytest.raises(ValueError, match=r"inputs_embeds \(\d, 3\) came without token ids.*Pass input_ids too"):
            target.generate(inputs_embeds=inputs["inputs_embeds"], attention_mask=inputs["attention_mask"],
                            max_new_tokens=4, assistant_model=drafter, **options)  # fmt: skip
    # One sequence without a tree runs transformers' own loop, which takes embeddings alone.
    alone = {"inputs_embeds": embeds[:1], "attention_mask": batch["attention_mask"][:1]}
    expected, output = both(target, drafter, alone, max_new_tokens=6)
    assert torch.equal(output, expected) and expected[0].tolist()[:3] == [16, 17, 18]


def test_position_ids_other_than_the_masks_are_refused_for_a_batch(arch):
    """generate() continues the position_ids it is given (packed or offset prompts); a drafted batch places tokens by
    its mask, so it refuses other positions, naming the fix, rather than answer otherwise than the target alone. The
    positions generate() makes itself pass; one sequence without a tree runs transformers' loop, which honours them."""
    target = tiny_target(arch)
    drafter = tiny_drafter(target)
    batch = left_padded([[5, 9, 11, 40, 41, 42], [20, 21, 22]])
    positions = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    expected, output = both(target, drafter, batch | {"position_ids": positions}, max_new_tokens=6)
    assert torch.equal(output, expected)
    positions[:, -2:] += 50  # a gap before the last two tokens, which the target reads:
    logits = [target(**batch, position_ids=p).logits[:, -1] for p in (positions, positions.clamp(max=5))]
    assert not torch.allclose(*logits)
    # (One sequence reading its prompt in chunks with hidden states goes to the batch loop too: generate_hook_domino.)
    chunks = {"prefill_chunk_size": 2, "output_hidden_states": True, "return_dict_in_generate": True}
    for rows, options, fix in ((slice(None), {}, "generate one prompt at a time"),
                               (slice(0, 1), {"domino_branches": 2}, "drop domino_branches"),
                               (slice(0, 1), chunks, "drop output_hidden_states and output_attentions")):  # fmt: skip
        inputs = {name: tensor[rows] for name, tensor in batch.items()}
        with pytest.raises(ValueError, match=f"these position_ids say otherwise: drop position_ids, or {fix}"):
            target.generate(
                **inputs, position_ids=positions[rows], max_new_tokens=4, assistant_model=drafter, **options
            )
    one = {name: tensor[:1] for name, tensor in batch.items()} | {"position_ids": positions[:1]}
    expected, output = both(target, drafter, one, max_new_tokens=6)
    assert torch.equal(output, expected)


def test_inputs_the_batch_loop_does_not_pass_on_are_refused():
    """A target whose forward names an input of its own (a vision model's pixel_values, here token_type_ids that shift
    its embeddings) reads it at the target alone's first step; a drafted batch, which feeds the target ids,
    embeddings and positions only, refuses the call naming it instead of answering otherwise."""
    from transformers import Qwen3ForCausalLM

    class TypedTarget(Qwen3ForCausalLM):
        def forward(self, input_ids=None, token_type_ids=None, inputs_embeds=None, **kwargs):
            if token_type_ids is not None and input_ids is not None:
                inputs_embeds, input_ids = (
                    self.get_input_embeddings()(input_ids) + 3.0 * token_type_ids[..., None],
                    None,
                )
            return super().forward(input_ids=input_ids, inputs_embeds=inputs_embeds, **kwargs)

    base = tiny_target("qwen3")
    target = TypedTarget(base.config).eval()
    target.load_state_dict(base.state_dict())
    drafter = tiny_drafter(target)
    batch = left_padded([[5, 9, 11], [20, 21]])
    types = torch.ones_like(batch["input_ids"])
    typed = target.generate(**batch, token_type_ids=types, max_new_tokens=4, do_sample=False)
    assert not torch.equal(typed, target.generate(**batch, max_new_tokens=4, do_sample=False))  # the target reads them
    with pytest.raises(ValueError, match="got token_type_ids for the target.*generate one prompt at a time"):
        target.generate(**batch, token_type_ids=types, max_new_tokens=4, assistant_model=drafter)
    expected, output = both(target, drafter, batch, max_new_tokens=4)  # without them, drafted as usual
    assert torch.equal(output, expected)


def test_return_dict_gives_the_sequences():
    target = successor_target("qwen3", VOCAB)
    drafter = forcing_drafter(target, successor(1))
    batch = left_padded([[4, 9, 11], [20]])
    expected = target.generate(**batch, max_new_tokens=6, do_sample=False)
    output = target.generate(
        **batch, max_new_tokens=6, do_sample=False, assistant_model=drafter, return_dict_in_generate=True
    )
    assert torch.equal(output.sequences, expected)


def test_scores_and_logits_are_the_target_alones_for_every_token_of_every_row():
    # Greedy with a processor (so scores differ from logits), rows ending at different columns (EOS 1 after 0, the
    # successor of 31, or token 12), and drafts accepted: each row's scores come from verification forwards, and
    # after its end from one forward over the padding the target alone feeds it.
    target = successor_target("qwen3", VOCAB)
    drafter = forcing_drafter(target, PARTIAL, block_size=8)
    batch = left_padded([[4, 5], [6, 7, 8, 9], [20, 21, 22]])
    kwargs = dict(max_new_tokens=12, do_sample=False, return_dict_in_generate=True, output_scores=True,
                  output_logits=True, sequence_bias={(7,): 0.5}, eos_token_id=[1, 12])  # fmt: skip
    expected = target.generate(**batch, **kwargs)
    output = target.generate(**batch, **kwargs, assistant_model=drafter, draft_policy="fixed")
    assert max(drafter.last_generation_stats.acceptance_lengths) > 2
    assert torch.equal(output.sequences, expected.sequences)
    assert len(output.scores) == len(output.logits) == len(expected.scores) == 11
    generated = expected.sequences[:, batch["input_ids"].shape[1] :]
    ends = [int(torch.isin(row, torch.tensor([1, 12])).nonzero()[0]) + 1 for row in generated]
    assert ends == [7, 3, 11]  # rows finish at different columns
    # After a row's end too: the target alone's scores for the padding it feeds the row (read after the loop).
    for column in range(11):
        torch.testing.assert_close(output.scores[column], expected.scores[column])
        torch.testing.assert_close(output.logits[column], expected.logits[column])
    assert not torch.equal(output.scores[1], output.logits[1])  # the bias acted
    only = target.generate(**batch, **{**kwargs, "output_logits": False}, assistant_model=drafter)
    assert only.logits is None and len(only.scores) == 11


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_hidden_states_are_the_target_alones_for_every_column_of_every_row(arch):
    # Random drafts, mostly rejected (holes), rows ending at EOS at different times: every layer's hidden states per
    # generated column, the prompt's at the first, each row's after its end too (read after the loop); also for a
    # prompt's copies read once (top-k 1 sampling, as deterministic as greedy), a tree of branches, and a next turn
    # continuing the cache the drafted call left.
    target = tiny_target(arch)
    drafter = tiny_drafter(target)
    batch = left_padded([[5, 9, 12, 7], [30, 5], [9, 12, 7, 30, 22, 40]])
    greedy = dict(max_new_tokens=14, do_sample=False, pad_token_id=0, eos_token_id=[17, 33, 41])
    hidden = dict(return_dict_in_generate=True, output_hidden_states=True)
    copies = {**greedy, "do_sample": True, "top_k": 1, "num_return_sequences": 2}
    for options, drafting in ((greedy, {}), (copies, {}), (greedy, {"domino_branches": 2})):
        expected = target.generate(**batch, **options, **hidden)
        output = target.generate(**batch, **options, **hidden, assistant_model=drafter, draft_policy="fixed",
                                 **drafting)  # fmt: skip
        assert torch.equal(output.sequences, expected.sequences)
        assert_same_hidden_states(output.hidden_states, expected.hidden_states)
    assert (expected.sequences[:, -1] == 0).any() and own_drafts(drafter.last_generation_stats) > 0
    expected, output = next_turns(target, drafter, batch, greedy, hidden)
    assert output.hidden_states[0][0].shape[1] == 4  # the new columns only, as the target alone reads them
    assert_same_hidden_states(output.hidden_states, expected.hidden_states)


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3-sliding", "mistral-sliding"])
def test_attentions_are_the_target_alones_for_every_column_of_every_row(arch):
    # output_attentions: each generated column's weights over the target alone's keys (the padded prompt and every
    # generated column, padding weighing 0), from verifications whose caches hold holes where the target alone holds
    # none; rows ending at different times (their columns after the end read after the loop), a prompt's copies read
    # once (top-k 1 sampling, as deterministic as greedy), a prefill in chunks (the first step's weights: the last
    # chunk's), and a next turn continuing the cache the drafted call left.
    # (Sliding: a window of 4 beside full attention, or in every layer, Mistral's: the target alone's sliding layers
    # hand a forward their last 3 columns and its own.)
    windows = {
        "qwen3-sliding": dict(layer_types=["sliding_attention", "full_attention"] * 2, use_sliding_window=True),
        "mistral-sliding": {},
    }
    sliding = {"sliding_window": 4, **windows[arch]} if arch in windows else {}
    target = tiny_target(arch.split("-")[0], vocab_size=32, attn_implementation="eager", **sliding)  # (vocab: forcing)
    batch = left_padded([[5, 9, 12, 7], [30, 5], [9, 12, 7, 30, 22, 10]])
    greedy = dict(max_new_tokens=14, do_sample=False, pad_token_id=0, eos_token_id=[17, 23, 29])
    table = list(range(32))  # each token's successor in the target alone's answers: drafts that hold, then miss
    for row in target.generate(**batch, **greedy).tolist():
        for token, following in zip(row, row[1:]):
            table[token] = following
    drafter = forcing_drafter(target, table, block_size=5)
    weights = dict(return_dict_in_generate=True, output_attentions=True)
    copies = {**greedy, "do_sample": True, "top_k": 1, "num_return_sequences": 2}
    one = {name: tensor[2:] for name, tensor in batch.items()}  # (a sliding target's goes to the batch loop too)
    for inputs, options in (
        (one, greedy),
        (batch, copies),
        (batch, {**greedy, "prefill_chunk_size": 4}),
        (batch, greedy),
    ):
        expected = target.generate(**inputs, **options, **weights)
        output = target.generate(**inputs, **options, **weights, assistant_model=drafter, draft_policy="fixed")
        assert torch.equal(output.sequences, expected.sequences)
        assert_same_hidden_states(output.attentions, expected.attentions)
    stats = drafter.last_generation_stats
    assert max(stats.acceptance_lengths) > 1 and min(stats.acceptance_lengths) == 1  # drafts held, and were cut
    assert (expected.sequences[:, -1] == 0).any()  # a row ended early
    expected, output = next_turns(target, drafter, batch, greedy, weights)
    assert output.attentions[0][0].shape[2] == 4  # the new columns' queries only, as the target alone reads them
    assert_same_hidden_states(output.attentions, expected.attentions)


def next_turns(target, drafter, batch: dict, greedy: dict, returned: dict) -> tuple:
    """A first turn with and without the drafter, each on a cache of its own, then a next turn of 3 tokens per row
    continuing each cache, returning `returned` (what the output dict holds): (the target alone's, the drafted)."""
    cache, alone_cache = DynamicCache(config=target.config), DynamicCache(config=target.config)
    first = target.generate(**batch, **greedy, **cache_argument(cache), assistant_model=drafter)
    assert torch.equal(first, target.generate(**batch, **greedy, **cache_argument(alone_cache)))
    rows = first.shape[0]
    answers = torch.ones(rows, first.shape[1] - batch["input_ids"].shape[1], dtype=torch.long)
    turn = {
        "input_ids": torch.cat([first, torch.tensor([[7, 8, 9]] * rows)], dim=-1),
        "attention_mask": torch.cat([batch["attention_mask"], answers, torch.ones(rows, 3, dtype=torch.long)], -1),
    }
    expected = target.generate(**turn, **greedy, **returned, **cache_argument(alone_cache))
    output = target.generate(**turn, **greedy, **returned, **cache_argument(cache), assistant_model=drafter)
    assert torch.equal(output.sequences, expected.sequences)
    return expected, output


def assert_same_hidden_states(hidden_states: tuple, expected: tuple, tolerance: float = 1e-4) -> None:
    assert len(hidden_states) == len(expected)
    for column, (ours, theirs) in enumerate(zip(hidden_states, expected)):
        assert len(ours) == len(theirs)
        for layer, (mine, alone) in enumerate(zip(ours, theirs)):
            assert mine.shape == alone.shape, (column, layer)
            torch.testing.assert_close(mine, alone, atol=tolerance, rtol=tolerance)


def test_sampled_scores_are_what_each_token_was_drawn_from():
    # Sampled rows differ from the target alone's, so check each token's raw logits against one forward over the
    # row's own output, and its scores against them through the call's warper (temperature); after a row's end, what
    # the target alone computes from the padding it feeds the row.
    # The first seed from 3 whose draws end a row early but not the batch (torch releases draw differently).
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    for seed in range(3, 40):
        torch.manual_seed(seed)
        batch = left_padded([torch.randint(13, 64, (n,)).tolist() for n in (5, 2)])
        output = target.generate(**batch, max_new_tokens=10, do_sample=True, temperature=0.7, top_k=0,
                                 num_return_sequences=2, return_dict_in_generate=True, output_scores=True,
                                 output_logits=True, assistant_model=drafter, draft_policy="fixed", pad_token_id=0,
                                 eos_token_id=list(range(4, 13)))  # fmt: skip
        sequences, width = output.sequences, batch["input_ids"].shape[1]
        if sequences.shape[1] == width + 10 and (sequences[:, -1] == 0).any():  # a row ended before the last
            break
    else:
        pytest.fail("no seed in 3..39 ends a row before the batch's last column")
    mask = torch.cat([batch["attention_mask"].repeat_interleave(2, dim=0), torch.ones(4, 10, dtype=torch.long)], -1)
    logits = target(sequences, attention_mask=mask).logits.float()
    for column in range(10):
        torch.testing.assert_close(output.logits[column], logits[:, width + column - 1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(output.scores[column], output.logits[column] / 0.7)


def test_prefix_allowed_tokens_fn_answers_for_each_row():
    # generate() calls it with the row's index in the batch (num_return_sequences included): batches with a drafter
    # must too, also after rows have left the batch.
    target = successor_target("qwen3", VOCAB)
    drafter = forcing_drafter(target, PARTIAL, block_size=6)
    batch = left_padded([[4, 5], [6, 7, 8, 9], [20, 21, 22]])
    allowed = {0: [5, 9, 13], 1: [10, 11, 12, 13, 14], 2: list(range(4, VOCAB))}
    kwargs = dict(max_new_tokens=12, do_sample=False, prefix_allowed_tokens_fn=lambda row, ids: allowed[row])
    expected = target.generate(**batch, **kwargs)
    output = target.generate(**batch, **kwargs, assistant_model=drafter, draft_policy="fixed")
    assert torch.equal(output, expected)
    assert max(drafter.last_generation_stats.acceptance_lengths) > 2
    allowed = {row: [10 + row, 20 + row] for row in range(6)}
    torch.manual_seed(0)
    sampled = target.generate(
        **batch, **{**kwargs, "do_sample": True}, num_return_sequences=2, assistant_model=drafter
    )
    for row, tokens in enumerate(sampled[:, 4:]):
        assert set(tokens.tolist()) == set(allowed[row])


class AllowedPerRow(LogitsProcessor):
    """A user's processor that keeps a constraint per place in the batch, as constrained-decoding libraries do."""

    def __init__(self, allowed: dict[int, list[int]]):
        self.allowed = allowed

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        banned = torch.full_like(scores, -float("inf"))
        for row in range(input_ids.shape[0]):
            banned[row, self.allowed[row]] = 0.0
        return scores + banned


class StopPerRow(StoppingCriteria):
    """A user's criterion that stops each place in the batch at a token of its own."""

    def __init__(self, stops: dict[int, int]):
        self.stops = stops

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        return torch.tensor([bool(ids[-1] == self.stops[row]) for row, ids in enumerate(input_ids)])


def test_a_users_processor_and_criterion_answer_for_each_row():
    # The target alone hands them the whole batch, each row at its place; the batch loop hands each row its own
    # tokens, so it must set the row at its place too (a row handed alone would read place 0's constraint).
    target = successor_target("qwen3", VOCAB)
    drafter = forcing_drafter(target, PARTIAL, block_size=6)
    batch = left_padded([[4, 5], [6, 7, 8, 9], [20, 21, 22]])
    greedy = dict(max_new_tokens=12, draft_policy="fixed")
    allowed = {0: [5, 9, 13], 1: [10, 11, 12, 13, 14], 2: list(range(4, VOCAB))}
    stops = {0: 99, 1: 14, 2: 27}  # row 0 runs on; rows 1 and 2 stop inside a block, at different tokens
    for hooks in (dict(logits_processor=LogitsProcessorList([AllowedPerRow(allowed)])),
                  dict(stopping_criteria=StoppingCriteriaList([StopPerRow(stops)]))):  # fmt: skip
        expected, output = both(target, drafter, batch, **greedy, **hooks)
        assert torch.equal(output, expected)
        assert max(drafter.last_generation_stats.acceptance_lengths) > 2
    assert expected[1, -1] == expected[2, -1] == 0 and expected[0, -1] != 0  # rows 1 and 2 stopped, row 0 did not
    allowed = {row: [10 + row, 20 + row] for row in range(6)}
    torch.manual_seed(0)
    sampled = target.generate(
        **batch, max_new_tokens=12, do_sample=True, num_return_sequences=2, assistant_model=drafter,
        logits_processor=LogitsProcessorList([AllowedPerRow(allowed)]),
    )  # fmt: skip
    for row, tokens in enumerate(sampled[:, 4:]):
        assert set(tokens.tolist()) == set(allowed[row])


class StopOnTwelve(StoppingCriteria):
    """A criterion written for one sequence, as many are: one bool for the whole batch (StoppingCriteriaList allows
    it; the target alone then stops every row at once)."""

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> bool:
        return bool((input_ids[:, -1] == 12).any())


def test_a_criterion_answering_one_bool_stops_one_sequence_and_is_refused_for_a_batch():
    target = successor_target("qwen3", VOCAB)
    drafter = forcing_drafter(target, PARTIAL, block_size=6)
    batch = left_padded([[4, 5], [6, 7, 8, 9]])
    stop = dict(max_new_tokens=12, draft_policy="fixed", stopping_criteria=StoppingCriteriaList([StopOnTwelve()]))
    one = {name: value[:1] for name, value in batch.items()}
    for branches in (1, 2):  # transformers' loop, and a tree of one in ours
        expected, output = both(target, drafter, one, **stop, domino_branches=branches)
        assert torch.equal(output, expected) and expected[0, -1] == 12  # stopped inside a block
    with pytest.raises(ValueError, match="StopOnTwelve answered False for the whole batch.*one entry per row"):
        target.generate(**batch, **stop, assistant_model=drafter)


def test_timings_and_stats_per_row():
    target = successor_target("qwen3", VOCAB)
    drafter = forcing_drafter(target, PARTIAL, block_size=6)
    batch = left_padded([[4, 9, 11], [20], [12, 13]])
    target.generate(**batch, max_new_tokens=10, assistant_model=drafter, draft_policy="fixed", domino_timings=True)
    stats = drafter.last_generation_stats
    assert set(stats.timings) == {"backbone", "lm_head", "head", "verify"}
    assert len(stats.acceptance_lengths) == len(stats.drafted) >= 3 * 2  # one entry per row per forward
    assert all(seconds > 0 for values in stats.timings.values() for seconds in values)


# -------------------------------------------------------------------------------- continuing a filled cache (chat)
@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_a_batch_continuing_a_filled_cache_is_identical_to_the_target_alone(arch, policy, gpu_like_costs):
    # Each row's second turn: the whole padded sequences with their mask, the first turn's cache passed back. The
    # prefill reads only the new columns, and the drafter starts from them. (GPU-like costs: the adaptive policy
    # drafts whatever this machine's timings.)
    target = tiny_target(arch)
    drafter = tiny_drafter(target)
    torch.manual_seed(6)
    first = left_padded([torch.randint(4, 64, (n,)).tolist() for n in (7, 3, 5)])
    cache = DynamicCache(config=target.config)
    answered = target.generate(**first, do_sample=False, max_new_tokens=6, min_new_tokens=6, **cache_argument(cache))
    turn = torch.randint(4, 64, (3, 4))
    batch = {
        "input_ids": torch.cat([answered, turn], dim=-1),
        "attention_mask": torch.cat([first["attention_mask"], torch.ones(3, 6 + 4, dtype=torch.long)], dim=-1),
    }
    fresh = target.generate(**batch, do_sample=False, max_new_tokens=13)
    expected = target.generate(**batch, do_sample=False, max_new_tokens=13, **cache_argument(copy.deepcopy(cache)))
    output = target.generate(
        **batch, do_sample=False, max_new_tokens=13, **cache_argument(copy.deepcopy(cache)), assistant_model=drafter,
        draft_policy=policy,
    )  # fmt: skip
    assert torch.equal(expected, fresh)
    assert torch.equal(output, expected) and own_drafts(drafter.last_generation_stats) > 0
    # A batch's own cache, filled by the first turn with the drafter, is continued the same way.
    own = DynamicCache(config=target.config)
    output = target.generate(**first, do_sample=False, max_new_tokens=6, min_new_tokens=6, **cache_argument(own),
                             assistant_model=drafter, draft_policy=policy)  # fmt: skip
    assert torch.equal(output, answered) and own.get_seq_length() == cache.get_seq_length()
    assert torch.equal(target.generate(**batch, do_sample=False, max_new_tokens=13, **cache_argument(own),
                                       assistant_model=drafter, draft_policy=policy), fresh)  # fmt: skip
    with pytest.raises(ValueError, match="the whole sequences"):  # new columns only: the rows' padding is unknown
        target.generate(turn, attention_mask=batch["attention_mask"], max_new_tokens=4, **cache_argument(copy.deepcopy(cache)),
                        assistant_model=drafter)  # fmt: skip
    with pytest.raises(ValueError, match="holds 3 rows and the batch has 6"):
        target.generate(**batch, max_new_tokens=4, do_sample=True, num_return_sequences=2,
                        **cache_argument(copy.deepcopy(cache)), assistant_model=drafter)  # fmt: skip


# ---------------------------------------------------------------------------- trees of first-token branches
@pytest.mark.parametrize("eos", [False, True])
def test_a_call_of_one_row_leaves_its_cache_as_the_target_alone_does(arch, eos):
    # A tree of branches runs in the batch loop with one row: its cache ends as the target alone's (every token but
    # the last, no holes; also in the output with return_dict_in_generate), so a chat's next turn reads only its new
    # tokens. Stopped at EOS inside a verified block, the drafts accepted after it are not kept.
    from hf_domino.cache_domino import CACHE_ARGUMENT

    target = successor_target(arch, VOCAB)
    drafter = forcing_drafter(target, PARTIAL)  # right, but where the target's token is a multiple of 5
    prompt = torch.tensor([[3, 9, 4, 12, 5, 6]])
    eos_token = (6 + 18) % VOCAB if eos else None  # 18 tokens into the answer, inside a verified block
    options = {"max_new_tokens": 24, "do_sample": False, "pad_token_id": 0, "eos_token_id": eos_token}
    alone_cache, cache = DynamicCache(config=target.config), DynamicCache(config=target.config)
    expected = target.generate(prompt, **options, **cache_argument(alone_cache))
    output = target.generate(prompt, **options, **cache_argument(cache), assistant_model=drafter, domino_branches=2,
                             draft_policy="fixed", return_dict_in_generate=True)  # fmt: skip
    assert torch.equal(output.sequences, expected) and getattr(output, CACHE_ARGUMENT) is cache
    assert max(drafter.last_generation_stats.acceptance_lengths) > 2
    assert cache.get_seq_length() == alone_cache.get_seq_length() == expected.shape[1] - 1
    for ours, alone in zip(cache.layers, alone_cache.layers):
        torch.testing.assert_close(ours.keys, alone.keys)
    turn = torch.cat([expected, torch.tensor([[7, 8, 9]])], dim=-1)
    read = []
    hook = target.register_forward_pre_hook(lambda module, args, kwargs: read.append(kwargs["input_ids"].shape[1]),
                                            with_kwargs=True)  # fmt: skip
    second = target.generate(turn, **options, **cache_argument(cache), assistant_model=drafter, domino_branches=2)
    hook.remove()
    assert read[0] == 4  # the answer's last token and the new ones, as the target alone reads them
    assert torch.equal(second, target.generate(turn, **options, **cache_argument(alone_cache)))


def attended_columns(batch: dict[str, torch.Tensor], sequences: torch.LongTensor) -> torch.BoolTensor:
    """The columns of a batch's cache after generate() that a next turn attends to: the prompt's mask, then every
    token generated (the padding after a row's end included), but the last."""
    answers = torch.ones(sequences.shape[0], sequences.shape[1] - batch["input_ids"].shape[1], dtype=torch.long)
    return torch.cat([batch["attention_mask"], answers], dim=-1)[:, :-1].bool()


def assert_same_columns(cache: DynamicCache, reference: DynamicCache, columns: torch.BoolTensor) -> None:
    assert cache.get_seq_length() == reference.get_seq_length() == columns.shape[1]
    for ours, alone in zip(cache.layers, reference.layers):
        for mine, theirs in ((ours.keys, alone.keys), (ours.values, alone.values)):
            attended = columns[:, None, :, None].expand_as(mine)
            torch.testing.assert_close(mine[attended], theirs[attended])


def forwards_of(target, call) -> int:
    count = []
    hook = target.register_forward_pre_hook(lambda *_: count.append(1))
    try:
        call()
    finally:
        hook.remove()
    return len(count)


def test_a_batch_leaves_its_cache_as_the_target_alone_does(arch):
    # Rows of different lengths that end at EOS at different times (inside verified blocks): the cache passed to the
    # call, also in the output dict, holds what the target alone's holds at every column a next turn attends to:
    # each row's tokens but the last, and the padding the target alone reads after a row's end (read in one forward
    # after the loop, and only where the caller sees the cache). The next turn reads only its new tokens.
    from hf_domino.cache_domino import CACHE_ARGUMENT

    target = successor_target(arch, VOCAB)
    drafter = forcing_drafter(target, PARTIAL)  # right, but where the target's token is a multiple of 5
    batch = left_padded([[3, 9, 4, 12, 5, 6], [20, 21], [7, 8, 9, 10]])
    options = {"max_new_tokens": 24, "do_sample": False, "pad_token_id": 0, "eos_token_id": 28}  # after 22, 7, 18
    alone_cache, cache = DynamicCache(config=target.config), DynamicCache(config=target.config)
    expected = target.generate(**batch, **options, **cache_argument(alone_cache))
    output = target.generate(**batch, **options, **cache_argument(cache), assistant_model=drafter,
                             draft_policy="fixed", return_dict_in_generate=True)  # fmt: skip
    assert torch.equal(output.sequences, expected) and getattr(output, CACHE_ARGUMENT) is cache
    assert (expected[:, -1] == 0).sum() == 2 and max(drafter.last_generation_stats.acceptance_lengths) > 2
    columns = attended_columns(batch, expected)
    assert_same_columns(cache, alone_cache, columns)
    mask = torch.cat([columns.long(), torch.ones(3, 4, dtype=torch.long)], dim=-1)
    turn = {"input_ids": torch.cat([expected, torch.tensor([[7, 8, 9]] * 3)], dim=-1), "attention_mask": mask}
    read = []
    hook = target.register_forward_pre_hook(lambda module, args, kwargs: read.append(kwargs["input_ids"].shape[1]),
                                            with_kwargs=True)  # fmt: skip
    second = target.generate(**turn, **options, **cache_argument(cache), assistant_model=drafter)
    hook.remove()
    assert read[0] == 4  # the answers' last column and the new ones, as the target alone reads them
    assert torch.equal(second, target.generate(**turn, **options, **cache_argument(alone_cache)))
    # A call whose caller sees no cache reads nothing past the rows' ends.
    drafted = {**options, "assistant_model": drafter, "draft_policy": "fixed"}
    seen = forwards_of(target, lambda: target.generate(**batch, **drafted, return_dict_in_generate=True))
    assert forwards_of(target, lambda: target.generate(**batch, **drafted)) == seen - 1


def test_a_sampled_batchs_cache_holds_what_a_forward_over_its_output_computes(arch):
    # Sampling several sequences per prompt, rows ending at different times: the returned cache is, at every column
    # a next turn attends to, what the target computes reading the output in one forward.
    from hf_domino.cache_domino import CACHE_ARGUMENT

    target = tiny_target(arch)
    drafter = tiny_drafter(target)
    torch.manual_seed(3)
    batch = left_padded([torch.randint(13, 64, (n,)).tolist() for n in (5, 2)])
    output = target.generate(**batch, do_sample=True, max_new_tokens=14, num_return_sequences=2, pad_token_id=0,
                             eos_token_id=list(range(4, 13)), assistant_model=drafter, draft_policy="fixed",
                             return_dict_in_generate=True)  # fmt: skip
    lengths = (output.sequences != 0).sum(dim=-1)
    assert len(set(lengths.tolist())) > 1  # the rows ended at different times
    repeated = {name: value.repeat_interleave(2, dim=0) for name, value in batch.items()}
    columns = attended_columns(repeated, output.sequences)
    reference = DynamicCache(config=target.config)
    positions = (columns.long().cumsum(dim=-1) - 1).masked_fill(~columns, 1)
    target(output.sequences[:, :-1], attention_mask=columns.long(), position_ids=positions,
           **cache_argument(reference))  # fmt: skip
    assert_same_columns(getattr(output, CACHE_ARGUMENT), reference, columns)


def placed_by_column(target):
    """`target` as a family whose forward names no `position_ids` (as MOSS-Transcribe-Diarize's): generate() then
    makes none, and the model places each token at its cache column, columns its mask leaves out included."""

    class PlacedByColumn(type(target)):
        def forward(self, input_ids=None, attention_mask=None, **kwargs):
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)

    target.__class__ = PlacedByColumn
    return target


def test_a_target_placing_tokens_by_column_is_the_target_alone_in_a_batch(arch):
    # Left padding and columns left out inside a row count in its positions: the batch's rows, the cache it returns
    # (rows ending at different times) and a next turn on it are the target alone's.
    target = placed_by_column(tiny_target(arch))
    drafter = tiny_drafter(target)
    torch.manual_seed(4)
    batch = left_padded([torch.randint(13, 64, (n,)).tolist() for n in (9, 4, 7)])
    batch["attention_mask"][0, 3:5] = 0
    options = {"max_new_tokens": 16, "do_sample": False, "pad_token_id": 0, "eos_token_id": list(range(4, 13))}
    alone_cache, cache = DynamicCache(config=target.config), DynamicCache(config=target.config)
    expected = target.generate(**batch, **options, **cache_argument(alone_cache))
    output = target.generate(**batch, **options, **cache_argument(cache), assistant_model=drafter,
                             draft_policy="fixed")  # fmt: skip
    assert torch.equal(output, expected) and (expected[:, -1] == 0).any()
    assert own_drafts(drafter.last_generation_stats) > 0  # drafts verified (and rejected: holes in the cache)
    columns = attended_columns(batch, expected)
    assert_same_columns(cache, alone_cache, columns)
    turn = {
        "input_ids": torch.cat([expected, torch.tensor([[20, 21, 22]] * 3)], dim=-1),
        "attention_mask": torch.cat([columns.long(), torch.ones(3, 4, dtype=torch.long)], dim=-1),
    }
    second = target.generate(**turn, **options, **cache_argument(cache), assistant_model=drafter)
    assert torch.equal(second, target.generate(**turn, **options, **cache_argument(alone_cache)))


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_tree_forward_gives_each_branch_what_a_forward_of_that_branch_alone_gives(arch, attention):
    # Each branch sees the cache, the anchor and its own drafts at the right positions, never another branch's.
    from hf_domino.ragged_cache_domino import TreeLayout, ragged_forward
    from hf_domino.ragged_masks_domino import adds_its_mask

    target = tiny_target(arch, attn_implementation=attention)
    torch.manual_seed(2)
    batch = left_padded([torch.randint(4, 64, (n,)).tolist() for n in (6, 3)])
    cache = RaggedCache(DynamicCache(config=target.config), torch.zeros(2, 0, dtype=torch.bool))
    with torch.no_grad():
        ragged_forward(target, cache, batch["input_ids"], batch["attention_mask"].bool(), [1])
        anchors, branches = torch.randint(4, 64, (2, 1)), torch.randint(4, 64, (2, 3, 4))
        lengths = torch.tensor([[4, 2, 3], [1, 4, 0]])  # shorter branches: holes among the columns
        offered = torch.arange(4)[None, None] < lengths[..., None]
        new_columns = torch.cat([torch.ones(2, 1, dtype=torch.bool), offered.flatten(1)], dim=1)
        layout = TreeLayout(3, 4, adds_its_mask(target))
        tree = ragged_forward(target, copy.deepcopy(cache), torch.cat([anchors, branches.flatten(1)], -1),
                              new_columns, [1], tree=layout)  # fmt: skip
        for branch in range(3):
            alone = ragged_forward(target, copy.deepcopy(cache), torch.cat([anchors, branches[:, branch]], -1),
                                   torch.arange(5)[None] <= lengths[:, branch, None], [1])  # fmt: skip
            path = layout.path(torch.full((2,), branch))
            for row in range(2):
                real = path[row, : 1 + lengths[row, branch]]
                torch.testing.assert_close(tree.logits[row, real], alone.logits[row, : real.shape[0]])


def top_two_drafter(target, first: list[int], second: list[int], block_size: int = 6):
    """`forcing_drafter` drafting `first[prev]`, with `second[prev]` its second likeliest draft."""
    drafter = forcing_drafter(target, first, block_size=block_size)
    with torch.no_grad():
        for t, token in enumerate(second):
            drafter.embed_proj[2].weight[token, t] = 5.0
    return drafter


@pytest.mark.parametrize("rows", [1, 3])
def test_trees_keep_the_target_alones_output_and_take_the_branch_it_picks(rows, gpu_like_costs):
    # Drafts right after 2 of every 3 tokens; after the others the right token is the second likeliest, so a second
    # branch goes on where one block stops.
    target = successor_target("qwen3", VOCAB)
    right = successor(1)
    first = [right[t] if t % 3 else (t + 7) % VOCAB for t in range(VOCAB)]
    drafter = top_two_drafter(target, first, [right[t] if t % 3 == 0 else (t + 9) % VOCAB for t in range(VOCAB)])
    batch = left_padded([[4, 5], [6, 7, 8, 9], [20, 21, 22]][:rows])
    expected, output = both(target, drafter, batch, max_new_tokens=24, draft_policy="fixed",
                            num_speculative_tokens=4, domino_branches=2)  # fmt: skip
    assert torch.equal(output, expected)
    stats = drafter.last_generation_stats
    assert 1 in stats.branches and max(a for a, b in zip(stats.acceptance_lengths, stats.branches) if b == 1) >= 3
    _, one_block = both(target, drafter, batch, max_new_tokens=24, draft_policy="fixed", num_speculative_tokens=4)
    forwards_with_one_block = len(drafter.last_generation_stats.acceptance_lengths)
    assert len(stats.acceptance_lengths) < forwards_with_one_block  # fewer target forwards for the same tokens
    # The adaptive policy verifies the second branch too where its columns cost little (here a GPU's cost table).
    expected, output = both(target, drafter, batch, max_new_tokens=24, domino_branches=2)
    assert torch.equal(output, expected)
    adaptive = drafter.last_generation_stats
    for call in (stats, adaptive):  # one branch per row and forward, as for its acceptance
        assert len(call.branches) == len(call.acceptance_lengths)
    assert (
        1 in adaptive.branches
        and max(a for a, b in zip(adaptive.acceptance_lengths, adaptive.branches) if b == 1) >= 3
    )
    _, one_block = both(target, drafter, batch, max_new_tokens=24)
    assert len(adaptive.acceptance_lengths) < len(drafter.last_generation_stats.acceptance_lengths)


@pytest.mark.parametrize("options", [dict(), dict(repetition_penalty=1.5, no_repeat_ngram_size=3)],
                         ids=["plain", "processors"])  # fmt: skip
@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_trees_on_a_random_target_keep_its_output(arch, options, policy, gpu_like_costs):
    target = tiny_target(arch)
    drafter = tiny_drafter(target)
    torch.manual_seed(7)
    batch = left_padded([torch.randint(4, 64, (n,)).tolist() for n in (7, 2, 4)])
    for rows, branches, k in ((1, 2, 3), (3, 3, 2), (3, 4, 5)):
        part = {name: value[:rows] for name, value in batch.items()}
        expected, output = both(target, drafter, part, max_new_tokens=16, draft_policy=policy,
                                num_speculative_tokens=k, domino_branches=branches, **options)  # fmt: skip
        assert torch.equal(output, expected)


def test_trees_refuse_what_they_cannot_serve_naming_the_fix():
    target = successor_target("qwen3", VOCAB)
    drafter = forcing_drafter(target, successor(1))
    prompt = torch.tensor([[4, 5]])
    with pytest.raises(ValueError, match="from 1 to 8"):
        target.generate(prompt, max_new_tokens=4, assistant_model=drafter, draft_policy="fixed", domino_branches=0)


@pytest.mark.slow
def test_the_prompt_copies_example_runs_as_a_user_runs_it():
    # The script behind docs/benchmarks.md's "A prompt's copies read once", at toy size: every way gets its figures.
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "prompt_copies.py"
    args = ["--num-prompts", "1", "--copies", "2", "--max-new-tokens", "4", "--repeats", "1"]
    run = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [line for line in run.stdout.splitlines() if "the target alone), prefill" in line]
    assert len(lines) == 3 and all(float(line.split(" s (")[0].split()[-1]) > 0 for line in lines), run.stdout

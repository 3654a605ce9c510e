"""Drafts retrieved from a drafter's datastore (`domino_datastore`): found right, saved with the drafter, verified
losslessly."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import tiny_drafter, tiny_target
from test_batching import both, left_padded
from test_generation import (
    chi_square_p_value,
    exact_sequence_distribution,
    law_drafter,
    law_target,
    sample_with_drafter,
)
from transformers import LogitsProcessorList

from hf_domino import DominoForSpeculation, batching_domino
from hf_domino.copied_drafts_domino import DATASTORE_FILE, DATASTORE_NGRAM_SIZES, DraftDatastore
from hf_domino.measure import parse_method


def brute_force(
    sequences: list[list[int]], query: list[int], limit: int, sizes=DATASTORE_NGRAM_SIZES, min_count=2
) -> list[int]:
    """The datastore's rule, written out: the longest n-gram with `min_count` occurrences, then token by token the
    continuation the most of them share (the smallest id on a tie), while `min_count` still agree."""
    for size in sizes:
        # Occurrences of the query's last n-gram that have a next token (not at a sequence's end).
        occurrences = [
            (sequence, start + size)
            for sequence in sequences
            for start in range(len(sequence) - size)
            if sequence[start : start + size] == query[-size:]
        ]
        if len(occurrences) < min_count:
            continue
        drafts = []
        while len(drafts) < limit:
            following = Counter(s[i] if i < len(s) else -1 for s, i in occurrences)
            best = min(following, key=lambda token: (-following[token], token))
            if best < 0 or following[best] < min_count:
                break
            drafts.append(best)
            occurrences = [(s, i + 1) for s, i in occurrences if i < len(s) and s[i] == best]
        if drafts:
            return drafts
    return []


def test_datastore_drafts_what_most_occurrences_continue_with():
    store = DraftDatastore.from_sequences([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 7], [9, 2, 3, 4, 8], [2, 3, 4, 5, 6]])

    def drafts(query, limit=4):
        found = store.lookup(torch.tensor([query]), limit)
        return None if found is None else found[0].tolist()

    assert drafts([1, 2, 3, 4]) == [5]  # "1 2 3 4" twice, then 5 twice; then 6 and 7 once each: not enough
    assert drafts([0, 2, 3, 4]) == [5, 6]  # "0 2 3 4" never occurred: its 3-gram "2 3 4" four times, 5 three times
    assert drafts([0, 2, 3, 4], limit=1) == [5]
    assert drafts([3, 4]) == [5, 6]  # the 2-gram "3 4" three times, 5 each time; then 6 twice
    assert store.build_index() is store and sorted(store._index) == sorted(DATASTORE_NGRAM_SIZES)  # built once
    assert drafts([7, 8, 9]) is None and drafts([3]) is None  # unknown, and shorter than every n-gram size
    assert drafts([4, 5, 6]) is None  # at the end of its sequences: nothing follows
    short = DraftDatastore.from_sequences([[5, 6]]).build_index()  # shorter than an n-gram and its next token
    assert short.lookup(torch.tensor([[5, 6]]), 4) is None and short.lookup(torch.tensor([[1, 5]]), 4) is None


def test_datastore_lookup_matches_the_rule_written_out():
    generator = torch.Generator().manual_seed(0)
    sequences = [
        torch.randint(0, 6, (int(torch.randint(3, 30, (1,), generator=generator)),), generator=generator).tolist()
        for _ in range(200)
    ]
    store = DraftDatastore.from_sequences(sequences)
    hits = 0
    for _ in range(150):
        query = torch.randint(0, 6, (7,), generator=generator).tolist()
        found = store.lookup(torch.tensor([query]), 5)
        assert (found[0].tolist() if found is not None else []) == brute_force(sequences, query, 5)
        hits += found is not None
    assert hits > 100
    # Tokens past the store's largest id (3 bits a key column here) occur in none of its n-grams: they spilled into
    # the next column of a key, and [0, 17] matched (1, 1).
    for _ in range(100):
        query = torch.randint(0, 20, (7,), generator=generator).tolist()
        found = store.lookup(torch.tensor([query]), 5)
        assert (found[0].tolist() if found is not None else []) == brute_force(sequences, query, 5)
    assert (
        DraftDatastore.from_sequences([[1, 1, 1, 7, 8, 9]] * 2, ngram_sizes=(2,)).lookup(torch.tensor([[0, 17]]), 4)
        is None
    )


def test_datastore_is_saved_with_its_drafter_and_checked(tmp_path):
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    drafter.datastore = DraftDatastore.from_sequences([[5, 6, 7, 8], [5, 6, 7, 9, 10]])
    drafter.save_pretrained(tmp_path)
    loaded = DominoForSpeculation.from_pretrained(tmp_path)
    assert torch.equal(loaded.datastore.tokens, drafter.datastore.tokens)
    assert sorted(loaded.datastore._index) == sorted(DATASTORE_NGRAM_SIZES)  # indexed at load: no generate() pays
    drafter.datastore = None  # saving without one removes a stale file
    drafter.save_pretrained(tmp_path)
    assert (
        not (tmp_path / DATASTORE_FILE).exists() and DominoForSpeculation.from_pretrained(tmp_path).datastore is None
    )
    large = DraftDatastore.from_sequences([[70000, 70001, 70002], [1, 2]])  # ids past uint16 are stored as int32
    large.save(str(tmp_path / "large.safetensors"))
    assert torch.equal(DraftDatastore.load(str(tmp_path / "large.safetensors")).tokens, large.tokens)
    with pytest.raises(ValueError, match="non-empty 1-D tensor of token ids"):
        DraftDatastore(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="at least one sequence"):  # a torch.cat error
        DraftDatastore.from_sequences([])
    # Refused at the call, naming the fix: an IndexError in the target's embedding, an AttributeError in a lookup.
    prompt = torch.tensor([[2, 5, 9, 12]])
    drafter.datastore = DraftDatastore.from_sequences([[5, 9, 12, 17, 100, 101]] * 2)
    with pytest.raises(ValueError, match="holds token id 101, outside the target's vocabulary of 64"):
        target.generate(prompt, assistant_model=drafter, max_new_tokens=10, do_sample=False)
    drafter.datastore = [[5, 9, 12, 17]]
    with pytest.raises(TypeError, match="drafter.datastore must be a DraftDatastore or None, got list"):
        target.generate(prompt, assistant_model=drafter, max_new_tokens=10, do_sample=False)
    for off in ({"domino_datastore": False}, {"domino_lookup": False}):  # a call that retrieves nothing runs
        expected = target.generate(prompt, max_new_tokens=10, do_sample=False)
        assert torch.equal(target.generate(prompt, assistant_model=drafter, max_new_tokens=10, do_sample=False, **off),
                           expected)  # fmt: skip


def own_answers_datastore(target, prompts: list[list[int]], max_new_tokens: int = 30) -> DraftDatastore:
    """The target's own greedy continuations of other prompts: a datastore that drafts well for it."""
    answers = [target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=max_new_tokens)[0] for p in prompts]
    return DraftDatastore.from_sequences(answers, ngram_sizes=(3, 2))


@pytest.mark.parametrize("options", [dict(draft_policy="fixed"), dict()])
def test_greedy_identical_with_retrieved_drafts(arch, options, gpu_like_costs):
    target = tiny_target(arch)
    drafter = tiny_drafter(target)
    drafter.datastore = own_answers_datastore(target, [[3, 9, 14], [21, 4], [8, 8, 30], [12, 40, 2]])
    prompt = torch.tensor([[3, 9, 15]])  # unlike every stored prompt, so only the store's answers can help
    expected = target.generate(prompt, do_sample=False, max_new_tokens=40)
    output = target.generate(prompt, do_sample=False, max_new_tokens=40, assistant_model=drafter, **options)
    assert torch.equal(output, expected)
    stats = drafter.last_generation_stats
    retrieved = [n for n, from_store in zip(stats.acceptance_lengths, stats.retrieved) if from_store]
    assert retrieved and max(retrieved) > 1  # retrieved drafts were verified, and accepted
    assert not any(c and r for c, r in zip(stats.copied, stats.retrieved))
    for off in (dict(domino_datastore=False), dict(domino_lookup=False)):
        output = target.generate(prompt, do_sample=False, max_new_tokens=40, assistant_model=drafter, **off, **options)
        assert torch.equal(output, expected) and not any(drafter.last_generation_stats.retrieved)


def test_sampling_with_retrieved_drafts_preserves_target_distribution():
    """Retrieved drafts, like copies, come without a distribution of their own and reach speculative sampling as
    drafts certain of their token: exact. Mixed with the drafter's cycles in the same calls."""
    vocab, num_new, draws = 4, 4, 2500
    target = law_target(vocab, seed=5, peak=20)  # a peaked law, far from uniform, so that a wrong one shows
    drafter = law_drafter(target)
    # Text without token 3: retrieval drafts after 2-grams of the other tokens, the drafter after those with a 3.
    drafter.datastore = DraftDatastore.from_sequences(
        [[a, b, c, d] for a in range(3) for b in range(3) for c in range(3) for d in (c, (c + 1) % 3)],
        ngram_sizes=(2,),
    )
    prompt = [1, 2, 1]  # no 0: it is the pad token
    probs = exact_sequence_distribution(target, prompt, num_new, LogitsProcessorList())
    calls = []
    counts, _, _ = sample_with_drafter(
        target, drafter, prompt, num_new, draws, seed=7, per_call=calls, draft_policy="fixed", top_k=0
    )
    cycles = {"retrieved": 0, "accepted": 0, "drafted": 0}
    for stats in calls:
        for length, offered, retrieved, copied in zip(
            stats.acceptance_lengths, stats.drafted, stats.retrieved, stats.copied
        ):
            cycles["retrieved"] += retrieved
            cycles["accepted"] += (length - 1) * retrieved
            cycles["drafted"] += offered * (not retrieved and not copied)
    assert cycles["retrieved"] > draws // 2 and cycles["accepted"] > draws // 10 and cycles["drafted"] > draws // 10
    assert chi_square_p_value(counts, probs, draws) > 1e-3
    # The test can fail: the same draws are far from the distribution of another prompt's continuations.
    wrong = exact_sequence_distribution(target, [1, 2, 2], num_new, LogitsProcessorList())
    assert chi_square_p_value(counts, wrong, draws) < 1e-6


def test_option_is_checked_and_bench_methods_name_it():
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    with pytest.raises(ValueError, match="domino_datastore must be True or False, got 'no'"):
        target.generate(torch.tensor([[5, 6]]), max_new_tokens=3, assistant_model=drafter, domino_datastore="no")
    assert parse_method("domino_vocab_lookup").options["domino_datastore"] is True
    copies = parse_method("domino_vocab_copies").options
    assert copies["domino_lookup"] is True and copies["domino_datastore"] is False


@pytest.mark.parametrize("options", [dict(draft_policy="fixed"), dict()])
def test_batch_rows_retrieve_and_stay_identical(options, gpu_like_costs, monkeypatch):
    monkeypatch.setattr(batching_domino, "RETRIEVAL_MAX_ROWS", None)  # every batch retrieves (the default)
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    drafter.datastore = own_answers_datastore(target, [[3, 9, 14], [21, 4], [8, 8, 30], [12, 40, 2]])
    rows = [[3, 9, 15], [7, 21, 5], [50, 8, 8, 31, 2]]
    expected, output = both(target, drafter, left_padded(rows), max_new_tokens=30, **options)
    assert torch.equal(output, expected)
    stats = drafter.last_generation_stats
    assert any(stats.retrieved) and not any(c and r for c, r in zip(stats.copied, stats.retrieved))
    retrieved = [n for n, from_store in zip(stats.acceptance_lengths, stats.retrieved) if from_store]
    assert max(retrieved) > 1
    expected, output = both(target, drafter, left_padded(rows), max_new_tokens=30, domino_datastore=False, **options)
    assert torch.equal(output, expected) and not any(drafter.last_generation_stats.retrieved)


def test_batches_retrieve_only_while_few_rows_are_active(gpu_like_costs, monkeypatch):
    """Above `RETRIEVAL_MAX_ROWS` active rows no row retrieves (text copies still count); at or below it rows do. The
    output stays the target's either way."""
    monkeypatch.setattr(batching_domino, "RETRIEVAL_MAX_ROWS", 2)
    cycles: list[tuple[int, bool]] = []  # (active rows, whether a row verified or was offered a retrieval)
    find_copies = batching_domino.BatchedDecoding.find_copies

    def recorded(self, *args):
        copies, declined, sources = find_copies(self, *args)
        cycles.append((len(self.active), any(source is self.drafting.datastore_policy for source in sources.values())))
        return copies, declined, sources

    monkeypatch.setattr(batching_domino.BatchedDecoding, "find_copies", recorded)
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    drafter.datastore = own_answers_datastore(target, [[3, 9, 14], [21, 4], [8, 8, 30], [12, 40, 2]])
    rows = [[3, 9, 15], [7, 21, 5], [50, 8, 8, 31, 2]]
    for batch in (rows, rows[:2]):
        cycles.clear()
        expected, output = both(target, drafter, left_padded(batch), max_new_tokens=30)
        assert torch.equal(output, expected)
        assert not any(retrieved for active, retrieved in cycles if active > 2)
    assert any(retrieved for _, retrieved in cycles)  # the batch of two


def test_bench_method_lookup2_retrieves_in_small_batches_for_its_call_only(monkeypatch):
    from hf_domino import measure_batch

    seen = []  # RETRIEVAL_MAX_ROWS as each cycle's find_copies sees it
    find_copies = batching_domino.BatchedDecoding.find_copies
    monkeypatch.setattr(
        batching_domino.BatchedDecoding,
        "find_copies",
        lambda self, *args: seen.append(batching_domino.RETRIEVAL_MAX_ROWS) or find_copies(self, *args),
    )
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    default = batching_domino.RETRIEVAL_MAX_ROWS
    batch = left_padded([[3, 9, 15], [7, 21, 5], [50, 8, 8, 31, 2]])
    measure_batch._generate(target, drafter, batch, "domino_lookup2", 6, 0.0, {})
    assert seen and set(seen) == {2} and batching_domino.RETRIEVAL_MAX_ROWS == default is None

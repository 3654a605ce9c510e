"""Batched speculative decoding: `generate(**batch, assistant_model=drafter)` for B > 1, lossless row by row."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from conftest import forcing_drafter, successor_target, tiny_drafter, tiny_target
from test_generation import (
    VOCAB,
    CollectingStreamer,
    chi_square_p_value,
    drafts_and_accepted,
    exact_sequence_distribution,
    letter_tokenizer,
    sample_with_drafter,
    sampled_continuations,
    successor,
)
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.cache_utils import DynamicLayer

from hf_domino import (
    batch_policy_domino,
    batching_domino,
    cost_model_domino,
    policy_domino,
    ragged_batch_domino,
    ragged_cache_domino,
    records_domino,
)
from hf_domino.cache_domino import BufferedLayer, buffer_layers, cache_argument
from hf_domino.drafting_domino import DrafterContext, run_backbone
from hf_domino.modeling_domino import TargetModules
from hf_domino.options_domino import DominoOptions
from hf_domino.ragged_batch_domino import BatchedDrafterContext, run_batched_backbone
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


def test_plain_steps_seconds_counts_the_rows_still_generating():
    # Rows that still generate 3, 1 and 0 tokens: plain steps of 2 rows, then 1 row, then 1 row.
    assert batch_policy_domino.plain_steps_seconds([3, 1, 0], lambda rows: 10.0 * rows) == 40.0
    assert batch_policy_domino.plain_steps_seconds([0, 0], lambda rows: 1.0) == 0


def test_plain_steps_seconds_of_a_server_joins_rows_as_places_free_up():
    # A step costs 10 plus 1 per row. Four rows of 4 tokens, 2 at a time: two rounds of 4 two-row steps; all at once:
    # 4 four-row steps. Rows of 3, 1 and 2 tokens, 2 at a time: the third row joins when the second finishes.
    def seconds(rows: int) -> float:
        return 10.0 + rows

    assert batch_policy_domino.plain_steps_seconds([4, 4, 4, 4], seconds, limit=2) == 8 * 12.0
    assert batch_policy_domino.plain_steps_seconds([4, 4, 4, 4], seconds) == 4 * 14.0
    assert batch_policy_domino.plain_steps_seconds([3, 1, 2], seconds, limit=2) == 12.0 + 2 * 12.0
    assert batch_policy_domino.plain_steps_seconds([], seconds, limit=2) == 0


def test_plain_steps_seconds_takes_no_request_on_before_it_came():
    # A step costs 10 plus 1 per row. Two requests of 64 tokens, the second arriving after 21 one-row steps: 21
    # one-row steps, 43 two-row steps (the first done), 21 one-row steps; all at once, 64 two-row steps, which priced
    # a manager's calls as losing whenever its requests came while others ran. A request coming after the others
    # finished: the idle time between does not count.
    def seconds(rows: int) -> float:
        return 10.0 + rows

    came = [0.0, 21 * 11.0]
    assert batch_policy_domino.plain_steps_seconds([64, 64], seconds, 4, came) == 42 * 11.0 + 43 * 12.0
    assert batch_policy_domino.plain_steps_seconds([64, 64], seconds, 4) == 64 * 12.0
    assert batch_policy_domino.plain_steps_seconds([5, 5], seconds, 4, [0.0, 1000.0]) == 10 * 11.0
    # One arriving between two steps joins at the next one; places still limit who joins.
    assert batch_policy_domino.plain_steps_seconds([4, 4], seconds, 4, [0.0, 5.0]) == 11.0 + 3 * 12.0 + 11.0
    assert batch_policy_domino.plain_steps_seconds([4, 4, 4], seconds, 2, [0.0, 0.0, 0.0]) == 4 * 12.0 + 4 * 11.0
    assert batch_policy_domino.plain_steps_seconds([3, 0, 2], seconds, 2, [0.0, 1.0, 50.0]) == 3 * 11.0 + 2 * 11.0


def test_a_servers_call_is_judged_against_plain_steps_joining_as_its_rows_joined(monkeypatch):
    # 21 requests of 17 tokens, 3 rows at a time, in 20 cycles of 1 s, where a plain step costs 1 s at any row count:
    # plain steps joining as the call did take 7 rounds of 17 steps (5.95x slower); all 21 at once would take 17
    # (0.85x: a loss, which paused the next call).
    monkeypatch.setattr(batch_policy_domino, "MAX_PLAIN_CALLS", 4)
    record = records_domino.DrafterRecord(position_acceptance=[0.5], plain_cycle_seconds={1: 1.0, 2: 1.0, 3: 1.0})
    table = cost_model_domino.VerifyCost({1: 1.0, 68: 1.0})
    policy = policy_domino.AdaptivePolicy(record, batch_policy_domino.BatchVerifyCost(table, 3), cap=4)
    cycles, steps = [(3, 1.0, None)] * 20, [17] * 21
    assert batch_policy_domino.call_gain(policy, cycles, steps, limit=3) == pytest.approx(119 / 20)
    assert batch_policy_domino.call_gain(policy, cycles, steps) == pytest.approx(17 / 20)
    batch_policy_domino.judge_call(policy, cycles, steps, speculated=True, limit=3)
    assert record.call_gain == pytest.approx(119 / 20) and batch_policy_domino.call_speculates(record)


def test_a_window_counts_tokens_and_arrivals_from_its_start():
    # A server's window of cycles counts each row's tokens from the window's start (rows admitted since held none),
    # and a request that came before the window's start came at its start.
    window = batch_policy_domino.CallWindow(limit=2, arrivals=[0.0, 3.0])
    window.cycles.append((2, 1.0, None))
    assert window.steps([5, 2]) == [5, 2] and window.arrived() == [0.0, 3.0]
    window.next(start=4.0, tokens=[5, 2])
    assert window.cycles == [] and window.start == 4.0
    window.arrivals.append(6.5)  # a third request joins during the window
    assert window.steps([9, 3, 4]) == [4, 1, 4] and window.arrived() == [0.0, 0.0, 2.5]
    assert batch_policy_domino.CallWindow().arrived() is None


def test_calls_losing_on_average_pause_speculation_for_1_2_4_calls(monkeypatch):
    monkeypatch.setattr(batch_policy_domino, "MAX_PLAIN_CALLS", 4)
    record = records_domino.DrafterRecord(position_acceptance=[0.5])

    def calls(gains: list[float]) -> str:
        pattern = ""
        for gain in gains:
            while not batch_policy_domino.call_speculates(record):
                pattern += "p"
            pattern += "s"
            batch_policy_domino.learn_call_gain(record, gain)
        return pattern

    # One losing call after winning ones is within the calls' spread: no pause.
    assert calls([1.3, 0.8, 1.2]) == "sss"
    # Then losing on average: after each losing call a pause of 1, 2, 4, 4 calls; a call that wins enough ends them.
    assert calls([0.5, 0.6, 0.7, 0.7, 0.7]) == "s" + "ps" + "pps" + "pppps" + "pppps"
    assert record.call_gain < 1
    assert calls([3.0, 1.0]) == "pppp" + "s" + "s"


def test_a_batch_size_whose_speculation_lost_takes_plain_steps_in_its_next_calls(monkeypatch):
    # `judge_call` compares a speculating call's cycles with what plain steps would have taken for the same tokens.
    # Forced to a loss (plain steps estimated free), the batch size takes plain steps only for 1 call, then 2, then 4
    # (MAX_PLAIN_CALLS); a win (plain steps estimated dear) ends the pauses. Every output is the target's. These calls
    # are a few cycles long, all judged here (CALL_MIN_CYCLES).
    monkeypatch.setattr(batch_policy_domino, "MAX_PLAIN_CALLS", 4)
    monkeypatch.setattr(batch_policy_domino, "CALL_MIN_CYCLES", 1)
    plain_cost = {"seconds": 0.0}
    monkeypatch.setattr(batch_policy_domino, "plain_cycle_estimate", lambda policy, rows: plain_cost["seconds"])
    decided = []
    speculates = batching_domino.call_speculates
    monkeypatch.setattr(
        batching_domino, "call_speculates", lambda record: decided.append(speculates(record)) or decided[-1]
    )
    target = successor_target("qwen3", VOCAB)
    drafter = forcing_drafter(target, successor(1), block_size=6)
    batch = left_padded([[4, 9, 11], [20], [12, 13]])
    expected = target.generate(**batch, do_sample=False, max_new_tokens=12)
    for call in range(12):
        if call == 10:
            plain_cost["seconds"] = 1e9
        output = target.generate(**batch, do_sample=False, max_new_tokens=12, assistant_model=drafter)
        assert torch.equal(output, expected)
        stats = drafter.last_generation_stats
        assert any(stats.drafted) == decided[-1], call  # a speculating call drafts (every draft is right)
    assert "".join("s" if s else "p" for s in decided) == "spsppsppppss"


def test_a_call_whose_speculation_loses_takes_plain_steps_for_the_rest_of_it(monkeypatch):
    # Checked every 3 cycles (CALL_CHECK_CYCLES), a call whose cycles so far lost to plain steps (forced: plain steps
    # estimated free) stops drafting at the first check and takes plain steps to its end; it still counts as a
    # speculating call that lost, so the next call of its batch size takes plain steps only; once plain steps are
    # estimated dear, a call drafts past its checks. Every output is the target's.
    monkeypatch.setattr(batch_policy_domino, "CALL_CHECK_CYCLES", 3)
    monkeypatch.setattr(batch_policy_domino, "MAX_PLAIN_CALLS", 4)
    monkeypatch.setattr(batch_policy_domino, "CALL_MIN_CYCLES", 1)
    plain_cost = {"seconds": 0.0}
    monkeypatch.setattr(batch_policy_domino, "plain_cycle_estimate", lambda policy, rows: plain_cost["seconds"])
    target = successor_target("qwen3", VOCAB)
    drafter = forcing_drafter(target, successor(1), block_size=4)  # 3 drafts per block, all right
    batch = left_padded([[4, 9, 11], [20], [12, 13]])
    expected = target.generate(**batch, do_sample=False, max_new_tokens=24)

    def drafted_per_cycle() -> list[bool]:
        output = target.generate(**batch, do_sample=False, max_new_tokens=24, assistant_model=drafter)
        assert torch.equal(output, expected)
        drafted = drafter.last_generation_stats.drafted  # one entry per row and cycle; the 3 rows end together
        return [any(drafted[i : i + 3]) for i in range(0, len(drafted), 3)]

    losing = drafted_per_cycle()
    assert any(losing[:3]) and not any(losing[3:]) and len(losing) > 6, losing
    assert not any(drafted_per_cycle())  # the pause after a losing call
    plain_cost["seconds"] = 1e9
    winning = drafted_per_cycle()
    assert any(winning[3:]) and len(winning) < len(losing), winning


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


def test_caches_compacted_every_cycle_or_never_give_the_same_output(monkeypatch):
    target = successor_target("qwen3", VOCAB)
    drafter = forcing_drafter(target, PARTIAL, block_size=8)
    batch = left_padded([[4], [9, 10, 11, 12, 13, 14, 15], [2, 3]])
    expected = target.generate(**batch, do_sample=False, max_new_tokens=30)
    calls = []
    original = RaggedCache.maybe_compact

    def counting(self):
        calls.append(original(self))
        return calls[-1]

    monkeypatch.setattr(RaggedCache, "maybe_compact", counting)
    for fraction, minimum in ((0.0, 0), (2.0, 10**9)):
        monkeypatch.setattr(ragged_cache_domino, "COMPACT_FRACTION", fraction)
        monkeypatch.setattr(ragged_cache_domino, "MIN_COMPACT_COLUMNS", minimum)
        calls.clear()
        output = target.generate(**batch, do_sample=False, max_new_tokens=30, assistant_model=drafter)
        assert torch.equal(output, expected)
        assert any(calls) == (minimum == 0)


def test_compaction_moves_a_sparse_attention_layers_indexer_columns_with_its_keys(monkeypatch):
    """DeepSeek-V3.2's and GLM-5's layers keep the indexer's keys beside keys and values, a column per token each
    (and, in some families, the indexer's positions): holes, crops, finished rows and compaction treat them alike."""
    from transformers.cache_utils import DynamicIndexedLayer

    layer = DynamicIndexedLayer()
    columns = torch.arange(6.0)  # column j holds j everywhere
    layer.update(columns.expand(2, 1, 6)[..., None].expand(2, 1, 6, 3).clone(), torch.zeros(2, 1, 6, 3))
    layer.update_indexer(columns.expand(2, 6)[..., None].expand(2, 6, 4).clone())
    layer.indexer_position_ids = columns.long().expand(3, 2, 6).clone()
    cache = DynamicCache()
    cache.layers = [layer]
    mask = torch.tensor([[0, 1, 0, 1, 1, 0], [1, 1, 0, 0, 0, 1]], dtype=torch.bool)
    ragged = RaggedCache(cache, mask.clone())
    monkeypatch.setattr(ragged_cache_domino, "MIN_COMPACT_COLUMNS", 0)
    assert ragged.maybe_compact()
    kept = torch.tensor([[1, 3, 4], [0, 1, 5]])  # each row's real columns, in order
    assert torch.equal(layer.keys[:, 0, :, 0], kept.float())
    assert torch.equal(layer.indexer_keys[..., 0], kept.float())
    assert torch.equal(layer.indexer_position_ids, kept.expand(3, 2, 3))
    ragged.select_rows(torch.tensor([1]))
    assert torch.equal(layer.indexer_keys[..., 0], kept[1:].float())
    assert torch.equal(layer.indexer_position_ids, kept[1:].expand(3, 1, 3))


def test_buffered_layer_holds_what_a_dynamic_layer_holds_and_appends_in_place():
    """Every operation the loops use, on both layers: the same keys/values, and a step writes into the buffers."""
    torch.manual_seed(0)
    plain, buffered = DynamicLayer(), BufferedLayer(reserve=12)

    def both_layers(operation) -> None:
        for layer in (plain, buffered):
            operation(layer)
        assert torch.equal(plain.keys, buffered.keys) and torch.equal(plain.values, buffered.values)
        assert plain.get_seq_length() == buffered.get_seq_length()

    def update(columns: int, rows: int = 3):
        keys, values = torch.randn(rows, 2, columns, 4), torch.randn(rows, 2, columns, 4)
        return lambda layer: layer.update(keys, values)

    both_layers(update(5))
    storage = buffered.buffers[0].data_ptr()
    both_layers(update(1))
    both_layers(lambda layer: layer.crop(-2))  # rejected drafts: the next step overwrites their columns
    both_layers(update(4))
    assert buffered.buffers[0].data_ptr() == storage and buffered.buffers[0].shape[-2] == 12
    both_layers(update(9))  # past the reserve: moved once, with room to spare
    grown = buffered.buffers[0]
    assert grown.data_ptr() != storage and grown.shape[-2] > 17
    both_layers(lambda layer: layer.batch_select_indices(torch.tensor([0, 2])))  # rows leave the batch
    both_layers(update(2, rows=2))
    order = torch.tensor([[1, 0, 2, 3], [3, 2, 1, 0]])[:, None, :, None].expand(-1, 2, -1, 4)

    def compact(layer) -> None:  # what RaggedCache.maybe_compact does to a layer
        layer.keys, layer.values = torch.gather(layer.keys, 2, order), torch.gather(layer.values, 2, order)

    both_layers(compact)
    both_layers(update(3, rows=2))
    storages = set()
    for _ in range(20):  # up to the reserve in place, then one move with room for the rest
        both_layers(update(1, rows=2))
        storages.add(buffered.buffers[0].data_ptr())
    assert len(storages) == 2
    generous = BufferedLayer(reserve=100_000)  # a long max_length is not taken before it is needed
    generous.update(torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4))
    assert generous.buffers[0].shape[-2] == 5 + 256


@pytest.mark.parametrize("rows", [[[4, 5, 6]], [[4], [9, 10, 11, 12], [2, 3]]], ids=["batch-1", "batch-3"])
def test_generate_appends_to_the_targets_cache_in_place(rows, monkeypatch):
    """generate() with a drafter, transformers' loop (one row) or ours (a batch): the target's keys/values are
    written into buffers reserved for the call, not concatenated at every step, and the output is unchanged."""
    target = successor_target("qwen3", VOCAB)
    drafter = forcing_drafter(target, PARTIAL, block_size=8)
    moves, updates = [], []
    move, update = BufferedLayer._move_to_buffers, BufferedLayer.update
    monkeypatch.setattr(BufferedLayer, "_move_to_buffers", lambda self, *a: moves.append(self) or move(self, *a))
    monkeypatch.setattr(BufferedLayer, "update", lambda self, *a, **k: updates.append(self) or update(self, *a, **k))
    batch = left_padded(rows)
    expected, output = both(target, drafter, batch, max_new_tokens=30)
    assert torch.equal(output, expected)
    target_layers = [layer for layer in set(updates) if layer.reserve]
    assert len(target_layers) == target.config.num_hidden_layers
    for layer in target_layers:
        moved, updated = moves.count(layer), updates.count(layer)
        # Once at the prefill; in a batch also when rows leave or holes are compacted away, which copy anyway.
        assert moved == 1 if len(rows) == 1 else moved * 3 <= updated, (moved, updated)
        assert updated > 5


def test_a_filled_layer_is_buffered_with_its_keys_and_moved_once():
    """A cache passed back for a chat's next turn: `buffer_layers` keeps a filled layer's keys/values, moves them into
    buffers at the first update, and later steps write in place, as for an empty layer."""
    torch.manual_seed(1)
    cache = DynamicCache()
    for layer in range(2):
        cache.update(torch.randn(1, 2, 7, 4), torch.randn(1, 2, 7, 4), layer)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    buffer_layers(cache, reserve=20)
    assert all(type(layer) is BufferedLayer and layer.get_seq_length() == 7 for layer in cache.layers)
    new = [(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)) for _ in range(2)]
    for index, (keys, values) in enumerate(new):
        cache.update(keys, values, index)
    storage = cache.layers[0].buffers[0].data_ptr()
    cache.update(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4), 0)
    assert cache.layers[0].buffers[0].data_ptr() == storage  # in place from the second update on
    for layer, (keys, values), (new_keys, new_values) in zip(cache.layers, before, new):
        assert torch.equal(layer.keys[..., :10, :], torch.cat([keys, new_keys], dim=-2))
        assert torch.equal(layer.values[..., :10, :], torch.cat([values, new_values], dim=-2))


@pytest.mark.parametrize("layers", [{}, {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4}])
def test_ragged_drafter_context_matches_one_row_at_a_time(layers):
    """The batched backbone over a ragged cache gives each row what the batch-1 ladder gives it alone, sliding-window
    layers (counted in each row's positions, across its holes) included."""
    target = tiny_target("llama")
    drafter = tiny_drafter(target, block_size=5, **layers)
    modules = TargetModules.from_target(target)
    torch.manual_seed(2)
    size = drafter.config.context_size
    appends = [[3, 7, 1], [2, 0, 4], [5, 1, 0], [1, 3, 2]]  # rows x cycles: features appended, 0 = a plain step
    batched = BatchedDrafterContext.empty(3, drafter.device)
    single = [DrafterContext() for _ in range(3)]
    for cycle in range(len(appends)):
        counts = torch.tensor([appends[cycle][row] for row in range(3)])
        features = torch.randn(3, int(counts.max()), size)
        batched.append(features, counts)
        for row in range(3):
            if counts[row]:
                single[row].append(features[row : row + 1, : counts[row]])
        anchors = torch.randint(4, 64, (3, 1))
        with torch.no_grad():
            hidden = run_batched_backbone(drafter, modules, anchors, batched, 4)
            for row in range(3):
                alone = run_backbone(drafter, modules, anchors[row : row + 1], single[row], 4)
                torch.testing.assert_close(hidden[row : row + 1], alone, rtol=1e-5, atol=1e-5)
    assert batched.cache.mask.shape[1] > int(batched.cache.lengths.min())  # holes were really there


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


def test_stop_strings_per_row():
    tokenizer = letter_tokenizer()
    target = successor_target("llama", VOCAB)  # emits consecutive letters
    drafter = forcing_drafter(target, successor(1), block_size=10)
    batch = left_padded([[4, 5], [10], [6, 7, 8]])  # "ab", "g", "cde": "hi" comes at different steps
    kwargs = dict(max_new_tokens=20, stop_strings=["hi"], tokenizer=tokenizer, draft_policy="fixed")
    expected, output = both(target, drafter, batch, **kwargs)
    assert torch.equal(output, expected)
    assert all("hi" in tokenizer.decode(row) for row in expected)


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
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    torch.manual_seed(5)
    rows = [torch.randint(4, 64, (n,)).tolist() for n in (7, 2, 4)]
    kwargs = dict(max_new_tokens=15, repetition_penalty=1.5, no_repeat_ngram_size=2, draft_policy="fixed")
    expected, output = both(target, drafter, left_padded(rows), **kwargs)
    assert torch.equal(output, expected)


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
def prefill_rows(target):
    """Within it, the rows of each forward of `target` that keeps only the last position's logits (a prefill's)."""
    rows = []

    def record(module, args, kwargs):
        if kwargs.get("logits_to_keep") == 1:
            rows.append(kwargs["input_ids"].shape[0])

    hook = target.register_forward_pre_hook(record, with_kwargs=True)
    try:
        yield rows
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
@pytest.mark.parametrize(
    "draft_vocab, branches, policy",
    [(None, 1, "fixed"), ([0, 2, 3], 1, "fixed"), (None, 2, "fixed"), ([0, 2, 3], 3, "fixed"), (None, 2, "adaptive")],
    ids=["full-vocab", "draft-vocab", "tree", "tree-draft-vocab", "tree-adaptive"],
)
def test_sampling_keeps_each_rows_law_with_num_return_sequences(draft_vocab, branches, policy, gpu_like_costs):
    from transformers.generation.logits_process import TemperatureLogitsWarper

    vocab, num_new, per_prompt = 5, 3, 2000
    target = tiny_target("qwen3", vocab_size=vocab, hidden_size=16, num_layers=2, eos_token_id=None, seed=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(4)  # peaked laws, so that a wrong one is told apart (below)
    drafter = tiny_drafter(target, block_size=4, mask_token_id=0)
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
    target = tiny_target("qwen3", vocab_size=vocab, hidden_size=16, num_layers=2, eos_token_id=None, seed=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(4)  # peaked laws, so that every threshold cuts tokens
    drafter = tiny_drafter(target, block_size=4, mask_token_id=0)
    drafter.set_draft_vocab(draft_vocab)
    sampling = dict(temperature=0.8, top_k=0, **truncation)
    law = target._get_logits_processor(GenerationConfig(do_sample=True, **sampling), device="cpu")
    untruncated = LogitsProcessorList([TemperatureLogitsWarper(sampling["temperature"])])
    prompts = [[2, 4, 1], [3]]

    alone, drafted, accepted = sample_with_drafter(
        target, drafter, prompts[0], num_new, draws, seed=11, draft_policy="fixed", **sampling
    )
    torch.manual_seed(7)
    in_batch, stats = sampled_continuations(target, left_padded(prompts), num_new, draws, assistant_model=drafter,
                                            draft_policy="fixed", **sampling)  # fmt: skip
    batch_drafted, batch_accepted = drafts_and_accepted(stats)
    assert 0 < accepted < drafted and 0 < batch_accepted < batch_drafted  # both outcomes of rejection sampling
    for observed, prompt in [(alone, prompts[0]), *zip(in_batch, prompts)]:
        assert chi_square_p_value(observed, exact_sequence_distribution(target, prompt, num_new, law), draws) > 1e-3
    # The test can fail: the same draws are far from the law without the threshold.
    wrong = exact_sequence_distribution(target, prompts[0], num_new, untruncated)
    assert chi_square_p_value(alone, wrong, draws) < 1e-6
    assert chi_square_p_value(in_batch[0], wrong, draws) < 1e-6


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
    with pytest.raises(ValueError, match="output_hidden_states.*or generate one prompt at a time"):
        target.generate(
            **batch, max_new_tokens=4, assistant_model=drafter, return_dict_in_generate=True, output_hidden_states=True
        )
    with pytest.raises(ValueError, match="output_hidden_states.*or drop domino_branches"):  # one prompt, as a tree
        target.generate(batch["input_ids"][:1], max_new_tokens=4, assistant_model=drafter, domino_branches=2,
                        return_dict_in_generate=True, output_hidden_states=True)  # fmt: skip
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
    for rows, options, fix in ((slice(None), {}, "generate one prompt at a time"),
                               (slice(0, 1), {"domino_branches": 2}, "drop domino_branches")):  # fmt: skip
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
    # successor of 31, or token 12), and drafts accepted: each row's scores come from verification forwards.
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
    emits_pad = torch.full((VOCAB,), -float("inf"))
    emits_pad[0] = 0.0
    for column in range(11):
        for row, end in enumerate(ends):
            if column < end:
                torch.testing.assert_close(output.scores[column][row], expected.scores[column][row])
                torch.testing.assert_close(output.logits[column][row], expected.logits[column][row])
            else:  # a finished row emits the pad token with certainty
                assert torch.equal(output.scores[column][row], emits_pad)
                assert torch.equal(output.logits[column][row], emits_pad)
    assert not torch.equal(output.scores[1], output.logits[1])  # the bias acted
    only = target.generate(**batch, **{**kwargs, "output_logits": False}, assistant_model=drafter)
    assert only.logits is None and len(only.scores) == 11


def test_sampled_scores_are_what_each_token_was_drawn_from():
    # Sampled rows differ from the target alone's, so check each token's raw logits against one forward over the
    # row's own output, and its scores against them through the call's warper (temperature).
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    torch.manual_seed(3)
    batch = left_padded([torch.randint(4, 64, (n,)).tolist() for n in (5, 2)])
    output = target.generate(**batch, max_new_tokens=10, do_sample=True, temperature=0.7, top_k=0,
                             num_return_sequences=2, return_dict_in_generate=True, output_scores=True,
                             output_logits=True, assistant_model=drafter, draft_policy="fixed")  # fmt: skip
    sequences, width = output.sequences, batch["input_ids"].shape[1]
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
def test_a_batch_continuing_a_filled_cache_is_identical_to_the_target_alone(arch, policy):
    # Each row's second turn: the whole padded sequences with their mask, the first turn's cache passed back. The
    # prefill reads only the new columns, and the drafter starts from them.
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
    assert torch.equal(output, expected)
    # A batch's own cache ends empty (rows leave it as they finish, and all-hole columns are cropped): continuing it
    # reads every column again, which is still exact.
    emptied = DynamicCache(config=target.config)
    output = target.generate(**first, do_sample=False, max_new_tokens=6, min_new_tokens=6, **cache_argument(emptied),
                             assistant_model=drafter, draft_policy=policy)  # fmt: skip
    assert torch.equal(output, answered) and emptied.get_seq_length() == 0
    assert torch.equal(target.generate(**batch, do_sample=False, max_new_tokens=13, **cache_argument(emptied),
                                       assistant_model=drafter, draft_policy=policy), fresh)  # fmt: skip
    with pytest.raises(ValueError, match="the whole sequences"):  # new columns only: the rows' padding is unknown
        target.generate(turn, attention_mask=batch["attention_mask"], max_new_tokens=4, **cache_argument(copy.deepcopy(cache)),
                        assistant_model=drafter)  # fmt: skip
    with pytest.raises(ValueError, match="holds 3 rows and the batch has 6"):
        target.generate(**batch, max_new_tokens=4, do_sample=True, num_return_sequences=2,
                        **cache_argument(copy.deepcopy(cache)), assistant_model=drafter)  # fmt: skip


# ---------------------------------------------------------------------------- trees of first-token branches
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_tree_forward_gives_each_branch_what_a_forward_of_that_branch_alone_gives(arch, attention):
    # Each branch sees the cache, the anchor and its own drafts at the right positions, never another branch's.
    from hf_domino.ragged_cache_domino import TreeLayout, adds_its_mask, ragged_forward

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

"""A drafted batch's caches: the target's ragged cache compacted or not, its layers growing in place, and the
drafter's ragged context, each giving what the plain caches give."""

from __future__ import annotations

import pytest
import torch
from conftest import forcing_drafter, successor_target, tiny_drafter, tiny_target
from test_batching import PARTIAL, both, left_padded
from test_generation import VOCAB
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from hf_domino import ragged_cache_domino
from hf_domino.cache_domino import BufferedLayer, buffer_layers
from hf_domino.drafting_domino import DrafterContext, run_backbone
from hf_domino.modeling_domino import TargetModules
from hf_domino.ragged_batch_domino import BatchedDrafterContext, run_batched_backbone
from hf_domino.ragged_cache_domino import RaggedCache


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
        counts = [appends[cycle][row] for row in range(3)]
        features = torch.randn(3, max(counts), size)
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

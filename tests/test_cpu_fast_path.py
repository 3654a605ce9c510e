"""The CPU fast path (`hf_domino.prepare_for_cpu_decoding`): oneDNN-prepacked linear layers, same weights, same
greedy output as the prepared target alone, with tiny real models and the real SmolLM2 target."""

from __future__ import annotations

import copy
import logging
import pickle
import warnings
from types import SimpleNamespace

import pytest
import torch
from conftest import forcing_drafter, successor_target, tiny_drafter, tiny_target
from torch import nn
from torch.nn import functional as F
from transformers import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import hf_domino
from hf_domino import (
    TargetModules,
    batch_policy_domino,
    cost_model_domino,
    cpu_fast_path,
    generation_domino,
    prepacked_linear,
    prepare_for_cpu_decoding,
)
from hf_domino.cpu_fast_path import (
    GROUPED_KV_ATTENTION,
    PrepackedLinear,
    eager_linears,
    grouped_matmul_attention,
    is_prepared_for_cpu_decoding,
    packable_dtypes,
    sdpa_grouped_kv_forward,
)

pytestmark = pytest.mark.skipif(not packable_dtypes(), reason="this torch build has no oneDNN")


def linears(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]


def greedy(target, input_ids, max_new_tokens=24, **kwargs):
    return target.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens, do_sample=False, **kwargs
    )


def prompt(vocab_size: int, length: int = 7, seed: int = 0) -> torch.LongTensor:
    return torch.randint(4, vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------------- what it changes
def test_prepare_replaces_every_linear_keeps_the_weights_and_is_idempotent(monkeypatch):
    target = tiny_target("llama", tie_word_embeddings=True)
    drafter = tiny_drafter(target)
    drafter.set_draft_vocab(torch.arange(10, 40))
    weights = {name: param for name, param in target.named_parameters(remove_duplicate=False)}
    state = {key: value.clone() for key, value in target.state_dict().items()}

    report = prepare_for_cpu_decoding(target, drafter)

    assert sorted(report.prepacked["target"]) == sorted(linears(target)) and "lm_head" in report.prepacked["target"]
    assert sorted(report.prepacked["drafter"]) == sorted(linears(drafter))
    assert all(type(m) is PrepackedLinear for m in target.modules() if isinstance(m, nn.Linear))
    assert report.packed_bytes > 0 and "prepacked" in str(report) and report.changed
    assert len(target.lm_head._row_sets) == 1  # the draft vocabulary's rows, packed before the first draft
    # Same parameter objects: tied weights stay tied, and the state dict is what it was.
    assert target.lm_head.weight is target.model.embed_tokens.weight
    for name, param in target.named_parameters(remove_duplicate=False):
        assert param is weights[name]
    assert target.state_dict().keys() == state.keys()
    assert all(torch.equal(value, state[key]) for key, value in target.state_dict().items())

    # The adaptive policy's verify costs are measured here, once per target: not in the first generate().
    assert (
        cost_model_domino.cached_verify_cost(target).seconds.keys()
        == report.verify_ms.keys()
        == set(cost_model_domino.CALIBRATION_LENGTHS)
    )
    assert "verifying 1/2/3/5/9/17 tokens costs" in str(report)
    for module in (cost_model_domino, generation_domino):
        monkeypatch.setattr(module, "measure_verify_cost", lambda *args, **kwargs: pytest.fail("measured again"))
    greedy(target, prompt(target.config.vocab_size), assistant_model=drafter)

    again = prepare_for_cpu_decoding(target, drafter)  # not measured again either
    assert not again.changed and again.packed_bytes == 0 and again.verify_ms
    monkeypatch.undo()

    # A drafter built for another target: preparing still works; generate() refuses the pair, naming the fix.
    deep = tiny_drafter(tiny_target("llama", num_layers=12), target_layer_ids=[2, 10])
    assert not prepare_for_cpu_decoding(tiny_target("llama"), deep).verify_ms
    assert again.already == {"target": len(linears(target)), "drafter": len(linears(drafter))}
    assert is_prepared_for_cpu_decoding(target) and is_prepared_for_cpu_decoding(drafter)


def test_prepare_for_a_batch_size_measures_its_shapes_so_no_batched_call_does(monkeypatch):
    target = tiny_target("qwen3", vocab_size=96, hidden_size=64)
    drafter = tiny_drafter(target, block_size=5)
    with pytest.raises(ValueError, match="batch_size=0: pass the largest number of sequences"):
        prepare_for_cpu_decoding(target, drafter, batch_size=0)
    with pytest.raises(TypeError, match="got str for the drafter: load it first"):  # an AttributeError
        prepare_for_cpu_decoding(target, "path/to/drafter")
    assert not is_prepared_for_cpu_decoding(target)  # refused before anything changed

    report = prepare_for_cpu_decoding(target, drafter, batch_size=3)

    # Batch 1's lengths and 3 rows x each length: what a call of 1 to 3 rows verifies, read between the two.
    lengths = cost_model_domino.CALIBRATION_LENGTHS
    assert sorted(report.verify_ms) == sorted({*lengths, *(3 * n for n in lengths)})
    assert cost_model_domino.cached_verify_cost(target).seconds.keys() == report.verify_ms.keys()
    for module in (cost_model_domino, batch_policy_domino):
        monkeypatch.setattr(module, "measure_verify_cost", lambda *args, **kwargs: pytest.fail("measured again"))
    rows = [prompt(96, length=n, seed=n)[0].clamp(min=4) for n in (7, 3, 11)]
    width = max(len(row) for row in rows)
    for count in (3, 2):
        batch = {
            "input_ids": torch.stack([F.pad(row, (width - len(row), 0)) for row in rows[:count]]),
            "attention_mask": torch.stack(
                [F.pad(torch.ones_like(row), (width - len(row), 0)) for row in rows[:count]]
            ),
        }
        expected = target.generate(**batch, max_new_tokens=12, do_sample=False)
        output = target.generate(**batch, max_new_tokens=12, do_sample=False, assistant_model=drafter)
        assert torch.equal(output, expected)
    # A larger batch than prepared for measures its own shapes at its first call, as without preparing.
    monkeypatch.undo()
    assert prepare_for_cpu_decoding(target, drafter, batch_size=4).verify_ms.keys() >= {4 * n for n in lengths}


def test_an_unprepared_cpu_target_whose_short_verifications_cost_much_is_told_the_fix(monkeypatch, caplog):
    from hf_domino.cost_model_domino import VerifyCost, cpu_fast_path_hint

    target = tiny_target("qwen3", vocab_size=96, hidden_size=64)
    drafter = tiny_drafter(target, block_size=5)
    slow = VerifyCost({1: 0.010, 2: 0.017, 3: 0.021, 5: 0.022})  # this 2-core EPYC's eager products, in shape
    assert "1.7x" in cpu_fast_path_hint(target, slow) and "prepare_for_cpu_decoding(target, drafter)" in (
        cpu_fast_path_hint(target, slow)
    )
    assert cpu_fast_path_hint(target, VerifyCost({1: 0.010, 2: 0.011, 3: 0.012})) is None  # nothing to gain
    assert cpu_fast_path_hint(target, VerifyCost({2: 0.010, 4: 0.017})) is None  # a batch's table: per-row costs

    # Said once, when a call measures such a table; the call is the target's own as ever.
    monkeypatch.setattr(generation_domino, "measure_verify_cost", lambda *args, **kwargs: VerifyCost(slow.seconds))
    cost_model_domino.swap_verify_cost(target, None)
    logging.Logger.warning_once.cache_clear()  # transformers' once-per-message warnings (another test's table)
    input_ids = prompt(96)
    expected = greedy(target, input_ids)
    with caplog.at_level("WARNING"):
        assert torch.equal(greedy(target, input_ids, assistant_model=drafter), expected)
    assert caplog.text.count("prepare_for_cpu_decoding(target, drafter)") == 1

    hooked = copy.deepcopy(target)  # offloaded by accelerate: preparing leaves hooked layers as they are
    for module in hooked.modules():
        module._hf_hook = None
    assert cpu_fast_path_hint(hooked, slow) is None
    assert cpu_fast_path_hint(copy.deepcopy(target).to("meta"), slow) is None  # not (all) on the CPU
    prepare_for_cpu_decoding(target, drafter)
    assert cpu_fast_path_hint(target, slow) is None  # prepared: its products are packed already


def test_models_off_the_cpu_are_left_untouched():
    # A model whose parameters are not on the CPU (here: the meta device, standing in for a GPU) is skipped.
    with torch.device("meta"):
        target = tiny_target("qwen3")
    report = prepare_for_cpu_decoding(target)
    assert "not the CPU" in report.skipped["target"] and not report.changed
    assert not is_prepared_for_cpu_decoding(target)


def test_inference_tensors_are_not_packed_and_the_report_says_what_changed():
    # An inference tensor has no version counter: a packed copy of one went on multiplying by the old weights after
    # load_state_dict under inference mode. And a target whose products stay as they are, but whose attention was
    # switched, was reported "untouched".
    with torch.inference_mode():
        target = tiny_target("qwen3", seed=0)
        report = prepare_for_cpu_decoding(target, measure_products=False)
        input_ids = prompt(64)
        greedy(target, input_ids)
        target.load_state_dict(tiny_target("qwen3", seed=7).state_dict())
        assert torch.equal(greedy(target, input_ids), greedy(tiny_target("qwen3", seed=7), input_ids))
    assert "inference tensors" in report.skipped["target"] and not any(report.prepacked.values())
    assert f"target: {GROUPED_KV_ATTENTION} attention, no nn.Linear prepacked (its weights are inference" in str(
        report
    )
    target = tiny_target("qwen3").double()
    report = prepare_for_cpu_decoding(target, measure_products=False)
    assert report.changed and str(report).startswith(f"target: {GROUPED_KV_ATTENTION} attention, no nn.Linear")


@torch.no_grad()
def test_a_target_quantized_by_torchao_keeps_its_quantized_products():
    # torchao's weights are tensor subclasses that report the float dtype they compute in; oneDNN's repacking of
    # them raised NotImplementedError inside prepare_for_cpu_decoding. Weight-only int8 keeps a forward's logits per
    # token independent of how many tokens it reads, so outputs stay the quantized target's own.
    quantization = pytest.importorskip("torchao.quantization", reason="torchao is not a dependency; run where it is")
    target = tiny_target("qwen3", vocab_size=96, hidden_size=64)
    quantization.quantize_(target, quantization.Int8WeightOnlyConfig())
    drafter = tiny_drafter(target, block_size=5)
    drafter.set_draft_vocab(torch.arange(0, 96, 2))
    input_ids = prompt(96)
    expected = greedy(target, input_ids)
    report = prepare_for_cpu_decoding(target, drafter)
    assert "quantized weights are left as they are" in report.skipped["target"] and report.prepacked["drafter"]
    assert torch.equal(greedy(target, input_ids), expected)
    for options in ({"draft_policy": "fixed", "num_speculative_tokens": 4}, {}):
        assert torch.equal(greedy(target, input_ids, assistant_model=drafter, **options), expected), options


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_models_are_left_untouched():
    target = tiny_target("qwen3").cuda()
    drafter = tiny_drafter(target).cuda().half()
    report = prepare_for_cpu_decoding(target, drafter)
    assert set(report.skipped) == {"target", "drafter"} and not report.changed
    assert drafter.dtype == torch.float16 and not is_prepared_for_cpu_decoding(target)


@torch.no_grad()
def test_products_over_few_rows_stay_eager_where_they_measured_faster(monkeypatch):
    # Which product is faster depends on the CPU and the shape (docs/benchmarks.md, "Packed or not, per row count");
    # here a CPU is made up where F.linear wins at 1-3 and 6-8 rows (7 unmeasured, between two that won) and at 17.
    eager_wins = {1, 2, 3, 6, 8, 17}
    monkeypatch.setattr(
        PrepackedLinear, "_product_seconds", lambda self, rows: (1.0, 2.0) if rows in eager_wins else (2.0, 2.0)
    )
    torch.manual_seed(0)
    layer, other_shape = nn.Linear(64, 96), nn.Linear(96, 64)
    report = prepare_for_cpu_decoding(nn.Sequential(layer, other_shape))
    assert layer._eager_rows == other_shape._eager_rows == {1, 2, 3, 6, 7, 8, 17}
    assert report.eager_rows["target"] == {
        (96, 64, torch.float32): layer._eager_rows,
        (64, 96, torch.float32): layer._eager_rows,
    }
    assert "2 of 2 weight shapes multiply up to 17 rows with F.linear" in str(report)
    packed = layer.packed_weight()
    for rows, eager in ((1, True), (2, True), (4, False), (7, True), (12, False), (17, True), (34, False)):
        x = torch.randn(1, rows, 64)
        expected = F.linear(x, layer.weight, layer.bias) if eager else torch.ops.mkldnn._linear_pointwise(
            x, packed, layer.bias, "none", [], ""
        )  # fmt: skip
        assert torch.equal(layer(x), expected), rows  # bit for bit the product chosen
    batch = torch.randn(2, 3, 64)  # rows are tokens x sequences: 6, eager
    assert torch.equal(layer(batch), F.linear(batch, layer.weight, layer.bias))
    # Measured for float32: another dtype goes back to packed products until measured again.
    if torch.bfloat16 in packable_dtypes():
        layer.to(torch.bfloat16)
        x = torch.randn(1, 2, 64, dtype=torch.bfloat16)
        layer(x)
        assert layer._eager_rows == frozenset()
    # Not measuring leaves every product packed.
    plain = nn.Linear(64, 96)
    assert not prepare_for_cpu_decoding(plain, measure_products=False).eager_rows and not plain._eager_rows


def test_measured_dispatch_times_each_weight_shape_once_and_is_real(monkeypatch):
    # The real timings, at tiny shapes: each shape's decision is a set of the measured row counts (or those between).
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 8))
    second = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 16))  # a drafter: one shape of the target's, one new
    calls = []
    original = PrepackedLinear._product_seconds

    def spy(self, rows):
        calls.append((self.out_features, rows))
        return original(self, rows)

    monkeypatch.setattr(PrepackedLinear, "_product_seconds", spy)
    report = prepare_for_cpu_decoding(model, second)
    assert sorted(calls) == sorted((out, rows) for out in (32, 8, 16) for rows in prepacked_linear.DISPATCH_ROWS)
    assert second[0]._eager_rows == model[0]._eager_rows
    assert model[0]._eager_rows == model[1]._eager_rows and set(report.eager_rows["target"]) == {
        (32, 32, torch.float32),
        (8, 32, torch.float32),
    }
    assert all(rows <= max(prepacked_linear.DISPATCH_ROWS) for rows in model[0]._eager_rows)


@torch.no_grad()  # as in generate(): with autograd on, products fall back to F.linear
def test_products_match_eager_and_follow_weight_changes(monkeypatch):
    # Packed at every row count (a measured dispatch sent 1-17 rows to F.linear here, past every check below).
    packed_products = []
    product = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: packed_products.append(1) or product(*a))
    torch.manual_seed(0)
    layer = nn.Linear(24, 40)
    reference = copy.deepcopy(layer)
    prepare_for_cpu_decoding(layer, measure_products=False)
    for shape in [(1, 1, 24), (1, 3, 24), (2, 17, 24), (5, 24), (1, 0, 24)]:
        x = torch.randn(shape)
        packed_products.clear()
        assert torch.allclose(layer(x), reference(x), atol=1e-5)
        assert packed_products  # the packed product ran
        with eager_linears():
            assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    x = torch.randn(1, 3, 24)
    rows = torch.tensor([3, 0, 39, 17])
    assert torch.allclose(layer.rows_linear(x, rows), reference(x)[..., rows], atol=1e-5)
    other = torch.tensor([1, 2, 3, 4])  # another row set of the same size, then changed in place
    assert torch.allclose(layer.rows_linear(x, other), reference(x)[..., other], atol=1e-5)
    other[0] = 30
    assert torch.allclose(layer.rows_linear(x, other), reference(x)[..., other], atol=1e-5)
    # In-place update, new tensor, load_state_dict: the packed copy follows the weight.
    layer.weight.mul_(2)
    reference.weight.mul_(2)
    packed_products.clear()
    assert torch.allclose(layer(x), reference(x), atol=1e-5) and packed_products
    assert torch.allclose(layer.rows_linear(x, rows), reference(x)[..., rows], atol=1e-5)
    layer.weight = nn.Parameter(torch.randn(40, 24))
    reference.load_state_dict(layer.state_dict())
    assert torch.allclose(layer(x), reference(x), atol=1e-5)
    layer.load_state_dict({"weight": torch.zeros(40, 24), "bias": torch.ones(40)})
    assert torch.equal(layer(x), torch.ones(1, 3, 40))
    layer.weight.data = torch.randn(40, 24)  # new data for the same Parameter, its version unchanged
    assert torch.allclose(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5)


def test_updates_through_data_are_followed_as_a_lora_merge_makes_them():
    """`.data` hands out the values with a version counter of their own, so an update through it (PEFT's merge of a
    LoRA adapter, `base_layer.weight.data += delta`; an edit of a tied embedding's rows) left the packed copy stale:
    the prepared target answered with its old weights, silently."""
    target = tiny_target("qwen3", tie_word_embeddings=True, seed=0)
    reference = copy.deepcopy(target)
    prepare_for_cpu_decoding(target, measure_products=False)  # every product packed
    input_ids = prompt(target.config.vocab_size)
    assert greedy(target, input_ids).equal(greedy(reference, input_ids))

    def low_rank(weight: torch.Tensor) -> torch.Tensor:  # a LoRA adapter's delta, rank 2
        generator = torch.Generator().manual_seed(weight.shape[0])
        return torch.randn(weight.shape[0], 2, generator=generator) @ torch.randn(
            2, weight.shape[1], generator=generator
        )

    edits = [
        lambda model: model.model.layers[0].self_attn.q_proj.weight.data.__iadd__(low_rank(model.lm_head.weight)[:32]),
        lambda model: model.model.layers[0].mlp.down_proj.weight.data.copy_(torch.full((32, 64), 0.05)),
        lambda model: model.model.embed_tokens.weight.data[10:20].mul_(5),  # the LM head's rows too, being tied
        lambda model: model.lm_head.weight.data.mul_(2),
    ]
    for edit in edits:
        edit(target)
        edit(reference)
        with torch.no_grad():
            assert torch.allclose(target(input_ids).logits, reference(input_ids).logits, atol=1e-5)
        assert greedy(target, input_ids).equal(greedy(reference, input_ids))
    # A parametrization moves the weight out of the module's parameters: the product is F.linear's (a KeyError before).
    layer = target.model.layers[0].mlp.up_proj
    torch.nn.utils.parametrize.register_parametrization(layer, "weight", _Doubled())
    torch.nn.utils.parametrize.register_parametrization(reference.model.layers[0].mlp.up_proj, "weight", _Doubled())
    with torch.no_grad():
        assert torch.allclose(target(input_ids).logits, reference(input_ids).logits, atol=1e-5)


class _Doubled(nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return 2 * weight


def test_autograd_dtype_changes_copies_and_pickles_fall_back_or_repack():
    torch.manual_seed(0)
    layer = nn.Linear(16, 8)
    prepare_for_cpu_decoding(layer)
    x = torch.randn(3, 16, requires_grad=True)
    layer(x).sum().backward()  # training: the eager product, with gradients
    assert layer.weight.grad is not None and torch.allclose(x.grad, layer.weight.sum(0).expand(3, 16))
    layer.zero_grad()
    twin = copy.deepcopy(layer)
    restored = pickle.loads(pickle.dumps(layer))
    with torch.no_grad():
        for other in (twin, restored):
            assert type(other) is PrepackedLinear and torch.allclose(other(x), layer(x), atol=1e-6)
        layer.to(torch.bfloat16)
        out = layer(x.detach().bfloat16())
        assert out.dtype == torch.bfloat16
        assert torch.allclose(out.float(), F.linear(x, twin.weight, twin.bias), atol=0.1)


def test_save_pretrained_of_prepared_models(tmp_path):
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    drafter.set_draft_vocab(torch.arange(5, 50))
    prepare_for_cpu_decoding(target, drafter)
    target.save_pretrained(tmp_path / "target")
    drafter.save_pretrained(tmp_path / "drafter")
    reloaded = type(target).from_pretrained(tmp_path / "target").eval()
    redrafter = hf_domino.DominoForSpeculation.from_pretrained(tmp_path / "drafter").eval()
    assert not is_prepared_for_cpu_decoding(reloaded) and torch.equal(redrafter.draft_vocab, drafter.draft_vocab)
    assert reloaded.config._attn_implementation == redrafter.config._attn_implementation == "sdpa"
    for model, copy_ in ((target, reloaded), (drafter, redrafter)):
        for key, value in model.state_dict().items():
            assert torch.equal(value, copy_.state_dict()[key]), key


# ----------------------------------------------------------------------------------------------------- attention
def grouped_attention_inputs(batch: int, queries: int, kv_length: int, heads: int = 9, kv_heads: int = 3):
    """What a verification (or a batch) meets: queries at the end of the cache, causal among themselves, rows
    left-padded by different amounts."""
    generator = torch.Generator().manual_seed(queries)
    query = torch.randn(batch, heads, queries, 16, generator=generator)
    key, value = (torch.randn(batch, kv_heads, kv_length, 16, generator=generator) for _ in range(2))
    positions = torch.arange(kv_length)
    mask = positions[None, :] <= torch.arange(kv_length - queries, kv_length)[:, None]
    mask = torch.stack([mask & (positions >= 2 * row) for row in range(batch)])[:, None]
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True, training=False)
    return module, query, key, value, mask


@pytest.mark.parametrize(
    "batch, queries, kv_length, path",
    [
        (1, 2, 9, "fused"), (1, 5, 40, "fused"), (1, 17, 300, "fused"), (2, 1, 20, "sdpa"), (8, 9, 60, "fused"),
        (2, 2, 30, "matmul"), (3, 4, 50, "matmul"), (8, 3, 200, "matmul"),
    ],
)  # fmt: skip
def test_grouped_kv_attention_is_sdpa(batch, queries, kv_length, path):
    # Bit for bit where sdpa or torch's fused kernel runs (reading the groups in place); to fp32 rounding where a
    # batch's few queries run as matmuls per key/value head (and exactly what `grouped_matmul_attention` gives: that
    # path ran).
    module, query, key, value, mask = grouped_attention_inputs(batch, queries, kv_length)
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
    output, _ = sdpa_grouped_kv_forward(module, query, key, value, mask, scaling=0.25)
    assert output.shape == expected.shape == (batch, queries, 9, 16)
    if path != "matmul":
        assert torch.equal(output, expected)
    else:
        assert torch.allclose(output, expected, atol=1e-6, rtol=1e-5)
        assert torch.equal(output, grouped_matmul_attention(query, key, value, mask, 0.25).transpose(1, 2))


def test_grouped_matmul_attention_gives_a_query_that_sees_no_key_finite_weights():
    # A short left-padded prompt: the padding's own queries may see nothing. NaN there would reach every real token
    # through the values of later layers (weight 0 times NaN).
    module, query, key, value, mask = grouped_attention_inputs(4, 3, 5)
    mask[1, :, 0] = False  # rows 1 and 3: the first query sees no key
    mask = mask[[0, 1, 0, 1]]
    output, _ = sdpa_grouped_kv_forward(module, query, key, value, mask, scaling=0.25)
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
    assert torch.isfinite(output).all()
    keep = torch.ones(4, 3, dtype=torch.bool)
    keep[1::2, 0] = False  # what the fused kernel gives a query with no key is its own business
    assert torch.allclose(output[keep], expected[keep], atol=1e-6, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")  # `cache` is new in 5.24
def test_prepare_reads_grouped_kv_heads_in_place_and_verification_logits_are_unchanged(monkeypatch):
    target = tiny_target("qwen3", vocab_size=96, hidden_size=64)  # 4 query heads over 2 key/value heads
    drafter = tiny_drafter(target)
    report = prepare_for_cpu_decoding(target, drafter)
    assert report.attention == ["target", "drafter"] and f"{GROUPED_KV_ATTENTION} attention" in str(report)
    assert target.config._attn_implementation == drafter.config._attn_implementation == GROUPED_KV_ATTENTION
    assert prepare_for_cpu_decoding(target, drafter).attention == []

    calls = []  # per attention call: "in place" (fused, groups read in place), "matmul", or "repeated"
    attention = F.scaled_dot_product_attention
    matmul_attention = cpu_fast_path.grouped_matmul_attention
    monkeypatch.setattr(
        F,
        "scaled_dot_product_attention",
        lambda *args, **kwargs: (
            calls.append(
                "in place" if kwargs.get("enable_gqa") and kwargs.get("attn_mask") is not None else "repeated"
            )
            or attention(*args, **kwargs)
        ),
    )
    monkeypatch.setattr(
        cpu_fast_path,
        "grouped_matmul_attention",
        lambda *args: calls.append("matmul") or matmul_attention(*args),
    )

    def verification_logits(rows: int) -> torch.Tensor:
        cache = DynamicCache(config=target.config)
        with torch.no_grad():
            target(prompt(96, length=30).expand(rows, -1), past_key_values=cache)
            calls.clear()  # the verification's attention only: 6 tokens after 30, under a mask
            return target(prompt(96, length=6, seed=1).expand(rows, -1), past_key_values=cache).logits

    layers = target.config.num_hidden_layers
    one, batch = verification_logits(1), verification_logits(3)
    assert calls == ["matmul"] * layers  # a batch's 6 queries per row: matmuls per key/value head
    verification_logits(1)
    # one sequence's: the fused kernel, every layer reading the groups in place (sdpa's copies where that rounds
    # differently: torch < 2.9)
    assert calls == ["in place" if cpu_fast_path.GROUPED_KV_IN_PLACE else "repeated"] * layers
    target.set_attn_implementation("sdpa")
    assert torch.equal(one, verification_logits(1))
    assert calls == ["repeated"] * layers  # sdpa repeated them
    expected = verification_logits(3)
    assert torch.allclose(batch, expected, atol=1e-5)  # fp32 rounding apart, the same logits
    assert torch.equal(batch.argmax(-1), expected.argmax(-1))

    # Nothing to gain where every query head has its own key/value head, or where attention is not sdpa.
    for model in (tiny_target("llama", num_key_value_heads=4), tiny_target("qwen3", attn_implementation="eager")):
        implementation = model.config._attn_implementation
        assert prepare_for_cpu_decoding(model).attention == []
        assert model.config._attn_implementation == implementation


# ------------------------------------------------------------------------------------------------------ drafting
def test_draft_vocabulary_logits_read_the_prepacked_head():
    target = tiny_target("llama", vocab_size=96)
    modules = TargetModules.from_target(target)
    hidden = torch.randn(1, 3, target.config.hidden_size)
    vocab = torch.arange(7, 90, 3)
    expected = modules.logits(hidden, vocab)
    prepare_for_cpu_decoding(target)
    assert torch.allclose(modules.logits(hidden, vocab), expected, atol=1e-5)
    assert torch.allclose(modules.logits(hidden)[..., vocab], expected, atol=1e-5)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_greedy_output_is_the_prepared_targets_own(arch):
    target = tiny_target(arch, vocab_size=96, hidden_size=64)
    drafter = tiny_drafter(target, block_size=5)
    drafter.set_draft_vocab(torch.arange(0, 96, 2))
    input_ids = prompt(96)
    prepare_for_cpu_decoding(target, drafter)
    expected = greedy(target, input_ids)
    for options in (
        {"draft_policy": "fixed", "num_speculative_tokens": 2},
        {"draft_policy": "fixed", "num_speculative_tokens": 4, "draft_vocab": False},
        {},
    ):
        assert torch.equal(greedy(target, input_ids, assistant_model=drafter, **options), expected), options


def test_batches_on_the_fast_path_are_the_prepared_targets_own_and_verify_with_matmul_attention(monkeypatch):
    # Rows of different lengths, left-padded: every row's tokens come out of verifications of 1 + k tokens per row,
    # whose attention runs as matmuls per key/value head (4 query heads over 2 here).
    target = tiny_target("qwen3", vocab_size=96, hidden_size=64)
    drafter = tiny_drafter(target, block_size=5)
    prepare_for_cpu_decoding(target, drafter)
    rows = [prompt(96, length=n, seed=n)[0].clamp(min=4) for n in (7, 3, 11)]  # no pad (0) or special tokens
    width = max(len(row) for row in rows)
    batch = {
        "input_ids": torch.stack([F.pad(row, (width - len(row), 0)) for row in rows]),
        "attention_mask": torch.stack([F.pad(torch.ones_like(row), (width - len(row), 0)) for row in rows]),
    }
    expected = target.generate(**batch, max_new_tokens=16, do_sample=False)
    calls = []
    matmul_attention = cpu_fast_path.grouped_matmul_attention
    monkeypatch.setattr(
        cpu_fast_path, "grouped_matmul_attention", lambda *args: calls.append(args[0].shape) or matmul_attention(*args)
    )
    for options in ({"draft_policy": "fixed", "num_speculative_tokens": 2}, {}):
        calls.clear()
        output = target.generate(**batch, max_new_tokens=16, do_sample=False, assistant_model=drafter, **options)
        assert torch.equal(output, expected), options
        if options:  # the adaptive policy's k depends on measured times
            assert any(shape[0] == 3 and shape[2] == 3 for shape in calls)  # 3 rows x (1 + 2) queries


def test_accepted_drafts_on_the_fast_path_are_lossless():
    # A target that counts up and a drafter forced to draft it: most drafts are accepted, so verification of several
    # tokens at once (the multi-row prepacked products) decides the output.
    target = successor_target("qwen3", vocab_size=32)
    drafter = forcing_drafter(target, [(t + 1) % 32 for t in range(32)])
    input_ids = torch.tensor([[5, 6, 7]])
    eager_expected = greedy(target, input_ids, max_new_tokens=20)
    prepare_for_cpu_decoding(target, drafter)
    expected = greedy(target, input_ids, max_new_tokens=20)
    assert torch.equal(expected, eager_expected)
    output = greedy(target, input_ids, max_new_tokens=20, assistant_model=drafter, draft_policy="fixed")
    assert torch.equal(output, expected)
    assert drafter.last_generation_stats.mean_acceptance_length > 3


def test_fp16_drafter_is_cast_by_the_fast_path_and_warned_about_without_it():
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target).half()
    input_ids = prompt(64)
    with pytest.warns(UserWarning, match=r"drafter.to\(target.dtype\)"):
        greedy(target, input_ids, max_new_tokens=4, assistant_model=drafter)
    report = prepare_for_cpu_decoding(target, drafter)
    assert drafter.dtype == torch.float32 and "cast from torch.float16" in str(report)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        greedy(target, input_ids, max_new_tokens=4, assistant_model=drafter)


# ----------------------------------------------------------------------------------------------- the real target
def test_real_smollm2_with_the_shipped_drafter_on_the_fast_path():
    from hf_domino.assets import SHIPPED_DRAFTER, encode_chat, load_smollm2
    from hf_domino.prompt_sets import load_mtbench

    target, tokenizer = load_smollm2()
    drafter = hf_domino.DominoForSpeculation.from_pretrained(SHIPPED_DRAFTER).eval()  # fp16, as shipped
    input_ids = encode_chat(tokenizer, load_mtbench(limit=1)[0])
    with torch.no_grad():
        eager_logits = target(input_ids).logits[0, -4:]
    report = prepare_for_cpu_decoding(target, drafter)
    assert drafter.dtype == torch.float32 and len(report.prepacked["target"]) == 30 * 7 + 1
    with torch.no_grad():
        # Another kernel sums in another order: the same logits up to fp32 rounding, not bit for bit.
        assert torch.allclose(target(input_ids).logits[0, -4:], eager_logits, atol=2e-3, rtol=0)
    expected = greedy(target, input_ids, max_new_tokens=32)
    for options in ({"draft_policy": "fixed", "num_speculative_tokens": 2}, {}):
        assert torch.equal(greedy(target, input_ids, max_new_tokens=32, assistant_model=drafter, **options), expected)

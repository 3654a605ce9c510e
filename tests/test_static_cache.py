"""A static key/value cache, and the compiled forward transformers runs on one, with a Domino drafter.

transformers 5.24 rolls a static cache back after a rejected draft (`StaticLayer.crop`), and its assisted loop then
compiles the target's forward wherever generate() compiles the target alone's (a static cache on a GPU, or any
device with `CompileConfig._compile_all_devices`). The drafter reads the same hidden states either way, so every
output must be the target alone's, and sampling must draw exactly what it draws with the default dynamic cache.
"""

from __future__ import annotations

import pytest
import torch
from conftest import own_drafts, tiny_drafter, tiny_target
from transformers import CompileConfig, StaticCache
from transformers.cache_utils import StaticLayer

from hf_domino.cache_domino import CACHE_ARGUMENT, cache_argument
from hf_domino.options_domino import static_caches_roll_back

rolls_back = pytest.mark.skipif(
    not static_caches_roll_back(),
    reason="static caches roll back from transformers 5.24 (the refusal is tested below)",
)


def prompts(count: int = 3) -> list[torch.LongTensor]:
    return [torch.randint(4, 64, (1, 5 + i), generator=torch.Generator().manual_seed(i)) for i in range(count)]


def caches_seen(target) -> tuple[list[type], object]:
    """The cache class of every target forward (to prove the static cache is the one verifying)."""
    seen: list[type] = []
    handle = target.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(type(kwargs.get(CACHE_ARGUMENT))), with_kwargs=True
    )
    return seen, handle


def compiling_here() -> CompileConfig:
    """A compile config that makes generate() compile on the CPU (transformers' `_compile_all_devices`), with dynamo's
    `eager` backend: its graphs and guards without inductor's minutes of C++ compilation."""
    from hf_domino.cpu_fast_path import compiling_on_any_device

    return compiling_on_any_device(CompileConfig(backend="eager"))


@rolls_back
@pytest.mark.parametrize("policy", [{}, {"draft_policy": "fixed"}], ids=["adaptive", "fixed"])
def test_static_cache_greedy_is_the_target_alones(arch, policy):
    target = tiny_target(arch)
    drafter = tiny_drafter(target)
    # The adaptive policy's first call measures verify costs on a scratch dynamic cache (a static one has no room for
    # a 17-token block past max_length): once per process, so before the forwards below are watched.
    target.generate(prompts(1)[0], max_new_tokens=2, cache_implementation="static", assistant_model=drafter, **policy)
    for prompt in prompts():
        expected = target.generate(prompt, max_new_tokens=24, do_sample=False)
        assert torch.equal(
            target.generate(prompt, max_new_tokens=24, do_sample=False, cache_implementation="static"), expected
        )
        seen, handle = caches_seen(target)
        try:
            output = target.generate(
                prompt, max_new_tokens=24, do_sample=False, cache_implementation="static", assistant_model=drafter,
                **policy,
            )  # fmt: skip
        finally:
            handle.remove()
        assert torch.equal(output, expected)
        assert set(seen) == {StaticCache}
        # Blocks were verified, and rejections rolled back: the drafter's own with the fixed policy; the adaptive one
        # may verify copies alone (a drafter this random does not pay).
        stats = drafter.last_generation_stats
        assert (own_drafts(stats) if policy else sum(stats.drafted)) > 0


@rolls_back
def test_static_cache_sampling_draws_what_the_dynamic_cache_draws(arch):
    # Same seed, same draws: the static cache changes where keys and values live, not one logit, so the sampling law
    # (checked by chi-square with the dynamic cache, test_generation.py) holds here too.
    target = tiny_target(arch)
    drafter = tiny_drafter(target)
    for seed, prompt in enumerate(prompts(4)):
        outputs = []
        for cache_implementation in (None, "static"):
            torch.manual_seed(seed)
            outputs.append(
                target.generate(
                    prompt,
                    max_new_tokens=24,
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    assistant_model=drafter,
                    draft_policy="fixed",
                    cache_implementation=cache_implementation,
                )  # fmt: skip
            )
        assert torch.equal(*outputs)
        assert own_drafts(drafter.last_generation_stats) > 0


@rolls_back
def test_a_static_cache_passed_back_continues_a_chat():
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    cache = StaticCache(config=target.config, max_cache_len=128)
    conversation = prompts(1)[0]
    for turn in range(3):
        expected = target.generate(conversation, max_new_tokens=12, do_sample=False)
        output = target.generate(
            conversation, max_new_tokens=12, do_sample=False, **cache_argument(cache), assistant_model=drafter
        )
        assert torch.equal(output, expected), f"turn {turn}"
        user = torch.randint(4, 64, (1, 4), generator=torch.Generator().manual_seed(100 + turn))
        conversation = torch.cat([output, user], dim=1)


@rolls_back
def test_the_compiled_forward_verifies_the_blocks(fresh_dynamo):
    # transformers compiles the verifying forward with a static cache on GPUs; `_compile_all_devices` does it here.
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    compile_config = compiling_here()
    for prompt in prompts(2):
        expected = target.generate(prompt, max_new_tokens=20, do_sample=False)
        output = target.generate(
            prompt, max_new_tokens=20, do_sample=False, cache_implementation="static",
            compile_config=compile_config, assistant_model=drafter, draft_policy="fixed",
        )  # fmt: skip
        assert torch.equal(output, expected)
    assert hasattr(target, "_compiled_call")  # the loop ran the compiled forward
    assert max(drafter.last_generation_stats.acceptance_lengths) > 1


@rolls_back
def test_a_chunked_prefill_runs_its_chunks_compiled_where_the_target_alones_are(fresh_dynamo):
    # transformers' `_prefill` runs each chunk through the compiled forward where it compiles (a static cache on a
    # GPU): the chunks read ahead of the drafted loop's prefill take the same forward, so they round alike.
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    options = dict(
        max_new_tokens=16, do_sample=False, cache_implementation="static", compile_config=compiling_here(),
        prefill_chunk_size=3,
    )  # fmt: skip
    compiled_widths: list[int] = []
    get_compiled_call = target.get_compiled_call

    def spied(compile_config):
        call = get_compiled_call(compile_config)
        return lambda **kwargs: (compiled_widths.append(kwargs["input_ids"].shape[1]), call(**kwargs))[1]

    target.get_compiled_call = spied
    prompt = prompts(1)[0]
    expected = target.generate(prompt, **options)
    alone, compiled_widths[:] = list(compiled_widths), []
    output = target.generate(prompt, **options, assistant_model=drafter, draft_policy="fixed")
    assert torch.equal(output, expected)
    leading = -(-prompt.shape[1] // 3) - 1
    assert compiled_widths[:leading] == alone[:leading] == [3] * leading


@rolls_back
def test_a_target_prepared_for_cpu_decoding_compiles_whole(fresh_dynamo):
    # The fast path's packed products are for eager forwards; traced, their checks broke the graph in every layer and
    # recompiled it per module (a compiled SmolLM2 ran 0.7x its eager self). Compiled, they are plain linears.
    from torch._dynamo.utils import counters

    from hf_domino import prepare_for_cpu_decoding

    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    prompt = prompts(1)[0]
    compiled = dict(max_new_tokens=20, do_sample=False, cache_implementation="static", compile_config=compiling_here())
    counters.clear()
    expected = target.generate(prompt, **compiled)
    if counters["graph_break"]:  # torch 2.6's dynamo breaks transformers' own forward (its ContextVars, say)
        pytest.skip(f"the unprepared target alone compiles with graph breaks here: {dict(counters['graph_break'])}")
    torch._dynamo.reset()
    prepare_for_cpu_decoding(target, drafter)
    counters.clear()
    output = target.generate(prompt, **compiled, assistant_model=drafter, draft_policy="fixed")
    assert torch.equal(output, expected)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert max(drafter.last_generation_stats.acceptance_lengths) > 1


def test_releases_that_cannot_roll_a_static_cache_back_say_to_upgrade(monkeypatch):
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    monkeypatch.setattr(StaticLayer, "is_croppable", False)  # transformers 5.23
    forwards = []
    target.register_forward_pre_hook(lambda *args: forwards.append(1))
    with pytest.raises(ValueError, match=r"transformers>=5\.24.*drop cache_implementation"):
        target.generate(prompts(1)[0], max_new_tokens=5, cache_implementation="static", assistant_model=drafter)
    assert forwards == []


@rolls_back
def test_a_static_sliding_layer_longer_than_its_window_is_refused_before_the_prefill():
    """A static cache's sliding layer keeps only its window's last tokens, so beyond the window it cannot take rejected
    drafts back (`is_croppable` False): refused before any forward, naming the dynamic cache, which serves the call."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=8, pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )  # fmt: skip
    target = MistralForCausalLM(config).eval()
    drafter = tiny_drafter(target)
    prompt = prompts(1)[0]
    forwards = []
    hook = target.register_forward_pre_hook(lambda *args: forwards.append(1))
    with pytest.raises(ValueError, match=r"StaticSlidingWindowLayer layers cannot be cropped.*default dynamic cache"):
        target.generate(prompt, max_new_tokens=12, cache_implementation="static", assistant_model=drafter)
    assert forwards == []
    hook.remove()
    expected = target.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(target.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=drafter), expected)


# ------------------------------------------------------------------------------ prepare_for_cpu_decoding(compile=True)
@rolls_back
def test_prepare_with_compile_makes_plain_generate_compile_on_the_cpu(fresh_dynamo):
    # One argument instead of a private flag in the user's code: plain generate() then verifies on a static cache with
    # the compiled forward, and the target alone compiles alike. A compile config the user set keeps its settings.
    from hf_domino import prepare_for_cpu_decoding

    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    prompt = prompts(1)[0]
    expected = target.generate(prompt, max_new_tokens=20, do_sample=False)
    conversation = torch.cat([expected, torch.tensor([[7, 8, 9]])], dim=1)  # a chat's next turn
    expected_next = target.generate(conversation, max_new_tokens=12, do_sample=False)
    target.generation_config.compile_config = CompileConfig(backend="eager")  # the user's (no inductor minutes here)
    report = prepare_for_cpu_decoding(target, drafter, compile=True)
    assert report.compiled and "compiles the target's forward on a static cache" in str(report)
    assert target.generation_config.cache_implementation == "static"
    assert target.generation_config.compile_config.backend == "eager"
    assert not prepare_for_cpu_decoding(target, drafter, compile=True).changed
    output = target.generate(
        prompt, max_new_tokens=20, do_sample=False, assistant_model=drafter, draft_policy="fixed",
        return_dict_in_generate=True,
    )  # fmt: skip
    assert hasattr(target, "_compiled_call")  # the loop ran the compiled forward
    assert max(drafter.last_generation_stats.acceptance_lengths) > 1
    alone = target.generate(prompt, max_new_tokens=20, do_sample=False)
    assert type(getattr(output, CACHE_ARGUMENT)) is StaticCache
    # A chat passes its own cache, long enough for every turn, and cache_implementation=None: transformers refuses
    # a cache beside a cache_implementation, the default one included.
    chat = {
        CACHE_ARGUMENT: StaticCache(config=target.config, max_cache_len=128),
        "cache_implementation": None,
        "draft_policy": "fixed",
    }
    first_turn = target.generate(prompt, max_new_tokens=20, do_sample=False, assistant_model=drafter, **chat)
    next_turn = target.generate(conversation, max_new_tokens=12, do_sample=False, assistant_model=drafter, **chat)
    assert torch.equal(output.sequences, expected) and torch.equal(alone, expected)
    assert torch.equal(first_turn, expected) and torch.equal(next_turn, expected_next)


@rolls_back
def test_a_batch_where_generate_compiles_takes_compiled_plain_steps(fresh_dynamo):
    # The batch loop cannot use the compiled forward (holes in a dynamic cache, eager), and without it drafting
    # measured slower than the compiled target alone: such a batch takes transformers' own compiled steps, greedy and
    # sampling exactly the target alone's, with a warning naming how to draft it anyway.
    from test_batching import left_padded

    from hf_domino import prepare_for_cpu_decoding

    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    batch = left_padded([[5, 6, 7, 8, 9], [11, 12, 13]])
    target.generation_config.compile_config = CompileConfig(backend="eager")
    prepare_for_cpu_decoding(target, drafter, compile=True)
    for sampling in ({"do_sample": False}, {"do_sample": True, "top_k": 0, "num_return_sequences": 2}):
        torch.manual_seed(0)
        expected = target.generate(**batch, max_new_tokens=16, **sampling)
        torch.manual_seed(0)
        with pytest.warns(UserWarning, match="decodes without drafting.*cache_implementation='dynamic'"):
            output = target.generate(**batch, max_new_tokens=16, assistant_model=drafter, **sampling)
        assert torch.equal(output, expected)
        assert drafter.last_generation_stats.acceptance_lengths == []  # no drafting cycle, nothing stale
    assert hasattr(target, "_compiled_call")


@rolls_back
def test_a_batch_on_a_static_cache_that_is_not_compiled_drafts_on_a_dynamic_one():
    # Where generate() does not compile (here disable_compile=True), the empty static cache it makes for a batch is
    # swapped for a dynamic one, where it had refused the call. A filled one is still refused.
    from test_batching import left_padded

    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    batch = left_padded([[5, 6, 7, 8, 9], [11, 12, 13]])
    expected = target.generate(**batch, max_new_tokens=16, do_sample=False)
    static = {"cache_implementation": "static", "disable_compile": True}
    with pytest.warns(UserWarning, match="keeps holes in a dynamic cache"):
        output = target.generate(**batch, max_new_tokens=16, do_sample=False, assistant_model=drafter, **static)
    assert torch.equal(output, expected) and own_drafts(drafter.last_generation_stats) > 0
    filled = StaticCache(config=target.config, max_cache_len=64)
    target(**batch, **{CACHE_ARGUMENT: filled})
    with pytest.raises(ValueError, match="DynamicCache of full-attention"):
        target.generate(**batch, **{CACHE_ARGUMENT: filled}, max_new_tokens=4, assistant_model=drafter)


def test_prepare_with_compile_names_what_it_needs(monkeypatch):
    from hf_domino import prepare_for_cpu_decoding
    from hf_domino.cpu_fast_path import is_prepared_for_cpu_decoding

    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    with pytest.raises(ValueError, match="no generation_config.*drop compile=True"):
        prepare_for_cpu_decoding(target.model, compile=True)
    monkeypatch.setattr(StaticLayer, "is_croppable", False)  # transformers 5.23
    with pytest.raises(ValueError, match=r"transformers 5\.24.*upgrade transformers, or drop compile=True"):
        prepare_for_cpu_decoding(target, drafter, compile=True)
    assert not is_prepared_for_cpu_decoding(target) and target.generation_config.cache_implementation is None

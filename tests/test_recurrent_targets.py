"""Targets with recurrent layers (linear attention, state-space models): Qwen3.5 and Qwen3.5-MoE, Qwen3-Next,
OLMo-Hybrid, Kimi-Linear, BailingHybrid, Nemotron-H, Falcon-H1, Granite 4 (GraniteMoeHybrid), Mamba2.

A recurrent state folds every token it reads into one tensor and cannot drop a verification's rejected drafts:
transformers < 5.25 refuses assisted generation for them (`_is_stateful`), later releases run the last tokens of
every forward one by one to keep a state per token. A Domino call keeps the inputs of the family's
scan (the Gated DeltaNet rule, Kimi Delta Attention, the Mamba2 chunk scan) during a verification and recomputes each state after the
accepted tokens from them (`recurrent_cache_domino.RecurrentRollback`); where no inputs were kept it rolls the verification back
whole and the next forward reads its verified tokens again, drafting nothing. These tiny models, built from configs,
check that each family continues its states exactly over a forward of several tokens (what `RECURRENT_TARGETS` rests
on; Mamba, FalconMamba, Bamba and Jamba do not, and are refused, as are targets keeping states in a cache class of
their own), that the output is the target alone's for one
sequence and for batches with drafts accepted in part, in whole and not at all, that the cache a call leaves holds
exactly the sequence's states (greedy outputs of tiny models hardly depend on them), that sampling keeps the target's
law and verifies against its own logits, that a cache handed back continues a chat, and that what cannot be served
(trees, per-step hidden states) is refused with the fix named.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from conftest import SPECIAL_TOKENS, forcing_drafter, own_drafts, tiny_drafter
from packaging.version import Version
from test_batching import left_padded

from hf_domino import prepare_for_cpu_decoding, recurrent_scans_domino
from hf_domino.cache_domino import CACHE_ARGUMENT
from hf_domino.options_domino import static_caches_roll_back
from hf_domino.recurrent_cache_domino import (
    RECURRENT_TARGETS,
    TRANSFORMERS_ROLLS_BACK_RECURRENT_STATES,
    RecurrentRollback,
    keeps_recurrent_states,
)
from hf_domino.recurrent_scans_domino import RULE_INPUT_TOKENS

VOCAB = 32
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, tie_word_embeddings=False, **SPECIAL_TOKENS)
ATTENTION = dict(intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
MAMBA = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1)
# Multi-head latent attention (Kimi-Linear's and BailingHybrid's attention layers) and their experts, at tiny sizes
MLA = dict(
    num_key_value_heads=4,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=4,
    qk_nope_head_dim=8,
    v_head_dim=8,
    layer_types=["linear_attention", "full_attention"] * 2,
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
FAMILIES = {
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {**ATTENTION, "head_dim": 8}),
    "qwen3_next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        {
            **ATTENTION,
            "head_dim": 8,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 16,
            "linear_num_value_heads": 4,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 8,
            "linear_value_head_dim": 8,
        },
    ),
    "olmo_hybrid": ("OlmoHybridConfig", "OlmoHybridForCausalLM", ATTENTION),
    "nemotron_h": (
        "NemotronHConfig",
        "NemotronHForCausalLM",
        {**ATTENTION, "head_dim": 8, "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 8, "n_groups": 1},
    ),
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM", {**ATTENTION, "head_dim": 8, "mamba_d_ssm": 64, **MAMBA}),
    "qwen3_5_moe": (
        "Qwen3_5MoeTextConfig",
        "Qwen3_5MoeForCausalLM",
        {
            **ATTENTION,
            "head_dim": 8,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 16,
        },
    ),
    "kimi_linear": (
        "KimiLinearConfig",
        "KimiLinearForCausalLM",
        {**ATTENTION, **MLA, "linear_num_heads": 4, "linear_head_dim": 8, "q_lora_rank": None, **MOE},
    ),
    "bailing_hybrid": (
        "BailingHybridConfig",
        "BailingHybridForCausalLM",
        {**ATTENTION, **MLA, "linear_num_heads": 4, "linear_head_dim": 8, "n_group": 1, "topk_group": 1, **MOE},
    ),
    "mamba2": ("Mamba2Config", "Mamba2ForCausalLM", {"num_heads": 4, "head_dim": 16, "state_size": 8, "n_groups": 1}),
    "granitemoehybrid": (
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        {
            **ATTENTION,
            **MAMBA,
            "layer_types": ["mamba", "attention", "mamba", "attention"],
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "shared_intermediate_size": 32,
        },
    ),
}
# Families whose forward over several tokens of a filled cache starts their scans from empty states (transformers
# 5.23-5.24): refused.
REFUSED = {
    "mamba": ("MambaConfig", "MambaForCausalLM", {"state_size": 8}),
    "falcon_mamba": ("FalconMambaConfig", "FalconMambaForCausalLM", {"state_size": 8}),
    "bamba": ("BambaConfig", "BambaForCausalLM", {**ATTENTION, **MAMBA, "attn_layer_indices": [1, 3]}),
    "jamba": (
        "JambaConfig",
        "JambaForCausalLM",
        {
            **ATTENTION,
            "mamba_d_state": 8,
            "attn_layer_period": 2,
            "attn_layer_offset": 1,
            "expert_layer_period": 2,
            "expert_layer_offset": 1,
            "num_experts": 2,
            "num_experts_per_tok": 1,
        },
    ),
}
# Before transformers 5.24 the state-space models kept their states in a cache of their own, which generate() does
# not pass through its loop: drafting refuses them there.
OWN_CACHE = Version(transformers.__version__) < Version("5.24")
STATE_SPACE = {"mamba2", "mamba", "falcon_mamba"}
PROMPT = torch.tensor([[5, 9, 12, 7, 30, 5, 9, 12, 7, 30, 5, 9]])
GREEDY = {"do_sample": False, "eos_token_id": None}


# Kimi Delta Attention initialises its decay rates to 1-16, which makes a tiny model's states forget a token within
# a few more: a state replayed after the wrong tokens would not show a few tokens later. exp(-4) keeps them.
SLOW_FORGETTING = {"kimi_linear", "bailing_hybrid"}
# Weights whose greedy answer to PROMPT repeats itself soon enough for whole blocks of copies to be accepted.
SEEDS = {"granitemoehybrid": 7}


def hybrid_target(name: str, seed: int | None = None):
    if OWN_CACHE and name in STATE_SPACE:
        pytest.skip(f"transformers {transformers.__version__} keeps {name}'s states in a cache of its own")
    config_class, model_class, extra = {**FAMILIES, **REFUSED}[name]
    torch.manual_seed(SEEDS.get(name, 0) if seed is None else seed)
    config = getattr(transformers, config_class)(**COMMON, **extra)
    target = getattr(transformers, model_class)(config).eval()
    target.generation_config.pad_token_id = 0
    if name in SLOW_FORGETTING:
        with torch.no_grad():
            for module in target.modules():
                if hasattr(module, "A_log"):
                    module.A_log.fill_(-4.0)
    return target


def successor_table(sequence: torch.Tensor) -> list[int]:
    """next[token] = the token that followed it last in `sequence`: a forcing drafter with this table drafts the
    target's own continuation where it does not depend on more than the last token, and misses elsewhere."""
    table = list(range(VOCAB))
    tokens = sequence[0].tolist()
    for token, following in zip(tokens, tokens[1:]):
        table[token] = following
    return table


def rolled_back(stats) -> int:
    """Verifications with a rejected draft (each rolled back whole)."""
    return sum(1 for drafted, accepted in zip(stats.drafted, stats.acceptance_lengths) if accepted < drafted + 1)


def states_after(target, chunks: list[torch.Tensor], states=None) -> list[torch.Tensor]:
    """`states` (default `layer_states`) of a cache after the target alone read `chunks` into it."""
    cache = transformers.DynamicCache(config=target.config)
    with torch.no_grad():
        for chunk in chunks:
            target(chunk, **{CACHE_ARGUMENT: cache})
    return (states or layer_states)(cache)


def relative_state_error(target) -> float:
    """How far the states after two forwards (8 tokens, then 5 on the filled cache) are from those after one."""
    split = states_after(target, [PROMPT[:, :8], PROMPT[:, 8:]])
    whole = states_after(target, [PROMPT])
    return max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-12)) for a, b in zip(split, whole, strict=True))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_served_family_continues_its_states_over_a_forward_of_several_tokens(name):
    """What `RECURRENT_TARGETS` rests on: a verification is a forward of several tokens on a filled cache."""
    target = hybrid_target(name)
    assert target.config.get_text_config().model_type in RECURRENT_TARGETS
    assert relative_state_error(target) < 1e-4


@pytest.mark.parametrize("name", list(REFUSED))
def test_families_whose_scans_restart_from_empty_states_are_refused(name):
    """If the first assertion fails, transformers now continues this family's states: add it to RECURRENT_TARGETS."""
    target = hybrid_target(name)
    assert relative_state_error(target) > 1e-2  # the served families' are below 1e-6
    with pytest.raises(ValueError, match="not among the families"):
        target.generate(PROMPT, assistant_model=tiny_drafter(target), max_new_tokens=4, **GREEDY)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_transformers_refuses_an_assistant_for_them_before_5_25(name):
    """Why RecurrentRollback exists: transformers < 5.25 refuses any assistant for these targets. Later releases roll
    states back themselves (each forward keeps a state per token for its last tokens, run one by one), and no longer
    mark them `_is_stateful`: `keeps_recurrent_states` tells from their layer types."""
    target = hybrid_target(name)
    assert keeps_recurrent_states(target)
    if TRANSFORMERS_ROLLS_BACK_RECURRENT_STATES:
        return
    assert target._is_stateful
    with pytest.raises(ValueError, match="stateful"):
        target.generate(PROMPT, assistant_model=hybrid_target(name), max_new_tokens=4, **GREEDY)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_output_is_the_target_alone_with_drafts_accepted_in_part_in_whole_and_not(name):
    target = hybrid_target(name)
    expected = target.generate(PROMPT, max_new_tokens=64, **GREEDY)
    drafter = forcing_drafter(target, successor_table(expected))
    kept_whole = 0
    # Whole blocks of copies (the tiny models repeat themselves) or drafts; the drafter's alone; the defaults.
    for options in ({"draft_policy": "fixed"}, {"draft_policy": "fixed", "domino_lookup": False}, {}):
        output = target.generate(PROMPT, assistant_model=drafter, max_new_tokens=64, **GREEDY, **options)
        assert torch.equal(output, expected), options
        stats = drafter.last_generation_stats
        rollbacks = [i for i, (drafted, accepted) in enumerate(zip(stats.drafted, stats.acceptance_lengths))
                     if accepted < drafted + 1]  # fmt: skip
        assert stats.rereads == 0, options  # the states after the verified tokens, from the scan's own inputs
        if options:
            assert rollbacks, options
        kept_whole += sum(
            0 < drafted == accepted - 1 for drafted, accepted in zip(stats.drafted, stats.acceptance_lengths)
        )
    # And verifications kept whole, every draft accepted (the tiny Mamba2 never repeats itself: none to copy).
    assert kept_whole or name == "mamba2"


@pytest.mark.parametrize("name", ["qwen3_5", "nemotron_h"])
def test_without_kept_scan_inputs_a_rejected_verification_is_read_again(name, monkeypatch):
    """Where no scan inputs are kept (a kernel that replaces a whole layer, a compiled forward), a verification with a
    rejected draft is rolled back whole and the next forward reads its verified tokens again, drafting nothing."""
    monkeypatch.setattr(recurrent_scans_domino, "SCAN_FAMILIES", ())
    target = hybrid_target(name)
    expected = target.generate(PROMPT, max_new_tokens=48, **GREEDY)
    drafter = forcing_drafter(target, successor_table(expected))
    output = target.generate(PROMPT, assistant_model=drafter, max_new_tokens=48, draft_policy="fixed", **GREEDY)
    assert torch.equal(output, expected)
    stats = drafter.last_generation_stats
    rollbacks = [i for i, (drafted, accepted) in enumerate(zip(stats.drafted, stats.acceptance_lengths))
                 if accepted < drafted + 1 and i + 1 < len(stats.drafted)]  # fmt: skip
    assert rollbacks and all(stats.drafted[i + 1] == 0 for i in rollbacks)
    assert stats.rereads == len(rollbacks)
    with pytest.raises(ValueError, match="cannot keep row by row"):  # a batch would need a re-read per row
        target.generate(**left_padded(BATCH[:2]), assistant_model=drafter, max_new_tokens=8, **GREEDY)


@pytest.mark.parametrize("name", ["qwen3_5", "nemotron_h"])
def test_on_a_cpu_a_verification_scans_as_one_chunk_of_its_length(name):
    """The reference scans pad every call to their chunk (64 tokens, Nemotron-H's 128-256): a verification's scan
    runs as one chunk of its own tokens instead, with the states and logits of the default chunks (fp32 rounding)."""
    target = hybrid_target(name)
    outputs = []
    for recording in (False, True):
        cache = transformers.DynamicCache(config=target.config)
        with torch.no_grad():
            target(PROMPT[:, :7], **{CACHE_ARGUMENT: cache})
        rollback = RecurrentRollback.install(cache, committed=7, target=target) if recording else None
        if recording:
            rollback.feed(PROMPT.shape[1])
        with torch.no_grad():
            logits = target(PROMPT[:, 7:], **{CACHE_ARGUMENT: cache}).logits
        states = [layer.recurrent_states[0] for layer in cache.layers if hasattr(layer, "recurrent_states")]
        outputs.append((logits, states))
        if recording:
            assert [layer.inputs_before[0]["chunk_size"] for layer in rollback.layers] == [5] * len(states)
            rollback.remove()
    torch.testing.assert_close(outputs[1][0], outputs[0][0], atol=1e-5, rtol=1e-5)
    for recorded, plain in zip(outputs[1][1], outputs[0][1], strict=True):
        torch.testing.assert_close(recorded, plain, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["qwen3_5", "nemotron_h"])
def test_the_verify_cost_table_times_forwards_as_drafting_runs_them(name, monkeypatch):
    """The adaptive policy's table (and the bench's) must price a verification as drafting runs it, its scan as one
    chunk on a CPU, not with the scan's own chunks: those cost a Nemotron-H-shaped target's 2-token forward 1.45
    steps on this CPU where drafting's costs 1.02 (docs/benchmarks.md)."""
    from hf_domino.cost_model_domino import measure_verify_cost_on_scratch
    from hf_domino.measure import measure_forward_ms

    target, chunked = hybrid_target(name), []
    one_chunk = recurrent_scans_domino._one_chunk_on_cpu

    def counting(names, args, kwargs, tokens):
        chunked.append(tokens.shape[1])
        return one_chunk(names, args, kwargs, tokens)

    monkeypatch.setattr(recurrent_scans_domino, "_one_chunk_on_cpu", counting)
    cost = measure_verify_cost_on_scratch(target, {})
    assert cost(17) > 0 and 17 in chunked and 1 not in chunked  # one-token forwards take the in-place step
    chunked.clear()
    measure_forward_ms(target, PROMPT, [1, 5], repeats=2)
    assert set(chunked) == {5}


def test_qwen3_5_as_users_load_it_keeps_verified_tokens():
    """Qwen/Qwen3.5-* checkpoints are vision-language models (`Qwen3_5ForConditionalGeneration`, what
    AutoModelForImageTextToText builds): a text prompt drafts with them, rejected verifications kept in part."""
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=2)
    config = transformers.Qwen3_5Config(text_config={**COMMON, **FAMILIES["qwen3_5"][2]}, vision_config=vision)
    torch.manual_seed(0)
    target = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    target.generation_config.pad_token_id = 0
    expected = target.generate(PROMPT, max_new_tokens=40, **GREEDY)
    drafter = forcing_drafter(target, successor_table(expected))
    output = target.generate(PROMPT, assistant_model=drafter, max_new_tokens=40, draft_policy="fixed", **GREEDY)
    assert torch.equal(output, expected)
    assert rolled_back(drafter.last_generation_stats) > 0 and drafter.last_generation_stats.rereads == 0
    batch = left_padded(BATCH)  # its three sections of multimodal-RoPE positions count each row's mask for text
    expected = target.generate(**batch, max_new_tokens=30, **GREEDY)
    output = target.generate(**batch, assistant_model=drafter, max_new_tokens=30, draft_policy="fixed", **GREEDY)
    assert torch.equal(output, expected) and rolled_back(drafter.last_generation_stats) > 0


@pytest.mark.parametrize("name", ["qwen3_5", "nemotron_h"])
def test_a_prompt_keeps_no_scan_inputs(name):
    """The scan's inputs are kept for verifications only: a prompt's would take memory in proportion to it."""
    target = hybrid_target(name)
    tokens = (torch.arange(RULE_INPUT_TOKENS + 4) % VOCAB)[None]
    cache = transformers.DynamicCache(config=target.config)
    with torch.no_grad():
        target(tokens[:, :4], **{CACHE_ARGUMENT: cache})
    rollback = RecurrentRollback.install(cache, committed=4, target=target)
    try:
        for length, kept in ((RULE_INPUT_TOKENS + 4, False), (3, True)):  # the rest of a prompt, a verification
            rollback.feed(rollback.committed + length)
            with torch.no_grad():
                target(tokens[:, :length], **{CACHE_ARGUMENT: cache})
            assert all((layer.inputs_before.get(0) is not None) is kept for layer in rollback.layers)
            rollback.crop(0)
    finally:
        rollback.remove()


def layer_states(cache, keys: bool = True) -> list[torch.Tensor]:
    """Every state a cache holds: recurrent states, the last convolution window, attention keys and values (with
    `keys`; a static cache's are as long as its buffer)."""
    states = []
    for layer in cache.layers:
        for index, recurrent in getattr(layer, "recurrent_states", {}).items():
            if recurrent is not None:
                states.append(recurrent)
            conv = layer.conv_states[index]
            if conv is not None:
                states.append(conv[..., -layer.conv_kernel_size[index] :])
        if keys and getattr(layer, "keys", None) is not None:
            states += [layer.keys, layer.values]
    return states


def recurrent_layer_states(cache) -> list[torch.Tensor]:
    return layer_states(cache, keys=False)


def lengths_held(target, cache, output: torch.Tensor, num_drafts: int, states=layer_states) -> list[int]:
    """The lengths of `output` whose states (`states` of a cache) the target alone's prefill of them leaves as `cache`
    holds them. A call leaves all tokens but the last, or fewer by a verification rolled back and not re-read (a
    state-space model's cache does not count its tokens): exactly one such length where the call kept them right."""
    last = output.shape[1] - 1
    candidates = range(last, last - num_drafts - 2, -1)
    if states is layer_states and any(hasattr(layer, "keys") for layer in cache.layers):
        candidates = [cache.get_seq_length()]
        assert last - num_drafts - 1 <= candidates[0] <= last

    def holds(length: int) -> bool:  # to each state's own scale: some tiny models' states are around 1e-5
        return all(
            torch.allclose(state, expected, rtol=1e-4, atol=1e-5 * float(expected.abs().max()))
            for state, expected in zip(states(cache), states_after(target, [output[:, :length]], states), strict=True)
        )

    return [length for length in candidates if holds(length)]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_cache_left_holds_the_states_of_the_sequence_and_nothing_rejected(name):
    """Greedy outputs of tiny models hardly depend on their recurrent states; the states themselves must be exact.
    After a call that rolled verifications back, the cache holds what the target alone's prefill of the same tokens
    holds (all but the last, or fewer where the last verification was rolled back and not re-read)."""
    target = hybrid_target(name, seed=0)  # Granite's seed 7 ends on whole blocks, after which its states forget
    expected = target.generate(PROMPT, max_new_tokens=40, **GREEDY)
    drafter = forcing_drafter(target, successor_table(expected))
    cache = transformers.DynamicCache(config=target.config)
    output = target.generate(
        PROMPT, assistant_model=drafter, max_new_tokens=40, draft_policy="fixed", **{CACHE_ARGUMENT: cache}, **GREEDY
    )
    assert torch.equal(output, expected)
    assert rolled_back(drafter.last_generation_stats) > 0
    assert len(lengths_held(target, cache, output, drafter.config.num_drafts)) == 1


@pytest.mark.parametrize("name", ["qwen3_5", "nemotron_h"])
def test_a_random_drafter_every_draft_rejected_and_the_prepared_target(name):
    target = hybrid_target(name)
    drafter = tiny_drafter(target)
    expected = target.generate(PROMPT, max_new_tokens=24, **GREEDY)
    output = target.generate(PROMPT, assistant_model=drafter, max_new_tokens=24, draft_policy="fixed", **GREEDY)
    assert torch.equal(output, expected)
    report = prepare_for_cpu_decoding(target, drafter)
    assert report.verify_ms and report.prepacked["target"]  # the cost table measured on a cache of its own
    assert torch.equal(target.generate(PROMPT, assistant_model=drafter, max_new_tokens=24, **GREEDY), expected)


@pytest.mark.parametrize("name", ["qwen3_5", "falcon_h1", "kimi_linear"])
def test_sampling_verifies_against_the_target_alones_logits(name):
    """Speculative sampling is exact when each verification reads the target's own distribution; after rollbacks and
    re-reads, the logits the loop sampled from must be those of one plain forward over the finished sequence."""
    target = hybrid_target(name)
    expected = target.generate(PROMPT, max_new_tokens=32, **GREEDY)
    drafter = forcing_drafter(target, successor_table(expected))
    torch.manual_seed(3)
    output = target.generate(
        PROMPT,
        assistant_model=drafter,
        max_new_tokens=32,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        eos_token_id=None,
        draft_policy="fixed",
        domino_lookup=False,
        return_dict_in_generate=True,
        output_logits=True,
    )
    assert rolled_back(drafter.last_generation_stats) > 0
    sampled = torch.stack(output.logits, dim=1)[0]
    with torch.no_grad():
        reference = target(output.sequences).logits[0, PROMPT.shape[1] - 1 : -1]
    torch.testing.assert_close(sampled, reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["qwen3_5", "mamba2"])
def test_a_cache_handed_back_continues_the_chat_as_the_target_alone(name):
    # A state-space model's cache (no attention layers) counts its tokens from transformers 5.25 on; before, a call
    # with a drafter cannot tell how much of the prompt it holds (refused, naming the fix: cache_domino.cached_tokens).
    if name == "mamba2" and not counts_linear_tokens():
        pytest.skip("transformers < 5.25: a state-space model's cache does not count its tokens")
    target = hybrid_target(name)
    first = target.generate(PROMPT, max_new_tokens=20, **GREEDY)
    drafter = forcing_drafter(target, successor_table(first))
    turns = []
    for assistant in (None, drafter):
        cache = transformers.DynamicCache(config=target.config)
        extra = {} if assistant is None else {"assistant_model": assistant, "draft_policy": "fixed"}
        answer = target.generate(PROMPT, **{CACHE_ARGUMENT: cache}, max_new_tokens=20, **GREEDY, **extra)
        assert len(lengths_held(target, cache, answer, drafter.config.num_drafts)) == 1  # the states it goes on from
        follow_up = torch.cat([answer, torch.tensor([[11, 5, 9]])], dim=-1)
        turns.append(target.generate(follow_up, **{CACHE_ARGUMENT: cache}, max_new_tokens=16, **GREEDY, **extra))
    assert torch.equal(turns[1], turns[0])
    # The call put the cache's layers back as they were built.
    assert all(not type(layer).__name__.startswith("Snapshot") for layer in cache.layers)


BATCH = [[11, 5, 9, 12, 7, 5, 9, 12], [5, 9, 12, 7, 30, 5, 9, 12, 7, 30, 22], [3, 4]]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_batch_is_the_target_alones_row_by_row(name):
    """transformers drafts no batch for any target, and no assistant at all for these: each row keeps the states of
    what it accepted (rows accept different numbers of drafts; shorter rows' holes come after their tokens), and its
    output is the target alone's for the padded batch, with drafts and copies, with rows stopping at different times."""
    target = hybrid_target(name)
    drafter = forcing_drafter(target, successor_table(target.generate(PROMPT, max_new_tokens=40, **GREEDY)))
    batch = left_padded(BATCH)
    expected = target.generate(**batch, max_new_tokens=30, **GREEDY)
    eos = int(expected[2, batch["input_ids"].shape[1] + 6])  # row 2 stops early, the others when they meet it
    for options in ({"draft_policy": "fixed"}, {"draft_policy": "fixed", "domino_lookup": False}, {}):
        output = target.generate(**batch, assistant_model=drafter, max_new_tokens=30, **GREEDY, **options)
        assert torch.equal(output, expected), options
        if options:
            assert rolled_back(drafter.last_generation_stats) > 0, options
    stopping = {**GREEDY, "eos_token_id": eos}
    expected = target.generate(**batch, max_new_tokens=30, **stopping)
    output = target.generate(**batch, assistant_model=drafter, max_new_tokens=30, draft_policy="fixed", **stopping)
    assert torch.equal(output, expected)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_chunked_prefill_is_the_target_alones_one_sequence_and_a_batch(name):
    # Chunks of 5 and 4 leave a last chunk of 2 columns for the prefill's own forward: read after the leading chunks,
    # it must still keep no scan inputs (a batch's recorded them until fixed, and its rows answered otherwise).
    target = hybrid_target(name)
    drafter = forcing_drafter(target, successor_table(target.generate(PROMPT, max_new_tokens=40, **GREEDY)))
    for inputs, chunk in ((dict(input_ids=PROMPT), 5), (left_padded(BATCH), 4)):
        try:
            expected = target.generate(**inputs, max_new_tokens=20, prefill_chunk_size=chunk, **GREEDY)
        except ValueError as error:  # transformers 5.24's chunks ask a cache of linear-attention layers its length
            if "get_seq_length" not in str(error):
                raise
            pytest.skip(f"the target alone's chunked prefill fails on this transformers: {error}")
        output = target.generate(
            **inputs, max_new_tokens=20, prefill_chunk_size=chunk, assistant_model=drafter, draft_policy="fixed",
            **GREEDY,
        )  # fmt: skip
        assert torch.equal(output, expected), chunk
        assert own_drafts(drafter.last_generation_stats) > 0


@pytest.mark.parametrize("name", ["qwen3_5", "nemotron_h"])
def test_the_scans_arguments_are_named_as_the_reference_names_them(name):
    # With the `kernels` package installed, transformers >= 5.25 turns each scan into a module taking *args, **kwargs:
    # the recording reads the function's own names, without which it kept nothing (every rejection read again).
    family = recurrent_scans_domino.replayable_scan(hybrid_target(name))
    names = recurrent_scans_domino._parameter_names(getattr(family.module, family.chunked))
    assert (
        names[: len(family.per_token) + 1]
        == {
            "qwen3_5": ["query", "key", "value", "g", "beta", "chunk_size"],
            "nemotron_h": ["hidden_states", "dt", "A", "B", "C"],
        }[name]
    )


def test_each_copy_of_the_code_in_a_process_records_its_own_verifications(tmp_path):
    """A drafter folder's remote code beside the package (a notebook that loads both, a test worker): each copy
    records the scan's inputs of its own verifications, whichever copy wrapped the scan first, one sequence and
    batches."""
    from transformers import AutoModel

    target = hybrid_target("qwen3_5")
    expected = target.generate(PROMPT, max_new_tokens=40, **GREEDY)
    package = forcing_drafter(target, successor_table(expected))
    package.save_pretrained(tmp_path)
    remote = AutoModel.from_pretrained(tmp_path, trust_remote_code=True)
    assert type(remote).__module__.startswith("transformers_modules")
    batch = left_padded(BATCH)
    expected_batch = target.generate(**batch, max_new_tokens=20, **GREEDY)
    for drafter in (remote, package, remote):
        output = target.generate(PROMPT, assistant_model=drafter, max_new_tokens=40, draft_policy="fixed", **GREEDY)
        assert torch.equal(output, expected)
        stats = drafter.last_generation_stats
        assert rolled_back(stats) > 0 and stats.rereads == 0, type(drafter).__module__
        output = target.generate(**batch, assistant_model=drafter, max_new_tokens=20, draft_policy="fixed", **GREEDY)
        assert torch.equal(output, expected_batch)  # a batch keeps its rows' states from the recorded inputs only


def assert_rows_sampled_from_their_own_logits(target, drafter, batch: dict, new_tokens: int = 24) -> None:
    """A sampled batch with drafts rejected in part: the logits each row sampled from are those of one plain forward
    over its finished sequence."""
    torch.manual_seed(3)
    output = target.generate(
        **batch, assistant_model=drafter, max_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_k=0,
        eos_token_id=None, draft_policy="fixed", domino_lookup=False, return_dict_in_generate=True, output_logits=True,
    )  # fmt: skip
    assert rolled_back(drafter.last_generation_stats) > 0
    assert_logits_are_each_rows_own(target, batch["attention_mask"], output, new_tokens)


def assert_logits_are_each_rows_own(target, attention_mask, output, new_tokens: int) -> None:
    """The logits of each output row (`output_logits`; rows of a prompt's copies follow each other) are those of one
    plain forward over its finished sequence: every state it read was its own."""
    logits = torch.stack(output.logits, dim=1)
    masks = attention_mask.bool().repeat_interleave(output.sequences.shape[0] // attention_mask.shape[0], dim=0)
    for row, mask in enumerate(masks):
        sequence = output.sequences[row : row + 1, torch.cat([mask, torch.ones(new_tokens, dtype=torch.bool)])]
        with torch.no_grad():
            reference = target(sequence).logits[0, int(mask.sum()) - 1 : -1]
        torch.testing.assert_close(logits[row], reference, atol=1e-4, rtol=1e-4)


def states_show_in_logits(target) -> None:
    """Scales the Mamba2 mixers' input projections: the tiny state-space layers' states are around 1e-6, too small
    for logits to show them."""
    with torch.no_grad():
        for module in target.modules():
            if hasattr(module, "A_log") and hasattr(module, "in_proj"):  # a Mamba2 mixer
                module.in_proj.weight.mul_(30)


@pytest.mark.parametrize("name", ["qwen3_5", "nemotron_h", "falcon_h1", "granitemoehybrid", "kimi_linear"])
def test_a_sampled_batch_verifies_each_row_against_the_target_alones_logits(name):
    """Speculative sampling per row is exact when each verification reads the row's own distribution: the logits
    each row sampled from are those of one plain forward over its finished sequence (which also checks each row's
    states, which greedy outputs of tiny models hardly depend on)."""
    target = hybrid_target(name)
    states_show_in_logits(target)
    drafter = forcing_drafter(target, successor_table(target.generate(PROMPT, max_new_tokens=40, **GREEDY)))
    batch = left_padded(BATCH)
    assert_rows_sampled_from_their_own_logits(target, drafter, batch)


def test_what_a_batch_cannot_keep_per_row_is_refused_naming_the_fix():
    target = hybrid_target("qwen3_5")
    drafter = tiny_drafter(target)
    with pytest.raises(ValueError, match="domino_branches=1"):
        target.generate(PROMPT, assistant_model=drafter, max_new_tokens=8, domino_branches=2, **GREEDY)


def counts_linear_tokens() -> bool:
    """Whether this transformers' linear-attention cache layers count their tokens (5.25 and later), without which a
    cache of such layers alone (a state-space model's) cannot say how much of a prompt it holds."""
    return hasattr(transformers.cache_utils.LinearAttentionLayer(), "cumulative_length_linear")


@pytest.mark.parametrize("name", ["qwen3_5", "nemotron_h", "falcon_h1", "mamba2"])
def test_a_drafted_batch_continues_a_cache_the_target_alone_left(name):
    # A chat's first turn answered by the target alone, its next by a drafted batch on that cache: the batch reads
    # only the new columns (messages of different lengths, so padding inside the rows) and answers as the target
    # alone continuing its own copy. Before, refused ("starts from its prompts").
    target = hybrid_target(name)
    drafter = tiny_drafter(target)
    batch = left_padded(BATCH)
    caches = [transformers.DynamicCache(config=target.config) for _ in range(2)]
    first = [target.generate(**batch, max_new_tokens=10, **GREEDY, **{CACHE_ARGUMENT: cache}) for cache in caches]
    assert torch.equal(first[0], first[1])
    messages = left_padded([[5, 9, 12], [7], [11, 5, 9, 12, 30]])
    turn = {
        "input_ids": torch.cat([first[0], messages["input_ids"]], dim=-1),
        "attention_mask": torch.cat([
            batch["attention_mask"], torch.ones(3, first[0].shape[1] - batch["input_ids"].shape[1], dtype=torch.long),
            messages["attention_mask"],
        ], dim=-1)[:, :],
    }  # fmt: skip
    if name == "mamba2" and not counts_linear_tokens():
        with pytest.raises(ValueError, match="upgrade transformers"):
            target.generate(
                **turn, assistant_model=drafter, max_new_tokens=12, **{CACHE_ARGUMENT: caches[0]}, **GREEDY
            )
        return
    read = []
    hook = target.register_forward_pre_hook(lambda module, args, kwargs: read.append(kwargs["input_ids"].shape[1]),
                                            with_kwargs=True)  # fmt: skip
    second = target.generate(
        **turn, assistant_model=drafter, max_new_tokens=12, draft_policy="fixed", **{CACHE_ARGUMENT: caches[0]},
        **GREEDY,
    )  # fmt: skip
    hook.remove()
    assert read[0] == messages["input_ids"].shape[1] + 1  # the last answer column, never read, and the messages
    expected = target.generate(**turn, max_new_tokens=12, **{CACHE_ARGUMENT: caches[1]}, **GREEDY)
    assert torch.equal(second, expected) and rolled_back(drafter.last_generation_stats) > 0


@pytest.mark.parametrize("name", ["qwen3_5", "nemotron_h"])
def test_a_prompts_copies_share_its_recurrent_states(name):
    # num_return_sequences: the prefill reads each distinct prompt once, and its copies take copies of its recurrent
    # states and convolution windows (`select_state_rows`); before, every copy was read. top-k 1 makes sampling as
    # deterministic as greedy.
    from test_batching import prefill_rows

    target = hybrid_target(name)
    states_show_in_logits(target)
    drafter = tiny_drafter(target)
    batch = left_padded([BATCH[0], BATCH[2], BATCH[0]])
    decoding = dict(do_sample=True, top_k=1, num_return_sequences=2, max_new_tokens=12, eos_token_id=None)
    expected = target.generate(**batch, **decoding)
    with prefill_rows(target) as rows:
        output = target.generate(**batch, **decoding, assistant_model=drafter, draft_policy="fixed",
                                 return_dict_in_generate=True, output_logits=True)  # fmt: skip
    assert torch.equal(output.sequences, expected) and rows == [2]  # 6 rows, 2 distinct prompts
    assert rolled_back(drafter.last_generation_stats) > 0
    # Each copy read its prompt's states (greedy outputs of tiny models hardly depend on them).
    assert_logits_are_each_rows_own(target, batch["attention_mask"], output, 12)


def test_a_row_that_ends_inside_an_accepted_block_keeps_its_states_at_its_end():
    # Row 2's prompt holds the 2-cycle its answer falls into, so copied drafts run on past the EOS token, and are
    # accepted past it. The target alone reads nothing after a row's end but padding: the cache the batch leaves
    # keeps the row's states at its end (`BatchedDecoding.columns_read`), not after the drafts it accepted past it,
    # which changed its scores after its end, and its cache.
    from test_architectures import assert_the_target_alones_cache

    target = hybrid_target("qwen3_5")
    free = target.generate(**left_padded(BATCH), max_new_tokens=17, **GREEDY)
    answer = free[2, -17:].tolist()
    assert answer[-4:] == [0, 15, 0, 15]
    batch = left_padded([BATCH[0], BATCH[1], BATCH[2] + answer])
    options = {**GREEDY, "eos_token_id": 15, "max_new_tokens": 20, "return_dict_in_generate": True,
               "output_scores": True}  # fmt: skip
    caches = [transformers.DynamicCache(config=target.config) for _ in range(2)]
    reference = target.generate(**batch, **options, **{CACHE_ARGUMENT: caches[0]})
    drafter = tiny_drafter(target)
    output = target.generate(**batch, **options, assistant_model=drafter, draft_policy="fixed",
                             **{CACHE_ARGUMENT: caches[1]})  # fmt: skip
    assert torch.equal(output.sequences, reference.sequences)
    assert reference.sequences[2, -20:].tolist()[:3] == [0, 15, 0]  # it ends at its second token
    assert max(drafter.last_generation_stats.acceptance_lengths) > 2  # where copies ran past it
    for ours, theirs in zip(output.scores, reference.scores, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    answers = torch.ones(3, reference.sequences.shape[1] - batch["input_ids"].shape[1], dtype=torch.long)
    attended = torch.cat([batch["attention_mask"], answers], dim=-1)[:, :-1].bool()
    assert_the_target_alones_cache(caches[1], caches[0], attended)


class StopOnBigram(transformers.StoppingCriteria):
    """A user's criterion: a row ends once it ends with tokens (a, b)."""

    def __init__(self, a: int, b: int):
        self.a, self.b = a, b

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids[:, -2] == self.a) & (input_ids[:, -1] == self.b)


def test_a_row_that_a_criterion_ends_inside_an_accepted_block_keeps_its_states_at_its_end():
    # As above, with the end a criterion of the user's (23 then 29), not an EOS: the batch loop offers the copy that
    # completes it and cuts the accepted block after it (`first_stop`), and the states it keeps must end there too
    # (before 2026-12-07's review they read the copies past it: the cache and the padded scores differed).
    from test_architectures import assert_the_target_alones_cache

    target = hybrid_target("qwen3_5")
    drafter = forcing_drafter(target, list(range(32)))  # its drafts all rejected: copies (prompt lookup) draft
    greedy = {"do_sample": False, "pad_token_id": 0, "eos_token_id": 1}
    base = left_padded([[11, 5, 9, 12, 7, 5, 9, 12], [5, 9, 12, 7, 30, 5, 9, 12, 7, 30, 22]])
    free = target.generate(**base, max_new_tokens=24, **greedy)  # a periodic answer: its own text, copied
    width = base["input_ids"].shape[1]
    batch = left_padded([free[0, 3 : width + 12].tolist(), free[1, : width + 15].tolist()])
    options = {**greedy, "max_new_tokens": 12, "return_dict_in_generate": True, "output_scores": True}
    caches = [transformers.DynamicCache(config=target.config) for _ in range(2)]
    criteria = [transformers.StoppingCriteriaList([StopOnBigram(23, 29)]) for _ in range(2)]
    reference = target.generate(**batch, **options, stopping_criteria=criteria[0], **{CACHE_ARGUMENT: caches[0]})
    output = target.generate(**batch, **options, stopping_criteria=criteria[1], assistant_model=drafter,
                             draft_policy="fixed", num_speculative_tokens=6, **{CACHE_ARGUMENT: caches[1]})  # fmt: skip
    assert torch.equal(output.sequences, reference.sequences)
    assert reference.sequences[:, -2:].tolist() == [[23, 29], [29, 0]]  # both end at the bigram, row 1 a token early
    assert max(drafter.last_generation_stats.acceptance_lengths) > 2  # copies accepted up to the end
    for ours, theirs in zip(output.scores, reference.scores, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    answers = torch.ones(2, reference.sequences.shape[1] - batch["input_ids"].shape[1], dtype=torch.long)
    attended = torch.cat([batch["attention_mask"], answers], dim=-1)[:, :-1].bool()
    assert_the_target_alones_cache(caches[1], caches[0], attended)


def test_a_batch_without_an_eos_token_that_stops_at_a_criterion_returns_no_cache_it_cannot_cut():
    """Without an EOS token a batch's rows run on until the last one stops, and a row may run past the column the
    call ends at, which recurrent states cannot take back: where the call returns its cache, refused, naming the fix."""
    target = hybrid_target("qwen3_5")
    drafter = forcing_drafter(target, list(range(32)))
    batch = left_padded([[11, 5, 9], [5, 9, 12, 7]])
    options = {"do_sample": False, "pad_token_id": 0, "eos_token_id": None, "max_new_tokens": 6,
               "stopping_criteria": transformers.StoppingCriteriaList([StopOnBigram(23, 29)])}  # fmt: skip
    with pytest.raises(ValueError, match="pass eos_token_id, or return no cache"):
        target.generate(**batch, **options, assistant_model=drafter, return_dict_in_generate=True)
    alone = target.generate(**batch, **options)
    assert torch.equal(target.generate(**batch, **options, assistant_model=drafter), alone)


def test_a_batch_under_max_time_returns_no_cache_it_cannot_cut():
    """A time limit ends a drafted batch at the column of its row furthest behind, the rows ahead cut back
    (`BatchedDecoding.ends_in_time`), which recurrent states cannot be: where the call returns its cache, refused
    before any work, naming the fix; without the cache, served."""
    target = hybrid_target("qwen3_5")
    drafter = forcing_drafter(target, list(range(32)))
    batch = left_padded([[11, 5, 9], [5, 9, 12, 7]])
    options = {"do_sample": False, "pad_token_id": 0, "max_new_tokens": 6, "max_time": 600.0}
    with pytest.raises(ValueError, match="Return no cache .* drop max_time"):
        target.generate(**batch, **options, assistant_model=drafter, return_dict_in_generate=True)
    alone = target.generate(**batch, **options)
    assert torch.equal(target.generate(**batch, **options, assistant_model=drafter), alone)


LFM2 = {
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", {}),
    "lfm2_moe": ("Lfm2MoeConfig", "Lfm2MoeForCausalLM", {"moe_intermediate_size": 16, "num_experts": 4,
                                                          "num_experts_per_tok": 2, "num_dense_layers": 1}),
}  # fmt: skip


@pytest.mark.parametrize("name", list(LFM2))
def test_a_batch_of_lfm2_keeps_each_rows_convolution_window(name):
    """LFM2's short convolutions keep a window of each row's last tokens and no recurrent state (transformers' own
    loop crops them for one sequence): in a batch each row's window ends after what it accepted. Greedy rows are the
    target alone's, and sampled rows verify against exactly their own logits (which a wrong window changes)."""
    config_class, model_class, extra = LFM2[name]
    layers = ["conv", "full_attention", "conv", "full_attention"]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**COMMON, **ATTENTION, **extra, layer_types=layers)
    target = getattr(transformers, model_class)(config).eval()
    target.generation_config.pad_token_id = 0
    alone = target.generate(PROMPT, max_new_tokens=40, **GREEDY)
    drafter = forcing_drafter(target, successor_table(alone))
    output = target.generate(PROMPT, assistant_model=drafter, max_new_tokens=40, draft_policy="fixed", **GREEDY)
    assert torch.equal(output, alone) and rolled_back(drafter.last_generation_stats) > 0  # transformers' own loop
    batch = left_padded(BATCH)
    expected = target.generate(**batch, max_new_tokens=30, **GREEDY)
    output = target.generate(**batch, assistant_model=drafter, max_new_tokens=30, draft_policy="fixed", **GREEDY)
    assert torch.equal(output, expected) and rolled_back(drafter.last_generation_stats) > 0
    assert_rows_sampled_from_their_own_logits(target, drafter, batch)


# Inkling's layers, at tiny sizes: sliding keys and values with short convolutions, full ones with them too.
INKLING = dict(
    **ATTENTION, head_dim=8, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8,
    sliding_window_size=4, unpadded_vocab_size=VOCAB, moe_intermediate_size=16, n_routed_experts=4,
    num_experts_per_tok=2, n_layers_per_attn_res_block=2, layer_types=["hybrid_sliding", "hybrid"] * 2,
)  # fmt: skip


# Named whole: the GPU payload keeps the modeling code of the classes the tests name (examples/gpu/prepare_payload.sh).
@pytest.mark.parametrize(
    "config_class, model_class",
    [("InklingTextConfig", "InklingForCausalLM"), ("Inkling2TextConfig", "Inkling2ForCausalLM")],
)
def test_inklings_convolution_windows_are_cropped_for_one_sequence_and_a_batch_is_refused(config_class, model_class):
    """Inkling's "hybrid" and "hybrid_sliding" layers are the types transformers gives layers keeping linear-attention
    states beside keys and values, but Inkling keeps only short-convolution windows there, which crop exactly: one
    sequence runs transformers' own loop, rejected drafts cropped (from transformers 5.25 the layer types alone
    called it recurrent and refused it). A batch is refused naming the fix (its layer types get no per-row masks)."""
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**COMMON, **INKLING)
    target = getattr(transformers, model_class)(config).eval()
    alone = target.generate(PROMPT, max_new_tokens=40, **GREEDY)
    drafter = forcing_drafter(target, successor_table(alone))
    output = target.generate(PROMPT, assistant_model=drafter, max_new_tokens=40, draft_policy="fixed", **GREEDY)
    assert torch.equal(output, alone) and rolled_back(drafter.last_generation_stats) > 0
    # The default policy measures what verifying costs, cropping what it measured: it had taken the windows for
    # recurrent states and failed in the target's forward (a shape error).
    assert torch.equal(target.generate(PROMPT, assistant_model=drafter, max_new_tokens=40, **GREEDY), alone)
    with pytest.raises(ValueError, match="generate one prompt at a time"):
        target.generate(**left_padded(BATCH), assistant_model=drafter, max_new_tokens=8, **GREEDY)
    if static_caches_roll_back():  # static sliding keys past their window cannot be cropped: the output differed
        with pytest.raises(ValueError, match="StaticSlidingWindowAttentionLayer layers cannot be cropped"):
            target.generate(PROMPT, assistant_model=drafter, max_new_tokens=40, cache_implementation="static",
                            **GREEDY)  # fmt: skip


def test_per_token_attentions_and_hidden_states_are_refused():
    target = hybrid_target("qwen3_5")
    with pytest.raises(ValueError, match="output_scores and output_logits work"):
        target.generate(
            PROMPT,
            assistant_model=tiny_drafter(target),
            max_new_tokens=8,
            return_dict_in_generate=True,
            output_hidden_states=True,
            **GREEDY,
        )


# Qwen3.5's linear attention runs transformers' reference kernels here (no flash-linear-attention): 96 s, slow.
@pytest.mark.parametrize("name", [pytest.param("qwen3_5", marks=pytest.mark.slow), "nemotron_h"])
def test_sampling_keeps_the_target_law(name):
    """Rolled-back verifications and their re-reads under speculative sampling: the continuations' law is the target
    alone's (chi-square over every continuation of 3 tokens from a 5-token vocabulary), and far from a wrong one."""
    from test_generation import chi_square_p_value, exact_sequence_distribution, law_drafter, sample_with_drafter
    from transformers import LogitsProcessorList, TemperatureLogitsWarper

    config_class, model_class, extra = FAMILIES[name]
    torch.manual_seed(3)
    small = {**COMMON, "vocab_size": 5, "eos_token_id": None, "bos_token_id": None, "pad_token_id": None}
    target = getattr(transformers, model_class)(getattr(transformers, config_class)(**small, **extra)).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(8)  # a law with a shape, which a wrong one (tempered, below) differs from
    drafter = law_drafter(target)
    prompt, num_new, draws = [2, 4, 1], 3, 1500
    probs = exact_sequence_distribution(target, prompt, num_new, LogitsProcessorList())
    stats = []
    counts, drafted, accepted = sample_with_drafter(
        target, drafter, prompt, num_new, draws, seed=1234, per_call=stats, draft_policy="fixed"
    )
    assert 0 < accepted < drafted  # verifications rolled back and kept
    assert sum(rolled_back(s) for s in stats) > 0
    assert chi_square_p_value(counts, probs, draws) > 1e-3
    tempered = exact_sequence_distribution(
        target, prompt, num_new, LogitsProcessorList([TemperatureLogitsWarper(0.5)])
    )
    assert chi_square_p_value(counts, tempered, draws) < 1e-6  # the test can fail


@pytest.mark.parametrize(
    "config_class, model_class, extra",
    [
        ("MiniMaxConfig", "MiniMaxForCausalLM", {**ATTENTION, "head_dim": 8, "num_local_experts": 2}),
        ("RwkvConfig", "RwkvForCausalLM", {"attention_hidden_size": 32, "intermediate_size": 64}),
    ],
)
def test_targets_with_caches_of_their_own_are_refused_naming_the_fix(config_class, model_class, extra):
    """Linear attention or recurrences kept outside transformers' cache classes: generate() cannot pass them to an
    assisted loop (transformers fails there with "Assisted decoding requires a cache")."""
    target = getattr(transformers, model_class)(getattr(transformers, config_class)(**COMMON, **extra)).eval()
    with pytest.raises(ValueError, match="cache of its own.*generate without the drafter"):
        target.generate(PROMPT, assistant_model=tiny_drafter(target), max_new_tokens=4, **GREEDY)


@pytest.mark.skipif(not OWN_CACHE, reason="transformers 5.24+ keeps Mamba2's states in the cache generate() passes")
def test_a_state_space_model_with_a_cache_of_its_own_is_refused_naming_the_fix():
    config_class, model_class, extra = FAMILIES["mamba2"]
    target = getattr(transformers, model_class)(getattr(transformers, config_class)(**COMMON, **extra)).eval()
    with pytest.raises(ValueError, match="upgrade transformers"):
        target.generate(PROMPT, assistant_model=tiny_drafter(target), max_new_tokens=4, **GREEDY)


def test_the_cost_example_runs_as_documented_at_a_smaller_depth():
    """examples/recurrent_targets.py (docs/benchmarks.md), as a user runs it, at 4 layers, 4 tokens, 64 tokens cached,
    one timing per figure and a 4096-token vocabulary (the LM head of Qwen3.5's 151,936 took 22 of its 36 s). Its Nemotron-H-shaped target (2.1B parameters at the documented 8 layers, 7.5 minutes
    here) runs the same code; its shape is checked on the meta device below."""
    script = Path(__file__).resolve().parents[1] / "examples" / "recurrent_targets.py"
    done = subprocess.run(
        # One thread, as the test workers run: two threads beside another worker's made it 4-6 times slower.
        [
            sys.executable,
            str(script),
            *"--layers 4 --new-tokens 4 --context 64 --repeats 1 --threads 1 --vocab-size 4096".split(),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| 17 |" in done.stdout and "| 16 |" in done.stdout  # verification costs; after a rejection
    calls = [line for line in done.stdout.splitlines() if line.startswith(("| 1 | ", "| 2 | ")) and "x |" in line]
    assert len(calls) == 2 and all(line.endswith("| yes |") for line in calls)


def test_the_cost_examples_nemotron_h_shape_is_the_documented_one():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from recurrent_targets import build_target

    with torch.device("meta"):
        target = build_target("nemotron_h", 8)
    assert target.config.layers_block_type.count("linear_attention") == 4
    assert target.config.layers_block_type[-1] == "full_attention"
    assert round(sum(p.numel() for p in target.parameters()) / 1e9, 2) == 2.08  # docs/benchmarks.md: 2.1B
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve().parents[1] / "examples" / "recurrent_targets.py"),
         "--family", "nemotron_h", "--layers", "4"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and "at least 8" in done.stderr  # no attention layer to count the cache's tokens


@pytest.mark.skipif(not static_caches_roll_back(), reason="a static cache with a drafter needs transformers 5.24+")
@pytest.mark.parametrize("name", ["qwen3_5", "nemotron_h"])
def test_a_static_cache_rolls_back_too(name):
    target = hybrid_target(name)
    expected = target.generate(PROMPT, max_new_tokens=32, **GREEDY)
    drafter = forcing_drafter(target, successor_table(expected))
    drafting = {"assistant_model": drafter, "max_new_tokens": 32, "draft_policy": "fixed", **GREEDY}
    assert torch.equal(target.generate(PROMPT, cache_implementation="static", **drafting), expected)
    assert rolled_back(drafter.last_generation_stats) > 0
    cache = transformers.StaticCache(config=target.config, max_cache_len=PROMPT.shape[1] + 32)  # one to look into
    output = target.generate(PROMPT, **{CACHE_ARGUMENT: cache}, **drafting)
    assert torch.equal(output, expected)
    # The recurrent states kept are the sequence's (greedy outputs of tiny models hardly depend on them).
    assert len(lengths_held(target, cache, output, drafter.config.num_drafts, recurrent_layer_states)) == 1


@pytest.mark.skipif(not static_caches_roll_back(), reason="a static cache with a drafter needs transformers 5.24+")
def test_a_static_cache_whose_layers_hold_states_beside_keys_is_refused_before_any_forward():
    # Falcon-H1's static layers keep keys beside Mamba states, and their `crop` (linear attention's) crops only the
    # states: the rejected drafts' keys stayed, and the call failed once the cache filled (an IndexError).
    target = hybrid_target("falcon_h1")
    forwards = []
    target.register_forward_pre_hook(lambda *args: forwards.append(1))
    with pytest.raises(
        ValueError, match=r"LinearAttentionAndStaticFullAttentionLayer layers cannot be cropped.*dynamic"
    ):
        target.generate(PROMPT, assistant_model=tiny_drafter(target), max_new_tokens=8, cache_implementation="static",
                        **GREEDY)  # fmt: skip
    assert forwards == []


def test_layers_of_different_devices_or_dtypes_replay_in_groups(monkeypatch):
    """A target split over GPUs keeps each layer's states on its own device: the states after a verification's
    accepted tokens are recomputed per group of layers that can be stacked (here: one layer's states in float64)."""
    target = hybrid_target("qwen3_5")
    module = sys.modules[type(target).__module__]
    rule, stacks = module.torch_recurrent_gated_delta_rule, set()

    def counting_rule(*args, initial_state=None, **kwargs):
        stacks.add((initial_state.dtype, initial_state.shape[0]))
        return rule(*args, initial_state=initial_state, **kwargs)

    monkeypatch.setattr(module, "torch_recurrent_gated_delta_rule", counting_rule)
    expected = target.generate(PROMPT, max_new_tokens=40, **GREEDY)
    drafter = forcing_drafter(target, successor_table(expected))
    outputs = []
    for assistant in (None, drafter):
        cache = transformers.DynamicCache(config=target.config)
        with torch.no_grad():
            target(PROMPT[:, :6], **{CACHE_ARGUMENT: cache})
        linear = [layer for layer in cache.layers if hasattr(layer, "recurrent_states")]
        linear[0].recurrent_states[0] = linear[0].recurrent_states[0].double()
        extra = {} if assistant is None else {"assistant_model": assistant, "draft_policy": "fixed"}
        outputs.append(target.generate(PROMPT, **{CACHE_ARGUMENT: cache}, max_new_tokens=40, **GREEDY, **extra))
        assert linear[0].recurrent_states[0].dtype == torch.float64
    assert torch.equal(outputs[1], outputs[0])
    stats = drafter.last_generation_stats
    assert rolled_back(stats) > 0 and stats.rereads == 0
    # The other layers' states in one call (batch: one row per layer), the float64 layer's in one of its own (seen
    # where one token was kept: more go through the chunked rule on a CPU, grouped by the same code).
    assert (torch.float32, len(linear) - 1) in stacks and (torch.float64, 1) in stacks

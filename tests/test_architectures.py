"""Targets beyond Qwen3 and Llama: greedy output identical to the target alone, one sequence and a batch.

A drafter reads its target through transformers' generic interfaces only (embeddings, LM head, hidden states, the
cache), so any decoder-only model should serve. These tiny models, built from configs, cover what differs between
families: tied embeddings and attention biases (Qwen2), sliding-window attention in every layer (Mistral) or in
some (Gemma 2; Gemma 3, with rotary parameters per layer type), fused projections (Phi-3, GPT-NeoX,
GPT-2), learned absolute positions (GPT-2; OPT's, counted from the attention mask), ALiBi from the attention
mask (Bloom, Falcon), mixture-of-experts MLPs (Qwen3-MoE), and the newer families listed at `ARCHITECTURES` (attention
sinks, latent attention, sparse attention's indexer keys, head sizes per layer, layers sharing keys and values); MPT,
whose ALiBi counts cache columns, is refused in batches, and targets whose layers pass several residual streams
(hyper-connections, AltUp) altogether. In a batch, rejected drafts leave holes in the cache, so a sliding window (or
Llama 4's attention chunk) must be counted in each row's own tokens rather than in cache columns
(`ragged_masks_domino.SlidingWindow`), and so must Llama 4's query temperature (`QueryTemperature`); the windows here
are far shorter than the sequences, so every row's window moves past holes. Also the drafter's side: saved and reloaded as remote code, and the training warm start, which
copies only decoder layers that compute what a draft layer does.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import SPECIAL_TOKENS, forward_inputs, own_drafts, same_tensors, tiny_drafter
from test_batching import assert_same_hidden_states, left_padded, prefill_rows
from test_recurrent_targets import counts_linear_tokens
from transformers import DynamicCache

from hf_domino.cache_domino import CACHE_ARGUMENT, cache_argument
from hf_domino.ragged_masks_domino import SlidingWindow

WINDOW = 8
EXPERTS = {"num_experts_per_tok": 2, "moe_intermediate_size": 16}
ROUTED_EXPERTS = {"n_routed_experts": 4, "n_group": 1, "topk_group": 1}
# Multi-head latent attention at tiny sizes: keys and values of every head from one latent per token.
MLA = {
    "num_key_value_heads": 4,
    "kv_lora_rank": 16,
    "q_lora_rank": 24,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
    "head_dim": 4,
}
# The sparse-attention indexer picks the 8 likeliest keys of each query. Its scores are sums over its heads of ReLUs,
# and with 2 heads many are exactly 0: ties, which topk breaks differently for a whole sequence and one token, so
# that the target alone's outputs depend on how it is fed. 16 heads leave no ties.
INDEXER = {"index_n_heads": 16, "index_head_dim": 8, "index_topk": 8}
ARCHITECTURES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": WINDOW}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"sliding_window": WINDOW}),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {"sliding_window": WINDOW, "layer_types": ["sliding_attention"] * 3 + ["full_attention"]},
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"n_embd": 32, "n_layer": 4, "n_head": 4, "n_positions": 128}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
    ),
    "cohere2": (
        "Cohere2Config",
        "Cohere2ForCausalLM",
        {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"] * 2},
    ),
    "bloom": ("BloomConfig", "BloomForCausalLM", {"intermediate_size": None, "head_dim": None}),
    # ALiBi from the attention mask, and no MLP width in its config (the drafter takes 4 x hidden)
    "falcon": ("FalconConfig", "FalconForCausalLM", {"alibi": True, "intermediate_size": None, "head_dim": None}),
    "opt": ("OPTConfig", "OPTForCausalLM", {"ffn_dim": 64, "word_embed_proj_dim": 32}),  # positions from the mask
    # The targets of the published DFlash drafters beyond Qwen and Llama, and the newest families: attention sinks in
    # alternating sliding and full layers (gpt-oss); multi-head latent attention, whose cache keeps one compressed
    # latent "head" (DeepSeek-V3, Kimi-K2.5's text model; LongCat-Flash); sparse attention whose indexer keeps keys of
    # its own per token, a second column-aligned cache in each layer (DeepSeek-V3.2, GLM-5); layers without rotary
    # positions (SmolLM3); sliding windows in patterns of their own (OLMo 3, EXAONE 4); GLM-4.5 and MiniMax-M2 experts.
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {
            **EXPERTS,
            "num_local_experts": 4,
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
        },
    ),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {**MLA, **EXPERTS, **ROUTED_EXPERTS}),
    "longcat_flash": (
        "LongcatFlashConfig",
        "LongcatFlashForCausalLM",
        {
            **MLA,
            # 8 attention sublayers, two in each of 4 decoder layers (`num_layers`): hidden states come per decoder
            # layer, and a drafter's default target layers must be among them (1 and 5 of 8, before, were not)
            "num_hidden_layers": 8,
            "n_routed_experts": 4,
            "moe_topk": 2,
            "expert_ffn_hidden_size": 16,
            "ffn_hidden_size": 64,
        },
    ),
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM", {**MLA, **EXPERTS, **ROUTED_EXPERTS, **INDEXER}),
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", {**MLA, **EXPERTS, **ROUTED_EXPERTS, **INDEXER}),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {"no_rope_layer_interval": 2}),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", {"sliding_window": WINDOW}),
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", {"sliding_window": WINDOW, "sliding_window_pattern": 2}),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", {**EXPERTS, **ROUTED_EXPERTS}),
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM", {**EXPERTS, "num_local_experts": 4}),
    # Gemma 4: head sizes per layer type (transformers' heterogeneous configs, which refuse a global `head_dim`),
    # per-layer token embeddings, and the last layers reading the keys and values of earlier ones.
    "gemma4": (
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        {
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "vocab_size_per_layer_input": 64,
            "hidden_size_per_layer_input": 8,
            "num_kv_shared_layers": 2,
        },
    ),
    "cohere2_moe": ("Cohere2MoeConfig", "Cohere2MoeForCausalLM", {**EXPERTS, "num_experts": 4}),  # no rms_norm_eps
    # sparse-attention layers (the indexer's keys cached beside latents) between sliding-window ones
    "dots3_note": (
        "Dots3NoteTextConfig",
        "Dots3NoteForCausalLM",
        {
            **MLA,
            **EXPERTS,
            **ROUTED_EXPERTS,
            **INDEXER,
            "sliding_window": WINDOW,
            "layer_types": ["indexed_attention", "sliding_attention"] * 2,
            # the sliding layers' attention at tiny sizes too: the config's defaults for them are the released
            # model's, 76M parameters at these sizes (2.4 s per 40 tokens, against 0.27 s)
            **{f"swa_{name}": size for name, size in MLA.items() if name != "head_dim"},
            "swa_num_attention_heads": 4,
            "swa_head_dim": MLA["qk_nope_head_dim"] + MLA["qk_rope_head_dim"],
        },
    ),
    # Llama 4: chunked attention (each row's tokens in chunks, counted from its left padding) beside layers without
    # rotary positions that scale their queries by cache column (its attention temperature, sized to change within
    # these outputs: a column counted with the batch's holes gives another greedy output).
    "llama4": (
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        {
            "attention_chunk_size": WINDOW,
            "no_rope_layer_interval": 2,
            "floor_scale": 12,
            "attn_scale": 2.0,
            "num_local_experts": 4,
            "num_experts_per_tok": 1,
            "intermediate_size_mlp": 64,
        },
    ),
}
SLIDING = ["mistral", "gemma2", "gemma3", "cohere2", "gpt_oss", "olmo3", "exaone4", "gemma4", "dots3_note", "llama4"]
# Prompts that repeat themselves, so that copied drafts are accepted too, beside the random drafter's rejected ones.
PROMPT = [5, 9, 12, 7, 30, 5, 9, 12, 7, 30, 5, 9, 12, 40, 41, 42, 5, 9]
ROWS = [[11, 5, 9, 12, 7, 5, 9, 12], [5, 9, 12, 7, 30, 5, 9, 12, 7, 30, 22]]
GREEDY = {"do_sample": False, "eos_token_id": None, "pad_token_id": 0}


SIZES = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "tie_word_embeddings": False,
    "max_position_embeddings": 128,
}


def architecture_target(name: str, architectures: dict = ARCHITECTURES):
    config_class, model_class, overrides = architectures[name]
    torch.manual_seed(0)
    kwargs = {name: value for name, value in {**SIZES, **SPECIAL_TOKENS, **overrides}.items() if value is not None}
    config = getattr(transformers, config_class)(**kwargs)
    return with_large_weights(getattr(transformers, model_class)(config).eval())


def with_large_weights(target):
    with torch.no_grad():  # weights large enough that each layer, and each window, changes the greedy choice
        for param in target.parameters():
            if param.dim() > 1:
                param.normal_(0, 0.3)
    return target


def had_rejections(stats) -> bool:
    """Whether some forward verified drafts and rejected part of them (which leaves holes in a batch's caches)."""
    return any(n and accepted < n + 1 for n, accepted in zip(stats.drafted, stats.acceptance_lengths))


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_greedy_output_is_the_target_alone_for_one_sequence_and_a_batch(name):
    target = architecture_target(name)
    drafter = tiny_drafter(target)
    fixed = {"draft_policy": "fixed", "num_speculative_tokens": 4}
    prompt = torch.tensor([PROMPT])
    expected = target.generate(prompt, max_new_tokens=40, **GREEDY)
    output = target.generate(prompt, max_new_tokens=40, assistant_model=drafter, **GREEDY, **fixed)
    assert torch.equal(output, expected)
    batch = left_padded(ROWS)
    expected = target.generate(**batch, max_new_tokens=30, **GREEDY)
    for options in (fixed, {"draft_policy": "fixed", "num_speculative_tokens": 4, "domino_lookup": False}):
        output = target.generate(**batch, max_new_tokens=30, assistant_model=drafter, **GREEDY, **options)
        assert torch.equal(output, expected), options
        assert had_rejections(drafter.last_generation_stats)
    if name in SLIDING:  # the window is counted in each row's tokens: outputs far longer than it, holes in them
        assert expected.shape[1] > 4 * WINDOW


@pytest.mark.parametrize("name", SLIDING)
def test_a_chunked_prefill_keeps_each_rows_window(name):
    # prefill_chunk_size read in the target alone's chunks (4 + 4 + 3 columns): a chunk's window reaches back into
    # the chunks before it, among the rows' left padding.
    target = architecture_target(name)
    drafter = tiny_drafter(target)
    batch = left_padded(ROWS)
    expected = target.generate(**batch, max_new_tokens=24, prefill_chunk_size=4, **GREEDY)
    fixed = {"draft_policy": "fixed", "num_speculative_tokens": 4}
    output = target.generate(
        **batch, max_new_tokens=24, prefill_chunk_size=4, assistant_model=drafter, **GREEDY, **fixed
    )
    assert torch.equal(output, expected)


@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_a_prompts_copies_read_once_keep_their_windows_on_a_sliding_target(name):
    # num_return_sequences' copies share their prompt's prefill; each copy's window is still counted in its own
    # tokens past the holes its rejections leave. top-k 1 makes sampling as deterministic as greedy.
    target = architecture_target(name)
    drafter = tiny_drafter(target)
    batch = left_padded(ROWS)
    decoding = {**GREEDY, "do_sample": True, "top_k": 1, "num_return_sequences": 2, "max_new_tokens": 30}
    expected = target.generate(**batch, **decoding)
    with prefill_rows(target) as rows:
        output = target.generate(**batch, **decoding, assistant_model=drafter, draft_policy="fixed")
    assert torch.equal(output, expected)
    assert rows == [len(ROWS)] and had_rejections(drafter.last_generation_stats)


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_prepared_for_a_cpu_with_the_default_policy_rows_stopping_at_their_eos(name):
    # prepare_for_cpu_decoding measures verification on a scratch cache of the target's own kind (sliding layers
    # included; they must give the measured blocks back) for one row and a batch's; rows stop at different times.
    from hf_domino import prepare_for_cpu_decoding

    target = architecture_target(name)
    drafter = tiny_drafter(target)
    prepare_for_cpu_decoding(target, drafter, batch_size=2)
    stopping = {**GREEDY, "eos_token_id": 7}
    for inputs in ({"input_ids": torch.tensor([PROMPT])}, left_padded(ROWS)):
        expected = target.generate(**inputs, max_new_tokens=30, **stopping)
        output = target.generate(**inputs, max_new_tokens=30, assistant_model=drafter, **stopping)
        assert torch.equal(output, expected)


def a_first_turn(target, batch: dict, cache, new_tokens: int) -> dict:
    """The batch after a first turn generated into `cache`: its sequences and their attention mask."""
    sequences = target.generate(**batch, **{CACHE_ARGUMENT: cache}, max_new_tokens=new_tokens, **GREEDY)
    added = torch.ones(sequences.shape[0], sequences.shape[1] - batch["input_ids"].shape[1], dtype=torch.long)
    return {"input_ids": sequences, "attention_mask": torch.cat([batch["attention_mask"], added], dim=1)}


def test_a_batch_continues_a_sliding_cache_whose_window_was_not_reached():
    # A chat's next turn: the sliding layers still hold every token, so they become whole layers for the call.
    from transformers import DynamicCache

    target = architecture_target("mistral")
    target.config.sliding_window = 128
    drafter = tiny_drafter(target)
    outputs = []
    for assistant in ({}, {"assistant_model": drafter, "draft_policy": "fixed", "num_speculative_tokens": 4}):
        cache = DynamicCache(config=target.config)
        second = a_first_turn(target, left_padded(ROWS), cache, new_tokens=10)
        outputs.append(target.generate(**second, **{CACHE_ARGUMENT: cache}, max_new_tokens=20, **GREEDY, **assistant))
    assert torch.equal(outputs[1], outputs[0])
    assert own_drafts(drafter.last_generation_stats) > 0


def test_a_batch_on_a_target_biased_by_cache_column_is_refused_and_one_sequence_is_exact():
    import transformers as tf

    torch.manual_seed(0)
    config = tf.MptConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=4, use_cache=True, **SPECIAL_TOKENS)
    target = tf.MptForCausalLM(config).eval()
    drafter = tiny_drafter(target)
    fixed = {"draft_policy": "fixed", "num_speculative_tokens": 4}
    prompt = torch.tensor([PROMPT])
    expected = target.generate(prompt, max_new_tokens=20, **GREEDY)
    assert torch.equal(
        target.generate(prompt, max_new_tokens=20, assistant_model=drafter, **GREEDY, **fixed), expected
    )
    with pytest.raises(ValueError, match="biases attention by cache column"):
        target.generate(**left_padded(ROWS), max_new_tokens=4, assistant_model=drafter, **GREEDY)
    target.config.use_cache = target.generation_config.use_cache = False  # MPT's own default
    with pytest.raises(ValueError, match="as MPT's is.*Pass use_cache=True"):
        target.generate(prompt, max_new_tokens=4, assistant_model=drafter, **GREEDY)


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v32", "glm_moe_dsa"])
def test_latent_and_sparse_attention_caches_compacted_every_cycle_give_the_same_rows(name, monkeypatch):
    """Their caches hold other columns than keys and values of every head (one latent per token; the indexer's keys):
    moved together when holes are compacted, every cycle here."""
    from hf_domino import ragged_cache_domino
    from hf_domino.ragged_cache_domino import RaggedCache

    target = architecture_target(name)
    drafter = tiny_drafter(target)
    batch = left_padded(ROWS)
    expected = target.generate(**batch, max_new_tokens=30, **GREEDY)
    compactions = []
    original = RaggedCache.maybe_compact

    def counted(self) -> bool:
        compactions.append(original(self))
        return compactions[-1]

    monkeypatch.setattr(RaggedCache, "maybe_compact", counted)
    monkeypatch.setattr(ragged_cache_domino, "COMPACT_FRACTION", 0.0)
    monkeypatch.setattr(ragged_cache_domino, "MIN_COMPACT_COLUMNS", 0)
    output = target.generate(
        **batch, max_new_tokens=30, assistant_model=drafter, draft_policy="fixed", num_speculative_tokens=4, **GREEDY
    )
    assert torch.equal(output, expected)
    assert sum(compactions) > 3


@pytest.mark.parametrize("name", ["hy_v4", "gemma3n"])
def test_targets_with_several_residual_streams_are_refused_naming_the_fix(name):
    """Hyper-connections (Hunyuan V4's) and AltUp (Gemma 3n's) keep several residual streams between layers, merged
    only before the LM head: no drafter format reads such hidden states, so a call says so instead of failing inside
    the drafter's attention."""
    streams = {
        "hy_v4": ("HYV4Config", "HYV4ForCausalLM", {}),
        "gemma3n": (
            "Gemma3nTextConfig",
            "Gemma3nForCausalLM",
            {
                **ARCHITECTURES["gemma4"][2],  # the same per-layer embeddings and shared keys and values
                "laurel_rank": 4,
                "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0],
                "altup_num_inputs": 2,  # and MLP widths listed per layer
            },
        ),
    }
    target = architecture_target(name, streams)
    drafter = tiny_drafter(target)
    for inputs in ({"input_ids": torch.tensor([PROMPT])}, left_padded(ROWS)):
        with pytest.raises(ValueError, match="several residual streams.*Generate without the drafter"):
            target.generate(**inputs, max_new_tokens=8, assistant_model=drafter, **GREEDY)


# Where a tree's 4D mask cannot serve (found by tests/test_option_mixes.py's mixes on these families, 2026-12-06:
# Mistral's window, set without layer types, went unnoticed and its trees' output was not the target alone's; Bloom's
# and Falcon's ALiBi, built from a 2D mask, crashed on the tree's 4D one).
TREES_REFUSED = {
    name: "(sliding|chunked|indexed)_attention" for name in (*SLIDING, "cohere2_moe", "deepseek_v32", "glm_moe_dsa")
} | {"mistral": "slides over a window", "bloom": "ALiBi biases from a 2D attention mask", "falcon": "ALiBi"}


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_trees_keep_the_target_alones_output_or_are_refused_naming_the_fix(name):
    target = architecture_target(name)
    drafter = tiny_drafter(target)
    tree = dict(domino_branches=3, draft_policy="fixed", num_speculative_tokens=3)
    for batch in (left_padded([PROMPT]), left_padded(ROWS)):
        expected = target.generate(**batch, max_new_tokens=16, **GREEDY)
        if name in TREES_REFUSED:
            with pytest.raises(ValueError, match=f"domino_branches=3 cannot serve.*{TREES_REFUSED[name]}.*Or drop"):
                target.generate(**batch, max_new_tokens=16, **GREEDY, assistant_model=drafter, **tree)
        else:
            output = target.generate(**batch, max_new_tokens=16, **GREEDY, assistant_model=drafter, **tree)
            assert torch.equal(output, expected)


def test_a_target_whose_cache_layers_cannot_be_cropped_is_refused_before_its_prefill():
    """DeepSeek-V4's compressed-attention cache layers say they cannot be cropped (`is_croppable`): rejected drafts
    could not be dropped. transformers' assisted loop found it only after the prefill, naming no fix, and a batch was
    told to go one prompt at a time, which then failed too; both, and requests joining a batch (generate_batch), are
    refused before any forward, naming the fix (before transformers 5.25, which marks the model stateful, as a
    family with states drafting does not serve)."""
    from hf_domino import prepare_for_cpu_decoding

    compressed = {
        "deepseek_v4": (
            "DeepseekV4Config",
            "DeepseekV4ForCausalLM",
            {**EXPERTS, **ROUTED_EXPERTS, "sliding_window": 8},
        )
    }
    target = architecture_target("deepseek_v4", compressed)
    drafter = tiny_drafter(target)
    # Preparing packs its products and measures no verification, which would crop its cache (a shape error before).
    assert prepare_for_cpu_decoding(target, drafter).prepacked["target"]
    forwards = []
    target.register_forward_pre_hook(lambda *args: forwards.append(1))
    for inputs in ({"input_ids": torch.tensor([PROMPT])}, left_padded(ROWS)):
        with pytest.raises(
            ValueError,
            match=r"DeepseekV4ForCausalLM.*(cannot be cropped|keeps recurrent).*generate without the drafter",
        ):
            target.generate(**inputs, max_new_tokens=8, assistant_model=drafter, **GREEDY)
    if not getattr(transformers.DynamicCache(config=target.config), "is_croppable", True):  # its layers from 5.25
        with pytest.raises(ValueError, match=r"DeepseekV4ForCausalLM.*cannot be cropped"):  # requests that join
            config = transformers.GenerationConfig(max_new_tokens=8)
            target.generate_batch(ROWS, generation_config=config, assistant_model=drafter)
    assert forwards == []


def test_the_architecture_sweep_runs_as_documented_and_tells_served_from_refused():
    """examples/architecture_sweep.py as a user runs it, on a few families: one served, one refused, one whose generic
    tiny sizes do not fit its config, a vision-language one (its towers built small too, in seconds), and one whose
    type maps to its text model (Qwen3.5, recurrent layers); exit status 0 (no defect)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "architecture_sweep.py"
    # Each family with the sweep's default time (120 s): 16 s for all five alone, but a fresh CI run on transformers
    # 5.23 with two other processes beside its workers took qwen3, the first (its imports included), past 60 s.
    done = subprocess.run(
        [sys.executable, str(script), "qwen3", "hy_v4", "zaya", "gemma3", "qwen3_5"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    lines = dict(line.split(maxsplit=1) for line in done.stdout.splitlines()[1:-1])
    assert lines["qwen3"] == "ok"
    assert lines["hy_v4"].startswith("refused: The target's hidden states")
    assert lines["zaya"].startswith("not built")
    assert lines["gemma3"] == "ok"
    assert lines["qwen3_5"] == "ok"  # built as the text model its type maps to, with that model's config
    assert done.stdout.splitlines()[-1] == "0 defects"


def test_the_sliding_targets_cover_each_kind_of_mask():
    from transformers.cache_utils import DynamicCache

    kinds = set()
    for name in SLIDING:
        target = architecture_target(name)
        window = SlidingWindow.take_over(DynamicCache(config=target.config), target)
        kinds.add((window.every_layer, window.additive))
    # Mistral: one mask for all layers; Gemma 2 (eager attention): additive masks by layer type; Gemma 3 (sdpa):
    # boolean masks by layer type.
    assert kinds == {(True, False), (False, True), (False, False)}


@pytest.mark.parametrize("name", ["qwen2", "gemma3", "gpt2"])
def test_a_drafter_for_the_family_reloads_as_remote_code_and_drafts_the_same(name, tmp_path):
    from transformers import AutoModel

    target = architecture_target(name)
    drafter = tiny_drafter(target)
    drafter.save_pretrained(tmp_path)
    reloaded = AutoModel.from_pretrained(tmp_path, trust_remote_code=True)
    assert type(reloaded).__module__.startswith("transformers_modules")
    options = {"max_new_tokens": 30, "draft_policy": "fixed", "num_speculative_tokens": 4, **GREEDY}
    prompt = torch.tensor([PROMPT])
    with forward_inputs(target) as drafted:
        expected = target.generate(prompt, assistant_model=drafter, **options)
    with forward_inputs(target) as drafted_again:
        assert torch.equal(target.generate(prompt, assistant_model=reloaded, **options), expected)
    # The same drafts offered at every verification (a random drafter's are rejected: acceptance could not tell).
    assert same_tensors(drafted_again, drafted) and own_drafts(reloaded.last_generation_stats) > 0


def test_a_sliding_window_counts_each_rows_tokens_not_its_columns():
    window = SlidingWindow(size=3, every_layer=True, additive=False)
    # Row 0: a pad, tokens t0 t1, a hole (a rejected draft), then t2 t3 as the forward's two queries.
    real = torch.tensor([[False, True, True, False, True, True]])
    mask = window.masks(real, queries=2, dtype=torch.float32)[0, 0]
    # t2 (position 2) sees t0, t1, itself; t3 (position 3) sees t1, t2, itself: the hole takes no room in the window.
    assert mask.tolist() == [[False, True, True, False, True, False], [False, False, True, False, True, True]]
    hybrid = SlidingWindow(size=3, every_layer=False, additive=True).masks(real, queries=2, dtype=torch.float32)
    assert set(hybrid) == {"full_attention", "indexed_attention", "sliding_attention"}  # sparse attention's: full
    assert torch.equal(hybrid["sliding_attention"] == 0, mask[None, None])
    assert torch.equal(hybrid["indexed_attention"], hybrid["full_attention"])
    assert (hybrid["full_attention"][0, 0] == 0).tolist() == [
        [False, True, True, False, True, False],
        [False, True, True, False, True, True],
    ]


def test_sliding_window_masks_match_transformers_where_a_batch_has_no_holes():
    # Without holes (left padding only), a row's columns after its padding are its tokens: transformers' own masks.
    from transformers.masking_utils import create_sliding_window_causal_mask

    target = architecture_target("mistral")
    batch = left_padded([[1 + i for i in range(20)], [3 + i for i in range(13)]])
    real = batch["attention_mask"].bool()
    embeds = target.get_input_embeddings()(batch["input_ids"])
    expected = create_sliding_window_causal_mask(
        config=target.config, inputs_embeds=embeds, attention_mask=batch["attention_mask"], **cache_argument(None)
    )
    ours = SlidingWindow(size=WINDOW, every_layer=True, additive=False).masks(real, real.shape[1], torch.float32)
    queries = real[:, :, None]  # rows of padding queries differ (transformers lets them see nothing or all): unused
    assert torch.equal(ours[:, 0] & queries, expected[:, 0] & queries)


def test_sliding_window_masks_match_transformers_where_a_mask_leaves_out_columns_inside_rows():
    # transformers counts the window in columns, those the mask leaves out included (`prompt_gaps` adds them back).
    from transformers.masking_utils import create_sliding_window_causal_mask

    from hf_domino.ragged_masks_domino import prompt_gaps

    target = architecture_target("mistral")
    batch = left_padded([[1 + i for i in range(20)], [3 + i for i in range(13)]])
    batch["attention_mask"][0, 4:9] = 0
    batch["attention_mask"][1, 10:12] = 0
    real = batch["attention_mask"].bool()
    assert prompt_gaps(torch.ones(2, 3, dtype=torch.bool)) is None
    assert prompt_gaps(left_padded([[1, 2], [3]])["attention_mask"].bool()).tolist() == [[0, 0, 0], [1, 1, 1]]
    embeds = target.get_input_embeddings()(batch["input_ids"])
    expected = create_sliding_window_causal_mask(
        config=target.config, inputs_embeds=embeds, attention_mask=batch["attention_mask"], **cache_argument(None)
    )
    window = SlidingWindow(size=WINDOW, every_layer=True, additive=False)
    ours = window.masks(real, real.shape[1], torch.float32, prompt_gaps(real))
    queries = real[:, :, None]
    assert torch.equal(ours[:, 0] & queries, expected[:, 0] & queries)
    assert not torch.equal(window.masks(real, real.shape[1], torch.float32)[:, 0] & queries, ours[:, 0] & queries)


def test_chunked_attention_masks_match_transformers_counting_chunks_from_each_rows_left_padding():
    # Llama 4's chunks start at a row's first column after its left padding; columns left out inside it count.
    from transformers.masking_utils import create_chunked_causal_mask

    from hf_domino.ragged_masks_domino import prompt_gaps

    target = architecture_target("llama4")
    window = SlidingWindow.take_over(DynamicCache(config=target.config), target)
    assert (window.layer_type, window.size, window.every_layer) == ("chunked_attention", WINDOW, False)
    batch = left_padded([[1 + i for i in range(20)], [3 + i for i in range(13)]])
    batch["attention_mask"][0, 4:9] = 0
    real = batch["attention_mask"].bool()
    embeds = target.get_input_embeddings()(batch["input_ids"])
    expected = create_chunked_causal_mask(
        config=target.config, inputs_embeds=embeds, attention_mask=batch["attention_mask"], **cache_argument(None)
    )
    ours = window.masks(real, real.shape[1], torch.float32, prompt_gaps(real))["chunked_attention"]
    queries = real[:, :, None]
    assert torch.equal(ours[:, 0] & queries, expected[:, 0] & queries)
    left_padding_alone = left_padded([[1 + i for i in range(20)], [3 + i for i in range(13)]])
    real = left_padding_alone["attention_mask"].bool()  # its gaps are dropped (`BatchedDecoding`): none inside rows
    expected = create_chunked_causal_mask(
        config=target.config, inputs_embeds=embeds, attention_mask=left_padding_alone["attention_mask"],
        **cache_argument(None),
    )  # fmt: skip
    ours = window.masks(real, real.shape[1], torch.float32)["chunked_attention"]
    assert torch.equal(ours[:, 0] & real[:, :, None], expected[:, 0] & real[:, :, None])


def test_llama4s_query_temperature_scaled_per_row_is_the_targets_own_to_the_bit():
    # `QueryTemperature.scaled` turns the layers' own scaling off and applies it per row: given the columns the
    # target counts (no holes), the same logits exactly; given others, other logits (it is what the layers read).
    from hf_domino.ragged_masks_domino import QueryTemperature

    target = architecture_target("llama4")
    temperature = QueryTemperature.of(target)
    assert len(temperature.modules) == 2  # the layers without rotary positions
    assert QueryTemperature.of(architecture_target("mistral")) is None
    batch = left_padded(ROWS)
    expected = target(**batch).logits
    columns = torch.arange(batch["input_ids"].shape[1]).expand(2, -1)
    with temperature.scaled(columns):
        assert torch.equal(target(**batch).logits, expected)
    assert all(module.attn_temperature_tuning for module in temperature.modules)  # handed back
    with temperature.scaled(columns + 12):
        assert not torch.allclose(target(**batch).logits, expected)


def test_llama4_without_chunks_verifies_trees_each_query_scaled_by_its_rows_column():
    # With no chunked layers (attention_chunk_size=None) trees serve Llama 4: the branches' queries are scaled by
    # their positions along their branch, the target alone's columns, not the forward's.
    config = transformers.Llama4TextConfig(
        **{**SIZES, **SPECIAL_TOKENS, **ARCHITECTURES["llama4"][2], "attention_chunk_size": None}
    )
    try:
        DynamicCache(config=config)
    except TypeError:  # transformers 5.23 gives its layers a sliding window of None
        pytest.skip(
            "this transformers cannot build Llama 4's cache without chunks (nor generate with the target alone)"
        )
    torch.manual_seed(0)
    target = with_large_weights(transformers.Llama4ForCausalLM(config).eval())
    drafter = tiny_drafter(target)
    batch = left_padded(ROWS)
    expected = target.generate(**batch, max_new_tokens=30, **GREEDY)
    output = target.generate(**batch, max_new_tokens=30, assistant_model=drafter, **GREEDY, draft_policy="fixed",
                             num_speculative_tokens=3, domino_branches=2)  # fmt: skip
    assert torch.equal(output, expected)
    assert had_rejections(drafter.last_generation_stats) and set(config.layer_types) == {"full_attention"}


@pytest.mark.parametrize("name", SLIDING)
def test_a_sliding_batch_whose_mask_leaves_out_columns_inside_rows_is_the_target_alones(name):
    # Padding inside a row (a chat's answer padding masked out, say) counts in the target alone's window.
    target = architecture_target(name)
    drafter = tiny_drafter(target)
    batch = left_padded(ROWS)
    batch["attention_mask"][0, 3:6] = 0
    batch["attention_mask"][1, 2] = 0
    expected = target.generate(**batch, max_new_tokens=30, **GREEDY)
    output = target.generate(**batch, max_new_tokens=30, assistant_model=drafter, **GREEDY, draft_policy="fixed",
                             num_speculative_tokens=4)  # fmt: skip
    assert torch.equal(output, expected)
    assert had_rejections(drafter.last_generation_stats)


# One family for each kind of cache a batch leaves: every layer sliding, sliding beside full, layers sharing another's
# keys (DummyLayer), chunked beside full (Llama 4's), sparse attention's indexer keys, both beside sliding layers, and
# recurrent states.
CACHE_KINDS = ["mistral", "gemma3", "gemma4", "llama4", "deepseek_v32", "dots3_note", "falcon_h1", "qwen3_5", "mamba2"]
RECURRENT_KINDS = ("falcon_h1", "qwen3_5", "mamba2")


def cache_kind_target(name: str):
    from test_recurrent_targets import FAMILIES, hybrid_target

    return hybrid_target(name) if name in FAMILIES else architecture_target(name)


def assert_the_target_alones_cache(cache, alone, attended: torch.BoolTensor) -> None:
    """`cache` holds what `alone` holds at every column a next turn attends to: per layer the same kind of layer
    (a sliding one keeping its window), and the same keys, values and indexer keys there; the same recurrent states
    and convolution windows per row, and the same counts."""
    from transformers.cache_utils import CacheLayerMixin

    from hf_domino.ragged_cache_domino import COLUMN_STATES, column_states
    from hf_domino.recurrent_cache_domino import row_states

    if counts_linear_tokens() or any(isinstance(layer, CacheLayerMixin) for layer in alone.layers):
        assert cache.get_seq_length() == alone.get_seq_length()
    for ours, theirs in zip(cache.layers, alone.layers, strict=True):
        assert isinstance(ours, type(theirs))  # a plain layer may be the loop's `BufferedLayer`
        for name in (
            "is_sliding",
            "cumulative_length",
            "cumulative_length_linear",
            "record_past",
            "has_previous_state",
        ):
            assert getattr(ours, name, None) == getattr(theirs, name, None), name
        states, expected = row_states(ours), row_states(theirs)
        assert states.keys() == expected.keys()
        for key, state in states.items():
            torch.testing.assert_close(state, expected[key], atol=1e-5, rtol=1e-4, msg=str(key))
        states, expected = column_states(ours), column_states(theirs)
        assert states.keys() == expected.keys()
        for name, state in states.items():
            assert state.shape == expected[name].shape, name
            row_dim, column_dim = COLUMN_STATES[name]
            shape = [1] * state.dim()
            shape[row_dim], shape[column_dim] = state.shape[row_dim], state.shape[column_dim]
            seen = attended[:, -state.shape[column_dim] :].reshape(shape).expand_as(state)  # a window: the last ones
            torch.testing.assert_close(state[seen], expected[name][seen])


@pytest.mark.parametrize("name", ["gpt2", "opt"])
def test_hidden_states_of_a_batch_with_learned_positions_are_the_target_alones_at_its_padding_too(name):
    # A learned position embedding makes even a pad column's hidden states depend on the position the column gets:
    # the loop gives holes generate()'s (0, where it gave 1 before).
    target = architecture_target(name)
    drafter = tiny_drafter(target)
    batch = left_padded(ROWS)
    returned = {**GREEDY, "max_new_tokens": 12, "return_dict_in_generate": True, "output_hidden_states": True}
    expected = target.generate(**batch, **returned)
    output = target.generate(**batch, **returned, assistant_model=drafter, draft_policy="fixed")
    assert torch.equal(output.sequences, expected.sequences)
    assert_same_hidden_states(output.hidden_states, expected.hidden_states)


def eos_ending_one_row(target, batch: dict, new_tokens: int) -> int:
    """A token the target alone generates for the first row, after a few tokens where it can, and never for the
    others."""
    generated = target.generate(**batch, **GREEDY, max_new_tokens=new_tokens)[:, batch["input_ids"].shape[1] :]
    others = set(generated[1:].flatten().tolist())
    first_row = generated[0].tolist()
    return next(token for token in first_row[4:] + first_row[3::-1] if token not in others)


@pytest.mark.parametrize("name", CACHE_KINDS)
def test_a_batch_leaves_its_cache_as_the_target_alone_does_and_a_next_turn_continues_it(name):
    # Rows that end at EOS at different times, outputs far past the window: the cache a drafted batch leaves holds
    # what the target alone's holds (sliding layers their window, sparse layers their indexer keys, recurrent layers
    # each row's states after its padding too), and the next turn, drafted on it, answers as the target alone
    # continuing its own, reading only the new columns. Before, sliding layers came back full without their window,
    # sparse layers emptied of rows, recurrent ones empty.
    target = cache_kind_target(name)
    drafter = tiny_drafter(target)
    batch = left_padded(ROWS)
    options = {**GREEDY, "max_new_tokens": 20, "eos_token_id": eos_ending_one_row(target, batch, 20)}
    drafted = {"assistant_model": drafter, "draft_policy": "fixed", "num_speculative_tokens": 4}
    recurrent = name in RECURRENT_KINDS
    # A finished row's scores and hidden states after its end are read off the cache too (recurrent targets return
    # no hidden states with a drafter).
    returned = {"return_dict_in_generate": True, "output_scores": True, "output_hidden_states": not recurrent}
    alone, cache = DynamicCache(config=target.config), DynamicCache(config=target.config)
    reference = target.generate(**batch, **options, **cache_argument(alone), **returned)
    output = target.generate(**batch, **options, **cache_argument(cache), **drafted, **returned)
    expected = reference.sequences
    assert torch.equal(output.sequences, expected) and had_rejections(drafter.last_generation_stats)
    assert (expected[:, -1] == 0).any() and expected.shape[1] > 2 * WINDOW  # a row ended early; windows passed
    answers = torch.ones(2, expected.shape[1] - batch["input_ids"].shape[1], dtype=torch.long)
    attended = torch.cat([batch["attention_mask"], answers], dim=-1)[:, :-1].bool()
    for ours, theirs in zip(output.scores, reference.scores, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    if not recurrent:  # Weights scaled up (`with_large_weights`): fp32 rounding of other orders reaches 2e-4 here.
        assert_same_hidden_states(output.hidden_states, reference.hidden_states, tolerance=1e-3)
    assert getattr(output, CACHE_ARGUMENT) is cache
    assert_the_target_alones_cache(cache, alone, attended)
    new = torch.tensor([[5, 9, 12]] * 2)
    turn = {"input_ids": torch.cat([expected, new], dim=-1),
            "attention_mask": torch.cat([attended.long(), torch.ones(2, 4, dtype=torch.long)], dim=-1)}  # fmt: skip
    if name == "mamba2" and not counts_linear_tokens():  # its states alone cannot say how much of a prompt they hold
        with pytest.raises(ValueError, match="upgrade transformers"):
            target.generate(**turn, **options, **cache_argument(cache), **drafted)
        return
    read = []
    hook = target.register_forward_pre_hook(lambda module, args, kwargs: read.append(kwargs["input_ids"].shape[1]),
                                            with_kwargs=True)  # fmt: skip
    second = target.generate(**turn, **options, **cache_argument(cache), **drafted)
    hook.remove()
    assert read[0] == 4
    assert torch.equal(second, target.generate(**turn, **options, **cache_argument(alone)))


def test_a_sliding_window_target_on_an_attention_without_prepared_masks_is_refused():
    target = architecture_target("mistral")
    drafter = tiny_drafter(target)
    target.config._attn_implementation = "flex_attention"  # read before any forward: nothing runs on it
    with pytest.raises(ValueError, match='attn_implementation="sdpa"'):
        target.generate(**left_padded(ROWS), max_new_tokens=4, assistant_model=drafter, **GREEDY)


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("mistral", None),
        ("qwen2", r"weights a Qwen3 layer lacks \(self_attn.q_proj.bias"),
        ("phi3", r"lacks \(self_attn.qkv_proj.weight"),
        ("gemma2", "pre_feedforward_layernorm"),
        ("gpt_neox", "weights a Qwen3 layer lacks"),
        ("qwen3_moe", "mlp.experts"),
        ("gemma", "GemmaRMSNorm does not scale by its weight"),
    ],
)
def test_the_warm_start_copies_only_layers_that_compute_what_a_draft_layer_does(name, reason):
    from hf_domino import DominoConfig, DominoForSpeculation
    from hf_domino.training import init_from_target_layers

    # Gemma (1): Llama's layer, but its RMS norm scales by 1 + weight.
    target = architecture_target(name, {**ARCHITECTURES, "gemma": ("GemmaConfig", "GemmaForCausalLM", {})})
    config = DominoConfig.from_target(target.config, num_hidden_layers=1, target_layer_ids=[1, 2])
    drafter = DominoForSpeculation(config)
    if reason is None:
        assert init_from_target_layers(drafter, target) == [3]
        assert torch.equal(drafter.layers[0].mlp.down_proj.weight, target.model.layers[3].mlp.down_proj.weight)
        return
    with pytest.raises(ValueError, match=reason) as refused:
        init_from_target_layers(drafter, target)
    assert "leave out --init-from-target" in str(refused.value)


def test_sampling_keeps_each_rows_law_on_a_sliding_window_target():
    # A window of 2 tokens over short rows: after the first rejection, every later token's window reaches back past
    # a hole, so a window counted in columns draws from another law (chi-square against enumeration: p = 0.0 for
    # both prompts when `SlidingWindow.masks` counts columns, checked by hand; the flat law at T = 1 shows it).
    from test_generation import (
        chi_square_p_value,
        drafts_and_accepted,
        exact_sequence_distribution,
        sampled_continuations,
    )
    from transformers.generation.logits_process import LogitsProcessorList, TemperatureLogitsWarper

    vocab, num_new, per_prompt = 5, 4, 4000
    torch.manual_seed(3)
    config = transformers.MistralConfig(
        vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=4, sliding_window=2, pad_token_id=0, eos_token_id=None, bos_token_id=2,
    )  # fmt: skip
    target = transformers.MistralForCausalLM(config).eval()
    with torch.no_grad():
        for param in target.parameters():
            if param.dim() > 1:
                param.normal_(0, 1.0)
    drafter = tiny_drafter(target, block_size=4, mask_token_id=0)
    prompts = [[2, 4, 1], [3]]
    batch = left_padded(prompts)
    counts, stats = sampled_continuations(
        target, batch, num_new, per_prompt, temperature=1.0, assistant_model=drafter, draft_policy="fixed"
    )
    drafted, accepted = drafts_and_accepted(stats)
    assert 0 < accepted < drafted  # rejections happened: holes inside the windows
    processors = LogitsProcessorList([TemperatureLogitsWarper(1.0)])
    for prompt, observed in zip(prompts, counts):
        probs = exact_sequence_distribution(target, prompt, num_new, processors)
        assert chi_square_p_value(observed, probs, per_prompt) > 1e-3


def vision_language_target(name: str):
    """A tiny vision-language model: AutoModelForCausalLM loads Gemma 3's checkpoints (4B and up) as this class."""
    torch.manual_seed(0)
    text = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, tie_word_embeddings=False, **SPECIAL_TOKENS,
    )  # fmt: skip
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=8)
    if name == "llava":
        config = transformers.LlavaConfig(
            vision_config=transformers.CLIPVisionConfig(**vision, patch_size=4),
            text_config=transformers.LlamaConfig(**text),
            image_token_id=63,
        )
        target = transformers.LlavaForConditionalGeneration(config)
    else:
        config = transformers.Gemma3Config(
            vision_config=transformers.SiglipVisionConfig(**vision, patch_size=4),
            text_config=transformers.Gemma3TextConfig(**text, sliding_window=WINDOW),
            image_token_id=63, boi_token_id=61, eoi_token_id=62, mm_tokens_per_image=4,
        )  # fmt: skip
        target = transformers.Gemma3ForConditionalGeneration(config)
        with torch.no_grad():  # initialized to zeros, which would hand the text model no image at all
            target.model.multi_modal_projector.mm_input_projection_weight.normal_()
    target.generation_config.pad_token_id = 0
    return target.eval()


@pytest.mark.parametrize("name", ["llava", "gemma3"])
def test_a_vision_language_target_drafts_batches_with_and_without_images(name):
    """generate() hands such a target an empty `mm_encoder_outputs` for text alone, which the batch loop had refused;
    with images, the batch's prefill reads their encodings as the target alone's first step does."""
    target = vision_language_target(name)
    drafter = tiny_drafter(target)
    batch = left_padded(ROWS)
    expected = target.generate(**batch, max_new_tokens=16, **GREEDY)
    assert torch.equal(target.generate(**batch, assistant_model=drafter, max_new_tokens=16, **GREEDY), expected)
    image = [5, 9] + [63] * 4 if name == "llava" else [5, 9, 61] + [63] * 4 + [62]
    batch = left_padded([image + PROMPT[:8], [11] + image + PROMPT[3:12]])
    pixels = torch.randn(2, 3, 8, 8)
    for rows in (slice(0, 1), slice(0, 2)):  # one sequence (transformers' loop), a batch (ours)
        inputs = {key: value[rows] for key, value in batch.items()}
        if rows.stop == 1:
            inputs = {"input_ids": inputs["input_ids"][:, 1:]}  # the first row without its padding
        expected = target.generate(**inputs, pixel_values=pixels[rows], max_new_tokens=16, **GREEDY)
        output = target.generate(
            **inputs, pixel_values=pixels[rows], assistant_model=drafter, max_new_tokens=16, **GREEDY
        )
        assert torch.equal(output, expected), rows


@pytest.mark.parametrize("name", ["llava", "gemma3"])
def test_a_vision_language_target_prepared_for_a_cpu_drafts_a_batch_with_images(name):
    # prepare_for_cpu_decoding reads a multimodal config's key/value heads in its text config: Llava's were not read
    # (its attention not switched), and on Gemma 3's it raised an AttributeError (transformers' per-layer view of the
    # composite config has no layer count).
    from hf_domino import prepare_for_cpu_decoding

    target = vision_language_target(name)
    drafter = tiny_drafter(target)
    report = prepare_for_cpu_decoding(target, drafter, batch_size=2)
    assert "target" in report.attention and report.prepacked["target"]  # grouped key/value heads read in place
    image = [5, 9] + [63] * 4 if name == "llava" else [5, 9, 61] + [63] * 4 + [62]
    batch = {**left_padded([image + PROMPT[:8], [11] + image + PROMPT[3:12]]), "pixel_values": torch.randn(2, 3, 8, 8)}
    expected = target.generate(**batch, max_new_tokens=16, **GREEDY)
    assert torch.equal(target.generate(**batch, assistant_model=drafter, max_new_tokens=16, **GREEDY), expected)


def test_gemma4_as_auto_model_for_causal_lm_builds_it_drafts_text_one_sequence_and_batched():
    """`AutoModelForCausalLM` loads Gemma 4 checkpoints as `Gemma4ForConditionalGeneration`: its text model is the one
    tested above, behind the multimodal class."""
    text = {**SIZES, **SPECIAL_TOKENS, **ARCHITECTURES["gemma4"][2]}
    torch.manual_seed(0)
    target = with_large_weights(
        transformers.Gemma4ForConditionalGeneration(transformers.Gemma4Config(text_config=text))
    )
    target.generation_config.pad_token_id = 0
    drafter = tiny_drafter(target)
    for inputs in ({"input_ids": torch.tensor([PROMPT])}, left_padded(ROWS)):
        expected = target.generate(**inputs, max_new_tokens=30, **GREEDY)
        output = target.generate(**inputs, max_new_tokens=30, assistant_model=drafter, draft_policy="fixed", **GREEDY)
        assert torch.equal(output, expected)
        assert had_rejections(drafter.last_generation_stats)


def multimodal_rope_target(name: str):
    """A tiny Qwen vision-language model, whose text positions are multimodal RoPE's (three sections)."""
    text = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, **SPECIAL_TOKENS,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]},
    )  # fmt: skip
    vision = dict(depth=1, hidden_size=16, num_heads=2, patch_size=2, temporal_patch_size=1, spatial_merge_size=1)
    models = {
        "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration", {"embed_dim": 16, "hidden_size": 32}),
        "qwen2_5_vl": (
            "Qwen2_5_VLConfig",
            "Qwen2_5_VLForConditionalGeneration",
            {"intermediate_size": 32, "out_hidden_size": 32, "fullatt_block_indexes": [0]},
        ),
        "qwen3_vl": (
            "Qwen3VLConfig",
            "Qwen3VLForConditionalGeneration",
            {"intermediate_size": 32, "out_hidden_size": 32, "deepstack_visual_indexes": [0]},
        ),
    }
    config_class, model_class, extra = models[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(text_config=text, vision_config={**vision, **extra})
    target = getattr(transformers, model_class)(config).eval()
    target.generation_config.pad_token_id = 0
    return target


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_a_text_batch_of_a_target_with_multimodal_rotary_positions_drafts(name):
    """generate() hands such a target three sections of positions, which count each row's mask alike for text: the
    batch loop's positions are theirs (it had refused them as positions of the caller's own)."""
    target = multimodal_rope_target(name)
    batch = left_padded(ROWS)
    expected = target.generate(**batch, max_new_tokens=16, **GREEDY)
    output = target.generate(**batch, assistant_model=tiny_drafter(target), max_new_tokens=16, draft_policy="fixed",
                             **GREEDY)  # fmt: skip
    assert torch.equal(output, expected)


def test_images_in_a_batch_of_a_target_with_multimodal_rotary_positions_are_refused():
    target = vision_language_target("llava")
    target.model.get_rope_index = lambda *args, **kwargs: None  # as Qwen2-VL's and Qwen3-VL's models have
    batch = left_padded([[5, 9] + [63] * 4 + PROMPT[:8]] * 2)
    with pytest.raises(ValueError, match="multimodal RoPE"):
        target.generate(
            **batch, pixel_values=torch.randn(2, 3, 8, 8), assistant_model=tiny_drafter(target), max_new_tokens=4,
            **GREEDY,
        )  # fmt: skip


def test_images_in_a_batch_continuing_a_filled_cache_are_refused():
    target = vision_language_target("llava")
    batch = left_padded([[5, 9] + [63] * 4 + PROMPT[:8]] * 2)
    cache = transformers.DynamicCache(config=target.config)
    with torch.no_grad():
        target(
            input_ids=batch["input_ids"][:, :4],
            attention_mask=batch["attention_mask"][:, :4],
            **{CACHE_ARGUMENT: cache},
        )
    with pytest.raises(ValueError, match="already holds some of it"):
        target.generate(
            **batch, pixel_values=torch.randn(2, 3, 8, 8), assistant_model=tiny_drafter(target), max_new_tokens=4,
            **{CACHE_ARGUMENT: cache}, **GREEDY,
        )  # fmt: skip

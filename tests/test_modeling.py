"""DominoForSpeculation: published Domino/DFlash checkpoint folders, our own save format, remote code, model card."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from conftest import tiny_drafter, tiny_target
from reference_domino import backbone, gru_cell, head_correction, reference_config
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, Qwen3Config
from transformers.cache_utils import DynamicCache
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging as hf_logging

from hf_domino import DominoConfig, DominoForSpeculation, TargetModules, default_target_layer_ids
from hf_domino.drafting_domino import DrafterContext, draft_block, eager_rollout
from hf_domino.export import export_drafter

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, LAYERS, GRU, RANK = 32, 4, 2, 8, 48, 64, 2, 16, 8


def published_config(domino: bool, layer_keys_at_top: bool = False) -> dict:
    """A config.json shaped like the published Domino / DFlash ones (transformers-4 keys included)."""
    config = {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "hidden_size": HIDDEN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "rope_scaling": None,
        "max_position_embeddings": 40960,
        "vocab_size": VOCAB,
        "layer_types": ["full_attention"] * LAYERS,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_cache": True,
        "block_size": 16,
        "num_target_layers": 36,
        "dflash_config": {"mask_token_id": 5, "target_layer_ids": [1, 17, 33]},
    }
    if layer_keys_at_top:
        config.update(config.pop("dflash_config"))
    if domino:
        config.setdefault("dflash_config", {}).update(
            projector_type="domino", emb_dim=RANK, gru_hidden_dim=GRU, pure_draft_prefix_len=1, shift_label=True
        )
    return config


def published_tensors(domino: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=generator) * 0.3

    tensors = {
        "fc.weight": rand(HIDDEN, 3 * HIDDEN),
        "hidden_norm.weight": 1 + rand(HIDDEN),
        "norm.weight": 1 + rand(HIDDEN),
    }
    for i in range(LAYERS):
        p = f"layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM),
            p + "self_attn.q_norm.weight": 1 + rand(HEAD_DIM),
            p + "self_attn.k_norm.weight": 1 + rand(HEAD_DIM),
            p + "mlp.gate_proj.weight": rand(FFN, HIDDEN),
            p + "mlp.up_proj.weight": rand(FFN, HIDDEN),
            p + "mlp.down_proj.weight": rand(HIDDEN, FFN),
            p + "input_layernorm.weight": 1 + rand(HIDDEN),
            p + "post_attention_layernorm.weight": 1 + rand(HIDDEN),
        }
    if domino:
        tensors |= {
            "prefix_gru.weight_ih_l0": rand(3 * GRU, HIDDEN),
            "prefix_gru.weight_hh_l0": rand(3 * GRU, GRU),
            "embed_proj.0.weight": rand(RANK, HIDDEN + GRU),
            "embed_proj.2.weight": rand(VOCAB, RANK),
        }
    return tensors


def write_folder(path: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def load_quietly(path, **kwargs) -> tuple[DominoForSpeculation, str, list]:
    hf_logging.set_verbosity_warning()
    logger = hf_logging.get_logger("transformers")
    with CaptureLogger(logger) as captured, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = DominoForSpeculation.from_pretrained(path, **kwargs)
    return (
        model,
        captured.out,
        [w for w in caught if "hf_domino" in str(w.filename) or "transformers" in str(w.filename)],
    )


# ------------------------------------------------------------------------------------------- published formats
@pytest.mark.parametrize("domino, top_level", [(True, False), (False, False), (False, True)])
def test_published_folder_loads_without_warnings_and_matches_the_method(tmp_path, domino, top_level):
    tensors = published_tensors(domino)
    folder = write_folder(tmp_path / "published", published_config(domino, top_level), tensors)
    drafter, log, warned = load_quietly(folder)
    assert log == "" and warned == []
    config = drafter.config
    assert config.target_layer_ids == [1, 17, 33] and config.mask_token_id == 5 and config.block_size == 16
    assert config.rope_parameters["rope_theta"] == 1000000  # transformers-4 `rope_theta` mapped
    assert config.has_domino_head is domino and config.num_drafts == (16 if domino else 15)
    assert config.architectures is None or "DFlashDraftModel" not in config.architectures

    # Backbone: the model's forward (context of 7 tokens, block of 16) against the functional reference.
    generator = torch.Generator().manual_seed(1)
    context = torch.randn(7, 3 * HIDDEN, generator=generator)
    block = torch.randn(16, HIDDEN, generator=generator)
    positions = torch.arange(7 + 16)[None]
    with torch.no_grad():
        ours = drafter(block[None], context[None], positions)[0]
    torch.testing.assert_close(ours, backbone(tensors, reference_config(config), block, context, start=7))

    if domino:  # head: GRU steps and the logit correction
        tokens = torch.randn(3, HIDDEN, generator=generator)
        state = torch.zeros(GRU)
        for token in tokens:
            state = gru_cell(token, state, tensors["prefix_gru.weight_ih_l0"], tensors["prefix_gru.weight_hh_l0"])
        with torch.no_grad():
            model_state = drafter.gru_step(tokens[None], None)
            correction = drafter.logit_correction(ours[None, 4:5], model_state)[0, 0]
        torch.testing.assert_close(model_state[0, 0], state)
        torch.testing.assert_close(correction, head_correction(tensors, ours[4], state))


def test_published_sliding_window_layers_see_their_window(tmp_path):
    """The DFlash drafters published for Qwen3.5/3.6 targets list `sliding_attention` layers and a `sliding_window`
    without `use_sliding_window` (which alone would make Qwen3Config drop the window): their sliding layers see the
    keys within the window of each block position, drafting one cycle after another on the context cache too."""
    config = published_config(domino=False) | {"layer_types": ["sliding_attention", "full_attention"]}
    config["sliding_window"] = 6
    tensors = published_tensors(domino=False)
    drafter, log, warned = load_quietly(write_folder(tmp_path / "published", config, tensors))
    assert log == "" and warned == []
    assert drafter.config.sliding_window == 6 and drafter.config.layer_types == config["layer_types"]
    reference = reference_config(drafter.config) | {"windows": [6, None]}

    generator = torch.Generator().manual_seed(1)
    context = torch.randn(20, 3 * HIDDEN, generator=generator)
    block = torch.randn(16, HIDDEN, generator=generator)
    cache = DynamicCache()
    with torch.no_grad():
        for start, end in ((0, 3), (3, 11), (11, 20)):  # three cycles, the later ones on the cache
            ours = drafter(block[None], context[None, start:end], torch.arange(start, end + 16)[None], None, cache)
            torch.testing.assert_close(ours[0], backbone(tensors, reference, block, context[:end], start=end))
        full = backbone(tensors, reference | {"windows": [None, None]}, block, context, start=20)
        assert not torch.allclose(ours[0], full, atol=1e-3)  # the window changed the drafts

    config.pop("sliding_window")
    write_folder(tmp_path / "no-window", config, tensors)
    with pytest.raises(ValueError, match="sliding_attention layers in layer_types but gives no sliding_window"):
        DominoForSpeculation.from_pretrained(tmp_path / "no-window")


@pytest.mark.parametrize("prefix", [0, 2])
def test_a_published_domino_folder_keeps_its_pure_draft_prefix(tmp_path, prefix):
    # The published drafters draft 1 position from the base logits alone, this project's default too: a folder with
    # another count (SGLang's default is 0) must load as it says, not as the default.
    config = published_config(domino=True)
    config["dflash_config"]["pure_draft_prefix_len"] = prefix
    drafter, _, _ = load_quietly(write_folder(tmp_path / "published", config, published_tensors(True)))
    assert drafter.config.pure_draft_prefix_len == prefix


@pytest.mark.parametrize("architecture", ["DFlash2DraftModel", "DSparkDraftModel"])
def test_other_drafter_architectures_are_named(tmp_path, architecture):
    config = published_config(domino=False) | {"architectures": [architecture]}
    write_folder(tmp_path / "other", config, published_tensors(domino=False))
    with pytest.raises(ValueError, match=f"describes a {architecture}.*another architecture than DFlash/Domino"):
        DominoForSpeculation.from_pretrained(tmp_path / "other")


@pytest.mark.parametrize("domino", [True, False])
def test_backbone_computes_only_the_positions_asked_for(domino):
    """`num_outputs` (what drafting k tokens needs) gives the whole block's first outputs, with a cached context and
    a batch's additive mask; `draft_hidden_states` then lines the drafts up as for the whole block."""
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target, head=domino, shift_label=domino, block_size=8)
    config = drafter.config
    generator = torch.Generator().manual_seed(2)
    rows, cached, pending = 2, 5, 3
    block = torch.randn(rows, 8, config.hidden_size, generator=generator)
    context = torch.randn(rows, pending, config.context_size, generator=generator)
    positions = torch.arange(cached, cached + pending + 8)[None].expand(rows, -1)  # after `cached` context tokens
    mask = torch.zeros(rows, 1, 8, cached + pending + 8)
    mask[1, ..., :2] = torch.finfo(mask.dtype).min  # row 1 has two holes in its cached context
    mask[0, 0, 1, cached] = torch.finfo(mask.dtype).min  # and one mask entry belongs to one query position only
    outputs = {}
    with torch.no_grad():
        for num_outputs in (None, drafter.outputs_for_drafts(3)):
            cache = DynamicCache()
            first = torch.arange(cached + 8)[None].expand(rows, -1)
            drafter(block, torch.ones(rows, cached, config.context_size), first, past_key_values=cache)
            outputs[num_outputs] = drafter(
                block, context, positions, attention_mask=mask, past_key_values=cache, num_outputs=num_outputs
            )
            assert cache.get_seq_length() == cached + pending  # the block's keys/values dropped either way
    whole, asked = outputs[None], outputs[drafter.outputs_for_drafts(3)]
    assert asked.shape[1] == (3 if domino else 4)  # DFlash's first output (the anchor's) drafts nothing
    torch.testing.assert_close(asked, whole[:, : asked.shape[1]])
    torch.testing.assert_close(drafter.draft_hidden_states(asked), drafter.draft_hidden_states(whole)[:, :3])


def test_default_layer_choice_is_dflash_spacing():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # the published Qwen3-8B Domino choice
    assert default_target_layer_ids(36, 1) == [18]
    target = tiny_target("llama", num_layers=12)
    config = DominoConfig.from_target(target.config, num_hidden_layers=3)
    assert config.target_layer_ids == default_target_layer_ids(12, 3) == [1, 5, 9]
    assert (config.vocab_size, config.hidden_size, config.eos_token_id, config.pad_token_id) == (64, 32, 1, 0)
    assert config.has_domino_head and config.shift_label and config.mask_token_id == 0  # pad token as mask


def test_from_target_takes_rotary_parameters_of_another_layer_type_where_full_layers_have_none():
    """Beam's full-attention layers have no rotary positions (`rope_parameters["full_attention"]` is None), its sliding
    ones do: the drafter's attention is rotary, with the sliding layers' parameters."""
    import transformers

    target_config = transformers.BeamConfig(
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 500.0}, "full_attention": None}
    )
    rope = DominoConfig.from_target(target_config, mask_token_id=0).rope_parameters
    assert rope["rope_type"] == "default" and rope["rope_theta"] == 500.0


def test_from_target_reads_configs_without_a_pad_token_field():
    """CodeGen's and RWKV's configs have no pad_token_id attribute at all: EOS is the mask, no pad token."""
    import transformers

    for target_config in (transformers.CodeGenConfig(eos_token_id=7), transformers.RwkvConfig(eos_token_id=7)):
        config = DominoConfig.from_target(target_config)
        assert (config.mask_token_id, config.eos_token_id, config.pad_token_id) == (7, 7, None)


# ------------------------------------------------------------------------------------------ our own save format
def test_save_load_round_trip_keeps_published_names_and_outputs(tmp_path):
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    drafter.save_pretrained(tmp_path / "d")
    files = sorted(p.name for p in (tmp_path / "d").iterdir())
    assert files == [
        "attached_drafter_domino.py",
        "attention_kernels_domino.py",
        "batch_call_domino.py",
        "batch_drafts_domino.py",
        "batch_generate_domino.py",
        "batch_policy_domino.py",
        "batch_prompts_domino.py",
        "batching_domino.py",
        "batching_manager_domino.py",
        "cache_domino.py",
        "config.json",
        "configuration_domino.py",
        "continuous_batching_domino.py",
        "copied_drafts_domino.py",
        "cost_model_domino.py",
        "drafting_domino.py",
        "generate_hook_domino.py",
        "generation_domino.py",
        "model.safetensors",
        "modeling_domino.py",
        "options_domino.py",
        "policy_domino.py",
        "ragged_batch_domino.py",
        "ragged_cache_domino.py",
        "ragged_masks_domino.py",
        "records_domino.py",
        "recurrent_cache_domino.py",
        "recurrent_scans_domino.py",
        "target_modules_domino.py",
        "warpers_domino.py",
    ]
    with safe_open(str(tmp_path / "d" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert names == set(drafter.state_dict()) and "prefix_gru.weight_ih_l0" in names and "embed_proj.2.weight" in names
    assert not any("rotary" in n or "embed_tokens" in n or "lm_head" in n for n in names)

    saved = json.loads((tmp_path / "d" / "config.json").read_text())
    assert saved["auto_map"] == {
        "AutoConfig": "configuration_domino.DominoConfig",
        "AutoModel": "modeling_domino.DominoForSpeculation",
        "AutoModelForCausalLM": "modeling_domino.DominoForSpeculation",
    }
    # The reference implementation reads a Qwen3Config with `dflash_config`, `block_size` and `num_target_layers`.
    as_qwen3 = Qwen3Config.from_dict(saved)
    assert as_qwen3.dflash_config["projector_type"] == "domino" and as_qwen3.block_size == drafter.config.block_size
    assert as_qwen3.dflash_config["target_layer_ids"] == drafter.config.target_layer_ids

    reloaded, log, _ = load_quietly(tmp_path / "d")
    assert log == ""
    modules = TargetModules.from_target(target)
    features = torch.randn(1, 5, drafter.config.context_size)
    drafts = []
    with torch.no_grad():
        for model in (drafter, reloaded):
            block = draft_block(
                model, modules, torch.tensor([[7, 8]]), DrafterContext(pending=[features]), model.config.num_drafts
            )
            drafts.append(eager_rollout(model, modules)(block, torch.tensor([[7, 8]])))
    assert torch.equal(drafts[0].ids, drafts[1].ids) and torch.equal(drafts[0].logits, drafts[1].logits)
    # The folder says `model_type: qwen3` (what serving stacks key on, see test_serving_formats.py): the Auto classes
    # reach the drafter through its remote code, and read the config as a plain Qwen3 one without it.
    for auto_class in (AutoModel, AutoModelForCausalLM):  # the latter is how transformers' docs load an assistant
        auto_model = auto_class.from_pretrained(tmp_path / "d", trust_remote_code=True)
        assert type(auto_model).__name__ == "DominoForSpeculation" and auto_model.config.block_size == 6
    assert type(AutoConfig.from_pretrained(tmp_path / "d", trust_remote_code=True)).__name__ == "DominoConfig"
    assert isinstance(AutoConfig.from_pretrained(tmp_path / "d"), Qwen3Config)


def test_remote_code_works_without_hf_domino(tmp_path):
    target = tiny_target("qwen3")
    target.save_pretrained(tmp_path / "target")
    drafter = tiny_drafter(target)
    export_drafter(drafter, tmp_path / "drafter", base_model="tiny/target")
    expected = target.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=10, do_sample=False)
    script = textwrap.dedent(
        f"""
        import sys
        class BlockHfDomino:
            def find_spec(self, name, path=None, target=None):
                if name == "hf_domino" or name.startswith("hf_domino."):
                    raise ImportError("hf_domino is blocked in this test")
        sys.meta_path.insert(0, BlockHfDomino())
        import torch
        from transformers import AutoModel, AutoModelForCausalLM
        target = AutoModelForCausalLM.from_pretrained({str(tmp_path / "target")!r})
        for auto_class in (AutoModel, AutoModelForCausalLM):
            drafter = auto_class.from_pretrained({str(tmp_path / "drafter")!r}, trust_remote_code=True)
            assert type(drafter).__name__ == "DominoForSpeculation" and "hf_domino" not in sys.modules
            prompt = torch.tensor([[5, 6, 7]])
            out = target.generate(prompt, max_new_tokens=10, do_sample=False, assistant_model=drafter)
            print("TOKENS", out[0].tolist(), len(drafter.last_generation_stats.acceptance_lengths))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        # A bare environment (no caches, no hub), but the same transformers as the suite: where PYTHONPATH supplies it
        # (the GPU machine's pinned copy, CI's other releases), keep it, and USE_HUB_KERNELS (CI's) with it;
        # `BlockHfDomino` keeps hf_domino out either way.
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
        | {name: os.environ[name] for name in ("PYTHONPATH", "USE_HUB_KERNELS") if name in os.environ},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("TOKENS")]
    assert len(lines) == 2 and all(line.split(" ", 1)[1].startswith(str(expected[0].tolist())) for line in lines)


ANOTHER_RELEASE = """
import json, sys, torch
from transformers import AutoModel, AutoModelForCausalLM
target = AutoModelForCausalLM.from_pretrained({target!r})
load_remote = lambda: AutoModel.from_pretrained({drafter!r}, trust_remote_code=True)
remote = load_remote() if {remote_first} else None
assert "hf_domino" not in sys.modules  # the remote code imports no hf_domino
import hf_domino
package = hf_domino.DominoForSpeculation.from_pretrained({drafter!r})
remote = remote or load_remote()
prompt, greedy = torch.tensor([[5, 6, 7]]), dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
batch = dict(input_ids=torch.tensor([[0, 5, 6, 7], [9, 10, 11, 12]]), attention_mask=torch.tensor([[0, 1, 1, 1], [1] * 4]))
results = {{}}
fixed = {{"draft_policy": "fixed", "num_speculative_tokens": 2}}  # options that must reach the drafter's own code
for name, drafter, options in (("package", package, fixed), ("remote", remote, {{**fixed, "domino_release_probe": True}})):
    code = lambda: (type(drafter.last_generation_stats).__module__.rpartition(".")[0], max(drafter.last_generation_stats.drafted))
    run = {{"one": target.generate(prompt, assistant_model=drafter, **options, **greedy).tolist(), "one_code": code()}}
    run |= {{"batch": target.generate(**batch, assistant_model=drafter, **options, **greedy).tolist(), "batch_code": code()}}
    hf_domino.attach_drafter(target, drafter)
    run["attached"] = target.generate(prompt, **greedy).tolist()
    run["attached_code"], drafter.last_generation_stats = code(), None
    run["declined"] = target.generate(prompt, guidance_scale=1.5, **greedy).tolist()  # the target alone serves it
    run["declined_stats"] = drafter.last_generation_stats is None
    hf_domino.detach_drafter(target)
    results[name] = run
print("RESULTS", json.dumps({{"results": results, "remote_code": type(remote).__module__.rpartition(".")[0]}}))
"""


@pytest.mark.parametrize("remote_first", [False, True])
def test_remote_code_of_another_release_drafts_with_its_own_code(tmp_path, remote_first):
    # The package and a drafter folder's remote code of another release (here: one with an option the package lacks)
    # in one process, either imported first: each drafter drafts with its own copy's code, through every entry point
    # (batch 1, a batch, an attached drafter and its fallback to the target alone), losslessly.
    target = tiny_target("qwen3")
    target.save_pretrained(tmp_path / "target")
    export_drafter(tiny_drafter(target), tmp_path / "drafter", base_model="tiny/target")
    options_file = tmp_path / "drafter" / "options_domino.py"
    source = options_file.read_text()
    assert source.count("    domino_branches: int = 1\n") == 1
    options_file.write_text(
        source.replace(
            "    domino_branches: int = 1\n", "    domino_branches: int = 1\n    domino_release_probe: bool = False\n"
        )
    )
    script = ANOTHER_RELEASE.format(
        target=str(tmp_path / "target"), drafter=str(tmp_path / "drafter"), remote_first=remote_first
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
        env=os.environ | {"HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.split("RESULTS ", 1)[1])
    assert report["remote_code"].startswith("transformers_modules")
    greedy = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    prompt = torch.tensor([[5, 6, 7]])
    batch = dict(
        input_ids=torch.tensor([[0, 5, 6, 7], [9, 10, 11, 12]]), attention_mask=torch.tensor([[0, 1, 1, 1], [1] * 4])
    )
    alone, guided = (target.generate(prompt, **greedy, **cfg).tolist() for cfg in ({}, {"guidance_scale": 1.5}))
    for name, code in (("package", "hf_domino"), ("remote", report["remote_code"])):
        run = report["results"][name]
        assert run["one"] == run["attached"] == alone and run["declined"] == guided, name
        assert run["batch"] == target.generate(**batch, **greedy).tolist(), name
        assert run["one_code"] == run["batch_code"] == [code, 2], name
        assert run["attached_code"][0] == code, name
        assert run["declined_stats"], name


FUSED_HEAD_OF_THE_PACKAGE = """
import sys, torch
from transformers import AutoModel, AutoModelForCausalLM
target = AutoModelForCausalLM.from_pretrained({target!r})
greedy = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, draft_policy="fixed", num_speculative_tokens=2)
same, other = (AutoModel.from_pretrained(folder, trust_remote_code=True) for folder in ({same!r}, {other!r}))
target.generate(torch.tensor([[5, 6, 7]]), assistant_model=same, **greedy)
print("IMPORTED", "hf_domino" in sys.modules)
for name, drafter in (("same", same), ("other", other)):
    try:
        target.generate(torch.tensor([[5, 6, 7]]), assistant_model=drafter, domino_rollout="triton", **greedy)
        print("FUSED", name, type(drafter.last_generation_stats).__module__)
    except ImportError as error:
        print("REFUSED", name, error)
"""


def test_remote_code_uses_the_package_fused_head_only_where_it_is_the_same_code(tmp_path):
    # The fused head lives in the package alone. A drafter folder's remote code of another release called into it
    # with arguments it did not take (a TypeError mid-call, from every generate() with the head on, CPU included); it
    # now drafts with it only where the installed package holds its very files, and imports nothing where the default
    # `auto` has nothing to fuse (off CUDA).
    target = tiny_target("qwen3")
    target.save_pretrained(tmp_path / "target")
    for name in ("same", "other"):
        export_drafter(tiny_drafter(target), tmp_path / name, base_model="tiny/target")
    options_file = tmp_path / "other" / "options_domino.py"
    options_file.write_text(options_file.read_text() + "\n# another release\n")
    script = FUSED_HEAD_OF_THE_PACKAGE.format(
        target=str(tmp_path / "target"), same=str(tmp_path / "same"), other=str(tmp_path / "other")
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
        env=os.environ | {"HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules"), "TRITON_INTERPRET": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert "IMPORTED False" in lines
    assert any(line.startswith("FUSED same transformers_modules") for line in lines), lines
    [refused] = [line for line in lines if line.startswith("REFUSED other")]
    assert "is not the installed hf_domino's" in refused and "options_domino.py differ" in refused


@pytest.mark.parametrize("layout", ["ours", "published"])
@pytest.mark.parametrize("auto_class", [AutoModel, AutoModelForCausalLM])
def test_a_drafter_built_as_a_plain_qwen3_model_is_refused_naming_the_loader(tmp_path, layout, auto_class):
    # Drafter folders say `model_type: qwen3`, so without remote code the Auto classes build a Qwen3 model with fresh
    # weights: transformers drafted with it at random, slower than the target alone (AutoModelForCausalLM, the usual
    # way to load an assistant), or failed deep inside its loop on a missing generation_config (AutoModel).
    target = tiny_target("qwen3", vocab_size=VOCAB, hidden_size=HIDDEN)
    if layout == "ours":
        tiny_drafter(target).save_pretrained(tmp_path / "d")
    else:
        write_folder(tmp_path / "d", published_config(True), published_tensors(True))
    built = auto_class.from_pretrained(tmp_path / "d")
    assert type(built).__name__ in ("Qwen3Model", "Qwen3ForCausalLM")
    prompt = torch.tensor([[5, 6, 7]])
    with pytest.raises(
        ValueError, match=rf"assistant_model is a {type(built).__name__} built from a Domino/DFlash"
    ) as error:
        target.generate(prompt, assistant_model=built, max_new_tokens=3, do_sample=False)
    assert "DominoForSpeculation.from_pretrained(path)" in str(error.value)
    if layout == "ours":  # the fix named (the published folder's drafter is built for a 36-layer target)
        drafter = DominoForSpeculation.from_pretrained(tmp_path / "d")
        expected = target.generate(prompt, max_new_tokens=6, do_sample=False)
        assert torch.equal(
            target.generate(prompt, assistant_model=drafter, max_new_tokens=6, do_sample=False), expected
        )


# ----------------------------------------------------------------------------------------------- bad checkpoints
@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda t: t.pop("prefix_gru.weight_hh_l0"), "missing tensors: .*prefix_gru.weight_hh_l0"),
        (lambda t: t.update({"extra_head.weight": torch.zeros(2, 2)}), "unexpected tensors: .*extra_head.weight"),
        (lambda t: t.update({"embed_proj.2.weight": torch.zeros(VOCAB, RANK + 1)}), "embed_proj.2.weight"),
        (lambda t: t.update({"fc.weight": torch.zeros(HIDDEN, 2 * HIDDEN)}), "fc.weight"),
    ],
)
def test_bad_checkpoints_fail_with_the_tensor_named(tmp_path, mutate, message):
    tensors = published_tensors(True)
    mutate(tensors)
    folder = write_folder(tmp_path / "bad", published_config(True), tensors)
    with pytest.raises(ValueError, match=message):
        DominoForSpeculation.from_pretrained(folder)


def test_pickle_weights_need_opt_in(tmp_path):
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(published_config(True)))
    torch.save(published_tensors(True), folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match="allow_pickle=True"):
        DominoForSpeculation.from_pretrained(folder)
    with pytest.raises(ValueError, match="allow_pickle=True"):
        DominoForSpeculation.from_pretrained(folder, use_safetensors=False)
    drafter = DominoForSpeculation.from_pretrained(folder, allow_pickle=True)
    assert torch.equal(drafter.fc.weight, published_tensors(True)["fc.weight"])


def test_invalid_config_values_are_named():
    with pytest.raises(Exception, match="projector_type"):
        DominoConfig(num_target_layers=8, projector_type="medusa")
    with pytest.raises(Exception, match="target_layer_ids"):
        DominoConfig()
    with pytest.raises(Exception, match="pure_draft_prefix_len"):
        DominoConfig(num_target_layers=8, projector_type="domino", block_size=4, pure_draft_prefix_len=9)


@pytest.mark.parametrize(
    "setting, message",
    [  # each failed late (an IndexError, the target blamed, a float in new_empty) or ran as another value
        (dict(shift_label="false"), "Field 'shift_label' expected bool"),  # was taken for True
        (dict(block_size=2.5), "Field 'block_size' expected int"),
        (dict(target_layer_ids="12"), "target_layer_ids"),  # was read as [1, 2]
        (dict(mask_token_id=64), r"mask_token_id must be a token id of the target's vocabulary \(0 to 63\), got 64"),
        (dict(num_hidden_layers=0), "num_hidden_layers .* must be at least 1"),
        (dict(target_layer_ids=[]), "target_layer_ids must name target layers"),
        (dict(target_layer_ids=[9]), r"below num_target_layers \(4\), got \[9\]"),
        (dict(num_target_layers=0), "num_target_layers must be at least 1"),
        (dict(projector_type="domino", emb_dim=0), "emb_dim and gru_hidden_dim of at least 1"),
    ],
)
def test_a_bad_config_value_is_refused_naming_its_field_however_it_is_given(setting, message, tmp_path):
    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    sizes |= dict(num_key_value_heads=2, head_dim=8, num_target_layers=4, target_layer_ids=[1, 2], mask_token_id=0)
    with pytest.raises(Exception, match=message):
        DominoConfig(**{**sizes, **setting})  # built
    DominoConfig(**sizes).save_pretrained(tmp_path)
    if not isinstance(next(iter(setting.values())), (str, float)):  # a value of the field's type, given beside a file
        with pytest.raises(ValueError, match=message):
            DominoForSpeculation.from_pretrained(tmp_path, **setting)  # loaded and drafted with before


def test_generic_calls_on_a_drafter_name_what_to_call_instead(tmp_path):
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    with pytest.raises(TypeError, match=r"pass it to the target, target.generate\(..., assistant_model=drafter\)"):
        drafter.generate(torch.tensor([[1, 2]]))  # an AttributeError: a causal LM's loader hands the drafter out
    with pytest.raises(TypeError, match=r"torch.compile\(drafter\), a wrapper .* \(drafter.compile\(\)\)"):
        target.generate(torch.tensor([[1, 2]]), assistant_model=torch.compile(drafter), max_new_tokens=2)
    drafter.save_pretrained(tmp_path)
    (tmp_path / "config.json").unlink()  # the advice was to load the drafter's folder, not its target's
    with pytest.raises(OSError, match="No config.json in .*: a drafter's folder holds config.json"):
        DominoForSpeculation.from_pretrained(tmp_path)
    deeper = tiny_drafter(tiny_target("qwen3", num_layers=target.config.num_hidden_layers + 2))
    with pytest.warns(UserWarning, match="built for a target of .* layers and this one has"):
        target.generate(torch.tensor([[1, 2]]), assistant_model=deeper, max_new_tokens=2)


def test_a_target_folder_loaded_as_a_drafter_says_so(tmp_path):
    tiny_target("qwen3").save_pretrained(tmp_path)
    # A ValueError, as the commands report bad input (huggingface_hub's own validation error was a traceback there).
    with pytest.raises(ValueError, match="load the drafter's folder, not its target's"):
        DominoForSpeculation.from_pretrained(tmp_path)


@pytest.mark.parametrize(("key", "edit"), [("mask_token_id", 4), ("target_layer_ids", [0, 1])])
def test_a_domino_field_edited_in_one_of_its_two_places_is_refused(tmp_path, key, edit):
    # The package reads `dflash_config`, AutoConfig without remote code the top level: a hand edit of one loaded
    # differently in the two places.
    tiny_drafter(tiny_target("qwen3")).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config[key] == config["dflash_config"][key] != edit
    config[key] = edit
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"{key}=.* at the top level and .* in `dflash_config`: make the two agree"):
        DominoForSpeculation.from_pretrained(tmp_path)


@pytest.mark.parametrize("content", ["wrong key", "not safetensors"])
def test_a_broken_draft_vocabulary_file_is_named(tmp_path, content):
    tiny_drafter(tiny_target("qwen3")).save_pretrained(tmp_path)
    vocab_file = tmp_path / "draft_vocab.safetensors"
    if content == "wrong key":
        save_file({"vocab": torch.tensor([1, 2, 3])}, str(vocab_file))
    else:
        vocab_file.write_bytes(b"\x01")
    with pytest.raises(ValueError, match="draft_vocab.safetensors should hold one tensor 'draft_vocab'"):
        DominoForSpeculation.from_pretrained(tmp_path)


# ----------------------------------------------------------------------------------------------------- export
def test_export_writes_a_hub_ready_folder_atomically(tmp_path):
    from huggingface_hub import ModelCard

    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    weights = {name: tensor.clone() for name, tensor in drafter.state_dict().items()}
    results = [{"prompts": "MT-Bench", "acceptance length": 3.1, "speedup": "1.6x"}]
    out = export_drafter(
        drafter,
        tmp_path / "exp",
        base_model="org/tiny-target",
        results=results,
        training_summary="Trained for 10 steps.",
        dtype=torch.float16,
    )
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model == "org/tiny-target" and card.data.library_name == "transformers"
    assert card.data.pipeline_tag == "text-generation" and "speculative-decoding" in card.data.tags
    assert card.data.license == "apache-2.0"
    assert "assistant_model=drafter" in card.text and 'pipeline(\n    "text-generation"' in card.text
    assert (
        "| MT-Bench | 3.1 | 1.6x |" in card.text
        and "| dtype | float16 |" in card.text
        and "Trained for 10 steps." in card.text
    )
    # The live model is left as it was: its dtype and every bit of its weights (not rounded through float16).
    assert drafter.dtype == torch.float32
    assert all(torch.equal(weights[name], tensor) for name, tensor in drafter.state_dict().items())
    umask = os.umask(0)
    os.umask(umask)
    assert (out.stat().st_mode & 0o777) == 0o777 & ~umask  # not the private staging permissions
    assert ((out / "model.safetensors").stat().st_mode & 0o777) == 0o666 & ~umask
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor("fc.weight").dtype == torch.float16

    with pytest.raises(FileExistsError):
        export_drafter(drafter, out, base_model="org/tiny-target")


class TokenizerThatFails:
    def save_pretrained(self, folder):
        raise RuntimeError("disk full")


def test_an_export_that_fails_half_way_leaves_what_was_there(tmp_path, monkeypatch):
    # The tokenizer is saved after the weights, config and remote code: a failure there finds those files written.
    drafter = tiny_drafter(tiny_target("qwen3"))
    with pytest.raises(RuntimeError, match="disk full"):
        export_drafter(drafter, tmp_path / "never", base_model="org/t", tokenizer=TokenizerThatFails())
    assert list(tmp_path.iterdir()) == []
    earlier = export_drafter(drafter, tmp_path / "exp", base_model="org/t", training_summary="the first export")
    with pytest.raises(RuntimeError, match="disk full"):
        export_drafter(drafter, earlier, base_model="org/t", tokenizer=TokenizerThatFails(), overwrite=True)
    assert [path.name for path in tmp_path.iterdir()] == ["exp"]
    assert "the first export" in (earlier / "README.md").read_text()

    # The new folder's rename failing puts the folder it replaced back.
    real_rename = Path.rename

    def rename(self, other):
        if self.name == "drafter":
            raise OSError("rename failed")
        return real_rename(self, other)

    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(OSError, match="rename failed"):
        export_drafter(drafter, earlier, base_model="org/t", overwrite=True)
    monkeypatch.undo()
    assert [path.name for path in tmp_path.iterdir()] == ["exp"]
    assert "the first export" in (earlier / "README.md").read_text()


def test_export_refuses_a_model_that_is_not_a_drafter(tmp_path):
    with pytest.raises(TypeError, match="not its target"):
        export_drafter(tiny_target("qwen3"), tmp_path / "out", base_model="org/t")
    assert list(tmp_path.iterdir()) == []


def test_a_card_table_keeps_the_columns_of_every_row(tmp_path):
    rows = [{"prompts": "MT-Bench", "acceptance length": 2.1}, {"prompts": "HumanEval", "speedup": "1.5x"}]
    out = export_drafter(tiny_drafter(tiny_target("qwen3")), tmp_path / "exp", base_model="org/t", results=rows)
    card = (out / "README.md").read_text()
    assert "| prompts | acceptance length | speedup |" in card
    assert "| MT-Bench | 2.1 |  |" in card and "| HumanEval |  | 1.5x |" in card


def test_export_to_a_symlinked_folder_replaces_what_it_points_to(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "old.txt").write_text("an earlier export")
    (tmp_path / "link").symlink_to(tmp_path / "real", target_is_directory=True)
    export_drafter(tiny_drafter(tiny_target("qwen3")), tmp_path / "link", base_model="org/t", overwrite=True)
    assert (tmp_path / "link").is_symlink() and (tmp_path / "real" / "config.json").is_file()
    assert not (tmp_path / "real" / "old.txt").exists()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["link", "real"]  # no staging folder left


def test_save_pretrained_uploads_the_vocabulary_and_datastore_files_too(tmp_path, monkeypatch):
    """transformers' own upload runs at the end of its save, before the draft vocabulary's file is written: the
    drafter uploads through `push_to_hub` after it (Hub calls replaced by a recorder)."""
    drafter = tiny_drafter(tiny_target("qwen3"))
    drafter.set_draft_vocab(torch.tensor([1, 2, 3]))
    uploads = []

    def push_to_hub(repo_id, **options):
        uploads.append((repo_id, options, sorted(os.listdir(tmp_path / "out"))))

    monkeypatch.setattr(drafter, "push_to_hub", push_to_hub)
    drafter.save_pretrained(tmp_path / "out", push_to_hub=True, commit_message="first", private=True)
    [(repo_id, options, files)] = uploads
    assert repo_id == "out" and options["commit_message"] == "first" and options["private"] is True
    assert "draft_vocab.safetensors" in files and "model.safetensors" in files


def test_a_drafter_in_a_subfolder_loads_its_vocabulary(tmp_path):
    drafter = tiny_drafter(tiny_target("qwen3"))
    drafter.set_draft_vocab(torch.tensor([1, 2, 3]))
    drafter.save_pretrained(tmp_path / "repo" / "drafter")
    loaded = DominoForSpeculation.from_pretrained(tmp_path / "repo", subfolder="drafter")
    assert loaded.draft_vocab.tolist() == [1, 2, 3]


@pytest.mark.parametrize("domino", [True, False])
def test_published_folders_draft_through_generate(tmp_path, domino):
    folder = write_folder(tmp_path / "published", published_config(domino), published_tensors(domino))
    drafter = DominoForSpeculation.from_pretrained(folder)
    target = tiny_target("qwen3", num_layers=36)  # the published configs read layers 1, 17 and 33
    prompt = torch.tensor([[7, 8, 9]])
    expected = target.generate(prompt, max_new_tokens=20, do_sample=False)
    output = target.generate(prompt, max_new_tokens=20, do_sample=False, assistant_model=drafter, draft_policy="fixed")
    assert torch.equal(output, expected)
    assert max(drafter.last_generation_stats.drafted) == drafter.config.num_drafts


def test_export_command_line(tmp_path):
    from hf_domino.cli import main

    target = tiny_target("qwen3")
    tiny_drafter(target).save_pretrained(tmp_path / "trained")
    (tmp_path / "results.json").write_text(json.dumps([{"prompts": "HumanEval", "acceptance length": 2.5}]))
    assert (
        main(
            [
                "export",
                str(tmp_path / "trained"),
                str(tmp_path / "hub"),
                "--base-model",
                "org/t",
                "--results",
                str(tmp_path / "results.json"),
                "--dtype",
                "bfloat16",
                "--repo-id",
                "org/t-domino",
                "--license",
                "mit",
            ]
        )
        == 0
    )
    card = (tmp_path / "hub" / "README.md").read_text()
    assert "| HumanEval | 2.5 |" in card and 'AutoModel.from_pretrained("org/t-domino"' in card
    assert "license: mit" in card
    assert DominoForSpeculation.from_pretrained(tmp_path / "hub").dtype == torch.bfloat16


def test_export_refuses_a_tokenizer_folder_that_holds_none(tmp_path, capsys):
    # transformers builds an empty tokenizer from a folder's config.json alone: the export wrote it, silently.
    from hf_domino.cli import main

    tiny_drafter(tiny_target("qwen3")).save_pretrained(tmp_path / "trained")
    command = ["export", str(tmp_path / "trained"), str(tmp_path / "hub"), "--base-model", "org/t"]
    assert main([*command, "--tokenizer", str(tmp_path / "trained")]) == 2
    assert "No tokenizer files in" in capsys.readouterr().err and not (tmp_path / "hub").exists()


def test_shipped_checkpoint_remote_code_is_the_package_source():
    """The remote code next to the shipped drafter must be today's modules (re-export after changing them)."""
    import hf_domino

    package = Path(hf_domino.__file__).parent
    shipped = package / "checkpoints" / "smollm2-135m-instruct-domino"
    remote_code = sorted(path.name for path in package.glob("*_domino.py"))
    assert sorted(path.name for path in shipped.glob("*.py")) == remote_code
    for name in remote_code:
        assert (shipped / name).read_text() == (package / name).read_text(), f"re-export: {name} is stale"


def test_gru_weights_are_packed_after_every_move(monkeypatch):
    # On CUDA, cuDNN copies an RNN's weights together on every call unless they are packed after .to()
    # (tests/test_on_cuda.py checks the call itself there); off CUDA packing is a no-op.
    packed = []
    monkeypatch.setattr(torch.nn.GRU, "flatten_parameters", lambda self: packed.append(self))
    drafter = tiny_drafter(tiny_target())
    drafter.to(torch.float64)
    assert drafter.prefix_gru in packed and isinstance(drafter.prefix_gru, torch.nn.GRU)

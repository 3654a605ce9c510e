"""Saved drafters read the same everywhere the format is served: transformers-4 loaders (the reference implementation
pins transformers 4.57.1), SGLang's DFlash/Domino drafter, and hf-domino itself (docs/model.md, "Who reads what")."""

from __future__ import annotations

import json
import os
import re
import subprocess
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from conftest import tiny_drafter, tiny_target
from reference_domino import draft_greedy
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModel, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from hf_domino import DominoConfig, DominoForSpeculation, default_target_layer_ids
from hf_domino.export import export_drafter
from hf_domino.sglang_serving import ServingCompatibilityWarning, sglang_serving_problems

SHIPPED = Path(__file__).parents[1] / "src" / "hf_domino" / "checkpoints" / "smollm2-135m-instruct-domino"
# A Qwen3-like RoPE base: far enough from transformers 4's default of 10000 that reading the wrong one shows.
QWEN3_ROPE = {"rope_type": "default", "rope_theta": 1_000_000.0}


def saved_drafter(tmp_path: Path, *, head: bool = True, rope: dict | None = None, **overrides):
    target = tiny_target("qwen3", num_layers=6, max_position_embeddings=512, rope_parameters=rope or QWEN3_ROPE)
    drafter = tiny_drafter(target, head=head, num_layers=2, **overrides)
    folder = tmp_path / "drafter"
    drafter.save_pretrained(folder)
    return target, drafter, folder


def read_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def write_config(folder: Path, config: dict) -> None:
    (folder / "config.json").write_text(json.dumps(config))


def drafter_fields(config) -> dict:
    """What a config says about the drafter, without where it was loaded from or which class wrote it."""
    ignored = ("architectures", "auto_map", "transformers_version")
    return {key: value for key, value in config.to_diff_dict().items() if key not in ignored}


# ----------------------------------------------------------------------------------- transformers 4 (reference)
def transformers4_view(config: dict) -> dict:
    """config.json as the reference implementation sees it under transformers 4.57.1.

    Its `DFlashDraftModel` is a `Qwen3PreTrainedModel` whose config is transformers 4.57.1's `Qwen3Config`: that
    class knows nothing of `rope_parameters` and takes the RoPE base from `rope_theta` (default 10000) and the scaling
    from `rope_scaling`; the model then reads `block_size` at the top level and the Domino fields from `dflash_config`
    (`pure_draft_prefix_len` defaulting to 0, `shift_label` to false). Returns the numbers
    `reference_domino.draft_greedy` drafts with, plus the rest of what was read.
    """
    dflash_config = config["dflash_config"]
    layers = config["num_hidden_layers"]
    target_layer_ids = dflash_config.get("target_layer_ids")
    if target_layer_ids is None:
        target_layer_ids = default_target_layer_ids(config["num_target_layers"], layers)
    return dict(
        model_type_warning=config.get("model_type") != "qwen3",  # "You are using a model of type ... to instantiate"
        layers=layers,
        heads=config["num_attention_heads"],
        kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
        head_dim=config.get("head_dim", 128),
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=config.get("rope_theta", 10000.0),
        rope_scaling=config.get("rope_scaling"),
        block_size=config["block_size"],
        target_layer_ids=target_layer_ids,
        mask_token_id=dflash_config.get("mask_token_id"),
        projector_type=dflash_config.get("projector_type"),
        pure_draft_prefix_len=dflash_config.get("pure_draft_prefix_len", 0),
        shift_label=bool(dflash_config.get("shift_label", False)),
        emb_dim=dflash_config.get("emb_dim"),
        gru_hidden_dim=dflash_config.get("gru_hidden_dim"),
    )


def target_states(target, seed: int = 0, length: int = 40) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    tokens = torch.randint(4, target.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        hidden_states = target(tokens, output_hidden_states=True).hidden_states
    return tokens[0], hidden_states


def our_drafts(drafter: DominoForSpeculation, target, features: torch.Tensor, anchor: int) -> list[int]:
    """Greedy drafts of one block with the drafter's own modules (backbone forward, GRU, logit correction)."""
    config, embed, lm_head = drafter.config, target.get_input_embeddings(), target.get_output_embeddings()
    block_ids = torch.tensor([[anchor] + [config.mask_token_id] * (config.block_size - 1)])
    positions = torch.arange(features.shape[0] + config.block_size)[None]
    with torch.no_grad():
        draft_hidden = drafter.draft_hidden_states(drafter(embed(block_ids), features[None], positions))
        realised, state, read = [anchor], None, 0
        for k in range(draft_hidden.shape[1]):
            logits = lm_head(draft_hidden[:, k])
            if config.has_domino_head and k >= config.pure_draft_prefix_len:
                state = drafter.gru_step(embed(torch.tensor([realised[read:]])), state)
                read = len(realised)
                logits = logits + drafter.logit_correction(draft_hidden[:, k : k + 1], state)[:, 0]
            realised.append(int(logits.argmax()))
    return realised[1:]


def transformers4_drafts(folder: Path, config: dict, target, tokens, hidden_states) -> list[list[int]]:
    """Greedy drafts of every block of `tokens`, from the raw tensors as `transformers4_view(config)` reads them."""
    view = transformers4_view(config)
    tensors = load_file(str(folder / "model.safetensors"))
    embed, lm_head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    features = torch.cat([hidden_states[i + 1][0] for i in view["target_layer_ids"]], dim=-1)
    use_head = view["projector_type"] == "domino"
    with torch.no_grad():
        return [
            draft_greedy(tensors, view, embed, lm_head, features[:start], int(tokens[start]), use_head=use_head)
            for start in range(1, len(tokens))
        ]


@pytest.mark.parametrize("head", [True, False], ids=["domino", "dflash"])
def test_transformers4_reader_drafts_exactly_like_us(tmp_path, head):
    target, drafter, folder = saved_drafter(tmp_path, head=head, pure_draft_prefix_len=1)
    config = read_config(folder)
    view = transformers4_view(config)
    ours = DominoForSpeculation.from_pretrained(folder).config
    assert not view["model_type_warning"] and view["rope_scaling"] is None
    assert view["rope_theta"] == ours.rope_parameters["rope_theta"] == QWEN3_ROPE["rope_theta"]
    assert view["target_layer_ids"] == ours.target_layer_ids and view["block_size"] == ours.block_size
    assert view["mask_token_id"] == ours.mask_token_id and view["shift_label"] == ours.shift_label
    assert (view["layers"], view["heads"], view["kv_heads"], view["head_dim"], view["rms_norm_eps"]) == (
        ours.num_hidden_layers,
        ours.num_attention_heads,
        ours.num_key_value_heads,
        ours.head_dim,
        ours.rms_norm_eps,
    )
    if head:
        assert view["projector_type"] == "domino" and view["pure_draft_prefix_len"] == ours.pure_draft_prefix_len
        assert (view["emb_dim"], view["gru_hidden_dim"]) == (ours.emb_dim, ours.gru_hidden_dim)

    tokens, hidden_states = target_states(target)
    features = torch.cat([hidden_states[i + 1][0] for i in drafter.config.target_layer_ids], dim=-1)
    expected = [our_drafts(drafter, target, features[:start], int(tokens[start])) for start in range(1, len(tokens))]
    assert transformers4_drafts(folder, config, target, tokens, hidden_states) == expected
    if head:
        # The layout before this change (no top-level `rope_theta`) reads as RoPE base 10000 there: the test sees it.
        old_layout = {key: value for key, value in config.items() if key != "rope_theta"}
        drafts = transformers4_drafts(folder, old_layout, target, tokens, hidden_states)
        assert sum(a != b for a, b in zip(drafts, expected)) > 0


def test_transformers4_fields_carry_rope_scaling(tmp_path):
    yarn = {"rope_type": "yarn", "rope_theta": 500_000.0, "factor": 4.0, "original_max_position_embeddings": 128}
    _, drafter, folder = saved_drafter(tmp_path, rope=yarn)
    config = read_config(folder)
    assert config["rope_theta"] == 500_000.0
    assert config["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
    # Read through the transformers-4 fields alone (what Qwen3Config makes of `rope_theta` + `rope_scaling`): the
    # same RoPE, down to the inverse frequencies.
    legacy = {key: value for key, value in config.items() if key != "rope_parameters"}
    as_transformers4 = Qwen3Config.from_dict(legacy)
    assert as_transformers4.rope_parameters == drafter.config.rope_parameters
    assert torch.equal(Qwen3RotaryEmbedding(as_transformers4).inv_freq, drafter.rotary_emb.inv_freq)
    assert DominoForSpeculation.from_pretrained(folder).config.rope_parameters == drafter.config.rope_parameters


def test_saved_config_has_the_serving_layout_and_loads_everywhere(tmp_path):
    _, drafter, folder = saved_drafter(tmp_path)
    config = read_config(folder)
    assert config["model_type"] == "qwen3" and config["architectures"] == ["DFlashDraftModel", "DominoForSpeculation"]
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] and "rope_scaling" not in config
    head_keys = ("projector_type", "emb_dim", "gru_hidden_dim", "pure_draft_prefix_len", "shift_label")
    expected = {key: getattr(drafter.config, key) for key in ("mask_token_id", "target_layer_ids", *head_keys)}
    assert config["dflash_config"] == expected
    assert config["auto_map"]["AutoModel"] == "modeling_domino.DominoForSpeculation"
    # Plain transformers reads it as the Qwen3 config it claims to be, with the drafter's fields alongside.
    as_qwen3 = AutoConfig.from_pretrained(folder)
    assert isinstance(as_qwen3, Qwen3Config) and as_qwen3.rope_parameters == drafter.config.rope_parameters
    assert as_qwen3.architectures == ["DFlashDraftModel", "DominoForSpeculation"] and as_qwen3.block_size == 6
    # ... and the Auto classes with remote code, or our class, give the drafter back.
    remote = AutoModel.from_pretrained(folder, trust_remote_code=True)
    assert type(remote).__name__ == "DominoForSpeculation"
    assert drafter_fields(remote.config) == drafter_fields(drafter.config)
    reloaded = DominoForSpeculation.from_pretrained(folder)
    assert reloaded.config.architectures == ["DFlashDraftModel", "DominoForSpeculation"]
    assert DominoConfig.from_dict(reloaded.config.to_dict()).to_dict() == reloaded.config.to_dict()
    assert all(torch.equal(a, b) for a, b in zip(reloaded.state_dict().values(), drafter.state_dict().values()))


def test_disagreeing_rope_fields_are_refused(tmp_path):
    _, _, folder = saved_drafter(tmp_path)
    config = read_config(folder)
    write_config(folder, {**config, "rope_theta": 10000.0})
    with pytest.raises(ValueError, match="rope_theta=10000.0.*rope_parameters"):
        DominoForSpeculation.from_pretrained(folder)


def test_drafters_saved_before_this_change_still_load(tmp_path):
    _, drafter, folder = saved_drafter(tmp_path)
    config = read_config(folder)
    old = {key: value for key, value in config.items() if key != "rope_theta"}
    write_config(folder, {**old, "model_type": "domino", "architectures": ["DominoForSpeculation"]})
    reloaded = DominoForSpeculation.from_pretrained(folder)
    assert drafter_fields(reloaded.config) == drafter_fields(drafter.config)
    assert isinstance(AutoModel.from_pretrained(folder), DominoForSpeculation)  # the old layout's model type
    assert all(torch.equal(a, b) for a, b in zip(reloaded.state_dict().values(), drafter.state_dict().values()))


def test_shipped_drafter_config_is_in_the_serving_layout():
    config = read_config(SHIPPED)
    assert config["model_type"] == "qwen3" and config["architectures"][0] == "DFlashDraftModel"
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 100_000.0  # SmolLM2's base
    assert transformers4_view(config)["target_layer_ids"] == [1, 14, 27]
    # Its weights are float16, so SGLang needs `--dtype bfloat16` for it; nothing else stands in the way.
    (problem,) = sglang_serving_problems(SHIPPED)
    assert problem.startswith("dtype='float16'") and "--dtype bfloat16" in problem


# ------------------------------------------------------------------------------------------------------ SGLang
def sglang_parameter_names(config: dict) -> set[str]:
    """The parameters SGLang 0.5.23's `DFlashDraftModel` builds for a config, in checkpoint names (its loader fuses
    q/k/v and gate/up on load), as read from `models/dflash.py`."""
    dflash_config = config.get("dflash_config") or {}
    per_layer = [f"self_attn.{p}_proj.weight" for p in "qkvo"] + ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    per_layer += [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    per_layer += ["input_layernorm.weight", "post_attention_layernorm.weight"]
    names = {"norm.weight", "fc.weight", "hidden_norm.weight"}
    names |= {f"layers.{i}.{name}" for i in range(config["num_hidden_layers"]) for name in per_layer}
    if dflash_config.get("projector_type", config.get("projector_type")) == "domino":
        names |= {"prefix_gru.weight_ih_l0", "prefix_gru.weight_hh_l0", "embed_proj.0.weight", "embed_proj.2.weight"}
    return names


@pytest.mark.parametrize("head", [True, False], ids=["domino", "dflash"])
def test_exported_folder_is_servable_by_sglang(tmp_path, head):
    target = tiny_target("qwen3", num_layers=6)
    drafter = tiny_drafter(target, head=head)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ServingCompatibilityWarning)
        folder = export_drafter(drafter, tmp_path / "export", base_model="org/target", dtype=torch.bfloat16)
    assert sglang_serving_problems(folder) == []
    # What SGLang's parser and loader read, checked here without our helper.
    config = read_config(folder)
    assert config["architectures"][0] == "DFlashDraftModel" and config["model_type"] == "qwen3"
    dflash_config = config["dflash_config"]
    assert dflash_config["target_layer_ids"] == drafter.config.target_layer_ids and config["block_size"] == 6
    if head:
        assert dflash_config["projector_type"] == "domino" and dflash_config["pure_draft_prefix_len"] == 1
        assert isinstance(dflash_config["shift_label"], bool)
        assert (
            dflash_config["emb_dim"] == config["emb_dim"]
            and dflash_config["gru_hidden_dim"] == config["gru_hidden_dim"]
        )
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        tensors = {name: (tuple(f.get_slice(name).get_shape()), f.get_slice(name).get_dtype()) for name in f.keys()}
    assert set(tensors) == sglang_parameter_names(config) and not any("bias" in name for name in tensors)
    assert {dtype for _, dtype in tensors.values()} == {"BF16"} and config["dtype"] == "bfloat16"
    hidden, gru, rank = config["hidden_size"], config["gru_hidden_dim"], config["emb_dim"]
    assert tensors["fc.weight"][0] == (hidden, len(dflash_config["target_layer_ids"]) * hidden)
    if head:
        assert tensors["prefix_gru.weight_ih_l0"][0] == (3 * gru, hidden)
        assert tensors["prefix_gru.weight_hh_l0"][0] == (3 * gru, gru)
        assert tensors["embed_proj.0.weight"][0] == (rank, hidden + gru)
        assert tensors["embed_proj.2.weight"][0] == (config["vocab_size"], rank)


def _set_nested(key: str, value):
    def mutate(config: dict, tensors: dict) -> None:
        config["dflash_config"][key] = value
        config[key] = value

    return mutate


def _add_bias_tensors(tensors: dict) -> None:
    # Every attention projection's bias, the last one of the wrong size.
    for layer in range(2):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            rows = tensors[f"layers.{layer}.self_attn.{name}.weight"].shape[0]
            tensors[f"layers.{layer}.self_attn.{name}.bias"] = torch.zeros(rows, dtype=torch.bfloat16)
    tensors["layers.1.self_attn.o_proj.bias"] = torch.zeros(7, dtype=torch.bfloat16)


def _add_tensor(name: str, shape: tuple[int, ...]):
    return lambda config, tensors: tensors.update({name: torch.zeros(shape, dtype=torch.bfloat16)})


@pytest.mark.parametrize(
    "mutate, field",
    [
        (_set_nested("pure_draft_prefix_len", 0), "pure_draft_prefix_len=0"),
        (_set_nested("shift_label", "yes"), "shift_label='yes'"),
        (_set_nested("mask_token_id", None), "mask_token_id=None"),
        (lambda config, tensors: config.update(emb_dim=999), "emb_dim is 999 at the top level"),
        (lambda config, tensors: config.update(dtype="float16"), "dtype='float16'"),
        (lambda config, tensors: config.update(model_type="domino"), "model_type='domino'"),
        (lambda config, tensors: config.update(architectures=["DominoForSpeculation"]), "architectures="),
        (lambda config, tensors: config.update(block_size=1), "block_size=1"),
        (lambda config, tensors: tensors.pop("layers.1.mlp.up_proj.weight"), "missing tensor layers.1.mlp.up_proj"),
        (lambda config, tensors: tensors.pop("embed_proj.2.weight"), "missing tensor embed_proj.2.weight"),
        (_add_tensor("prefix_gru.bias_ih_l0", (48,)), "prefix_gru.bias_ih_l0: SGLang's Domino head is bias-free"),
        (_add_tensor("fc.weight", (32, 96)), "fc.weight has shape \\(32, 96\\)"),
        # Until 2026-12-07 no case checked these (an audit removed each check and the suite passed).
        (_set_nested("mask_token_id", 10**6), "mask_token_id=1000000"),
        (lambda config, tensors: config.update(layer_types=["full_attention"]), "layer_types has 1 entries for 2"),
        (lambda config, tensors: config.update(hidden_act="gelu"), "hidden_act='gelu'"),
        (lambda config, tensors: config.update(num_target_layers=None), "num_target_layers=None: SGLang checks"),
        (
            lambda config, tensors: tensors.update({"fc.weight": tensors["fc.weight"].to(torch.int32)}),
            "fc.weight is stored as I32",
        ),  # fmt: skip
        (
            lambda config, tensors: (config.update(attention_bias=True), _add_bias_tensors(tensors)),
            "layers.1.self_attn.o_proj.bias has shape \\(7,\\)",
        ),
    ],
)
def test_sglang_problems_name_the_field(tmp_path, mutate, field):
    drafter = tiny_drafter(tiny_target("qwen3", num_layers=6))
    folder = export_drafter(drafter, tmp_path / "export", base_model="org/target", dtype=torch.bfloat16)
    config, tensors = read_config(folder), load_file(str(folder / "model.safetensors"))
    mutate(config, tensors)
    write_config(folder, config)
    save_file(tensors, str(folder / "model.safetensors"))
    problems = sglang_serving_problems(folder)
    assert len(problems) == 1 and re.search(field, problems[0]), problems


def test_dflash_drafter_with_shifted_labels_is_flagged(tmp_path):
    drafter = tiny_drafter(tiny_target("qwen3", num_layers=6), head=False, shift_label=True)
    with pytest.warns(ServingCompatibilityWarning, match="shift_label=true without the Domino head"):
        export_drafter(drafter, tmp_path / "export", base_model="org/target", dtype=torch.bfloat16)


def test_export_warns_naming_the_setting_to_change(tmp_path):
    target = tiny_target("qwen3", num_layers=6)
    with pytest.warns(ServingCompatibilityWarning, match=r"dtype='float16'.*--dtype bfloat16") as caught:
        export_drafter(tiny_drafter(target), tmp_path / "fp16", base_model="org/target", dtype=torch.float16)
    assert len([w for w in caught if w.category is ServingCompatibilityWarning]) == 1
    assert (tmp_path / "fp16" / "model.safetensors").exists()  # a warning, not a refusal
    drafter = tiny_drafter(target, pure_draft_prefix_len=2)
    with pytest.warns(ServingCompatibilityWarning, match="pure_draft_prefix_len=2.*pure_draft_prefix_len=1"):
        export_drafter(drafter, tmp_path / "prefix", base_model="org/target", dtype=torch.bfloat16)


# -------------------------------------------------------------------------- the real reference, transformers 4
REFERENCE_SCRIPT = """
import json
import logging as std_logging
import sys

import torch
from safetensors.torch import load_file
from transformers.utils import logging

sys.path.insert(0, sys.argv[1])
from dflash import DFlashDraftModel  # the reference implementation's model, built from Qwen3 classes


class Collect(std_logging.Handler):
    def emit(self, record):
        logs.append(record.getMessage())


logs = []
logging.set_verbosity_warning()
logging.get_logger("transformers").addHandler(Collect())
model = DFlashDraftModel.from_pretrained(sys.argv[2], dtype=torch.float32).eval()
inputs = load_file(sys.argv[3])
embed, lm_head, tokens = inputs["embed"], inputs["lm_head"], inputs["tokens"].tolist()
features = torch.cat([inputs[f"hidden_{i + 1}"] for i in model.target_layer_ids], dim=-1)
shift = bool(model.config.dflash_config.get("shift_label", False))
drafts = []
with torch.no_grad():
    for start in range(1, len(tokens)):
        block = torch.tensor([[tokens[start]] + [model.mask_token_id] * (model.block_size - 1)])
        hidden = model(
            position_ids=torch.arange(start + model.block_size)[None], noise_embedding=embed[block],
            target_hidden=features[None, :start], is_causal=False,
        )
        hidden = hidden if shift else hidden[:, 1:]
        realised, state = [tokens[start]], None
        for k in range(hidden.shape[1]):
            logits = hidden[0, k] @ lm_head.T
            if k >= model.pure_draft_prefix_len:
                new = embed[torch.tensor([realised[-1:] if state is not None else realised])]
                _, state = model.prefix_gru(new, state)
                logits = logits + model.embed_proj(torch.cat([hidden[:, k], state[0]], dim=-1))[0]
            realised.append(int(logits.argmax()))
        drafts.append(realised[1:])
print("RESULT", json.dumps({"drafts": drafts, "logs": logs, "rope_theta": model.config.rope_theta}))
"""


@pytest.mark.slow
@pytest.mark.skipif(
    not (os.environ.get("HF_DOMINO_TRANSFORMERS4_PYTHON") and os.environ.get("HF_DOMINO_REFERENCE_CODE")),
    reason="needs a python with transformers==4.57.1 (HF_DOMINO_TRANSFORMERS4_PYTHON) and the reference "
    "implementation's code/ folder (HF_DOMINO_REFERENCE_CODE); see docs/model.md",
)
def test_reference_implementation_under_transformers4_drafts_like_us(tmp_path):
    target, drafter, folder = saved_drafter(tmp_path, pure_draft_prefix_len=1)
    tokens, hidden_states = target_states(target)
    inputs = {f"hidden_{i}": h[0].contiguous() for i, h in enumerate(hidden_states)}
    inputs |= {"embed": target.get_input_embeddings().weight, "lm_head": target.get_output_embeddings().weight}
    save_file({**inputs, "tokens": tokens}, str(tmp_path / "inputs.safetensors"))
    result = subprocess.run(
        [os.environ["HF_DOMINO_TRANSFORMERS4_PYTHON"], "-c", textwrap.dedent(REFERENCE_SCRIPT)]
        + [os.environ["HF_DOMINO_REFERENCE_CODE"], str(folder), str(tmp_path / "inputs.safetensors")],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    reference = json.loads(line.removeprefix("RESULT "))
    assert not any("model of type" in message for message in reference["logs"]), reference["logs"]
    assert reference["rope_theta"] == QWEN3_ROPE["rope_theta"]
    features = torch.cat([hidden_states[i + 1][0] for i in drafter.config.target_layer_ids], dim=-1)
    expected = [our_drafts(drafter, target, features[:start], int(tokens[start])) for start in range(1, len(tokens))]
    assert reference["drafts"] == expected

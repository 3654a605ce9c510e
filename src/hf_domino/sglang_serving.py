"""Whether SGLang could serve an exported drafter folder as the same drafter it is here.

`export_drafter` writes the published DFlash/Domino layout, which SGLang's DFlash speculative decoding also reads;
`sglang_serving_problems` checks a folder's config and tensors against what SGLang's loader accepts, and
`export_drafter` warns with them (`ServingCompatibilityWarning`). docs/model.md, "Who reads what", lists the rules.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors import safe_open

from .configuration_domino import SERVING_ARCHITECTURE, SERVING_MODEL_TYPE
from .transformers_dflash import HEAD_PREFIXES


class ServingCompatibilityWarning(UserWarning):
    """An exported drafter that SGLang's DFlash/Domino drafter would refuse, or serve differently, as it stands."""


# Safetensors dtypes SGLang's weight loader copies (casting) into its float parameters.
_FLOAT_DTYPES = frozenset({"F16", "BF16", "F32"})


def sglang_serving_problems(folder: str | Path) -> list[str]:
    """What would stop SGLang (0.5.23, `--speculative-algorithm DFLASH`) from serving the drafter saved in `folder` as
    the same drafter it is here.

    Follows, from SGLang 0.5.23's source, the draft-model class resolution (`architectures`, `model_type` read by
    `AutoConfig` without remote code), the DFlash/Domino config parser (`speculative/dflash_utils.py`: `dflash_config`
    values first, then the top level), the tensors `DFlashDraftModel.load_weights` fills (a missing backbone tensor
    stays uninitialised there, an unknown one is skipped) and the Domino runtime's bfloat16 requirement. Conditions
    only the running server knows (CUDA, a bfloat16 target with the same vocabulary) are not checked.

    Returns one message per problem, each naming the field or tensor and the change that fixes it; an empty list
    when the folder is servable as it stands.
    """
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    problems = _sglang_config_problems(config)
    weight_files = _weight_files(folder)
    if not weight_files:
        return [*problems, "no model.safetensors: SGLang loads drafter weights from safetensors files."]
    found: dict[str, tuple[tuple[int, ...], str]] = {}
    for path in weight_files:
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                tensor = f.get_slice(name)
                found[name] = (tuple(tensor.get_shape()), tensor.get_dtype())
    try:
        expected = _sglang_expected_shapes(config)
    except (KeyError, TypeError, ValueError) as error:
        return [*problems, f"cannot derive the drafter's tensor shapes from config.json ({error!r})."]
    return problems + _sglang_tensor_problems(config, found, expected)


def _weight_files(folder: Path) -> list[Path]:
    # The weights proper, as transformers finds them; other .safetensors files (a draft vocabulary) are side files.
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return [folder / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return [folder / "model.safetensors"] if (folder / "model.safetensors").exists() else []


def _sglang_value(config: dict[str, Any], key: str, default: Any = None) -> Any:
    # SGLang's parser reads `dflash_config` first and falls back to the top level.
    return (config.get("dflash_config") or {}).get(key, config.get(key, default))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _sglang_config_problems(config: dict[str, Any]) -> list[str]:
    problems = []
    resave = "re-save the drafter with this version of hf-domino (`save_pretrained` or `hf-domino export`)"
    if config.get("model_type") != SERVING_MODEL_TYPE:
        problems.append(
            f"model_type={config.get('model_type')!r}: SGLang reads the draft config with transformers' AutoConfig, "
            f"which needs --trust-remote-code for a type it does not know (the format's is 'qwen3'); {resave}."
        )
    architectures = config.get("architectures") or []
    if architectures[:1] != [SERVING_ARCHITECTURE]:
        problems.append(
            f"architectures={architectures!r}: SGLang serves this format only as {SERVING_ARCHITECTURE!r} (the first "
            f"entry) and would fall back to its generic transformers backend; {resave}."
        )
    layers = config.get("num_hidden_layers")
    if not _is_int(layers) or layers < 1:
        problems.append(f"num_hidden_layers={layers!r}: SGLang needs a positive number of draft layers.")
    layer_types = config.get("layer_types")
    if layer_types is not None and _is_int(layers) and len(layer_types) < layers:
        problems.append(f"layer_types has {len(layer_types)} entries for {layers} layers: give one per draft layer.")
    block_size = _sglang_value(config, "block_size")
    projector_type = _sglang_value(config, "projector_type")
    minimum_block = 2 if projector_type == "domino" else 1
    if not _is_int(block_size) or block_size < minimum_block:
        problems.append(f"block_size={block_size!r}: SGLang needs an integer block size of at least {minimum_block}.")
    layer_ids = _sglang_value(config, "target_layer_ids")
    if not isinstance(layer_ids, list) or not layer_ids or not all(_is_int(i) for i in layer_ids):
        problems.append(f"target_layer_ids={layer_ids!r}: SGLang needs a non-empty list of target layer indices.")
    else:
        # Without num_target_layers SGLang takes the draft's own depth for the target's, and refuses deeper ids.
        depth = config.get("num_target_layers") or layers
        if _is_int(depth) and max(layer_ids) >= depth:
            problems.append(
                f"num_target_layers={config.get('num_target_layers')!r}: SGLang checks target_layer_ids {layer_ids} "
                f"against {depth} target layers; record the target's depth (num_target_layers) in the config."
            )
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={config['hidden_act']!r}: SGLang's DFlash MLP runs SiLU only.")
    mask_token_id = _sglang_value(config, "mask_token_id")
    vocab_size = config.get("vocab_size")
    if not _is_int(mask_token_id) or mask_token_id < 0 or (_is_int(vocab_size) and mask_token_id >= vocab_size):
        problems.append(
            f"mask_token_id={mask_token_id!r}: SGLang needs an id inside the vocabulary (else it looks up a "
            "'<|MASK|>' token in the target tokenizer); set mask_token_id in the drafter's config."
        )
    shift_label = _sglang_value(config, "shift_label")
    if projector_type == "domino":
        if not isinstance(shift_label, bool):
            problems.append(f"shift_label={shift_label!r}: SGLang's Domino parser needs true or false.")
        prefix_len = _sglang_value(config, "pure_draft_prefix_len")
        if prefix_len != 1:
            problems.append(
                f"pure_draft_prefix_len={prefix_len!r}: SGLang's Domino rollout takes exactly one draft from the base "
                "logits before the head; train the drafter with pure_draft_prefix_len=1."
            )
        for key in ("gru_hidden_dim", "emb_dim"):
            value = _sglang_value(config, key)
            if not _is_int(value) or value < 1:
                problems.append(f"{key}={value!r}: SGLang's Domino head needs a positive integer {key}.")
        nested_emb_dim = (config.get("dflash_config") or {}).get("emb_dim")
        if nested_emb_dim is not None and config.get("emb_dim", nested_emb_dim) != nested_emb_dim:
            problems.append(
                f"emb_dim is {config['emb_dim']!r} at the top level but {nested_emb_dim!r} in dflash_config: SGLang "
                "refuses the mismatch; make them equal."
            )
        dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
        if dtype != "bfloat16":
            problems.append(
                f"dtype={dtype!r}: SGLang's Domino runtime needs bfloat16 weights, and under its default --dtype auto "
                "serves a float16/float32 checkpoint in float16; export with dtype=torch.bfloat16 "
                "(`hf-domino export --dtype bfloat16`) or serve with --dtype bfloat16."
            )
    elif projector_type is not None:
        problems.append(f"projector_type={projector_type!r}: SGLang knows only 'domino' or none (plain DFlash).")
    elif shift_label:
        problems.append(
            "shift_label=true without the Domino head: SGLang's plain DFlash path drafts from block positions "
            "1.. (shift_label=false) and would propose the wrong tokens; train a DFlash drafter with "
            "shift_label=False."
        )
    return problems


def _sglang_expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The tensors SGLang's `DFlashDraftModel` builds for this config, with their (unsharded) shapes."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    ffn, vocab = config["intermediate_size"], config["vocab_size"]
    shapes = {
        "norm.weight": (hidden,),
        "hidden_norm.weight": (hidden,),
        "fc.weight": (hidden, len(_sglang_value(config, "target_layer_ids")) * hidden),
    }
    projections = {"q_proj": heads * head_dim, "k_proj": kv_heads * head_dim, "v_proj": kv_heads * head_dim}
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        shapes |= {p + f"self_attn.{name}.weight": (rows, hidden) for name, rows in projections.items()}
        shapes |= {
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "self_attn.q_norm.weight": (head_dim,),
            p + "self_attn.k_norm.weight": (head_dim,),
            p + "mlp.gate_proj.weight": (ffn, hidden),
            p + "mlp.up_proj.weight": (ffn, hidden),
            p + "mlp.down_proj.weight": (hidden, ffn),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
        if config.get("attention_bias"):
            shapes |= {p + f"self_attn.{name}.bias": (rows,) for name, rows in projections.items()}
            shapes[p + "self_attn.o_proj.bias"] = (hidden,)
    if _sglang_value(config, "projector_type") == "domino":
        gru, rank = _sglang_value(config, "gru_hidden_dim"), _sglang_value(config, "emb_dim")
        shapes |= {
            "prefix_gru.weight_ih_l0": (3 * gru, hidden),
            "prefix_gru.weight_hh_l0": (3 * gru, gru),
            "embed_proj.0.weight": (rank, hidden + gru),
            "embed_proj.2.weight": (vocab, rank),
        }
    return shapes


def _sglang_tensor_problems(
    config: dict[str, Any],
    found: dict[str, tuple[tuple[int, ...], str]],
    expected: dict[str, tuple[int, ...]],
) -> list[str]:
    problems = []
    domino = _sglang_value(config, "projector_type") == "domino"
    for name, shape in expected.items():
        if name not in found:
            # SGLang checks only the Domino head for completeness; a backbone tensor it misses stays uninitialised.
            head = domino and name.startswith(HEAD_PREFIXES)
            consequence = "SGLang refuses the checkpoint" if head else "SGLang would leave it uninitialised"
            problems.append(f"missing tensor {name} {shape}: {consequence}.")
        elif found[name][0] != shape:
            problems.append(f"tensor {name} has shape {found[name][0]}, but config.json implies {shape}.")
    for name, (_, dtype) in found.items():
        if name not in expected:
            if name.startswith(HEAD_PREFIXES) and not domino:
                reason = "SGLang refuses Domino head tensors when projector_type is not 'domino'"
            elif name.startswith(HEAD_PREFIXES):
                reason = "SGLang's Domino head is bias-free and would ignore it"
            else:
                reason = "SGLang would ignore it"
            problems.append(f"unexpected tensor {name}: {reason}.")
        elif dtype not in _FLOAT_DTYPES:
            problems.append(f"tensor {name} is stored as {dtype}: SGLang loads float16, bfloat16 or float32 weights.")
    return problems

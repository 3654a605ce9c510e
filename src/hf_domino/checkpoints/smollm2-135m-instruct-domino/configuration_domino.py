"""Configuration of Domino (and plain DFlash) speculative-decoding drafters.

This file is also written next to exported checkpoints as remote code, so it imports only transformers and torch.
Its annotations are evaluated (no `from __future__ import annotations`): huggingface_hub's strict dataclass checks a
field's type only where its annotation is a type, not a string (`shift_label="false"` was taken for true).
"""

import copy
from pathlib import Path
from typing import Any

from huggingface_hub.dataclasses import strict
from huggingface_hub.errors import StrictDataclassError
from transformers import PretrainedConfig
from transformers.integrations.heterogeneity.configuration_utils import AmbiguousGlobalPerLayerAttributeError
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

# Keys that the published checkpoints keep inside `dflash_config` (some put `mask_token_id` and
# `target_layer_ids` at the top level instead); we hold them all as top-level config fields.
DFLASH_CONFIG_KEYS = (
    "mask_token_id",
    "target_layer_ids",
    "projector_type",
    "emb_dim",
    "gru_hidden_dim",
    "pure_draft_prefix_len",
    "shift_label",
)
# The published configs point at their authors' remote code; these keys must not leak into ours.
FOREIGN_KEYS = ("architectures", "auto_map")

# What the published layout says and serving stacks key on (see docs/model.md, "Who reads what"): with
# `model_type: qwen3`, SGLang reads the file through AutoConfig without remote code and the reference implementation
# through transformers 4's Qwen3Config without a model-type warning; SGLang picks its DFlash/Domino drafter from the
# first `architectures` name it registers. `DominoForSpeculation` comes second so that
# `pipeline(..., assistant_model="path")` finds our class in the transformers namespace.
SERVING_MODEL_TYPE = "qwen3"
SERVING_ARCHITECTURE = "DFlashDraftModel"
OWN_ARCHITECTURE = "DominoForSpeculation"
# `auto_map["AutoConfig"]` of a folder saved here; it tells our own layout from the published one on loading.
OWN_AUTO_CONFIG = "configuration_domino.DominoConfig"

# transformers' own DFlash assistant (`MuseGlimmerAssistantConfig`, for `generate(..., speculation_type="dflash")`):
# the same backbone; the fields that mean the same in both configs.
TRANSFORMERS_DFLASH_MODEL_TYPE = "muse_glimmer_assistant"
TRANSFORMERS_DFLASH_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "max_position_embeddings",
    "hidden_act",
    "attention_dropout",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "block_size",
    "mask_token_id",
    "target_layer_ids",
    "rope_parameters",
    "layer_types",
)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's layer choice: the middle layer for one draft layer, else evenly spaced from 1 to L - 3.

    Targets shallower than 4 layers (tests, toys) get the ids clamped into range.
    """
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    spaced = [round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)]
    return [min(max(i, 0), num_target_layers - 1) for i in spaced]


def normalize_published_config(config_dict: dict[str, Any]) -> dict[str, Any]:
    """Map a DFlash/Domino `config.json` (published, or saved here: model_type `qwen3` + `dflash_config`) to
    DominoConfig keys. Idempotent, so it is safe on a dict that is already normalized."""
    config_dict = copy.deepcopy(config_dict)
    if config_dict.get("model_type") == TRANSFORMERS_DFLASH_MODEL_TYPE:
        config_dict = from_transformers_dflash_config(config_dict)
    _refuse_other_drafter_architectures(config_dict)
    dflash_config = config_dict.pop("dflash_config", None) or {}
    for key in DFLASH_CONFIG_KEYS:
        if key in dflash_config:
            # The package reads `dflash_config`, AutoConfig without remote code the top level: a hand edit of one
            # would load differently in the two places, so it is refused rather than guessed.
            if config_dict.get(key) is not None and config_dict[key] != dflash_config[key]:
                raise ValueError(
                    f"config.json says {key}={config_dict[key]!r} at the top level and {dflash_config[key]!r} in "
                    "`dflash_config`: make the two agree (the reference implementation reads `dflash_config`)."
                )
            config_dict[key] = dflash_config[key]
    if config_dict.get("model_type") != DominoConfig.model_type:
        if not _saved_by_hf_domino(config_dict):
            for key in FOREIGN_KEYS:
                config_dict.pop(key, None)
        config_dict["model_type"] = DominoConfig.model_type
    _drop_legacy_mirrors(config_dict)
    _check_sliding_window(config_dict)
    return config_dict


def from_transformers_dflash_config(config_dict: dict[str, Any]) -> dict[str, Any]:
    """A `config.json` of transformers' own DFlash assistant as a DFlash drafter's (`shift_label=False`, no head).

    Read through transformers' class, so that a field its file leaves out takes that class's default. Its sliding
    window counts keys within `window` positions of a query inclusively, ours (and DFlash's) exclusively. It records
    no vocabulary size unless `to_transformers_dflash` wrote the folder (`DominoConfig.get_config_dict` then asks for
    one).
    """
    from transformers import MuseGlimmerAssistantConfig

    native = MuseGlimmerAssistantConfig.from_dict(config_dict)
    fields = {name: copy.deepcopy(getattr(native, name)) for name in TRANSFORMERS_DFLASH_FIELDS}
    fields.update(model_type=DominoConfig.model_type, projector_type=None, shift_label=False, sliding_window=None)
    if "sliding_attention" in fields["layer_types"]:
        fields["sliding_window"] = native.sliding_window + 1
    for key in ("vocab_size", "dtype", "num_target_layers"):  # recorded by `to_transformers_dflash` beside its fields
        if key in config_dict:
            fields[key] = config_dict[key]
    return fields


# Drafters published under the same `model_type: qwen3` whose modules are not DFlash's: loading their weights into a
# DFlash backbone would fail on missing and unexpected keys, so they are named instead.
OTHER_DRAFTER_ARCHITECTURES = {
    "DFlash2DraftModel": "DFlash2 (a causal-convolution selector beside the backbone)",
    "DSparkDraftModel": "DSpark (a Markov head and a confidence head)",
}


def _refuse_other_drafter_architectures(config_dict: dict[str, Any]) -> None:
    for name in config_dict.get("architectures") or []:
        if name in OTHER_DRAFTER_ARCHITECTURES:
            raise ValueError(
                f"This config.json describes a {name}, a {OTHER_DRAFTER_ARCHITECTURES[name]} drafter, which is "
                "another architecture than DFlash/Domino: it cannot load as a DominoForSpeculation. Use a DFlash or "
                "Domino drafter for the same target (their configs say DFlashDraftModel or DominoForSpeculation)."
            )


def _check_sliding_window(config_dict: dict[str, Any]) -> None:
    # Without the key, Qwen3Config's default window (4096) would apply silently.
    if "sliding_attention" in (config_dict.get("layer_types") or []) and not config_dict.get("sliding_window"):
        raise ValueError(
            "config.json lists sliding_attention layers in layer_types but gives no sliding_window: add the window "
            "the drafter was trained with (`sliding_window`, in tokens), or list its layers as full_attention."
        )


def legacy_rope_fields(rope_parameters: dict[str, Any] | None) -> dict[str, Any]:
    """The transformers-4 spelling of `rope_parameters`: `rope_theta`, plus `rope_scaling` (without the base) when
    the RoPE type is not the default, plus a top-level `partial_rotary_factor` when one is set.

    Transformers 4 reads only these (a missing `rope_theta` silently means base 10000); transformers 5 maps them back
    to the same `rope_parameters`. Per-layer-type (nested) RoPE has no transformers-4 form and gets no mirror.
    """
    if not rope_parameters or "rope_theta" not in rope_parameters:
        return {}
    fields: dict[str, Any] = {"rope_theta": rope_parameters["rope_theta"]}
    if rope_parameters.get("partial_rotary_factor") is not None:
        fields["partial_rotary_factor"] = rope_parameters["partial_rotary_factor"]
    if rope_parameters.get("rope_type", "default") != "default":
        fields["rope_scaling"] = {
            key: value for key, value in rope_parameters.items() if key not in ("rope_theta", "partial_rotary_factor")
        }
    return fields


def _saved_by_hf_domino(config_dict: dict[str, Any]) -> bool:
    # Remote code loaded from the Hub rewrites the reference as "owner/repo--configuration_domino.DominoConfig".
    auto_config = (config_dict.get("auto_map") or {}).get("AutoConfig") or ""
    return auto_config.split("--")[-1] == OWN_AUTO_CONFIG


def _drop_legacy_mirrors(config_dict: dict[str, Any]) -> None:
    """Drops the transformers-4 mirrors of `rope_parameters` after checking that they agree with it.

    A folder written here carries both forms. Transformers 5 would give `rope_scaling` priority over
    `rope_parameters` but `rope_parameters` priority over `rope_theta`, so a hand edit of only one form would load
    differently in different places; refuse it instead of guessing.
    """
    rope_parameters = config_dict.get("rope_parameters")
    if isinstance(rope_parameters, dict) and "rope_theta" in rope_parameters:
        expected = legacy_rope_fields(rope_parameters)
        for key in ("rope_theta", "rope_scaling", "partial_rotary_factor"):
            if key not in config_dict:
                continue
            found = config_dict.pop(key)
            if found is None and key == "rope_scaling" and "rope_scaling" not in expected:
                continue  # `rope_scaling: null` is how transformers 4 spells the default RoPE
            if found != expected.get(key):
                raise ValueError(
                    f"config.json has {key}={found!r}, which disagrees with rope_parameters={rope_parameters!r} "
                    f"(expected {key}={expected.get(key)!r}). Both forms are written so that transformers 4 and 5 "
                    "loaders read the same RoPE: correct whichever of the two was edited."
                )


@strict
class DominoConfig(Qwen3Config):
    r"""
    Configuration of a [`DominoForSpeculation`] drafter: a Qwen3-style DFlash backbone that drafts a block in one
    non-causal forward from the target's hidden states, plus the optional Domino head (`projector_type="domino"`).

    The Qwen3 fields (`hidden_size`, `num_hidden_layers` = draft layers, heads, rope, ...) describe the backbone.
    `hidden_size` and `vocab_size` must equal the target's: the drafter reads the target's input embeddings and
    applies the target's LM head.

    Args:
        block_size (`int`): tokens per drafted block, the anchor included.
        num_target_layers (`int`): number of decoder layers of the target.
        target_layer_ids (`list[int]`): target layers whose outputs (`hidden_states[i + 1]`) feed the drafter.
            Defaults to DFlash's spacing rule.
        mask_token_id (`int`): token id filling the block after the anchor.
        projector_type (`str`, *optional*): `"domino"` adds the Domino head; `None` is a plain DFlash drafter.
        emb_dim (`int`): rank of the head's logit correction.
        gru_hidden_dim (`int`): hidden size of the head's GRU.
        pure_draft_prefix_len (`int`): leading drafts taken from the base logits alone.
        shift_label (`bool`): `True` (Domino) makes block position i predict token `start + i + 1` (block_size
            drafts); `False` (DFlash) makes position i predict `start + i` (block_size - 1 drafts).
    """

    model_type = "domino"
    # No drafter without its target layers, so no default instance: older transformers 5 releases (5.17, say) build
    # one to diff against in `to_diff_dict` (every `repr`, so every load of remote code) unless this says so.
    has_no_defaults_at_init = True

    block_size: int = 16
    num_target_layers: int | None = None
    target_layer_ids: list[int] | None = None
    mask_token_id: int | None = None
    projector_type: str | None = None
    emb_dim: int = 256
    gru_hidden_dim: int = 1024
    pure_draft_prefix_len: int = 1
    shift_label: bool = False

    def __post_init__(self, **kwargs):
        if "sliding_attention" in (self.layer_types or []) and self.sliding_window:
            # Qwen3Config drops the window unless `use_sliding_window`, which the published drafters do not set.
            self.use_sliding_window = True
        if self.target_layer_ids is None and self.num_target_layers is not None:
            self.target_layer_ids = default_target_layer_ids(self.num_target_layers, self.num_hidden_layers)
        if isinstance(self.target_layer_ids, str):  # "12" was read as [1, 2]
            raise ValueError(f"target_layer_ids must be a list of layer indices, got {self.target_layer_ids!r}.")
        if self.target_layer_ids is not None:
            self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        super().validate_architecture()
        if self.projector_type not in (None, "domino"):
            raise ValueError(f"projector_type must be None (DFlash) or 'domino', got {self.projector_type!r}.")
        if self.block_size < 2:
            raise ValueError(f"block_size must be at least 2 (the anchor plus one draft), got {self.block_size}.")
        if self.target_layer_ids is None:
            raise ValueError(
                "DominoConfig needs `target_layer_ids` or `num_target_layers` to choose them. A drafter's config.json "
                "has one of them and a target model's has neither: load the drafter's folder, not its target's."
            )
        if self.has_domino_head and not 0 <= self.pure_draft_prefix_len <= self.num_drafts:
            raise ValueError(
                f"pure_draft_prefix_len={self.pure_draft_prefix_len} must be between 0 and the number of drafts "
                f"per block ({self.num_drafts})."
            )
        # What failed only in the first generate() call, as an IndexError or as a fault of the target's.
        if self.num_hidden_layers < 1:
            raise ValueError(
                f"num_hidden_layers (the drafter's layers) must be at least 1, got {self.num_hidden_layers}."
            )
        if self.num_target_layers is not None and self.num_target_layers < 1:
            raise ValueError(f"num_target_layers must be at least 1, got {self.num_target_layers}.")
        depth = self.num_target_layers
        if not self.target_layer_ids or any(
            i < 0 or (depth is not None and i >= depth) for i in self.target_layer_ids
        ):
            within = "" if depth is None else f" below num_target_layers ({depth})"
            raise ValueError(f"target_layer_ids must name target layers from 0{within}, got {self.target_layer_ids}.")
        if self.mask_token_id is None or not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id must be a token id of the target's vocabulary (0 to {self.vocab_size - 1}), got "
                f"{self.mask_token_id}."
            )
        if self.has_domino_head and (self.emb_dim < 1 or self.gru_hidden_dim < 1):
            raise ValueError(
                f"The Domino head needs emb_dim and gru_hidden_dim of at least 1, got {self.emb_dim} and "
                f"{self.gru_hidden_dim}."
            )

    @property
    def has_domino_head(self) -> bool:
        return self.projector_type == "domino"

    @property
    def num_drafts(self) -> int:
        """Draft tokens per block: every block position with `shift_label`, all but the anchor's without."""
        return self.block_size if self.shift_label else self.block_size - 1

    @property
    def context_size(self) -> int:
        """Width of the concatenated target features fed to `fc`."""
        return len(self.target_layer_ids) * self.hidden_size

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs) -> tuple[dict[str, Any], dict[str, Any]]:
        # Published checkpoints (and ours) say `model_type: qwen3`; normalizing here, before `from_pretrained`
        # compares model types, is what keeps loading them free of the "model of type qwen3" warning.
        folder = Path(str(pretrained_model_name_or_path)).expanduser()
        if folder.is_dir() and not (folder / kwargs.get("subfolder", "") / "config.json").is_file():
            # transformers reads such a folder as an empty config, which the validator took for a target's.
            raise OSError(
                f"No config.json in {pretrained_model_name_or_path}: a drafter's folder holds config.json and "
                "model.safetensors, as save_pretrained writes them."
            )
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        from_transformers = config_dict.get("model_type") == TRANSFORMERS_DFLASH_MODEL_TYPE
        if from_transformers and "vocab_size" not in config_dict and "vocab_size" not in kwargs:
            raise ValueError(
                f"{pretrained_model_name_or_path} holds transformers' own DFlash assistant (model_type "
                f"{TRANSFORMERS_DFLASH_MODEL_TYPE}), whose config does not record the vocabulary it drafts over: pass "
                "the target's, DominoForSpeculation.from_pretrained(path, vocab_size=target.config.vocab_size)."
            )
        return normalize_published_config(config_dict), kwargs

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs) -> "DominoConfig":
        # `to_dict` writes the serving layout (model_type `qwen3`, transformers-4 mirrors); read it back as ours.
        try:
            loaded = super().from_dict(normalize_published_config(config_dict), **kwargs)
            # Settings given beside the file (from_pretrained(path, block_size=0)) are set after its validation.
            (loaded[0] if isinstance(loaded, tuple) else loaded).validate_architecture()
            return loaded
        except StrictDataclassError as error:
            # huggingface_hub wraps a validator's ValueError (a target's config.json given as a drafter's, say) in
            # an error of its own, which callers that report bad input as a ValueError would show as a traceback.
            if isinstance(error.__cause__, ValueError):
                raise ValueError(str(error.__cause__)) from error
            raise

    def to_dict(self) -> dict[str, Any]:
        """The serving layout that every loader of the format reads the same (docs/model.md, "Who reads what").

        Besides the transformers-5 fields: the Domino fields mirrored in `dflash_config` (the reference
        implementation reads them there), `model_type: qwen3` and `DFlashDraftModel` first in `architectures` (what
        SGLang and AutoConfig without remote code key on), and the transformers-4 `rope_theta`/`rope_scaling`
        (without `rope_theta`, a transformers-4 loader silently uses RoPE base 10000).
        """
        output = super().to_dict()
        output["dflash_config"] = {key: output[key] for key in DFLASH_CONFIG_KEYS if output.get(key) is not None}
        output["model_type"] = SERVING_MODEL_TYPE
        own = [name for name in output.get("architectures") or [OWN_ARCHITECTURE] if name != SERVING_ARCHITECTURE]
        output["architectures"] = [SERVING_ARCHITECTURE, *own]
        output.update(legacy_rope_fields(output.get("rope_parameters")))
        auto_map = output.get("auto_map") or {}
        model_class = auto_map.get("AutoModel") or auto_map.get("AutoModelForCausalLM") or ""
        if model_class.endswith(f".{OWN_ARCHITECTURE}"):
            # AutoModelForCausalLM is how transformers' docs load an assistant; with remote code allowed it then
            # builds the drafter too, where the Qwen3 model_type alone would build a Qwen3ForCausalLM.
            output["auto_map"] = {**auto_map, "AutoModel": model_class, "AutoModelForCausalLM": model_class}
        return output

    @classmethod
    def from_target(
        cls,
        target_config: PretrainedConfig,
        *,
        num_hidden_layers: int = 1,
        block_size: int = 16,
        mask_token_id: int | None = None,
        target_layer_ids: list[int] | None = None,
        with_domino_head: bool = True,
        emb_dim: int = 256,
        gru_hidden_dim: int = 1024,
        pure_draft_prefix_len: int = 1,
        shift_label: bool | None = None,
        **backbone_kwargs: Any,
    ) -> "DominoConfig":
        """Builds a fresh drafter config for `target_config` (sizes, vocabulary and special tokens from the target).

        Backbone shapes default to the target's (heads, head_dim, MLP width); override them with `backbone_kwargs`.
        `shift_label` defaults to `True` with the Domino head (the published Domino convention), `False` without.
        """
        text_config = target_config.get_text_config()
        num_target_layers = target_depth(text_config)
        if mask_token_id is None:
            mask_token_id = _default_mask_token_id(text_config)
        # A target without attention (a state-space model such as Mamba) gives no head count: heads of 64.
        num_heads = _target_value(text_config, "num_attention_heads") or max(1, text_config.hidden_size // 64)
        backbone = {
            "hidden_size": text_config.hidden_size,
            "intermediate_size": _mlp_width(text_config),
            "num_attention_heads": num_heads,
            "num_key_value_heads": _target_value(text_config, "num_key_value_heads") or num_heads,
            "head_dim": _target_value(text_config, "head_dim") or text_config.hidden_size // num_heads,
            # Cohere's and GPT-2's configs name their norm's epsilon otherwise: the drafter's own RMSNorm default
            "rms_norm_eps": _target_value(text_config, "rms_norm_eps") or 1e-6,
            "max_position_embeddings": _target_value(text_config, "max_position_embeddings") or 32768,
            "rope_parameters": _full_attention_rope(text_config),
            "vocab_size": text_config.vocab_size,
            # Older configs (CodeGen's, RWKV's) have no pad_token_id at all
            "eos_token_id": _target_value(text_config, "eos_token_id"),
            "pad_token_id": _target_value(text_config, "pad_token_id"),
            "bos_token_id": _target_value(text_config, "bos_token_id"),
        }
        backbone.update(backbone_kwargs)
        return cls(
            num_hidden_layers=num_hidden_layers,
            block_size=block_size,
            num_target_layers=num_target_layers,
            target_layer_ids=target_layer_ids,
            mask_token_id=mask_token_id,
            projector_type="domino" if with_domino_head else None,
            emb_dim=emb_dim,
            gru_hidden_dim=gru_hidden_dim,
            pure_draft_prefix_len=pure_draft_prefix_len,
            shift_label=with_domino_head if shift_label is None else shift_label,
            **backbone,
        )


def target_depth(text_config: PretrainedConfig) -> int | None:
    """How many decoder layers return hidden states (`output_hidden_states`): `num_hidden_layers`, except where a
    config counts more there, as LongCat-Flash's counts the two attention sublayers of each of its `num_layers`."""
    layers, decoder_layers = getattr(text_config, "num_hidden_layers", None), getattr(text_config, "num_layers", None)
    if isinstance(layers, int) and isinstance(decoder_layers, int) and 0 < decoder_layers < layers:
        return decoder_layers
    return layers


def _target_value(text_config: PretrainedConfig, name: str) -> Any:
    """A field of the target's config, None where it has none. Where transformers keeps it per layer (heterogeneous
    configs: Gemma 4's head size differs between its sliding and full layers), the first full-attention layer's: the
    drafter's attention is full."""
    try:
        return getattr(text_config, name, None)
    except AmbiguousGlobalPerLayerAttributeError:
        layer_types = list(getattr(text_config, "layer_types", None) or [])
        layer = layer_types.index("full_attention") if "full_attention" in layer_types else 0
        return getattr(text_config.per_layer_config[layer], name, None)


def _mlp_width(text_config: PretrainedConfig) -> int:
    # Families name it differently (Falcon's ffn_hidden_size, GPT-2's n_inner), derive it (MPT) or list it per layer
    # (Gemma 3n); the drafter's MLP is its own, so a target without one gets the common 4 x hidden.
    for name in ("intermediate_size", "ffn_hidden_size", "n_inner"):
        width = _target_value(text_config, name)
        if width:
            return max(width) if isinstance(width, (list, tuple)) else width
    return 4 * text_config.hidden_size


def _full_attention_rope(text_config: PretrainedConfig) -> dict | None:
    # Hybrid targets (Gemma 3) keep one set of rotary parameters per layer type; the drafter's attention is full and
    # rotary: the full layers' parameters, else another type's where those have none (Beam's full-attention layers
    # have no rotary positions), else the defaults.
    rope = _target_value(text_config, "rope_parameters")
    if isinstance(rope, dict) and "rope_type" not in rope:
        by_type = [rope.get("full_attention"), *rope.values()]
        return next((dict(parameters) for parameters in by_type if isinstance(parameters, dict)), None)
    return rope


def _default_mask_token_id(text_config: PretrainedConfig) -> int:
    # Any id works as long as training and inference agree; the pad token is the usual choice, EOS the fallback.
    for candidate in (_target_value(text_config, "pad_token_id"), _target_value(text_config, "eos_token_id")):
        if isinstance(candidate, list):
            candidate = candidate[0] if candidate else None
        if candidate is not None:
            return int(candidate)
    raise ValueError("The target config has neither pad_token_id nor eos_token_id: pass `mask_token_id=` explicitly.")


__all__ = [
    "DominoConfig",
    "default_target_layer_ids",
    "legacy_rope_fields",
    "normalize_published_config",
    "target_depth",
]

# save_pretrained then writes this file next to the checkpoint and `auto_map` into config.json.
DominoConfig.register_for_auto_class()

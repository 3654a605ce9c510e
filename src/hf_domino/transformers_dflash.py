"""A drafter's backbone as transformers' own DFlash assistant (`generate(..., speculation_type="dflash")`).

Every transformers release hf-domino supports drafts DFlash-style by itself: `DFlashTokenCandidateGenerator` with a
`MuseGlimmerAssistantModel`, the same backbone as ours (a projection of the target's hidden states, non-causal
Qwen3-style layers with q/k norms, the target's embeddings and LM head) under other tensor names.
`to_transformers_dflash` builds that model from a DFlash drafter, so that the drafter runs in transformers with no
remote code and no hf-domino, or is compared with ours: on the same weights both draft the same tokens at every cycle
(tests/test_transformers_dflash.py). `from_transformers_dflash` goes back, in memory, so that transformers' assistant
drafts through hf-domino (batches, the adaptive policy); folders load back with `DominoForSpeculation.from_pretrained`.

What does not carry over: the Domino head, the draft vocabulary (transformers drafts over the whole vocabulary),
and drafters trained with `shift_label=True` (every published Domino drafter, and ours): transformers reads the drafts
from block positions 1 to B - 1, where such a drafter predicts from position 0.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

from .configuration_domino import TRANSFORMERS_DFLASH_FIELDS, DominoConfig
from .modeling_domino import TRANSFORMERS_DFLASH_NAMES, DominoForSpeculation

HEAD_PREFIXES = ("prefix_gru.", "embed_proj.")


def to_transformers_dflash(
    drafter: DominoForSpeculation, *, drop_domino_head: bool = False
) -> MuseGlimmerAssistantModel:
    """transformers' `MuseGlimmerAssistantModel` with `drafter`'s backbone, on its device and in its dtype.

    Use it as transformers' own DFlash drafter: `target.generate(**inputs, assistant_model=model,
    speculation_type="dflash")`, or `model.save_pretrained(folder)` for a folder `AutoModel.from_pretrained` loads
    without `trust_remote_code`. Raises `ValueError` for a drafter transformers' path would run differently:
    `shift_label=True`, a Domino head (unless `drop_domino_head=True`, which drafts as `domino_head=False` does
    here), attention biases or partial RoPE.
    """
    if not isinstance(drafter, DominoForSpeculation):
        raise TypeError(
            f"to_transformers_dflash converts a DominoForSpeculation drafter, got a {type(drafter).__name__}: pass "
            "the drafter (DominoForSpeculation.from_pretrained(path)), not the target."
        )
    config = drafter.config
    check_convertible(config, drop_domino_head=drop_domino_head)
    native = MuseGlimmerAssistantModel(MuseGlimmerAssistantConfig(**_native_config_fields(config))).eval()
    weights = {
        TRANSFORMERS_DFLASH_NAMES.get(name, name): tensor
        for name, tensor in drafter.state_dict().items()
        if not name.startswith(HEAD_PREFIXES)
    }
    native.load_state_dict(weights, strict=True)
    return native.to(device=drafter.device, dtype=drafter.dtype)


def from_transformers_dflash(
    model: MuseGlimmerAssistantModel, *, vocab_size: int | None = None
) -> DominoForSpeculation:
    """The `DominoForSpeculation` drafter with `model`'s weights (a DFlash drafter: `shift_label=False`, no Domino
    head), on its device and in its dtype.

    `target.generate(**batch, assistant_model=drafter)` then drafts what transformers' own path drafts, with what
    hf-domino adds (batches, the adaptive policy, copied drafts). `vocab_size` is the target's; a model that
    `to_transformers_dflash` built records it, one transformers built alone does not, and is refused without it.
    """
    if not isinstance(model, MuseGlimmerAssistantModel):
        raise TypeError(
            f"from_transformers_dflash converts transformers' MuseGlimmerAssistantModel, got a {type(model).__name__}"
            + (": it is a drafter of ours already." if isinstance(model, DominoForSpeculation) else ".")
        )
    config_dict = model.config.to_dict()
    if vocab_size is not None:
        config_dict["vocab_size"] = vocab_size
    elif "vocab_size" not in config_dict:
        raise ValueError(
            "This MuseGlimmerAssistantModel's config does not record the vocabulary it drafts over: pass the "
            "target's, from_transformers_dflash(model, vocab_size=target.config.vocab_size)."
        )
    mask_token_id = config_dict.get("mask_token_id")
    if mask_token_id is None or not 0 <= mask_token_id < config_dict["vocab_size"]:
        raise ValueError(
            f"This MuseGlimmerAssistantModel's mask_token_id ({mask_token_id}) is not an id of the "
            f"{config_dict['vocab_size']}-token vocabulary it drafts over (its config's default, unset?): set "
            "model.config.mask_token_id to the id its block was trained with."
        )
    drafter = DominoForSpeculation(DominoConfig.from_dict(config_dict)).eval()
    ours = {theirs: mine for mine, theirs in TRANSFORMERS_DFLASH_NAMES.items()}
    drafter.load_state_dict({ours.get(name, name): tensor for name, tensor in model.state_dict().items()}, strict=True)
    return drafter.to(device=model.device, dtype=model.dtype)


def check_convertible(config: Any, *, drop_domino_head: bool = False) -> None:
    """Raises the `ValueError` `to_transformers_dflash` would raise for a drafter with this config, naming why."""
    if config.shift_label:
        raise ValueError(
            "This drafter was trained with shift_label=True (block position i predicts token start + i + 1, as every "
            "published Domino drafter does); transformers' DFlash path reads block position i as token start + i, so "
            "every draft would come one token late and almost none would be accepted. Draft with it through "
            "hf-domino (target.generate(..., assistant_model=drafter)); only shift_label=False (DFlash) drafters "
            "convert."
        )
    if config.has_domino_head and not drop_domino_head:
        raise ValueError(
            "transformers' DFlash assistant has no Domino head (the GRU and logit correction, prefix_gru.* and "
            "embed_proj.*): converting keeps the backbone only, which drafts as domino_head=False does here. Pass "
            "drop_domino_head=True (hf-domino export: --drop-domino-head) to convert without it, or draft with the "
            "head through hf-domino."
        )
    if config.attention_bias:
        raise ValueError(
            "This drafter's attention projections have biases (attention_bias=True); transformers' DFlash assistant "
            "has none. Draft with it through hf-domino."
        )
    rope = config.rope_parameters or {}
    if "rope_theta" not in rope or (rope.get("partial_rotary_factor", 1.0) != 1.0 and not _same_rotation(config)):
        raise ValueError(
            f"This drafter's RoPE ({rope}) is not one transformers' DFlash assistant builds (one set of parameters "
            "for every layer, rotating the whole head). Draft with it through hf-domino."
        )


def _same_rotation(config: Any) -> bool:
    """Whether transformers' assistant rotates as the drafter does with this config's RoPE: compared, not assumed,
    for a `partial_rotary_factor` (the default RoPE of both reads it the same way, rotating the whole head, on the
    transformers releases tested; a release that read it in one place only would be refused)."""
    from transformers.models.muse_glimmer_assistant.modeling_muse_glimmer_assistant import (
        MuseGlimmerAssistantRotaryEmbedding,
    )
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    ours = Qwen3RotaryEmbedding(config)  # the drafter's (modeling_domino)
    theirs = MuseGlimmerAssistantRotaryEmbedding(MuseGlimmerAssistantConfig(**_native_config_fields(config)))
    return (
        ours.inv_freq.shape == theirs.inv_freq.shape
        and bool(torch.equal(ours.inv_freq, theirs.inv_freq))
        and (ours.attention_scaling == theirs.attention_scaling)
    )


def _native_config_fields(config: Any) -> dict[str, Any]:
    fields = {name: copy.deepcopy(getattr(config, name)) for name in TRANSFORMERS_DFLASH_FIELDS}
    fields["layer_types"] = fields["layer_types"] or ["full_attention"] * config.num_hidden_layers
    if "sliding_attention" in fields["layer_types"]:
        # Ours (and DFlash's) sees keys with |query - key| < window; transformers' bidirectional window is inclusive.
        fields["sliding_window"] = config.sliding_window - 1
    # Not fields of transformers' config, which keeps them: DominoForSpeculation.from_pretrained reads them back (a
    # drafter's depth of target, which SGLang reads its layer ids against, included).
    fields["vocab_size"] = config.vocab_size
    if config.num_target_layers is not None:
        fields["num_target_layers"] = config.num_target_layers
    # Its config takes one EOS id (a list, as Llama 3.1's targets have, failed its validation); the assistant never
    # stops on it: the target's generation config does.
    if isinstance(fields.get("eos_token_id"), list):
        fields["eos_token_id"] = fields["eos_token_id"][0] if fields["eos_token_id"] else None
    return fields

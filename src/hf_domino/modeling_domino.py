"""Domino drafter: a DFlash parallel backbone plus the Domino head (GRU over drafted tokens + low-rank logit fix).

One block of drafting, for a target whose last produced token is the *anchor*:

1. the backbone reads `[anchor, MASK, ..., MASK]` (embedded with the target's table) in one non-causal forward;
   its keys/values also cover the target's hidden states of every verified token before the anchor;
2. the target's LM head turns the backbone output into base logits for every draft position;
3. the Domino head walks the drafts in order: a GRU reads the anchor and each drafted token, and
   `embed_proj([z ; s])` adds a correction to the base logits of the next position.

The drafter owns neither embeddings nor an LM head: both are the target's and are passed explicitly as
`TargetModules` (target_modules_domino.py). This file is also written next to exported checkpoints as remote code (transformers + torch only).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import re
from collections.abc import Callable, Iterator, Sequence

import torch
from safetensors.torch import save_file
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.qwen3.modeling_qwen3 import (
    ALL_ATTENTION_FUNCTIONS,
    Qwen3Attention,
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    eager_attention_forward,
    rotate_half,
)
from transformers.utils import cached_file

from .configuration_domino import DominoConfig
from .target_modules_domino import TargetModules, vocab_rows

# A drafter's optional draft vocabulary lives in this file next to model.safetensors.
DRAFT_VOCAB_FILE = "draft_vocab.safetensors"
# Tensors that transformers' own DFlash assistant (`MuseGlimmerAssistantModel`) names otherwise: ours -> theirs.
TRANSFORMERS_DFLASH_NAMES = {"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}
# `with drafter.domino_head(False):` sets the default of generate()'s `domino_head` option for the block (None: on
# when the drafter has a head).
DOMINO_HEAD_DEFAULT: contextvars.ContextVar[bool | None] = contextvars.ContextVar("domino_head_default", default=None)


def hidden_state_indices(layer_ids: Sequence[int]) -> list[int]:
    """Where the target layers `layer_ids` sit in the `hidden_states` a transformers model returns: index 0 is the
    embedding output, so layer i is `hidden_states[i + 1]` (what `output_hidden_states` asks for)."""
    return [i + 1 for i in layer_ids]


def context_features(hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> torch.Tensor:
    """A drafter's context input: the target's hidden states after each layer in `layer_ids`, concatenated.

    `hidden_states` is the tuple a transformers model returns with `output_hidden_states` (index 0 is the embedding
    output, so layer i is `hidden_states[i + 1]`): `[b, n, hidden]` each -> `[b, n, len(layer_ids) * hidden]`.
    """
    states = [hidden_states[i] for i in hidden_state_indices(layer_ids)]
    # A target split over several devices (`device_map`) leaves its layers' outputs on each.
    return torch.cat([state.to(states[0].device) for state in states], dim=-1)


def check_context_features(features: torch.Tensor, config: DominoConfig) -> None:
    """Raises, naming the fix, where a target's hidden states are not one `[b, n, hidden_size]` state per layer: those
    with hyper-connections (Hunyuan V4's) or AltUp (Gemma 3n's) carry several residual streams between layers, merged
    only before their LM head, which no drafter format reads yet."""
    if features.dim() != 3 or features.shape[-1] != config.context_size:
        raise ValueError(
            f"The target's hidden states after the {len(config.target_layer_ids)} layers the drafter reads come as "
            f"{tuple(features.shape)}, where a drafter reads [batch, tokens, {config.context_size}] (one hidden state "
            f"of hidden_size {config.hidden_size} per layer): this target keeps several residual streams between its "
            "layers (hyper-connections, AltUp), which no drafter format reads yet. Generate without the drafter."
        )


def _apply_rotary(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return states * cos + rotate_half(states) * sin


def sliding_window_mask(
    attention_mask: torch.Tensor | None,
    query_positions: torch.LongTensor,
    key_positions: torch.LongTensor,
    window: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """`attention_mask` (additive, `[b, 1, q, kv]`, or None for all visible) restricted to the keys within `window`
    positions of each query, on both sides (`|query - key| < window`, the window counting the query's own position,
    as transformers counts a causal one): a sliding-window layer of the DFlash drafters published for Qwen3.5/3.6
    targets, non-causal like every layer of the backbone."""
    outside = (query_positions[:, :, None] - key_positions[:, None, :]).abs() >= window
    if attention_mask is None:
        attention_mask = torch.zeros(outside.shape, dtype=dtype, device=outside.device)[:, None]
    return attention_mask.masked_fill(outside[:, None], torch.finfo(attention_mask.dtype).min)


class DominoAttention(Qwen3Attention):
    """Qwen3 attention whose keys/values are `[context ; block]`, with the same projections for both, non-causal."""

    def __init__(self, config: DominoConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.is_causal = False

    def forward(
        self,
        hidden_states: torch.Tensor,
        context: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        past_key_values: DynamicCache | None = None,
        num_queries: int | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`num_queries`: only the block's first positions ask (all of it still answers as keys/values)."""
        batch_size, block_len = hidden_states.shape[:2]
        num_queries = block_len if num_queries is None else num_queries
        kv_input = torch.cat([context, hidden_states], dim=1)
        query = self.q_proj(hidden_states[:, :num_queries]).view(batch_size, num_queries, -1, self.head_dim)
        query = self.q_norm(query).transpose(1, 2)
        key = self.k_norm(self.k_proj(kv_input).view(batch_size, kv_input.shape[1], -1, self.head_dim)).transpose(1, 2)
        value = self.v_proj(kv_input).view(batch_size, kv_input.shape[1], -1, self.head_dim).transpose(1, 2)

        # cos/sin cover [new context ; block]; queries are the block's first positions, keys all of them.
        cos, sin = position_embeddings
        start = cos.shape[1] - block_len
        query = _apply_rotary(query, cos[:, start : start + num_queries], sin[:, start : start + num_queries])
        key = _apply_rotary(key, cos, sin)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        if attention_mask is not None:
            attention_mask = attention_mask[:, :, :num_queries]

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            sliding_window=self.sliding_window,
            is_causal=False,
            **kwargs,
        )
        attn_output = attn_output.reshape(batch_size, num_queries, -1).contiguous()
        return self.o_proj(attn_output), attn_weights


class DominoDecoderLayer(GradientCheckpointingLayer):
    """A Qwen3 decoder layer over the block; the (already normalized) context only enters as keys/values."""

    def __init__(self, config: DominoConfig, layer_idx: int):
        super().__init__()
        self.attention_type = config.layer_types[layer_idx]
        self.self_attn = DominoAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        context: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        past_key_values: DynamicCache | None = None,
        num_queries: int | None = None,
        **kwargs,
    ) -> torch.Tensor:
        residual = hidden_states[:, :num_queries]
        hidden_states, _ = self.self_attn(
            self.input_layernorm(hidden_states),
            context,
            position_embeddings,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            num_queries=num_queries,
            **kwargs,
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class PrefixGRU(nn.GRU):
    """`nn.GRU` that packs its weights into cuDNN's single buffer after every `.to()` / `.cuda()`. torch only
    re-points them there, and cuDNN then copies them together on every call (warning that they are "not part of
    single contiguous chunk of memory"). torch packs float32 and float16 weights only, so bfloat16 weights on CUDA
    run torch's own GRU kernels instead of cuDNN's copying path (the first GPU run found that warning on every eager
    bf16 call). A no-op off CUDA."""

    def _apply(self, fn, recurse=True):
        module = super()._apply(fn, recurse)
        self.flatten_parameters()
        return module

    def forward(self, input, hx=None):
        weight = self.weight_ih_l0
        packed = not weight.is_cuda or torch.backends.cudnn.is_acceptable(weight)
        with contextlib.nullcontext() if packed else torch.backends.cudnn.flags(enabled=False):
            return super().forward(input, hx)


def build_domino_head(config: DominoConfig) -> tuple[nn.GRU, nn.Sequential]:
    """The head's modules, named as in the published checkpoints (`prefix_gru`, `embed_proj.0`, `embed_proj.2`)."""
    prefix_gru = PrefixGRU(config.hidden_size, config.gru_hidden_dim, num_layers=1, bias=False, batch_first=True)
    embed_proj = nn.Sequential(
        nn.Linear(config.hidden_size + config.gru_hidden_dim, config.emb_dim, bias=False),
        nn.SiLU(),
        nn.Linear(config.emb_dim, config.vocab_size, bias=False),
    )
    return prefix_gru, embed_proj


class DominoPreTrainedModel(PreTrainedModel):
    config_class = DominoConfig
    config: DominoConfig
    base_model_prefix = ""
    supports_gradient_checkpointing = True
    _no_split_modules = ["DominoDecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flex_attn = False
    _supports_attention_backend = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, nn.GRU):
            bound = module.hidden_size**-0.5
            for weight in module.parameters():
                nn.init.uniform_(weight, -bound, bound)


class DominoForSpeculation(DominoPreTrainedModel):
    """A Domino (or, without the head, DFlash) drafter for speculative decoding with a frozen target.

    Pass it as `assistant_model=` to the target's `generate()` (or to a text-generation `pipeline`): the assisted
    decoding loop then drafts one block per target forward with this model and verifies it losslessly.
    """

    # Recognised by the generate() hook by attribute, so that the package and remote-code copies of this class (two
    # different Python classes) are both dispatched.
    _is_domino_drafter = True

    def __init__(self, config: DominoConfig):
        # Again here: settings given to from_pretrained (`block_size=0`) are set after the config was validated.
        config.validate_architecture()
        super().__init__(config)
        self.layers = nn.ModuleList([DominoDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.fc = nn.Linear(config.context_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.has_domino_head:
            self.prefix_gru, self.embed_proj = build_domino_head(config)
        # What the latest generate() call with this drafter did (a result, not an option); see DominoGenerationStats.
        self.last_generation_stats = None
        # Token ids of the draft vocabulary (FR-Spec), or None for the whole vocabulary; saved in its own file.
        self.register_buffer("draft_vocab", None, persistent=False)
        self.datastore = None  # a copied_drafts_domino.DraftDatastore: drafts by retrieval, where the drafter has one
        self.post_init()
        # Every way of getting a drafter (this package, remote code, a subclass) builds it here, so this is the one
        # place that installs the generate() hook; the import is local because the hook's module imports this one.
        from .generate_hook_domino import install_assisted_generation_hook

        install_assisted_generation_hook()

    @contextlib.contextmanager
    def domino_head(self, enabled: bool | None) -> Iterator[DominoForSpeculation]:
        """Default for `generate(..., domino_head=...)` inside this block (off = DFlash drafting, same weights).

        The default lives in a context variable, not on the model: an explicit `domino_head=` still wins, and other
        threads and calls outside the block are unaffected. None restores the package default (the head when the
        drafter has one) inside the block.
        """
        # Checked here rather than at generate(), so that a typo fails on the `with` line that holds it.
        if enabled is not None and not isinstance(enabled, bool):
            raise ValueError(
                f"drafter.domino_head(enabled) takes True (Domino head), False (DFlash drafting) or None (the "
                f"default), got {enabled!r}: write `with drafter.domino_head(False):`."
            )
        if enabled and not self.config.has_domino_head:
            raise ValueError("This drafter has no Domino head (projector_type is not 'domino'); it drafts as DFlash.")
        token = DOMINO_HEAD_DEFAULT.set(enabled)
        try:
            yield self
        finally:
            DOMINO_HEAD_DEFAULT.reset(token)

    # ----------------------------------------------------------------------------------------------------- backbone
    def project_context(self, context_features: torch.Tensor) -> torch.Tensor:
        """Concatenated target features `[b, n, len(layers) * hidden]` -> drafter-width context `[b, n, hidden]`."""
        return self.hidden_norm(self.fc(context_features.to(self.fc.weight.dtype)))

    def forward(
        self,
        block_embeds: torch.Tensor,
        context_features: torch.Tensor,
        position_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: DynamicCache | None = None,
        num_outputs: int | None = None,
        key_positions: torch.LongTensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """The parallel backbone: returns the normalized hidden states of the block, `[b, block_len, hidden]`.

        Args:
            block_embeds: target embeddings of the block tokens `[b, q, hidden]`.
            context_features: target hidden states of the context tokens not yet in `past_key_values`,
                concatenated over `target_layer_ids`, `[b, c, len(target_layer_ids) * hidden]`.
            position_ids: positions of `[context ; block]`, `[b, c + q]`.
            attention_mask: optional additive mask `[b, 1, q, cached + c + q]`; `None` lets every block position see
                all the context and the whole block (inference).
            past_key_values: the drafter's context cache. It only ever holds context: the block's own keys/values
                are dropped after the forward, so the caller never crops.
            num_outputs: return the block's first `num_outputs` positions only (see `outputs_for_drafts`). The last
                layer then computes those positions alone; every position still serves as keys/values, so they are
                the same outputs, at a fraction of the last layer's cost when few drafts are wanted.
            key_positions: positions of every key, `[cached ; context ; block]`, `[b, kv]`, read by sliding-window
                layers only (`layer_types`), whose queries see the keys within `sliding_window` positions. None:
                `position_ids` without a cache, else the cache holds positions `0 .. cached - 1` (one sequence's
                context cache).
        """
        hidden_states = block_embeds.to(self.fc.weight.dtype)
        block_len = hidden_states.shape[1]
        context = self.project_context(context_features)
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        masks = {"full_attention": attention_mask, "sliding_attention": attention_mask}
        if "sliding_attention" in self.config.layer_types:
            window = self.config.sliding_window
            if key_positions is None and past_key_values is None:
                key_positions = position_ids  # every key is in this forward (training)
            elif key_positions is None:
                # The cache holds positions 0 .. cached - 1, so some key is outside some query's window only once
                # there are more keys than the window (known on the host: no device sync at every draft).
                keys = past_key_values.get_seq_length() + position_ids.shape[1]
                if keys > window:
                    key_positions = torch.arange(keys, device=position_ids.device).expand(position_ids.shape[0], -1)
            if key_positions is not None:
                masks["sliding_attention"] = sliding_window_mask(
                    attention_mask, position_ids[:, -block_len:], key_positions, window, hidden_states.dtype
                )
        last = len(self.layers) - 1
        for index, layer in enumerate(self.layers):
            hidden_states = layer(
                hidden_states,
                context,
                position_embeddings,
                attention_mask=masks[layer.attention_type],
                past_key_values=past_key_values,
                num_queries=num_outputs if index == last else None,
                **kwargs,
            )
        if past_key_values is not None:
            past_key_values.crop(-block_len)
        return self.norm(hidden_states)

    def draft_hidden_states(self, block_hidden: torch.Tensor) -> torch.Tensor:
        """Backbone outputs of the draft positions, in draft order: `config.num_drafts` of them for a whole block,
        the first ones for a forward with `num_outputs`."""
        return block_hidden[:, self.config.block_size - self.config.num_drafts :]

    def outputs_for_drafts(self, num_drafts: int) -> int:
        """The block positions whose outputs draft the first `num_drafts` tokens (DFlash skips the anchor's)."""
        return self.config.block_size - self.config.num_drafts + num_drafts

    # -------------------------------------------------------------------------------------------------- Domino head
    def gru_step(self, token_embeds: torch.Tensor, state: torch.Tensor | None) -> torch.Tensor:
        """Feeds realised tokens `[b, n, hidden]` to the GRU; returns the new state `[1, b, gru_hidden_dim]`."""
        _, state = self.prefix_gru(token_embeds.to(self.prefix_gru.weight_ih_l0.dtype), state)
        return state

    def logit_correction(
        self, draft_hidden: torch.Tensor, state: torch.Tensor, vocab: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`embed_proj([z ; s])` for one draft position: `[b, 1, hidden]`, `[1, b, G]` -> `[b, 1, vocab]`.

        With `vocab` (token ids of a draft vocabulary) only those logits are computed: `[b, 1, len(vocab)]`.
        """
        features = torch.cat([draft_hidden, state.transpose(0, 1).to(draft_hidden.dtype)], dim=-1)
        if vocab is None:
            return self.embed_proj(features)
        rank = self.embed_proj[1](self.embed_proj[0](features))
        rows_linear = getattr(self.embed_proj[2], "rows_linear", None)
        if rows_linear is not None:
            return rows_linear(rank, vocab)
        return nn.functional.linear(rank, vocab_rows(self.embed_proj[2].weight, vocab))

    # ------------------------------------------------------------------------------------------------- convenience
    def embed_block(self, target: TargetModules, anchor_ids: torch.LongTensor) -> torch.Tensor:
        """Target embeddings of the blocks `[anchor, MASK, ..., MASK]`, one per row, for anchors `anchor_ids[:, -1]`."""
        block_ids = torch.full(
            (anchor_ids.shape[0], self.config.block_size),
            self.config.mask_token_id,
            dtype=torch.long,
            device=anchor_ids.device,
        )
        block_ids[:, 0] = anchor_ids[:, -1]
        return target.embed(block_ids, self.dtype, self.device)

    # ------------------------------------------------------------------------------------------------ generate() glue
    def build_candidate_generator(self, target: PreTrainedModel, **kwargs):
        """Called by the generate() hook when this drafter is the `assistant_model`."""
        from .generation_domino import DominoCandidateGenerator

        return DominoCandidateGenerator(drafter=self, target=target, **kwargs)

    # --------------------------------------------------------------------------------------------- loading & saving
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, allow_pickle: bool = False, **kwargs):
        """Loads a drafter in the published Domino/DFlash format or our own, strictly.

        Every tensor must be present with its expected shape and no unexpected tensor may be left: anything else
        raises a `ValueError` naming the tensors. Pickle (`.bin`) weights are refused unless `allow_pickle=True`.
        """
        if not allow_pickle and kwargs.get("use_safetensors") is False:
            raise ValueError("use_safetensors=False loads pickle weights; pass allow_pickle=True to opt in.")
        if not allow_pickle:
            kwargs["use_safetensors"] = True
            _refuse_pickle_only_folder(os.path.join(str(pretrained_model_name_or_path), kwargs.get("subfolder") or ""))
        return_loading_info = kwargs.pop("output_loading_info", False)
        # Let mis-shaped tensors through to the loading report so that our error can name them.
        strict_shapes = not kwargs.pop("ignore_mismatched_sizes", False)
        renamed = {f"^{re.escape(theirs)}$": ours for ours, theirs in TRANSFORMERS_DFLASH_NAMES.items()}
        model, info = super().from_pretrained(
            pretrained_model_name_or_path,
            *model_args,
            output_loading_info=True,
            ignore_mismatched_sizes=True,
            key_mapping={**renamed, **(kwargs.pop("key_mapping", None) or {})},
            **kwargs,
        )
        # Whatever layout it was read from, a drafter saves in the published one, not back in the folder's.
        model._weight_conversions = None
        if not strict_shapes:
            info = {**info, "mismatched_keys": []}
        _raise_on_loading_problems(info, pretrained_model_name_or_path)
        from .copied_drafts_domino import DATASTORE_FILE, DraftDatastore, read_named_tensor

        hub = {
            key: kwargs[key] for key in _HUB_OPTIONS if key in kwargs
        }  # the vocabulary and datastore sit by the weights
        vocab_file = cached_file(
            pretrained_model_name_or_path, DRAFT_VOCAB_FILE, _raise_exceptions_for_missing_entries=False, **hub
        )
        if vocab_file is not None:
            model.set_draft_vocab(read_named_tensor(vocab_file, "draft_vocab", "the draft vocabulary's token ids"))
        datastore_file = cached_file(
            pretrained_model_name_or_path, DATASTORE_FILE, _raise_exceptions_for_missing_entries=False, **hub
        )
        if datastore_file is not None:  # indexed now, so that no generate() call pays for it (0.6 s on 2 CPU cores)
            model.datastore = DraftDatastore.load(datastore_file).build_index()
        return (model, info) if return_loading_info else model

    def save_pretrained(self, save_directory, *args, push_to_hub: bool = False, **kwargs) -> None:
        """`PreTrainedModel.save_pretrained`, plus the draft vocabulary and the datastore (if any) in files of their own.

        The vocabulary stays out of model.safetensors and config.json, so loaders of the published format, which
        would reject an unknown tensor, read the folder as if it had none. With `push_to_hub=True` the folder is
        uploaded once those files are written too (`push_to_hub`, which saves it again): transformers' own upload, at
        the end of its save, would leave them out.
        """
        from .copied_drafts_domino import DATASTORE_FILE

        upload = {name: kwargs.pop(name) for name in _UPLOAD_OPTIONS if name in kwargs}
        super().save_pretrained(save_directory, *args, **kwargs)
        vocab_path = os.path.join(save_directory, DRAFT_VOCAB_FILE)
        if self.draft_vocab is not None:
            save_file({"draft_vocab": self.draft_vocab.cpu().contiguous()}, vocab_path)
        elif os.path.exists(vocab_path):
            os.remove(vocab_path)
        datastore_path = os.path.join(save_directory, DATASTORE_FILE)
        if self.datastore is not None:
            self.datastore.save(datastore_path)
        elif os.path.exists(datastore_path):
            os.remove(datastore_path)
        if push_to_hub:
            repo_id = upload.pop("repo_id", None) or os.path.basename(os.path.normpath(str(save_directory)))
            self.push_to_hub(
                repo_id, token=kwargs.get("token"), max_shard_size=kwargs.get("max_shard_size", "50GB"), **upload
            )

    def generate(self, *args: object, **kwargs: object) -> None:
        """A drafter generates nothing alone (transformers' loaders hand it out as a causal LM, whose `generate` a
        user would call): this names what to call instead."""
        raise TypeError(
            "A Domino drafter drafts for its target and generates nothing alone: pass it to the target, "
            "target.generate(..., assistant_model=drafter), or pipeline('text-generation', model=target, "
            "assistant_model=drafter)."
        )

    def set_draft_vocab(self, token_ids: torch.Tensor | None) -> None:
        """Drafts over these token ids only (FR-Spec), or over the whole vocabulary with None.

        The target still verifies every draft, so greedy output is unchanged; when sampling, the draft distribution is
        zero outside the subset and speculative sampling stays exact. See `hf_domino.draft_vocab` to build one.
        """
        if token_ids is None:
            self.draft_vocab = None
            return
        expected = "set_draft_vocab takes token ids (a tensor, list or array of ints) or None"
        if isinstance(token_ids, (str, bytes)):
            raise TypeError(
                f"{expected}, got the string {token_ids!r}. A saved vocabulary loads with its folder "
                "(DominoForSpeculation.from_pretrained), or pass safetensors.torch.load_file(file)['draft_vocab']."
            )
        try:
            token_ids = torch.as_tensor(token_ids)
        except (TypeError, ValueError, RuntimeError) as error:
            raise TypeError(f"{expected}, got {type(token_ids).__name__}: {error}") from error
        # A cast to long would silently truncate floats and turn a boolean mask into ids 0 and 1.
        if token_ids.dtype == torch.bool:
            raise TypeError(f"{expected}, got a boolean mask; pass the ids it selects: mask.nonzero().flatten().")
        if token_ids.is_floating_point() or token_ids.is_complex():
            raise TypeError(f"{expected}, got {token_ids.dtype} values; pass integer ids (e.g. ids.long()).")
        token_ids = token_ids.to(torch.long).flatten()
        vocab_size = self.config.vocab_size
        if token_ids.numel() == 0 or int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab_size:
            raise ValueError(f"A draft vocabulary must be a non-empty set of token ids in [0, {vocab_size}).")
        if torch.unique(token_ids).numel() != token_ids.numel():
            raise ValueError("A draft vocabulary must not repeat a token id.")
        self.draft_vocab = torch.sort(token_ids).values.to(self.device)


# from_pretrained's options that say where a folder's files are, which the draft vocabulary and datastore files follow.
_HUB_OPTIONS = ("cache_dir", "revision", "token", "local_files_only", "subfolder", "force_download", "proxies")
# save_pretrained's options for its upload (`push_to_hub=True`), handed to `push_to_hub`.
_UPLOAD_OPTIONS = ("repo_id", "commit_message", "commit_description", "private", "revision", "create_pr", "tags")


def _refuse_pickle_only_folder(path) -> None:
    if not os.path.isdir(str(path)):
        return
    files = os.listdir(path)
    has_safetensors = any(name.endswith(".safetensors") for name in files)
    has_pickle = any(name.endswith((".bin", ".pt", ".pth", ".pkl")) for name in files)
    if has_pickle and not has_safetensors:
        raise ValueError(
            f"{path} holds only pickle weights, which can run arbitrary code when loaded. Convert them to "
            "safetensors, or pass allow_pickle=True if you trust the source."
        )


def _raise_on_loading_problems(info: dict, path) -> None:
    problems = []
    if info.get("missing_keys"):
        problems.append(f"missing tensors: {sorted(info['missing_keys'])}")
    if info.get("unexpected_keys"):
        problems.append(f"unexpected tensors: {sorted(info['unexpected_keys'])}")
    if info.get("mismatched_keys"):
        shapes = [
            f"{name} (checkpoint {tuple(old)}, expected {tuple(new)})" for name, old, new in info["mismatched_keys"]
        ]
        problems.append(f"mis-shaped tensors: {shapes}")
    if problems:
        raise ValueError(
            f"The checkpoint at {path} does not match its config ({'; '.join(problems)}). Check that config.json "
            "(projector_type, emb_dim, gru_hidden_dim, target_layer_ids, sizes) describes these weights."
        )


# save_pretrained then writes this file (and the files it imports) next to the weights, with `auto_map` in config.json.
DominoForSpeculation.register_for_auto_class("AutoModel")

__all__ = [
    "DominoForSpeculation",
    "DominoPreTrainedModel",
    "TargetModules",
    "check_context_features",
    "context_features",
    "hidden_state_indices",
]

"""An independent, functional re-implementation of Domino drafting from raw checkpoint tensors (method notes §2).

Written with plain torch ops from the published tensor names, without the package's modules or any cache, so that
tests can check the package against the method itself.
"""

from __future__ import annotations

import torch


def reference_config(config) -> dict:
    """The plain numbers the functions below read, taken from a DominoConfig."""
    return dict(
        layers=config.num_hidden_layers,
        heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_parameters["rope_theta"],
        block_size=config.block_size,
        shift_label=config.shift_label,
        mask_token_id=config.mask_token_id,
        pure_draft_prefix_len=config.pure_draft_prefix_len,
        windows=[None] * config.num_hidden_layers,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x: [heads, n, head_dim]; rotate-half RoPE at `positions`."""
    dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    freqs = positions.to(torch.float64)[:, None] * inv_freq[None]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def backbone(tensors: dict, cfg: dict, block_embeds: torch.Tensor, context_features: torch.Tensor, start: int):
    """block_embeds [q, H], context_features [c, F] for positions 0..c-1 (= start); returns normalized [q, H].

    `cfg["windows"][i]`: layer i's sliding window (keys within it of each query, on both sides), or None (all)."""
    eps, heads, kv_heads, head_dim = cfg["rms_norm_eps"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    q_len, c_len = block_embeds.shape[0], context_features.shape[0]
    context = rms_norm(context_features @ tensors["fc.weight"].T, tensors["hidden_norm.weight"], eps)
    block_pos = torch.arange(start, start + q_len)
    all_pos = torch.cat([torch.arange(c_len), block_pos])
    h = block_embeds
    for i in range(cfg["layers"]):
        p = f"layers.{i}."
        x = rms_norm(h, tensors[p + "input_layernorm.weight"], eps)
        kv_in = torch.cat([context, x])
        q = (x @ tensors[p + "self_attn.q_proj.weight"].T).view(q_len, heads, head_dim)
        k = (kv_in @ tensors[p + "self_attn.k_proj.weight"].T).view(-1, kv_heads, head_dim)
        v = (kv_in @ tensors[p + "self_attn.v_proj.weight"].T).view(-1, kv_heads, head_dim)
        q = rms_norm(q, tensors[p + "self_attn.q_norm.weight"], eps).transpose(0, 1)
        k = rms_norm(k, tensors[p + "self_attn.k_norm.weight"], eps).transpose(0, 1)
        q, k = rope(q, block_pos, cfg["rope_theta"]), rope(k, all_pos, cfg["rope_theta"])
        k = k.repeat_interleave(heads // kv_heads, dim=0)
        v = v.transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)
        scores = (q @ k.transpose(1, 2)) / head_dim**0.5
        window = cfg.get("windows", [None] * cfg["layers"])[i]
        if window is not None:
            scores = scores.masked_fill((block_pos[:, None] - all_pos[None, :]).abs() >= window, float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        attn = (weights @ v).transpose(0, 1).reshape(q_len, -1)
        h = h + attn @ tensors[p + "self_attn.o_proj.weight"].T
        x = rms_norm(h, tensors[p + "post_attention_layernorm.weight"], eps)
        gate = torch.nn.functional.silu(x @ tensors[p + "mlp.gate_proj.weight"].T)
        h = h + (gate * (x @ tensors[p + "mlp.up_proj.weight"].T)) @ tensors[p + "mlp.down_proj.weight"].T
    return rms_norm(h, tensors["norm.weight"], eps)


def gru_cell(x: torch.Tensor, h: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor) -> torch.Tensor:
    """Bias-free GRU cell in PyTorch's gate order (r, z, n)."""
    i_r, i_z, i_n = (x @ w_ih.T).chunk(3, dim=-1)
    h_r, h_z, h_n = (h @ w_hh.T).chunk(3, dim=-1)
    r, z = torch.sigmoid(i_r + h_r), torch.sigmoid(i_z + h_z)
    n = torch.tanh(i_n + r * h_n)
    return (1 - z) * n + z * h


def head_correction(tensors: dict, z: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    u = torch.nn.functional.silu(torch.cat([z, s]) @ tensors["embed_proj.0.weight"].T)
    return u @ tensors["embed_proj.2.weight"].T


def draft_greedy(
    tensors: dict,
    cfg: dict,
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    context_features: torch.Tensor,
    anchor: int,
    num_drafts: int | None = None,
    use_head: bool = True,
) -> list[int]:
    """Greedy drafts after `anchor`, whose position is `len(context_features)`."""
    block_size, shift = cfg["block_size"], cfg["shift_label"]
    block_ids = torch.tensor([anchor] + [cfg["mask_token_id"]] * (block_size - 1))
    hidden = backbone(tensors, cfg, embed[block_ids], context_features, start=context_features.shape[0])
    draft_hidden = hidden if shift else hidden[1:]
    num_drafts = draft_hidden.shape[0] if num_drafts is None else num_drafts
    realised = [anchor]
    state = torch.zeros(tensors["prefix_gru.weight_hh_l0"].shape[1], dtype=hidden.dtype) if use_head else None
    gru_read = 0
    for k in range(num_drafts):
        logits = draft_hidden[k] @ lm_head.T
        if use_head and k >= cfg["pure_draft_prefix_len"]:
            for token in realised[gru_read:]:
                state = gru_cell(
                    embed[token], state, tensors["prefix_gru.weight_ih_l0"], tensors["prefix_gru.weight_hh_l0"]
                )
            gru_read = len(realised)
            logits = logits + head_correction(tensors, draft_hidden[k], state)
        realised.append(int(logits.argmax()))
    return realised[1:]

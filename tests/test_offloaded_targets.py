"""Targets dispatched by accelerate with offloaded parts (`from_pretrained(..., device_map=..., offload_folder=...)`,
`accelerate.cpu_offload` / `disk_offload`).

Their offloaded weights wait on the meta device and accelerate's hooks bring them in for each forward; a drafter
borrows the target's embeddings and LM head, so it must run them where the hooks do. The offloaded target's output is
compared with the same weights loaded whole: greedy, sampled, one sequence, a batch, a tree, prepared for the CPU.
"""

from __future__ import annotations

import copy

import accelerate
import pytest
import torch
from conftest import forward_inputs, own_drafts, same_tensors, tiny_drafter, tiny_target
from transformers import AutoModelForCausalLM

import hf_domino

LAYERS = 4
# The LM head and one layer on disk; then the input embeddings too, which makes `target.device` the meta device.
HEAD_OFFLOADED = {"lm_head": "disk", "model.layers.1": "disk"}
EMBEDDINGS_OFFLOADED = {**HEAD_OFFLOADED, "model.embed_tokens": "disk"}


@pytest.fixture(scope="module")
def resident():
    target = tiny_target(vocab_size=128, hidden_size=64, num_layers=LAYERS)
    target.generation_config.pad_token_id = 0
    return target


def offloaded(resident, folder, offloaded_parts: dict[str, str]):
    resident.save_pretrained(folder / "target")
    device_map = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    device_map |= {f"model.layers.{i}": "cpu" for i in range(LAYERS)} | offloaded_parts
    target = AutoModelForCausalLM.from_pretrained(
        folder / "target", device_map=device_map, offload_folder=folder / "offload"
    ).eval()
    target.generation_config.pad_token_id = 0
    assert target.lm_head.weight.device.type == "meta"  # offloaded: what the drafter must not read directly
    return target


def drafter_for(target, draft_vocab: bool):
    drafter = tiny_drafter(target)
    drafter.set_draft_vocab(torch.arange(0, 128, 2) if draft_vocab else None)
    return drafter


PROMPT = torch.tensor([[5, 9, 17, 33, 2, 7, 40]])
BATCH = {
    "input_ids": torch.tensor([[0, 0, 0, 5, 9, 17], [4, 8, 12, 16, 20, 24]]),
    "attention_mask": torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]]),
}


@pytest.mark.parametrize("parts", [HEAD_OFFLOADED, EMBEDDINGS_OFFLOADED], ids=["head", "embeddings"])
@pytest.mark.parametrize("draft_vocab", [False, True], ids=["vocab", "draft_vocab"])
def test_an_offloaded_target_drafts_as_the_target_loaded_whole(resident, tmp_path, parts, draft_vocab):
    target = offloaded(resident, tmp_path, parts)
    drafter = drafter_for(resident, draft_vocab)
    fixed = {"do_sample": False, "assistant_model": drafter, "draft_policy": "fixed"}
    for inputs, extra in [({"input_ids": PROMPT}, {}), ({"input_ids": PROMPT}, {"domino_branches": 2}), (BATCH, {})]:
        expected = resident.generate(**inputs, max_new_tokens=16, do_sample=False)
        with forward_inputs(resident) as resident_verified:
            resident_drafts = resident.generate(**inputs, max_new_tokens=16, **fixed, **extra)
        assert own_drafts(drafter.last_generation_stats) > 0
        with forward_inputs(target) as verified:
            out = target.generate(**inputs, max_new_tokens=16, **fixed, **extra)
        assert torch.equal(out, expected) and torch.equal(resident_drafts, expected)
        # The same drafts: the offloaded embeddings and head gave the drafter what the resident ones do (the drafter's
        # are rejected here, so its acceptance, compared before, could not tell).
        assert same_tensors(verified, resident_verified)


def test_a_chat_continues_the_cache_of_a_target_whose_embeddings_are_offloaded(resident, tmp_path):
    # Its calls run in the batch loop (the target's device is the meta device), one row: the cache is left as the
    # target alone leaves it, and the next turn continues it.
    from transformers import DynamicCache

    from hf_domino.cache_domino import cache_argument

    target = offloaded(resident, tmp_path, EMBEDDINGS_OFFLOADED)
    drafter = drafter_for(resident, draft_vocab=False)
    cache = DynamicCache(config=target.config)
    first = target.generate(
        PROMPT, max_new_tokens=12, do_sample=False, assistant_model=drafter, **cache_argument(cache)
    )
    assert torch.equal(first, resident.generate(PROMPT, max_new_tokens=12, do_sample=False))
    assert cache.get_seq_length() == first.shape[1] - 1
    turn = torch.cat([first, torch.tensor([[11, 12, 13]])], dim=-1)
    second = target.generate(
        turn, max_new_tokens=12, do_sample=False, assistant_model=drafter, **cache_argument(cache)
    )
    assert torch.equal(second, resident.generate(turn, max_new_tokens=12, do_sample=False))


@pytest.mark.parametrize("parts", [HEAD_OFFLOADED, EMBEDDINGS_OFFLOADED], ids=["head", "embeddings"])
def test_an_offloaded_target_samples_as_the_target_loaded_whole(resident, tmp_path, parts):
    target = offloaded(resident, tmp_path, parts)
    drafter = drafter_for(resident, draft_vocab=True)
    for inputs in [{"input_ids": PROMPT}, BATCH]:
        outputs = []
        for model in (resident, target):
            torch.manual_seed(3)
            # a fixed draft length: the adaptive policy's choices follow measured times, and the draws follow them
            kwargs = {"do_sample": True, "assistant_model": drafter, "draft_policy": "fixed"}
            outputs.append(model.generate(**inputs, max_new_tokens=16, **kwargs))
        assert torch.equal(*outputs)  # the same random draws on the same drafts and target logits


def offloaded_whole(resident, folder, how: str):
    """A copy of `resident` offloaded whole by accelerate's own functions: every weight on the meta device, no
    `hf_device_map`."""
    target = copy.deepcopy(resident)
    if how == "cpu_offload":
        accelerate.cpu_offload(target, execution_device="cpu")
    else:
        accelerate.disk_offload(target, folder, execution_device="cpu")
    assert target.device.type == "meta" and not getattr(target, "hf_device_map", None)
    return target


@pytest.mark.parametrize("how", ["device_map", "cpu_offload", "disk_offload"])
def test_prepare_for_cpu_decoding_leaves_an_offloaded_target_s_hooked_layers_to_accelerate(resident, tmp_path, how):
    if how == "device_map":
        target = offloaded(resident, tmp_path, HEAD_OFFLOADED)
    else:
        target = offloaded_whole(resident, tmp_path, how)
    drafter = drafter_for(resident, draft_vocab=True)
    expected = resident.generate(PROMPT, max_new_tokens=16, do_sample=False)
    fixed = {"do_sample": False, "assistant_model": drafter, "draft_policy": "fixed"}
    with forward_inputs(resident) as resident_verified:
        assert torch.equal(resident.generate(PROMPT, max_new_tokens=16, **fixed), expected)
    with forward_inputs(target) as verified:
        assert torch.equal(target.generate(PROMPT, max_new_tokens=16, **fixed), expected)
    assert same_tensors(verified, resident_verified) and own_drafts(drafter.last_generation_stats) > 0
    report = hf_domino.prepare_for_cpu_decoding(target, drafter)
    linears = sum(isinstance(module, torch.nn.Linear) for module in target.modules())
    assert report.hooked["target"] == linears and not report.prepacked["target"] and "target" not in report.skipped
    assert f"{linears} under accelerate's offloading hooks left as they are" in str(report)
    assert report.verify_ms  # the adaptive policy's cost table, measured on the offloaded target
    assert torch.equal(target.generate(PROMPT, max_new_tokens=16, do_sample=False, assistant_model=drafter), expected)


def test_compiling_an_offloaded_target_is_refused_naming_the_fix(resident, tmp_path):
    # generate() would decline to compile it with a warning, after prepare_for_cpu_decoding had said it compiles
    target = offloaded(resident, tmp_path, HEAD_OFFLOADED)
    with pytest.raises(ValueError, match=r"does not compile a target with offloaded weights.*drop compile=True"):
        hf_domino.prepare_for_cpu_decoding(target, drafter_for(resident, draft_vocab=False), compile=True)
    assert target.generation_config.cache_implementation is None  # refused before changing anything

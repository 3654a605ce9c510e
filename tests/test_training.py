"""Tests of the Domino training recipe (`hf_domino.training`) on a tiny Qwen3 target, on CPU."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from conftest import free_port
from conftest import tiny_target as conftest_tiny_target
from safetensors.torch import save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from hf_domino import DominoConfig, DominoForSpeculation, TargetModules
from hf_domino.drafting_domino import BlockDraft, DrafterContext, eager_rollout, run_backbone
from hf_domino.training import (
    DominoTrainingModule,
    Example,
    FeatureCache,
    TrainConfig,
    block_attention_mask,
    build_block_inputs,
    collate,
    curriculum_lambda,
    domino_losses,
    draft_logits,
    generate_chain,
    init_from_target_layers,
    loop,
    position_weights,
    read_log,
    sample_anchors,
    sample_chain_anchors,
    target_context_features,
    target_hidden_states,
    target_next_token_probs,
    train,
)
from hf_domino.training.loop import example_indices
from hf_domino.training.run_folder import check_resumable

VOCAB = 64
BLOCK = 4


def tiny_target() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        tie_word_embeddings=True,
        initializer_range=0.3,  # logits through the frozen tied head need some scale to be learnable quickly
    )
    return Qwen3ForCausalLM(config).eval()


def tiny_drafter(target: Qwen3ForCausalLM, seed: int = 0, **backbone) -> DominoForSpeculation:
    backbone = {"num_hidden_layers": 1, **backbone}
    config = DominoConfig.from_target(
        target.config, block_size=BLOCK, emb_dim=8, gru_hidden_dim=16, target_layer_ids=[1, 2], **backbone
    )
    torch.manual_seed(seed)
    return DominoForSpeculation(config)


def toy_examples(count: int = 8, prompt_len: int = 5, response_len: int = 20) -> list[Example]:
    """Responses count up from the last prompt token (mod the vocabulary): learnable in a few steps."""
    generator = torch.Generator().manual_seed(0)
    examples = []
    for _ in range(count):
        prompt = torch.randint(3, VOCAB, (prompt_len,), generator=generator).tolist()
        response = [3 + (prompt[-1] + j) % (VOCAB - 3) for j in range(1, response_len + 1)]
        examples.append(Example(prompt + response, [0] * prompt_len + [1] * response_len))
    return examples


@pytest.fixture(scope="module")
def target() -> Qwen3ForCausalLM:
    return tiny_target()


@pytest.fixture(scope="module")
def trained_run(target, tmp_path_factory):
    """One short curriculum run shared by the tests that need a trained drafter."""
    output_dir = tmp_path_factory.mktemp("run")
    config = TrainConfig(total_steps=30, batch_size=2, num_anchors=4, learning_rate=1e-2, log_every=5, save_every=30)
    drafter = train(tiny_drafter(target), target, toy_examples(), config, output_dir)
    return drafter, output_dir


def batch_and_features(target, examples):
    batch = collate(examples, pad_token_id=0)
    features = target_context_features(target, batch.input_ids, batch.attention_mask, [1, 2])
    return batch, features


# ------------------------------------------------------------------------------------------------- pure functions
def test_curriculum_lambda_is_linear_from_one_to_zero():
    assert curriculum_lambda(0, 11) == 1.0
    assert curriculum_lambda(5, 11) == pytest.approx(0.5)
    assert curriculum_lambda(10, 11) == 0.0
    assert [curriculum_lambda(s, 11, enabled=False) for s in (0, 5, 10)] == [0.0, 0.0, 0.0]


def test_position_weights():
    weights = position_weights(16, 16)
    expected = torch.tensor([math.exp(-k / 16) for k in range(16)])
    torch.testing.assert_close(weights, expected)
    assert weights[0] == 1.0


def test_sample_anchors_stay_inside_responses():
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0], [0, 1, 1, 0, 0, 0, 0, 0]])
    anchors, valid = sample_anchors(loss_mask, 3, torch.Generator().manual_seed(0))
    assert anchors.shape == (2, 3)
    assert sorted(anchors[0].tolist()) == [2, 3, 4]  # position 5 has no response token after it
    assert valid[0].all()
    assert valid[1].tolist() == [True, False, False] and anchors[1, 0] == 1


def test_generate_chain_follows_each_block_to_the_next_anchor():
    # A block at p adds acceptance[p] tokens; 0 marks positions where no block can start (prompt, the last token).
    acceptance = [0, 0, 1, 3, 2, 1, 1, 2, 1, 1, 0]
    assert generate_chain(acceptance, first=2) == [(2, 1), (3, 3), (6, 1), (7, 2)]  # the block at 9 is cut off
    assert generate_chain(acceptance, first=4) == [(4, 2), (6, 1), (7, 2)]
    assert generate_chain([0, 1, 0], first=1) == []


def test_sample_chain_anchors_draws_distinct_chain_anchors_in_order():
    chains = [[(2, 1), (3, 3), (6, 1), (7, 2)], [(4, 2)], []]
    anchors, valid = sample_chain_anchors(chains, 3, torch.Generator().manual_seed(0))
    assert valid.tolist() == [[True] * 3, [True, False, False], [False] * 3]
    picked = anchors[0].tolist()
    assert picked == sorted(picked) and len(set(picked)) == 3 and set(picked) <= {2, 3, 6, 7}
    assert anchors[1].tolist() == [4, 0, 0] and anchors[2].tolist() == [0, 0, 0]
    again, _ = sample_chain_anchors(chains, 3, torch.Generator().manual_seed(0))
    assert torch.equal(anchors, again)
    assert sorted(sample_chain_anchors(chains, 8)[0][0, :4].tolist()) == [2, 3, 6, 7]


def test_build_block_inputs_labels_and_gru_inputs():
    input_ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16]])
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1]])
    anchors, valid = torch.tensor([[2, 5]]), torch.tensor([[True, True]])
    blocks = build_block_inputs(input_ids, loss_mask, anchors, valid, block_size=4, num_drafts=4, mask_token_id=0)
    assert blocks.block_ids.tolist() == [[[12, 0, 0, 0], [15, 0, 0, 0]]]
    assert blocks.position_ids.tolist() == [[[2, 3, 4, 5], [5, 6, 7, 8]]]
    assert blocks.labels[0, 0].tolist() == [13, 14, 15, 16]
    assert blocks.label_mask.tolist() == [[[True] * 4, [True, False, False, False]]]  # past the end: masked
    assert blocks.gru_ids[0, 0].tolist() == [12, 13, 14, 15]  # anchor, then the ground truth y_0 .. y_{D-2}


def test_block_attention_mask_structure():
    anchors = torch.tensor([[2, 4]])
    context_mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    allowed = block_attention_mask(anchors, context_mask, block_size=2)[0, 0] == 0
    assert allowed.shape == (4, 6 + 4)
    assert allowed[0, :6].tolist() == [True, True, False, False, False, False]  # strictly before anchor 2
    assert allowed[2, :6].tolist() == [True, True, True, True, False, False]
    assert allowed[:, 6:].tolist() == [[True, True, False, False]] * 2 + [[False, False, True, True]] * 2


# ------------------------------------------------------------------------------------------------- information flow
def block_losses_and_grads(drafter, target, batch, features, anchors):
    """Per-draft base/final logits of every block, plus the gradient of their sum, for one fixed set of blocks."""
    valid = torch.ones_like(anchors, dtype=torch.bool)
    config = drafter.config
    blocks = build_block_inputs(
        batch.input_ids,
        batch.loss_mask,
        anchors,
        valid,
        block_size=config.block_size,
        num_drafts=config.num_drafts,
        mask_token_id=config.mask_token_id,
    )
    drafter.zero_grad()
    base, final = draft_logits(
        drafter, TargetModules.from_target(target), features, batch.attention_mask, blocks, anchors
    )
    return base, final, blocks


def test_block_never_sees_context_at_or_after_its_anchor(target):
    drafter = tiny_drafter(target)
    batch, features = batch_and_features(target, toy_examples(1))
    anchors = torch.tensor([[9]])
    base, final, _ = block_losses_and_grads(drafter, target, batch, features, anchors)
    final.sum().backward()
    grads = {name: p.grad.clone() for name, p in drafter.named_parameters()}

    perturbed = features.clone()
    perturbed[:, 9:] += 5.0 * torch.randn_like(perturbed[:, 9:])
    base2, final2, _ = block_losses_and_grads(drafter, target, batch, perturbed, anchors)
    final2.sum().backward()
    torch.testing.assert_close(base2, base, rtol=0, atol=0)
    torch.testing.assert_close(final2, final, rtol=0, atol=0)
    for name, p in drafter.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=0, atol=0, msg=name)

    earlier = features.clone()
    earlier[:, 8] += 5.0
    base3, _, _ = block_losses_and_grads(drafter, target, batch, earlier, anchors)
    assert not torch.allclose(base3, base)


def test_blocks_of_one_sequence_are_isolated(target):
    drafter = tiny_drafter(target)
    batch, features = batch_and_features(target, toy_examples(1))
    anchors = torch.tensor([[6, 12]])
    base, _, _ = block_losses_and_grads(drafter, target, batch, features, anchors)
    perturbed = features.clone()
    perturbed[:, 6:] += 5.0
    base2, _, _ = block_losses_and_grads(drafter, target, batch, perturbed, anchors)
    torch.testing.assert_close(base2[0], base[0], rtol=0, atol=0)  # block at 6 sees none of it
    assert not torch.allclose(base2[1], base[1])  # block at 12 sees positions 6..11
    # Block 1's anchor token is not visible to block 0 either.
    changed = batch.input_ids.clone()
    changed[0, 12] = 3 if changed[0, 12] != 3 else 4
    batch.input_ids = changed
    base3, _, _ = block_losses_and_grads(drafter, target, batch, features, anchors)
    torch.testing.assert_close(base3[0], base[0], rtol=0, atol=0)


def test_sliding_window_layers_train_on_what_they_draft_from(target):
    """A drafter with sliding-window layers (the DFlash drafters published for Qwen3.5/3.6 targets) sees in training
    exactly the context it sees when drafting: the keys within its window of each block position."""
    drafter = tiny_drafter(
        target, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=4
    )
    batch, features = batch_and_features(target, toy_examples(1))
    anchors = torch.tensor([[9, 16]])
    base, _, _ = block_losses_and_grads(drafter, target, batch, features, anchors)
    modules = TargetModules.from_target(target)
    for block, anchor in enumerate(anchors[0].tolist()):
        context = DrafterContext()
        context.append(features[:, :anchor])
        with torch.no_grad():
            hidden = run_backbone(drafter, modules, batch.input_ids[:, anchor : anchor + 1], context, BLOCK)
        torch.testing.assert_close(modules.logits(hidden)[0], base[block].detach(), rtol=1e-4, atol=1e-4)
    # The window is real: context outside every block position's window changes nothing of the sliding layer's
    # queries, and all of it reaches the full-attention layer.
    with_full = tiny_drafter(target, num_hidden_layers=2)
    with_full.load_state_dict(drafter.state_dict())
    full, _, _ = block_losses_and_grads(with_full, target, batch, features, anchors)
    assert not torch.allclose(full[1], base[1])


def test_gru_reads_ground_truth_tokens(target):
    drafter = tiny_drafter(target)
    torch.nn.init.normal_(drafter.embed_proj[2].weight, std=0.5)  # make the correction visible
    batch, features = batch_and_features(target, toy_examples(1))
    anchors = torch.tensor([[7]])
    base, final, blocks = block_losses_and_grads(drafter, target, batch, features, anchors)

    # Same numbers as the inference rollout when it is forced to pick the ground-truth tokens.
    labels = blocks.labels[0, 0]
    forced = iter(labels.tolist())

    def pick(logits, realised):
        return torch.tensor([[next(forced)]]), logits

    config = drafter.config
    with torch.no_grad():
        block_ids = blocks.block_ids.view(1, -1)
        position_ids = torch.cat([torch.arange(7)[None], blocks.position_ids.view(1, -1)], dim=1)
        modules = TargetModules.from_target(target)
        hidden = drafter(modules.embed(block_ids, drafter.dtype, drafter.device), features[:, :7], position_ids)
        draft_hidden = drafter.draft_hidden_states(hidden)
        block = BlockDraft(draft_hidden, modules.logits(draft_hidden))
        rollout_logits = eager_rollout(drafter, modules, pick)(block, batch.input_ids[:, :8]).logits
    torch.testing.assert_close(rollout_logits[0], final[0].detach(), rtol=1e-4, atol=1e-4)
    assert config.pure_draft_prefix_len == 1
    torch.testing.assert_close(final[0, 0], base[0, 0])  # the first draft is base-only

    # Changing the ground truth y_1 (token at anchor + 2) changes the final logits of drafts 2.. only.
    changed = batch.input_ids.clone()
    changed[0, 9] = 3 if changed[0, 9] != 3 else 4
    batch.input_ids = changed
    base2, final2, _ = block_losses_and_grads(drafter, target, batch, features, anchors)
    torch.testing.assert_close(base2, base, rtol=0, atol=0)
    torch.testing.assert_close(final2[0, :2], final[0, :2], rtol=0, atol=0)
    assert not torch.allclose(final2[0, 2], final[0, 2])
    assert not torch.allclose(final2[0, 3], final[0, 3])


# ---------------------------------------------------------------------------------------------------------- training
def fixed_batch_losses(drafter, target, vocab=None):
    batch, features = batch_and_features(target, toy_examples(8))
    anchors, valid = sample_anchors(batch.loss_mask, 4, torch.Generator().manual_seed(123))
    module = DominoTrainingModule(drafter, TargetModules.from_target(target), vocab)
    with torch.no_grad():
        out = module(batch.input_ids, batch.loss_mask, batch.attention_mask, features, anchors, valid, 0.5)
    return out.base_loss.item(), out.final_loss.item()


def test_training_reduces_both_losses(target, trained_run):
    drafter, output_dir = trained_run
    base_before, final_before = fixed_batch_losses(tiny_drafter(target), target)
    base_after, final_after = fixed_batch_losses(drafter, target)
    assert base_after < 0.8 * base_before
    assert final_after < 0.8 * final_before
    records = [json.loads(line) for line in (output_dir / "log.jsonl").read_text().splitlines()]
    assert records[0]["lam"] == pytest.approx(1 - 4 / 29) and records[-1]["lam"] == 0.0
    assert len(records[-1]["final_acc"]) == BLOCK and records[-1]["base_loss"] < records[0]["base_loss"]


def test_each_step_weighs_the_base_loss_by_the_curriculum(target, tmp_path, monkeypatch):
    # The logged lam was checked, not the one the loss got: a loop that passed lam=0 to every step passed.
    seen = []
    forward = DominoTrainingModule.forward

    def recording(self, *args, lam, **kwargs):
        seen.append(lam)
        return forward(self, *args, lam=lam, **kwargs)

    monkeypatch.setattr(DominoTrainingModule, "forward", recording)
    config = TrainConfig(total_steps=3, batch_size=2, num_anchors=3, learning_rate=1e-2, save_every=100)
    train(tiny_drafter(target), target, toy_examples(), config, tmp_path / "curriculum")
    assert seen == [1.0, 0.5, 0.0]
    seen.clear()
    train(tiny_drafter(target), target, toy_examples(), TrainConfig(**{**config.__dict__, "curriculum": False}),
          tmp_path / "plain")  # fmt: skip
    assert seen == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("draft_vocab", [False, True])
def test_resume_continues_bit_for_bit(target, tmp_path, draft_vocab):
    """A stage stopped after every step ends where one straight run ends. With a draft vocabulary (its file sits
    beside the weights in each checkpoint) and validation at every stop, as the CPU stages of docs/training.md run."""

    def drafter(seed: int = 0) -> DominoForSpeculation:
        model = tiny_drafter(target, seed=seed)
        if draft_vocab:
            model.set_draft_vocab(DRAFT_VOCAB)
        return model

    config = TrainConfig(
        total_steps=4, batch_size=2, num_anchors=3, learning_rate=1e-2, save_every=100, draft_vocab=draft_vocab
    )
    examples = toy_examples(10)
    examples, held_out = examples[:8], (examples[8:] if draft_vocab else ())
    straight = train(drafter(), target, examples, config, tmp_path / "straight", validation_examples=held_out)

    staged_config = TrainConfig(**{**config.__dict__, "stop_after_seconds": 0.0})  # stop after every step
    for stage in range(4):
        # Later stages start from another init: the checkpoint must overwrite it.
        staged = train(
            drafter(seed=stage), target, examples, staged_config, tmp_path / "staged", validation_examples=held_out
        )
    if draft_vocab:  # a validation record at every stop, each where the straight run would have scored
        assert [record["step"] for record in read_log(tmp_path / "staged" / "validation.jsonl")] == [1, 2, 3, 4]
    assert sorted(p.name for p in (tmp_path / "staged").glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]
    for (name, a), (_, b) in zip(straight.state_dict().items(), staged.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_a_staged_run_with_accumulation_logs_and_ends_as_a_straight_one(target, tmp_path):
    """Two micro steps a step, a record every third step, a stage stopped after every step: each record averages
    the same steps as the straight run's (a resumed run's first record held only the steps after its checkpoint)."""
    config = TrainConfig(total_steps=6, batch_size=1, gradient_accumulation_steps=2, num_anchors=3,
                         learning_rate=1e-2, log_every=3, save_every=100)  # fmt: skip
    examples = toy_examples(8)
    straight = train(tiny_drafter(target), target, examples, config, tmp_path / "straight")
    for _ in range(6):
        staged = train(tiny_drafter(target), target, examples, dataclasses.replace(config, stop_after_seconds=0.0),
                       tmp_path / "staged")  # fmt: skip
    for (name, a), (_, b) in zip(straight.state_dict().items(), staged.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    logs = [[{k: v for k, v in record.items() if k != "elapsed_s"} for record in read_log(run / "log.jsonl")]
            for run in (tmp_path / "straight", tmp_path / "staged")]  # fmt: skip
    assert [record["step"] for record in logs[0]] == [3, 6] and logs[0] == logs[1]


def test_a_step_with_micro_steps_takes_the_gradient_one_batch_of_them_all_would(target, tmp_path, monkeypatch):
    # Nothing ran gradient accumulation: every micro step reading the same examples, or gradients summed rather
    # than averaged, passed the whole suite; and a mean per micro step weighed a micro step of few labels (a short
    # answer's) as much as one of many, unlike one batch of both.
    config = TrainConfig(total_steps=1, batch_size=1, gradient_accumulation_steps=2, num_anchors=3,
                         learning_rate=1e-2, max_grad_norm=1e9, curriculum=False)  # fmt: skip
    examples = toy_examples(8, response_len=20)
    examples[:4] = [Example(e.input_ids[:9], e.loss_mask[:9]) for e in examples[:4]]  # short answers beside long
    drafter = tiny_drafter(target)
    initial = copy.deepcopy(drafter)
    forwards, gradients = [], []
    original_forward = DominoTrainingModule.forward

    def forward(self, *args, **kwargs):
        forwards.append(kwargs)
        return original_forward(self, *args, **kwargs)

    def step(self, *args, **kwargs):
        gradients.append({name: p.grad.clone() for name, p in drafter.named_parameters() if p.grad is not None})

    monkeypatch.setattr(DominoTrainingModule, "forward", forward)
    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    train(drafter, target, examples, config, tmp_path)
    monkeypatch.undo()
    assert len(forwards) == 2 and len(gradients) == 1
    for micro_step, inputs in enumerate(forwards):
        [index] = example_indices(0, micro_step, 0, config=config, world_size=1, num_examples=len(examples))
        assert inputs["input_ids"][0].tolist() == examples[index].input_ids
    lengths = [inputs["input_ids"].shape[1] for inputs in forwards]
    assert lengths[0] != lengths[1], "one short and one long answer make the weighting show"

    # The two micro steps as one batch (right-padded to one length), with the same anchors.
    def padded(tensor: torch.Tensor, length: int) -> torch.Tensor:  # along the sequence, which dimension 1 is
        if tensor.dim() < 2 or tensor.shape[1] != length:  # anchors
            return tensor
        return F.pad(tensor, (0, 0) * (tensor.dim() - 2) + (0, max(lengths) - length))

    batch = {key: torch.cat([padded(inputs[key], length) for inputs, length in zip(forwards, lengths)])
             if torch.is_tensor(forwards[0][key]) else forwards[0][key] for key in forwards[0]}  # fmt: skip
    module = DominoTrainingModule(initial, TargetModules.from_target(target)).train()
    module(**batch).loss.backward()
    for name, parameter in initial.named_parameters():
        if parameter.grad is not None:
            torch.testing.assert_close(gradients[0][name], parameter.grad, msg=name)


def test_example_indices_read_each_example_once_an_epoch():
    config = TrainConfig(batch_size=3, gradient_accumulation_steps=2)
    read = [i for step in range(5) for micro in range(2) for rank in range(2)
            for i in example_indices(step, micro, rank, config=config, world_size=2, num_examples=60)]  # fmt: skip
    assert sorted(read) == list(range(60))


# ------------------------------------------------------------------------------------------------ run folders
def test_resuming_on_other_data_processes_or_precision_is_refused(target, tmp_path):
    # Other --data, --max-examples or --validation-examples resumed silently (held-out examples then trained on).
    config = TrainConfig(total_steps=3, batch_size=2, num_anchors=3, learning_rate=1e-2, save_every=2)
    examples = toy_examples(10)
    train(tiny_drafter(target), target, examples[:8], config, tmp_path, validation_examples=examples[8:])
    shutil.rmtree(tmp_path / "checkpoint-3")
    with pytest.raises(ValueError, match=r"but its examples were others \(--data, --max-examples"):
        train(tiny_drafter(target), target, examples[:7], config, tmp_path, validation_examples=examples[8:])
    with pytest.raises(ValueError, match=r"but its validation examples were others"):
        train(tiny_drafter(target), target, examples[:8], config, tmp_path, validation_examples=examples[7:])
    checkpoint = tmp_path / "checkpoint-2"
    with pytest.raises(ValueError, match="it ran on 1 processes, now 2"):
        check_resumable(checkpoint, tiny_drafter(target), config, 2)
    with pytest.raises(ValueError, match="its mixed precision was 'no', now 'bf16'"):
        check_resumable(checkpoint, tiny_drafter(target), config, 1, mixed_precision="bf16")
    (checkpoint / "trainer_state.pt").touch()  # what an older hf-domino wrote
    with pytest.raises(ValueError, match="was written by an older hf-domino"):
        check_resumable(checkpoint, tiny_drafter(target), config, 1)


def test_a_validation_cut_short_is_made_when_the_run_resumes(target, tmp_path, monkeypatch):
    config = TrainConfig(total_steps=4, batch_size=2, num_anchors=3, learning_rate=1e-2, save_every=2)
    examples = toy_examples(10)
    straight = tmp_path / "straight"
    train(tiny_drafter(target), target, examples[:8], config, straight, validation_examples=examples[8:])
    real_window = loop.held_out_window

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "held_out_window", interrupted)
    with pytest.raises(KeyboardInterrupt):  # checkpoint-2 written, its validation never logged
        train(tiny_drafter(target), target, examples[:8], config, tmp_path / "cut", validation_examples=examples[8:])
    monkeypatch.setattr(loop, "held_out_window", real_window)
    train(tiny_drafter(target), target, examples[:8], config, tmp_path / "cut", validation_examples=examples[8:])
    records = [[{k: v for k, v in record.items() if k != "elapsed_s"} for record in read_log(run / "validation.jsonl")]
               for run in (straight, tmp_path / "cut")]  # fmt: skip
    assert [record["step"] for record in records[1]] == [2, 4] and records[0] == records[1]


def test_an_accelerator_holding_another_run_is_refused(target, tmp_path):
    # Its checkpoints held both runs' optimizers and schedules, and a fresh process could not resume them.
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    config = TrainConfig(total_steps=1, batch_size=2, num_anchors=3, save_every=100)
    train(tiny_drafter(target), target, toy_examples(8), config, tmp_path / "a", accelerator=accelerator)
    with pytest.raises(ValueError, match=r"pass a fresh Accelerator to each train\(\) call"):
        train(tiny_drafter(target), target, toy_examples(8), config, tmp_path / "b", accelerator=accelerator)
    assert not (tmp_path / "b").exists()


def test_a_resumed_run_logs_each_step_once(target, tmp_path):
    """A run that crashed after logging steps past its last checkpoint logged them again once resumed."""
    config = TrainConfig(total_steps=4, batch_size=2, num_anchors=3, learning_rate=1e-2, log_every=1, save_every=2)
    examples = toy_examples(8)
    train(tiny_drafter(target), target, examples, config, tmp_path, validation_examples=examples[6:])
    shutil.rmtree(tmp_path / "checkpoint-4")  # the crash: steps 3 and 4 logged, checkpoint-4 never written
    with open(tmp_path / "log.jsonl", "a") as log:
        log.write('{"step": 5, "cut sh')  # and a line cut short
    train(tiny_drafter(target), target, examples, config, tmp_path, validation_examples=examples[6:])
    assert [record["step"] for record in read_log(tmp_path / "log.jsonl")] == [1, 2, 3, 4]
    assert [record["step"] for record in read_log(tmp_path / "validation.jsonl")] == [2, 4]


def test_resuming_with_other_settings_or_another_drafter_is_refused(target, tmp_path):
    """Resuming continued a run with whatever settings were given now; another architecture was a raw traceback."""
    config = TrainConfig(total_steps=3, batch_size=2, num_anchors=3, learning_rate=1e-2, save_every=2)
    examples = toy_examples(8)
    train(tiny_drafter(target), target, examples, config, tmp_path, resume=False)
    (tmp_path / "checkpoint-3").rename(tmp_path / "straight")  # as if the run had stopped at step 2
    with pytest.raises(ValueError, match=r"but total_steps was 3, now 4; learning_rate was 0.01, now 0.02\. Rerun"):
        train(tiny_drafter(target), target, examples, dataclasses.replace(config, learning_rate=2e-2, total_steps=4),
              tmp_path)  # fmt: skip
    with pytest.raises(ValueError, match=r"the drafter's intermediate_size was 64, now 48"):
        train(tiny_drafter(target, intermediate_size=48), target, examples, config, tmp_path)
    other_vocab = tiny_drafter(target)
    other_vocab.set_draft_vocab(torch.arange(3, 30))
    with pytest.raises(ValueError, match="draft_vocab was False, now True; the drafter's draft vocabulary holds"):
        save_file({"draft_vocab": DRAFT_VOCAB}, tmp_path / "checkpoint-2" / "draft_vocab.safetensors")  # its own
        train(other_vocab, target, examples, dataclasses.replace(config, draft_vocab=True), tmp_path)
    (tmp_path / "checkpoint-2" / "draft_vocab.safetensors").unlink()
    # What is logged and kept may change: the run resumes and ends where it would have.
    resumed = train(tiny_drafter(target), target, examples, dataclasses.replace(config, log_every=1), tmp_path)
    straight = DominoForSpeculation.from_pretrained(tmp_path / "straight")
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_a_new_run_is_refused_where_another_left_checkpoints_until_cleared(target, tmp_path):
    """`resume=False` into a longer run's folder pruned the new run's checkpoints (lower steps sort first) and never
    wrote the last one kept; `clear_run` removes what a run left there, and nothing else."""
    from hf_domino.training import clear_run

    config = TrainConfig(total_steps=4, batch_size=2, num_anchors=3, learning_rate=1e-2, log_every=1, save_every=2)
    train(tiny_drafter(target), target, toy_examples(8), config, tmp_path)
    (tmp_path / "final").mkdir()
    mine = ["checkpoint-2.tar.gz", "checkpoint-best", "notes.txt"]  # the user's, whatever their names
    (tmp_path / "checkpoint-best").mkdir()
    for name in ("notes.txt", "checkpoint-2.tar.gz"):
        (tmp_path / name).write_text("mine")
    short = dataclasses.replace(config, total_steps=2)
    says = "holds what an earlier run left \\(checkpoint-2, checkpoint-4, final, log.jsonl\\)"
    with pytest.raises(ValueError, match=says):
        train(tiny_drafter(target), target, toy_examples(8), short, tmp_path, resume=False)
    for checkpoint in tmp_path.glob("checkpoint-[0-9]"):  # a finished run whose checkpoints were removed
        shutil.rmtree(checkpoint)
    with pytest.raises(ValueError, match="holds what an earlier run left \\(final, log.jsonl\\)"):
        train(tiny_drafter(target), target, toy_examples(8), short, tmp_path)  # its log was erased
    clear_run(tmp_path)
    assert sorted(path.name for path in tmp_path.iterdir()) == mine
    train(tiny_drafter(target), target, toy_examples(8), short, tmp_path, resume=False)
    assert sorted(path.name for path in tmp_path.glob("checkpoint-[0-9]")) == ["checkpoint-2"]
    assert [record["step"] for record in read_log(tmp_path / "log.jsonl")] == [1, 2]


def test_token_ids_outside_the_targets_vocabulary_are_refused(target, tmp_path):
    """Data tokenized for a bigger vocabulary ended in an IndexError inside the embedding."""
    from hf_domino.prompt_sets import InputDataError

    examples = [*toy_examples(2), Example([5, 6, VOCAB + 3, 7], [0, 1, 1, 1])]
    config = TrainConfig(total_steps=1, num_anchors=2)
    with pytest.raises(
        InputDataError, match=f"example 2 holds token id {VOCAB + 3}, outside .* vocabulary of {VOCAB}"
    ):
        train(tiny_drafter(target), target, examples, config, tmp_path)
    assert not tmp_path.joinpath("log.jsonl").exists()


def test_bad_settings_and_data_are_refused_at_the_call(target, tmp_path):
    """Each of these failed deep inside a step (an IndexError, a ZeroDivisionError after the first step, a KeyError)
    or trained silently with something else (kl_weight 2, max_length ignored)."""
    from hf_domino.prompt_sets import InputDataError
    from hf_domino.training import load_examples, pack, teacher_forced_metrics

    for setting, value in [("batch_size", 0), ("log_every", 0), ("num_anchors", 0), ("kl_weight", 2.0),
                           ("gradient_accumulation_steps", 0), ("learning_rate", 0.0), ("total_steps", 1.5)]:  # fmt: skip
        with pytest.raises(ValueError, match=f"TrainConfig.{setting} "):
            TrainConfig(**{setting: value})
    config = TrainConfig(total_steps=2, batch_size=2, num_anchors=3, log_every=1, max_length=12)
    with pytest.raises(TypeError, match="its settings as a TrainConfig, got dict"):
        train(tiny_drafter(target), target, toy_examples(4), {"total_steps": 2}, tmp_path)
    with pytest.raises(TypeError, match="examples must be a list of training.Example"):
        train(tiny_drafter(target), target, "regen.jsonl", config, tmp_path)
    with pytest.raises(InputDataError, match="None of the 0 examples has two response tokens"):
        train(tiny_drafter(target), target, [], config, tmp_path)
    with pytest.raises(Exception, match=r"target_layer_ids must name target layers from 0 below num_target_layers"):
        DominoConfig.from_target(target.config, block_size=BLOCK, emb_dim=8, gru_hidden_dim=16,
                                 target_layer_ids=[1, 14, 27], num_hidden_layers=1)  # fmt: skip
    deeper = conftest_tiny_target("qwen3", vocab_size=VOCAB, hidden_size=32, num_layers=30).config
    deep = DominoConfig.from_target(deeper, block_size=BLOCK, emb_dim=8, gru_hidden_dim=16,
                                    target_layer_ids=[1, 14, 27], num_hidden_layers=1)  # fmt: skip
    with pytest.raises(ValueError, match=r"target_layer_ids .* outside the target's 4 layers"):
        train(DominoForSpeculation(deep), target, toy_examples(4), config, tmp_path)
    assert not tmp_path.joinpath("log.jsonl").exists()
    # TrainConfig.max_length cuts the examples, as load_examples(max_length) does.
    train(tiny_drafter(target), target, toy_examples(4), config, tmp_path)
    assert {record["seq_len"] for record in read_log(tmp_path / "log.jsonl")} == {12}

    lines = ['{"index": 0, "input_ids": [5, 6, 7, 8], "loss_mask": [0, 1, 1, 1]}',
             '{"index": 1, "input_ids": [5, 6, 7, 8], "loss_mask": [0, 1, 1]}']  # fmt: skip
    (tmp_path / "short_mask.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(InputDataError, match="short_mask.jsonl:2 has 4 input_ids but a loss_mask of 3"):
        load_examples(tmp_path / "short_mask.jsonl", max_length=64)
    (tmp_path / "lined.jsonl").write_text('{"id": "mt:a\\nb", "input_ids": [5, 6], "loss_mask": [0, 1]}\n')
    with pytest.raises(InputDataError, match="holds a line break"):
        pack(tmp_path / "lined.jsonl", tmp_path / "lined.safetensors", recipe={})
    with pytest.raises(InputDataError, match=f"holds token id {VOCAB}, outside the target's vocabulary"):
        teacher_forced_metrics(tiny_drafter(target), target, [Example([5, 6, VOCAB, 7], [0, 1, 1, 1])])
    from hf_domino.training import evaluate_acceptance

    chat = [[{"role": "user", "content": "Hi"}]]
    with pytest.raises(ValueError, match="draft_length must be from 1"):  # 0 measured whole blocks
        evaluate_acceptance(target, None, tiny_drafter(target), chat, draft_length=0)
    with pytest.raises(TypeError, match="prompts must be a list of chat conversations"):
        evaluate_acceptance(target, None, tiny_drafter(target), ["Hi there"])
    with pytest.raises(ValueError, match="max_new_tokens must be at least 2"):  # no drafting forward: it said 0.0
        evaluate_acceptance(target, None, tiny_drafter(target), chat, max_new_tokens=1)
    from hf_domino.training.evaluate import AcceptanceResult

    assert (
        json.loads(json.dumps(AcceptanceResult(float("nan"), [], 0, 0.0).to_dict()))["mean_acceptance_length"] is None
    )


CUDA_RUN = """
import os, sys, torch
sys.path.insert(0, {tests!r})
from test_training import DRAFT_VOCAB, TrainConfig, tiny_drafter, tiny_target, toy_examples, train
os.environ.pop("ACCELERATE_USE_CPU")  # set by the suite's conftest, which test_training imports
target = tiny_target()
drafter = tiny_drafter(target)
options, held_out = {options}, ()
if options:  # what the GPU fine-tuning stage runs: anchors at generate()'s blocks, a draft vocabulary, validation
    drafter.set_draft_vocab(DRAFT_VOCAB)
    held_out = toy_examples(count=10)[8:]
config = TrainConfig(total_steps={steps}, batch_size=2, num_anchors=4, learning_rate=1e-2, log_every=1, save_every=12,
                     **options)
drafter = train(drafter, target, toy_examples(), config, {output!r}, validation_examples=held_out)
print("devices", drafter.device.type, target.device.type, "weights", drafter.dtype)
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_training_on_cuda(tmp_path):
    """What a user's `train()` does on a GPU machine (the suite pins the CPU): bf16 autocast, fp32 weights, losses
    that fall, and a resumed run that picks up its checkpoint. In a subprocess, since accelerate's state is one per
    process."""

    def run(steps: int, output: Path, **options) -> str:
        script = CUDA_RUN.format(tests=os.path.dirname(__file__), steps=steps, output=str(output), options=options)
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout

    assert "devices cuda cuda weights torch.float32" in run(24, tmp_path)
    losses = [json.loads(line)["base_loss"] for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert all(map(math.isfinite, losses)) and sum(losses[-3:]) < 0.8 * sum(losses[:3]), losses
    assert "Resumed from" in run(27, tmp_path) and (tmp_path / "checkpoint-27").is_dir()
    finetune = dict(anchor_chain=True, draft_vocab=True, generate_tau=True)
    assert "devices cuda cuda" in run(4, tmp_path / "finetune", **finetune)
    assert 1.0 <= read_log(tmp_path / "finetune" / "validation.jsonl")[-1]["generate_tau"] <= BLOCK


def test_feature_cache_matches_in_process_features(target, tmp_path):
    examples = toy_examples(3)
    cache = FeatureCache.build(tmp_path / "features", target, examples, [1, 2], max_length=64, progress=False)
    batch, features = batch_and_features(target, examples[:1])
    torch.testing.assert_close(cache.get(0), features[0], rtol=1e-3, atol=1e-3)  # stored as float16
    assert FeatureCache.build(tmp_path / "features", target, examples, [1, 2], 64, progress=False).index == cache.index


def test_a_feature_cache_of_other_data_or_another_target_is_refused(target, tmp_path):
    """Features were looked up by example number alone: other --data, or another target, read the wrong rows."""
    from hf_domino.prompt_sets import InputDataError

    examples, folder = toy_examples(3), tmp_path / "features"
    FeatureCache.build(folder, target, examples, [1, 2], max_length=64, progress=False)
    shuffled = [examples[1], examples[0], examples[2]]
    with pytest.raises(InputDataError, match="other examples than this run's \\(example 0 differs"):
        FeatureCache.build(folder, target, shuffled, [1, 2], max_length=64, progress=False)
    other = copy.deepcopy(target)
    with torch.no_grad():
        other.model.norm.weight.mul_(2)
    with pytest.raises(InputDataError, match="made otherwise than this run's \\(target differ"):
        FeatureCache.build(folder, other, examples, [1, 2], max_length=64, progress=False)
    # The same target in another dtype reads the same cache.
    half = copy.deepcopy(target).to(torch.bfloat16)
    assert len(FeatureCache.build(folder, half, examples[:2], [1, 2], 64, progress=False).index) == 3
    # A cache filled before fingerprints and digests were kept is still read, checked on what it recorded.
    meta = json.loads((folder / "meta.json").read_text())
    del meta["target"]
    (folder / "meta.json").write_text(json.dumps(meta))
    entries = [json.loads(line) for line in (folder / "index.jsonl").read_text().splitlines()]
    (folder / "index.jsonl").write_text(
        "".join(json.dumps({**e, "ids": 0}) + "\n" for e in entries).replace(', "ids": 0', "")
    )
    assert len(FeatureCache.build(folder, other, shuffled, [1, 2], 64, progress=False).index) == 3


def test_trained_checkpoint_drafts_losslessly(target, trained_run):
    _, output_dir = trained_run
    drafter = DominoForSpeculation.from_pretrained(output_dir / "checkpoint-30").eval()
    input_ids = torch.tensor([toy_examples(1)[0].input_ids[:8]])
    expected = target.generate(input_ids, max_new_tokens=20, do_sample=False, pad_token_id=0)
    for head in (True, False):
        with drafter.domino_head(head):
            output = target.generate(
                input_ids, assistant_model=drafter, max_new_tokens=20, do_sample=False, pad_token_id=0
            )
        assert output.tolist() == expected.tolist()
        assert sum(drafter.last_generation_stats.acceptance_lengths) == 20 - 1  # the prefill made the first


# ------------------------------------------------------------------------------------------------------ two ranks
def _ddp_worker(rank: int, world_size: int, port: int, output_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    assert accelerator.num_processes == world_size
    target = tiny_target()
    config = TrainConfig(total_steps=2, batch_size=1, num_anchors=3, learning_rate=1e-2, save_every=100)
    drafter = train(tiny_drafter(target), target, toy_examples(), config, output_dir, accelerator=accelerator)
    torch.save(drafter.state_dict(), os.path.join(output_dir, f"rank{rank}.pt"))
    accelerator.wait_for_everyone()
    accelerator.end_training()


def test_two_processes_agree_on_weights(tmp_path, monkeypatch):
    # CPU processes (gloo): accelerate's barrier names the process's GPU (`device_ids=[local rank]`) whenever CUDA is
    # visible, even with cpu=True, so on a one-GPU machine rank 1 would name a GPU that is not there.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    mp.spawn(_ddp_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    rank0 = torch.load(tmp_path / "rank0.pt", weights_only=True)
    rank1 = torch.load(tmp_path / "rank1.pt", weights_only=True)
    initial = tiny_drafter(tiny_target()).state_dict()
    assert any(not torch.equal(rank0[name], initial[name]) for name in rank0)  # it trained
    for name in rank0:
        torch.testing.assert_close(rank0[name], rank1[name], rtol=0, atol=0, msg=name)


def test_gradient_checkpointing_gives_the_same_step(target, tmp_path):
    config = TrainConfig(total_steps=2, batch_size=2, num_anchors=3, learning_rate=1e-2, save_every=100)
    runs = {}
    for checkpointing in (False, True):
        drafter, calls = tiny_drafter(target), []
        drafter.layers[0].self_attn.register_forward_pre_hook(lambda *args, calls=calls: calls.append(1))  # replayed
        run_config = TrainConfig(**{**config.__dict__, "gradient_checkpointing": checkpointing})
        runs[checkpointing] = train(drafter, target, toy_examples(), run_config, tmp_path / str(checkpointing)), calls
    for (name, a), (_, b) in zip(runs[False][0].state_dict().items(), runs[True][0].state_dict().items()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    # Checkpointed, each step runs the layer again in its backward (it passed with checkpointing never switched on).
    assert len(runs[True][1]) == 2 * len(runs[False][1]) > 0


# ------------------------------------------------------------------------------------------ target-layer warm start
def test_init_from_target_layers_reproduces_the_targets_context_inputs(target):
    drafter = tiny_drafter(target)  # 1 layer; context from target layers [1, 2] of 4
    assert init_from_target_layers(drafter, target) == [3]
    target_layer = target.model.layers[3]
    for name, tensor in target_layer.state_dict().items():
        torch.testing.assert_close(drafter.layers[0].state_dict()[name], tensor, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(drafter.norm.weight, target.model.norm.weight)

    # The context enters draft layer 0 exactly as the target's layer 3 reads it: its input, normalized by its norm.
    batch, features = batch_and_features(target, toy_examples(count=2))
    with torch.no_grad():
        hidden_states = target(batch.input_ids, output_hidden_states=True).hidden_states
        expected = target_layer.input_layernorm(hidden_states[3])
        torch.testing.assert_close(drafter.project_context(features), expected, rtol=1e-5, atol=1e-5)


def test_init_from_target_layers_on_llama_keeps_fresh_qk_norms():
    llama = conftest_tiny_target("llama", vocab_size=VOCAB, num_layers=3)
    config = DominoConfig.from_target(llama.config, num_hidden_layers=2, block_size=BLOCK, target_layer_ids=[0])
    drafter = DominoForSpeculation(config)
    assert init_from_target_layers(drafter, llama) == [1, 2]
    torch.testing.assert_close(
        drafter.layers[1].self_attn.q_proj.weight, llama.model.layers[2].self_attn.q_proj.weight
    )
    torch.testing.assert_close(drafter.layers[0].mlp.down_proj.weight, llama.model.layers[1].mlp.down_proj.weight)
    assert torch.equal(drafter.layers[0].self_attn.q_norm.weight, torch.ones(8))

    too_deep = DominoForSpeculation(DominoConfig.from_target(llama.config, num_hidden_layers=4, target_layer_ids=[0]))
    with pytest.raises(ValueError, match="drafter has 4 layers but the target only 3"):
        init_from_target_layers(too_deep, llama)


def test_plot_loss_curves_one_or_several_keys(trained_run, tmp_path):
    pytest.importorskip("matplotlib")
    from hf_domino.training import plot_loss_curves

    _, output_dir = trained_run
    log = output_dir / "log.jsonl"
    for key in ("base_loss", ("base_loss", "final_loss")):
        png = plot_loss_curves({"run": log, "same run": log}, tmp_path / "plots" / "loss.png", key=key)
        assert png.read_bytes().startswith(b"\x89PNG")
    with pytest.raises(KeyError):
        plot_loss_curves({"run": log}, tmp_path / "bad.png", key="no_such_loss")


def test_each_log_record_says_its_batch_padded_length(target, tmp_path):
    # On a GPU, attention kernels may plan each new shape: the per-step log shows which steps met a new length.
    config = TrainConfig(total_steps=6, batch_size=2, num_anchors=4, learning_rate=1e-2, log_every=1, save_every=6)
    examples = [*toy_examples(count=3, response_len=12), *toy_examples(count=3, response_len=20)]
    train(tiny_drafter(target), target, examples, config, tmp_path)
    lengths = [
        max(len(examples[i].input_ids) for i in example_indices(s, 0, 0, config=config, world_size=1, num_examples=6))
        for s in range(6)
    ]
    assert [r["seq_len"] for r in read_log(tmp_path / "log.jsonl")] == lengths and len(set(lengths)) == 2


def test_validation_is_logged_and_leaves_training_untouched(target, tmp_path):
    config = TrainConfig(total_steps=20, batch_size=2, num_anchors=4, learning_rate=1e-2, log_every=10, save_every=10)
    examples = toy_examples(count=10)
    train_set, held_out = examples[:8], examples[8:]
    plain = train(tiny_drafter(target), target, train_set, config, tmp_path / "plain")
    validated = train(tiny_drafter(target), target, train_set, config, tmp_path / "val", validation_examples=held_out)
    for (name, a), (_, b) in zip(plain.state_dict().items(), validated.state_dict().items()):
        assert torch.equal(a, b), name

    records = read_log(tmp_path / "val" / "validation.jsonl")
    assert [r["step"] for r in records] == [10, 20]
    train_keys = set(read_log(tmp_path / "val" / "log.jsonl")[0])
    assert set(records[0]) == train_keys - {"lr", "grad_norm", "seq_len"}
    assert records[-1]["final_loss"] < records[0]["final_loss"]  # held-out toy sequences follow the same rule
    assert not (tmp_path / "plain" / "validation.jsonl").exists()


def greedy_answers(target, count: int, prompt_len: int = 5, new_tokens: int = 24) -> list[Example]:
    """The target's own greedy answers to random prompts: regenerated data, on which generate() reproduces them."""
    generator = torch.Generator().manual_seed(1)
    examples = []
    for _ in range(count):
        prompt = torch.randint(3, VOCAB, (1, prompt_len), generator=generator)
        output = target.generate(prompt, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)[0].tolist()
        examples.append(Example(output, [0] * prompt_len + [1] * (len(output) - prompt_len)))
    return examples


@pytest.fixture(scope="module")
def self_trained(target, tmp_path_factory):
    """A drafter trained on the target's own greedy answers, which it then drafts well (tau~ about 2; 2 s)."""
    config = TrainConfig(total_steps=150, batch_size=4, num_anchors=6, learning_rate=1e-2, save_every=1000)
    return train(tiny_drafter(target), target, greedy_answers(target, 16), config, tmp_path_factory.mktemp("self"))


def test_block_acceptance_is_what_the_loss_counts(target, self_trained):
    batch, features = batch_and_features(target, greedy_answers(target, 4))
    anchors, valid = sample_anchors(batch.loss_mask, 4, torch.Generator().manual_seed(5))
    module = DominoTrainingModule(self_trained, TargetModules.from_target(target))
    args = (batch.input_ids, batch.loss_mask, batch.attention_mask, features)
    accepted = module.block_acceptance(*args, anchors, valid)
    with torch.no_grad():
        out = module(*args, anchors, valid, 0.0)
    assert accepted.sum() == out.accepted and accepted.max() > 1


def test_first_draft_branches_count_a_block_whose_first_draft_is_among_the_likeliest(target, self_trained):
    # One branch is the block itself; more never accept less; with a branch for every token the first draft always
    # holds, and each block then adds 1 + what the head drafts after the true first token.
    batch, features = batch_and_features(target, greedy_answers(target, 4))
    anchors, valid = sample_anchors(batch.loss_mask, 6, torch.Generator().manual_seed(5))
    module = DominoTrainingModule(self_trained, TargetModules.from_target(target))
    args = (batch.input_ids, batch.loss_mask, batch.attention_mask, features, anchors, valid)
    one, two, every = (module.block_acceptance(*args, first_draft_branches=n) for n in (1, 2, 64))
    assert torch.equal(one, module.block_acceptance(*args))
    assert (two >= one).all() and (every >= two).all() and (two > one).any()
    assert (every[valid] >= 2).all()
    assert torch.equal(every[one >= 2], one[one >= 2])  # where the first draft held, the rest is the block's own


def test_generate_blocks_are_generate_blocks(target, self_trained):
    """On the target's own greedy answer, the chain of teacher-forced blocks is generate()'s, anchor for anchor and
    block for block, for an untrained drafter and one that drafts well."""
    from hf_domino.acceptance import block_anchors, generate_with_acceptance

    prompt = torch.tensor([toy_examples(1)[0].input_ids[:6]])
    for drafter in (tiny_drafter(target), self_trained):
        output, lengths = generate_with_acceptance(
            target, prompt, assistant_model=drafter, draft_policy="fixed", domino_lookup=False, max_new_tokens=24,
            do_sample=False,
        )  # fmt: skip
        loss_mask = torch.zeros_like(output)
        loss_mask[:, prompt.shape[1] :] = 1
        features = target_context_features(target, output, torch.ones_like(output), [1, 2])
        module = DominoTrainingModule(drafter, TargetModules.from_target(target))
        (blocks,) = module.generate_blocks(output, loss_mask, torch.ones_like(output), features)
        expected = list(zip(block_anchors(prompt.shape[1], lengths), lengths))[:-1]
        assert blocks == expected
    assert max(lengths) > 1


def test_training_at_generates_anchors(target, self_trained, tmp_path, monkeypatch):
    """--anchor-chain trains on blocks anchored where generate() anchors them, deterministically (so resumable)."""
    from hf_domino.training import loop

    examples = greedy_answers(target, 4)
    chains = []
    original = loop.sample_chain_anchors
    monkeypatch.setattr(loop, "sample_chain_anchors", lambda c, *a: chains.append(c) or original(c, *a))
    config = TrainConfig(total_steps=2, batch_size=2, num_anchors=4, learning_rate=1e-2, save_every=100)
    chain = TrainConfig(**{**config.__dict__, "anchor_chain": True})
    plain = train(copy.deepcopy(self_trained), target, examples, config, tmp_path / "plain")
    first = train(copy.deepcopy(self_trained), target, examples, chain, tmp_path / "a")
    again = train(copy.deepcopy(self_trained), target, examples, chain, tmp_path / "b")
    weights = [m.state_dict()["prefix_gru.weight_ih_l0"] for m in (plain, first, again)]
    assert torch.equal(weights[1], weights[2]) and not torch.equal(weights[0], weights[1])
    # The first step's chains are the blocks generate() drafts over those answers with the starting drafter.
    module = DominoTrainingModule(self_trained, TargetModules.from_target(target))
    batch, features = batch_and_features(target, [examples[i] for i in loop.example_indices(
        0, 0, 0, config=chain, world_size=1, num_examples=len(examples))])  # fmt: skip
    assert chains[0] == module.generate_blocks(batch.input_ids, batch.loss_mask, batch.attention_mask, features)


def test_validation_logs_generate_tau(target, tmp_path):
    from hf_domino.training import teacher_forced_metrics

    config = TrainConfig(total_steps=10, batch_size=2, num_anchors=4, learning_rate=1e-2, save_every=10)
    config = TrainConfig(**{**config.__dict__, "generate_tau": True})
    held_out = toy_examples(count=10)[8:]
    drafter = train(tiny_drafter(target), target, toy_examples(), config, tmp_path, validation_examples=held_out)
    logged = read_log(tmp_path / "validation.jsonl")[-1]
    assert 1.0 <= logged["generate_tau"] <= BLOCK
    drafter.eval()
    assert teacher_forced_metrics(drafter, target, held_out, config)["generate_tau"] == pytest.approx(
        logged["generate_tau"], rel=1e-5
    )


@pytest.mark.parametrize("draft_vocab", [False, True])
def test_teacher_forced_metrics_match_the_validation_log(target, tmp_path, draft_vocab):
    """The example that scores a shipped drafter (examples/heldout_teacher_forced.py) gives a run's own figures, over
    the draft vocabulary too when the run trained over it."""
    from hf_domino.training import teacher_forced_metrics

    config = TrainConfig(
        total_steps=10, batch_size=2, num_anchors=4, learning_rate=1e-2, save_every=10, draft_vocab=draft_vocab
    )
    held_out = toy_examples(count=10)[8:]
    drafter = tiny_drafter(target)
    if draft_vocab:
        drafter.set_draft_vocab(DRAFT_VOCAB)
    drafter = train(drafter, target, toy_examples(), config, tmp_path, validation_examples=held_out)
    logged = read_log(tmp_path / "validation.jsonl")[-1]
    drafter.eval()
    metrics = teacher_forced_metrics(drafter, target, held_out, config)
    assert not drafter.training
    for key in ("base_loss", "final_loss", "train_tau"):
        assert metrics[key] == pytest.approx(logged[key], rel=1e-5), key
    assert metrics["final_acc"] == logged["final_acc"]
    if draft_vocab:  # the toy labels outside it make the two scores differ
        whole = teacher_forced_metrics(drafter, target, held_out, dataclasses.replace(config, draft_vocab=False))
        assert whole["final_loss"] != pytest.approx(logged["final_loss"], rel=1e-3)


# ---------------------------------------------------------------------------------------------------- distillation
def test_target_next_token_probs_are_the_targets_distribution_before_each_label(target):
    batch = collate(toy_examples(2), pad_token_id=0)
    features, last_hidden = target_hidden_states(target, batch.input_ids, batch.attention_mask, [1, 2])
    torch.testing.assert_close(
        features, target_context_features(target, batch.input_ids, batch.attention_mask, [1, 2])
    )
    anchors, _ = sample_anchors(batch.loss_mask, 3, torch.Generator().manual_seed(0))
    probs = target_next_token_probs(TargetModules.from_target(target), last_hidden, anchors, BLOCK)
    vocab = torch.tensor([3, 7, 20, 41])  # over a draft vocabulary: the same probabilities, its columns only
    torch.testing.assert_close(
        target_next_token_probs(TargetModules.from_target(target), last_hidden, anchors, BLOCK, vocab),
        probs[..., vocab],
    )
    with torch.no_grad():
        logits = target(batch.input_ids, attention_mask=batch.attention_mask).logits
    labels = build_block_inputs(
        batch.input_ids, batch.loss_mask, anchors, torch.ones_like(anchors, dtype=torch.bool),
        block_size=BLOCK, num_drafts=BLOCK, mask_token_id=0,
    ).labels  # fmt: skip
    for row, block, k in itertools.product(range(2), range(3), range(BLOCK)):
        position = int(anchors[row, block]) + k  # the target predicts the label at position + 1 from here
        if position + 1 < batch.input_ids.shape[1]:
            assert int(labels[row, block, k]) == int(batch.input_ids[row, position + 1])
            torch.testing.assert_close(probs[row * 3 + block, k], logits[row, position].softmax(-1))


def test_distillation_loss_is_the_cross_entropy_against_one_hot_targets_and_pulls_towards_the_target():
    generator = torch.Generator().manual_seed(0)
    base, final = torch.randn(3, BLOCK, VOCAB, generator=generator), torch.randn(3, BLOCK, VOCAB, generator=generator)
    labels = torch.randint(VOCAB, (3, BLOCK), generator=generator)
    mask = torch.rand(3, BLOCK, generator=generator) > 0.2
    weights = position_weights(BLOCK, BLOCK)
    one_hot = F.one_hot(labels, VOCAB).float()
    plain = domino_losses(base, final, labels, mask, weights, 0.3)
    # The curriculum's mix: lam of the base loss, the rest of the final one (a loss of the final alone passed).
    torch.testing.assert_close(plain.loss, 0.7 * plain.final_loss + 0.3 * plain.base_loss)
    assert not torch.isclose(plain.base_loss, plain.final_loss)
    for kl_weight in (0.5, 1.0):
        distilled = domino_losses(base, final, labels, mask, weights, 0.3, one_hot, kl_weight)
        torch.testing.assert_close(distilled.loss, plain.loss)

    # Against a soft target p, the gradient of the final logits z is (softmax(z) - p), weighted per draft.
    probs = torch.randn(3, BLOCK, VOCAB, generator=generator).softmax(-1)
    logits = final.clone().requires_grad_(True)
    domino_losses(base, logits, labels, mask, weights, 0.0, probs, 1.0).loss.backward()
    weight = weights.view(1, -1) * mask
    expected = (final.softmax(-1) - probs) * (weight / weight.sum()).unsqueeze(-1)
    torch.testing.assert_close(logits.grad, expected)
    with pytest.raises(ValueError, match="target_probs"):
        domino_losses(base, final, labels, mask, weights, 0.3, None, 0.5)


def distillation_loss(drafter, target):
    batch = collate(toy_examples(8), pad_token_id=0)
    features, last_hidden = target_hidden_states(target, batch.input_ids, batch.attention_mask, [1, 2])
    anchors, valid = sample_anchors(batch.loss_mask, 4, torch.Generator().manual_seed(123))
    module = DominoTrainingModule(drafter, TargetModules.from_target(target))
    with torch.no_grad():
        out = module(
            batch.input_ids, batch.loss_mask, batch.attention_mask, features, anchors, valid, 0.0,
            target_last_hidden=last_hidden, kl_weight=1.0,
        )  # fmt: skip
    return out.final_loss.item()


def test_training_with_distillation_reduces_the_distillation_loss(target, tmp_path):
    config = TrainConfig(
        total_steps=20, batch_size=2, num_anchors=4, learning_rate=1e-2, save_every=100, kl_weight=1.0
    )
    drafter = train(tiny_drafter(target), target, toy_examples(), config, tmp_path)
    assert distillation_loss(drafter, target) < 0.9 * distillation_loss(tiny_drafter(target), target)


# ------------------------------------------------------------------------------------------ draft vocabulary (FR-Spec)
DRAFT_VOCAB = torch.arange(3, 40)  # the toy responses also use tokens 40..63: those labels fall outside


def test_training_over_a_draft_vocab_scores_exactly_its_columns(target):
    drafter = tiny_drafter(target)
    target_modules = TargetModules.from_target(target)
    batch, features = batch_and_features(target, toy_examples(4))
    anchors, valid = sample_anchors(batch.loss_mask, 4, torch.Generator().manual_seed(0))
    blocks = build_block_inputs(
        batch.input_ids, batch.loss_mask, anchors, valid, block_size=BLOCK, num_drafts=BLOCK, mask_token_id=0
    )
    args = (drafter, target_modules, features, batch.attention_mask, blocks, anchors)
    with torch.no_grad():
        full_base, full_final = draft_logits(*args)
        base, final = draft_logits(*args, vocab=DRAFT_VOCAB)
    torch.testing.assert_close(base, full_base[..., DRAFT_VOCAB])
    torch.testing.assert_close(final, full_final[..., DRAFT_VOCAB])

    # The losses are the cross-entropies over those columns; a label outside counts, never hits, takes no loss.
    labels, mask = blocks.labels.flatten(0, 1), blocks.label_mask.flatten(0, 1)
    inside = (labels >= 3) & (labels < 40)
    assert (mask & ~inside).any() and (mask & inside).any()
    out = DominoTrainingModule(drafter, target_modules, DRAFT_VOCAB)(
        batch.input_ids, batch.loss_mask, batch.attention_mask, features, anchors, valid, 0.0
    )
    weight = position_weights(BLOCK, BLOCK).view(1, -1) * (mask & inside)
    ce = F.cross_entropy(final.flatten(0, 1), (labels - 3).clamp(0, 36).flatten(), reduction="none")
    torch.testing.assert_close(out.final_loss, (ce.view(labels.shape) * weight).sum() / weight.sum())
    hits = (final.argmax(-1) + 3 == labels) & mask & inside
    torch.testing.assert_close(out.final_correct, hits.sum(0).float())
    torch.testing.assert_close(out.counts, mask.sum(0).float())

    # Distilling over the vocabulary reads the target's probabilities of its tokens, on the same drafts.
    _, last_hidden = target_hidden_states(target, batch.input_ids, batch.attention_mask, [1, 2])
    probs = target_next_token_probs(target_modules, last_hidden, anchors, BLOCK, DRAFT_VOCAB)
    distilled = DominoTrainingModule(drafter, target_modules, DRAFT_VOCAB)(
        batch.input_ids, batch.loss_mask, batch.attention_mask, features, anchors, valid, 0.0,
        target_last_hidden=last_hidden, kl_weight=1.0,
    )  # fmt: skip
    soft = -(probs * final.log_softmax(-1)).sum(-1)
    torch.testing.assert_close(distilled.final_loss, (soft * weight).sum() / weight.sum())

    # The head's gradient reaches the correction rows of the draft vocabulary's tokens, and no others.
    out.loss.backward()
    row_grads = drafter.embed_proj[2].weight.grad.abs().sum(-1)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[DRAFT_VOCAB] = False
    assert (row_grads[DRAFT_VOCAB] > 0).all() and (row_grads[outside] == 0).all()


def test_training_over_a_draft_vocab_learns_and_keeps_the_vocab(target, tmp_path):
    config = TrainConfig(
        total_steps=30, batch_size=2, num_anchors=4, learning_rate=1e-2, save_every=100, draft_vocab=True
    )
    with pytest.raises(ValueError, match="has none: give it one"):
        train(tiny_drafter(target), target, toy_examples(), config, tmp_path / "none")
    drafter = tiny_drafter(target)
    drafter.set_draft_vocab(DRAFT_VOCAB)
    trained = train(drafter, target, toy_examples(), config, tmp_path / "run")
    _, final_before = fixed_batch_losses(tiny_drafter(target), target, DRAFT_VOCAB)
    _, final_after = fixed_batch_losses(trained, target, DRAFT_VOCAB)
    assert final_after < 0.8 * final_before
    trained.save_pretrained(tmp_path / "saved")
    reloaded = DominoForSpeculation.from_pretrained(tmp_path / "saved")
    assert torch.equal(reloaded.draft_vocab, DRAFT_VOCAB)


def test_evaluate_acceptance_pools_every_forward_at_the_draft_length_asked():
    # A mean of the per-prompt means, or a draft length ignored, passed every test (one prompt, a random drafter).
    from conftest import forcing_drafter, successor_target
    from test_generation import letter_tokenizer

    from hf_domino.acceptance import generate_with_acceptance, mean_acceptance_length
    from hf_domino.training import evaluate_acceptance

    vocab = 32
    target = successor_target("llama", vocab)
    drafter = forcing_drafter(target, [(t + 1) % vocab if t < 14 else (t + 2) % vocab for t in range(vocab)])
    tokenizer = letter_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    prompts = [[{"role": "user", "content": "ab"}], [{"role": "user", "content": "kl"}]]  # right, then wrong, drafts
    result = evaluate_acceptance(target, tokenizer, drafter, prompts, max_new_tokens=12, draft_length=3)
    lengths = []
    for messages in prompts:
        input_ids = tokenizer.apply_chat_template(messages, return_tensors="pt", return_dict=True)["input_ids"]
        lengths.append(generate_with_acceptance(target, input_ids, assistant_model=drafter, draft_policy="fixed",
                                                num_speculative_tokens=3, domino_lookup=False, max_new_tokens=12,
                                                do_sample=False, pad_token_id=0)[1])  # fmt: skip
    assert max(max(each) for each in lengths) == 4  # 3 drafts + the target's token: the length asked
    assert result.per_prompt == [mean_acceptance_length(each) for each in lengths]
    pooled = mean_acceptance_length([length for each in lengths for length in each])
    assert result.mean_acceptance_length == pytest.approx(pooled)
    assert pooled != pytest.approx(sum(result.per_prompt) / 2)  # the two means differ here

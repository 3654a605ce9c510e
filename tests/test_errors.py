"""Bad input a newcomer types: each error names the option, the bad value and the fix, at the line that holds it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_drafter, tiny_target

from hf_domino import DominoOptions


@pytest.fixture(scope="module")
def models():
    target = tiny_target("qwen3")
    return target, tiny_drafter(target)


def generate(target, drafter, **options):
    prompt = torch.tensor([[5, 6, 7]])
    return target.generate(prompt, assistant_model=drafter, max_new_tokens=3, do_sample=False, **options)


@pytest.mark.parametrize("threshold", ["x", "0.5", [0.5], True, 0, 1.5, float("nan")])
def test_confidence_threshold_must_be_a_probability(models, threshold):
    target, drafter = models
    with pytest.raises(ValueError, match=r"assistant_confidence_threshold must be a number in \(0, 1\)") as error:
        generate(target, drafter, assistant_confidence_threshold=threshold)
    assert repr(threshold) in str(error.value) and "assistant_confidence_threshold=0.4" in str(error.value)


def test_confidence_threshold_accepts_numbers(models):
    target, drafter = models
    for threshold in (0.5, np.float32(0.3)):
        generate(target, drafter, assistant_confidence_threshold=threshold)


@pytest.mark.parametrize("rows", [1, 2])
def test_synced_gpus_is_refused_before_any_work(models, rows):
    """generate() sets `synced_gpus` for a target sharded with ZeRO-3 or FSDP across processes: its processes then
    step together until all are done, which a drafted call cannot keep (a batch's processes fell out of step; one
    sequence's went on past its EOS). Refused, naming the fix, rather than hanging."""
    target, drafter = models
    prompt = torch.tensor([[5, 6, 7]] * rows)
    with pytest.raises(ValueError, match=r"synced_gpus=True .*GatheredParameters"):
        target.generate(prompt, assistant_model=drafter, max_new_tokens=3, do_sample=False, synced_gpus=True)


@pytest.mark.parametrize(
    "setting",
    [{"num_assistant_tokens": 3}, {"num_assistant_tokens_schedule": "heuristic"}, {"assistant_lookbehind": 5}],
)
def test_settings_of_transformers_own_assistants_are_named_as_unread(models, setting):
    target, drafter = models
    with pytest.warns(UserWarning, match=f"{next(iter(setting))}: settings of transformers' own assistants.*"
                      "num_speculative_tokens"):  # fmt: skip
        generate(target, drafter, **setting)


@pytest.mark.parametrize("value", ["no", 0, 1, "False"])
def test_domino_head_option_must_be_a_bool_or_none(models, value):
    target, drafter = models
    with pytest.raises(ValueError, match=r"domino_head must be True, False or None \(the default"):
        generate(target, drafter, domino_head=value)


@pytest.mark.parametrize("name", ["draft_vocab", "domino_timings", "domino_cudnn_attention"])
def test_switches_must_be_bools(models, name):
    target, drafter = models
    with pytest.raises(ValueError, match=f"{name} must be True or False, got None"):
        generate(target, drafter, **{name: None})


def test_domino_head_none_is_the_default(models):
    """None means "not set": the head when the drafter has one, or the default of an enclosing `with` block."""
    target, drafter = models
    assert DominoOptions.resolve({"domino_head": None}, None).head_enabled(drafter)
    with drafter.domino_head(False):
        assert not DominoOptions.resolve({"domino_head": None}, None).head_enabled(drafter)
        assert DominoOptions.resolve({"domino_head": True}, None).head_enabled(drafter)  # explicit wins
        with drafter.domino_head(None):
            assert DominoOptions.resolve({}, None).head_enabled(drafter)
    dflash = tiny_drafter(target, head=False)
    assert not DominoOptions.resolve({"domino_head": None}, None).head_enabled(dflash)
    assert torch.equal(generate(target, drafter, domino_head=None), generate(target, drafter))


@pytest.mark.parametrize("value", ["no", 0, 1, "off"])
def test_domino_head_context_fails_on_the_with_line(models, value):
    _, drafter = models
    entered = []
    with pytest.raises(ValueError, match=r"drafter\.domino_head\(enabled\) takes True .* got " + repr(value)):
        with drafter.domino_head(value):
            entered.append(True)
    assert not entered


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ("abc", "got the string 'abc'"),
        (b"abc", "got the string b'abc'"),
        ([1.0, 2.0], "got torch.float32 values; pass integer ids"),
        (torch.ones(4, dtype=torch.bool), "got a boolean mask; pass the ids it selects"),
        ([[1, 2], [3]], "got list"),
        ({"a": 1}, "got dict"),
    ],
)
def test_set_draft_vocab_names_what_it_takes(models, ids, message):
    _, drafter = models
    with pytest.raises(TypeError, match="set_draft_vocab takes token ids") as error:
        drafter.set_draft_vocab(ids)
    assert message in str(error.value)
    assert drafter.draft_vocab is None


def test_set_draft_vocab_accepts_ids_in_any_integer_container(models):
    _, drafter = models
    try:
        for ids in ([9, 4, 5], np.array([9, 4, 5]), torch.tensor([9, 4, 5], dtype=torch.int32)):
            drafter.set_draft_vocab(ids)
            assert drafter.draft_vocab.tolist() == [4, 5, 9]
        with pytest.raises(ValueError, match="must not repeat"):
            drafter.set_draft_vocab([4, 4])
    finally:
        drafter.set_draft_vocab(None)

"""transformers' own DFlash path (`speculation_type="dflash"`) and ours, on the same weights.

`to_transformers_dflash` builds transformers' `MuseGlimmerAssistantModel` from a DFlash drafter. transformers'
implementation is a second reference for our backbone: run through its own `DFlashTokenCandidateGenerator`, it must
propose exactly the drafts ours proposes at every cycle, and both outputs must be the target's own.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_drafter, tiny_target
from transformers import AutoModel

from hf_domino import DominoForSpeculation
from hf_domino.generation_domino import DominoCandidateGenerator
from hf_domino.transformers_dflash import from_transformers_dflash, to_transformers_dflash

BLOCK = 6
SLIDING = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 5}
# A Qwen3.5-style RoPE field, which both sides read alike (refused until 2026-12-07 without being compared).
PARTIAL_ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}}


def record_drafts(monkeypatch, generator_class) -> list[tuple[int, list[int]]]:
    """(context length, drafted tokens) of every cycle in which `generator_class` drafted."""
    drafts: list[tuple[int, list[int]]] = []
    get_candidates = generator_class.get_candidates

    def recording(self, input_ids, *args, **kwargs):
        candidates = get_candidates(self, input_ids, *args, **kwargs)
        if candidates[0].shape[1] > input_ids.shape[1]:
            drafts.append((input_ids.shape[1], candidates[0][0, input_ids.shape[1] :].tolist()))
        return candidates

    monkeypatch.setattr(generator_class, "get_candidates", recording)
    return drafts


@pytest.mark.parametrize("layers", ["full", "sliding", "partial-rope"])
def test_transformers_dflash_drafts_what_we_draft(arch, layers, monkeypatch):
    from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator

    target = tiny_target(arch, **(PARTIAL_ROPE if layers == "partial-rope" else {}))
    window = SLIDING if layers == "sliding" else {}
    drafter = tiny_drafter(target, head=False, shift_label=False, block_size=BLOCK, **window)
    native = to_transformers_dflash(drafter)
    theirs = record_drafts(monkeypatch, DFlashTokenCandidateGenerator)
    ours = record_drafts(monkeypatch, DominoCandidateGenerator)
    max_new_tokens = 48
    for seed in range(3):
        prompt = torch.randint(4, target.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(seed))
        alone = target.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False)
        theirs.clear(), ours.clear()
        by_transformers = target.generate(
            prompt, max_new_tokens=max_new_tokens, do_sample=False, assistant_model=native, speculation_type="dflash"
        )
        by_us = target.generate(
            prompt,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            assistant_model=drafter,
            draft_policy="fixed",
            domino_lookup=False,
        )
        assert torch.equal(by_transformers, alone) and torch.equal(by_us, alone)
        assert len(ours) == len(theirs) > max_new_tokens // 2
        # Near max_new_tokens we draft only what can still be kept; transformers drafts a whole block regardless.
        end = prompt.shape[1] + max_new_tokens - BLOCK
        assert [(n, d[: len(mine)]) for (n, d), (_, mine) in zip(theirs, ours)] == ours
        assert all(d == mine for (n, d), (_, mine) in zip(theirs, ours) if n < end)


def test_a_saved_conversion_loads_without_remote_code(tmp_path):
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target, head=False, shift_label=False, block_size=BLOCK)
    to_transformers_dflash(drafter).save_pretrained(tmp_path)
    loaded = AutoModel.from_pretrained(tmp_path)
    assert type(loaded).__name__ == "MuseGlimmerAssistantModel"
    prompt = torch.tensor([[5, 9, 11, 20, 7, 30, 12]])
    assert torch.equal(
        target.generate(prompt, max_new_tokens=24, do_sample=False, assistant_model=loaded, speculation_type="dflash"),
        target.generate(prompt, max_new_tokens=24, do_sample=False),
    )


def test_what_does_not_carry_over_is_refused_by_name():
    target = tiny_target("qwen3")
    with pytest.raises(ValueError, match="shift_label=True .* one token late"):
        to_transformers_dflash(tiny_drafter(target, head=False, shift_label=True))
    with_head = tiny_drafter(target, head=True, shift_label=False, block_size=BLOCK)
    with pytest.raises(ValueError, match="no Domino head .* drop_domino_head=True"):
        to_transformers_dflash(with_head)
    backbone = to_transformers_dflash(with_head, drop_domino_head=True).state_dict()
    assert backbone["encoder.fc.weight"].equal(with_head.fc.weight) and not any("gru" in name for name in backbone)
    with pytest.raises(ValueError, match="attention_bias=True"):
        to_transformers_dflash(tiny_drafter(target, head=False, shift_label=False, attention_bias=True))
    with pytest.raises(TypeError, match="got a Qwen3ForCausalLM: pass the drafter"):  # an AttributeError
        to_transformers_dflash(target)
    with pytest.raises(TypeError, match="got a DominoForSpeculation: it is a drafter of ours already"):
        from_transformers_dflash(with_head)


@pytest.mark.parametrize("layers", ["full", "sliding"])
def test_a_transformers_dflash_folder_loads_as_the_drafter_it_came_from(layers, tmp_path):
    """Back from transformers' layout: the same tensors and config, drafting as before, and saved in ours."""
    from safetensors import safe_open

    target = tiny_target("llama")
    window = SLIDING if layers == "sliding" else {}
    drafter = tiny_drafter(target, head=False, shift_label=False, block_size=BLOCK, **window)
    to_transformers_dflash(drafter).save_pretrained(tmp_path / "theirs")
    loaded = DominoForSpeculation.from_pretrained(tmp_path / "theirs")
    assert loaded.state_dict().keys() == drafter.state_dict().keys()
    assert all(loaded.state_dict()[name].equal(tensor) for name, tensor in drafter.state_dict().items())
    fields = ("sliding_window", "layer_types", "vocab_size", "block_size", "mask_token_id", "target_layer_ids")
    for field in (*fields, "num_target_layers"):  # the last was lost (SGLang then reads the ids against 1 layer)
        assert getattr(loaded.config, field) == getattr(drafter.config, field), field
    assert drafter.config.num_target_layers == target.config.num_hidden_layers
    assert not loaded.config.shift_label and not loaded.config.has_domino_head
    loaded.save_pretrained(tmp_path / "ours")
    with safe_open(tmp_path / "ours" / "model.safetensors", "pt") as saved:
        assert {"fc.weight", "hidden_norm.weight"} <= set(saved.keys())
    prompt = torch.tensor([[5, 9, 11, 20, 7, 30, 12]])
    options = dict(max_new_tokens=24, do_sample=False, draft_policy="fixed", domino_lookup=False)
    assert torch.equal(
        target.generate(prompt, assistant_model=loaded, **options),
        target.generate(prompt, assistant_model=drafter, **options),
    )
    assert loaded.last_generation_stats.acceptance_lengths == drafter.last_generation_stats.acceptance_lengths


def test_a_target_with_several_eos_ids_converts(tmp_path):
    # Llama 3.1's targets list their EOS ids; transformers' assistant config takes one, and the conversion (and
    # `hf-domino export --layout transformers-dflash`) failed on its validation.
    target = tiny_target("llama", eos_token_id=[1, 4])
    drafter = tiny_drafter(target, head=False, shift_label=False, block_size=BLOCK)
    assert drafter.config.eos_token_id == [1, 4]
    to_transformers_dflash(drafter).save_pretrained(tmp_path)
    loaded = DominoForSpeculation.from_pretrained(tmp_path)
    assert all(loaded.state_dict()[name].equal(tensor) for name, tensor in drafter.state_dict().items())


def test_an_assistant_whose_mask_id_is_outside_the_vocabulary_is_refused():
    # transformers' assistant config defaults its mask id to 201818: converted as it was, generate() failed on an
    # IndexError deep in the drafter's embedding.
    native = to_transformers_dflash(tiny_drafter(tiny_target("qwen3"), head=False, shift_label=False))
    native.config.mask_token_id = 201818
    with pytest.raises(ValueError, match=r"mask_token_id \(201818\) is not an id of the 64-token vocabulary"):
        from_transformers_dflash(native, vocab_size=64)


def test_a_folder_without_its_vocabulary_size_asks_for_it(tmp_path):
    """Folders transformers wrote itself record no vocabulary size: the error says which to pass."""
    import json

    target = tiny_target("qwen3")
    to_transformers_dflash(tiny_drafter(target, head=False, shift_label=False)).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["vocab_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"pass the target's, .*vocab_size=target\.config\.vocab_size"):
        DominoForSpeculation.from_pretrained(tmp_path)
    loaded = DominoForSpeculation.from_pretrained(tmp_path, vocab_size=target.config.vocab_size)
    assert loaded.config.vocab_size == target.config.vocab_size


def test_export_in_transformers_layout_writes_a_folder_transformers_drafts_with_alone(tmp_path):
    """`hf-domino export --layout transformers-dflash`: weights and config transformers loads without remote code,
    a card whose usage names `speculation_type="dflash"`, no remote code or draft vocabulary; a drafter the layout
    cannot hold is refused with the reason, and nothing is written."""
    from hf_domino.cli import main

    target = tiny_target("qwen3")
    drafter = tiny_drafter(target, head=False, shift_label=False, block_size=BLOCK)
    drafter.set_draft_vocab(torch.arange(10, 40))
    drafter.save_pretrained(tmp_path / "trained")
    argv = ["export", str(tmp_path / "trained"), str(tmp_path / "hub"), "--base-model", "org/t", "--dtype", "bfloat16"]
    assert main([*argv, "--layout", "transformers-dflash"]) == 0
    written = sorted(path.name for path in (tmp_path / "hub").iterdir())
    assert written == ["README.md", "config.json", "model.safetensors"]
    card = (tmp_path / "hub" / "README.md").read_text()
    assert 'speculation_type="dflash"' in card and "trust_remote_code" not in card and "draft vocabulary" not in card
    loaded = AutoModel.from_pretrained(tmp_path / "hub")
    assert type(loaded).__name__ == "MuseGlimmerAssistantModel" and loaded.dtype == torch.bfloat16
    prompt = torch.tensor([[5, 9, 11, 20, 7, 30, 12]])
    assert torch.equal(
        target.generate(
            prompt, max_new_tokens=24, do_sample=False, assistant_model=loaded.float(), speculation_type="dflash"
        ),
        target.generate(prompt, max_new_tokens=24, do_sample=False),
    )
    tiny_drafter(target, head=True, shift_label=True).save_pretrained(tmp_path / "domino")
    argv[1:3] = [str(tmp_path / "domino"), str(tmp_path / "never")]
    with pytest.raises(SystemExit, match="--layout transformers-dflash: .*shift_label=True"):
        main([*argv, "--layout", "transformers-dflash"])
    assert not (tmp_path / "never").exists()

    # A DFlash drafter with a Domino head: its backbone only, on request, and the card describes what was written.
    with_head = tiny_drafter(target, head=True, shift_label=False, block_size=BLOCK)
    with_head.save_pretrained(tmp_path / "with-head")
    argv[1:3] = [str(tmp_path / "with-head"), str(tmp_path / "backbone")]
    with pytest.raises(SystemExit, match="no Domino head .*--drop-domino-head"):
        main([*argv, "--layout", "transformers-dflash"])
    with pytest.raises(SystemExit, match="--drop-domino-head.* applies to layout='transformers-dflash' only"):
        main([*argv, "--drop-domino-head"])
    assert not (tmp_path / "backbone").exists()
    assert main([*argv, "--layout", "transformers-dflash", "--drop-domino-head"]) == 0
    backbone = AutoModel.from_pretrained(tmp_path / "backbone")
    card = (tmp_path / "backbone" / "README.md").read_text()
    assert "DFlash drafter (transformers' DFlash layout)" in card and "\n- dflash\n" in card
    assert "Domino head" not in card and "GRU" not in card and "\n- domino\n" not in card
    assert torch.equal(backbone.encoder.fc.weight, with_head.fc.weight.to(torch.bfloat16))  # the backbone written
    assert torch.equal(
        target.generate(
            prompt, max_new_tokens=24, do_sample=False, assistant_model=backbone.float(), speculation_type="dflash"
        ),
        target.generate(prompt, max_new_tokens=24, do_sample=False),
    )


def test_a_published_dflash_checkpoint_drafts_the_same_on_transformers_path(tmp_path, monkeypatch):
    """A folder in z-lab's published DFlash layout, loaded here and converted: transformers' generator drafts what
    ours drafts from it."""
    from test_modeling import published_config, published_tensors, write_folder
    from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator

    folder = write_folder(tmp_path / "published", published_config(domino=False), published_tensors(domino=False))
    drafter = DominoForSpeculation.from_pretrained(folder)
    target = tiny_target("qwen3", num_layers=36)  # the published configs read layers 1, 17 and 33
    theirs = record_drafts(monkeypatch, DFlashTokenCandidateGenerator)
    ours = record_drafts(monkeypatch, DominoCandidateGenerator)
    prompt = torch.tensor([[7, 8, 9, 21, 30]])
    options = dict(max_new_tokens=40, do_sample=False)
    native = to_transformers_dflash(drafter)
    by_transformers = target.generate(prompt, assistant_model=native, speculation_type="dflash", **options)
    by_us = target.generate(prompt, assistant_model=drafter, draft_policy="fixed", domino_lookup=False, **options)
    assert torch.equal(by_transformers, by_us)
    end = prompt.shape[1] + options["max_new_tokens"] - drafter.config.block_size
    assert [d for n, d in theirs if n < end] == [d for n, d in ours if n < end] and len(ours) > 10


def test_an_assistant_transformers_built_drafts_through_us_in_batches(monkeypatch):
    """`from_transformers_dflash`: a `MuseGlimmerAssistantModel` transformers built alone drafts through hf-domino what
    transformers' own path drafts from it, and serves a left-padded batch, which transformers' path refuses."""
    from test_batching import left_padded
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel
    from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator

    target = tiny_target("qwen3")
    torch.manual_seed(0)
    config = MuseGlimmerAssistantConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        block_size=BLOCK,
        mask_token_id=3,
        target_layer_ids=[0, 2],
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=4,
    )
    native = MuseGlimmerAssistantModel(config).eval()
    with torch.no_grad():  # transformers' initial weights are small: drafts would hardly vary with the context
        for param in native.parameters():
            if param.dim() > 1:
                param.normal_(0, 0.5)
    with pytest.raises(ValueError, match=r"from_transformers_dflash\(model, vocab_size=target\.config\.vocab_size\)"):
        from_transformers_dflash(native)
    drafter = from_transformers_dflash(native.to(torch.float64), vocab_size=target.config.vocab_size)
    assert drafter.dtype == torch.float64 and drafter.config.sliding_window == 5  # transformers' window is inclusive
    assert not drafter.config.shift_label and not drafter.config.has_domino_head
    target, native, drafter = target.double(), native.double(), drafter.double()

    theirs = record_drafts(monkeypatch, DFlashTokenCandidateGenerator)
    ours = record_drafts(monkeypatch, DominoCandidateGenerator)
    prompt = torch.tensor([[7, 8, 9, 21, 30, 11, 12, 40, 41]])  # longer than the window: both layers kinds matter
    options = dict(max_new_tokens=40, do_sample=False)
    by_transformers = target.generate(prompt, assistant_model=native, speculation_type="dflash", **options)
    by_us = target.generate(prompt, assistant_model=drafter, draft_policy="fixed", domino_lookup=False, **options)
    assert torch.equal(by_transformers, by_us)
    end = prompt.shape[1] + options["max_new_tokens"] - BLOCK
    assert [d for n, d in theirs if n < end] == [d for n, d in ours if n < end] and len(ours) > 10

    batch = left_padded([[5, 9, 11, 20], [7], [30, 12, 13]])
    with pytest.raises(ValueError, match="batch_size = 1"):
        target.generate(**batch, assistant_model=native, speculation_type="dflash", **options)
    drafted = target.generate(**batch, assistant_model=drafter, draft_policy="fixed", domino_lookup=False, **options)
    assert torch.equal(drafted, target.generate(**batch, **options))
    assert sum(drafter.last_generation_stats.drafted) > 3 * options["max_new_tokens"]  # it drafted all along

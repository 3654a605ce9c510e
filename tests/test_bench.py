"""Tests for `hf-domino bench` and `hf-domino demo` with tiny random Llama/Qwen3 targets and a word-level tokenizer."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import io
import json
import re
import statistics

import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

from hf_domino import (
    DominoConfig,
    DominoForSpeculation,
    DominoGenerationStats,
    assets,
    cli,
    demo,
    generation_domino,
    measure,
    measure_batch,
    prepare_for_cpu_decoding,
    report,
)
from hf_domino.acceptance import acceptance_from_cache_lengths
from hf_domino.drafting_domino import Drafts

WORDS = "the a sea sky ship sail wind blue red green is was and of to in what why how write poem code hello world"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|> {{ message['content'] }} <eos> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
PROMPTS = [
    [{"role": "user", "content": "write a poem of the sea and the wind"}],
    [{"role": "user", "content": "what is the blue sky"}],
]
MAX_NEW_TOKENS = 24


def make_tokenizer() -> transformers.PreTrainedTokenizerFast:
    specials = ["<pad>", "<eos>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]
    vocab = {token: index for index, token in enumerate(specials + WORDS.split())}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_target(kind: str = "llama", vocab_size: int = 64) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    common = {
        "vocab_size": vocab_size,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 256,
        # Wide logits: no near-ties that the different shapes of decode and verify forwards could flip.
        "initializer_range": 0.5,
        "bos_token_id": None,
        "eos_token_id": 1,
        "pad_token_id": 0,
    }
    if kind == "qwen3":
        config = transformers.Qwen3Config(head_dim=16, **common)
        return transformers.Qwen3ForCausalLM(config).eval()
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).eval()


def make_drafter(target: transformers.PreTrainedModel, block_size: int = 4) -> DominoForSpeculation:
    torch.manual_seed(1)
    config = DominoConfig.from_target(
        target.config, num_hidden_layers=1, emb_dim=16, gru_hidden_dim=32, block_size=block_size
    )
    return DominoForSpeculation(config).eval()


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def target(tokenizer):
    return make_target(vocab_size=len(tokenizer))


@pytest.fixture(scope="module")
def drafter(target):
    return make_drafter(target)


def target_greedy(target, input_ids, max_new_tokens=MAX_NEW_TOKENS) -> torch.LongTensor:
    return target.generate(input_ids, **measure.generation_kwargs(target, max_new_tokens, 0.0))


def oracle_rollout(reference: torch.LongTensor, correct: int, vocab_size: int):
    """A stand-in for `eager_rollout` that drafts the target's own tokens `correct` times, then wrong ones.

    Random drafters are almost never right; this one makes verification accept several drafts per block, so the
    cache cropping and context bookkeeping of both decoding loops are exercised.
    """

    def make_rollout(drafter, target, pick=None, head=True, keep_rolling=None, ends=None):
        def rollout(block, prefix_ids):
            start, num_drafts = prefix_ids.shape[1], block.num_drafts
            padded = torch.cat([reference[0], reference.new_zeros(num_drafts)])
            drafts = padded[start : start + num_drafts].clone()
            drafts[correct:] = (drafts[correct:] + 1) % vocab_size
            return Drafts(drafts[None], block.base_logits, torch.ones(num_drafts))

        return rollout

    return make_rollout


def use_oracle(monkeypatch, reference, correct: int) -> None:
    """Both loops build their rollout with `eager_rollout`: replace it in each."""
    for module in (measure, generation_domino):
        monkeypatch.setattr(module, "eager_rollout", oracle_rollout(reference, correct=correct, vocab_size=64))


def test_acceptance_from_cache_lengths():
    # prompt of 5; the prefill adds 1 token, then forwards add 3, 1 and 2 tokens: sequence 6 -> 9 -> 10 -> 12.
    assert acceptance_from_cache_lengths([0, 5, 8, 9], final_length=12) == [3, 1, 2]
    assert acceptance_from_cache_lengths([0], final_length=6) == []


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_manual_loop_matches_target_greedy(kind, monkeypatch):
    target = make_target(kind)
    drafter = make_drafter(target, block_size=5)
    torch.manual_seed(2)
    for length in (3, 11):
        input_ids = torch.randint(2, 64, (1, length))
        reference = target_greedy(target, input_ids)
        assert torch.equal(measure.manual_generate(target, drafter, input_ids, MAX_NEW_TOKENS, [1]), reference)

        # With drafts that are partly right, both loops accept the same blocks and still give the target's tokens.
        use_oracle(monkeypatch, reference, correct=2)
        manual = measure.run_method("manual", target, drafter, input_ids, MAX_NEW_TOKENS)
        domino = measure.run_method(f"domino_k{drafter.config.num_drafts}", target, drafter, input_ids, MAX_NEW_TOKENS)
        monkeypatch.undo()
        new_tokens = reference[0, length:].tolist()
        assert manual.new_tokens == domino.new_tokens == new_tokens
        assert manual.acceptance_lengths == domino.acceptance_lengths
        assert sum(manual.acceptance_lengths) + 1 == len(new_tokens)  # + the prefill's token
        assert max(manual.acceptance_lengths) == 3
        assert set(manual.timings) == set(domino.timings) == set(measure.TIMING_KEYS)


def test_both_loops_honour_num_speculative_tokens(monkeypatch):
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=5)
    input_ids = torch.randint(2, 64, (1, 7), generator=torch.Generator().manual_seed(4))
    reference = target_greedy(target, input_ids)
    use_oracle(monkeypatch, reference, correct=5)
    # Every draft is right: each forward adds exactly 2 drafts + 1.
    manual = measure.run_method("manual", target, drafter, input_ids, MAX_NEW_TOKENS, num_speculative_tokens=2)
    domino = measure.run_method("domino_k2", target, drafter, input_ids, MAX_NEW_TOKENS)
    assert manual.new_tokens == domino.new_tokens == reference[0, 7:].tolist()
    assert manual.acceptance_lengths == domino.acceptance_lengths
    assert max(manual.acceptance_lengths) == 3 and manual.acceptance_lengths.count(3) >= 3
    # The adaptive policy takes the same cap.
    adaptive = measure.run_method("domino", target, drafter, input_ids, MAX_NEW_TOKENS, num_speculative_tokens=2)
    assert adaptive.new_tokens == manual.new_tokens and max(adaptive.drafted) <= 2
    # Its cost table was measured in this call, on the call's cache: those timing forwards decode nothing (they were
    # counted as forwards that added 0 tokens, 1.03 tokens per forward reported for 4.11).
    assert adaptive.acceptance_lengths == drafter.last_generation_stats.acceptance_lengths


def test_manual_loop_stops_at_eos_and_length(target, drafter):
    input_ids = torch.randint(2, target.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(3))
    reference = target_greedy(target, input_ids, max_new_tokens=40)
    first_new = int(reference[0, 6])
    # Declaring the first generated token an EOS must stop both right after it.
    assert measure.manual_generate(target, drafter, input_ids, 40, [first_new]).tolist() == reference[:, :7].tolist()
    assert measure.manual_generate(target, drafter, input_ids, 1, [1]).shape[1] == 7


def test_bench_runs_all_methods(target, drafter, tokenizer, tmp_path):
    prompts = [assets.encode_chat(tokenizer, messages) for messages in PROMPTS]
    settings = measure.BenchSettings(max_new_tokens=16, warmup_tokens=4)
    whole = f"domino_k{drafter.config.num_drafts}@eager"  # the blocks `manual` drafts, on generate()'s loop
    methods = [*measure.METHODS, "domino_k3", "dflash_k3", whole]
    result = measure.run_benchmark(target, drafter, prompts, methods, settings, progress=False)
    summary = report.summarize(result)
    assert list(summary) == methods
    for method, s in summary.items():
        assert s["greedy_mismatches"] == 0, method
        assert s["prompts"] == 2 and s["new_tokens"] > 0 and s["tokens_per_second"] > 0
        assert s["mean_acceptance_length"] >= 1
    assert summary["target"]["speedup_total"] == pytest.approx(1.0)
    assert summary["target"]["acceptance_histogram"] == {"1": summary["target"]["new_tokens"] - 2}
    for method in ("manual", "domino_k3", "dflash_k3", whole):  # fixed draft lengths: every cycle drafts
        assert set(summary[method]["latency_ms"]) == {*measure.TIMING_KEYS, "cycle"}
    assert set(summary["domino_k3"]["drafts_histogram"]) <= {"0", "1", "2", "3"}
    # The loop's cost against manual's is priced where the same blocks were drafted, never against the adaptive
    # policy's other blocks (the line priced those until 2026-12-07).
    assert report.loop_pair(result) == whole and "loop_overhead_vs_manual" in summary[whole]
    assert "loop_overhead_vs_manual" not in summary["domino"]
    # Each drafting method priced its cycles with a table of its own, refined by its own loop alone.
    assert "domino" in result.policy_verify_ms and "target" not in result.policy_verify_ms

    paths = report.write_report(result, tmp_path / "out")
    written = json.loads(paths["json"].read_text())
    assert written["summary"]["domino"]["greedy_mismatches"] == 0
    assert len(written["records"]["manual"]) == 2
    assert "| domino |" in paths["markdown"].read_text()
    assert f"transformers loop ({whole}) vs manual loop, the same blocks" in paths["markdown"].read_text()
    for name in report.PLOT_FILES:
        assert paths[name].read_bytes()[:4] == b"\x89PNG"


def test_method_names():
    assert measure.parse_method("domino_vocab_k16@triton+graph").options == {
        "domino_head": True,
        "draft_vocab": True,
        "domino_lookup": False,
        "domino_datastore": False,
        "draft_policy": "fixed",
        "num_speculative_tokens": 16,
        "domino_rollout": "triton+graph",
    }
    assert "domino_rollout" not in measure.parse_method("domino_vocab").options
    with pytest.raises(ValueError, match="dflash has no head"):
        measure.parse_method("dflash_k4@eager")
    with pytest.raises(ValueError, match="Unknown method"):
        measure.parse_method("domino@fused")
    tree = measure.parse_method("domino_vocab_lookup_k4_tree3").options
    assert tree["domino_branches"] == 3 and tree["num_speculative_tokens"] == 4 and tree["domino_lookup"]
    adaptive_tree = measure.parse_method("domino_vocab_lookup_tree2").options  # the adaptive policy prices k
    assert adaptive_tree["domino_branches"] == 2 and "draft_policy" not in adaptive_tree


def test_bench_sampling(target, drafter):
    prompts = [torch.randint(2, target.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(4))]
    settings = measure.BenchSettings(max_new_tokens=8, temperature=0.8, warmup_tokens=2)
    result = measure.run_benchmark(target, drafter, prompts, ["target", "domino"], settings, progress=False)
    summary = report.summarize(result)
    assert summary["domino"]["greedy_mismatches"] is None
    assert summary["domino"]["new_tokens"] == 8
    with pytest.raises(ValueError, match="greedy only"):
        measure.run_method("manual", target, drafter, prompts[0], 4, temperature=0.8)


def test_greedy_agreement_counts_the_tokens_before_the_first_difference():
    def record(tokens):
        return measure.Generation(new_tokens=tokens, seconds=1.0, acceptance_lengths=[1] * len(tokens))

    baseline = [record([1, 2, 3, 4]), record([5, 6, 7, 8, 9, 10]), record([1, 2])]
    same = report._against_baseline(baseline, baseline, greedy=True)
    assert same["greedy_mismatches"] == 0 and same["greedy_agreement"] == 1.0
    # Differs at the third token, is identical, stops early (EOS) where the baseline went on.
    other = [record([1, 2, 9, 9]), record([5, 6, 7, 8, 9, 10]), record([1])]
    against = report._against_baseline(other, baseline, greedy=True)
    assert against["greedy_mismatches"] == 2 and against["greedy_agreement"] == pytest.approx((2 + 6 + 1) / 12)
    assert report._mismatch_cell(2, against["greedy_agreement"], 3) == "2/3 (75% agree)"
    assert report._mismatch_cell(0, 1.0, 3) == "0/3" and report._mismatch_cell(None, None, 3) == "-"
    assert report._against_baseline(other, baseline, greedy=False)["greedy_agreement"] is None


def saved_bench_argv(target, drafter, tokenizer, tmp_path) -> list[str]:
    """`hf-domino bench` arguments for these models saved as folders and a prompt file, as a user would pass them."""
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    drafter.save_pretrained(tmp_path / "drafter")
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"messages": m}) + "\n" for m in PROMPTS * 2))
    return [
        "bench",
        "--target",
        str(tmp_path / "target"),
        "--drafter",
        str(tmp_path / "drafter"),
        "--prompts",
        str(prompt_file),
    ]


def test_random_weights_take_the_folders_shape_at_another_targets_sizes():
    from hf_domino.options_domino import check_drafter_for_target

    other = make_target(vocab_size=77)
    shipped = assets.load_drafter(random_weights=True)
    resized = assets.load_drafter(random_weights=True, target_config=other.config)
    check_drafter_for_target(resized, other)  # drafts for that target
    assert resized.config.vocab_size == 77 and resized.draft_vocab is None  # the folder's ids were another target's
    assert (resized.config.num_hidden_layers, resized.config.block_size, resized.config.emb_dim) == (
        shipped.config.num_hidden_layers,
        shipped.config.block_size,
        shipped.config.emb_dim,
    )


def test_cli_bench_names_a_missing_drafter_before_loading_the_target(target, drafter, tokenizer, tmp_path):
    argv = ["bench", "--target", str(tmp_path / "no-target"), "--drafter", str(tmp_path / "no-drafter")]
    for methods in (["--methods", "target,domino"], ["--batch-size", "1"]):
        with pytest.raises(SystemExit, match="hf-domino bench: No drafter checkpoint at .*no-drafter"):
            cli.main([*argv, *methods, "--num-prompts", "1"])
    # The target alone needs no drafter: a missing one is no error there.
    argv = saved_bench_argv(target, drafter, tokenizer, tmp_path)
    argv[argv.index("--drafter") + 1] = str(tmp_path / "no-drafter")
    out = ["--output-dir", str(tmp_path / "out"), "--no-progress", "--no-cpu-fast-path", "--max-new-tokens", "4"]
    assert cli.main([*argv, "--methods", "target", "--num-prompts", "1", "--threads", "1", *out]) == 0


def test_cli_bench_refuses_a_drafter_of_another_target_before_it_runs(target, tokenizer, tmp_path):
    other_drafter = make_drafter(make_target(vocab_size=target.config.vocab_size + 8))
    argv = saved_bench_argv(target, other_drafter, tokenizer, tmp_path) + ["--num-prompts", "1", "--no-progress"]
    for methods in (["--methods", "target,domino"], ["--batch-size", "1", "--batch-methods", "target,domino"]):
        with pytest.raises(
            SystemExit, match="vocab_size .* differs .*--drafter: a drafter folder trained for --target"
        ):
            cli.main([*argv, *methods, "--output-dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        # Each was a traceback at its warm-up.
        (["--methods", "target,domino_vocab"], "'domino_vocab' needs a drafter with a draft vocabulary"),
        (["--methods", "target,domino_tree0"], "'domino_tree0': domino_branches must be an int from 1 to 8"),
        (["--methods", "target,domino_k99"], "'domino_k99': num_speculative_tokens must be an int from 0 to"),
        (["--methods", "target,domino", "--num-speculative-tokens", "99"], "num_speculative_tokens must be an int"),
        (["--batch-size", "1", "--batch-methods", "target,domino_k99"], "--batch-methods domino_k99: num_spec"),
    ],
)
def test_cli_bench_refuses_a_method_its_drafter_cannot_run_before_any_run(
    flags, message, target, drafter, tokenizer, tmp_path
):
    assert drafter.draft_vocab is None
    argv = saved_bench_argv(target, drafter, tokenizer, tmp_path) + ["--num-prompts", "1", "--no-progress"]
    with pytest.raises(SystemExit, match=re.escape(message)):
        cli.main([*argv, *flags, "--output-dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fast_path", [True, False])
def test_cli_bench_end_to_end(fast_path, target, drafter, tokenizer, tmp_path, capsys):
    argv = saved_bench_argv(target, drafter, tokenizer, tmp_path)
    argv += ["--num-prompts", "2", "--max-new-tokens", "8", "--threads", "1", "--device", "cpu"]  # not a GPU's
    argv += ["--methods", "target,target_no_cudnn,prompt_lookup,domino,manual", "--output-dir", str(tmp_path / "out")]
    argv += ["--no-progress"]
    assert cli.main(argv + ([] if fast_path else ["--no-cpu-fast-path"])) == 0
    written = json.loads((tmp_path / "out" / "bench.json").read_text())
    summary, out = written["summary"], capsys.readouterr().out
    assert all(s["greedy_mismatches"] == 0 for s in summary.values())
    assert written["metadata"]["torch_threads"] == 1
    assert written["metadata"]["command"].startswith("hf-domino bench --target")
    assert "| manual |" in out and "| target_no_cudnn |" in out  # on a CPU, the target alone's own kernels
    assert "cudnn_attention" not in written["metadata"]  # said on CUDA only
    if fast_path:  # on a CPU, by default: both models prepared, and the target alone also timed without it
        assert written["methods"] == ["target", "target_eager", "target_no_cudnn", "prompt_lookup", "domino", "manual"]
        assert "nn.Linear prepacked" in written["metadata"]["cpu_fast_path"] and "CPU fast path" in out
        assert summary["target_eager"]["greedy_mismatches"] == 0  # fp32 rounding only, on these prompts
        assert summary["domino"]["speedup_vs_eager_target"] > 0 and "vs eager target" in out
        assert sorted(written["eager_target_forward_ms_by_tokens"]) == sorted(written["target_forward_ms_by_tokens"])
    else:
        assert written["methods"] == ["target", "target_no_cudnn", "prompt_lookup", "domino", "manual"]
        assert written["metadata"]["cpu_fast_path"] == "off" and "speedup_vs_eager_target" not in summary["domino"]
        assert "vs eager target" not in out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cli_bench_on_cuda_in_bf16_also_times_the_target_without_cudnn(target, drafter, tokenizer, tmp_path):
    argv = saved_bench_argv(target, drafter, tokenizer, tmp_path)
    argv += ["--num-prompts", "1", "--max-new-tokens", "8", "--device", "cuda", "--dtype", "bfloat16"]
    argv += ["--methods", "target,domino", "--output-dir", str(tmp_path / "out"), "--no-progress"]
    assert cli.main(argv) == 0
    written = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert written["methods"] == ["target", "target_no_cudnn", "domino"]
    assert "its SDPA kernels enabled for the process" in written["metadata"]["cudnn_attention"]
    argv = [*argv[:-5], "--num-prompts", "2", "--batch-size", "2", "--batch-methods", "target,domino"]
    assert cli.main([*argv, "--output-dir", str(tmp_path / "batch"), "--no-progress"]) == 0
    written = json.loads((tmp_path / "batch" / "batch.json").read_text())
    assert [r["method"] for r in written["rows"]] == ["target", "target_no_cudnn", "domino"]


def test_cli_bench_samples_with_top_k_and_top_p(target, drafter, tokenizer, tmp_path, monkeypatch):
    # The warpers reach every method's generate() (a spy on generation_kwargs' result), the run is named by them, and
    # they are refused where they cannot apply.
    seen = []
    original = measure.generation_kwargs

    def spy(*args, **kwargs):
        seen.append(original(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(measure, "generation_kwargs", spy)
    argv = saved_bench_argv(target, drafter, tokenizer, tmp_path)
    argv += ["--num-prompts", "1", "--max-new-tokens", "6", "--threads", "1", "--device", "cpu", "--no-progress"]
    argv += ["--methods", "target,domino", "--no-cpu-fast-path", "--output-dir", str(tmp_path / "out")]
    assert cli.main([*argv, "--temperature", "0.7", "--top-k", "5", "--top-p", "0.9"]) == 0
    assert seen and all(kw["do_sample"] and (kw["top_k"], kw["top_p"]) == (5, 0.9) for kw in seen)
    assert "--temperature 0.7 --top-k 5 --top-p 0.9" in (tmp_path / "out" / "bench.md").read_text()
    with pytest.raises(SystemExit, match="pass --temperature > 0"):
        cli.main([*argv, "--top-k", "5"])
    with pytest.raises(SystemExit, match="drop them with --batch-size"):
        cli.main([*argv, "--temperature", "0.7", "--top-p", "0.9", "--batch-size", "2"])


def test_cli_bench_on_a_static_cache(target, drafter, tokenizer, tmp_path, monkeypatch):
    # Every generate() method runs on a static cache (the target alone too: the speedup is against what a user who
    # compiles gets); transformers decides whether to compile (a GPU), and the report says what it did.
    from hf_domino.options_domino import static_caches_roll_back

    seen = []
    original = measure.compile_kwargs
    monkeypatch.setattr(measure, "compile_kwargs", lambda *args: seen.append(original(*args)) or seen[-1])
    argv = saved_bench_argv(target, drafter, tokenizer, tmp_path)
    argv += ["--num-prompts", "1", "--max-new-tokens", "6", "--threads", "1", "--device", "cpu", "--no-progress"]
    argv += ["--methods", "target,domino", "--no-cpu-fast-path", "--output-dir", str(tmp_path / "out")]
    if static_caches_roll_back():
        assert cli.main([*argv, "--static-cache"]) == 0
        written = json.loads((tmp_path / "out" / "bench.json").read_text())
        assert seen and all(kw == {"cache_implementation": "static"} for kw in seen)
        assert written["metadata"]["cache"] == "static" and written["metadata"]["target_forward"] == "not compiled"
        assert all(s["greedy_mismatches"] == 0 for s in written["summary"].values())
        assert "--static-cache" in written["metadata"]["command"]
    assert measure.compile_kwargs(None, "off") == {"disable_compile": True}
    assert measure.compile_kwargs("static", "on")["compile_config"]._compile_all_devices
    with pytest.raises(SystemExit, match="batches and the manual loop keep a dynamic cache"):
        cli.main([*argv, "--static-cache", "--batch-size", "1"])
    with pytest.raises(SystemExit, match="--compile applies to --static-cache runs"):
        cli.main([*argv, "--compile", "on"])
    with pytest.raises(SystemExit, match="prompt lookup overflows a static cache"):
        cli.main([*argv, "--static-cache", "--methods", "target,prompt_lookup"])


def compile_with_the_eager_backend(monkeypatch) -> None:
    """`measure.compile_kwargs` with dynamo's eager backend: its graphs and guards (what decides a recompilation)
    without inductor's minutes of C++ compiling."""
    original = measure.compile_kwargs

    def eager_backend(*args):
        kwargs = original(*args)
        kwargs["compile_config"].backend = "eager"
        return kwargs

    monkeypatch.setattr(measure, "compile_kwargs", eager_backend)


def test_cli_bench_compiled_on_a_static_cache_compiles_only_while_warming_up(
    target, drafter, tokenizer, tmp_path, monkeypatch, fresh_dynamo
):
    # `--compile on` compiles with inductor, here with the eager backend. Once warmed up, no timed generation may
    # compile again: a CPU run had timed the recompilation a longer static cache brings, and one per forward (the
    # acceptance record's list, traced), which the GPU's `static` stage would have timed too.
    from torch._dynamo.utils import counters

    from hf_domino.options_domino import static_caches_roll_back

    if not static_caches_roll_back():
        pytest.skip("static caches roll back from transformers 5.24")
    run_method, frames = measure.run_method, []

    def counting(*args, **kwargs):
        before = counters["frames"]["total"]
        output = run_method(*args, **kwargs)
        frames.append(counters["frames"]["total"] - before)
        return output

    compile_with_the_eager_backend(monkeypatch)
    monkeypatch.setattr(measure, "run_method", counting)
    argv = saved_bench_argv(target, drafter, tokenizer, tmp_path)
    argv += ["--num-prompts", "3", "--max-new-tokens", "8", "--threads", "1", "--device", "cpu", "--no-progress"]
    argv += ["--methods", "target,domino", "--warmup-tokens", "4", "--output-dir", str(tmp_path / "out")]
    counters.clear()
    assert cli.main([*argv, "--static-cache", "--compile", "on"]) == 0
    written = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert written["metadata"]["target_forward"] == "compiled"
    assert all(s["greedy_mismatches"] == 0 for s in written["summary"].values())
    # target, target_eager (the CPU's baseline) and domino: two warm-ups each, then three prompts each
    assert len(frames) == 3 * 2 + 3 * 3 and sum(frames[:6]) > 0, frames
    assert frames[6:] == [0] * 9, frames


def test_a_stopped_bench_leaves_the_tables_of_the_prompts_it_finished(
    target, drafter, tokenizer, tmp_path, monkeypatch
):
    argv = saved_bench_argv(target, drafter, tokenizer, tmp_path)
    argv += ["--num-prompts", "3", "--max-new-tokens", "6", "--threads", "1", "--device", "cpu", "--no-cpu-fast-path"]
    argv += ["--methods", "target,domino", "--warmup-tokens", "2", "--output-dir", str(tmp_path / "out")]
    run_method, calls = measure.run_method, []

    def stopped_in_the_second_prompt(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2 + 2 + 1:  # the warm-ups, the first prompt, then the second prompt's first method
            raise KeyboardInterrupt  # what the GPU stages' timeout sends
        return run_method(*args, **kwargs)

    monkeypatch.setattr(measure, "run_method", stopped_in_the_second_prompt)
    with pytest.raises(KeyboardInterrupt):
        cli.main(argv)
    partial = (tmp_path / "out" / "bench.partial.md").read_text()
    assert partial.startswith("Partial: 1 of 3 prompts") and "| domino |" in partial and "- command:" in partial
    assert not (tmp_path / "out" / "bench.json").exists()
    monkeypatch.setattr(measure, "run_method", run_method)
    assert cli.main(argv) == 0  # a full run leaves its report, and no partial one
    assert (tmp_path / "out" / "bench.json").exists() and not (tmp_path / "out" / "bench.partial.md").exists()


def test_demo_core(target, drafter, tokenizer):
    stream = io.StringIO()

    class Streamer(transformers.TextStreamer):
        def on_finalized_text(self, text, stream_end=False):
            stream.write(text)

    streamer = Streamer(tokenizer, skip_prompt=True)
    result = demo.run_demo(target, tokenizer, drafter, "hello world", max_new_tokens=12, streamer=streamer)
    assert result.identical_to_target
    assert result.new_tokens > 0 and result.seconds > 0 and result.target_seconds > 0
    assert result.mean_acceptance_length >= 1
    assert stream.getvalue().strip() == result.text.strip()
    assert "tokens per target forward" in result.summary()
    assert result.default_target_seconds is None  # eager models: nothing else to compare with


def test_demo_core_on_the_cpu_fast_path(target, drafter, tokenizer, monkeypatch):
    from hf_domino import prepacked_linear
    from hf_domino.cpu_fast_path import GROUPED_KV_ATTENTION

    target, drafter = copy.deepcopy(target), copy.deepcopy(drafter)
    prepare_for_cpu_decoding(target, drafter)
    assert target.config._attn_implementation == GROUPED_KV_ATTENTION
    calls, generate = [], target.generate

    def recording(*args, **kwargs):  # how each call ran: with a drafter, eager linears, which attention
        calls.append((kwargs.get("assistant_model") is not None, prepacked_linear._EAGER.get(),
                      target.config._attn_implementation, kwargs["max_new_tokens"]))  # fmt: skip
        return generate(*args, **kwargs)

    monkeypatch.setattr(target, "generate", recording)
    result = demo.run_demo(target, tokenizer, drafter, "hello world", max_new_tokens=12, warmup_tokens=2)
    assert result.identical_to_target and result.default_target_seconds > 0
    assert "CPU fast path on both; the target alone as it runs by default" in result.summary()
    timed = [call for call in calls if call[3] == 12]
    # The drafted call, the target alone prepared, then as it runs by default (unprepared attention and linears).
    assert timed == [(True, False, GROUPED_KV_ATTENTION, 12), (False, False, GROUPED_KV_ATTENTION, 12),
                     (False, True, "sdpa", 12)]  # fmt: skip
    assert target.config._attn_implementation == GROUPED_KV_ATTENTION  # prepared again after


def test_demo_says_when_the_answer_differs_from_the_target_alones(target, drafter, tokenizer, monkeypatch):
    # run_demo's own comparison: comparing the drafted answer with itself passed every test.
    generate = target.generate

    def drafted_differently(*args, **kwargs):
        output = generate(*args, **kwargs)
        if kwargs.get("assistant_model") is not None and kwargs["max_new_tokens"] == 12:
            output[0, -1] = (output[0, -1] + 1) % target.config.vocab_size
        return output

    monkeypatch.setattr(target, "generate", drafted_differently)
    result = demo.run_demo(target, tokenizer, drafter, "hello world", max_new_tokens=12)
    assert not result.identical_to_target and "DIFFERENT" in result.summary()


def test_demo_core_compiled(target, drafter, tokenizer, monkeypatch, fresh_dynamo):
    # `--compile`: both runs on a static cache with the target's forward compiled (the eager backend here), which the
    # warm-ups compile, not the timed runs.
    from torch._dynamo.utils import counters

    from hf_domino.options_domino import static_caches_roll_back

    if not static_caches_roll_back():
        pytest.skip("static caches roll back from transformers 5.24")
    compile_with_the_eager_backend(monkeypatch)
    target, generate_calls = copy.deepcopy(target), []
    generate = target.generate

    def counting(*args, **kwargs):
        before = counters["frames"]["total"]
        output = generate(*args, **kwargs)
        generate_calls.append(
            (kwargs["max_new_tokens"], kwargs.get("cache_implementation"), counters["frames"]["total"] - before)
        )
        return output

    monkeypatch.setattr(target, "generate", counting)
    counters.clear()
    result = demo.run_demo(target, tokenizer, drafter, "hello world", max_new_tokens=12, compile=True)
    assert result.identical_to_target and result.compiled and result.default_target_seconds > 0
    assert "compiled on a static cache; the target alone as it runs by default" in result.summary()
    assert [(tokens, cache) for tokens, cache, _ in generate_calls] == [
        (8, "static"),  # measure.warm_verification_lengths
        (9, "static"),
        (9, "static"),
        (8, "static"),  # the policy's warm-ups
        (9, "static"),
        (8, "static"),
        (9, "static"),
        (12, "static"),
        (12, "static"),
        (8, None),
        (12, None),
    ]
    assert sum(frames for *_, frames in generate_calls[:7]) > 0
    assert [frames for *_, frames in generate_calls[7:]] == [0, 0, 0, 0], generate_calls


def test_warmed_verification_lengths_leave_no_number_of_drafts_to_compile(
    target, tokenizer, monkeypatch, fresh_dynamo
):
    # The demo's timed call once compiled on a loaded machine: its policy's warm-ups had verified one number of
    # drafts only. After `warm_verification_lengths`, a generation with a longer static cache compiles nothing
    # whatever it verifies, from plain steps to whole blocks, with and without the policy's own warm-ups.
    from torch._dynamo.utils import counters

    from hf_domino.options_domino import static_caches_roll_back

    if not static_caches_roll_back():
        pytest.skip("static caches roll back from transformers 5.24")
    compile_with_the_eager_backend(monkeypatch)
    drafter = make_drafter(target, block_size=5)
    input_ids = tokenizer("a b c", return_tensors="pt").input_ids
    compile_settings = measure.compile_kwargs("static", "on")
    measure.warm_verification_lengths(target, drafter, input_ids, 4, compile_settings)
    assert counters["frames"]["total"] > 0
    frames = []
    for drafts in range(drafter.config.num_drafts + 1):
        before = counters["frames"]["total"]
        kwargs = measure.generation_kwargs(target, 12, 0.0) | compile_settings
        kwargs |= {"assistant_model": drafter, "draft_policy": "fixed", "num_speculative_tokens": drafts}
        target.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
        assert drafts in drafter.last_generation_stats.drafted
        frames.append(counters["frames"]["total"] - before)
    assert frames == [0] * (drafter.config.num_drafts + 1)


def test_demo_compile_on_a_transformers_that_cannot_roll_a_static_cache_back_says_to_upgrade(monkeypatch, capsys):
    monkeypatch.setattr(demo, "static_caches_roll_back", lambda: False)
    assert cli.main(["demo", "--compile"]) == 2  # bad input; 1 says the answer differed from the target alone's
    assert re.search("from transformers 5.24 .* upgrade transformers or drop --compile", capsys.readouterr().err)


def test_demo_fails_when_the_output_differs_from_the_target_alones(target, drafter, tokenizer, monkeypatch, capsys):
    # Speed aside, the demo promises the target's own output: a script running it must see that promise break.
    different = demo.DemoResult(
        text="text",
        new_tokens=1,
        seconds=1.0,
        target_seconds=1.0,
        mean_acceptance_length=1.0,
        identical_to_target=False,
    )
    monkeypatch.setattr(demo, "load_drafter", lambda path: drafter)
    monkeypatch.setattr(demo, "load_smollm2", lambda: (target, tokenizer))
    monkeypatch.setattr(demo, "run_demo", lambda *args, **kwargs: different)
    # What the drafted call leaves (the demo reports from it); not left to whichever test used the drafter before.
    monkeypatch.setattr(drafter, "last_generation_stats", DominoGenerationStats(), raising=False)
    assert cli.main(["demo", "--no-cpu-fast-path"]) == 1
    output = capsys.readouterr()
    assert "output DIFFERENT from the target's own" in output.out and "differs from the target alone's" in output.err
    monkeypatch.setattr(
        demo, "run_demo", lambda *args, **kwargs: dataclasses.replace(different, identical_to_target=True)
    )
    assert cli.main(["demo", "--no-cpu-fast-path"]) == 0


def test_demo_refuses_a_drafter_of_another_target_and_says_when_nothing_was_drafted(
    target, drafter, tokenizer, monkeypatch, capsys
):
    other = make_drafter(make_target(vocab_size=target.config.vocab_size + 8))
    monkeypatch.setattr(demo, "load_drafter", lambda path: other)
    monkeypatch.setattr(demo, "load_smollm2", lambda: (target, tokenizer))
    assert cli.main(["demo", "--no-cpu-fast-path", "--drafter", "elsewhere"]) == 2  # was a traceback, then status 1
    assert re.search("hf-domino demo: --drafter .*vocab_size .* differs", capsys.readouterr().err)
    one_token = demo.DemoResult("text", new_tokens=1, seconds=1.0, target_seconds=1.0, mean_acceptance_length=0.0,
                                identical_to_target=True)  # fmt: skip
    assert "no target forward after the prefill's" in one_token.summary()  # was "0.00 tokens per target forward"


def test_missing_drafter_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="No drafter checkpoint"):
        assets.load_drafter(tmp_path / "missing")
    assert cli.main(["demo", "--drafter", str(tmp_path / "missing")]) == 2
    assert "hf-domino demo: No drafter checkpoint" in capsys.readouterr().err
    make_target().save_pretrained(tmp_path / "a_target")  # a folder that holds a model, not a drafter
    assert cli.main(["demo", "--drafter", str(tmp_path / "a_target")]) == 2
    assert "load the drafter's folder, not its target's" in capsys.readouterr().err


def test_cli_bench_batch_sizes(target, drafter, tokenizer, tmp_path, capsys):
    argv = saved_bench_argv(target, drafter, tokenizer, tmp_path)
    argv += ["--num-prompts", "4", "--max-new-tokens", "6", "--threads", "1"]
    argv += ["--batch-size", "1,2,4", "--batch-methods", "target,target_no_cudnn,domino,domino_k2"]
    argv += ["--warmup-tokens", "2", "--output-dir", str(tmp_path / "out")]
    assert cli.main(argv) == 0
    written = json.loads((tmp_path / "out" / "batch.json").read_text())
    assert [(r["batch_size"], r["method"]) for r in written["rows"]][:4] == [
        (1, "target"),
        (1, "target_no_cudnn"),  # on a CPU the target alone's own kernels: the same rows
        (1, "domino"),
        (1, "domino_k2"),
    ]
    assert len(written["rows"]) == 12 and all(r["tokens"] > 0 for r in written["rows"])
    assert all(r["mismatched_rows"] == 0 for r in written["rows"] if r["method"] != "target")
    # tau pools every row's forwards of every group (it was the mean of the groups' means, 2.44 for 1.55).
    for r in written["rows"]:
        if not r["method"].startswith("target"):
            assert r["accepting_forwards"] >= sum(r["forwards"]) and len(r["acceptance"]) == 4 // r["batch_size"]
    # The batch's own tau: the longest row's tokens per forward after the prefill; exactly 1 for the target alone,
    # at least 1 with a drafter (a forward never yields fewer than one token per row).
    for r in written["rows"]:
        groups = 4 // r["batch_size"]
        assert len(r["forwards"]) == len(r["longest_rows"]) == groups
        batch_tau = (sum(r["longest_rows"]) - groups) / sum(r["forwards"])
        assert batch_tau == 1.0 if r["method"].startswith("target") else batch_tau >= 1.0
    out = capsys.readouterr().out
    assert "| 4 | domino_k2 |" in out and "batch tau (longest row)" in out
    # A fixed k drafts every cycle: its drafting cycles are timed piece by piece, and the table says what they cost.
    k2 = next(r for r in written["rows"] if (r["batch_size"], r["method"]) == (2, "domino_k2"))
    assert len(k2["timings"]["verify"]) == len(k2["timings"]["head"]) > 0
    assert "Mean per drafting cycle, ms" in out and any(
        line.startswith("| 2 | domino_k2 | ") for line in out.split("\n")
    )
    assert not any(r["timings"] or r["acceptance"] for r in written["rows"] if r["method"].startswith("target"))
    with pytest.raises(SystemExit, match="batch-methods"):
        cli.main(argv[:-2] + ["--batch-methods", "target,beam"])
    # Each method and batch size once: a second of either merged its groups into one row, or paired the speedups of
    # one batch size with the other's target.
    with pytest.raises(SystemExit, match="--batch-methods: expected each method once"):
        cli.main(argv[:-2] + ["--batch-methods", "target,domino_k2,domino_k2"])
    with pytest.raises(SystemExit):
        cli.main([*argv, "--batch-size", "1,1"])
    assert "expected each batch size once" in capsys.readouterr().err
    # Without the target alone nothing is compared: no speedup, no rows differing (it printed 0).
    assert cli.main(argv[:-2] + ["--batch-methods", "domino_k2", "--batch-size", "1,3"]) == 0
    out = capsys.readouterr().out
    assert "| 1 | domino_k2 |" in out and out.split("| 1 | domino_k2 |")[1].split("\n")[0].endswith("| - |")
    assert "Prompts measured (1 rows: 4 of 4, 3 rows: 3 of 4): a last group smaller than the batch is left out." in out


def test_cli_bench_batch_repeats_count_each_group_once(target, drafter, tokenizer, tmp_path, monkeypatch):
    calls, drafters = [], {}
    generate = measure_batch._generate

    def recorded(*args):
        calls.append(args[3])
        drafters.setdefault(args[3], set()).add(id(args[1]))
        return generate(*args)

    monkeypatch.setattr(measure_batch, "_generate", recorded)
    per_prompt = saved_bench_argv(target, drafter, tokenizer, tmp_path)
    per_prompt += ["--num-prompts", "2", "--max-new-tokens", "5", "--threads", "1", "--warmup-tokens", "2"]
    argv = [
        *per_prompt,
        "--batch-size",
        "2",
        "--batch-methods",
        "target,domino,domino_makespan",
        "--output-dir",
        str(tmp_path / "out"),
    ]
    assert cli.main(argv) == 0
    once = json.loads((tmp_path / "out" / "batch.json").read_text())["rows"]
    methods = ["target", "domino", "domino_makespan"]
    assert calls == methods * 2  # a warm-up, then the one group once
    # Each drafting method learns with a drafter of its own (the policy's records are kept per drafter object).
    assert drafters["target"] == {id(None)} and len(drafters["domino"]) == len(drafters["domino_makespan"]) == 1
    assert drafters["domino"] != drafters["domino_makespan"]
    calls.clear()
    assert cli.main([*argv, "--repeats", "3"]) == 0
    assert calls == methods * 4  # a warm-up, then the group three times, methods interleaved
    written = json.loads((tmp_path / "out" / "batch.json").read_text())
    assert "--repeats 3" in written["command"]
    for single, repeated in zip(once, written["rows"]):
        # Tokens and acceptance come from one run per group; the group's time is the median of its three.
        assert repeated["tokens"] == single["tokens"] and len(repeated["seconds"]) == 1
        assert len(repeated["acceptance"]) == len(single["acceptance"])
    with pytest.raises(SystemExit):
        cli.main([*argv, "--repeats", "0"])
    with pytest.raises(SystemExit, match="--repeats applies to --batch-size"):
        cli.main([*per_prompt, "--repeats", "2"])


def test_each_method_learns_on_its_own_as_in_a_process_of_its_own(target, drafter):
    from hf_domino.cost_model_domino import VerifyCost, cached_verify_cost, swap_verify_cost
    from hf_domino.records_domino import _RECORDS, forget_records

    forget_records(drafter)  # what earlier tests taught it
    shared = VerifyCost({1: 0.01, 17: 0.02})
    previous = swap_verify_cost(target, shared)
    try:
        tables: dict = {}
        with measure.own_verify_cost(target, tables, "a"):
            cached_verify_cost(target).observe(5, 0.05)  # what method a's loop teaches its table
        with measure.own_verify_cost(target, tables, "b"):
            assert 5 not in cached_verify_cost(target).seconds  # b starts from the process's table, not from a's
        assert 5 in tables["a"].seconds and cached_verify_cost(target) is shared and 5 not in shared.seconds
        # A bench run leaves the caller's drafter and table as they were: every method learned on copies.
        prompts = [torch.randint(2, target.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(1))]
        settings = measure.BenchSettings(max_new_tokens=6, warmup_tokens=2)
        result = measure.run_benchmark(
            target, drafter, prompts, ["target", "domino", "domino_k2"], settings, progress=False
        )
        assert drafter not in _RECORDS and cached_verify_cost(target) is shared
        assert set(result.policy_verify_ms) == {"domino"}  # the fixed policy reads no table
    finally:
        swap_verify_cost(target, previous)


def test_the_drafter_goes_to_the_targets_device_before_the_pair_is_checked():
    # The fourth GPU run met this: the drafter, loaded on the CPU, was refused next to the CUDA target before it was
    # moved, so every bench on the GPU exited. "meta" stands in for a device other than the CPU here.
    from hf_domino.bench import _drafter_for

    target = make_target().to("meta")
    drafter = _drafter_for(target, argparse.Namespace(drafter=None, random_weights=True, seed=0), torch.float32)
    assert drafter.device.type == "meta"


def test_cli_bench_times_transformers_own_dflash_path_on_the_same_drafts(target, drafter, tokenizer, tmp_path, capsys):
    """`transformers_dflash` drafts with transformers' own generator what `dflash_k<block - 1>` drafts with ours:
    the same tokens per target forward on every prompt, on the CPU fast path's prepared drafter too."""
    from hf_domino.assets import backbone_as_dflash

    dflash = backbone_as_dflash(drafter)
    argv = saved_bench_argv(target, dflash, tokenizer, tmp_path) + ["--num-prompts", "3", "--max-new-tokens", "12"]
    argv += ["--threads", "1", "--device", "cpu", "--no-progress", "--output-dir", str(tmp_path / "out")]
    k = dflash.config.num_drafts
    assert cli.main([*argv, "--methods", f"target,dflash_k{k},transformers_dflash"]) == 0
    written = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert all(summary["greedy_mismatches"] == 0 for summary in written["summary"].values())
    ours, theirs = written["records"][f"dflash_k{k}"], written["records"]["transformers_dflash"]
    assert [r["acceptance_lengths"] for r in theirs] == [r["acceptance_lengths"] for r in ours]
    assert any(n > 1 for r in ours for n in r["acceptance_lengths"])  # drafts were accepted: a comparison
    assert "| transformers_dflash |" in capsys.readouterr().out
    # The shipped kind of drafter (shift_label=True) is refused before any prompt runs, with the reason.
    argv = saved_bench_argv(target, drafter, tokenizer, tmp_path / "shifted") + ["--no-progress"]
    with pytest.raises(SystemExit, match="transformers_dflash method: .*shift_label=True"):
        cli.main([*argv, "--methods", "target,transformers_dflash", "--output-dir", str(tmp_path / "out2")])
    assert not (tmp_path / "out2").exists()


def test_cli_bench_refuses_the_other_modes_flags_and_a_file_for_its_folder(tmp_path):
    """--methods (and the per-prompt knobs) were ignored in silence under --batch-size, --batch-methods without it;
    an --output-dir that is a file failed after the whole run. All refused before anything loads."""
    bench = ["bench", "--target", str(tmp_path / "never-loaded"), "--num-prompts", "2"]
    refusals = {
        ("--batch-size", "2", "--methods", "target,domino"): "--methods set the per-prompt methods, which",
        ("--batch-size", "2", "--num-speculative-tokens", "4"): "--num-speculative-tokens set the per-prompt",
        ("--batch-methods", "target,domino"): "--batch-methods applies to --batch-size runs",
        ("--output-dir", __file__): "is a file; give a folder for the report",
        ("--output-dir", f"{__file__}/report"): f"{__file__} is a file; give a folder",  # failed after the run
        ("--batch-size", "1", "--batch-methods", ","): "give at least one method",  # ran and wrote no rows
        # After loading: a ZeroDivisionError, no output.
        ("--methods", "manual", "--temperature", "0.5"): "manual is greedy only, and no other method is left",
    }
    for flags, message in refusals.items():
        with pytest.raises(SystemExit, match=message):
            cli.main([*bench, *flags])
    with pytest.raises(SystemExit):  # a warm-up of 0 tokens failed in generate() after loading
        cli.main([*bench, "--warmup-tokens", "0"])


def test_a_summary_compares_each_method_with_the_target_alone_the_right_way_round():
    # Inverted speedups, or forwards counted without the prefill, passed every bench test: the only speedup checked
    # was the target's against itself.
    from hf_domino.measure import BenchResult, BenchSettings, Generation
    from hf_domino.report import summarize_method

    result = BenchResult(methods=["target", "domino"], settings=BenchSettings())
    result.records["target"] = [Generation([1, 2, 3, 4], 4.0, [1, 1, 1]), Generation([5, 6], 1.0, [1])]
    result.records["domino"] = [Generation([1, 2, 3, 4], 1.0, [3]), Generation([5, 7], 1.0, [1])]
    summary = summarize_method(result, "domino")
    assert summary["speedup_total"] == pytest.approx((6 / 2.0) / (6 / 5.0))  # twice as fast, and more
    assert summary["speedup_median"] == pytest.approx(statistics.median([4.0, 1.0]))
    assert summary["mean_acceptance_length"] == pytest.approx(2.0)  # (3 + 1) / 2 forwards after the prefills
    assert summary["ms_per_target_forward"] == pytest.approx(1000 * 2.0 / 4)  # 2 decoding forwards + 2 prefills
    assert summary["greedy_mismatches"] == 1 and summary["greedy_agreement"] == pytest.approx(5 / 6)

"""`hf-domino bench`: decoding methods against the target alone, interleaved per prompt in one process.

The command only parses arguments, loads the target, drafter and prompts (`hf_domino.assets`), runs
`hf_domino.measure.run_benchmark` and writes `hf_domino.report`'s tables and plots. See `hf_domino.measure` for what
each method name means.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import transformers

from . import assets, prompt_sets
from .attention_kernels_domino import cudnn_attention_applies
from .cli import device_name, non_negative_int, number_in, output_problem, positive_int, seed_int
from .cpu_fast_path import prepare_for_cpu_decoding
from .measure import COMPILE_MODES, METHODS, BenchResult, BenchSettings, check_method, parse_method, run_benchmark
from .measure_batch import BATCH_METHODS, batch_markdown, parse_batch_method, run_batch_benchmark
from .options_domino import DominoOptions, check_drafter_for_target
from .recurrent_cache_domino import TRANSFORMERS_ROLLS_BACK_RECURRENT_STATES, keeps_recurrent_states
from .report import markdown_report, write_report
from .transformers_dflash import check_convertible

PROMPT_LOOKUP_TOKENS = 10  # transformers' prompt_lookup_num_tokens for the prompt_lookup method

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from .modeling_domino import DominoForSpeculation


def machine_metadata(threads: int) -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "machine": f"{cpu}, {os.cpu_count()} cores",
        # Other processes on the cores wreck multi-threaded CPU timings (thread barriers stall): keep the evidence.
        "load_average_1min_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "device": "cuda: " + torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch_threads": threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


# ------------------------------------------------------------------------------------------------------------ CLI
def _methods(value: str) -> list[str]:
    methods = [m.strip() for m in value.split(",") if m.strip()]
    if not methods:
        raise argparse.ArgumentTypeError("give at least one method")
    if len(set(methods)) < len(methods):
        raise argparse.ArgumentTypeError(f"expected each method once (the report pairs them by name), got {value!r}")
    for method in methods:
        try:
            parse_method(method)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    return methods


def _batch_sizes(value: str) -> list[int]:
    try:
        sizes = [int(size) for size in value.split(",") if size.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"batch sizes are comma-separated integers, got {value!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be positive integers, got {value!r}")
    if len(set(sizes)) < len(sizes):
        raise argparse.ArgumentTypeError(
            f"expected each batch size once (speedups pair with its target), got {value!r}"
        )
    return sizes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target",
        default="smollm2",
        help="an offline name ('smollm2': SmolLM2-135M-Instruct; 'qwen2.5-coder-0.5b'), or a Hugging Face model id or "
        "folder",
    )
    parser.add_argument("--gguf-file", help="GGUF file inside the --target folder to load the target from")
    parser.add_argument(
        "--device", type=device_name, default=None, help="where to run: cpu, cuda, cuda:1 (default: cuda if available)"
    )
    parser.add_argument("--drafter", default=None, help=f"drafter folder (default: {assets.SHIPPED_DRAFTER})")
    parser.add_argument(
        "--random-weights",
        action="store_true",
        help="an untrained drafter: the --drafter folder's architecture with random weights (seeded by --seed), at "
        "--target's sizes where the folder's are another target's",
    )
    parser.add_argument(
        "--prompts", default="mtbench", help=f"a prompt set ({', '.join(prompt_sets.PROMPT_SETS)}) or a jsonl file"
    )
    parser.add_argument("--num-prompts", type=positive_int, default=20, help="first prompts of --prompts to run")
    parser.add_argument(
        "--max-new-tokens", type=positive_int, default=128, help="tokens generated per prompt and method"
    )
    parser.add_argument("--temperature", type=number_in(0), default=0.0, help="0 = greedy")
    parser.add_argument(
        "--top-k", type=non_negative_int, default=0, help="with --temperature > 0: top-k sampling (0: off)"
    )
    parser.add_argument(
        "--top-p",
        type=number_in(0, 1, low_included=False),
        default=1.0,
        help="with --temperature > 0: top-p sampling (1: off)",
    )
    parser.add_argument("--threads", type=positive_int, default=os.cpu_count(), help="torch.set_num_threads")
    parser.add_argument(
        "--methods",
        type=_methods,
        default=list(METHODS),
        help=f"comma-separated (default {','.join(METHODS)}: `default` is the drafter with generate()'s defaults, "
        "`domino` the drafter alone over the whole vocabulary); also domino_vocab, domino_k<N>, dflash_k<N>, and "
        "domino...@eager|@triton|@triton+graph (the head's rollout), target_no_cudnn (the target alone with a drafting "
        "call's attention kernels: no cuDNN; added beside target on CUDA in half precision), transformers_dflash "
        "(transformers' own speculation_type='dflash' with the drafter converted: a shift_label=False drafter)",
    )
    parser.add_argument(
        "--prompt-lookup-tokens", type=positive_int, default=PROMPT_LOOKUP_TOKENS, help="prompt_lookup_num_tokens"
    )
    parser.add_argument(
        "--num-speculative-tokens",
        type=non_negative_int,
        default=None,
        help="cap on drafts per target forward for methods without a fixed _k<N> (default: the whole block)",
    )
    parser.add_argument(
        "--warmup-tokens",
        type=positive_int,
        default=16,
        help="untimed warm-up generation per method, in tokens (at least 1: every timed method runs warm)",
    )
    parser.add_argument(
        "--seed", type=seed_int, default=0, help="sampling seed (with --temperature > 0) and --random-weights seed"
    )
    parser.add_argument(
        "--batch-size",
        type=_batch_sizes,
        default=None,
        help="comma-separated batch sizes, e.g. 1,2,4,8: batched generation (left-padded groups of the prompts) with "
        "the drafter against the batched target alone, instead of the per-prompt methods",
    )
    parser.add_argument(
        "--batch-methods",
        default=",".join(BATCH_METHODS),
        help="with --batch-size: target, target_no_cudnn (added beside target on CUDA in half precision), domino (the "
        "drafter alone, adaptive, one k per batch), domino_rowk "
        "(adaptive, k per row), domino_k<N> (fixed), each optionally with _lookup (copied and retrieved drafts beside "
        "the drafter, generate()'s default), _lookup2 (retrieving only while at most 2 rows are active) or _copies "
        "(copies from the text only), then optionally _makespan (cycles priced by when the batch's last row "
        "finishes, not by the rows' mean tokens), then _tree<N> (N first-token branches per block), then "
        "@eager|@triton|@triton+graph (the head's rollout)",
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=1,
        help="with --batch-size: runs of every group per method (interleaved); each group's median time counts",
    )
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), default="float32", help="dtype of both models"
    )
    parser.add_argument(
        "--static-cache",
        action="store_true",
        help="every method generates on a static cache (cache_implementation='static', transformers>=5.24), the "
        "target alone included; on a GPU transformers then compiles the target's forward (see --compile)",
    )
    parser.add_argument(
        "--compile",
        choices=COMPILE_MODES,
        default="auto",
        help="with --static-cache: auto compiles the target's forward where transformers does (a GPU), on also on a "
        "CPU (minutes of compiling), off never",
    )
    parser.add_argument(
        "--no-cpu-fast-path",
        action="store_true",
        help="on a CPU, keep eager linear layers (default: hf_domino.prepare_for_cpu_decoding on both models, and "
        "the target alone is also timed eagerly, as method target_eager: eager linear layers on the dynamic cache)",
    )
    parser.add_argument("--output-dir", default=None, help="default: runs/bench/<prompts>-T<temperature>")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def command_line(args: argparse.Namespace) -> str:
    """The `hf-domino bench` command that reproduces `args`, for the report."""
    parts = ["hf-domino bench"]
    # Each mode's own flags only: --batch-size runs --batch-methods, otherwise --methods.
    batch_only = ("batch_methods", "repeats")
    unused = ("methods", "prompt_lookup_tokens", "num_speculative_tokens") if args.batch_size else batch_only
    for key, value in vars(args).items():
        if key in ("module_name", "command", "progress", *unused) or value is None or value is False:
            continue
        if (key, value) in (("top_k", 0), ("top_p", 1.0), ("compile", "auto")):  # defaults: the docs' commands stay
            continue
        value = ",".join(map(str, value)) if isinstance(value, list) else value
        parts.append(f"--{key.replace('_', '-')}" + ("" if value is True else f" {value}"))
    return " ".join(parts)


def decoding_names(args: argparse.Namespace) -> tuple[str, str]:
    """How a run's decoding names its default folder and its title: `T0.6-k20-p0.95`, `T=0.6, top-k 20, top-p 0.95`
    (top-k and top-p only where they are on)."""
    parts = [(f"T{args.temperature:g}", f"T={args.temperature:g}")]
    parts += [(f"k{args.top_k}", f"top-k {args.top_k}")] if args.top_k else []
    parts += [(f"p{args.top_p:g}", f"top-p {args.top_p:g}")] if args.top_p < 1 else []
    return "-".join(short for short, _ in parts), ", ".join(long for _, long in parts)


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    metadata = machine_metadata(args.threads)
    if (metadata["load_average_1min_at_start"] or 0) > 0.5:
        print(f"Warning: load average {metadata['load_average_1min_at_start']:.1f}: timings will not be reliable.")
    if args.threads > (os.cpu_count() or args.threads):  # OpenMP threads beyond the cores wait on each other
        print(f"Warning: --threads {args.threads} on {os.cpu_count()} cores: timings will not be reliable.")
    dtype = getattr(torch, args.dtype)
    methods = list(args.methods)
    if args.temperature > 0 and "manual" in methods:
        print(f"Skipping manual at temperature {args.temperature}: greedy only.")
        methods.remove("manual")
        if not methods and not args.batch_size:
            raise SystemExit("hf-domino bench: manual is greedy only, and no other method is left: add --methods.")
    warped = args.top_k or args.top_p < 1
    if warped and args.temperature <= 0:
        raise SystemExit("hf-domino bench: --top-k/--top-p apply to sampling; pass --temperature > 0 with them.")
    if warped and args.batch_size:
        raise SystemExit("hf-domino bench: --top-k/--top-p are for per-prompt runs; drop them with --batch-size.")
    if args.static_cache and (args.batch_size or "manual" in methods):
        raise SystemExit(
            "hf-domino bench: --static-cache is for generate() one prompt at a time: batches and the manual loop keep "
            "a dynamic cache. Drop --batch-size or the manual method."
        )
    if args.static_cache and "prompt_lookup" in methods:
        # transformers 5.24's own candidates run past the static cache's last column near max_length (IndexError).
        raise SystemExit("hf-domino bench: transformers' prompt lookup overflows a static cache; drop prompt_lookup.")
    if args.compile != "auto" and not args.static_cache:
        raise SystemExit("hf-domino bench: --compile applies to --static-cache runs (transformers compiles no other).")
    _check_mode_flags(args)
    if args.output_dir and (problem := output_problem(args.output_dir, folder=True)):
        raise SystemExit(f"hf-domino bench: --output-dir {args.output_dir}: {problem}; give a folder for the report.")
    if args.batch_size:
        return run_batches(args, metadata, dtype)
    if args.repeats != 1:
        raise SystemExit(
            "hf-domino bench: --repeats applies to --batch-size runs (per-prompt runs time each prompt once)."
        )
    # The prompts and the drafter's folder are checked before the target's load, which can take a minute.
    conversations = _load_prompts(args)
    needs_drafter = any(parse_method(m).uses_drafter for m in methods)
    if needs_drafter:
        _drafter_folder(args)
    target, tokenizer = assets.load_target(args.target, gguf_file=args.gguf_file, dtype=dtype, device=args.device)
    drafter = _drafter_for(target, args, dtype) if needs_drafter else None
    for method in methods:  # before any run: the warm-up of the first method alone takes seconds
        try:
            check_method(method, drafter, args.temperature)
            if drafter is not None and args.num_speculative_tokens is not None:
                DominoOptions(num_speculative_tokens=args.num_speculative_tokens).validate_for(drafter.config)
        except ValueError as error:
            raise SystemExit(
                f"hf-domino bench: {error} (--drafter {args.drafter or assets.SHIPPED_DRAFTER})"
            ) from None
    if "transformers_dflash" in methods:
        try:
            check_convertible(drafter.config)
        except ValueError as error:
            raise SystemExit(f"hf-domino bench: the transformers_dflash method: {error}") from None
    methods = _runnable_methods(methods, target)
    fast_path = _cpu_fast_path(args, target, drafter)
    if fast_path != "off":  # the CPU's baseline without the fast path
        _add_baseline(methods, "target_eager")
    if cudnn_attention_applies(target.device, target.dtype):  # the target alone with a drafting call's kernels
        _add_baseline(methods, "target_no_cudnn")
    prompts = [assets.encode_chat(tokenizer, messages) for messages in conversations]
    settings = BenchSettings(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        prompt_lookup_tokens=args.prompt_lookup_tokens,
        warmup_tokens=args.warmup_tokens,
        num_speculative_tokens=args.num_speculative_tokens,
        cache_implementation="static" if args.static_cache else None,
        compile=args.compile,
    )
    prompt_set = Path(args.prompts).stem if Path(args.prompts).suffix else args.prompts
    mean_prompt = sum(p.shape[1] for p in prompts) / max(len(prompts), 1)
    metadata = {
        "command": command_line(args),
        **metadata,
        "target": args.target,
        "drafter": str(args.drafter or assets.SHIPPED_DRAFTER) + (" (random weights)" if args.random_weights else ""),
        "dtype": args.dtype,
        "cpu_fast_path": fast_path,
        "cache": "static" if args.static_cache else "dynamic",
        "prompts": f"{prompt_set} ({len(prompts)} prompts, mean {mean_prompt:.0f} prompt tokens, chat template)",
        "speedup": "tokens/s of the method over tokens/s of the target alone, totals over all prompts, same run",
    }
    if target.device.type == "cuda":  # cuDNN's attention is left out of drafting calls in half precision: say so
        metadata["cudnn_attention"] = (
            f"cuDNN {torch.backends.cudnn.version()}, its SDPA kernels "
            f"{'enabled' if torch.backends.cuda.cudnn_sdp_enabled() else 'disabled'} for the process; generate() with "
            "the drafter and target_no_cudnn run without them in float16/bfloat16 (domino_cudnn_attention=False)"
        )
    folder_suffix, decoding = decoding_names(args)
    output_dir = Path(args.output_dir or f"runs/bench/{prompt_set}-{folder_suffix}")
    partial = output_dir / "bench.partial.md"

    def save_partial(result: BenchResult) -> None:  # what a stopped run leaves: the tables of the prompts so far
        result.metadata = metadata
        done = len(next(iter(result.records.values())))
        output_dir.mkdir(parents=True, exist_ok=True)
        partial.write_text(f"Partial: {done} of {len(prompts)} prompts\n\n" + markdown_report(result))

    result = run_benchmark(target, drafter, prompts, methods, settings, progress=args.progress, on_prompt=save_partial)
    if args.static_cache:  # whether transformers compiled it is its own decision (--compile auto): say which it took
        metadata["target_forward"] = "compiled" if hasattr(target, "_compiled_call") else "not compiled"
    result.metadata, result.title = metadata, f"({prompt_set}, {decoding})"
    paths = write_report(result, output_dir)
    partial.unlink(missing_ok=True)
    print(markdown_report(result))
    print("Wrote " + ", ".join(str(path) for path in paths.values()))
    return 0


def _check_mode_flags(args: argparse.Namespace) -> None:
    """Refuses flags of the other mode (per-prompt methods or --batch-size), which that mode would ignore."""
    per_prompt = {
        "--methods": args.methods != list(METHODS),
        "--prompt-lookup-tokens": args.prompt_lookup_tokens != PROMPT_LOOKUP_TOKENS,
        "--num-speculative-tokens": args.num_speculative_tokens is not None,
    }
    if args.batch_size and (given := [flag for flag, changed in per_prompt.items() if changed]):
        raise SystemExit(
            f"hf-domino bench: {' and '.join(given)} set the per-prompt methods, which --batch-size does not run: "
            "name the batched methods with --batch-methods (or drop --batch-size)."
        )
    if not args.batch_size and args.batch_methods != ",".join(BATCH_METHODS):
        raise SystemExit("hf-domino bench: --batch-methods applies to --batch-size runs: add --batch-size, or name "
                         "per-prompt methods with --methods.")  # fmt: skip


def _runnable_methods(methods: list[str], target) -> list[str]:
    """`methods` without those the target cannot run, each named: for a target with recurrent states (Qwen3.5,
    Nemotron-H, ...) the manual loop's cache crop cannot roll them back, and transformers before 5.25 refuses it any
    assistant (its prompt lookup too); generate() with a Domino drafter serves them."""
    if not keeps_recurrent_states(target):
        return methods
    cannot = (
        ("manual",) if TRANSFORMERS_ROLLS_BACK_RECURRENT_STATES else ("prompt_lookup", "transformers_dflash", "manual")
    )
    skipped = [method for method in methods if method in cannot]
    if skipped:
        print(
            f"Skipping {' and '.join(skipped)} for {type(target).__name__}: its recurrent states cannot roll back "
            "rejected drafts there (the manual loop crops a cache; transformers before 5.25 refuses any assistant)."
        )
    return [method for method in methods if method not in skipped]


def _add_baseline(methods: list[str], baseline: str) -> None:
    """Times the target alone a second way, right after `target`, when the run has `target` and not that one."""
    if "target" in methods and baseline not in methods:
        methods.insert(methods.index("target") + 1, baseline)


def _drafter_folder(args: argparse.Namespace) -> None:
    try:
        assets.drafter_folder(args.drafter)
    except FileNotFoundError as error:
        raise SystemExit(f"hf-domino bench: {error}") from None


def _drafter_for(target: PreTrainedModel, args: argparse.Namespace, dtype: torch.dtype) -> DominoForSpeculation:
    """`--drafter` on the target's device (with `--random-weights`, at the target's sizes), or an exit that names why
    it cannot draft for the target, before any run."""
    try:
        drafter = assets.load_drafter(
            args.drafter, dtype=dtype, random_weights=args.random_weights, seed=args.seed, target_config=target.config
        ).to(target.device)  # before the check, which refuses a drafter on another device than its target
        check_drafter_for_target(drafter, target)
    except ValueError as error:
        raise SystemExit(f"hf-domino bench: {error} (--drafter: a drafter folder trained for --target)") from None
    return drafter


def _cpu_fast_path(args: argparse.Namespace, target, drafter) -> str:
    """Prepares both models for CPU decoding unless `--no-cpu-fast-path` or not on a CPU; says what it did."""
    if args.no_cpu_fast_path or target.device.type != "cpu":
        return "off"
    report = prepare_for_cpu_decoding(target, drafter, batch_size=max(args.batch_size or [1]))
    print(f"CPU fast path (--no-cpu-fast-path to turn it off): {report}")
    return str(report)


def _load_prompts(args: argparse.Namespace) -> list:
    """The first --num-prompts prompts of --prompts, saying so where the set holds fewer (the report's rows and
    medians would otherwise stand for a run of the number asked)."""
    conversations = prompt_sets.load_prompts(args.prompts, args.num_prompts)
    if len(conversations) < args.num_prompts:
        print(
            f"Note: --prompts {args.prompts} holds {len(conversations)} prompts, fewer than --num-prompts "
            f"{args.num_prompts}: running {len(conversations)}.",
            file=sys.stderr,
        )
    return conversations


def run_batches(args: argparse.Namespace, metadata: dict[str, Any], dtype: torch.dtype) -> int:
    """`--batch-size`: batched generation with the drafter against the batched target alone, per batch size."""
    methods = [m.strip() for m in args.batch_methods.split(",") if m.strip()]
    if not methods:
        raise SystemExit("hf-domino bench: --batch-methods: give at least one method, e.g. target,domino_lookup.")
    if len(set(methods)) < len(methods):
        raise SystemExit(f"hf-domino bench: --batch-methods: expected each method once, got {args.batch_methods!r}.")
    for method in methods:
        try:
            parse_batch_method(method)
        except ValueError as error:
            raise SystemExit(f"hf-domino bench: --batch-methods: {error}") from None
    if max(args.batch_size) > args.num_prompts:
        raise SystemExit(f"hf-domino bench: --batch-size {max(args.batch_size)} needs --num-prompts at least that.")
    conversations = _load_prompts(args)  # a typo fails before loading
    if max(args.batch_size) > len(conversations):
        raise SystemExit(
            f"hf-domino bench: --batch-size {max(args.batch_size)} needs that many prompts, and --prompts "
            f"{args.prompts} holds {len(conversations)}."
        )
    _drafter_folder(args)
    target, tokenizer = assets.load_target(args.target, gguf_file=args.gguf_file, dtype=dtype, device=args.device)
    drafter = _drafter_for(target, args, dtype)
    for method in methods:  # before any run: its _k<N> and _tree<N> against the drafter's block
        try:
            options = {name: value for name, value in parse_batch_method(method).items() if name != "loop"}
            DominoOptions.resolve(options, None).validate_for(drafter.config)
        except ValueError as error:
            raise SystemExit(f"hf-domino bench: --batch-methods {method}: {error}") from None
    metadata["cpu_fast_path"] = _cpu_fast_path(args, target, drafter)
    if cudnn_attention_applies(target.device, target.dtype):  # the batched target alone with a drafting call's kernels
        _add_baseline(methods, "target_no_cudnn")
    rows = run_batch_benchmark(
        target,
        tokenizer,
        drafter,
        conversations,
        args.batch_size,
        methods,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        warmup_tokens=args.warmup_tokens,
        seed=args.seed,
        repeats=args.repeats,
    )
    table = batch_markdown(rows)
    output_dir = Path(args.output_dir or f"runs/bench/batch-{Path(args.prompts).stem}-T{args.temperature:g}")
    output_dir.mkdir(parents=True, exist_ok=True)
    report = {"command": command_line(args), **metadata, "rows": [vars(row) for row in rows]}
    (output_dir / "batch.json").write_text(json.dumps(report, indent=2))
    print(f"`{report['command']}`\n\n{table}")
    print(f"Wrote {output_dir / 'batch.json'}")
    return 0

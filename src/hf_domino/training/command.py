"""`hf-domino train`: the command line over `train` (and `--eval-only`, over `evaluate_acceptance`).

It loads the target through `hf_domino.assets`, builds the drafter to start from (a fresh one shaped by the
architecture flags, optionally warm-started from the target's top layers, or `--init-from` a checkpoint), reads the
regenerated data, optionally fills a feature cache, trains, and saves `final/` (and an export) once the last step
is done. Rerunning the same command resumes from the latest checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors.torch import load_file

from .. import assets, prompt_sets
from ..cli import non_negative_int, number_in, output_problem, positive_int, seed_int
from ..configuration_domino import DominoConfig
from ..modeling_domino import DRAFT_VOCAB_FILE, DominoForSpeculation
from ..options_domino import check_drafter_config_for_target_config, check_drafter_for_target
from .data import Example, FeatureCache, check_token_ids, data_digests, load_examples
from .evaluate import evaluate_acceptance
from .loop import TrainConfig, init_from_target_layers, train
from .run_folder import (
    CHECKPOINT_PREFIX,
    FINAL_DIR,
    STATE_JSON,
    check_fresh_start,
    check_resumable,
    clear_run,
    latest_checkpoint,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the `hf-domino train` options."""
    target_group = parser.add_argument_group("target")
    target_group.add_argument(
        "--target",
        default="smollm2",
        help="Model id or folder, or an offline name: `smollm2` (default), `qwen2.5-coder-0.5b`.",
    )
    target_group.add_argument("--gguf-file", help="GGUF file inside --target.")

    data = parser.add_argument_group("data")
    data.add_argument("--data", nargs="+", type=Path, help="`hf-domino regenerate` jsonl or `hf-domino pack` files.")
    data.add_argument("--max-examples", type=positive_int, default=None, help="Use only the first examples of --data.")
    data.add_argument(
        "--validation-examples",
        type=non_negative_int,
        default=0,
        help="Hold out the last N examples (after --max-examples): losses and tau~ at every checkpoint.",
    )
    data.add_argument(
        "--generate-tau",
        action="store_true",
        help="Validation also logs generate_tau: the acceptance greedy generate() with whole blocks has on the "
        "held-out answers (every anchor is scored: about 4x the validation time on a CPU; regenerated data only).",
    )
    data.add_argument("--max-length", type=positive_int, default=1024, help="Cut sequences to this many tokens.")
    data.add_argument(
        "--features-only", action="store_true", help="Fill --feature-cache and exit (before concurrent runs)."
    )
    data.add_argument(
        "--feature-cache",
        type=Path,
        help="Folder of precomputed target features (filled first if incomplete). Without it, the target runs "
        "in-process at every step.",
    )

    model = parser.add_argument_group("drafter architecture (new drafters)")
    model.add_argument(
        "--num-draft-layers", type=positive_int, default=1, help="Decoder layers of the drafter's backbone."
    )
    model.add_argument(
        "--block-size", type=positive_int, default=16, help="Tokens per drafted block, the anchor included."
    )
    model.add_argument(
        "--target-layer-ids",
        type=non_negative_int,
        nargs="+",
        default=None,
        help="Target layers whose hidden states feed the drafter (default: DFlash's spacing rule).",
    )
    model.add_argument("--emb-dim", type=positive_int, default=64, help="Rank of the Domino head's logit correction.")
    model.add_argument(
        "--gru-hidden-dim", type=positive_int, default=256, help="Hidden size of the Domino head's GRU."
    )
    model.add_argument(
        "--intermediate-size", type=positive_int, default=None, help="Draft MLP width (default: target's)."
    )
    model.add_argument(
        "--pure-draft-prefix-len",
        type=non_negative_int,
        default=1,
        help="Leading drafts taken from the base logits alone.",
    )
    model.add_argument("--no-domino-head", action="store_true", help="Train a plain DFlash drafter.")
    model.add_argument("--no-shift-label", action="store_true", help="DFlash label convention (B - 1 drafts).")
    model.add_argument("--init-from", type=Path, help="Start from this drafter checkpoint instead of a fresh one.")
    model.add_argument(
        "--init-from-target",
        action="store_true",
        help="Start the draft layers as copies of the target's top layers (init_from_target_layers).",
    )

    optim = parser.add_argument_group("optimization")
    optim.add_argument(
        "--output-dir", type=Path, default=Path("runs/train"), help="Checkpoints, logs and final/ go here."
    )
    optim.add_argument(
        "--total-steps", type=positive_int, default=1000, help="Optimizer steps in all (resumed runs included)."
    )
    optim.add_argument("--batch-size", type=positive_int, default=1, help="Sequences per process and micro step.")
    optim.add_argument(
        "--gradient-accumulation-steps", type=positive_int, default=1, help="Micro steps per optimizer step."
    )
    optim.add_argument("--num-anchors", type=positive_int, default=16, help="Blocks per sequence.")
    optim.add_argument(
        "--anchor-chain",
        action="store_true",
        help="Draw the anchors among the blocks greedy generate() drafts over each answer (where the drafter just "
        "failed, and more of them where it advances little), found by a no-grad pass over every anchor: about "
        "(response tokens / --num-anchors) forwards more per step. Default: uniformly random anchors.",
    )
    optim.add_argument(
        "--lr", type=number_in(0, low_included=False), default=6e-4, help="Peak AdamW learning rate (cosine schedule)."
    )
    optim.add_argument(
        "--warmup-ratio",
        type=number_in(0, 1),
        default=0.04,
        help="Share of the steps with a linear learning-rate warm-up.",
    )
    optim.add_argument(
        "--max-grad-norm", type=number_in(0, low_included=False), default=1.0, help="Clip the gradient norm to this."
    )
    optim.add_argument("--no-curriculum", action="store_true", help="Ablation: lam = 0 (no base loss) throughout.")
    optim.add_argument(
        "--kl-weight",
        type=number_in(0, 1),
        default=0.0,
        help="Distill the target's next-token distribution: this share of each cross-entropy reads it (0 to 1).",
    )
    optim.add_argument(
        "--draft-vocab",
        type=Path,
        help="Train and score drafts over this draft vocabulary only (a draft_vocab.safetensors file, or a drafter "
        "folder with one; `hf-domino draft-vocab` builds it): cuts the LM head's share of each step. The trained "
        "drafter keeps it.",
    )
    optim.add_argument("--seed", type=seed_int, default=0, help="Seed of the initial weights and the block anchors.")
    optim.add_argument("--log-every", type=positive_int, default=10, help="Log losses every this many steps.")
    optim.add_argument("--save-every", type=positive_int, default=100, help="Checkpoint every this many steps.")
    optim.add_argument(
        "--gradient-checkpointing", action="store_true", help="Recompute activations in backward (less memory)."
    )
    optim.add_argument(
        "--stop-after-minutes",
        type=number_in(0, low_included=False),
        default=None,
        help="Checkpoint and stop (resume later).",
    )
    optim.add_argument(
        "--no-resume",
        action="store_true",
        help="Start a new run rather than resume (refused where --output-dir holds another run's checkpoints, logs "
        "or final/: it would mix the two runs).",
    )
    optim.add_argument(
        "--overwrite-output-dir",
        action="store_true",
        help="Start a new run after removing what an earlier one left in --output-dir (its checkpoints, logs and "
        "final/; nothing else).",
    )
    optim.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads per process.")
    optim.add_argument("--export-dir", type=Path, help="Export the finished drafter here (export_drafter).")

    evaluation = parser.add_argument_group("evaluation")
    evaluation.add_argument("--eval-only", action="store_true", help="Measure acceptance lengths of --drafter.")
    evaluation.add_argument(
        "--drafter", type=Path, help="Drafter folder to evaluate (loaded in the target's dtype, as it drafts)."
    )
    evaluation.add_argument(
        "--eval-prompts",
        nargs="+",
        default=["mtbench", "humaneval"],
        help="Prompt sets (mtbench, humaneval, sharegpt, math) or jsonl files to measure on.",
    )
    evaluation.add_argument("--eval-limit", type=positive_int, default=30, help="Prompts per set.")
    evaluation.add_argument("--max-new-tokens", type=positive_int, default=128, help="Tokens generated per prompt.")
    evaluation.add_argument(
        "--head",
        choices=["on", "off", "both"],
        default="both",
        help="Measure with the Domino head, without it (DFlash mode), or both.",
    )
    evaluation.add_argument(
        "--draft-lengths",
        type=positive_int,
        nargs="+",
        default=None,
        help="Drafts verified per cycle, e.g. 2 4 8 16 (default: the whole block); each is measured separately.",
    )
    evaluation.add_argument("--eval-output", type=Path, help="Write the results as json here.")


def run(args: argparse.Namespace) -> int:
    """Run `hf-domino train` with parsed arguments."""
    if args.threads:
        torch.set_num_threads(args.threads)
    from accelerate import PartialState

    # Bad options fail before the target and the data are loaded.
    if args.generate_tau and not args.validation_examples:
        raise SystemExit("--generate-tau scores the held-out answers: give --validation-examples N too.")
    if args.kl_weight > 0 and args.feature_cache:
        raise SystemExit(
            "--kl-weight needs the target's last hidden state, which --feature-cache does not store: drop one of them."
        )
    if not args.eval_only and not args.data:
        raise SystemExit("--data is required for training.")
    if not args.eval_only and (args.draft_lengths or args.eval_output or args.drafter):
        raise SystemExit(
            "--drafter, --draft-lengths and --eval-output belong to --eval-only (a drafter's acceptance): add "
            "--eval-only, or drop them to train (--init-from starts training from a drafter)."
        )
    if args.eval_only and args.max_new_tokens < 2:
        raise SystemExit(
            "--max-new-tokens must be at least 2: the prefill makes the first token, the drafts the rest."
        )
    if problem := output_problem(args.output_dir, folder=True):
        raise SystemExit(f"--output-dir {args.output_dir}: {problem}; give the path of a folder for the checkpoints.")
    if args.eval_output and (problem := output_problem(args.eval_output)):
        raise SystemExit(f"--eval-output {args.eval_output}: {problem}; give the path of a json file to write.")
    if args.features_only and not args.feature_cache:
        raise SystemExit("--features-only fills a feature cache and trains nothing: give --feature-cache DIR too.")
    _check_checkpoints_left(args)
    if args.no_resume and not (args.overwrite_output_dir or args.eval_only or args.features_only):
        _exit_on_value_error(check_fresh_start, args.output_dir)
    missing = [str(path) for path in args.data or () if not path.exists()]
    if missing:
        raise FileNotFoundError(
            f"--data {' '.join(missing)}: no such file (answers from `hf-domino regenerate`, or `hf-domino pack` files)."
        )
    draft_vocab = _read_draft_vocab(args.draft_vocab) if args.draft_vocab else None
    examples, validation = _examples_from_args(args) if not args.eval_only else ([], [])
    target_model, tokenizer = assets.load_target(args.target, gguf_file=args.gguf_file, device="cpu")
    if args.eval_only:
        return _run_eval(args, target_model, tokenizer)

    drafter = _drafter_from_args(args, target_model)
    if draft_vocab is not None:
        drafter.set_draft_vocab(draft_vocab)
    check_token_ids([*examples, *validation], target_model.get_input_embeddings().num_embeddings)
    config = TrainConfig(
        total_steps=args.total_steps,
        batch_size=args.batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        num_anchors=args.num_anchors,
        max_length=args.max_length,
        learning_rate=args.lr,
        warmup_ratio=args.warmup_ratio,
        max_grad_norm=args.max_grad_norm,
        curriculum=not args.no_curriculum,
        kl_weight=args.kl_weight,
        draft_vocab=draft_vocab is not None,
        anchor_chain=args.anchor_chain,
        generate_tau=args.generate_tau,
        seed=args.seed,
        log_every=args.log_every,
        save_every=args.save_every,
        gradient_checkpointing=args.gradient_checkpointing,
        stop_after_seconds=args.stop_after_minutes * 60 if args.stop_after_minutes else None,
    )
    resume = _resumes(args)
    checkpoint = latest_checkpoint(args.output_dir) if resume else None
    if checkpoint is not None:
        _exit_on_value_error(
            check_resumable, checkpoint, drafter, config, PartialState().num_processes,
            data=data_digests(examples, validation),
        )  # fmt: skip
    feature_cache = None
    if args.feature_cache:
        # Safe to call from every process (and from concurrent runs): a file lock lets one fill it at a time.
        feature_cache = FeatureCache.build(
            args.feature_cache, target_model, examples, drafter.config.target_layer_ids, args.max_length
        )
        if args.features_only:
            return 0
    if args.overwrite_output_dir:
        if PartialState().is_main_process:
            clear_run(args.output_dir)
        PartialState().wait_for_everyone()
    PartialState().print(
        f"Training {sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M-parameter drafter on {len(examples)} "
        f"examples ({sum(sum(e.loss_mask) for e in examples)} response tokens) for {config.total_steps} steps.",
        flush=True,
    )
    drafter = train(
        drafter,
        target_model,
        examples,
        config,
        args.output_dir,
        feature_cache=feature_cache,
        resume=resume,
        pad_token_id=assets.pad_token_id(target_model, tokenizer),
        validation_examples=validation,
    )
    finished = latest_checkpoint(args.output_dir)
    if PartialState().is_main_process and finished is not None:
        if finished.name == f"{CHECKPOINT_PREFIX}{config.total_steps}":
            drafter.save_pretrained(args.output_dir / FINAL_DIR)
            if args.export_dir:
                from ..export import export_drafter

                export_drafter(drafter, args.export_dir, base_model=assets.hub_id(args.target), overwrite=True)
    return 0


def _resumes(args: argparse.Namespace) -> bool:
    """Whether the command takes up a run left in --output-dir: it trains (--eval-only measures a drafter,
    --features-only fills the cache alone: the run folder is no business of theirs) and neither starts over nor clears
    the folder."""
    return not (args.eval_only or args.features_only or args.no_resume or args.overwrite_output_dir)


def _check_checkpoints_left(args: argparse.Namespace) -> None:
    """A checkpoint in --output-dir of a run with other --total-steps (the schedule spans them), or past this run's
    (resumed from, the run would train nothing and write no final drafter), refused before anything loads."""
    if not _resumes(args) or not args.output_dir.is_dir():
        return
    latest = latest_checkpoint(args.output_dir)
    if latest is None:
        return
    step = int(latest.name.removeprefix(CHECKPOINT_PREFIX))
    total = json.loads((latest / STATE_JSON).read_text()).get("train_config", {}).get("total_steps")
    if total is not None and total != args.total_steps:
        raise SystemExit(
            f"{latest} belongs to a run of --total-steps {total}, over which its learning-rate schedule and "
            f"curriculum run: give --total-steps {total} to resume it, or a new --output-dir (with --init-from "
            f"{latest} to start a new run from its weights)."
        )
    if step > args.total_steps:
        raise SystemExit(
            f"{latest} is at step {step}, past --total-steps {args.total_steps}: give --total-steps {step} or more to "
            "resume from it, or a new --output-dir."
        )


def _exit_on_value_error(check, *args, **options) -> None:
    """Runs a check of the run's folder, turning its refusal into the command's exit message."""
    try:
        check(*args, **options)
    except ValueError as error:
        raise SystemExit(f"hf-domino train: {error}") from None


def _read_draft_vocab(path: Path) -> torch.Tensor:
    """`--draft-vocab`: the token ids in the file itself, or in the one inside a drafter folder; read before any loading."""
    file = path / DRAFT_VOCAB_FILE if path.is_dir() else path
    if not file.is_file():
        raise SystemExit(f"--draft-vocab {path}: no such file. Build one with `hf-domino draft-vocab`.")
    try:
        tensors = load_file(file)
    except Exception as error:  # safetensors raises its own error types for files that are not safetensors
        raise SystemExit(f"--draft-vocab {file} is not a safetensors file ({error}).") from error
    if "draft_vocab" not in tensors:
        raise SystemExit(
            f"--draft-vocab {file} holds no `draft_vocab` tensor; build one with `hf-domino draft-vocab`."
        )
    return tensors["draft_vocab"]


def _examples_from_args(args: argparse.Namespace) -> tuple[list[Example], list[Example]]:
    """The training examples and the held-out ones (`--max-examples`, then the last `--validation-examples`)."""
    examples = load_examples(args.data, args.max_length)
    if args.max_examples:
        examples = examples[: args.max_examples]
    if not args.validation_examples:
        return examples, []
    if not 0 < args.validation_examples < len(examples):
        raise SystemExit(
            f"--validation-examples {args.validation_examples} must be between 1 and the number of examples "
            f"minus one ({len(examples) - 1})."
        )
    return examples[: -args.validation_examples], examples[-args.validation_examples :]


def _drafter_from_args(args: argparse.Namespace, target_model: PreTrainedModel) -> DominoForSpeculation:
    """The drafter to train: a checkpoint (`--init-from`), or a fresh one shaped by the architecture flags."""
    if args.init_from and args.init_from_target:
        raise SystemExit("--init-from and --init-from-target exclude each other: pick one starting point.")
    if args.init_from:
        # fp32 master weights whatever the checkpoint was saved in (exports are often fp16).
        return _drafter_for(args.init_from, "--init-from", target_model, dtype=torch.float32)
    backbone = {"intermediate_size": args.intermediate_size} if args.intermediate_size else {}
    try:
        config = DominoConfig.from_target(
            target_model.config,
            num_hidden_layers=args.num_draft_layers,
            block_size=args.block_size,
            target_layer_ids=args.target_layer_ids,
            with_domino_head=not args.no_domino_head,
            emb_dim=args.emb_dim,
            gru_hidden_dim=args.gru_hidden_dim,
            pure_draft_prefix_len=args.pure_draft_prefix_len,
            shift_label=False if args.no_shift_label else None,
            **backbone,
        )
        check_drafter_config_for_target_config(config, target_model.config)
    except (ValueError, StrictDataclassError) as error:
        # huggingface_hub wraps a validator's ValueError in an error of its own: the ValueError says it.
        reason = error.__cause__ if isinstance(error.__cause__, ValueError) else error
        raise SystemExit(f"hf-domino train: the drafter the architecture flags describe: {reason}") from None
    torch.manual_seed(args.seed)
    drafter = DominoForSpeculation(config)
    if args.init_from_target:
        from accelerate import PartialState

        try:
            copied = init_from_target_layers(drafter, target_model)
        except ValueError as error:
            raise SystemExit(f"hf-domino train: {error}") from None
        PartialState().print(f"Draft layers start as copies of target layers {copied}.")
    return drafter


def _drafter_for(path: str, flag: str, target_model: PreTrainedModel, **kwargs) -> DominoForSpeculation:
    """The drafter folder a flag names, or an exit that says why it cannot serve `--target`, before any work."""
    try:
        drafter = DominoForSpeculation.from_pretrained(assets.drafter_folder(path), **kwargs)
        check_drafter_for_target(drafter, target_model)
    except (FileNotFoundError, ValueError) as error:
        raise SystemExit(f"hf-domino train: {flag} {path}: {error}") from None
    return drafter


def _run_eval(args: argparse.Namespace, target_model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> int:
    """`--eval-only`: acceptance lengths of `--drafter` per prompt set, head on and/or off, optionally as json."""
    if args.drafter is None:
        raise SystemExit("--eval-only needs --drafter.")
    # In the target's dtype, as drafting runs once prepared (a float16 folder would otherwise draft in float16).
    drafter = _drafter_for(args.drafter, "--drafter", target_model, dtype=target_model.dtype).eval()
    heads = {"on": [True], "off": [False], "both": [True, False]}[args.head]
    if not drafter.config.has_domino_head:
        heads = [False]
    draft_lengths = args.draft_lengths or [drafter.config.num_drafts]
    if bad := [k for k in draft_lengths if not 1 <= k <= drafter.config.num_drafts]:
        raise SystemExit(f"--draft-lengths {bad}: each must be between 1 and the block's {drafter.config.num_drafts}.")
    results = {}
    for name in args.eval_prompts:
        prompts = prompt_sets.load_prompts(name, limit=args.eval_limit)
        for head, k in itertools.product(heads, draft_lengths):
            with drafter.domino_head(head) if drafter.config.has_domino_head else contextlib.nullcontext():
                result = evaluate_acceptance(target_model, tokenizer, drafter, prompts, args.max_new_tokens, k)
            key = f"{Path(str(name)).stem}/head_{'on' if head else 'off'}/k{k}"
            results[key] = result.to_dict()
            print(
                f"{key}: acceptance length {result.mean_acceptance_length:.3f} over {len(prompts)} prompts "
                f"({result.new_tokens} tokens, {result.seconds:.0f}s)",
                flush=True,
            )
    if args.eval_output:
        args.eval_output.parent.mkdir(parents=True, exist_ok=True)
        args.eval_output.write_text(json.dumps(results, indent=2))
    return 0

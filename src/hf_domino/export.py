"""Hub-ready export of a drafter: safetensors weights, config with `auto_map`, remote code and a model card.

`save_pretrained` alone already writes the weights (published tensor names), the config (in the layout the reference
implementation and SGLang read, see docs/model.md) and the remote-code files. `export_drafter` adds the target's
tokenizer (so that `pipeline(..., assistant_model="path")` finds one) and a model card, writes everything atomically
(the folder appears complete or not at all), and warns when SGLang could not serve the result as it stands.
`layout="transformers-dflash"` writes a DFlash drafter in transformers' own DFlash layout instead
(`to_transformers_dflash`: no remote code, for `generate(..., speculation_type="dflash")`), with a card of its own.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import ModelCard, ModelCardData

from .modeling_domino import DominoForSpeculation
from .sglang_serving import ServingCompatibilityWarning, sglang_serving_problems
from .transformers_dflash import from_transformers_dflash, to_transformers_dflash

# What `export_drafter` writes: our layout (the published DFlash/Domino one, with our remote code), or transformers'
# own DFlash assistant's.
LAYOUTS = ("hf-domino", "transformers-dflash")

CARD_TEMPLATE = """\
---
{card_data}
---

# {title}

A speculative-decoding drafter for [{base_model}](https://huggingface.co/{base_model}), in the
{kind} format ([Domino](https://arxiv.org/abs/2605.29707) on a [DFlash](https://arxiv.org/abs/2602.06036)
backbone). It drafts {num_drafts} tokens per target forward in one parallel pass{head_sentence}
Verification is transformers' own assisted decoding: greedy output is identical to the target alone, and
sampling keeps the target's distribution.

## Usage

```python
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer, pipeline

target = AutoModelForCausalLM.from_pretrained("{base_model}")
tokenizer = AutoTokenizer.from_pretrained("{base_model}")
# The target's device and dtype: an fp16 drafter next to an fp32 target is the slow case on a CPU.
drafter = AutoModel.from_pretrained("{repo_id}", trust_remote_code=True).to(target.device, target.dtype)

messages = [{{"role": "user", "content": "Explain speculative decoding in one paragraph."}}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
inputs = inputs.to(target.device)
# Greedy (do_sample=False): the output is exactly the target's own; with sampling it follows the target's law.
output = target.generate(**inputs, assistant_model=drafter, max_new_tokens=256, do_sample=False)
print(tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
print("tokens per target forward:", drafter.last_generation_stats.mean_acceptance_length)

# device=target.device keeps the target beside the drafter (a pipeline moves its model to a GPU by default)
generator = pipeline(
    "text-generation", model=target, tokenizer=tokenizer, assistant_model=drafter, device=target.device
)
print(generator(messages, max_new_tokens=256, do_sample=False)[0]["generated_text"][-1]["content"])  # the same text
```

With `pip install hf-domino`, `hf_domino.DominoForSpeculation.from_pretrained(...)` makes `trust_remote_code`
unnecessary. Options per call: `target.generate(..., assistant_model=drafter, domino_head=False)` drafts with the
Domino head switched off (DFlash mode, same weights); by default the number of drafts verified per target forward
is chosen per block from the measured cost of verification and the drafts' confidence (`draft_policy="fixed",
num_speculative_tokens=16` verifies whole blocks), and where the text repeats (the last 3 or 2 tokens occurred
before) the tokens that followed are verified instead of a drafted block, else, when the folder has a
`draft_datastore.safetensors`, the continuation the target's own earlier answers share after the last 4, 3 or 2 tokens
(`domino_datastore=False`: copies only; `domino_lookup=False`: the drafter's drafts only). On a CPU, what verifying costs depends on the machine: where
eager PyTorch packs each weight matrix again for every product over more than one row, a forward over 2-3 tokens costs
1.6-2x a single token and the policy takes plain target steps almost everywhere (about the target's own speed); where
it does not (CPUs with AMX, for one), 2-3 tokens cost about one and drafting pays as it is. With `pip install
hf-domino`, one line before `generate()`, `hf_domino.prepare_for_cpu_decoding(target, drafter)` (oneDNN-prepacked
weights where they measure faster; same weights, same output) makes verifying a few drafts cost about one step on
either kind; the first `generate()` with the drafter on an unprepared CPU target where it would pay says so once.

## Drafter

| | |
|---|---|
{shape_rows}
{results_section}{training_section}"""


TRANSFORMERS_DFLASH_CARD_TEMPLATE = """\
---
{card_data}
---

# {title}

A speculative-decoding drafter for [{base_model}](https://huggingface.co/{base_model}) in transformers' own DFlash
layout (`MuseGlimmerAssistantModel`; [DFlash](https://arxiv.org/abs/2602.06036)): it drafts {num_drafts} tokens per
target forward in one parallel pass from the target's hidden states, and transformers' assisted decoding verifies
them: greedy output is identical to the target alone, and sampling keeps the target's distribution. It loads without
remote code.

## Usage

```python
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

target = AutoModelForCausalLM.from_pretrained("{base_model}")
tokenizer = AutoTokenizer.from_pretrained("{base_model}")
drafter = AutoModel.from_pretrained("{repo_id}").to(target.device, target.dtype)

messages = [{{"role": "user", "content": "Explain speculative decoding in one paragraph."}}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
inputs = inputs.to(target.device)
# Greedy (do_sample=False): the output is exactly the target's own.
output = target.generate(
    **inputs, assistant_model=drafter, speculation_type="dflash", max_new_tokens=256, do_sample=False
)
print(tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
```

transformers verifies a whole block at every target forward, one sequence at a time. With `pip install hf-domino`,
`hf_domino.DominoForSpeculation.from_pretrained("{repo_id}")` loads the same weights as its drafter
(`target.generate(..., assistant_model=drafter)`, no `speculation_type`): the same drafts per block, plus batches,
a draft length chosen per block from what verifying costs, and drafts copied from the text.

## Drafter

| | |
|---|---|
{shape_rows}
{results_section}{training_section}"""
# Rows of `drafter_shape` that a transformers-layout folder does not carry.
NOT_IN_TRANSFORMERS_LAYOUT = (
    "Domino head",
    "GRU hidden / correction rank",
    "pure draft prefix",
    "draft vocabulary",
    "datastore",
)


def drafter_shape(drafter: DominoForSpeculation, dtype: torch.dtype | None = None) -> dict[str, Any]:
    config = drafter.config
    shape = {
        "draft layers": config.num_hidden_layers,
        "hidden size": config.hidden_size,
        "attention heads (kv)": f"{config.num_attention_heads} ({config.num_key_value_heads})",
        "MLP width": config.intermediate_size,
        "block size": config.block_size,
        "drafts per block": config.num_drafts,
        "target layers read": config.target_layer_ids,
        "Domino head": "yes" if config.has_domino_head else "no (DFlash)",
    }
    if config.has_domino_head:
        shape["GRU hidden / correction rank"] = f"{config.gru_hidden_dim} / {config.emb_dim}"
        shape["pure draft prefix"] = config.pure_draft_prefix_len
    if drafter.draft_vocab is not None:
        shape["draft vocabulary"] = f"{drafter.draft_vocab.numel()} of {config.vocab_size} tokens"
    if drafter.datastore is not None:
        tokens = int((drafter.datastore.tokens >= 0).sum())
        shape["datastore"] = f"{tokens:,} tokens the target wrote (`draft_datastore.safetensors`)"
    shape["parameters"] = f"{sum(p.numel() for p in drafter.parameters()) / 1e6:.1f}M"
    shape["dtype"] = str(dtype or drafter.dtype).removeprefix("torch.")
    return shape


def _markdown_table(rows: list[dict[str, Any]]) -> str:
    columns = list(dict.fromkeys(column for row in rows for column in row))  # a column only later rows name kept too
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def model_card(
    drafter: DominoForSpeculation,
    *,
    base_model: str,
    repo_id: str = "<this-repo>",
    license: str = "apache-2.0",
    results: list[dict[str, Any]] | None = None,
    training_summary: str | None = None,
    dtype: torch.dtype | None = None,
    layout: str = "hf-domino",
) -> ModelCard:
    """The drafter's Hub model card: YAML metadata, usage for generate() and pipeline() (transformers' own DFlash
    path for `layout="transformers-dflash"`), shape, results."""
    config = drafter.config
    native = layout == "transformers-dflash"
    card_data = ModelCardData(
        library_name="transformers",
        base_model=base_model,
        pipeline_tag="text-generation",
        license=license,
        tags=["speculative-decoding", "domino" if config.has_domino_head else "dflash", "hf-domino", "drafter"],
    )
    head_sentence = (
        ", then fixes the block's causal consistency with the Domino head (a GRU over the drafted tokens and a "
        "low-rank logit correction)."
        if config.has_domino_head
        else "."
    )
    results_section = f"\n## Results\n\n{_markdown_table(results)}\n" if results else ""
    training_section = f"\n## Training\n\n{training_summary}\n" if training_summary else ""
    shape = drafter_shape(drafter, dtype)
    if native:
        shape = {key: value for key, value in shape.items() if key not in NOT_IN_TRANSFORMERS_LAYOUT}
    content = (TRANSFORMERS_DFLASH_CARD_TEMPLATE if native else CARD_TEMPLATE).format(
        card_data=card_data.to_yaml(),
        title=f"{base_model.split('/')[-1]} {'Domino' if config.has_domino_head else 'DFlash'} drafter"
        + (" (transformers' DFlash layout)" if native else ""),
        base_model=base_model,
        repo_id=repo_id,
        kind="Domino" if config.has_domino_head else "DFlash",
        num_drafts=config.num_drafts,
        head_sentence=head_sentence,
        shape_rows="\n".join(f"| {key} | {value} |" for key, value in shape.items()),
        results_section=results_section,
        training_section=training_section,
    )
    return ModelCard(content)


def export_drafter(
    drafter: DominoForSpeculation,
    output_dir: str | Path,
    *,
    base_model: str,
    tokenizer=None,
    results: list[dict[str, Any]] | None = None,
    training_summary: str | None = None,
    repo_id: str | None = None,
    license: str = "apache-2.0",
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    layout: str = "hf-domino",
    drop_domino_head: bool = False,
) -> Path:
    """Writes a Hub-ready drafter folder: weights, config, remote code, model card and (optionally) the tokenizer.

    Args:
        drafter: the drafter to export (left unchanged; `dtype` converts a copy of the weights).
        output_dir: the folder to create; an existing non-empty folder is refused unless `overwrite=True`.
        base_model: the target's Hub id, for the card's metadata and usage snippet.
        tokenizer: the target's tokenizer, saved alongside so `pipeline(assistant_model="path")` works.
        results: rows for the card's results table (e.g. `{"prompts": "MT-Bench", "acceptance length": 3.2}`).
        training_summary: a paragraph on how the drafter was trained.
        dtype: save the weights in this dtype (e.g. `torch.float16` to halve the size).
        layout: `"hf-domino"` (the published DFlash/Domino layout, with our remote code), or `"transformers-dflash"`
            (transformers' own DFlash assistant, for `generate(..., speculation_type="dflash")`, no remote code: a
            `shift_label=False` drafter without a Domino head; `to_transformers_dflash` raises a `ValueError` for
            others, before anything is written). Draft vocabulary and datastore stay out of the second.
        drop_domino_head: with `layout="transformers-dflash"`, write a `shift_label=False` drafter's backbone without
            its Domino head (transformers' assistant has none; it drafts as `domino_head=False` does here).
    """
    # By name: a drafter loaded through a folder's remote code is the class of that code, and exports alike.
    if type(drafter).__name__ != DominoForSpeculation.__name__:
        raise TypeError(
            f"export_drafter writes a DominoForSpeculation drafter, got a {type(drafter).__name__}: pass the drafter "
            "(DominoForSpeculation.from_pretrained(path)), not its target."
        )
    # The real folder: a symlink is followed, and "." gets its name (the staging folder sits beside it).
    output_dir = Path(output_dir).resolve()
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: choose among {', '.join(LAYOUTS)}.")
    if drop_domino_head and layout != "transformers-dflash":
        raise ValueError(
            "drop_domino_head=True (--drop-domino-head) applies to layout='transformers-dflash' only: the hf-domino "
            "layout keeps the Domino head (a drafter drafts without it when called with domino_head=False)."
        )
    if problem := _output_problem(output_dir, overwrite, "overwrite=True"):
        raise FileExistsError(f"{problem}.")
    native = layout == "transformers-dflash"
    model = to_transformers_dflash(drafter, drop_domino_head=drop_domino_head) if native else drafter
    if dtype is not None and dtype != model.dtype:  # converted in a copy: the caller's weights keep every bit
        model = copy.deepcopy(model).to(dtype)
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=output_dir.parent, prefix=f".{output_dir.name}.") as staging:
        staging_dir = Path(staging) / "drafter"
        model.save_pretrained(staging_dir)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging_dir)
        card = model_card(
            from_transformers_dflash(model) if native else drafter,  # what the folder holds
            base_model=base_model,
            repo_id=repo_id or output_dir.name,
            license=license,
            results=results,
            training_summary=training_summary,
            dtype=dtype,
            layout=layout,
        )
        card.save(staging_dir / "README.md")
        _apply_umask_permissions(staging_dir)
        problems = sglang_serving_problems(staging_dir) if layout == "hf-domino" else []
        _replace_folder(output_dir, staging_dir, Path(staging) / "replaced")
    if problems:
        warnings.warn(
            f"SGLang cannot serve {output_dir} as it stands (the folder works with transformers):\n- "
            + "\n- ".join(problems),
            ServingCompatibilityWarning,
            stacklevel=2,
        )
    return output_dir


def _output_problem(output_dir: Path, overwrite: bool, overwrite_option: str) -> str | None:
    """Why `output_dir` cannot take an export, if it cannot (`overwrite_option`: how the caller spells overwrite)."""
    output_dir = output_dir.resolve()
    if Path.cwd().is_relative_to(output_dir):
        return (
            f"{output_dir} is the current folder or holds it, which an export replaces whole: write to a new "
            "folder (e.g. ./drafter)"
        )
    if output_dir.exists() and not output_dir.is_dir():
        return f"{output_dir} is a file: give the path of a folder to write"
    if output_dir.exists() and any(output_dir.iterdir()) and not overwrite:
        return f"{output_dir} exists and is not empty; pass {overwrite_option} to replace it"
    return None


def _replace_folder(output_dir: Path, new_dir: Path, aside: Path) -> None:
    """Puts `new_dir` at `output_dir`, an existing folder there moved `aside` first (deleted with the staging folder
    once the new one is in place): two renames, so an interrupt never leaves neither folder."""
    if output_dir.exists():
        output_dir.rename(aside)
    try:
        new_dir.rename(output_dir)
    except BaseException:
        if aside.exists():
            aside.rename(output_dir)
        raise


def _apply_umask_permissions(folder: Path) -> None:
    # The staging folder comes from `tempfile` (private, 0700/0600): give the export the permissions a plain
    # `mkdir`/`open` would have had.
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


# ------------------------------------------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("drafter", help="folder of a trained drafter (any supported checkpoint format)")
    parser.add_argument("output", help="folder to write")
    parser.add_argument("--base-model", required=True, help="the target's Hub id, e.g. Qwen/Qwen3-8B")
    parser.add_argument(
        "--tokenizer",
        help="the target's tokenizer, saved alongside so that pipeline(assistant_model=OUTPUT) finds one: "
        "an offline target name ('smollm2', 'qwen2.5-coder-0.5b'), or a Hugging Face model id or folder",
    )
    parser.add_argument("--tokenizer-gguf-file", help="GGUF file inside the --tokenizer folder to read it from")
    parser.add_argument("--results", help="JSON file with a list of result rows for the model card")
    parser.add_argument("--training-summary", help="text file with a paragraph on training")
    parser.add_argument(
        "--repo-id",
        help="the Hub repository the folder will be uploaded to (org/name), for the card's usage code (default: the "
        "output folder's name, which loads from the folder above it only)",
    )
    parser.add_argument("--license", default="apache-2.0", help="the card's license, a Hub license id")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="convert the weights")
    parser.add_argument("--overwrite", action="store_true", help="replace OUTPUT if it exists and is not empty")
    parser.add_argument(
        "--layout",
        choices=LAYOUTS,
        default="hf-domino",
        help="hf-domino: the published DFlash/Domino layout with our remote code; transformers-dflash: transformers' "
        "own DFlash assistant (generate(..., speculation_type='dflash'), no remote code; a shift_label=False drafter "
        "without a Domino head)",
    )
    parser.add_argument(
        "--drop-domino-head",
        action="store_true",
        help="with --layout transformers-dflash: write a shift_label=False drafter's backbone without its Domino head",
    )


def run(args: argparse.Namespace) -> int:
    from .assets import check_model_reference, drafter_folder, load_tokenizer

    # Bad input fails before anything loads: each exit names the file and the fix.
    output = Path(args.output)
    if problem := _output_problem(output, args.overwrite, "--overwrite"):
        raise SystemExit(f"hf-domino export: {problem}.")
    if args.tokenizer_gguf_file and not args.tokenizer:
        raise SystemExit(
            "hf-domino export: --tokenizer-gguf-file names a file inside --tokenizer's folder; pass both."
        )
    if args.tokenizer:
        check_model_reference(args.tokenizer)
    results = _result_rows(Path(args.results)) if args.results else None
    training_summary = Path(args.training_summary).read_text() if args.training_summary else None
    try:
        drafter = DominoForSpeculation.from_pretrained(drafter_folder(args.drafter))
    except ValueError as error:  # a folder whose config and weights disagree, ...: the loader names it
        raise SystemExit(f"hf-domino export: {args.drafter}: {error}") from None
    tokenizer = load_tokenizer(args.tokenizer, gguf_file=args.tokenizer_gguf_file) if args.tokenizer else None
    try:
        export_drafter(
            drafter,
            output,
            base_model=args.base_model,
            tokenizer=tokenizer,
            results=results,
            training_summary=training_summary,
            repo_id=args.repo_id,
            license=args.license,
            dtype=getattr(torch, args.dtype) if args.dtype else None,
            overwrite=args.overwrite,
            layout=args.layout,
            drop_domino_head=args.drop_domino_head,
        )
    except ValueError as error:  # a drafter the layout cannot hold: nothing was written
        raise SystemExit(f"hf-domino export --layout {args.layout}: {error}") from None
    print(f"wrote {args.output}")
    return 0


def _result_rows(path: Path) -> list[dict[str, Any]]:
    """`--results`: a JSON list of objects, one row of the card's results table each."""
    try:
        rows = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise SystemExit(f"hf-domino export: --results {path} is not JSON ({error}).") from None
    if not isinstance(rows, list) or not rows or not all(isinstance(row, dict) for row in rows):
        raise SystemExit(
            f"hf-domino export: --results {path} must hold a non-empty JSON list of objects, one row of the card's "
            'results table each, e.g. [{"prompts": "MT-Bench", "acceptance length": 2.1}].'
        )
    return rows

"""Hub-ready export of a drafter: safetensors weights, config with `auto_map`, remote code and a model card.

`save_pretrained` alone already writes the weights (published tensor names), the config (with `dflash_config` for the
reference implementation) and the remote-code files. `export_drafter` adds the target's tokenizer (so that
`pipeline(..., assistant_model="path")` finds one) and a model card, and writes everything atomically: the folder
appears complete or not at all.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import ModelCard, ModelCardData

from .modeling_domino import DominoForSpeculation

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
drafter = AutoModel.from_pretrained("{repo_id}", trust_remote_code=True)

messages = [{{"role": "user", "content": "Explain speculative decoding in one paragraph."}}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
output = target.generate(**inputs, assistant_model=drafter, max_new_tokens=256)
print(tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
print("tokens per target forward:", drafter.last_generation_stats.mean_acceptance_length)

generator = pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=drafter)
print(generator(messages, max_new_tokens=64)[0]["generated_text"][-1]["content"])
```

With `pip install hf-domino`, `import hf_domino` makes `trust_remote_code` unnecessary. Drafting with the Domino head
switched off (DFlash mode, same weights): `with drafter.domino_head(False): target.generate(...)`.

## Drafter

| | |
|---|---|
{shape_rows}
{results_section}{training_section}"""


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
    shape["parameters"] = f"{sum(p.numel() for p in drafter.parameters()) / 1e6:.1f}M"
    shape["dtype"] = str(dtype or drafter.dtype).removeprefix("torch.")
    return shape


def _markdown_table(rows: list[dict[str, Any]]) -> str:
    columns = list(rows[0])
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
) -> ModelCard:
    """The drafter's Hub model card: YAML metadata, usage for generate() and pipeline(), shape, results."""
    config = drafter.config
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
    content = CARD_TEMPLATE.format(
        card_data=card_data.to_yaml(),
        title=f"{base_model.split('/')[-1]} {'Domino' if config.has_domino_head else 'DFlash'} drafter",
        base_model=base_model,
        repo_id=repo_id,
        kind="Domino" if config.has_domino_head else "DFlash",
        num_drafts=config.num_drafts,
        head_sentence=head_sentence,
        shape_rows="\n".join(f"| {key} | {value} |" for key, value in drafter_shape(drafter, dtype).items()),
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
    """
    output_dir = Path(output_dir)
    if output_dir.exists() and any(output_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"{output_dir} exists and is not empty; pass overwrite=True to replace it.")
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=output_dir.parent, prefix=f".{output_dir.name}.") as staging:
        staging_dir = Path(staging) / "drafter"
        original_dtype = drafter.dtype
        try:
            if dtype is not None:
                drafter.to(dtype)
            drafter.save_pretrained(staging_dir)
        finally:
            drafter.to(original_dtype)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging_dir)
        card = model_card(
            drafter,
            base_model=base_model,
            repo_id=repo_id or output_dir.name,
            license=license,
            results=results,
            training_summary=training_summary,
            dtype=dtype,
        )
        card.save(staging_dir / "README.md")
        _apply_umask_permissions(staging_dir)
        if output_dir.exists():
            shutil.rmtree(output_dir)
        staging_dir.rename(output_dir)
    return output_dir


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
    parser.add_argument("--tokenizer", help="tokenizer folder or id to save alongside (the target's)")
    parser.add_argument("--results", help="JSON file with a list of result rows for the model card")
    parser.add_argument("--training-summary", help="text file with a paragraph on training")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="convert the weights")
    parser.add_argument("--overwrite", action="store_true")


def run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    drafter = DominoForSpeculation.from_pretrained(args.drafter)
    export_drafter(
        drafter,
        args.output,
        base_model=args.base_model,
        tokenizer=AutoTokenizer.from_pretrained(args.tokenizer) if args.tokenizer else None,
        results=json.loads(Path(args.results).read_text()) if args.results else None,
        training_summary=Path(args.training_summary).read_text() if args.training_summary else None,
        dtype=getattr(torch, args.dtype) if args.dtype else None,
        overwrite=args.overwrite,
    )
    print(f"wrote {args.output}")
    return 0

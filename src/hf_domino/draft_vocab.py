"""`hf-domino draft-vocab`: give a drafter a draft vocabulary (FR-Spec, arXiv 2502.14856).

Drafting computes base logits (the target's LM head) and Domino-head corrections over the whole vocabulary at every
drafted position; on a 49k- or 152k-token vocabulary that is the largest drafting cost on a CPU. Most of those
logits are for tokens that almost never occur, so a draft vocabulary keeps only the most frequent tokens. The target
still verifies every draft, so greedy output is unchanged; when sampling, the draft distribution is zero outside the
subset and speculative sampling stays exact. Only acceptance can suffer, where the target's next token is rare.

Frequencies are counted on target-regenerated training data (`hf-domino regenerate` files: response tokens only),
or, where none is at hand, on the assistant turns of ShareGPT tokenized with the target's tokenizer. The special
tokens of the tokenizer (EOS in particular) are always kept. The drafter folder is copied unchanged and
`draft_vocab.safetensors` written beside its weights (see `DominoForSpeculation.set_draft_vocab`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

from . import assets, prompt_sets
from .cli import positive_int
from .modeling_domino import DRAFT_VOCAB_FILE

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def count_tokens(sequences: Iterable[Sequence[int]], vocab_size: int) -> torch.Tensor:
    """How often each token id occurs in `sequences`: `[vocab_size]` int64. An id outside the vocabulary is a
    `ValueError`: the sequences were tokenized for another model than the drafter's target."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for sequence in sequences:
        if len(sequence):
            ids = torch.as_tensor(sequence, dtype=torch.long)
            if int(ids.max()) >= vocab_size or int(ids.min()) < 0:
                raise ValueError(
                    f"token id {int(ids.max()) if int(ids.max()) >= vocab_size else int(ids.min())} is outside the "
                    f"drafter's {vocab_size}-token vocabulary: count tokens of the drafter's own target (its "
                    "tokenizer for --target, its regenerated answers for --data)."
                )
            counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def most_frequent(counts: torch.Tensor, size: int, always: Iterable[int] = ()) -> torch.Tensor:
    """The `size` most frequent token ids (ties to the lower id), always including `always`; sorted."""
    always = sorted({int(token) for token in always if 0 <= int(token) < counts.numel()})
    if not len(always) <= size <= counts.numel():
        raise ValueError(
            f"A draft vocabulary of {size} tokens must hold the {len(always)} special tokens and fit in "
            f"the {counts.numel()}-token vocabulary."
        )
    order = sorted(range(counts.numel()), key=lambda token: (-int(counts[token]), token))
    chosen = list(always)
    seen = set(always)
    for token in order:
        if len(chosen) == size:
            break
        if token not in seen:
            chosen.append(token)
            seen.add(token)
    return torch.tensor(sorted(chosen), dtype=torch.long)


def regenerated_response_ids(paths: Sequence[str | os.PathLike]) -> Iterator[list[int]]:
    """The response tokens (loss_mask 1) of `hf-domino regenerate` jsonl files or `hf-domino pack` files."""
    from .training.packed import iter_records

    for path in paths:
        for record in iter_records(path):
            yield [token for token, keep in zip(record["input_ids"], record["loss_mask"]) if keep]


def sharegpt_assistant_ids(tokenizer: PreTrainedTokenizerBase, limit: int | None) -> Iterator[list[int]]:
    """Token ids of the assistant turns of the first `limit` ShareGPT conversations."""
    text = prompt_sets.sharegpt_json_path().read_text(encoding="utf-8")
    for index, record in enumerate(prompt_sets.iter_json_array(text)):
        if limit is not None and index >= limit:
            return
        try:
            messages = prompt_sets.sharegpt_to_messages(record.get("conversations", []))
        except ValueError:
            continue
        for message in messages:
            if message["role"] == "assistant" and message["content"]:
                yield tokenizer(message["content"], add_special_tokens=False)["input_ids"]


def write_drafter_with_vocab(drafter_dir: str | os.PathLike, token_ids: torch.Tensor, output_dir: str | os.PathLike):
    """Copies the drafter folder to `output_dir` with `token_ids` as its draft vocabulary; all or nothing."""
    output_dir = Path(output_dir)
    if output_dir.exists():
        raise FileExistsError(f"{output_dir} exists; choose a new --output folder.")
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    # A plain sibling folder (not `tempfile`'s private 0700 one), so the result gets the usual permissions.
    staging = output_dir.with_name(f".{output_dir.name}.{os.getpid()}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        shutil.copytree(drafter_dir, staging, ignore=shutil.ignore_patterns("__pycache__"))
        save_file({"draft_vocab": token_ids.contiguous()}, staging / DRAFT_VOCAB_FILE)
        os.replace(staging, output_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return output_dir


def _config_special_ids(config: dict) -> set[int]:
    """The EOS and pad ids a drafter's config.json names (an EOS may be a list)."""
    ids = set()
    for name in ("eos_token_id", "pad_token_id"):
        value = config.get(name)
        ids |= {value} if isinstance(value, int) else {i for i in value or () if isinstance(i, int)}
    return ids


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--drafter", default=None, help=f"drafter folder (default: {assets.SHIPPED_DRAFTER})")
    parser.add_argument(
        "--target", default="smollm2", help="tokenizer source: an offline target name or a model id/folder"
    )
    parser.add_argument("--size", type=positive_int, required=True, help="tokens in the draft vocabulary")
    parser.add_argument(
        "--data", nargs="*", default=[], help="`hf-domino regenerate` jsonl or `hf-domino pack` files to count on"
    )
    parser.add_argument(
        "--sharegpt-conversations", type=positive_int, default=4000, help="without --data: ShareGPT to count"
    )
    parser.add_argument("--output", required=True, help="new drafter folder (a copy with the draft vocabulary)")


def run(args: argparse.Namespace) -> int:
    # Bad input fails before the counting (minutes over ShareGPT), each exit naming the fix.
    drafter_dir = assets.drafter_folder(args.drafter)
    config = json.loads((drafter_dir / "config.json").read_text())
    if Path(args.output).exists():
        raise SystemExit(f"hf-domino draft-vocab: {args.output} exists; choose a new --output folder.")
    if args.size > config["vocab_size"]:
        raise SystemExit(
            f"hf-domino draft-vocab: --size {args.size} exceeds the drafter's {config['vocab_size']}-token "
            "vocabulary: a draft vocabulary is a subset of it (the shipped drafter's holds 8192)."
        )
    if any(parent.exists() and not parent.is_dir() for parent in Path(args.output).parents):
        raise SystemExit(f"hf-domino draft-vocab: --output {args.output} lies under a file: give a folder's path.")
    tokenizer = assets.load_tokenizer(args.target)
    if len(tokenizer) > config["vocab_size"]:
        raise SystemExit(
            f"hf-domino draft-vocab: --target {args.target}'s tokenizer has {len(tokenizer)} tokens, more than the "
            f"drafter's {config['vocab_size']}-token vocabulary: pass the drafter's own target."
        )
    # The drafter's own special ids (its config's), which a tokenizer of another model does not hold: the default
    # --target (SmolLM2) gave a Qwen drafter a vocabulary of SmolLM2's ids, its EOS left out.
    own = _config_special_ids(config)
    if own and not own & set(tokenizer.all_special_ids):
        raise SystemExit(
            f"hf-domino draft-vocab: --target {args.target}'s tokenizer holds none of the drafter's special tokens "
            f"({sorted(own)}, its config's EOS/pad ids): it tokenizes for another model; pass the drafter's own "
            "target as --target."
        )
    specials = {token for token in [*tokenizer.all_special_ids, *own] if 0 <= token < config["vocab_size"]}
    if args.size < len(specials):
        raise SystemExit(
            f"hf-domino draft-vocab: --size {args.size} cannot hold the tokenizer's {len(specials)} special tokens, "
            "which every draft vocabulary keeps: give a larger --size."
        )
    if args.data:
        source, sequences = f"{len(args.data)} regenerated file(s)", regenerated_response_ids(args.data)
    else:
        source = f"assistant turns of {args.sharegpt_conversations} ShareGPT conversations"
        sequences = sharegpt_assistant_ids(tokenizer, args.sharegpt_conversations)
    try:
        counts = count_tokens(sequences, config["vocab_size"])
    except ValueError as error:
        raise SystemExit(f"hf-domino draft-vocab: {error}") from None
    if not counts.sum():
        raise SystemExit(
            f"hf-domino draft-vocab: no response token in {source}: a draft vocabulary is the most frequent tokens "
            "of the target's answers; pass files `hf-domino regenerate` wrote."
        )
    token_ids = most_frequent(counts, args.size, always=sorted(specials))
    covered = counts[token_ids].sum().item() / max(counts.sum().item(), 1)
    write_drafter_with_vocab(drafter_dir, token_ids, args.output)
    print(
        f"{args.output}: {args.size} of {config['vocab_size']} tokens, covering {covered:.1%} of the "
        f"{counts.sum().item()} tokens counted ({source})."
    )
    return 0

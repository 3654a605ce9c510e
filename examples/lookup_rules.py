"""Which rule for copied drafts (`domino_lookup`): tokens per target forward of each, offline and exact.

On the target's own greedy answers (greedy generate() reproduces them token for token), a block's acceptance at any
anchor is known without generating: the drafter's from a teacher-forced block there
(`DominoTrainingModule.acceptance_everywhere`, checked against generate() in the tests), a copy's by comparing it
with the answer. Following the blocks from the first generated token (`p <- p + tokens(p)`) then gives exactly the
tokens per forward of greedy generate() under each rule:

- drafter: the Domino drafter alone (what `domino_lookup=False` does);
- copy n=...: drafts copied where the last n tokens occurred before (`lookup_drafts` with those sizes, longest
  first), a plain target step where they did not;
- copy n=..., else drafter: copies where the text repeats, the drafter elsewhere (n = 3, 2: generate()'s default for
  a drafter without a datastore);
- with `--datastore FILE` (a `draft_datastore.safetensors`): datastore alone (retrieved drafts, a plain step where
  none), and copy n=3,2, else datastore, else drafter (generate()'s default for a drafter with one).

Blocks verify every draft here (the drafter's at most `--drafts`, copies at most `--copies`); in generate() the
policy verifies fewer where that pays more.

    python examples/lookup_rules.py --prompts humaneval --num-prompts 20
    python examples/lookup_rules.py --prompts data/smollm2-regen/heldout_ids.safetensors --num-prompts 30
    python examples/lookup_rules.py --prompts mtbench --datastore \
        src/hf_domino/checkpoints/smollm2-135m-instruct-domino/draft_datastore.safetensors
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from hf_domino import TargetModules
from hf_domino.assets import encode_chat, load_drafter, load_smollm2
from hf_domino.copied_drafts_domino import DraftDatastore, lookup_drafts
from hf_domino.prompt_sets import load_prompts
from hf_domino.training import DominoTrainingModule, load_examples, target_context_features

NGRAM_SIZES = ((3, 2), (2,), (2, 1), (3,))


def answers(target, tokenizer, prompts: str, limit: int, max_new_tokens: int) -> list[tuple[list[int], int]]:
    """(prompt + greedy answer, prompt length) pairs: generated for a prompt set, read from a regenerated file."""
    if Path(prompts).suffix in (".safetensors", ".jsonl"):
        examples = load_examples(prompts, max_length=640)[:limit]
        return [(example.input_ids, len(example.input_ids) - sum(example.loss_mask)) for example in examples]
    pairs = []
    for messages in load_prompts(prompts, limit):
        input_ids = encode_chat(tokenizer, messages)
        output = target.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens, do_sample=False
        )
        pairs.append((output[0].tolist(), input_ids.shape[1]))
    return pairs


def tokens_added(drafts: torch.LongTensor | None, sequence: list[int], anchor: int) -> int | None:
    """Tokens a forward at `anchor` adds when it verifies `drafts` `[1, k]` (None: no drafts to verify)."""
    if drafts is None:
        return None
    accepted = 0
    for draft, truth in zip(drafts[0].tolist(), sequence[anchor + 1 :]):
        if draft != truth:
            break
        accepted += 1
    return 1 + accepted


def copy_tokens(sequence: list[int], anchor: int, sizes: tuple[int, ...], limit: int) -> int | None:
    """Tokens a forward adds with drafts copied at `anchor` (None: nothing to copy)."""
    return tokens_added(lookup_drafts(torch.tensor([sequence[: anchor + 1]]), limit, sizes), sequence, anchor)


def retrieved_tokens(datastore: DraftDatastore, sequence: list[int], anchor: int, limit: int) -> int | None:
    """Tokens a forward adds with drafts retrieved from the datastore at `anchor` (None: nothing retrieved)."""
    return tokens_added(datastore.lookup(torch.tensor([sequence[: anchor + 1]]), limit), sequence, anchor)


def follow(tokens: dict[int, int], start: int) -> list[tuple[int, int]]:
    """The blocks greedy generate() verifies from `start` on, with `tokens[anchor]` added by a block at each anchor:
    (anchor, tokens added) each."""
    blocks, anchor = [], start
    while anchor in tokens:
        blocks.append((anchor, tokens[anchor]))
        anchor += tokens[anchor]
    return blocks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", default=None, help="a drafter folder (default: the shipped one)")
    parser.add_argument("--prompts", default="humaneval", help="a prompt set, or a regenerated data file")
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=144)
    parser.add_argument("--drafts", type=int, default=4, help="drafter drafts verified per block")
    parser.add_argument("--copies", type=int, default=10, help="copied drafts verified per block")
    parser.add_argument("--datastore", default=None, help="a draft_datastore.safetensors: also its rules")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    datastore = DraftDatastore.load(args.datastore) if args.datastore else None
    torch.set_num_threads(args.threads)
    target, tokenizer = load_smollm2()
    drafter = load_drafter(args.drafter)
    module = DominoTrainingModule(drafter, TargetModules.from_target(target), drafter.draft_vocab)  # as generate()
    layers = drafter.config.target_layer_ids
    blocks: dict[str, list[int]] = {}
    copied_share: dict[str, list[bool]] = {}
    for sequence, prompt_length in answers(target, tokenizer, args.prompts, args.num_prompts, args.max_new_tokens):
        ids = torch.tensor([sequence])
        loss_mask = torch.tensor([[0] * prompt_length + [1] * (len(sequence) - prompt_length)])
        ones = torch.ones_like(ids)
        features = target_context_features(target, ids, ones, layers)
        everywhere = module.acceptance_everywhere(ids, loss_mask, ones, features)[0].tolist()
        drafter_tokens = [min(tokens, 1 + args.drafts) for tokens in everywhere]
        anchors = range(prompt_length, len(sequence) - drafter.config.block_size)  # whose blocks fit the answer
        rules = {"drafter": {p: drafter_tokens[p] for p in anchors}}
        for sizes in NGRAM_SIZES:
            copies = {p: copy_tokens(sequence, p, sizes, args.copies) for p in anchors}
            name = "n=" + ",".join(map(str, sizes))
            rules[f"copy {name}"] = {p: copies[p] or 1 for p in anchors}
            hybrid = rules[f"copy {name}, else drafter"] = {p: copies[p] or drafter_tokens[p] for p in anchors}
            copied_share.setdefault(f"copy {name}, else drafter", []).extend(
                copies[p] is not None for p, _ in follow(hybrid, prompt_length)
            )
        if datastore is not None:
            retrieved = {p: retrieved_tokens(datastore, sequence, p, args.copies) for p in anchors}
            copies = {p: copy_tokens(sequence, p, (3, 2), args.copies) for p in anchors}
            rules["datastore"] = {p: retrieved[p] or 1 for p in anchors}
            rules["copy n=3,2, else datastore, else drafter"] = {
                p: copies[p] or retrieved[p] or drafter_tokens[p] for p in anchors
            }
        for name, tokens in rules.items():
            blocks.setdefault(name, []).extend(added for _, added in follow(tokens, prompt_length))
    print(
        f"{args.prompts}: {args.num_prompts} answers; drafter blocks of <= {args.drafts}, copies of <= {args.copies}"
    )
    for name, added in blocks.items():
        share = copied_share.get(name)
        note = f"  ({100 * statistics.mean(share):.0f}% of blocks copied)" if share else ""
        print(f"  {name:28s} tokens per forward {statistics.mean(added):.3f}{note}")


if __name__ == "__main__":
    main()

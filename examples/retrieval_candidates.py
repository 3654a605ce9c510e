"""Would a tree of retrieved candidates pay? Where the target's next token ranks among the datastore's continuations.

A retrieval (`DraftDatastore.lookup`) verifies the one continuation most occurrences of the text's last n-gram
agree on. REST-style retrieval verifies several as a tree, which pays only where the first candidate is wrong and a
later one right. This reads the target alone's greedy answers (the prepared SmolLM2 target) and, at every position
of each answer where the datastore has occurrences, ranks the next tokens those occurrences continue with (by count,
as the lookup orders them) and finds the target's own next token among them. Prints the share of positions with a
candidate and, of those, how often the target's next token is the first, second, third or a later candidate, or none
of them. docs/benchmarks.md quotes it ("Retrieval from the process's own earlier answers", the note on trees of
retrieved candidates):

    python examples/retrieval_candidates.py --prompts mtbench --num-prompts 8
    python examples/retrieval_candidates.py --prompts humaneval --num-prompts 8
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch

import hf_domino
from hf_domino.assets import encode_chat, load_drafter, load_target
from hf_domino.copied_drafts_domino import DraftDatastore
from hf_domino.prompt_sets import load_prompts


def ranked_continuations(store: DraftDatastore, sequence: list[int]) -> list[int] | None:
    """The next tokens after the longest n-gram of `sequence`'s end that the lookup would read (`occurrences`), most
    frequent first (ties: the smaller id, as the lookup breaks them); None where none occurs often enough."""
    for at in store.occurrences(torch.tensor([sequence])):
        counts = Counter(store.tokens[at].tolist())
        ranked = [t for t, n in sorted(counts.items(), key=lambda c: (-c[1], c[0])) if n >= store.min_count and t >= 0]
        if ranked:
            return ranked
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", default="mtbench", help="mtbench, humaneval, ... (prompt_sets.load_prompts)")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target("smollm2", device="cpu")
    drafter = load_drafter()
    hf_domino.prepare_for_cpu_decoding(target, drafter)
    ranks, positions = Counter(), 0
    for messages in load_prompts(args.prompts, args.num_prompts):
        prompt = encode_chat(tokenizer, messages)
        sequence = target.generate(prompt, max_new_tokens=args.max_new_tokens, do_sample=False)[0].tolist()
        for end in range(prompt.shape[1], len(sequence) - 1):
            positions += 1
            ranked = ranked_continuations(drafter.datastore, sequence[: end + 1])
            if ranked is not None:
                following = sequence[end + 1]
                ranks[ranked.index(following) + 1 if following in ranked else "miss"] += 1
    found = sum(ranks.values())
    print(f"{args.prompts}: {positions} positions, a candidate at {found / positions:.0%} of them; of those:")
    for rank in (1, 2, 3):
        print(f"  the target's next token is candidate {rank}: {ranks[rank] / found:.1%}")
    later = sum(n for rank, n in ranks.items() if rank != "miss" and rank > 3)
    print(f"  candidate 4 or later: {later / found:.1%}; among none of them: {ranks['miss'] / found:.1%}")


if __name__ == "__main__":
    main()

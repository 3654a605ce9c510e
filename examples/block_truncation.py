"""Acceptance and time of the shipped drafter with its block cut short (fewer MASK positions for the backbone to
read): one sequence, greedy, fixed k (default 3), no copies, 10 prompts x 64 tokens per set, blocks of 16, 8, 6, 4.
docs/benchmarks.md, "The batch's tail", quotes it:

    python examples/block_truncation.py 3
"""

import argparse
import time

import torch

from hf_domino import DominoForSpeculation, prepare_for_cpu_decoding
from hf_domino.assets import SHIPPED_DRAFTER, load_smollm2
from hf_domino.prompt_sets import load_humaneval, load_mtbench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("k", nargs="?", type=int, default=3, help="drafts verified per target forward")
    k = parser.parse_args().k
    torch.set_num_threads(2)
    target, tok = load_smollm2()
    drafter = DominoForSpeculation.from_pretrained(SHIPPED_DRAFTER, dtype=torch.float32).eval()
    prepare_for_cpu_decoding(target, drafter)
    sets = {"mtbench": load_mtbench(limit=10), "humaneval": load_humaneval(limit=10)}
    for name, prompts in sets.items():
        inputs = [
            tok.apply_chat_template(
                p if isinstance(p, list) else [{"role": "user", "content": p}],
                add_generation_prompt=True,
                return_tensors="pt",
                return_dict=True,
            )
            for p in prompts
        ]
        for block in (16, 8, 6, 4):
            drafter.config.block_size = block
            acc, n, t0 = 0, 0, time.perf_counter()
            for x in inputs:
                target.generate(
                    **x,
                    assistant_model=drafter,
                    max_new_tokens=64,
                    do_sample=False,
                    draft_policy="fixed",
                    num_speculative_tokens=min(k, drafter.config.num_drafts),
                    domino_lookup=False,
                )
                a = drafter.last_generation_stats.acceptance_lengths
                acc += sum(a)
                n += len(a)
            print(
                f"{name} block {block}: tau {acc / n:.3f} over {n} forwards, {time.perf_counter() - t0:.1f} s",
                flush=True,
            )
        drafter.config.block_size = 16


if __name__ == "__main__":
    main()

"""Retrieval from the process's own earlier answers: does remembering what the target wrote in earlier calls pay?

The drafter's datastore holds the target's answers to the training prompts, fixed when the drafter was exported. A
process that answers many prompts of one kind (code, say) could also retrieve from its own earlier answers, as
SuffixDecoding does. This probe asks what that would earn before anything is built: per prompt, in one process and in
turn, `generate()` with the shipped drafter as it is, and with a second copy whose datastore looks in the answers of
the earlier prompts first (an n-gram index rebuilt after each answer, `min_count` occurrences agreeing, 1 by
default) and in the shipped datastore after. Greedy, so both must give the same tokens (asserted); the answer of
each prompt is remembered only after both ran. Prints each drafter's time and tokens per target forward over all
prompts and over the second half (where the memory holds more), and the share of its target forwards that took plain
steps or verified copied, retrieved or drafted tokens. The prepared SmolLM2 target, 2 threads. docs/benchmarks.md
quotes it ("Retrieval from the process's own earlier answers"):

    python examples/answer_memory_probe.py --prompts humaneval --num-prompts 40
    python examples/answer_memory_probe.py --prompts mtbench --num-prompts 40
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import torch

import hf_domino
from hf_domino.assets import encode_chat, load_drafter, load_target
from hf_domino.copied_drafts_domino import DraftDatastore
from hf_domino.prompt_sets import load_prompts

SOURCES = ("plain", "copied", "retrieved", "drafted")


class RememberingDatastore:
    """The drafter's datastore, with the earlier answers looked up first; everything else is the datastore's."""

    def __init__(self, datastore: DraftDatastore, min_count: int):
        self.datastore, self.min_count = datastore, min_count
        self.answers: list[torch.Tensor] = []
        self.memory: DraftDatastore | None = None

    def remember(self, answer: torch.Tensor) -> None:
        self.answers.append(answer)
        self.memory = DraftDatastore.from_sequences(self.answers, min_count=self.min_count).build_index()

    def lookup(self, input_ids: torch.LongTensor, max_drafts: int) -> torch.LongTensor | None:
        found = None if self.memory is None else self.memory.lookup(input_ids, max_drafts)
        return found if found is not None else self.datastore.lookup(input_ids, max_drafts)

    def __getattr__(self, name: str):
        return getattr(self.datastore, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", default="humaneval", help="mtbench, humaneval, ... (prompt_sets.load_prompts)")
    parser.add_argument("--num-prompts", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--min-count", type=int, default=1, help="occurrences in the memory that must agree")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target("smollm2", device="cpu")
    drafters = {"as shipped": load_drafter(), "remembering": load_drafter()}
    for drafter in drafters.values():
        hf_domino.prepare_for_cpu_decoding(target, drafter)
    memory = drafters["remembering"].datastore = RememberingDatastore(
        drafters["remembering"].datastore, args.min_count
    )
    seconds = {name: [] for name in drafters}
    tau = {name: [] for name in drafters}
    sources = {name: Counter() for name in drafters}  # what the target forwards verified
    for index, messages in enumerate(load_prompts(args.prompts, args.num_prompts)):
        prompt = encode_chat(tokenizer, messages)
        answers = {}
        for name in sorted(drafters, reverse=bool(index % 2)):  # alternate which runs first
            start = time.perf_counter()
            output = target.generate(prompt, assistant_model=drafters[name], max_new_tokens=args.max_new_tokens,
                                     do_sample=False)  # fmt: skip
            seconds[name].append(time.perf_counter() - start)
            stats = drafters[name].last_generation_stats
            tau[name].append(stats.mean_acceptance_length)
            for drafted, copied, retrieved in zip(stats.drafted, stats.copied, stats.retrieved):
                sources[name][
                    "plain" if not drafted else "copied" if copied else "retrieved" if retrieved else "drafted"
                ] += 1
            answers[name] = output[0, prompt.shape[1] :]
        assert torch.equal(answers["as shipped"], answers["remembering"]), f"prompt {index}: the outputs differ"
        memory.remember(answers["remembering"])
    half = args.num_prompts // 2
    print(f"{args.prompts}, {args.num_prompts} prompts x {args.max_new_tokens} tokens, outputs identical")
    print("| drafter | all: seconds | tokens per forward | second half: seconds | tokens per forward | forwards: "
          "plain / copied / retrieved / drafted |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for name in drafters:
        shares = " / ".join(f"{sources[name][kind] / sum(sources[name].values()):.0%}" for kind in SOURCES)
        print(f"| {name} | {sum(seconds[name]):.1f} | {statistics.mean(tau[name]):.2f} | "
              f"{sum(seconds[name][half:]):.1f} | {statistics.mean(tau[name][half:]):.2f} | {shares} |")  # fmt: skip


if __name__ == "__main__":
    main()

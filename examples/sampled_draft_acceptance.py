"""Expected first-draft acceptance `sum_x min(p(x), q(x))` when sampling (T 0.6, top-k 20, top-p 0.95), for draft
distributions q other than the drafter's warped as the call asks: unwarped, its argmax alone (a greedy draft), top-k
alone, other draft temperatures.
Speculative sampling is lossless for any q. The target's processed p and the drafter's logits of each block's first
draft are recorded inside `generate()` (fixed k = 2, no copies), 10 prompts x 64 tokens per set. docs/benchmarks.md,
"Sampled drafts warped and drawn on the draft vocabulary's columns", quotes it:

    python examples/sampled_draft_acceptance.py
"""

import argparse

import torch
import transformers.generation.utils as gu

from hf_domino import DominoForSpeculation, drafting_domino, generation_domino, prepare_for_cpu_decoding
from hf_domino.assets import SHIPPED_DRAFTER, load_smollm2
from hf_domino.prompt_sets import load_humaneval, load_mtbench


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    torch.set_num_threads(2)
    target, tok = load_smollm2()
    drafter = DominoForSpeculation.from_pretrained(SHIPPED_DRAFTER, dtype=torch.float32).eval()
    prepare_for_cpu_decoding(target, drafter)
    records, raws, pending = [], [], []
    original = gu._speculative_sampling

    def spy(candidate_input_ids, candidate_logits, candidate_length, new_logits, *a, **k):
        records.append(new_logits[0, 0].clone())
        raws.append(pending[0])
        pending.clear()
        return original(candidate_input_ids, candidate_logits, candidate_length, new_logits, *a, **k)

    gu._speculative_sampling = spy
    orig_pp = drafting_domino.processed_pick

    def recording_pick(logits_processor, do_sample, vocab, vocab_size):
        pick = orig_pp(logits_processor, do_sample, vocab, vocab_size)

        def wrapped(logits, realised):
            pending.append(drafting_domino.spread_to_vocabulary(logits.float(), vocab, vocab_size)[0].clone())
            return pick(logits, realised)

        return wrapped

    generation_domino.processed_pick = recording_pick
    for name, loader in (("mtbench", load_mtbench), ("humaneval", load_humaneval)):
        records.clear()
        raws.clear()
        pending.clear()
        torch.manual_seed(0)
        for p in loader(limit=10):
            x = tok.apply_chat_template(p, add_generation_prompt=True, return_tensors="pt", return_dict=True)
            target.generate(
                **x,
                assistant_model=drafter,
                max_new_tokens=64,
                do_sample=True,
                temperature=0.6,
                top_k=20,
                top_p=0.95,
                draft_policy="fixed",
                num_speculative_tokens=2,
                domino_lookup=False,
            )
        assert len(raws) == len(records), (len(raws), len(records))
        p = torch.stack(records).softmax(-1)
        raw = torch.stack(raws) / 0.6

        def acc(q_logits, p=p):
            return torch.minimum(p, q_logits.softmax(-1)).sum(-1).mean().item()

        def topk(logits, k):
            kth = logits.topk(k, -1).values[..., -1:]
            return logits.masked_fill(logits < kth, float("-inf"))

        # A greedy draft (q one-hot at the drafter's likeliest token) is accepted with the target's probability of it.
        out = {"unwarped": acc(raw), "argmax": p.gather(-1, raw.argmax(-1, keepdim=True)).mean().item()}
        for tau in (0.8, 1.0, 1.3, 1.6):
            out[f"unwarped tau {tau}"] = acc(raw / tau)
        for k in (20, 50, 200):
            out[f"top-k {k}"] = acc(topk(raw, k))
        from transformers import TopKLogitsWarper, TopPLogitsWarper

        warped = TopPLogitsWarper(0.95)(None, TopKLogitsWarper(20)(None, raw.clone()))
        out["as generate (top-k 20, top-p .95)"] = acc(warped)
        # How often the target's sampled token can be drafted at all: p's mass inside the drafter's warped support.
        out["p inside the drafter's top-k/top-p set"] = (p * torch.isfinite(warped)).sum(-1).mean().item()
        print(name, len(records), "; ".join(f"{k}: {v:.3f}" for k, v in out.items()), flush=True)


if __name__ == "__main__":
    main()

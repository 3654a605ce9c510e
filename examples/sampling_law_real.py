"""Sampling with the shipped drafter keeps the real SmolLM2 target's law: a chi-square test against enumeration.

With top-k sampling the target's law over the next few tokens has few enough sequences to enumerate exactly (k^n,
scored in batches of prefixes); draws of `generate()` with the drafter, one sequence at a time (transformers'
assisted loop) and as `num_return_sequences` rows (the batch loop), are counted against it, and so are draws of the
target alone as the control. The tiny-model tests do this for many settings; this runs it where the drafts come from
the real drafter (its draft vocabulary, copies and retrievals included) and the target's law from the real model.

    python examples/sampling_law_real.py --tokens 4 --draws 1200
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import GenerationConfig

from hf_domino.assets import encode_chat, load_drafter, load_smollm2

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_generation import chi_square_p_value, drafts_and_accepted  # noqa: E402  (the tests' own statistic)


def exact_law(target, prompt: torch.LongTensor, tokens: int, processors) -> dict[tuple, float]:
    """P(continuation) of every continuation of `tokens` tokens the processed law allows, by enumeration."""
    law = {(): 1.0}
    for _ in range(tokens):
        prefixes = list(law)
        continued = torch.tensor([list(p) for p in prefixes], dtype=torch.long).reshape(len(prefixes), -1)
        batch = torch.cat([prompt.repeat(len(prefixes), 1), continued], dim=1)
        with torch.no_grad():
            step = torch.softmax(processors(batch, target(batch).logits[:, -1].float()), dim=-1)
        law = {
            p + (t,): law[p] * step[i, t].item()
            for i, p in enumerate(prefixes)
            for t in step[i].nonzero()[:, 0].tolist()
        }
    return law


def count_draws(
    target, prompt: torch.LongTensor, tokens: int, draws: int, per_call: int, **kwargs
) -> tuple[dict, int, int]:
    """Continuations drawn by `draws // per_call` generate() calls of `per_call` sequences each, counted; and the
    drafts the calls verified and accepted (0, 0 without a drafter)."""
    counts: dict[tuple, int] = {}
    drafted = accepted = 0
    for _ in range(draws // per_call):
        output = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=tokens,
                                 min_new_tokens=tokens, num_return_sequences=per_call, **kwargs)  # fmt: skip
        for row in output[:, prompt.shape[1] :].tolist():
            counts[tuple(row)] = counts.get(tuple(row), 0) + 1
        if "assistant_model" in kwargs:
            call_drafted, call_accepted = drafts_and_accepted([kwargs["assistant_model"].last_generation_stats])
            drafted, accepted = drafted + call_drafted, accepted + call_accepted
    return counts, drafted, accepted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4, help="continuation length (k^tokens sequences)")
    parser.add_argument("--draws", type=int, default=1200, help="draws per method (a multiple of --rows)")
    parser.add_argument("--rows", type=int, default=200, help="num_return_sequences of the batched draws")
    parser.add_argument("--top-k", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--prompt", default="Tell me a story.")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target, tokenizer = load_smollm2()
    drafter = load_drafter(dtype=target.dtype)
    prompt = encode_chat(tokenizer, [{"role": "user", "content": args.prompt}])
    sampling = dict(do_sample=True, temperature=args.temperature, top_k=args.top_k)
    law = exact_law(target, prompt, args.tokens, target._get_logits_processor(GenerationConfig(**sampling)))
    print(f"{len(law)} continuations of {args.tokens} tokens, the likeliest p = {max(law.values()):.3f}")

    runs = [
        ("target alone, one sequence per call", dict(per_call=1)),
        ("drafter, one sequence per call (transformers' loop)", dict(per_call=1, assistant_model=drafter)),
        # The fixed policy: under the adaptive one, a CPU verifying hundreds of rows x (1 + k) tokens takes plain steps.
        (
            f"drafter, {args.rows} sequences per call (the batch loop, fixed policy)",
            dict(per_call=args.rows, assistant_model=drafter, draft_policy="fixed"),
        ),
    ]
    for name, kwargs in runs:
        torch.manual_seed(args.seed)
        start = time.perf_counter()
        counts, drafted, accepted = count_draws(target, prompt, args.tokens, args.draws, **kwargs, **sampling)
        p_value = chi_square_p_value(counts, law, sum(counts.values()))
        # The statistic reads the law's continuations only: a draw the law forbids (outside top-k) is counted apart.
        outside = sum(count for continuation, count in counts.items() if continuation not in law)
        seconds = time.perf_counter() - start
        print(f"{name}: chi-square p = {p_value:.3g} over {sum(counts.values())} draws ({outside} outside the law), "
              f"drafts verified {drafted}, accepted {accepted} ({seconds:.0f} s)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

"""An A/B of drafting settings in `generate()` itself, one sequence or batches: datastore n-gram sizes, the
attention verification runs with, or any of the drafter's generate() options.

Each setting gets its own drafter object, so that each learns its own acceptance and verify-cost records (they are
kept per drafter), and the settings run interleaved group by group in one process, their order alternating, against
the prepared target alone on the same group. Greedy outputs are asserted identical to the target alone's. A setting
is `default`, or `key=value` items joined by `+`: `sizes=4,3,2` (the datastore's n-gram sizes), `attention=sdpa`
(the target's attention implementation while it verifies), `drafter_dtype=bfloat16` (the drafter's dtype, instead of
the target's), a generate() option of the drafter (`domino_lookup=False`, `num_speculative_tokens=0`,
`draft_policy=fixed`, ...), or an upper-case setting of the batch loop, the policy or the CPU fast path module, set
for that setting's calls only (`PRICE_BY_MAKESPAN=True`, `MATMUL_MAX_QUERIES=0`). `--first-calls`: each call with a
drafter starts from nothing learned (`records_domino.forget_records`), as a process's first call does. docs/benchmarks.md
quotes it:

    python examples/generate_ab.py --prompts mtbench --settings sizes=4,3 sizes=4,3,2
    python examples/generate_ab.py --prompts mtbench --settings attention=sdpa attention=sdpa_grouped_kv
    python examples/generate_ab.py --prompts mtbench --num-prompts 16 --max-new-tokens 64 --batch-size 4 \\
        --repeats 2 --settings default domino_lookup=False num_speculative_tokens=0 \\
        domino_lookup=False+draft_policy=fixed+num_speculative_tokens=0
    python examples/generate_ab.py --prompts mtbench --num-prompts 16 --max-new-tokens 64 --batch-size 4 \\
        --repeats 2 --settings MATMUL_MAX_QUERIES=0 default
    python examples/generate_ab.py --prompts mtbench --num-prompts 48 --max-new-tokens 128 --batch-size 8 \\
        --first-calls --settings default PRICE_BY_MAKESPAN=True+ROW_PACES=True PRICE_BY_MAKESPAN=True
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from hf_domino import (
    batch_policy_domino,
    batch_prompts_domino,
    batching_domino,
    cpu_fast_path,
    policy_domino,
    prepare_for_cpu_decoding,
    records_domino,
)
from hf_domino.assets import chat_token_ids, load_drafter, load_target, pad_token_id
from hf_domino.copied_drafts_domino import DATASTORE_FILE, DraftDatastore
from hf_domino.measure_batch import left_padded_groups
from hf_domino.prompt_sets import load_prompts

# Where `--settings NAME=...` looks up an upper-case KEY (a module constant, set for the setting's calls).
SETTING_MODULES = (
    batching_domino,
    batch_prompts_domino,
    batch_policy_domino,
    policy_domino,
    records_domino,
    cpu_fast_path,
)


@dataclass
class Setting:
    drafter: object
    attention: str | None = None  # the target's attention while it verifies (None: as prepared)
    options: dict = field(default_factory=dict)  # generate() options of the drafter
    modules: dict = field(default_factory=dict)  # (module, name) -> value, set during this setting's calls


def option_value(text: str):
    if text in ("True", "False"):
        return text == "True"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def setting_for(name: str, target, batch_size: int = 1) -> Setting:
    setting = Setting(load_drafter(None))
    match_dtype = True  # the fast path casts the drafter to the target's dtype unless a setting names one
    for item in [] if name == "default" else name.split("+"):
        key, _, value = item.partition("=")
        if key == "sizes":
            sizes = tuple(int(size) for size in value.split(","))
            path = str(setting.drafter.name_or_path) + "/" + DATASTORE_FILE
            setting.drafter.datastore = DraftDatastore.load(path, ngram_sizes=sizes)
        elif key == "attention":
            setting.attention = value
        elif key == "drafter_dtype":
            setting.drafter.to(getattr(torch, value))
            match_dtype = False
        elif key.isupper():
            module = next((m for m in SETTING_MODULES if hasattr(m, key)), None)
            if module is None:
                names = ", ".join(m.__name__.rsplit(".", 1)[-1] for m in SETTING_MODULES)
                raise SystemExit(f"setting {name!r}: no module setting {key!r} in {names}")
            setting.modules[module, key] = option_value(value)
        elif value:
            setting.options[key] = option_value(value)
        else:
            raise SystemExit(f"setting {name!r}: {item!r} is not key=value")
    prepare_for_cpu_decoding(target, setting.drafter, match_drafter_dtype=match_dtype, batch_size=batch_size)
    if setting.drafter.datastore is not None:
        setting.drafter.datastore.build_index()
    return setting


@contextlib.contextmanager
def applied(target, setting: Setting | None) -> Iterator[None]:
    """The setting's attention implementation and module settings, for one call."""
    prepared = target.config._attn_implementation
    modules = {} if setting is None else setting.modules
    previous = {(module, name): getattr(module, name) for module, name in modules}
    if setting is not None and setting.attention is not None:
        target.set_attn_implementation(setting.attention)
    for (module, name), value in modules.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        target.set_attn_implementation(prepared)
        for (module, name), value in previous.items():
            setattr(module, name, value)


def timed(target, batch: dict, max_new_tokens: int, setting: Setting | None = None) -> tuple[torch.Tensor, float]:
    extra = {} if setting is None else {"assistant_model": setting.drafter, **setting.options}
    with applied(target, setting):
        start = time.perf_counter()
        output = target.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, **extra)
        return output, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="mtbench")
    parser.add_argument("--num-prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--settings", nargs="+", required=True, help="e.g. sizes=4,3 sizes=4,3,2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--first-calls",
        action="store_true",
        help="every call with a drafter is its first: what the drafter's policies learned is forgotten before it",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target("smollm2", device="cpu")
    settings = {name: setting_for(name, target, args.batch_size) for name in args.settings}
    prompts = [chat_token_ids(tokenizer, messages) for messages in load_prompts(args.prompts, args.num_prompts)]
    size, pad = args.batch_size, pad_token_id(target, tokenizer)
    groups = left_padded_groups(tokenizer, prompts, size, pad)
    timed(target, groups[0], 8)  # warm-up
    for setting in settings.values():
        timed(target, groups[0], 8, setting)
    seconds = {name: [] for name in ["target", *settings]}
    tau = {name: [] for name in settings}
    for repeat in range(args.repeats):
        for index, batch in enumerate(groups):
            reference, elapsed = timed(target, batch, args.max_new_tokens)
            seconds["target"].append(elapsed)
            for name in list(settings) if (repeat + index) % 2 == 0 else list(reversed(settings)):
                if args.first_calls:
                    records_domino.forget_records(settings[name].drafter)
                output, elapsed = timed(target, batch, args.max_new_tokens, settings[name])
                assert torch.equal(output, reference), f"{name}: output differs from the target alone's"
                seconds[name].append(elapsed)
                tau[name].append(statistics.fmean(settings[name].drafter.last_generation_stats.acceptance_lengths))
    print(
        f"{args.prompts}: {len(groups)} groups of {size} x {args.repeats} repeats, {args.max_new_tokens} tokens, "
        "greedy, identical outputs"
    )
    for name in settings:
        speedup = sum(seconds["target"]) / sum(seconds[name])
        print(f"  {name:28s} {speedup:.3f}x the target alone, tau {statistics.fmean(tau[name]):.2f}")


if __name__ == "__main__":
    main()

"""Random mixes of generate()'s options, with a drafter and without: the same output, whatever the mix.

Each option has tests of its own; these draw several at once (logits processors, stopping rules, scores, caches, draft
policies, copies, branches, the head off, batches of 1-4 rows, requests served by `generate_batch` or added to the
manager beneath it, greedy or sampling) on tiny Qwen3 and Llama targets, with drafters that are right at every draft, at some, or at
random. A mix transformers refuses for the target alone is skipped; one the drafter call refuses or runs differently
fails with the mix in the message. The suite runs a fixed few seeds; `OPTION_MIX_SEEDS=N` runs seeds 0 to N - 1 of
each test instead, `OPTION_MIX_SEEDS=A:B` seeds A to B - 1 (docs/usage.md, "Greedy and sampling are lossless", gives
the runs made).
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import re
import threading

import pytest
import torch
from conftest import forcing_drafter, own_drafts, successor_target, tiny_drafter, tiny_target
from test_batching import left_padded
from test_generation import CollectingStreamer
from transformers import DynamicCache, WatermarkingConfig

import hf_domino
from hf_domino.cache_domino import CACHE_ARGUMENT
from hf_domino.options_domino import static_caches_roll_back


def seeds(default: int) -> range:
    first, _, last = os.environ.get("OPTION_MIX_SEEDS", str(default)).rpartition(":")
    return range(int(first or 0), int(last))


def random_models(rng: random.Random, random_weights: bool = True):
    """(target, drafter, vocabulary size): a successor target with a drafter right at all, most or half of its
    drafts, or (unless `random_weights=False`) a random target and drafter."""
    arch = rng.choice(["qwen3", "llama"])
    if rng.random() < 2 / 3 or not random_weights:
        vocab, step = 32, rng.choice([1, 2, 3])
        target = successor_target(arch, vocab, step=step)
        right = rng.choice([1.0, 0.8, 0.5])
        table = [(t + step) % vocab if rng.random() < right else rng.randrange(vocab) for t in range(vocab)]
        drafter = forcing_drafter(target, table, block_size=rng.choice([4, 6, 8]), shift_label=rng.random() < 0.8)
    else:
        vocab = 64
        target = tiny_target(arch, vocab_size=vocab, seed=rng.randrange(100))
        drafter = tiny_drafter(
            target,
            head=rng.random() < 0.7,
            shift_label=rng.random() < 0.7,
            block_size=rng.choice([4, 6]),
            seed=rng.randrange(100),
        )
    return target, drafter, vocab


def random_options(rng: random.Random, pool: range, eos: int, drafter) -> tuple[dict, dict]:
    """(generate()'s options, the drafter call's own); the processors' tokens are drawn from `pool`."""
    token = lambda: rng.choice(pool)  # noqa: E731
    maybe = {
        "min_new_tokens": lambda: rng.randint(0, 20),
        "eos_token_id": lambda: [eos] + rng.sample(pool, rng.randint(0, 2)),
        "repetition_penalty": lambda: rng.choice([1.2, 1.5, 2.0]),
        "no_repeat_ngram_size": lambda: rng.choice([2, 3]),
        "bad_words_ids": lambda: [[token()], [token()], [token(), token()]],
        "suppress_tokens": lambda: [token(), token()],
        "begin_suppress_tokens": lambda: [token(), token()],
        "sequence_bias": lambda: {(token(),): rng.choice([-5.0, 5.0]), (token(), token()): 5.0},
        "forced_eos_token_id": lambda: 1,
        "forced_bos_token_id": token,
        "exponential_decay_length_penalty": lambda: (rng.randint(1, 5), 1.5),
        "renormalize_logits": lambda: True,
    }
    options = {"max_new_tokens": rng.randint(1, 30), "do_sample": False}
    options.update({name: draw() for name, draw in maybe.items() if rng.random() < 0.2})
    if rng.random() < 0.2:
        options.update(return_dict_in_generate=True, output_scores=rng.random() < 0.5, output_logits=True)
        options["output_hidden_states"] = rng.random() < 0.5
    ours = {"draft_policy": rng.choice(["fixed", "adaptive"])}
    if rng.random() < 0.5:
        ours["num_speculative_tokens"] = rng.randint(0, drafter.config.num_drafts)
    if rng.random() < 0.3:
        ours["domino_lookup"] = False
    if rng.random() < 0.2:
        ours["domino_branches"] = rng.choice([2, 3])
    if rng.random() < 0.2 and drafter.config.has_domino_head:
        ours["domino_head"] = False
    if rng.random() < 0.15:
        ours["assistant_confidence_threshold"] = rng.choice([0.1, 0.3])
    return options, ours


# What a mix's output holds besides tokens (dropped where only tokens come back).
OUTPUTS = ("return_dict_in_generate", "output_scores", "output_logits", "output_hidden_states", "output_attentions")


def random_rows(rng: random.Random, vocab: int, rows: int) -> list[list[int]]:
    return [[rng.randrange(4, vocab) for _ in range(rng.randint(1, 7))] for _ in range(rows)]


def both_outputs(target, drafter, batch: dict, options: dict, ours: dict, streamers: tuple | None = None):
    """(the target alone's output, the drafter call's); a mix transformers refuses for the target alone is skipped.
    `streamers`: the target alone's and the drafter call's."""
    alone_streamer, drafted_streamer = streamers or (None, None)
    try:
        alone = target.generate(**batch, **options, streamer=alone_streamer)
    except (ValueError, TypeError, RuntimeError) as error:  # (RuntimeError: ALiBi Falcon on a static cache)
        pytest.skip(f"the target alone refuses or fails the mix ({type(error).__name__}: {error}): {options}")
    return alone, target.generate(**batch, assistant_model=drafter, **options, **ours, streamer=drafted_streamer)


def later_draws(rng: random.Random, target, drafter, vocab: int, batch: dict, options: dict) -> tuple | None:
    """What a mix draws after all the rest, so that the seeds run before these were added (docs/usage.md) keep
    their mixes: a draft vocabulary, `max_length` for `max_new_tokens`, `min_length`, the CPU fast path on both
    models, and at batch 1 a streamer per call (returned: they must receive the same tokens); then NaN and inf
    removal, a watermark, a chunked prefill, a time limit and top-h sampling."""
    if rng.random() < 0.25:
        drafter.set_draft_vocab(sorted(rng.sample(range(vocab), vocab // 2)))
    if rng.random() < 0.15:
        options["max_length"] = batch["input_ids"].shape[1] + options.pop("max_new_tokens")
    if rng.random() < 0.1:
        options["min_length"] = batch["input_ids"].shape[1] + rng.randint(0, 10)
    if rng.random() < 0.15:
        rows = batch["input_ids"].shape[0]
        hf_domino.prepare_for_cpu_decoding(target, drafter, batch_size=rows, measure_products=False)
    streamers = None
    if batch["input_ids"].shape[0] * options.get("num_return_sequences", 1) == 1 and rng.random() < 0.4:
        streamers = CollectingStreamer(), CollectingStreamer()
    # Drawn after those since 2026-12-06: settings no draw above touches.
    if rng.random() < 0.1:
        options["remove_invalid_values"] = True
    if rng.random() < 0.1:
        # (transformers' self-hashing scheme tries the 40 likeliest tokens: an IndexError below 40 in the vocabulary)
        scheme = rng.choice(["lefthash", "selfhash"]) if vocab >= 40 else "lefthash"
        options["watermarking_config"] = WatermarkingConfig(bias=rng.choice([1.0, 4.0]), seeding_scheme=scheme)
    if rng.random() < 0.1:
        options["prefill_chunk_size"] = rng.randint(1, 4)
    if rng.random() < 0.1:
        options["max_time"] = 600.0  # (never reached: its stopping rule on every path)
    if options["do_sample"] and rng.random() < 0.2:
        options["top_h"] = rng.choice([0.4, 0.8])
    return streamers


def streamed(streamer: CollectingStreamer) -> list:
    """The tokens a streamer received, in order (a drafter call puts several at once), then "end"."""
    return [token for chunk in streamer.chunks for token in (chunk if chunk != "end" else [chunk])]


def sequences(output) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.sequences


def greedy_mix(seed: int, device: str = "cpu", models=None) -> int:
    """One greedy mix: the drafter call's sequences and scores (a finished row's after its end too) are the target
    alone's; returns how many drafts of the drafter's own the call verified (`own_drafts`). On CUDA (test_on_cuda.py) only the exact models are drawn (successor targets and forcing drafters, whose
    logits have no near-ties for the device's rounding to flip), and the default rollout runs the fused head.
    `models(rng)` draws (target, drafter, vocabulary size) instead of `random_models`."""
    rng = random.Random(seed)
    target, drafter, vocab = (models or functools.partial(random_models, random_weights=device == "cpu"))(rng)
    target, drafter = target.to(device), drafter.to(device)
    batch = left_padded(random_rows(rng, vocab, rng.choice([1, 1, 2, 3, 4])))
    batch = {name: tensor.to(device) for name, tensor in batch.items()}
    options, ours = random_options(rng, range(4, vocab), 1, drafter)
    if device == "cpu" and batch["input_ids"].shape[0] == 1 and rng.random() < 0.3 and static_caches_roll_back():
        options["cache_implementation"] = "static"  # (refused on 5.23, naming the fix: test_static_cache.py)
    if device != "cpu" and rng.random() < 0.3:
        ours["domino_rollout"] = "eager"  # else "auto": the fused head where it applies
    streamers = later_draws(rng, target, drafter, vocab, batch, options) if device == "cpu" else None
    if options.get("return_dict_in_generate") and rng.random() < 0.5 and returns_attentions(target, options, ours):
        target.set_attn_implementation("eager")  # (drawn last: the one kernel that returns attention weights)
        options["output_attentions"] = True
    alone, drafted = both_outputs(target, drafter, batch, options, ours, streamers)
    verified = own_drafts(drafter.last_generation_stats)
    mix = f"{type(target).__name__}: options {options}, drafter options {ours}, draft vocabulary {drafter.draft_vocab}"
    assert streamers is None or streamed(streamers[1]) == streamed(streamers[0]), mix
    assert sequences(drafted).device.type == torch.device(device).type and torch.equal(
        sequences(drafted), sequences(alone)
    ), mix
    if not options.get("return_dict_in_generate"):
        return verified
    for field in ("scores", "logits"):
        expected, got = getattr(alone, field), getattr(drafted, field)
        assert (expected is None) == (got is None), (field, mix)
        for i, (a, b) in enumerate(zip(expected or (), got or (), strict=True)):
            assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (field, i, mix)
    # Per column, a tuple of every layer's. A verification's forward over several tokens rounds otherwise than one-token
    # steps, which a family's large random weights amplify through its layers: up to 3e-4 on Dots3Note (seed 2147 of
    # the families' mixes) where its logits agreed within 4e-5 and its tokens exactly.
    for field in ("hidden_states", "attentions"):
        expected, got = getattr(alone, field), getattr(drafted, field)
        assert (expected is None) == (got is None), (field, mix)
        for i, (a, b) in enumerate(zip(expected or (), got or (), strict=True)):
            assert all(x.shape == y.shape for x, y in zip(a, b, strict=True)), (field, i, mix)
            assert all(torch.allclose(x, y, atol=1e-3, rtol=1e-3) for x, y in zip(a, b)), (field, i, mix)
    return verified


def returns_attentions(target, options: dict, ours: dict) -> bool:
    """Whether a drafter call returns the target alone's attentions on `target` (docs/usage.md): full or
    sliding-window attention, no recurrent states, no trees of branches, no static cache (whose every column the target
    alone's weights cover, where transformers' assisted loop returns the sequence's)."""
    from hf_domino.recurrent_cache_domino import keeps_recurrent_states

    if ours.get("domino_branches", 1) > 1 or keeps_recurrent_states(target) or "cache_implementation" in options:
        return False
    return set(getattr(target.config.get_text_config(), "layer_types", None) or ()) <= {
        "full_attention",
        "sliding_attention",
    }


@pytest.mark.parametrize("seed", seeds(32))
def test_greedy_option_mixes_are_the_target_alones(seed):
    greedy_mix(seed)


def test_most_mixes_verify_drafts_of_the_drafters_own():
    """The mixes compare outputs, which a drafter that never drafted would pass too: most of them verify drafts of
    the drafter's own (the rest draw options that leave it none: num_speculative_tokens=0, a single new token, a
    confidence threshold, copies taking every block)."""
    verified = []
    for mix in (greedy_mix, sampled_mix):
        for seed in range(8):
            with contextlib.suppress(pytest.skip.Exception):
                verified.append(mix(seed))
    assert sum(count > 0 for count in verified) >= len(verified) // 2 > 0


def random_family(rng: random.Random):
    """(target, drafter, vocabulary size): a family of test_architectures.py's (sliding windows, chunked, latent and
    sparse attention, learned positions, ...), random weights, and a random drafter."""
    from test_architectures import ARCHITECTURES, architecture_target

    target = architecture_target(rng.choice(sorted(ARCHITECTURES)))
    drafter = tiny_drafter(target, head=rng.random() < 0.7, block_size=rng.choice([4, 6]), seed=rng.randrange(100))
    return target, drafter, target.get_output_embeddings().weight.shape[0]


def second_turn_mix(seed: int, models=random_models) -> None:
    """One conversation or a batch of them, each turn's follow-up appended to every row (the mask says which columns
    are tokens: the prompts' left padding is not; what the rows generated, their padding included, and the
    follow-ups are): the drafter's turns, each continuing the cache, are the target alone's."""
    rng = random.Random(seed)
    target, drafter, vocab = models(rng)
    prompt = left_padded(random_rows(rng, vocab, rng.choice([1, 1, 2, 3])))
    rows = prompt["input_ids"].shape[0]
    turns = []
    for _ in range(2):
        options, ours = random_options(rng, range(4, vocab), 1, drafter)
        for name in OUTPUTS:
            options.pop(name, None)
        turns.append((options, ours, torch.tensor(random_rows(rng, vocab, 1)).repeat(rows, 1)))

    def conversation(with_drafter: bool) -> torch.Tensor:
        cache, ids, mask = DynamicCache(config=target.config), prompt["input_ids"], prompt["attention_mask"]
        for options, ours, follow_up in turns:
            drafting = dict(ours, assistant_model=drafter) if with_drafter else {}
            generated = target.generate(ids, attention_mask=mask, **{CACHE_ARGUMENT: cache}, **options, **drafting)
            # Left as the target alone leaves it (so the next turn continues it rather than reading it all again).
            assert cache.get_seq_length() == generated.shape[1] - 1, (with_drafter, turns)
            ids = torch.cat([generated, follow_up], dim=1)
            mask = torch.cat([mask, torch.ones(rows, ids.shape[1] - mask.shape[1], dtype=torch.long)], dim=1)
        return ids

    try:
        alone = conversation(with_drafter=False)
    except (ValueError, TypeError, RuntimeError) as error:
        pytest.skip(f"the target alone refuses or fails a turn ({type(error).__name__}: {error}): {turns}")
    assert torch.equal(conversation(with_drafter=True), alone), (type(target).__name__, turns)


@pytest.mark.parametrize("seed", seeds(16))
def test_a_second_turn_on_the_first_turns_cache_is_the_target_alones(seed):
    second_turn_mix(seed)


SAMPLERS = {
    "temperature": [0.5, 1.0, 1.5],
    "top_k": [0, 5, 20],
    "top_p": [0.8, 1.0],
    "min_p": [0.05, 0.2],
    "typical_p": [0.7],
    "epsilon_cutoff": [0.02],
    "eta_cutoff": [0.02],
    "num_return_sequences": [2, 3],
}


def draw_sampling(rng: random.Random, options: dict, copies: bool = True) -> None:
    """Sampling, with some of the warpers generation configs use and, where `copies`, several answers a prompt."""
    options["do_sample"] = True
    samplers = (
        SAMPLERS if copies else {name: values for name, values in SAMPLERS.items() if name != "num_return_sequences"}
    )
    options.update({name: rng.choice(values) for name, values in samplers.items() if rng.random() < 0.35})


def own_sampling(rng: random.Random) -> dict:
    """A request's own sampling settings (`DraftedBatchingManager.add_request`): one to three of them."""
    settings = {"temperature": rng.choice([0.3, 0.7, 1.5]), "top_k": rng.choice([1, 1, 3, 10]), "top_p": 0.9}
    return dict(rng.sample(sorted(settings.items()), rng.randint(1, 3)))


def ties_at_the_top(target) -> bool:
    """Whether the target's logits tie (a successor target's: every token but the successor at 0), so that where
    processors ban the successor, `top_k=1` keeps every tied token and draws among them."""
    return bool((target.get_output_embeddings().weight == 0).float().mean() > 0.5)


def sampled_answer_holds(tokens: list[int], limit: int, ends: set[int], vocab: int) -> bool:
    """What any sampled answer must be: tokens of the vocabulary up to an EOS, or `limit` of them without one."""
    end = next((i + 1 for i, token in enumerate(tokens) if token in ends), limit)
    return len(tokens) == min(end, limit) and all(0 <= token < vocab for token in tokens)


def sampled_mix(seed: int, models=random_models) -> int:
    """Sampling draws differ (each law is tested elsewhere); a mix must still run, give every row its answers
    (`num_return_sequences`) and stay inside the vocabulary. Returns the drafts of the drafter's own verified."""
    rng = random.Random(seed)
    target, drafter, vocab = models(rng)
    batch = left_padded(random_rows(rng, vocab, rng.choice([1, 2, 3])))
    options, ours = random_options(rng, range(4, vocab), 1, drafter)
    draw_sampling(rng, options)
    streamers = later_draws(rng, target, drafter, vocab, batch, options)
    alone, drafted = map(sequences, both_outputs(target, drafter, batch, options, ours, streamers))
    verified = own_drafts(drafter.last_generation_stats)
    mix = f"{type(target).__name__}: options {options}, drafter options {ours}, draft vocabulary {drafter.draft_vocab}"
    assert drafted.shape[0] == alone.shape[0], mix
    longest = options.get("max_length") or batch["input_ids"].shape[1] + options["max_new_tokens"]
    assert drafted.shape[1] <= longest, mix
    assert 0 <= drafted.min() and drafted.max() < vocab, mix
    # The streamer got the prompt, then each token.
    assert streamers is None or streamed(streamers[1]) == drafted[0].tolist() + ["end"], mix
    return verified


@pytest.mark.parametrize("seed", seeds(16))
def test_sampled_option_mixes_run_as_the_target_alone_runs(seed):
    sampled_mix(seed)


def served_options(rng: random.Random, target, drafter, vocab: int, prompts: list) -> tuple[dict, dict]:
    """A greedy mix for requests served together (`generate_batch`, the manager): their results hold tokens only, and
    a request's length limit is `max_new_tokens` (the lengths and streamer `later_draws` draws, counted from the first
    prompt, are dropped)."""
    options, ours = random_options(rng, range(4, vocab), 1, drafter)
    for name in OUTPUTS:
        options.pop(name, None)
    max_new_tokens = options["max_new_tokens"]
    later_draws(rng, target, drafter, vocab, {"input_ids": torch.tensor([prompts[0]])}, options)
    options.pop("max_length", None)
    options.pop("min_length", None)
    options["max_new_tokens"] = max_new_tokens
    return options, ours


def served_mix(seed: int, models=random_models, sampled: bool = False) -> None:
    """`generate_batch` with the drafter, a mix for all its requests: 2-7 prompts joining 1-4 rows as rows finish;
    greedy, each request's tokens are what the target alone generates for its prompt; `sampled`, each request gets
    an answer any sampling could give (`sampled_answer_holds`)."""
    from transformers import ContinuousBatchingConfig

    rng = random.Random(seed)
    target, drafter, vocab = models(rng)
    prompts = random_rows(rng, vocab, rng.randint(2, 7))
    options, ours = served_options(rng, target, drafter, vocab, prompts)
    if sampled:
        draw_sampling(rng, options, copies=False)
    try:
        expected = [
            target.generate(torch.tensor([p]), pad_token_id=0, **options)[0, len(p) :].tolist() for p in prompts
        ]
    except (ValueError, TypeError, RuntimeError) as error:  # (RuntimeError: a sampled mix's NaN, as both_outputs)
        pytest.skip(f"the target alone refuses or fails the mix ({type(error).__name__}: {error}): {options}")
    rows = ContinuousBatchingConfig(max_requests_per_batch=rng.randint(1, 4))
    results = target.generate_batch(
        prompts, assistant_model=drafter, continuous_batching_config=rows, pad_token_id=0, **options, **ours
    )
    mix = f"{type(target).__name__}: options {options}, drafter options {ours}, draft vocabulary {drafter.draft_vocab}"
    answers = [result.generated_tokens for result in results.values()]
    if not sampled:
        assert answers == expected, f"{mix}, {rows}"
        return
    assert len(answers) == len(prompts), f"{mix}, {rows}"
    ends = answer_ends(target, options)
    assert all(sampled_answer_holds(a, options["max_new_tokens"], ends, vocab) for a in answers), (answers, mix, rows)


def answer_ends(target, options: dict) -> set[int]:
    """The EOS tokens of a mix: its own, or the target's generation config's."""
    ends = options.get("eos_token_id", target.generation_config.eos_token_id)
    return set(ends if isinstance(ends, list) else [] if ends is None else [ends])


@pytest.mark.parametrize("seed", seeds(8))
def test_requests_served_in_option_mixes_are_the_target_alones(seed):
    served_mix(seed)


def sampled_served_mix(seed: int, models=random_models) -> None:
    served_mix(seed, models, sampled=True)


@pytest.mark.parametrize("seed", seeds(6))
def test_requests_served_sampling_in_option_mixes_run_as_the_target_alone_runs(seed):
    sampled_served_mix(seed)


def managed_mix(seed: int, models=random_models, sampled: bool = False) -> None:
    """The manager (`init_continuous_batching`) with the drafter, a mix in its generation config: 2-7 requests
    added while its thread runs (some before it starts, some after a first result, some from other threads), with
    their own `max_new_tokens` or streaming, one perhaps cancelled; greedy, every result a request gets is its target
    alone's tokens (a streamed one: their first ones); `sampled`, a request's final answer is one any sampling could
    give (`sampled_answer_holds`), its streamed results the answer's first tokens."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    rng = random.Random(seed)
    target, drafter, vocab = models(rng)
    prompts = random_rows(rng, vocab, rng.randint(2, 7))
    options, ours = served_options(rng, target, drafter, vocab, prompts)
    if sampled:
        draw_sampling(rng, options, copies=False)
    limits = [rng.randint(1, 30) if rng.random() < 0.3 else None for _ in prompts]
    streaming = [rng.random() < 0.3 for _ in prompts]
    # Sampling, a request may set its own temperature, top-k and top-p (`top_k=1`: its answer is certain).
    own = [own_sampling(rng) if sampled and rng.random() < 0.4 else {} for _ in prompts]
    try:
        expected = [
            target.generate(
                torch.tensor([p]),
                pad_token_id=0,
                **dict(options, max_new_tokens=limit or options["max_new_tokens"], **settings),
            )[0, len(p) :].tolist()
            for p, limit, settings in zip(prompts, limits, own, strict=True)
        ]
    except (ValueError, TypeError, RuntimeError) as error:  # (RuntimeError: a sampled mix's NaN, as both_outputs)
        pytest.skip(f"the target alone refuses or fails the mix ({type(error).__name__}: {error}): {options}")
    rows = ContinuousBatchingConfig(max_requests_per_batch=rng.randint(1, 4))
    config = GenerationConfig(pad_token_id=0, **options)
    manager = target.init_continuous_batching(config, rows, assistant_model=drafter, **ours)
    mix = f"{type(target).__name__}: options {options}, drafter options {ours}, draft vocabulary {drafter.draft_vocab}"
    mix += f", requests' own sampling {own}" if any(own) else ""
    add = lambda i: manager.add_request(  # noqa: E731
        prompts[i], f"r{i}", max_new_tokens=limits[i], streaming=streaming[i], **own[i]
    )
    # Requests [0, before) come before start(), [before, early) right after it, the rest after a first result
    # (perhaps) and from threads of their own (perhaps).
    early = rng.randint(1, len(prompts))
    before, waits, threaded = rng.randint(0, early), rng.random() < 0.5, rng.random() < 0.5
    cancelled = f"r{rng.randrange(early)}" if rng.random() < 0.3 else None
    waits = waits and early > (cancelled is not None)  # (a result to wait for)
    results: dict[str, list] = {}
    try:
        for i in range(before):
            add(i)
        manager.start()
        for i in range(before, early):
            add(i)
        if cancelled is not None:
            manager.cancel_request(cancelled)
        if waits:
            first = manager.get_result(timeout=60)
            assert first is not None, f"no result within 60 s: {mix}"
            results.setdefault(first.request_id, []).append(first)
        if threaded:
            threads = [threading.Thread(target=add, args=(i,)) for i in range(early, len(prompts))]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        else:
            for i in range(early, len(prompts)):
                add(i)
    finally:
        manager.stop(timeout=120)
    assert manager.error is None and not manager.is_running(), (manager.error, mix)
    while (result := manager.get_result(timeout=0)) is not None:
        results.setdefault(result.request_id, []).append(result)
    ends = answer_ends(target, options)
    for i, answer in enumerate(expected):
        got = results.get(f"r{i}", [])
        finished = [result.generated_tokens for result in got if result.is_finished()]
        certain = own[i].get("top_k") == 1 and not ties_at_the_top(target)
        if sampled and not certain:  # the answer is the one it got, if it got one
            if not finished:
                assert f"r{i}" == cancelled, (i, got, mix, rows)
                continue
            limit = limits[i] or options["max_new_tokens"]
            assert sampled_answer_holds(finished[0], limit, ends, vocab), (i, finished, mix, rows)
            answer = finished[0]
        assert f"r{i}" == cancelled or finished == [answer], (i, answer, finished, mix, rows)
        assert all(result.generated_tokens == answer[: len(result.generated_tokens)] for result in got), (i, mix)


@pytest.mark.parametrize("seed", seeds(8))
def test_requests_added_to_the_manager_in_option_mixes_are_the_target_alones(seed):
    managed_mix(seed)


def sampled_managed_mix(seed: int, models=random_models) -> None:
    managed_mix(seed, models, sampled=True)


@pytest.mark.parametrize("seed", seeds(6))
def test_requests_added_to_the_manager_sampling_in_option_mixes_run_as_the_target_alone_runs(seed):
    sampled_managed_mix(seed)


@pytest.mark.parametrize("seed", seeds(4))
@pytest.mark.parametrize(
    "mix",
    [greedy_mix, second_turn_mix, sampled_mix, served_mix, managed_mix, sampled_served_mix, sampled_managed_mix],
    ids=lambda mix: mix.__name__,
)
def test_option_mixes_on_other_families_as_on_qwen3_and_llama(mix, seed):
    """Each kind of mix above on a family of test_architectures.py's: what a family cannot serve is refused as
    documented, and skipped."""
    try:
        mix(seed, models=random_family)
    except ValueError as error:
        if not re.search(r"domino_branches=\d cannot serve this call|cannot drop the drafts", str(error)):
            raise
        pytest.skip(f"refused as documented: {error}")


@pytest.fixture(scope="module", params=["eager", "prepared"])
def smollm2_pair(request):
    import hf_domino
    from hf_domino.assets import load_drafter, load_target

    target, tokenizer = load_target("smollm2", device="cpu")
    drafter = load_drafter()
    if request.param == "prepared":
        hf_domino.prepare_for_cpu_decoding(target, drafter)
    tokenizer.padding_side = "left"
    return target, tokenizer, drafter


@pytest.mark.slow
@pytest.mark.parametrize("seed", seeds(10))
def test_option_mixes_on_the_real_target_are_its_own_output(smollm2_pair, seed):
    """The same on SmolLM2 with the shipped drafter (its draft vocabulary, datastore and head), eager and prepared:
    chat prompts of MT-Bench and HumanEval, 1-3 rows, stop strings too."""
    from hf_domino.prompt_sets import load_prompts

    target, tokenizer, drafter = smollm2_pair
    rng = random.Random(seed)
    chats = rng.sample(load_prompts("mtbench", 20) + load_prompts("humaneval", 20), rng.choice([1, 1, 2, 3]))
    texts = [tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) for chat in chats]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    options, ours = random_options(rng, range(200, 3000), tokenizer.eos_token_id, drafter)
    options.pop("forced_bos_token_id", None)  # a first token out of the chat: fine, but it says nothing more here
    if rng.random() < 0.3:
        options.update(stop_strings=rng.sample([".", "\n", " the", "return", ":"], 2), tokenizer=tokenizer)
    for name, chance in (("domino_datastore", 0.2), ("draft_vocab", 0.15)):
        if rng.random() < chance:
            ours[name] = False
    alone, drafted = map(sequences, both_outputs(target, drafter, batch, options, ours))
    assert torch.equal(drafted, alone), f"options {options}, drafter options {ours}"

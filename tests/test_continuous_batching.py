"""`target.generate_batch(prompts, assistant_model=drafter)`: requests join the drafted batch as rows finish, and each
generates what the target alone generates for it."""

from __future__ import annotations

import pytest
import torch
from conftest import forcing_drafter, successor_target, tiny_drafter, tiny_target
from test_batching import left_padded, prefill_rows
from test_generation import (
    chi_square_p_value,
    drafts_and_accepted,
    exact_sequence_distribution,
    law_drafter,
    law_target,
    successor,
)
from transformers import ContinuousBatchingConfig, GenerationConfig, LogitsProcessorList
from transformers.cache_utils import DynamicCache
from transformers.generation.continuous_batching.requests import RequestStatus

from hf_domino import batch_policy_domino
from hf_domino.cache_domino import buffer_layers
from hf_domino.drafting_domino import DrafterContext, run_backbone
from hf_domino.modeling_domino import TargetModules
from hf_domino.ragged_batch_domino import BatchedDrafterContext, run_batched_backbone
from hf_domino.ragged_cache_domino import RaggedCache, ragged_forward

VOCAB = 32
EOS = 1
PROMPTS = [[4, 9, 11], [20], [7, 25, 26, 27, 28, 3, 14], [12, 13], [5, 6], [30, 2, 8, 17], [22, 23, 24]]


def rows_at_most(rows: int) -> ContinuousBatchingConfig:
    return ContinuousBatchingConfig(max_requests_per_batch=rows)


def alone(target, prompt: list[int], **settings) -> list[int]:
    """What the target alone generates for one prompt, greedy."""
    output = target.generate(torch.tensor([prompt]), do_sample=False, pad_token_id=0, **settings)
    return output[0, len(prompt) :].tolist()


def followed_by(target, prompts: list[list[int]], **settings) -> list[int]:
    """next[token] = the token the target alone put after it last, over its answers to `prompts`: a forcing drafter
    with this table drafts the target's own continuation often, and misses where answers disagree."""
    table = list(range(VOCAB))
    for prompt in prompts:
        tokens = prompt + alone(target, prompt, **settings)
        for token, following in zip(tokens, tokens[1:]):
            table[token] = following
    return table


def random_target(arch: str, **overrides):
    return tiny_target(arch, vocab_size=VOCAB, hidden_size=32, num_layers=2, eos_token_id=EOS, seed=5, **overrides)


# ------------------------------------------------------------------------------------------ greedy: token-identical
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_each_request_is_what_the_target_alone_generates_for_it(arch, policy, rows):
    target = random_target(arch)
    settings = dict(max_new_tokens=20, eos_token_id=EOS)
    drafter = forcing_drafter(target, followed_by(target, PROMPTS, **settings), block_size=6)
    results = target.generate_batch(
        PROMPTS,
        GenerationConfig(do_sample=False, pad_token_id=0, **settings),
        continuous_batching_config=rows_at_most(rows),
        assistant_model=drafter,
        draft_policy=policy,
    )
    assert list(results) == [f"req_{i}" for i in range(len(PROMPTS))]
    expected = [alone(target, prompt, **settings) for prompt in PROMPTS]
    assert [result.generated_tokens for result in results.values()] == expected
    assert {len(tokens) for tokens in expected} != {20}  # some requests stopped at EOS, others ran to the limit
    assert all(result.status == RequestStatus.FINISHED and result.error is None for result in results.values())
    # The same answers as transformers' continuous batching of the target alone.
    # (Its paged cache sized by hand: by default it takes a share of the machine's memory.)
    small = ContinuousBatchingConfig(num_blocks=16, page_size=16)
    own = target.generate_batch(PROMPTS, GenerationConfig(do_sample=False, pad_token_id=0, **settings), small)
    assert [result.generated_tokens for result in own.values()] == expected
    stats = drafter.last_generation_stats
    if policy == "fixed":
        assert len(set(stats.acceptance_lengths)) > 2  # rows accepted whole, partial and no blocks


def test_a_requests_sequences_read_its_prompt_once(arch):
    # num_return_sequences: a request's copies join together, read their prompt once and share its cache columns;
    # each generates what the target alone does (top-k 1 makes sampling as deterministic as greedy).
    target = random_target(arch)
    settings = dict(max_new_tokens=12, eos_token_id=EOS)
    drafter = forcing_drafter(target, followed_by(target, PROMPTS[:3], **settings), block_size=4)
    config = GenerationConfig(do_sample=True, top_k=1, num_return_sequences=3, pad_token_id=0, **settings)
    with prefill_rows(target) as rows:
        results = target.generate_batch(PROMPTS[:3], config, continuous_batching_config=rows_at_most(6),
                                        assistant_model=drafter, draft_policy="fixed")  # fmt: skip
    for request_id, result in results.items():
        prompt = PROMPTS[int(request_id.split("__")[0].removeprefix("req_"))]
        assert result.generated_tokens == alone(target, prompt, **settings), request_id
    assert len(results) == 9 and sum(rows) == 3  # each prompt read once: 3 rows in all


@pytest.mark.parametrize("chunk", [2, 3])
def test_joining_prompts_are_read_in_the_calls_chunks(arch, chunk, monkeypatch):
    # prefill_chunk_size bounds what a forward reads of the prompts that join a served batch, as it bounds a
    # generate() prompt's: each request still generates what the target alone does, and the drafter's context of a
    # joining row is its whole prompt (the leading chunks' features, then the last's), as after a prompt read whole.
    target = random_target(arch)
    settings = dict(max_new_tokens=12, eos_token_id=EOS)
    drafter = forcing_drafter(target, followed_by(target, PROMPTS, **settings), block_size=4)
    joined, add_rows = [], BatchedDrafterContext.add_rows

    def recorded(context, contexts):
        joined.append([features.clone() for features in contexts])
        return add_rows(context, contexts)

    monkeypatch.setattr(BatchedDrafterContext, "add_rows", recorded)

    def serve(chunk_size: int | None) -> tuple[list, list, list]:
        joined.clear()
        config = GenerationConfig(do_sample=False, pad_token_id=0, prefill_chunk_size=chunk_size, **settings)
        with prefill_rows(target, dim=1) as widths:
            results = target.generate_batch(PROMPTS, config, continuous_batching_config=rows_at_most(3),
                                            assistant_model=drafter, draft_policy="fixed")  # fmt: skip
        return [result.generated_tokens for result in results.values()], widths, [c for cs in joined for c in cs]

    whole, whole_widths, whole_contexts = serve(None)
    chunked, widths, contexts = serve(chunk)
    assert chunked == whole == [alone(target, prompt, **settings) for prompt in PROMPTS]
    assert max(whole_widths) == 7 and max(widths) == chunk and len(widths) > len(whole_widths)
    assert [len(c) for c in contexts] == [len(c) for c in whole_contexts] == [len(p) for p in PROMPTS]
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(whole_contexts, contexts, strict=True))


def test_a_row_joins_with_its_prompt_read_alone_and_its_cache_joined_to_the_batchs():
    # Caches filled apart and joined (holes on the left of the narrower side) give each row what it gives alone.
    target = random_target("qwen3")
    prompts, extra = [[4, 9, 11, 3], [20]], [7, 25, 26, 27, 28, 3]
    batch = left_padded(prompts)
    joined = RaggedCache(buffer_layers(DynamicCache(config=target.config)), batch["attention_mask"][:, :0].bool())
    ragged_forward(target, joined, batch["input_ids"], batch["attention_mask"].bool(), [])
    own = RaggedCache(buffer_layers(DynamicCache(config=target.config)), torch.zeros(1, 0, dtype=torch.bool))
    ragged_forward(target, own, torch.tensor([extra]), torch.ones(1, len(extra), dtype=torch.bool), [])
    joined.add_rows(own)
    assert joined.mask.tolist() == [[False, False] + [True] * 4, [False] * 5 + [True], [True] * 6]
    step = torch.tensor([[5], [6], [8]])
    logits = ragged_forward(target, joined, step, torch.ones(3, 1, dtype=torch.bool), []).logits[:, -1]
    for row, prompt in enumerate([*prompts, extra]):
        expected = target(torch.tensor([prompt + step[row].tolist()])).logits[0, -1]
        torch.testing.assert_close(logits[row], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layers", [{}, {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4}])
def test_a_joining_rows_drafter_context_gives_what_it_gives_alone(layers):
    """A row joining the drafter's ragged context (`BatchedDrafterContext.add_rows`) after others drafted drafts what
    the batch-1 ladder drafts for it alone, and the rows already there are unchanged."""
    target = tiny_target("llama")
    drafter = tiny_drafter(target, block_size=5, **layers)
    modules = TargetModules.from_target(target)
    torch.manual_seed(2)
    size = drafter.config.context_size
    batched, single = BatchedDrafterContext.empty(2, drafter.device), [DrafterContext() for _ in range(3)]
    appends = [[3, 7], [2, 0], [5, 1, 0], [1, 3, 2], [0, 2, 1]]  # cycles x rows: the third row joins at cycle 2
    for counts in appends:
        rows = len(counts)
        if rows > batched.known.shape[0]:  # the joining row's prompt: 6 tokens' features
            prompt = torch.randn(6, size)
            batched.add_rows([prompt])
            single[2].append(prompt[None])
        features = torch.randn(rows, max(counts), size)
        batched.append(features, counts)
        for row, count in enumerate(counts):
            if count:
                single[row].append(features[row : row + 1, :count])
        anchors = torch.randint(4, 64, (rows, 1))
        with torch.no_grad():
            hidden = run_batched_backbone(drafter, modules, anchors, batched, 4)
            for row in range(rows):
                alone = run_backbone(drafter, modules, anchors[row : row + 1], single[row], 4)
                torch.testing.assert_close(hidden[row : row + 1], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [None, 3])
def test_sliding_window_targets_keep_each_rows_window(chunk):
    # (In chunks: a joining prompt's window reaches back into its chunks before, among its left padding.)
    target = random_target("qwen3", layer_types=["sliding_attention", "full_attention"], sliding_window=4,
                           use_sliding_window=True)  # fmt: skip
    settings = dict(max_new_tokens=16, eos_token_id=EOS, prefill_chunk_size=chunk)
    drafter = forcing_drafter(target, followed_by(target, PROMPTS, **settings), block_size=6)
    results = target.generate_batch(
        PROMPTS, GenerationConfig(do_sample=False, pad_token_id=0, draft_policy="fixed", **settings),
        continuous_batching_config=rows_at_most(3), assistant_model=drafter,
    )  # fmt: skip
    assert [result.generated_tokens for result in results.values()] == [alone(target, p, **settings) for p in PROMPTS]


def test_generation_settings_act_per_request_as_generate_builds_them():
    # Processors and criteria generate() builds from the prompt's length (min_new_tokens), and stop strings.
    target = random_target("llama")
    drafter = tiny_drafter(target, block_size=4)
    for settings in (dict(max_new_tokens=12, min_new_tokens=8, eos_token_id=EOS, repetition_penalty=1.3),
                     dict(max_new_tokens=12, no_repeat_ngram_size=2)):  # fmt: skip
        results = target.generate_batch(PROMPTS, assistant_model=drafter, draft_policy="fixed", do_sample=False,
                                        pad_token_id=0, continuous_batching_config=rows_at_most(2), **settings)  # fmt: skip
        expected = [alone(target, prompt, **settings) for prompt in PROMPTS]
        assert [result.generated_tokens for result in results.values()] == expected
    # Whole blocks meet the penalty (test_batching's test_repetition_penalty_acts_per_row): a drafted column's reads
    # the drafts before it.
    target = successor_target("llama", VOCAB, step=16, runner_up=3)
    drafter = forcing_drafter(target, successor(16), block_size=8)
    settings = dict(max_new_tokens=24, repetition_penalty=1.5)
    results = target.generate_batch(PROMPTS, assistant_model=drafter, draft_policy="fixed", do_sample=False,
                                    pad_token_id=0, continuous_batching_config=rows_at_most(2), **settings)  # fmt: skip
    assert [result.generated_tokens for result in results.values()] == [alone(target, p, **settings) for p in PROMPTS]
    assert max(drafter.last_generation_stats.acceptance_lengths) > 1


def test_results_carry_timestamps_and_lifespans_and_stats():
    target = random_target("qwen3")
    drafter = tiny_drafter(target, block_size=4)
    results = target.generate_batch(PROMPTS, assistant_model=drafter, max_new_tokens=6, do_sample=False,
                                    pad_token_id=0, record_timestamps=True, progress_bar=True,
                                    continuous_batching_config=rows_at_most(2))  # fmt: skip
    for result, prompt in zip(results.values(), PROMPTS):
        assert result.prompt_ids == prompt
        assert len(result.timestamps) == len(result.generated_tokens) > 0  # one per token (EOS may come early)
        assert result.lifespan[0] <= result.timestamps[0] <= result.timestamps[-1] <= result.lifespan[1]
    assert drafter.last_generation_stats.acceptance_lengths  # the call's drafting statistics


@pytest.mark.parametrize(
    "name", ["mistral", "gemma2", "gemma3", "gpt_oss", "deepseek_v3", "qwen2", "gemma4", "deepseek_v32", "dots3_note"]
)
def test_other_families_serve_requests_exactly(name):
    # Sliding windows counted per row (Mistral, Gemma 2/3, gpt-oss), attention sinks, latent attention, layers that
    # read another layer's keys (Gemma 4), sparse attention's indexer keys (DeepSeek-V3.2, dots.llm3): joined rows
    # with holes on their left, random drafts rejected in part.
    from test_architectures import GREEDY, architecture_target, had_rejections

    target = architecture_target(name)
    drafter = tiny_drafter(target)
    prompts = [[5, 9, 12, 7, 30, 5, 9, 12, 7, 30, 22], [11, 5, 9], [40, 41, 42, 5, 9, 12, 7], [3, 4]]
    settings = {**GREEDY, "max_new_tokens": 24}
    results = target.generate_batch(prompts, assistant_model=drafter, draft_policy="fixed", num_speculative_tokens=4,
                                    continuous_batching_config=rows_at_most(2), **settings)  # fmt: skip
    expected = [target.generate(torch.tensor([p]), **settings)[0, len(p) :].tolist() for p in prompts]
    assert [result.generated_tokens for result in results.values()] == expected
    assert had_rejections(drafter.last_generation_stats)


def test_targets_whose_cache_rows_cannot_join_are_refused():
    import transformers as tf

    torch.manual_seed(0)  # ALiBi over cache columns: holes would change its distances
    config = tf.MptConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=2, use_cache=True, eos_token_id=1,
                          pad_token_id=0)  # fmt: skip
    target = tf.MptForCausalLM(config).eval()
    drafter = tiny_drafter(target)
    with pytest.raises(ValueError, match="one prompt at a time"):
        target.generate_batch([[4, 5, 6]], assistant_model=drafter, max_new_tokens=4)


@pytest.mark.parametrize("chunk", [None, 4])
@pytest.mark.parametrize("name", ["qwen3_5", "nemotron_h", "falcon_h1", "mamba2"])
def test_targets_with_recurrent_layers_serve_requests_exactly(name, chunk):
    # Each request's recurrent states and convolution windows, read apart, join the running batch by rows
    # (`add_state_rows`), with the columns of its attention layers; a request's copies share its prompt's states;
    # drafts rejected in part. Before, refused ("keeps more than keys and values per token").
    from test_recurrent_targets import (
        BATCH,
        GREEDY,
        PROMPT,
        hybrid_target,
        rolled_back,
        states_show_in_logits,
        successor_table,
    )

    target = hybrid_target(name)
    states_show_in_logits(target)  # so that the greedy answers depend on each row's states being its own
    drafter = forcing_drafter(target, successor_table(target.generate(PROMPT, max_new_tokens=40, **GREEDY)))
    prompts = [*BATCH, [5, 9, 12, 7, 30, 22]]
    settings = {**GREEDY, "max_new_tokens": 20, "pad_token_id": 0, "prefill_chunk_size": chunk}
    results = target.generate_batch(prompts, assistant_model=drafter, draft_policy="fixed", num_speculative_tokens=4,
                                    continuous_batching_config=rows_at_most(2), **settings)  # fmt: skip
    # (Each prompt read whole by the target alone: transformers 5.24's own chunks fail on Mamba2's cache.)
    alone = {**settings, "prefill_chunk_size": None}
    expected = [target.generate(torch.tensor([p]), **alone)[0, len(p) :].tolist() for p in prompts]
    assert [result.generated_tokens for result in results.values()] == expected
    assert rolled_back(drafter.last_generation_stats) > 0
    if name == "qwen3_5":  # what a drafted batch does not serve on such a target, named as generate() names it
        with pytest.raises(ValueError, match="linear_attention layers"):
            target.generate_batch(prompts, assistant_model=drafter, domino_branches=2, **settings)


# ----------------------------------------------------------------------------------------------- sampling: the law
def test_sampling_keeps_each_requests_law_with_num_return_sequences(gpu_like_costs):
    vocab, num_new, draws = 5, 3, 1000
    target = law_target(vocab, seed=3, peak=4)  # peaked laws, so that a wrong one is told apart (below)
    drafter = law_drafter(target)
    prompts = [[2, 4, 1], [3]]
    torch.manual_seed(7)
    config = GenerationConfig(do_sample=True, temperature=0.5, max_new_tokens=num_new, num_return_sequences=draws,
                              pad_token_id=0, draft_policy="fixed")  # fmt: skip
    results = target.generate_batch(prompts, config, assistant_model=drafter,
                                    continuous_batching_config=rows_at_most(64))  # fmt: skip
    assert len(results) == 2 * draws
    assert list(results)[draws - 2 : draws + 1] == [f"req_0__child#{draws - 2}", "req_0", "req_1__child#0"]
    drafted, accepted = drafts_and_accepted([drafter.last_generation_stats])
    assert 0 < accepted < drafted  # rejection sampling really ran, with both outcomes
    counts = [{}, {}]
    for request_id, result in results.items():
        prompt = int(request_id.split("__")[0].removeprefix("req_"))
        key = tuple(result.generated_tokens)
        counts[prompt][key] = counts[prompt].get(key, 0) + 1
    from transformers.generation.logits_process import TemperatureLogitsWarper

    for prompt, observed in zip(prompts, counts):
        probs = exact_sequence_distribution(
            target, prompt, num_new, LogitsProcessorList([TemperatureLogitsWarper(0.5)])
        )
        assert chi_square_p_value(observed, probs, draws) > 1e-3
    # The test can fail: the same draws are far from a wrong law (the untempered target).
    wrong = exact_sequence_distribution(target, prompts[0], num_new, LogitsProcessorList())
    assert chi_square_p_value(counts[0], wrong, draws) < 1e-6


# --------------------------------------------------------------------------------------------------- bad requests
def test_what_a_refilled_batch_does_not_serve_is_refused_with_the_fix():
    target = random_target("qwen3")
    drafter = tiny_drafter(target, block_size=4)
    with pytest.raises(ValueError, match="return_logprobs"):
        target.generate_batch(PROMPTS, assistant_model=drafter,
                              continuous_batching_config=ContinuousBatchingConfig(return_logprobs=True))  # fmt: skip
    with pytest.raises(TypeError, match="attention_mask"):
        target.generate_batch(PROMPTS, assistant_model=drafter, attention_mask=torch.ones(1, 3))
    with pytest.raises(ValueError, match="num_beams"):
        target.generate_batch(PROMPTS, assistant_model=drafter, num_beams=2)
    with pytest.raises(ValueError, match=r"prompt 1 is dict .*\['input_ids'\]"):
        target.generate_batch([[4, 5], {"input_ids": [4, 5]}], assistant_model=drafter)
    with pytest.raises(ValueError, match="prompt 0 is list"):
        target.generate_batch([[[4, 5]]], assistant_model=drafter)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        target.generate_batch([[4, 5], []], assistant_model=drafter)
    assert target.generate_batch([], assistant_model=drafter) == {}


def test_lengths_are_read_as_generate_reads_them():
    """Without max_new_tokens generate() gives 20 new tokens (its default max_length counts from the prompt, within
    the model's positions); the drafted batch counted 20 in all, so SmolLM2's chat prompts (over 20 tokens, its
    generation config naming no length) got empty answers. A max_length the prompt reaches, and a max_new_tokens that
    is not a positive integer, are generate()'s errors (an empty answer, a TypeError in the middle of the call)."""
    target = random_target("qwen3", max_position_embeddings=64)
    drafter = tiny_drafter(target, block_size=4)
    prompts = [[4, 9, 11], list(range(2, 27)), list(range(2, 30)) + list(range(2, 30))]  # 3, 25 and 56 tokens
    results = target.generate_batch(
        prompts, GenerationConfig(do_sample=False, pad_token_id=0), assistant_model=drafter
    )
    answers = [result.generated_tokens for result in results.values()]
    assert answers == [alone(target, prompt) for prompt in prompts]
    assert [len(answer) for answer in answers] == [20, 20, 8]  # the last within the model's 64 positions
    with pytest.raises(ValueError, match="Input length of input_ids is 25, but `max_length` is set to 10"):
        target.generate_batch(prompts[1:2], assistant_model=drafter, max_length=10)
    for bad in (2.5, 0, -3):
        with pytest.raises(ValueError, match="max_new_tokens"):
            target.generate_batch(prompts[:1], assistant_model=drafter, max_new_tokens=bad)
    with pytest.raises(ValueError, match="max_requests_per_batch = -1 but expected an integer >= 1"):
        target.generate_batch(prompts, assistant_model=drafter, continuous_batching_config=rows_at_most(-1))  # hung


def test_a_call_is_judged_against_plain_steps_that_join_as_its_requests_join(monkeypatch):
    # Judged as if all its requests had started together, a call of 21 requests, 3 rows at a time, read 0.27x plain
    # steps with a drafter whose drafts held, and every second call took plain steps only (0 drafting cycles). The
    # judge now gets the rows at a time (test_batch_judge checks what it makes of them).
    from conftest import successor_target

    judged = []
    judge = batch_policy_domino.judge_call
    monkeypatch.setattr(batch_policy_domino, "judge_call", lambda *a, **k: judged.append(a[4:]) or judge(*a, **k))
    target = successor_target("qwen3", VOCAB)
    drafter = forcing_drafter(target, [(t + 1) % VOCAB for t in range(VOCAB)], block_size=6)
    config = GenerationConfig(do_sample=False, pad_token_id=0, max_new_tokens=40, eos_token_id=EOS)
    target.generate_batch(PROMPTS * 3, config, rows_at_most(3), assistant_model=drafter)
    target.generate_batch(PROMPTS * 3, config, rows_at_most(2), assistant_model=drafter)
    # The rows at a time, and when each request came: all at the call's start.
    assert judged == [(3, [0.0] * 21), (2, [0.0] * 21)]


@pytest.mark.slow
def test_the_serving_benchmark_runs_as_a_user_runs_it():
    # The script docs/benchmarks.md quotes, at toy size: it asserts every drafted answer is the target alone's.
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "serve_requests.py"
    run = subprocess.run(
        [sys.executable, str(script), "--num-prompts", "4", "--rows", "2", "--max-new-tokens", "12", "--repeats", "1"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    joining = next(line for line in run.stdout.splitlines() if "drafter, generate_batch (joining)" in line)
    assert "0 of 4 answers differing from the target alone's" in joining, run.stdout

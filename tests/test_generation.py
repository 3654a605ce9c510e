"""generate() / pipeline() with a Domino drafter inside transformers' assisted-decoding loop: lossless and exact."""

from __future__ import annotations

import copy
import inspect
import time

import pytest
import torch
from conftest import forcing_drafter, own_drafts, successor_target, tiny_drafter, tiny_target
from reference_domino import draft_greedy, reference_config
from transformers import (
    DynamicCache,
    GenerationConfig,
    GenerationMixin,
    LogitsProcessor,
    LogitsProcessorList,
    Qwen3ForCausalLM,
    StoppingCriteria,
    StoppingCriteriaList,
    SynthIDTextWatermarkingConfig,
    WatermarkingConfig,
)
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.streamers import BaseStreamer

from hf_domino import attention_kernels_domino, generate_hook_domino
from hf_domino.cache_domino import cache_argument
from hf_domino.modeling_domino import DOMINO_HEAD_DEFAULT, TargetModules

VOCAB = 32


def successor(step: int = 1) -> list[int]:
    return [(t + step) % VOCAB for t in range(VOCAB)]


def greedy(target, input_ids, **kwargs):
    # These tests exercise whole blocks (EOS inside a block, stop strings, ...), so they fix the draft length; the
    # adaptive policy, which may skip drafting on models this small, has its own tests in test_draft_policy.py.
    if generate_hook_domino.is_domino_drafter(kwargs.get("assistant_model")):
        kwargs.setdefault("draft_policy", "fixed")
    return target.generate(input_ids, do_sample=False, **kwargs)


# ------------------------------------------------------------------------------------------ greedy: token-identical
@pytest.mark.parametrize(
    "next_token, regime",
    [
        (successor(1), "full"),  # every draft accepted, plus the bonus token
        ([(t + 1) % VOCAB if t % 5 else 0 for t in range(VOCAB)], "partial"),
        (successor(2), "none"),
    ],
)
@pytest.mark.parametrize("shift_label", [True, False])
def test_greedy_identical_in_each_acceptance_regime(arch, next_token, regime, shift_label):
    target = successor_target(arch, VOCAB)
    drafter = forcing_drafter(target, next_token, block_size=6, shift_label=shift_label)
    prompt = torch.tensor([[4, 9, 11]])
    expected = greedy(target, prompt, max_new_tokens=23)
    assert torch.equal(greedy(target, prompt, max_new_tokens=23, assistant_model=drafter), expected)
    lengths = drafter.last_generation_stats.acceptance_lengths
    drafts = drafter.config.num_drafts
    if regime == "full":
        assert max(lengths) == drafts + 1
    elif regime == "none":
        assert set(lengths) == {1}
    else:
        assert 1 < max(lengths) <= drafts
    assert 1 + sum(lengths) == expected.shape[1] - prompt.shape[1]  # prefill token + one entry per forward


def test_greedy_identical_random_models(arch):
    target = tiny_target(arch)
    for head in (True, False):
        drafter = tiny_drafter(target, head=head)
        for seed in range(3):
            prompt = torch.randint(4, 64, (1, 5 + seed), generator=torch.Generator().manual_seed(seed))
            assert torch.equal(
                greedy(target, prompt, max_new_tokens=17, assistant_model=drafter),
                greedy(target, prompt, max_new_tokens=17),
            )
            assert own_drafts(drafter.last_generation_stats) > 0  # the drafter's drafts were verified (and rejected)


def test_eos_inside_block_stops_like_target():
    target = successor_target("qwen3", VOCAB)  # ... 29, 30, 31, 0, 1 (= EOS)
    drafter = forcing_drafter(target, successor(1), block_size=8)
    prompt = torch.tensor([[20, 27]])
    expected = greedy(target, prompt, max_new_tokens=30)
    assert expected[0, -1].item() == 1 and expected.shape[1] < 2 + 30
    assert torch.equal(greedy(target, prompt, max_new_tokens=30, assistant_model=drafter), expected)
    assert ended_in_a_drafted_block(drafter.last_generation_stats)


def ended_in_a_drafted_block(stats) -> bool:
    """Whether a call's last forward verified a block of the drafter's own (more than one draft): a stop that
    ends such a call fired inside the block, not at a plain step."""
    return stats.drafted[-1] > 1 and not (stats.copied[-1] or stats.retrieved[-1])


class NothingPastAnEnd(LogitsProcessor):
    """Fails on a sequence that goes on past an EOS token (a finished row's padding aside): the target alone never
    shows its processors one, and some fail on it (no-repeat n-grams banning the EOS, then a length penalty on its
    `-inf`: NaN)."""

    def __init__(self, eos: int, pad: int):
        self.eos, self.pad = eos, pad

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        for row in input_ids.tolist():
            if self.eos in row:
                assert set(row[row.index(self.eos) + 1 :]) <= {self.pad}, f"a sequence past its end: {row}"
        return scores


@pytest.mark.parametrize("rows", [[[20, 27]], [[20, 27], [3, 4, 5]]], ids=["one-sequence", "batch"])
@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled"])
def test_a_block_ends_at_an_eos_draft(rows, do_sample):
    # Drafts and copies after an EOS draft are never generated: none is offered, and processors never see them.
    from test_batching import left_padded

    target = successor_target("qwen3", VOCAB)  # ... 29, 30, 31, 0, 1 (= EOS): the drafts run past it
    drafter = forcing_drafter(target, successor(1), block_size=8)
    batch = left_padded(rows)
    options = dict(max_new_tokens=30, do_sample=do_sample, pad_token_id=0, eos_token_id=1)
    processors = LogitsProcessorList([NothingPastAnEnd(eos=1, pad=0)])
    drafting = dict(assistant_model=drafter, draft_policy="fixed")
    output = target.generate(**batch, logits_processor=processors, **options, **drafting)
    assert (output == 1).any(dim=1).all()  # every row reached its EOS
    assert own_drafts(drafter.last_generation_stats) > 0
    if not do_sample:
        assert torch.equal(output, target.generate(**batch, logits_processor=processors, **options))


@pytest.mark.parametrize("rows", [[[25, 22, 22]], [[25, 22, 22], [9, 14]]], ids=["one-sequence", "batch"])
def test_a_draft_vocabulary_without_the_eos_keeps_the_length_penalty_finite(rows):
    # Spread over the whole vocabulary, the EOS's draft logit would be -inf, which remove_invalid_values makes the
    # most negative float and the exponential length penalty then takes past the largest: NaN, where the target
    # alone has none (option mix seed 559: every drafted call failed). The EOS is drafted over with the vocabulary.
    from test_batching import left_padded

    target = tiny_target("qwen3", vocab_size=32)
    drafter = tiny_drafter(target)
    drafter.set_draft_vocab([0, 2, 4, 5, 6, 8, 9, 10, 11, 12, 13, 17, 19, 22, 25, 26])  # no EOS (1)
    options = dict(
        do_sample=True, max_new_tokens=24, eos_token_id=1, pad_token_id=0, remove_invalid_values=True,
        exponential_decay_length_penalty=(4, 1.5), temperature=1.5, typical_p=0.7,
    )  # fmt: skip
    for seed in range(5):
        torch.manual_seed(seed)
        output = target.generate(**left_padded(rows), **options, assistant_model=drafter, draft_policy="fixed")
        assert output.shape[0] == len(rows) and 0 <= output.min() and output.max() < 32


CHUNKED_ROWS = [[[7, 8, 9, 10, 11, 12, 13]], [[7, 8, 9, 10, 11, 12, 13], [5, 6]]]


@pytest.mark.parametrize("hidden", [False, True], ids=["tokens", "hidden-states"])
@pytest.mark.parametrize("chunk", [1, 3, 7])
@pytest.mark.parametrize("rows", CHUNKED_ROWS, ids=["one", "batch"])
def test_a_chunked_prefill_reads_the_prompt_as_the_target_alones(arch, rows, chunk, hidden):
    # prefill_chunk_size bounds the memory of reading a long prompt: with a drafter the prompt is read in the target
    # alone's chunks too (transformers' own assisted decoding reads it whole), and the first step's hidden states are
    # the last chunk's, as the target alone returns them.
    from test_batching import left_padded

    target = tiny_target(arch)
    drafter = tiny_drafter(target)
    batch = left_padded(rows)
    options = dict(
        max_new_tokens=8, prefill_chunk_size=chunk, do_sample=False, return_dict_in_generate=True,
        output_hidden_states=hidden,
    )  # fmt: skip
    read = prefill_lengths(target)
    alone = target.generate(**batch, **options)
    chunks = read[: -(-batch["input_ids"].shape[1] // chunk)]
    read.clear()
    drafted = target.generate(**batch, **options, assistant_model=drafter, draft_policy="fixed")
    assert read[: len(chunks)] == chunks == [chunk] * (len(chunks) - 1) + [7 - chunk * (len(chunks) - 1)]
    assert torch.equal(drafted.sequences, alone.sequences)
    assert own_drafts(drafter.last_generation_stats) > 0
    if hidden:
        first, expected = drafted.hidden_states[0], alone.hidden_states[0]
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(first, expected, strict=True))


@pytest.mark.parametrize("rows", CHUNKED_ROWS, ids=["one", "batch"])
def test_a_chunked_prefill_gives_the_drafter_the_whole_prompt(rows, monkeypatch):
    # The chunks before the last are read ahead of the loop's prefill: their features must start the drafter's
    # context, or it would draft from the last chunk alone (which no token comparison would notice).
    from test_batching import left_padded

    from hf_domino.batching_domino import BatchedDecoding
    from hf_domino.drafting_domino import DrafterContext

    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    batch = left_padded(rows)
    contexts: list[list[torch.Tensor]] = []

    def prompt_contexts(chunk_size: int | None) -> list[torch.Tensor]:
        contexts.append([])
        target.generate(
            **batch, max_new_tokens=4, do_sample=False, prefill_chunk_size=chunk_size, assistant_model=drafter
        )
        if len(rows) == 1:  # the pieces appended to the drafter's context, up to the prompt's length
            return [torch.cat(contexts[-1], dim=1)[:, : len(rows[0])]]
        return contexts[-1]

    appended, read_prompt = DrafterContext.append, BatchedDecoding.read_prompt
    monkeypatch.setattr(DrafterContext, "append", lambda self, f: (contexts[-1].append(f), appended(self, f))[1])

    def spied_read_prompt(self, *args, **kwargs):
        found, finished = read_prompt(self, *args, **kwargs)
        contexts[-1].extend(found)
        return found, finished

    monkeypatch.setattr(BatchedDecoding, "read_prompt", spied_read_prompt)
    whole, chunked = prompt_contexts(None), prompt_contexts(3)
    assert [c.shape[-2] for c in chunked] == [c.shape[-2] for c in whole] == [len(row) for row in rows]
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(whole, chunked, strict=True))


def test_a_chunked_prefill_names_a_bad_size_and_reads_embeddings_whole():
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    prompt = torch.tensor([[7, 8, 9, 10, 11, 12]])
    for size in (0, -2, 2.5):
        with pytest.raises(ValueError, match=rf"prefill_chunk_size={size}: .* must be a positive int"):
            target.generate(prompt, max_new_tokens=4, prefill_chunk_size=size, assistant_model=drafter)
    embeds = target.get_input_embeddings()(prompt)
    options = dict(inputs_embeds=embeds, max_new_tokens=6, do_sample=False)
    alone = target.generate(**options)  # (the target alone's chunks fail on embeddings: transformers 5.25)
    read = prefill_lengths(target)
    with pytest.warns(UserWarning, match=r"not applied with a drafter to a prompt given with \['inputs_embeds'\]"):
        drafted = target.generate(**options, prefill_chunk_size=2, assistant_model=drafter)
    assert torch.equal(drafted, alone) and read[0] == 6


def test_a_filled_cache_returns_the_target_alones_hidden_states():
    # transformers' assisted loop splits its first step's hidden states as if the prefill read the whole prompt, and
    # fails on one that reads only the tokens a filled cache lacks: such a call returns them through the batch loop.
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    torch.manual_seed(5)
    answered, cache = first_turn(target, torch.randint(4, 64, (1, 9)))
    conversation = torch.cat([answered, torch.randint(4, 64, (1, 5))], dim=-1)
    options = dict(max_new_tokens=8, do_sample=False, return_dict_in_generate=True, output_hidden_states=True)
    alone = target.generate(conversation, **cache_argument(copy.deepcopy(cache)), **options)
    drafted = target.generate(conversation, **cache_argument(copy.deepcopy(cache)), **options, assistant_model=drafter)
    assert torch.equal(drafted.sequences, alone.sequences)
    assert alone.hidden_states[0][0].shape[1] == 6  # the 5 new tokens and the last answered one
    for expected, got in zip(alone.hidden_states, drafted.hidden_states, strict=True):
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(expected, got, strict=True))


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 7, 13])
def test_max_new_tokens_below_and_off_block_multiples(max_new_tokens):
    target = successor_target("llama", VOCAB)
    drafter = forcing_drafter(target, successor(1), block_size=8)
    prompt = torch.tensor([[4]])  # a one-token prompt
    output = greedy(target, prompt, max_new_tokens=max_new_tokens, assistant_model=drafter)
    assert torch.equal(output, greedy(target, prompt, max_new_tokens=max_new_tokens))
    # Every draft is right: the first block takes what the limit leaves after the prefill's and the target's tokens.
    expected = max(0, min(drafter.config.num_drafts, max_new_tokens - 2))
    assert max(drafter.last_generation_stats.drafted, default=0) == expected


def test_attention_mask_with_left_padding():
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    prompt = torch.tensor([[0, 0, 7, 8, 9, 10]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1]])
    kwargs = dict(attention_mask=mask, max_new_tokens=12)
    assert torch.equal(greedy(target, prompt, assistant_model=drafter, **kwargs), greedy(target, prompt, **kwargs))
    assert own_drafts(drafter.last_generation_stats) > 0


class CollectingStreamer(BaseStreamer):
    def __init__(self):
        self.chunks = []

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.chunks.append("end")


def test_streamer_receives_the_same_tokens():
    target = successor_target("qwen3", VOCAB)
    drafter = forcing_drafter(target, successor(1))
    prompt = torch.tensor([[4, 5]])
    streamed, alone = CollectingStreamer(), CollectingStreamer()
    output = greedy(target, prompt, max_new_tokens=15, assistant_model=drafter, streamer=streamed)
    greedy(target, prompt, max_new_tokens=15, streamer=alone)
    flat = lambda chunks: [t for c in chunks[1:-1] for t in c]  # noqa: E731  (skip the prompt and "end")
    assert flat(streamed.chunks) == flat(alone.chunks) == output[0, 2:].tolist()
    assert streamed.chunks[-1] == "end" and len(streamed.chunks) < len(alone.chunks)  # whole blocks per put


def test_return_dict_with_scores_hidden_states_and_attentions():
    target = tiny_target("llama", attn_implementation="eager")  # the one kernel that returns attention weights
    drafter = tiny_drafter(target)
    prompt = torch.tensor([[5, 6, 7]])
    kwargs = dict(max_new_tokens=9, return_dict_in_generate=True, output_scores=True, output_hidden_states=True,
                  output_attentions=True)  # fmt: skip
    assisted = greedy(target, prompt, assistant_model=drafter, **kwargs)
    alone = greedy(target, prompt, **kwargs)
    assert torch.equal(assisted.sequences, alone.sequences)
    assert own_drafts(drafter.last_generation_stats) > 0
    assert len(assisted.scores) == len(alone.scores) == 9
    for a, b in zip(assisted.scores, alone.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert len(assisted.hidden_states) == len(alone.hidden_states)
    assert len(assisted.attentions) == len(alone.attentions) == 9
    for a, b in zip(assisted.attentions, alone.attentions):
        for layer_a, layer_b in zip(a, b, strict=True):
            torch.testing.assert_close(layer_a, layer_b, atol=1e-4, rtol=1e-4)


def test_repetition_penalty_and_processors():
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    prompt = torch.tensor([[5, 6, 7, 5, 6]])
    kwargs = dict(max_new_tokens=15, repetition_penalty=1.5, no_repeat_ngram_size=3)
    assert torch.equal(greedy(target, prompt, assistant_model=drafter, **kwargs), greedy(target, prompt, **kwargs))
    assert own_drafts(drafter.last_generation_stats) > 0


class StopAfterToken(StoppingCriteria):
    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_custom_stopping_criteria_fire_inside_a_block():
    target = successor_target("qwen3", VOCAB)
    drafter = forcing_drafter(target, successor(1), block_size=8)
    prompt = torch.tensor([[4, 5]])
    criteria = StoppingCriteriaList([StopAfterToken(9)])  # mid-block for a fully accepted block
    expected = greedy(target, prompt, max_new_tokens=20, stopping_criteria=criteria)
    assert expected[0, -1].item() == 9
    assert torch.equal(
        greedy(target, prompt, max_new_tokens=20, stopping_criteria=criteria, assistant_model=drafter), expected
    )
    assert ended_in_a_drafted_block(drafter.last_generation_stats)


def letter_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    letters = [chr(ord("a") + i) for i in range(VOCAB - 4)]
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<mask>": 3} | {c: i + 4 for i, c in enumerate(letters)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one letter, one token
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")


def test_stop_strings_inside_a_block():
    tokenizer = letter_tokenizer()
    target = successor_target("llama", VOCAB)  # emits consecutive letters
    drafter = forcing_drafter(target, successor(1), block_size=10)
    prompt = torch.tensor([[4, 5]])  # "ab"
    kwargs = dict(max_new_tokens=20, stop_strings=["hi"], tokenizer=tokenizer)
    expected = greedy(target, prompt, **kwargs)
    assert tokenizer.decode(expected[0, -2:]) == "hi"
    assert torch.equal(greedy(target, prompt, assistant_model=drafter, **kwargs), expected)
    assert ended_in_a_drafted_block(drafter.last_generation_stats)


# ---------------------------------------------------------------------------- drafts = the method, step by step
def copied_from_text(sequence: list[int], limit: int) -> list[int]:
    """Prompt lookup written out: what followed the earliest earlier occurrence of the last 3, else 2, tokens."""
    for n in (3, 2):
        tail = sequence[-n:]
        for start in range(len(sequence) - n):
            if sequence[start : start + n] == tail:
                return sequence[start + n : start + n + limit]
    return []


@pytest.mark.parametrize("shift_label, pure_prefix", [(True, 1), (False, 0), (True, 3)])
def test_drafted_tokens_match_independent_reference(arch, shift_label, pure_prefix):
    """Reads the drafts from the target's verification inputs and recomputes each block from raw tensors: the
    drafter's from its weights, copied ones from the text. The drafter's context must stay right across copied
    cycles, which it does not draft."""
    target = tiny_target(arch).double()
    drafter = tiny_drafter(target, shift_label=shift_label, pure_draft_prefix_len=pure_prefix, block_size=5).double()
    verify_inputs = []
    handle = target.register_forward_pre_hook(
        lambda module, args, kwargs: verify_inputs.append(kwargs["input_ids"].clone()), with_kwargs=True
    )
    prompt = torch.tensor([[7, 7, 8, 9, 10, 11, 12, 7, 7, 8]])  # the text repeats: blocks are copied, then drafted
    try:
        output = greedy(target, prompt, max_new_tokens=30, assistant_model=drafter)
    finally:
        handle.remove()

    tensors = dict(drafter.state_dict())
    cfg = reference_config(drafter.config)
    config = drafter.config
    embed, lm_head = target.model.embed_tokens.weight, target.lm_head.weight
    sequence = output[0]
    stats = drafter.last_generation_stats
    position = prompt.shape[1]  # length of the sequence before each verification's first token
    checked = 0
    for step_input, copied in zip(verify_inputs[1:], stats.copied, strict=True):
        anchor_pos = position  # step_input = [anchor, drafts...]
        drafts = step_input[0, 1:].tolist()
        if copied:
            expected = copied_from_text(sequence[: anchor_pos + 1].tolist(), limit=drafter.config.num_drafts)
            assert drafts and drafts == expected[: len(drafts)]
        else:
            with torch.no_grad():
                hidden = target(sequence[None, :anchor_pos], output_hidden_states=True).hidden_states
            features = torch.cat([hidden[i + 1][0] for i in config.target_layer_ids], dim=-1)
            # Whole blocks (the fixed policy), but for the room max_new_tokens leaves.
            assert len(drafts) == min(config.num_drafts, prompt.shape[1] + 30 - anchor_pos - 2)
            expected = draft_greedy(tensors, cfg, embed, lm_head, features, int(sequence[anchor_pos]), len(drafts))
            assert drafts == expected
        checked += 1
        position += stats.acceptance_lengths[checked - 1]
    assert checked == len(stats.acceptance_lengths) > 2
    # Both sources drafted, and the drafter drafted after copied cycles.
    assert any(stats.copied) and False in stats.copied[stats.copied.index(True) :]


def test_head_switch_changes_drafts_not_output():
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    prompt = torch.tensor([[5, 6, 7]])
    verified = []  # each call's verification inputs: the drafts it offered
    hook = target.register_forward_pre_hook(lambda module, args, kwargs: verified[-1].append(kwargs["input_ids"]),
                                            with_kwargs=True)  # fmt: skip

    def call(**kwargs):
        verified.append([])
        return greedy(target, prompt, max_new_tokens=15, assistant_model=drafter, domino_lookup=False, **kwargs)

    try:
        with drafter.domino_head(False):
            off = call()
            assert DOMINO_HEAD_DEFAULT.get() is False
        assert DOMINO_HEAD_DEFAULT.get() is None  # the switch is scoped to the block, not stored on the model
        on = call()
        off_again = call(domino_head=False)
    finally:
        hook.remove()
    assert torch.equal(on, off) and torch.equal(off_again, off)
    same = lambda a, b: len(a) == len(b) and all(map(torch.equal, a, b))  # noqa: E731
    assert not same(verified[1], verified[0]) and same(verified[2], verified[0])  # the head changed the drafts
    no_head = tiny_drafter(target, head=False)
    with pytest.raises(ValueError, match="no Domino head"):
        with no_head.domino_head(True):
            pass


def test_timings_are_recorded_on_request():
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    out = greedy(
        target, torch.tensor([[5, 6, 7]]), max_new_tokens=12, assistant_model=drafter, domino_timings=True,
        domino_lookup=False,  # timings are per drafted cycle; copied drafts are not drafted
    )  # fmt: skip
    stats = drafter.last_generation_stats
    assert set(stats.timings) == {"backbone", "lm_head", "head", "verify"}
    assert all(stats.drafted)  # every target forward verified drafts, so every cycle drafted
    for name, seconds in stats.timings.items():
        # A verify is timed when the next cycle starts, so the last one (after which generate() returns) is not.
        expected = len(stats.acceptance_lengths) - (name == "verify")
        assert len(seconds) == expected, name
        assert all(s > 0 for s in seconds), name
    assert sum(stats.acceptance_lengths) + 1 == out.shape[1] - 3  # + the prefill's token


# -------------------------------------------------------------------------------------------- sampling: lossless
def exact_sequence_distribution(target, prompt, num_new: int, logits_processor) -> dict[tuple, float]:
    """P(continuation) under target-only sampling with the same processors, by enumeration."""
    vocab = target.config.vocab_size
    probs = {(): 1.0}
    for _ in range(num_new):
        prefixes = list(probs)
        batch = torch.tensor([prompt + list(p) for p in prefixes])
        with torch.no_grad():
            logits = target(batch).logits[:, -1].float()
        logits = logits_processor(batch, logits)
        step = torch.softmax(logits, dim=-1)
        probs = {p + (t,): probs[p] * step[i, t].item() for i, p in enumerate(prefixes) for t in range(vocab)}
    return probs


def law_target(vocab: int, seed: int, peak: float = 1.0, num_layers: int = 1):
    """The small target the sampling-law tests draw thousands of continuations from: no EOS, its logits scaled by
    `peak` (a peaked law, which a wrong one differs from clearly). One layer by default, as `law_drafter` has: such a
    test's time is generate() calls, most of it per layer, and a law does not need depth to be kept exactly."""
    target = tiny_target(
        "qwen3", vocab_size=vocab, hidden_size=16, num_layers=num_layers, eos_token_id=None, seed=seed
    )
    if peak != 1.0:
        with torch.no_grad():
            target.lm_head.weight.mul_(peak)
    return target


def law_drafter(target):
    """The drafter of the sampling-law tests: blocks of 4 (3 drafts), mask token 0, one layer."""
    return tiny_drafter(target, block_size=4, mask_token_id=0, num_layers=1)


def sampled_continuations(target, batch: dict, num_new: int, draws: int, **generate_kwargs) -> tuple[list, list]:
    """Draws `draws` continuations of `num_new` tokens for each row of a left-padded `batch` (generate() with
    `num_return_sequences` of 250 at a time), counted per row; also each call's `last_generation_stats`."""
    rows = batch["input_ids"].shape[0]
    counts, stats = [{} for _ in range(rows)], []
    for _ in range(draws // 250):
        out = target.generate(
            **batch,
            do_sample=True,
            max_new_tokens=num_new,
            num_return_sequences=250,
            pad_token_id=0,
            **generate_kwargs,
        )
        assert out.shape == (rows * 250, batch["input_ids"].shape[1] + num_new)
        for row, sequence in enumerate(out):
            key = tuple(sequence[-num_new:].tolist())
            counts[row // 250][key] = counts[row // 250].get(key, 0) + 1
        stats.append(generate_kwargs["assistant_model"].last_generation_stats)
    return counts, stats


def drafts_and_accepted(stats: list) -> tuple[int, int]:
    """Drafts verified and drafts accepted over these calls."""
    drafted = sum(sum(s.drafted) for s in stats)
    return drafted, sum(sum(s.acceptance_lengths) - len(s.acceptance_lengths) for s in stats)


def chi_square_p_value(counts: dict[tuple, int], probs: dict[tuple, float], draws: int) -> float:
    from scipy.stats import chi2

    # Pool cells whose expected count is below 5 so the chi-square approximation holds.
    observed, expected, pooled_o, pooled_e = [], [], 0, 0.0
    for cell, p in probs.items():
        if p * draws < 5:
            pooled_o += counts.get(cell, 0)
            pooled_e += p * draws
        else:
            observed.append(counts.get(cell, 0))
            expected.append(p * draws)
    if pooled_e > 0:
        observed.append(pooled_o)
        expected.append(pooled_e)
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    return float(chi2.sf(statistic, df=len(observed) - 1))


def sample_with_drafter(target, drafter, prompt, num_new: int, draws: int, seed: int, per_call=None, **kwargs):
    """`draws` sampled continuations through the drafter: (counts per continuation, drafts offered, drafts accepted).
    Each call's `last_generation_stats` is appended to the list `per_call` when one is given."""
    torch.manual_seed(seed)
    counts: dict[tuple, int] = {}
    drafted = accepted = 0
    for _ in range(draws):
        out = target.generate(
            torch.tensor([prompt]),
            do_sample=True,
            max_new_tokens=num_new,
            assistant_model=drafter,
            pad_token_id=0,
            **kwargs,
        )
        key = tuple(out[0, len(prompt) :].tolist())
        counts[key] = counts.get(key, 0) + 1
        stats = drafter.last_generation_stats
        if per_call is not None:
            per_call.append(stats)
        drafted += sum(stats.drafted)
        accepted += sum(stats.acceptance_lengths) - len(stats.acceptance_lengths)
    return counts, drafted, accepted


@pytest.mark.parametrize(
    "sampling, draft_vocab, peak",
    # The draft vocabulary's cases warp and draw on its columns (processed_pick): top-k 2 bites there. The plain law
    # (T = 1, no warper) is test_draft_policy.py's: the adaptive policy, and the fixed one with a draft vocabulary.
    # The first case's law is peaked (logits x 6), so that the temperature moves the drafts' law far: a generator
    # returning its drafts' logits without the temperature fails it (the test below). With the plain law that fault
    # passed (p 0.62 and 0.95, two seeds, 2026-12-06): the tiny drafter's logits are near zero.
    [
        (dict(temperature=0.7, top_k=3), None, 6),
        (dict(temperature=0.7, top_k=2), [0, 2, 3], 1),
        (dict(temperature=0.8, top_p=0.7), [0, 2, 3], 1),  # not peaked: top-p keeps nuclei of several tokens
    ],
    ids=["T=0.7,top-k", "T=0.7,top-k,draft-vocab", "T=0.8,top-p,draft-vocab"],
)
def test_sampling_preserves_target_distribution(sampling, draft_vocab, peak):
    vocab, num_new, draws = 5, 4, 2500
    target = law_target(vocab, seed=3, peak=peak)
    drafter = law_drafter(target)
    drafter.set_draft_vocab(draft_vocab)
    processors = LogitsProcessorList([TemperatureLogitsWarper(sampling["temperature"])])
    if "top_k" in sampling:
        processors.append(TopKLogitsWarper(sampling["top_k"]))
    if "top_p" in sampling:
        processors.append(TopPLogitsWarper(sampling["top_p"]))
    prompt = [2, 4, 1]
    probs = exact_sequence_distribution(target, prompt, num_new, processors)

    # A fixed draft length keeps the draws independent of this machine's timings (the adaptive policy's law is tested
    # in test_draft_policy.py with fixed costs), so the seeded test is deterministic.
    counts, drafted, accepted = sample_with_drafter(
        target, drafter, prompt, num_new, draws, seed=1, draft_policy="fixed", **sampling
    )
    assert 0 < accepted < drafted  # rejection sampling really ran, with both outcomes
    assert chi_square_p_value(counts, probs, draws) > 1e-3
    # The test can fail: the same draws are far from a wrong distribution (the untempered target).
    wrong = exact_sequence_distribution(target, prompt, num_new, LogitsProcessorList())
    assert chi_square_p_value(counts, wrong, draws) < 1e-6


@pytest.mark.slow  # 2,500 draws again, to show the test above has the power it needs
def test_the_law_test_fails_drafts_returned_without_their_temperature(monkeypatch):
    # A generator drawing its drafts tempered but returning their logits untempered: the T = 0.7 case's law check fails
    # (p 1.9e-8; the generator as it is: 0.24).
    from hf_domino.generation_domino import DominoCandidateGenerator

    sampling, get_candidates = dict(temperature=0.7, top_k=3), DominoCandidateGenerator.get_candidates

    def untempered(self, input_ids, **kwargs):
        candidates, logits = get_candidates(self, input_ids, **kwargs)
        return candidates, None if logits is None else logits * sampling["temperature"]

    monkeypatch.setattr(DominoCandidateGenerator, "get_candidates", untempered)
    with pytest.raises(AssertionError, match=r"> 0\.001"):
        test_sampling_preserves_target_distribution(sampling, None, 6)


# -------------------------------------------------------------------------------- each draft's law, at the rollout
# Sampling stays lossless only if each draft is drawn from exactly the law its returned logits state (the verification
# accepts it with probability min(1, p/q) for that q). The generate() law tests above check this end to end, but their
# tiny drafters' laws over a draft vocabulary's 2-3 columns are near-uniform or near-one-hot, where no temperature or
# sharpening moves them: checked at the rollout, over a thousand rows at once, the same property is tested with power
# on every path (the whole vocabulary, a draft vocabulary's columns, and spread before processors that read tokens).
ROLLOUT_DRAWS = {
    "T=0.7,top-k": ([TemperatureLogitsWarper(0.7), TopKLogitsWarper(20)], False),
    "T=0.7,top-p,draft-vocab": ([TemperatureLogitsWarper(0.7), TopPLogitsWarper(0.9)], True),
    "penalty,T=0.8,draft-vocab": ([RepetitionPenaltyLogitsProcessor(1.5), TemperatureLogitsWarper(0.8)], True),
    "T=0.6,top-h": ([TemperatureLogitsWarper(0.6), TopHLogitsWarper(0.6)], False),  # an entropy-sized nucleus
}


def rollout_draws(processors: list, draft_vocab: bool, batch_loop: bool, rows: int = 1000, pick=None):
    """One block drafted for `rows` copies of one context, sampled: (drafts `[rows, k]`, the logits each was drawn from
    `[rows, k, V]`), through one sequence's rollout (`eager_rollout` with `processed_pick`, or `pick` wrapping it) or
    the batch loop's (`CycleDrafter.roll_out`). The head's corrections are scaled down 5x, so that the laws are spread
    at every position (the tiny drafter's corrections otherwise make its later drafts near-certain)."""
    from hf_domino.batch_drafts_domino import CycleDrafter
    from hf_domino.drafting_domino import BlockDraft, eager_rollout, processed_pick
    from hf_domino.options_domino import DominoOptions
    from hf_domino.policy_domino import FixedPolicy
    from hf_domino.ragged_batch_domino import process_rows

    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    with torch.no_grad():
        drafter.embed_proj[-1].weight.mul_(0.2)
    vocab_size, processors = drafter.config.vocab_size, LogitsProcessorList(processors)
    vocab = torch.arange(0, vocab_size, 3) if draft_vocab else None
    drafter.set_draft_vocab(vocab)
    modules = TargetModules.from_target(target)
    torch.manual_seed(0)
    hidden = 3 * torch.randn(1, drafter.config.num_drafts, drafter.config.hidden_size).expand(rows, -1, -1)
    anchors = torch.full((rows, 1), 7)
    with torch.no_grad():
        base = modules.logits(hidden, vocab=vocab).float()
        if not batch_loop:
            pick = (pick or (lambda made: made))(processed_pick(processors, True, vocab, vocab_size))
            drafts = eager_rollout(drafter, modules, pick)(BlockDraft(hidden, base, vocab), anchors)
            return drafts.ids, drafts.logits
        drafting = CycleDrafter(
            drafter, modules, DominoOptions(), GenerationConfig(do_sample=True), processors, [], None,
            process=lambda logits, extra, repeats=1: process_rows([processors] * rows, list(anchors), logits, extra),
            clock=time.perf_counter, padding=[0] * rows, per_row=[processors] * rows,
        )  # fmt: skip
        drafting.policy = FixedPolicy(drafter.config.num_drafts)
        drafts, _ = drafting.roll_out(hidden, base, anchors, list(range(rows)))
        return drafts.ids, drafts.logits


def smallest_law_p_value(ids: torch.LongTensor, logits: torch.Tensor) -> float:
    """Per draft position, a chi-square test of the rows' drafts against the sum of the laws their logits state (one
    law per row, after the head read the row's own earlier draws: a token's count is then a sum of unequal coin tosses,
    whose variance is below the multinomial's, so the test is conservative); the smallest p-value of the positions."""
    rows, p_values = ids.shape[0], []
    for position in range(ids.shape[1]):
        expected = torch.softmax(logits[:, position].double(), dim=-1).mean(dim=0).tolist()
        counts = torch.bincount(ids[:, position], minlength=len(expected)).tolist()
        law = {(token,): p for token, p in enumerate(expected)}
        p_values.append(chi_square_p_value({(token,): n for token, n in enumerate(counts)}, law, rows))
    return min(p_values)


@pytest.mark.parametrize("batch_loop", [False, True], ids=["one-sequence", "batch-loop"])
@pytest.mark.parametrize("case", list(ROLLOUT_DRAWS))
def test_the_rollout_draws_each_draft_from_the_logits_it_returns(case, batch_loop):
    ids, logits = rollout_draws(*ROLLOUT_DRAWS[case], batch_loop=batch_loop)
    spread = torch.softmax(logits, dim=-1).amax(dim=-1).mean(dim=0)
    assert (spread < 0.9).all()  # no position's law near-certain: a wrong law would show
    assert smallest_law_p_value(ids, logits) > 1e-3


def drawn_sharper(pick):
    """A fault to show a law test's power: `pick` drawing from a law 1.5 times sharper than the logits it returns
    (the law the verification corrects against)."""

    def sharper(logits, realised_ids):
        _, processed = pick(logits, realised_ids)
        return torch.multinomial(torch.softmax(processed * 1.5, dim=-1), num_samples=1), processed

    return sharper


def batch_loop_draws_sharper(monkeypatch) -> None:
    """The same fault in the batch loop, which draws through `ragged_batch_domino.pick_tokens`."""
    from hf_domino import ragged_batch_domino

    pick_tokens = ragged_batch_domino.pick_tokens
    monkeypatch.setattr(
        ragged_batch_domino, "pick_tokens", lambda logits, do_sample: pick_tokens(logits * 1.5, do_sample=do_sample)
    )


@pytest.mark.parametrize("fault", ["drawn 1.5x sharper", "returned without the temperature"])
@pytest.mark.parametrize("case", list(ROLLOUT_DRAWS))
def test_the_rollout_law_test_fails_a_miscalibrated_pick(case, fault, monkeypatch):
    # Each fault fails every case by far, draft vocabularies included: p from 1e-9 (no temperature 0.8, one sequence)
    # to 1e-51, where the code as it is gives 0.05-0.36.
    processors, draft_vocab = ROLLOUT_DRAWS[case]
    temperature = next(p.temperature for p in processors if isinstance(p, TemperatureLogitsWarper))

    def untempered(pick):
        def returned_untempered(logits, realised_ids):
            index, processed = pick(logits, realised_ids)
            return index, processed * temperature

        return returned_untempered

    faulty = drawn_sharper if fault == "drawn 1.5x sharper" else untempered
    assert smallest_law_p_value(*rollout_draws(processors, draft_vocab, batch_loop=False, pick=faulty)) < 1e-6
    if fault == "drawn 1.5x sharper":
        batch_loop_draws_sharper(monkeypatch)
        assert smallest_law_p_value(*rollout_draws(processors, draft_vocab, batch_loop=True)) < 1e-6


# ------------------------------------------------------------------------------------------------------ pipeline
def test_seeded_sampling_with_the_fixed_policy_repeats_exactly():
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    prompt = torch.randint(4, 64, (1, 7), generator=torch.Generator().manual_seed(0))
    outputs = []
    for _ in range(3):
        torch.manual_seed(1)
        outputs.append(
            target.generate(prompt, max_new_tokens=20, do_sample=True, assistant_model=drafter, draft_policy="fixed")
        )
    assert all(torch.equal(output, outputs[0]) for output in outputs)
    assert max(drafter.last_generation_stats.acceptance_lengths) > 1  # drafts were verified, not plain steps only


def test_pipeline_with_drafter_object_and_path(tmp_path):
    from transformers import pipeline

    tokenizer = letter_tokenizer()
    target = successor_target("qwen3", VOCAB)
    drafter = forcing_drafter(target, successor(1))
    # device=target.device, as docs/usage.md says: else on a GPU machine the pipeline moves the target away from
    # the drafter object, and generate() refuses the pair.
    generator = pipeline(
        "text-generation", model=target, tokenizer=tokenizer, assistant_model=drafter, device=target.device
    )
    expected = pipeline("text-generation", model=target, tokenizer=tokenizer, device=target.device)(
        "ab", max_new_tokens=8, do_sample=False
    )
    # Domino options pass through the pipeline call to generate() like any generation argument.
    assert generator("ab", max_new_tokens=8, do_sample=False, draft_policy="fixed") == expected
    assert drafter.last_generation_stats.mean_acceptance_length > 2

    drafter.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    by_path = pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=str(tmp_path))
    assert by_path("ab", max_new_tokens=8, do_sample=False) == expected


# ---------------------------------------------------------------------------------------------------- errors
# Keys as transformers' SynthID example has them; any will do.
SYNTHID = SynthIDTextWatermarkingConfig(keys=[654, 400, 836, 123, 340, 443, 597, 160, 57], ngram_len=3)


def test_errors_before_any_generation_work(monkeypatch):
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    forwards = []
    monkeypatch.setattr(type(target), "__call__", lambda *a, **k: forwards.append(1), raising=False)
    prompt = torch.tensor([[5, 6, 7]])
    cases = [
        (dict(input_ids=prompt.repeat(2, 1), attention_mask=torch.tensor([[1, 1, 1], [1, 1, 0]])), "padding_side"),
        (dict(input_ids=prompt, num_beams=2), "beam search"),
        (dict(input_ids=prompt, use_cache=False), "use_cache=False"),
        (dict(input_ids=prompt.repeat(2, 1), use_cache=False), "use_cache=False"),
        (dict(input_ids=prompt, guidance_scale=1.5), "classifier-free guidance"),
        (dict(input_ids=prompt.repeat(2, 1), attention_mask=torch.ones(2, 3), guidance_scale=1.5), "guidance_scale"),
        (dict(input_ids=prompt, watermarking_config=SYNTHID), "SynthID"),
        (dict(input_ids=prompt.repeat(2, 1), attention_mask=torch.ones(2, 3), watermarking_config=SYNTHID), "SynthID"),
        (dict(input_ids=prompt, dola_layers="low"), "DoLa"),
        (dict(input_ids=prompt, return_dict_in_generate=True, output_attentions=True), "attn_implementation='eager'"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            target.generate(max_new_tokens=5, assistant_model=drafter, **kwargs)
    assert forwards == []

    other_vocab = tiny_target("qwen3", vocab_size=80)
    with pytest.raises(ValueError, match="vocab_size"):
        target.generate(prompt, assistant_model=tiny_drafter(other_vocab), max_new_tokens=3)
    wider = tiny_target("qwen3", hidden_size=48)
    with pytest.raises(ValueError, match="hidden_size"):
        target.generate(prompt, assistant_model=tiny_drafter(wider), max_new_tokens=3)
    deep = tiny_drafter(tiny_target("qwen3", num_layers=12), target_layer_ids=[2, 10])
    with pytest.raises(ValueError, match="outside the target"):
        target.generate(prompt, assistant_model=deep, max_new_tokens=3)
    with pytest.raises(ValueError, match="speculation_type"):
        target.generate(prompt, assistant_model=drafter, max_new_tokens=3, speculation_type="dflash")
    elsewhere = tiny_drafter(target).to("meta")  # on another device than the target (pipeline() moves only the target)
    for input_ids in (prompt, prompt.repeat(2, 1)):
        with pytest.raises(ValueError, match=r"on meta and the target on cpu.*device=target.device"):
            target.generate(input_ids, assistant_model=elsewhere, max_new_tokens=3)


@pytest.mark.parametrize(
    "setting", [dict(guidance_scale=1.5), dict(watermarking_config=SYNTHID)], ids=["cfg", "synthid"]
)
def test_settings_refused_for_per_token_state_do_change_an_assisted_output(setting):
    # Why they are refused (test_errors_before_any_generation_work): their logits processors advance state once per
    # call, and transformers' own prompt lookup, which calls them for every candidate token as our drafts are, answers
    # otherwise than the target alone. Greedy, so the answers must be equal where the processor is a function of the
    # sequence (the other watermark, the control). Should a transformers release make them equal, lift the refusal.
    target = tiny_target("qwen3")
    prompt = torch.tensor([[5, 6, 7, 8, 5, 6, 7]])

    def answers(**kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        alone = target.generate(prompt, max_new_tokens=24, do_sample=False, **kwargs)
        return alone, target.generate(prompt, max_new_tokens=24, do_sample=False, prompt_lookup_num_tokens=3, **kwargs)

    assert not torch.equal(*answers(**setting))
    assert torch.equal(*answers(watermarking_config=WatermarkingConfig(bias=2.0)))


def test_target_without_hidden_states_is_refused():
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    original_forward = type(target).forward

    def forward_without_hidden_states(self, *args, **kwargs):
        outputs = original_forward(self, *args, **kwargs)
        outputs.hidden_states = None
        return outputs

    type(target).forward, restore = forward_without_hidden_states, original_forward
    try:
        with pytest.raises(ValueError, match="no hidden_states"):
            target.generate(torch.tensor([[5, 6]]), assistant_model=drafter, max_new_tokens=5)
    finally:
        type(target).forward = restore


def test_drafter_in_another_dtype_stays_lossless():
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target).to(torch.bfloat16)
    prompt = torch.tensor([[5, 6, 7]])
    assert torch.equal(
        greedy(target, prompt, max_new_tokens=12, assistant_model=drafter), greedy(target, prompt, max_new_tokens=12)
    )


# ------------------------------------------------------------------------------------- attention kernels of a call
SDPA_SWITCHES = {
    "cudnn": torch.backends.cuda.cudnn_sdp_enabled,
    "flash": torch.backends.cuda.flash_sdp_enabled,
    "efficient": torch.backends.cuda.mem_efficient_sdp_enabled,
    "math": torch.backends.cuda.math_sdp_enabled,
}


def sdpa_switches() -> dict[str, bool]:
    return {name: enabled() for name, enabled in SDPA_SWITCHES.items()}


def test_drafting_attention_kernels_leave_out_cudnn_on_cuda_in_half_precision():
    # The switches are process-wide settings, readable and settable on any build: only the device named matters.
    before = sdpa_switches()
    assert before["cudnn"]
    cuda = torch.device("cuda")
    for dtype in (torch.bfloat16, torch.float16):
        with attention_kernels_domino.drafting_attention_kernels(cuda, dtype):
            assert sdpa_switches() == before | {"cudnn": False}
        assert sdpa_switches() == before
    unchanged = [
        (cuda, torch.float32, False),
        (torch.device("cpu"), torch.bfloat16, False),
        (cuda, torch.bfloat16, True),
    ]
    for device, dtype, allow_cudnn in unchanged:
        with attention_kernels_domino.drafting_attention_kernels(device, dtype, allow_cudnn):
            assert sdpa_switches() == before, (device, dtype, allow_cudnn)


def test_drafting_attention_kernels_never_enable_what_the_user_disabled():
    cuda = torch.device("cuda")
    for switch, enable in (
        ("flash", torch.backends.cuda.enable_flash_sdp),
        ("cudnn", torch.backends.cuda.enable_cudnn_sdp),
    ):
        enable(False)
        try:
            with attention_kernels_domino.drafting_attention_kernels(cuda, torch.bfloat16):
                assert not sdpa_switches()["cudnn"] and not sdpa_switches()[switch]
            assert not sdpa_switches()[switch], switch
        finally:
            enable(True)


def test_overlapping_calls_share_one_switch_and_the_last_one_restores_it():
    # Threads serving requests (or a streamer's generation thread) overlap their calls: the first call to finish must
    # not turn cuDNN back on under the other, nor may the other then leave it off for good.
    cuda = torch.device("cuda")
    first = attention_kernels_domino.drafting_attention_kernels(cuda, torch.bfloat16)
    second = attention_kernels_domino.drafting_attention_kernels(cuda, torch.float16)
    first.__enter__()
    second.__enter__()
    try:
        first.__exit__(None, None, None)
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:  # never leave the process's switch off for the tests after this one
        second.__exit__(None, None, None)
    assert torch.backends.cuda.cudnn_sdp_enabled()


def attention_switches_seen_by(target, **generate_kwargs) -> list[dict[str, bool]]:
    """The SDPA switches at every target forward of `target.generate(**generate_kwargs)`."""
    seen = []
    handle = target.register_forward_pre_hook(lambda module, args: seen.append(sdpa_switches()))
    try:
        target.generate(do_sample=False, **generate_kwargs)
    finally:
        handle.remove()
    return seen


def test_a_call_on_a_cpu_keeps_the_attention_switches():
    # Leaving cuDNN out is for CUDA in half precision; a CPU call, bf16 included, runs with the process's settings.
    target = tiny_target("qwen3").to(torch.bfloat16)
    drafter = tiny_drafter(target).to(torch.bfloat16)
    before = sdpa_switches()
    seen = attention_switches_seen_by(
        target, input_ids=torch.tensor([[5, 6, 7]]), max_new_tokens=8, assistant_model=drafter
    )
    assert len(seen) > 1 and all(switches == before for switches in seen)


# ----------------------------------------------------------------------------------------------- the hook itself
def test_hook_is_idempotent_and_leaves_other_paths_alone(monkeypatch):
    names = list(generate_hook_domino._WRAPPERS)
    before = {name: getattr(GenerationMixin, name) for name in names}
    generate_hook_domino.install_assisted_generation_hook()
    assert {name: getattr(GenerationMixin, name) for name in names} == before
    for name in names:
        assert before[name].__domino_hook__ and before[name].__wrapped__ is not None

    # Other generation paths call the untouched originals with the very same arguments.
    target = tiny_target("qwen3")
    assistant = tiny_target("qwen3", num_layers=1, seed=5)
    prompt = torch.tensor([[5, 6, 7, 5, 6]])
    calls = []
    original = before["_get_candidate_generator"].__wrapped__

    def spy(self, *args, **kwargs):
        calls.append(kwargs.get("assistant_model"))
        return original(self, *args, **kwargs)

    for kwargs in (dict(assistant_model=assistant), dict(prompt_lookup_num_tokens=3), {}):
        with_hook = greedy(target, prompt, max_new_tokens=8, **kwargs)
        monkeypatch.setattr(GenerationMixin, "_get_candidate_generator", spy)
        for name in names:
            if name != "_get_candidate_generator":
                monkeypatch.setattr(GenerationMixin, name, before[name].__wrapped__)
        without_hook = greedy(target, prompt, max_new_tokens=8, **kwargs)
        monkeypatch.undo()
        assert torch.equal(with_hook, without_hook)
    assert calls[0] is assistant and len(calls) == 2


def test_hook_refuses_a_changed_transformers(monkeypatch):
    def changed(self, generation_config, logits_processor):  # lost input_ids / model_kwargs / assistant_model
        return None

    monkeypatch.setattr(GenerationMixin, "_get_candidate_generator", changed)
    with pytest.raises(ImportError, match="GenerationMixin._get_candidate_generator"):
        generate_hook_domino.install_assisted_generation_hook()


def test_num_speculative_tokens_caps_the_verified_drafts():
    target = successor_target("qwen3", VOCAB)
    drafter = forcing_drafter(target, successor(1), block_size=8)
    prompt = torch.tensor([[4, 5]])
    assert torch.equal(
        greedy(target, prompt, max_new_tokens=20, assistant_model=drafter, num_speculative_tokens=3),
        greedy(target, prompt, max_new_tokens=20),
    )
    assert (
        max(drafter.last_generation_stats.drafted) == 3 and max(drafter.last_generation_stats.acceptance_lengths) == 4
    )
    for bad in (-1, 9, 2.5, True):  # the block has 8 drafts (shift_label)
        with pytest.raises(ValueError, match="num_speculative_tokens"):
            greedy(target, prompt, max_new_tokens=5, assistant_model=drafter, num_speculative_tokens=bad)


# -------------------------------------------------------------------------------- continuing a filled cache (chat)
def first_turn(target, prompt: torch.Tensor, new_tokens: int = 7) -> tuple[torch.Tensor, DynamicCache]:
    """The target alone answers `prompt` into a fresh cache, as a chat's first turn does."""
    cache = DynamicCache(config=target.config)
    return target.generate(prompt, do_sample=False, max_new_tokens=new_tokens, **cache_argument(cache)), cache


def prefill_lengths(target) -> list[int]:
    """Records how many tokens each target forward reads (the first one is the prefill)."""
    lengths = []

    def record(module, args, kwargs):
        read = kwargs["input_ids"] if kwargs.get("input_ids") is not None else kwargs["inputs_embeds"]
        lengths.append(read.shape[1])

    target.register_forward_pre_hook(record, with_kwargs=True)
    return lengths


@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
@pytest.mark.parametrize("mask", [True, False], ids=["with-mask", "no-mask"])
def test_a_call_continuing_a_filled_cache_reads_only_the_new_tokens(arch, policy, mask):
    # A chat's second turn: the whole conversation as input_ids, the first turn's cache passed back. transformers'
    # assisted loop would read the cached tokens a second time; the target alone (and now the drafter) does not.
    target = tiny_target(arch)
    drafter = tiny_drafter(target)
    torch.manual_seed(3)
    answered, cache = first_turn(target, torch.randint(4, 64, (1, 9)))
    conversation = torch.cat([answered, torch.randint(4, 64, (1, 5))], dim=-1)
    kwargs = dict(attention_mask=torch.ones_like(conversation)) if mask else {}
    fresh = greedy(target, conversation, max_new_tokens=15, **kwargs)
    alone = greedy(target, conversation, max_new_tokens=15, **cache_argument(copy.deepcopy(cache)), **kwargs)
    read = prefill_lengths(target)
    output = greedy(
        target, conversation, max_new_tokens=15, **cache_argument(copy.deepcopy(cache)), assistant_model=drafter,
        draft_policy=policy, **kwargs,
    )  # fmt: skip
    assert torch.equal(output, alone)
    if mask:  # without a mask transformers reads the whole prompt again for the target alone too (its rule)
        assert torch.equal(alone, fresh)
        assert read[0] == conversation.shape[1] - cache.get_seq_length()
    if policy == "fixed":  # the drafter drafted from the context the prefill gave it
        assert own_drafts(drafter.last_generation_stats) > 0


def test_a_cache_continued_with_new_tokens_only_or_holding_the_whole_prompt():
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    torch.manual_seed(4)
    answered, cache = first_turn(target, torch.randint(4, 64, (1, 8)))
    new = torch.cat([answered[:, -1:], torch.randint(4, 64, (1, 4))], dim=-1)  # the token the cache lacks, then more
    mask = torch.ones(1, cache.get_seq_length() + new.shape[1], dtype=torch.long)
    alone = greedy(target, new, attention_mask=mask, max_new_tokens=12, **cache_argument(copy.deepcopy(cache)))
    output = greedy(
        target,
        new,
        attention_mask=mask,
        max_new_tokens=12,
        **cache_argument(copy.deepcopy(cache)),
        assistant_model=drafter,
    )
    assert torch.equal(output, alone)
    with pytest.raises(ValueError, match="already holds 14 tokens"):  # 8 prompt + 7 new, the last not cached yet
        greedy(
            target, answered[:, :-1], max_new_tokens=4, **cache_argument(copy.deepcopy(cache)), assistant_model=drafter
        )


def test_a_target_whose_prefill_skips_the_hook_is_stopped_before_drafting():
    # A model overriding prepare_inputs_for_generation without calling GenerationMixin's: the cached tokens are read
    # twice, and the generator says so instead of drafting from a wrong context.
    # transformers' own method, beneath every hook layer: a checkpoint's remote code loaded earlier in the process
    # (test_modeling) installs its copy's layer over hf_domino's.
    unhooked = inspect.unwrap(
        GenerationMixin.prepare_inputs_for_generation, stop=lambda method: not getattr(method, "__domino_hook__", 0)
    )

    class OwnPrepare(Qwen3ForCausalLM):
        def prepare_inputs_for_generation(self, *args, **kwargs):
            return unhooked(self, *args, **kwargs)

    target = tiny_target("qwen3")
    own = OwnPrepare(target.config).eval()
    own.load_state_dict(target.state_dict())
    drafter = tiny_drafter(own)
    answered, cache = first_turn(own, torch.randint(4, 64, (1, 6), generator=torch.Generator().manual_seed(5)))
    conversation = torch.cat([answered, torch.tensor([[9, 10, 11]])], dim=-1)
    with pytest.raises(RuntimeError, match="does not call GenerationMixin's"):
        greedy(own, conversation, max_new_tokens=6, **cache_argument(cache), assistant_model=drafter,
               draft_policy="fixed")  # fmt: skip


def test_a_target_quantized_by_torch_ao_drafts_through_its_packed_head():
    # torch.ao's quantize_dynamic keeps each Linear's weight packed behind a method, and the drafter's use of the
    # target's LM head read it as a tensor: generate() crashed. Its activations are quantized with a scale per
    # forward, so the target's logits for a token depend on how many tokens the forward reads, and no verifier gives
    # the target alone's output (transformers' prompt lookup differs as well, docs/usage.md): checked here is that
    # drafting runs and reads the head as the target does, over the whole vocabulary and a draft vocabulary.
    float_target = tiny_target("qwen3")
    target = torch.ao.quantization.quantize_dynamic(float_target, {torch.nn.Linear}, dtype=torch.qint8)
    assert not isinstance(target.lm_head.weight, torch.Tensor)
    modules, hidden, vocab = TargetModules.from_target(target), torch.randn(1, 3, 32), torch.tensor([1, 5, 9])
    whole = target.lm_head(hidden)
    assert torch.equal(modules.logits(hidden), whole) and torch.equal(modules.logits(hidden, vocab), whole[..., vocab])
    drafter = tiny_drafter(float_target)
    for draft_vocab in (None, torch.arange(0, 64, 2)):
        if draft_vocab is not None:
            drafter.set_draft_vocab(draft_vocab)
        output = target.generate(
            torch.tensor([[5, 6, 7]]), assistant_model=drafter, max_new_tokens=8, do_sample=False, draft_policy="fixed"
        )
        assert output.shape == (1, 11) and own_drafts(drafter.last_generation_stats) > 0

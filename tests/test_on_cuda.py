"""What only a GPU can show about `generate()` with a drafter, beside the fused head's tests (test_triton_head.py).

The rest of the suite builds its models on the CPU even where there is a GPU, so the batch loop, retrieval and
sampling never run on CUDA there; these tests put the same tiny models on the GPU. They skip without one.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import SPECIAL_TOKENS, forcing_drafter, successor_target, tiny_drafter, tiny_target
from test_batching import PARTIAL, both, left_padded
from test_datastore_drafts import own_answers_datastore
from test_generation import VOCAB, attention_switches_seen_by, sdpa_switches
from test_option_mixes import greedy_mix

from hf_domino import batching_domino

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def on_cuda(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.cuda() for name, tensor in batch.items()}


def assert_sampled(output: torch.Tensor, prompt: torch.Tensor, max_new_tokens: int) -> None:
    """Sampled rows on the device that continue their prompts: each row runs `max_new_tokens` or ends at its EOS.

    A random 64-token model samples its EOS often enough to end every row early (the fourth GPU run met it).
    """
    assert output.device.type == "cuda" and torch.equal(output[:, : prompt.shape[1]], prompt)
    new = output[:, prompt.shape[1] :].cpu()
    assert new.shape[1] <= max_new_tokens
    for row in new.tolist():
        ended = SPECIAL_TOKENS["eos_token_id"] in row
        assert ended or len(row) == max_new_tokens, row
        if ended:  # after its EOS a row holds only padding
            assert set(row[row.index(SPECIAL_TOKENS["eos_token_id"]) + 1 :]) <= {SPECIAL_TOKENS["pad_token_id"]}, row


@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_cuda_batch_is_identical_to_the_target_alone(arch, policy):
    # Ragged acceptance, rows retiring at different times, both caches with holes: all on the device.
    target = successor_target(arch, VOCAB).cuda()
    drafter = forcing_drafter(target, PARTIAL, block_size=6).cuda()
    batch = on_cuda(left_padded([[4, 9, 11], [20], [7, 25, 26, 27, 28], [12, 13]]))
    expected, output = both(target, drafter, batch, max_new_tokens=24, draft_policy=policy)
    assert output.device.type == "cuda" and torch.equal(output, expected)
    if policy == "fixed":
        assert len(set(drafter.last_generation_stats.acceptance_lengths)) > 2


def test_cuda_batch_retrieves_and_stays_identical(monkeypatch):
    monkeypatch.setattr(batching_domino, "RETRIEVAL_MAX_ROWS", None)
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    drafter.datastore = own_answers_datastore(target, [[3, 9, 14], [21, 4], [8, 8, 30], [12, 40, 2]])
    target, drafter = target.cuda(), drafter.cuda()
    drafter.set_draft_vocab(list(range(0, 64, 2)))
    for rows in ([[3, 9, 15]], [[3, 9, 15], [7, 21, 5], [50, 8, 8, 31, 2]]):
        expected, output = both(target, drafter, on_cuda(left_padded(rows)), max_new_tokens=30, draft_policy="fixed")
        assert torch.equal(output, expected), len(rows)
        assert any(drafter.last_generation_stats.retrieved), len(rows)


def test_cuda_sampling_runs_on_the_device_one_row_and_a_batch():
    # The law itself is checked on the CPU (chi-square); here the sampled paths (fused head at T = 1, speculative
    # sampling, several sequences per prompt) run on CUDA and give well-formed outputs.
    target = tiny_target("qwen3").cuda()
    drafter = tiny_drafter(target).cuda()
    torch.manual_seed(0)
    one = torch.tensor([[5, 17, 42, 8, 9]], device="cuda")
    output = target.generate(one, assistant_model=drafter, do_sample=True, max_new_tokens=16, draft_policy="fixed")
    assert_sampled(output, one, 16)
    batch = on_cuda(left_padded([[5, 17, 42], [8, 9], [30, 31, 32, 33]]))
    output = target.generate(
        **batch, assistant_model=drafter, do_sample=True, max_new_tokens=12, num_return_sequences=2
    )
    assert output.shape[0] == 6 and output.device.type == "cuda"
    assert int(output.min()) >= 0 and int(output.max()) < target.config.vocab_size


@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_cuda_trees_are_identical_to_the_target_alone_and_sample_on_the_device(policy):
    # First-token branches: the tree's 4D mask, its positions and the cache's kept columns, all on the device.
    target = tiny_target("qwen3").cuda()
    drafter = tiny_drafter(target).cuda()
    batch = on_cuda(left_padded([[5, 17, 42, 8, 9], [3, 30]]))
    for rows in (1, 2):
        part = {name: value[-rows:] for name, value in batch.items()}
        expected, output = both(target, drafter, part, max_new_tokens=16, draft_policy=policy, domino_branches=3)
        assert output.device.type == "cuda" and torch.equal(output, expected), rows
    torch.manual_seed(0)
    sampled = target.generate(**batch, assistant_model=drafter, do_sample=True, max_new_tokens=16,
                              draft_policy=policy, domino_branches=3)  # fmt: skip
    assert_sampled(sampled, batch["input_ids"], 16)


def test_cuda_target_with_a_cpu_drafter_is_refused_before_any_work():
    # What pipeline(model=target) leaves behind on a GPU machine: the target moved to the GPU, the drafter not.
    target = tiny_target("qwen3").cuda()
    drafter = tiny_drafter(target)
    with pytest.raises(ValueError, match=r"drafter is on cpu and the target on cuda.*device=target.device"):
        target.generate(torch.tensor([[5, 6, 7]], device="cuda"), assistant_model=drafter, max_new_tokens=3)


def test_cuda_gru_weights_stay_packed_after_to():
    # torch re-points an RNN's weights after .to() without packing them; cuDNN then warns and copies on every call.
    drafter = tiny_drafter(tiny_target("qwen3")).cuda().to(torch.bfloat16)
    tokens = torch.randn(1, 3, drafter.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        drafter.gru_step(tokens, None)


def test_cuda_adaptive_policy_learns_its_times_on_the_device():
    # On CUDA the loops synchronize at their laps so that the policy refines its cost table and learns the drafter's
    # times, as on a CPU (the first GPU run priced every block with one noisy calibration and CPU-sized defaults).
    from hf_domino import records_domino

    target = successor_target("qwen3", VOCAB).cuda()
    drafter = forcing_drafter(target, [(t + 1) % VOCAB for t in range(VOCAB)], block_size=8).cuda()
    prompt = torch.tensor([[4, 5]], device="cuda")
    expected = target.generate(prompt, max_new_tokens=40, do_sample=False)
    output = target.generate(prompt, max_new_tokens=40, do_sample=False, assistant_model=drafter)
    assert torch.equal(output, expected) and any(drafter.last_generation_stats.drafted)
    records = records_domino._RECORDS[drafter][target]
    assert any(record.backbone_seconds is not None for record in records.values()), records.keys()


def test_cuda_static_cache_runs_the_compiled_forward_and_stays_identical():
    # On a GPU transformers compiles the verifying forward by itself once the cache is static (inductor, CUDA graphs);
    # the drafter's blocks go through it unchanged (test_static_cache.py checks the same on the CPU's eager backend).
    from hf_domino.options_domino import static_caches_roll_back

    if not static_caches_roll_back():
        pytest.skip("static caches roll back from transformers 5.24")
    target = tiny_target("qwen3").cuda()
    drafter = tiny_drafter(target).cuda()
    prompt = torch.tensor([[5, 17, 42, 8, 9]], device="cuda")
    try:
        for policy in ("fixed", "adaptive"):
            expected = target.generate(prompt, max_new_tokens=24, do_sample=False)
            output = target.generate(
                prompt, max_new_tokens=24, do_sample=False, cache_implementation="static", assistant_model=drafter,
                draft_policy=policy,
            )  # fmt: skip
            assert torch.equal(output, expected), policy
        assert hasattr(target, "_compiled_call")
        assert sum(drafter.last_generation_stats.drafted) > 0
    finally:
        torch._dynamo.reset()


def test_cuda_bench_warms_the_compiled_verification_from_prompts_kept_on_the_cpu():
    # The bench keeps its prompts on the CPU and moves each to the target's device; the static-cache warm-up did not
    # (fifth GPU run: position ids on the CPU beside the CUDA model, inside transformers' assisted loop).
    from hf_domino.measure import warm_verification_lengths
    from hf_domino.options_domino import static_caches_roll_back

    if not static_caches_roll_back():
        pytest.skip("static caches roll back from transformers 5.24")
    target = tiny_target("qwen3").cuda()
    drafter = tiny_drafter(target).cuda()
    try:
        warm_verification_lengths(
            target, drafter, torch.tensor([[5, 17, 42, 8, 9]]), 4, {"cache_implementation": "static"}
        )
        assert sum(drafter.last_generation_stats.drafted) > 0
    finally:
        torch._dynamo.reset()


def requests_on_cuda():
    """A toy target whose forcing drafter often drafts its own answers, both on the device, the greedy generation
    config of the requests, and each request's answer from the target alone on the device."""
    from test_continuous_batching import EOS, PROMPTS, followed_by, random_target
    from transformers import GenerationConfig

    target = random_target("qwen3")
    settings = dict(max_new_tokens=20, eos_token_id=EOS)
    drafter = forcing_drafter(target, followed_by(target, PROMPTS, **settings), block_size=6)
    target, drafter = target.cuda(), drafter.cuda()
    expected = []
    for prompt in PROMPTS:
        output = target.generate(torch.tensor([prompt], device="cuda"), do_sample=False, pad_token_id=0, **settings)
        expected.append(output[0, len(prompt) :].tolist())
    return target, drafter, GenerationConfig(do_sample=False, pad_token_id=0, **settings), expected


def test_cuda_requests_join_the_drafted_batch_and_each_is_the_target_alones():
    # `generate_batch` with the drafter: rows finish and requests join on the device, each token-identical to the
    # target alone generating its prompt alone.
    from test_continuous_batching import PROMPTS, rows_at_most

    target, drafter, config, expected = requests_on_cuda()
    results = target.generate_batch(
        PROMPTS, config, continuous_batching_config=rows_at_most(3), assistant_model=drafter
    )
    assert [result.generated_tokens for result in results.values()] == expected
    assert sum(drafter.last_generation_stats.drafted) > 0


def test_cuda_the_drafted_manager_serves_requests_added_while_it_runs():
    # init_continuous_batching(assistant_model=drafter): the background thread drafts on the device, a streaming
    # request's tokens so far are prefixes of its answer, and every answer is the target alone's.
    from test_continuous_batching import PROMPTS, rows_at_most

    target, drafter, config, expected = requests_on_cuda()
    rows = rows_at_most(3)
    with target.continuous_batching_context_manager(
        config, continuous_batching_config=rows, assistant_model=drafter
    ) as manager:
        ids = [manager.add_request(prompt, streaming=True) for prompt in PROMPTS]
        outputs = {request_id: list(manager.request_id_iter(request_id)) for request_id in ids}
    assert [outputs[request_id][-1].generated_tokens for request_id in ids] == expected
    for request_id, answer in zip(ids, expected):
        assert all(output.generated_tokens == answer[: len(output.generated_tokens)] for output in outputs[request_id])
    assert sum(drafter.last_generation_stats.drafted) > 0


def test_cuda_half_precision_calls_run_without_cudnn_attention():
    # cuDNN plans every new (query, key) length; a drafting call meets new ones at every cycle (third GPU run's bf16
    # slow state). Both loops run without its kernels, unless asked, and put the switch back afterwards.
    target = tiny_target("qwen3").cuda().to(torch.bfloat16)
    drafter = tiny_drafter(target).cuda().to(torch.bfloat16)
    before = sdpa_switches()
    one = torch.tensor([[5, 17, 42, 8, 9]], device="cuda")
    batch = on_cuda(left_padded([[5, 17, 42], [8, 9]]))
    for inputs in ({"input_ids": one}, batch):
        seen = attention_switches_seen_by(target, **inputs, assistant_model=drafter, max_new_tokens=12)
        assert seen and all(switches == before | {"cudnn": False} for switches in seen)
        assert sdpa_switches() == before
        seen = attention_switches_seen_by(
            target, **inputs, assistant_model=drafter, max_new_tokens=6, domino_cudnn_attention=True
        )
        assert seen and all(switches == before for switches in seen)


# Last in the file: the GPU run's `cuda` stage has a deadline, and these compile the fused head for new shapes.
@pytest.mark.parametrize("seed", range(8))
def test_cuda_option_mixes_are_the_target_alones(seed):
    # test_option_mixes.py's greedy mixes on the device: processors, stopping rules, scores, batches, policies,
    # copies, branches, the head off, the fused head or the eager one.
    greedy_mix(seed, device="cuda")

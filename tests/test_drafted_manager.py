"""`target.init_continuous_batching(assistant_model=drafter)`: requests added from any thread while the drafted batch
runs, each what the target alone generates for it; streaming, cancellation, failures and bad input."""

from __future__ import annotations

import asyncio
import os
import threading
from collections import Counter

import pytest
import torch
from conftest import forcing_drafter
from test_continuous_batching import EOS, PROMPTS, alone, followed_by, random_target, rows_at_most
from test_generation import (
    chi_square_p_value,
    drafts_and_accepted,
    exact_sequence_distribution,
    law_drafter,
    law_target,
)
from transformers import GenerationConfig, LogitsProcessorList
from transformers.generation.continuous_batching.requests import RequestStatus
from transformers.generation.logits_process import TemperatureLogitsWarper

from hf_domino import (
    batch_policy_domino,
    batching_domino,
    batching_manager_domino,
    continuous_batching_domino,
    records_domino,
)
from hf_domino.batching_manager_domino import DraftedBatchingManager

SETTINGS = dict(max_new_tokens=20, eos_token_id=EOS)


def greedy(**extra) -> GenerationConfig:
    return GenerationConfig(do_sample=False, pad_token_id=0, **SETTINGS, **extra)


@pytest.fixture(scope="module")
def models():
    target = random_target("qwen3")
    drafter = forcing_drafter(target, followed_by(target, PROMPTS, **SETTINGS), block_size=6)
    return target, drafter


def results_of(manager, count: int, timeout: float = 60) -> tuple[dict, list]:
    """The next `count` finished results by request id, and every result before them (streamed ones included)."""
    finished, seen = {}, []
    while len(finished) < count:
        result = manager.get_result(timeout=timeout)
        assert result is not None, "no result within the timeout"
        seen.append(result)
        if result.is_finished():
            finished[result.request_id] = result
    return finished, seen


def test_requests_added_from_threads_while_it_runs_are_each_the_target_alones(models, monkeypatch):
    target, drafter = models
    # A batch of at most 3 requests: the 7 requests run through several batches that run dry and start again.
    monkeypatch.setattr(batching_manager_domino, "MANAGER_BATCH_REQUESTS", 3)
    batches = []
    start_batch = continuous_batching_domino.ServingCall.decoding
    monkeypatch.setattr(
        continuous_batching_domino.ServingCall,
        "decoding",
        lambda self, rules: batches.append(1) or start_batch(self, rules),
    )
    manager = target.init_continuous_batching(greedy(), rows_at_most(2), assistant_model=drafter)
    assert isinstance(manager, DraftedBatchingManager)
    manager.start()
    first = manager.add_requests(PROMPTS[:2])
    early, _ = results_of(manager, 1)  # a request finished: the rest join a batch that is running or ran dry
    threads = [
        threading.Thread(target=manager.add_request, args=(prompt,), kwargs={"request_id": f"late_{i}"})
        for i, prompt in enumerate(PROMPTS[2:])
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    later, _ = results_of(manager, len(PROMPTS) - 1)
    manager.stop()
    assert not manager.is_running() and manager.error is None
    results = {**early, **later}
    ids = first + [f"late_{i}" for i in range(len(PROMPTS) - 2)]
    expected = [alone(target, prompt, **SETTINGS) for prompt in PROMPTS]
    assert [results[request_id].generated_tokens for request_id in ids] == expected
    assert all(results[request_id].prompt_ids == prompt for request_id, prompt in zip(ids, PROMPTS))
    assert all(result.status == RequestStatus.FINISHED and result.lifespan[1] > 0 for result in results.values())
    assert manager.get_result(timeout=0.1) is None  # nothing left, and no thread to produce more
    assert len(batches) >= 3  # at most 3 requests a batch


def test_starting_on_a_cpu_releases_the_callers_openmp_workers(models, monkeypatch):
    target, drafter = models
    released = []
    monkeypatch.setattr(batching_manager_domino, "release_openmp_workers", lambda: released.append(1) or True)
    for release in (True, False):
        monkeypatch.setattr(batching_manager_domino, "RELEASE_CALLER_OPENMP", release)
        with target.continuous_batching_context_manager(greedy(), assistant_model=drafter) as manager:
            result = manager.get_result(manager.add_request(PROMPTS[0]), timeout=60)
        assert result.generated_tokens == alone(target, PROMPTS[0], **SETTINGS)
        assert len(released) == 1  # on start with the switch on, not with it off


@pytest.mark.skipif(
    not os.path.isdir("/proc/self/task") or not batching_manager_domino._openmp_pause_functions(),
    reason="counts this process's threads in /proc, on an OpenMP runtime that can end them (torch 2.6's cannot)",
)
def test_released_openmp_workers_end_until_the_threads_next_parallel_work():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        running = lambda: set(os.listdir("/proc/self/task"))  # noqa: E731
        torch.ones(1 << 22).sum()  # parallel work: this thread's OpenMP worker starts (or is still there)
        before = running()
        assert batching_manager_domino.release_openmp_workers()
        assert before - running(), "no thread ended"
        after = running()
        torch.ones(1 << 22).sum()
        assert running() - after, "no worker started again"
    finally:
        torch.set_num_threads(threads)


def test_a_streaming_request_gets_its_tokens_so_far_then_its_result(models):
    target, drafter = models
    with target.continuous_batching_context_manager(
        greedy(), assistant_model=drafter, draft_policy="fixed"
    ) as manager:
        plain = manager.add_request(PROMPTS[0], max_new_tokens=6, record_timestamps=True)
        streamed = manager.add_request(PROMPTS[2], streaming=True, record_timestamps=True)
        outputs = list(manager.request_id_iter(streamed))
        result = manager.get_result(plain, timeout=60)
    assert not manager.is_running()
    expected = alone(target, PROMPTS[2], **SETTINGS)
    assert outputs[-1].status == RequestStatus.FINISHED and outputs[-1].generated_tokens == expected
    partial = [output.generated_tokens for output in outputs[:-1]]
    assert partial and all(output.status == RequestStatus.DECODING for output in outputs[:-1])
    assert all(tokens == expected[: len(tokens)] for tokens in partial)  # prefixes of the answer
    assert [len(tokens) for tokens in partial] == sorted({len(tokens) for tokens in partial})  # each adds some
    assert all(len(output.timestamps) == len(output.generated_tokens) for output in outputs)
    assert len(partial) < len(expected)  # some cycles accepted drafts: fewer updates than tokens
    # A request's own max_new_tokens, and its timestamps, one per token.
    assert result.generated_tokens == alone(target, PROMPTS[0], max_new_tokens=6, eos_token_id=EOS)
    assert len(result.timestamps) == len(result.generated_tokens)


def test_cancelled_requests_leave_without_a_result(models):
    target, drafter = models
    manager = target.init_continuous_batching(greedy(), rows_at_most(1), assistant_model=drafter)
    ids = manager.add_requests(PROMPTS[:3])  # queued before the thread starts
    manager.cancel_request(ids[1])
    manager.start()
    results, _ = results_of(manager, 2)
    assert set(results) == {ids[0], ids[2]}
    # A running request: the batch drops its row at its next step, and it never finishes.
    running = manager.add_request(PROMPTS[2], max_new_tokens=1000, streaming=True)
    manager.get_result(running, timeout=60)  # its first tokens: it runs
    manager.cancel_request(running)
    manager.stop()
    assert manager.error is None
    left = []
    while (result := manager.get_result(timeout=0.1)) is not None:
        left.append(result)
    assert all(not result.is_finished() for result in left)
    assert sum(drafter.last_generation_stats.acceptance_lengths) < 500  # its row left: it did not run to the end


def test_a_paused_manager_steps_no_further_until_the_last_pause_ends(models):
    target, drafter = models
    with target.continuous_batching_context_manager(greedy(), assistant_model=drafter) as manager:
        with manager.pause():
            request_id = manager.add_request(PROMPTS[0])
            with manager.pause():  # pauses nest, from one thread or several
                assert manager.get_result(timeout=0.3) is None  # no step while paused
            assert manager.get_result(timeout=0.3) is None
            with pytest.raises(RuntimeError, match="Leave the pause first"):
                manager.stop()
        result = manager.get_result(request_id, timeout=60)
    assert result.generated_tokens == alone(target, PROMPTS[0], **SETTINGS)
    with pytest.raises(RuntimeError, match=r"start\(\) it first"):
        with manager.pause():
            pass


def test_results_go_to_a_handler_on_the_event_loop(models):
    target, drafter = models

    async def serve_one(manager) -> list:
        loop, seen = asyncio.get_running_loop(), []
        finished = loop.create_future()

        def on_result(result) -> None:
            assert threading.current_thread() is threading.main_thread()  # called on the loop's thread
            seen.append(result)
            if result.is_finished():
                finished.set_result(result)

        request_id = manager.add_request(PROMPTS[2], streaming=True)
        manager.register_result_handler(request_id, on_result)
        await asyncio.wait_for(finished, 60)
        return seen

    with target.continuous_batching_context_manager(greedy(), assistant_model=drafter) as manager:
        seen = asyncio.run(serve_one(manager))
        assert manager.get_result(timeout=0.2) is None  # nothing of it went to the queue
    expected = alone(target, PROMPTS[2], **SETTINGS)
    assert seen[-1].generated_tokens == expected and len(seen) > 1
    assert all(result.generated_tokens == expected[: len(result.generated_tokens)] for result in seen)


def test_a_batch_is_judged_with_when_its_requests_came(models, monkeypatch):
    # Plain steps would not have taken a request on before it came: the judge of a manager's batch is told when each
    # came (test_batch_judge checks what it makes of that).
    target, drafter = models
    judged = []
    judge = batch_policy_domino.judge_call
    monkeypatch.setattr(batch_policy_domino, "judge_call", lambda *a, **k: judged.append(a[5]) or judge(*a, **k))
    # One judgement, of the whole batch: no window of MANAGER_JUDGE_CYCLES inside it, which the first request's 300
    # tokens reach where the policy takes plain steps (a loaded machine's costs).
    monkeypatch.setattr(batching_manager_domino, "MANAGER_JUDGE_CYCLES", 10**6)
    config = GenerationConfig(do_sample=False, pad_token_id=0, max_new_tokens=300)
    with target.continuous_batching_context_manager(config, assistant_model=drafter) as manager:
        first = manager.add_request(PROMPTS[2], streaming=True)  # 300 tokens without an EOS
        manager.get_result(first, timeout=60)  # it runs
        second = manager.add_request(PROMPTS[0], max_new_tokens=5)
        assert manager.get_result(second, timeout=60).is_finished()
        *_, last = manager.request_id_iter(first)
    assert last.is_finished() and len(judged) == 1
    assert judged[0][0] == 0.0 and judged[0][1] > 0.0


def test_a_batch_that_never_runs_dry_is_judged_a_window_at_a_time(models, monkeypatch):
    # A server always busy would judge its batch only when 1024 requests had gone through it, and pause whole batches.
    # Every MANAGER_JUDGE_CYCLES cycles its window is judged as a call; a losing one pauses the next window (1, then
    # 2, ... windows of plain steps), and every answer is still the target alone's.
    target, drafter = models
    records_domino.forget_records(drafter)  # from a first batch: nothing learned by the other tests' batches
    monkeypatch.setattr(batching_manager_domino, "MANAGER_JUDGE_CYCLES", 8)
    monkeypatch.setattr(batch_policy_domino, "CALL_MIN_CYCLES", 1)
    monkeypatch.setattr(batch_policy_domino, "call_gain", lambda *args: 0.5)  # every speculating window loses
    windows = []
    judge = batch_policy_domino.judge_call
    monkeypatch.setattr(
        batch_policy_domino, "judge_call", lambda *a, **k: windows.append((len(a[1]), a[3])) or judge(*a, **k)
    )
    config = GenerationConfig(do_sample=False, pad_token_id=0, max_new_tokens=200)
    with target.continuous_batching_context_manager(config, rows_at_most(2), assistant_model=drafter) as manager:
        ids = manager.add_requests([PROMPTS[2], PROMPTS[5]])  # 200 tokens each, without an EOS
        results = [manager.get_result(request_id, timeout=60) for request_id in ids]
    assert [result.generated_tokens for result in results] == [
        alone(target, prompt, max_new_tokens=200) for prompt in (PROMPTS[2], PROMPTS[5])
    ]
    assert len(windows) >= 5 and all(cycles <= 8 for cycles, _ in windows[:-1])  # one batch, judged in windows
    speculated = [flag for _, flag in windows]
    assert speculated[:5] == [True, False, True, False, False]  # paused 1 window, then 2


def test_a_check_within_a_window_weighs_the_windows_own_tokens(models, monkeypatch):
    # A check every CALL_CHECK_CYCLES cycles (`losing`) weighs the window's cycles against plain steps for the tokens
    # generated in them, counted from the window's start, as the window's judge does: not every token since the batch
    # began, which made a later window's cycles look far faster than plain steps.
    target, drafter = models
    records_domino.forget_records(drafter)
    monkeypatch.setattr(batching_manager_domino, "MANAGER_JUDGE_CYCLES", 8)
    monkeypatch.setattr(batch_policy_domino, "CALL_CHECK_CYCLES", 4)
    checks = []
    check = batch_policy_domino.stops_speculating
    monkeypatch.setattr(
        batch_policy_domino, "stops_speculating", lambda *a: checks.append((len(a[1]), a[2], a[4])) or check(*a)
    )
    config = GenerationConfig(do_sample=False, pad_token_id=0, max_new_tokens=120)
    with target.continuous_batching_context_manager(config, rows_at_most(2), assistant_model=drafter) as manager:
        ids = manager.add_requests([PROMPTS[2], PROMPTS[5]])
        results = [manager.get_result(request_id, timeout=60) for request_id in ids]
    assert [result.generated_tokens for result in results] == [
        alone(target, prompt, max_new_tokens=120) for prompt in (PROMPTS[2], PROMPTS[5])
    ]
    assert len(checks) >= 4  # checks in several windows
    block = drafter.config.num_drafts + 1  # a row's most tokens per cycle
    assert all(0 < sum(steps) and max(steps) <= cycles * block for cycles, steps, _ in checks)
    assert all(min(arrivals) >= 0.0 for _, _, arrivals in checks)


def test_num_return_sequences_come_back_as_transformers_names_them(models):
    target, drafter = models
    config = GenerationConfig(do_sample=True, num_return_sequences=3, pad_token_id=0, **SETTINGS)
    torch.manual_seed(0)
    with target.continuous_batching_context_manager(config, assistant_model=drafter) as manager:
        request_id = manager.add_request(PROMPTS[0], request_id="mine")
        results, _ = results_of(manager, 3)
    assert request_id == "mine"
    assert set(results) == {"mine", "mine__child#0", "mine__child#1"}
    assert all(len(result.generated_tokens) > 0 for result in results.values())


def test_each_request_samples_with_its_own_settings_and_keeps_its_law(gpu_like_costs):
    """What transformers' manager takes per request (and `transformers serve` sends): a request's own temperature,
    top-k and top-p where the config samples. Requests of three settings share the batch's cycles: each keeps the law
    the target alone has with its settings, and `top_k=1` is the target alone's greedy answer."""
    vocab, num_new, draws = 5, 3, 600
    target = law_target(vocab, seed=3, peak=4)  # peaked laws, so that a wrong one is told apart (below)
    drafter = law_drafter(target)
    prompt = [2, 4, 1]
    config = GenerationConfig(do_sample=True, temperature=0.5, max_new_tokens=num_new, pad_token_id=0)
    manager = target.init_continuous_batching(config, rows_at_most(64), assistant_model=drafter, draft_policy="fixed")
    assert manager.logit_processor.supported_keys == {"temperature": float, "top_k": int, "top_p": float}
    torch.manual_seed(7)
    ids = {"own": [], "config": [], "greedy": []}
    for i in range(draws):  # interleaved, so that every cycle verifies rows of different laws together
        ids["own"].append(manager.add_request(prompt, temperature=1.5))
        ids["config"].append(manager.add_request(prompt))
        if i % 100 == 0:
            ids["greedy"].append(manager.add_request(prompt, top_k=1))
    manager.start()
    results, _ = results_of(manager, sum(map(len, ids.values())), timeout=300)
    manager.stop()
    drafted, accepted = drafts_and_accepted([drafter.last_generation_stats])
    assert 0 < accepted < drafted  # rejection sampling really ran, with both outcomes
    greedy_answer = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=num_new)[0, 3:].tolist()
    assert all(results[request_id].generated_tokens == greedy_answer for request_id in ids["greedy"])
    counts = {}
    for kind in ("own", "config"):
        counts[kind] = Counter(tuple(results[request_id].generated_tokens) for request_id in ids[kind])
    laws = {
        kind: exact_sequence_distribution(
            target, prompt, num_new, LogitsProcessorList([TemperatureLogitsWarper(temperature)])
        )
        for kind, temperature in (("own", 1.5), ("config", 0.5))
    }
    assert chi_square_p_value(counts["own"], laws["own"], draws) > 1e-3
    assert chi_square_p_value(counts["config"], laws["config"], draws) > 1e-3
    # The test can fail: each group's draws are far from the other's law.
    assert chi_square_p_value(counts["own"], laws["config"], draws) < 1e-6
    assert chi_square_p_value(counts["config"], laws["own"], draws) < 1e-6


def test_a_batch_begun_without_processors_takes_on_requests_with_some(models):
    target, drafter = models
    config = GenerationConfig(do_sample=True, pad_token_id=0, **SETTINGS)
    with target.continuous_batching_context_manager(config, rows_at_most(4), assistant_model=drafter) as manager:
        manager.add_request(PROMPTS[0], top_k=0)  # temperature 1, no top-k or top-p: generate() builds no processor
        greedy_ids = [manager.add_request(prompt, top_k=1) for prompt in PROMPTS[1:4]]
        results, _ = results_of(manager, 4)
    expected = [alone(target, prompt, **SETTINGS) for prompt in PROMPTS[1:4]]
    assert [results[request_id].generated_tokens for request_id in greedy_ids] == expected


def test_a_failure_in_the_thread_fails_every_request_it_held(models, monkeypatch):
    target, drafter = models

    def broken(self):
        raise RuntimeError("device lost")

    monkeypatch.setattr(batching_domino.BatchedDecoding, "cycle", broken)
    manager = target.init_continuous_batching(greedy(), rows_at_most(2), assistant_model=drafter)
    manager.add_requests(PROMPTS[:4])
    manager.start()
    results, _ = results_of(manager, 4)
    # A request added once the thread has ended on its error was queued and never answered: now refused.
    with pytest.raises(RuntimeError, match="thread ended on an error .*device lost.* start\\(\\) it again"):
        manager.add_request(PROMPTS[0])
    manager.stop()
    assert {result.status for result in results.values()} == {RequestStatus.FAILED}
    assert all("device lost" in result.error for result in results.values())
    assert isinstance(manager.error, RuntimeError) and not manager.is_running()


def test_a_manager_restarts_after_a_stop_that_did_not_wait(models):
    """start() right after stop(block=False) returned at once, the old thread still finishing: the next request
    was refused as if stopped."""
    target, drafter = models
    manager = target.init_continuous_batching(greedy(), assistant_model=drafter)
    manager.start()
    first = manager.add_request(PROMPTS[0])
    manager.stop(block=False)
    manager.start()
    second = manager.add_request(PROMPTS[1])
    results, _ = results_of(manager, 2)
    manager.stop()
    assert results[first].generated_tokens == alone(target, PROMPTS[0], **SETTINGS)
    assert results[second].generated_tokens == alone(target, PROMPTS[1], **SETTINGS)


def test_a_request_of_a_length_generate_refuses_is_refused_and_the_others_are_served(models):
    """add_request(max_new_tokens=2.5) ended the thread with a TypeError, failing every request it held; 0 and -3
    were served empty answers."""
    target, drafter = models
    with target.init_continuous_batching(greedy(), assistant_model=drafter) as manager:
        served = manager.add_request(PROMPTS[0])
        for bad in (2.5, 0, -3):
            with pytest.raises(ValueError, match="max_new_tokens"):
                manager.add_request(PROMPTS[1], max_new_tokens=bad)
        results, _ = results_of(manager, 1)
    assert results[served].generated_tokens == alone(target, PROMPTS[0], **SETTINGS)


def test_a_hard_stop_fails_what_the_manager_holds_and_destroy_ends_it_for_good(models):
    """transformers' manager's stop(hard_stop=..., keep_for_next_session=...) and destroy() were TypeErrors and an
    AttributeError on a drafted manager."""
    target, drafter = models
    manager = target.init_continuous_batching(greedy(), rows_at_most(1), assistant_model=drafter)
    manager.add_requests(PROMPTS)
    manager.stop(hard_stop=True, block=False)  # before the thread takes them
    manager.start()  # a start clears an earlier stop's
    manager.stop(hard_stop=True, keep_for_next_session=True)
    results = list(manager)
    assert len(results) == len(PROMPTS) and all(result.is_finished() for result in results)
    failed = [result for result in results if result.status == RequestStatus.FAILED]
    assert failed and all("hard_stop" in result.error for result in failed) and manager.error is None
    manager.start()
    again = manager.add_request(PROMPTS[0])
    assert results_of(manager, 1)[0][again].generated_tokens == alone(target, PROMPTS[0], **SETTINGS)
    manager.destroy()
    manager.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        manager.start()


def test_what_a_manager_cannot_serve_is_refused_with_the_fix(models):
    target, drafter = models
    manager = target.init_continuous_batching(greedy(), assistant_model=drafter)
    with pytest.raises(ValueError, match="Set it in the GenerationConfig"):
        manager.add_request(PROMPTS[0], eos_token_id=EOS + 1)
    manager.add_request(PROMPTS[0], eos_token_id=[EOS])  # the config's own: accepted
    with pytest.raises(ValueError, match="list of token ids"):
        manager.add_request("a prompt as text")
    with pytest.raises(ValueError, match=r"list of token ids \(integers\)"):
        manager.add_request([4.5, 3])  # was cut to [4, 3]
    vocab = target.config.vocab_size
    with pytest.raises(ValueError, match=f"holds token id {vocab}, outside the target's vocabulary of {vocab}"):
        manager.add_request([4, vocab])  # ended the thread, failing every request it held
    # A request's own sampling settings: only where the config samples, of their types, and no other setting.
    with pytest.raises(ValueError, match=r"decodes greedily .* GenerationConfig\(do_sample=True"):
        manager.add_request(PROMPTS[0], temperature=0.7)
    sampling_config = GenerationConfig(do_sample=True, pad_token_id=0, **SETTINGS)
    sampling = target.init_continuous_batching(sampling_config, assistant_model=drafter)
    with pytest.raises(ValueError, match="repetition_penalty=1.2. Set other generation settings in the Generation"):
        sampling.add_request(PROMPTS[0], repetition_penalty=1.2)
    with pytest.raises(TypeError, match="temperature is a float; got 1"):
        sampling.add_request(PROMPTS[0], temperature=1)
    with pytest.raises(ValueError, match="temperature"):  # generate()'s own check of the value
        sampling.add_request(PROMPTS[0], temperature=-0.5)
    manager.start()
    manager.stop()
    with pytest.raises(RuntimeError, match=r"start\(\) it again"):
        manager.add_request(PROMPTS[0])
    with pytest.raises(TypeError, match="generation settings as keyword arguments"):
        target.init_continuous_batching(greedy(), assistant_model=drafter, not_a_setting=1)
    with pytest.raises(ValueError, match="draft_policy"):
        target.init_continuous_batching(greedy(), assistant_model=drafter, draft_policy="sometimes")
    if not torch.cuda.is_available():  # a rollout the device cannot run ended the thread at the first request
        with pytest.raises(ValueError, match="domino_rollout='triton' needs CUDA, or Triton's interpreter"):
            target.init_continuous_batching(greedy(), assistant_model=drafter, domino_rollout="triton")
    with pytest.raises(TypeError, match="assistant_model"):  # another assistant: transformers' own error
        target.init_continuous_batching(greedy(), assistant_model=target)
    # Without an assistant, transformers' own manager.
    assert type(target.init_continuous_batching(greedy())).__name__ == "ContinuousBatchingManager"
    assert (
        type(target.init_continuous_batching(greedy(), assistant_model=None)).__name__ == "ContinuousBatchingManager"
    )


@pytest.mark.slow
def test_the_arrivals_benchmark_runs_as_a_user_runs_it():
    # The script docs/benchmarks.md quotes, at toy size: it asserts every drafted answer is the target alone's.
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "serve_arrivals.py"
    run = subprocess.run(
        [sys.executable, str(script), "--num-prompts", "4", "--rows", "2", "--max-new-tokens", "12", "--rate", "8",
         "--show-calls"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [line for line in run.stdout.splitlines() if "manager" in line and "tokens/s" in line]
    assert len(lines) == 4 and all("0 of 4 answers differing" in line for line in lines), run.stdout


@pytest.mark.slow
def test_the_thread_penalty_example_runs_as_a_user_runs_it():
    # The script behind docs/benchmarks.md's "torch's work in a second thread", at toy size: every way it measures
    # runs (the manager's own thread among them) and gets a figure.
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "thread_penalty.py"
    args = ["--prompts", "1", "--tokens", "4", "--rounds", "1"]
    run = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    figures = [line for line in run.stdout.splitlines() if line.startswith("  ") and line.rstrip().endswith("]")]
    assert len(figures) == 5 + 8 and all(float(line.split()[-2]) > 0 for line in figures), run.stdout

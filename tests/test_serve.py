"""A drafter attached to its target (`attach_drafter`), and `hf-domino serve`: transformers' OpenAI-compatible server
answering with the target alone's tokens while it drafts, one request at a time and continuously batched."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import forcing_drafter, free_port, successor_target, tiny_drafter, tiny_target
from test_batching import left_padded
from test_generation import VOCAB, successor
from transformers import GenerationConfig
from transformers.utils import is_serve_available

import hf_domino
from hf_domino.batching_manager_domino import DraftedBatchingManager
from hf_domino.cpu_fast_path import is_prepared_for_cpu_decoding

PROMPT = torch.tensor([[4, 9, 11]])


@pytest.fixture
def attached():
    target = successor_target("qwen3", VOCAB)
    drafter = forcing_drafter(target, successor(1), block_size=6)  # every draft right
    alone = target.generate(PROMPT, do_sample=False, max_new_tokens=20)
    hf_domino.attach_drafter(target, drafter)
    yield target, drafter, alone
    hf_domino.detach_drafter(target)


def drafted(drafter) -> bool:
    """Whether the call just made drafted with `drafter` (and so reset its statistics)."""
    stats, drafter.last_generation_stats = drafter.last_generation_stats, None
    return stats is not None and stats.mean_acceptance_length > 1


def test_an_attached_drafter_drafts_every_call_that_names_no_assistant(attached):
    target, drafter, alone = attached
    drafter.last_generation_stats = None
    assert torch.equal(target.generate(PROMPT, do_sample=False, max_new_tokens=20), alone) and drafted(drafter)
    batch = left_padded([[4, 9, 11], [20], [12, 13]])
    with_drafter = target.generate(**batch, do_sample=False, max_new_tokens=12)
    assert drafted(drafter)
    hf_domino.detach_drafter(target)
    assert hf_domino.attached_drafter(target) is None
    assert torch.equal(with_drafter, target.generate(**batch, do_sample=False, max_new_tokens=12))
    assert not drafted(drafter)
    hf_domino.attach_drafter(target, drafter)
    assert hf_domino.attached_drafter(target) is drafter
    # The entry points of continuous batching, which take no assistant in transformers.
    config = GenerationConfig(do_sample=False, max_new_tokens=20, pad_token_id=0)
    results = target.generate_batch([PROMPT[0].tolist()], config)
    assert results["req_0"].generated_tokens == alone[0, 3:].tolist() and drafted(drafter)
    paged = target.generate(PROMPT, config, cache_implementation="paged")  # generate() hands it to generate_batch
    assert paged[0, 0].tolist() == alone[0].tolist() and drafted(drafter)
    # ... with its model inputs, an attention mask too (tokenizer output), which was refused as no setting.
    paged = target.generate(input_ids=PROMPT, attention_mask=torch.ones_like(PROMPT), generation_config=config,
                            cache_implementation="paged")  # fmt: skip
    assert paged[0, 0].tolist() == alone[0].tolist() and drafted(drafter)
    manager = target.init_continuous_batching(generation_config=config)
    assert isinstance(manager, DraftedBatchingManager) and manager.background_thread_status.fatal_error is None
    # Not a submodule of the target: its parameters, state dict and devices are the target's alone.
    assert all(module is not drafter for module in target.modules())


def test_a_call_nested_in_an_attached_call_keeps_its_own_errors(attached):
    # A stopping criterion of an attached call whose own generate() call was refused: the refusal was taken for the
    # attached call's, escaped the criterion's `except ValueError`, and the outer call ran again with the target alone.
    target, drafter, alone = attached
    other = successor_target("qwen3", VOCAB)
    caught, calls = [], []

    def criterion(input_ids, scores, **kwargs):
        calls.append(1)
        try:
            other.generate(PROMPT, assistant_model=drafter, guidance_scale=2.0, max_new_tokens=2)
        except ValueError as error:
            caught.append(error)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    drafter.last_generation_stats = None
    output = target.generate(PROMPT, do_sample=False, max_new_tokens=20, stopping_criteria=[criterion])
    assert torch.equal(output, alone) and drafted(drafter)
    assert caught and len(caught) == len(calls)  # each criterion call caught its own refusal; none ran twice


def test_a_pipeline_over_an_attached_target_drafts(attached):
    # pipeline() calls generate() without an assistant: one prompt, and a list in batches (left-padded).
    from test_generation import letter_tokenizer
    from transformers import pipeline

    target, drafter, _ = attached
    tokenizer = letter_tokenizer()
    tokenizer.padding_side = "left"
    generator = pipeline("text-generation", model=target, tokenizer=tokenizer)
    calls = [("abc", {}), (["abc", "hijkl"], {"batch_size": 2})]
    drafted_answers = []
    for prompts, batching in calls:
        drafted_answers.append(generator(prompts, max_new_tokens=8, do_sample=False, **batching))
        assert drafted(drafter)
    hf_domino.detach_drafter(target)
    alone = [generator(prompts, max_new_tokens=8, do_sample=False, **batching) for prompts, batching in calls]
    assert drafted_answers == alone and not drafted(drafter)
    assert alone[0][0]["generated_text"] == "abcdefghijk"  # the successor target, eight letters on


def test_an_attached_drafters_options_are_the_calls_defaults(attached):
    target, drafter, alone = attached
    # A fixed policy: the adaptive one may verify fewer drafts than allowed where a loaded machine made them look dear.
    hf_domino.attach_drafter(target, drafter, num_speculative_tokens=2, draft_policy="fixed")
    assert torch.equal(target.generate(PROMPT, do_sample=False, max_new_tokens=20), alone)
    assert max(drafter.last_generation_stats.drafted) == 2
    target.generate(PROMPT, do_sample=False, max_new_tokens=20, num_speculative_tokens=4)  # the call's own wins
    assert max(drafter.last_generation_stats.drafted) == 4


def test_calls_that_ask_for_something_else_run_as_without_the_drafter(attached, caplog):
    target, drafter, _ = attached
    drafter.last_generation_stats = None
    for settings in (dict(num_beams=2), dict(prompt_lookup_num_tokens=3), dict(assistant_model=None, num_beams=2)):
        hf_domino.detach_drafter(target)
        expected = target.generate(PROMPT, do_sample=False, max_new_tokens=8, **settings)
        hf_domino.attach_drafter(target, drafter)
        assert torch.equal(target.generate(PROMPT, do_sample=False, max_new_tokens=8, **settings), expected)
        assert not drafted(drafter), settings
    # Refused by the drafter before any work (classifier-free guidance keeps state across a call): the target alone
    # serves it, and says why once.
    hf_domino.detach_drafter(target)
    expected = target.generate(PROMPT, do_sample=False, max_new_tokens=8, guidance_scale=1.5)
    hf_domino.attach_drafter(target, drafter)
    with caplog.at_level("WARNING"):
        output = target.generate(PROMPT, do_sample=False, max_new_tokens=8, guidance_scale=1.5)
    assert torch.equal(output, expected) and not drafted(drafter)
    assert "does not serve this call" in caplog.text and "guidance_scale" in caplog.text


def test_a_streamer_gets_what_the_plain_loop_hands_it(attached):
    # transformers' assisted loop puts `[1, n]` after the prompt, its plain loop `[n]`: a streamer written for the
    # plain loop (transformers serve's reads `value.tolist()` as token ids) gets token rows.
    target, _, alone = attached

    class Shapes:
        def __init__(self):
            self.values = []

        def put(self, value):
            self.values.append(value)

        def end(self):
            self.values.append(None)

    streamer = Shapes()
    target.generate(PROMPT, do_sample=False, max_new_tokens=20, streamer=streamer)
    prompt, *tokens, end = streamer.values
    assert prompt.shape == (1, 3) and end is None and all(value.dim() == 1 for value in tokens) and len(tokens) < 20
    assert torch.cat(tokens).tolist() == alone[0, 3:].tolist()


def test_attach_refuses_what_cannot_draft_naming_the_fix():
    target = tiny_target()
    with pytest.raises(TypeError, match="takes a Domino drafter"):
        hf_domino.attach_drafter(target, tiny_target())
    drafter = tiny_drafter(target)
    with pytest.raises(TypeError, match="unknown options \\['domino_lookahead'\\]"):
        hf_domino.attach_drafter(target, drafter, domino_lookahead=3)
    with pytest.raises(ValueError, match="draft_policy"):
        hf_domino.attach_drafter(target, drafter, draft_policy="greedy")
    with pytest.raises(ValueError, match="vocab"):
        hf_domino.attach_drafter(tiny_target(vocab_size=128), drafter)
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":  # every call failed instead
        with pytest.raises(ValueError, match="domino_rollout='triton' needs CUDA, or Triton's interpreter, and the"):
            hf_domino.attach_drafter(target, drafter, domino_rollout="triton")
    assert hf_domino.attached_drafter(target) is None


def test_the_rollout_check_reads_every_device_serving_takes(monkeypatch):
    from hf_domino.options_domino import DominoOptions

    for device in ("0", "cuda:1", "balanced", "auto"):  # a GPU's index, a device map: nothing to refuse (was a crash)
        DominoOptions(domino_rollout="triton+graph").validate_device(device)
    DominoOptions().validate_device("not a device")  # no Triton rollout forced: never parsed
    monkeypatch.setenv("TRITON_INTERPRET", "true")  # Triton's own spelling of on, as 1
    DominoOptions(domino_rollout="triton").validate_device("cpu")
    with pytest.raises(ValueError, match="needs CUDA \\(CUDA graphs\\)"):
        DominoOptions(domino_rollout="triton+graph").validate_device("cpu")


# ------------------------------------------------------------------------------------------- hf-domino serve
needs_serving = pytest.mark.skipif(not is_serve_available(), reason='needs pip install "hf-domino[serve]"')
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
MESSAGES = [{"role": "user", "content": "Write a Python function that adds two numbers."}]


def wait_for(port: int, running=lambda: True, seconds: float = 240, log=None) -> None:
    """Until the server on `port` answers (`running()` says whether it still can; `log`, its output's file)."""
    deadline = time.time() + seconds
    while True:
        try:
            urllib.request.urlopen(f"http://localhost:{port}/health", timeout=5)
            return
        except OSError:
            assert running() and time.time() < deadline, log.read_text() if log else "the server did not come up"
            time.sleep(0.5)


def ask(port: int, stream: bool, max_tokens: int = 24) -> str:
    """A greedy chat completion's text, as an OpenAI client gets it (streamed: its deltas joined)."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    request = urllib.request.Request(
        f"http://localhost:{port}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        if not stream:
            return json.loads(response.read())["choices"][0]["message"]["content"]
        lines = [line.decode()[len("data: ") :] for line in response if line.startswith(b"data: {")]
    return "".join(json.loads(line)["choices"][0]["delta"].get("content") or "" for line in lines)


@pytest.fixture(scope="module")
def smollm2_answer():
    """The target alone's greedy answer to MESSAGES, as transformers serve builds and decodes it."""
    from hf_domino.assets import load_target

    target, tokenizer = load_target("smollm2", device="cpu")
    inputs = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    output = target.generate(**inputs, do_sample=False, max_new_tokens=24)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def models_load_in_processes_of_their_own() -> bool:
    """transformers >= 5.25 serves each model from a process of its own (`hf_domino.serve_loader`)."""
    from transformers.cli.serving import model_manager

    return hasattr(model_manager, "ModelLoader")


@needs_serving
@pytest.mark.parametrize("continuous_batching", [False, True], ids=["generate", "continuous-batching"])
def test_the_server_answers_as_the_target_alone_and_drafts(continuous_batching, smollm2_answer):
    from concurrent.futures import ThreadPoolExecutor

    from hf_domino.serve import NotServable, serve

    if models_load_in_processes_of_their_own():  # see test_the_model_process_drafts_with_the_servers_settings
        with pytest.raises(NotServable, match="non_blocking: the server of transformers .* runs until it stops"):
            serve(continuous_batching=continuous_batching, port=free_port(), non_blocking=True)
        return

    port = free_port()
    # Continuously batched: 2 rows at a time (transformers serve has no option for it), 3 drafts of the drafter's own
    # every cycle (the fixed policy, no copies), where its defaults would choose k per cycle and copy.
    options = {"draft_policy": "fixed", "num_speculative_tokens": 3, "domino_lookup": False}
    batch = {"max_requests_per_batch": 2, "drafter_options": options} if continuous_batching else {}
    server = serve(continuous_batching=continuous_batching, cpu_fast_path=False, port=port, non_blocking=True, **batch)
    try:
        wait_for(port)
        (loaded,) = server._model_manager.loaded_models.values()
        drafter = hf_domino.attached_drafter(loaded.model)
        for stream in (False, True):
            drafter.last_generation_stats = None
            assert ask(port, stream) == smollm2_answer, stream
            assert drafter.last_generation_stats.mean_acceptance_length > 1
        if continuous_batching:
            with ThreadPoolExecutor(3) as pool:  # more requests than rows: the third joins as a row finishes
                assert list(pool.map(lambda stream: ask(port, stream), [False, True, False])) == [smollm2_answer] * 3
            assert server._generation_state._cb_manager._cb.call.limit == 2
            drafted = drafter.last_generation_stats.drafted
            # Fewer only where a row's answer ends within 3 tokens (27 of 33 cycles drafted 3 when written).
            assert max(drafted) == 3 and drafted.count(3) > len(drafted) // 2, drafted
    finally:
        server.kill_server()


def end_the_runners_output_thread(runner) -> None:
    """transformers' runner sends its manager's outputs until the manager dies (a server's model process exits
    instead of stopping it): a stopped manager answers at once, and the thread would ask again and again for the rest
    of the test process, taking the interpreter's lock from every later test (one took 250 s instead of 0.3 s)."""
    (sender,) = [thread for thread in threading.enumerate() if thread.name == "continuous-batching-outputs"]
    runner.manager.error = RuntimeError("the test is over")  # what the thread reads as its manager's death
    sender.join(10)
    assert not sender.is_alive()


@needs_serving
def test_the_model_process_of_a_server_serving_one_request_at_a_time_drafts(smollm2_answer):
    """transformers >= 5.25 serves one request at a time through its `GenerateRunner` in the model's process: each
    request, streamed or not, is the target alone's answer and drafted (a loader that left the drafter out of this
    server, the default one, passed every test before: the HTTP tests compare answers only)."""
    import pickle

    if not models_load_in_processes_of_their_own():
        pytest.skip("transformers < 5.25 loads models in the server's process: test_the_server_answers_...")
    from transformers.cli.serving.utils import GenerateRunner, canonical_model_id

    from hf_domino.assets import offline_folder
    from hf_domino.serve import Drafting
    from hf_domino.serve_loader import DraftingModelLoader, configured

    drafting = Drafting(options={"draft_policy": "fixed", "num_speculative_tokens": 3}, cpu_fast_path=False)
    with configured(drafting, {MODEL: str(offline_folder("smollm2"))}):
        loader = DraftingModelLoader(device="cpu", dtype="float32")
    model, processor = pickle.loads(pickle.dumps(loader)).load_model_and_processor(canonical_model_id(MODEL))
    drafter = hf_domino.attached_drafter(model)
    assert drafter is not None
    finished, streamed = {}, []

    def send_results(ids, tokens, ended):
        streamed.extend(tokens)
        finished.update(ended)

    runner = GenerateRunner(model, processor, send_results)
    inputs = processor.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    settings = {"do_sample": False, "max_new_tokens": 24}
    for request_id, stream in ((0, False), (1, True)):
        drafter.last_generation_stats = None
        runner.generate(request_id, dict(inputs), dict(settings), stream=stream)
        deadline = time.time() + 300
        while request_id not in finished and time.time() < deadline:
            time.sleep(0.1)
        assert not isinstance(finished[request_id], Exception), finished[request_id]
        drafted = drafter.last_generation_stats.drafted
        assert max(drafted) == 3 and drafted.count(3) > len(drafted) // 2, (stream, drafted)
    assert processor.decode(finished[0], skip_special_tokens=True) == smollm2_answer
    assert processor.decode(streamed, skip_special_tokens=True) == smollm2_answer


@needs_serving
def test_the_model_process_drafts_with_the_servers_settings(smollm2_answer):
    """transformers >= 5.25: the server pickles its loader and generation state into the model's process, which loads
    the target and runs transformers' continuous-batching runner on it. Both keep the command line's settings through
    the pickle; the runner serves 3 requests 2 at a time, each the target alone's answer, drafting 3 a cycle."""
    import pickle

    if not models_load_in_processes_of_their_own():
        pytest.skip("transformers < 5.25 loads models in the server's process: test_the_server_answers_...")
    from transformers.cli.serving.utils import CBGenerateRunner, canonical_model_id

    from hf_domino.assets import offline_folder
    from hf_domino.serve import Drafting
    from hf_domino.serve_loader import BatchRowsGenerationState, DraftingModelLoader, configured

    options = {"draft_policy": "fixed", "num_speculative_tokens": 3, "domino_lookup": False}
    drafting = Drafting(options=options, cpu_fast_path=False, continuous_batching=True, rows=2)
    with configured(drafting, {MODEL: str(offline_folder("smollm2"))}):
        loader = DraftingModelLoader(device="cpu", dtype="float32")
        state = BatchRowsGenerationState(continuous_batching=True)
    loader, state = pickle.loads(pickle.dumps((loader, state)))  # as the model's process gets them
    assert loader.drafting == drafting and state.cb_config.max_requests_per_batch == 2
    model, processor = loader.load_model_and_processor(canonical_model_id(MODEL))
    drafter = hf_domino.attached_drafter(model)
    assert drafter is not None and not is_prepared_for_cpu_decoding(model)

    results = {}
    runner = CBGenerateRunner(
        model, processor, lambda ids, tokens, finished: results.update(finished), state.cb_config
    )
    try:
        inputs = processor.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True)
        settings = {"do_sample": False, "max_new_tokens": 24, "eos_token_id": model.generation_config.eos_token_id}
        for request_id in range(3):  # more requests than rows: the third joins as a row finishes
            runner.generate(request_id, {"input_ids": list(inputs["input_ids"])}, dict(settings), stream=False)
        deadline = time.time() + 300
        while len(results) < 3 and time.time() < deadline:
            time.sleep(0.2)
    finally:
        runner.manager.stop()
        end_the_runners_output_thread(runner)
    answers = [processor.decode(results[request_id], skip_special_tokens=True) for request_id in range(3)]
    assert answers == [smollm2_answer] * 3
    assert runner.manager.call.limit == 2
    drafted = drafter.last_generation_stats.drafted
    assert max(drafted) == 3 and drafted.count(3) > len(drafted) // 2, drafted


@needs_serving
def test_a_continuously_batched_server_serves_each_requests_sampling_settings():
    """transformers serve (>= 5.25) hands its manager each request's temperature, top-k and top-p (a greedy request:
    top_k=1) where the model's generation config samples, as Qwen3's and most chat models' do. With the drafter
    attached, greedy requests come back as the target alone's greedy answers (they came back sampled at the config's
    temperature until 2026-12-06), and a sampled one reaches its row with its own settings."""
    from transformers.cli.serving import utils

    if not hasattr(getattr(utils, "CBGenerateRunner", None), "_build_continuous_batching_kwargs"):
        pytest.skip("transformers < 5.25 builds its manager with the first request's settings, sent to none")
    CBGenerateRunner = utils.CBGenerateRunner
    from test_continuous_batching import EOS, PROMPTS, alone, followed_by, random_target

    settings = {"max_new_tokens": 12, "eos_token_id": EOS}
    target = random_target("qwen3")
    drafter = forcing_drafter(target, followed_by(target, PROMPTS, **settings), block_size=6)
    greedy = [alone(target, prompt, **settings) for prompt in PROMPTS]
    target.generation_config = GenerationConfig(do_sample=True, temperature=0.7, top_k=20, top_p=0.95, pad_token_id=0,
                                                **settings)  # fmt: skip
    sent = []
    hf_domino.attach_drafter(target, drafter)
    try:
        results = {}
        runner = CBGenerateRunner(target, None, lambda ids, tokens, finished: results.update(finished), None)
        manager = runner.manager
        assert isinstance(manager, DraftedBatchingManager)
        add_request = manager.add_request
        manager.add_request = lambda *args, **kwargs: sent.append(kwargs) or add_request(*args, **kwargs)
        try:
            # What transformers serve builds for a request with temperature 0, then for one with temperature 0.3.
            request = {**settings, "do_sample": False, "temperature": 0.0, "top_k": 20, "top_p": 0.95}
            for request_id, prompt in enumerate(PROMPTS):
                runner.generate(request_id, {"input_ids": prompt}, dict(request), stream=False)
            sampled = {**request, "do_sample": True, "temperature": 0.3}
            runner.generate(len(PROMPTS), {"input_ids": PROMPTS[0]}, sampled, stream=False)
            deadline = time.time() + 120
            while len(results) <= len(PROMPTS) and time.time() < deadline:
                time.sleep(0.05)
        finally:
            manager.stop()
            end_the_runners_output_thread(runner)
    finally:
        hf_domino.detach_drafter(target)
    assert [list(results[request_id]) for request_id in range(len(PROMPTS))] == greedy
    assert [kwargs.get("top_k") for kwargs in sent[: len(PROMPTS)]] == [1] * len(PROMPTS)
    assert {name: sent[-1][name] for name in ("temperature", "top_k", "top_p")} == {
        "temperature": 0.3,
        "top_k": 20,
        "top_p": 0.95,
    }
    assert len(results[len(PROMPTS)]) > 0


def test_serve_reads_drafter_options_as_their_types():
    import argparse

    from hf_domino.serve import drafter_option

    assert drafter_option("num_speculative_tokens=4") == ("num_speculative_tokens", 4)
    assert drafter_option("num_speculative_tokens=none") == ("num_speculative_tokens", None)
    assert drafter_option("domino_lookup=False") == ("domino_lookup", False)
    assert drafter_option("assistant_confidence_threshold=0.4") == ("assistant_confidence_threshold", 0.4)
    assert drafter_option("draft_policy=fixed") == ("draft_policy", "fixed")
    for text, says in [
        ("bogus=1", "NAME one of draft_policy"),
        ("domino_lookup", "NAME=VALUE"),
        ("domino_lookup=maybe", "domino_lookup takes true or false"),
        ("domino_branches=two", "domino_branches takes an integer"),
        ("draft_vocab=none", "draft_vocab takes true or false, got 'none'"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=says):
            drafter_option(text)


def test_serve_reads_transformers_serve_options_as_their_types():
    import argparse

    from hf_domino.serve import serve_option

    assert serve_option("cb_num_blocks=512") == ("cb_num_blocks", 512)
    assert serve_option("cb_use_cuda_graph=none") == ("cb_use_cuda_graph", None)
    assert serve_option("trust_remote_code=true") == ("trust_remote_code", True)
    assert serve_option("attn_implementation=sdpa") == ("attn_implementation", "sdpa")
    assert serve_option("reasoning=off")[1].value == "off"  # transformers' ReasoningMode
    for text, says in [
        ("port=8001", "port is set by hf-domino serve's --port"),
        ("continuous_batching=true", "set by hf-domino serve's --continuous-batching"),
        ("bogus=1", r"bogus is no option of the server of transformers 5\.\d+\.\d+; its options: attn_implementation"),
        ("cb_num_blocks", "expected NAME=VALUE"),
        ("cb_num_blocks=many", "cb_num_blocks takes an integer or none, got 'many'"),
        ("reasoning=maybe", "reasoning takes one of on, off, auto"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=says):
            serve_option(text)


def test_an_offline_target_is_loaded_from_its_folder_under_the_revision_a_request_names():
    from hf_domino.serve import located

    folders = {"HuggingFaceTB/SmolLM2-135M-Instruct": "/cache/smollm2"}
    assert located("HuggingFaceTB/SmolLM2-135M-Instruct", folders) == "/cache/smollm2"
    assert located("HuggingFaceTB/SmolLM2-135M-Instruct@main", folders) == "/cache/smollm2@main"
    for other in ["org/model@main", "/tmp/ckpt@1000", "HuggingFaceTB/SmolLM2-135M-Instruct-other@main"]:
        assert located(other, folders) == other  # transformers reads these as it always does


@needs_serving
def test_a_second_server_while_one_holds_the_process_is_refused_naming_the_fix(capsys):
    """serve() patches transformers serve's modules for its drafter while its server is built (and, on 5.25, runs):
    a second serve() from another thread then would serve with the first one's drafter."""
    from hf_domino.serve import NotServable, serve, serving_alone

    outcome = []

    def second_server() -> None:
        try:
            serve(cpu_fast_path=False, port=free_port())
        except Exception as error:  # whatever it raised is checked below
            outcome.append(error)

    # From another thread, as the guard's case: were the guard gone, this serve() would serve on (it blocks), and the
    # join's timeout turns that into a failure instead of a hung suite, on every release.
    second = threading.Thread(target=second_server, daemon=True)
    with serving_alone():  # what a first serve() holds until it returns
        second.start()
        second.join(timeout=120)
    assert not second.is_alive(), "a second serve() started serving while the first held the process"
    assert len(outcome) == 1 and isinstance(outcome[0], NotServable), outcome
    assert re.search("another serve\\(\\) of this process .* in a process of its own", str(outcome[0]))
    assert "http://" not in capsys.readouterr().out  # no banner for a server that never starts
    with serving_alone():  # and gives back, refused or not
        pass


@needs_serving
def test_a_drafter_that_does_not_fit_the_served_target_is_refused_naming_both(tmp_path):
    from hf_domino.serve import Drafting, NotServable

    target = tiny_target("qwen3", vocab_size=96)  # the shipped drafter's vocabulary is SmolLM2's 49152 tokens
    says = r"tiny/model@main with this drafter: The drafter's vocab_size \(49152\)"
    if models_load_in_processes_of_their_own():  # refused as the server reads the config, before the process starts
        from hf_domino.serve_loader import DraftingModelLoader, configured

        target.save_pretrained(tmp_path)
        with configured(Drafting(), {"tiny/model": str(tmp_path)}):
            loader = DraftingModelLoader(device="cpu")
        with pytest.raises(NotServable, match=says):
            loader.load_config("tiny/model@main")
        return
    from transformers.cli.serving.model_manager import ModelManager

    from hf_domino.serve import drafting_model_manager

    loaded = []

    class Loading(ModelManager):  # transformers' loading, which here hands over the target already built
        def _load_model(self, model_id_and_revision, *args, **kwargs):
            loaded.append(model_id_and_revision)
            return target

    manager = drafting_model_manager(Loading, Drafting(), {"tiny/model": "/folder/of/tiny"})(device="cpu")
    with pytest.raises(NotServable, match=says):
        manager._load_model("tiny/model@main")  # as transformers loads a pinned model
    assert loaded == ["/folder/of/tiny@main"]  # loaded from its folder, under the revision asked for
    assert hf_domino.attached_drafter(target) is None and not is_prepared_for_cpu_decoding(target)  # refused first


# A setting `hf-domino serve` refuses in a line before loading anything: its arguments, and what the refusal says.
REFUSED_SETTINGS = {
    "rows-without-batching": (
        ["--max-requests-per-batch", "2"],
        "add continuous_batching=True (--continuous-batching)",
    ),
    "options-without-drafter": (
        ["--no-drafter", "--drafter-option", "domino_lookup=false"],
        "drop them to serve the target alone",
    ),
    "option-out-of-range": (
        ["--drafter-option", "num_speculative_tokens=99"],
        "from 0 to the drafter's 16 drafts per block",
    ),
    "unknown-option": (["--drafter-option", "bogus=1"], "expected NAME=VALUE with NAME one of"),
    "no-drafter": (["--drafter", "no/such/folder"], "No drafter checkpoint at no/such/folder"),
    "no-target": (["/no/such/target"], "No model folder at /no/such/target"),
    "serve-option-of-its-own": (["--serve-option", "port=8001"], "port is set by hf-domino serve's --port"),
    "rollout-off-cuda": (  # was served, then ended the server at its first request
        ["--device", "cpu", "--drafter-option", "domino_rollout=triton+graph"],
        "domino_rollout='triton+graph' needs CUDA (CUDA graphs), and the drafter is on cpu",
    ),
    # Until 2026-12-07 the rest were tracebacks, the last two after both models had loaded.
    "log-level": (["--log-level", "loud"], "invalid choice: 'loud'"),
    "device-unknown": (["--device", "nonsense"], "device 'nonsense' is no device torch names"),
    "target-a-file": ([__file__], "is a file, not a model folder"),
    "target-without-config": ([str(Path(__file__).parent)], "holds no config.json"),
    "host-unknown": (["--host", "no.such.host.invalid"], "cannot listen on no.such.host.invalid:8000"),
}
if not torch.cuda.is_available():
    REFUSED_SETTINGS["device-cuda-missing"] = (["--device", "0"], "device '0': this torch sees 0 CUDA GPUs")
# Each setting through the command's entry point in one process (one import of torch and transformers for all): exit
# status, stdout and stderr per setting. A setting not refused would start serving and time the process out, so the
# process first names each setting it starts on the real stderr.
REFUSALS_IN_ONE_PROCESS = """
import contextlib, io, json, sys
from hf_domino.cli import main
results = []
for args in json.loads(sys.argv[1]):
    print("starting:", len(results), file=sys.stderr, flush=True)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(["serve", *args])
        except SystemExit as exit:
            status = exit.code
    results.append([status, out.getvalue(), err.getvalue()])
print(json.dumps(results))
"""


def test_hf_domino_serve_takes_what_transformers_serve_takes():
    # Refusing bad settings early must not refuse good ones: levels in any case, a GPU's index, placement strategies.
    from hf_domino.cli import command_parser
    from hf_domino.serve import _check_device, check_address

    parser = command_parser("serve")
    assert [parser.parse_args(["--log-level", level]).log_level for level in ("INFO", "detail")] == ["info", "detail"]
    for device in ("auto", "balanced", "sequential", "cpu"):
        _check_device(device)
    for host in ("localhost", "0.0.0.0", "127.0.0.1"):
        check_address(host, free_port())


def test_hf_domino_serve_refuses_bad_settings_before_loading():
    def assert_refused(name: str, status: int, stdout: str, stderr: str) -> None:
        says = settings[name][1]
        assert status == 2 and says in stderr, (name, stderr)
        assert "Traceback" not in stderr and not stdout, (name, stderr)  # refused in a line, nothing loaded or printed

    def run(command: list[str], names: list[str]) -> subprocess.CompletedProcess:
        try:
            return subprocess.run(command, capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired as timed_out:  # a setting served instead of being refused: which one
            stderr = timed_out.stderr.decode() if isinstance(timed_out.stderr, bytes) else timed_out.stderr or ""
            started = [int(line.split()[-1]) for line in stderr.splitlines() if line.startswith("starting:")]
            pytest.fail(f"not refused within 120 s: {names[started[-1] if started else 0]}")

    # The first as a user runs it; the others through the same entry point, in one process.
    held = socket.create_server(("localhost", 0))  # a port another server holds
    port = held.getsockname()[1]
    settings = {**REFUSED_SETTINGS, "port-in-use": (["--port", str(port)], f"cannot listen on localhost:{port}")}
    first, *others = settings
    done = run([sys.executable, "-m", "hf_domino", "serve", *settings[first][0]], [first])
    assert_refused(first, done.returncode, done.stdout, done.stderr)
    arguments = json.dumps([settings[name][0] for name in others])
    done = run([sys.executable, "-c", REFUSALS_IN_ONE_PROCESS, arguments], others)
    assert done.returncode == 0, done.stderr[-3000:]
    held.close()
    results = json.loads(done.stdout)
    assert len(results) == len(others)
    for name, (status, stdout, stderr) in zip(others, results):
        assert_refused(name, status, stdout, stderr)


def transformers_serve_options() -> list[str]:
    """Options of transformers' own server, as `hf-domino serve` passes them on: from transformers 5.25, two API
    server processes sharing the model's process."""
    if is_serve_available() and models_load_in_processes_of_their_own():
        return ["--serve-option", "api_server_count=2", "--serve-option", "model_timeout=600"]
    return ["--serve-option", "model_timeout=600"]


@needs_serving
@pytest.mark.parametrize(
    "options",
    [
        # Slow: the last case runs the same defaults of ours (with options of transformers' server only).
        pytest.param([], id="defaults", marks=pytest.mark.slow),
        pytest.param(
            ["--continuous-batching", "--max-requests-per-batch", "2", "--drafter-option", "num_speculative_tokens=4"],
            id="continuous-batching-with-options",
        ),
        pytest.param(transformers_serve_options(), id="transformers-serve-options"),
    ],
)
def test_hf_domino_serve_runs_as_a_user_runs_it(options, smollm2_answer, tmp_path):
    port = free_port()
    command = [sys.executable, "-m", "hf_domino", "serve", "--port", str(port), "--no-cpu-fast-path", *options]
    log = open(tmp_path / "serve.log", "w")
    server = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    try:
        wait_for(port, running=lambda: server.poll() is None, log=tmp_path / "serve.log")
        with urllib.request.urlopen(f"http://localhost:{port}/v1/models", timeout=30) as response:
            assert [model["id"] for model in json.loads(response.read())["data"]] == [MODEL]
        assert ask(port, stream=True) == smollm2_answer
        said = (tmp_path / "serve.log").read_text().splitlines()[0]  # what it is, before it loads
        assert said.startswith(f"hf-domino serve: {MODEL} (requests name it so), drafting with the shipped drafter")
        if "--continuous-batching" in options:
            assert "(num_speculative_tokens=4), continuously batched, 2 requests at a time" in said, said
        if "api_server_count=2" in options:  # each API server answers what the one model process drafts
            assert ask(port, stream=False) == smollm2_answer
            assert (tmp_path / "serve.log").read_text().count("Started server process") == 2
    finally:
        server.terminate()
        server.wait(30)
        log.close()


@needs_serving
@pytest.mark.slow  # four server processes, each loading SmolLM2
@pytest.mark.parametrize("batched", [False, True], ids=["one-at-a-time", "continuous-batching"])
def test_the_http_benchmark_runs_as_a_user_runs_it(batched):
    # The script behind docs/benchmarks.md's "Over HTTP", at toy size: both ways answer, and their table comes out.
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "serve_http.py"
    args = ["--num-prompts", "2", "--max-tokens", "8", "--repeats", "1"] + (
        ["--continuous-batching"] if batched else []
    )
    run = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "2 answers identical" in run.stdout and run.stdout.count("x |") == 2, run.stdout


@needs_serving
@pytest.mark.slow  # four server processes, each loading SmolLM2
@pytest.mark.parametrize("batched", [False, True], ids=["one-at-a-time", "continuous-batching"])
def test_the_http_mixes_run_as_a_user_runs_them(batched):
    # examples/serve_mixes.py at toy size: random requests, the drafter's answers against the target alone's.
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "serve_mixes.py"
    args = ["--requests", "4", "--seed", "3"] + (["--continuous-batching", "--concurrency", "2"] if batched else [])
    run = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "4 requests (" in run.stdout and "; 0 differing" in run.stdout, run.stdout

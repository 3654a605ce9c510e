"""The GPU proof's scripts (examples/gpu; docs/fast_path.md, "Proving it on a lent GPU") behave as the device time
needs: a stage never runs past the call's deadline, and a second call on a fresh machine says what happened.

A lent GPU is rare and its time short, so what can be checked without one is checked here; the whole two-call flow
runs here at tiny sizes as docs/fast_path.md shows (a few minutes, hence not in the suite).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "examples" / "gpu"


def run(command: list[str], tmp_path: Path, timeout: int = 120, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "S": str(tmp_path / "stage"), "W": str(ROOT), "OUT": str(tmp_path / "out"), **env}
    return subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=timeout)


def test_the_suite_keeps_each_failure_as_it_happens(tmp_path, monkeypatch):
    # The fourth run's suite was killed at its deadline before pytest printed any failure: the suite stage now sets
    # HF_DOMINO_FAILURES_LOG, and conftest's hook writes each failed report there at once (the main process only).
    from conftest import pytest_runtest_logreport

    log = tmp_path / "failures.log"
    monkeypatch.setenv("HF_DOMINO_FAILURES_LOG", str(log))
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)

    def report(outcome: str) -> pytest.TestReport:
        return pytest.TestReport("tests/x.py::test_x", ("x.py", 1, "test_x"), {}, outcome, f"{outcome} here", "call")

    pytest_runtest_logreport(report("passed"))
    assert not log.exists()
    pytest_runtest_logreport(report("failed"))
    assert log.read_text() == "tests/x.py::test_x (call)\nfailed here\n\n"
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")  # a worker's report reaches the main process too: once
    pytest_runtest_logreport(report("failed"))
    assert log.read_text().count("failed here") == 1
    assert "HF_DOMINO_FAILURES_LOG=$R/suite-failures.log" in (GPU / "stages.sh").read_text()


@pytest.mark.parametrize("script", sorted(GPU.glob("*.sh")), ids=lambda path: path.name)
def test_scripts_parse(script):
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0


def test_a_stage_past_the_deadline_is_skipped_not_run(tmp_path):
    result = run(["bash", str(GPU / "stages.sh"), "costs", "nonsense"], tmp_path, DEADLINE=str(int(time.time()) + 5))
    log = (tmp_path / "stage" / "results" / "stages.log").read_text()
    assert "costs: skipped" in log and "unknown stage nonsense" in log, result.stdout + result.stderr
    assert not (tmp_path / "stage" / "results" / "costs.log").exists()


def test_a_stage_is_stopped_at_the_deadline(tmp_path):
    # 15 s left, some of them spent importing torch before the first stage (slowly on a busy machine): the stage starts
    # (told to with 5 s left; on the device it takes 20), and would take minutes at this length on a CPU or a GPU (one
    # long prompt is not enough there: the target reaches its EOS within the deadline).
    start = time.time()
    run(["bash", str(GPU / "stages.sh"), "bf16"], tmp_path, DEADLINE=str(int(start) + 15), MIN_STAGE_SECONDS="5",
        METHODS="target", PROMPTS="80", TOKENS="512")  # fmt: skip
    log = (tmp_path / "stage" / "results" / "stages.log").read_text()
    # Stopped by its SIGINT (124), or killed 20 s later where it did not exit in time (137: the fifth GPU run, a bench
    # still setting up CUDA).
    assert ("bf16: exit 124" in log or "bf16: exit 137" in log) and time.time() - start < 55, log


def test_the_second_call_on_a_fresh_machine_says_so(tmp_path):
    # Call 1 empties W: the repository itself is refused.
    assert run(["bash", str(GPU / "call.sh"), "1"], tmp_path).returncode == 2 and (ROOT / "src").is_dir()
    result = run(["bash", str(GPU / "call.sh"), "2"], tmp_path, W=str(tmp_path / "work"))
    assert result.returncode == 3 and "went back between the calls" in result.stderr


def test_the_costs_stage_runs_here_at_toy_shapes(tmp_path):
    # The paper-scale costs stage, as stages.sh runs it but at toy shapes on this CPU: every row of its table, the
    # split of the loop's verification, and the profile (a broken script would cost a GPU call).
    result = run(["bash", str(GPU / "stages.sh"), "costs"], tmp_path, COST_SHAPE="tiny", SMALL_COST_SHAPE="tiny")
    log = (tmp_path / "stage" / "results" / "costs.log").read_text()
    assert "costs: exit 0" in (tmp_path / "stage" / "results" / "stages.log").read_text(), result.stderr + log
    for row in (
        "target, 17 tokens, cache grown in place",
        "target, 17 tokens, query heads packed (no repeat_kv)",
        "target, 17 tokens, inside generate()",
        "**cycle** (fastest head)",
    ):
        assert f"| {row} | " in log, log
    assert "The loop's 17-token forward was called with: input_ids: (1, 17)" in log
    assert "Implied (not measured) speedup" in log and "Ordered by: internal time" in log
    assert log.count("**cycle** (fastest head)") == 2, "the second shape's table"
    assert "packed query heads: logits within" in log and "argmax equal: True" in log


@pytest.mark.slow  # the real SmolLM2 target, twice
def test_the_batch_and_serve_stages_run_here_at_toy_sizes(tmp_path):
    # Issue 20's stages as the next proof runs them first, on this CPU at toy sizes: a broken flag costs a GPU call.
    result = run(["bash", str(GPU / "stages.sh"), "batch", "serve"], tmp_path, timeout=600, BATCH_PROMPTS="2",
                 BATCH_TOKENS="8", BATCH_SIZES="1,2", SERVE_ARGS="--num-prompts 2 --rows 2 --max-new-tokens 8")  # fmt: skip
    results = tmp_path / "stage" / "results"
    stages, batch, serve = ((results / name).read_text() for name in ("stages.log", "batch.log", "serve.log"))
    assert "batch: exit 0" in stages and "serve: exit 0" in stages, result.stderr + batch + serve
    for method in ("target", "domino_lookup", "domino_lookup_tree4"):
        assert f"| 2 | {method} | " in batch, batch
    assert "drafter, generate_batch (joining)" in serve and "0 of 2 answers differing" in serve, serve


@pytest.mark.slow  # 46 s on 2 cores; the stage is off the proof's list since the fourth run answered it
def test_the_stalls_stage_runs_here_at_toy_shapes(tmp_path):
    # The stage that asks why whole calls ran slow on the second GPU run: both thread counts, every kind of work,
    # and the columns that tell the host from the device (n/a here, where there is no device or clock to read).
    result = run(["bash", str(GPU / "stages.sh"), "stalls"], tmp_path, STALL_SHAPE="tiny")
    log = (tmp_path / "stage" / "results" / "stalls.log").read_text()
    assert "stalls: exit 0" in (tmp_path / "stage" / "results" / "stages.log").read_text(), result.stderr + log
    assert "torch threads: 8" in log and "torch threads: 1" in log, log
    for work in ("bare forwards", "generate(), target alone", "generate(), with the drafter"):
        assert log.count(f"| {work} | ") == 10, log  # 5 repeats x 2 thread counts
    assert "| device ms / forward | involuntary switches | throttled ms | cudaMalloc / retries | SM clock MHz |" in log


@pytest.mark.slow  # 90 s on 2 cores; the stage is off the proof's list since the fourth run answered it
def test_the_laps_stage_runs_here_with_the_real_models(tmp_path):
    # The stage that asks whether a bf16 drafting cycle's extra 40 ms (third GPU run) are cuDNN's attention plans, with
    # the bench's real target, drafter and prompts: every call a row (warm-ups included), then profiles of the two
    # whole-block variants. Off CUDA it runs the eager head in fp32, small, and has no telemetry to print.
    result = run(["bash", str(GPU / "stages.sh"), "laps"], tmp_path,
                 LAPS_DTYPES="float32", LAPS_ARGS="--new-tokens 4 --warmup-tokens 2 --rounds 1 --rows 5")  # fmt: skip
    log = (tmp_path / "stage" / "results" / "laps.log").read_text()
    assert "laps: exit 0" in (tmp_path / "stage" / "results" / "stages.log").read_text(), result.stderr + log
    rows = [line for line in log.splitlines() if line.startswith("| ") and "(warm-up)" not in line]
    assert len(rows) == 2 + 6, log  # the header, its rule, and the six variants once
    assert sum(" (no timings) |" in line for line in rows) == 1, log
    assert sum(" (cuDNN allowed) |" in line for line in rows) == 1, log
    assert {line.split(" | ")[1] for line in rows[2:]} == {"1"}, log  # one round: the first new prompt
    assert sum("(warm-up) |" in line for line in log.splitlines()) == 6, log  # one per variant, on prompt 0
    assert log.count("profiled on prompts no call has met") == 2, log
    assert log.count("Ordered by: internal time") == 2 and log.count("Self CPU time total") == 2, log


def laps_table(run: str) -> list[list[str]]:
    """`examples/gpu/laps_from_records.py` on a GPU run's committed bf16 MT-Bench record: its rows, cell by cell."""
    record = ROOT / "docs" / "gpu-runs" / run / "bfloat16-mtbench.json"
    out = subprocess.run(
        [sys.executable, str(GPU / "laps_from_records.py"), str(record)], capture_output=True, text=True, check=True
    ).stdout
    return [
        [cell.strip() for cell in line.strip("|").split("|")] for line in out.splitlines() if line.startswith("| ")
    ]


DFLASH_DOMINO = ("dflash_vocab_k16", "domino_vocab_k16@triton+graph")


def test_the_laps_behind_the_slow_state_section_come_from_the_committed_records():
    # docs/benchmarks.md, "The bf16 slow state", quotes these rows of the third and second GPU runs' records.
    third = laps_table("2026-11-27-h200")
    first_call = ["domino_vocab_k16@triton+graph", "0", "", "75/87", "12", "2.9-5.1", "41.8-486.5", "80.1-153.5"]
    assert first_call in third
    assert [row[2] for row in third if row[0] == "target"] == ["56.2", "29.5", "28.7", "25.8"]
    rows = laps_table("2026-11-26-h200")
    second = {method: [row[3] for row in rows if row[0] == method] for method in DFLASH_DOMINO}
    assert second == {
        "dflash_vocab_k16": ["80/93", "85/85", "96/96", "6/88", "81/81", "98/98"],
        "domino_vocab_k16@triton+graph": ["0/87", "3/80", "2/95", "82/82", "1/74", "0/97"],
    }


@pytest.mark.parametrize("batch_size", [1, 2])
def test_cycle_ops_counts_what_a_drafting_cycle_dispatches_beyond_a_plain_step(batch_size):
    # examples/cycle_ops.py, as docs/fast_path.md runs it but at toy widths: the GPU's host cost, counted on a CPU.
    command = [sys.executable, "examples/cycle_ops.py", "--tiny", "--new-tokens", "6", "--top", "5"]
    command += ["--batch-size", str(batch_size)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    step, cycle = map(int, re.search(r"ops per plain step (\d+), per drafting cycle (\d+)", result.stdout).groups())
    assert 1000 < step < cycle, result.stdout  # 30 layers of a dozen or more ops each, and a cycle drafts too
    assert "(repeat_kv)" in result.stdout, "a verification's masked attention copies its key/value heads"
    kinds = re.search(r"a plain step: (\d+) kernels, (\d+) views, (\d+) allocations, (\d+) syncs", result.stdout)
    assert sum(map(int, kinds.groups())) == step, result.stdout  # every op has one kind
    ours = re.search(r"ops per plain step of our batched loop (\d+)", result.stdout)
    assert (ours is not None) == (batch_size > 1), result.stdout
    if ours:  # the same forwards, plus our loop's bookkeeping (the cache's masks, per-row stops)
        assert int(ours.group(1)) > step, result.stdout
        # A GPU waits at each read back: our plain step reads its tokens and its stopping criteria once for all rows.
        syncs = re.search(r"of our batched loop \d+ .*?, (\d+) syncs", result.stdout)
        assert int(syncs.group(1)) <= 2, result.stdout

"""The draft policy (how many drafts each target forward verifies), the draft vocabulary, and per-call options.

The adaptive policy decides from timings. To make its decisions reproducible here, `cpu_like_costs` replaces the
first-use measurement with a fixed table shaped like the 2-core CPU's (two tokens cost 1.6 single-token steps) and
turns online timing off, so the policy judges every cycle by that table.
"""

from __future__ import annotations

import pytest
import torch
from conftest import CPU_LIKE, GPU_LIKE, forcing_drafter, own_drafts, successor_target, tiny_drafter, tiny_target
from test_generation import (
    chi_square_p_value,
    drawn_sharper,
    exact_sequence_distribution,
    law_drafter,
    law_target,
    sample_with_drafter,
)
from transformers import GenerationConfig, LogitsProcessorList
from transformers.cache_utils import DynamicCache

import hf_domino
from hf_domino import batch_policy_domino, cost_model_domino, policy_domino, records_domino
from hf_domino.cache_domino import cache_argument
from hf_domino.cost_model_domino import VerifyCost, expected_tokens, row_paces
from hf_domino.policy_domino import AdaptivePolicy, LookupPolicy
from hf_domino.records_domino import AcceptanceCalibration, DrafterRecord

VOCAB = 32


def greedy(target, prompt, **kwargs):
    return target.generate(prompt, do_sample=False, pad_token_id=0, **kwargs)


# -------------------------------------------------------------------------------------------------- the pieces
def test_expected_tokens_and_cost_interpolation():
    assert expected_tokens(torch.tensor([1.0, 1.0, 0.0])).tolist() == [1, 2, 3, 3]
    assert expected_tokens(torch.tensor([0.5, 0.5])).tolist() == [1, 1.5, 1.75]
    cost = VerifyCost({1: 1.0, 3: 2.0, 17: 4.0})
    assert cost(2) == pytest.approx(1.5) and cost(10) == pytest.approx(3.0) and cost(30) == 4.0
    cost.observe(2, 2.5)  # moves the estimate towards the observation, by TIME_RATE
    assert cost(2) == pytest.approx(1.5 + cost_model_domino.TIME_RATE * 1.0)
    for table in ({1: 0.0, 2: 0.01}, {}, {1: float("nan")}):  # a zero was a ZeroDivisionError inside generate()
        with pytest.raises(ValueError, match="positive seconds of a target forward"):
            VerifyCost(table)


def test_a_stall_does_not_make_a_length_look_dear_for_good():
    """A 40x stall counts as twice the estimate: a 5-token verification stays priced near its real cost (and is
    chosen again); a lasting change is still learned within a few dozen cycles."""
    cost = VerifyCost({1: 0.020, 5: 0.025, 17: 0.040})
    cost.observe(5, 1.0)
    assert cost(5) == pytest.approx(0.025 * (1 + cost_model_domino.TIME_RATE))
    for _ in range(30):
        cost.observe(5, 0.050)
    assert cost(5) == pytest.approx(0.050, rel=0.01)
    for _ in range(60):
        cost.observe(1, 0.001)  # faster too, as far as the observations go
    assert cost(1) == pytest.approx(0.001, rel=0.05)


def test_calibration_learns_what_the_target_accepts():
    calibration = AcceptanceCalibration()
    confident = torch.tensor([0.97])
    assert calibration(confident).item() == pytest.approx(0.95)  # the prior trusts the drafter
    for _ in range(40):  # an over-confident drafter: its sure drafts are accepted one time in four
        calibration.observe(torch.tensor([0.97, 0.98, 0.99, 0.96]), torch.tensor([True, False, False, False]))
    assert calibration(confident).item() == pytest.approx(0.25, abs=0.03)
    assert calibration(torch.tensor([0.15])).item() == pytest.approx(0.15)  # other bins untouched


def adaptive(table, acceptance: float, cap: int = 16) -> AdaptivePolicy:
    record = DrafterRecord(position_acceptance=[acceptance] * 16)
    return AdaptivePolicy(record, VerifyCost(dict(table)), cap=cap, learn_times=False)


def test_the_rollout_stops_where_no_later_draft_can_pay():
    policy = AdaptivePolicy(DrafterRecord([0.8] * 16), VerifyCost(dict(CPU_LIKE)), cap=8, learn_times=True)
    policy.record.backbone_seconds, policy.record.position_seconds = 0.008, 0.004
    assert policy.keep_rolling(torch.tensor([0.95, 0.9]))  # the next drafts may well be accepted
    assert not policy.keep_rolling(torch.tensor([0.95, 0.02]))  # a block that has failed: more cannot pay
    assert not policy.keep_rolling(torch.tensor([0.9] * 8))  # the cap
    # A batch rolls on while some row's drafts still hold; on CUDA it never asks (a decision would synchronize).
    assert policy.keep_rolling(torch.tensor([[0.95, 0.9], [0.05, 0.05]]))
    assert not policy.keep_rolling(torch.tensor([[0.95, 0.02], [0.05, 0.05]]))
    assert AdaptivePolicy(policy.record, policy.verify_cost, cap=8, learn_times=False).keep_rolling(
        torch.tensor([0.01])
    )
    # On CUDA the policy learns times but never decides per position.
    on_cuda = AdaptivePolicy(policy.record, policy.verify_cost, cap=8, learn_times=True, per_position=False)
    assert on_cuda.learn_times and on_cuda.keep_rolling(torch.tensor([0.95, 0.02]))


def test_one_slow_drafting_cycle_moves_the_drafter_times_a_bounded_step():
    # A CUDA graph captured for a longer block, or a stall, in one cycle: counted as at most twice the estimate.
    policy = AdaptivePolicy(DrafterRecord([0.8] * 16), VerifyCost(dict(GPU_LIKE)), cap=8)
    policy.record.backbone_seconds, policy.record.position_seconds = 0.004, 0.0001
    policy.drafted_before = True
    common = dict(drafted=True, verified=4, accepted=2, verify_seconds=0.0105, positions=4)
    policy.observe(backbone_seconds=0.004, rollout_seconds=4 * 0.05, **common)  # 500x the position estimate
    assert policy.record.position_seconds == pytest.approx(0.0001 * (1 + 0.2))
    policy.observe(backbone_seconds=0.0005, rollout_seconds=4 * 0.0001, **common)
    assert policy.record.backbone_seconds == pytest.approx(0.004 - 0.2 * 0.002)


def test_a_rollout_stopped_early_is_the_start_of_the_whole_block():
    from hf_domino.drafting_domino import BlockDraft, eager_rollout, greedy_pick, processed_pick
    from hf_domino.modeling_domino import TargetModules
    from hf_domino.ragged_batch_domino import batched_rollout

    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    modules = TargetModules.from_target(target)
    torch.manual_seed(3)
    hidden = torch.randn(2, drafter.config.num_drafts, drafter.config.hidden_size)
    anchors = torch.tensor([[7], [9]])
    asked = []

    def three(confidence):
        asked.append(confidence.shape)
        return confidence.shape[-1] < 3

    sampling = processed_pick(None, True, None, drafter.config.vocab_size)
    with torch.no_grad():
        base = modules.logits(hidden).float()
        for pick in (greedy_pick, sampling):
            block = BlockDraft(hidden[:1], base[:1])
            torch.manual_seed(0)
            whole = eager_rollout(drafter, modules, pick)(block, anchors[:1])
            torch.manual_seed(0)
            short = eager_rollout(drafter, modules, pick, keep_rolling=three)(block, anchors[:1])
            assert len(short) == 3 and torch.equal(short.ids, whole.ids[:, :3])
            assert torch.equal(short.logits, whole.logits[:, :3])
            assert torch.allclose(short.confidence, whole.confidence[:3])
        assert asked[:3] == [torch.Size([1]), torch.Size([2]), torch.Size([3])]
        rows = dict(head=True, pick_logits=lambda logits, drafted: logits, do_sample=False)
        whole = batched_rollout(drafter, modules, hidden, base, None, anchors, **rows)
        short = batched_rollout(drafter, modules, hidden, base, None, anchors, **rows, keep_rolling=three)
    assert short.ids.shape == (2, 3) and torch.equal(short.ids, whole.ids[:, :3])
    assert torch.allclose(short.confidence, whole.confidence[:, :3])
    assert asked[-1] == torch.Size([2, 3])


def test_adaptive_policy_drafts_long_blocks_where_verification_is_flat():
    policy = adaptive(GPU_LIKE, acceptance=0.9)
    assert policy.budget(room=100) == 16
    assert policy.choose(torch.full((16,), 0.99), draft_seconds=0.002) == 16
    assert policy.budget(room=5) == 5  # never past the length limit
    assert adaptive(GPU_LIKE, acceptance=0.9, cap=4).budget(room=100) == 4


def test_adaptive_policy_cuts_the_block_where_confidence_drops():
    policy = adaptive({1: 0.040, 2: 0.050, 17: 0.120}, acceptance=0.8)  # each verified token costs 4.7 ms
    assert 0 < policy.budget(room=100) < 16  # 17 tokens cost too much for 80% drafts
    confidence = torch.tensor([0.99, 0.98, 0.97, 0.05, 0.99, 0.99])
    assert policy.choose(confidence, draft_seconds=0.008) == 3
    policy.confidence_threshold = 0.985  # transformers' meaning: drafting ends after the first draft below it
    assert policy.choose(confidence, draft_seconds=0.008) == 2


def simulated_sampling(record: DrafterRecord, cycles: int = 400, acceptance: float = 0.35) -> tuple[float, float]:
    """The adaptive policy deciding `cycles` forwards for a drafter whose drafts are each accepted with probability
    `acceptance` (speculative sampling's coin, independent from cycle to cycle), on a cost table as flat as the
    prepared SmolLM2's on a 2-core CPU. Returns (the share of forwards that were plain steps, tokens per second over
    a plain step's rate)."""
    table = {1: 0.045, 3: 0.047, 5: 0.049, 9: 0.050, 17: 0.056}
    policy = AdaptivePolicy(record, VerifyCost(table), cap=8, learn_times=False)
    record.backbone_seconds, record.position_seconds = 0.005, 0.0017
    coins = torch.Generator().manual_seed(0)
    plain = tokens = seconds = 0.0
    for _ in range(cycles):
        budget = policy.budget(room=100)
        k = policy.choose(torch.full((budget,), 0.5), policy._draft_seconds(budget)) if budget else 0
        held = torch.rand(max(k, 1), generator=coins) < acceptance
        accepted = int(held.long().cumprod(0).sum()) if k else 0
        policy.observe(drafted=budget > 0, verified=k, accepted=accepted, verify_seconds=0.0, positions=budget)
        plain += not budget
        tokens += 1 + accepted
        seconds += (policy._draft_seconds(budget) if budget else 0.0) + policy.verify_cost(1 + k)
    return plain / cycles, tokens / seconds * table[1]


def test_sampled_acceptance_is_learned_slowly_so_a_paying_drafter_keeps_drafting():
    """A drawn draft is accepted by a coin toss, so one cycle says little about the next: the drafter's sampled records
    move their acceptance per position at SAMPLED_POSITION_RATE (greedy ones, and copies', at POSITION_RATE). At the
    greedy rate the coin's runs of failures pause a drafter whose drafts pay on average (at 0.35, about 1.14x here)."""
    drafter, target = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    mode = records_domino.DraftingMode
    greedy, sampled = (
        records_domino.drafter_record(drafter, target, mode(sampled=s, head=True), 8) for s in (False, True)
    )
    assert sampled.sampled and not greedy.sampled
    assert records_domino.drafter_record(
        drafter, target, mode(sampled=True, vocab=True, branches=2, rows=4), 8
    ).sampled
    assert not any(
        records_domino.drafter_record(drafter, target, mode(source, True), 8).sampled
        for source in ("lookup", "datastore")
    )
    policy_domino.learn_acceptance(sampled, offered=2, accepted=0)
    policy_domino.learn_acceptance(greedy, offered=2, accepted=0)
    start = records_domino.INITIAL_ACCEPTANCE
    assert sampled.position_acceptance[:2] == [pytest.approx(start * (1 - policy_domino.SAMPLED_POSITION_RATE)), start]
    assert greedy.position_acceptance[0] == pytest.approx(start * (1 - policy_domino.POSITION_RATE))

    paused, speed = simulated_sampling(DrafterRecord([0.8] * 8, sampled=True))
    paused_greedy_rate, _ = simulated_sampling(DrafterRecord([0.8] * 8, sampled=False))
    assert paused < 0.05 and speed > 1.1
    assert paused_greedy_rate > 0.1


def test_adaptive_policy_backs_off_and_probes_when_drafting_does_not_pay():
    policy = adaptive(CPU_LIKE, acceptance=0.5)
    decisions = []
    for _ in range(40):
        k = policy.budget(room=100)
        decisions.append(k)
        if k:
            policy.choose(torch.full((k,), 0.9), draft_seconds=0.008)
        # Every draft is rejected.
        policy.observe(drafted=k > 0, verified=k and 1, accepted=0, verify_seconds=0.05, positions=k)
    probes = [i for i, k in enumerate(decisions) if k]
    gaps = [b - a - 1 for a, b in zip(probes, probes[1:])]
    assert gaps[-3:] == sorted(gaps[-3:]) and gaps[-1] >= 8  # the pause doubles after every failed probe
    assert policy.record.position_acceptance[0] < 0.5 * (1 - policy_domino.POSITION_RATE) ** 3  # learned

    # The drafter becomes right again: the next probe pays, and drafting resumes at once.
    while policy.budget(room=100) == 0:
        pass
    policy.choose(torch.full((16,), 0.99), draft_seconds=0.008)
    policy.observe(drafted=True, verified=4, accepted=4, verify_seconds=0.06, positions=4)
    assert policy.record.skip_left == 0 and policy.budget(room=100) > 0


# Costs of a CPU with the fast path (hf_domino.prepare_for_cpu_decoding): verifying 2-4 drafts costs about a step.
PREPACKED = {1: 0.040, 2: 0.045, 3: 0.041, 5: 0.042, 9: 0.047, 17: 0.060}


def test_the_first_drafting_cycle_of_a_call_does_not_set_the_drafters_cost():
    # The first cycle reads the whole prompt into the drafter's context and pays one-time set-up: a drafter priced by
    # it would look ten times dearer than it is and never draft again.
    policy = AdaptivePolicy(DrafterRecord([0.8] * 16), VerifyCost(dict(PREPACKED)), cap=16, learn_times=True)

    def cycle(accepted: int, backbone_seconds: float, rollout_seconds: float) -> None:
        policy.budget(room=100)
        policy.observe(
            drafted=True, verified=2, accepted=accepted, verify_seconds=0.045, positions=2,
            backbone_seconds=backbone_seconds, rollout_seconds=rollout_seconds,
        )  # fmt: skip

    cycle(accepted=2, backbone_seconds=0.9, rollout_seconds=0.3)
    assert policy.record.backbone_seconds is None and policy.record.position_seconds is None
    assert policy.record.skip_left == 0 and policy.budget(room=100) > 0  # judged by the cost model: it pays
    cycle(accepted=1, backbone_seconds=0.005, rollout_seconds=0.002)
    assert policy.record.backbone_seconds == pytest.approx(0.005)
    assert policy.record.position_seconds == pytest.approx(0.001)


def test_one_failed_cycle_pauses_only_a_drafter_whose_acceptance_says_drafting_does_not_pay():
    def after_a_failed_cycle(acceptance: float) -> int:
        policy = adaptive(PREPACKED, acceptance=acceptance)
        policy.record.drafting_rate = 1 / 0.040  # drafting has been paying as much as plain steps
        k = policy.budget(room=100)
        policy.choose(torch.full((k,), 0.9), draft_seconds=0.006)
        policy.observe(drafted=True, verified=2, accepted=0, verify_seconds=0.045, positions=k)
        return policy.record.skip_left

    # 60% of first drafts right: a failed cycle is bad luck, and drafting still pays on average at these costs.
    assert after_a_failed_cycle(0.6) == 0
    # 15%: the same cycle confirms that it does not.
    assert after_a_failed_cycle(0.15) > 0


# Per draft position, the chance a draft is accepted once the ones before it were (examples/batch_makespan.py's).
ACCEPTANCE = [0.45, 0.6, 0.65, 0.7, 0.7, 0.7, 0.7, 0.7]


def batch_makespan_example():
    """`examples/batch_makespan.py`: its simulated batches (the figures docs/benchmarks.md quotes)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "batch_makespan.py"
    spec = importlib.util.spec_from_file_location("batch_makespan", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


@pytest.mark.parametrize("rooms", [[64] * 4, [64] * 8, [16] * 4, [64, 60, 58, 64]])
def test_a_batch_is_priced_by_when_its_last_row_finishes(rooms):
    """Rows that accept different numbers of drafts drift apart, and the batch waits for the one behind. Priced by
    `rooms`, a cycle verifying k drafts per row is worth the cycles it saves the batch, against a plain step, when
    later cycles verify k too: as simulated batches show, within 3%. That is below the rows' mean (more so for more
    rows and fewer tokens left), and far above one cycle's view of the shortest row (what every level row accepts)."""
    acceptance = [0.45, 0.6, 0.65, 0.7, 0.7, 0.7, 0.7, 0.7]
    batch = torch.tensor([acceptance] * len(rooms))
    priced, mean = expected_tokens(batch, rooms), expected_tokens(batch)
    assert priced[0].item() == pytest.approx(1.0)  # a plain step advances every row by one
    example = batch_makespan_example()
    for k in (1, 4):
        assert priced[k].item() == pytest.approx(example.first_cycle_worth(rooms, k, trials=4000), rel=0.03), k
        assert priced[k].item() < mean[k].item()
        every_row = 1 + sum(torch.tensor(acceptance[: j + 1]).prod().item() ** len(rooms) for j in range(k))
        assert priced[k].item() > every_row + 0.3
    rows = batch[:1]
    assert expected_tokens(rows.expand(8, -1), [64] * 8)[4] < expected_tokens(rows.expand(4, -1), [64] * 4)[4]
    assert expected_tokens(rows.expand(4, -1), [16] * 4)[4] < expected_tokens(rows.expand(4, -1), [64] * 4)[4]


@pytest.mark.parametrize(
    "acceptance",
    [
        [[0.2] * 8, [0.45, 0.6, 0.65, 0.7, 0.7, 0.7, 0.7, 0.7], [0.7] * 8, [0.8] * 8],
        [[0.3] * 8] + [[0.7] + [0.8] * 7] * 3,
        [[0.5] * 8] * 2 + [[0.9] * 8] * 2,
    ],
    ids=["spread", "one-lags", "two-and-two"],
)
def test_a_row_that_lags_is_priced_by_its_own_pace(acceptance):
    """Rows whose drafts hold differently all along: the one whose drafts fail most sets when the batch finishes.
    Given each row's pace (its accepted drafts per cycle over the pooled rows'), a first cycle is priced as simulated
    batches of such rows show it is worth, within 3%; priced as if every row held like the pooled ones, drafting is
    overpriced by 20% or more."""
    rooms, batch, example = [64] * len(acceptance), torch.tensor(acceptance), batch_makespan_example()
    for k in (1, 2, 4):
        paces, worth = example.kept_paces(acceptance, k), example.first_cycle_worth(rooms, k, acceptance, trials=4000)
        assert expected_tokens(batch, rooms, paces)[k].item() == pytest.approx(worth, rel=0.03), k
        assert expected_tokens(batch, rooms)[k].item() > 1.1 * worth, k
    assert torch.equal(expected_tokens(batch, rooms, [1.0] * len(rooms)), expected_tokens(batch, rooms))


@pytest.mark.parametrize("fixed_share", [0.2, 0.6])
@pytest.mark.parametrize(
    "acceptance", [[ACCEPTANCE] * 4, [[0.3] * 8] + [[0.7] + [0.8] * 7] * 3], ids=["level", "lags"]
)
def test_a_cycle_saves_time_as_the_batch_and_its_rows_pay_for_later_cycles(acceptance, fixed_share):
    """Where a cycle costs a share whatever its rows and the rest per row still generating (a CPU's forward grows with
    the rows), a cycle is worth the time it saves: the batch's cycles to its last row, for the fixed share, and each
    row's own cycles, for the rest. Priced so, a first cycle is worth what simulated batches of such costs show, within
    3%; the rows' mean misses a row that lags, the last row's cycles alone miss the rows' costs."""
    rooms, batch, example = [64] * len(acceptance), torch.tensor(acceptance), batch_makespan_example()
    for k in (1, 4):
        paces = example.kept_paces(acceptance, k)
        worth = example.first_cycle_worth(rooms, k, acceptance, fixed_share, trials=4000)
        priced = expected_tokens(batch, rooms, paces, lambda num_tokens: fixed_share)[k].item()
        assert priced == pytest.approx(worth, rel=0.03), k
        if acceptance[0] != acceptance[1]:
            assert abs(expected_tokens(batch)[k].item() - worth) > 0.05 * worth, k
            assert abs(expected_tokens(batch, rooms, paces)[k].item() - worth) > 0.05 * worth, k
    # No share paid per cycle: a row's cycles alone count, and level rows are priced by the rows' mean.
    level = torch.tensor([ACCEPTANCE] * 4)
    assert torch.allclose(expected_tokens(level, rooms, None, lambda n: 0.0), expected_tokens(level), rtol=1e-6)


def test_a_batch_reads_the_share_of_its_forward_that_does_not_grow_with_its_rows():
    from hf_domino.batch_policy_domino import BatchVerifyCost

    table = VerifyCost({1: 0.030, 2: 0.033, 4: 0.039, 8: 0.051})  # 27 ms whatever the rows, then 3 ms per token
    assert BatchVerifyCost(table, rows=4).fixed_share(1) == pytest.approx(27 / 39)
    assert BatchVerifyCost(table, rows=4).fixed_share(2) == pytest.approx(27 / 51)
    assert BatchVerifyCost(table, rows=1).fixed_share(2) == table.fixed_share(2) == 1.0
    flat = VerifyCost({1: 0.01, 8: 0.01})  # a GPU's small forwards: every row free
    assert BatchVerifyCost(flat, rows=8).fixed_share(1) == 1.0


def test_a_row_pace_is_its_accepted_drafts_per_cycle_over_the_rows_pulled_towards_theirs():
    # Pooled: 12 accepted drafts over 12 row-cycles, 1 per cycle; 4 prior cycles at that rate.
    assert row_paces([9, 3, 0], [4, 4, 4]) == pytest.approx([13 / 8, 7 / 8, 4 / 8])
    assert row_paces([0, 5], [0, 5]) == pytest.approx([1.0, 1.0])  # a row not yet verified keeps the pooled pace
    assert row_paces([0, 0], [3, 3]) == [1.0, 1.0]  # nothing accepted yet: no row is known to lag
    assert row_paces([40, 0], [20, 20])[1] < 0.2  # the longer a row lags, the surer


def test_one_row_is_priced_as_one_sequence():
    acceptance = torch.tensor([[0.9, 0.7, 0.5, 0.3]])
    for room in (1, 5, 64, 1000):
        assert torch.allclose(expected_tokens(acceptance, [room]), expected_tokens(acceptance[0]), rtol=1e-4), room


def test_drafts_that_only_put_rows_further_ahead_are_not_verified():
    from hf_domino.batch_policy_domino import BatchVerifyCost

    class SameCostForAnyRows(BatchVerifyCost):
        """A device whose forward costs the same for 1 row or 2 (a GPU): the batch pays every cycle until its last
        row finishes, and a row that finishes early saves nothing."""

        def fixed_share(self, num_tokens: int) -> float:
            return 1.0

    table = VerifyCost({2: 1.0, 4: 1.3, 6: 1.5, 10: 2.0})  # 2 rows: 1 token each 1.0, 2 tokens 1.3, ...
    policy = AdaptivePolicy(DrafterRecord([0.9] * 4), SameCostForAnyRows(table, rows=2), cap=4, learn_times=False)
    policy.record.calibration = AcceptanceCalibration(prior_weight=1e9)  # calibrated acceptance = the confidence
    confidence = torch.tensor([[0.95, 0.95, 0.95, 0.95], [0.05, 0.05, 0.05, 0.05]])
    # Averaged over the rows, the first row's drafts pay; but it is 30 tokens ahead of the second, whose drafts fail.
    assert policy.choose(confidence, 0.0, limits=[4, 4]) > 0
    policy.rooms = [30, 60]
    assert policy.choose(confidence, 0.0, limits=[4, 4]) == 0
    policy.rooms = [60, 30]  # the confident row is the one behind
    assert policy.choose(confidence, 0.0, limits=[4, 4]) > 0
    # Copies likewise: found only in a row far ahead of the other, they advance nothing; in the row behind, they do.
    copies = LookupPolicy(DrafterRecord([0.9] * 4), SameCostForAnyRows(table, rows=2), learn_times=False)
    assert copies.choose([4, 0], rival_rate=1.0) == 4
    assert copies.choose([4, 0], rival_rate=1.0, rooms=[30, 60]) == 0
    assert copies.choose([4, 0], rival_rate=1.0, rooms=[60, 30]) == 4
    # Where a verification grows with its rows (this table read as `fixed + rows x per_row`), a row that finishes
    # early saves its own share of every later cycle: the row ahead's sure drafts pay again.
    policy.verify_cost = BatchVerifyCost(table, rows=2)
    policy.rooms = [30, 60]
    assert policy.choose(confidence, 0.0, limits=[4, 4]) > 0


def test_a_failed_cycle_over_several_rows_is_evidence_enough_to_pause():
    from hf_domino.batch_policy_domino import BatchVerifyCost

    def after_a_failed_batch_cycle(rows: int) -> int:
        table = VerifyCost({n * rows: seconds for n, seconds in PREPACKED.items()})
        policy = AdaptivePolicy(DrafterRecord([0.6] * 16), BatchVerifyCost(table, rows), cap=16, learn_times=False)
        policy.record.drafting_rate = 1 / table(rows)  # drafting has been paying as much as plain steps
        k = policy.budget(room=100)
        policy.choose(torch.full((rows, k), 0.9), draft_seconds=0.006, limits=[k] * rows)
        policy.observe(
            drafted=True, verified=2, accepted=[0] * rows, row_verified=[2] * rows, verify_seconds=0.045, positions=k
        )
        return policy.record.skip_left

    # Two rows failing together may still be bad luck: the acceptance learned per position decides, as for one.
    assert after_a_failed_batch_cycle(2) == 0
    # Four rows failing together are a measurement: the policy pauses although 60% acceptance looked good.
    assert policy_domino.BATCH_EVIDENCE_ROWS == 4 and after_a_failed_batch_cycle(4) > 0


def test_a_batchs_pauses_grow_whatever_the_long_run_acceptance_says():
    from hf_domino.batch_policy_domino import BatchVerifyCost

    def pauses(rows: int) -> list[int]:
        table = VerifyCost({n * rows: seconds for n, seconds in PREPACKED.items()})
        record = DrafterRecord([0.1] * 16, steady_acceptance=[0.9] * 16, steady_cycles=100)
        policy = AdaptivePolicy(record, BatchVerifyCost(table, rows), cap=16, learn_times=False)
        seen = []
        for _ in range(6):  # failed probes, one after another
            while policy.budget(room=100) == 0:
                pass
            policy.choose(torch.full((rows, 4), 0.9), draft_seconds=0.006, limits=[4] * rows)
            policy.observe(
                drafted=True,
                verified=2,
                accepted=[0] * rows,
                row_verified=[2] * rows,
                verify_seconds=0.09,
                positions=4,
            )
            seen.append(record.skip_interval)
        return seen

    assert max(pauses(1)) == policy_domino.STEADY_SKIP_INTERVAL  # one sequence: the long run keeps pauses short
    assert pauses(4)[-1] > policy_domino.STEADY_SKIP_INTERVAL  # a batch: its failed probes double the pause


def test_while_the_long_run_acceptance_pays_pauses_stay_short():
    def pauses(steady: float) -> list[int]:
        policy = adaptive(PREPACKED, acceptance=0.6)
        policy.record.steady_acceptance = [steady] * 16
        policy.record.steady_cycles = policy_domino.STEADY_CYCLES
        gaps = []
        for _ in range(12):  # a stretch the drafter cannot follow: every probe fails
            skipped = 0
            while (k := policy.budget(room=100)) == 0:
                skipped += 1
            gaps.append(skipped)
            policy.choose(torch.full((k,), 0.9), draft_seconds=0.006)
            policy.observe(drafted=True, verified=1, accepted=0, verify_seconds=0.045, positions=k)
        return gaps

    # The drafter's acceptance learned over many cycles says drafting pays: probe every few steps, so that drafting
    # resumes soon after the stretch ends.
    assert max(pauses(steady=0.6)) == policy_domino.STEADY_SKIP_INTERVAL
    # It does not: back off exponentially, as before.
    assert max(pauses(steady=0.1)) > 4 * policy_domino.STEADY_SKIP_INTERVAL


def test_an_untrained_drafter_backs_off_although_its_prior_acceptance_looked_good():
    # The long-run acceptance starts from the optimistic prior: it caps pauses only once it rests on enough cycles.
    policy = adaptive(PREPACKED, acceptance=records_domino.INITIAL_ACCEPTANCE)
    plain = 0
    for _ in range(300):
        k = policy.budget(room=100)
        if k == 0:
            plain += 1
            continue
        verified = policy.choose(torch.full((k,), 0.5), draft_seconds=0.006)
        policy.observe(drafted=True, verified=verified, accepted=0, verify_seconds=0.045, positions=k)
    assert policy.record.steady_cycles < policy_domino.STEADY_CYCLES
    assert plain > 0.9 * 300 and policy.record.skip_interval > 4 * policy_domino.STEADY_SKIP_INTERVAL


def test_drafting_drafts_at_least_one_position_so_its_cost_stays_measured():
    # An estimate of the drafter's cost that says every k loses would otherwise never be corrected.
    policy = adaptive(PREPACKED, acceptance=0.02)
    policy.record.drafting_rate = 1 / 0.040  # drafting has been paying
    acceptance = torch.tensor(policy.record.position_acceptance)
    assert policy._best_k(acceptance, spent=None) == 0  # the cost model alone would take a plain step
    assert policy.budget(room=100) >= 1
    assert policy.choose(torch.tensor([0.01]), draft_seconds=0.004) == 0  # poor drafts are still not verified


# ------------------------------------------------------------------------------------------- through generate()
def test_adaptive_greedy_is_identical_through_long_plain_runs_and_back(cpu_like_costs):
    # Right drafts for tokens below 20, wrong ones above: the sequence counts up mod 32, so drafting pays for most of
    # each period and not at all for the rest.
    target = successor_target("qwen3", VOCAB)
    drafter = forcing_drafter(target, [(t + 1) % VOCAB if t < 20 else (t + 2) % VOCAB for t in range(VOCAB)])
    target.generation_config.eos_token_id = None  # count through several periods
    prompt = torch.tensor([[4, 5]])
    expected = greedy(target, prompt, max_new_tokens=120)
    assert torch.equal(greedy(target, prompt, max_new_tokens=120, assistant_model=drafter), expected)
    stats = drafter.last_generation_stats
    drafted, accepted = stats.drafted, stats.acceptance_lengths
    assert sum(accepted) + 1 == 120
    runs, run = [], 0
    for k in drafted:
        run = run + 1 if k == 0 else 0
        runs.append(run)
    assert max(runs) >= 4, drafted  # long stretches of plain target steps ...
    resumed = [i for i in range(1, len(drafted)) if runs[i - 1] >= 3 and drafted[i] > 0 and accepted[i] > 2]
    assert resumed, (drafted, accepted)  # ... after which drafting resumes, and pays


def test_adaptive_matches_full_blocks_where_every_draft_is_right(gpu_like_costs):
    target = successor_target("qwen3", VOCAB)
    drafter = forcing_drafter(target, [(t + 1) % VOCAB for t in range(VOCAB)], block_size=8)
    prompt = torch.tensor([[4, 5]])
    expected = greedy(target, prompt, max_new_tokens=40)
    assert torch.equal(greedy(target, prompt, max_new_tokens=40, assistant_model=drafter), expected)
    assert max(drafter.last_generation_stats.acceptance_lengths) == drafter.config.num_drafts + 1


@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_draft_vocabulary_keeps_greedy_identical(policy, cpu_like_costs):
    target = successor_target("qwen3", VOCAB)
    drafter = forcing_drafter(target, [(t + 1) % VOCAB for t in range(VOCAB)])
    drafter.set_draft_vocab(torch.arange(0, VOCAB, 2))  # odd tokens can never be drafted
    prompt = torch.tensor([[4, 5]])
    expected = greedy(target, prompt, max_new_tokens=30)
    output = greedy(target, prompt, max_new_tokens=30, assistant_model=drafter, draft_policy=policy)
    assert torch.equal(output, expected)
    if policy == "fixed":
        stats = drafter.last_generation_stats
        assert max(stats.acceptance_lengths) == 2  # an even draft is right, the odd one after it never is
        without = greedy(
            target, prompt, max_new_tokens=30, assistant_model=drafter, draft_policy=policy, draft_vocab=False
        )
        assert torch.equal(without, expected) and max(drafter.last_generation_stats.acceptance_lengths) > 2


@pytest.mark.parametrize("fast_path", [False, True])
def test_draft_vocabulary_with_models_made_under_inference_mode(fast_path):
    # Weights created under torch.inference_mode() are inference tensors, which have no version counter: the cached
    # vocabulary rows (and the CPU fast path's packed ones) must key them some other way.
    with torch.inference_mode():
        target = successor_target("qwen3", VOCAB)
        drafter = forcing_drafter(target, [(t + 1) % VOCAB for t in range(VOCAB)])
        drafter.set_draft_vocab(torch.arange(0, VOCAB, 2))
        if fast_path:
            hf_domino.prepare_for_cpu_decoding(target, drafter)
        prompt = torch.tensor([[4, 5]])
        expected = greedy(target, prompt, max_new_tokens=20)
        output = greedy(target, prompt, max_new_tokens=20, assistant_model=drafter, draft_policy="fixed")
    assert torch.equal(output, expected) and max(drafter.last_generation_stats.acceptance_lengths) == 2


def test_cached_vocabulary_rows_follow_the_weight():
    from hf_domino.modeling_domino import vocab_rows

    vocab = torch.tensor([3, 1, 4])
    weight = torch.randn(8, 5)
    assert torch.equal(vocab_rows(weight, vocab), weight[vocab])
    with torch.no_grad():
        weight.mul_(2)  # in place
    assert torch.equal(vocab_rows(weight, vocab), weight[vocab])
    for _ in range(3):  # new weights, which may take a freed one's address
        weight = torch.randn(8, 5)
        assert torch.equal(vocab_rows(weight, vocab), weight[vocab])
    vocab[0] = 7
    assert torch.equal(vocab_rows(weight, vocab), weight[vocab])


def test_cached_vocabulary_rows_are_freed_with_their_model():
    # The cache held each gathered copy until it had 8 entries: a server reloading models never got them back.
    import gc

    from hf_domino import target_modules_domino

    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    drafter.set_draft_vocab(torch.arange(0, target.config.vocab_size, 2))
    prompt = torch.tensor([[5, 6, 7]])
    greedy(target, prompt, max_new_tokens=6, assistant_model=drafter, draft_policy="fixed")
    weight = target.get_output_embeddings().weight
    held = [entry for entry in target_modules_domino._VOCAB_ROWS.values() if entry[1]() is weight]
    assert held, "the call gathered its draft vocabulary's rows"
    del target, drafter, weight, held
    gc.collect()
    assert all(entry[1]() is not None for entry in target_modules_domino._VOCAB_ROWS.values())


def test_draft_vocabulary_round_trips_and_is_validated(tmp_path):
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    drafter.save_pretrained(tmp_path / "plain")
    assert not (tmp_path / "plain" / "draft_vocab.safetensors").exists()
    drafter.set_draft_vocab(torch.tensor([9, 3, 5]))
    drafter.save_pretrained(tmp_path / "vocab")
    reloaded = type(drafter).from_pretrained(tmp_path / "vocab")
    assert reloaded.draft_vocab.tolist() == [3, 5, 9]
    assert type(drafter).from_pretrained(tmp_path / "plain").draft_vocab is None
    for bad in ([], [3, 3], [-1], [target.config.vocab_size]):
        with pytest.raises(ValueError, match="draft vocabulary"):
            drafter.set_draft_vocab(torch.tensor(bad, dtype=torch.long))


@pytest.mark.parametrize("options", [dict(draft_policy="adaptive"), dict(draft_policy="fixed", draft_vocab=True)])
def test_sampling_preserves_target_distribution_adaptive_and_with_a_draft_vocabulary(options, gpu_like_costs):
    vocab, num_new, draws = 5, 4, 2500
    # Peaked (logits x 6): drafts drawn from a law 1.5 times sharper than the logits they return fail the adaptive
    # case (the test below); with the plain law both cases passed that fault (2026-12-06).
    target = law_target(vocab, seed=3, peak=6)
    drafter = law_drafter(target)
    if options.get("draft_vocab"):
        drafter.set_draft_vocab(torch.tensor([0, 2, 3]))
    prompt = [2, 4, 1]
    probs = exact_sequence_distribution(target, prompt, num_new, LogitsProcessorList())
    counts, drafted, accepted = sample_with_drafter(target, drafter, prompt, num_new, draws, seed=4321, **options)
    assert 0 < accepted < drafted  # rejection sampling really ran, with both outcomes
    assert chi_square_p_value(counts, probs, draws) > 1e-3
    if options.get("draft_vocab"):
        # Tokens the drafter can never propose still come out, from the target.
        assert any(token in (1, 4) for key in counts for token in key)


@pytest.mark.slow  # 2,500 draws again, to show the test above has the power it needs
def test_the_law_test_fails_drafts_drawn_from_another_law(gpu_like_costs, monkeypatch):
    # One sequence's drafts drawn from a law 1.5 times sharper than the logits they return for the verification.
    from hf_domino import generation_domino

    processed_pick = generation_domino.processed_pick
    monkeypatch.setattr(generation_domino, "processed_pick", lambda *args: drawn_sharper(processed_pick(*args)))
    with pytest.raises(AssertionError, match=r"> 0\.001"):
        test_sampling_preserves_target_distribution_adaptive_and_with_a_draft_vocabulary(
            dict(draft_policy="adaptive"), gpu_like_costs
        )


# ------------------------------------------------------------------------------------------------------ options
def test_options_come_from_the_call_or_the_generation_config():
    target = successor_target("qwen3", VOCAB)
    drafter = forcing_drafter(target, [(t + 1) % VOCAB for t in range(VOCAB)], block_size=8)
    prompt = torch.tensor([[4, 5]])
    config = GenerationConfig(do_sample=False, max_new_tokens=20, pad_token_id=0, draft_policy="fixed")
    config.num_speculative_tokens = 3
    target.generate(prompt, generation_config=config, assistant_model=drafter)
    assert max(drafter.last_generation_stats.drafted) == 3
    greedy(target, prompt, max_new_tokens=20, assistant_model=drafter, draft_policy="fixed", num_speculative_tokens=2)
    assert max(drafter.last_generation_stats.drafted) == 2
    # k = 0 with the fixed policy: every forward is a plain target step.
    output = greedy(
        target, prompt, max_new_tokens=20, assistant_model=drafter, draft_policy="fixed", num_speculative_tokens=0
    )
    assert torch.equal(output, greedy(target, prompt, max_new_tokens=20))
    assert set(drafter.last_generation_stats.drafted) == {0}


@pytest.mark.parametrize("rows", [1, 3])
def test_no_drafts_allowed_are_plain_steps_with_the_adaptive_policy_too(rows, gpu_like_costs):
    # num_speculative_tokens=0 allows no drafts and no copies under the default policy too, one sequence or a batch
    # (a batch's policy had kept k >= 1, the floor of a tree's share of the block). Drafts that would all hold and
    # text that repeats, so that any draft or copy offered would show.
    target = successor_target("qwen3", VOCAB)
    drafter = forcing_drafter(target, [(t + 1) % VOCAB for t in range(VOCAB)], block_size=8)
    prompt = torch.tensor([[4, 5, 6, 4, 5], [9, 10, 11, 9, 10], [4, 5, 6, 4, 5]][:rows])
    kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=20)
    output = greedy(target, prompt, **kwargs, assistant_model=drafter, num_speculative_tokens=0)
    assert torch.equal(output, greedy(target, prompt, **kwargs))
    assert set(drafter.last_generation_stats.drafted) == {0}
    greedy(target, prompt, **kwargs, assistant_model=drafter)  # the test can fail: the default drafts here
    assert own_drafts(drafter.last_generation_stats) > 0


def test_confidence_threshold_stops_drafting_like_transformers():
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)  # random: its drafts are far from certain
    prompt = torch.tensor([[5, 6, 7]])
    expected = greedy(target, prompt, max_new_tokens=12)
    output = greedy(
        target,
        prompt,
        max_new_tokens=12,
        assistant_model=drafter,
        draft_policy="fixed",
        assistant_confidence_threshold=0.999,
        domino_lookup=False,  # copied drafts have no probability to threshold
    )
    # transformers' ConfidenceCriteria ends drafting after the first draft under the threshold, which is verified.
    assert torch.equal(output, expected) and set(drafter.last_generation_stats.drafted) == {1}


@pytest.mark.parametrize(
    "option, match",
    [
        (dict(draft_policy="greedy"), "draft_policy must be one of"),
        (dict(num_speculative_tokens=99), "num_speculative_tokens must be an int"),
        (dict(assistant_confidence_threshold=1.5), "assistant_confidence_threshold must be a number in"),
        (dict(domino_head="yes"), "domino_head must be True, False or None"),
        (dict(domino_rollout="fast"), "domino_rollout must be one of"),
        (dict(domino_timings=1), "domino_timings must be True or False"),
    ],
)
def test_bad_options_are_rejected_before_any_work(option, match, monkeypatch):
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    calls = []
    monkeypatch.setattr(target, "forward", lambda *a, **k: calls.append(1))
    with pytest.raises(ValueError, match=match):
        greedy(target, torch.tensor([[5, 6]]), max_new_tokens=4, assistant_model=drafter, **option)
    assert not calls


def test_domino_options_without_a_domino_drafter_keep_transformers_error():
    target = tiny_target("qwen3")
    with pytest.raises(ValueError, match="not used by the model"):
        greedy(target, torch.tensor([[5, 6]]), max_new_tokens=4, draft_policy="fixed")


# ------------------------------------------------------------------------------------------ building a vocabulary
def test_draft_vocab_counts_and_keeps_special_tokens():
    from hf_domino.draft_vocab import count_tokens, most_frequent

    counts = count_tokens([[5, 5, 6], [7, 5, 6], []], vocab_size=10)
    assert counts.tolist() == [0, 0, 0, 0, 0, 3, 2, 1, 0, 0]
    assert most_frequent(counts, 3, always=[1]).tolist() == [1, 5, 6]
    assert most_frequent(counts, 4).tolist() == [0, 5, 6, 7]  # ties go to the lower id
    with pytest.raises(ValueError, match="special tokens"):
        most_frequent(counts, 1, always=[1, 2])
    # Ids of another model's vocabulary: an error, not counts of the ids that happen to fit.
    with pytest.raises(ValueError, match="token id 12 is outside the drafter's 10-token vocabulary"):
        count_tokens([[5, 12]], vocab_size=10)


def test_draft_vocab_command_writes_a_loadable_copy(tmp_path):
    import json

    from test_generation import letter_tokenizer

    from hf_domino import cli
    from hf_domino.modeling_domino import DominoForSpeculation

    target = successor_target("qwen3", VOCAB)
    drafter = forcing_drafter(target, [(t + 1) % VOCAB for t in range(VOCAB)])
    drafter.save_pretrained(tmp_path / "drafter")
    letter_tokenizer().save_pretrained(tmp_path / "tokenizer")
    data = tmp_path / "regen.jsonl"
    record = {"index": 0, "input_ids": [9, 9, 5, 6, 5, 7], "loss_mask": [0, 0, 1, 1, 1, 1]}
    data.write_text(json.dumps(record) + "\n" + '{"index": 1, "input_ids": [8')  # a line still being written
    argv = ["draft-vocab", "--drafter", str(tmp_path / "drafter"), "--target", str(tmp_path / "tokenizer")]
    assert cli.main([*argv, "--size", "6", "--data", str(data), "--output", str(tmp_path / "out")]) == 0
    loaded = DominoForSpeculation.from_pretrained(tmp_path / "out")
    assert loaded.draft_vocab.tolist() == [0, 1, 2, 5, 6, 7]  # the tokenizer's special tokens, then by frequency
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (
        tmp_path / "drafter" / "model.safetensors"
    ).read_bytes()
    # Bad input fails before any counting: a taken --output, a --size past the vocabulary, no drafter there.
    with pytest.raises(SystemExit, match="out exists; choose a new --output folder"):
        cli.main([*argv, "--size", "6", "--data", str(data), "--output", str(tmp_path / "out")])
    with pytest.raises(SystemExit, match=f"--size 999 exceeds the drafter's {VOCAB}-token vocabulary"):
        cli.main([*argv, "--size", "999", "--data", str(data), "--output", str(tmp_path / "big")])
    missing = ["draft-vocab", "--drafter", str(tmp_path / "none"), "--size", "6", "--output", str(tmp_path / "m")]
    assert cli.main(missing) == 2  # "No drafter checkpoint at ...", one line
    # Data or a tokenizer of another target: named, nothing written.
    data.write_text(json.dumps(record | {"input_ids": [9, 9, 5, VOCAB + 3, 5, 7]}) + "\n")
    with pytest.raises(SystemExit, match=f"token id {VOCAB + 3} is outside the drafter's {VOCAB}-token vocabulary"):
        cli.main([*argv, "--size", "6", "--data", str(data), "--output", str(tmp_path / "other")])
    with pytest.raises(SystemExit, match=f"tokenizer has 49152 tokens, more than the drafter's {VOCAB}-token"):
        cli.main([*argv[:-1], "smollm2", "--size", "6", "--data", str(data), "--output", str(tmp_path / "other")])
    assert not (tmp_path / "big").exists() and not (tmp_path / "m").exists() and not (tmp_path / "other").exists()
    # Tracebacks after the counting, or a vocabulary of nothing counted, exit 0: now named before or instead.
    data.write_text(json.dumps(record) + "\n")
    with pytest.raises(SystemExit, match="--size 2 cannot hold the tokenizer's 3 special tokens"):
        cli.main([*argv, "--size", "2", "--data", str(data), "--output", str(tmp_path / "small")])
    (tmp_path / "a-file").write_text("")
    with pytest.raises(SystemExit, match="a-file/sub lies under a file"):
        cli.main([*argv, "--size", "6", "--data", str(data), "--output", str(tmp_path / "a-file" / "sub")])
    (tmp_path / "prompts-only.jsonl").write_text(json.dumps(record | {"loss_mask": [0] * 6}) + "\n")
    with pytest.raises(SystemExit, match="no response token in 1 regenerated file"):
        cli.main(
            [*argv, "--size", "6", "--data", str(tmp_path / "prompts-only.jsonl"), "--output", str(tmp_path / "e")]
        )
    assert not (tmp_path / "small").exists() and not (tmp_path / "e").exists()

    # The committed form of regenerated data (`hf-domino pack`) counts the same.
    from hf_domino.training import pack

    pack([data], tmp_path / "packed.safetensors", recipe={"name": "test"})
    packed_argv = ["--size", "6", "--data", str(tmp_path / "packed.safetensors"), "--output", str(tmp_path / "p")]
    assert cli.main([*argv, *packed_argv]) == 0
    assert DominoForSpeculation.from_pretrained(tmp_path / "p").draft_vocab.tolist() == [0, 1, 2, 5, 6, 7]


# --------------------------------------------------------------------------------------------------------- batches
def test_a_batch_gets_one_k_priced_by_all_its_tokens():
    from hf_domino.batch_policy_domino import BatchVerifyCost

    assert expected_tokens(torch.tensor([[1.0, 0.0], [1.0, 1.0]])).tolist() == [1, 2, 2.5]  # mean over rows
    table = VerifyCost({1: 0.010, 4: 0.011, 8: 0.012, 16: 0.030, 64: 0.100})  # cheap up to 8 tokens, then dear
    policy = AdaptivePolicy(DrafterRecord([0.9] * 16), BatchVerifyCost(table, rows=4), cap=16, learn_times=False)
    confident = torch.full((4, 8), 0.99)
    # 4 rows x (1 + 1) tokens cost about what 4 x 1 do; 4 x (1 + 3) = 16 tokens cost 2.7 plain steps.
    assert policy.choose(confident, draft_seconds=0.001, limits=[8, 8, 8, 8]) == 1
    # One row may offer none (a stop string ahead, no room): the others still draft, and k never passes the limits.
    assert policy.choose(confident, draft_seconds=0.001, limits=[0, 8, 8, 8]) == 1
    assert policy.choose(confident, draft_seconds=0.001, limits=[0, 0, 0, 0]) == 0
    # Learning from every row: row 0 rejected its first draft, the others accepted theirs.
    before = policy.record.position_acceptance[0]
    policy.observe(drafted=True, verified=1, accepted=[0, 1, 1, 1], row_verified=[1, 1, 1, 1], verify_seconds=0.02)
    assert policy.record.position_acceptance[0] != before
    assert policy.record.calibration.trials.sum() > AcceptanceCalibration().trials.sum() + 3


def test_draft_vocab_keeps_the_drafters_own_special_tokens_and_refuses_another_models_tokenizer(tmp_path):
    # The default --target (SmolLM2) gave a drafter of another model a vocabulary of SmolLM2's ids, its EOS left out.
    import json

    from test_generation import letter_tokenizer

    from hf_domino import cli
    from hf_domino.modeling_domino import DominoForSpeculation

    target = successor_target("qwen3", VOCAB)
    drafter = forcing_drafter(target, [(t + 1) % VOCAB for t in range(VOCAB)])
    drafter.config.eos_token_id, drafter.config.pad_token_id = [1, 20], 0  # 20: an EOS the tokenizer has no name for
    drafter.save_pretrained(tmp_path / "drafter")
    letter_tokenizer().save_pretrained(tmp_path / "tokenizer")
    data = tmp_path / "regen.jsonl"
    data.write_text(json.dumps({"index": 0, "input_ids": [9, 9, 5, 6, 5, 7], "loss_mask": [0, 0, 1, 1, 1, 1]}) + "\n")
    argv = ["draft-vocab", "--drafter", str(tmp_path / "drafter"), "--size", "7", "--data", str(data)]
    assert cli.main([*argv, "--target", str(tmp_path / "tokenizer"), "--output", str(tmp_path / "out")]) == 0
    assert DominoForSpeculation.from_pretrained(tmp_path / "out").draft_vocab.tolist() == [0, 1, 2, 5, 6, 7, 20]
    config = json.loads((tmp_path / "drafter" / "config.json").read_text())
    config["eos_token_id"], config["pad_token_id"] = [25], 26  # a model whose special tokens this tokenizer lacks
    (tmp_path / "drafter" / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit, match="holds none of the drafter's special tokens .*pass the drafter's own target"):
        cli.main([*argv, "--target", str(tmp_path / "tokenizer"), "--output", str(tmp_path / "other")])
    assert not (tmp_path / "other").exists()


def test_verify_cost_of_a_batch_is_keyed_by_all_its_tokens():
    target = tiny_target("qwen3")
    cache = DynamicCache()
    target(torch.tensor([[5, 6, 7]] * 3), use_cache=True, **cache_argument(cache))
    cost = cost_model_domino.measure_verify_cost(target, cache, torch.tensor([[7]] * 3), {}, lengths=(1, 2), repeats=1)
    assert sorted(cost.seconds) == [3, 6] and cache.get_seq_length() == 3  # the cache is left as it was


def test_a_table_covers_a_batch_that_verifies_whole_blocks_within_it():
    table = VerifyCost({n: 0.01 * n for n in cost_model_domino.CALIBRATION_LENGTHS})
    assert table.covers(1) and not table.covers(2)
    table.update(VerifyCost({2: 0.5, 34: 0.9}))  # a batch of 2's own measurements replace batch 1's at shared lengths
    assert table.covers(2) and not table.covers(3)
    assert list(table.seconds) == [1, 2, 3, 5, 9, 17, 34] and table(2) == 0.5 and table(34) == 0.9


def test_a_cost_table_belongs_to_its_model_and_goes_with_it(monkeypatch):
    # Keyed by the model itself, not its address: a model created where a freed one was gets no stale table.
    import gc

    monkeypatch.setattr(cost_model_domino, "_VERIFY_COSTS", cost_model_domino.weakref.WeakKeyDictionary())
    target = tiny_target("qwen3")
    table = cost_model_domino.verify_cost_for(target, lambda: VerifyCost({1: 0.01}))
    assert cost_model_domino.verify_cost_for(target, lambda: pytest.fail("measured again")) is table
    assert cost_model_domino.cached_verify_cost(tiny_target("qwen3")) is None
    del target
    gc.collect()
    assert len(cost_model_domino._VERIFY_COSTS) == 0


def test_a_new_setting_waits_before_probing_when_the_cost_model_says_drafting_will_not_pay():
    from hf_domino.batch_policy_domino import BatchVerifyCost

    table = VerifyCost({1: 0.010, 8: 0.110, 16: 0.130, 24: 0.150})  # CPU-like at batch 8: 2 tokens per row cost 1.2x
    known_poor = AdaptivePolicy(DrafterRecord([0.1] * 16), BatchVerifyCost(table, rows=8), cap=16, learn_times=False)
    decisions = [known_poor.budget(room=100) for _ in range(policy_domino.PRIOR_SKIP_INTERVAL + 1)]
    assert decisions[:-1] == [0] * policy_domino.PRIOR_SKIP_INTERVAL and decisions[-1] > 0  # then one probe
    # The same costs with a drafter expected to do well: probe at once, as before anything was learned.
    hopeful = AdaptivePolicy(DrafterRecord([0.9] * 16), BatchVerifyCost(table, rows=8), cap=16, learn_times=False)
    assert hopeful.budget(room=100) > 0


def new_batch_size_policy(monkeypatch, table: dict[int, float], rows: int = 8, acceptance: float | None = None):
    """The policy of a first call at `rows` rows, after batch 1 learned the drafter's times (4 ms, 1 ms a position)."""
    import types

    from hf_domino.options_domino import DominoOptions

    monkeypatch.setattr(batch_policy_domino, "measure_verify_cost", lambda *a, **k: VerifyCost(dict(table)))
    monkeypatch.setattr(cost_model_domino, "_VERIFY_COSTS", cost_model_domino.weakref.WeakKeyDictionary())
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    shared = records_domino.drafter_record(drafter, target, records_domino.DraftingMode(), drafter.config.num_drafts)
    shared.backbone_seconds, shared.position_seconds = 0.004, 0.001  # learned at batch 1
    if acceptance is not None:
        shared.position_acceptance[:] = [acceptance] * len(shared.position_acceptance)
    anchors = torch.zeros(rows, 1, dtype=torch.long)
    cache = types.SimpleNamespace(cache=None, recurrent=None)
    greedy = records_domino.DraftingMode()
    policy = batch_policy_domino.batch_policy(target, drafter, DominoOptions(), greedy, cache, anchors, {}, 4)
    assert policy.record is not shared and policy.record.position_acceptance is shared.position_acceptance
    return policy


@pytest.mark.parametrize(
    "table, growth",
    [
        ({1: 0.01, 17: 0.02, 136: 0.08}, 4.0),  # a CPU: 8 rows' block costs 4x one row's
        ({1: 0.030, 17: 0.033, 136: 0.0363}, 1.1),  # a GPU: nearly flat
    ],
)
def test_a_new_batch_size_starts_from_the_drafters_cost_at_batch_1_grown_as_the_targets(monkeypatch, table, growth):
    policy = new_batch_size_policy(monkeypatch, table)
    assert policy.record.backbone_seconds == pytest.approx(0.004 * growth)
    assert policy.record.position_seconds == pytest.approx(0.001 * growth)
    assert policy.record.backbone_from_prior
    # The call's first drafting cycle is not the drafter's cost (it reads the prompt); its second replaces the prior
    # backbone time, and moves the rollout's a bounded step (a first cycle at a new width can capture a CUDA graph).
    common = dict(drafted=True, verified=2, accepted=[1] * 8, verify_seconds=table[17], positions=2)
    policy.observe(backbone_seconds=0.5, rollout_seconds=0.5, **common)
    assert policy.record.backbone_seconds == pytest.approx(0.004 * growth)
    position = policy.record.position_seconds
    policy.observe(backbone_seconds=0.006, rollout_seconds=1.0, **common)
    assert policy.record.backbone_seconds == pytest.approx(0.006) and not policy.record.backbone_from_prior
    assert policy.record.position_seconds == pytest.approx(position + cost_model_domino.TIME_RATE * position)
    policy.observe(backbone_seconds=0.010, rollout_seconds=0.004, **common)  # measured: learned at TIME_RATE
    assert policy.record.backbone_seconds == pytest.approx(0.006 + cost_model_domino.TIME_RATE * 0.004)


def test_on_a_flat_cost_table_a_new_batch_size_drafts_from_its_first_cycle(monkeypatch):
    # An H200 (docs/benchmarks.md, "Fifth run on a GPU"): a step ~30 ms at any batch size, a 17-token verification
    # ~10% more, the drafter's 4 ms barely growing with rows. Priced as 8 rows x the batch-1 backbone (32 ms, more than
    # a step), a drafter that pays at batch 1 took plain steps for the first 8 cycles of each new batch size, then
    # learned the real cost a fifth of the way per probe; 8 rows ran 0.91x the target alone.
    policy = new_batch_size_policy(monkeypatch, {1: 0.030, 17: 0.033, 136: 0.0363}, acceptance=0.6)
    assert policy.budget(room=100) > 0


@pytest.mark.parametrize("rows", [1, 3])
def test_where_timing_needs_a_synchronization_the_policy_still_learns(monkeypatch, rows):
    # CUDA, simulated on the CPU: host timings need the device to finish first (a recorded no-op here). The loops then
    # wait at their laps, the policy learns the verify table and the drafter's times from them as on a CPU, and it
    # never decides per drafted position (each decision would wait for the device inside the rollout).
    from test_batching import left_padded

    from hf_domino import generation_domino

    waits, built = [], []
    monkeypatch.setattr(cost_model_domino, "synchronize", waits.append)
    monkeypatch.setattr(cost_model_domino, "timing_is_free", lambda device: False)
    for module in (generation_domino, batch_policy_domino):

        class Spy(module.AdaptivePolicy):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                built.append(self)

        monkeypatch.setattr(module, "AdaptivePolicy", Spy)
    monkeypatch.setattr(batch_policy_domino, "timing_is_free", lambda device: False)
    monkeypatch.setattr(generation_domino.DominoCandidateGenerator, "_timing_is_free", property(lambda self: False))
    monkeypatch.setattr(records_domino, "_RECORDS", records_domino.weakref.WeakKeyDictionary())
    target = successor_target("qwen3", VOCAB)
    drafter = forcing_drafter(target, [(t + 1) % VOCAB for t in range(VOCAB)], block_size=8)
    batch = left_padded([[4, 5], [9], [20, 21, 22]][:rows])
    expected = target.generate(**batch, max_new_tokens=40, do_sample=False)
    output = target.generate(**batch, max_new_tokens=40, do_sample=False, assistant_model=drafter)
    assert torch.equal(output, expected)
    (policy,) = built
    assert policy.learn_times and not policy.per_position and waits
    assert policy.record.backbone_seconds is not None and policy.record.position_seconds is not None
    assert own_drafts(drafter.last_generation_stats) > 0


def test_what_one_target_taught_does_not_pause_the_drafter_beside_another(cpu_like_costs):
    # Records were kept per drafter only: after calls beside a target that rejects every draft, the drafter beside a
    # target that accepts them all took plain steps for two whole calls (8x the forwards).
    rejects, accepts = successor_target("qwen3", VOCAB, step=2), successor_target("qwen3", VOCAB, step=1)
    drafter = forcing_drafter(accepts, [(t + 1) % VOCAB for t in range(VOCAB)], block_size=9)
    prompt = torch.tensor([[5, 6, 7]])
    for _ in range(6):
        greedy(rejects, prompt, assistant_model=drafter, max_new_tokens=40, domino_lookup=False)
    assert own_drafts(drafter.last_generation_stats) < 10  # drafting paused there
    greedy(accepts, prompt, assistant_model=drafter, max_new_tokens=40, domino_lookup=False)
    assert drafter.last_generation_stats.mean_acceptance_length > 5


def test_forgetting_a_drafter_records_starts_its_next_call_from_nothing_learned():
    drafter, target = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    greedy = records_domino.DraftingMode()
    record = records_domino.drafter_record(drafter, target, greedy, 4)
    record.position_acceptance[0], record.skip_left = 0.1, 3
    assert records_domino.drafter_record(drafter, target, greedy, 4) is record  # kept across calls
    assert records_domino.drafter_record(drafter, torch.nn.Linear(1, 1), greedy, 4) is not record  # per target
    records_domino.forget_records(drafter)
    fresh = records_domino.drafter_record(drafter, target, greedy, 4)
    assert fresh is not record and fresh.position_acceptance == [records_domino.INITIAL_ACCEPTANCE] * 4
    assert fresh.skip_left == 0
    records_domino.forget_records(torch.nn.Linear(1, 1))  # a drafter that never ran: nothing to forget


# ---------------------------------------------------------------------------- trees of first-token branches
def test_a_tree_earns_its_first_branch_plus_what_each_other_branch_would_accept():
    from hf_domino.policy_domino import tree_tokens

    # One row, two branches: first drafts right with 0.5 and 0.3 (different tokens, so exclusive), the next with 0.8
    # and 0.6 after them.
    acceptance = torch.tensor([[[0.5, 0.8], [0.3, 0.6]]])
    tokens = tree_tokens(acceptance, expected_tokens)
    assert tokens[0].tolist() == pytest.approx([1, 1.5, 1.9])  # the first branch alone: a block
    assert tokens[1].tolist() == pytest.approx([1, 1.8, 1.9 + 0.3 + 0.3 * 0.6])
    # Calibrated first acceptances that add up to more than 1 are scaled down: at most one of them is right.
    overlapping = tree_tokens(torch.tensor([[[0.8, 0.0], [0.6, 0.0]]]), expected_tokens)
    assert overlapping[1, 1].item() == pytest.approx(2.0)


def test_the_policy_verifies_a_second_branch_where_its_columns_are_cheap_and_it_may_be_right():
    from hf_domino.batch_policy_domino import BatchVerifyCost

    def policy(table):
        return AdaptivePolicy(DrafterRecord([0.8] * 16), BatchVerifyCost(VerifyCost(table), rows=1), cap=8,
                              learn_times=False, branches=2)  # fmt: skip

    unsure_first = torch.tensor([[[0.45] + [0.95] * 7, [0.4] + [0.95] * 7]])  # a coin toss between two tokens
    limits = torch.tensor([[8, 8]])
    # Columns cost about nothing (a GPU): both branches, whole.
    assert policy(dict(GPU_LIKE)).choose_tree(unsure_first, 0.001, limits) == (8, 2)
    # Every column costs as much as a token step: the second branch doubles the forward for less than it adds.
    steep = {n: 0.010 * n for n in (1, 2, 3, 5, 9, 17)}
    assert policy(steep).choose_tree(unsure_first, 0.001, limits)[1] == 1
    # Where a wider forward costs something (this CPU's shape), a second branch that is hardly ever right is not
    # verified, one that is as likely as the first is; nor is one that may offer nothing.
    assert policy(dict(CPU_LIKE)).choose_tree(unsure_first, 0.001, limits) == (8, 2)
    hopeless = unsure_first.clone()
    hopeless[0, 1, 0] = 0.001
    assert policy(dict(CPU_LIKE)).choose_tree(hopeless, 0.001, limits) == (8, 1)
    assert policy(dict(GPU_LIKE)).choose_tree(unsure_first, 0.001, torch.tensor([[8, 0]]))[1] == 1
    assert policy(dict(GPU_LIKE)).choose_tree(unsure_first, 0.001, torch.tensor([[0, 0]]))[0] == 0
    # The fixed policy verifies every branch, as long as its rows allow.
    assert policy_domino.FixedPolicy(4).choose_tree(unsure_first, 0.001, torch.tensor([[3, 2]])) == (3, 2)


def test_after_a_tree_the_policy_learns_along_the_branch_taken_and_that_the_others_first_drafts_failed():
    policy = AdaptivePolicy(DrafterRecord([0.8] * 16), VerifyCost(dict(GPU_LIKE)), cap=4, learn_times=True,
                            branches=3)  # fmt: skip
    confidence = torch.tensor([[[0.55, 0.9], [0.35, 0.8], [0.05, 0.7]]])
    policy.choose_tree(confidence, 0.001, torch.tensor([[2, 2, 2]]))
    trials = policy.record.calibration.trials.clone()
    policy.take_branch([1], torch.tensor([[2, 2, 0]]))  # branch 1 taken; branch 2 offered nothing
    assert torch.equal(policy.confidence, confidence[0, 1:2])
    learned = policy.record.calibration.trials - trials
    assert learned.sum() == 1 and learned[5] == 1  # branch 0's first draft (0.55), rejected
    assert policy.record.calibration.accepted.sum() == AcceptanceCalibration().accepted.sum()
    policy.observe(drafted=True, verified=2, accepted=2, verify_seconds=0.011, tokens=5)
    assert policy.record.position_acceptance[:2] == pytest.approx([0.84, 0.84])  # along branch 1: both accepted
    assert sorted(policy.verify_cost.seconds) == [1, 5, 17]  # the forward held 1 + 2 x 2 tokens, not 1 + 2


def test_a_tree_rolls_its_branches_on_while_one_of_them_can_still_pay():
    table = VerifyCost(dict(CPU_LIKE))
    policy = AdaptivePolicy(DrafterRecord([0.8] * 16), table, cap=4, learn_times=True, branches=2)
    policy.record.backbone_seconds, policy.record.position_seconds = 0.008, 0.004
    # Rows come as each sequence's branches, one after the other: the second branch still holds.
    assert policy.keep_rolling(torch.tensor([[0.5, 0.05], [0.45, 0.95]]))
    assert not policy.keep_rolling(torch.tensor([[0.5, 0.02], [0.45, 0.02]]))


def test_a_cost_table_measured_while_the_machine_was_busy_is_measured_again():
    # Measured under load, every verification looked dear: only plain steps ran, only they were observed, and the
    # process never drafted again (seen once on a server started beside other work).
    table = VerifyCost({1: 0.010, 2: 0.050, 17: 0.200})
    for _ in range(10):
        table.observe(1, 0.002)
        assert table.measured == {1: 0.010, 2: 0.050, 17: 0.200}
    assert table.measured_while_busy() and not VerifyCost({1: 0.010, 2: 0.012}).measured_while_busy()

    target, measured = tiny_target("qwen3"), []

    def measure() -> VerifyCost:
        measured.append(1)
        return VerifyCost({1: 0.010, 2: 0.050})

    cost_model_domino.swap_verify_cost(target, table)
    fresh = cost_model_domino.verify_cost_for(target, measure)
    assert measured == [1] and fresh is not table and fresh.remeasures == 1
    # The call's shape measured again; the others keep what they held and were measured at.
    assert fresh.seconds == {1: 0.010, 2: 0.050, 17: 0.200} and fresh.measured[17] == 0.200
    assert cost_model_domino.verify_cost_for(target, measure) is fresh and measured == [1]  # not busy: kept
    for remeasures in range(1, cost_model_domino.MAX_REMEASURES + 2):  # a machine always that busy: a bound
        for _ in range(10):
            fresh.observe(1, 0.001)
        fresh = cost_model_domino.verify_cost_for(target, measure)
        assert fresh.remeasures == min(remeasures + 1, cost_model_domino.MAX_REMEASURES)
    assert len(measured) == cost_model_domino.MAX_REMEASURES


def test_a_process_whose_first_measurement_priced_drafting_out_drafts_at_its_next_call():
    target = successor_target()
    drafter = forcing_drafter(target, [(t + 1) % VOCAB for t in range(VOCAB)])
    prompt, greedy = torch.tensor([[3, 4, 5]]), dict(max_new_tokens=24, do_sample=False, pad_token_id=0)
    expected = target.generate(prompt, **greedy)
    one = measure_one_step(target)
    # As measured while other work held the machine: one token 20x its cost, verifying drafts 400x.
    busy = {1: 20 * one, **{n: 400 * one for n in (2, 3, 5, 9, 17)}}
    cost_model_domino.swap_verify_cost(target, VerifyCost(busy))
    first = target.generate(prompt, assistant_model=drafter, **greedy)
    assert torch.equal(first, expected) and max(drafter.last_generation_stats.drafted) == 0
    # Longer: the first call's failed probes leave a pause of up to 16 plain steps to sit out first.
    longer = greedy | {"max_new_tokens": 64}
    second = target.generate(prompt, assistant_model=drafter, **longer)
    assert torch.equal(second, target.generate(prompt, **longer)) and own_drafts(drafter.last_generation_stats) > 0


def measure_one_step(target) -> float:
    cache = DynamicCache(config=target.config)
    context = torch.tensor([[1, 2, 3, 4]])
    target(input_ids=context, use_cache=True, **cache_argument(cache))
    return min(
        cost_model_domino.measure_verify_cost(target, cache, context[:, -1:], {}, lengths=(1,)).seconds.values()
    )

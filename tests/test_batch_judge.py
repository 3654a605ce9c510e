"""The judge of a batch's calls: a drafted call (or a server's window of cycles) weighed against the plain steps
that would have generated the same tokens, and a batch size whose speculation loses taking plain steps for a while."""

from __future__ import annotations

import pytest
import torch
from conftest import forcing_drafter, successor_target
from test_batching import left_padded
from test_generation import VOCAB, successor

from hf_domino import (
    batch_policy_domino,
    batching_domino,
    cost_model_domino,
    policy_domino,
    records_domino,
)


def test_plain_steps_seconds_counts_the_rows_still_generating():
    # Rows that still generate 3, 1 and 0 tokens: plain steps of 2 rows, then 1 row, then 1 row.
    assert batch_policy_domino.plain_steps_seconds([3, 1, 0], lambda rows: 10.0 * rows) == 40.0
    assert batch_policy_domino.plain_steps_seconds([0, 0], lambda rows: 1.0) == 0


def test_plain_steps_seconds_of_a_server_joins_rows_as_places_free_up():
    # A step costs 10 plus 1 per row. Four rows of 4 tokens, 2 at a time: two rounds of 4 two-row steps; all at once:
    # 4 four-row steps. Rows of 3, 1 and 2 tokens, 2 at a time: the third row joins when the second finishes.
    def seconds(rows: int) -> float:
        return 10.0 + rows

    assert batch_policy_domino.plain_steps_seconds([4, 4, 4, 4], seconds, limit=2) == 8 * 12.0
    assert batch_policy_domino.plain_steps_seconds([4, 4, 4, 4], seconds) == 4 * 14.0
    assert batch_policy_domino.plain_steps_seconds([3, 1, 2], seconds, limit=2) == 12.0 + 2 * 12.0
    assert batch_policy_domino.plain_steps_seconds([], seconds, limit=2) == 0


def test_plain_steps_seconds_takes_no_request_on_before_it_came():
    # A step costs 10 plus 1 per row. Two requests of 64 tokens, the second arriving after 21 one-row steps: 21
    # one-row steps, 43 two-row steps (the first done), 21 one-row steps; all at once, 64 two-row steps, which priced
    # a manager's calls as losing whenever its requests came while others ran. A request coming after the others
    # finished: the idle time between does not count.
    def seconds(rows: int) -> float:
        return 10.0 + rows

    came = [0.0, 21 * 11.0]
    assert batch_policy_domino.plain_steps_seconds([64, 64], seconds, 4, came) == 42 * 11.0 + 43 * 12.0
    assert batch_policy_domino.plain_steps_seconds([64, 64], seconds, 4) == 64 * 12.0
    assert batch_policy_domino.plain_steps_seconds([5, 5], seconds, 4, [0.0, 1000.0]) == 10 * 11.0
    # One arriving between two steps joins at the next one; places still limit who joins.
    assert batch_policy_domino.plain_steps_seconds([4, 4], seconds, 4, [0.0, 5.0]) == 11.0 + 3 * 12.0 + 11.0
    assert batch_policy_domino.plain_steps_seconds([4, 4, 4], seconds, 2, [0.0, 0.0, 0.0]) == 4 * 12.0 + 4 * 11.0
    assert batch_policy_domino.plain_steps_seconds([3, 0, 2], seconds, 2, [0.0, 1.0, 50.0]) == 3 * 11.0 + 2 * 11.0


def test_a_servers_call_is_judged_against_plain_steps_joining_as_its_rows_joined(monkeypatch):
    # 21 requests of 17 tokens, 3 rows at a time, in 20 cycles of 1 s, where a plain step costs 1 s at any row count:
    # plain steps joining as the call did take 7 rounds of 17 steps (5.95x slower); all 21 at once would take 17
    # (0.85x: a loss, which paused the next call).
    monkeypatch.setattr(batch_policy_domino, "MAX_PLAIN_CALLS", 4)
    record = records_domino.DrafterRecord(position_acceptance=[0.5], plain_cycle_seconds={1: 1.0, 2: 1.0, 3: 1.0})
    table = cost_model_domino.VerifyCost({1: 1.0, 68: 1.0})
    policy = policy_domino.AdaptivePolicy(record, batch_policy_domino.BatchVerifyCost(table, 3), cap=4)
    cycles, steps = [(3, 1.0, None)] * 20, [17] * 21
    assert batch_policy_domino.call_gain(policy, cycles, steps, limit=3) == pytest.approx(119 / 20)
    assert batch_policy_domino.call_gain(policy, cycles, steps) == pytest.approx(17 / 20)
    batch_policy_domino.judge_call(policy, cycles, steps, speculated=True, limit=3)
    assert record.call_gain == pytest.approx(119 / 20) and batch_policy_domino.call_speculates(record)


def test_a_window_counts_tokens_and_arrivals_from_its_start():
    # A server's window of cycles counts each row's tokens from the window's start (rows admitted since held none),
    # and a request that came before the window's start came at its start.
    window = batch_policy_domino.CallWindow(limit=2, arrivals=[0.0, 3.0])
    window.cycles.append((2, 1.0, None))
    assert window.steps([5, 2]) == [5, 2] and window.arrived() == [0.0, 3.0]
    window.next(start=4.0, tokens=[5, 2])
    assert window.cycles == [] and window.start == 4.0
    window.arrivals.append(6.5)  # a third request joins during the window
    assert window.steps([9, 3, 4]) == [4, 1, 4] and window.arrived() == [0.0, 0.0, 2.5]
    assert batch_policy_domino.CallWindow().arrived() is None


def test_calls_losing_on_average_pause_speculation_for_1_2_4_calls(monkeypatch):
    monkeypatch.setattr(batch_policy_domino, "MAX_PLAIN_CALLS", 4)
    record = records_domino.DrafterRecord(position_acceptance=[0.5])

    def calls(gains: list[float]) -> str:
        pattern = ""
        for gain in gains:
            while not batch_policy_domino.call_speculates(record):
                pattern += "p"
            pattern += "s"
            batch_policy_domino.learn_call_gain(record, gain)
        return pattern

    # One losing call after winning ones is within the calls' spread: no pause.
    assert calls([1.3, 0.8, 1.2]) == "sss"
    # Then losing on average: after each losing call a pause of 1, 2, 4, 4 calls; a call that wins enough ends them.
    assert calls([0.5, 0.6, 0.7, 0.7, 0.7]) == "s" + "ps" + "pps" + "pppps" + "pppps"
    assert record.call_gain < 1
    assert calls([3.0, 1.0]) == "pppp" + "s" + "s"


def test_a_batch_size_whose_speculation_lost_takes_plain_steps_in_its_next_calls(monkeypatch):
    # `judge_call` compares a speculating call's cycles with what plain steps would have taken for the same tokens.
    # Forced to a loss (plain steps estimated free), the batch size takes plain steps only for 1 call, then 2, then 4
    # (MAX_PLAIN_CALLS); a win (plain steps estimated dear) ends the pauses. Every output is the target's. These calls
    # are a few cycles long, all judged here (CALL_MIN_CYCLES).
    monkeypatch.setattr(batch_policy_domino, "MAX_PLAIN_CALLS", 4)
    monkeypatch.setattr(batch_policy_domino, "CALL_MIN_CYCLES", 1)
    plain_cost = {"seconds": 0.0}
    monkeypatch.setattr(batch_policy_domino, "plain_cycle_estimate", lambda policy, rows: plain_cost["seconds"])
    decided = []
    speculates = batching_domino.call_speculates
    monkeypatch.setattr(
        batching_domino, "call_speculates", lambda record: decided.append(speculates(record)) or decided[-1]
    )
    target = successor_target("qwen3", VOCAB)
    drafter = forcing_drafter(target, successor(1), block_size=6)
    batch = left_padded([[4, 9, 11], [20], [12, 13]])
    expected = target.generate(**batch, do_sample=False, max_new_tokens=12)
    for call in range(12):
        if call == 10:
            plain_cost["seconds"] = 1e9
        output = target.generate(**batch, do_sample=False, max_new_tokens=12, assistant_model=drafter)
        assert torch.equal(output, expected)
        stats = drafter.last_generation_stats
        assert any(stats.drafted) == decided[-1], call  # a speculating call drafts (every draft is right)
    assert "".join("s" if s else "p" for s in decided) == "spsppsppppss"


def test_a_call_whose_speculation_loses_takes_plain_steps_for_the_rest_of_it(monkeypatch):
    # Checked every 3 cycles (CALL_CHECK_CYCLES), a call whose cycles so far lost to plain steps (forced: plain steps
    # estimated free) stops drafting at the first check and takes plain steps to its end; it still counts as a
    # speculating call that lost, so the next call of its batch size takes plain steps only; once plain steps are
    # estimated dear, a call drafts past its checks. Every output is the target's.
    monkeypatch.setattr(batch_policy_domino, "CALL_CHECK_CYCLES", 3)
    monkeypatch.setattr(batch_policy_domino, "MAX_PLAIN_CALLS", 4)
    monkeypatch.setattr(batch_policy_domino, "CALL_MIN_CYCLES", 1)
    plain_cost = {"seconds": 0.0}
    monkeypatch.setattr(batch_policy_domino, "plain_cycle_estimate", lambda policy, rows: plain_cost["seconds"])
    target = successor_target("qwen3", VOCAB)
    drafter = forcing_drafter(target, successor(1), block_size=4)  # 3 drafts per block, all right
    batch = left_padded([[4, 9, 11], [20], [12, 13]])
    expected = target.generate(**batch, do_sample=False, max_new_tokens=24)

    def drafted_per_cycle() -> list[bool]:
        output = target.generate(**batch, do_sample=False, max_new_tokens=24, assistant_model=drafter)
        assert torch.equal(output, expected)
        drafted = drafter.last_generation_stats.drafted  # one entry per row and cycle; the 3 rows end together
        return [any(drafted[i : i + 3]) for i in range(0, len(drafted), 3)]

    losing = drafted_per_cycle()
    assert any(losing[:3]) and not any(losing[3:]) and len(losing) > 6, losing
    assert not any(drafted_per_cycle())  # the pause after a losing call
    plain_cost["seconds"] = 1e9
    winning = drafted_per_cycle()
    assert any(winning[3:]) and len(winning) < len(losing), winning

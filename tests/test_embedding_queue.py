"""BucketQueue (engine/embedding_queue.py): which bucket runs next, merging, compiled batch
sizes, timeouts, deadlines and the cost table they plan with (engine/embedding_cost.py). No threads and no sleeps: time is the `now` each call is given."""

from __future__ import annotations

import math
import random

import pytest

from bucketserve.engine.embedding_cost import CostTable
from bucketserve.engine.embedding_queue import (
    COST_MARGIN,
    GUARD_DECAY,
    WAIT_MIN_BUSY,
    WAKE_SLACK_S,
    BucketQueue,
    finish_by,
)


class Req:
    def __init__(self) -> None:
        self.done = False


def make(**kw) -> BucketQueue:
    args = dict(boundaries=(4, 8, 16), preferred_batch_size=4, max_batch_tokens=64,
                max_queue_delay_s=0.010)
    args.update(kw)
    return BucketQueue(**args)


def ids(first: int, n: int) -> list[int]:
    return [first] + [1] * (n - 1)


def firsts(batch) -> list[int]:
    return [item.ids[0] for item in batch.items]


def queued(q: BucketQueue) -> dict[int, int]:
    """Queued inputs per bucket length (empty buckets left out)."""
    return {length: b.live for length, b in q._buckets.items() if b.live}


def test_a_bucket_waits_for_its_delay_or_its_capacity():
    q = make()
    q.add(Req(), [ids(1, 3), ids(2, 3)], 0, now=100.0)
    assert q.pop_batch(100.005) is None
    assert q.next_wake(100.005) == 100.010
    batch = q.pop_batch(100.010)
    assert (batch.length, firsts(batch)) == (4, [1, 2])
    # four inputs of one bucket fill it: ready at once, without the delay
    q.add(Req(), [ids(i, 6) for i in range(10, 14)], 0, now=200.0)
    assert q.next_wake(200.0) == 200.0
    batch = q.pop_batch(200.0)
    assert (batch.length, firsts(batch)) == (8, [10, 11, 12, 13])
    assert q.pop_batch(1e9) is None and q.next_wake(1e9) is None


def test_token_budget_caps_a_batch():
    q = make(max_batch_tokens=32)  # bucket 16 holds 2 inputs, bucket 4 still 4
    assert [q.capacity(b) for b in (4, 8, 16)] == [4, 4, 2]
    q.add(Req(), [ids(i, 10) for i in range(3)], 0, now=0.0)
    assert [firsts(q.pop_batch(0.0))] == [[0, 1]]
    assert q.pop_batch(0.0) is None  # one left: waits for the delay
    assert firsts(q.pop_batch(0.01)) == [2]


def test_priority_then_arrival_and_fcfs():
    for use_priority, order in ((True, [4, 3, 1, 2]), (False, [1, 2, 3, 4])):
        q = make(preferred_batch_size=1, use_priority=use_priority)
        for first, prio in ((1, 5), (2, 5), (3, 0), (4, -1)):
            q.add(Req(), [ids(first, 2)], prio, now=float(first))
        got = [firsts(q.pop_batch(10.0))[0] for _ in range(4)]
        assert got == order, use_priority


def test_the_bucket_with_the_best_input_runs_first():
    q = make(preferred_batch_size=2)
    q.add(Req(), [ids(2, 3), ids(3, 3)], 0, now=1.0)  # bucket 4, full
    q.add(Req(), [ids(1, 12)], 0, now=1.995)  # bucket 16, ready at 2.005
    q.add(Req(), [ids(4, 7)], -1, now=2.0)  # bucket 8, best priority, ready at 2.01
    assert firsts(q.pop_batch(2.0)) == [2, 3]  # bucket 16 not ready yet (delay), 4 is full
    assert firsts(q.pop_batch(2.02)) == [4]  # both ready: priority -1 wins
    assert firsts(q.pop_batch(2.02)) == [1]


def test_merging_within_the_padding_bound():
    q = make(max_merged_padding=0.25)
    q.add(Req(), [ids(10, 8), ids(11, 7), ids(12, 4), ids(13, 2), ids(14, 16)], 0, now=0.0)
    batch = q.pop_batch(1.0)
    # bucket 8 runs (earliest input), topped up with the 4-token input: 1 - 19/24 = 0.21
    assert (batch.length, firsts(batch), batch.merged) == (8, [10, 11, 12], True)
    assert [firsts(q.pop_batch(1.0)) for _ in range(2)] == [[13], [14]]


def test_graph_sizes_cut_a_batch_instead_of_padding_rows():
    # sizes 1, 2, 4, 8: five inputs would run at 8 (3 padding rows, waste >= 3/8): cut to 4
    q = make(preferred_batch_size=8, max_batch_tokens=128, graph_sizes=[1, 2, 4, 8])
    q.add(Req(), [ids(i, 4) for i in range(5)], 0, now=0.0)
    batch = q.pop_batch(1.0)
    assert firsts(batch) == [0, 1, 2, 3] and q.padded_size(batch.size) == 4
    assert firsts(q.pop_batch(1.0)) == [4]
    # within the bound, padding rows are accepted: 7 inputs at 8 rows, 1 - 28/32 = 0.125
    q = make(preferred_batch_size=8, max_batch_tokens=128, graph_sizes=[1, 2, 4, 8],
             max_merged_padding=0.2)
    q.add(Req(), [ids(i, 4) for i in range(7)], 0, now=0.0)
    batch = q.pop_batch(1.0)
    assert batch.size == 7 and q.padded_size(7) == 8
    # above the largest size: eager, its own size
    q = make(preferred_batch_size=16, max_batch_tokens=128, graph_sizes=[1, 2, 4, 8])
    q.add(Req(), [ids(i, 4) for i in range(11)], 0, now=0.0)
    assert q.pop_batch(1.0).size == 11 and q.padded_size(11) == 11


def test_cut_inputs_go_back_in_arrival_order_and_merges_are_undone():
    q = make(preferred_batch_size=8, max_batch_tokens=128, graph_sizes=[1, 2, 4, 8],
             max_merged_padding=0.2)
    # bucket 8: 5 inputs of 8 tokens (earliest), bucket 4: one of 3 tokens
    q.add(Req(), [ids(i, 8) for i in range(5)], 0, now=0.0)
    q.add(Req(), [ids(9, 3)], 0, now=0.5)
    batch = q.pop_batch(1.0)
    # merged to 6 rows (1 - 43/48 = 0.10), but at 8 rows 1 - 43/64 = 0.33: cut to 4
    assert firsts(batch) == [0, 1, 2, 3] and not batch.merged and batch.length == 8
    assert queued(q) == {4: 1, 8: 1}
    batch = q.pop_batch(1.0)  # 8 and 3 tokens: 2 rows at length 8, 1 - 11/16 = 0.31 > 0.2
    assert firsts(batch) == [4]
    assert firsts(q.pop_batch(1.0)) == [9]


def test_dead_inputs_are_skipped_and_swept():
    q = make()
    dead, live = Req(), Req()
    q.add(dead, [ids(1, 3), ids(2, 3), ids(3, 12)], 0, now=0.0)
    q.add(live, [ids(4, 3)], 0, now=0.0)
    dead.done = True
    assert firsts(q.pop_batch(1.0)) == [4]  # skipped at the head without a sweep
    assert q.pop_batch(1.0) is None and queued(q) == {}
    q2 = make()
    q2.add(dead, [ids(1, 3), ids(2, 3), ids(3, 12)], 0, now=0.0)
    q2.add(live, [ids(4, 3)], 0, now=0.0)
    q2.mark_dead()
    assert queued(q2) == {4: 1}
    assert firsts(q2.pop_batch(1.0)) == [4]
    assert q2.pop_batch(1.0) is None and queued(q2) == {}


def test_expired_names_each_late_request_once():
    q = make(queue_timeout_s=5.0)
    a, b = Req(), Req()
    q.add(a, [ids(1, 3), ids(2, 12)], 0, now=0.0)
    q.add(b, [ids(3, 3)], 0, now=4.0)
    assert q.expired(4.5) == []
    assert q.expired(6.0) == [a]
    a.done = True
    assert q.expired(9.5) == [b]


def test_a_large_queue_drains_each_input_once_within_capacity():
    rng = random.Random(0)
    boundaries = tuple(range(8, 257, 8))
    q = BucketQueue(boundaries, 64, 8192, 0.005, max_merged_padding=0.1,
                    graph_sizes=[1, 2, 4, 8, 16, 32, 64])
    lengths = [rng.randint(3, 256) for _ in range(5000)]
    req = Req()
    q.add(req, [ids(i, n) for i, n in enumerate(lengths)], 0, now=0.0)
    seen = []
    computed = useful = 0
    while (batch := q.pop_batch(1.0)) is not None:
        assert batch.size <= q.capacity(batch.length)
        assert all(q.spec.lookup(item.length) <= batch.length for item in batch.items)
        seen += [item.index for item in batch.items]
        computed += q.padded_size(batch.size) * batch.length
        useful += sum(item.length for item in batch.items)
    assert sorted(seen) == list(range(len(lengths)))
    assert 1 - useful / computed < 0.05  # 8-token buckets, padding rows cut: a few percent


# ------------------------------------------------------------------ deadlines (point 7)
class FixedCost(CostTable):
    """A cost table whose prediction is a given function of (length, rows)."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def predict(self, length: int, rows: int, inputs: int | None = None) -> float:
        return self.fn(length, rows)


def sublinear(length: int, rows: int) -> float:
    """10 ms a row up to 3 rows, a full batch of 4 as 3: batching pays (WAIT_GAIN)."""
    return 0.010 * min(rows, 3)


def planned(cost: float) -> float:
    """The time a job of predicted `cost` seconds is planned with."""
    return cost * (1 + COST_MARGIN) + WAKE_SLACK_S


def test_slo_bucket_waits_until_the_deadline_allows_the_predicted_cost():
    # 10 ms per row: one input at t=0, SLO 100 ms -> deadline 90 ms, start 90 - planned(10)
    q = make(latency_slo_s=0.100, cost=FixedCost(sublinear))
    q.add(Req(), [ids(1, 3)], 0, now=0.0)
    start = finish_by(0.0, 0.100) - planned(0.010)
    assert q.next_wake(0.0) == pytest.approx(start)
    assert q.pop_batch(0.011) is None  # past max_queue_delay_s (10 ms): not used with an SLO
    assert q.pop_batch(start - 1e-6) is None
    assert firsts(q.pop_batch(start)) == [1]


def test_a_bucket_waits_only_where_a_fuller_batch_is_cheaper_per_input():
    # CPU-like: short inputs cost a fixed 8 ms a batch plus 0.5 ms each (batching pays),
    # long ones 40 ms each (a forward in proportion to its tokens: waiting buys nothing)
    cost = FixedCost(lambda length, rows: 0.008 + 0.0005 * rows if length == 4 else 0.040 * rows)
    q = make(latency_slo_s=0.500, cost=cost)
    q.add(Req(), [ids(1, 3)], 0, now=0.0)
    q.add(Req(), [ids(2, 12)], 0, now=0.0)
    assert q.waiting_pays(4, 1) and not q.waiting_pays(16, 1)
    starts = q.start_times()
    assert starts[16] == -math.inf and starts[4] > 0.3
    assert firsts(q.pop_batch(0.0)) == [2]  # the long input runs at once
    assert q.pop_batch(0.0) is None  # the short one waits for company
    # alone now, the short bucket no longer plans the long job ahead of it: it starts later
    assert q.next_wake(0.0) == pytest.approx(q.start_times()[4]) and q.next_wake(0.0) > starts[4]
    # nothing measured yet: the table cannot tell, so the bucket waits as before
    q = make(latency_slo_s=0.500)
    assert q.waiting_pays(16, 1)


def run_full_batches(q: BucketQueue, first_end: float, n: int, seconds: float) -> float:
    """n full batches of bucket 4, back to back, `seconds` each; returns the last end."""
    end = first_end
    for i in range(n):
        q.add(Req(), [ids(100 + 4 * i + k, 3) for k in range(4)], 0, now=end - seconds)
        batch = q.pop_batch(end - seconds)  # full: ready at once
        assert batch is not None and batch.size == 4
        q.batch_done(batch, 4, seconds, end=end)
        end += seconds
    return end - seconds


def test_an_idle_worker_waits_for_nothing_a_busy_one_waits_for_fuller_batches():
    # batching pays here (sublinear), so only the worker's busy share decides
    idle = make(latency_slo_s=0.100, cost=FixedCost(sublinear))
    assert idle.busy_share(0.0) is None  # nothing ran yet
    last = run_full_batches(idle, 1.0, 1, 0.010)
    assert idle.busy_share(last) == pytest.approx(1.0)
    assert idle.busy_share(2.0) < 0.01  # one 10 ms batch in the last second
    idle.add(Req(), [ids(1, 3)], 0, now=2.0)
    assert idle.start_times(2.0) == {4: -math.inf}
    assert firsts(idle.pop_batch(2.0)) == [1]  # at once, as a fixed delay of 0 would
    assert idle.start_times() == {}  # (nothing queued)

    busy = make(latency_slo_s=0.100, cost=FixedCost(sublinear))
    last = run_full_batches(busy, 1.0, 40, 0.010)
    assert busy.busy_share(last) > 0.99 and busy.busy_share(last) >= WAIT_MIN_BUSY
    busy.add(Req(), [ids(10 + k, 12) for k in range(4)], 0, now=last)
    running = busy.pop_batch(last)  # a full batch of another bucket, still running
    assert running.size == 4 and running.length == 16
    busy.add(Req(), [ids(1, 3)], 0, now=last)
    assert busy.pop_batch(last) is None  # waits for company within its deadline
    wake = busy.next_wake(last)
    assert last < wake < finish_by(last, 0.100)
    assert busy.pop_batch(last + 0.03) is None  # still waiting: a batch is running
    # that batch ends: an idle worker waits at most the longest recent batch (11 ms) more
    busy.batch_done(running, 4, 0.011, end=last + 0.031)
    assert busy.busy_share(last + 0.031) >= WAIT_MIN_BUSY
    assert busy.next_wake(last + 0.031) == pytest.approx(last + 0.042)
    assert busy.pop_batch(last + 0.041) is None
    assert firsts(busy.pop_batch(last + 0.042)) == [1]
    # the share decays while the worker idles
    assert busy.busy_share(last + 0.03) > busy.busy_share(last + 0.3)
    assert busy.busy_share(last + 0.3) < WAIT_MIN_BUSY


def test_a_growing_batch_moves_its_start_earlier_and_a_full_one_runs_at_once():
    q = make(latency_slo_s=0.100, cost=FixedCost(sublinear))
    q.add(Req(), [ids(1, 3)], 0, now=0.0)
    q.add(Req(), [ids(2, 3), ids(3, 3)], 0, now=0.020)
    # the oldest deadline (90 ms) now has to allow three rows
    start = finish_by(0.0, 0.100) - planned(0.030)
    assert q.next_wake(0.020) == pytest.approx(start)
    assert q.pop_batch(start - 1e-6) is None
    q.add(Req(), [ids(4, 3)], 0, now=0.030)  # four inputs: the bucket is full
    assert q.next_wake(0.030) == 0.030
    assert firsts(q.pop_batch(0.030)) == [1, 2, 3, 4]


def test_buckets_are_planned_in_deadline_order_on_one_worker():
    # bucket 4 (deadline 90 ms, 10 ms) then bucket 16 (deadline 95 ms, 40 ms): for bucket 16
    # to finish in time, bucket 4 must start before its own latest start
    cost = FixedCost(lambda length, rows: 0.010 if length == 4 else 0.040)
    q = make(latency_slo_s=0.100, cost=cost)
    q.add(Req(), [ids(1, 3)], 0, now=0.0)
    q.add(Req(), [ids(2, 12)], 0, now=0.005)  # deadline 95 ms
    start16 = finish_by(0.005, 0.100) - planned(0.040)
    start4 = min(0.090, start16) - planned(0.010)
    assert start4 < 0.090 - planned(0.010)
    assert q.start_times() == {4: pytest.approx(start4), 16: pytest.approx(start16)}
    assert q.next_wake(0.01) == pytest.approx(start4)
    assert q.pop_batch(start4 - 1e-6) is None
    assert firsts(q.pop_batch(start4)) == [1]
    # alone now, bucket 16 keeps its own latest start
    assert q.pop_batch(start4) is None
    assert q.next_wake(start4) == pytest.approx(start16)
    assert firsts(q.pop_batch(start16)) == [2]


def test_request_deadline_without_slo_only_shortens_the_fixed_delay():
    # fixed delay 10 ms; a request deadline of 5 ms must start at once, one of 1 s waits 10 ms
    cost = FixedCost(lambda length, rows: 0.002)
    q = make(cost=cost)
    q.add(Req(), [ids(1, 3)], 0, now=0.0, deadline=finish_by(0.0, 1.0))
    q.add(Req(), [ids(2, 12)], 0, now=0.0)  # no deadline: the fixed delay
    q.add(Req(), [ids(3, 6)], 0, now=0.0, deadline=finish_by(0.0, 0.005))
    tight = finish_by(0.0, 0.005) - planned(0.002)
    assert q.next_wake(0.0) == pytest.approx(tight)
    assert firsts(q.pop_batch(tight)) == [3]
    assert q.pop_batch(0.0099) is None
    assert sorted(firsts(q.pop_batch(0.010)) + firsts(q.pop_batch(0.010))) == [1, 2]


def test_earlier_deadline_runs_first_among_ready_buckets():
    q = make(cost=FixedCost(lambda length, rows: 0.001))
    q.add(Req(), [ids(1, 3)], 0, now=0.0, deadline=5.0)  # earlier arrival, later deadline
    q.add(Req(), [ids(2, 12)], 0, now=1.0, deadline=2.0)
    assert [firsts(q.pop_batch(10.0)) for _ in range(2)] == [[2], [1]]
    q.add(Req(), [ids(3, 3)], 1, now=0.0, deadline=1.0)  # worse priority: after
    q.add(Req(), [ids(4, 12)], 0, now=0.0, deadline=2.0)
    assert [firsts(q.pop_batch(10.0)) for _ in range(2)] == [[4], [3]]


def test_dead_and_taken_inputs_leave_the_deadline_plan():
    q = make(latency_slo_s=10.0, cost=FixedCost(lambda length, rows: 0.001))
    dead = Req()
    q.add(dead, [ids(1, 3)], 0, now=0.0, deadline=0.5)
    q.add(Req(), [ids(2, 3)], 0, now=0.0)  # the SLO's deadline, 9 s
    dead.done = True
    assert q.start_times()[4] == pytest.approx(finish_by(0.0, 10.0) - planned(0.001))
    assert firsts(q.pop_batch(9.0)) == [2]
    assert q.start_times() == {} and q.next_wake(9.0) is None


def test_inputs_cut_back_to_a_graph_size_keep_their_deadlines():
    q = make(preferred_batch_size=8, max_batch_tokens=128, graph_sizes=[1, 2, 4, 8],
             latency_slo_s=1.0,
             cost=FixedCost(lambda length, rows: 0.001 * rows if rows < 8 else 0.006))
    q.add(Req(), [ids(i, 4) for i in range(5)], 0, now=0.0)
    start = finish_by(0.0, 1.0) - planned(0.006)  # five rows are planned at graph size 8
    assert firsts(q.pop_batch(start)) == [0, 1, 2, 3]  # 3 padding rows of 8: cut to 4
    # the input cut off is queued again with its deadline, now planned as one row
    alone = finish_by(0.0, 1.0) - planned(0.001)
    assert q.start_times() == {4: pytest.approx(alone)}
    assert q.pop_batch(alone - 1e-6) is None
    assert firsts(q.pop_batch(alone)) == [4]


def test_slo_must_be_finite_and_not_negative():
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="latency_slo_s"):
            make(latency_slo_s=bad)


# ------------------------------------------------------------------ the cost table
def test_cost_table_moving_average_per_shape():
    table = CostTable(alpha=0.5)
    assert table.predict(16, 4) == 0.0  # nothing measured
    table.observe(16, 4, 0.010)
    table.observe(16, 4, 0.020)
    assert table.predict(16, 4) == pytest.approx(0.015)
    # one other cell: the nearest shape in tokens, scaled up by the token ratio, never down
    assert table.predict(16, 8) == pytest.approx(0.030)
    assert table.predict(16, 1) == pytest.approx(0.015)


def test_cost_table_fit_predicts_unmeasured_shapes():
    def true(length, rows):  # fixed cost + per token + attention
        return 0.002 + 1e-6 * rows * length + 2e-9 * rows * length * length

    table = CostTable()
    for length in (16, 128, 512):
        for rows in (1, 8, 32):
            table.observe(length, rows, true(length, rows))
    for length, rows in ((64, 4), (256, 16), (512, 2), (8, 64)):
        assert table.predict(length, rows) == pytest.approx(true(length, rows), rel=1e-6)
    # a new measurement of an unmeasured shape becomes its cell and refits the rest
    table.observe(64, 4, 1.0)
    assert table.predict(64, 4) == 1.0
    assert table.predict(256, 16) != pytest.approx(true(256, 16), rel=1e-6)


def test_cost_table_fit_keeps_coefficients_non_negative():
    table = CostTable()
    for rows, secs in ((1, 0.005), (2, 0.005), (4, 0.005), (8, 0.005)):  # launch-bound: flat
        table.observe(32, rows, secs)
    assert table.predict(32, 3) == pytest.approx(0.005, rel=1e-6)
    assert table.predict(512, 1) >= 0.005 - 1e-9


def test_live_batches_teach_the_per_input_host_cost_the_start_up_cells_missed():
    # GPU-like start-up cells: a batch costs 0.5 ms at any size (a graph replay), so a full
    # batch looks 4x cheaper per input than one input alone
    table = CostTable()
    for rows in (1, 2, 4):
        table.observe(4, rows, 0.0005)
    q = make(latency_slo_s=0.050, cost=table)
    assert q.waiting_pays(4, 2)
    # live, every input costs 1 ms more (host work, the GIL shared with the HTTP front end)
    for n in (1, 2, 1, 2, 1, 2):
        table.observe(4, n, 0.0005 + 0.001 * n, inputs=n)
    assert table.excess(4) == pytest.approx(0.001)
    assert table.excess(8) == pytest.approx(0.001)  # no batch of its own yet: every bucket's
    # a shape no live batch ran at: the start-up cell plus the excess of its inputs
    assert table.predict(4, 4, 4) == pytest.approx(0.0045)
    assert table.predict(4, 4, 3) == pytest.approx(0.0035)  # a padding row costs no host work
    assert table.predict(4, 2, 2) == pytest.approx(0.0025)  # a live cell: its own average
    # a full batch now costs 1.125 ms an input against 1.25 ms for two: waiting does not pay
    assert not q.waiting_pays(4, 2)
    assert q.waiting_pays(4, 1)  # one input alone still pays 1.5 ms
    q.add(Req(), [ids(1, 3), ids(2, 3)], 0, now=0.0)
    assert q.start_times() == {4: -math.inf}
    # planning counts the excess too: 3 full batches of 4 and one of 2
    assert q.batch_cost(4, 14) == pytest.approx(3 * 0.0045 + 0.0025)


def test_live_batches_at_the_start_up_cost_leave_the_wait_decision_alone():
    # CPU-like: a fixed 8 ms a batch plus 0.5 ms an input; live batches cost what start-up
    # measured, so nothing is added and short inputs still wait for company
    table = CostTable()
    for rows in (1, 2, 4):
        table.observe(4, rows, 0.008 + 0.0005 * rows)
    for n in (1, 2, 3):
        table.observe(4, n, 0.008 + 0.0005 * n, inputs=n)
    assert table.excess_s == pytest.approx(0.0, abs=1e-12)
    q = make(latency_slo_s=0.500, cost=table)
    assert q.waiting_pays(4, 1) and q.waiting_pays(4, 2)
    # no start-up cells: nothing to compare with, the live cells are the model
    bare = CostTable()
    bare.observe(4, 1, 0.010, inputs=1)
    assert bare.excess_s == 0.0 and bare.predict(4, 1) == 0.010


def test_under_overload_a_batch_takes_the_size_of_least_cost_per_input():
    # 2-core-CPU-like: a 4 ms fixed cost a batch, per-token work, and per-token work growing
    # with the batch (out of cache): at L=16 per input 4/B + 0.1 + 0.0625 B ms, least at 8 of
    # cap 16; at L=4 the fixed cost dominates up to cap
    def cost(length, rows):
        scale = length / 16
        return 0.004 + 1e-4 * rows * scale + 6.25e-5 * rows * rows * scale

    def drain(q: BucketQueue, now: float) -> list[int]:
        q.add(Req(), [ids(i, 12) for i in range(20)], 0, now=now)
        sizes = []
        while (batch := q.pop_batch(now + 100.0)) is not None:
            sizes.append(batch.size)
        return sizes

    kw = dict(preferred_batch_size=16, max_batch_tokens=256, cost=FixedCost(cost))
    fixed = make(max_queue_delay_s=0.0, **kw)
    slo = make(latency_slo_s=0.010, **kw)  # a 10 ms SLO: 20 queued inputs are a backlog
    assert fixed.target(16) == 16 and slo.capacity(16) == 16
    per = {b: cost(16, b) / b for b in (1, 2, 4, 8, 16)}
    assert min(per, key=per.get) == slo.target(16) == 8
    assert slo.target(4) == 16
    assert drain(fixed, 0.0) == [16, 4]
    # lost inputs and more queued work than the SLO: batches of 8 while the backlog lasts
    # (the last 4 alone are no backlog any more and run as one batch anyway)
    assert drain(slo, 0.0) == [8, 8, 4]
    # without a backlog (a long SLO) a batch takes cap(L) as before
    relaxed = make(latency_slo_s=10.0, **kw)
    assert drain(relaxed, 0.0) == [16, 4]
    assert relaxed.batch_cost(16, 20) == pytest.approx(cost(16, 16) + cost(16, 4))


def test_a_live_only_table_refits_every_few_batches_not_every_one():
    from bucketserve.engine.embedding_cost import REFIT_EVERY

    table = CostTable()
    for rows in (1, 4, 16):
        table.observe(32, rows, 0.001 * rows, inputs=rows)  # live only: no start-up cells
    assert table.predict(64, 8) == pytest.approx(0.016, rel=1e-3)  # 1 ms per 32 tokens
    # a longer bucket turns out twice as dear per token (attention-like, cost ~ B x L^2):
    # the fit waits for more batches ...
    for rows in (1, 4, 16):
        table.observe(64, rows, 0.004 * rows, inputs=rows)
    assert table.predict(64, 8) == pytest.approx(0.016, rel=1e-3)
    for _ in range(REFIT_EVERY - 3):
        table.observe(64, 16, 0.064, inputs=16)
    # ... then refits on every cell
    assert table.predict(64, 8) == pytest.approx(0.032, rel=0.02)


def test_cost_table_keeps_the_longest_recent_batch():
    table = CostTable(recent=2)
    assert table.recent_max() == 0.0
    for secs in (0.010, 0.300, 0.002, 0.001):
        table.observe(16, 1, secs)
    assert table.recent_max() == 0.002  # the 300 ms batch left the window of two


def test_a_long_recent_batch_makes_buckets_start_earlier():
    table = CostTable()
    q = make(latency_slo_s=1.0, cost=table)
    table.observe(4, 1, 0.010)
    table.observe(4, 4, 0.012)  # a full batch costs little more: waiting pays
    q.add(Req(), [ids(1, 3)], 0, now=0.0)
    assert q.start_times() == {4: pytest.approx(finish_by(0.0, 1.0) - planned(0.010) - 0.012)}
    table.observe(16, 2, 0.300)  # another bucket's long batch: it could be running then
    late = finish_by(0.0, 1.0) - planned(0.010) - 0.300
    assert q.start_times() == {4: pytest.approx(late)}
    assert q.pop_batch(late - 1e-6) is None
    assert firsts(q.pop_batch(late)) == [1]


def test_late_batches_raise_the_guard_and_on_time_ones_lower_it_slowly():
    q = make(latency_slo_s=1.0, cost=FixedCost(lambda length, rows: 0.010))
    q.add(Req(), [ids(1, 3)], 0, now=0.0)
    q.add(Req(), [ids(2, 12)], 0, now=0.0)
    d = finish_by(0.0, 1.0)
    base = q.start_times()[4]
    batch = q.pop_batch(base)
    assert q.batch_done(batch, 1, 0.050, end=d + 0.040) == 1  # ended 40 ms late
    assert q.guard_s == pytest.approx(0.040)
    assert q.cost.cells[(4, 1)] == 0.050  # the measured shape is in the table
    # the other bucket now plans 40 ms earlier (and with the 50 ms batch as blocking)
    assert q.start_times() == {16: pytest.approx(d - planned(0.010) - 0.050 - 0.040)}
    q.add(Req(), [ids(3, 3)], 0, now=0.5)
    batch = q.pop_batch(10.0)
    assert q.batch_done(batch, 1, 0.010, end=d - 0.100) == 0  # 100 ms early
    assert q.guard_s == pytest.approx(0.040 * (1 - GUARD_DECAY))
    # inputs without deadlines leave the guard alone; the guard never passes the budget
    q2 = make(cost=FixedCost(lambda length, rows: 0.010))
    q2.add(Req(), [ids(1, 3)], 0, now=0.0)
    assert q2.batch_done(q2.pop_batch(1.0), 1, 0.010, end=5.0) == 0 and q2.guard_s == 0.0
    q2.add(Req(), [ids(2, 3)], 0, now=0.0, deadline=0.5)
    assert q2.batch_done(q2.pop_batch(1.0), 1, 0.010, end=99.0) == 1
    assert q2.guard_s == pytest.approx(0.5)


# ------------------------------------------------------------------ overload (point 9)
def late_queue(backlog: bool) -> BucketQueue:
    """40 ms a batch, SLO 100 ms. Bucket 4: one input (deadline 90 ms); bucket 8: three inputs
    (deadline 140 ms); with backlog, bucket 16: one input (deadline 140 ms): 120 ms of work."""
    q = make(latency_slo_s=0.100, cost=FixedCost(lambda length, rows: 0.040))
    q.add(Req(), [ids(1, 3)], 0, now=0.0)
    q.add(Req(), [ids(2, 6), ids(3, 6), ids(4, 6)], 0, now=0.050)
    if backlog:
        q.add(Req(), [ids(5, 12)], 0, now=0.050)
    return q


def test_under_overload_the_fullest_ready_bucket_runs_first():
    # late inputs but 80 ms of work, less than the SLO: earliest deadline first
    q = late_queue(backlog=False)
    assert not q.overloaded(0.200)
    assert [firsts(q.pop_batch(0.200)) for _ in range(2)] == [[1], [2, 3, 4]]
    # 120 ms of work, deadlines lost: the fullest bucket (3 of 4) first, then (80 ms left, no
    # backlog) the earliest deadline
    q = late_queue(backlog=True)
    assert q.overloaded(0.200)
    batch = q.pop_batch(0.200)
    assert firsts(batch) == [2, 3, 4] and batch.overload
    assert not q.overloaded(0.200)
    assert [firsts(q.pop_batch(0.200)) for _ in range(2)] == [[1], [5]]
    # one lost input (bucket 16) and a backlog: buckets that could still
    # be on time (4 and 8, ready through the guard) compete on fill too
    q = late_queue(backlog=False)
    q.add(Req(), [ids(5, 12)], 0, now=-1.0)
    q.guard_s = 0.080
    assert q.overloaded(0.050)
    assert [firsts(q.pop_batch(0.050)) for _ in range(3)] == [[2, 3, 4], [5], [1]]


def test_a_lost_input_never_waits_and_a_starving_one_runs_first():
    q = make(latency_slo_s=0.100, queue_timeout_s=10.0,
             cost=FixedCost(lambda length, rows: 0.060))
    q.add(Req(), [ids(1, 3)], 0, now=0.0)
    assert q.next_wake(0.0) > 0.0 and q.pop_batch(0.0) is None  # can wait: it does
    assert q.next_wake(0.2) <= 0.2  # lost: ready, the worker does not idle
    q.add(Req(), [ids(i, 6) for i in range(10, 14)], 0, now=0.5)  # bucket 8, full
    assert q.overloaded(4.0)
    assert firsts(q.pop_batch(4.0)) == [10, 11, 12, 13]  # fullest first
    q.add(Req(), [ids(i, 6) for i in range(20, 24)], 0, now=4.5)
    # the bucket-4 input has waited 6 s > STARVE_SHARE x 10 s: ahead of the full bucket
    assert firsts(q.pop_batch(6.0)) == [1]
    assert firsts(q.pop_batch(6.0)) == [20, 21, 22, 23]


def simulate(q: BucketQueue, arrivals: list[tuple[float, int]], cost) -> tuple[int, float]:
    """One worker draining `arrivals` ((time, length), sorted) from q, each batch taking
    cost(length, rows) seconds: (batches run, time the last one ended)."""
    now, i, batches = 0.0, 0, 0
    while True:
        while i < len(arrivals) and arrivals[i][0] <= now:
            t, n = arrivals[i]
            q.add(Req(), [ids(i, n)], 0, now=t)
            i += 1
        batch = q.pop_batch(now)
        if batch is not None:
            took = cost(batch.length, q.padded_size(batch.size))
            now += took
            q.batch_done(batch, q.padded_size(batch.size), took, end=now)
            batches += 1
            continue
        wake = q.next_wake(now)
        upcoming = [x for x in (wake, arrivals[i][0] if i < len(arrivals) else None)
                    if x is not None]
        if not upcoming:
            return batches, now
        now = max(now, min(upcoming))


def test_overloaded_deadline_queue_drains_no_slower_than_fixed_delays():
    # Poisson arrivals for 4 s at about 1.35x what full batches serve (one worker, a batch
    # costs 20 ms + 1 ms per 64 tokens), lengths of two clusters as in
    # bench/embedding_slo_sweep.py: the 50 ms SLO is lost within the first second. The deadline
    # queue then runs the fullest bucket first and finishes the same work sooner than oldest-
    # first with any fixed delay (it did not before point 9: 6.01 s, fixed 5 ms 5.97 s)
    rng = random.Random(1)
    bounds = tuple(range(8, 257, 8))
    cost = lambda length, rows: 0.020 + 0.001 * rows * length / 64  # noqa: E731
    t, arrivals = 0.0, []
    while len(arrivals) < 3000:
        t += rng.expovariate(700.0)
        n = int(rng.gauss(12, 3)) if rng.random() < 0.6 else int(rng.gauss(180, 15))
        arrivals.append((t, min(max(n, 4), 220)))

    def run(**kw) -> tuple[int, float]:
        q = BucketQueue(bounds, 32, 8192, max_merged_padding=0.1, **kw)
        return simulate(q, arrivals, cost)

    _, fb_end = run(max_queue_delay_s=0.0, latency_slo_s=0.050, cost=FixedCost(cost))
    fixed = {ms: run(max_queue_delay_s=ms / 1000)[1] for ms in (0, 5, 50, 200)}
    assert fb_end < min(fixed.values()), (fb_end, fixed)


def test_add_says_when_the_wake_up_time_may_have_moved():
    """The batcher notifies its sleeping worker only when add returns True: the answer must be
    True whenever next_wake moved earlier."""
    q = make()
    assert q.add(Req(), [ids(1, 3)], 0, now=100.0)  # an empty bucket gets its first input
    wake = q.next_wake(100.001)
    assert not q.add(Req(), [ids(2, 3)], 0, now=100.001)  # same oldest input: same wake-up
    assert not q.add(Req(), [ids(3, 3)], 0, now=100.002)
    assert q.next_wake(100.002) == wake
    assert q.add(Req(), [ids(4, 3)], 0, now=100.003)  # the bucket is full: ready now
    assert q.next_wake(100.003) == 100.003
    assert q.add(Req(), [ids(5, 6)], 0, now=100.004)  # another, empty bucket
    assert q.add(Req(), [ids(6, 6)], 0, now=100.005, deadline=100.05)  # a deadline
    slo = make(latency_slo_s=0.05)
    assert slo.add(Req(), [ids(1, 3)], 0, now=0.0)
    assert slo.add(Req(), [ids(2, 3)], 0, now=0.001)  # every input has the SLO's deadline
    # randomized: whenever next_wake moved earlier, add said so
    rng = random.Random(0)
    q = make()
    now = 0.0
    for _ in range(400):
        now += rng.random() * 0.004
        before = q.next_wake(now)
        moved = q.add(Req(), [ids(0, rng.randint(1, 16)) for _ in range(rng.randint(1, 2))], 0,
                      now=now)
        after = q.next_wake(now)
        if before is None or after < before:
            assert moved
        if rng.random() < 0.3:
            q.pop_batch(now)

"""BucketQueue (engine/embedding_queue.py): which bucket runs next, merging, compiled batch
sizes, deadlines. No threads and no sleeps: time is the `now` each call is given."""

from __future__ import annotations

import random

from bucketserve.engine.embedding_queue import BucketQueue


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
    assert q.live_per_bucket() == {4: 1, 8: 1}
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
    assert q.pop_batch(1.0) is None and q.num_live == 0
    q2 = make()
    q2.add(dead, [ids(1, 3), ids(2, 3), ids(3, 12)], 0, now=0.0)
    q2.add(live, [ids(4, 3)], 0, now=0.0)
    q2.mark_dead((4, 16))
    assert q2.live_per_bucket() == {4: 1}
    assert firsts(q2.pop_batch(1.0)) == [4]
    assert q2.pop_batch(1.0) is None and q2.num_live == 0


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

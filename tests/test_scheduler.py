import time

from factories import make_requests, make_scheduler, run_to_end, update

from bucketserve.engine.sequence import FinishReason, SequenceStatus


def test_all_finish_and_pool_returns_to_initial():
    sched = make_scheduler()
    initial = sched.blocks.num_free_blocks
    seqs = make_requests(5, prompt_len=7, max_tokens=5)
    for s in seqs:
        sched.add(s)
    run_to_end(sched)
    assert all(s.finish_reason is FinishReason.LENGTH and s.num_output_tokens == 5 for s in seqs)
    assert sched.blocks.num_free_blocks == initial


def test_decodes_come_first_and_budget_is_respected():
    sched = make_scheduler(max_batched_tokens=20)
    for s in make_requests(4, prompt_len=8, max_tokens=3):
        sched.add(s)
    for batch in run_to_end(sched):
        assert batch.num_tokens <= 20
        assert all(n == 1 for n in batch.num_new_tokens[: batch.num_decodes])
        assert all(n > 1 for n in batch.num_new_tokens[batch.num_decodes:])


def test_long_prompt_is_prefilled_in_chunks():
    sched = make_scheduler(max_batched_tokens=16, boundaries=(16, 32, 64))
    (seq,) = make_requests(1, prompt_len=40, max_tokens=2)
    sched.add(seq)
    batches = run_to_end(sched)
    assert [b.num_new_tokens[0] for b in batches[:3]] == [16, 16, 8]
    assert seq.num_output_tokens == 2


def test_prompts_grouped_by_bucket():
    sched = make_scheduler(max_batched_tokens=200, boundaries=(8, 16, 32, 64))
    short = make_requests(2, prompt_len=6)
    long = make_requests(2, prompt_len=30)
    for s in (short[0], long[0], short[1], long[1]):
        sched.add(s)
    first = sched.schedule()
    assert set(first.seqs) == set(short) and first.bucket == 8


def test_preemption_by_recompute_keeps_generated_tokens():
    # 7 usable blocks of 4 tokens; two sequences growing to 16 tokens need 8 blocks.
    sched = make_scheduler(num_blocks=8, block_size=4, max_batched_tokens=64)
    seqs = make_requests(2, prompt_len=8, max_tokens=8)
    for s in seqs:
        sched.add(s)
    batches = run_to_end(sched)
    assert sum(b.num_preemptions for b in batches) > 0
    assert all(s.num_output_tokens == 8 and s.output_token_ids == [7] * 8 for s in seqs)
    assert any(s.num_preemptions > 0 for s in seqs)
    # recomputed tokens count as computed, not useful
    assert sum(b.num_tokens for b in batches) > sum(b.useful_tokens for b in batches)
    assert sum(b.useful_tokens for b in batches) == sum(s.num_tokens - 1 for s in seqs)
    assert sched.blocks.num_free_blocks == 7


def test_priority_orders_admission():
    sched = make_scheduler(max_running=1)
    low, high = make_requests(1, priority=5)[0], make_requests(1, priority=-1)[0]
    sched.add(low)
    sched.add(high)
    assert sched.schedule().seqs == [high]


def test_admitted_sequences_take_their_rank_in_the_batch():
    """The batch lists decodes, then prefill chunks, each in rank order: sequences admitted in
    this step that outrank the running ones come before them (a one-token prompt among the
    decodes, a longer one among the prefill chunks)."""
    sched = make_scheduler(max_batched_tokens=64, max_prefill_tokens=16)
    (a,) = make_requests(1, prompt_len=8, max_tokens=20, priority=5)
    sched.add(a)
    update(sched, sched.schedule(), [7])  # a decodes from now on
    (b,) = make_requests(1, prompt_len=100, max_tokens=5, priority=5)
    sched.add(b)
    batch = sched.schedule()
    assert batch.seqs == [a, b] and batch.num_new_tokens == [1, 16]
    update(sched, batch, [7, None])  # b is mid-prompt
    (h,) = make_requests(1, prompt_len=6, priority=-1)
    (h1,) = make_requests(1, prompt_len=1, priority=-1)
    sched.add(h)
    sched.add(h1)
    batch = sched.schedule()
    assert batch.seqs == [h1, a, h, b] and batch.num_new_tokens == [1, 1, 6, 16]
    assert batch.num_decodes == 2 and batch.kind == "mixed"
    assert batch.useful_tokens == 24


def test_fcfs_ignores_priority():
    sched = make_scheduler(max_running=1, policy="fcfs")
    low, high = make_requests(1, priority=5)[0], make_requests(1, priority=-1)[0]
    sched.add(low)
    sched.add(high)
    assert sched.schedule().seqs == [low]


def test_abort_takes_effect_at_next_step_and_frees_blocks():
    sched = make_scheduler()
    initial = sched.blocks.num_free_blocks
    a, b = make_requests(2, max_tokens=50)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    update(sched, batch, [7, 7])
    sched.abort(a.request_id)
    assert a.status is SequenceStatus.RUNNING  # not before the step boundary
    batch = sched.schedule()
    assert a.finish_reason is FinishReason.ABORT and batch.finished == [a]
    assert batch.seqs == [b]
    sched.abort(b.request_id)
    sched.schedule()
    assert sched.blocks.num_free_blocks == initial


def test_queue_timeout_drops_waiting_request():
    sched = make_scheduler(max_running=1)
    a, b = make_requests(2, max_tokens=50)
    b.deadline = time.monotonic() - 1
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert b.finish_reason is FinishReason.TIMEOUT and batch.finished == [b]


def test_eos_stops_only_after_min_tokens_and_not_with_ignore_eos():
    sched = make_scheduler()
    (a,) = make_requests(1, max_tokens=10, min_tokens=3)
    (b,) = make_requests(1, max_tokens=4, ignore_eos=True)
    sched.add(a)
    sched.add(b)
    run_to_end(sched, token=2)  # the fake model always says EOS
    assert a.finish_reason is FinishReason.STOP and a.num_output_tokens == 3
    assert b.finish_reason is FinishReason.LENGTH and b.num_output_tokens == 4


def _prefill_long_then_arrive(max_prefill_tokens: int | None) -> tuple[list, object, object]:
    """An 8,000-token prompt starts its prefill alone; a 1-token request arrives after the
    first step. Returns the batches run until the short one got its first token."""
    sched = make_scheduler(num_blocks=600, block_size=16, max_running=8, max_batched_tokens=2048,
                           max_model_len=8192, boundaries=(16, 512, 2048),
                           max_prefill_tokens=max_prefill_tokens)
    (long,) = make_requests(1, prompt_len=8000, max_tokens=2)
    (short,) = make_requests(1, prompt_len=1, max_tokens=1)
    sched.add(long)
    batches = [sched.schedule()]
    update(sched, batches[0], [None])
    sched.add(short)
    while short.num_output_tokens == 0:
        batch = sched.schedule()
        batches.append(batch)
        update(sched, batch, [7 if s.num_computed_tokens + n == s.num_tokens else None
                             for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)])
    return batches, long, short


def test_short_request_is_admitted_next_step_while_a_long_prompt_prefills():
    batches, long, short = _prefill_long_then_arrive(max_prefill_tokens=512)
    assert batches[0].num_new_tokens == [512]  # the long prompt never takes the whole step
    # the step right after its arrival runs the short request, next to the long prompt's chunk
    assert batches[1].seqs == [short, long] and batches[1].num_new_tokens == [1, 512]
    assert short.num_output_tokens == 1 and long.num_computed_tokens == 1024


def test_without_the_chunk_limit_one_long_prompt_holds_every_step():
    """The behaviour the limit fixes: the short request waits out the whole prefill."""
    batches, long, short = _prefill_long_then_arrive(max_prefill_tokens=None)
    # admitted only into the last chunk's leftover room, three whole steps after it arrived
    assert [b.num_new_tokens for b in batches] == [[2048], [2048], [2048], [1, 1856]]
    assert batches[3].seqs[0] is short


def run_pipelined(sched, token_at, max_steps: int = 10_000) -> list:
    """Steps as overlapped scheduling does: step N+1 is scheduled and launched before step
    N's tokens reach the host. token_at(seq, k) is the token a fake model samples as the
    sequence's k-th output. Returns the batches."""
    batches, inflight = [], None
    for _ in range(max_steps):
        if inflight is None and not sched.has_unfinished():
            return batches
        batch = sched.schedule()
        launched = None
        if not batch.is_empty:
            batches.append(batch)
            samples = [i for i, (s, n) in enumerate(zip(batch.seqs, batch.num_new_tokens,
                                                         strict=True))
                       if s.num_computed_tokens + n == s.num_tokens + s.num_pending]
            # the k-th output token of each sampling sequence, fixed at launch
            tokens = [token_at(batch.seqs[i], batch.seqs[i].num_output_tokens
                               + batch.seqs[i].num_pending) for i in samples]
            sched.on_launched(batch, samples)
            launched = (batch, samples, tokens)
        if inflight is not None:
            prev, samples, tokens = inflight
            for i, tok in zip(samples, tokens, strict=True):
                sched.on_sampled(prev.seqs[i], tok)
        inflight = launched
    raise AssertionError("scheduler did not finish")


def test_pipelined_steps_learn_stops_one_step_late():
    """A decode is scheduled on its pending token; its EOS is learnt one step late and the
    token computed for it meanwhile is dropped; max_tokens is known ahead, so a sequence whose
    pending token is its last is not scheduled again; every block comes back."""
    sched = make_scheduler()
    initial = sched.blocks.num_free_blocks
    eos_seq, long_seq = make_requests(2, prompt_len=6, max_tokens=6)
    for s in (eos_seq, long_seq):
        sched.add(s)

    def token_at(seq, k):
        return 2 if seq is eos_seq and k == 2 else 7  # EOS (id 2) as eos_seq's 3rd token

    batches = run_pipelined(sched, token_at)
    assert eos_seq.output_token_ids == [7, 7, 2] and eos_seq.finish_reason is FinishReason.STOP
    assert long_seq.output_token_ids == [7] * 6 and long_seq.finish_reason is FinishReason.LENGTH
    assert sched.blocks.num_free_blocks == initial
    # eos_seq ran once more after its EOS was sampled (the late stop), never twice
    steps_with = [b for b in batches if eos_seq in b.seqs]
    assert len(steps_with) == 1 + 3  # its prefill, then decodes on outputs 1, 2 and 3 (EOS)
    # long_seq: prefill + 5 decodes; not scheduled on its 6th (last) pending token
    assert sum(long_seq in b.seqs for b in batches) == 6
    assert long_seq.num_pending == 0


def test_on_sampled_drops_tokens_of_finished_sequences():
    sched = make_scheduler()
    (seq,) = make_requests(1, prompt_len=6, max_tokens=8)
    sched.add(seq)
    batch = sched.schedule()
    sched.on_launched(batch, [0])
    assert seq.num_pending == 1 and seq.num_uncomputed_tokens == 1
    sched.finish(seq, FinishReason.ABORT)  # aborted while its token is in flight
    assert sched.on_sampled(seq, 7) is False
    assert seq.output_token_ids == [] and seq.finish_reason is FinishReason.ABORT

from factories import make_requests, make_scheduler, run_to_end, update

from bucketserve.engine.block_manager import BlockManager
from bucketserve.engine.sequence import SamplingParams, Sequence


def test_allocate_covers_tokens_and_free_restores_pool():
    bm = BlockManager(num_blocks=10, block_size=4)
    assert bm.num_free_blocks == 9  # block 0 is the dummy
    seq = make_requests(1, prompt_len=9)[0]
    assert bm.num_blocks_needed(seq, 9) == 3
    assert bm.can_allocate(seq, 9)
    bm.allocate(seq, 9)
    assert len(seq.block_table) == 3 and 0 not in seq.block_table
    assert bm.num_free_blocks == 6
    seq.num_computed_tokens = 9
    assert bm.num_blocks_needed(seq, 3) == 0  # fits in the last block's free slots
    assert bm.num_blocks_needed(seq, 4) == 1
    bm.free(seq)
    assert bm.num_free_blocks == 9 and seq.block_table == []


def test_can_allocate_refuses_when_pool_is_short():
    bm = BlockManager(num_blocks=3, block_size=4)
    seq = make_requests(1, prompt_len=9)[0]
    assert not bm.can_allocate(seq, 9)
    try:
        bm.allocate(seq, 9)
    except RuntimeError:
        pass
    else:
        raise AssertionError("allocate beyond the pool must fail")


# ---- prefix cache ----------------------------------------------------------------------


def seq_of(tokens: list[int]) -> Sequence:
    return Sequence(list(tokens), SamplingParams(max_tokens=4))


def admit(bm: BlockManager, seq: Sequence) -> list[int]:
    """What the scheduler does for a waiting sequence; returns the cached prefix it took."""
    prefix = bm.lookup(seq)
    n = seq.num_tokens - len(prefix) * bm.block_size
    assert bm.can_allocate(seq, n, prefix)
    bm.allocate(seq, n, prefix)
    return prefix


def compute(bm: BlockManager, seq: Sequence) -> None:
    """The step that writes the sequence's K/V, then its registration."""
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_computed(seq)


TOKENS = list(range(100, 140))  # 10 blocks of 4


def test_caching_off_shares_nothing():
    bm = BlockManager(num_blocks=32, block_size=4)
    a, b = seq_of(TOKENS[:12]), seq_of(TOKENS[:12])
    admit(bm, a)
    compute(bm, a)
    assert bm.lookup(b) == [] and bm.num_cached_blocks == 0
    bm.free(a)
    assert bm.num_free_blocks == 31 and bm.num_evictable_blocks == 0
    assert bm.query_tokens == bm.hit_tokens == 0


def test_shared_prefix_is_ref_counted_and_stays_cached_after_free():
    bm = BlockManager(num_blocks=32, block_size=4, enable_caching=True)
    a = seq_of(TOKENS[:10])  # 2 full blocks + 2 tokens
    assert admit(bm, a) == []
    compute(bm, a)
    assert bm.num_cached_blocks == 2  # the partial third block is not cached
    b = seq_of(TOKENS[:8] + [7, 7, 7, 7, 7])  # shares a's 2 full blocks, then differs
    assert admit(bm, b) == a.block_table[:2]
    assert b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert b.block_table[2] not in a.block_table
    assert [bm.ref_counts[x] for x in a.block_table] == [2, 2, 1]
    compute(bm, b)
    used = bm.num_used_blocks
    bm.free(a)
    assert [bm.ref_counts[x] for x in b.block_table[:2]] == [1, 1]
    assert bm.num_used_blocks == used - 1  # only a's own third block went back
    assert bm.num_evictable_blocks == 0  # the shared ones are still held by b
    bm.free(b)
    # nothing held; b's 3rd block is full and computed (13 tokens): cached too
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 31
    assert bm.num_cached_blocks == bm.num_evictable_blocks == 3
    c = seq_of(TOKENS[:8] + [7, 7, 7, 7, 9])
    assert len(admit(bm, c)) == 3  # evictable blocks are reused, not recomputed
    assert bm.num_evictable_blocks == 0


def test_only_computed_blocks_are_reused():
    bm = BlockManager(num_blocks=32, block_size=4, enable_caching=True)
    a = seq_of(TOKENS[:20])
    admit(bm, a)
    a.num_computed_tokens = 9  # a chunk of 9 tokens ran: 2 full blocks written
    bm.cache_computed(a)
    b = seq_of(TOKENS[:20])
    assert bm.lookup(b) == a.block_table[:2]
    a.num_computed_tokens = 20
    bm.cache_computed(a)
    assert bm.lookup(b) == a.block_table[:4]  # all but the last block (last token computed)


def test_whole_prompt_cached_recomputes_last_block_into_a_fresh_block():
    bm = BlockManager(num_blocks=32, block_size=4, enable_caching=True)
    a = seq_of(TOKENS[:8])
    admit(bm, a)
    compute(bm, a)
    b = seq_of(TOKENS[:8])
    prefix = admit(bm, b)
    assert prefix == a.block_table[:1]
    assert b.num_computed_tokens == 4  # the last block's 4 tokens run again
    assert b.block_table[1] != a.block_table[1]  # written into its own block, never a's
    compute(bm, b)
    assert bm.block_hash[b.block_table[1]] is None  # a duplicate: a's copy stays the cached one
    bm.free(b)
    assert b.block_table == [] and bm.num_cached_blocks == 2


def test_duplicates_computed_at_once_keep_one_cached_copy():
    bm = BlockManager(num_blocks=32, block_size=4, enable_caching=True)
    a, b = seq_of(TOKENS[:12]), seq_of(TOKENS[:12])
    admit(bm, a)
    admit(bm, b)  # admitted in the same step: nothing is registered yet
    assert b.num_cached_tokens == 0 and set(a.block_table).isdisjoint(b.block_table)
    compute(bm, a)
    compute(bm, b)
    assert bm.num_cached_blocks == 3
    bm.free(b)
    assert bm.num_evictable_blocks == 0  # b's private copies went to the free list
    bm.free(a)
    assert bm.num_evictable_blocks == 3


def test_lru_eviction_order_and_uncached_blocks_first():
    bm = BlockManager(num_blocks=8, block_size=4, enable_caching=True)  # 7 usable
    a = seq_of(TOKENS[:8])  # 2 blocks
    b = seq_of(TOKENS[20:28])  # 2 blocks, other tokens
    for s in (a, b):
        admit(bm, s)
        compute(bm, s)
    a0, a1 = a.block_table
    b0, b1 = b.block_table
    bm.free(a)  # released tail first: a1 then a0
    bm.free(b)
    c = seq_of(TOKENS[:4] + [5, 5, 5, 5, 5])  # touches a0 again
    assert admit(bm, c) == [a0]
    compute(bm, c)
    c1, c2 = c.block_table[1:]  # c1 full (cached), c2 partial (not cached)
    bm.free(c)  # tail first: c2 to the free list, c1 then a0 to the evictable end
    assert list(bm._evictable) == [a1, b1, b0, c1, a0]
    assert bm.num_free_blocks - bm.num_evictable_blocks == 2  # never-cached: c2 and one more
    d = seq_of(list(range(500, 520)))  # 5 blocks, nothing cached
    admit(bm, d)
    # the two uncached blocks first, then the three least recently released cached ones
    assert d.block_table[0] == c2 and d.block_table[2:] == [a1, b1, b0]
    assert bm.lookup(seq_of(TOKENS[20:28] + [1])) == []  # b's blocks left the cache
    assert bm.lookup(seq_of(TOKENS[:9])) == [a0]  # a0 survived, a1 was evicted
    assert bm.num_cached_blocks == 2  # a0 and c1


def test_can_allocate_counts_prefix_blocks_taken_off_the_evictable_list():
    bm = BlockManager(num_blocks=6, block_size=4, enable_caching=True)  # 5 usable
    a = seq_of(TOKENS[:16])
    admit(bm, a)
    compute(bm, a)
    bm.free(a)  # 4 evictable + 1 free
    fits = seq_of(TOKENS[:16] + [1, 2, 3, 4])  # 4 cached blocks + 1 new
    prefix = bm.lookup(fits)
    assert len(prefix) == 4 and bm.can_allocate(fits, 4, prefix)
    too_big = seq_of(TOKENS[:16] + [1, 2, 3, 4, 5])  # needs 2 new: would evict its own prefix
    prefix = bm.lookup(too_big)
    assert len(prefix) == 4 and not bm.can_allocate(too_big, 5, prefix)


def test_hit_accounting_in_tokens():
    bm = BlockManager(num_blocks=32, block_size=4, enable_caching=True)
    a = seq_of(TOKENS[:10])
    admit(bm, a)
    compute(bm, a)
    assert (bm.query_tokens, bm.hit_tokens) == (10, 0)
    b = seq_of(TOKENS[:14])  # a's 2 full blocks hit; a's 3rd block was partial
    admit(bm, b)
    assert (bm.query_tokens, bm.hit_tokens) == (24, 8)
    assert bm.lookup(seq_of(TOKENS[:14])) and (bm.query_tokens, bm.hit_tokens) == (24, 8), \
        "a lookup alone (a sequence that is not admitted) counts nothing"


def test_generated_tokens_full_blocks_are_cached():
    bm = BlockManager(num_blocks=32, block_size=4, enable_caching=True)
    a = seq_of(TOKENS[:6])
    admit(bm, a)
    compute(bm, a)
    for t in (50, 51, 52):  # decode: a token is sampled, then computed in the next step
        a.token_ids.append(t)
        bm.allocate(a, 1)
        compute(bm, a)
    assert bm.num_cached_blocks == 2  # 9 tokens: blocks [0:4] and [4:8]
    follow_up = seq_of(TOKENS[:6] + [50, 51, 52, 60])  # the next turn of the conversation
    assert bm.lookup(follow_up) == a.block_table[:2]


def test_scheduler_counts_only_the_uncached_suffix():
    sched = make_scheduler(num_blocks=64, block_size=4, max_batched_tokens=64,
                           boundaries=(8, 16, 32, 64), prefix_caching=True)
    first = seq_of(TOKENS[:32])
    sched.add(first)
    run_to_end(sched)
    second = seq_of(TOKENS[:32] + [1, 2, 3])
    sched.add(second)
    batch = sched.schedule()
    assert batch.seqs == [second] and batch.num_new_tokens == [3]
    assert batch.bucket == 8  # the bucket of the 3 computed tokens, not of 35
    assert batch.useful_tokens == 3
    assert sched.blocks.hit_tokens == 32


def test_request_arriving_during_prefill_reuses_only_computed_blocks():
    sched = make_scheduler(num_blocks=64, block_size=4, max_batched_tokens=24,
                           boundaries=(8, 16, 32, 64), prefix_caching=True)
    long = seq_of(TOKENS)  # 40 tokens: two chunks of 24 and 16
    sched.add(long)
    batch = sched.schedule()
    assert batch.num_new_tokens == [24]
    update(sched, batch, [None])
    late = seq_of(TOKENS)
    sched.add(late)
    batch = sched.schedule()  # long's second chunk (16) and late, from long's 6 computed blocks
    assert batch.seqs == [long, late] and batch.num_new_tokens == [16, 8]
    assert late.num_cached_tokens == 24
    assert late.block_table[:6] == long.block_table[:6]
    # blocks 6.. of long are being written in this very step: late gets its own
    assert set(late.block_table[6:]).isdisjoint(long.block_table)
    update(sched, batch, [7, None])
    run_to_end(sched)
    assert sched.blocks.num_used_blocks == 0


def test_abort_and_preemption_release_shared_blocks_to_the_cache():
    sched = make_scheduler(num_blocks=64, block_size=4, max_batched_tokens=64,
                           boundaries=(8, 16, 32, 64), prefix_caching=True)
    bm = sched.blocks
    a = seq_of(TOKENS[:20])
    sched.add(a)
    batch = sched.schedule()
    update(sched, batch, [7])  # a's prompt computed: 5 blocks registered, first token sampled
    b = seq_of(TOKENS[:20] + [3, 3])
    sched.add(b)
    batch = sched.schedule()  # a decodes, b starts from a's 5 blocks
    assert b.block_table[:5] == a.block_table[:5] and b.num_cached_tokens == 20
    shared = a.block_table[:5]
    assert all(bm.ref_counts[x] == 2 for x in shared)
    sched.abort(b.request_id)
    update(sched, batch, [7, 7])
    left = sched.schedule().finished
    assert left == [b] and all(bm.ref_counts[x] == 1 for x in shared)
    sched._preempt(a)  # as under memory pressure: a's blocks go back, stay cached
    assert bm.num_used_blocks == 0 and all(bm.ref_counts[x] == 0 for x in shared)
    assert set(shared) <= set(bm._evictable)
    batch = sched.schedule()  # a is readmitted from its own cached blocks
    assert a.block_table[:5] == shared and a.num_cached_tokens == 20
    assert batch.num_new_tokens == [a.num_tokens - 20]
    run_to_end(sched)
    assert bm.num_used_blocks == 0

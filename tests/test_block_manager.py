from factories import make_requests

from bucketserve.engine.block_manager import BlockManager


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


def test_fork_shares_full_blocks_with_ref_counts():
    bm = BlockManager(num_blocks=10, block_size=4)
    parent, child = make_requests(2, prompt_len=10)
    bm.allocate(parent, 10)
    parent.num_computed_tokens = 10
    bm.fork(parent, child)
    assert child.block_table == parent.block_table[:2]
    assert child.num_computed_tokens == 8
    assert all(bm.ref_counts[b] == 2 for b in child.block_table)
    bm.free(parent)
    assert bm.num_free_blocks == 9 - 2  # shared blocks stay while the child holds them
    bm.free(child)
    assert bm.num_free_blocks == 9

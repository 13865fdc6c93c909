"""Paged KV memory: which pool blocks each sequence owns. Plain Python, no tensors.

The pool has `num_blocks` blocks of `block_size` token slots. Block 0 is the dummy block
(padded slots write into it, nothing reads it), so `num_blocks - 1` blocks are usable.
Queries and commits come in pairs (`can_allocate` / `allocate`) so the scheduler can ask
before it decides; `free` returns a sequence's blocks, and reference counts let several
sequences share full blocks (`fork`), a block going back to the free list when its last
holder lets go.
"""

from __future__ import annotations

from collections import deque

from bucketserve.engine.sequence import Sequence

DUMMY_BLOCK = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV pool needs at least 2 blocks (1 is the dummy), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to add so that the sequence's table covers its computed + new tokens."""
        # (runs for every sequence every step: arithmetic inline, no helper calls)
        need = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size) - len(seq.block_table)
        return need if need > 0 else 0

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_blocks_needed(seq, num_new_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        need = self.num_blocks_needed(seq, num_new_tokens)
        if need == 0:
            return
        if need > len(self._free):
            raise RuntimeError(f"allocate() without can_allocate(): need {need}, free {len(self._free)}")
        for _ in range(need):
            block = self._free.popleft()
            self.ref_counts[block] = 1
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        # Released in reverse so the most recently used blocks are reused first.
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} freed twice"
            if self.ref_counts[block] == 0:
                self._free.appendleft(block)
        seq.block_table = []

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Share the parent's full blocks with `child` (which must hold none yet).

        Only full blocks are shared: the parent's partial last block would be written by
        both, so the child gets its own when it next allocates. The child's computed count
        is set to the shared prefix it can reuse.
        """
        assert not child.block_table
        num_full = parent.num_computed_tokens // self.block_size
        shared = parent.block_table[:num_full]
        for block in shared:
            self.ref_counts[block] += 1
        child.block_table = list(shared)
        child.num_computed_tokens = num_full * self.block_size

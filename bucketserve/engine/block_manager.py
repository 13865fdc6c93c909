"""Paged KV memory: which pool blocks each sequence owns, and the prefix cache. Plain Python,
no tensors.

The pool has `num_blocks` blocks of `block_size` token slots. Block 0 is the dummy block
(padded slots write into it, nothing reads it), so `num_blocks - 1` blocks are usable.
Queries and commits come in pairs (`can_allocate` / `allocate`) so the scheduler can ask
before it decides; `free` returns a sequence's blocks.

Automatic prefix caching (``enable_caching``):

- A full block is named by a hash of (the previous block's hash, its token ids); block 0's
  "previous hash" is a root hash of the model, dtype, block size and a random per-engine
  salt, so a name stands for the whole prefix up to the block's end and never matches KV of
  another model (or, the salt being secret, a collision crafted from outside). A sequence
  hashes each full block of its tokens once (`Sequence.block_hashes`).
- A block is registered under its hash only once its K/V is written: `cache_computed` runs
  after the step that computed it. A block still being prefilled by one sequence is thus
  never handed to another. When two sequences compute the same block at once, the first
  to register wins and the other's copy stays private (it goes back to the free list).
- `lookup` returns the longest run of registered blocks at the start of a waiting
  sequence's tokens, capped so that at least the last token is computed (sampling needs its
  logits): when every full block is cached and the tokens end on a block boundary, the last
  block is recomputed into a fresh block. Writes therefore always start on a block the
  sequence owns alone: a shared block is never written.
- Blocks are reference-counted. A block no sequence holds stays cached (evictable) until
  the pool needs it; blocks without a hash are handed out first, then cached ones, least
  recently released first. A sequence's blocks are released last-to-first, so its tail
  (the part least likely to be shared) goes before its head.
- Generated tokens' full blocks are cached as well (a later turn of a conversation, or a
  preempted sequence coming back, reuses them when its tokens match).

Counts: `num_free_blocks` is what `allocate` can hand out (never-used or freed blocks plus
evictable cached ones); `num_used_blocks` are the blocks sequences hold; `num_cached_blocks`
those registered under a hash (held or evictable). `query_tokens` / `hit_tokens` total the
prompt tokens looked up at admission and the tokens served from the cache.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict, deque

from bucketserve.engine.sequence import Sequence

DUMMY_BLOCK = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False,
                 cache_key: tuple = ()) -> None:
        """`cache_key`: whatever else changes the K/V of a token run (model name, dtype);
        mixed with a random salt into the root of every block hash."""
        if num_blocks < 2:
            raise ValueError(f"the KV pool needs at least 2 blocks (1 is the dummy), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        # blocks nobody holds and no hash names, most recently released first
        self._free: deque[int] = deque(range(1, num_blocks))
        self.enable_caching = enable_caching
        self.root_hash = hash(("bucketserve-kv", block_size, *cache_key, secrets.randbits(64)))
        self.block_hash: list[int | None] = [None] * num_blocks  # the hash a block is registered under
        self._cached: dict[int, int] = {}  # hash -> block
        # cached blocks nobody holds, least recently released first (values unused)
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.query_tokens = 0  # tokens of the sequences admitted with a lookup
        self.hit_tokens = 0  # of those, tokens whose K/V came from the cache

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - len(self._free) - len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to add so that the sequence's table covers its computed + new tokens."""
        # (runs for every sequence every step: arithmetic inline, no helper calls)
        need = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size) - len(seq.block_table)
        return need if need > 0 else 0

    def can_allocate(self, seq: Sequence, num_new_tokens: int, prefix: list[int] | None = None) -> bool:
        """Whether `allocate(seq, num_new_tokens, prefix)` would succeed. `prefix`: cached
        blocks from `lookup` the sequence (which holds no blocks yet) starts with."""
        if not prefix:
            return self.num_blocks_needed(seq, num_new_tokens) <= len(self._free) + len(self._evictable)
        bs = self.block_size
        need = -(-(len(prefix) * bs + num_new_tokens) // bs) - len(prefix)
        # a prefix block nobody holds yet is taken off the evictable list, not evicted
        pinned = sum(1 for b in prefix if self.ref_counts[b] == 0)
        return need <= len(self._free) + len(self._evictable) - pinned

    def allocate(self, seq: Sequence, num_new_tokens: int, prefix: list[int] | None = None) -> None:
        """Grows the sequence's table to cover its computed + `num_new_tokens` tokens. With
        `prefix` (a waiting sequence's `lookup`), the sequence first takes those cached
        blocks and counts their tokens as computed."""
        if prefix is not None and self.enable_caching:
            assert not seq.block_table and seq.num_computed_tokens == 0
            self.query_tokens += seq.num_tokens
            if prefix:
                self.hit_tokens += len(prefix) * self.block_size
                self._take_prefix(seq, prefix)
        need = self.num_blocks_needed(seq, num_new_tokens)
        if need == 0:
            return
        if need > len(self._free) + len(self._evictable):
            raise RuntimeError(f"allocate() without can_allocate(): need {need}, "
                               f"free {len(self._free) + len(self._evictable)}")
        table = seq.block_table
        ref = self.ref_counts
        for _ in range(need):
            block = self._free.popleft() if self._free else self._evict()
            ref[block] = 1
            table.append(block)

    def free(self, seq: Sequence) -> None:
        # Released in reverse: uncached blocks are reused most recently used first; cached
        # ones are evicted tail first.
        ref = self.ref_counts
        for block in reversed(seq.block_table):
            ref[block] -= 1
            assert ref[block] >= 0, f"block {block} freed twice"
            if ref[block] == 0:
                if self.block_hash[block] is None:
                    self._free.appendleft(block)
                else:
                    self._evictable[block] = None
        seq.block_table = []
        seq.num_registered_blocks = 0

    # ---- prefix cache ------------------------------------------------------------------

    def hash_blocks(self, seq: Sequence, num_blocks: int) -> list[int]:
        """The hashes of the sequence's first `num_blocks` full blocks (computed once each)."""
        hashes = seq.block_hashes
        if len(hashes) < num_blocks:
            bs = self.block_size
            tokens = seq.token_ids
            prev = hashes[-1] if hashes else self.root_hash
            for i in range(len(hashes), num_blocks):
                prev = hash((prev, *tokens[i * bs:(i + 1) * bs]))
                hashes.append(prev)
        return hashes

    def lookup(self, seq: Sequence) -> list[int]:
        """Cached blocks a waiting sequence can start from: the longest registered run at the
        start of its tokens, leaving at least its last token to compute. Takes nothing."""
        if not self.enable_caching:
            return []
        bs = self.block_size
        # full blocks before the last token: the last token is always computed
        usable = (seq.num_tokens - 1) // bs
        if usable == 0:
            return []
        hashes = self.hash_blocks(seq, seq.num_tokens // bs)
        cached = self._cached
        blocks: list[int] = []
        for i in range(usable):
            block = cached.get(hashes[i])
            if block is None:
                break
            blocks.append(block)
        return blocks

    def _take_prefix(self, seq: Sequence, prefix: list[int]) -> None:
        ref = self.ref_counts
        evictable = self._evictable
        for block in prefix:
            if ref[block] == 0:
                del evictable[block]
            ref[block] += 1
        seq.block_table = list(prefix)  # a new list: the CUDA inputs cache rows by identity
        cached = len(prefix) * self.block_size
        seq.num_computed_tokens = cached
        seq.num_cached_tokens = cached
        seq.num_registered_blocks = len(prefix)
        # cached tokens were not computed by this step: they are not useful work of it
        if cached > seq.num_ever_computed:
            seq.num_ever_computed = cached

    def _evict(self) -> int:
        block, _ = self._evictable.popitem(last=False)
        del self._cached[self.block_hash[block]]
        self.block_hash[block] = None
        return block

    def cache_computed(self, seq: Sequence) -> None:
        """Registers the sequence's full blocks whose K/V is now written (call after the
        step that computed them advanced `num_computed_tokens`)."""
        full = seq.num_computed_tokens // self.block_size
        start = seq.num_registered_blocks
        if full <= start or not self.enable_caching:
            return
        # never past the table (a sequence freed since the step ran holds no blocks), nor
        # past the tokens known on the host (overlapped scheduling: a pending token's id is
        # still on the device, so its block is registered at a later step)
        full = min(full, len(seq.block_table), len(seq.token_ids) // self.block_size)
        hashes = self.hash_blocks(seq, full)
        table = seq.block_table
        cached = self._cached
        block_hash = self.block_hash
        for i in range(start, full):
            block = table[i]
            h = hashes[i]
            if block_hash[block] is None and h not in cached:
                cached[h] = block
                block_hash[block] = h
        seq.num_registered_blocks = full

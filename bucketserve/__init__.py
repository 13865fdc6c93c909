"""bucketserve: an LLM/NLP inference server built on sequence-length buckets,
iteration-level scheduling over a paged KV pool, and an OpenAI-compatible API."""

import os

# Idle OpenMP threads sleep instead of spinning. PyTorch's CPU ops and bucketserve's C
# decode kernel take turns on the same cores every layer; spinning threads of one starve
# the other (and anything else on a small machine): measured on 2 cores, a decode step
# went from ~1.0 s to ~0.3 s and prefill ~5x faster. Must be set before torch loads its
# OpenMP runtime; an explicit setting in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# ...but not at once: a thread that finishes its share of one parallel region spins for
# about 0.1 ms (10,000 spins; libgomp reads GOMP_SPINCOUNT even with PASSIVE) before it
# sleeps, so that the next region of the same step (microseconds later: the next GEMM or
# C kernel) finds it awake, while between steps it still sleeps. Served on 2 cores against
# sleeping at once: 1.16-1.24x on `mixed`, 1.17-1.30x on `short` (bench/results/
# cpu_vs_vllm_layouts.json, the -spin variant).
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

__version__ = "0.1.0"

"""bucketserve: an LLM/NLP inference server built on sequence-length buckets,
iteration-level scheduling over a paged KV pool, and an OpenAI-compatible API."""

import os

# Idle OpenMP threads sleep instead of spinning. PyTorch's CPU ops and bucketserve's C
# decode kernel take turns on the same cores every layer; spinning threads of one starve
# the other (and anything else on a small machine): measured on 2 cores, a decode step
# went from ~1.0 s to ~0.3 s and prefill ~5x faster. Must be set before torch loads its
# OpenMP runtime; an explicit setting in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"

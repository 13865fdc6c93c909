"""Prefix caching on CUDA (Triton attention, decode graphs, piecewise graphs): greedy output
with caching on equals caching off, for prompts sharing none, some and all of their full
blocks, including a 1-token prefill that runs as a decode row (in a decode graph). Skipped
without a GPU."""

from __future__ import annotations

import random

import pytest
import torch
from test_engine_gpu import VOCAB, setup  # noqa: F401  (setup is a fixture)

from bucketserve.buckets import load_buckets
from bucketserve.engine.llm_engine import LLMEngine
from bucketserve.engine.sequence import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def prompts_sharing_prefixes() -> list[list[int]]:
    rng = random.Random(7)

    def rand(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    base = rand(600)
    return [base, list(base), base[:512], base[:300] + rand(77), base[:64] + rand(1), rand(200),
            base + rand(50)]


def run(loaded, tmp_path, caching: bool, cuda_graphs: bool, piecewise: bool):
    path = tmp_path / f"buckets-{caching}.toml"
    path.write_text("[scheduler]\nmax_batched_tokens = 256\nmax_running = 16\n"
                    f"[kv_cache]\nprefix_caching = {'true' if caching else 'false'}\n")
    engine = LLMEngine(loaded, load_buckets(str(path), max_model_len=2048), "cuda",
                       cuda_graphs=cuda_graphs, piecewise_graphs=piecewise)
    prompts = prompts_sharing_prefixes()
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    first = engine.generate(prompts[:1], params)  # cached before the others arrive
    rest = engine.generate(prompts[1:], params)
    bm = engine.block_manager
    assert bm.num_used_blocks == 0, "KV blocks leaked"
    return [o.token_ids for o in first + rest], engine


@pytest.mark.parametrize("cuda_graphs, piecewise", [(True, True), (True, False), (False, False)])
def test_gpu_prefix_caching_same_output(setup, tmp_path, cuda_graphs, piecewise):  # noqa: F811
    loaded, _, _ = setup
    off, _ = run(loaded, tmp_path, False, cuda_graphs, piecewise)
    on, engine = run(loaded, tmp_path, True, cuda_graphs, piecewise)
    assert on == off
    # base's 37 full blocks: 37 + 31 (aligned, last block recomputed) + 18 + 4 + 37 blocks
    assert engine.block_manager.hit_tokens == 16 * (37 + 31 + 18 + 4 + 37)

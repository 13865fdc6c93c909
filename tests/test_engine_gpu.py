"""On CUDA, the engine's greedy output equals transformers' `generate` token for token (fp32,
Triton attention), for 16 concurrent prompts of mixed lengths, with and without CUDA graphs
for the decode steps, prefill and mixed steps captured whole or piecewise, and under
preemption, with overlapped scheduling on and off (NVTX ranges on). Skipped without a GPU."""

from __future__ import annotations

import random

import pytest
import torch

from bucketserve.buckets import load_buckets
from bucketserve.engine.llm_engine import LLMEngine
from bucketserve.engine.sequence import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

LENGTHS = [8, 600, 33, 250, 9, 128, 511, 17, 64, 300, 12, 90, 450, 40, 200, 25]
MAX_TOKENS = [12, 5, 20, 9, 16, 3, 7, 24, 10, 6, 18, 11, 4, 14, 8, 21]
VOCAB = 1000


def word_tokenizer(vocab: int):
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    from bucketserve.models.tokenizer import Tokenizer

    backend = Backend(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(backend, eos_token="w2")


@pytest.fixture(scope="module")
def setup():
    from transformers import LlamaConfig, LlamaForCausalLM

    from bucketserve.models.config import ModelConfig
    from bucketserve.models.loader import LoadedModel, get_backend, model_from_hf_tensors

    torch.manual_seed(0)
    # Llama layout (GQA 4:1, head_dim 64, untied), weights large enough that logits are
    # well separated (no near-ties for rounding to flip)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
                      max_position_embeddings=2048, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2)
    hf = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.12)
    hf = hf.cuda().eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in LENGTHS]
    expected = []
    with torch.inference_mode():
        for p, m in zip(prompts, MAX_TOKENS, strict=True):
            ids = torch.tensor([p], device="cuda")
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=m,
                              min_new_tokens=m, do_sample=False)
            expected.append(out[0, len(p):].tolist())
    config = ModelConfig.from_hf_dict(cfg.to_dict() | {"architectures": ["LlamaForCausalLM"]})
    tensors = {k: v.detach().cpu() for k, v in hf.state_dict().items()}
    model = model_from_hf_tensors(config, tensors, "cuda", torch.float32, get_backend("cuda"))
    assert type(model.attn_backend).__name__ == "TritonAttentionBackend"
    loaded = LoadedModel(model, word_tokenizer(VOCAB), config, "tiny-gpu", 2048)
    return loaded, prompts, expected


def run_engine(loaded, prompts, tmp_path, cuda_graphs: bool, num_blocks: int | None = None,
               piecewise: bool = True, overlap: bool = True, nvtx: bool = False,
               mixed: str = "full"):
    path = tmp_path / "buckets.toml"
    path.write_text("[scheduler]\nmax_batched_tokens = 256\nmax_running = 16\n"
                    f'[prefill]\nmixed_graphs = "{mixed}"\n')
    engine = LLMEngine(loaded, load_buckets(str(path), max_model_len=2048), "cuda",
                       num_blocks=num_blocks, cuda_graphs=cuda_graphs, piecewise_graphs=piecewise,
                       async_scheduling=overlap, nvtx=nvtx)
    free = engine.block_manager.num_free_blocks
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS]
    outs = engine.generate(prompts, params)
    assert engine.block_manager.num_free_blocks == free, "KV blocks leaked"
    return [o.token_ids for o in outs], engine


@pytest.mark.parametrize("cuda_graphs, piecewise, overlap, mixed",
                         [(True, True, True, "full"), (True, True, False, "full"),
                          (True, True, True, "piecewise"), (True, True, False, "piecewise"),
                          (True, False, True, "full"), (False, False, True, "full"),
                          (False, False, False, "full")])
def test_gpu_engine_greedy_matches_transformers(setup, tmp_path, cuda_graphs, piecewise, overlap,
                                                mixed):
    loaded, prompts, expected = setup
    got, engine = run_engine(loaded, prompts, tmp_path, cuda_graphs, piecewise=piecewise,
                             overlap=overlap, nvtx=overlap, mixed=mixed)
    assert got == expected
    # with overlap, decode inputs came from the previous step's sampled ids on the device
    assert (engine.runner.num_placeholder_tokens > 0) is overlap
    kinds = {s.kind for s in engine.stats.recent}
    assert {"decode", "mixed"} <= kinds, kinds
    if cuda_graphs:
        assert engine.cuda_info["graphs"] == len(engine.buckets.decode_graph_sizes("cuda"))
        assert engine.runner.num_graph_steps > 0
    else:
        assert engine.runner.num_graph_steps == 0
    # decode graphs pad batches up to a captured size and piecewise graphs steps up to a token
    # count: the padding is counted as computed, not useful; without graphs nothing is padded
    stats = engine.stats
    if cuda_graphs:
        assert stats.computed_tokens_total > stats.useful_tokens_total
    else:
        assert stats.computed_tokens_total == stats.useful_tokens_total
    if piecewise:  # every prefill and mixed step (<= 256 tokens here) ran as graphs (whole
        # steps or pieces), or eagerly where the start-up cost model found that cheaper
        assert engine.cuda_info["mixed_graphs"] == mixed
        assert type(engine.runner.piecewise).__name__ == (
            "MixedGraphs" if mixed == "full" else "PiecewiseGraphs")
        assert engine.cuda_info["piecewise_graphs"] > 0
        assert "piecewise_eager_from" in engine.cuda_info  # piecewise_choice "cost" (default)
        non_decode = sum(s.kind != "decode" for s in engine.stats.recent)
        runner = engine.runner
        assert runner.num_piecewise_steps + runner.num_cost_eager_steps >= non_decode > 0
        assert runner.num_piecewise_steps > 0
    else:
        assert engine.runner.num_piecewise_steps == 0


def test_gpu_engine_greedy_matches_with_cost_model_choices(setup, tmp_path):
    """Steps the cost model runs eagerly (here: every step above 64 tokens) and steps it
    replays padded give the same greedy tokens; padding is counted only for the replays."""
    from bucketserve.kernels.cuda_graphs import PaddingCostModel

    loaded, prompts, expected = setup
    path = tmp_path / "buckets.toml"
    path.write_text("[scheduler]\nmax_batched_tokens = 256\nmax_running = 16\n")
    engine = LLMEngine(loaded, load_buckets(str(path), max_model_len=2048), "cuda")
    pw = engine.runner.piecewise
    sizes = tuple(pw.sizes)
    pw.cost = PaddingCostModel(sizes, tuple(1.0 if t <= 64 else 100.0 for t in sizes),
                               tuple(10.0 for _ in sizes))
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS]
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == expected
    assert engine.runner.num_cost_eager_steps > 0 and engine.runner.num_piecewise_steps > 0
    snap = engine.stats.snapshot()
    assert sum(snap["kind_padding_tokens"].values()) == (snap["computed_tokens_total"]
                                                         - snap["useful_tokens_total"])


@pytest.mark.parametrize("overlap", [True, False])
def test_gpu_engine_greedy_matches_under_preemption(setup, tmp_path, overlap):
    loaded, prompts, expected = setup
    got, engine = run_engine(loaded, prompts, tmp_path, cuda_graphs=True, num_blocks=48,
                             overlap=overlap)
    assert engine.stats.preemptions_total > 0
    assert got == expected

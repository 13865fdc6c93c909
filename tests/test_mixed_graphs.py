"""Whole prefill / mixed steps as one graph each (kernels/cuda_graphs.MixedGraphs).

On the CPU, through Triton's interpreter (tests/triton_interp.py; skipped when triton is
not installed or a GPU is present, where tests/test_engine_gpu.py runs the compiled
kernels and the captured graphs):

  * the prefill tiles and their bound (no interpreter needed);
  * the attention kernels on fixed grids (decode count and prefill tiles on the device,
    padding rows with slot -1) give the torch reference's output on every real row and
    write K/V at exactly the real rows' slots;
  * the engine with its prefill and mixed steps run through MixedGraphs' static buffers
    (the graph's forward run eagerly) gives transformers' greedy tokens, with overlapped
    scheduling on and off, and counts the padding rows.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from bucketserve.kernels.attention import (
    PREFILL_BLOCK_M,
    AttentionMetadata,
    FixedGrid,
    max_prefill_tiles,
    prefill_tiles,
    reference_attention,
)


@pytest.mark.parametrize("seed", range(20))
def test_prefill_tiles_cover_every_query_row_within_the_bound(seed):
    rng = random.Random(seed)
    max_seqs = rng.choice([1, 4, 16, 256])
    n = rng.randint(1, max_seqs)
    nd = rng.randint(0, n - 1) if n > 1 else 0
    qlens = [1] * nd + [rng.choice([1, 2, 63, 64, 65, 130, rng.randint(1, 700)])
                        for _ in range(n - nd)]
    total = sum(qlens)
    out = np.full(max_prefill_tiles(total, max_seqs), 7, dtype=np.int32)
    k = prefill_tiles(qlens, nd, out)
    tiles = out[:k]
    assert (out[k:] == -1).all()
    seqs, blocks = tiles >> 16, tiles & 0xFFFF
    # every query row of every prefill sequence is in exactly one tile, in sequence order
    covered = {(int(s), int(b) * PREFILL_BLOCK_M + r) for s, b in zip(seqs, blocks, strict=True)
               for r in range(PREFILL_BLOCK_M) if int(b) * PREFILL_BLOCK_M + r < qlens[s]}
    assert covered == {(i, r) for i in range(nd, n) for r in range(qlens[i])}
    assert len(set(tiles.tolist())) == k and list(seqs) == sorted(seqs)
    assert k == sum(-(-q // PREFILL_BLOCK_M) for q in qlens[nd:])


def test_prefill_tiles_refuse_too_small_a_buffer():
    with pytest.raises(ValueError, match="more than 2 tiles"):
        prefill_tiles([1, 200], 1, np.zeros(2, dtype=np.int32))


# -- the kernels, interpreted -------------------------------------------------------------

def _interp():
    from triton_interp import interpreted_triton

    interpreted_triton()
    from bucketserve.kernels import triton_attention

    return triton_attention


@pytest.mark.parametrize("case", [
    # (decode contexts, (prefill chunk, cached prefix) pairs, padded token count)
    ([20, 37, 5], [(5, 9), (70, 0)], 96),
    ([], [(130, 16), (3, 0)], 160),
    ([33, 1, 16, 200], [], 16),
    ([7], [(64, 64)], 128),
])
def test_fixed_grid_attention_matches_reference(case):
    ta = _interp()
    torch.manual_seed(0)
    decodes, prefills, t = case
    page, hkv, hq, d, max_seqs = 16, 2, 6, 32, 8
    lens = decodes + [c + p for c, p in prefills]
    qlens = [1] * len(decodes) + [c for c, _ in prefills]
    ntok = sum(qlens)
    nb = sum(-(-n // page) for n in lens) + 2
    kc, vc = torch.randn(nb, page, hkv, d), torch.randn(nb, page, hkv, d)
    tables = torch.zeros(max_seqs, 16, dtype=torch.int32)
    free = torch.randperm(nb - 1) + 1
    used = 0
    for i, n in enumerate(lens):
        need = -(-n // page)
        tables[i, :need] = free[used:used + need]
        used += need
    n = len(lens)
    # the step's new tokens: the last qlens[i] positions of each sequence
    slots = torch.full((t,), -1, dtype=torch.long)
    row = 0
    for i, (n_i, q_i) in enumerate(zip(lens, qlens, strict=True)):
        for p in range(n_i - q_i, n_i):
            slots[row] = tables[i, p // page] * page + p % page
            row += 1
    q, k, v = torch.randn(t, hq, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    qsl = torch.zeros(max_seqs + 1, dtype=torch.int32)
    qsl[1:n + 1] = torch.tensor(np.cumsum(qlens), dtype=torch.int32)
    seq_lens = torch.ones(max_seqs, dtype=torch.int32)
    seq_lens[:n] = torch.tensor(lens, dtype=torch.int32)
    counts = np.full(1 + max_prefill_tiles(t, max_seqs), -1, dtype=np.int32)
    counts[0] = len(decodes)
    prefill_tiles(qlens, len(decodes), counts[1:])
    counts_t = torch.from_numpy(counts)
    fixed = FixedGrid(num_decodes=counts_t[:1], max_decodes=min(t, max_seqs), tiles=counts_t[1:])
    meta = AttentionMetadata(slot_mapping=slots, query_start_loc=qsl, seq_lens=seq_lens,
                             block_tables=tables, num_decodes=fixed.max_decodes,
                             max_query_len=t, max_seq_len=0, query_lens_cpu=[],
                             seq_lens_cpu=[], fixed=fixed)
    backend = ta.TritonAttentionBackend(decode_splits=1)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    backend.write_kv(k, v, kc, vc, meta)
    out = backend.attend(q, kc, vc, meta, d ** -0.5)
    # K/V written at the real rows' slots only, padding rows (slot -1) wrote nothing
    real = slots[:ntok]
    kc_ref.view(-1, hkv, d)[real] = k[:ntok]
    vc_ref.view(-1, hkv, d)[real] = v[:ntok]
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    ref_meta = AttentionMetadata(slot_mapping=real, query_start_loc=qsl[:n + 1],
                                 seq_lens=seq_lens[:n], block_tables=tables[:n],
                                 num_decodes=len(decodes), max_query_len=max(qlens),
                                 max_seq_len=max(lens), query_lens_cpu=qlens, seq_lens_cpu=lens)
    ref = reference_attention(q[:ntok], kc, vc, ref_meta, d ** -0.5)
    torch.testing.assert_close(out[:ntok], ref, rtol=1e-5, atol=1e-5)


# -- the engine through MixedGraphs, interpreted -------------------------------------------

LENGTHS = [8, 200, 33, 90, 9, 17, 64, 12]
MAX_TOKENS = [6, 3, 8, 4, 7, 9, 5, 6]
VOCAB = 500


@pytest.fixture(scope="module")
def tiny():
    ta = _interp()
    from test_engine_gpu import word_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    from bucketserve.models.config import ModelConfig
    from bucketserve.models.loader import LoadedModel, model_from_hf_tensors

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2)
    hf = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
    hf = hf.eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in LENGTHS]
    expected = []
    with torch.inference_mode():
        for p, m in zip(prompts, MAX_TOKENS, strict=True):
            ids = torch.tensor([p])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=m,
                              min_new_tokens=m, do_sample=False)
            expected.append(out[0, len(p):].tolist())
    config = ModelConfig.from_hf_dict(cfg.to_dict() | {"architectures": ["LlamaForCausalLM"]})
    tensors = {k: v.detach() for k, v in hf.state_dict().items()}
    model = model_from_hf_tensors(config, tensors, "cpu", torch.float32,
                                  ta.TritonAttentionBackend(decode_splits=1))
    return LoadedModel(model, word_tokenizer(VOCAB), config, "tiny-interp", 1024), prompts, expected


@pytest.mark.parametrize("overlap", [False, True])
def test_engine_through_mixed_graphs_matches_transformers(tiny, tmp_path, overlap):
    from bucketserve.buckets import load_buckets
    from bucketserve.engine.llm_engine import LLMEngine
    from bucketserve.engine.sequence import SamplingParams
    from bucketserve.kernels.cuda_graphs import MixedGraphs

    loaded, prompts, expected = tiny
    path = tmp_path / "buckets.toml"
    path.write_text("[scheduler]\nmax_batched_tokens = 128\nmax_running = 8\n"
                    "max_prefill_share = 1.0\n[kv_cache]\nprefix_caching = false\n")
    buckets = load_buckets(str(path), max_model_len=1024)
    engine = LLMEngine(loaded, buckets, "cpu", num_blocks=200, async_scheduling=overlap)
    runner = engine.runner
    sizes = buckets.piecewise_token_counts(engine.max_batched_tokens)
    runner.use_mixed_graphs(MixedGraphs(loaded.model, sizes, runner.inputs.max_seqs,
                                        runner.max_blocks, "cpu", capture=False))
    free = engine.block_manager.num_free_blocks
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS]
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == expected
    assert engine.block_manager.num_free_blocks == free
    # without decode graphs (CPU) every step, decode steps too, ran through MixedGraphs
    kinds = {s.kind for s in engine.stats.recent}
    assert {"decode", "mixed"} <= kinds and len(engine.stats.recent) == engine.stats.num_steps
    assert runner.num_piecewise_steps == engine.stats.num_steps
    assert (runner.num_placeholder_tokens > 0) is overlap
    snap = engine.stats.snapshot()
    padding = sum(snap["kind_padding_tokens"].values())
    assert padding == snap["computed_tokens_total"] - snap["useful_tokens_total"] > 0


# -- on the GPU: the captured graphs --------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_decodes, prefills", [
    (5, [(40, 0), (250, 100)]), (0, [(300, 0), (7, 0)]), (12, []), (1, [(1, 0)])])
def test_mixed_graph_replay_equals_forward(num_decodes, prefills, dtype):
    """A captured mixed-step graph, replayed on a step loaded as the runner loads it (slots
    of the padding rows -1, decode count and tiles on the device), gives the eager forward
    of the real rows and writes exactly the same K/V slots."""
    from test_piecewise_graphs import TOL, VOCAB, tiny_model
    from test_runner_inputs import BS, make_batch, step_inputs

    from bucketserve.kernels.attention import forward_context
    from bucketserve.kernels.cuda_graphs import MixedGraphs

    rng = random.Random(num_decodes)
    model = tiny_model("cuda", dtype)
    cfg = model.config
    pool = torch.zeros(cfg.num_layers, 2, 2000, BS, cfg.num_kv_heads, cfg.head_dim,
                       device="cuda", dtype=dtype)
    model.bind_kv_cache(pool)
    batch = make_batch(rng, num_decodes, prefills)
    ids, pos, meta = step_inputs(batch, "cuda")
    n, nseq = ids.shape[0], meta.num_seqs
    pool.normal_()
    before = pool.clone()
    with torch.inference_mode(), forward_context(meta):
        want = model(ids, pos)
    kv_want = pool.clone()
    width = meta.block_tables.shape[1]
    mg = MixedGraphs(model, [16, 64, 128, 512], 64, width, "cuda")
    mg.capture()
    t = mg.padded_size(n)
    assert t is not None
    counts = np.full(1 + mg.num_tiles(t), -1, dtype=np.int32)
    counts[0] = meta.num_decodes
    prefill_tiles(meta.query_lens_cpu, meta.num_decodes, counts[1:])
    slots = torch.full((t,), -1, dtype=torch.long, device="cuda")
    slots[:n] = meta.slot_mapping
    stale = torch.randint(0, VOCAB, (t,), device="cuda")  # padding rows: stale ids, positions
    stale[:n] = ids
    spos = torch.randint(0, cfg.max_position_embeddings, (t,), device="cuda")
    spos[:n] = pos
    pool.copy_(before)
    mg.load(t, nseq, stale, spos, slots, meta.query_start_loc, meta.seq_lens, meta.block_tables,
            torch.from_numpy(counts).cuda())
    got = mg.run(t, n)
    torch.cuda.synchronize()
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert torch.equal(pool != before, kv_want != before), "padding rows reached the pool"
    torch.testing.assert_close(pool, kv_want, **TOL[dtype])

"""Prefix caching changes no output: greedy tokens with caching on equal caching off and
Hugging Face transformers, for prompts sharing none, some and all of their full KV blocks, a
request arriving while its prefix is still being prefilled, and under preemption."""

from __future__ import annotations

import random

import pytest
import torch
from test_engine_vs_hf import hf_greedy

from bucketserve.buckets import load_buckets
from bucketserve.engine.llm_engine import LLMEngine
from bucketserve.engine.sequence import SamplingParams
from bucketserve.models import load_model

BS = 16  # the default block size


def make_engine(loaded, tmp_path, caching: bool, max_batched_tokens: int = 256,
                num_blocks: int | None = None, max_running: int = 16,
                boundaries: str = "[16, 32, 64, 128, 256]") -> LLMEngine:
    path = tmp_path / f"buckets-{caching}-{max_batched_tokens}.toml"
    path.write_text(f"[prefill]\nboundaries = {boundaries}\n"
                    f"[scheduler]\nmax_batched_tokens = {max_batched_tokens}\n"
                    f"max_running = {max_running}\n"
                    # chunks of the whole step budget, as the tests below count them (the
                    # default caps one prompt's chunk at a quarter of it)
                    "max_prefill_share = 1.0\n"
                    f"[kv_cache]\nprefix_caching = {'true' if caching else 'false'}\n")
    return LLMEngine(loaded, load_buckets(str(path), max_model_len=loaded.max_model_len),
                     num_blocks=num_blocks)


def greedy(engine: LLMEngine, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
    return [o.token_ids for o in engine.generate(prompts, params)]


def assert_no_leak(engine: LLMEngine) -> None:
    bm = engine.block_manager
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_usable_blocks, "KV blocks leaked"
    assert all(r == 0 for r in bm.ref_counts)


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    ours = load_model(str(tiny_llama_dir), dtype=torch.float32)
    rng = random.Random(12)

    def rand(n: int) -> list[int]:
        return [rng.randrange(100, hf.config.vocab_size) for _ in range(n)]

    base = rand(7 * BS + 5)  # 7 full blocks + 5 tokens
    prompts = {
        "base": base,
        "same": list(base),  # every full block shared, last partial block computed
        "aligned": base[:6 * BS],  # ends on a block boundary: all blocks cached, last recomputed
        "extends": base + rand(40),  # all of base's full blocks, then more
        "some": base[:3 * BS + 7] + rand(50),  # 3 full blocks shared, then differs
        "one_token_more": base[:4 * BS] + rand(1),  # 4 cached blocks, a 1-token prefill
        "short": base[:9],  # under one block: nothing to share
        "none": rand(130),  # shares nothing
    }
    max_tokens = {name: 6 + i for i, name in enumerate(prompts)}
    expected = {name: hf_greedy(hf, p, max_tokens[name], ignore_eos=True) for name, p in prompts.items()}
    return ours, hf, prompts, max_tokens, expected


def test_shared_prefixes_match_transformers_with_caching_on_and_off(tiny, tmp_path):
    ours, _, prompts, max_tokens, expected = tiny
    names = list(prompts)
    results = {}
    for caching in (False, True):
        engine = make_engine(ours, tmp_path, caching)
        # "base" first and alone: its blocks are cached before the others arrive
        got = greedy(engine, [prompts["base"]], [max_tokens["base"]])
        rest = names[1:]
        got += greedy(engine, [prompts[n] for n in rest], [max_tokens[n] for n in rest])
        results[caching] = dict(zip(names, got, strict=True))
        assert results[caching] == expected
        assert_no_leak(engine)
        stats = engine.stats
        if caching:
            assert stats.prefix_cache_hits_total > 0
            assert stats.prefix_cache_blocks == engine.block_manager.num_cached_blocks > 0
        else:
            assert stats.prefix_cache_queries_total == stats.prefix_cache_hits_total == 0
    assert results[True] == results[False]


def test_cached_tokens_per_prompt(tiny, tmp_path):
    """How much each prompt took from the cache: full blocks only, the last token always
    computed, an identical prompt admitted in the same step gets nothing (not yet computed)."""
    ours, _, prompts, max_tokens, expected = tiny
    # one bucket and a large budget: every prompt below is admitted in the same step
    engine = make_engine(ours, tmp_path, caching=True, max_batched_tokens=2048, boundaries="[2048]")
    greedy(engine, [prompts["base"]], [max_tokens["base"]])
    names = ["same", "aligned", "extends", "some", "one_token_more", "short", "none"]
    seqs = [engine.add_request(prompts[n], SamplingParams(max_tokens=max_tokens[n], temperature=0.0,
                                                          ignore_eos=True)) for n in names]
    twin = engine.add_request(prompts["none"], SamplingParams(max_tokens=3, temperature=0.0,
                                                              ignore_eos=True))
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.token_ids
    cached = {n: s.num_cached_tokens for n, s in zip(names, seqs, strict=True)}
    assert cached == {"same": 7 * BS, "aligned": 5 * BS, "extends": 7 * BS, "some": 3 * BS,
                      "one_token_more": 4 * BS, "short": 0, "none": 0}
    assert twin.num_cached_tokens == 0
    assert outs[twin.request_id] == expected["none"][:3]
    for n, s in zip(names, seqs, strict=True):
        assert outs[s.request_id] == expected[n], n
    bm = engine.block_manager
    assert bm.hit_tokens == sum(cached.values())
    assert bm.query_tokens == sum(len(prompts[n]) for n in ["base", *names]) + len(prompts["none"])
    assert_no_leak(engine)


def test_request_arriving_while_its_prefix_is_prefilled(tiny, tmp_path):
    """A 600-token prompt prefilled in 64-token chunks; a request sharing its first 598
    tokens arrives after two chunks. It is admitted in the step of the long prompt's last
    chunk (24 tokens, leaving budget): it reuses the 36 blocks written before that step but
    not block 36, which that very step writes."""
    ours, hf, _, _, _ = tiny
    rng = random.Random(5)
    long = [rng.randrange(100, hf.config.vocab_size) for _ in range(600)]
    late = long[:598] + [rng.randrange(100, hf.config.vocab_size) for _ in range(20)]
    want_long = hf_greedy(hf, long, 8, ignore_eos=True)
    want_late = hf_greedy(hf, late, 8, ignore_eos=True)
    for caching in (False, True):
        engine = make_engine(ours, tmp_path, caching, max_batched_tokens=64)
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        a = engine.add_request(long, params)
        engine.step()
        engine.step()
        assert a.num_computed_tokens == 128
        b = engine.add_request(late, params)
        outs = {}
        computed_at_admission = None
        while engine.has_unfinished():
            before = a.num_computed_tokens
            for o in engine.step():
                if o.finished:
                    outs[o.request_id] = o.token_ids
            if computed_at_admission is None and b.first_scheduled_time is not None:
                computed_at_admission = before
        assert outs[a.request_id] == want_long
        assert outs[b.request_id] == want_late
        assert computed_at_admission == 576  # long's last chunk ran with b's first
        assert b.num_cached_tokens == (576 if caching else 0)  # 37 full blocks shared, 36 written
        assert_no_leak(engine)


def test_caching_under_preemption_matches_transformers(tiny, tmp_path):
    """A pool too small for all requests at once: preempted sequences free their blocks
    (which stay cached until evicted) and are recomputed, from the cache where it still
    holds their blocks."""
    ours, hf, _, _, _ = tiny
    rng = random.Random(3)
    system = [rng.randrange(100, hf.config.vocab_size) for _ in range(5 * BS + 3)]
    prompts = [system + [rng.randrange(100, hf.config.vocab_size) for _ in range(n)]
               for n in (30, 200, 5, 120, 64, 300, 17, 90)]
    max_tokens = [20, 12, 30, 16, 25, 10, 28, 14]
    expected = [hf_greedy(hf, p, m, ignore_eos=True) for p, m in zip(prompts, max_tokens, strict=True)]
    for caching in (False, True):
        engine = make_engine(ours, tmp_path, caching, num_blocks=28)  # 27 usable, largest needs 25
        assert greedy(engine, prompts, max_tokens) == expected
        assert engine.stats.preemptions_total > 0
        assert_no_leak(engine)
        if caching:
            assert engine.stats.prefix_cache_hits_total > 0


def test_smollm2_chat_turns_share_the_system_prompt(smollm2_path, hf_smollm2, hf_tokenizer, tmp_path):
    """The default model on chat prompts: a shared system prompt and a conversation's growing
    history; greedy output equals transformers' with caching on."""
    ours = load_model(str(smollm2_path), dtype=torch.float32)
    system = ("You are a careful assistant for a hardware shop. Answer in one short sentence, "
              "name the aisle when you can, and never invent prices. " * 3)
    chats = [
        [{"role": "system", "content": system}, {"role": "user", "content": "Where are the nails?"}],
        [{"role": "system", "content": system}, {"role": "user", "content": "Do you sell paint?"}],
        [{"role": "system", "content": system}, {"role": "user", "content": "Where are the nails?"},
         {"role": "assistant", "content": "Nails are in aisle 4."},
         {"role": "user", "content": "And screws?"}],
    ]
    prompts = [hf_tokenizer.encode(hf_tokenizer.apply_chat_template(c, tokenize=False,
                                                                    add_generation_prompt=True),
                                   add_special_tokens=False) for c in chats]
    # EOS ends a reply here as it does in transformers (ignore_eos would differ: transformers'
    # min_new_tokens masks EOS, ours samples past it)
    expected = [hf_greedy(hf_smollm2, p, 12, ignore_eos=False) for p in prompts]
    engine = make_engine(ours, tmp_path, caching=True)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    first = engine.generate(prompts[:1], params)[0]
    seqs = [engine.add_request(p, params) for p in prompts[1:]]  # admitted together
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.token_ids
    assert [first.token_ids] + [outs[s.request_id] for s in seqs] == expected
    # each takes the full blocks it shares with the first conversation's computed tokens
    # (its prompt and all but the last generated token), leaving its own last token
    computed = prompts[0] + expected[0][:-1]
    for p, seq in zip(prompts[1:], seqs, strict=True):
        n = min(len(p), len(computed))
        common = next((i for i in range(n) if p[i] != computed[i]), n)
        assert seq.num_cached_tokens == min(common // BS, (len(p) - 1) // BS) * BS > 0
    assert_no_leak(engine)

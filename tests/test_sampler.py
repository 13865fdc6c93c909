"""Sampler: greedy, filters, penalties, min_tokens, per-request seeds, logprobs."""

from __future__ import annotations

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from bucketserve.engine.sampler import Sampler
from bucketserve.engine.sequence import SamplingParams, Sequence

EOS = 7


def make_seq(prompt: list[int] | None = None, output: list[int] | None = None,
             **params) -> Sequence:
    seq = Sequence(list(prompt if prompt is not None else [1, 2, 3]), SamplingParams(**params))
    seq.token_ids.extend(output or [])
    return seq


def rand_logits(rows: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * scale


def draw(logits_row: torch.Tensor, n: int, seed: int = 0, **params) -> torch.Tensor:
    """n independent samples from one logits row: a batch of n identical rows."""
    sampler = Sampler({EOS}, seed=seed)
    seqs = [make_seq(**params) for _ in range(n)]
    return torch.tensor(sampler(logits_row.expand(n, -1).clone(), seqs).token_ids)


def test_greedy_is_argmax():
    logits = rand_logits(16, 500, seed=0)
    out = Sampler({EOS})(logits, [make_seq(temperature=0.0) for _ in range(16)])
    assert out.token_ids == torch.argmax(logits, dim=-1).tolist()
    assert out.logprobs == [None] * 16
    # Same result on the general path (one row asks for logprobs).
    seqs = [make_seq(temperature=0.0, logprobs=2 if i == 3 else None) for i in range(16)]
    assert Sampler({EOS})(logits, seqs).token_ids == torch.argmax(logits, dim=-1).tolist()


def test_greedy_on_bf16_logits_equals_float32_argmax():
    """The plain-greedy path takes the argmax on the logits' own dtype (bf16 on GPU): the same
    token as on the float32 widening, also where bf16 rounding makes maxima tie (first wins)."""
    logits = rand_logits(64, 4000, seed=5).to(torch.bfloat16)
    logits[::4, 17] = logits[::4].max(dim=-1).values  # exact ties with a later column
    seqs = [make_seq(temperature=0.0) for _ in range(64)]
    got = Sampler({EOS})(logits, seqs).token_ids
    assert got == torch.argmax(logits.float(), dim=-1).tolist()
    # and the general path (one row asks for logprobs, so everything is widened) agrees
    seqs[5] = make_seq(temperature=0.0, logprobs=1)
    assert Sampler({EOS})(logits, seqs).token_ids == got


def test_top_k_1_is_greedy_including_ties():
    logits = rand_logits(32, 300, seed=1)
    logits[0, 10] = logits[0, 20] = logits[0].max() + 1.0  # tie: argmax takes the first
    seqs = [make_seq(temperature=1.3, top_k=1) for _ in range(32)]
    assert Sampler({EOS}, seed=5)(logits, seqs).token_ids == torch.argmax(logits, -1).tolist()


def test_temperature_sampling_matches_distribution():
    logits = rand_logits(1, 12, seed=2, scale=1.0)[0]
    n = 20000
    tokens = draw(logits, n, temperature=0.7)
    freq = torch.bincount(tokens, minlength=12).float() / n
    expected = torch.softmax(logits / 0.7, dim=-1)
    # Standard error is at most 0.0036 per bin; 0.02 is > 5 sigma.
    assert torch.allclose(freq, expected, atol=0.02), (freq, expected)


def allowed_and_probs(logits: torch.Tensor, temperature: float, keep) -> tuple[set[int], dict]:
    probs = torch.softmax(logits / temperature, dim=-1)
    allowed = {int(t) for t in keep(probs)}
    values = probs.tolist()
    total = sum(values[t] for t in allowed)
    return allowed, {t: values[t] / total for t in allowed}


def check_draws(tokens: torch.Tensor, allowed: set[int], renorm: dict) -> None:
    seen = set(tokens.tolist())
    assert seen <= allowed, f"sampled excluded tokens {seen - allowed}"
    # Tokens worth >= 20/n must all show up in n draws (miss chance < e^-20 each).
    assert {t for t, p in renorm.items() if p >= 20 / len(tokens)} <= seen


def test_top_k_excludes_the_rest():
    logits = rand_logits(1, 40, seed=3, scale=1.0)[0]
    k = 6
    allowed, renorm = allowed_and_probs(logits, 1.0, lambda p: torch.topk(p, k).indices)
    check_draws(draw(logits, 4000, top_k=k), allowed, renorm)


def top_p_reference(probs: torch.Tensor, top_p: float) -> list[int]:
    values = probs.tolist()
    order = sorted(range(len(values)), key=lambda t: -values[t])
    kept, mass = [], 0.0
    for t in order:  # smallest prefix whose mass reaches top_p
        kept.append(t)
        mass += values[t]
        if mass >= top_p:
            break
    return kept


def test_top_p_keeps_smallest_nucleus():
    logits = rand_logits(1, 40, seed=4, scale=1.5)[0]
    temperature = 0.9
    probs = torch.softmax(logits / temperature, dim=-1)
    cum = torch.cumsum(torch.sort(probs, descending=True).values, 0)
    top_p = float(cum[7] + cum[8]) / 2  # halfway between two boundaries: 9 tokens, no rounding doubt
    allowed, renorm = allowed_and_probs(logits, temperature, lambda p: top_p_reference(p, top_p))
    assert len(allowed) == 9
    check_draws(draw(logits, 4000, temperature=temperature, top_p=top_p), allowed, renorm)


@pytest.mark.parametrize("scale,nucleus", [(4.0, 20), (0.5, 1500)])
def test_top_p_large_vocab(scale, nucleus):
    """Narrow and wide nuclei over a large vocabulary (the sampler searches the top 1024
    tokens first and sorts everything only when the nucleus is wider)."""
    logits = rand_logits(1, 3000, seed=10, scale=scale)[0]
    probs = torch.softmax(logits, dim=-1)
    cum = torch.cumsum(torch.sort(probs, descending=True).values, 0)
    top_p = float(cum[nucleus - 2] + cum[nucleus - 1]) / 2
    allowed, renorm = allowed_and_probs(logits, 1.0, lambda p: top_p_reference(p, top_p))
    assert len(allowed) == nucleus
    check_draws(draw(logits, 1500, top_p=top_p), allowed, renorm)


def test_min_p_drops_unlikely_tokens():
    logits = rand_logits(1, 40, seed=5, scale=1.5)[0]
    probs = torch.softmax(logits, dim=-1)
    ratios = torch.sort(probs / probs.max(), descending=True).values
    min_p = float(ratios[4] + ratios[5]) / 2
    allowed, renorm = allowed_and_probs(logits, 1.0, lambda p: (p >= min_p * p.max()).nonzero()[:, 0])
    assert len(allowed) == 5
    check_draws(draw(logits, 4000, min_p=min_p), allowed, renorm)


def test_filters_combined_are_intersection():
    logits = rand_logits(1, 40, seed=6, scale=1.0)[0]
    probs = torch.softmax(logits, dim=-1)
    top3 = set(torch.topk(probs, 3).indices.tolist())
    tokens = set(draw(logits, 2000, top_k=3, top_p=0.999, min_p=0.0).tolist())
    assert tokens <= top3


def reference_penalties(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """Straightforward per-token loop: OpenAI presence/frequency over output tokens."""
    out = logits.clone()
    p = seq.params
    for tok in set(seq.output_token_ids):
        count = seq.output_token_ids.count(tok)
        out[tok] -= p.frequency_penalty * count + p.presence_penalty
    return out


def test_presence_frequency_penalties_match_reference():
    logits = rand_logits(4, 60, seed=7)
    seqs = [
        make_seq(prompt=[5, 5, 9], output=[1, 1, 1, 2, 40], presence_penalty=0.5, frequency_penalty=0.3),
        make_seq(prompt=[1, 2], output=[], presence_penalty=1.0, frequency_penalty=1.0),
        make_seq(prompt=[3], output=[59, 0, 59], presence_penalty=-0.7, frequency_penalty=0.0),
        make_seq(prompt=[3], output=[4, 4], temperature=0.0),  # no penalty: untouched
    ]
    got = Sampler({EOS}).process_logits(logits, seqs)
    for i, seq in enumerate(seqs):
        assert torch.allclose(got[i], reference_penalties(logits[i], seq), atol=1e-6), i
    # Prompt tokens are not penalised by presence/frequency.
    assert got[0, 5] == logits[0, 5] and got[0, 9] == logits[0, 9]


def test_repetition_penalty_matches_hf():
    logits = rand_logits(3, 80, seed=8)
    seqs = [
        make_seq(prompt=[3, 4, 4, 50], output=[60, 3, 79], repetition_penalty=1.3),
        make_seq(prompt=[0, 1], output=[2], repetition_penalty=0.8),
        make_seq(prompt=[10, 11], output=[12], repetition_penalty=1.0),
    ]
    got = Sampler({EOS}).process_logits(logits, seqs)
    for i, seq in enumerate(seqs):
        hf = RepetitionPenaltyLogitsProcessor(seq.params.repetition_penalty)
        want = hf(torch.tensor([seq.token_ids]), logits[i:i + 1].clone())[0]
        assert torch.allclose(got[i], want, atol=1e-6), i


def test_greedy_uses_penalised_logits():
    logits = torch.zeros(1, 10)
    logits[0, 4], logits[0, 6] = 2.0, 1.9
    seq = make_seq(prompt=[4], output=[], temperature=0.0, repetition_penalty=1.5)
    assert Sampler({EOS})(logits, [seq]).token_ids == [6]


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.zeros(3, 20)
    logits[:, EOS] = 10.0
    logits[:, 12] = 9.0
    logits[:, 3] = 8.0
    seqs = [
        make_seq(output=[1], temperature=0.0, min_tokens=3),  # EOS banned -> 12
        make_seq(output=[1], temperature=0.0, min_tokens=3, stop_token_ids=[12]),  # -> 3
        make_seq(output=[1, 2, 3], temperature=0.0, min_tokens=3),  # reached -> EOS
    ]
    assert Sampler({EOS})(logits, seqs).token_ids == [12, 3, EOS]
    # ignore_eos lifts the EOS ban but stop_token_ids stay banned.
    seq = make_seq(output=[], temperature=0.0, min_tokens=2, ignore_eos=True, stop_token_ids=[EOS, 12])
    assert Sampler({EOS})(logits[:1], [seq]).token_ids == [3]
    seq = make_seq(output=[], temperature=0.0, min_tokens=2, ignore_eos=True)
    assert Sampler({EOS})(logits[:1], [seq]).token_ids == [EOS]
    # Sampled rows never draw a banned token either.
    flat = torch.zeros(1, 20)
    tokens = draw(flat[0], 2000, min_tokens=1, stop_token_ids=[12])
    assert EOS not in tokens.tolist() and 12 not in tokens.tolist()


def reference_plain(s: Sequence, grammar: bool = True) -> bool:
    """The fast path's condition, read from the params as it was before the row flags
    (grammar=False: the grammar is not read)."""
    p = s.params
    return not (p.temperature >= 1e-5 or p.logprobs is not None or p.repetition_penalty != 1.0
                or (grammar and s.grammar is not None) or p.logit_bias
                or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
                or (p.min_tokens and len(s.token_ids) + s.num_pending - s.num_prompt_tokens
                    < p.min_tokens))


ROW_KINDS = [
    {}, {"temperature": 0.0}, {"temperature": 0.0, "top_k": 1}, {"top_k": 1},
    {"temperature": 0.0, "logprobs": 0}, {"temperature": 0.0, "logit_bias": {3: 2.0}},
    {"temperature": 0.0, "repetition_penalty": 1.2}, {"temperature": 0.0, "presence_penalty": 0.5},
    {"temperature": 0.0, "frequency_penalty": -0.4}, {"temperature": 0.0, "min_tokens": 1},
    {"temperature": 0.0, "min_tokens": 3}, {"temperature": 0.0, "min_tokens": 4},
    {"temperature": 0.0, "min_tokens": 2, "logit_bias": {0: -1.0}, "presence_penalty": 0.1},
]


@pytest.mark.parametrize("pending", [0, 1])
def test_row_flags_decide_as_the_params(pending):
    """Sequence's sampling flags (read once from the params) give the same fast-path, argmax
    and min_tokens decisions as the params read every step, pending tokens included."""
    from bucketserve.engine.sampler import MASKED, OTHER, PLAIN, _min_tokens_active, _row_kind

    for kind in ROW_KINDS:
        for output in ([], [1], [1, 2], [1, 2, 3]):
            seq = make_seq(output=output, **kind)
            seq.num_pending = pending
            p = seq.params
            assert (_row_kind(seq) == PLAIN) == reference_plain(seq), (kind, output)
            seq.grammar = object()  # the same row under a grammar: MASKED where it was PLAIN
            assert _row_kind(seq) == (MASKED if reference_plain(seq, grammar=False) else OTHER)
            seq.grammar = None
            assert seq.sample_argmax == (p.greedy or p.top_k == 1)
            assert seq.penalised == (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0
                                     or p.frequency_penalty != 0.0)
            assert _min_tokens_active(seq) == (
                seq.num_output_tokens + seq.num_pending < p.min_tokens), (kind, output)


def test_process_logits_batch_equals_rows_alone():
    """A batch mixing every kind of logit processing (bias, min_tokens active and reached,
    penalties, plain rows) is processed row by row exactly as each row alone."""
    seqs = [make_seq(prompt=[5, 9, 9], output=out, stop_token_ids=[11], **kind)
            for kind in ROW_KINDS for out in ([], [9, 3, 3])]
    logits = rand_logits(len(seqs), 40, seed=11)
    got = Sampler({EOS}).process_logits(logits, seqs)
    for i, seq in enumerate(seqs):
        alone = Sampler({EOS}).process_logits(logits[i:i + 1], [seq])
        assert torch.equal(got[i:i + 1], alone), i
    assert not torch.equal(got, logits)  # something was processed


def run_steps(seed_seq_position: int, batch_size: int, mates_seed: int, steps: int = 12) -> list[int]:
    """Generate `steps` tokens for a seeded request placed among random batch mates."""
    target = make_seq(temperature=1.0, top_p=0.95, seed=1234, presence_penalty=0.2)
    mate_gen = torch.Generator().manual_seed(mates_seed)
    mates = [make_seq(temperature=1.0, seed=(None if j % 2 else 99 + j))
             for j in range(batch_size - 1)]
    sampler = Sampler({EOS}, seed=mates_seed)
    target_logits = rand_logits(steps, 200, seed=42, scale=1.0)  # same model output per step
    for step in range(steps):
        batch = mates[:seed_seq_position] + [target] + mates[seed_seq_position:]
        logits = torch.randn(batch_size, 200, generator=mate_gen)
        logits[seed_seq_position] = target_logits[step]
        out = sampler(logits, batch)
        for seq, tok in zip(batch, out.token_ids, strict=True):
            seq.token_ids.append(tok)
    return target.output_token_ids


def test_seeded_request_independent_of_batch():
    alone = run_steps(0, 1, mates_seed=0)
    assert run_steps(3, 6, mates_seed=1) == alone
    assert run_steps(5, 6, mates_seed=2) == alone
    assert run_steps(1, 3, mates_seed=3) == alone


def test_unseeded_rows_vary_and_seeds_differ():
    logits = torch.zeros(2, 1000)
    a = Sampler(set(), seed=0)(logits, [make_seq(seed=1), make_seq(seed=2)]).token_ids
    b = Sampler(set(), seed=0)(logits, [make_seq(seed=1), make_seq(seed=2)]).token_ids
    assert a == b  # same seeds -> same draws
    draws = {tuple(Sampler(set(), seed=0)(logits, [make_seq(seed=s), make_seq(seed=s + 1)]).token_ids)
             for s in range(10)}
    assert len(draws) > 5  # different seeds -> different draws


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_are_raw_log_softmax(temperature):
    logits = rand_logits(3, 100, seed=9)
    seqs = [
        make_seq(temperature=temperature, logprobs=5, repetition_penalty=1.5, output=[0, 1]),
        make_seq(temperature=temperature),
        make_seq(temperature=temperature, logprobs=0),
    ]
    out = Sampler({EOS}, seed=1)(logits, seqs)
    ref = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[1] is None
    for i in (0, 2):
        lp = out.logprobs[i]
        assert lp is not None and lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(float(ref[i, lp.token_id]), abs=1e-5)
    top = out.logprobs[0].top
    assert len(top) == 5 and out.logprobs[2].top == []
    values = [v for _, v in top]
    assert values == sorted(values, reverse=True)
    want = torch.topk(ref[0], 5)
    assert [t for t, _ in top] == want.indices.tolist()
    assert values == pytest.approx(want.values.tolist(), abs=1e-5)


def test_bad_shape_is_reported():
    with pytest.raises(ValueError, match="logits must be"):
        Sampler()(torch.zeros(2, 5), [make_seq()])

"""Padding where it costs (issue 11): the start-up cost model that picks, per prefill / mixed
step, between replaying the piecewise graphs at the next captured size and an eager run of the
step's exact tokens; the runner following it; padding counted per step kind in the stats."""

from __future__ import annotations

import random

import pytest
import torch

from bucketserve.engine.block_manager import BlockManager
from bucketserve.engine.kv_budget import KVLayout, StepLimits
from bucketserve.engine.runner import ModelRunner
from bucketserve.engine.sampler import Sampler
from bucketserve.engine.scheduler import ScheduledBatch
from bucketserve.engine.sequence import SamplingParams, Sequence
from bucketserve.engine.stats import EngineStats, StepStats
from bucketserve.kernels.cuda_graphs import (
    GRAPH_TIE_MARGIN,
    PaddingCostModel,
    PiecewiseGraphs,
    next_size,
)
from tests.test_piecewise_graphs import VOCAB, tiny_model

SIZES = (16, 64, 256, 1024, 2048)


def brute_choice(model: PaddingCostModel, n: int) -> int | None:
    t = next_size(list(model.sizes), n)
    if t is None:
        return None
    eager = model.eager_estimate(n) * (1 + GRAPH_TIE_MARGIN)
    return t if model.graph_ms[model.sizes.index(t)] <= eager else None


def test_launch_bound_steps_always_replay_the_next_size() -> None:
    # eager pays ~10 ms of launches at any size; the graphs cost only the arithmetic
    eager = tuple(10.0 + 0.001 * t for t in SIZES)
    graphs = tuple(0.2 + 0.001 * t for t in SIZES)
    model = PaddingCostModel(SIZES, graphs, eager)
    for n in range(1, SIZES[-1] + 1):
        assert model.choose(n) == next_size(list(SIZES), n), n
    assert model.choose(SIZES[-1] + 1) is None
    assert model.eager_from() is None


def test_arithmetic_bound_steps_run_eagerly_when_padding_costs_more() -> None:
    # both times linear in the rows (15 us a token), eager with 1 ms of launches on top
    eager = tuple(1.0 + 0.015 * t for t in SIZES)
    graphs = tuple(0.015 * t for t in SIZES)
    model = PaddingCostModel(SIZES, graphs, eager)
    assert model.choose(1024) == 1024  # no padding: the graphs win
    assert model.choose(1025) is None  # 2048 rows for 1,025 tokens: eager
    assert model.choose(1990) == 2048  # 58 padding rows cost less than 1 ms of launches
    assert model.choose(16) == 16 and model.choose(10) == 16
    for n in range(1, SIZES[-1] + 2):
        assert model.choose(n) == brute_choice(model, n), n
    # the padding of every replayed step costs at most the eager run's overhead (1 ms) and
    # the tie margin of its time
    for n in range(1, SIZES[-1] + 1):
        t = model.choose(n)
        if t is not None:
            eager = 1.0 + 0.015 * n
            assert 0.015 * (t - n) <= 1.0 + GRAPH_TIE_MARGIN * eager + 1e-9, (n, t)
    first = model.eager_from()
    assert first is not None and model.choose(first) is None
    assert all(model.choose(n) is not None for n in range(1, first))


def test_a_near_tie_replays_the_graph() -> None:
    """Measured on an H100 at the 1B shape: eager launch-bound near 6.1-6.3 ms up to 1,024
    tokens, the 2,048-token graph 6.35 ms. A step of 1,025 tokens replays the graph whichever
    way the noise fell (an eager run holds the host for its launches); a clear win (the 8B
    shape's 18.4 ms eager against a 28.7 ms replay) still runs eagerly."""
    sizes = (16, 1024, 2048, 3072)
    for eager_1024 in (6.0, 6.15, 6.34, 6.5):
        model = PaddingCostModel(sizes, (1.16, 3.64, 6.37, 9.85),
                                 (6.1, eager_1024, 6.9, 10.6))
        assert model.choose(1025) == 2048, eager_1024
        assert model.choose(2049) is None  # 3,072 rows for 2,049 tokens: 9.85 against 6.9
        assert model.eager_from() == 2049
    big = PaddingCostModel(sizes, (3.9, 15.0, 28.7, 42.5), (17.4, 18.4, 31.4, 45.4))
    assert big.choose(1024) == 1024 and big.choose(1025) is None


def test_eager_estimate_interpolates_and_extrapolates() -> None:
    model = PaddingCostModel((16, 64, 256), (1.0, 1.0, 1.0), (2.0, 4.0, 10.0))
    assert model.eager_estimate(1) == 2.0 and model.eager_estimate(16) == 2.0
    assert model.eager_estimate(40) == pytest.approx(3.0)
    assert model.eager_estimate(64) == pytest.approx(4.0)
    assert model.eager_estimate(160) == pytest.approx(7.0)
    assert model.eager_estimate(448) == pytest.approx(16.0)  # along the last segment
    single = PaddingCostModel((100,), (1.0,), (2.0,))
    assert single.eager_estimate(50) == 2.0 and single.eager_estimate(200) == pytest.approx(4.0)
    assert single.choose(100) == 100 and single.choose(101) is None


def test_cost_model_rejects_bad_tables() -> None:
    with pytest.raises(ValueError, match="one graph and one eager time"):
        PaddingCostModel((16, 64), (1.0,), (1.0, 2.0))
    with pytest.raises(ValueError, match="one graph and one eager time"):
        PaddingCostModel((), (), ())
    with pytest.raises(ValueError, match="increasing"):
        PaddingCostModel((64, 16), (1.0, 1.0), (1.0, 1.0))


def test_measure_costs_times_every_size() -> None:
    pw = PiecewiseGraphs(tiny_model(), [16, 64, 256], "cpu", capture=False)
    assert pw.choose(17) == 64  # before measuring: always the next size
    cost = pw.measure_costs(repeats=1, long_tokens=64)
    assert pw.cost is cost and cost.sizes == (16, 64, 256)
    assert all(x > 0 for x in cost.graph_ms + cost.eager_ms)
    for n in (1, 17, 100, 256, 257):
        assert pw.choose(n) == cost.choose(n)
    assert pw.choose(257) is None
    assert set(cost.describe()) == {"sizes", "graph_ms", "eager_ms", "eager_from"}


# ---- the runner follows the model -------------------------------------------------------------

BS = 16


def greedy_batch(rng: random.Random, bm: BlockManager, num_decodes: int,
                 prompts: list[int]) -> ScheduledBatch:
    seqs, counts = [], []
    for _ in range(num_decodes):
        n = rng.randint(2, 60)
        s = Sequence([rng.randrange(3, VOCAB) for _ in range(n)],
                     SamplingParams(max_tokens=4, temperature=0.0))
        bm.allocate(s, n)
        s.num_computed_tokens = n - 1
        seqs.append(s)
        counts.append(1)
    for n in prompts:
        s = Sequence([rng.randrange(3, VOCAB) for _ in range(n)],
                     SamplingParams(max_tokens=4, temperature=0.0))
        bm.allocate(s, n)
        seqs.append(s)
        counts.append(n)
    kind = "mixed" if num_decodes and prompts else ("decode" if num_decodes else "prefill")
    return ScheduledBatch(seqs, counts, num_decodes, kind, 0, 0, sum(counts))


def make_runner(model) -> ModelRunner:
    cfg = model.config
    layout = KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BS, torch.float32)
    limits = StepLimits(max_num_seqs=32, max_num_tokens=512, max_model_len=1024)
    return ModelRunner(model, layout, 400, limits, torch.device("cpu"), torch.float32,
                       Sampler([2]))


def test_runner_replays_or_runs_eagerly_as_the_cost_model_says() -> None:
    model = tiny_model()
    runner = make_runner(model)
    pw = PiecewiseGraphs(model, [16, 64, 256], "cpu", capture=False)
    runner.piecewise = pw
    # graphs cheap up to 64 tokens, 256 rows costly: a step of 65..256 tokens runs eagerly
    pw.cost = PaddingCostModel((16, 64, 256), (1.0, 2.0, 50.0), (5.0, 6.0, 10.0))
    plain = make_runner(tiny_model())  # the same weights (seeded), no piecewise graphs
    bm = BlockManager(400, BS)
    rng = random.Random(7)
    cases = [(3, [37], "graph", 64 - 40), (2, [98], "eager", 0), (0, [16], "graph", 0),
             (4, [300], "eager", 0)]  # the last is above every captured size
    for decodes, prompts, path, padding in cases:
        batch = greedy_batch(rng, bm, decodes, prompts)
        before = (runner.num_piecewise_steps, runner.num_cost_eager_steps)
        out = runner.run(batch)
        want = plain.run(batch)
        assert out.num_padding == padding, (decodes, prompts)
        graph_steps = runner.num_piecewise_steps - before[0]
        eager_steps = runner.num_cost_eager_steps - before[1]
        if path == "graph":
            assert (graph_steps, eager_steps) == (1, 0)
        else:
            assert graph_steps == 0
            assert eager_steps == (1 if pw.padded_size(batch.num_tokens) else 0)
        assert (out.seqs, out.ids) == (want.seqs, want.ids)  # both paths compute the same forward
        assert want.num_padding == 0


# ---- padding per step kind in the stats ---------------------------------------------------------

def step(kind: str, computed: int, padding: int) -> StepStats:
    return StepStats(kind=kind, bucket=0, num_seqs=1, num_prefill_seqs=0, num_decode_seqs=1,
                     computed_tokens=computed, useful_tokens=computed - padding,
                     kv_blocks_used=0, kv_blocks_total=10, num_preemptions=0, num_waiting=0,
                     num_running=1, step_time_s=0.01, padding_tokens=padding)


def test_stats_count_padding_per_step_kind() -> None:
    stats = EngineStats()
    assert stats.padding_share() == 0.0 and stats.padding_share("mixed") == 0.0
    stats.record(step("decode", 64, 14))
    stats.record(step("decode", 32, 2))
    stats.record(step("mixed", 1024, 100))
    stats.record(step("prefill", 500, 0))
    snap = stats.snapshot()
    assert snap["kind_computed_tokens"] == {"decode": 96, "mixed": 1024, "prefill": 500}
    assert snap["kind_padding_tokens"] == {"decode": 16, "mixed": 100, "prefill": 0}
    assert stats.padding_share("decode") == pytest.approx(16 / 96)
    assert stats.padding_share("mixed") == pytest.approx(100 / 1024)
    assert stats.padding_share("prefill") == 0.0
    assert stats.padding_share() == pytest.approx(116 / 1620)
    assert stats.padding_share("unknown") == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_kv_layout_counts_the_bytes_its_pool_takes(dtype) -> None:
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=BS, dtype=dtype)
    pool = layout.pool(5, "cpu")
    assert pool.shape == (3, 2, 5, BS, 2, 8) and pool.dtype == dtype
    assert pool.numel() * pool.element_size() == 5 * layout.bytes_per_block()

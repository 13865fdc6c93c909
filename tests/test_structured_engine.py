"""Grammar-constrained decoding and logit_bias in the engine (engine/structured.py), on the
default model (SmolLM2-135M, CPU), synchronous and overlapped scheduling."""

from __future__ import annotations

import dataclasses
import json
import re
import threading
from concurrent.futures import Future

import jsonschema
import pytest
import torch

from bucketserve.buckets import load_buckets
from bucketserve.engine.llm_engine import LLMEngine
from bucketserve.engine.sequence import GuidedDecoding, SamplingParams
from bucketserve.engine.structured import GrammarError, check_guided
from bucketserve.models import load_model

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"]}


@pytest.fixture(scope="module")
def loaded():
    return load_model("smollm2-135m-instruct", device="cpu")


@pytest.fixture(scope="module", params=["sync", "overlapped", "overlapped_fill",
                                        "overlapped_early_fill", "overlapped_ahead",
                                        "overlapped_ahead_llguidance", "sync_llguidance"])
def engine(request, loaded):
    buckets = load_buckets(None, max_model_len=loaded.max_model_len)
    mode, _, backend = request.param.partition("_llguidance")
    if request.param.endswith("_llguidance"):
        buckets = dataclasses.replace(buckets, structured_backend="llguidance")
    eng = LLMEngine(loaded, buckets, "cpu", async_scheduling=mode != "sync")
    eng.overlap_fill = mode.endswith(("_fill", "_ahead"))
    eng.early_fill = mode == "overlapped_early_fill"
    eng.schedule_ahead = mode == "overlapped_ahead"
    return eng


@pytest.fixture(scope="module")
def overlapped(loaded):
    return LLMEngine(loaded, load_buckets(None, max_model_len=loaded.max_model_len), "cpu",
                     async_scheduling=True)


def prompt(engine: LLMEngine, text: str) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


def prompt_for(loaded, text: str) -> list[int]:
    tok = loaded.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


def test_guided_kinds_match_and_stop(engine):
    p = prompt(engine, "Describe a person as JSON.")
    params = [
        SamplingParams(max_tokens=80, temperature=0, guided=GuidedDecoding("json", json.dumps(PERSON))),
        SamplingParams(max_tokens=80, temperature=0.9, seed=3,
                       guided=GuidedDecoding("json", json.dumps(PERSON))),
        SamplingParams(max_tokens=40, temperature=0, guided=GuidedDecoding("json_object")),
        SamplingParams(max_tokens=20, temperature=0.7, seed=1,
                       guided=GuidedDecoding("choice", json.dumps(["red", "green", "blue"]))),
        SamplingParams(max_tokens=20, temperature=0, guided=GuidedDecoding("regex", r"[0-9]{3}-[a-z]{2}")),
        SamplingParams(max_tokens=20, temperature=0,
                       guided=GuidedDecoding("grammar", 'root ::= "yes" | "no" | "maybe"')),
        SamplingParams(max_tokens=8, temperature=0),  # unconstrained batch mate
    ]
    outs = engine.generate([p] * len(params), params)
    for o in outs[:2]:
        jsonschema.validate(json.loads(o.text), PERSON)
        assert " " not in o.text.replace(json.loads(o.text)["name"], "")  # compact separators
    # any JSON object is unbounded: it stops as a whole object or runs to max_tokens
    assert outs[2].text.startswith("{")
    if outs[2].finish_reason == "stop":
        assert isinstance(json.loads(outs[2].text), dict)
    assert outs[3].text in ("red", "green", "blue")
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", outs[4].text)
    assert outs[5].text in ("yes", "no", "maybe")
    assert all(outs[i].finish_reason == "stop" for i in (0, 1, 3, 4, 5))
    # the unconstrained row is what it is alone
    alone = engine.generate([p], SamplingParams(max_tokens=8, temperature=0))[0]
    assert outs[6].token_ids == alone.token_ids


def test_logit_bias(overlapped):
    engine = overlapped
    tok = engine.tokenizer
    p = prompt(engine, "Say something.")
    forced = tok.encode(" banana", add_special_tokens=False)[0]
    out = engine.generate([p], SamplingParams(max_tokens=5, temperature=0.8, seed=0,
                                              logit_bias={forced: 100.0}))[0]
    assert out.token_ids == [forced] * 5
    free = engine.generate([p], SamplingParams(max_tokens=3, temperature=0))[0]
    banned = engine.generate([p], SamplingParams(max_tokens=3, temperature=0,
                                                 logit_bias={free.token_ids[0]: -100.0}))[0]
    assert banned.token_ids[0] != free.token_ids[0]


def test_json_never_holds_a_raw_control_character(engine):
    """Compact JSON has no raw byte 0x00-0x1F; xgrammar 0.2.9 lets most of them into a string
    with a length bound. A logit_bias that favours them must still give valid JSON."""
    tok = engine.tokenizer
    controls = [i for i in range(tok.vocab_size)
                if len(tok.token_bytes(i)) == 1 and tok.token_bytes(i)[0] < 0x20]
    assert len(controls) > 10
    p = prompt(engine, "Describe a person as JSON.")
    # (bounded, so that either backend's document ends inside max_tokens)
    for schema in (PERSON, {"type": "object", "properties": {
            "names": {"type": "array", "items": {"type": "string", "minLength": 3,
                                                 "maxLength": 16}, "maxItems": 3}},
            "required": ["names"]}):
        out = engine.generate([p], SamplingParams(
            max_tokens=80, temperature=0, logit_bias={t: 50.0 for t in controls},
            guided=GuidedDecoding("json", json.dumps(schema))))[0]
        assert not set(out.token_ids) & set(controls), out.text
        jsonschema.validate(json.loads(out.text), schema)  # json.loads refuses raw controls
        assert out.finish_reason == "stop"


def test_compiling_grammar_does_not_stall_others(overlapped, monkeypatch):
    """A request whose grammar is not compiled yet waits in the queue; others run."""
    engine = overlapped
    pending: Future = Future()
    real_submit = engine.grammar_compiler.submit
    monkeypatch.setattr(engine.grammar_compiler, "submit", lambda g: pending)
    p = prompt(engine, "Pick a colour.")
    guided = engine.add_request(p, SamplingParams(
        max_tokens=10, temperature=0, guided=GuidedDecoding("choice", '["red","blue"]')))
    other = engine.add_request(p, SamplingParams(max_tokens=4, temperature=0))
    finished = {}
    for _ in range(20):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if other.request_id in finished:
            break
    assert other.request_id in finished and guided.num_computed_tokens == 0
    pending.set_result(real_submit(guided.params.guided).result())
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished[guided.request_id].text in ("red", "blue")


def test_bad_specs_are_refused_up_front():
    for g in [GuidedDecoding("json", '{"type": "nonsense"}'), GuidedDecoding("json", "{"),
              GuidedDecoding("regex", "(unclosed"), GuidedDecoding("choice", "[]"),
              GuidedDecoding("grammar", "root ::= missing_rule"), GuidedDecoding("nope")]:
        with pytest.raises(GrammarError):
            check_guided(g)


def test_logit_bias_validated():
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={5: 101.0})


def test_preemption_keeps_the_matcher(loaded, overlapped):
    """A pool too small for the batch preempts guided sequences (recompute); their matchers
    stay with them, so the greedy outputs equal those of a roomy pool."""
    buckets = load_buckets(None, max_model_len=loaded.max_model_len)
    p = prompt(overlapped, "Describe a person as JSON.")
    blocks = -(-(len(p) + 40) // buckets.block_size) + 1
    tight = LLMEngine(loaded, buckets, "cpu", num_blocks=blocks * 2 + 1, async_scheduling=True)
    params = [SamplingParams(max_tokens=40, temperature=0,
                             guided=GuidedDecoding("json", json.dumps(PERSON)))] * 4
    # compiled before the four arrive, so that they are admitted in one step and outgrow the
    # pool together (a compile that ends between two of them would stagger their admissions)
    tight.grammar_compiler.submit(params[0].guided).result()
    outs = tight.generate([p] * 4, params)
    assert tight.stats.preemptions_total > 0
    want = overlapped.generate([p], params[:1])[0]
    for o in outs:
        assert o.token_ids == want.token_ids and o.finish_reason == "stop"
        jsonschema.validate(json.loads(o.text), PERSON)


@pytest.mark.parametrize("ahead", [False, True], ids=["overlap_fill_0", "schedule_ahead"])
def test_overlapped_guided_steps_resolve_after_the_forward_is_queued(loaded, ahead):
    """Overlapped scheduling with a grammar: the previous step is resolved once the next
    forward is queued and before its sampling reads the newest tokens (the mask), so the host
    work hides behind the forward; and each call queues the following step's forward behind
    its sampling before it returns, so the device computes it while the caller sends the
    outputs. With `schedule_ahead` (the default) that following step is scheduled and
    prepared inside the resolve, before the sampling, and queued right after it. The tokens
    are those of synchronous scheduling. Fresh engines: a prefix cached by another test would
    change the numerics."""
    sync, overlapped = (LLMEngine(loaded, load_buckets(None, max_model_len=loaded.max_model_len),
                                  "cpu", async_scheduling=a) for a in (False, True))
    overlapped.overlap_fill = overlapped.schedule_ahead = ahead
    p = prompt(overlapped, "Describe a person as JSON.")
    params = [SamplingParams(max_tokens=60, temperature=0,
                             guided=GuidedDecoding("json", json.dumps(PERSON))),
              SamplingParams(max_tokens=30, temperature=0)]
    want = [o.token_ids for o in sync.generate([p, p], params)]

    runner = overlapped.runner
    launch_forward, sample_queued = runner.launch_forward, runner.sample_queued
    model_forward, step_news = runner.model.forward, overlapped.step_news
    events: list[str] = []

    def forward(*args, **kwargs):
        events.append("F" if torch.is_inference_mode_enabled() else "f")  # (no autograd)
        return model_forward(*args, **kwargs)

    def traced_launch_forward(batch):
        events.append("Q")
        return launch_forward(batch)

    prepare_forward, enqueue_forward = runner.prepare_forward, runner.enqueue_forward

    def traced_prepare_forward(batch, after=None):
        events.append("P")
        return prepare_forward(batch, after)

    def traced_enqueue_forward(prepared):
        events.append("E")
        return enqueue_forward(prepared)

    def traced_sample_queued(queued, before_sample=None, **kwargs):
        events.append("S")

        def resolve() -> None:
            events.append("R")
            before_sample()

        return sample_queued(queued, resolve if before_sample is not None else None, **kwargs)

    def traced_step_news():
        news = step_news()
        events.append("|")
        return news

    runner.launch_forward, runner.sample_queued = traced_launch_forward, traced_sample_queued
    runner.prepare_forward, runner.enqueue_forward = traced_prepare_forward, traced_enqueue_forward
    runner.model.forward, overlapped.step_news = forward, traced_step_news
    got = [o.token_ids for o in overlapped.generate([p, p], params)]
    assert got == want
    assert json.loads(overlapped.tokenizer.decode(got[0]))  # a whole document
    steps = "".join(events)
    # every guided step after the first two: sampled at the start of a call, its predecessor
    # resolved inside (after its forward, queued by the call before), then the next forward
    # queued before the call returns (launch_forward: Q, its halves P and E; schedule_ahead:
    # prepared after the resolve, before the sampling, and queued after it)
    assert steps.count("SRPEF|" if ahead else "SRQPEF|") >= len(want[0]) - 3, steps
    # a queued forward's model run comes with it (never a sampling or a resolve before it)
    assert steps.count("EF") == steps.count("E") > 0, steps
    assert "f" not in steps, steps  # every forward, queued or not, runs in inference mode


class SmallVocab:
    """The tokenizer interface GrammarCompiler reads: id 0 EOS, then every printable ASCII
    character (a RAW vocabulary), so a document is accepted one character at a time."""

    def __init__(self) -> None:
        self.tokens = ["</s>", *(chr(c) for c in range(32, 127))]
        self.vocab_size = len(self.tokens)
        self.eos_token_ids = {0}
        self.is_byte_level = False

    def id_to_token(self, i: int) -> str:
        return self.tokens[i]

    def ids(self, text: str) -> list[int]:
        return [self.tokens.index(c) for c in text]


@pytest.fixture(scope="module")
def small_compiler():
    from bucketserve.engine.structured import GrammarCompiler

    vocab = SmallVocab()
    return vocab, GrammarCompiler(vocab, 128, threads=1)


def small_state(small_compiler, spec: str = '["yes", "no", "maybe"]'):
    _, compiler = small_compiler
    st = compiler.state(GuidedDecoding("choice", spec))
    st.future.result()
    assert st.ready() and st.error is None
    return st


def test_terminated_is_the_matchers_after_every_accept(small_compiler):
    """GrammarState.terminated (kept on the host; the matcher is asked only after a stop
    token) is what the matcher says after each accepted or rejected token: EOS before the
    document is complete is rejected and ends nothing, EOS after it ends the grammar."""
    vocab, _ = small_compiler
    st = small_state(small_compiler)
    assert st.terminated is False and st.matcher.is_terminated() is False
    oks = []
    for tok in [*vocab.ids("may"), 0, vocab.ids("x")[0], *vocab.ids("be"), 0]:
        oks.append(st.accept(tok))
        assert st.terminated == st.matcher.is_terminated()
    assert oks == [True, True, True, False, False, True, True, True]
    assert st.terminated  # the document, then EOS


@pytest.mark.parametrize("raw", [True, False], ids=["raw", "wrapper"])
def test_accepts_on_the_fill_thread_equal_accepting_here(small_compiler, monkeypatch, raw):
    """BUCKETSERVE_OVERLAP_FILL=4: a step's accepts handed to the fill thread
    (structured.BatchAccepts, run by GrammarMasks.start ahead of the fill) give each row the
    answer and the `terminated` its own GrammarState.accept gives (a valid token, a rejected
    one, EOS ending a document), they run on the fill thread, and the masks applied after them
    equal those of accepting here first: a row whose grammar the accept ended is not masked.
    Through xgrammar's batch accept without its Python wrapper (`raw`) and with it (where the
    library lacks the former)."""
    import torch

    from bucketserve.engine import structured
    from bucketserve.engine.structured import BatchAccepts, GrammarMasks

    if raw:
        assert structured._RAW_BATCH_ACCEPT is not None  # (this xgrammar has it)
    else:
        monkeypatch.setattr(structured, "_RAW_BATCH_ACCEPT", None)

    vocab, _ = small_compiler
    texts = ["", "y", "ma", "mayb", "no", "ye"]
    tokens = [vocab.ids("y")[0], vocab.ids("x")[0], vocab.ids("y")[0], vocab.ids("e")[0], 0,
              vocab.ids("s")[0]]
    here, there = ([small_state(small_compiler) for _ in texts] for _ in range(2))
    for states in (here, there):
        for st, text in zip(states, texts, strict=True):
            for tok in vocab.ids(text):
                assert st.accept(tok)
    want = {j: st.accept(tok) for j, (st, tok) in enumerate(zip(here, tokens, strict=True))}
    assert list(want.values()) == [True, False, True, True, True, True]
    assert [st.terminated for st in here] == [False, False, False, False, True, False]

    ran_on: list[str] = []

    class Spied(BatchAccepts):
        def __call__(self):
            ran_on.append(threading.current_thread().name)
            super().__call__()

    rows = list(range(6))
    accepts = Spied(there, tokens, rows)
    masks_there, masks_here = GrammarMasks(), GrammarMasks()
    masks_there.start(rows, there, 6, 128, torch.device("cpu"), accepts)
    assert accepts.results() == want and ran_on == ["grammar-fill"]
    assert [st.terminated for st in there] == [st.terminated for st in here]
    logits = torch.randn(6, 128, generator=torch.Generator().manual_seed(0))
    got, ref = logits.clone(), logits.clone()
    masks_there.apply(got, rows, there)
    masks_here.apply(ref, rows, here)
    assert torch.equal(got, ref)
    assert torch.equal(got[4], logits[4])  # its grammar ended: left alone
    assert not torch.equal(got[0], logits[0])


@pytest.mark.parametrize("fill_threads", [None, "1", "3"])
def test_grammar_masks_equal_one_row_at_a_time(small_compiler, fill_threads, monkeypatch):
    """GrammarMasks.apply over several steps (the same rows again, a new set of rows, a row whose
    grammar has ended, one live row) masks each row as that row's own bitmask does, with the
    batch fill on the default number of threads and on those BUCKETSERVE_FILL_THREADS names."""
    import torch
    import xgrammar as xgr

    from bucketserve.engine.structured import GrammarMasks

    if fill_threads is not None:
        monkeypatch.setenv("BUCKETSERVE_FILL_THREADS", fill_threads)
    vocab, _ = small_compiler
    states = [small_state(small_compiler) for _ in range(6)]
    for st, text in zip(states, ["", "y", "ma", "mayb", "n", "ye"], strict=True):
        for tok in vocab.ids(text):
            assert st.accept(tok)
    masks = GrammarMasks()
    steps = [[0, 2, 3, 5], [0, 2, 3, 5], [1, 2, 4], [1, 2, 4], [4], [0, 1, 2, 3, 4, 5]]
    for step, rows in enumerate(steps):
        if step == 3:  # row 4's grammar ends: "no", then EOS
            for tok in [*vocab.ids("o"), 0]:
                assert states[4].accept(tok)
            assert states[4].terminated
        logits = torch.randn(6, 128, generator=torch.Generator().manual_seed(step))
        got = logits.clone()
        masks.apply(got, rows, [states[r] for r in rows])
        want = logits.clone()
        for r in rows:
            if states[r].terminated:
                continue
            bitmask = xgr.allocate_token_bitmask(1, 128)
            states[r].matcher.fill_next_token_bitmask(bitmask, 0)
            xgr.apply_token_bitmask_inplace(want[r:r + 1], bitmask)
        assert torch.equal(got, want), step


def test_llguidance_and_xgrammar_rows_are_masked_in_one_step(loaded):
    """The llguidance backend: a step whose rows run on both libraries (JSON schemas on
    llguidance, an EBNF grammar on xgrammar) masks each row as its own library masks it alone,
    whether the fill runs in the sampling or was started on the fill thread, with several
    rows of a library or one. llguidance's grammar ends at the document's closing brace
    (nothing but EOS can follow), and a spec it cannot build fails that request alone."""
    import numpy as np
    import xgrammar as xgr

    from bucketserve.engine.structured import GrammarCompiler, GrammarMasks

    tok = loaded.tokenizer
    vocab = loaded.config.vocab_size
    compiler = GrammarCompiler(tok, vocab, threads=1, backend="llguidance")
    schema = GuidedDecoding("json", json.dumps(PERSON))
    specs = [schema] * 4 + [GuidedDecoding("grammar", 'root ::= "yes" | "no"')]
    states = [compiler.state(g) for g in specs]
    for st in states:
        st.future.result()
        assert st.ready() and st.error is None
    assert [st.llguidance for st in states] == [True] * 4 + [False]
    texts = ["", '{"name":"Jo', '{"name":"Jo","age":3', '{"name":"Jo","age":3,"tags":["a"', ""]
    for st, text in zip(states, texts, strict=True):
        for t in tok.encode(text, add_special_tokens=False):
            assert st.accept(t)
    masks = GrammarMasks()
    for step, (rows, started) in enumerate([([0, 1, 2, 3, 4], False), ([0, 1, 2, 3, 4], True),
                                            ([1, 4], True), ([2], False), ([3, 4], False)]):
        logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(step))
        got = logits.clone()
        if started:
            masks.start(rows, [states[r] for r in rows], 5, vocab, torch.device("cpu"))
        masks.apply(got, rows, [states[r] for r in rows])
        want = logits.clone()
        for r in rows:
            bitmask = xgr.allocate_token_bitmask(1, vocab)
            if states[r].llguidance:
                states[r].matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.shape[1] * 4)
            else:
                states[r].matcher.fill_next_token_bitmask(bitmask, 0)
            xgr.apply_token_bitmask_inplace(want[r:r + 1], bitmask)
        assert torch.equal(got, want), step
        allowed = np.isfinite(got[rows].numpy()).sum(axis=1)
        assert (allowed > 0).all() and (allowed < vocab).all(), step  # each row masked
    # the document's last token ends llguidance's grammar (no EOS needed); the EBNF row's
    # ends only with EOS, as xgrammar's do
    done = states[2]
    for t in tok.encode(',"tags":[]}', add_special_tokens=False):
        assert not done.terminated
        assert done.accept(t)
    assert done.terminated
    for t in tok.encode("yes", add_special_tokens=False):
        assert states[4].accept(t)
    assert not states[4].terminated
    assert states[4].accept(sorted(tok.eos_token_ids)[0]) and states[4].terminated
    bad = compiler.state(GuidedDecoding("regex", "[0-9"))
    with pytest.raises(Exception, match="regex|parse|unclosed|bracket"):
        bad.future.result()
    assert bad.ready() and "could not be compiled" in bad.error


def test_grammar_masks_on_a_growing_batch_double_their_buffers(small_compiler):
    """A batch that grows step by step (a server ramping up) gets correct masks, and the host
    buffers are reallocated only when outgrown, at least doubling (each growth is a page-locked
    allocation on CUDA): 2, 3, 4, 5, 9 rows take buffers of 2, 4, 4, 8, 16 rows."""
    import torch
    import xgrammar as xgr

    from bucketserve.engine.structured import GrammarMasks

    vocab, _ = small_compiler
    masks = GrammarMasks()
    caps = []
    for step, b in enumerate((2, 3, 4, 5, 9)):
        states = [small_state(small_compiler) for _ in range(b)]
        for i, st in enumerate(states):
            for tok in vocab.ids(["", "y", "ma", "n"][i % 4]):
                assert st.accept(tok)
        logits = torch.randn(b, 128, generator=torch.Generator().manual_seed(step))
        got = logits.clone()
        masks.apply(got, list(range(b)), states)
        want = logits.clone()
        for r, st in enumerate(states):
            bitmask = xgr.allocate_token_bitmask(1, 128)
            st.matcher.fill_next_token_bitmask(bitmask, 0)
            xgr.apply_token_bitmask_inplace(want[r:r + 1], bitmask)
        assert torch.equal(got, want), b
        caps.append(masks._host[0][0].shape[0])
    assert caps == [2, 4, 4, 8, 16]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_guided_batches_are_masked_in_place(small_compiler, dtype):
    """A batch of greedy rows whose only processing is a grammar (the runner's logits, passed
    with inplace=True) is masked in the logits' own dtype without a copy and gives the tokens
    of the copying path; a batch with any other row (logprobs, a draw, active min_tokens)
    takes the copying path, and without inplace the caller's logits are never touched."""
    from bucketserve.engine.sampler import Sampler
    from bucketserve.engine.sequence import Sequence

    def batch(extra: dict) -> list:
        seqs = []
        for i, params in enumerate([{}, {}, extra, {}, {}]):
            seq = Sequence([1, 2, 3], SamplingParams(**{"max_tokens": 8, "temperature": 0,
                                                        **params}))
            if i % 2 == 0:
                seq.grammar = small_state(small_compiler)
            seqs.append(seq)
        return seqs

    gen = torch.Generator().manual_seed(0)
    for extra, fast in [({}, True), ({"logprobs": 2}, False),
                        ({"temperature": 0.7, "seed": 3}, False), ({"min_tokens": 2}, False)]:
        logits = torch.randn(5, 128, generator=gen).to(dtype)
        raw = logits.clone()
        want, _ = Sampler(seed=0).sample(logits, batch(extra))
        assert torch.equal(logits, raw)  # not in place without inplace=True
        got, _ = Sampler(seed=0).sample(logits, batch(extra), inplace=True)
        assert torch.equal(got, want), extra
        # the fast path wrote -inf over the grammar rows' banned tokens; the other left them
        assert torch.equal(logits, raw) is not fast, extra
        for r in (0, 2, 4):  # each grammar row took an allowed token: a choice's first letter
            assert small_compiler[0].tokens[int(got[r])] in "ynm", (extra, r)


def test_the_cuda_mask_kernel_masks_bf16_logits_as_float32(monkeypatch):
    """On CUDA, GrammarMasks.apply runs xgrammar's Triton kernel (its "auto" backend there),
    now on the logits in the model's dtype: through Triton's interpreter, bf16 logits get -inf
    exactly where float32 ones do (the rows the indices name, by their bitmask rows) and keep
    every other value. On a GPU, tests/test_structured_gpu.py runs the compiled kernel."""
    import types

    from triton_interp import interpreted_triton

    interpreted_triton()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a, **k: types.SimpleNamespace(
        multi_processor_count=4, gcnArchName=""))
    from xgrammar.kernels.apply_token_bitmask_inplace_triton import (
        apply_token_bitmask_inplace_triton,
    )

    gen = torch.Generator().manual_seed(0)
    vocab = 300
    bitmask = torch.randint(-2**31, 2**31 - 1, (4, (vocab + 31) // 32), generator=gen,
                            dtype=torch.int64).to(torch.int32)
    rows = torch.tensor([0, 2], dtype=torch.int32)
    base = torch.randn(3, vocab, generator=gen)
    wide, narrow = base.clone(), base.to(torch.bfloat16)
    apply_token_bitmask_inplace_triton(wide, bitmask, None, rows)
    apply_token_bitmask_inplace_triton(narrow, bitmask, None, rows)
    banned = torch.isinf(wide)
    assert banned[[0, 2]].any() and not banned[1].any()
    for r in (0, 2):  # bit t of row r's mask clear <=> token t banned
        bits = (bitmask[r].to(torch.int64).unsqueeze(1) >> torch.arange(32)) & 1
        assert torch.equal(banned[r], bits.reshape(-1)[:vocab] == 0)
    assert torch.equal(torch.isinf(narrow), banned)
    assert torch.equal(narrow[~banned], base.to(torch.bfloat16)[~banned])


def test_fill_threads_setting():
    from bucketserve.engine.structured import fill_threads

    assert fill_threads("", cores=16) == 8
    assert fill_threads("", cores=64) == 8
    assert fill_threads("", cores=2) == 1
    assert fill_threads("", cores=1) == 1
    assert fill_threads("3", cores=16) == 3
    assert fill_threads(" 12 ", cores=2) == 12
    for bad in ("0", "-1", "two", "1.5"):
        with pytest.raises(ValueError, match="BUCKETSERVE_FILL_THREADS"):
            fill_threads(bad)


def test_a_bad_fill_threads_value_fails_the_engine_start(loaded, monkeypatch):
    monkeypatch.setenv("BUCKETSERVE_FILL_THREADS", "none")
    with pytest.raises(ValueError, match="BUCKETSERVE_FILL_THREADS"):
        LLMEngine(loaded, load_buckets(None, max_model_len=loaded.max_model_len), "cpu")


def test_json_rows_mask_control_bytes_and_other_rows_keep_them():
    """json_text_mask on a RAW vocabulary with control characters: a JSON row inside a
    length-bounded string (xgrammar 0.2.9 allows them there) loses every token holding one,
    a regex row in the same step keeps them, alone and beside the JSON row."""
    import torch

    from bucketserve.engine.structured import GrammarCompiler, GrammarMasks

    vocab = SmallVocab()
    vocab.tokens += ["\x01", "a\x01b", "\t"]
    vocab.vocab_size = len(vocab.tokens)
    compiler = GrammarCompiler(vocab, 128, threads=1)
    controls = [vocab.tokens.index(t) for t in ("\x01", "a\x01b", "\t")]
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 20}},
              "required": ["s"]}
    json_row = compiler.state(GuidedDecoding("json", json.dumps(schema)))
    regex_row = compiler.state(GuidedDecoding("regex", "[a\\x01]{1,5}"))
    for st in (json_row, regex_row):
        st.future.result()
        assert st.ready() and st.error is None
    for tok in vocab.ids('{"s":"a'):
        assert json_row.accept(tok)
    assert regex_row.accept(vocab.ids("a")[0])
    masks = GrammarMasks()
    for rows, states in (([0, 1], [json_row, regex_row]), ([0], [json_row]), ([1], [regex_row])):
        logits = torch.zeros(2, 128)
        masks.apply(logits, rows, states)
        for r, st in zip(rows, states, strict=True):
            banned = torch.isinf(logits[r, controls])
            if st is json_row:
                assert banned.all(), rows
                assert not torch.isinf(logits[r, vocab.ids("b")[0]])  # text still allowed
            else:
                assert not banned[0], rows  # the regex allows \x01


def test_mask_fill_on_a_thread_gives_the_same_tokens(loaded, monkeypatch):
    """LLMEngine.overlap_fill: the guided rows' masks are filled on the fill thread while the
    resolve goes on, and every guided step with two rows or more takes that fill; the tokens
    are those of the same requests without it (greedy), with stops and a grammar ending
    mid-batch. `early_fill`: the same, with the accepts and the fill started at the end of
    the call that queued the step (on the CPU the tokens are always on the host by then), and
    the resolve taking the kept accept results instead of accepting again."""
    from bucketserve.engine.runner import RunnerStep
    from bucketserve.engine.structured import GrammarMasks, GrammarState

    taken: list[bool] = []  # per apply that found a started fill: whether it was its own
    take = GrammarMasks._take_pending

    def spy(self, *args):
        pending = self._pending
        got = take(self, *args)
        if pending is not None:  # (accepts_on_thread: a fill whose accepts ended every row
            taken.append(got is not None or pending[4].rows == [])  # filled none)
        return got

    monkeypatch.setattr(GrammarMasks, "_take_pending", spy)
    early_steps: list[RunnerStep] = []
    accept_early = LLMEngine._accept_early

    def spy_early(self):
        accept_early(self)
        if self._inflight is not None and self._inflight.early_accepted is not None:
            early_steps.append(self._inflight)

    monkeypatch.setattr(LLMEngine, "_accept_early", spy_early)
    accepts = [0]
    accept = GrammarState.accept

    def count_accept(self, token):
        accepts[0] += 1
        return accept(self, token)

    monkeypatch.setattr(GrammarState, "accept", count_accept)
    from bucketserve.engine.structured import BatchAccepts

    on_thread: list[tuple[str, int]] = []  # accepts_on_thread: (the thread, rows) per batch
    thread_accept = BatchAccepts.__call__

    def count_thread_accepts(self):
        on_thread.append((threading.current_thread().name, len(self.tokens)))
        accepts[0] += len(self.tokens)
        return thread_accept(self)

    monkeypatch.setattr(BatchAccepts, "__call__", count_thread_accepts)
    from bucketserve.engine.runner import ModelRunner

    prepared_ahead = [0]  # schedule_ahead: steps prepared before the sampling of the one before
    prepare = ModelRunner.prepare_forward

    def count_prepare(self, batch, after=None):
        prepared_ahead[0] += after is not None
        return prepare(self, batch, after)

    monkeypatch.setattr(ModelRunner, "prepare_forward", count_prepare)
    buckets = load_buckets(None, max_model_len=loaded.max_model_len)
    p = [prompt_for(loaded, f"Describe person {i} as JSON.") for i in range(6)]
    params = [SamplingParams(max_tokens=60, temperature=0,
                             guided=GuidedDecoding("json", json.dumps(PERSON)))] * 4 + [
        SamplingParams(max_tokens=20, temperature=0,
                       guided=GuidedDecoding("choice", json.dumps(["red", "green", "blue"]))),
        SamplingParams(max_tokens=12, temperature=0)]
    outs, num_accepts = {}, {}
    for mode in ("off", "fill", "early", "ahead", "thread"):
        eng = LLMEngine(loaded, buckets, "cpu", async_scheduling=True)
        eng.overlap_fill = mode != "off"
        eng.early_fill = mode == "early"
        eng.schedule_ahead = mode in ("ahead", "thread")
        eng.accepts_on_thread = mode == "thread"
        taken.clear()
        early_steps.clear()
        on_thread.clear()
        accepts[0] = prepared_ahead[0] = 0
        outs[mode] = [(o.token_ids, o.finish_reason) for o in eng.generate(p, params)]
        num_accepts[mode] = accepts[0]
        if mode != "off":  # the steady guided steps took the fill started for them
            assert len(taken) > 10 and all(taken), (mode, taken)
        else:
            assert taken == []
        if mode == "early":  # the steady steps accepted early, each step once
            assert len(early_steps) > 10
            assert len(set(map(id, early_steps))) == len(early_steps)
            # (on the CPU a launched step's tokens are on the host at once: never missed)
            assert eng.early_fills == {"taken": len(early_steps), "missed": 0}
        else:
            assert early_steps == []
        if mode in ("ahead", "thread"):  # the steady steps were prepared ahead of the sampling
            assert prepared_ahead[0] > 10  # before
        else:
            assert prepared_ahead[0] == 0
        if mode == "thread":  # the steady steps' accepts ran on the fill thread, in batches
            assert len(on_thread) > 10
            assert {name for name, _ in on_thread} == {"grammar-fill"}, on_thread
            assert max(n for _, n in on_thread) == 5  # every guided row (xgrammar's)
        else:
            assert on_thread == []
    assert outs["fill"] == outs["off"] and outs["early"] == outs["off"]
    assert outs["ahead"] == outs["off"] and outs["thread"] == outs["off"]
    # a token is accepted once with the early accepts too (the resolve takes their results);
    # both accept before the stops are applied, so a row's ending token is accepted as well
    assert (num_accepts["early"] == num_accepts["fill"] == num_accepts["ahead"]
            == num_accepts["thread"])
    assert num_accepts["fill"] >= num_accepts["off"]
    assert [reason for _, reason in outs["off"][:4]] == ["stop"] * 4  # JSON documents end


def test_needs_host_tokens_for_a_pending_grammar_or_penalty():
    """The previous step must be resolved first when a row with a pending token has a grammar or
    a repetition / presence / frequency penalty; not for plain rows, nor without a pending token."""
    from types import SimpleNamespace

    from bucketserve.engine.sequence import Sequence

    def row(pending: int, grammar: bool = False, **params) -> Sequence:
        seq = Sequence([1, 2, 3], SamplingParams(**params))
        seq.num_pending = pending
        seq.grammar = object() if grammar else None
        return seq

    needs = LLMEngine._needs_host_tokens
    plain = [row(1), row(1, temperature=0, logit_bias={3: 1.0}, min_tokens=2, logprobs=1)]
    assert not needs(SimpleNamespace(seqs=plain))
    for special in ({"grammar": True}, {"repetition_penalty": 1.1}, {"presence_penalty": 0.3},
                    {"frequency_penalty": -0.2}):
        assert needs(SimpleNamespace(seqs=[*plain, row(1, **special)])), special
        assert not needs(SimpleNamespace(seqs=[*plain, row(0, **special)])), special


def test_overlapped_news_reach_the_core_once_per_step(loaded):
    """The engine core's path (OutputProcessor.add_news after each step_news, ids only): with
    sequences whose sampling reads the host tokens (a penalty) beside plain ones of staggered
    lengths, a call that resolves two steps (the queued-forward path launches a plain next step
    whole and resolves the one before) must still report each sequence once, so that a
    sequence ending in the second step is not sent after its state is gone; and every request
    gets exactly its max_tokens ids, each once."""
    eng = LLMEngine(loaded, load_buckets(None, max_model_len=loaded.max_model_len), "cpu",
                    async_scheduling=True)
    p = prompt(eng, "Count to ten.")
    want: dict[str, int] = {}
    for i in range(12):
        n = 3 + i
        seq = eng.add_request(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True,
                                                detokenize=False,
                                                repetition_penalty=1.3 if i % 3 == 0 else 1.0))
        want[seq.request_id] = n
    got = {rid: [] for rid in want}
    finished: set[str] = set()
    while eng.has_unfinished():
        outputs, rids, tokens = [], [], []
        eng.outputs.add_news(eng.step_news(), outputs, rids, tokens)
        for rid, tok in zip(rids, tokens, strict=True):
            got[rid].append(tok)
        for o in outputs:
            assert o.request_id not in finished
            got[o.request_id] += o.new_token_ids
            if o.finish_reason is not None:
                assert o.finish_reason == "length"
                finished.add(o.request_id)
    assert finished == set(want)
    assert {rid: len(ids) for rid, ids in got.items()} == want
    assert not eng.outputs.states


def test_early_fill_never_waits_for_the_device(overlapped):
    """`_accept_early` with the in-flight step's tokens not yet on the host (a CUDA event not
    reached) leaves the step to the next resolve: no result taken, no accept, counted missed."""
    from types import SimpleNamespace

    def result():
        raise AssertionError("result() would wait for the device")

    step = SimpleNamespace(sample_seqs=[0], done=lambda: False, result=result,
                           early_accepted=None)
    inflight, queued, counts = overlapped._inflight, overlapped._queued, overlapped.early_fills
    overlapped._inflight, overlapped._queued = step, (None, None)
    overlapped.early_fills = {"taken": 0, "missed": 0}
    try:
        overlapped._accept_early()
        assert step.early_accepted is None
        assert overlapped.early_fills == {"taken": 0, "missed": 1}
    finally:
        overlapped._inflight, overlapped._queued = inflight, queued
        overlapped.early_fills = counts


def test_schedule_ahead_keeps_min_tokens_and_penalties(loaded):
    """`schedule_ahead` counts a step's token as pending before the step samples, so its
    sampling runs with a pending offset of -1: min_tokens must ban the stop tokens for exactly
    as long as without it. Each request stops at the token greedy decoding (with the same
    repetition penalty) gives at position m - 1, and has min_tokens m: that token is banned
    there, so an offset off by one shows as a different output."""
    buckets = load_buckets(None, max_model_len=loaded.max_model_len)
    p = prompt_for(loaded, "Tell me a story about a cat.")
    base = SamplingParams(max_tokens=24, temperature=0, repetition_penalty=1.2)
    ref = LLMEngine(loaded, buckets, "cpu", async_scheduling=True).generate([p], base)[0]
    assert len(ref.token_ids) == 24
    ms = list(range(2, 14, 2))
    params = [SamplingParams(max_tokens=24, temperature=0, repetition_penalty=1.2,
                             min_tokens=m, stop_token_ids=[ref.token_ids[m - 1]]) for m in ms]
    outs = {}
    for mode in ("off", "ahead"):
        eng = LLMEngine(loaded, buckets, "cpu", async_scheduling=True)
        eng.overlap_fill = eng.schedule_ahead = mode == "ahead"
        got = eng.generate([p] * len(ms), params)
        outs[mode] = [(o.token_ids, o.finish_reason) for o in got]
        for (ids, _), m in zip(outs[mode], ms, strict=True):
            assert len(ids) >= m
    assert outs["ahead"] == outs["off"]


@pytest.mark.parametrize("ahead", [False, True], ids=["overlapped", "schedule_ahead"])
def test_a_failed_queued_sampling_ends_its_requests_once(loaded, monkeypatch, ahead):
    """A queued step's sampling fails after its held resolve gave its sequences a token: each
    sequence gets one entry in that call's news (its error), never two (the caller builds one
    output per entry and drops a finished sequence's state at the first). With
    `schedule_ahead` the next step was scheduled and prepared too: its requests end with an
    error as well (its placeholders wait for tokens never made). None is left hanging, the
    blocks come back, and the engine serves the next request."""
    from bucketserve.engine.runner import ModelRunner

    buckets = load_buckets(None, max_model_len=loaded.max_model_len)
    eng = LLMEngine(loaded, buckets, "cpu", async_scheduling=True)
    eng.overlap_fill = eng.schedule_ahead = ahead
    sample = ModelRunner._sample
    calls = [0]

    def failing(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 6:
            raise RuntimeError("injected sampling failure")
        return sample(self, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "_sample", failing)
    p = prompt_for(loaded, "Count to twenty.")
    params = SamplingParams(max_tokens=30, temperature=0, repetition_penalty=1.1)
    seqs = [eng.add_request(p, params) for _ in range(3)]
    ended: dict[str, str | None] = {}
    for _ in range(200):
        if not eng.has_unfinished():
            break
        for out in eng.step():
            if out.finish_reason is not None:
                ended[out.request_id] = out.finish_reason
    assert calls[0] >= 6
    assert set(ended) == {s.request_id for s in seqs}
    assert set(ended.values()) == {"error"}
    assert eng.block_manager.num_used_blocks == 0
    monkeypatch.setattr(ModelRunner, "_sample", sample)
    out = eng.generate([p], params)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 30


def test_overlap_fill_defaults_to_schedule_ahead_and_refuses_a_bad_value(loaded, monkeypatch):
    from bucketserve.engine.llm_engine import OVERLAP_FILL_ENV

    buckets = load_buckets(None, max_model_len=loaded.max_model_len)

    def modes() -> tuple[bool, bool, bool]:
        e = LLMEngine(loaded, buckets, "cpu", async_scheduling=True)
        return e.overlap_fill, e.early_fill, e.schedule_ahead

    monkeypatch.delenv(OVERLAP_FILL_ENV, raising=False)
    assert modes() == (True, False, True)  # measured ahead of 0 (docs/structured-output.md)
    for value, want in (("0", (False, False, False)), ("1", (True, False, False)),
                        ("2", (True, True, False)), (" 3 ", (True, False, True)),
                        ("4", (True, False, True))):
        monkeypatch.setenv(OVERLAP_FILL_ENV, value)
        assert modes() == want, value
        assert LLMEngine(loaded, buckets, "cpu").accepts_on_thread is (value == "4")
    for bad in ("5", "on", "-1"):
        monkeypatch.setenv(OVERLAP_FILL_ENV, bad)
        with pytest.raises(ValueError, match=OVERLAP_FILL_ENV):
            modes()


def test_strict_schema_closes_objects_as_xgrammar_reads_them():
    """For llguidance, every object schema that says nothing of extra keys gets
    `additionalProperties: false` (xgrammar's strict reading), nested ones too, through
    properties, items, anyOf and $defs; what a schema says itself is kept; a property named
    like a keyword is a name, not a keyword; a tuple gets `items: false`."""
    from bucketserve.engine.structured import strict_schema

    schema = {"type": "object", "properties": {
        "type": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "items": {"type": "array", "items": {"properties": {"y": {"type": "string"}}}},
        "open": {"type": "object", "additionalProperties": True},
        "either": {"anyOf": [{"type": "object"}, {"type": "null"}]},
        "pair": {"type": "array", "prefixItems": [{"type": "integer"}, {"$ref": "#/$defs/d"}]}},
        "$defs": {"d": {"type": ["object", "null"], "properties": {}}}}
    got = json.loads(strict_schema(json.dumps(schema)))
    assert got["additionalProperties"] is False
    props = got["properties"]
    assert props["type"]["additionalProperties"] is False
    assert "additionalProperties" not in props["type"]["properties"]["x"]
    assert props["items"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in props["items"]  # an array
    assert props["open"]["additionalProperties"] is True
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert props["pair"]["items"] is False
    assert got["$defs"]["d"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the caller's schema is not touched
    for text in ("[1, 2]", "not json", '"a string"'):
        assert strict_schema(text) == text


def test_the_front_end_checks_specs_with_the_cores_backend():
    """server/structured: a spec is checked by the library the core runs it on (set from
    the core's info at the front end's start): llguidance's regex errors are 400s naming the
    field on its backend, and guided_decoding_backend may name that backend (vLLM's
    "guidance" too) or "auto", nothing else."""
    from types import SimpleNamespace

    from bucketserve.server import structured as s
    from bucketserve.server.errors import APIError

    def req(**fields):
        base = dict.fromkeys(("response_format", "guided_json", "guided_regex", "guided_choice",
                              "guided_grammar", "structured_outputs",
                              "guided_decoding_backend", "guided_whitespace_pattern"))
        return SimpleNamespace(**{**base, **fields})

    try:
        for backend, ok, refused in (("xgrammar", ("xgrammar", "auto"), ("guidance",)),
                                     ("llguidance", ("llguidance", "guidance", "auto"),
                                      ("xgrammar",))):
            s.set_backend(backend)
            for name in ok:
                g = s.guided_decoding(req(guided_choice=["a", "b"], guided_decoding_backend=name))
                assert g.kind == "choice"
            for name in refused:
                with pytest.raises(APIError) as err:
                    s.guided_decoding(req(guided_choice=["a"], guided_decoding_backend=name))
                assert err.value.param == "guided_decoding_backend" and backend in str(
                    err.value.message)
            with pytest.raises(APIError) as err:
                s.guided_decoding(req(guided_regex="[0-9"))
            assert err.value.param == "guided_regex"
            with pytest.raises(APIError) as err:
                s.guided_decoding(req(guided_json={"type": "object", "properties": 3}))
            assert err.value.param == "guided_json"
            assert s.guided_decoding(req(guided_json={"type": "object"})).kind == "json"
        # the EBNF kind stays on xgrammar, whatever the backend
        assert s.guided_decoding(req(guided_grammar='root ::= "a"')).kind == "grammar"
        with pytest.raises(APIError):
            s.guided_decoding(req(guided_grammar="root ::= "))
    finally:
        s.set_backend("xgrammar")

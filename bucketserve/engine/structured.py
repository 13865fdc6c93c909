"""Grammar-constrained decoding with xgrammar: compiled grammars, matchers, token masks.

A request with `SamplingParams.guided` (a `GuidedDecoding`: kind + spec text) decodes under a
grammar:
- `GrammarCompiler` (one per engine) holds the xgrammar TokenizerInfo built once from our
  tokenizer and compiles grammars on a thread pool, cached by (kind, spec): a request's
  compilation never runs in an engine step. The scheduler keeps a request waiting until its
  grammar is compiled (`GrammarState.ready`) and admits the others meanwhile.
- `GrammarState` (one per sequence) holds the xgrammar GrammarMatcher; it accepts every token
  the sequence samples (`accept`) and says when the grammar has ended (`terminated`: asked of
  the matcher when it accepts a stop token, the only token that ends it, and kept, since only
  `accept` changes the matcher).
  Output tokens survive a preemption, and so does the matcher: recompute needs nothing from it.
- `check_guided` builds the xgrammar Grammar without the tokenizer (fast): the server calls it
  in the request path so that a schema xgrammar rejects is a 400 before any token.

JSON grammars are compact (xgrammar's any_whitespace=False with "," and ":" separators: no whitespace
between JSON tokens), so
that a bounded schema has a bounded output and the matcher ends it.

Backends (`[structured] backend`, `--structured-backend`): "xgrammar" (the default) compiles a
grammar into per-state mask caches once; "llguidance" builds a matcher from the spec in about
a millisecond and computes masks lazily, several times faster inside JSON strings
(docs/structured-output.md has the measurements). With "llguidance" the json, json_object,
regex and choice kinds run on it (`LLGuidance`); EBNF grammars (kind "grammar", xgrammar's
GBNF dialect) stay on xgrammar. Both fill the same int32 bitmask layout (bit set: allowed), so
one step masks rows of both with one kernel.

Compact JSON has no raw control character (bytes 0x00-0x1F) anywhere: inside strings JSON
wants them escaped, and between tokens there is no whitespace. xgrammar 0.2.9's rule for a
string with `minLength` / `maxLength` lets most of them through (not newline), so a sampled
control byte would end as invalid JSON (`json.loads` refuses it). The rows of JSON grammars
therefore also mask every token whose bytes hold one (`json_text_mask`, applied with the
grammar's mask on the device).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import queue
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch
import xgrammar as xgr

from bucketserve.engine.sequence import GuidedDecoding

log = logging.getLogger(__name__)

# JSON separators: no whitespace at all
_COMPACT = (",", ":")
KINDS = ("json", "json_object", "regex", "choice", "grammar")


class GrammarError(ValueError):
    """xgrammar cannot build the grammar; the message says why."""


def _choice_ebnf(spec: str) -> str:
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in _choices(spec))


def _grammar_error(exc: Exception) -> GrammarError:
    """A library's exception as a GrammarError: its message's first line."""
    text = str(exc).strip()
    return GrammarError(text.splitlines()[0] if text else type(exc).__name__)


def build_grammar(g: GuidedDecoding) -> xgr.Grammar:
    """The xgrammar Grammar of a spec (no tokenizer needed); GrammarError when it is bad."""
    try:
        if g.kind == "json":
            return xgr.Grammar.from_json_schema(g.spec, any_whitespace=False, separators=_COMPACT)
        if g.kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False,
                                                separators=_COMPACT)
        if g.kind == "regex":
            return xgr.Grammar.from_regex(g.spec)
        if g.kind == "choice":
            return xgr.Grammar.from_ebnf(_choice_ebnf(g.spec))
        if g.kind == "grammar":
            return xgr.Grammar.from_ebnf(g.spec)
    except GrammarError:
        raise
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError / its own
        raise _grammar_error(exc) from exc
    raise GrammarError(f"unknown guided decoding kind {g.kind!r}; one of {', '.join(KINDS)}")


def check_guided(g: GuidedDecoding, backend: str = "xgrammar") -> None:
    """Raises GrammarError when the library that will run the grammar cannot build it:
    xgrammar's builder, or, on the llguidance backend for the kinds it runs, llguidance's
    validator (no tokenizer needed either way)."""
    if backend == "llguidance" and g.kind in LLGUIDANCE_KINDS:
        import llguidance

        why = llguidance.LLMatcher.validate_grammar(llguidance_grammar(g))
        if why:
            raise GrammarError(why.strip().splitlines()[0])
        return
    build_grammar(g)


def tokenizer_info(tokenizer, vocab_size: int) -> xgr.TokenizerInfo:
    """xgrammar's view of our tokenizer: every id's token string (byte-level BPE vocabularies
    as such, others raw), padded to the model's logits width, and our EOS ids as stops."""
    n = tokenizer.vocab_size
    vocab = [tokenizer.id_to_token(i) or "" for i in range(n)]
    kind = xgr.VocabType.BYTE_LEVEL if tokenizer.is_byte_level else xgr.VocabType.RAW
    return xgr.TokenizerInfo(vocab, kind, vocab_size=max(vocab_size, n),
                             stop_token_ids=sorted(tokenizer.eos_token_ids))


def json_text_mask(tokenizer, vocab_size: int) -> torch.Tensor:
    """int32 [ceil(vocab_size / 32)], xgrammar's bitmask layout: every token allowed but those
    whose bytes hold a control character (0x00-0x1F), which compact JSON never has. Ids past
    the tokenizer's vocabulary stay allowed (the grammar's own mask decides them)."""
    words = (vocab_size + 31) // 32
    bits = np.ones(words * 32, dtype=np.uint8)
    for i in range(min(tokenizer.vocab_size, vocab_size)):
        if tokenizer.is_byte_level:
            raw = tokenizer.token_bytes(i)
        else:
            raw = (tokenizer.id_to_token(i) or "").encode("utf-8", "replace")
        if any(b < 0x20 for b in raw):
            bits[i] = 0
    return torch.from_numpy(np.packbits(bits, bitorder="little").view(np.int32).copy())


FILL_THREADS_ENV = "BUCKETSERVE_FILL_THREADS"


def fill_threads(value: str | None = None, cores: int | None = None) -> int:
    """Threads of xgrammar's batch mask fill: `$BUCKETSERVE_FILL_THREADS` (an integer >= 1)
    where set, else half the cores, 1 to 8. The fill returns when its slowest thread does, so
    on a host whose cores the front ends keep busy fewer threads may finish sooner (an
    experiment: structured-output.md). Raises ValueError on a malformed value."""
    value = os.environ.get(FILL_THREADS_ENV, "") if value is None else value
    if value.strip():
        try:
            n = int(value)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"{FILL_THREADS_ENV}={value!r}: expected an integer >= 1")
        return n
    cores = cores if cores is not None else (os.cpu_count() or 2)
    return min(8, max(1, cores // 2))


BACKENDS = ("xgrammar", "llguidance")
# the kinds the llguidance backend runs (EBNF grammars stay on xgrammar: its GBNF dialect)
LLGUIDANCE_KINDS = ("json", "json_object", "regex", "choice")


class LLGuidance:
    """llguidance's side of the llguidance backend: its tokenizer, built once from ours, and
    the grammar text of a spec. A compiled spec is a template matcher; each sequence takes a
    copy (`LLMatcher.deep_copy`, about a microsecond)."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import llguidance

        self.lib = llguidance
        # our tokenizers.Tokenizer as llguidance reads it (its JSON), padded to the logits'
        # width, with our EOS ids as the stop tokens
        backend = copy.copy(tokenizer.backend)
        backend.no_padding()
        backend.no_truncation()
        self.tokenizer = llguidance.LLTokenizer(
            backend.to_str(), n_vocab=vocab_size,
            eos_token=sorted(tokenizer.eos_token_ids) or None)

    def compile(self, g: GuidedDecoding):
        """A template LLMatcher of the spec, its first mask computed once (llguidance builds
        its lexer lazily: the first fill pays for it, here on the compile pool rather than in
        a step)."""
        try:
            text = llguidance_grammar(g)
        except GrammarError:
            raise
        except Exception as exc:  # noqa: BLE001 - llguidance raises ValueError / its own
            raise _grammar_error(exc) from exc
        matcher = self.lib.LLMatcher(self.tokenizer, text, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error().strip().splitlines()[0])
        scratch = np.empty((self.tokenizer.vocab_size + 31) // 32, dtype=np.int32)
        matcher.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
        return matcher


def llguidance_grammar(g: GuidedDecoding) -> str:
    """The llguidance grammar text of a spec (GrammarError for a bad choice list; whether
    the rest is valid, a matcher built from it or llguidance's validator says)."""
    from llguidance import LLMatcher as m

    if g.kind == "json":
        return m.grammar_from_json_schema(strict_schema(g.spec), defaults=_LLG_COMPACT)
    if g.kind == "json_object":
        return m.grammar_from_json_schema('{"type": "object"}', defaults=_LLG_COMPACT)
    if g.kind == "regex":
        return m.grammar_from_regex(g.spec)
    if g.kind == "choice":
        return m.grammar_from_regex("|".join(_regex_literal(c) for c in _choices(g.spec)))
    raise GrammarError(f"llguidance does not run {g.kind!r} grammars")


# keywords whose value is a schema, a list of schemas, or a {name: schema} map
_SUB_SCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else",
               "propertyNames", "additionalProperties", "unevaluatedProperties",
               "unevaluatedItems")
_SUB_SCHEMAS = ("prefixItems", "anyOf", "oneOf", "allOf")
_SUB_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                    "dependentSchemas")


def strict_schema(spec: str) -> str:
    """A JSON schema with xgrammar's strict reading made explicit, for llguidance, which reads
    schemas as JSON Schema says: an object schema that does not say otherwise gets
    `additionalProperties: false`, and a tuple (`prefixItems`) without `items` gets
    `items: false`. Without it llguidance lets a model add keys without end (a small model
    then runs to max_tokens), where xgrammar allows only the keys the schema names. Text that
    is no JSON object is passed on unchanged (llguidance says what is wrong with it)."""
    try:
        schema = json.loads(spec)
    except ValueError:
        return spec
    if not isinstance(schema, dict):
        return spec

    def walk(node):
        if isinstance(node, list):
            for x in node:
                walk(x)
            return
        if not isinstance(node, dict):
            return
        kind = node.get("type")
        objectish = (kind == "object" or (isinstance(kind, list) and "object" in kind)
                     or "properties" in node)
        if objectish and "additionalProperties" not in node \
                and "unevaluatedProperties" not in node:
            node["additionalProperties"] = False
        if "prefixItems" in node and "items" not in node:
            node["items"] = False
        for key in _SUB_SCHEMA:
            if isinstance(node.get(key), (dict, list)):
                walk(node[key])
        for key in _SUB_SCHEMAS:
            if isinstance(node.get(key), list):
                walk(node[key])
        for key in _SUB_SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                for sub in node[key].values():
                    walk(sub)

    walk(schema)
    return json.dumps(schema)


def _choices(spec: str) -> list[str]:
    try:
        choices = json.loads(spec)
    except ValueError as exc:
        raise GrammarError(f"guided_choice is not a JSON list: {exc}") from exc
    if not (isinstance(choices, list) and choices
            and all(isinstance(c, str) and c for c in choices)):
        raise GrammarError("guided_choice must be a non-empty list of non-empty strings")
    return choices


def _regex_literal(text: str) -> str:
    """A regex matching exactly `text` (llguidance's regex syntax: Rust's, where re.escape's
    escapes all hold)."""
    return "(" + re.escape(text) + ")"


# llguidance's JSON options for compact output (no whitespace; "," and ":"), as xgrammar's
_LLG_COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


class GrammarCompiler:
    """Compiles grammars on `threads` worker threads; futures cached by spec (LRU).
    `backend`: "xgrammar" or "llguidance" (see the module docstring)."""

    def __init__(self, tokenizer, vocab_size: int, threads: int | None = None,
                 cache_size: int = 512, backend: str = "xgrammar") -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown structured-output backend {backend!r}; one of "
                             + ", ".join(BACKENDS))
        # a quarter of the cores, 2 to 4: a burst of new schemas compiles in parallel without
        # taking the cores the engine loop and the front ends run on
        threads = threads or min(4, max(2, (os.cpu_count() or 2) // 4))
        self.info = tokenizer_info(tokenizer, vocab_size)
        self.vocab_size = self.info.vocab_size
        self.json_mask = json_text_mask(tokenizer, self.vocab_size)
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=threads)
        self.llguidance = (LLGuidance(tokenizer, self.vocab_size) if backend == "llguidance"
                           else None)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar")
        self._cache: OrderedDict[GuidedDecoding, Future] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def runs_on_llguidance(self, g: GuidedDecoding) -> bool:
        return self.llguidance is not None and g.kind in LLGUIDANCE_KINDS

    def submit(self, g: GuidedDecoding) -> Future:
        """A future of the CompiledGrammar (raises GrammarError when it cannot compile)."""
        with self._lock:
            fut = self._cache.get(g)
            if fut is not None:
                self._cache.move_to_end(g)
                return fut
            fut = self._pool.submit(self._compile, g)
            self._cache[g] = fut
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return fut

    def _compile(self, g: GuidedDecoding):
        """xgrammar's CompiledGrammar, or llguidance's template LLMatcher."""
        if self.runs_on_llguidance(g):
            return self.llguidance.compile(g)
        return self._compiler.compile_grammar(build_grammar(g))

    def state(self, g: GuidedDecoding) -> GrammarState:
        return GrammarState(self.submit(g),
                            self.json_mask if g.kind in ("json", "json_object") else None,
                            llguidance=self.runs_on_llguidance(g))


class GrammarState:
    """One sequence's grammar: the compile future, then its matcher. `text_mask`: a bitmask
    ANDed into every mask of this row (JSON grammars: `json_text_mask`), or None."""

    def __init__(self, future: Future, text_mask: torch.Tensor | None = None,
                 llguidance: bool = False) -> None:
        self.future = future
        self.text_mask = text_mask
        # the matcher is llguidance's LLMatcher (a copy of the compiled template), not
        # xgrammar's GrammarMatcher
        self.llguidance = llguidance
        self.matcher = None  # xgr.GrammarMatcher or llguidance.LLMatcher, once ready
        self.error: str | None = None
        # the matcher's is_terminated(), as of its last accepted token (a new matcher has
        # accepted nothing: not terminated); read by every step's mask and resolve
        self.terminated = False
        self._stops: frozenset[int] = frozenset()  # the matcher's stop tokens

    def ready(self) -> bool:
        """True once compiled (or failed: `error` says why). Never blocks."""
        if self.matcher is not None or self.error is not None:
            return True
        if not self.future.done():
            return False
        try:
            if self.llguidance:
                self.matcher = self.future.result().deep_copy()
            else:
                self.matcher = xgr.GrammarMatcher(self.future.result())
                self._stops = frozenset(self.matcher.stop_token_ids)
        except Exception as exc:  # noqa: BLE001 - the request fails, the engine goes on
            self.error = f"the grammar could not be compiled: {exc}"
        return True

    def accept(self, token: int) -> bool:
        """Advances the matcher by a sampled token; False when the grammar rejects it
        (xgrammar's matcher is then unchanged; llguidance's stays in its error state).
        Updates `terminated`."""
        matcher = self.matcher
        if self.llguidance:
            # llguidance's matcher stops as soon as nothing but a stop token can follow (a
            # JSON document's closing brace): asked after every token. A rejected token puts
            # it in its error state, for good (the sequence ends with an error anyway).
            ok = matcher.consume_token(token)
            if ok:
                self.terminated = matcher.is_stopped()
            return ok
        ok = matcher.accept_token(token)
        # the matcher ends only by accepting a stop token (terminate_without_stop_token is
        # off), so it is asked only then: one call less for every other token, on the path
        # from a step's tokens to the next step's masks
        if ok and token in self._stops:
            self.terminated = matcher.is_terminated()
        return ok


def _raw_batch_accept():
    """xgrammar's batch accept without its Python wrapper (which turns the answer into a
    list of bools: about 0.1 ms of the 0.15 ms a call of 128 rows takes, all of it holding
    the GIL), or None where this xgrammar has no such function."""
    try:
        from xgrammar.matcher import _core

        return _core.BatchGrammarMatcher.batch_accept_token
    except (ImportError, AttributeError):
        return None


_RAW_BATCH_ACCEPT = _raw_batch_accept()


class BatchAccepts:
    """A step's xgrammar accepts as one batch call (which releases the GIL): run by the
    engine thread (`LLMEngine._resolve`'s accepts), or handed to the fill thread ahead of the
    next step's mask fill (BUCKETSERVE_OVERLAP_FILL=4), while the engine thread goes on with
    the rest of the resolve. `js`: the rows of the step's output they belong to. Runs once:
    where `started` is still False (`GrammarMasks.start` sets it on the caller's thread
    before it hands them over) the caller runs it. `results()` waits for it and gives {row:
    accepted}. Updates each state's `terminated` as `GrammarState.accept` does, where it runs
    (a fill after it leaves ended rows out)."""

    def __init__(self, states: list[GrammarState], tokens: list[int], js: list[int]) -> None:
        self.states, self.tokens, self.js = states, tokens, js
        # the rows whose token is a stop token (rare): only their grammar can end here
        self._stop_rows = [k for k, (st, token) in enumerate(zip(states, tokens, strict=True))
                           if token in st._stops]
        self._handles = ([st.matcher._handle for st in states]
                         if _RAW_BATCH_ACCEPT is not None else None)
        self.started = False
        self.ended = False  # whether they ended a grammar (`terminated`)
        self._done = threading.Event()
        self._ok = None  # the library's answer: an array of 0 / 1, or a list of bools
        self._error: BaseException | None = None

    def __call__(self) -> None:
        self.started = True
        try:
            if self._handles is not None:
                ok = _RAW_BATCH_ACCEPT(self._handles, self.tokens, False)
            else:
                ok = xgr.BatchGrammarMatcher.batch_accept_token(
                    [st.matcher for st in self.states], self.tokens)
            for k in self._stop_rows:  # (xgrammar ends a match only at a stop token)
                if ok[k]:
                    st = self.states[k]
                    st.terminated = st.matcher.is_terminated()
                    self.ended = self.ended or st.terminated
            self._ok = ok
        except BaseException as exc:  # noqa: BLE001 - raised again in results()
            self._error = exc
        finally:
            self._done.set()

    def results(self) -> dict[int, bool]:
        self._done.wait()
        if self._error is not None:
            raise self._error
        ok = self._ok
        if 0 in ok or False in ok:  # (a rejection: rare; reading the array is ~0.7 us a row)
            return {j: bool(a) for j, a in zip(self.js, ok, strict=True)}
        return dict.fromkeys(self.js, True)


class _Fill:
    """One step's mask fill, split by library: xgrammar's rows through its batch matcher,
    llguidance's through its executor, into the same bitmask (each library releases the
    GIL while it fills)."""

    def __init__(self, masks: GrammarMasks, states: list[GrammarState], bitmask: torch.Tensor,
                 rows: list[int]) -> None:
        self.bitmask = bitmask
        self.x_matchers: list = []
        self.x_rows: list[int] = []
        self.l_pairs: list[tuple] = []
        for st, r in zip(states, rows, strict=True):
            if st.llguidance:
                self.l_pairs.append((st.matcher, r))
            else:
                self.x_matchers.append(st.matcher)
                self.x_rows.append(r)
        self.batch = masks._batch_matcher() if len(self.x_rows) > 1 else None
        self.executor = masks._executor() if len(self.l_pairs) > 1 else None

    def __call__(self) -> None:
        bitmask = self.bitmask
        if self.batch is not None:
            self.batch.batch_fill_next_token_bitmask(self.x_matchers, bitmask, self.x_rows)
        elif self.x_rows:
            self.x_matchers[0].fill_next_token_bitmask(bitmask, self.x_rows[0])
        if self.executor is not None:
            self.executor.unsafe_compute_mask_ptr(self.l_pairs, bitmask.data_ptr(),
                                                  bitmask.shape[1] * 4, bitmask.shape[0])
        elif self.l_pairs:
            matcher, r = self.l_pairs[0]
            row = bitmask[r]
            matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.shape[0] * 4)


class _FillJob:
    def __init__(self, fill) -> None:
        self.fill = fill
        self.started = threading.Event()
        self.done = threading.Event()
        self.error: BaseException | None = None
        # the rows and states it filled, where they were known only on the thread (accepts
        # first: rows whose grammar ended at the accepted token are not filled)
        self.rows: list[int] | None = None
        self.states: list[GrammarState] | None = None

    def wait(self) -> None:
        self.done.wait()
        if self.error is not None:
            raise self.error


class _FillThread:
    """One daemon thread that runs xgrammar batch fills. `submit` returns once the thread is
    about to enter xgrammar (which releases the GIL): the fill starts at once instead of
    waiting for the caller's Python to give the GIL up at the switch interval."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_FillJob] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="grammar-fill", daemon=True).start()

    def submit(self, job: _FillJob) -> _FillJob:
        self._jobs.put(job)
        job.started.wait()
        return job

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            job.started.set()
            try:
                job.fill()
            except BaseException as exc:  # noqa: BLE001 - raised again in the caller's wait
                job.error = exc
            finally:
                job.done.set()


class GrammarMasks:
    """Applies the rows' grammar masks to a step's logits (the sampler holds one).

    The bitmask of every guided row is filled on the host by its matcher and applied on the
    logits' device by xgrammar's kernel, outside any graph, to those rows alone (`indices`: no
    gather or scatter of the logits). On CUDA the host side lives in two page-locked buffers
    used in turn, so the copy to the device is truly asynchronous (a copy from pageable memory
    may wait for the stream, i.e. for the forward in flight) and a step never overwrites the
    buffer whose copy the previous step may still have queued. Buffers grow to the largest
    batch seen."""

    def __init__(self) -> None:
        self._host: list[tuple[torch.Tensor, torch.Tensor]] = []  # (bitmask, row indices)
        self._device: tuple[torch.Tensor, torch.Tensor] | None = None
        self._turn = 0
        self._batch: xgr.BatchGrammarMatcher | None = None
        self._llexec = None  # llguidance.LLExecutor, at the first batch of its rows
        # the rows whose indices the applied index tensor holds (the device one on CUDA, the
        # one host buffer on the CPU): decode steps mostly mask the same rows as the step
        # before, and then the index is neither rebuilt nor copied again
        self._index_rows: list[int] | None = None
        self._text: tuple[torch.Tensor, torch.Tensor] | None = None  # text mask: host, device
        self._worker: _FillThread | None = None
        # a fill started by `start`: (rows, states, bitmask, index, job)
        self._pending: tuple | None = None

    def _buffers(self, rows: int, vocab: int, device: torch.device):
        words = (vocab + 31) // 32
        if not self._host or self._host[0][0].shape[0] < rows or self._host[0][0].shape[1] != words:
            # at least double what a step outgrew: while a server's batch ramps up, each
            # growth costs a page-locked allocation (0.1-2 ms on an H100 host; a traced run
            # grew 8 times in 30 steps when growing to the batch alone)
            if self._host and self._host[0][0].shape[1] == words:
                rows = max(rows, 2 * self._host[0][0].shape[0])
            pin = device.type == "cuda"
            self._host = [(xgr.allocate_token_bitmask(rows, vocab).pin_memory() if pin
                           else xgr.allocate_token_bitmask(rows, vocab),
                           torch.empty(rows, dtype=torch.int32, pin_memory=pin))
                          for _ in range(2 if pin else 1)]
            self._device = None if not pin else (
                torch.empty(rows, words, dtype=torch.int32, device=device),
                torch.empty(rows, dtype=torch.int32, device=device))
            self._index_rows = None
        self._turn = (self._turn + 1) % len(self._host)
        return self._host[self._turn]

    def _batch_matcher(self) -> xgr.BatchGrammarMatcher:
        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher(fill_threads())
        return self._batch

    def _executor(self):
        """llguidance's LLExecutor (its fill threads), made at the first batch of its rows."""
        if self._llexec is None:
            import llguidance

            self._llexec = llguidance.LLExecutor(fill_threads())
        return self._llexec

    def start(self, rows: list[int], states: list[GrammarState], b: int, vocab: int,
              device: torch.device, accepts: BatchAccepts | None = None) -> None:
        """Starts the fill of these rows' masks on the fill thread (LLMEngine.overlap_fill), for a
        coming `apply` to logits [b, vocab] on `device` with the same rows and states, which
        then waits for it instead of filling. The matchers must not change in between.
        `accepts`: the previous step's accepts, run first on the thread; the rows whose
        grammar they end are then left out of the fill, as `apply` leaves them out."""
        self._take_pending()  # a fill no apply took: its buffer may be reused below
        if accepts is not None:
            self._start_after(accepts, rows, states, b, vocab, device)
            return
        live = [(r, st) for r, st in zip(rows, states, strict=True) if not st.terminated]
        if len(live) < 2:
            return
        rows, states = [r for r, _ in live], [st for _, st in live]
        bitmask, index = self._buffers(b, vocab, device)
        if self._worker is None:
            self._worker = _FillThread()
        job = self._worker.submit(_FillJob(_Fill(self, states, bitmask, rows)))
        self._pending = (rows, states, bitmask, index, job)

    def _start_after(self, accepts: BatchAccepts, rows: list[int], states: list[GrammarState],
                     b: int, vocab: int, device: torch.device) -> None:
        bitmask, index = self._buffers(b, vocab, device)
        if self._worker is None:
            self._worker = _FillThread()
        live = [(r, st) for r, st in zip(rows, states, strict=True) if not st.terminated]
        live_rows, live_states = [r for r, _ in live], [st for _, st in live]
        # made here: on the thread, between the accepts and the fill, the GIL is held and the
        # engine thread may be waiting for the accepts. (It also makes the libraries' batch
        # helpers that a fill of fewer rows, rebuilt on the thread below, would need.)
        fill = _Fill(self, live_states, bitmask, live_rows)

        def run() -> None:
            accepts()
            job.rows, job.states = live_rows, live_states
            if accepts.ended:  # the accepts ended some grammars (rare): a fill without them
                going = [(r, st) for r, st in live if not st.terminated]
                job.rows, job.states = [r for r, _ in going], [st for _, st in going]
                _Fill(self, job.states, bitmask, job.rows)()
            else:
                fill()

        job = _FillJob(run)
        accepts.started = True  # claimed here, before the thread can run them: the caller
        # runs them itself only where this never came
        self._pending = (rows, states, bitmask, index, self._worker.submit(job))

    def _take_pending(self, rows: list[int] | None = None,
                      states: list[GrammarState] | None = None, b: int = 0, words: int = 0):
        """Waits for the started fill, if any, and drops it. Returns its (bitmask, index) when
        it is the one of these rows and states on [b, words] buffers, else None."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        p_rows, p_states, bitmask, index, job = pending
        job.wait()
        if job.rows is not None:
            p_rows, p_states = job.rows, job.states
        if (rows is not None and states is not None and p_rows == rows
                and len(p_states) == len(states)
                and all(a is c for a, c in zip(p_states, states, strict=True))
                and bitmask.shape[0] >= b and bitmask.shape[1] == words):
            return bitmask, index
        return None

    def apply(self, logits: torch.Tensor, rows: list[int], states: list[GrammarState]) -> None:
        """logits [B, V] in place: each row in `rows` keeps only the tokens its matcher allows
        (a row whose grammar has ended is left alone: its token is dropped)."""
        live = sum(not st.terminated for st in states)
        if not live:
            self._take_pending()  # (none is started for rows that all ended)
            return
        if live != len(rows):
            rows = [r for r, st in zip(rows, states, strict=True) if not st.terminated]
            states = [st for st in states if not st.terminated]
        b, vocab = logits.shape
        n = len(rows)
        started = self._take_pending(rows, states, b, (vocab + 31) // 32)
        if started is not None:
            bitmask, index = started
        else:
            bitmask, index = self._buffers(b, vocab, logits.device)
            # (each library fills its rows on its own threads, in one call)
            _Fill(self, states, bitmask, rows)()
        new_index = rows != self._index_rows
        if new_index:
            index.numpy()[:n] = rows
            self._index_rows = list(rows)
        if self._device is not None:
            dev_mask, dev_index = self._device
            dev_mask[:b].copy_(bitmask[:b], non_blocking=True)
            if new_index:
                dev_index[:n].copy_(index[:n], non_blocking=True)
            bitmask, index = dev_mask[:b], dev_index[:n]
        else:
            bitmask, index = bitmask[:b], index[:n]
        self._text_masks(bitmask, rows, states)
        xgr.apply_token_bitmask_inplace(logits, bitmask, indices=index)

    def _text_masks(self, bitmask: torch.Tensor, rows: list[int],
                    states: list[GrammarState]) -> None:
        """ANDs each row's `text_mask` into its bitmask row (where the mask will be applied).
        The usual step has one (the JSON one) for every row: one op over the buffer, whose
        rows outside `rows` are never applied."""
        first = states[0].text_mask
        if all(st.text_mask is first for st in states):
            if first is None:
                return
            if self._text is None or self._text[0] is not first:
                self._text = (first, _fitted(first, bitmask))
            bitmask &= self._text[1]
            return
        for r, st in zip(rows, states, strict=True):  # mixed kinds: row by row
            if st.text_mask is not None:
                bitmask[r] &= _fitted(st.text_mask, bitmask)


def _fitted(mask: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """A text mask cut or padded (ids past its vocabulary stay allowed) to the bitmask's
    width, on its device."""
    words = bitmask.shape[1]
    if mask.shape[0] < words:
        mask = torch.cat([mask, mask.new_full((words - mask.shape[0],), -1)])
    return mask[:words].to(bitmask.device)

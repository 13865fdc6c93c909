"""Grammar-constrained decoding with xgrammar: compiled grammars, matchers, token masks.

A request with `SamplingParams.guided` (a `GuidedDecoding`: kind + spec text) decodes under a
grammar:
- `GrammarCompiler` (one per engine) holds the xgrammar TokenizerInfo built once from our
  tokenizer and compiles grammars on a thread pool, cached by (kind, spec): a request's
  compilation never runs in an engine step. The scheduler keeps a request waiting until its
  grammar is compiled (`GrammarState.ready`) and admits the others meanwhile.
- `GrammarState` (one per sequence) holds the xgrammar GrammarMatcher; it accepts every token
  the sequence samples (`accept`) and says when the grammar has ended (`terminated`). Output
  tokens survive a preemption, and so does the matcher: recompute needs nothing from it.
- `check_guided` builds the xgrammar Grammar without the tokenizer (fast): the server calls it
  in the request path so that a schema xgrammar rejects is a 400 before any token.

JSON grammars are compact (xgrammar's any_whitespace=False with "," and ":" separators: no whitespace
between JSON tokens), so
that a bounded schema has a bounded output and the matcher ends it.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

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
    choices = json.loads(spec)
    if (not isinstance(choices, list) or not choices
            or not all(isinstance(c, str) and c for c in choices)):
        raise GrammarError("guided_choice must be a non-empty list of non-empty strings")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


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
        raise GrammarError(str(exc).strip().splitlines()[0] if str(exc).strip()
                           else type(exc).__name__) from exc
    raise GrammarError(f"unknown guided decoding kind {g.kind!r}; one of {', '.join(KINDS)}")


def check_guided(g: GuidedDecoding) -> None:
    """Raises GrammarError when xgrammar cannot build the grammar."""
    build_grammar(g)


def tokenizer_info(tokenizer, vocab_size: int) -> xgr.TokenizerInfo:
    """xgrammar's view of our tokenizer: every id's token string (byte-level BPE vocabularies
    as such, others raw), padded to the model's logits width, and our EOS ids as stops."""
    n = tokenizer.vocab_size
    vocab = [tokenizer.id_to_token(i) or "" for i in range(n)]
    kind = xgr.VocabType.BYTE_LEVEL if tokenizer.is_byte_level else xgr.VocabType.RAW
    return xgr.TokenizerInfo(vocab, kind, vocab_size=max(vocab_size, n),
                             stop_token_ids=sorted(tokenizer.eos_token_ids))


class GrammarCompiler:
    """Compiles grammars on `threads` worker threads; futures cached by spec (LRU)."""

    def __init__(self, tokenizer, vocab_size: int, threads: int = 2, cache_size: int = 512) -> None:
        self.info = tokenizer_info(tokenizer, vocab_size)
        self.vocab_size = self.info.vocab_size
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=threads)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar")
        self._cache: OrderedDict[GuidedDecoding, Future] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

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

    def _compile(self, g: GuidedDecoding) -> xgr.CompiledGrammar:
        return self._compiler.compile_grammar(build_grammar(g))

    def state(self, g: GuidedDecoding) -> GrammarState:
        return GrammarState(self.submit(g))


class GrammarState:
    """One sequence's grammar: the compile future, then its matcher."""

    def __init__(self, future: Future) -> None:
        self.future = future
        self.matcher: xgr.GrammarMatcher | None = None
        self.error: str | None = None

    def ready(self) -> bool:
        """True once compiled (or failed: `error` says why). Never blocks."""
        if self.matcher is not None or self.error is not None:
            return True
        if not self.future.done():
            return False
        try:
            self.matcher = xgr.GrammarMatcher(self.future.result())
        except Exception as exc:  # noqa: BLE001 - the request fails, the engine goes on
            self.error = f"the grammar could not be compiled: {exc}"
        return True

    def accept(self, token: int) -> bool:
        """Advances the matcher by a sampled token; False when the grammar rejects it."""
        return self.matcher.accept_token(token)

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()


def apply_grammar_masks(logits: torch.Tensor, rows: list[int], states: list[GrammarState]) -> None:
    """logits [B, V] in place: each row in `rows` keeps only the tokens its matcher allows.
    The bitmask is filled on the host and applied on the logits' device (outside any graph)."""
    bitmask = xgr.allocate_token_bitmask(len(rows), logits.shape[1])
    for j, st in enumerate(states):
        if not st.matcher.is_terminated():  # (ended, its token is dropped: left unmasked)
            st.matcher.fill_next_token_bitmask(bitmask, j)
    sub = logits[rows] if len(rows) != logits.shape[0] else logits
    xgr.apply_token_bitmask_inplace(sub, bitmask.to(logits.device, non_blocking=True))
    if sub is not logits:
        logits[rows] = sub

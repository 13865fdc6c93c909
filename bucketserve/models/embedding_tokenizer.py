"""Tokenization for the embedding encoder, without torch (worker processes import only this).

`EmbeddingTokenizer` wraps a tokenizers.Tokenizer (tokenizer.json) for BERT-family encoders.
`TokenizerProcesses` runs it in worker processes for offline work (embed_texts): each worker
tokenizes a chunk of texts and hands back one packed int32 array, so the Python objects a
tokenization makes (one int per token id) are made in the workers, not in the process that
runs the batcher, whose one GIL the batcher's own host work needs.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import multiprocessing
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

# ASCII control characters BertNormalizer's clean_text removes (tab, newline, return stay: they
# are whitespace to the pre-tokenizer either way).
_ASCII_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
# The same but NUL (the separator of a chunk joined into one string, _fast_texts), as bytes:
# bytes.translate deletes them in one pass, several times faster than a regex search.
_CONTROL_BUT_NUL = bytes(range(1, 9)) + b"\x0b\x0c" + bytes(range(0x0E, 0x20)) + b"\x7f"


class EmbeddingTokenizer:
    """tokenizers.Tokenizer with the file's own padding/truncation switched off: the batcher
    pads to bucket lengths itself, and over-long inputs are refused or truncated explicitly.

    ASCII fast path: BERT's normalizer (clean text, CJK spacing, NFD accent stripping,
    lowercasing) runs per character with offset bookkeeping and took about half the encode
    time. On ASCII text without control characters or special-token strings, all it does is
    lowercase, so such texts are lowercased in Python and encoded by a copy of the tokenizer
    without normalizer: the same ids (tests/test_embeddings_model.py compares them), ~1.9x
    faster. Other texts take the full tokenizer. A chunk is checked as one string joined by
    NUL first (a few C passes instead of several per text); only a chunk that fails that check
    is checked text by text.
    """

    def __init__(self, path: Path | str, do_lower_case: bool = False) -> None:
        self.path = Path(path)
        self._tok = Tokenizer.from_file(str(path))
        self._tok.no_padding()
        self._tok.no_truncation()
        self.do_lower_case = do_lower_case
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        # Rust batch encoding over all cores, the GIL released; the _fast variant (tokenizers
        # >= 0.20) skips character offsets, which embeddings never use (~25% faster).
        self._encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        self._plain, self._plain_lower, self._specials = self._ascii_fast_path()
        self._special_starts = {c for s in self._specials for c in (s[:1], s[:1].lower()) if c}

    def _ascii_fast_path(self) -> tuple[Callable | None, bool, tuple[str, ...]]:
        """(encode of the normalizer-free copy, lowercase first, special-token strings), or
        (None, ...) when the tokenizer's normalizer is not BERT's (no fast path)."""
        spec = json.loads(self._tok.to_str())
        norm = spec.get("normalizer") or {}
        if norm.get("type") != "BertNormalizer":
            return None, False, ()
        plain = Tokenizer.from_str(self._tok.to_str())
        plain.normalizer = None
        specials = tuple(t["content"] for t in spec.get("added_tokens", []))
        encode = getattr(plain, "encode_batch_fast", plain.encode_batch)
        return encode, bool(norm.get("lowercase", True)), specials

    def _fast_text(self, text: str) -> str | None:
        """The text the normalizer-free copy encodes to the same ids, or None (full path)."""
        if not text.isascii() or _ASCII_CONTROL.search(text):
            return None
        low = text.lower()
        for s in self._specials:  # added tokens are matched before (or after) normalizing
            if s in text or s.lower() in low:
                return None
        return low if self._plain_lower else text

    def _fast_texts(self, texts: list[str]) -> list[str] | None:
        """_fast_text of every text when all of them take the fast path, else None: the chunk
        joined by NUL and checked at once (a NUL inside a text is a control character, so the
        NUL count tells whether the split gives the texts back)."""
        joined = "\0".join(texts)
        if not joined.isascii() or joined.count("\0") != len(texts) - 1:
            return None
        raw = joined.encode("ascii")
        if len(raw.translate(None, _CONTROL_BUT_NUL)) != len(raw):
            return None
        low = joined.lower()
        # a special string never holds NUL: no false match across texts; its first character
        # (one memchr pass) rules most chunks out before the substring searches
        if any(c in joined or c in low for c in self._special_starts):
            for s in self._specials:
                if s in joined or s.lower() in low:
                    return None
        return (low if self._plain_lower else joined).split("\0")

    def _encodings(self, texts: list[str], add_special_tokens: bool = True) -> list:
        """tokenizers Encodings of texts, through the ASCII fast path where it applies."""
        if self._plain is None:
            return self._encode(texts, add_special_tokens=add_special_tokens)
        every = self._fast_texts(texts) if texts else None
        if every is not None:
            return self._plain(every, add_special_tokens=add_special_tokens)
        fast = [self._fast_text(t) for t in texts]
        out: list = [None] * len(texts)
        for encode, src, keep in ((self._plain, fast, True), (self._encode, texts, False)):
            picks = [i for i, f in enumerate(fast) if (f is not None) == keep]
            if picks:
                encs = encode([src[i] for i in picks], add_special_tokens=add_special_tokens)
                for i, e in zip(picks, encs, strict=True):
                    out[i] = e
        return out

    def encode_batch(self, texts: list[str], max_length: int | None = None) -> list[list[int]]:
        """Token ids with special tokens ([CLS] ... [SEP]). max_length truncates as
        sentence-transformers does: keeps the start and the special tokens, <= max_length ids."""
        if self.do_lower_case:
            texts = [t.lower() for t in texts]
        if max_length is None:
            return [e.ids for e in self._encodings(texts)]
        special = self._tok.num_special_tokens_to_add(is_pair=False)
        if max_length <= special:
            raise ValueError(f"truncation length {max_length} leaves no room for the text; "
                             f"use at least {special + 1}")
        # Truncate the text's own tokens, then add the special tokens: what the tokenizer's
        # truncation does, without touching its shared (thread-unsafe) truncation state.
        out = []
        for enc in self._encodings(texts, add_special_tokens=False):
            if len(enc.ids) > max_length - special:
                enc.truncate(max_length - special)
            out.append(self._tok.post_process(enc).ids)
        return out

    def encode_packed(self, texts: list[str], max_length: int | None = None
                      ) -> tuple[np.ndarray, np.ndarray]:
        """encode_batch as (every text's ids one after the other, int32; lengths, int64)."""
        ids = self.encode_batch(texts, max_length)
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32,
                           count=int(lengths.sum()))
        return flat, lengths

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


def unpack(flat: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
    """encode_packed's result as one 1-D int32 view per text."""
    ends = np.cumsum(lengths).tolist()
    starts = [0] + ends[:-1]
    return [flat[a:b] for a, b in zip(starts, ends, strict=True)]


# ------------------------------------------------------------------ worker processes
_WORKER: EmbeddingTokenizer | None = None


def _worker_init(path: str, do_lower_case: bool, threads: int) -> None:
    global _WORKER
    # tokenizers' Rust thread pool starts at the first parallel encode and reads this then
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 else "false"
    _WORKER = EmbeddingTokenizer(path, do_lower_case)


def _worker_encode(texts: list[str], max_length: int | None) -> tuple[np.ndarray, np.ndarray]:
    assert _WORKER is not None
    return _WORKER.encode_packed(texts, max_length)


class TokenizerProcesses:
    """EmbeddingTokenizer in `processes` worker processes (spawned, `threads` Rust threads
    each): `submit(texts)` gives a concurrent Future of encode_packed's (flat, lengths).
    For offline embedding (embed_texts takes it in place of a tokenize function); start-up
    costs a process start per worker, so build it once and `close` it at the end."""

    def __init__(self, tokenizer: EmbeddingTokenizer, processes: int,
                 threads: int | None = None) -> None:
        if processes < 1:
            raise ValueError(f"processes must be >= 1, got {processes}")
        cores = os.cpu_count() or 1
        self.processes = processes
        self.threads = threads or max(1, cores // processes)
        self._pool = concurrent.futures.ProcessPoolExecutor(
            processes, mp_context=multiprocessing.get_context("spawn"),
            initializer=_worker_init,
            initargs=(str(tokenizer.path), tokenizer.do_lower_case, self.threads))
        # start every worker now (not at the first timed chunk)
        warm = [self._pool.submit(_worker_encode, ["warm up"], None) for _ in range(processes)]
        for f in warm:
            f.result()

    def submit(self, texts: Sequence[str], max_length: int | None = None
               ) -> concurrent.futures.Future:
        return self._pool.submit(_worker_encode, list(texts), max_length)

    def encode_batch(self, texts: list[str], max_length: int | None = None) -> list[np.ndarray]:
        return unpack(*self.submit(texts, max_length).result())

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> TokenizerProcesses:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

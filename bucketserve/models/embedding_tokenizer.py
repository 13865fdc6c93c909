"""Tokenization for the embedding encoder, without torch (the offline benchmark's tokenizer
worker processes import only this, bench/embeddings_gpu.py TokenizerProcesses).

`EmbeddingTokenizer` wraps a tokenizers.Tokenizer (tokenizer.json) for BERT-family encoders.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from tokenizers import Tokenizer

# ASCII control characters BertNormalizer's clean_text removes (tab, newline, return stay: they
# are whitespace to the pre-tokenizer either way), but NUL (the separator of a chunk joined into
# one string, _fast_texts; a NUL of a text shows in their count), as bytes: bytes.translate
# deletes them in one pass, several times faster than a regex search.
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

    def _fast_texts(self, texts: list[str]) -> list[str] | None:
        """The texts the normalizer-free copy encodes to the same ids, when all of them take
        the fast path, else None: the chunk joined by NUL and checked at once (a NUL inside a
        text is a control character, so the NUL count tells whether the split gives the texts
        back)."""
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
        fast = [self._fast_texts([t]) for t in texts]  # per text: [its fast text] or None
        out: list = [None] * len(texts)
        for encode, keep in ((self._plain, True), (self._encode, False)):
            picks = [i for i, f in enumerate(fast) if (f is not None) == keep]
            if picks:
                encs = encode([(fast[i] or [texts[i]])[0] for i in picks],
                              add_special_tokens=add_special_tokens)
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

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


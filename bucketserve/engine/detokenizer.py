"""Streaming text: token ids -> newly completed text, and stop-string matching on that text.

IncrementalDetokenizer decodes a small window (a few already-emitted tokens + the new ones)
rather than the whole output each step, and emits the part of the window's text that extends
past the already-emitted tokens' text. The window gives the tokenizer the left context it needs
(SentencePiece drops a leading space on the first token, WordPiece glues "##" pieces, byte-level
BPE may split a character over tokens). While the decoded window ends in U+FFFD (an incomplete
multi-byte character) nothing is emitted and the window keeps growing.

ByteLevelDetokenizer is the fast path for byte-level BPE tokenizers (GPT-2, Llama 3, Qwen2,
SmolLM2), whose decode is the lossy UTF-8 decoding of the tokens' concatenated bytes: each
token adds its bytes to an incremental UTF-8 decoder, which holds back an incomplete
character by itself. No tokenizer call per token (the window decode above costs two).
`make_detokenizer` picks it when the tokenizer says it is byte-level.

Known limit: a decoder whose clean-up rewrites text across the window edge (e.g. a
" ' " -> "'" rule) could differ from a one-shot decode; the byte-level BPE and WordPiece
tokenizers tested in tests/test_detokenizer.py do not.
"""

from __future__ import annotations

import codecs
from typing import Protocol

_REPLACEMENT = "\ufffd"
# Tokens of left context kept before the first unemitted token (ample for any decoder's
# look-behind: a leading-space or "##" decision needs one, a split UTF-8 char at most 3 more).
_WINDOW = 6


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """step(new_token_ids) -> text completed by them; flush() -> anything still held back."""

    def __init__(self, tokenizer: _Decoder, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_token_ids)
        # ids[prefix_offset:read_offset]: context already emitted (or prompt);
        # ids[read_offset:]: tokens whose text has not been emitted yet.
        self.read_offset = len(self.ids)
        self.prefix_offset = max(self.read_offset - _WINDOW, 0)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, new_token_ids: list[int]) -> str:
        self.ids.extend(new_token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """Text held back at the end of the sequence (e.g. a genuinely broken character)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self.read_offset >= len(self.ids):
            return ""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset:])
        if len(full_text) <= len(prefix_text) and not final:
            return ""  # e.g. a skipped special token or the first byte of a character
        if full_text.endswith(_REPLACEMENT) and not final:
            return ""  # incomplete UTF-8 sequence: wait for the rest of the character
        new_text = full_text[len(prefix_text):]
        # Slide the window: keep a few emitted tokens as left context for the next decode.
        self.read_offset = len(self.ids)
        self.prefix_offset = max(self.read_offset - _WINDOW, 0)
        return new_text


class ByteLevelDetokenizer:
    """step(new_token_ids) -> text completed by them; flush() -> anything still held back.

    The output text is the decode of the output ids alone (a byte-level decode has no left
    context to take from the prompt)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self._bytes = tokenizer.token_bytes
        self._skip = tokenizer.all_special_ids if skip_special_tokens else frozenset()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def step(self, new_token_ids: list[int]) -> str:
        skip = self._skip
        data = b"".join(self._bytes(t) for t in new_token_ids if t not in skip)
        return self._utf8.decode(data) if data else ""

    def flush(self) -> str:
        """U+FFFD for bytes of a character that never completed, as a one-shot decode."""
        return self._utf8.decode(b"", final=True)


def make_detokenizer(tokenizer, prompt_token_ids: list[int],
                     skip_special_tokens: bool = True) -> IncrementalDetokenizer | ByteLevelDetokenizer:
    """The byte-level fast path where the tokenizer allows it, else the window decoder."""
    if getattr(tokenizer, "is_byte_level", False):
        return ByteLevelDetokenizer(tokenizer, skip_special_tokens)
    return IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)


class StopStringMatcher:
    """feed(text) -> (emit, matched). Emitted text never contains a stop string nor the start
    of one that might still complete; on a match, emits the text before the stop."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""
        self.matched = False

    def feed(self, text: str) -> tuple[str, bool]:
        if self.matched:
            return "", True
        if not self.stops:
            return text, False
        buf = self._held + text
        # The stop that completes first wins (as if fed one character at a time); on equal
        # ends, the one that starts first. This keeps the result independent of chunking.
        best: tuple[int, int] | None = None  # (end, start)
        for stop in self.stops:
            start = buf.find(stop)
            if start >= 0:
                cand = (start + len(stop), start)
                if best is None or cand < best:
                    best = cand
        if best is not None:
            self.matched = True
            self._held = ""
            return buf[:best[1]], True
        hold = self._partial_len(buf)
        self._held = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold], False

    def _partial_len(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop."""
        longest = min(len(buf), max(len(s) for s in self.stops) - 1)
        for n in range(longest, 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0

    def flush(self) -> str:
        """Held-back text, for when the sequence ends for another reason (EOS, length)."""
        held, self._held = self._held, ""
        return "" if self.matched else held

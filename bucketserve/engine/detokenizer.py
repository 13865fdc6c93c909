"""Streaming text: token ids -> newly completed text, and stop-string matching on that text.

IncrementalDetokenizer decodes a small window (a few already-emitted tokens + the new ones)
rather than the whole output each step, and emits the part of the window's text that extends
past the already-emitted tokens' text. The window gives the tokenizer the left context it needs
(SentencePiece drops a leading space on the first token, WordPiece glues "##" pieces, byte-level
BPE may split a character over tokens). While the decoded window ends in U+FFFD (an incomplete
multi-byte character) nothing is emitted and the window keeps growing.

Known limit: a decoder whose clean-up rewrites text across the window edge (e.g. a
" ' " -> "'" rule) could differ from a one-shot decode; the byte-level BPE and WordPiece
tokenizers tested in tests/test_detokenizer.py do not.
"""

from __future__ import annotations

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

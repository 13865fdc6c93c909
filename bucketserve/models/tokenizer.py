"""Tokenizer: a thin wrapper over the `tokenizers` library plus the chat template.

Two sources:
  * a Hugging Face directory: tokenizer.json, tokenizer_config.json (special tokens, chat
    template; or chat_template.jinja), generation_config.json (extra EOS ids);
  * GGUF metadata (`tokenizer.ggml.*`): a byte-level BPE is rebuilt from the token list, the
    merges and the token types; the pre-tokenizer is chosen from `tokenizer.ggml.pre`.

Chat templates run in jinja2's immutable sandbox with the helpers HF templates expect
(raise_exception, strftime_now, tojson, bos_token/eos_token).
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend

# llama.cpp token types (gguf.TokenType)
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4

# Text splitting rules for byte-level BPE vocabularies, keyed by `tokenizer.ggml.pre`.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _gpt2_pre() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2_pre() -> pre_tokenizers.PreTokenizer:
    # StarCoder / SmolLM: every digit is its own piece, then the GPT-2 split.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_pre()])


def _split_pre(pattern: str):
    def build() -> pre_tokenizers.PreTokenizer:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    return build


_PRE_TOKENIZERS = {
    "smollm": _digits_then_gpt2_pre,
    "starcoder": _digits_then_gpt2_pre,
    "gpt-2": _gpt2_pre,
    "gpt2": _gpt2_pre,
    "default": _gpt2_pre,
    "llama-bpe": _split_pre(_LLAMA3_SPLIT),
    "llama3": _split_pre(_LLAMA3_SPLIT),
    "qwen2": _split_pre(_QWEN2_SPLIT),
}


class ChatTemplateError(ValueError):
    """The chat template could not be rendered (bad messages, or the template raised)."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False,
            separators: Any = None, sort_keys: bool = False) -> str:
    # HF templates call tojson with indent and expect non-ASCII text to stay as is.
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, separators=separators,
                      sort_keys=sort_keys)


def _token_content(tok: Any) -> str | None:
    """tokenizer_config special tokens are either a string or {"content": ...}."""
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def _byte_level_chars() -> dict[str, int]:
    """The byte-level BPE alphabet: each of the 256 byte values is written as one printable
    character. Printable Latin-1 bytes stand for themselves; the others (controls, space,
    DEL, NBSP, soft hyphen) take the code points from 256 upwards, in byte order."""
    own = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {chr(b): b for b in own}
    extra = 0
    for b in range(256):
        if b not in own:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_LEVEL_CHARS = _byte_level_chars()


# Texts longer than this are encoded through the batch call, which releases the GIL (a server
# tokenizing a long prompt in a worker thread keeps its event loop running).
_LONG_TEXT_CHARS = 2048


class Tokenizer:
    def __init__(self, backend: _Backend, *, bos_token: str | None = None,
                 eos_token: str | None = None, extra_eos_ids: Sequence[int] = (),
                 chat_template: str | None = None) -> None:
        self._tok = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id: int | None = backend.token_to_id(bos_token) if bos_token else None
        eos = {backend.token_to_id(eos_token)} if eos_token else set()
        self.eos_token_ids: set[int] = {i for i in eos | set(extra_eos_ids) if i is not None}
        self.chat_template = chat_template
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.all_special_ids: set[int] = {
            i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        self._token_bytes: dict[int, bytes] = {}

    # ---- text <-> ids ----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > _LONG_TEXT_CHARS:  # the batch call releases the GIL while it works
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    @cached_property
    def is_byte_level(self) -> bool:
        """True when decoding is the plain byte-level one: decode(ids) is the UTF-8 (lossy)
        decoding of the concatenated `token_bytes` of the ids. Streams then detokenize a
        token at a time without calling the tokenizer (engine/detokenizer.py)."""
        return isinstance(self._tok.decoder, decoders.ByteLevel)

    @cached_property
    def max_token_bytes(self) -> int | None:
        """The most bytes one token stands for, when that bounds the token count of a text
        (byte-level, no normalizer): a text of B UTF-8 bytes has at least B / this tokens.
        None otherwise."""
        if not self.is_byte_level or self._tok.normalizer is not None:
            return None
        return max(len(self.token_bytes(i)) for i in range(self.vocab_size))

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for under byte-level decoding (`is_byte_level`); a
        token written outside the byte alphabet (e.g. an added token) stands for its own
        UTF-8 text, as the tokenizers library decodes it. Cached per id."""
        cache = self._token_bytes
        got = cache.get(token_id)
        if got is None:
            text = self._tok.id_to_token(token_id)
            if text is None:
                raise ValueError(f"token id {token_id} is outside the vocabulary")
            chars = _BYTE_LEVEL_CHARS
            if all(c in chars for c in text):
                got = bytes(chars[c] for c in text)
            else:
                got = text.encode("utf-8")
            cache[token_id] = got
        return got

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def backend(self) -> _Backend:
        """The underlying tokenizers.Tokenizer."""
        return self._tok

    # ---- chat ------------------------------------------------------------------------------

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        return env.from_string(self.chat_template or "")

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Renders messages ([{"role": ..., "content": ...}]) to the prompt text. Extra keyword
        arguments (tools, documents, ...) are passed to the template."""
        if not self.chat_template:
            raise ChatTemplateError(
                "this model's tokenizer has no chat template; send a plain prompt to the "
                "completions endpoint instead")
        try:
            return self._compiled_template.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e

    # ---- constructors ----------------------------------------------------------------------

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise FileNotFoundError(
                f"{tj} not found: the model directory needs a fast tokenizer file; create it with "
                "transformers' AutoTokenizer.from_pretrained(...).save_pretrained(dir)")
        backend = _Backend.from_file(str(tj))
        cfg = _read_json(path / "tokenizer_config.json")
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        if template is None and (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        if template is None:
            template = _read_json(path / "chat_template.json").get("chat_template")
        gen = _read_json(path / "generation_config.json").get("eos_token_id")
        extra = gen if isinstance(gen, list) else ([] if gen is None else [gen])
        return cls(backend, bos_token=_token_content(cfg.get("bos_token")),
                   eos_token=_token_content(cfg.get("eos_token")), extra_eos_ids=extra,
                   chat_template=template)

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> Tokenizer:
        """meta: GGUF key -> python value (strings, ints, lists) for the tokenizer.* keys."""
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"GGUF tokenizer model {kind!r} is not supported; only byte-level BPE ('gpt2') "
                "vocabularies can be rebuilt. Use the model's Hugging Face directory instead.")
        pre = meta.get("tokenizer.ggml.pre", "default")
        if pre not in _PRE_TOKENIZERS:
            raise ValueError(
                f"GGUF pre-tokenizer {pre!r} is not supported; supported: "
                f"{', '.join(sorted(_PRE_TOKENIZERS))}. Use the model's Hugging Face directory "
                "instead.")
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        types: list[int] = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
        vocab = {tok: i for i, tok in enumerate(tokens)}
        backend = _Backend(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        backend.pre_tokenizer = _PRE_TOKENIZERS[pre]()
        backend.decoder = decoders.ByteLevel()
        # Control tokens (<|im_start|>, ...) must match whole and count as special;
        # user-defined ones match whole but are ordinary text.
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                    for t, ty in zip(tokens, types, strict=True) if ty == _CONTROL])
        backend.add_tokens([AddedToken(t, special=False, normalized=False)
                            for t, ty in zip(tokens, types, strict=True) if ty == _USER_DEFINED])

        def tok_of(key: str) -> str | None:
            i = meta.get(key)
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        bos, eos = tok_of("tokenizer.ggml.bos_token_id"), tok_of("tokenizer.ggml.eos_token_id")
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
        if add_bos or add_eos:
            pre_s = [bos] if add_bos else []
            post_s = [eos] if add_eos else []
            single = pre_s + ["$A"] + post_s
            pair = single + pre_s + ["$B:1"] + post_s
            backend.post_processor = processors.TemplateProcessing(
                single=single, pair=pair,
                special_tokens=[(t, vocab[t]) for t in dict.fromkeys(pre_s + post_s)])
        eot = meta.get("tokenizer.ggml.eot_token_id")
        return cls(backend, bos_token=bos, eos_token=eos,
                   extra_eos_ids=[eot] if eot is not None else [],
                   chat_template=meta.get("tokenizer.chat_template"))


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)

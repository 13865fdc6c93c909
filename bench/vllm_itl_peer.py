"""vLLM's side of decode_itl_gpu.py: the decode step inside vLLM's own LLM.generate loop.

    python3 vllm_itl_peer.py SHAPE B1,B2 PROMPT TOKENS REPEATS   (vLLM importable)

Random bf16 weights (load_format="dummy"), prefix caching off, token-id prompts; per batch B
one JSON line with the median decode step (t_T - t_1) / (T - 1), the method of
decode_itl_gpu.itl (imported from there so that both systems are measured the same way).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

from decode_itl_gpu import itl

HF_SHAPES = {  # Hugging Face LlamaConfig fields of gpu_throughput.SHAPES
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
}


def main() -> None:
    shape, batches = sys.argv[1], [int(b) for b in sys.argv[2].split(",")]
    prompt, tokens, repeats = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    from transformers import LlamaConfig

    d = os.path.join(tempfile.mkdtemp(), shape)
    LlamaConfig(max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True,
                bos_token_id=1, eos_token_id=2, pad_token_id=0,
                architectures=["LlamaForCausalLM"], torch_dtype="bfloat16",
                **HF_SHAPES[shape]).save_pretrained(d)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=d, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=2048, gpu_memory_utilization=0.85, seed=0,
              enable_prefix_caching=False)

    def gen(ps, max_tokens):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0,
                                detokenize=False)
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], params,
                            use_tqdm=False)
        dt = time.perf_counter() - t0
        assert sum(len(o.outputs[0].token_ids) for o in outs) == max_tokens * len(ps)
        return dt

    vocab = HF_SHAPES[shape]["vocab_size"]
    for b in batches:
        row = itl(gen, b, prompt, tokens, vocab, repeats, seed0=1000 * b)
        row["system"] = "vllm"
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

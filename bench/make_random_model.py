"""A Hugging Face Llama directory with random weights of a benchmark shape and SmolLM2's
tokenizer: what the GPU scripts serve (throughput does not depend on weight values).

    python3 bench/make_random_model.py --shape llama-1b --tok DIR --out /tmp/model-llama-1b [--device cuda]

Shapes: smollm2-135m (SmolLM2's own config), llama-1b (Llama-3.2-1B's), llama-8b (Llama-3.1-8B's,
untied as it ships), all with SmolLM2's 49,152-token vocabulary. --tok holds SmolLM2's
config.json / tokenizer.json / tokenizer_config.json (no weights needed). bf16 on CUDA, float32
on the CPU. A directory that already holds weights keeps them; its config.json is rewritten with
the shape's values (a copied config must not win).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

SHAPES = {
    "smollm2-135m": {},
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=64),
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128),
}


def shape_overrides(shape: str) -> dict:
    """The config values a shape sets over SmolLM2's config (tied embeddings except at 8B)."""
    if shape not in SHAPES:
        raise SystemExit(f"unknown shape {shape!r}; one of {sorted(SHAPES)}")
    return dict(SHAPES[shape], tie_word_embeddings=shape != "llama-8b")


def write_shape(path: str, over: dict) -> None:
    """config.json with the shape's values written out explicitly."""
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(over)
    cfg.pop("layer_types", None)
    with open(path, "w") as f:
        json.dump(cfg, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", required=True, choices=sorted(SHAPES))
    ap.add_argument("--tok", required=True, help="SmolLM2's tokenizer and config files")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    over = shape_overrides(args.shape)
    os.makedirs(args.out, exist_ok=True)
    has_weights = any(f.endswith(".safetensors") for f in os.listdir(args.out))
    if not has_weights:
        for f in os.listdir(args.tok):
            if not f.endswith((".safetensors", ".bin", ".gguf")):
                shutil.copy(os.path.join(args.tok, f), args.out)
    path = os.path.join(args.out, "config.json")
    write_shape(path, over)
    if has_weights:
        print(args.shape, "random weights already in", args.out)
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM(LlamaConfig.from_pretrained(args.out))
        model = model.to(torch.bfloat16 if args.device == "cuda" else torch.float32)
    model.save_pretrained(args.out)
    write_shape(path, over)  # save_pretrained rewrote it
    print(args.shape, "random weights:", sum(p.numel() for p in model.parameters()), "parameters")


if __name__ == "__main__":
    main()

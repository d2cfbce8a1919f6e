"""Turn a GGUF checkpoint into a Hugging Face model folder that vLLM loads, with no model hub.

    python scripts/convert_gguf.py MODEL.gguf OUT_DIR [--layers N]

Runs in the vLLM environment (transformers, gguf, torch). The GGUF weights are dequantized on
load, copied into a fresh model built from the same config (a model loaded from GGUF refuses to
be saved as it is), and saved in bfloat16 with the tokenizer. `--layers N` keeps only the first N
decoder layers: a weak draft model for speculative decoding, useful as a low-acceptance case.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("gguf", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int)
    args = parser.parse_args()
    folder, name = str(args.gguf.parent), args.gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the saved weights are plain: vLLM must not look for GGUF
    if args.layers is not None:
        config.num_hidden_layers = args.layers
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {k: v for k, v in loaded.state_dict().items() if k in fresh.state_dict()}
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    # Tied embeddings may be absent from the state dict; anything else missing is a failed conversion.
    missing = [k for k in missing if not k.endswith("lm_head.weight")]
    if missing or unexpected:
        raise SystemExit(f"conversion lost weights: missing {missing[:5]}, unexpected {unexpected[:5]}")
    fresh.to(torch.bfloat16)
    fresh.config.torch_dtype = torch.bfloat16
    args.out.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"wrote {args.out} ({sum(p.numel() for p in fresh.parameters()) / 1e6:.0f}M parameters)")


if __name__ == "__main__":
    main()

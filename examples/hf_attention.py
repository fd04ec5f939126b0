"""Turn a Hugging Face model's eager attention into kda_compile's fused attention op, on CPU.

Builds a tiny Llama from a config (random weights, nothing downloaded), then

1. ``kda_compile.optimize(model)``: torch.compile with the kda_compile rewrites and Inductor;
   the logits are compared with eager and the rewrite report is printed;
2. ``torch.compile(model.forward, backend="kda_compile", dynamic=True)``: the same backend by
   name (no import needed in a fresh process: it is an entry point), used by ``generate()``,
   which must produce eager's tokens; ``kda_compile.report(model.forward)`` lists the graphs that
   backend traced for this model (``kda_compile.report()``: every graph compiled in the process).

Run:  python examples/hf_attention.py   (Inductor's first compiles take most of the time)
"""
from __future__ import annotations

import logging
import time

import torch
import transformers

import kda_compile


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    model = tiny_llama()
    prompt = torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(0))

    start = time.perf_counter()
    compiled = kda_compile.optimize(model)
    with torch.no_grad():
        logits = compiled(prompt).logits
        expected = model(prompt).logits
    error = float((logits - expected).norm() / expected.norm())
    print(f"optimize(model): relative error of the logits vs eager {error:.1e} "
          f"({time.perf_counter() - start:.1f} s with the compile)")
    print(kda_compile.report(compiled))

    start = time.perf_counter()
    eager_tokens = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=2,
                                  do_sample=False)
    model.forward = torch.compile(model.forward, backend="kda_compile", dynamic=True)
    tokens = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=2, do_sample=False)
    print(f'backend="kda_compile" generate(): same tokens as eager: {torch.equal(tokens, eager_tokens)} '
          f"({time.perf_counter() - start:.1f} s with the compiles)")
    print(kda_compile.report(model.forward))


if __name__ == "__main__":
    main()

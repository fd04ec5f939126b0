"""generate() with every decode step replayed from one CUDA graph (docs/cuda-graphs.md).

A tiny Kimi-Linear-shaped model (KDA + MLA layers, random weights) decodes into Hugging Face's StaticCache through
``kda_compile.optimize(model.forward, mode="reduce-overhead")``: the prefill is compiled without CUDA graphs, the
decode step is captured once and replayed for every token. The tokens are checked against HF's eager model and
the report says which graph was captured.

On a machine without CUDA the same code runs without CUDA graphs (they need a GPU): Inductor is swapped for
aot_eager so the example finishes quickly, and the report lists the rewrites; on a GPU each graph's report also
says whether it was captured ("cuda graphs: captured" for the decode step).

    python examples/cuda_graph_decode.py
"""
import torch
from transformers import StaticCache

import kda_compile
from kda_compile.bench import e2e_kimi


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = e2e_kimi.build_model(e2e_kimi.TINY, layers=4, device=device, dtype=torch.float32)
    ids = torch.randint(3, e2e_kimi.TINY.vocab, (2, 12), device=device)
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)

    config = kda_compile.Config() if device == "cuda" else kda_compile.Config(compiler="aot_eager")
    model.forward = kda_compile.optimize(model.forward, config, mode="reduce-overhead")
    cache = StaticCache(config=model.config, max_cache_len=64)  # one cache, reused: one decode graph
    for _ in range(2):  # the second call replays the decode graph the first one recorded
        cache.reset()
        tokens = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=8,
                                do_sample=False)
    print("tokens equal eager:", torch.equal(tokens, expected))
    print(kda_compile.report(model.forward))


if __name__ == "__main__":
    main()

"""End to end: a Hugging Face decoder's prefill forward in four configurations, side by side.

``--model kimi_linear`` / ``--model qwen3_next``: a Kimi-Linear- / Qwen3-Next-shaped hybrid model, prefill
tokens/s and decode ms per token with HF eager (FLA kernels / torch fallback), Inductor and kda_compile; see
e2e_hybrid.py (e2e_kimi.py, e2e_qwen3_next.py).

``--model llama`` (default): a Llama-style model of about 1B parameters (hidden 2048, 16 layers,
32 heads / 8 KV heads, MLP 8192), random weights, bf16, batch 1, the decoder body without the LM
head (as in the project's anchors), prompts of 1k / 4k / 8k tokens, in:

- ``hf_eager``: attn_implementation="eager", no compile;
- ``hf_sdpa``: attn_implementation="sdpa", no compile;
- ``inductor``: torch.compile of the eager model (Inductor does not fuse HF's eager attention);
- ``kda_compile``: kda_compile.optimize of the eager model.

Metrics: forward latency (ms), tokens per second and peak memory (GiB) per prompt length. Compiled
configurations mark the sequence dimension dynamic, so each compiles once for all prompt lengths.
The forward runs as inference prefill does (``use_cache`` left at its default, as in ``generate()``).
With ``--no-cache`` (``use_cache=False``, as in training) transformers adds packed-sequence terms
computed from ``position_ids`` to the mask; with no ``position_ids`` given (as here) they are made in
the graph from ``arange`` and kda_compile proves the mask is still the causal one, so the op runs on
flags as with the cache. Only ``position_ids`` passed in by the caller (really packed sequences) keep
the T x T mask tensor (correct, slower at long prompts; the rewrite report says so).
"""
from __future__ import annotations

import gc
import logging

import torch

from kda_compile.bench.common import format_table, row, time_quantiles

logger = logging.getLogger("kda_compile.bench.e2e")

CONFIGURATIONS = ("hf_eager", "hf_sdpa", "inductor", "kda_compile")


def add_arguments(parser) -> None:
    parser.add_argument("--model", choices=("llama", "kimi_linear", "qwen3_next"), default="llama")
    parser.add_argument("--prompts", default=None,
                        help="comma-separated prompt lengths (llama: 1024,4096,8192; kimi_linear, qwen3_next: "
                             "1024,4096)")
    parser.add_argument("--configs", default=None, help="comma-separated subset of the configurations (llama: " +
                        ", ".join(CONFIGURATIONS) + "; kimi_linear, qwen3_next: hf_eager_fla, "
                        "hf_eager_torch, inductor, kda_compile, kda_compile (cuda graphs))")
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder layers (llama: 16, about 1B parameters; kimi_linear: 4 = 3 KDA + 1 MLA; "
                             "qwen3_next: 4 = 3 GDN + 1 attention)")
    parser.add_argument("--no-cache", action="store_true",
                        help="llama: forward with use_cache=False (training-style mask)")
    kimi = parser.add_argument_group("kimi_linear, qwen3_next")
    kimi.add_argument("--decode-shapes", default="1x512,1x8192,64x512",
                      help="comma-separated BATCHxPROMPT decode shapes: a PROMPT-token prefill per sequence, then the "
                           "timed decode loop (default: %(default)s)")
    kimi.add_argument("--new-tokens", type=int, default=32, help="single-token forwards timed per decode loop")
    kimi.add_argument("--decode-repeats", type=int, default=5, help="decode loops timed (median reported)")
    kimi.add_argument("--torch-max-prompt", type=int, default=1024,
                      help="longest prompt run on HF's torch fallback (its chunk path is memory-hungry)")
    kimi.add_argument("--compile-mode", default=None, help="torch.compile mode of the compiled configurations")
    kimi.add_argument("--smoke", action="store_true", help="tiny widths on CPU: check the wiring, not the speed")


def _llama_body(attn_implementation: str, layers: int):
    from transformers import LlamaConfig, LlamaModel

    config = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=layers,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                         max_position_embeddings=16384, attn_implementation=attn_implementation)
    torch.manual_seed(0)
    return LlamaModel(config).to(device="cuda", dtype=torch.bfloat16).eval()


def _build(name: str, layers: int):
    import kda_compile

    model = _llama_body("sdpa" if name == "hf_sdpa" else "eager", layers)
    if name == "inductor":
        return torch.compile(model)
    if name == "kda_compile":
        return kda_compile.optimize(model)
    return model


def _forward(model, input_ids, use_cache):
    with torch.inference_mode():
        return model(input_ids=input_ids, use_cache=use_cache).last_hidden_state


def run(args) -> list[dict]:
    if args.model in ("kimi_linear", "qwen3_next"):
        from kda_compile.bench import e2e_hybrid, e2e_kimi, e2e_qwen3_next

        return e2e_hybrid.run((e2e_kimi if args.model == "kimi_linear" else e2e_qwen3_next).MODEL, args)
    if args.smoke:
        raise SystemExit("--smoke is offered for --model kimi_linear and qwen3_next only")
    if not torch.cuda.is_available():
        raise SystemExit("the end-to-end benchmark needs a CUDA device")
    args.layers = args.layers or 16
    prompts = [int(p) for p in (args.prompts or "1024,4096,8192").split(",")]
    use_cache = None if not args.no_cache else False  # None: the model's default (True for inference)
    configs = (args.configs or ",".join(CONFIGURATIONS)).split(",")
    rows, results, outputs = [], {}, {}
    for name in configs:
        model = _build(name, args.layers)
        for T in prompts:
            input_ids = torch.randint(0, 32000, (1, T), device="cuda")
            if name in ("inductor", "kda_compile"):
                torch._dynamo.mark_dynamic(input_ids, 1)
            out = _forward(model, input_ids, use_cache)  # compiles on first use
            if name == "kda_compile" and T == prompts[0]:
                import kda_compile

                logger.info("rewrite report:\n%s", kda_compile.report(model))
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            out = _forward(model, input_ids, use_cache)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() / 2**30
            times = time_quantiles(lambda: _forward(model, input_ids, use_cache), warmup_ms=50, rep_ms=500)
            shape = f"1x{T}"
            rows.append(row("llama_1b_prefill", name, "inference", shape, "time", "ms", times))
            rows.append(row("llama_1b_prefill", name, "inference", shape, "tokens_per_s", "tok/s",
                            tuple(T / (t * 1e-3) for t in reversed(times))))
            rows.append(row("llama_1b_prefill", name, "inference", shape, "peak_memory", "GiB", (peak, peak, peak)))
            results[(name, T)] = (times[1], peak)
            # Same random weights in every configuration: the outputs must agree (bf16 tolerance).
            outputs[(name, T)] = out[0, -8:].float().cpu()
            logger.info("%s T=%d: %.2f ms, peak %.2f GiB", name, T, times[1], peak)
        del model
        gc.collect()
        torch.cuda.empty_cache()
        torch._dynamo.reset()
    lines = []
    for T in prompts:
        ref = outputs.get(("hf_eager", T))
        for name in configs:
            ms, peak = results[(name, T)]
            err = "-" if ref is None else f"{((outputs[(name, T)] - ref).norm() / ref.norm()).item():.1e}"
            sdpa = results.get(("hf_sdpa", T))
            ind = results.get(("inductor", T))
            lines.append([T, name, ms, T / (ms * 1e-3), peak, "-" if sdpa is None else sdpa[0] / ms,
                          "-" if ind is None else ind[0] / ms, err])
    print(f"\nLlama-style {args.layers} layers (hidden 2048, 32/8 heads), bf16, batch 1, prefill forward (median)")
    print(format_table(["prompt", "configuration", "ms", "tokens/s", "peak GiB", "x vs hf_sdpa", "x vs inductor",
                        "rel. err vs eager (last 8 tokens)"], lines))
    return rows

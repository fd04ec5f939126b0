"""End to end: Hugging Face decoders' prefill and decode, HF eager against kda_compile.

The decode runner (e2e_hybrid.py): prefill tokens/s and decode ms per token, GPU ms and kernels per decode step,
with HF eager, Inductor, kda_compile and kda_compile in CUDA graphs, for

- ``--model kimi_linear`` / ``--model qwen3_next``: a Kimi-Linear- / Qwen3-Next-shaped hybrid model (e2e_kimi.py,
  e2e_qwen3_next.py); HF eager with FLA's kernels (``hf_eager_fla``, the baseline) and with HF's torch fallback
  (``hf_eager_torch``);
- ``--model deepseek_v32``: a DeepSeek-V3.2-shaped model, MLA with the DSA indexer (e2e_deepseek_v32.py);
- ``--model llama --decode-shapes BxP,...``: a Llama-3.1-8B-shaped model (e2e_llama.py).

The last two bind no FLA kernels: their baseline is plain HF eager (``hf_eager``), and they measure decode only
unless ``--prompts`` asks for prefill rows too. ``--smoke`` runs any of them at tiny widths on CPU.

``--train`` (any ``--model``; llama: the Llama-3.1-8B-shaped model): training steps instead, forward with labels and
backward at ``--train-tokens`` tokens, each configuration in a fresh process with empty compile caches
(e2e_train.py: ``time_per_step``, ``gpu_time_per_step``, ``peak_memory``, ``first_step_time``).

``--model llama`` (the default) without ``--decode-shapes`` or ``--smoke``: the prefill benchmark of a Llama-style
model of about 1B parameters (hidden 2048, 16 layers, 32 heads / 8 KV heads, MLP 8192), random weights, bf16,
batch 1, the decoder body without the LM head (as in the project's anchors), prompts of 1k / 4k / 8k tokens, in:

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
import importlib
import logging

import torch

from kda_compile.bench import e2e_hybrid, e2e_train
from kda_compile.bench.common import format_table, row, time_quantiles
from kda_compile.cli_help import HelpFormatter

logger = logging.getLogger("kda_compile.bench.e2e")

CONFIGURATIONS = ("hf_eager", "hf_sdpa", "inductor", "kda_compile")  # the llama prefill benchmark
DECODE_MODELS = {  # --model -> the module of its HybridModel (MODEL), run by e2e_hybrid
    "kimi_linear": "kda_compile.bench.e2e_kimi",
    "qwen3_next": "kda_compile.bench.e2e_qwen3_next",
    "deepseek_v32": "kda_compile.bench.e2e_deepseek_v32",
    "llama": "kda_compile.bench.e2e_llama",  # with --decode-shapes or --smoke; otherwise the prefill benchmark
}


CLI_EPILOG = """\
examples:
  e2e --model kimi_linear | qwen3_next    decode runner, prefill and decode rows, baselines hf_eager_fla and
                                          hf_eager_torch
  e2e --model deepseek_v32                decode runner, baseline hf_eager (decode rows only by default)
  e2e --model llama --decode-shapes 1x512,64x512
                                          decode runner on the Llama-3.1-8B-shaped model, baseline hf_eager
  e2e --model llama                       the Llama-style 1B prefill benchmark (no decode)
  e2e --model MODEL --smoke               tiny widths on CPU (llama: the decode runner)
  e2e --model kimi_linear --train         training steps at 2k and 8k tokens, hf_eager_fla against kda_compile
"""


def add_arguments(parser) -> None:
    parser.epilog = CLI_EPILOG
    parser.formatter_class = HelpFormatter
    parser.add_argument("--model", choices=("llama", "kimi_linear", "qwen3_next", "deepseek_v32"), default="llama",
                        help="llama: the Llama-style 1B prefill benchmark, or with --decode-shapes / --smoke the "
                             "Llama-3.1-8B-shaped decode benchmark; the others: the decode runner "
                             "(default: %(default)s)")
    parser.add_argument("--prompts", default=None,
                        help="comma-separated prompt lengths of the prefill rows (llama prefill: 1024,4096,8192; "
                             "kimi_linear, qwen3_next: 1024,4096; deepseek_v32 and llama decode: none, decode rows "
                             "only)")
    parser.add_argument("--configs", default=None, help="comma-separated subset of the configurations (llama "
                        "prefill: " + ", ".join(CONFIGURATIONS) + "; kimi_linear, qwen3_next: hf_eager_fla, "
                        "hf_eager_torch, inductor, kda_compile, kda_compile (cuda graphs), kda_compile (cuda graphs; "
                        "skip_decode_guards); deepseek_v32 and llama decode: hf_eager and the same four)")
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder layers (llama prefill: 16, about 1B parameters; kimi_linear: 4 = 3 KDA + 1 MLA; "
                             "qwen3_next: 4 = 3 GDN + 1 attention; deepseek_v32: 4 = 3 dense + 1 MoE; llama "
                             "decode: 4)")
    parser.add_argument("--no-cache", action="store_true",
                        help="llama prefill: forward with use_cache=False (training-style mask)")
    decode = parser.add_argument_group("decode runner (kimi_linear, qwen3_next, deepseek_v32; llama with "
                                       "--decode-shapes)")
    decode.add_argument("--decode-shapes", default=None,
                        help="comma-separated BATCHxPROMPT decode shapes: a PROMPT-token prefill per sequence, then "
                             f"the timed decode loop (default: {e2e_hybrid.DEFAULT_DECODE_SHAPES}); with --model "
                             "llama, giving it runs the Llama-3.1-8B-shaped decode benchmark")
    decode.add_argument("--new-tokens", type=int, default=32, help="single-token forwards timed per decode loop")
    decode.add_argument("--decode-repeats", type=int, default=5, help="decode loops timed (median reported)")
    decode.add_argument("--torch-max-prompt", type=int, default=1024,
                        help="kimi_linear, qwen3_next: longest prompt run on HF's torch fallback (its chunk path is "
                             "memory-hungry)")
    decode.add_argument("--compile-mode", default=None, help="torch.compile mode of the compiled configurations")
    train = parser.add_argument_group("training steps (--train)")
    train.add_argument("--train", action="store_true",
                       help="measure training steps (forward with labels + backward), each configuration and length "
                            "in a fresh process with empty compile caches; --configs: the model's HF eager "
                            "baselines and kda_compile (default: its first baseline and kda_compile)")
    train.add_argument("--train-tokens", default=None,
                       help="comma-separated tokens per step, one sequence (default: 2048,8192; --smoke: 16)")
    train.add_argument("--train-steps", type=int, default=5, help="timed steps after two warm-up steps")
    decode.add_argument("--smoke", action="store_true",
                        help="tiny widths on CPU in fp32, kda_compile on aot_eager: check the wiring, not the speed "
                             "(llama: the decode benchmark); --configs, --prompts and --decode-shapes narrow it")


def runs_decode(args) -> bool:
    """Whether the command runs the decode runner: every model but llama, and llama when a decode is asked
    (``--decode-shapes`` or ``--smoke``); plain ``--model llama`` stays the 1B prefill benchmark."""
    return args.model != "llama" or args.decode_shapes is not None or args.smoke


def run_decode(args) -> list[dict]:
    """The decode runner on the model's HybridModel. ``--no-cache`` is refused rather than ignored: decoding needs
    the cache, and a run that silently dropped the option would not measure what was asked."""
    if args.no_cache:
        raise SystemExit(f"--no-cache applies to the llama prefill benchmark only (without --decode-shapes and "
                         f"--smoke), not to --model {args.model} with the decode runner")
    spec = importlib.import_module(DECODE_MODELS[args.model]).MODEL
    return e2e_hybrid.run(spec, args)


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


def _prefill_configs(text: str | None) -> list[str]:
    """``--configs`` of the llama prefill benchmark, checked before any model is built (a decode configuration
    named without ``--decode-shapes`` is refused with a pointer to it)."""
    configs = (text or ",".join(CONFIGURATIONS)).split(",")
    unknown = [c for c in configs if c not in CONFIGURATIONS]
    if unknown:
        raise SystemExit(f"--configs for the llama prefill benchmark must name configurations among "
                         f"{', '.join(CONFIGURATIONS)}, got {unknown} (the decode configurations need "
                         f"--decode-shapes)")
    return configs


def run_train(args) -> list[dict]:
    """Training rows of the model's HybridModel (llama: the Llama-3.1-8B-shaped one). Decode options are refused
    rather than ignored."""
    given = [flag for flag, value in (("--decode-shapes", args.decode_shapes), ("--prompts", args.prompts),
                                      ("--no-cache", args.no_cache), ("--compile-mode", args.compile_mode))
             if value not in (None, False)]
    if given:
        raise SystemExit(f"--train measures training steps; {', '.join(given)} belong to the prefill / decode runs")
    spec = importlib.import_module(DECODE_MODELS[args.model]).MODEL
    return e2e_train.run(spec, args)


def run(args) -> list[dict]:
    if args.train:
        return run_train(args)
    if runs_decode(args):
        return run_decode(args)
    configs = _prefill_configs(args.configs)
    if not torch.cuda.is_available():
        raise SystemExit("the end-to-end benchmark needs a CUDA device")
    args.layers = args.layers or 16
    prompts = [int(p) for p in (args.prompts or "1024,4096,8192").split(",")]
    use_cache = None if not args.no_cache else False  # None: the model's default (True for inference)
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

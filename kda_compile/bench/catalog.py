"""What each curated benchmark CSV in the repository's ``benchmarks/`` folder measures, and which tables
``python -m kda_compile.bench report`` makes of it.

Keys are the CSV names without ``.csv``. A CSV without an entry still gets a table (``DEFAULT_VIEW``).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class View:
    """One table of a benchmark: the median (p50) of ``metric`` per shape (one column per provider) and,
    for every ``(baseline, ours)`` pair present, the ratio ``baseline / ours``. Ratios are only asked of time
    metrics, so above 1 means ours is faster. ``providers`` restricts and orders the columns (default: every
    provider with that metric, in the CSV's order)."""

    metric: str
    ours: tuple[str, ...] = ()
    baselines: tuple[str, ...] = ()
    providers: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Benchmark:
    """The heading, a paragraph on what is measured, the command that produces the CSV, and its tables."""

    title: str
    measures: str
    command: str
    views: tuple[View, ...]


DEFAULT_VIEW = View("time")
_GDN_OURS = ("ours", "ours (KDA kernels)", "ours (decode kernel)")
OURS_DECODE = ("kda_compile", "kda_compile (cuda graphs)", "kda_compile (cuda graphs; skip_decode_guards)")



def _kda_prefill(gate: str) -> str:
    return (
        f"`chunk_kda` on bf16 q / k / v with K = V = 128, the q / k L2 norm, the gate and the beta sigmoid computed "
        f"inside the op, and an fp32 initial state, over B x T x H shapes. {gate} `fwd`: the forward in inference "
        "mode; "
        "`fwd+bwd`: forward and backward. Providers: `ours (own kernels)` (our prepare and scan kernels; the "
        "backward is FLA's), `ours (FLA path)` (FLA's gate and intra-chunk kernels, then our scan kernel) and `FLA` "
        "(flash-linear-attention's own `chunk_kda`). Each figure is the median over 3 interleaved rounds of "
        "`triton.testing.do_bench`. Kernel design and its measurements: [docs/kda-kernels.md](../docs/kda-kernels.md)."
    )

def _cp_names(suffix: str = "", who: str = "ours") -> tuple[str, ...]:
    """Provider names of the context-parallel benchmark at 2, 4 and 8 GPUs (and of its CPU smoke run:
    ``processes``)."""
    return tuple(f"{who} (CP, {n} {unit}{suffix})" for unit in ("GPUs", "processes") for n in (2, 4, 8))


CP_ONE = ("ours (1 GPU)", "ours (1 process)")
CP_PROVIDERS = tuple(name for pair in zip(_cp_names(), _cp_names(", balanced")) for name in pair)

CATALOG: dict[str, Benchmark] = {
    "gdn": Benchmark(
        title="GDN (gated delta rule): prefill, training and decode",
        measures="`chunk_gated_delta_rule` (`fwd`: forward in inference mode; `fwd+bwd`: forward and backward) and "
        "`fused_recurrent_gated_delta_rule` (`decode`: one token) at Qwen3-Next's widths: 16 q/k heads, 32 value "
        "heads, K = V = 128, bf16, the q / k L2 norm, the GDN gate and the beta sigmoid computed inside the op, an "
        "fp32 initial state and the final state returned. Providers: `ours` (`kda_compile.ops` with its automatic "
        "backend choice), `ours (KDA kernels)` (the route through our KDA Triton kernels with the gate broadcast "
        "over K: what runs without FLA), `ours (decode kernel)` (decode on our Triton step with the scalar gate) "
        "and `FLA` (flash-linear-attention's public functions). `wall_time`: one call as its caller waits for it; "
        "`kernel_time`: the summed GPU time of its kernels; `gpu_time_cuda_graph`: one decode step replayed from a "
        "CUDA graph; `gpu_time_per_step`: one of 8 decode steps captured back to back in one graph, each on its own "
        "inputs and state (a layer's cost inside a model's decode graph); `fraction_of_copy_bandwidth`: the fp32 "
        "state read and written per second at the per-step time over the measured copy bandwidth; `first_call_time` (`cold_start`): the first call in a fresh process with empty kernel "
        "caches. Design: [docs/gdn.md](../docs/gdn.md).",
        command="python -m kda_compile.bench gdn",
        views=(View("wall_time", ours=_GDN_OURS, baselines=("FLA",)),
               View("kernel_time", ours=_GDN_OURS, baselines=("FLA",)),
               View("gpu_time_cuda_graph", ours=_GDN_OURS, baselines=("FLA",)),
               View("gpu_time_per_step", ours=_GDN_OURS, baselines=("FLA",)),
               View("fraction_of_copy_bandwidth"),
               View("first_call_time", ours=_GDN_OURS, baselines=("FLA",))),
    ),
    "kda_prefill_lower_bound": Benchmark(
        title="KDA prefill, lower-bound gate",
        measures=_kda_prefill("Gate: `lower_bound=-5` with `safe_gate=True` (FlashKDA's setting); for it the op's "
                              "default on CUDA is `ours (own kernels)`."),
        command="python -m kda_compile.bench kda --gate lower_bound --modes fwd,fwd+bwd",
        views=(View("time", ours=("ours (own kernels)",), baselines=("FLA",)),),
    ),
    "kda_prefill_softplus": Benchmark(
        title="KDA prefill, softplus gate",
        measures=_kda_prefill("Gate: the softplus gate of the released Kimi-Linear (`A_log`, `dt_bias`). Measured "
                              "on 2026-11-22 with the Triton prepare kernel (`ours (own kernels)`, whose exact pass "
                              "slows down on strong decays), when the op's default for this gate was "
                              "`ours (FLA path)`; today bf16 calls with K = V = 128 run the CUDA prepare kernel by "
                              "default, compared in `kda_prefill_softplus_vs_fla` below."),
        command="python -m kda_compile.bench kda --gate softplus --modes fwd,fwd+bwd",
        views=(View("time", ours=("ours (FLA path)", "ours (own kernels)"), baselines=("FLA",)),),
    ),
    "kda_prefill_vs_flashkda": Benchmark(
        title="KDA prefill: ours, FLA and FlashKDA",
        measures="The forward of `chunk_kda` in inference mode on bf16 q / k / v / g with K = V = 128, the q / k L2 "
        "norm, the gate and the beta sigmoid computed inside the op, an fp32 initial state in the value-first "
        "layout `[N, H, V, K]` and the final state returned, for the lower-bound gate (`lower_bound=-5`, "
        "`safe_gate=True`) and the softplus gate. Shapes: `BxTxH` is a batch of B sequences of T tokens; "
        "`varlen:NxTxH` packs N sequences of T tokens into one call with `cu_seqlens` (`varlen:3000+1+0+517+2048+"
        "2626x32`: sequences of those lengths, one empty and one of a single token). Providers, all with the same "
        "math: `ours` (`kda_compile.ops.chunk_kda` with its automatic backend choice), `FLA` "
        "(flash-linear-attention's `chunk_kda`) and `FlashKDA` (MoonshotAI's CUDA kernels, `flash_kda.fwd`, built "
        "from source for sm_90a by `.ci/flashkda_build.sh`; lower-bound gate only, and missing where it was not "
        "installed; it keeps the state in bf16 while computing). `wall_time`: one call as its caller waits for it, "
        "host time (checks, allocations, launches) included: CUDA events around the call after synchronising, L2 "
        "flushed before it. `kernel_time`: the summed GPU time of the call's kernels (torch.profiler), without "
        "the host. Each figure is the median over 3 interleaved rounds; the CSV also holds `launches` (the GPU "
        "kernels and memory operations the profiler records per call), `rel_error_vs_ours` (output) and `final_state_rel_error_vs_ours`. A ratio above 1 means ours "
        "is faster.",
        command="python -m kda_compile.bench kda --modes prefill --gates lower_bound,softplus",
        views=(View("wall_time", ours=("ours",), baselines=("FLA", "FlashKDA")),
               View("kernel_time", ours=("ours",), baselines=("FLA", "FlashKDA")),
               View("rel_error_vs_ours", providers=("FLA", "FlashKDA"))),
    ),
    "kda_prefill_softplus_vs_fla": Benchmark(
        title="KDA prefill, softplus gate: ours and FLA",
        measures="The prefill comparison above (`python -m kda_compile.bench kda --modes prefill`: the same inputs, "
        "options, shapes, metrics and timing) for the softplus gate of the released Kimi-Linear "
        "(`g = -exp(A_log) softplus(g + dt_bias)`, `exp(A_log)` in [1, e)) and for `softplus_strong`, the same gate "
        "with Mamba-style `exp(A_log) ~ U(1, 16)`: decays strong enough that most 16-token blocks span more than "
        "2^120 in some channel, which made the Triton prepare kernel's exact pass cost 1.9x. Providers: `ours` "
        "(`kda_compile.ops.chunk_kda` as it chooses: the CUDA prepare and scan kernels for these calls) and `FLA` "
        "(flash-linear-attention's `chunk_kda`). A ratio above 1 means ours is faster.",
        command="python -m kda_compile.bench kda --gates softplus,softplus_strong --providers ours,FLA",
        views=(View("wall_time", ours=("ours",), baselines=("FLA",)),
               View("kernel_time", ours=("ours",), baselines=("FLA",)),
               View("rel_error_vs_ours", providers=("FLA",))),
    ),
    "kda_decode": Benchmark(
        title="KDA decode",
        measures="`fused_recurrent_kda` for one token: 32 heads, K = V = 128, bf16 inputs, an fp32 state, the "
        "softplus gate, q / k L2 norm and beta sigmoid inside the op; batch 1 / 64 / 256. `gpu_time_per_step`: 8 "
        "steps on distinct inputs and states captured in one CUDA graph, per step (the L2 cache is flushed between "
        "replays); `host_time_per_call`: wall clock per eager call over 500 back-to-back calls, as a loop without "
        "CUDA graphs sees it. `fraction_of_copy_bandwidth`: state bytes read and written per second over the "
        "measured device-to-device copy bandwidth. Providers: `ours (triton_decode)` (the op's default on CUDA), "
        "`ours (fla path)` (the op on FLA's kernel) and `fla` (FLA's `fused_recurrent_kda`).",
        command="python -m kda_compile.bench kda --modes decode",
        views=(View("gpu_time_per_step", ours=("ours (triton_decode)",), baselines=("fla",)),
               View("host_time_per_call", ours=("ours (triton_decode)",), baselines=("fla",)),
               View("fraction_of_copy_bandwidth", providers=("ours (triton_decode)",))),
    ),
    "mla_decode": Benchmark(
        title="MLA decode",
        measures="One decode step of one MLA layer, from the query and the latent cache to the per-head outputs: "
        "bf16, kv_lora_rank 512, nope 128, rope 64, v 128; shapes are batch x cache x heads. `kda_compile` is "
        "`mla_attention` (absorbed form: the wgmma kernel on an H100 with 64 or more query rows, else the Triton "
        "split-KV kernel); `hf_*` is Hugging Face's `DeepseekV3Attention.expand_kv` followed by its eager or SDPA "
        "attention, `*_compiled` under `torch.compile`. `time`: one eager call (at batch 1 ours is bound by host "
        "time). `gpu_time_cuda_graph`: our layer step replayed from a CUDA graph, automatic kernel choice against "
        "the Triton kernel forced. `fraction_of_copy_bandwidth`: latent bytes the decode kernel alone reads per "
        "second over the measured copy bandwidth. Kernel design: "
        "[docs/mla-decode-kernels.md](../docs/mla-decode-kernels.md).",
        command="python -m kda_compile.bench mla --quick --heads 32,64,128 --modes decode",
        views=(View("time", ours=("kda_compile",), baselines=("hf_sdpa_compiled",),
                    providers=("kda_compile", "hf_eager", "hf_sdpa", "hf_eager_compiled", "hf_sdpa_compiled")),
               View("gpu_time_cuda_graph", ours=("kda_compile",), baselines=("kda_compile_triton_kernel",),
                    providers=("kda_compile", "kda_compile_triton_kernel")),
               View("fraction_of_copy_bandwidth",
                    providers=("kda_compile_triton_kernel_only", "kda_compile_wgmma_kernel_only"))),
    ),
    "dsa": Benchmark(
        title="DeepSeek Sparse Attention",
        measures="One DSA layer's two ops, bf16: `dsa_indexer` (the lightning indexer's scores and the top-k 2048 "
        "selection) and `dsa_sparse_attention` (the absorbed MQA form, d_qk 576 = latent 512 + rope 64, d_v 512, "
        "over the selected keys). Widths `deepseek_v32` (128 heads, indexer 64 x 128), `glm5` (64 heads, "
        "indexer 32 x 128) and `glm5_next` (`dsa_pooled_indexer`: 32 x 128 over pools of 16 keys; attention 64 heads "
        "over latent 512, no rope); shapes `prefill:1xSxS` (one causal sequence) and `decode:Bx1xT` (one query against T "
        "cached keys). `ours`: `kda_compile.ops.dsa_indexer_topk` / `dsa_sparse_attention`; `dense torch`: the "
        "indexer as Hugging Face computes it (the [B, S, H_I, T] fp32 logits) and SDPA over every key with a dense "
        "mask of the selection (NaN where it would not fit in memory). `time`: GPU time (do_bench); `tflops`: "
        "FlashMLA's convention 2 * s_q * topk * heads * (d_qk + d_v) for the attention, the QK FLOPs of the visible "
        "pairs for the indexer; `gpu_time_cuda_graph`: decode replayed from a CUDA graph (no host time), per op "
        "and for `dsa_decode_layer` (the indexer and the attention of one layer together). Design: "
        "[docs/dsa.md](../docs/dsa.md).",
        command="python -m kda_compile.bench dsa",
        views=(View("time", ours=("ours",), baselines=("dense torch",)), View("tflops", providers=("ours",)),
               View("gpu_time_cuda_graph", providers=("ours",))),
    ),
    "attention": Benchmark(
        title="Softmax attention",
        measures="Causal attention, batch 1, 32 heads, bf16, Hugging Face layout (q / k / v are [B, H, T, D] views "
        "of [B, T, H, D] storage), head dims 128 / 128 and 192 / 128 (MLA prefill); `fwd` without autograd, "
        "`fwd+bwd` with the gradients of q, k and v. `kda_compile`: the op's automatic choice; "
        "`kda_compile-triton`: our Triton kernel forced (the path for softcap, dropout and mask gradients); "
        "`sdpa`: `F.scaled_dot_product_attention`'s own choice; `sdpa-<backend>`: one backend forced (missing "
        "where it refuses the shape).",
        command="python -m kda_compile.bench attention --lengths 4096",
        views=(View("time", ours=("kda_compile", "kda_compile-triton"), baselines=("sdpa",)),),
    ),
    "moe": Benchmark(
        title="Routed experts",
        measures="`kda_compile.ops.moe_experts` against Hugging Face's default experts path "
        "(`grouped_mm_experts_forward`, CUTLASS's grouped GEMM through `torch._grouped_mm`) at the widths of "
        "Qwen3-Next (512 experts, 10 active, hidden 2048, expert 512), DeepSeek-V3.2 (256 / 8 / 7168 / 2048) and the "
        "Kimi-Linear-shaped benchmark model (16 / 4 / 2304 / 1024), bf16, random routing, T tokens per call, each "
        "call replayed from a CUDA graph. `kda_compile`: the op's choice per call; `kda_compile-triton` / "
        "`kda_compile-grouped_mm`: one kernel forced. Bandwidth: the hit experts' weights over the time, as a share "
        "of the measured copy bandwidth ([docs/moe.md](../docs/moe.md)).",
        command="python -m kda_compile.bench moe",
        views=(View("time", ours=("kda_compile", "kda_compile-triton"), baselines=("hf_grouped_mm",)),),
    ),
    "block_sparse": Benchmark(
        title="Block-sparse attention (MiniMax-M3's sparse layers)",
        measures="`kda_compile.ops.block_sparse_attention` at MiniMax-M3's widths (64 query heads in 4 KV groups of "
        "width 128, blocks of 128 keys, 16 selected per query and group, its own block among them), bf16, a random "
        "selection in HF's indexer layout, against Hugging Face's own path: `MiniMaxM3VLIndexer.build_block_mask` "
        "then SDPA (`hf_sdpa`) or eager attention (`hf_eager`) over the dense mask, built inside the call as HF "
        "builds it per layer. Shapes `B`, `Sq` queries, `T` keys: decode over a 32k cache at batch 1 and 16, a "
        "chunk of 1024 queries over 16k keys, an 8k prefill. Each call replayed from a CUDA graph; `rel_err_vs_fp32`: "
        "against the float32 reference where its dense scores fit ([docs/block-sparse.md](../docs/block-sparse.md)).",
        command="python -m kda_compile.bench block_sparse",
        views=(View("time", ours=("kda_compile",), baselines=("hf_sdpa", "hf_eager")),),
    ),
    "e2e_llama": Benchmark(
        title="End to end: Llama-style 1B prefill",
        measures="A Llama-style decoder body of about 1B parameters (hidden 2048, 16 layers, 32 / 8 heads, MLP "
        "8192), random weights, bf16, batch 1: one prefill forward with the default cache, prompts of 1k / 4k / 8k "
        "tokens. `hf_sdpa`: transformers with SDPA attention; `inductor`: `torch.compile` of the eager-attention "
        "model; `kda_compile`: `kda_compile.optimize` of the eager-attention model.",
        command="python -m kda_compile.bench e2e --configs hf_sdpa,inductor,kda_compile",
        views=(View("time", ours=("kda_compile",), baselines=("hf_sdpa", "inductor")), View("peak_memory")),
    ),
    "e2e_kimi": Benchmark(
        title="End to end: Kimi-Linear-shaped model",
        measures="`KimiLinearForCausalLM` from transformers at the released model's widths (hidden 2304; KDA 32 "
        "heads x 128; MLA 32 heads, kv_lora_rank 512; MoE 16 experts, 4 active) with 4 layers (KDA, KDA, KDA, MLA), "
        "random weights, bf16, batch 1. Prefill (`time`): one forward of the prompt with a fresh cache and "
        "`logits_to_keep=1`. Decode (`time_per_token`): 16 greedy single-token forwards with the cache after a "
        "512-token prompt, median of 3 loops. `hf_eager_fla`: HF eager with flash-linear-attention's kernels; "
        "`kda_compile`: `kda_compile.optimize(model.forward)`.",
        command="python -m kda_compile.bench e2e --model kimi_linear --configs hf_eager_fla,kda_compile "
        "--prompts 1024,4096 --decode-repeats 3 --new-tokens 16",
        views=(View("time", ours=("kda_compile",), baselines=("hf_eager_fla",)),
               View("time_per_token", ours=("kda_compile",), baselines=("hf_eager_fla",))),
    ),
    "e2e_qwen3_next": Benchmark(
        title="End to end: Qwen3-Next-shaped model",
        measures="`Qwen3NextForCausalLM` from transformers at the released model's widths (hidden 2048; gated delta "
        "rule with 16 q/k heads and 32 value heads of 128; softmax attention 16 / 2 heads of 256; MoE 512 experts, "
        "10 active) with 4 layers (GDN, GDN, GDN, attention), random weights, bf16, batch 1. Prefill (`time`): one "
        "forward of the prompt with a fresh cache and `logits_to_keep=1`. Decode (`time_per_token`): 16 greedy "
        "single-token forwards with the cache after a 512-token prompt, median of 3 loops. `hf_eager_fla`: HF eager "
        "with flash-linear-attention's GDN kernels; `kda_compile`: `kda_compile.optimize(model.forward)`. The bf16 "
        "configurations differ in their logits and greedy tokens by bf16 rounding, which the random-weight MoE "
        "amplifies (against HF's torch path in fp32: FLA in bf16 9.5%, ours 8.6%; both 0.85% in fp32; "
        "[docs/gdn.md](../docs/gdn.md) section 6).",
        command="python -m kda_compile.bench e2e --model qwen3_next --configs hf_eager_fla,kda_compile "
        "--prompts 1024,4096 --decode-repeats 3 --new-tokens 16",
        views=(View("time", ours=("kda_compile",), baselines=("hf_eager_fla",)),
               View("time_per_token", ours=("kda_compile",), baselines=("hf_eager_fla",))),
    ),
    "e2e_decode": Benchmark(
        title="End to end: decode steps in CUDA graphs (Kimi-Linear-, Qwen3-Next-, DeepSeek-V3.2- and "
        "Llama-3.1-8B-shaped models)",
        measures="The Kimi-Linear- and Qwen3-Next-shaped models of the two end-to-end benchmarks above, a "
        "DeepSeek-V3.2-shaped `DeepseekV32ForCausalLM` (MLA with the DSA indexer, top 2048 keys; 3 dense layers and "
        "1 MoE layer of 256 experts, 8 active) and a Llama-3.1-8B-shaped `LlamaForCausalLM` (released widths, 4 "
        "layers, random weights, bf16). After a P-token prefill per sequence (not timed), 32 greedy "
        "single-token forwards with the cache (shape `BxP+32`: batch x prompt + new tokens), median of 2-5 loops "
        "(the command column says). "
        "`time_per_token`: wall-clock ms per decode step (a token of every sequence); `gpu_time_per_token`: the "
        "summed GPU time of the step's kernels (torch.profiler, a separate loop); `kernels_per_step`: the kernels and "
        "memory operations it records per step; `host_time_per_token`: the median host time of one step started with "
        "the GPU idle (a third loop, synchronized before each step; rows from the runs that measured it): a step is "
        "host-bound when it nears the GPU time (an eager step synchronizes inside itself, so there it includes those "
        "waits). The host's speed varies between runs on these machines, and within one run (Kimi-Linear's "
        "`1x512+32` CUDA-graph row: host 1.044 and 0.519 ms per step in two earlier runs; in the CSV's run the "
        "`skip_decode_guards` row's 0.78 ms is above the plain row's 0.41 ms, while the same option toggled round by "
        "round in one process cut the host time from 354 to 227 us for Kimi-Linear and from 341 to 215 us for "
        "Qwen3-Next: docs/cuda-graphs.md, section 9). `kda_compile (cuda graphs; skip_decode_guards)`: the same with "
        "`Config(skip_decode_guards=True)`, warm decode steps running only Dynamo's differentiating guards. "
        "`hf_eager_fla`: HF eager with flash-linear-attention's kernels and "
        "HF's DynamicCache (Kimi-Linear, Qwen3-Next); `hf_eager`: HF eager and its DynamicCache (DeepSeek-V3.2, "
        "Llama, whose HF code binds no FLA kernels); `kda_compile (cuda graphs)`: `kda_compile.optimize(model.forward, "
        "mode=\"reduce-overhead\")` decoding into HF's `StaticCache`, each step one CUDA-graph replay "
        "([docs/cuda-graphs.md](../docs/cuda-graphs.md)); the routed experts of every MoE layer run as "
        "`kda_compile.ops.moe_experts` there ([docs/moe.md](../docs/moe.md)), four launches per layer at decode, and "
        "the short convolution of each linear-attention layer as `kda_compile.ops.causal_conv1d_update`, one launch "
        "(docs/cuda-graphs.md, section 8). The `1x8192+32` rows were measured before those two became single "
        "launches (199 and 215 kernels per step against 142 and 143 at `1x512+32` now). The rows of one command "
        "come from one process. "
        "HF eager is host-bound, and its wall time varies from machine to machine more than its GPU time does "
        "(DeepSeek-V3.2 at batch 1: 9.2 and 18.9 ms per token in two runs on H200 machines, 3.07 and 3.04 ms of GPU "
        "time): compare GPU times for the kernels, wall times for what a user waits.",
        command="python -m kda_compile.bench e2e --model kimi_linear --configs 'hf_eager_fla,kda_compile (cuda graphs)' "
        "--prompts 128 --decode-shapes 1x512,64x512 --decode-repeats 3 (--model qwen3_next likewise; --model llama with --configs 'hf_eager,kda_compile,kda_compile (cuda graphs)', "
        "--model deepseek_v32 with --configs 'hf_eager,kda_compile (cuda graphs)' and --decode-repeats 2, both "
        "without --prompts)",
        views=(View("time_per_token", ours=OURS_DECODE, baselines=("hf_eager_fla", "hf_eager")),
               View("gpu_time_per_token", ours=OURS_DECODE[:2], baselines=("hf_eager_fla", "hf_eager")),
               View("kernels_per_step"),
               View("host_time_per_token", ours=OURS_DECODE[1:])),
    ),
    "cp": Benchmark(
        title="Context-parallel KDA prefill: one long sequence over several GPUs",
        measures="The forward of `chunk_kda` in inference mode on ONE sequence (B = 1, `cu_seqlens = [0, T]`) of "
        "T = 128k to 1M tokens, 16 heads, bf16 q / k / v / g, K = V = 128, the q / k L2 norm, the lower-bound gate "
        "(`lower_bound=-5`, `safe_gate=True`) and the beta sigmoid computed inside the op, an fp32 initial state "
        "and the final state returned. `ours (1 GPU)`: the plain op on the whole sequence on one GPU (no row where "
        "it runs out of memory). `ours (CP, N GPUs)`: `cp_context=build_cp_context(cu_seqlens, group)`, one "
        "process per GPU, each rank holding T / N tokens; the states crossing rank boundaries are exchanged with "
        "one all-gather over NCCL. `balanced`: rank 0 holds twice the tokens of each other rank (`slice_lengths`), "
        "since every other rank pays for the state it receives. `ours (CP, N GPUs, no state)` and `FLA (CP, N "
        "GPUs, no state)`: ours and fla-core 0.6's context-parallel `chunk_kda` without initial and final state "
        "(FLA refuses them with a context). A call's time: its ranks meet at a barrier, each times the call on the "
        "host until its GPU is done, and the call counts the slowest rank; median over the timed calls "
        "(`--reps`, default 10) after the warm-up calls (`--warmup`, default 2). The ratio `ours (1 GPU) / ours (CP, ...)` is the speedup of context parallelism (divide by N for "
        "the parallel efficiency). `--ops gdn` runs `chunk_gated_delta_rule` the same way (its scalar gate per "
        "head). Design: [docs/context-parallel.md](../docs/context-parallel.md).",
        command="python -m kda_compile.bench cp",
        views=(View("wall_time", ours=CP_PROVIDERS, baselines=CP_ONE, providers=CP_ONE + CP_PROVIDERS),)
        + tuple(View("wall_time", ours=(ours,), baselines=(fla,), providers=(fla, ours))
                for ours, fla in zip(_cp_names(", no state"), _cp_names(", no state", "FLA"))),
    ),
}

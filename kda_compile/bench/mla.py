"""MLA decode per layer: kda_compile's absorbed op against Hugging Face's expansion path.

One decode step of one MLA layer, from the query split and the latent cache (what the layer holds
after its cache update) to the per-head outputs, bf16, DeepSeek/Kimi widths (kv_lora_rank 512,
nope 128, rope 64, v 128), batch 1 / 8 / 64 x cache 1k / 4k / 16k x 32 / 64 / 128 heads.

Providers: ``kda_compile`` (``mla_attention``; the automatic choice takes the absorbed form and, on
an H100 with 64+ query rows, the wgmma kernel, else the Triton split-KV kernel; the Triton kernel is
also timed side by side, forced through ``KDA_COMPILE_MLA_DECODE_KERNEL=triton``), and Hugging
Face's own ``DeepseekV3Attention.expand_kv`` followed by its
eager or SDPA attention function, each eager and under ``torch.compile``. Metrics per shape: time
(``do_bench``, p20/p50/p80 ms); our GPU time replayed from a CUDA graph; latent bandwidth = latent
bytes read (B * T * 576 * 2) / our graph time, and its fraction of the measured device-to-device copy
bandwidth (a 1 GiB copy, bytes read + written), for the whole layer step and for the decode kernel alone
(its split merge included, the absorption matmuls not: the bandwidth target is the kernel's);
the speedup over the faster compiled HF path; our
relative error against HF's eager output. The target: at batch 64 and cache 4k, >= 70% of
copy bandwidth and >= 10x faster than HF's compiled expansion.

Extra modes: ``crossover`` times the two forms, forced, against query length (calibrates
``ops/mla/path_choice.py``); ``configs`` sweeps the decode kernel's tile configs at batch 64,
cache 4k. HF shapes whose expanded K/V would not fit in free memory are skipped (logged).
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import os

import torch

from kda_compile.bench.common import (cuda_graph_time, format_table, measure_copy_bandwidth, rel_error, row,
                                      time_quantiles)
from kda_compile.ops import envs

logger = logging.getLogger("kda_compile.bench.mla")

NOPE, ROPE, VALUE, LATENT = 128, 64, 128, 512
BATCHES, CACHES, HEADS = (1, 8, 64), (1024, 4096, 16384), (32, 64, 128)
QUICK = ((1, 64), (4096,), (32, 128))
TARGET = dict(batch=64, cache=4096, bandwidth_fraction=0.70, speedup=10.0)
CROSSOVER_QUERIES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
KERNEL_CONFIGS = ((16, 64, 4, 2), (32, 32, 8, 2), (32, 64, 8, 2), (32, 64, 8, 3), (64, 32, 8, 2), (64, 64, 8, 2),
                  (32, 32, 4, 3), (32, 32, 8, 4), (16, 32, 4, 4), (64, 32, 8, 3), (32, 16, 4, 4))
SPLIT_COUNTS = (None, 2, 4, 8, 16, 32)  # None: the launcher's choice


def add_arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true", help="batch 1/64, cache 4k, 32/128 heads only")
    parser.add_argument("--modes", default="decode", help="comma-separated subset of decode,crossover,configs")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile'd HF providers")
    parser.add_argument("--heads", default=None,
                        help="comma-separated head counts (overrides the default / --quick set)")


# ----------------------------------------------------------------------------------------------
# Inputs and providers.
# ----------------------------------------------------------------------------------------------
def _hf_layer(heads: int, device="cuda"):
    """A DeepseekV3Attention (bf16) with the real MLA widths and DeepSeek-V3's YaRN scaling (scale
    0.1352); small hidden size (only kv_b_proj, expand_kv and scaling are used)."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    config = DeepseekV3Config(
        hidden_size=512, num_attention_heads=heads, num_key_value_heads=heads, q_lora_rank=256,
        kv_lora_rank=LATENT, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=VALUE,
        rope_parameters={"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                         "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0},
        max_position_embeddings=163840,
    )
    layer = DeepseekV3Attention(config, layer_idx=0).to(device=device, dtype=torch.bfloat16).eval()
    torch.nn.init.normal_(layer.kv_b_proj.weight, std=LATENT ** -0.5)
    return layer


def _decode_inputs(batch: int, cache: int, heads: int, queries: int = 1, device="cuda"):
    """HF's tensors at a decode step: query [B, H, Sq, 192] (a transposed view), latent caches
    [B, 1, T, 512] / [B, 1, T, 64]."""
    make = lambda *s: torch.randn(*s, device=device, dtype=torch.bfloat16)  # noqa: E731
    query = make(batch, queries, heads, NOPE + ROPE).transpose(1, 2)
    return query, make(batch, 1, cache, LATENT), make(batch, 1, cache, ROPE)


def _hf_step(layer, attention_fn):
    def step(query, kv_nope, k_rot):
        key, value = layer.expand_kv(kv_nope, k_rot)
        out, _ = attention_fn(layer, query, key, value, None, dropout=0.0, scaling=layer.scaling)
        return out  # [B, Sq, H, Dv]
    return step


def _providers(layer, compile_hf: bool, causal: bool = False):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import eager_attention_forward

    from kda_compile.ops.mla import mla_attention

    def ours(query, kv_nope, k_rot, path="auto"):
        out = mla_attention(query[..., :NOPE], query[..., NOPE:], kv_nope, k_rot, layer.kv_b_proj.weight,
                            scale=layer.scaling, is_causal=causal, path=path)
        return out.transpose(1, 2)

    providers = {"kda_compile": ours, "hf_eager": _hf_step(layer, eager_attention_forward),
                 "hf_sdpa": _hf_step(layer, sdpa_attention_forward)}
    if compile_hf:
        providers["hf_eager_compiled"] = torch.compile(_hf_step(layer, eager_attention_forward))
        providers["hf_sdpa_compiled"] = torch.compile(_hf_step(layer, sdpa_attention_forward))
    return providers


@contextlib.contextmanager
def _decode_kernel(name: str):
    """Force the absorbed-decode kernel (``KDA_COMPILE_MLA_DECODE_KERNEL``) for the block."""
    old = os.environ.get(envs.MLA_DECODE_KERNEL)
    os.environ[envs.MLA_DECODE_KERNEL] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(envs.MLA_DECODE_KERNEL)
        else:
            os.environ[envs.MLA_DECODE_KERNEL] = old


def _kernel_inputs(layer, query, kv_nope, k_rot):
    """The decode kernel's own inputs for one step: the absorbed query (as the op builds it) and the caches."""
    from kda_compile.ops.mla.reference import split_kv_b_weight

    b, h, sq, _ = query.shape
    w_uk, _ = split_kv_b_weight(layer.kv_b_proj.weight, h, NOPE)
    q_lat = torch.bmm(query[..., :NOPE].permute(1, 0, 2, 3).reshape(h, b * sq, NOPE), w_uk)
    return (q_lat.view(h, b, sq, LATENT).permute(1, 0, 2, 3), query[..., NOPE:], kv_nope[:, 0], k_rot[:, 0],
            layer.scaling)


def _decode_kernel_only(q_lat, q_rope, latent, k_rope, scale):
    from kda_compile.ops.mla.decode.kernels import mla_decode

    return mla_decode(q_lat, q_rope, latent, k_rope, None, scale, False)


def _chosen_kernel(q_lat, q_rope, latent, k_rope) -> str:
    """The decode kernel the automatic choice runs on these kernel inputs."""
    from kda_compile.ops.mla.decode.kernels import choose_decode_kernel

    return choose_decode_kernel(q_lat, q_rope, latent, k_rope)[0]


def _hf_fits(batch: int, cache: int, heads: int) -> bool:
    """HF's expansion holds kv_b_proj's output, the assembled keys, fp32 scores: bf16 bytes per
    (token, head) about 2 * (256 + 192 + 128), times 1.5 for the allocator's slack."""
    need = 1.5 * batch * cache * heads * 2 * (256 + 192 + 128)
    free, _ = torch.cuda.mem_get_info()
    return need < 0.8 * free


# ----------------------------------------------------------------------------------------------
# Modes.
# ----------------------------------------------------------------------------------------------
def _bench_decode(shapes, compile_hf, copy_bw, rows, table, verdicts):
    for heads in sorted({h for _, _, h in shapes}):
        layer = _hf_layer(heads)
        providers = _providers(layer, compile_hf)
        for batch, cache, h in [s for s in shapes if s[2] == heads]:
            shape = f"{batch}x{cache}x{h}"
            inputs = _decode_inputs(batch, cache, heads)
            times, outputs = {}, {}
            with torch.inference_mode():
                for name, fn in providers.items():
                    if name != "kda_compile" and not _hf_fits(batch, cache, heads):
                        logger.info("%s %s: skipped, the expanded K/V would not fit in free memory", name, shape)
                        continue
                    try:
                        outputs[name] = fn(*inputs)
                        times[name] = time_quantiles(lambda fn=fn: fn(*inputs))
                    except torch.cuda.OutOfMemoryError:
                        logger.info("%s %s: skipped, out of memory", name, shape)
                        outputs.pop(name, None)
                        continue
                    finally:
                        torch.cuda.empty_cache()
                    rows.append(row("mla_decode", name, "decode", shape, "time", "ms", times[name]))
                gpu = cuda_graph_time(lambda: providers["kda_compile"](*inputs))
                with _decode_kernel("triton"):  # the Triton kernel side by side (the choice may be wgmma)
                    gpu_triton = cuda_graph_time(lambda: providers["kda_compile"](*inputs))
                kernel_args = _kernel_inputs(layer, *inputs)
                gpu_kernel = cuda_graph_time(lambda: _decode_kernel_only(*kernel_args))
            kernel = _chosen_kernel(*kernel_args[:4])
            rows.append(row("mla_decode", f"kda_compile_{kernel}_kernel_only", "decode", shape, "gpu_time_cuda_graph",
                            "ms", gpu_kernel))
            rows.append(row("mla_decode", "kda_compile", "decode", shape, "gpu_time_cuda_graph", "ms", gpu))
            rows.append(row("mla_decode", "kda_compile_triton_kernel", "decode", shape, "gpu_time_cuda_graph", "ms",
                            gpu_triton))
            latent_bytes = batch * cache * (LATENT + ROPE) * 2
            bw = tuple(latent_bytes / (t * 1e-3) / 1e12 for t in reversed(gpu))
            rows.append(row("mla_decode", "kda_compile", "decode", shape, "latent_bandwidth", "TB/s", bw))
            frac = bw[1] / copy_bw[1]
            rows.append(row("mla_decode", "kda_compile", "decode", shape, "fraction_of_copy_bandwidth", "1",
                            (frac, frac, frac)))
            kernel_frac = latent_bytes / (gpu_kernel[1] * 1e-3) / 1e12 / copy_bw[1]
            rows.append(row("mla_decode", f"kda_compile_{kernel}_kernel_only", "decode", shape,
                            "fraction_of_copy_bandwidth", "1", (kernel_frac,) * 3))
            compiled = [times[n][1] for n in ("hf_eager_compiled", "hf_sdpa_compiled") if n in times]
            speedup = min(compiled) / times["kda_compile"][1] if compiled else float("nan")
            if compiled:
                rows.append(row("mla_decode", "kda_compile", "decode", shape, "speedup_vs_hf_compiled", "x",
                                (speedup, speedup, speedup)))
            err = rel_error(outputs["kda_compile"], outputs["hf_eager"]) if "hf_eager" in outputs else float("nan")
            if "hf_eager" in outputs:
                rows.append(row("mla_decode", "kda_compile", "decode", shape, "rel_err_vs_hf_eager", "1",
                                (err, err, err)))
            cell = lambda n: times[n][1] if n in times else "skipped"  # noqa: E731
            table.append([shape, kernel, cell("kda_compile"), gpu[1], gpu_triton[1], gpu_triton[1] / gpu[1],
                          gpu_kernel[1], 100 * kernel_frac, cell("hf_eager"), cell("hf_sdpa"),
                          cell("hf_eager_compiled"), cell("hf_sdpa_compiled"), speedup, bw[1], 100 * frac,
                          f"{err:.1e}"])
            if batch == TARGET["batch"] and cache == TARGET["cache"]:
                ok = kernel_frac >= TARGET["bandwidth_fraction"] and speedup >= TARGET["speedup"]
                verdicts.append(f"{shape}: the {kernel} kernel reads the latent at {100 * kernel_frac:.0f}% of copy "
                                f"bandwidth (target >= {100 * TARGET['bandwidth_fraction']:.0f}%; the whole layer "
                                f"step with its absorption matmuls: {100 * frac:.0f}%), {speedup:.1f}x vs HF compiled "
                                f"(target >= {TARGET['speedup']:.0f}x): {'MET' if ok else 'NOT MET'}")
            torch.cuda.empty_cache()
        torch._dynamo.reset()  # drop the compiled HF graphs of this head count


def _bench_crossover(heads_list, rows, table):
    from kda_compile.ops.mla import explain_mla_path

    cache = 4096
    for heads in heads_list:
        layer = _hf_layer(heads)
        ours = _providers(layer, compile_hf=False, causal=True)["kda_compile"]
        for batch in (1, 8):
            for queries in CROSSOVER_QUERIES:
                shape = f"{batch}x{cache}x{heads}xSq{queries}"
                inputs = _decode_inputs(batch, cache, heads, queries)
                t = {}
                with torch.inference_mode():
                    for path in ("absorbed", "expanded"):
                        t[path] = time_quantiles(lambda path=path: ours(*inputs, path=path))
                        rows.append(row("mla_forms", path, "forced", shape, "time", "ms", t[path]))
                q = inputs[0]
                rule = explain_mla_path(q[..., :NOPE], q[..., NOPE:], inputs[1], inputs[2], layer.kv_b_proj.weight,
                                        is_causal=True)[0]
                faster = "absorbed" if t["absorbed"][1] <= t["expanded"][1] else "expanded"
                table.append([shape, t["absorbed"][1], t["expanded"][1], faster, rule,
                              "ok" if rule == faster else "MISMATCH"])
        torch.cuda.empty_cache()


def _bench_configs(heads_list, copy_bw, rows, table):
    from kda_compile.ops.mla.decode.triton_decode import DecodeConfig, mla_decode_attention

    batch, cache = TARGET["batch"], TARGET["cache"]
    latent_bytes = batch * cache * (LATENT + ROPE) * 2
    for heads in heads_list:
        make = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16)  # noqa: E731
        q_lat, q_rope = make(batch, heads, 1, LATENT), make(batch, heads, 1, ROPE)
        latent, k_rope = make(batch, cache, LATENT), make(batch, cache, ROPE)
        for cfg, splits in itertools.product([None, *(DecodeConfig(*c) for c in KERNEL_CONFIGS)], SPLIT_COUNTS):
            name = "default" if cfg is None else f"m{cfg.block_m}_n{cfg.block_n}_w{cfg.num_warps}_s{cfg.num_stages}"
            name += "" if splits is None else f"_split{splits}"
            try:
                fn = lambda cfg=cfg, splits=splits: mla_decode_attention(  # noqa: E731
                    q_lat, q_rope, latent, k_rope, None, 0.1, False, config=cfg, num_splits=splits)
                gpu = cuda_graph_time(fn)
            except Exception as exc:  # a config may exceed shared memory or registers on this GPU
                logger.info("config %s at H=%d failed: %s", name, heads, exc)
                continue
            shape = f"{batch}x{cache}x{heads}"
            bw = latent_bytes / (gpu[1] * 1e-3) / 1e12
            rows.append(row("mla_decode_kernel", name, "decode", shape, "gpu_time_cuda_graph", "ms", gpu))
            table.append([shape, name, gpu[1], bw, 100 * bw / copy_bw[1]])


def run(args) -> list[dict]:
    if not torch.cuda.is_available():
        raise SystemExit("the MLA benchmark needs a CUDA device")
    torch.manual_seed(0)
    modes = args.modes.split(",")
    batches, caches, heads = QUICK if args.quick else (BATCHES, CACHES, HEADS)
    if args.heads:
        heads = tuple(int(h) for h in args.heads.split(","))
    rows = []
    copy_bw = measure_copy_bandwidth()
    rows.append(row("copy", "torch", "d2d", "1GiB", "copy_bandwidth", "TB/s", copy_bw))
    print(f"\nmeasured device-to-device copy bandwidth: {copy_bw[1]:.2f} TB/s (read + write)")
    if "decode" in modes:
        table, verdicts = [], []
        shapes = [(b, t, h) for h in heads for b in batches for t in caches]
        _bench_decode(shapes, not args.no_compile, copy_bw, rows, table, verdicts)
        print("\nMLA decode per layer, bf16, R 512 / nope 128 / rope 64 / v 128 (median ms)")
        print(format_table(["B x T x H", "kernel", "ours", "ours (graph)", "Triton kernel (graph)",
                            "Triton / ours", "kernel only (graph)", "% copy BW (kernel)", "HF eager", "HF sdpa",
                            "HF eager+compile",
                            "HF sdpa+compile", "speedup vs HF compiled", "latent TB/s", "% copy BW",
                            "rel err vs HF"], table))
        for line in verdicts:
            print("target", line)
    if "crossover" in modes:
        table = []
        _bench_crossover(heads, rows, table)
        print("\nabsorbed vs expanded form, causal, cache 4096 (median ms): does the rule pick the faster?")
        print(format_table(["B x T x H x Sq", "absorbed", "expanded", "faster", "rule picks", ""], table))
    if "configs" in modes:
        table = []
        _bench_configs(heads, copy_bw, rows, table)
        print(f"\ndecode kernel tile configs at batch {TARGET['batch']}, cache {TARGET['cache']} (CUDA-graph ms)")
        print(format_table(["B x T x H", "config", "ms", "latent TB/s", "% copy BW"], table))
    return rows

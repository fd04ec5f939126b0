"""DeepSeek Sparse Attention per layer: our indexer + top-k and sparse attention ops against dense torch.

Widths: ``deepseek_v32`` (128 heads, latent 512 + rope 64 = d_qk 576, d_v 512 in the absorbed MQA form;
indexer 64 heads x 128; top-k 2048), ``glm5`` (GLM-MoE-DSA-like: 64 heads, the same latent widths, indexer
32 heads x 128, top-k 2048) and ``glm5_next`` (its pooled indexer: 32 heads x 128 over pools of 16 keys, top-k
2048 tokens = 128 pools plus the 15-slot visible tail; attention 64 heads over latent 512, no rope; its keys,
gates and key flags are views of one ``[B, T, 2D + 1]`` tensor, as HF's cache holds them, passed with HF's options
as the rewritten model passes them). Shapes:
prefill of one sequence of 4k / 16k / 32k / 64k tokens (causal) and decode (one query) at batch 1 / 64 against
8k / 32k cached tokens; bf16 inputs, fp32 indexer weights.

Providers: ``ours`` (``kda_compile.ops.dsa_indexer_topk`` / ``dsa_pooled_indexer_topk`` /
``dsa_sparse_attention``) and ``dense torch``: the indexer as Hugging Face computes it (the [B, S, H_I, T] fp32
logits, ReLU, weighted head sum, masked top-k; glm5_next: the [B, S, H_I, T / 16] pool logits, top-k over the
pools a query has passed, expanded to tokens) and the attention as SDPA over the whole cache with a dense
[B, 1, S, T] mask made from the indices (scores materialised where SDPA has no fused kernel for d_qk 576); a
dense shape whose temporaries would not fit in free memory is reported as ``OOM`` instead of run. Ops:
``dsa_indexer`` (glm5_next: ``dsa_pooled_indexer``) and ``dsa_sparse_attention`` (mode ``fwd``; ``fwd+bwd``
with ``--modes fwd,fwd+bwd``: the attention's gradients of q and kv).

Metrics per (op, provider, mode, shape): ``time`` (GPU time, triton's do_bench), ``wall_time`` (one call as
its caller waits, host included, L2 flushed), for decode on CUDA ``gpu_time_cuda_graph`` (one call replayed from a
CUDA graph, as a serving engine runs decode: no host time; also for ``dsa_decode_layer``, the indexer and the
attention of one layer together), ``tflops`` (FlashMLA's convention for the attention,
2 * B * s_q * topk * heads * (d_qk + d_v), forward only; the indexer's QK FLOPs 2 * H_I * D per visible
(query, key) pair, or (query, complete pool) pair for the pooled indexer), ``peak_memory`` (MiB allocated
above the inputs during one call).

``--modes configs`` sweeps the sparse attention kernel's tile configs (deepseek_v32 widths, 4k prefill).
``--smoke`` runs tiny shapes (token-level and pooled) on the CPU (the reference path) to check the command end to end.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kda_compile.bench.common import cuda_graph_time, format_table, row, time_quantiles, wall_time_quantiles

logger = logging.getLogger("kda_compile.bench.dsa")


@dataclass(frozen=True)
class Widths:
    heads: int
    latent: int
    rope: int
    indexer_heads: int
    indexer_dim: int
    topk: int
    pool: int = 0  # > 0: glm5_next's pooled indexer over pools of this many keys (0: the token-level indexer)


MODELS = {
    "deepseek_v32": Widths(heads=128, latent=512, rope=64, indexer_heads=64, indexer_dim=128, topk=2048),
    "glm5": Widths(heads=64, latent=512, rope=64, indexer_heads=32, indexer_dim=128, topk=2048),
    "glm5_next": Widths(heads=64, latent=512, rope=0, indexer_heads=32, indexer_dim=128, topk=2048, pool=16),
}
SMOKE = Widths(heads=4, latent=16, rope=8, indexer_heads=2, indexer_dim=8, topk=6)
SMOKE_POOLED = Widths(heads=4, latent=16, rope=0, indexer_heads=2, indexer_dim=8, topk=8, pool=4)


@dataclass(frozen=True)
class Case:
    batch: int
    queries: int
    keys: int

    @property
    def name(self) -> str:
        kind = "decode" if self.queries == 1 else "prefill"
        return f"{kind}:{self.batch}x{self.queries}x{self.keys}"


PREFILL = tuple(Case(1, n, n) for n in (4096, 16384, 32768, 65536))
DECODE = tuple(Case(b, 1, t) for b in (1, 64) for t in (8192, 32768))


def add_arguments(parser) -> None:
    parser.add_argument("--models", default="deepseek_v32,glm5,glm5_next",
                        help="comma-separated subset of " + ",".join(MODELS))
    parser.add_argument("--cases", default="prefill,decode", help="comma-separated subset of prefill,decode")
    parser.add_argument("--max-prefill", type=int, default=65536, help="longest prefill to run (default: %(default)s)")
    parser.add_argument("--modes", default="fwd", help="comma-separated subset of fwd,fwd+bwd,configs")
    parser.add_argument("--no-dense", action="store_true", help="skip the dense torch baseline")
    parser.add_argument("--smoke", action="store_true", help="one tiny shape on the CPU (checks the command)")


# ----------------------------------------------------------------------------------------------
# Inputs, FLOPs, the dense baseline
# ----------------------------------------------------------------------------------------------
def make_inputs(w: Widths, case: Case, device, dtype=torch.bfloat16, seed: int = 0):
    """(q_index [B, S, H_I, D], k_index [B, T, D], weights [B, S, H_I] fp32, q [B, S, H, 576], kv [B, T, 1, 576])."""
    gen = torch.Generator(device=device).manual_seed(seed)
    b, s, t = case.batch, case.queries, case.keys
    d_qk = w.latent + w.rope

    def make(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dt)

    weights = make(b, s, w.indexer_heads, dt=torch.float32) * w.indexer_heads ** -0.5
    return (make(b, s, w.indexer_heads, w.indexer_dim), make(b, t, w.indexer_dim), weights,
            make(b, s, w.heads, d_qk), make(b, t, 1, d_qk))


def pooled_inputs(w: Widths, case: Case, k_index, seed: int = 1):
    """(k, gate, flags, ape): the pooled indexer's keys, gate scores and key flags as views of one
    ``[B, T, 2D + 1]`` tensor, laid out as HF's glm5_next cache keeps them (``cat([k, gate, valid])``: rows of 514
    bytes at D = 128, no 16-byte aligned row starts), every key valid; and the per-position bias ``ape`` [P, D]
    fp32."""
    device, dtype = k_index.device, k_index.dtype
    gen = torch.Generator(device=device).manual_seed(seed)
    gate = torch.randn(case.batch, case.keys, w.indexer_dim, generator=gen, device=device).to(dtype)
    flags = torch.ones(case.batch, case.keys, 1, device=device, dtype=dtype)
    rows = torch.cat([k_index, gate, flags], dim=-1)
    d = w.indexer_dim
    return rows[..., :d], rows[..., d:2 * d], rows[..., 2 * d], torch.randn(w.pool, d, generator=gen, device=device)


def visible_pairs(case: Case, pool: int = 1) -> int:
    """(query, key) pairs the causal indexer scores: query i sees min(i + T - S + 1, T) keys; with ``pool`` > 1,
    (query, complete pool) pairs."""
    s, t = case.queries, case.keys
    offset = t - s
    return case.batch * sum(min(i + offset + 1, t) // pool for i in range(s))


def attention_flops(w: Widths, case: Case) -> float:
    return 2.0 * case.batch * case.queries * w.topk * w.heads * (w.latent + w.rope + w.latent)


def indexer_flops(w: Widths, case: Case) -> float:
    return 2.0 * visible_pairs(case, max(1, w.pool)) * w.indexer_heads * w.indexer_dim


def dense_indexer(q_index, k_index, weights, topk: int, scale: float):
    """Hugging Face's way: the [B, S, H_I, T] fp32 logits, ReLU, weighted head sum, causal mask, top-k."""
    s, t = q_index.shape[1], k_index.shape[1]
    logits = torch.einsum("bshd,btd->bsht", q_index.float(), k_index.float()) * scale
    scores = (logits.relu() * weights[..., None]).sum(2)
    causal = torch.arange(t, device=scores.device)[None, :] <= torch.arange(s, device=scores.device)[:, None] + t - s
    scores = scores.masked_fill(~causal, float("-inf"))
    return torch.topk(scores, min(topk, t), dim=-1).indices.to(torch.int32)


def dense_pooled_indexer(q_index, k_index, weights, gate, ape, topk: int, scale: float):
    """Hugging Face's way for glm5_next (no padding): the [B, S, H_I, T / P] fp32 pool logits, ReLU, weighted
    head sum, the pools a query has not passed masked, top-k over pools, expanded to their tokens."""
    from kda_compile.ops.dsa.pooled.reference import pooled_keys

    b, s, t = q_index.shape[0], q_index.shape[1], k_index.shape[1]
    pool = ape.shape[0]
    valid = torch.ones(b, t, dtype=torch.bool, device=q_index.device)
    pk, pool_valid = pooled_keys(k_index, gate, valid, ape, valid.new_zeros(b, dtype=torch.long))
    logits = torch.einsum("bshd,bpd->bshp", q_index.float(), pk.float()) * scale
    scores = (logits.relu() * weights[..., None]).sum(2)
    last = torch.arange(pk.shape[1], device=scores.device) * pool + pool - 1
    seen = (last[None, :] <= torch.arange(s, device=scores.device)[:, None] + t - s) & pool_valid[:, None]
    scores = scores.masked_fill(~seen, float("-inf"))
    chosen = torch.topk(scores, min(topk // pool, scores.shape[-1]), dim=-1).indices
    tokens = chosen[..., None] * pool + torch.arange(pool, device=scores.device)
    return tokens.flatten(-2).to(torch.int32)


def dense_attention(q, kv, indices, d_v: int, scale: float):
    """SDPA over every cached key with a dense [B, 1, S, T] mask of the selected ones (absorbed MQA form)."""
    b, s, h, _ = q.shape
    t = kv.shape[1]
    mask = torch.zeros(b, s, t, dtype=torch.bool, device=q.device)
    mask.scatter_(2, indices.clamp_min(0).long(), indices >= 0)
    key = kv.transpose(1, 2).expand(b, h, t, kv.shape[-1])
    return torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), key, key[..., :d_v],
                                                            attn_mask=mask[:, None], scale=scale)


def dense_bytes(w: Widths, case: Case, op: str) -> int:
    """Temporaries of the dense baseline (what decides OOM): the fp32 logits for the indexer; the mask and
    the materialised scores (fp32, plus the bf16 probabilities) for the attention."""
    b, s, t = case.batch, case.queries, case.keys
    if op == "dsa_indexer":
        return b * s * t * (w.indexer_heads * 4 * 2 + 12)
    if op == "dsa_pooled_indexer":
        return b * s * (t // w.pool) * (w.indexer_heads * 4 * 2 + 12)
    return b * s * t * (1 + w.heads * 10)


# ----------------------------------------------------------------------------------------------
# Measuring
# ----------------------------------------------------------------------------------------------
def _peak_mib(fn, device) -> float:
    if device.type != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def _measure(fn, device, smoke: bool):
    """(time, wall_time) quantiles in ms, and the peak memory in MiB."""
    if smoke:
        import time

        start = time.perf_counter()
        fn()
        ms = (time.perf_counter() - start) * 1e3
        return (ms, ms, ms), (ms, ms, ms), float("nan")
    return time_quantiles(fn), wall_time_quantiles(fn), _peak_mib(fn, device)


def _bench_one(rows, table, model: str, w: Widths, case: Case, op: str, provider: str, mode: str, fn, flops,
               device, smoke):
    shape = f"{model}:{case.name}"
    try:
        t, wall, peak = _measure(fn, device, smoke)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        logger.info("%s %s %s: out of memory", op, provider, shape)
        table.append([shape, op, provider, mode, "OOM", "", "", ""])
        return
    rows.append(row(op, provider, mode, shape, "time", "ms", t))
    rows.append(row(op, provider, mode, shape, "wall_time", "ms", wall))
    rows.append(row(op, provider, mode, shape, "peak_memory", "MiB", (peak,) * 3))
    tflops = flops / (t[1] * 1e-3) / 1e12 if flops else float("nan")
    if flops:
        rates = tuple(flops / (x * 1e-3) / 1e12 for x in t[::-1])
        rows.append(row(op, provider, mode, shape, "tflops", "TFLOP/s", rates))
    table.append([shape, op, provider, mode, t[1], wall[1], tflops, peak])


def _bench_decode_graphs(rows, table, model, case, index_op, indexer, q, kv, scale, d_v):
    """Decode as a server runs it, replayed from a CUDA graph (no host time): the indexer, the attention over
    the indices the captured indexer writes, and the layer's two ops together (``dsa_decode_layer``)."""
    from kda_compile.ops import dsa_sparse_attention

    shape = f"{model}:{case.name}"

    def layer():
        return dsa_sparse_attention(q, kv, None, indexer(), scale, d_v=d_v)

    idx = indexer()
    steps = ((index_op, indexer), ("dsa_sparse_attention", lambda: dsa_sparse_attention(q, kv, None, idx, scale,
                                                                                         d_v=d_v)),
             ("dsa_decode_layer", layer))
    for op, fn in steps:
        graph = cuda_graph_time(fn)
        rows.append(row(op, "ours", "fwd", shape, "gpu_time_cuda_graph", "ms", graph))
        table.append([shape, op, "ours (CUDA graph)", "fwd", graph[1], "", "", ""])


def _oom_row(rows, table, model, case, op, mode, why):
    shape = f"{model}:{case.name}"
    rows.append(row(op, "dense torch", mode, shape, "time", "ms", (float("nan"),) * 3))
    table.append([shape, op, "dense torch", mode, "OOM", "", "", why])


def bench_case(model: str, w: Widths, case: Case, modes, dense: bool, device, smoke: bool, rows, table):
    from kda_compile.ops import dsa_indexer_topk, dsa_pooled_indexer_topk, dsa_sparse_attention

    dtype = torch.float32 if smoke else torch.bfloat16
    qi, ki, weights, q, kv = make_inputs(w, case, device, dtype)
    iscale, scale = w.indexer_dim ** -0.5, (w.latent + w.rope) ** -0.5 * 1.3
    if w.pool:
        ki, gate, flags, ape = pooled_inputs(w, case, ki)
        queries = torch.ones(case.batch, case.queries, dtype=torch.bool, device=device)
        index_op = "dsa_pooled_indexer"

        def indexer():  # what the rewritten model passes: the cache's views (its flags too) and HF's options
            return dsa_pooled_indexer_topk(qi, ki, weights, gate, ape, w.topk, scale=iscale, key_valid=flags,
                                           query_mask=queries, q_offset=case.keys - case.queries, select_tail=True)

        dense_index = lambda: dense_pooled_indexer(qi, ki, weights, gate, ape, w.topk, iscale)  # noqa: E731
    else:
        index_op = "dsa_indexer"
        indexer = lambda: dsa_indexer_topk(qi, ki, weights, w.topk, scale=iscale)  # noqa: E731
        dense_index = lambda: dense_indexer(qi, ki, weights, w.topk, iscale)  # noqa: E731
    with torch.no_grad():
        idx = indexer()
        attend = lambda: dsa_sparse_attention(q, kv, None, idx, scale, d_v=w.latent)  # noqa: E731
        if "fwd" in modes:
            _bench_one(rows, table, model, w, case, index_op, "ours", "fwd", indexer, indexer_flops(w, case),
                       device, smoke)
            _bench_one(rows, table, model, w, case, "dsa_sparse_attention", "ours", "fwd", attend,
                       attention_flops(w, case), device, smoke)
            if case.queries == 1 and device.type == "cuda" and not smoke:
                _bench_decode_graphs(rows, table, model, case, index_op, indexer, q, kv, scale, w.latent)
    if "fwd+bwd" in modes:
        q.requires_grad_(True), kv.requires_grad_(True)

        def train_step():
            o, _ = dsa_sparse_attention(q, kv, None, idx, scale, d_v=w.latent)
            torch.autograd.grad(o, (q, kv), torch.ones_like(o))

        _bench_one(rows, table, model, w, case, "dsa_sparse_attention", "ours", "fwd+bwd", train_step, 0.0, device,
                   smoke)
        q.requires_grad_(False), kv.requires_grad_(False)
    if not dense or "fwd" not in modes:
        return
    free = torch.cuda.mem_get_info()[0] if device.type == "cuda" else 1 << 62
    with torch.no_grad():
        for op, fn, flops in (
                (index_op, dense_index, indexer_flops(w, case)),
                ("dsa_sparse_attention", lambda: dense_attention(q, kv, idx, w.latent, scale),
                 attention_flops(w, case))):
            need = dense_bytes(w, case, op)
            if need > 0.8 * free:
                _oom_row(rows, table, model, case, op, "fwd", f"needs ~{need / 2 ** 30:.0f} GiB")
                continue
            _bench_one(rows, table, model, w, case, op, "dense torch", "fwd", fn, flops, device, smoke)


CONFIGS = ((64, 32, 1, 8, 2), (64, 64, 1, 8, 2), (64, 32, 1, 8, 3), (64, 16, 1, 8, 3), (32, 32, 1, 8, 2),
           (32, 64, 1, 4, 2), (64, 32, 2, 8, 2), (128, 32, 2, 8, 2), (128, 16, 1, 8, 2))

BACKWARD_CONFIGS = ((32, 32, 8, 2), (64, 32, 8, 1), (16, 32, 4, 1), (32, 16, 8, 1), (64, 16, 8, 2), (32, 64, 8, 1))


def _bench_configs(rows):
    """The sparse attention forward kernel's tile configs at deepseek_v32 widths, 4k prefill, full selections."""
    from kda_compile.ops.dsa.sparse.triton_forward import SparseConfig, sparse_attention_fwd_triton

    w, case = MODELS["deepseek_v32"], Case(1, 4096, 4096)
    _, _, _, q, kv = make_inputs(w, case, "cuda")
    idx = torch.rand(1, case.queries, case.keys, device="cuda").argsort(-1)[..., :w.topk].to(torch.int32)
    table = []
    for cfg in (None, *(SparseConfig(*c) for c in CONFIGS)):
        name = "default" if cfg is None else "h{}_k{}_dv{}_w{}_s{}".format(*cfg.__dict__.values())
        try:
            t = time_quantiles(lambda cfg=cfg: sparse_attention_fwd_triton(q, kv, None, idx, 0.1, w.latent, config=cfg))
        except Exception as exc:  # a config may exceed shared memory or registers
            logger.info("config %s failed: %s", name, exc)
            continue
        rows.append(row("dsa_sparse_attention_kernel", name, "fwd", "deepseek_v32:prefill:1x4096x4096", "time", "ms",
                        t))
        table.append([name, t[1], attention_flops(w, case) / (t[1] * 1e-3) / 1e12])
    print("\nsparse attention forward kernel configs, deepseek_v32 widths, 4k prefill, top-k 2048")
    print(format_table(["config", "ms", "TFLOP/s"], table))
    from kda_compile.ops.dsa.sparse.triton_backward import sparse_attention_bwd_triton

    o, lse = sparse_attention_fwd_triton(q, kv, None, idx, 0.1, w.latent)
    grad = torch.randn_like(o)
    table = []
    for cfg in (None, *BACKWARD_CONFIGS):
        name = "default" if cfg is None else "h{}_k{}_w{}_s{}".format(*cfg)
        try:
            t = time_quantiles(lambda cfg=cfg: sparse_attention_bwd_triton(grad, None, q, kv, None, idx, o, lse, 0.1,
                                                                           w.latent, config=cfg))
        except Exception as exc:
            logger.info("backward config %s failed: %s", name, exc)
            continue
        rows.append(row("dsa_sparse_attention_kernel", name, "bwd", "deepseek_v32:prefill:1x4096x4096", "time", "ms",
                        t))
        table.append([name, t[1]])
    print("\nsparse attention backward kernel configs (same shape)")
    print(format_table(["config", "ms"], table))


def run(args) -> list[dict]:
    smoke = args.smoke
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("the DSA benchmark needs a CUDA device (or --smoke for a tiny CPU run)")
    device = torch.device("cpu" if smoke else "cuda")
    modes = args.modes.split(",")
    bad = [m for m in modes if m not in ("fwd", "fwd+bwd", "configs")]
    if bad:
        raise SystemExit(f"--modes must be a subset of fwd,fwd+bwd,configs, got {bad}")
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise SystemExit(f"--models must be a subset of {','.join(MODELS)}, got {unknown}")
    cases = []
    if "prefill" in args.cases:
        cases += [c for c in PREFILL if c.queries <= args.max_prefill]
    if "decode" in args.cases:
        cases += list(DECODE)
    rows, table = [], []
    smoke_plan = [(name, widths, case) for name, widths in (("smoke", SMOKE), ("smoke_pooled", SMOKE_POOLED))
                  for case in (Case(1, 12, 12), Case(2, 1, 20))]
    plan = smoke_plan if smoke else [(m, MODELS[m], c) for m in models for c in cases]
    for model, widths, case in plan:
        logger.info("%s %s", model, case.name)
        bench_case(model, widths, case, modes, not args.no_dense, device, smoke, rows, table)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if "configs" in modes and not smoke:
        _bench_configs(rows)
    print("\nDSA per layer (median ms; TFLOP/s by FlashMLA's convention for the attention, QK FLOPs for the indexer)")
    print(format_table(["model:case", "op", "provider", "mode", "time ms", "wall ms", "TFLOP/s", "peak MiB"], table))
    return rows

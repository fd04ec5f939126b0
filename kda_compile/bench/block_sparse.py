"""Block-sparse attention: kda_compile's ``block_sparse_attention`` against Hugging Face's dense-masked path, side
by side.

MiniMax-M3's widths (64 query heads in 4 KV groups of width 128, blocks of 128 keys, 16 selected per query and
group, the query's own block among them), bf16, a random selection in HF's indexer layout (visible blocks only,
left-packed, -1 after them). Shapes (``--shapes``): decode (one query per sequence over a 32k cache, batch 1 and
16), a chunk of 1024 queries over 16k keys, an 8k prefill. Providers: ``kda_compile`` (the op's forward),
``hf_sdpa`` (HF's own ``MiniMaxM3VLIndexer.build_block_mask`` then ``F.scaled_dot_product_attention`` over the
dense mask, what HF's SDPA mode runs) and ``hf_eager`` (the same mask, then HF's ``eager_attention_forward``).
Each call is replayed from a CUDA graph (no host time); HF's mask is built inside the call, as HF builds it per
layer. Rows: time (ms) and the relative error against the float32 reference (where its dense scores fit).
"""
from __future__ import annotations

import logging
import types

import torch

from kda_compile.bench.common import cuda_graph_time, format_table, named_choices, rel_error, row

logger = logging.getLogger("kda_compile.bench.block_sparse")

HEADS, GROUPS, HEAD_DIM, BLOCK_SIZE, TOP_BLOCKS = 64, 4, 128, 128, 16
SHAPES = {"decode-b1": (1, 1, 32768), "decode-b16": (16, 1, 32768), "chunk": (1, 1024, 16384),
          "prefill": (1, 8192, 8192)}  # (B, Sq, T)
PROVIDERS = ("kda_compile", "hf_sdpa", "hf_eager")
REFERENCE_ELEMENTS = 1 << 31  # the float32 reference's dense scores must stay under this


def add_arguments(parser) -> None:
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated shapes to measure")
    parser.add_argument("--providers", default=",".join(PROVIDERS), help="comma-separated providers")


def random_selection(batch: int, queries: int, keys: int, device) -> torch.Tensor:
    """int64 [B, G, Sq, TOP_BLOCKS] as HF's indexer lays it out: the best blocks of random scores among those a
    query sees, its own block first, -1 where fewer blocks are visible."""
    blocks = -(-keys // BLOCK_SIZE)
    own = (torch.arange(keys - queries, keys, device=device) // BLOCK_SIZE)[None, None, :, None]
    scores = torch.rand(batch, GROUPS, queries, blocks, device=device)
    scores = scores.masked_fill(torch.arange(blocks, device=device) > own, float("-inf"))
    scores.scatter_(-1, own.expand(batch, GROUPS, queries, 1), float("inf"))
    best, index = scores.topk(min(TOP_BLOCKS, blocks), dim=-1)
    return index.masked_fill(best == float("-inf"), -1)


def _providers(names):
    from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as hf

    from kda_compile.ops import block_sparse_attention

    indexer = types.SimpleNamespace(block_size=BLOCK_SIZE, config=types.SimpleNamespace(num_attention_heads=HEADS))
    module = types.SimpleNamespace(num_key_value_groups=HEADS // GROUPS, training=False)

    def hf_mask(q, k, idx):
        queries, keys = q.shape[2], k.shape[2]
        positions = torch.arange(keys - queries, keys, device=q.device).expand(q.shape[0], queries)
        return hf.MiniMaxM3VLIndexer.build_block_mask(indexer, idx, None, keys, q.dtype, q.device, positions)

    def sdpa(q, k, v, idx):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=hf_mask(q, k, idx),
                                                                enable_gqa=True)

    def eager(q, k, v, idx):
        return hf.eager_attention_forward(module, q, k, v, hf_mask(q, k, idx), scaling=HEAD_DIM ** -0.5)[0]

    table = {"kda_compile": lambda q, k, v, idx: block_sparse_attention(q, k, v, idx, block_size=BLOCK_SIZE),
             "hf_sdpa": sdpa, "hf_eager": lambda q, k, v, idx: eager(q, k, v, idx).transpose(1, 2)}
    return {n: table[n] for n in names}


def run(args) -> list[dict]:
    if not torch.cuda.is_available():
        raise SystemExit("the block_sparse benchmark needs a CUDA device")
    from kda_compile.ops.block_sparse.reference import block_sparse_attention_reference

    shapes = named_choices(args.shapes, tuple(SHAPES), "--shapes")
    providers = _providers(named_choices(args.providers, PROVIDERS, "--providers"))
    torch.manual_seed(0)
    rows, table = [], []
    for name in shapes:
        batch, queries, keys = SHAPES[name]
        q = torch.randn(batch, HEADS, queries, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch, GROUPS, keys, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        idx = random_selection(batch, queries, keys, q.device)
        reference = None
        if batch * HEADS * queries * keys <= REFERENCE_ELEMENTS:
            reference = block_sparse_attention_reference(q.float(), k.float(), v.float(), idx, BLOCK_SIZE,
                                                         HEAD_DIM ** -0.5)[0]
        shape = f"minimax_m3 {name} B={batch} Sq={queries} T={keys}"
        base, first = None, len(table)
        for provider, call in providers.items():
            fn = (lambda call=call: call(q, k, v, idx))
            try:
                err = rel_error(fn(), reference) if reference is not None else float("nan")
                times = cuda_graph_time(fn)
            except (RuntimeError, ValueError) as exc:  # out of memory, or a path that refuses the call
                logger.info("%s %s: skipped (%s)", provider, shape, str(exc).splitlines()[0][:160])
                continue
            rows.append(row("block_sparse_attention", provider, "inference", shape, "time", "ms", times))
            if reference is not None:
                rows.append(row("block_sparse_attention", provider, "inference", shape, "rel_err_vs_fp32", "1",
                                (err,) * 3))
            base = times[1] if provider == "hf_sdpa" else base
            table.append([shape, provider, times[1] * 1e3, "-" if reference is None else f"{err:.1e}"])
        for line in table[first:]:
            line.append("-" if base is None else f"{base / (line[2] / 1e3):.2f}x")
    print("\nBlock-sparse attention (MiniMax-M3 widths), bf16, CUDA-graph replay (median)")
    print(format_table(["shape", "provider", "us", "rel. err vs fp32", "vs hf_sdpa"], table))
    return rows

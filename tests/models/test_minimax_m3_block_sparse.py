"""MiniMax-M3's sparse attention layers rewritten into ``block_sparse_attention`` (passes/dsa/block_sparse.py) on a
tiny random model (fp32, CPU, aot_eager): layer 0 sparse (blocks of 4 keys, top-2 plus the local block), layer 1
full attention; hidden 64, 4 query heads in 2 KV groups, one block selection per group.

Checked, for HF's eager and SDPA attention, through ``kda_compile.optimize(model.forward, fullgraph=True)`` and a
DynamicCache: a prefill, a second prefill into the non-empty cache (chunked prefill) and a decode step each give
eager's logits within ``TOL`` (relative error, fp32); every graph holds one ``block_sparse_attention`` for the sparse
layer and no [B, H, Sq, T] tensor, and the rewrite left nothing alone (strict mode: it would raise). Greedy
``generate()`` on a left-padded batch of two prompts of different lengths gives eager's tokens and logits; so do
indexers with fewer selections than KV groups, or one per query head. A StaticCache's decode step is rewritten
(its one-query mask read as the keys it may see); its prefill, whose queries are not the last Sq of the cache's
slots, keeps HF's attention with the reason reported. A mask
the op cannot express (a 4-D mask passed in by the caller) keeps HF's dense-masked attention, with the reason in
``kda_compile.report()``, and still eager's logits. Once through ``torch.compile(model, backend="kda_compile")``
with Inductor (slow).
"""
from __future__ import annotations

import pytest
import torch

import kda_compile
from kda_compile import Config, optimize
from kda_compile.testing import rel_error

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.minimax_m3_vl")

from kda_compile.coverage.models import tiny_config  # noqa: E402

TOL = 1e-5  # fp32: the op's softmax over the selected keys against HF's over the dense mask
QUICK = Config(compiler="aot_eager", strict=True)
OP = "kda_compile.block_sparse_attention"
BLOCK, TOPK = 4, 2

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py


def build(attn: str, selections: int | None = None) -> torch.nn.Module:
    cfg = tiny_config("minimax_m3_vl_text")
    cfg.index_n_heads = selections or cfg.num_key_value_heads  # HF's contract: one selection per KV group
    cfg.index_block_size, cfg.index_topk_blocks, cfg.index_local_blocks = BLOCK, TOPK, 1
    cfg.layer_types = ["minimax_m3_sparse", "full_attention"]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32)
    return model.eval()


def ids(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 200, (batch, length), generator=torch.Generator().manual_seed(seed))


def dense_block_masks(gm: torch.fx.GraphModule, heads: int, queries: int, keys: int) -> list[str]:
    """Nodes holding a [B, H, Sq, T] tensor: H query heads (the indexer's own token scores have one head per KV
    group, not H), Sq queries, T keys."""
    found = []
    for node in gm.graph.nodes:
        value = node.meta.get("example_value")
        if isinstance(value, torch.Tensor) and value.dim() == 4 and tuple(value.shape[1:]) == (heads, queries, keys):
            found.append(node.format_node())
    return found


class Inspect:
    """A backend that runs kda_compile's passes, keeps each rewritten graph and its report, then aot_eager."""

    def __init__(self, config: Config) -> None:
        from kda_compile.passes import PassManager

        self.manager, self.graphs, self.reports = PassManager(config), [], []

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.registry import lookup_backend

        self.reports.append(self.manager.run(gm))
        self.graphs.append(gm)
        return lookup_backend("aot_eager")(gm, example_inputs)


def assert_rewritten(reports) -> None:
    assert reports
    for report in reports:
        ops = [r.op for r in report.rewritten if r.rewrite == "dsa_attention"]
        assert ops == [OP], report.format(verbose=True)
        assert not report.left_alone, report.format(verbose=True)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_prefill_chunked_prefill_and_decode_match_eager(attn):
    model = build(attn)
    fast = optimize(model.forward, QUICK, fullgraph=True)
    steps = [ids(2, 11, 1), ids(2, 6, 2), ids(2, 1, 3)]  # T = 11, 17, 18: 3 to 5 blocks of 4
    theirs, ours = transformers.DynamicCache(config=model.config), transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        for step, chunk in enumerate(steps):
            want = model(chunk, past_key_values=theirs, use_cache=True).logits
            have = fast(chunk, past_key_values=ours, use_cache=True).logits
            assert rel_error(have, want) < TOL, step
    assert_rewritten(kda_compile.report(fast).graphs)


def test_the_graph_holds_the_op_and_no_dense_block_mask():
    model = build("eager")
    inspect = Inspect(Config(compiler="aot_eager"))
    compiled = torch.compile(model.forward, backend=inspect, fullgraph=True)
    prompt = ids(2, 11, 4)
    mask = torch.ones_like(prompt)
    mask[1, :3] = 0
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        compiled(prompt, attention_mask=mask, past_key_values=cache, use_cache=True)
        compiled(ids(2, 1, 5), attention_mask=torch.cat([mask, mask[:, :1] * 0 + 1], 1), past_key_values=cache,
                 use_cache=True)
    assert_rewritten(inspect.reports)
    heads = model.config.num_attention_heads
    assert len(inspect.graphs) == 2
    for gm, (queries, keys) in zip(inspect.graphs, [(11, 11), (1, 12)]):
        targets = [str(getattr(n.target, "__name__", n.target)) for n in gm.graph.nodes]
        assert targets.count("block_sparse_attention") == 1, gm.code
        assert not dense_block_masks(gm, heads, queries, keys), dense_block_masks(gm, heads, queries, keys)
        assert "build_block_mask" not in "".join(n.meta.get("stack_trace") or "" for n in gm.graph.nodes)


def test_left_padded_batch_generates_eagers_tokens():
    model = build("eager")
    prompt = ids(2, 9, 6)
    mask = torch.ones_like(prompt)
    mask[0, :4] = 0  # rows of 5 and 9 tokens
    kwargs = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)
    expected = model.generate(prompt, **kwargs)
    fast = optimize(model.forward, QUICK, fullgraph=True)
    model.forward = fast
    try:
        got = model.generate(prompt, **kwargs)
    finally:
        del model.forward
    assert torch.equal(got.sequences, expected.sequences)
    for step, (have, want) in enumerate(zip(got.logits, expected.logits)):
        assert rel_error(have, want) < TOL, step
    assert_rewritten(kda_compile.report(fast).graphs)


@pytest.mark.parametrize("selections", [1, 4])  # fewer selections than the 2 KV groups, or one per query head
def test_selection_counts_other_than_the_kv_groups(selections):
    model = build("eager", selections)
    prompt = ids(2, 10, 8)
    mask = torch.ones_like(prompt)
    mask[1, :2] = 0
    fast = optimize(model.forward, QUICK, fullgraph=True)
    with torch.no_grad():
        want = model(prompt, attention_mask=mask).logits
        have = fast(prompt, attention_mask=mask).logits
    keep = mask.bool()  # a padded query sees no key: HF's full-attention layer averages, ours gives 0
    assert rel_error(have[keep], want[keep]) < TOL
    assert_rewritten(kda_compile.report(fast).graphs)


@pytest.mark.slow
def test_kda_compile_backend_with_inductor():
    model = build("eager")
    fast = torch.compile(model, backend="kda_compile", fullgraph=True)
    prompt = ids(2, 9, 11)
    mask = torch.ones_like(prompt)
    mask[0, :3] = 0
    with torch.no_grad():
        want, have = model(prompt, attention_mask=mask).logits, fast(prompt, attention_mask=mask).logits
    keep = mask.bool()
    assert rel_error(have[keep], want[keep]) < TOL
    assert_rewritten(kda_compile.report().graphs)


def test_a_static_cache_decode_step_is_rewritten_and_its_prefill_stays_dense():
    model = build("eager")
    fast = optimize(model.forward, Config(compiler="aot_eager"), fullgraph=True)
    theirs, ours = (transformers.StaticCache(config=model.config, max_cache_len=20) for _ in range(2))
    with torch.no_grad():
        for step, chunk in enumerate([ids(1, 9, 9), ids(1, 1, 10)]):
            want = model(chunk, past_key_values=theirs, use_cache=True).logits
            have = fast(chunk, past_key_values=ours, use_cache=True).logits
            assert rel_error(have, want) < TOL, step
    prefill, decode = kda_compile.report(fast).graphs
    # the prefill's queries sit at the cache position, not at T - Sq + i of the cache's 20 slots
    (kept,) = [c for c in prefill.left_alone if c.rewrite == "dsa_attention"]
    assert "block-sparse attention kept dense" in kept.reason and "causal diagonal" in kept.reason, kept.reason
    assert_rewritten([decode])  # one query: its [B, 1, 1, T] mask is the keys it may see


def test_a_mask_the_op_cannot_express_stays_dense_with_its_reason():
    model = build("eager")
    prompt = ids(1, 10, 7)
    # a caller's own 4-D mask (additive: 0 = attend): causal, but a graph input, so nothing proves it is
    allowed = torch.ones(10, 10).tril().bool()
    allowed[7, 2] = False
    custom = torch.zeros(1, 1, 10, 10).masked_fill(~allowed, torch.finfo(torch.float32).min)
    fast = optimize(model.forward, Config(compiler="aot_eager"), fullgraph=True)
    with torch.no_grad():
        want = model(prompt, attention_mask=custom).logits
        have = fast(prompt, attention_mask=custom).logits
    assert rel_error(have, want) < TOL
    (graph,) = kda_compile.report(fast).graphs
    assert OP not in [r.op for r in graph.rewritten]
    reasons = [c.reason for c in graph.left_alone if c.rewrite == "dsa_attention"]
    assert len(reasons) == 1 and "block-sparse attention kept dense" in reasons[0], graph.format(verbose=True)
    assert "is not one block_sparse_attention expresses" in reasons[0], reasons
    assert "block-sparse attention kept dense" in kda_compile.report(fast).format(verbose=True)

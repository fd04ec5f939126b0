"""The DSA rewrite (passes/dsa/attention.py) on tiny DeepSeek-V3.2 / GLM-MoE-DSA models, fp32, CPU, aot_eager.

Checked: the prefill logits match eager (relative error < 1e-4) with the indexer turned into
``dsa_indexer_topk`` and every attention over its top-k mask into ``dsa_sparse_attention`` (a shared
indexer layer reading the previous layer's selection included), for eager and SDPA attention; no tensor
with S x T elements is left in the rewritten graph (every example value walked; the traced graph had
them); a training step's gradients match; left padding reaches the indexer as its key mask; top-k >= T;
an attention left alone (dropout in training) keeps its indexer as written; ``Config(dsa_attention=False)``;
the block-sparse families reported; the rewrite runs before the attention and MLA rewrites. The absorbed
form (passes/dsa/absorb.py): its math against the expanded attention in fp64, and the expanded form kept,
with its reason, where the keys are not expand_kv's.
"""
from __future__ import annotations

import pytest
import torch
import torch.fx
from torch._dynamo.backends.registry import lookup_backend

from kda_compile.config import Config
from kda_compile.ops import dsa_indexer_topk, dsa_sparse_attention
from kda_compile.passes import PassManager
from kda_compile.passes.dsa.attention import DSAAttentionRewrite
from kda_compile.passes.rewrite import RewriteLog
from kda_compile.testing import rel_error

from .families import VOCAB, build_dsa_model

pytest.importorskip("transformers")

SEQ = 13  # prime and unlike every other size of the tiny models: a dim of 13 is a sequence dim
TOL = 1e-4


class KeepGraphs:
    """A backend keeping each rewritten graph (with its example values) and its report; runs aot_eager."""

    def __init__(self, config: Config | None = None) -> None:
        self.config = config or Config(compiler="aot_eager")
        self.graphs: list[torch.fx.GraphModule] = []
        self.seq_by_seq_before: list[int] = []
        self.reports = []

    def __call__(self, gm, example_inputs, **kwargs):
        self.seq_by_seq_before.append(len(seq_by_seq_tensors(gm)))
        self.reports.append(PassManager(self.config).run(gm, graph=str(len(self.reports))))
        self.graphs.append(gm)
        return lookup_backend("aot_eager")(gm, example_inputs)

    def calls(self, target, graph: int = -1) -> list[torch.fx.Node]:
        return [n for n in self.graphs[graph].graph.nodes if n.target is target]

    def entries(self, op: str, graph: int = -1) -> list:
        return [r for r in self.reports[graph].rewritten if r.op == op]


def seq_by_seq_tensors(gm: torch.fx.GraphModule) -> list[str]:
    """Nodes whose example value has two dims of the prompt length: an S x T tensor in a prefill graph."""
    found = []
    for node in gm.graph.nodes:
        value = node.meta.get("example_value")
        values = value if isinstance(value, (tuple, list)) else (value,)
        if any(isinstance(v, torch.Tensor) and list(v.shape).count(SEQ) >= 2 for v in values):
            found.append(node.format_node())
    return found


def prompt(batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def run(model, ids, cap, **kwargs):
    with torch.no_grad():
        return torch.compile(model, backend=cap, fullgraph=True)(ids, **kwargs).logits, model(ids, **kwargs).logits


@pytest.mark.parametrize("name,attn", [("deepseek_v32", "eager"), ("deepseek_v32", "sdpa"), ("glm_moe_dsa", "eager")])
def test_prefill_becomes_the_dsa_ops_with_no_seq_by_seq_tensor(name, attn):
    model = build_dsa_model(name, attn)
    cap = KeepGraphs()
    got, want = run(model, prompt(), cap)
    assert rel_error(got, want) < TOL
    assert len(cap.graphs) == 1
    report = cap.reports[0].summary()
    indexers = sum(m.indexer is not None for m in model.modules() if hasattr(m, "indexer"))
    assert len(cap.calls(dsa_indexer_topk)) == len(cap.entries("kda_compile.dsa_indexer_topk")) == indexers, report
    attentions = cap.entries("kda_compile.dsa_sparse_attention")
    assert len(cap.calls(dsa_sparse_attention)) == len(attentions) == 2, report
    assert {e.details["attention"] for e in attentions} == {"eager attention" if attn == "eager" else "sdpa"}
    assert [e.details["form"] for e in attentions] == ["absorbed"] * 2, report
    if name == "glm_moe_dsa":
        assert attentions[1].details["indices"] == "shared: model.layers.0.self_attn.indexer", report
    for entry in cap.entries("kda_compile.dsa_indexer_topk"):
        assert entry.details["is_causal"] is True and entry.details["key_mask"] == "none", report
        assert entry.details["topk"] == "6" and entry.details["heads"] == 8, report
    code = cap.graphs[0].code
    for gone in (".topk(", ".scatter(", "softmax(", "scaled_dot_product_attention("):
        assert gone not in code, (gone, code)
    assert cap.seq_by_seq_before[0] > 0  # the check below can fail
    assert seq_by_seq_tensors(cap.graphs[0]) == []


def test_training_step_gradients_match():
    """The sparse attention is differentiable (q, k, v); the indexer runs under HF's no_grad in both."""
    model = build_dsa_model("glm_moe_dsa").train()
    ids, cap = prompt(), KeepGraphs()
    torch.compile(model, backend=cap, fullgraph=True)(ids, labels=ids).loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model(ids, labels=ids).loss.backward()
    assert len(cap.calls(dsa_sparse_attention)) == 2 and any("kv_b_proj" in n for n in got)
    for n, p in model.named_parameters():
        assert (n in got) == (p.grad is not None), n
        if p.grad is not None and p.grad.norm() > 0:
            assert rel_error(got[n], p.grad) < TOL, n


def test_left_padding_reaches_the_indexer_as_its_key_mask():
    model = build_dsa_model("deepseek_v32")
    ids, mask = prompt(), torch.ones(2, SEQ, dtype=torch.long)
    mask[0, :4] = 0
    cap = KeepGraphs()
    got, want = run(model, ids, cap, attention_mask=mask)
    keep = mask.bool()  # padded queries attend to nothing here (0) and to everything in eager: unused rows
    assert rel_error(got[keep], want[keep]) < TOL
    entries = cap.entries("kda_compile.dsa_indexer_topk")
    assert entries and all(e.details["key_mask"] == "padding [B, T]" for e in entries), cap.reports[0].summary()
    key_masks = [c.kwargs["key_mask"] for c in cap.calls(dsa_indexer_topk)]
    assert all(k is not None and list(k.meta["example_value"].shape) == [2, SEQ] for k in key_masks)


def test_topk_at_least_the_number_of_keys():
    model = build_dsa_model("deepseek_v32", index_topk=64)
    cap = KeepGraphs()
    got, want = run(model, prompt(), cap)
    assert rel_error(got, want) < TOL
    assert [e.details["topk"] for e in cap.entries("kda_compile.dsa_indexer_topk")] == [str(SEQ)] * 2


def test_an_attention_left_alone_keeps_its_indexer():
    """Dropout in training is not the op's: the attention stays as written, so the indexer must too (our
    -1-padded indices cannot feed HF's scatter); the compiled model still runs."""
    model = build_dsa_model("deepseek_v32", attention_dropout=0.5).train()
    cap = KeepGraphs()
    with torch.no_grad():  # dropout is on (train mode); no backward graph to build
        out = torch.compile(model, backend=cap, fullgraph=True)(prompt()).logits
    assert torch.isfinite(out).all()
    assert not cap.calls(dsa_indexer_topk) and not cap.calls(dsa_sparse_attention)
    reasons = [c.reason for c in cap.reports[0].left_alone if c.rewrite == "dsa_attention"]
    assert sum("indexer kept with its attention" in r and "dropout_p=0.5" in r for r in reasons) == 2, reasons


def test_switched_off_leaves_the_model_code():
    model = build_dsa_model("glm_moe_dsa")
    cap = KeepGraphs(Config(compiler="aot_eager", dsa_attention=False))
    got, want = run(model, prompt(), cap)
    assert rel_error(got, want) < TOL
    assert not cap.calls(dsa_indexer_topk) and not cap.calls(dsa_sparse_attention)
    assert ".topk(" in cap.graphs[0].code and ".scatter(" in cap.graphs[0].code


def test_deepseek_v4_is_not_reported_as_block_sparse_dsa():
    """DeepSeek-V4's compressed layers are passes/dsa/compressed.py's (tests/models/test_deepseek_v4_compressed.py):
    this rewrite leaves its modules to it without a report."""
    modeling = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    gm = torch.fx.symbolic_trace(lambda x: x.sin() + 1)
    for node in gm.graph.nodes:
        node.meta["nn_module_stack"] = {"attn": ("L['self'].model.layers[0].self_attn", modeling.DeepseekV4Attention)}
    log = RewriteLog()
    assert DSAAttentionRewrite(Config()).apply(gm, log) == 0
    assert log.left_alone == [] and log.rewritten == []


def test_runs_before_the_rewrites_that_would_take_its_attention():
    from kda_compile.passes import REWRITES

    order = list(REWRITES)
    assert order.index("dsa_attention") < min(order.index(n) for n in ("softmax_attention", "sdpa_attention",
                                                                         "mla_absorb"))


@pytest.mark.parametrize("heads,nope,rope,value,rank,topk", [(4, 16, 8, 16, 32, 6), (3, 8, 4, 12, 20, 9)])
def test_absorbed_form_equals_the_expanded_attention(heads, nope, rope, value, rank, topk):
    """passes/dsa/absorb.py's math on fresh random inputs (fp64): W_UK folded into the query and W_UV after the
    attention over the latent rows equals the attention over kv_b_proj's expanded keys and values (-1 padded
    indices included), output and log-sum-exp."""
    from kda_compile.passes.dsa.absorb import absorbed_attention

    g = torch.Generator().manual_seed(heads * 100 + rank)
    b, s, t = 2, 5, 11

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    q_nope, q_rope, latent, k_rope = rand(b, heads, s, nope), rand(b, heads, s, rope), rand(b, 1, t, rank), rand(
        b, 1, t, rope)
    weight = rand(heads * (nope + value), rank) / rank ** 0.5
    indices = torch.stack([torch.randperm(t, generator=g)[:topk] for _ in range(b * s)]).view(b, s, topk).int()
    indices[0, 0, topk // 2:] = -1
    scale = (nope + rope) ** -0.5
    o, lse, w_uv = absorbed_attention(dsa_sparse_attention, q_nope, q_rope, latent, k_rope, weight, indices,
                                      heads=heads, nope=nope, scale=scale, dtype=torch.float64)
    got = o.transpose(1, 2) @ w_uv.transpose(-1, -2)
    kv = torch.nn.functional.linear(latent, weight).view(b, t, heads, nope + value).transpose(1, 2)
    keys = torch.cat((kv[..., :nope], k_rope.expand(-1, heads, -1, -1)), dim=-1)
    want, want_lse = dsa_sparse_attention(torch.cat((q_nope, q_rope), -1).transpose(1, 2), keys.transpose(1, 2),
                                          kv[..., nope:].transpose(1, 2), indices, scale)
    assert rel_error(got, want.transpose(1, 2)) < 1e-10
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    assert rel_error(lse[torch.isfinite(lse)], want_lse[torch.isfinite(want_lse)]) < 1e-10


def test_keys_not_expand_kvs_keep_the_expanded_form():
    """Keys changed after expand_kv (here ``* 1.0``) are not the latent cache's: the attention stays in the
    expanded form (the report says why), still matches eager, and mla_absorb names the layer as a DSA
    attention kept expanded. Unchanged, the same model is absorbed."""
    model = build_dsa_model("deepseek_v32")
    for layer in model.model.layers:
        expand = layer.self_attn.expand_kv
        layer.self_attn.expand_kv = lambda kv, k_rot, expand=expand: (lambda k, v: (k * 1.0, v))(*expand(kv, k_rot))
    cap = KeepGraphs()
    got, want = run(model, prompt(), cap)
    assert rel_error(got, want) < TOL
    forms = [e.details["form"] for e in cap.entries("kda_compile.dsa_sparse_attention")]
    assert len(forms) == 2 and all(f.startswith("expanded: the attention's keys") for f in forms), forms
    mla = [c.reason for c in cap.reports[0].left_alone if c.rewrite == "mla_absorb"]
    assert len(mla) == 2 and all("DSA attention kept in the expanded form" in r for r in mla), mla

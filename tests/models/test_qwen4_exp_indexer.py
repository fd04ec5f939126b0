"""qwen4_exp's QSA indexer under kda_compile: traced branch-free (passes/dsa/qsa_indexer.py), so its full-attention
layer compiles without a graph break and its softmax attention becomes ``kda_compile.attention``.

Checked (cheap): the substitute, called eagerly, returns HF's selection mask bit for bit, on bool (SDPA) and
additive (eager) masks, with key padding, with holes in a custom mask, in prefill and in decode over a cache,
for fewer keys than a block and lengths that are not a multiple of one (16 indexer heads: no two block
scores tie); where every block scores 0 (``k_layernorm`` weight -1), a row whose blocks are all complete (a
decode step) picks HF's blocks (the same ``topk`` call); HF's class is registered by identity and a copy of
it in another modeling module by its bytecode, a changed copy not at all.

Checked on a tiny qwen4_exp_text model (2 layers: GDN, then an indexed full attention; 2 indexer heads,
budget 8, blocks of 4; fp32, CPU, aot_eager): prefill through ``optimize(fullgraph=True)`` (a graph break is
an error) gives one graph holding ``kda_compile.attention``, the report names the indexer as rewritten and
leaves nothing alone, logits within 1e-4 of eager; so does ``torch.compile(fullgraph=True)`` with the
backend (no capture of data-dependent ops), its graph holding our attention op; ``generate()`` through the
compiled forward gives eager's tokens. Slow (``-m slow``): with ``Config(dsa_attention=False)`` HF's loop is
traced as written and its graph break at ``if num_complete_blocks > 0`` is back in the report, logits still
eager's.
"""
from __future__ import annotations

import sys
import types

import pytest
import torch

import kda_compile
import kda_compile.ops
from kda_compile import Config, optimize, report
from kda_compile.passes.dsa import qsa_indexer
from kda_compile.testing import rel_error

transformers = pytest.importorskip("transformers")
modeling = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")

QUICK = Config(compiler="aot_eager")
LOGITS_TOL = 1e-4
INDEXER = dict(indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4)
MODEL = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
             linear_value_head_dim=8, linear_conv_kernel_dim=4, layer_types=["linear_attention", "indexed_attention"],
             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
             max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2, indexer_n_heads=2, **INDEXER)
FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
             "causal_conv1d_update")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield


# ----------------------------------------------------------------------------------------------
# The substitute against HF's loop (eager calls)
# ----------------------------------------------------------------------------------------------
class IndexerCache:
    """The one method HF's indexer calls on its cache: the past raw keys, then this call's."""

    def __init__(self, past: torch.Tensor) -> None:
        self.past = past

    def update_indexer(self, keys: torch.Tensor, layer_idx: int) -> torch.Tensor:
        return torch.cat([self.past, keys], dim=1)


def _indexer(heads: int, seed: int) -> torch.nn.Module:
    config = transformers.Qwen4ExpTextConfig(**dict(MODEL, indexer_n_heads=heads))
    indexer = modeling.Qwen4ExpTextQSAIndexer(config, layer_idx=1)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in indexer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return indexer.eval(), config


def _call(indexer, config, *, batch, past, seq, keys_kept, bool_mask, seed):
    """(HF's mask, the substitute's mask) for one call."""
    gen = torch.Generator().manual_seed(seed)
    total = past + seq
    hidden = torch.randn(batch, seq, config.hidden_size, generator=gen)
    positions = torch.arange(total).view(1, 1, -1).expand(3, batch, -1)
    cos_sin = modeling.Qwen4ExpTextRotaryEmbedding(config)(hidden, positions)
    causal = torch.arange(total)[None, :] <= torch.arange(past, total)[:, None]
    visible = (causal[None] & keys_kept[:, None]).unsqueeze(1)  # [B, 1, S, T]
    mask = visible if bool_mask else torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)
    cache = IndexerCache(torch.randn(batch, past, config.indexer_head_dim, generator=gen)) if past else None
    substitute = qsa_indexer.make_substitute(modeling.Qwen4ExpTextQSAIndexer.forward, "test")
    with torch.no_grad():
        return indexer(hidden, cos_sin, mask, cache), substitute(indexer, hidden, cos_sin, mask, cache)


CASES = {  # name -> (past keys, queries, which keys are kept: "all", "left padding" or "holes")
    "prefill": (0, 13, "all"),
    "prefill, left padding": (0, 17, "left padding"),
    "prefill, holes": (0, 19, "holes"),
    "prefill after a cache": (9, 6, "all"),
    "decode": (26, 1, "all"),
    "decode, holes": (33, 1, "holes"),
    "fewer keys than a block": (0, 3, "all"),
    "decode, one block": (4, 1, "all"),
}


@pytest.mark.parametrize("bool_mask", [True, False], ids=["bool mask", "additive mask"])
@pytest.mark.parametrize("case", CASES)
def test_substitute_selects_the_keys_hf_selects(case, bool_mask):
    past, seq, kept = CASES[case]
    for seed in range(4):
        indexer, config = _indexer(heads=16, seed=seed)
        gen = torch.Generator().manual_seed(100 + seed)
        keys_kept = torch.ones(2, past + seq, dtype=torch.bool)
        if kept == "left padding":
            keys_kept[1, : 3 + seed] = False
        elif kept == "holes":
            keys_kept = torch.rand(2, past + seq, generator=gen) > 0.3
        want, got = _call(indexer, config, batch=2, past=past, seq=seq, keys_kept=keys_kept, bool_mask=bool_mask,
                          seed=seed)
        assert got.dtype == torch.bool and got.shape == want.shape == (2, 1, seq, past + seq)
        assert torch.equal(got, want), f"seed {seed}: {(got != want).nonzero()[:4].tolist()}"


def test_equal_scores_in_a_full_row_pick_hfs_blocks():
    """k_layernorm's weight -1 zeroes every pooled key (HF's norm scales by 1 + weight): every block scores 0,
    and the choice among them is topk's. A decode row's blocks are all complete: the same topk call as HF's."""
    for past in (7, 12, 23, 40):
        indexer, config = _indexer(heads=2, seed=past)
        with torch.no_grad():
            indexer.k_layernorm.weight.fill_(-1.0)
        want, got = _call(indexer, config, batch=2, past=past, seq=1, keys_kept=torch.ones(2, past + 1, dtype=bool),
                          bool_mask=True, seed=past)
        assert torch.equal(got, want), past


def _copy_module(name: str, forward_code: types.CodeType) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(torch=torch, math=__import__("math"), apply_rotary_pos_emb=modeling.apply_rotary_pos_emb)
    forward = types.FunctionType(forward_code, module.__dict__, "forward")
    module.CopiedQSAIndexer = type("CopiedQSAIndexer", (modeling.Qwen4ExpTextQSAIndexer,),
                                   {"forward": forward, "__module__": name})
    return module


def test_hfs_class_by_identity_and_a_copy_by_bytecode():
    entries = {r.where: r for r in qsa_indexer.registered()}
    hf = f"{qsa_indexer.HF_MODULE}.{qsa_indexer.HF_CLASS}"
    assert entries[hf].by == "identity" and entries[hf].original is modeling.Qwen4ExpTextQSAIndexer.forward
    code = modeling.Qwen4ExpTextQSAIndexer.forward.__code__
    changed = code.replace(co_consts=tuple(-2 if c == -1 else c for c in code.co_consts))  # pads with -2
    names = tuple(f"transformers.models.{n}.modeling_{n}" for n in ("copied_qsa", "changed_qsa"))
    try:
        for name, forward_code in zip(names, (code, changed)):
            sys.modules[name] = _copy_module(name, forward_code)
        qsa_indexer.register_loaded_indexers()
        entries = {r.where: r for r in qsa_indexer.registered()}
        assert entries[f"{names[0]}.CopiedQSAIndexer"].by == "bytecode"
        assert f"{names[1]}.CopiedQSAIndexer" not in entries
    finally:
        for name in names:
            sys.modules.pop(name, None)


# ----------------------------------------------------------------------------------------------
# A tiny qwen4_exp_text model
# ----------------------------------------------------------------------------------------------
def build_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.Qwen4ExpTextConfig(**MODEL)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                         dtype=torch.float32).eval()


def prompt(length: int, batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, MODEL["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


def torch_path():
    from hf_kda_binding import torch_path as hf_torch_path

    return hf_torch_path(modeling, *FUNCTIONS)


def test_prefill_is_one_graph_with_the_attention_op():
    model, ids = build_model(), prompt(12)
    with torch.no_grad(), torch_path():
        compiled = optimize(model, QUICK, fullgraph=True)  # a graph break is an error
        got, want = compiled(ids).logits, model(ids).logits
    assert rel_error(got, want) < LOGITS_TOL
    found = kda_compile.report(compiled)
    assert found.graph_breaks == () and len(found.graphs) == 1
    sites = {r.site: r for r in found.rewritten if r.rewrite in ("dsa_attention", "softmax_attention")}
    assert sites["model.layers.1.self_attn"].op == "kda_compile.attention", sites
    indexer = sites["model.layers.1.self_attn.indexer"]
    assert indexer.op == qsa_indexer.SELECTION and indexer.details["recognised"] == "identity", indexer
    assert indexer.source.startswith("modeling_qwen4_exp.py:"), indexer
    assert found.left_alone == (), found.left_alone


def test_torch_compile_with_the_backend_has_no_graph_break():
    """``torch.compile(backend=...)`` runs without optimize()'s capture of data-dependent ops: nothing in the
    indexer needs it."""
    from kda_compile.backend import KdaCompileBackend

    model, ids = build_model(), prompt(13)
    graphs = []

    def backend(gm, example_inputs, **kwargs):
        graphs.append(gm)
        return KdaCompileBackend(QUICK)(gm, example_inputs, **kwargs)

    with torch.no_grad(), torch_path():
        got = torch.compile(model, backend=backend, fullgraph=True)(ids).logits
        assert rel_error(got, model(ids).logits) < LOGITS_TOL
    assert len(graphs) == 1
    assert any(n.target is kda_compile.ops.attention for n in graphs[0].graph.nodes)  # rewritten in place


def test_generate_gives_eager_tokens():
    model, ids = build_model(), prompt(10)
    ones = torch.ones_like(ids)
    with torch_path():
        expected = model.generate(ids, attention_mask=ones, max_new_tokens=6, do_sample=False)
        model.forward = optimize(model.forward, QUICK, fullgraph=True)
        try:
            got = model.generate(ids, attention_mask=ones, max_new_tokens=6, do_sample=False)
            found = report(model.forward)
        finally:
            del model.forward
    assert torch.equal(got, expected)
    assert found.graph_breaks == ()
    assert [r.op for r in found.rewritten if r.site == "model.layers.1.self_attn"] == ["kda_compile.attention"] * len(
        found.graphs)  # the prefill graph and the decode graphs


@pytest.mark.slow
def test_switched_off_keeps_hfs_loop_and_its_graph_break():
    model, ids = build_model(), prompt(12)
    with torch.no_grad(), torch_path():
        compiled = optimize(model, Config(compiler="aot_eager", dsa_attention=False))
        assert rel_error(compiled(ids).logits, model(ids).logits) < LOGITS_TOL
    found = kda_compile.report(compiled)
    assert any(b.location.startswith("modeling_qwen4_exp.py:") and "data-dependent" in b.reason
               for b in found.graph_breaks), str(found)
    assert not any(r.op in (qsa_indexer.SELECTION, "kda_compile.attention") for r in found.rewritten), str(found)

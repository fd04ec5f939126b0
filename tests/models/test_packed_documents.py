"""Documents packed into one row (docs/packed-documents.md): tiny random Kimi-Linear, Qwen3-Next, Qwen3.5 and
OLMo-Hybrid (kda_compile.coverage.models.build_model: fp32, eager attention, conv kernel 4), CPU, aot_eager.

Checked: four documents of 5, 1, 2 and 8 tokens (two shorter than the conv kernel, one of a single token) packed
into one row with restarting ``position_ids``, as ``DataCollatorWithFlattening`` packs them, give through
``optimize()`` each document's logits as that document run alone by HF's eager model (relative error < 1e-4:
both sides compute in fp32, the chunked delta rule in different orders), with no graph break and the report
listing every linear-attention layer's conv and delta rule as per document; the same with the offsets given as
``cu_seq_lens_q`` / ``cu_seq_lens_k`` (through ``optimize()`` and through ``torch.compile(backend=
"kda_compile")``, whose rewritten graph reads no value to the host); Qwen3.5's parameter gradients of the packed
row's summed next-token loss equal those of the separate documents' summed losses (relative error of all
gradients together < 1e-4, and of each parameter's relative to that norm: some are about 1e-6 of it, where fp32
rounding alone exceeds 1e-4 of their own norm); calls without packing (no ``position_ids``, or ``0..T-1``) keep
eager's logits. HF's torch path runs whatever is installed (FLA / causal-conv1d bind CUDA-only kernels).
Also: the per-document conv equals HF's conv run on each document on random inputs, the offsets derived from
position ids, a batch of two packed rows (offsets over the rows laid end to end), and the log of calls that cannot
be kept apart (``position_ids`` rows that do not match the batch; ``Config(kda_substitution=False)``).
"""
from __future__ import annotations

import logging

import pytest
import torch

import kda_compile
from kda_compile import Config, optimize
from kda_compile.backend import KdaCompileBackend
from kda_compile.packed_documents import with_document_offsets
from kda_compile.passes.substitution.documents import causal_conv1d_per_document, document_offsets
from kda_compile.passes.substitution.sites import CONV_OP
from kda_compile.testing import rel_error
from hf_kda_binding import torch_path

transformers = pytest.importorskip("transformers")
from kda_compile.coverage.models import build_model  # noqa: E402

FAMILIES = ("kimi_linear", "qwen3_next", "qwen3_5", "olmo_hybrid")
DELTA_FUNCTIONS = {"kimi_linear": ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention")}
GDN_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
CONV_FUNCTIONS = ("causal_conv1d_fn", "causal_conv1d_update")
LENGTHS = (5, 1, 2, 8)
LOGITS_TOL = GRAD_TOL = 1e-4
QUICK = Config(compiler="aot_eager")


def modeling(family: str):
    return pytest.importorskip(f"transformers.models.{family}.modeling_{family}")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    with torch._dynamo.config.patch(specialize_float=True):
        yield


@pytest.fixture(params=FAMILIES)
def family(request):
    """A family, with HF's torch path for the test's duration (tests/hf_kda_binding.py)."""
    with torch_path(modeling(request.param), *DELTA_FUNCTIONS.get(request.param, GDN_FUNCTIONS), *CONV_FUNCTIONS):
        yield request.param


def packed_row(vocab: int, lengths=LENGTHS, seed: int = 1):
    ids = torch.randint(3, vocab, (1, sum(lengths)), generator=torch.Generator().manual_seed(seed))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return ids, positions, offsets


def each_alone(model, ids, lengths=LENGTHS) -> torch.Tensor:
    pieces = torch.split(ids, list(lengths), dim=1)
    return torch.cat([model(input_ids=piece, use_cache=False).logits for piece in pieces], dim=1)


def per_document_sites(compiled) -> tuple[set[str], set[str]]:
    """(layers whose conv ran per document, layers whose delta rule got cu_seqlens) in the report."""
    convs, deltas = set(), set()
    for graph in kda_compile.report(compiled).graphs:
        for site in graph.rewritten:
            if site.op == CONV_OP:
                convs.add(site.site)
            elif site.details.get("cu_seqlens"):
                deltas.add(site.site)
    return convs, deltas


def linear_layers(model) -> set[str]:
    types = model.config.layer_types
    attribute = "self_attn" if model.config.model_type == "kimi_linear" else "linear_attn"
    return {f"model.layers.{i}.{attribute}" for i, kind in enumerate(types) if kind == "linear_attention"}


@torch.no_grad()
def test_packed_documents_match_each_document_alone(family):
    model = build_model(family)
    ids, positions, _ = packed_row(model.config.vocab_size)
    expected = each_alone(model, ids)
    compiled = optimize(model, QUICK)
    packed = compiled(input_ids=ids, position_ids=positions, use_cache=False).logits
    assert rel_error(packed, expected) < LOGITS_TOL
    for piece, alone in zip(torch.split(packed, list(LENGTHS), 1), torch.split(expected, list(LENGTHS), 1)):
        assert rel_error(piece, alone) < LOGITS_TOL
    assert kda_compile.report(compiled).graph_breaks == ()
    convs, deltas = per_document_sites(compiled)
    assert convs == deltas == linear_layers(model)


@torch.no_grad()
def test_a_batch_of_packed_rows_matches_each_document_alone(family):
    """Two packed rows of different document layouts (16 tokens each, one row's last document of a single token):
    every document's logits equal that document run alone; the rows go to the delta rule laid end to end."""
    model = build_model(family)
    layouts = ((5, 1, 2, 8), (3, 12, 1))
    rows = [packed_row(model.config.vocab_size, lengths, seed=7 + i) for i, lengths in enumerate(layouts)]
    ids = torch.cat([r[0] for r in rows])
    positions = torch.cat([r[1] for r in rows])
    compiled = optimize(model, QUICK)
    packed = compiled(input_ids=ids, position_ids=positions, use_cache=False).logits
    for b, lengths in enumerate(layouts):
        assert rel_error(packed[b:b + 1], each_alone(model, ids[b:b + 1], lengths)) < LOGITS_TOL
    assert kda_compile.report(compiled).graph_breaks == ()
    convs, deltas = per_document_sites(compiled)
    assert convs == deltas == linear_layers(model)


@torch.no_grad()
def test_calls_without_packing_keep_eager_logits(family):
    model = build_model(family)
    ids, _, _ = packed_row(model.config.vocab_size)
    expected = model(input_ids=ids, use_cache=False).logits
    compiled = optimize(model, QUICK)
    counting = torch.arange(ids.shape[1])[None]
    assert rel_error(compiled(input_ids=ids, use_cache=False).logits, expected) < LOGITS_TOL
    assert rel_error(compiled(input_ids=ids, position_ids=counting, use_cache=False).logits, expected) < LOGITS_TOL
    assert kda_compile.report(compiled).graph_breaks == ()


HOST_READS = {"item", "tolist", "nonzero", "_local_scalar_dense", "_local_scalar_dense.default"}  # host reads


class HostReadCheck:
    """The kda_compile backend, keeping the names of the calls of the graphs it rewrote, and their number (a host
    read Dynamo does not capture is a graph break: a second graph)."""

    def __init__(self) -> None:
        self.backend = KdaCompileBackend(QUICK)
        self.calls: list[str] = []
        self.graphs = 0

    def __call__(self, gm, example_inputs, **kwargs):
        self.graphs += 1
        compiled = self.backend(gm, example_inputs, **kwargs)
        self.calls += [str(getattr(n.target, "__name__", n.target)) for n in gm.graph.nodes
                       if n.op in ("call_function", "call_method")]
        return compiled


@pytest.mark.parametrize("through", ["optimize", "backend"])
@torch.no_grad()
def test_offsets_given_as_flash_attention_keywords(through):
    """Exact offsets through ``optimize()``; through the backend, the ``T + 1`` offsets ``optimize()`` derives, and
    the rewritten graph reads no value to the host."""
    with torch_path(modeling("kimi_linear"), *DELTA_FUNCTIONS["kimi_linear"], *CONV_FUNCTIONS):
        model = build_model("kimi_linear")
        ids, positions, offsets = packed_row(model.config.vocab_size)
        expected = each_alone(model, ids)
        check = HostReadCheck()
        if through == "optimize":
            compiled = optimize(model, QUICK)
        else:
            compiled, offsets = torch.compile(model, backend=check), document_offsets(positions)
        packed = compiled(input_ids=ids, position_ids=positions, cu_seq_lens_q=offsets, cu_seq_lens_k=offsets,
                          max_length_q=max(LENGTHS), max_length_k=max(LENGTHS), use_cache=False).logits
        assert rel_error(packed, expected) < LOGITS_TOL
        if through == "backend":
            assert "causal_conv1d_per_document" not in check.calls and "searchsorted" in check.calls
            assert check.graphs == 1 and check.calls and not HOST_READS & set(check.calls)


def next_token_targets(ids: torch.Tensor) -> torch.Tensor:
    """Each token's target: the document's next token (-100 for its last, which predicts nothing)."""
    return torch.cat([ids[0, 1:], torch.full((1,), -100)])


def summed_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[0], targets, ignore_index=-100, reduction="sum")


def test_packed_gradients_match_separate_documents():
    with torch_path(modeling("qwen3_5"), *GDN_FUNCTIONS, *CONV_FUNCTIONS):
        model = build_model("qwen3_5")
        ids, positions, _ = packed_row(model.config.vocab_size)
        pieces = torch.split(ids, list(LENGTHS), 1)
        alone = sum(summed_loss(model(input_ids=piece, use_cache=False).logits, next_token_targets(piece))
                    for piece in pieces)
        alone.backward()
        expected = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        model.zero_grad()
        compiled = optimize(model, QUICK)
        logits = compiled(input_ids=ids, position_ids=positions, use_cache=False).logits
        loss = summed_loss(logits, torch.cat([next_token_targets(piece) for piece in pieces]))
        loss.backward()
        assert rel_error(loss.detach(), alone.detach()) < GRAD_TOL
        assert len(expected) > 10
        got = dict(model.named_parameters())
        everything = torch.cat([grad.flatten() for grad in expected.values()])
        assert rel_error(torch.cat([got[name].grad.flatten() for name in expected]), everything) < GRAD_TOL
        for name, grad in expected.items():  # each parameter's error, relative to the whole gradient's norm
            assert rel_error(got[name].grad, grad, floor=float(everything.norm())) < GRAD_TOL, name
        assert kda_compile.report(compiled).graph_breaks == ()


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("activation", [None, "silu"])
def test_per_document_conv_equals_conv_of_each_document(seed, activation):
    """Against HF's own torch conv (kimi_linear's ``causal_conv1d_fn``) run on each document alone."""
    hf_conv = modeling("kimi_linear").causal_conv1d_fn.__wrapped__
    gen = torch.Generator().manual_seed(seed)
    C, W = 6, 4
    lengths = [int(n) for n in torch.randint(0, 7, (4,), generator=gen)] + [1, 3]
    lengths = [n for n in lengths if n] or [1]
    T = sum(lengths)
    x = torch.randn(2, C, T, generator=gen)
    weight, bias = torch.randn(C, W, generator=gen), torch.randn(C, generator=gen)
    expected = torch.cat([hf_conv(piece, weight, bias, activation) for piece in torch.split(x, lengths, -1)], -1)
    # The offsets count both rows' tokens end to end: as the model derives them (2T + 1, trailing repeats) and
    # as FLA writes them, with empty ones.
    positions = torch.cat([torch.arange(n) for n in lengths]).expand(2, T)
    one_row = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    exact = torch.cat([one_row, one_row[1:] + T])
    with_empty = torch.cat([exact[:1], exact[:2], exact[1:], exact[-1:]])
    act = torch.nn.functional.silu if activation else None
    for offsets in (document_offsets(positions), exact, with_empty):
        assert rel_error(causal_conv1d_per_document(x, weight, bias, offsets, act), expected) < 1e-6
    assert rel_error(causal_conv1d_per_document(x, weight, None, torch.tensor([0, T, 2 * T]), act),
                     hf_conv(x, weight, None, activation)) < 1e-6  # one document a row: HF's conv of the rows


def test_document_offsets_follow_hf_packed_sequences():
    from transformers.masking_utils import find_packed_sequence_indices

    positions = torch.tensor([[0, 1, 2, 0, 0, 1, 5, 6, 0]])
    offsets = document_offsets(positions)
    assert offsets.dtype == torch.int32 and offsets.tolist() == [0, 3, 4, 6, 8, 9, 9, 9, 9, 9]
    documents = find_packed_sequence_indices(positions)[0]
    assert torch.equal(torch.bincount(documents), torch.diff(offsets)[:int(documents.max()) + 1].long())
    assert document_offsets(torch.arange(5)).tolist() == [0, 5, 5, 5, 5, 5]
    # Rows laid end to end: every row starts a document, even one continuing a position count.
    rows = torch.tensor([[0, 1, 0, 1], [2, 3, 4, 0]])
    assert document_offsets(rows).tolist() == [0, 2, 4, 7, 8, 8, 8, 8, 8]
    with pytest.raises(ValueError, match="position_ids"):
        document_offsets(torch.zeros(2, 2, 4, dtype=torch.long))


@torch.no_grad()
def test_substitution_off_is_logged_as_not_kept_apart(caplog):
    with torch_path(modeling("kimi_linear"), *DELTA_FUNCTIONS["kimi_linear"], *CONV_FUNCTIONS):
        model = build_model("kimi_linear")
        ids, positions, _ = packed_row(model.config.vocab_size)
        compiled = optimize(model, Config(compiler="aot_eager", kda_substitution=False))
        with caplog.at_level(logging.WARNING, logger="kda_compile.passes.kda_substitution"):
            compiled(input_ids=ids, position_ids=positions, use_cache=False)
    assert "packed documents are not kept apart" in caplog.text and "kda_substitution=False" in caplog.text
    assert per_document_sites(compiled) == (set(), set())


def test_calls_not_kept_apart_are_logged(caplog):
    model = build_model("qwen3_next")
    positions = torch.tensor([[0, 1, 0, 1]] * 2)
    call = dict(input_ids=torch.ones(2, 4, dtype=torch.long), position_ids=positions, use_cache=False)
    assert with_document_offsets(model, call)["cu_seq_lens_q"].tolist() == [0, 2, 4, 6, 8, 8, 8, 8, 8]
    shared = dict(call, position_ids=positions[0])  # [T] positions broadcast over the batch
    assert with_document_offsets(model, shared)["cu_seq_lens_q"].tolist() == [0, 2, 4, 6, 8, 8, 8, 8, 8]
    mismatched = dict(call, input_ids=torch.ones(3, 4, dtype=torch.long))
    with caplog.at_level(logging.WARNING, logger="kda_compile.packed_documents"):
        assert with_document_offsets(model, mismatched) is mismatched
    assert "position_ids has 2 rows for a batch of 3" in caplog.text
    one_row = dict(call, input_ids=call["input_ids"][:1], position_ids=positions[:1])
    assert with_document_offsets(model, one_row)["cu_seq_lens_q"].tolist() == [0, 2, 4, 4, 4]
    assert with_document_offsets(model, dict(one_row, use_cache=True)) == dict(one_row, use_cache=True)
    wrapper = torch.nn.Sequential(model)  # e.g. a PEFT model around it: still covered
    assert with_document_offsets(wrapper, one_row)["cu_seq_lens_k"].tolist() == [0, 2, 4, 4, 4]
    assert with_document_offsets(torch.nn.Linear(2, 2), one_row) is one_row  # not a covered family

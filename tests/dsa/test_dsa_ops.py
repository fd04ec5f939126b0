"""The public DSA ops against the dense float64 oracle (``naive.py``) on fixed cases: the indexer's exact
selection (quantised inputs make every fp32 score exact, so ties are real and the tie rule is checked),
the sparse attention's output, lse and gradients, both head layouts, empty rows."""
import pytest
import torch

from kda_compile.ops import dsa_indexer_topk, dsa_sparse_attention
from kda_compile.testing import assert_rel_close

from .naive import dense_scores, dense_sparse_attention, dense_topk, dense_visible


def quantised(shape, generator, low=-2, high=3):
    """Small integers: every fp32 product and sum of them is exact, and ties are frequent."""
    return torch.randint(low, high, shape, generator=generator).float()


@pytest.mark.parametrize("b,s,t,topk,causal,padding,packed", [
    (2, 7, 9, 4, True, False, False),    # a cache of 2 keys before the queries
    (1, 6, 6, 10, True, True, False),    # topk > T, padded keys
    (1, 10, 10, 3, True, False, True),   # packed sequences
    (2, 1, 12, 5, True, True, False),    # decode
    (2, 5, 8, 8, False, False, False),   # not causal
    (1, 9, 9, 4, False, True, True),     # packed, not causal, padded
])
def test_indexer_topk_exact(b, s, t, topk, causal, padding, packed, device):
    gen = torch.Generator().manual_seed(b * 100 + s * 10 + t)
    heads, dim = 3, 8
    q, k = quantised((b, s, heads, dim), gen), quantised((b, t, dim), gen)
    w = quantised((b, s, heads), gen, -1, 2)
    key_mask = torch.rand(b, t, generator=gen) > 0.3 if padding else None
    cu = torch.tensor([0, 3, 3, 7, t], dtype=torch.int32) if packed else None
    want = dense_topk(dense_scores(q, k, w, 0.5), dense_visible(b, s, t, causal, key_mask, cu), topk)
    got = dsa_indexer_topk(q.to(device), k.to(device), w.to(device), topk, scale=0.5, is_causal=causal,
                           key_mask=None if key_mask is None else key_mask.to(device),
                           cu_seqlens=None if cu is None else cu.to(device))
    assert got.dtype == torch.int32 and got.shape == (b, s, topk)
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_indexer_topk_random_is_a_true_topk(dtype, device):
    """Continuous scores: the chosen keys beat every other visible key (fp64 scores, fp32 slack)."""
    gen = torch.Generator().manual_seed(5)
    b, s, t, heads, dim, topk = 2, 11, 13, 4, 16, 6
    q, k = torch.randn(b, s, heads, dim, generator=gen), torch.randn(b, t, dim, generator=gen)
    w = torch.rand(b, s, heads, generator=gen)
    q, k = q.to(dtype), k.to(dtype)
    got = dsa_indexer_topk(q.to(device), k.to(device), w.to(device), topk, scale=0.25).cpu().long()
    scores = dense_scores(q, k, w, 0.25)
    vis = dense_visible(b, s, t, True)
    for bi in range(b):
        for i in range(s):
            n = int(vis[bi, i].sum())
            row = got[bi, i]
            assert (row[min(n, topk):] == -1).all() and (row[:min(n, topk)] >= 0).all()
            chosen = row[row >= 0]
            assert len(set(chosen.tolist())) == len(chosen) and vis[bi, i, chosen].all()
            worst = scores[bi, i, chosen].min() if len(chosen) else None
            rest = vis[bi, i].clone()
            rest[chosen] = False
            if rest.any():
                assert scores[bi, i][rest].max() <= worst + 1e-4 * (1 + abs(float(worst)))
            assert (chosen.diff() > 0).all(), "ascending key order"


def _random_indices(b, s, t, topk, gen, empty_rows=True):
    """Unique indices per row with some -1 (and, optionally, rows with none)."""
    idx = torch.full((b, s, topk), -1, dtype=torch.int32)
    for bi in range(b):
        for i in range(s):
            n = int(torch.randint(0 if empty_rows else 1, min(t, topk) + 1, (), generator=gen))
            idx[bi, i, :n] = torch.randperm(t, generator=gen)[:n].to(torch.int32)
    return idx


@pytest.mark.parametrize("absorbed", [True, False])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_sparse_attention_matches_dense(absorbed, dtype, tol, device):
    gen = torch.Generator().manual_seed(11)
    b, s, t, topk = 2, 6, 10, 5
    hq, hkv, dqk, dv = (4, 1, 24, 16) if absorbed else (6, 2, 12, 10)
    q = torch.randn(b, s, hq, dqk, generator=gen, dtype=torch.float64)
    k = torch.randn(b, t, hkv, dqk, generator=gen, dtype=torch.float64)
    v = None if absorbed else torch.randn(b, t, hkv, dv, generator=gen, dtype=torch.float64)
    idx = _random_indices(b, s, t, topk, gen)
    idx[0, 0] = -1  # a row with no key
    leaves = [x.to(device=device, dtype=dtype).requires_grad_(True) for x in (q, k, v) if x is not None]
    qd, kd = leaves[0], leaves[1]
    vd = None if absorbed else leaves[2]
    o, lse = dsa_sparse_attention(qd, kd, vd, idx.to(device), 0.3, d_v=dv if absorbed else None)
    ref_leaves = [x.clone().requires_grad_(True) for x in (q, k, v) if x is not None]
    o_ref, lse_ref = dense_sparse_attention(ref_leaves[0], ref_leaves[1], None if absorbed else ref_leaves[2],
                                            idx, 0.3, dv)
    assert o.dtype == dtype and lse.dtype == torch.float32 and o.shape == (b, s, hq, dv)
    assert_rel_close(o, o_ref, tol, name="o")
    assert torch.isneginf(lse[0, 0]).all() and (o[0, 0] == 0).all()
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse).cpu(), finite)
    assert_rel_close(lse.cpu()[finite], lse_ref[finite], 1e-6, name="lse")
    # Gradients through o and lse together.
    g_o = torch.randn(o.shape, generator=gen, dtype=torch.float64)
    g_l = torch.randn(lse.shape, generator=gen, dtype=torch.float64)
    live = finite.to(device)
    loss = (o.double() * g_o.to(device)).sum() + (lse.double().masked_fill(~live, 0) * g_l.to(device)).sum()
    loss_ref = (o_ref * g_o).sum() + (lse_ref.masked_fill(~finite, 0) * g_l).sum()
    grads = torch.autograd.grad(loss, leaves)
    grads_ref = torch.autograd.grad(loss_ref, ref_leaves)
    for name, g, r in zip("qkv", grads, grads_ref):
        assert_rel_close(g, r, max(tol, 1e-6) * 10, name=f"d{name}")


class _Passthrough(torch.utils._python_dispatch.TorchDispatchMode):
    """A dispatch mode that changes nothing: calls under it must go through the custom ops."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _spy(monkeypatch, name):
    """Record which function called ``custom_ops.<name>``: the public API (eager, no dispatcher) or the op."""
    import sys

    from kda_compile.ops.dsa import custom_ops

    callers, real = [], getattr(custom_ops, name)

    def spy(*args):
        callers.append(sys._getframe(1).f_code.co_name)
        return real(*args)
    monkeypatch.setattr(custom_ops, name, spy)
    return callers


def test_eager_calls_skip_the_dispatcher(monkeypatch, device):
    """Eager calls without autograd run the ops' implementations directly (no dispatcher: its host time was more
    than a decode step's kernels) and return what the ops return; a dispatch mode, or gradients for the attention,
    take the ops."""
    gen = torch.Generator().manual_seed(7)
    q, k = quantised((1, 3, 2, 8), gen).to(device), quantised((1, 9, 8), gen).to(device)
    w = quantised((1, 3, 2), gen, -1, 2).to(device)
    callers = _spy(monkeypatch, "indexer_topk_impl")
    direct = dsa_indexer_topk(q, k, w, 4)
    with _Passthrough():
        through_op = dsa_indexer_topk(q, k, w, 4)
    assert callers == ["dsa_indexer_topk", "dsa_indexer_topk_op"]
    assert torch.equal(direct, through_op)

    qa = torch.randn(1, 3, 4, 16, generator=gen).to(device)
    kv = torch.randn(1, 9, 1, 16, generator=gen).to(device)
    callers = _spy(monkeypatch, "sparse_attention_fwd_impl")
    o, lse = dsa_sparse_attention(qa, kv, None, direct, d_v=8)
    o_grad, lse_grad = dsa_sparse_attention(qa.requires_grad_(), kv, None, direct, d_v=8)
    assert callers == ["dsa_sparse_attention", "dsa_sparse_attention_fwd"]
    assert o.grad_fn is None and o_grad.grad_fn is not None
    assert torch.equal(o, o_grad.detach()) and torch.equal(lse, lse_grad.detach())


def test_visible_ranges_without_packed_sequences_follow_the_rule():
    """Query i of S sees keys [0, T), cut after i + T - S when causal (none when that is negative): every (S, T)
    up to 8, against loops over plain ints."""
    from kda_compile.ops.dsa.reference import visible_ranges

    for s_len in range(9):
        for t_len in range(9):
            for causal in (False, True):
                lo, hi = visible_ranges(s_len, t_len, causal, None, "cpu")
                want_hi = [max(0, min(t_len, i + t_len - s_len + 1)) if causal else t_len for i in range(s_len)]
                assert lo.tolist() == [0] * s_len and hi.tolist() == want_hi, (s_len, t_len, causal)
                assert lo.dtype == hi.dtype == torch.int64

"""``dsa_pooled_indexer_topk`` (glm5_next's pooled indexer) against Hugging Face's own
``Glm5NextTextIndexer`` and a dense float64 oracle that follows HF's code (``pooled_naive.py``): prefill with
left padding, batch > 1, several T / pool sizes / top-k (more than the visible pools), the tail on and off,
decode (S = 1) and chunks over a cache (a query offset), a static-cache-like length, ties (exact integer
scores: the lower pool wins), negative scores in rows that see fewer pools than slots (the true top-k oracle,
HF's own selection included), blockwise merging (small blocks give the same selection), no host read of a tensor
value (no device synchronisation), opcheck (with non-contiguous inputs) and torch.compile(fullgraph=True,
dynamic=True) with no graph break."""
import pytest
import torch

import kda_compile.ops.dsa.pooled.reference as pooled
from kda_compile.ops import dsa_pooled_indexer_topk

from .pooled_naive import (StubCache, assert_true_pooled_topk, dense_pooled, hf_inputs, no_host_reads,
                           quantised_pooled_inputs)

transformers = pytest.importorskip("transformers")
modeling = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")


def _indexer(pool, topk, tail, seed=0, heads=8, dim=16):
    config = transformers.Glm5NextTextConfig(
        hidden_size=32, q_lora_rank=24, index_n_heads=heads, index_head_dim=dim, index_topk=topk, index_kpool=pool,
        index_kpool_always_select_tail=tail, qk_rope_head_dim=0)
    torch.manual_seed(seed)
    module = modeling.Glm5NextTextIndexer(config, 0)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()
    return module.eval()


def _padding(b, t, seed):
    valid = torch.ones(b, t, dtype=torch.bool)
    lead = torch.randint(0, max(1, t // 2), (b,), generator=torch.Generator().manual_seed(seed))
    for bi in range(1, b):  # row 0 unpadded, the others left-padded
        valid[bi, :lead[bi]] = False
    return valid


def _run_both(module, b, s, t, seed, dtype=torch.float32, length=None):
    """(HF's selection, the op's) for S queries at the end of a T-key cache (``length`` filled slots)."""
    module = module.to(dtype)
    g = torch.Generator().manual_seed(seed)
    length = t if length is None else length
    hidden = torch.randn(b, t, module.hidden_size, generator=g, dtype=dtype)
    q_resid = torch.randn(b, t, module.q_lora_rank, generator=g, dtype=dtype)
    valid = _padding(b, t, seed)
    valid[:, length:] = False  # a static cache's unfilled slots
    with torch.no_grad():
        q, k, gate, weights = hf_inputs(module, hidden, q_resid)
        rows = slice(length - s, length)
        if s == t and length == t:
            want = module(hidden, q_resid, valid, None)
        else:
            packed = torch.cat([k, gate, valid.to(dtype)[..., None]], dim=-1)
            want = module(hidden[:, rows], q_resid[:, rows], valid[:, rows], StubCache(packed, length))
        got = dsa_pooled_indexer_topk(
            q[:, rows], k, weights[:, rows], gate, module.index_kpool_compress_ape, module.index_topk,
            scale=module.softmax_scale, key_valid=valid, query_mask=valid[:, rows], q_offset=length - s,
            select_tail=module.index_kpool_always_select_tail)
        dense = dense_pooled(q[:, rows], k, gate, weights[:, rows], valid, module.index_kpool_compress_ape,
                             valid[:, rows], module.index_topk, module.softmax_scale, length - s,
                             module.index_kpool_always_select_tail)
    return want, got, dense


CASES = [  # (B, S, T, pool, topk, tail)
    (2, 11, 11, 4, 8, True), (2, 13, 13, 4, 8, False), (3, 16, 16, 2, 6, True), (1, 9, 9, 1, 4, True),
    (2, 20, 20, 4, 64, True),  # top-k above every visible pool count
    (2, 1, 17, 4, 8, True), (2, 1, 12, 4, 8, True),  # decode: S = 1 after a cache (T % P == 0 too)
    (2, 5, 23, 3, 9, True),  # a chunk over a cache
    (2, 18, 18, 5, 10, True), (2, 7, 7, 8, 8, True),  # a pool of 5; T below one pool
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("b,s,t,pool,topk,tail", CASES)
def test_matches_hf_indexer(b, s, t, pool, topk, tail, dtype):
    want, got, dense = _run_both(_indexer(pool, topk, tail), b, s, t, seed=b + s + t, dtype=dtype)
    assert got.dtype == torch.int32 and got.shape == want.shape
    assert torch.equal(got, want)
    assert torch.equal(got, dense)


def test_static_cache_length():
    """Unfilled cache slots past the current length are never selected; queries sit at length - S + i."""
    want, got, dense = _run_both(_indexer(4, 8, True), 2, 3, 20, seed=3, length=14)
    assert torch.equal(got, want) and torch.equal(got, dense)
    assert int(got.max()) < 14


def test_small_blocks_merge_the_same(monkeypatch):
    """Pool and query blocks of a few rows (the running top-k merges across blocks) give the same answer."""
    module = _indexer(2, 10, True)
    want, whole, _ = _run_both(module, 2, 24, 24, seed=5)
    monkeypatch.setattr(pooled, "POOL_BLOCK", 3)
    monkeypatch.setattr(pooled, "QUERY_BLOCK", 5)
    _, blocked, _ = _run_both(module, 2, 24, 24, seed=5)
    assert torch.equal(blocked, whole) and torch.equal(blocked, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_pool_keys_in_blocks_are_bitwise_the_whole(monkeypatch, dtype):
    """Pool keys formed a few pools at a time (bounded temporaries) equal those formed at once, bit for bit,
    left padding and a partial last pool included; the selections too."""
    a = _args(b=3, s=5, t=29, dim=8, pool=4, seed=11)
    k, gate = a["k"].to(dtype), a["gate"].to(dtype)
    first = pooled.first_valid(a["key_valid"])
    whole = pooled.pooled_keys(k, gate, a["key_valid"], a["ape"], first)
    want = dsa_pooled_indexer_topk(a["q"], a["k"], a["weights"], a["gate"], a["ape"], 8, scale=0.5,
                                   key_valid=a["key_valid"])
    per_pool = 3 * 4 * (8 * (2 * k.element_size() + 12) + 64)
    monkeypatch.setattr(pooled, "BLOCK_BYTES", 2 * per_pool)  # two pools per block
    blocked = pooled.pooled_keys(k, gate, a["key_valid"], a["ape"], first)
    assert whole[0].shape == (3, 8, 8) and torch.equal(blocked[0], whole[0]) and torch.equal(blocked[1], whole[1])
    got = dsa_pooled_indexer_topk(a["q"], a["k"], a["weights"], a["gate"], a["ape"], 8, scale=0.5,
                                  key_valid=a["key_valid"])
    assert torch.equal(got, want)


@pytest.mark.parametrize("q_offset", [-3, 0, 5, 48, 49, 50, 60])
@pytest.mark.parametrize("s", [1, 2, 7, 50])
def test_visible_counts_are_the_prefix_sums(q_offset, s):
    """Each query's count of visible valid keys (a sum before the queries, a prefix sum over their positions) is
    the prefix sum of the whole row at its position; without a mask, the position clamped to [0, T]."""
    g = torch.Generator().manual_seed(q_offset + 100 * s)
    valid = torch.rand(3, 50, generator=g) > 0.3
    valid[1] = False
    pos = q_offset + torch.arange(s)
    prefix = torch.cat((torch.zeros(3, 1, dtype=torch.long), valid.long().cumsum(-1)), dim=1)
    upto = (pos + 1).clamp(0, 50)
    assert torch.equal(pooled.visible_count(valid, pos, q_offset, 3, 50), prefix[:, upto])
    assert torch.equal(pooled.visible_count(None, pos, q_offset, 3, 50), upto.expand(3, s))


def test_first_valid_key():
    valid = torch.tensor([[True, True, False], [False, False, False], [False, False, True]])
    assert pooled.first_valid(valid).tolist() == [0, 3, 2]
    assert pooled.first_valid(torch.zeros(2, 0, dtype=torch.bool)).tolist() == [0, 0]


def test_ties_take_the_lower_pool():
    """Exact integer scores with many equal values: the selection is the dense oracle's stable order."""
    g = torch.Generator().manual_seed(7)
    b, s, t, heads, dim, pool = 2, 10, 16, 2, 4, 4
    q = torch.randint(-1, 2, (b, s, heads, dim), generator=g).float()
    q[0, 3] = 0  # a zero query: every pool scores 0
    k = torch.randint(-2, 3, (b, t, dim), generator=g).float()
    weights = torch.randint(0, 2, (b, s, heads), generator=g).float()
    gate, ape = torch.zeros(b, t, dim), torch.zeros(pool, dim)  # equal gates: exact means over 4 tokens
    got = dsa_pooled_indexer_topk(q, k, weights, gate, ape, 8, scale=0.5)
    assert torch.equal(got, dense_pooled(q, k, gate, weights, None, ape, None, 8, 0.5, t - s, True))
    assert got[0, 3, :8].tolist() == [0, 1, 2, 3, 4, 5, 6, 7]  # pools 0 and 1 of the two visible


def _pool_scores(a, scale):
    """float64 [B, S, NP] pool scores over the op's pool keys, and each row's first valid key."""
    first = pooled.first_valid(a["key_valid"])
    pk, _ = pooled.pooled_keys(a["k"], a["gate"], a["key_valid"], a["ape"], first)
    scores = torch.einsum("bshd,bpd->bshp", a["q"].double(), pk.double()).mul(scale).relu()
    return torch.einsum("bshp,bsh->bsp", scores, a["weights"].double()), first


def _chosen_pools(idx, first, n_sel, pool):
    """int64 [B, S, n_sel]: the pools a selection holds, -1 for an empty slot."""
    blocks = idx[..., :n_sel * pool].long().view(*idx.shape[:2], n_sel, pool)[..., 0]
    return torch.where(blocks >= 0, (blocks - first[:, None, None]) // pool, -1)


def _random_pooled(b, s, t, heads, dim, pool, seed):
    """Unquantised float32 inputs with signed head weights (``randn * H ** -0.5``, as HF scales them)."""
    g = torch.Generator().manual_seed(seed)
    a = quantised_pooled_inputs(b, s, t, heads, dim, pool, device="cpu", seed=seed)
    for name in ("q", "k", "gate", "ape"):
        a[name] = torch.randn(a[name].shape, generator=g)
    a["weights"] = torch.randn(a["weights"].shape, generator=g) * heads ** -0.5
    return a


def test_negative_scores_fewer_visible_pools_than_slots():
    """Signed head weights make pool scores negative; the first topk / P - 1 queries see fewer pools than the
    slots: every visible pool is taken (the negative ones too), in score order, the other slots -1 (the true
    top-k oracle at glm5_next's pool size, with pool 0 ranked below another pool in many rows)."""
    heads, dim, pool, topk, scale = 4, 32, 16, 256, 32 ** -0.5
    a = _random_pooled(2, 512, 512, heads, dim, pool, seed=3)
    args = (a["q"], a["k"], a["weights"], a["gate"], a["ape"], topk)
    got = dsa_pooled_indexer_topk(*args, scale=scale, key_valid=a["key_valid"], query_mask=a["query_mask"],
                                  q_offset=a["q_offset"])
    want = pooled.pooled_indexer_topk_reference(a["q"], a["k"], a["gate"], a["weights"], a["key_valid"], a["ape"],
                                                a["query_mask"], topk, scale, a["q_offset"], True)
    assert torch.equal(got, want)
    assert_true_pooled_topk(got, want, a, topk, scale)

    n_sel = topk // pool
    scores, first = _pool_scores(a, scale)
    chosen = _chosen_pools(got, first, n_sel, pool)
    pos = a["q_offset"] + torch.arange(got.shape[1])
    n_visible = ((pos[None, :] - first[:, None] + 1) // pool).clamp(0, n_sel)  # no padding inside a row
    n_visible = n_visible.masked_fill(~a["query_mask"], 0)
    assert torch.equal((chosen >= 0).sum(-1), n_visible)  # all visible pools, up to the slots
    few = (n_visible >= 2) & (n_visible < n_sel)
    picked = scores.gather(-1, chosen.clamp_min(0))
    negative = ((picked < 0) & (chosen >= 0)).any(-1)
    pool0_not_first = ((chosen == 0).any(-1)) & (chosen[..., 0] != 0)
    assert bool((few & negative).any()) and bool((few & pool0_not_first).any())


def test_hf_takes_negative_scoring_pools():
    """HF's own selection takes a visible pool whatever its score's sign (only non-candidates get ``finfo.min``)
    and passes the true top-k oracle against the op (HF's order among exactly equal scores is torch.topk's)."""
    module = _indexer(16, 256, True, seed=1, heads=4, dim=32)
    b, t = 2, 512
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(b, t, module.hidden_size, generator=g)
    q_resid = torch.randn(b, t, module.q_lora_rank, generator=g)
    valid = _padding(b, t, 7)
    with torch.no_grad():
        q, k, gate, weights = hf_inputs(module, hidden, q_resid)
        hf = module(hidden, q_resid, valid, None)
        ape = module.index_kpool_compress_ape
        got = dsa_pooled_indexer_topk(q, k, weights, gate, ape, 256, scale=module.softmax_scale, key_valid=valid,
                                      query_mask=valid)
    a = dict(q=q, k=k, gate=gate, weights=weights, key_valid=valid, ape=ape, query_mask=valid, q_offset=0)
    assert_true_pooled_topk(hf, got, a, 256, module.softmax_scale)
    scores, first = _pool_scores(a, module.softmax_scale)
    chosen = _chosen_pools(hf, first, 16, 16)
    assert bool(((scores.gather(-1, chosen.clamp_min(0)) < 0) & (chosen >= 0)).any())


def test_true_topk_oracle_catches_wrong_selections():
    """The oracle rejects a pool dropped, a pool chosen twice, a pool the query cannot see and a better pool
    left out, in rows with fewer visible pools than slots and in rows with more."""
    heads, dim, pool, topk, scale = 2, 8, 4, 16, 0.5
    a = _random_pooled(1, 40, 40, heads, dim, pool, seed=5)
    ref = pooled.pooled_indexer_topk_reference(a["q"], a["k"], a["gate"], a["weights"], a["key_valid"], a["ape"],
                                               a["query_mask"], topk, scale, a["q_offset"], True)
    assert_true_pooled_topk(ref, ref, a, topk, scale)
    scores, _ = _pool_scores(a, scale)
    blocks = torch.arange(pool)

    def bad(row, slot, new_pool):
        out = ref.clone()
        out[0, row, slot * pool:(slot + 1) * pool] = -1 if new_pool is None else new_pool * pool + blocks
        return out

    # row 10 sees pools 0 and 1 (of 4 slots); row 39 sees all 10 pools and keeps 4
    assert ref[0, 10, :8].ge(0).all() and ref[0, 10, 8:16].eq(-1).all()
    left_out = [p for p in range(10) if p not in (ref[0, 39, :16:pool] // pool).tolist()]
    best_left = max(left_out, key=lambda p: float(scores[0, 39, p]))
    for wrong, message in ((bad(10, 1, None), None), (bad(10, 1, int(ref[0, 10, 0]) // pool), "twice"),
                           (bad(10, 1, 5), "may not see"), (bad(39, 0, best_left), "left out|score order")):
        with pytest.raises(AssertionError, match=message):
            assert_true_pooled_topk(wrong, ref, a, topk, scale)


@pytest.mark.parametrize("b,s,t,pool,topk,length,blocks", [
    (2, 11, 11, 4, 8, None, False),   # prefill with left padding
    (2, 1, 17, 4, 64, None, False),   # decode, top-k above every pool count
    (2, 3, 26, 4, 32, 13, False),     # a static cache: fewer kept pools than slots (the tail moves up)
    (2, 24, 24, 2, 10, None, True),   # small query and pool blocks (the running top-k merges)
    (2, 5, 5, 8, 8, None, False),     # T below one pool: only the tail
])
def test_no_host_reads(b, s, t, pool, topk, length, blocks, monkeypatch):
    """The CPU path reads no tensor value on the host (on a GPU: no synchronisation, a decode call can be
    captured in a CUDA graph): every size and loop bound comes from shapes and ``q_offset``, and HF's selection
    count, which places the tail, stays a tensor. The same selection as without the guard, HF's layout."""
    if blocks:
        monkeypatch.setattr(pooled, "POOL_BLOCK", 3)
        monkeypatch.setattr(pooled, "QUERY_BLOCK", 5)
    a = quantised_pooled_inputs(b, s, t, 2, 8, pool, device="cpu", seed=b + s + t, length=length)
    args = (a["q"], a["k"], a["gate"], a["weights"], a["key_valid"], a["ape"], a["query_mask"], topk, 0.5,
            a["q_offset"], True)
    want = dense_pooled(*args)
    with no_host_reads(monkeypatch):
        direct = pooled.pooled_indexer_topk_reference(*args)  # every aten op under the dispatch mode
        through_op = dsa_pooled_indexer_topk(a["q"], a["k"], a["weights"], a["gate"], a["ape"], topk, scale=0.5,
                                             key_valid=a["key_valid"], query_mask=a["query_mask"],
                                             q_offset=a["q_offset"])
    assert torch.equal(direct, want) and torch.equal(through_op, want)


def test_no_host_reads_catches_a_host_read(monkeypatch):
    """The guard of ``test_no_host_reads`` fails ``.item()``, ``int(t)``, ``.tolist()`` and a boolean index."""
    x = torch.arange(4)
    for read in (lambda: x.sum().item(), lambda: int(x[1]), lambda: x.tolist(), lambda: x[x > 1],
                 lambda: bool(x.any())):
        with pytest.raises(AssertionError, match="host read"), no_host_reads(monkeypatch):
            read()


def test_floating_key_flags_read_as_the_mask():
    """HF's cache column (floating flags, nonzero = valid, NaN too) selects what the bool mask selects."""
    a = quantised_pooled_inputs(2, 5, 40, 2, 8, 4, device="cpu", seed=4)
    call = lambda valid: dsa_pooled_indexer_topk(a["q"], a["k"], a["weights"], a["gate"], a["ape"], 8, scale=0.5,  # noqa
                                                 key_valid=valid, query_mask=a["query_mask"], q_offset=a["q_offset"])
    flags = a["key_valid"].to(torch.bfloat16) * torch.tensor([1.0, -3.5]).repeat(20)
    flags[0, 30] = float("nan")
    flags[1, 3] = -0.0
    mask = a["key_valid"].clone()
    mask[0, 30], mask[1, 3] = True, False
    assert torch.equal(call(flags), call(mask))


def test_validation_names_the_argument():
    q, k, w = torch.randn(1, 3, 2, 4), torch.randn(1, 5, 4), torch.randn(1, 3, 2)
    gate, ape = torch.randn(1, 5, 4), torch.randn(2, 4)
    with pytest.raises(ValueError, match="gate must be"):
        dsa_pooled_indexer_topk(q, k, w, gate[:, :4], ape, 4, scale=1.0)
    with pytest.raises(ValueError, match="ape must be"):
        dsa_pooled_indexer_topk(q, k, w, gate, ape[:, :3], 4, scale=1.0)
    with pytest.raises(ValueError, match="topk must be an int >= 1"):
        dsa_pooled_indexer_topk(q, k, w, gate, ape, 0, scale=1.0)
    with pytest.raises(TypeError, match="key_valid must be None, a bool mask or floating flags"):
        dsa_pooled_indexer_topk(q, k, w, gate, ape, 4, scale=1.0, key_valid=torch.ones(1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="key_valid must be"):
        dsa_pooled_indexer_topk(q, k, w, gate, ape, 4, scale=1.0, key_valid=torch.ones(1, 4))
    with pytest.raises(TypeError, match="k must be"):
        dsa_pooled_indexer_topk(q, k.double(), w, gate, ape, 4, scale=1.0)


def _args(b=2, s=6, t=9, heads=3, dim=8, pool=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[1, :2] = False
    return dict(q=torch.randn(b, s, heads, dim, generator=g), k=torch.randn(b, t, dim, generator=g),
                weights=torch.randn(b, s, heads, generator=g), gate=torch.randn(b, t, dim, generator=g),
                ape=torch.randn(pool, dim, generator=g), key_valid=valid, query_mask=valid[:, t - s:].clone())


@pytest.mark.parametrize("transposed", [False, True])
def test_opcheck(transposed):
    a = _args()
    q, k, w, gate = a["q"], a["k"], a["weights"], a["gate"]
    if transposed:  # non-contiguous views with the same values
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
        k = k.transpose(0, 1).contiguous().transpose(0, 1)
        w = w.transpose(1, 2).contiguous().transpose(1, 2)
        gate = gate.transpose(1, 2).contiguous().transpose(1, 2)
    torch.library.opcheck(torch.ops.kda_compile.dsa_pooled_indexer_topk.default,
                          (q, k, gate, w, a["key_valid"], a["ape"], a["query_mask"], 7, 0.25, 3, True))


def test_compile_fullgraph_dynamic():
    calls = []

    def count(gm, example_inputs):
        calls.append(gm)
        return gm.forward

    def layer(q, k, weights, gate, ape, key_valid, query_mask):
        idx = dsa_pooled_indexer_topk(q, k, weights, gate, ape, 8, scale=0.25, key_valid=key_valid,
                                      query_mask=query_mask)
        return idx.long().clamp_min(0).sum(-1)

    compiled = torch.compile(layer, backend=count, fullgraph=True, dynamic=True)
    for s, t in ((6, 9), (5, 13), (8, 11)):  # (S = 1 and S == T specialise, as for every op)
        a = _args(s=s, t=t, pool=4, seed=s + t)
        a["key_valid"][1, :2] = False
        args = (a["q"], a["k"], a["weights"], a["gate"], a["ape"], a["key_valid"], a["query_mask"])
        assert torch.equal(compiled(*args), layer(*args))
    assert len(calls) == 1

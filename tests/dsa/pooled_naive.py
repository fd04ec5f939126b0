"""A dense float64 oracle of glm5_next's pooled indexer that follows Hugging Face's
``Glm5NextTextIndexer.forward`` step by step ([B, S, T] visibility, [B, S, NP] scores), with the tie rule
of ``dsa_pooled_indexer_topk`` (equal scores: the lower pool index) by a stable sort; and a helper that
runs HF's own module on given indexer inputs; ``no_host_reads``, which fails a call that reads a tensor's value
on the host."""
from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def dense_pooled(q, k, gate, weights, key_valid, ape, query_mask, topk, scale, q_offset, select_tail):
    """int32 [B, S, topk (+ P - 1)]; scores in float64."""
    b, s_len, _, _ = q.shape
    t_len, pool = k.shape[1], ape.shape[0]
    if key_valid is None:
        key_valid = torch.ones(b, t_len, dtype=torch.bool)
    pos = q_offset + torch.arange(s_len)
    visible = (torch.arange(t_len)[None, None, :] <= pos[None, :, None]) & key_valid[:, None, :]
    first = torch.where(key_valid.any(-1), key_valid.long().argmax(-1), torch.full((b,), t_len))
    n_pools = (t_len + pool - 1) // pool
    tok = first[:, None, None] + torch.arange(n_pools * pool).view(1, n_pools, pool)
    safe = tok.clamp(0, t_len - 1)
    b_ix = torch.arange(b)[:, None, None]
    valid = key_valid[b_ix, safe] & (tok < t_len)
    pool_valid = valid.all(-1)
    logits = (gate[b_ix, safe].double() + ape.double()[None, None]).masked_fill(~valid[..., None], float("-inf"))
    probs = torch.nan_to_num(logits.softmax(dim=2))
    pk = (probs * k[b_ix, safe].double()).sum(2)
    keep = pool_valid.any(0)
    pk, pool_valid, tok = pk[:, keep], pool_valid[:, keep], tok[:, keep]
    scores = torch.relu(torch.einsum("bshd,bpd->bshp", q.double(), pk) * scale)
    scores = torch.einsum("bshp,bsh->bsp", scores, weights.double())
    last = tok[..., -1].clamp(0, t_len - 1)
    cand = visible.gather(-1, last[:, None, :].expand(b, s_len, -1)) & pool_valid[:, None]
    n_sel = min(topk // pool, scores.shape[-1])
    width = topk + (pool - 1 if select_tail else 0)
    out = torch.full((b, s_len, width), -1, dtype=torch.long)
    for bi in range(b):
        for i in range(s_len):
            order = sorted((p for p in range(scores.shape[-1]) if cand[bi, i, p]),
                           key=lambda p: -float(scores[bi, i, p]))[:n_sel]
            for slot, p in enumerate(order):
                out[bi, i, slot * pool:(slot + 1) * pool] = tok[bi, p]
            if select_tail and pool > 1:
                count = int(visible[bi, i].sum())
                tail = count % pool
                start = int(first[bi]) + count - tail
                for j in range(pool - 1):
                    s = start + j
                    if j < tail and s < t_len and bool(visible[bi, i, s]):
                        out[bi, i, n_sel * pool + j] = s
    if query_mask is not None:
        out[~query_mask] = -1
    return out.to(torch.int32)


class _Layer:
    def __init__(self, packed, length):
        self.keys = packed.new_empty(packed.shape[0], 1, packed.shape[1], 1)  # only .shape[-2] is read
        self.length = length

    def get_seq_length(self):
        return self.length


class StubCache:
    """Stands in for HF's cache: ``update_indexer`` returns the given [B, T, 2D + 1] packed states (the
    cache after this step's write), ``get_seq_length`` the filled length (``< T`` mimics a static cache)."""

    def __init__(self, packed, length, layer_idx=0):
        self.packed = packed
        self.layers = {layer_idx: _Layer(packed, length)}

    def update_indexer(self, packed_states, layer_idx):
        return self.packed


def hf_inputs(module, hidden, q_resid):
    """(q, k, gate, weights) exactly as HF's forward computes them from the hidden states."""
    b, s = hidden.shape[:2]
    q = module.wq_b(q_resid).view(b, s, -1, module.head_dim)
    k = module.k_norm(module.wk(hidden))
    gate = torch.nn.functional.linear(hidden, module.index_kpool_compress_gate)
    weights = module.weights_proj(hidden).float() * module.n_heads ** -0.5
    return q, k, gate, weights


KEY_MASK_FORMS = ("all", "left padding", "holes", "none")


def drawn_key_mask(form: str, b: int, t: int, g: torch.Generator) -> torch.Tensor:
    """A bool [B, T] key mask of one of ``KEY_MASK_FORMS``: every key, random left padding per row, random holes
    (80% valid), no valid key."""
    valid = torch.ones(b, t, dtype=torch.bool)
    if form == "left padding":
        for row in range(b):
            valid[row, :int(torch.randint(0, t + 1, (1,), generator=g))] = False
    elif form == "holes":
        valid = torch.rand(b, t, generator=g) > 0.2
    elif form == "none":
        valid[:] = False
    return valid


def quantised_pooled_inputs(b, s, t, heads, dim, pool, *, device, dtype=torch.float32, seed=0, length=None,
                            pad=True):
    """Pooled indexer inputs whose float32 pool scores are exact on any device and in any summation order
    (small-integer queries and keys, head weights in quarters, a gate whose softmax picks one token's key per
    feature: ``exp(-1000)`` is 0), as a dict of the op's arguments (scale 0.5 keeps them exact). Left padding
    in rows 1.. (row 0 unpadded); a static cache's slots past ``length`` invalid; the S queries end at the
    filled length; padded queries masked."""
    g = torch.Generator().manual_seed(seed)
    length = t if length is None else length
    q = torch.randint(-2, 3, (b, s, heads, dim), generator=g).to(dtype)
    k = torch.randint(-2, 3, (b, t, dim), generator=g).to(dtype)
    weights = torch.randint(-2, 3, (b, s, heads), generator=g).float() / 4
    gate = torch.randn(b, t, dim, generator=g)
    leader = torch.randint(0, pool, (dim,), generator=g)
    ape = torch.where(torch.arange(pool)[:, None] == leader[None, :], 0.0, -1000.0)
    key_valid = torch.ones(b, t, dtype=torch.bool)
    if pad:
        lead = torch.randint(0, max(1, length // 2), (b,), generator=g)
        for bi in range(1, b):
            key_valid[bi, :lead[bi]] = False
    key_valid[:, length:] = False
    q_offset = length - s
    query_mask = key_valid[:, q_offset:length].clone()
    tensors = dict(q=q, k=k, gate=gate, weights=weights, key_valid=key_valid, ape=ape, query_mask=query_mask)
    return {**{n: v.to(device) for n, v in tensors.items()}, "q_offset": q_offset}


def assert_true_pooled_topk(got, want, a, topk, scale, rtol=1e-5):
    """Where rounding may order near-equal pools differently: ``got`` and ``want`` (the torch path) agree on
    the layout (same tail and padding slots, the same number of pools per row, each pool's P consecutive
    tokens), ``got``'s pools are distinct, complete, valid and visible, in score order, and no visible pool
    left out scores above a chosen one, up to ``rtol`` of the row's largest score (float64 scores over the
    pool keys ``got``'s path formed: ``pooled.pooled_keys`` on the CPU, the op's pool-forming kernel on CUDA, which
    may round a pool key's last bit differently; tests/dsa/test_triton_pool_keys.py and test_cuda_pool_keys.py bound
    that).

    HF's rule, as checked here: a pool is a candidate for query ``i`` when it is valid and its last token
    ``first + p * P + P - 1 <= pos_i``; HF fills the other pools' scores with ``finfo.min`` before its top-k
    and turns any of them it picks into -1, so every candidate outranks every non-candidate, whatever its
    sign: a candidate with a negative (or zero) score is still taken while a slot is free. A row that sees
    fewer candidates than the ``n_sel`` slots takes all of them, in score order, and its remaining slots hold
    P times -1 (they are not pools; in particular not pool 0)."""
    from kda_compile.ops.dsa.pooled.reference import first_valid, pooled_keys

    got, want = got.long(), want.long()
    b, s_len, _ = got.shape
    t_len, pool = a["k"].shape[1], a["ape"].shape[0]
    key_valid = a["key_valid"]
    if key_valid is not None:
        key_valid = key_valid != 0  # (bool masks and floating flags alike)
    if key_valid is None:
        key_valid = torch.ones(b, t_len, dtype=torch.bool, device=got.device)
    first = first_valid(key_valid)
    if got.is_cuda:  # the pools the op's CUDA path formed (CUDA or Triton pool kernel, as it chose)
        from kda_compile.ops.dsa.pooled.triton_indexer import form_pools

        pk, pool_valid = form_pools(a["k"], a["gate"], a["key_valid"], a["ape"])[2:]
    else:
        pk, pool_valid = pooled_keys(a["k"], a["gate"], key_valid, a["ape"], first)
    n_pools = pool_valid.shape[1]
    n_sel = min(topk // pool, int(pool_valid.any(0).sum()))
    assert torch.equal(got[..., n_sel * pool:], want[..., n_sel * pool:])
    blocks, ref_blocks = got[..., :n_sel * pool].view(b, s_len, n_sel, pool), want[..., :n_sel * pool]
    assert torch.equal((blocks[..., 0] >= 0).sum(-1), (ref_blocks.view(b, s_len, n_sel, pool)[..., 0] >= 0).sum(-1))
    taken = blocks[..., :1] >= 0
    steps = torch.arange(pool, device=got.device)
    assert torch.equal(blocks, torch.where(taken, blocks[..., :1] + steps, -1))
    chosen = torch.where(taken[..., 0], (blocks[..., 0] - first[:, None, None]) // pool, -1)  # [B, S, n_sel]
    ordered = chosen.sort(-1).values
    assert not bool(((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)).any()), "a pool chosen twice"
    scores = torch.einsum("bshd,bpd->bshp", a["q"].double(), pk.double()).mul(scale).relu()
    scores = torch.einsum("bshp,bsh->bsp", scores, a["weights"].double())
    pos = a["q_offset"] + torch.arange(s_len, device=got.device)
    last = first[:, None] + torch.arange(n_pools, device=got.device) * pool + pool - 1
    visible = pool_valid[:, None, :] & (last[:, None, :] <= pos[None, :, None])
    # chosen pools as a [B, S, NP] mask; empty slots (-1) go to a spare last column, dropped after (scattering
    # them onto pool 0 with False would erase a chosen pool 0)
    mask = visible.new_zeros(b, s_len, n_pools + 1)
    mask.scatter_(-1, torch.where(chosen >= 0, chosen, n_pools), True)
    mask = mask[..., :n_pools]
    assert bool((mask <= visible).all()), "a chosen pool the query may not see"
    slack = rtol * scores.abs().amax(-1)
    picked = scores.gather(-1, chosen.clamp_min(0)).masked_fill(chosen < 0, float("-inf"))
    falls = picked[..., 1:] - picked[..., :-1]
    assert bool((falls.nan_to_num(0.0, neginf=0.0) <= slack[..., None]).all()), "pools out of score order"
    worst = scores.masked_fill(~mask, float("inf")).amin(-1)
    best_left = scores.masked_fill(mask | ~visible, float("-inf")).amax(-1)
    assert bool((best_left <= worst + slack).all()), "a better visible pool left out"


class _NoValueReads(TorchDispatchMode):
    """Raises on the aten ops that read values on the host or size their output from values (each a device
    synchronisation on CUDA): ``_local_scalar_dense`` (what ``.item()`` / ``int(t)`` / ``bool(t)`` call),
    ``nonzero`` and the like, and indexing by a boolean mask (its ``nonzero`` runs below the dispatcher)."""

    FORBIDDEN = ("_local_scalar_dense", "item", "nonzero", "masked_select", "equal", "is_nonzero", "allclose",
                 "_unique", "_unique2", "unique_dim", "unique_consecutive", "repeat_interleave")
    INDEXING = ("index", "index_put", "index_put_", "_index_put_impl_")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        masks = name in self.INDEXING and any(
            t is not None and t.dtype in (torch.bool, torch.uint8) for t in args[1])
        if name in self.FORBIDDEN or masks:
            raise AssertionError(f"a host read of a tensor's value: {func}")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def no_host_reads(monkeypatch):
    """Fails any read of a tensor's value on the host inside the block: the Tensor methods that return Python
    values (``tolist`` does not go through the dispatcher) raise, and a dispatch mode rejects the aten ops that
    read values. Only ops called directly see the mode (a custom op hides the ops it runs; the methods' patch
    still holds there)."""
    def refuse(name):
        def method(self, *args, **kwargs):
            raise AssertionError(f"a host read of a tensor's value: Tensor.{name}")
        return method

    with monkeypatch.context() as patch:
        for name in ("item", "tolist", "__int__", "__index__", "__float__", "__bool__", "numpy"):
            patch.setattr(torch.Tensor, name, refuse(name))
        with _NoValueReads():
            yield

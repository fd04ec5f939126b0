"""Attention whose softmax is spelled ``exp(x - logsumexp(x))`` (reformer's local and LSH self-attention):
not rewritten, but listed as left alone with what stops the rewrite (passes/attention/lse_softmax.py). The same
spelling over a linear projection (a router) is no candidate."""
from __future__ import annotations

import torch

from .graph_capture import GraphCapture


class LocalAttention(torch.nn.Module):
    """reformer's LocalSelfAttention for a sequence no longer than a chunk: 4-D scores, a causal
    ``torch.where`` whose fill is a module buffer, the softmax as exp(x - logsumexp(x))."""

    def __init__(self):
        super().__init__()
        self.mask_value_float32 = torch.nn.Buffer(torch.tensor(-1e9), persistent=False)

    def forward(self, q, k, v):
        dots = torch.matmul(q, (k / 8.0).transpose(-1, -2))
        idx = torch.arange(q.shape[-2])
        dots = torch.where(idx[:, None] >= idx[None, :], dots, self.mask_value_float32)
        logits = torch.logsumexp(dots, dim=-1, keepdim=True)
        probs = torch.exp(dots - logits)
        probs = torch.nn.functional.dropout(probs, p=0.1, training=self.training)
        return torch.matmul(probs, v)


def chunked_lsh(q, k, v):
    """reformer's LSH attention over chunks: 5-D scores, the log-sum-exp returned with the output."""
    dots = torch.matmul(q, k.transpose(-1, -2))           # [B, H, chunks, chunk, keys]
    logits = torch.logsumexp(dots, dim=-1, keepdim=True)
    out = torch.matmul(torch.exp(dots - logits), v)
    return out.flatten(2, 3), logits.flatten(2, 3).squeeze(-1)


def router(x, weight):
    logits = torch.nn.functional.linear(x, weight)
    return torch.exp(logits - torch.logsumexp(logits, dim=-1, keepdim=True))


def _left_alone(fn, *args):
    cap = GraphCapture()
    got = torch.compile(fn, backend=cap, fullgraph=True)(*args)
    return cap, [c for r in cap.reports for c in r.left_alone], got


def test_local_exp_logsumexp_attention_is_reported_with_its_buffer_fill():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 6, 8) for _ in range(3))
    module = LocalAttention().eval()
    cap, left, got = _left_alone(module, q, k, v)
    assert torch.allclose(got, module(q, k, v), atol=1e-6)  # nothing changed
    assert cap.attention_calls() == 0
    assert len(left) == 1, left
    (entry,) = left
    assert entry.rewrite == "softmax_attention" and entry.source.startswith("test_lse_softmax.py:")
    assert "spelled exp(x - logsumexp(x, dim=-1, keepdim=True))" in entry.reason
    assert "module buffer mask_value_float32" in entry.reason
    assert "4-D" not in entry.reason  # the scores are 4-D: no rank complaint


def test_chunked_attention_names_the_rank_and_the_returned_log_sum_exp():
    q, k, v = torch.randn(2, 4, 3, 5, 8), torch.randn(2, 4, 3, 10, 8), torch.randn(2, 4, 3, 10, 8)
    _, left, _ = _left_alone(chunked_lsh, q, k, v)
    assert len(left) == 1, left
    reason = left[0].reason
    assert "the scores are 5-D [2, 4, 3, 5, 10] (chunked attention" in reason
    assert "the log-sum-exp (logits (logsumexp)) is also used by" in reason


def test_exp_logsumexp_over_a_linear_projection_is_no_candidate():
    _, left, _ = _left_alone(router, torch.randn(6, 16), torch.randn(4, 16))
    assert left == []

"""Bad arguments raise ValueError/TypeError naming the argument, the value and what is accepted."""
import pytest
import torch

from kda_compile.ops.attention import attention, attention_backend, attention_with_lse


def _inputs():
    return torch.randn(2, 4, 5, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 4)


BAD = [
    # (description, change to (q, k, v, kwargs), exception, text the message must hold)
    ("query rank", lambda q, k, v, kw: (q[0], k, v, kw), ValueError, "query must be a 4-D tensor"),
    ("int query", lambda q, k, v, kw: (q.long(), k, v, kw), TypeError, "query must be of dtype"),
    ("key dtype", lambda q, k, v, kw: (q, k.double(), v, kw), TypeError, "key must be of the query's dtype"),
    ("value dtype", lambda q, k, v, kw: (q, k, v.half(), kw), TypeError, "value must be of the query's dtype"),
    ("heads not dividing", lambda q, k, v, kw: (q, k[:, :1].expand(2, 3, 6, 8), v[:, :1].expand(2, 3, 6, 4), kw),
     ValueError, "dividing the query's 4 heads"),
    ("key head dim", lambda q, k, v, kw: (q, k[..., :4], v, kw), ValueError, "head dim 8"),
    ("value length", lambda q, k, v, kw: (q, k, v[:, :, :5], kw), ValueError, "value must be"),
    ("batch", lambda q, k, v, kw: (q, k[:1], v[:1], kw), ValueError, "batch size 2"),
    ("query head dim 0", lambda q, k, v, kw: (q[..., :0], k[..., :0], v, kw), ValueError,
     "query must be a [B, H, Sq, Dqk] tensor with H >= 1 heads of width Dqk >= 1"),
    ("value head dim 0", lambda q, k, v, kw: (q, k, v[..., :0], kw), ValueError, "Dv >= 1"),
    ("mask shape", lambda q, k, v, kw: (q, k, v, dict(kw, attn_mask=torch.ones(5, 5, dtype=torch.bool))),
     ValueError, "attn_mask must be broadcastable to [B, H, Sq, Sk] = [2, 4, 5, 6]"),
    ("int mask", lambda q, k, v, kw: (q, k, v, dict(kw, attn_mask=torch.ones(5, 6, dtype=torch.int32))),
     TypeError, "attn_mask must be a bool or floating-point tensor"),
    ("mask list", lambda q, k, v, kw: (q, k, v, dict(kw, attn_mask=[[True]])), TypeError, "attn_mask must be a torch.Tensor"),
    ("is_causal int", lambda q, k, v, kw: (q, k, v, dict(kw, is_causal=1)), TypeError, "is_causal must be a bool, got 1"),
    ("scale str", lambda q, k, v, kw: (q, k, v, dict(kw, scale="0.1")), TypeError, "scale must be a finite float"),
    ("scale nan", lambda q, k, v, kw: (q, k, v, dict(kw, scale=float("nan"))), ValueError, "scale must be a finite float, got nan"),
    ("softcap zero", lambda q, k, v, kw: (q, k, v, dict(kw, softcap=0.0)), ValueError, "softcap must be None or a finite float > 0, got 0.0"),
    ("dropout 1", lambda q, k, v, kw: (q, k, v, dict(kw, dropout_p=1.0)), ValueError, "dropout_p must be a float in [0, 1), got 1.0"),
    ("window without causal", lambda q, k, v, kw: (q, k, v, dict(kw, sliding_window=4)), ValueError,
     "sliding_window must be None unless is_causal=True, got 4"),
    ("window zero", lambda q, k, v, kw: (q, k, v, dict(kw, is_causal=True, sliding_window=0)), ValueError,
     "sliding_window must be None or an int >= 1, got 0"),
    ("window float", lambda q, k, v, kw: (q, k, v, dict(kw, is_causal=True, sliding_window=2.5)), TypeError,
     "sliding_window must be None or an int >= 1, got 2.5"),
    ("sinks shape", lambda q, k, v, kw: (q, k, v, dict(kw, sinks=torch.zeros(2))), ValueError,
     "sinks must be a floating-point [H] = [4] tensor"),
    ("sinks int", lambda q, k, v, kw: (q, k, v, dict(kw, sinks=torch.zeros(4, dtype=torch.long))), TypeError,
     "sinks must be a floating-point"),
]


@pytest.mark.parametrize("fn", [attention, attention_with_lse])
@pytest.mark.parametrize("change,exc,text", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_arguments_raise_with_the_argument_named(fn, change, exc, text):
    q, k, v, kw = change(*_inputs(), {})
    with pytest.raises(exc) as info:
        fn(q, k, v, **kw)
    assert text in str(info.value)


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match=r"name must be one of .*got 'fast'"):
        with attention_backend("fast"):
            pass

"""qkv.scaled_dot_product_attention: reference, fast path and torch's SDPA agree; safe masking."""

import math

import pytest
import torch
import torch.nn.functional as F

import qkv
from qkv.attention import attention_reference, select_backend, use_backend

ATOL = 1e-5


def bottom_right_causal(s_q, s_k):
    """Independent construction: query i sees key j iff j <= i + (s_k - s_q)."""
    return torch.tensor([[j <= i + (s_k - s_q) for j in range(s_k)] for i in range(s_q)])


def qkv_tensors(b=2, h=3, s_q=7, s_k=7, d=16, d_v=None, dtype=torch.float32):
    d_v = d if d_v is None else d_v
    return (
        torch.randn(b, h, s_q, d, dtype=dtype),
        torch.randn(b, h, s_k, d, dtype=dtype),
        torch.randn(b, h, s_k, d_v, dtype=dtype),
    )


def cases():
    """(name, s_q, s_k, mask builder, is_causal, scale, torch mask equivalent)"""
    torch.manual_seed(1)
    pad = torch.tensor([[True] * 9, [True] * 5 + [False] * 4])[:, None, None, :]  # (b,1,1,s_k)
    rand_bool = torch.rand(2, 3, 6, 9) > 0.3
    rand_bool[..., 0] = True  # keep every row attending somewhere: torch's reference is then unambiguous
    additive = torch.randn(6, 9)
    return [
        ("no mask", 6, 9, None, False, None, None),
        ("causal square", 9, 9, None, True, None, bottom_right_causal(9, 9)),
        ("causal s_q < s_k", 4, 9, None, True, None, bottom_right_causal(4, 9)),
        ("causal single query", 1, 9, None, True, None, bottom_right_causal(1, 9)),
        ("padding", 6, 9, pad, False, None, pad),
        ("random boolean", 6, 9, rand_bool, False, None, rand_bool),
        ("additive float", 6, 9, additive, False, None, additive),
        ("scale given", 6, 9, None, False, 0.37, None),
        ("padding + causal", 9, 9, pad, True, None, pad & bottom_right_causal(9, 9)),
        ("additive + scale", 6, 9, additive, False, 2.0, additive),
    ]


@pytest.mark.parametrize("name,s_q,s_k,mask,is_causal,scale,torch_mask", cases(), ids=[c[0] for c in cases()])
def test_reference_fast_path_and_torch_agree(name, s_q, s_k, mask, is_causal, scale, torch_mask):
    q, k, v = qkv_tensors(s_q=s_q, s_k=s_k)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=torch_mask, scale=scale)
    with use_backend("reference"):
        ref = qkv.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)
    fast = qkv.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)
    out_w, weights = qkv.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, need_weights=True
    )
    assert select_backend(q, k, v, mask, is_causal, 0.0, False).backend == "torch_sdpa"
    torch.testing.assert_close(ref, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(fast, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(out_w, expected, atol=ATOL, rtol=0)
    assert weights.shape == (2, 3, s_q, s_k)


def test_weights_by_hand():
    """The formula of section 3.2.1 written out with explicit loops."""
    q, k, v = qkv_tensors(b=1, h=1, s_q=3, s_k=4, d=5, dtype=torch.float64)
    _, weights = qkv.scaled_dot_product_attention(q, k, v, need_weights=True)
    for i in range(3):
        scores = [sum(q[0, 0, i, t] * k[0, 0, j, t] for t in range(5)) / math.sqrt(5) for j in range(4)]
        exps = [math.exp(s) for s in scores]
        for j in range(4):
            assert weights[0, 0, i, j].item() == pytest.approx(exps[j] / sum(exps), abs=1e-12)


def test_weights_rows_sum_to_one_and_masked_keys_get_exactly_zero():
    q, k, v = qkv_tensors(s_q=6, s_k=9)
    mask = torch.rand(2, 3, 6, 9) > 0.4
    mask[..., 2] = True
    _, weights = qkv.scaled_dot_product_attention(q, k, v, attn_mask=mask, need_weights=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 3, 6), atol=1e-6, rtol=0)
    assert (weights[~mask] == 0).all()
    assert (weights >= 0).all()


@pytest.mark.parametrize("backend", ["reference", "auto"])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_fully_masked_rows_give_zeros_and_no_nan(backend, kind):
    q, k, v = qkv_tensors(s_q=5, s_k=6)
    q.requires_grad_(True)
    k.requires_grad_(True)
    v.requires_grad_(True)
    keep = torch.ones(5, 6, dtype=torch.bool)
    keep[1] = False  # query 1 may attend to nothing
    keep[3, 2:] = False
    mask = keep if kind == "bool" else torch.zeros(5, 6).masked_fill(~keep, float("-inf"))
    with use_backend(backend):
        out = qkv.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    _, weights = qkv.scaled_dot_product_attention(q, k, v, attn_mask=mask, need_weights=True)
    assert torch.isfinite(out).all()
    assert (out[:, :, 1] == 0).all()
    assert (weights[:, :, 1] == 0).all()
    (out.square().sum() + weights.sum()).backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert (q.grad[:, :, 1] == 0).all()


def test_causal_with_more_queries_than_keys_zeroes_the_first_rows():
    q, k, v = qkv_tensors(s_q=5, s_k=2)
    out, weights = qkv.scaled_dot_product_attention(q, k, v, is_causal=True, need_weights=True)
    fast = qkv.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (out[:, :, :3] == 0).all() and (weights[:, :, :3] == 0).all()
    torch.testing.assert_close(fast, out, atol=ATOL, rtol=0)
    expected = F.scaled_dot_product_attention(q[:, :, 3:], k, v, attn_mask=bottom_right_causal(5, 2)[3:])
    torch.testing.assert_close(out[:, :, 3:], expected, atol=ATOL, rtol=0)


def test_different_value_dim_and_extra_batch_dims():
    q, k, v = torch.randn(2, 3, 4, 5, 8), torch.randn(2, 3, 4, 6, 8), torch.randn(2, 3, 4, 6, 11)
    expected = F.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(qkv.scaled_dot_product_attention(q, k, v), expected, atol=ATOL, rtol=0)
    out, _ = qkv.scaled_dot_product_attention(q, k, v, need_weights=True)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


def test_dropout_is_applied_in_both_paths_and_keeps_expectation():
    q, k, v = qkv_tensors(b=1, h=1, s_q=64, s_k=64, d=8)
    out_ref, _ = attention_reference(q, k, v, dropout_p=0.5)
    out_fast = qkv.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    clean = qkv.scaled_dot_product_attention(q, k, v)
    assert not torch.allclose(out_ref, clean) and not torch.allclose(out_fast, clean)
    # Averaged over many draws, inverted dropout leaves the output unbiased.
    mean = torch.stack([qkv.scaled_dot_product_attention(q, k, v, dropout_p=0.5) for _ in range(400)]).mean(0)
    assert (mean - clean).abs().mean() < 0.05


def test_gradcheck_float64():
    q, k, v = (t.requires_grad_(True) for t in qkv_tensors(b=1, h=2, s_q=3, s_k=4, d=5, dtype=torch.float64))
    keep = torch.tensor([[1, 1, 0, 1], [0, 0, 0, 0], [1, 0, 1, 1]], dtype=torch.bool)  # row 1 fully masked
    additive = torch.randn(3, 4, dtype=torch.float64)

    def with_weights(q, k, v):
        out, w = qkv.scaled_dot_product_attention(q, k, v, attn_mask=keep, need_weights=True)
        return out, w

    assert torch.autograd.gradcheck(with_weights, (q, k, v))
    assert torch.autograd.gradcheck(
        lambda q, k, v: qkv.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v)
    )
    assert torch.autograd.gradcheck(
        lambda q, k, v: qkv.scaled_dot_product_attention(q, k, v, attn_mask=additive, scale=0.5), (q, k, v)
    )


def test_backend_records_why_it_fell_back(caplog):
    q, k, v = qkv_tensors()
    assert select_backend(q, k, v, None, False, 0.0, need_weights=True).reason.startswith("need_weights")
    with use_backend("reference"):
        assert select_backend(q, k, v, None, False, 0.0, False).backend == "reference"
    with caplog.at_level("DEBUG", logger="qkv.attention.backends"):
        qkv.scaled_dot_product_attention(q, k, v, need_weights=True)
    assert "need_weights" in caplog.text
    with pytest.raises(ValueError, match="unknown attention backend"), use_backend("flash9"):
        pass


@pytest.mark.parametrize(
    "shapes,match",
    [
        (((2, 3, 4), (2, 3), (2, 3, 4)), "same rank"),
        (((2, 3, 4), (2, 3, 5), (2, 3, 4)), "feature size"),
        (((2, 3, 4), (2, 5, 4), (2, 6, 4)), "same number of keys"),
        (((2, 3, 4), (3, 5, 4), (3, 5, 4)), "leading"),
        (((4,), (4,), (4,)), "rank >= 2"),
    ],
)
def test_bad_shapes_raise_value_error_naming_shapes(shapes, match):
    q, k, v = (torch.randn(*s) for s in shapes)
    with pytest.raises(ValueError, match=match):
        qkv.scaled_dot_product_attention(q, k, v)


def test_bad_mask_dtype_device_raise_value_error():
    q, k, v = qkv_tensors(s_q=4, s_k=5)
    with pytest.raises(ValueError, match=r"does not broadcast.*\(2, 3, 4, 5\)"):
        qkv.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="bool or floating"):
        qkv.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(4, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match="dtypes differ"):
        qkv.scaled_dot_product_attention(q, k.double(), v)
    with pytest.raises(ValueError, match="devices differ"):
        qkv.scaled_dot_product_attention(q, k.to("meta"), v)
    with pytest.raises(ValueError, match="dropout_p"):
        qkv.scaled_dot_product_attention(q, k, v, dropout_p=1.5)

"""Property-based tests (hypothesis) over random shapes, head counts and masks."""

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import qkv
from qkv.attention import use_backend

SETTINGS = settings(max_examples=40, deadline=None)


@st.composite
def attention_case(draw):
    b = draw(st.integers(1, 3))
    h = draw(st.integers(1, 4))
    s_q = draw(st.integers(1, 12))
    s_k = draw(st.integers(1, 12))
    d = draw(st.integers(1, 16))
    d_v = draw(st.integers(1, 16))
    mask_kind = draw(st.sampled_from(["none", "bool", "float", "padding"]))
    is_causal = draw(st.booleans())
    scale = draw(st.one_of(st.none(), st.floats(0.05, 3.0)))
    seed = draw(st.integers(0, 2**31 - 1))
    return b, h, s_q, s_k, d, d_v, mask_kind, is_causal, scale, seed


def build(case):
    b, h, s_q, s_k, d, d_v, mask_kind, is_causal, scale, seed = case
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, s, n, generator=g) for s, n in ((s_q, d), (s_k, d), (s_k, d_v)))
    if mask_kind == "bool":
        mask = torch.rand(b, 1, s_q, s_k, generator=g) > 0.3
    elif mask_kind == "float":
        mask = torch.randn(s_q, s_k, generator=g)
    elif mask_kind == "padding":
        lengths = torch.randint(0, s_k + 1, (b,), generator=g)
        mask = qkv.padding_mask_from_lengths(lengths, s_k)[:, None, None, :]
    else:
        mask = None
    return q, k, v, mask


def torch_reference(q, k, v, mask, is_causal, scale):
    """torch SDPA given an explicit combined mask; rows with nothing to attend set to zero."""
    s_q, s_k = q.size(-2), k.size(-2)
    keep = torch.ones(s_q, s_k, dtype=torch.bool)
    if is_causal:
        keep = torch.tensor([[j <= i + s_k - s_q for j in range(s_k)] for i in range(s_q)]).reshape(s_q, s_k)
    if mask is None or mask.dtype == torch.bool:
        keep = keep if mask is None else keep & mask
        keep = keep.expand(*q.shape[:-1], s_k)
        empty = ~keep.any(-1, keepdim=True)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep | empty, scale=scale)
        return out.masked_fill(empty, 0.0), empty
    additive = mask.masked_fill(~keep, float("-inf"))
    empty = ~keep.any(-1, keepdim=True)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=additive.masked_fill(empty, 0.0), scale=scale)
    return out.masked_fill(empty, 0.0), empty.expand(*q.shape[:-1], 1)


@SETTINGS
@given(attention_case())
def test_every_path_matches_torch(case):
    q, k, v, mask = build(case)
    is_causal, scale = case[7], case[8]
    expected, empty = torch_reference(q, k, v, mask, is_causal, scale)
    fast = qkv.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)
    with use_backend("reference"):
        ref = qkv.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)
    out, weights = qkv.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, need_weights=True
    )
    for got in (fast, ref, out):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # rows with something to attend to sum to 1; rows with nothing get exactly 0
    torch.testing.assert_close(weights.sum(-1, keepdim=True), (~empty).to(weights.dtype), atol=1e-5, rtol=0)
    assert not torch.isnan(weights).any()


@SETTINGS
@given(
    st.integers(1, 3),
    st.integers(1, 4),
    st.integers(1, 4),
    st.integers(1, 9),
    st.integers(1, 9),
    st.booleans(),
    st.integers(0, 2**31 - 1),
)
def test_multihead_matches_torch_multihead(b, heads, head_dim, s_q, s_k, cross, seed):
    torch.manual_seed(seed)
    e = heads * head_dim
    ours = qkv.MultiHeadAttention(e, heads).eval()
    ref = torch.nn.MultiheadAttention(e, heads, batch_first=True).eval()
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight]))
        ref.in_proj_bias.copy_(torch.cat([ours.q_proj.bias, ours.k_proj.bias, ours.v_proj.bias]))
        ref.out_proj.weight.copy_(ours.out_proj.weight)
        ref.out_proj.bias.copy_(ours.out_proj.bias)
    x = torch.randn(b, s_q, e)
    mem = torch.randn(b, s_k, e) if cross else x
    lengths = torch.randint(1, mem.size(1) + 1, (b,))
    keep = qkv.padding_mask_from_lengths(lengths, mem.size(1))
    got = ours(x, mem if cross else None, key_padding_mask=keep, need_weights=True)
    want, want_w = ref(x, mem, mem, key_padding_mask=~keep, need_weights=True, average_attn_weights=False)
    torch.testing.assert_close(got.output, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.weights, want_w, atol=1e-5, rtol=1e-5)

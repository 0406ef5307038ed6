"""qkv.MultiHeadAttention against torch.nn.MultiheadAttention with copied weights; the KV cache."""

import pytest
import torch

import qkv

ATOL = 1e-5


def torch_mha_like(ours: qkv.MultiHeadAttention) -> torch.nn.MultiheadAttention:
    """A torch.nn.MultiheadAttention holding the same weights (mask polarity converted at call sites)."""
    ref = torch.nn.MultiheadAttention(
        ours.embed_dim, ours.num_heads, kdim=ours.kdim, vdim=ours.vdim, batch_first=True
    ).eval()
    with torch.no_grad():
        if ref._qkv_same_embed_dim:
            ref.in_proj_weight.copy_(torch.cat([ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight]))
        else:
            ref.q_proj_weight.copy_(ours.q_proj.weight)
            ref.k_proj_weight.copy_(ours.k_proj.weight)
            ref.v_proj_weight.copy_(ours.v_proj.weight)
        ref.in_proj_bias.copy_(torch.cat([ours.q_proj.bias, ours.k_proj.bias, ours.v_proj.bias]))
        ref.out_proj.weight.copy_(ours.out_proj.weight)
        ref.out_proj.bias.copy_(ours.out_proj.bias)
    return ref


def test_self_attention_with_key_padding_matches_torch():
    ours = qkv.MultiHeadAttention(32, 4).eval()
    ref = torch_mha_like(ours)
    x = torch.randn(3, 7, 32)
    keep = qkv.padding_mask_from_lengths([7, 4, 1])
    got = ours(x, key_padding_mask=keep, need_weights=True)
    want, want_w = ref(x, x, x, key_padding_mask=~keep, average_attn_weights=False)
    _, want_avg = ref(x, x, x, key_padding_mask=~keep, average_attn_weights=True)
    torch.testing.assert_close(got.output, want, atol=ATOL, rtol=0)
    torch.testing.assert_close(got.weights, want_w, atol=ATOL, rtol=0)
    torch.testing.assert_close(got.weights.mean(dim=1), want_avg, atol=ATOL, rtol=0)
    assert got.weights.shape == (3, 4, 7, 7)
    fast = ours(x, key_padding_mask=keep)  # no weights: the fused path
    assert fast.weights is None
    torch.testing.assert_close(fast.output, want, atol=ATOL, rtol=0)


def test_cross_attention_with_other_kdim_vdim_matches_torch():
    ours = qkv.MultiHeadAttention(24, 3, kdim=10, vdim=14).eval()
    ref = torch_mha_like(ours)
    query, key, value = torch.randn(2, 5, 24), torch.randn(2, 8, 10), torch.randn(2, 8, 14)
    keep = qkv.padding_mask_from_lengths([8, 3])
    got = ours(query, key, value, key_padding_mask=keep, need_weights=True)
    want, want_w = ref(query, key, value, key_padding_mask=~keep, average_attn_weights=False)
    torch.testing.assert_close(got.output, want, atol=ATOL, rtol=0)
    torch.testing.assert_close(got.weights, want_w, atol=ATOL, rtol=0)
    torch.testing.assert_close(ours(query, key, value, key_padding_mask=keep).output, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("mask_kind", ["causal", "bool3d", "additive"])
def test_attn_masks_match_torch(mask_kind):
    ours = qkv.MultiHeadAttention(16, 2).eval()
    ref = torch_mha_like(ours)
    x = torch.randn(2, 6, 16)
    if mask_kind == "causal":
        got = ours(x, is_causal=True).output
        want, _ = ref(x, x, x, attn_mask=~torch.tril(torch.ones(6, 6, dtype=torch.bool)))
    elif mask_kind == "bool3d":
        keep = torch.rand(2, 6, 6) > 0.3
        keep[..., 0] = True
        got = ours(x, attn_mask=keep).output
        want, _ = ref(x, x, x, attn_mask=(~keep).repeat_interleave(2, dim=0))  # torch wants (b*h, s, s)
    else:
        additive = torch.randn(6, 6)
        got = ours(x, attn_mask=additive).output
        want, _ = ref(x, x, x, attn_mask=additive)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_fully_masked_query_gives_zero_not_nan_unlike_torch():
    ours = qkv.MultiHeadAttention(8, 2).eval()
    x = torch.randn(1, 3, 8, requires_grad=True)
    keep = torch.ones(3, 3, dtype=torch.bool)
    keep[1] = False
    out = ours(x, attn_mask=keep, need_weights=True)
    assert torch.isfinite(out.output).all() and (out.weights[:, :, 1] == 0).all()
    out.output.sum().backward()
    assert torch.isfinite(x.grad).all()


def test_self_attention_cache_equals_full_causal():
    mha = qkv.MultiHeadAttention(16, 4).eval()
    x = torch.randn(2, 6, 16)
    full = mha(x, is_causal=True).output
    cache, steps = None, []
    for t in range(6):
        step = mha(x[:, t : t + 1], is_causal=True, cache=cache)
        cache = step.cache
        steps.append(step.output)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=ATOL, rtol=0)
    assert len(cache) == 6 and not cache.static
    # several new queries at once after a prefix (bottom-right causal alignment)
    prefix = mha(x[:, :2], is_causal=True)
    chunk = mha(x[:, 2:], is_causal=True, cache=prefix.cache).output
    torch.testing.assert_close(chunk, full[:, 2:], atol=ATOL, rtol=0)


def test_cross_attention_cache_projects_memory_once():
    mha = qkv.MultiHeadAttention(16, 4).eval()
    memory, query = torch.randn(2, 5, 16), torch.randn(2, 3, 16)
    first = mha(query[:, :1], memory)
    assert first.cache.static

    calls = []
    handle = mha.k_proj.register_forward_hook(lambda *a: calls.append(1))
    second = mha(query[:, 1:], memory, cache=first.cache)
    handle.remove()
    assert calls == []  # keys were not projected again
    torch.testing.assert_close(second.output, mha(query[:, 1:], memory).output, atol=ATOL, rtol=0)
    reordered = first.cache.index_select(torch.tensor([1, 1, 0]))
    assert torch.equal(reordered.key[2], first.cache.key[0])


def test_dropout_only_in_training():
    mha = qkv.MultiHeadAttention(16, 4, dropout=0.5)
    x = torch.randn(2, 5, 16)
    mha.eval()
    torch.testing.assert_close(mha(x).output, mha(x).output)
    mha.train()
    assert not torch.allclose(mha(x).output, mha(x).output)


def test_gradcheck_module_float64():
    mha = qkv.MultiHeadAttention(6, 2, kdim=4, vdim=4).double()
    q = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 4, 4, dtype=torch.float64, requires_grad=True)
    keep = qkv.padding_mask_from_lengths([4, 2])
    assert torch.autograd.gradcheck(lambda q, k: mha(q, k, key_padding_mask=keep, need_weights=True).output, (q, k))
    self_attn = qkv.MultiHeadAttention(6, 3).double()
    assert torch.autograd.gradcheck(lambda q: self_attn(q, is_causal=True).output, (q,))
    with pytest.raises(ValueError, match="self-attention .* needs kdim == vdim == embed_dim"):
        mha(q)


def test_bad_inputs_raise_value_errors():
    with pytest.raises(ValueError, match=r"embed_dim \(10\) must be divisible by num_heads \(3\)"):
        qkv.MultiHeadAttention(10, 3)
    mha = qkv.MultiHeadAttention(8, 2)
    with pytest.raises(ValueError, match=r"\(batch, seq, embed_dim\).*\(3, 8\)"):
        mha(torch.randn(3, 8))
    with pytest.raises(ValueError, match="expected embed_dim=8"):
        mha(torch.randn(1, 3, 9))
    with pytest.raises(ValueError, match=r"key_padding_mask must be \(batch, s_k\) = \(1, 3\)"):
        mha(torch.randn(1, 3, 8), key_padding_mask=torch.ones(1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="must be bool"):
        mha(torch.randn(1, 3, 8), key_padding_mask=torch.ones(1, 3))
    with pytest.raises(ValueError, match="does not broadcast"):
        mha(torch.randn(1, 3, 8), attn_mask=torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="share dtype and device"):
        mha(torch.randn(1, 3, 8), torch.randn(1, 3, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="batch/sequence sizes disagree"):
        mha(torch.randn(1, 3, 8), torch.randn(2, 3, 8))

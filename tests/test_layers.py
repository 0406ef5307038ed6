"""EncoderLayer / DecoderLayer against torch.nn.TransformerEncoderLayer / TransformerDecoderLayer."""

import pytest
import torch

import qkv

D, H, FF = 32, 4, 64


def copy_attention(ours: qkv.MultiHeadAttention, ref: torch.nn.MultiheadAttention) -> None:
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight]))
        ref.in_proj_bias.copy_(torch.cat([ours.q_proj.bias, ours.k_proj.bias, ours.v_proj.bias]))
        ref.out_proj.weight.copy_(ours.out_proj.weight)
        ref.out_proj.bias.copy_(ours.out_proj.bias)


def copy_common(ours, ref, norms):
    with torch.no_grad():
        ref.linear1.load_state_dict(ours.feed_forward.linear1.state_dict())
        ref.linear2.load_state_dict(ours.feed_forward.linear2.state_dict())
        for name in norms:
            getattr(ref, name).load_state_dict(getattr(ours, name).state_dict())
            # non-trivial LayerNorm parameters so a swapped norm would be caught
            getattr(ours, name).weight.uniform_(0.5, 1.5)
            getattr(ours, name).bias.uniform_(-0.5, 0.5)
            getattr(ref, name).load_state_dict(getattr(ours, name).state_dict())


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_encoder_layer_matches_torch(norm_first, activation):
    ours = qkv.EncoderLayer(d_model=D, num_heads=H, d_ff=FF, dropout=0.0, norm_first=norm_first, activation=activation)
    ref = torch.nn.TransformerEncoderLayer(
        D, H, FF, dropout=0.0, activation=activation, batch_first=True, norm_first=norm_first
    )
    copy_attention(ours.self_attn, ref.self_attn)
    copy_common(ours, ref, ["norm1", "norm2"])
    ours.eval(), ref.eval()
    x = torch.randn(3, 9, D)
    keep = qkv.padding_mask_from_lengths([9, 6, 2])
    got = ours(x, key_padding_mask=keep, need_weights=True)
    # torch's eval fast path may leave padded positions unspecified: compare real positions (all are
    # compared in the training-mode run below, where torch runs its plain path).
    want = ref(x, src_key_padding_mask=~keep)
    torch.testing.assert_close(got.output[keep], want[keep], atol=1e-5, rtol=0)
    ours.train(), ref.train()
    torch.testing.assert_close(
        ours(x, key_padding_mask=keep).output, ref(x, src_key_padding_mask=~keep), atol=1e-5, rtol=0
    )
    assert got.self_weights.shape == (3, H, 9, 9)


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_layer_matches_torch(norm_first):
    ours = qkv.DecoderLayer(d_model=D, num_heads=H, d_ff=FF, dropout=0.0, norm_first=norm_first)
    ref = torch.nn.TransformerDecoderLayer(D, H, FF, dropout=0.0, batch_first=True, norm_first=norm_first)
    copy_attention(ours.self_attn, ref.self_attn)
    copy_attention(ours.cross_attn, ref.multihead_attn)
    copy_common(ours, ref, ["norm1", "norm2", "norm3"])
    ours.eval(), ref.eval()
    tgt, memory = torch.randn(2, 7, D), torch.randn(2, 5, D)
    tgt_keep = qkv.padding_mask_from_lengths([7, 4])
    mem_keep = qkv.padding_mask_from_lengths([5, 3])
    got = ours(tgt, memory, key_padding_mask=tgt_keep, memory_key_padding_mask=mem_keep, need_weights=True)
    want = ref(
        tgt,
        memory,
        tgt_mask=torch.nn.Transformer.generate_square_subsequent_mask(7),
        tgt_key_padding_mask=~tgt_keep,
        memory_key_padding_mask=~mem_keep,
        tgt_is_causal=True,
    )
    torch.testing.assert_close(got.output, want, atol=1e-5, rtol=0)
    assert got.self_weights.shape == (2, H, 7, 7) and got.cross_weights.shape == (2, H, 7, 5)
    assert (got.cross_weights[1, :, :, 3:] == 0).all()


def test_feed_forward_and_bad_activation():
    ff = qkv.FeedForward(4, 8, activation="relu")
    x = torch.randn(2, 3, 4)
    expected = ff.linear2(torch.relu(ff.linear1(x)))
    torch.testing.assert_close(ff(x), expected)
    with pytest.raises(ValueError, match="unknown activation 'swish'"):
        qkv.FeedForward(4, 8, activation="swish")


def test_layer_output_is_a_pytree_node_whose_tensors_torch_finds():
    """FSDP2 (torch 2.11) finds a sharded layer's output tensors with torch's pytree to hang its
    pre-backward hook on them; a LayerOutput that pytree saw as one opaque leaf left that hook out."""
    from torch.utils._pytree import tree_flatten

    from qkv.nn.layers import LayerOutput

    out, weights = torch.randn(2, 3, 4, requires_grad=True), torch.rand(2, 1, 3, 3)
    leaves, _ = tree_flatten(LayerOutput(out, self_weights=weights))
    assert [id(t) for t in leaves] == [id(out), id(weights)]

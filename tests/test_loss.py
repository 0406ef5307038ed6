"""The fused output projection + label-smoothed loss against PyTorch's F.cross_entropy on logits."""

import pytest
import torch
import torch.nn.functional as F

from qkv.models.transformer import Transformer, TransformerConfig
from qkv.nn.loss import (
    fused_linear_cross_entropy,
    fused_linear_rdrop_cross_entropy,
    label_smoothed_cross_entropy,
    rdrop_cross_entropy,
)


def _reference(hidden, weight, target, smoothing, pad):
    """PyTorch on the full logits, in float64."""
    logits = hidden.double() @ weight.double().T
    real = target != pad
    return F.cross_entropy(logits[real], target[real], label_smoothing=smoothing, reduction="sum")


@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.3])
@pytest.mark.parametrize("chunk_rows", [1, 7, 4096])
def test_fused_loss_and_gradients_match_torch(smoothing, chunk_rows):
    torch.manual_seed(0)
    hidden = torch.randn(4, 9, 16, requires_grad=True)
    weight = torch.randn(30, 16, requires_grad=True)
    target = torch.randint(1, 30, (4, 9))
    target[1, 5:] = 0  # padding
    target[3, :] = 0  # a sentence of padding only
    reference = _reference(hidden, weight, target, smoothing, 0)
    grads_ref = torch.autograd.grad(reference * 0.37, (hidden, weight))
    got = fused_linear_cross_entropy(hidden, weight, target, smoothing, 0, chunk_rows=chunk_rows)
    grads = torch.autograd.grad(got * 0.37, (hidden, weight))
    assert got.item() == pytest.approx(reference.item(), rel=1e-5)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-4)
    assert grads[0][3].abs().max() == 0  # padding positions get no gradient


def test_fused_loss_without_gradients_and_with_no_real_target():
    torch.manual_seed(1)
    hidden, weight = torch.randn(2, 3, 8), torch.randn(5, 8)
    target = torch.tensor([[1, 2, 0], [4, 0, 0]])
    with torch.no_grad():
        got = fused_linear_cross_entropy(hidden, weight, target, 0.1, 0)
    assert got.item() == pytest.approx(float(_reference(hidden, weight, target, 0.1, 0)), rel=1e-6)
    empty = fused_linear_cross_entropy(hidden, weight, torch.zeros_like(target), 0.1, 0)
    assert float(empty) == 0.0
    with pytest.raises(ValueError, match="disagree on positions"):
        fused_linear_cross_entropy(hidden, weight, target[:, :2], 0.1, 0)


def _tiny_transformer_and_batch(dropout: float, seed: int):
    """A 2+2-layer tied model and a padded batch: ``(config, model, src, tgt_in, tgt_out)``."""
    config = TransformerConfig(
        src_vocab_size=40,
        tgt_vocab_size=40,
        d_model=32,
        num_heads=4,
        num_encoder_layers=2,
        num_decoder_layers=2,
        d_ff=64,
        dropout=dropout,
        share_embeddings=True,
        tie_output=True,
    )
    torch.manual_seed(seed)
    model = Transformer(config)
    src = torch.randint(3, 40, (3, 7))
    src[0, 5:] = config.pad_id
    tgt_in = torch.randint(3, 40, (3, 6))
    tgt_out = torch.roll(tgt_in, -1, dims=1)
    tgt_out[1, 3:] = config.pad_id
    return config, model, src, tgt_in, tgt_out


def test_transformer_loss_equals_cross_entropy_of_its_logits():
    """Tied output projection: the weight's gradient sums the embedding's and the projection's."""
    config, model, src, tgt_in, tgt_out = _tiny_transformer_and_batch(dropout=0.0, seed=2)
    reference = label_smoothed_cross_entropy(model(src, tgt_in), tgt_out, 0.1, config.pad_id)
    grads_ref = torch.autograd.grad(reference, list(model.parameters()))
    got = model.loss(src, tgt_in, tgt_out, label_smoothing=0.1)
    grads = torch.autograd.grad(got, list(model.parameters()))
    assert got.item() == pytest.approx(reference.item(), rel=1e-5)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, atol=2e-5, rtol=1e-4)


def test_fused_loss_under_bf16_autocast_is_close_to_float32():
    torch.manual_seed(3)
    hidden = torch.randn(50, 32, requires_grad=True)
    weight = torch.randn(64, 32, requires_grad=True)
    target = torch.randint(1, 64, (50,))
    reference = _reference(hidden, weight, target, 0.1, 0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fused_linear_cross_entropy(hidden, weight, target, 0.1, 0)
    got.backward()
    assert got.dtype == torch.float32 and weight.grad.dtype == torch.float32
    assert got.item() == pytest.approx(reference.item(), rel=2e-2)


@pytest.mark.parametrize("autocast_dtype", [None, torch.bfloat16, torch.float16])
def test_fused_loss_when_a_target_probability_underflows(autocast_dtype):
    """Five of six targets 58-355 below their row's largest logit: softmax stores p_y = 0 (or a
    subnormal), so the loss of those rows must come from the logits, not from log p_y."""
    torch.manual_seed(0)
    hidden = (40 * torch.randn(6, 8)).requires_grad_()
    weight = torch.randn(12, 8, requires_grad=True)
    target = torch.randint(1, 12, (6,))
    reference = _reference(hidden, weight, target, 0.1, 0)
    grads_ref = torch.autograd.grad(reference, (hidden, weight))
    with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        got = fused_linear_cross_entropy(hidden, weight, target, 0.1, 0)
    grads = torch.autograd.grad(got, (hidden, weight))
    rel = 1e-5 if autocast_dtype is None else 2e-3
    assert got.item() == pytest.approx(reference.item(), rel=rel)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g.double(), g_ref.double(), rtol=rel, atol=rel * g_ref.abs().max().item())


# --------------------------------------------------------------------------- R-Drop
def test_rdrop_reference_by_hand():
    """One position, three classes: (CE_a + CE_b) / 2 + alpha / 4 * (KL(a||b) + KL(b||a)) written out."""
    import math

    za, zb, y, eps, alpha = [1.0, -0.5, 2.0], [0.3, 0.9, -1.2], 2, 0.1, 3.0

    def probs(z):
        e = [math.exp(v) for v in z]
        return [v / sum(e) for v in e]

    pa, pb = probs(za), probs(zb)
    q = [eps / 3 + (1 - eps) * (c == y) for c in range(3)]
    ce = [-sum(qc * math.log(pc) for qc, pc in zip(q, p)) for p in (pa, pb)]
    kl_ab = sum(a * math.log(a / b) for a, b in zip(pa, pb))
    kl_ba = sum(b * math.log(b / a) for a, b in zip(pa, pb))
    expected = 0.5 * (ce[0] + ce[1]) + alpha / 4 * (kl_ab + kl_ba)
    got = rdrop_cross_entropy(
        torch.tensor([za], dtype=torch.float64),
        torch.tensor([zb], dtype=torch.float64),
        torch.tensor([y]),
        eps,
        -1,
        alpha,
    )
    assert got.item() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("alpha", [0.0, 1.0, 5.0])
@pytest.mark.parametrize("chunk_rows", [1, 7, 4096])
def test_fused_rdrop_loss_and_gradients_match_torch(smoothing, alpha, chunk_rows):
    torch.manual_seed(4)
    hidden_a = torch.randn(4, 9, 16, dtype=torch.float64, requires_grad=True)
    hidden_b = (hidden_a.detach() + 0.5 * torch.randn(4, 9, 16, dtype=torch.float64)).requires_grad_()
    weight = torch.randn(30, 16, dtype=torch.float64, requires_grad=True)
    target = torch.randint(1, 30, (4, 9))
    target[1, 5:] = 0
    target[3, :] = 0
    inputs = (hidden_a, hidden_b, weight)
    reference = rdrop_cross_entropy(hidden_a @ weight.T, hidden_b @ weight.T, target, smoothing, 0, alpha)
    grads_ref = torch.autograd.grad(reference * 0.37, inputs)
    got = fused_linear_rdrop_cross_entropy(
        hidden_a, hidden_b, weight, target, smoothing, 0, alpha, chunk_rows=chunk_rows
    )
    grads = torch.autograd.grad(got * 0.37, inputs)
    # the fused loss makes its logits in float32
    assert got.item() == pytest.approx(reference.item(), rel=1e-6)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-4)
    assert grads[0][3].abs().max() == 0 and grads[1][3].abs().max() == 0
    if alpha == 0.0:  # no KL: the mean of the two passes' plain losses
        plain = [_reference(h, weight, target, smoothing, 0) for h in (hidden_a, hidden_b)]
        assert got.item() == pytest.approx(0.5 * float((plain[0] + plain[1]).detach()), rel=1e-6)


def test_fused_rdrop_loss_under_bf16_autocast_is_close_to_float32():
    torch.manual_seed(5)
    hidden_a, hidden_b = torch.randn(300, 32), torch.randn(300, 32)
    weight = torch.randn(64, 32, requires_grad=True)
    target = torch.randint(1, 64, (300,))
    reference = rdrop_cross_entropy(hidden_a @ weight.T, hidden_b @ weight.T, target, 0.1, 0, 3.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fused_linear_rdrop_cross_entropy(hidden_a, hidden_b, weight, target, 0.1, 0, 3.0)
    got.backward()
    assert got.dtype == torch.float32 and weight.grad.dtype == torch.float32
    assert got.item() == pytest.approx(reference.item(), rel=2e-2)
    with pytest.raises(ValueError, match="disagree on positions"):
        fused_linear_rdrop_cross_entropy(hidden_a, hidden_b[:2], weight, target, 0.1, 0, 3.0)


def check_transformer_rdrop_loss(model, src, tgt_in, tgt_out, pad_id):
    """The model's R-Drop loss and gradients against the reference on the logits of the stacked batch
    drawn with the same random stream (also run on the GPU by tests/test_cuda.py)."""
    torch.manual_seed(7)
    got = model.loss(src, tgt_in, tgt_out, label_smoothing=0.1, rdrop=2.0)
    grads = torch.autograd.grad(got, list(model.parameters()))
    torch.manual_seed(7)
    logits_a, logits_b = model(torch.cat([src, src]), torch.cat([tgt_in, tgt_in])).chunk(2)
    assert (logits_a - logits_b).abs().max() > 0.1  # each copy drew its own dropout
    reference = rdrop_cross_entropy(logits_a, logits_b, tgt_out, 0.1, pad_id, 2.0)
    grads_ref = torch.autograd.grad(reference, list(model.parameters()))
    assert got.item() == pytest.approx(reference.item(), rel=1e-5)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, atol=2e-5, rtol=1e-4)


def test_transformer_rdrop_loss_runs_two_dropout_passes():
    """With dropout the two copies differ, and the loss is R-Drop's reference on the logits of the
    stacked batch drawn with the same random stream; without dropout it is the plain loss."""
    config, model, src, tgt_in, tgt_out = _tiny_transformer_and_batch(dropout=0.3, seed=6)
    check_transformer_rdrop_loss(model, src, tgt_in, tgt_out, config.pad_id)
    model.eval()
    plain = model.loss(src, tgt_in, tgt_out, label_smoothing=0.1)
    assert model.loss(src, tgt_in, tgt_out, label_smoothing=0.1, rdrop=2.0).item() == pytest.approx(
        plain.item(), rel=1e-5
    )


@pytest.mark.parametrize("vocab", [20, 100])  # below and above d_model: the plain and the fused path
def test_causal_lm_rdrop_loss_against_the_reference(vocab):
    from qkv.models.causal_lm import IGNORE, CausalLM, CausalLMConfig

    config = CausalLMConfig(vocab_size=vocab, d_model=32, num_heads=4, num_layers=2, d_ff=64, context=16, dropout=0.2)
    torch.manual_seed(8)
    model = CausalLM(config)
    ids = torch.randint(0, vocab, (3, 16))
    targets = torch.roll(ids, -1, dims=1)
    targets[2, 10:] = IGNORE
    torch.manual_seed(9)
    got = model.loss(ids, targets, label_smoothing=0.1, rdrop=1.5)
    torch.manual_seed(9)
    logits_a, logits_b = model(torch.cat([ids, ids])).logits.chunk(2)
    reference = rdrop_cross_entropy(logits_a, logits_b, targets, 0.1, IGNORE, 1.5)
    assert got.item() == pytest.approx(reference.item(), rel=1e-5)

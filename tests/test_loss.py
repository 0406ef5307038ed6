"""The fused output projection + label-smoothed loss against PyTorch's F.cross_entropy on logits (R-Drop's
loss, a training objective, is tested in tests/test_training_objectives.py)."""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from qkv.models.transformer import Transformer, TransformerConfig
from qkv.nn.loss import fused_linear_cross_entropy, label_smoothed_cross_entropy


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


def test_starting_qkv_does_not_import_the_compiler():
    """The fused losses are left out of compiled graphs by a decorator made at their first call:
    importing torch._dynamo at start-up took 2.6 of the 6.5 s every ``qkv`` command spent starting
    (2-core EPYC). Building every subcommand's parser imports every subcommand's module."""
    code = "import sys, qkv.cli; qkv.cli.build_parser(None, every=True); print('torch._dynamo' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"

"""The fast decoding path (qkv.decoding.steps.FastSteps, qkv.decoding.packed_linear) against the plain one:
PackedLinear = F.linear, FastSteps' logits = Transformer.decode's step by step (row selection included),
greedy/beam outputs = the plain path's, and the plain path wherever the fast one does not apply."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import qkv.decoding.packed_linear as packed_linear
import qkv.decoding.steps as steps
from qkv.attention.backends import use_backend
from qkv.data.batching import pad_sequences
from qkv.decoding.ensemble import Ensemble
from qkv.decoding.packed_linear import PackedLinear, fuse
from qkv.decoding.search import argmax_rows, beam_search, greedy_decode
from qkv.decoding.steps import FastSteps, PlainSteps, decoder_steps
from qkv.models.transformer import Transformer, TransformerConfig
from qkv.nn.layers import ACTIVATIONS

BOS, EOS = 1, 2
packs = torch.backends.mkldnn.is_available() and packed_linear._pack(torch.randn(4, 4)) is not None


@pytest.fixture
def pack_everything(monkeypatch):
    monkeypatch.setattr(packed_linear, "MIN_WEIGHT", 1)  # small test weights are packed too


@pytest.mark.parametrize("rows,inputs,outputs", [(1, 8, 3), (16, 256, 256), (5, 64, 1000), (80, 96, 48)])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_equals_f_linear(pack_everything, rows, inputs, outputs, bias):
    w, b, x = torch.randn(outputs, inputs) * 0.1, torch.randn(outputs) if bias else None, torch.randn(rows, inputs)
    layer = PackedLinear(w, b)
    assert (layer.packed is not None) == packs  # where oneDNN is there, the packed product is what runs
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, w, b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("pack", [True, False])
def test_packed_linear_with_its_activation_equals_the_layers_activation(pack_everything, monkeypatch, activation, pack):
    """The activation oneDNN computes in the product's pass (packed) or after it (not): the feed-forward
    network's own, ``ACTIVATIONS[name](F.linear(x, w, b))``."""
    monkeypatch.setattr(packed_linear, "PACK", pack)
    w, b, x = torch.randn(1024, 256) * 0.05, torch.randn(1024), torch.randn(16, 256)
    layer = PackedLinear(w, b, activation=activation)
    assert (layer.packed is not None) == (pack and packs)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), ACTIVATIONS[activation](F.linear(x, w, b)), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="unknown activation 'swish'"):
        PackedLinear(w, b, activation="swish")


def test_a_weight_is_packed_again_once_it_changes(pack_everything):
    w, x = torch.randn(40, 24), torch.randn(6, 24)
    PackedLinear(w)
    with torch.no_grad():
        w.mul_(-2.0)  # in place, as an optimizer step or load_state_dict changes a weight
    torch.testing.assert_close(PackedLinear(w)(x), F.linear(x, w), atol=1e-5, rtol=1e-5)
    w.data = torch.randn(40, 24)
    torch.testing.assert_close(PackedLinear(w)(x), F.linear(x, w), atol=1e-5, rtol=1e-5)


def test_fused_products_equal_separate_ones(pack_everything):
    pairs = [(torch.randn(24, 16), torch.randn(24)), (torch.randn(8, 16), None), (torch.randn(24, 16), torch.randn(24))]
    x = torch.randn(7, 16)
    want = torch.cat([F.linear(x, w, b) for w, b in pairs], dim=1)
    torch.testing.assert_close(fuse(*pairs)(x), want, atol=1e-5, rtol=1e-5)


def test_packed_linear_falls_back_to_f_linear(pack_everything, monkeypatch):
    w, b, x = torch.randn(32, 16), torch.randn(32), torch.randn(4, 16)
    monkeypatch.setattr(packed_linear, "_pack", lambda weight: None)  # no oneDNN operator
    assert PackedLinear(w, b).packed is None
    torch.testing.assert_close(PackedLinear(w, b)(x), F.linear(x, w, b))
    monkeypatch.setattr(packed_linear, "_pack", lambda weight: weight)  # a "packed" weight the product refuses

    def refuse(*args):
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(packed_linear, "_packed_product", refuse)
    layer = PackedLinear(w, b)
    assert layer.packed is None
    torch.testing.assert_close(layer(x), F.linear(x, w, b))
    monkeypatch.setattr(
        packed_linear, "_packed_product", lambda x, packed, bias, act=None: F.linear(x, packed, bias) + 1
    )
    assert PackedLinear(w, b).packed is None  # a product that disagrees on the probe is not used


def _model(seed: int, **options) -> Transformer:
    torch.manual_seed(seed)
    config = dict(src_vocab_size=50, tgt_vocab_size=60, d_model=32, num_heads=4, num_encoder_layers=2)
    config |= dict(num_decoder_layers=2, d_ff=48, dropout=0.1, max_len=40) | options
    return Transformer(TransformerConfig(**config)).eval()


MODELS = [
    dict(),
    dict(norm_first=True, activation="relu", positional="learned", tie_output=False),
    dict(bias=False, activation="gelu_tanh", share_embeddings=True, tgt_vocab_size=50),
]


def _sources(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 9, 5, 1, 7]
    return pad_sequences([(torch.randint(3, 50, (n,), generator=g).tolist()) + [EOS] for n in lengths], 0)


@pytest.mark.parametrize("options", MODELS)
def test_fast_steps_equal_plain_steps_with_row_selection(pack_everything, options):
    model, src = _model(1, **options), _sources(2)
    with torch.inference_mode():
        memory = model.encode(src)
        fast, plain = decoder_steps(model, memory), PlainSteps(model, memory)
        assert isinstance(fast, FastSteps)
        tokens = torch.full((src.size(0), 1), BOS)
        for step in range(6):
            got, want = fast(tokens), plain(tokens)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
            tokens = torch.cat([tokens, want.argmax(-1, keepdim=True)], dim=1)
            if step == 2:  # beams reordered and repeated, the memory left as it is
                index = torch.tensor([4, 4, 0, 2, 1])
                fast.select(index, None)
                plain.select(index, None)
                tokens = tokens[index]
            if step == 4:  # rows leave: the memory follows
                index = torch.tensor([3, 1])
                fast.select(index, index)
                plain.select(index, index)
                tokens = tokens[index]


@pytest.mark.parametrize("options", MODELS)
def test_greedy_and_beam_equal_the_plain_path(options, monkeypatch):
    model, src = _model(4, **options), _sources(5)
    fast_greedy = greedy_decode(model, src, bos_id=BOS, eos_id=EOS, extra_len=8)
    fast_beam = beam_search(model, src, bos_id=BOS, eos_id=EOS, beam_size=3, extra_len=8, return_all=True)
    monkeypatch.setattr(steps, "FAST", False)
    assert fast_greedy == greedy_decode(model, src, bos_id=BOS, eos_id=EOS, extra_len=8)
    plain_beam = beam_search(model, src, bos_id=BOS, eos_id=EOS, beam_size=3, extra_len=8, return_all=True)
    for got, want in zip(fast_beam, plain_beam, strict=True):
        assert [h.tokens for h in got] == [h.tokens for h in want]
        assert [h.score for h in got] == pytest.approx([h.score for h in want], abs=1e-4)
    assert fast_greedy == greedy_decode(model, src, bos_id=BOS, eos_id=EOS, extra_len=8, use_cache=False)


def test_plain_steps_wherever_the_fast_ones_do_not_apply():
    model, src = _model(6), _sources(7)
    with torch.inference_mode():
        memory = model.encode(src)
        assert isinstance(decoder_steps(model, memory), FastSteps)
        assert type(decoder_steps(model, memory, use_cache=False)) is PlainSteps
        with use_backend("reference"):
            assert type(decoder_steps(model, memory)) is PlainSteps
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert type(decoder_steps(model, memory)) is PlainSteps
        handle = model.decoder.layers[1].cross_attn.register_forward_hook(lambda *args: None)
        assert type(decoder_steps(model, memory)) is PlainSteps  # a hook that records a layer must see it run
        handle.remove()
        ensemble = Ensemble([model, _model(8)])
        assert type(decoder_steps(ensemble, ensemble.encode(src))) is PlainSteps
        model.train()
        assert type(decoder_steps(model, memory)) is PlainSteps
        model.eval()
        double = _model(6).double()
        assert type(decoder_steps(double, double.encode(src))) is PlainSteps


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 20),
    vocab=st.sampled_from([128, 256, 8000, 100, 33, 1]),
    levels=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_argmax_rows_equals_torch_argmax_ties_included(rows, vocab, levels, seed):
    """A few distinct values per row (so that ties are common): the same index as ``argmax``, the first."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, levels, (rows, vocab), generator=g).float() - 2.5
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    x[0, vocab // 2] = float("nan")  # argmax's rule: a NaN counts as the maximum
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))

"""qkv.decoding.inference.InferenceModel against the model's own encode/decode, for every layer variant qkv
has: post-LN and pre-LN (with its final norms), each activation, each positional kind, tied and untied
output projections, with and without biases; padded sources, beams with sentences leaving; and decoding
after a fused AdamW step, with an object built after it."""

import pytest
import torch

import qkv.decoding.packed_linear as packed_linear
from qkv.data.batching import pad_sequences
from qkv.decoding.inference import InferenceModel
from qkv.decoding.search import beam_search, greedy_decode
from qkv.models.transformer import Transformer, TransformerConfig

BOS, EOS = 1, 2

VARIANTS = [
    dict(norm_first=False, activation="relu", positional="sinusoidal", tie_output=True),
    dict(norm_first=True, activation="relu", positional="learned", tie_output=False),
    dict(norm_first=False, activation="gelu", positional="none", tie_output=False),
    dict(norm_first=True, activation="gelu", positional="sinusoidal", tie_output=True, bias=False),
    dict(norm_first=False, activation="gelu_tanh", positional="learned", tie_output=True),
    dict(norm_first=True, activation="gelu_tanh", positional="none", tie_output=False, share_embeddings=True),
    # the parts of today's models, in the encoder-decoder too
    dict(norm_first=True, activation="swiglu", positional="sinusoidal", norm="rms", num_kv_heads=2, bias=False),
    dict(norm_first=False, activation="geglu", positional="learned", num_kv_heads=1),
    dict(norm_first=True, activation="relu2", positional="none", norm="rms", tie_output=False),
    dict(norm_first=True, activation="silu", positional="sinusoidal", num_kv_heads=2),
]


@pytest.fixture(autouse=True)
def pack_everything(monkeypatch):
    monkeypatch.setattr(packed_linear, "MIN_WEIGHT", 1)  # small test weights are packed too


def _model(seed: int, **options) -> Transformer:
    torch.manual_seed(seed)
    config = dict(src_vocab_size=50, tgt_vocab_size=50, d_model=32, num_heads=4, num_encoder_layers=2)
    config |= dict(num_decoder_layers=2, d_ff=48, dropout=0.1, max_len=40) | options
    return Transformer(TransformerConfig(**config)).eval()


def _sources(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return pad_sequences([torch.randint(3, 50, (n,), generator=g).tolist() + [EOS] for n in (3, 9, 5, 1, 7)], 0)


@pytest.mark.parametrize("options", VARIANTS)
def test_memory_and_every_steps_logits_equal_the_models_own(options):
    """Teacher-forced: the inference object's memory is model.encode's (padded positions too) and its
    logits at each step are model.decode's over the whole prefix (no cache on the reference side)."""
    model, src = _model(1, **options), _sources(2)
    inference = InferenceModel.build(model)
    g = torch.Generator().manual_seed(3)
    tgt = torch.cat([torch.full((src.size(0), 1), BOS), torch.randint(3, 50, (src.size(0), 6), generator=g)], 1)
    with torch.inference_mode():
        memory, want_memory = inference.encode(src), model.encode(src)
        torch.testing.assert_close(memory.hidden, want_memory.hidden, atol=1e-5, rtol=1e-5)
        assert torch.equal(memory.key_padding_mask, want_memory.key_padding_mask)
        want = model.decode(tgt, want_memory).logits  # (b, t, V)
        steps = inference.steps(memory)
        for t in range(tgt.size(1)):
            torch.testing.assert_close(steps(tgt[:, : t + 1]), want[:, t], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("options", VARIANTS)
def test_greedy_and_beam_equal_the_models_own_decoding(options):
    """Greedy and beam 3 (sentences leaving the batch as they finish) through the inference object give
    the ids and scores of the plain path without a cache (the model's own decode, the whole prefix)."""
    model, src = _model(4, **options), _sources(5)
    inference = InferenceModel.build(model)
    kw = dict(bos_id=BOS, eos_id=EOS, extra_len=8)
    assert greedy_decode(inference, src, **kw) == greedy_decode(model, src, use_cache=False, **kw)
    got = beam_search(inference, src, beam_size=3, return_all=True, **kw)
    want = beam_search(model, src, beam_size=3, return_all=True, use_cache=False, **kw)
    for hyps, plain in zip(got, want, strict=True):
        assert [h.tokens for h in hyps] == [h.tokens for h in plain]
        assert [h.score for h in hyps] == pytest.approx([h.score for h in plain], abs=1e-4)


@pytest.mark.parametrize("pack", [True, False])
def test_an_object_built_after_a_fused_adamw_step_decodes_with_the_new_weights(monkeypatch, pack):
    """torch's fused AdamW changes the weights in place without bumping their version counters. An
    object built after the step computes the updated model's logits, which differ from the logits before;
    the object built before keeps the old weights (it is a snapshot), with nothing bumped anywhere."""
    monkeypatch.setattr(packed_linear, "PACK", pack)
    model, src = _model(6), _sources(7)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    tgt = torch.full((src.size(0), 1), BOS)
    before = InferenceModel.build(model)
    with torch.inference_mode():
        old = before.steps(before.encode(src))(tgt)
    model.train()
    logits = model(src, torch.cat([tgt, tgt], 1))
    logits.logsumexp(-1).mean().backward()
    optimizer.step()
    after = InferenceModel.build(model)  # eval mode again
    with torch.inference_mode():
        new = after.steps(after.encode(src))(tgt)
        want = model.decode(tgt, model.encode(src)).logits[:, -1]
        torch.testing.assert_close(new, want, atol=1e-4, rtol=1e-4)
        assert not torch.allclose(new, old, atol=1e-3)
        # the products built before are a snapshot (the embeddings, modules, are the model's own)
        assert not torch.allclose(before.project(torch.ones(1, 32)), after.project(torch.ones(1, 32)))


def test_build_refuses_what_is_not_a_transformer():
    with pytest.raises(ValueError, match="needs a qkv Transformer, got Linear"):
        InferenceModel.build(torch.nn.Linear(2, 2))  # type: ignore[arg-type]

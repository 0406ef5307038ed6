"""The fast decoding path (qkv.decoding.inference.InferenceModel, qkv.decoding.packed_linear) against the
plain one: PackedLinear = F.linear, the inference object's logits = Transformer.decode's step by step (row
selection included), its memory = Transformer.encode's, greedy/beam outputs = the plain path's, and the
plain path wherever the fast one does not apply. tests/test_inference_model.py covers every layer variant."""

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
from qkv.decoding.inference import InferenceModel, InferenceSteps
from qkv.decoding.packed_linear import PackedLinear, fuse
from qkv.decoding.search import argmax_rows, beam_search, greedy_decode
from qkv.decoding.steps import PlainSteps, decoder_steps, encode, for_decoding
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


@pytest.mark.parametrize("pack", [True, False])
def test_a_packed_product_keeps_the_weights_it_was_built_with(pack_everything, monkeypatch, pack):
    """A product is a snapshot: a weight changed in place afterwards (an optimizer step) changes nothing in
    it, packed or not; a product built after the change computes with the new values."""
    monkeypatch.setattr(packed_linear, "PACK", pack)
    w, b, x = torch.randn(40, 24), torch.randn(40), torch.randn(6, 24)
    before, want_before = PackedLinear(w, b), F.linear(x, w, b)
    with torch.no_grad():
        w.mul_(-2.0)
        b.add_(1.0)
    torch.testing.assert_close(before(x), want_before, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(PackedLinear(w, b)(x), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(before(x), F.linear(x, w, b))


def test_fused_products_equal_separate_ones(pack_everything):
    pairs = [(torch.randn(24, 16), torch.randn(24)), (torch.randn(8, 16), None), (torch.randn(24, 16), torch.randn(24))]
    x = torch.randn(7, 16)
    want = torch.cat([F.linear(x, w, b) for w, b in pairs], dim=1)
    torch.testing.assert_close(fuse(*pairs)(x), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("capability,packs_all", [("AVX512", True), ("AMX", True), ("AVX2", False), ("DEFAULT", False)])
def test_every_weight_is_packed_where_the_cpu_has_avx512(monkeypatch, capability, packs_all):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    assert packed_linear._wide_vectors() == packs_all


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
        fast, plain = decoder_steps(InferenceModel.build(model), memory), PlainSteps(model, memory)
        assert isinstance(fast, InferenceSteps)
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
def test_fast_encoder_equals_transformer_encode(pack_everything, options):
    model, src = _model(3, **options), _sources(4)
    with torch.inference_mode():
        got, want = encode(InferenceModel.build(model), src), model.encode(src)
    assert torch.equal(got.key_padding_mask, want.key_padding_mask) and got.attentions is None
    torch.testing.assert_close(got.hidden, want.hidden, atol=1e-5, rtol=1e-5)  # padded positions too


def test_a_plain_model_is_decoded_by_its_own_modules_wherever_the_fast_path_does_not_apply():
    """Autocast, training mode, float64, an ensemble, no cache: the model's own encode/decode run (a hook on
    an encoder layer sees them); a float32 model in eval mode on the CPU gets an InferenceModel."""
    model, src = _model(9), _sources(10)
    calls: list[str] = []
    with torch.inference_mode():
        assert isinstance(for_decoding(model), InferenceModel)
        assert for_decoding(model, use_cache=False) is model
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert for_decoding(model) is model
        model.train()
        assert for_decoding(model) is model
        model.eval()
        double = _model(9).double()
        assert for_decoding(double) is double
        handle = double.encoder.layers[0].register_forward_hook(lambda *args: calls.append("hook"))
        greedy_decode(double, src, bos_id=BOS, eos_id=EOS, extra_len=2)
        handle.remove()
        assert calls == ["hook"]
        ensemble = Ensemble([model, _model(8)])
        assert for_decoding(ensemble) is ensemble
        torch.testing.assert_close(encode(ensemble, src).hidden, ensemble.encode(src).hidden)


def test_the_inference_model_honours_a_forced_reference_backend(monkeypatch):
    """Inside use_backend("reference") the inference object's attention is the eager reference (the spec),
    and its memory and logits stay the model's."""
    import qkv.attention.functional as functional

    model, src = _model(9), _sources(10)
    calls: list[int] = []
    reference = functional.attention_reference

    def counted(*args):
        calls.append(1)
        return reference(*args)

    monkeypatch.setattr(functional, "attention_reference", counted)  # the module's attend runs it, fast path too
    inference = InferenceModel.build(model)
    with torch.inference_mode():
        inference.encode(src)
        assert not calls
        with use_backend("reference"):
            got = inference.encode(src)
            steps_fast, tokens = inference.steps(got), torch.full((src.size(0), 1), BOS)
            logits = steps_fast(tokens)
        assert len(calls) == model.config.num_encoder_layers + 2 * model.config.num_decoder_layers
        torch.testing.assert_close(got.hidden, model.encode(src).hidden, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logits, PlainSteps(model, model.encode(src))(tokens), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("options", MODELS)
def test_fast_steps_equal_plain_steps_with_beams_sharing_a_memory_row(pack_everything, options):
    """Beam search's selections: each sentence's row repeated k times (the memory too), beams reordered
    within their sentence, a sentence leaving. FastSteps keeps the memory once per sentence and
    attends with the k beams as k queries; the logits stay the plain path's."""
    model, src = _model(11, **options), _sources(12)
    k, b = 3, src.size(0)
    with torch.inference_mode():
        memory = model.encode(src)
        fast, plain = InferenceModel.build(model).steps(memory), PlainSteps(model, memory)
        tokens = torch.full((b, 1), BOS)
        beams = torch.arange(b).repeat_interleave(k)
        selections = [
            (beams, beams),  # every sentence's row k times
            (torch.tensor([2, 0, 0, 3, 4, 5, 8, 8, 7, 9, 10, 11, 14, 13, 12]), None),  # beams within a sentence
            (torch.tensor([0, 1, 2, 6, 7, 8, 12, 13, 14]), torch.tensor([0, 1, 2, 6, 7, 8, 12, 13, 14])),  # 1, 3 leave
            (torch.tensor([1, 1, 1, 3, 4, 5, 6, 7, 8]), None),
            (torch.tensor([4, 7]), torch.tensor([4, 7])),  # a row of two sentences each: a memory row a row
        ]
        for index, memory_index in selections:
            got, want = fast(tokens), plain(tokens)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
            tokens = torch.cat([tokens, want.argmax(-1, keepdim=True)], dim=1)[index]
            fast.select(index, memory_index)
            plain.select(index, memory_index)
            if memory_index is beams:
                assert fast.layers[0][1].rows == b  # once per sentence, not k times
        assert fast.layers[0][1].rows == 2
        torch.testing.assert_close(fast(tokens), plain(tokens), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("options", MODELS)
def test_greedy_and_beam_equal_the_plain_path(options, monkeypatch):
    model, src = _model(4, **options), _sources(5)
    fast_greedy = greedy_decode(model, src, bos_id=BOS, eos_id=EOS, extra_len=8)
    fast_beam = beam_search(model, src, bos_id=BOS, eos_id=EOS, beam_size=3, extra_len=8, return_all=True)
    monkeypatch.setattr(steps, "applies", lambda model: False)  # the model's own decode, with its cache
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
        inference = InferenceModel.build(model)
        assert isinstance(decoder_steps(inference, memory), InferenceSteps)
        assert type(decoder_steps(inference, memory, use_cache=False)) is PlainSteps
        assert type(decoder_steps(model, memory)) is PlainSteps  # a plain model: its own decode
        ensemble = Ensemble([model, _model(8)])
        assert type(decoder_steps(ensemble, ensemble.encode(src))) is PlainSteps


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


def test_the_fast_path_decodes_with_the_weights_of_now_after_training_steps(pack_everything, tmp_path):
    """Decoding between training steps (validation) builds an InferenceModel; the Trainer's fused AdamW then
    changes the weights in place, bumping no version counter. An InferenceModel built after the step
    computes the updated model's memory and logits (and no longer the old ones), with nothing bumped."""
    from qkv.data.dates import generate_dates
    from qkv.data.tokenizer import Tokenizer
    from qkv.training import TrainConfig, Trainer, TranslationTask

    torch.manual_seed(0)
    pairs = generate_dates(200, seed=3)
    tokenizer = Tokenizer.train(pairs.src + pairs.tgt, vocab_size=300, split_digits=True)
    config = TransformerConfig(
        src_vocab_size=tokenizer.vocab_size,
        tgt_vocab_size=tokenizer.vocab_size,
        d_model=32,
        num_heads=4,
        num_encoder_layers=1,
        num_decoder_layers=1,
        d_ff=48,
        dropout=0.0,
        max_len=48,
    )
    task = TranslationTask(tokenizer, pairs, None, max_len=config.max_len, pad_id=config.pad_id)
    train = TrainConfig(max_tokens=800, warmup_steps=5, max_steps=1, progress=False)
    trainer = Trainer(Transformer(config), task, train, tmp_path)
    assert trainer.optimizer.defaults.get("fused")  # the case: weights changed without a version bump
    src = pad_sequences([tokenizer.encode(s, add_eos=True) for s in pairs.src[:6]], 0)
    batches = task.batches(0, train.max_tokens, 0)
    tokens = torch.full((src.size(0), 1), tokenizer.bos_id)
    before = None
    for n in range(3):
        trainer.step([task.make_batch(batches[n])])
        model = trainer.model.eval()
        with torch.inference_mode():
            inference = InferenceModel.build(model)
            memory, want = inference.encode(src), model.encode(src)
            torch.testing.assert_close(memory.hidden, want.hidden, atol=1e-5, rtol=1e-5)
            logits = inference.steps(memory)(tokens)
            torch.testing.assert_close(logits, PlainSteps(model, want)(tokens), atol=1e-4, rtol=1e-4)
            if before is not None:
                assert not torch.allclose(logits, before, atol=1e-4)  # the step changed what is decoded
            before = logits
        trainer.model.train()

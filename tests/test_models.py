"""Transformer, EncoderModel and CausalLM: invariants that any correct implementation satisfies."""

import math

import pytest
import torch

import qkv


def tiny_config(**overrides):
    base = dict(
        src_vocab_size=40,
        tgt_vocab_size=40,
        d_model=32,
        num_heads=4,
        num_encoder_layers=2,
        num_decoder_layers=2,
        d_ff=64,
        dropout=0.0,
        max_len=64,
    )
    base.update(overrides)
    return qkv.TransformerConfig(**base)


def ids(b, s, vocab=40):
    return torch.randint(1, vocab, (b, s))  # 0 is the pad id


def test_paper_base_defaults():
    c = qkv.TransformerConfig()
    assert (c.d_model, c.num_heads, c.num_encoder_layers, c.num_decoder_layers, c.d_ff, c.dropout) == (
        512,
        8,
        6,
        6,
        2048,
        0.1,
    )
    model = qkv.Transformer(qkv.TransformerConfig(src_vocab_size=37000, tgt_vocab_size=37000, share_embeddings=True))
    n_params = sum(p.numel() for p in model.parameters())
    assert 60e6 < n_params < 66e6  # the paper's base model has about 65M parameters (Table 3)


def test_embeddings_are_scaled_and_shared():
    model = qkv.Transformer(tiny_config(share_embeddings=True, positional="none")).eval()
    assert model.tgt_embed.embedding is model.src_embed.embedding
    assert model.output_proj.weight is model.src_embed.embedding.weight
    x = ids(1, 3)
    torch.testing.assert_close(model.src_embed(x), model.src_embed.embedding(x) * math.sqrt(32))


@pytest.mark.parametrize("norm_first", [False, True])
def test_future_target_tokens_do_not_change_earlier_outputs(norm_first):
    model = qkv.Transformer(tiny_config(norm_first=norm_first)).eval()
    src, tgt = ids(2, 6), ids(2, 8)
    changed = tgt.clone()
    changed[:, 5:] = ids(2, 3)
    a, b = model(src, tgt), model(src, changed)
    torch.testing.assert_close(a[:, :5], b[:, :5], atol=1e-6, rtol=0)
    assert not torch.allclose(a[:, 5:], b[:, 5:])


def test_padding_leaves_real_positions_unchanged():
    model = qkv.Transformer(tiny_config()).eval()
    src, tgt = ids(2, 6), ids(2, 5)
    padded_src = torch.cat([src, torch.zeros(2, 4, dtype=torch.long)], dim=1)
    padded_tgt = torch.cat([tgt, torch.zeros(2, 3, dtype=torch.long)], dim=1)
    base = model(src, tgt)
    padded = model(padded_src, padded_tgt)
    torch.testing.assert_close(padded[:, :5], base, atol=1e-5, rtol=0)
    enc, enc_padded = model.encode(src).hidden, model.encode(padded_src).hidden
    torch.testing.assert_close(enc_padded[:, :6], enc, atol=1e-5, rtol=0)


def test_batch_of_different_lengths_equals_one_by_one():
    model = qkv.Transformer(tiny_config()).eval()
    src = ids(2, 7)
    src[1, 4:] = 0
    tgt = ids(2, 5)
    batched = model(src, tgt)
    alone = model(src[1:, :4], tgt[1:])
    torch.testing.assert_close(batched[1:], alone, atol=1e-5, rtol=0)


def test_encoder_without_positions_is_permutation_equivariant():
    model = qkv.EncoderModel(tiny_config(positional="none")).eval()
    x = ids(2, 9)
    perm = torch.randperm(9)
    out = model(x).last_hidden_state
    out_perm = model(x[:, perm]).last_hidden_state
    torch.testing.assert_close(out_perm, out[:, perm], atol=1e-5, rtol=0)
    with_positions = qkv.EncoderModel(tiny_config(positional="sinusoidal")).eval()
    assert not torch.allclose(
        with_positions(x[:, perm]).last_hidden_state, with_positions(x).last_hidden_state[:, perm], atol=1e-3
    )


@pytest.mark.parametrize("norm_first", [False, True])
def test_cached_step_by_step_decoding_equals_full_decoding(norm_first):
    model = qkv.Transformer(tiny_config(norm_first=norm_first)).eval()
    src = ids(3, 7)
    src[2, 3:] = 0
    tgt = ids(3, 10)
    memory = model.encode(src)
    full = model.decode(tgt, memory, need_weights=True)
    cache, logits, cross = None, [], []
    for t in range(10):
        step = model.decode(tgt[:, t : t + 1], memory, cache=cache, need_weights=True)
        cache = step.cache
        logits.append(step.logits)
        cross.append(step.cross_attentions[-1])
    torch.testing.assert_close(torch.cat(logits, 1), full.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.cat(cross, 2), full.cross_attentions[-1], atol=1e-5, rtol=0)
    assert (full.cross_attentions[0][2, :, :, 3:] == 0).all()  # padded source keys get no weight


def test_need_weights_returns_every_layer():
    model = qkv.Transformer(tiny_config(num_encoder_layers=3)).eval()
    src, tgt = ids(2, 6), ids(2, 4)
    memory = model.encode(src, need_weights=True)
    dec = model.decode(tgt, memory, need_weights=True)
    assert [a.shape for a in memory.attentions] == [(2, 4, 6, 6)] * 3
    assert [a.shape for a in dec.self_attentions] == [(2, 4, 4, 4)] * 2
    assert [a.shape for a in dec.cross_attentions] == [(2, 4, 4, 6)] * 2
    torch.testing.assert_close(dec.logits, model(src, tgt), atol=1e-5, rtol=0)


def test_causal_lm_is_causal_and_learns():
    torch.manual_seed(0)
    model = qkv.CausalLM(
        qkv.CausalLMConfig(vocab_size=40, d_model=32, num_heads=4, num_layers=2, d_ff=64, context=32, dropout=0.0)
    )
    x = ids(2, 12)
    logits = model.eval()(x).logits
    changed = x.clone()
    changed[:, 8:] = ids(2, 4)
    torch.testing.assert_close(model(changed).logits[:, :8], logits[:, :8], atol=1e-6, rtol=0)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    seq = torch.arange(1, 13).repeat(4, 1)  # predictable: next token = current + 1
    for _ in range(60):
        logits = model(seq[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 40), seq[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.1


def test_config_round_trip_and_errors(tmp_path):
    config = tiny_config(norm_first=True)
    config.to_json(tmp_path / "config.json")
    assert qkv.TransformerConfig.from_json(tmp_path / "config.json") == config
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]  # written atomically, no temporaries left
    (tmp_path / "broken.json").write_text('{"d_model": 32,')  # a config cut short
    with pytest.raises(ValueError, match=r"broken\.json: not valid JSON"):
        qkv.TransformerConfig.from_json(tmp_path / "broken.json")
    with pytest.raises(ValueError, match=r"d_model \(30\) must be divisible by num_heads \(4\)"):
        tiny_config(d_model=30)
    with pytest.raises(ValueError, match="share_embeddings needs one vocabulary"):
        tiny_config(share_embeddings=True, tgt_vocab_size=41)
    with pytest.raises(ValueError, match="unknown TransformerConfig fields"):
        qkv.TransformerConfig.from_dict({"d_modle": 3})
    model = qkv.Transformer(tiny_config(max_len=8)).eval()
    with pytest.raises(ValueError, match="max_len=8"):
        model(ids(1, 9), ids(1, 3))
    with pytest.raises(ValueError, match=r"token ids must be \(batch, seq\)"):
        model(ids(1, 5)[0], ids(1, 3))


@pytest.mark.parametrize("vocab", [40, 100])  # below d_model: plain product; above: the fused loss
def test_causal_lm_loss_equals_cross_entropy_of_its_logits(vocab):
    torch.manual_seed(0)
    model = qkv.CausalLM(
        qkv.CausalLMConfig(vocab_size=vocab, d_model=64, num_heads=4, num_layers=2, d_ff=64, context=16, dropout=0.0)
    )
    x, y = torch.randint(0, vocab, (3, 16)), torch.randint(0, vocab, (3, 16))
    y[0, :5] = -100  # nothing predicted there
    loss = model.loss(x, y, label_smoothing=0.1)
    reference = torch.nn.functional.cross_entropy(
        model(x).logits.reshape(-1, vocab), y.reshape(-1), ignore_index=-100, label_smoothing=0.1, reduction="sum"
    )
    torch.testing.assert_close(loss, reference, atol=1e-4, rtol=1e-5)
    grads = torch.autograd.grad(loss, model.token_embedding.weight)[0]
    expected = torch.autograd.grad(reference, model.token_embedding.weight)[0]
    torch.testing.assert_close(grads, expected, atol=1e-5, rtol=1e-4)

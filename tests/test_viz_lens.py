"""The logit lens (qkv.viz.lens), checked against computations written here: a small random GPT-2 saved
with save_pretrained, loaded through qkv.load_pretrained, against transformers' GPT2LMHeadModel
(output_hidden_states=True, then its ln_f and lm_head by hand); a small translation model against a
decoder forward pass written out by hand from its weights (post-LN and pre-LN)."""

from __future__ import annotations

import argparse
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from test_gpt2 import make_gpt2_folder, train_tokenizer

import qkv
import qkv.viz.lens
from qkv import Transformer, TransformerConfig
from qkv.viz import CausalLMExplorer, check_data, explorer_data
from qkv.viz.lens import TOP_K, causal_lm_lens, decoder_lens

transformers = pytest.importorskip("transformers")
TEXT = "The quick brown fox jumps over the lazy dog."


class WordTokenizer:
    """Whitespace words of a fixed list (as tests/test_browser.py's), for a small translation model."""

    pad_id, bos_id, eos_id, unk_id = 0, 1, 2, 3

    def __init__(self, words):
        self.words = ["<pad>", "<s>", "</s>", "<unk>", *words]
        self.index = {w: i for i, w in enumerate(self.words)}

    def encode(self, text, *, add_bos=False, add_eos=False):
        ids = [self.index.get(w, 3) for w in text.split()]
        return ([1] if add_bos else []) + ids + ([2] if add_eos else [])

    def decode(self, ids):
        return " ".join(self.words[int(i)] for i in ids if int(i) > 3)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """(transformers' model, qkv's CausalLM loaded from the same folder, its explorer)."""
    folder = tmp_path_factory.mktemp("gpt2")
    hf = make_gpt2_folder(folder, train_tokenizer())
    model = qkv.load_pretrained(folder, device="cpu")
    return hf, model, CausalLMExplorer(model=model, tokenizer=model.tokenizer, name="tiny-gpt2")


def check_against(lens: dict, reference: torch.Tensor, next_ids: list[int | None]) -> None:
    """``lens`` lists, at every depth and position, the top tokens of ``reference (L + 1, s, V)``
    (probabilities) with their probabilities, and the next token's probability."""
    depth, s, _ = reference.shape
    assert len(lens["layers"]) == depth and len(lens["positions"]) == s
    ids = lens["token_ids"]
    for layer in range(depth):
        for i in range(s):
            listed = [ids[n] for n in lens["top"][layer][i]]
            got = lens["probs"][layer][i]
            assert len(listed) == TOP_K == len(set(listed))
            want = reference[layer, i]
            assert got == pytest.approx(want[listed].tolist(), rel=1e-3, abs=1e-7), (layer, i)
            assert got == sorted(got, reverse=True)
            others = torch.ones_like(want, dtype=torch.bool)
            others[listed] = False
            assert float(want[listed].min()) >= float(want[others].max()) - 1e-6  # the k largest (ties aside)
            if next_ids[i] is None:
                assert lens["next_probs"][layer][i] is None and lens["next"][i] is None
            else:
                assert lens["next_probs"][layer][i] == pytest.approx(float(want[next_ids[i]]), rel=1e-3, abs=1e-7)


def test_logit_lens_matches_gpt2_hidden_states_through_ln_f_and_lm_head(gpt2, monkeypatch):
    hf, model, explorer = gpt2
    ids = model.tokenizer.encode(TEXT)
    example = explorer.example(TEXT)
    check_data(explorer_data([example]))
    lens = example["lens"]
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True)
        hidden = out.hidden_states  # embeddings, then each block's output; the last already through ln_f
        layers = hf.config.n_layer
        assert len(hidden) == layers + 1
        logits = [hf.lm_head(hf.transformer.ln_f(h[0])) for h in hidden[:-1]] + [hf.lm_head(hidden[-1][0])]
        reference = torch.softmax(torch.stack(logits).double(), dim=-1)  # (L + 1, s, V)
    assert torch.allclose(torch.stack(logits)[-1], out.logits[0], atol=1e-5)  # the last depth is the output
    assert lens["layers"] == ["embeddings", "layer 0", "layer 1"]
    assert lens["positions"] == example["views"][0]["queries"]
    check_against(lens, reference, [*ids[1:], None])
    assert lens["next"][:-1] == explorer._labels(ids[1:])
    assert lens["vocabulary"] == explorer._labels(lens["token_ids"])
    # the candidates at the last position are the model's most likely next tokens
    best = int(out.logits[0, -1].argmax())
    assert lens["token_ids"][lens["top"][-1][-1][0]] == best
    assert lens["first"] == 0
    # a text longer than MAX_POSITIONS: its last positions
    monkeypatch.setattr(qkv.viz.lens, "MAX_POSITIONS", 4)
    short = causal_lm_lens(model, torch.tensor([ids]), explorer._labels)
    assert short["first"] == len(ids) - 4 and short["positions"] == lens["positions"][-4:]
    check_against(short, reference[:, -4:], [*ids[-3:], None])


def linear(x, module):
    return x @ module.weight.T + (0 if module.bias is None else module.bias)


def attend(attn, q_in, kv_in, causal):
    h, d = attn.num_heads, q_in.size(-1)
    dh = d // h
    q = linear(q_in, attn.q_proj).view(-1, h, dh).transpose(0, 1)  # (h, s_q, dh)
    k = linear(kv_in, attn.k_proj).view(-1, h, dh).transpose(0, 1)
    v = linear(kv_in, attn.v_proj).view(-1, h, dh).transpose(0, 1)
    scores = q @ k.transpose(1, 2) / math.sqrt(dh)
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), -math.inf)
    merged = (torch.softmax(scores, dim=-1) @ v).transpose(0, 1).reshape(-1, d)
    return linear(merged, attn.out_proj)


def norm(x, ln):
    mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    return (x - mean) / torch.sqrt(var + ln.eps) * ln.weight + ln.bias


def sinusoid(s, d):
    pos = torch.arange(s, dtype=torch.float64)[:, None]
    freq = torch.exp(-math.log(10000.0) * torch.arange(0, d, 2, dtype=torch.float64) / d)
    table = torch.zeros(s, d, dtype=torch.float64)
    table[:, 0::2], table[:, 1::2] = torch.sin(pos * freq), torch.cos(pos * freq)
    return table


def by_hand_decoder(model: Transformer, memory: torch.Tensor, tgt_in: list[int]) -> list[torch.Tensor]:
    """The decoder's residual stream written out from its weights: the embedding (scaled by
    sqrt(d), plus the sinusoids), then each layer (masked self-attention, cross-attention,
    feed-forward; post-LN or pre-LN)."""
    d = model.config.d_model
    x = model.tgt_embed.embedding.weight[tgt_in] * math.sqrt(d) + sinusoid(len(tgt_in), d)
    stream = [x]
    for layer in model.decoder.layers:
        ff = layer.feed_forward
        parts = (
            lambda h, layer=layer: attend(layer.self_attn, h, h, True),
            lambda h, layer=layer: attend(layer.cross_attn, h, memory, False),
            lambda h, ff=ff: linear(F.relu(linear(h, ff.linear1)), ff.linear2),
        )
        for part, ln in zip(parts, (layer.norm1, layer.norm2, layer.norm3)):
            x = x + part(norm(x, ln)) if model.config.norm_first else norm(x + part(x), ln)
        stream.append(x)
    return stream


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_lens_matches_a_decoder_written_by_hand(norm_first):
    torch.manual_seed(4)
    config = TransformerConfig(
        src_vocab_size=23,
        tgt_vocab_size=29,
        d_model=32,
        num_heads=4,
        num_encoder_layers=2,
        num_decoder_layers=3,
        d_ff=48,
        max_len=32,
        dropout=0.0,
        norm_first=norm_first,
    )
    model = Transformer(config).eval().double()
    with torch.no_grad():  # LayerNorms and biases off their initial ones and zeros
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.3)
    src, tgt_in, predicted = [5, 9, 3, 17, 2], [1, 8, 20, 4, 11], [8, 20, 4, 11, 2]
    labels = lambda ids: [f"t{i}" for i in ids]  # noqa: E731
    lens = decoder_lens(model, torch.tensor([src]), torch.tensor([tgt_in]), predicted, labels)
    with torch.no_grad():
        memory = model.encode(torch.tensor([src])).hidden[0]
        stream = by_hand_decoder(model, memory, tgt_in)
        final = (lambda h: norm(h, model.decoder.norm)) if norm_first else (lambda h: h)
        reference = torch.softmax(torch.stack([final(h) @ model.output_proj.weight.T for h in stream]), dim=-1)
        # the last depth is the model's own output
        own = torch.softmax(model(torch.tensor([src]), torch.tensor([tgt_in]))[0], dim=-1)
    assert torch.allclose(reference[-1], own, atol=1e-10)
    assert lens["positions"] == labels(tgt_in) and lens["next"] == labels(predicted)
    assert lens["layers"] == ["embeddings", "layer 0", "layer 1", "layer 2"]
    check_against(lens, reference, list(predicted))
    assert lens["vocabulary"] == labels(lens["token_ids"])


def test_seq2seq_example_carries_a_valid_lens_and_bad_fields_are_refused():
    torch.manual_seed(3)
    config = TransformerConfig(
        src_vocab_size=15, tgt_vocab_size=15, d_model=32, num_heads=4, num_encoder_layers=2,
        num_decoder_layers=2, d_ff=64, max_len=32, dropout=0.0,
    )  # fmt: skip
    tokenizer = WordTokenizer(["a", "dog", "runs", "on", "the", "beach", "ein", "hund", "läuft", "am", "strand"])
    explorer = qkv.viz.Seq2SeqExplorer(
        model=Transformer(config).eval(), tokenizer=tokenizer, name="t", max_new_tokens=4
    )
    example = explorer.example("a dog runs")
    data = explorer_data([example])
    check_data(data)
    lens = example["lens"]
    assert lens["positions"] == example["views"][1]["queries"]  # the decoder's input tokens
    assert lens["next"] == example["views"][2]["queries"]  # what each decoder position predicts
    for change, message in [
        (lambda x: x.pop("vocabulary"), "has no 'vocabulary'"),
        (lambda x: x["top"][0][0].__setitem__(0, 10**6), "'top' must be"),
        (lambda x: x["probs"][-1][0].__setitem__(0, 1.5), "'probs' must be"),
        (lambda x: x["next_probs"][0].__setitem__(0, None), "'next_probs' must be"),
        (lambda x: x["next"].append("x"), "'next' must be"),
        (lambda x: x["token_ids"].pop(), "'token_ids' must be"),
    ]:
        bad = copy.deepcopy(data)
        change(bad["examples"][0]["lens"])
        with pytest.raises(ValueError, match=f"example 0 'lens': {message}"):
            check_data(bad)


def test_no_lens_leaves_the_two_views_out(gpt2):
    """``qkv attend --no-lens`` (the explorer's ``lens = False``): the same example without the
    logit lens and attribution fields, every other view as before."""
    _, _, explorer = gpt2
    with_views = explorer.example(TEXT)
    explorer.lens = False
    try:
        without = explorer.example(TEXT)
    finally:
        explorer.lens = True
    assert "lens" in with_views and "lens" not in without and "attribution" not in without
    assert [v["name"] for v in without["views"]] == [v["name"] for v in with_views["views"]]
    from qkv.cli import attend

    parser = argparse.ArgumentParser()
    attend.add_arguments(parser)
    assert parser.parse_args(["x", "--no-lens"]).no_lens and not parser.parse_args(["x"]).no_lens

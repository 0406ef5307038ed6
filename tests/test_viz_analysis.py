"""The explorer's analysis (issue 15): head statistics, head labels, attention rollout, gradient x
input saliency, the two-sentence comparison and corpus averages, each checked against an
independent computation written here: direct Python loops over the weights, an explicit
matrix-product loop, ``torch.autograd.grad`` of the same output computed here (with respect to a
per-token scale of the embeddings, whose derivative at 1 is exactly gradient x input), central
finite differences on float64 models, and Hugging Face's BertModel for all-MiniLM-L6-v2. Then
``qkv attend --compare/--corpus`` and ``/api/attend`` end to end, and bad inputs."""

from __future__ import annotations

import copy
import json
import math
from contextlib import contextmanager

import pytest
import torch
from test_viz import WordTokenizer, make_tiny_bert
from test_viz_page import assert_page_holds

import qkv
from qkv import Transformer, TransformerConfig
from qkv.cli import main
from qkv.data.text import CharTokenizer
from qkv.models.causal_lm import CausalLM, CausalLMConfig
from qkv.pretrained import mean_pool
from qkv.viz import (
    AttentionView,
    CausalLMExplorer,
    EncoderExplorer,
    Seq2SeqExplorer,
    check_data,
    explorer_data,
    make_example,
)
from qkv.viz.analysis import cross_rollout, entropy_ratio, head_labels, head_stats, rollout, view_fields
from qkv.viz.app import ExplorerApp, RequestError
from qkv.viz.compare import compare_field, shared_tokens
from qkv.viz.explorers import encoder_token_labels, token_strings
from qkv.viz.html import page_document
from qkv.viz.lm_explorer import visible
from qkv.viz.saliency import cosine_saliency, next_token_saliency, translation_saliency

# ---- independent references -----------------------------------------------------------------


def loop_stats(att: list[list[float]], delimiters: list[int], *, cross: bool = False) -> dict[str, float]:
    """One head's statistics by a direct loop over its weights ``[s_q][s_k]``."""
    s_q, s_k = len(att), len(att[0])
    total = dict.fromkeys(("entropy", "previous", "same", "next", "delimiter", "distance"), 0.0)
    for i in range(s_q):
        centre = i * (s_k - 1) / max(s_q - 1, 1) if cross else i
        for j in range(s_k):
            a = att[i][j]
            if a > 0:
                total["entropy"] -= a * math.log(a)
            total["previous"] += a if j == i - 1 else 0.0
            total["same"] += a if j == i else 0.0
            total["next"] += a if j == i + 1 else 0.0
            total["delimiter"] += a if j in delimiters else 0.0
            total["distance"] += a * abs(j - centre)
    out = {name: value / s_q for name, value in total.items()}
    return {k: out[k] for k in ("entropy", "delimiter", "distance")} if cross else out


def matmul(a: list[list[float]], b: list[list[float]]) -> list[list[float]]:
    return [[sum(a[i][k] * b[k][j] for k in range(len(b))) for j in range(len(b[0]))] for i in range(len(a))]


def mean_heads_renormalised(layer: list, *, residual: bool) -> list[list[float]]:
    heads, s_q, s_k = len(layer), len(layer[0]), len(layer[0][0])
    mixed = [
        [sum(layer[h][i][j] for h in range(heads)) / heads + (1.0 if residual and i == j else 0.0) for j in range(s_k)]
        for i in range(s_q)
    ]
    return [[v / sum(row) for v in row] for row in mixed]


def loop_rollout(layers: list) -> list[list[list[float]]]:
    """Rollout by explicit loops: (mean over heads + I), rows renormalised, multiplied layer by layer."""
    s = len(layers[0][0])
    flow = [[1.0 if i == j else 0.0 for j in range(s)] for i in range(s)]
    out = []
    for layer in layers:
        flow = matmul(mean_heads_renormalised(layer, residual=True), flow)
        out.append(flow)
    return out


def softmax_attention(*shape: int, causal: bool = False, seed: int = 0) -> torch.Tensor:
    scores = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2
    if causal:
        scores = scores.masked_fill(torch.ones(shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    return scores.softmax(-1)


@contextmanager
def scaled_embeddings(embedding: torch.nn.Module, factors: list[torch.Tensor]):
    """The k-th call of ``embedding`` has each position's output multiplied by ``factors[k][position]``:
    d output / d factor at 1 is gradient x input, and finite differences in the factor approximate it."""
    calls = []

    def hook(module, args, output):
        k = len(calls)
        calls.append(k)
        return output * factors[k][None, :, None].to(output.dtype) if k < len(factors) else output

    handle = embedding.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def autograd_scores(function, sizes: list[int], outputs: int, dtype=torch.float32) -> list[torch.Tensor]:
    """``d function(factors)[o] / d factors`` at all-ones factors, by torch.autograd.grad; per input sequence
    ``(outputs, size)``."""
    factors = [torch.ones(n, dtype=dtype, requires_grad=True) for n in sizes]
    values = function(factors)  # (outputs,)
    rows = [torch.autograd.grad(values[o], factors, retain_graph=o + 1 < outputs) for o in range(outputs)]
    return [torch.stack([row[k] for row in rows]) for k in range(len(sizes))]


def finite_difference_scores(function, sizes: list[int], outputs: int, eps: float = 1e-6) -> list[torch.Tensor]:
    """Central differences of ``function`` in each factor, float64."""
    out = []
    for k, n in enumerate(sizes):
        grid = torch.zeros(outputs, n, dtype=torch.float64)
        for j in range(n):
            values = []
            for sign in (1, -1):
                factors = [torch.ones(m, dtype=torch.float64) for m in sizes]
                factors[k][j] += sign * eps
                with torch.no_grad():
                    values.append(function(factors))
            grid[:, j] = (values[0] - values[1]) / (2 * eps)
        out.append(grid)
    return out


# ---- head statistics, labels, rollout on weights built here ---------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_head_stats_equal_a_direct_loop(causal):
    att = softmax_attention(2, 3, 6, 6, causal=causal)  # (L, h, s, s)
    delimiters = [0, 5]
    got = head_stats(list(att), delimiters=delimiters)
    assert list(got) == ["entropy", "previous", "same", "next", "delimiter", "distance"]
    for layer in range(2):
        for head in range(3):
            want = loop_stats(att[layer, head].tolist(), delimiters)
            for name, value in want.items():
                assert abs(float(got[name][layer, head]) - value) <= 1e-12, (name, layer, head)


def test_cross_attention_stats_equal_a_direct_loop():
    att = softmax_attention(2, 2, 4, 7, seed=1)  # 4 target rows over 7 source tokens
    got = head_stats(list(att), delimiters=[6], cross=True)
    assert list(got) == ["entropy", "delimiter", "distance"]
    for layer in range(2):
        for head in range(2):
            for name, value in loop_stats(att[layer, head].tolist(), [6], cross=True).items():
                assert abs(float(got[name][layer, head]) - value) <= 1e-12, name


def hand_built_heads(n: int = 6) -> torch.Tensor:
    """One layer of hand-set heads over ``[CLS] w1 .. w4 [SEP]``: previous-token, delimiter, uniform,
    next-token, same-token, and one split evenly between the previous and the same token."""
    eye = torch.eye(n, dtype=torch.float64)
    previous = torch.roll(eye, -1, dims=1)  # row i has its 1 at column i-1 (row 0 wraps to the last)
    previous[0] = eye[0]
    following = torch.roll(eye, 1, dims=1)
    following[-1] = eye[-1]
    delimiter = torch.zeros(n, n, dtype=torch.float64)
    delimiter[:, 0], delimiter[:, -1] = 0.45, 0.45
    delimiter += 0.1 / n
    split = 0.45 * previous + 0.45 * eye + 0.1 / n
    split[0] = 1.0 / n  # the first token has no previous one: spread evenly
    heads = [
        0.9 * previous + 0.1 / n,
        delimiter,
        torch.full((n, n), 1.0 / n, dtype=torch.float64),
        0.8 * following + 0.2 / n,
        0.7 * eye + 0.3 / n,
        split,
    ]
    return torch.stack(heads)[None]  # (1, 6, n, n)


def test_head_labels_on_hand_set_heads():
    att = hand_built_heads()
    tokens = ["[CLS]", "a", "b", "c", "d", "[SEP]"]
    view = AttentionView("self-attention", tokens, tokens, list(att.float()))
    fields = view_fields(view)
    assert fields["delimiters"] == [0, 5]
    assert fields["labels"] == [
        ["previous-token head", "delimiter head", "broad head", "next-token head", "same-token head", None]
    ]
    # the same uniform head but causal: row i can only spread over i + 1 keys, and it does, so it is broad
    causal = torch.tril(torch.ones(6, 6, dtype=torch.float64))
    causal = causal / causal.sum(-1, keepdim=True)
    assert head_labels(head_stats([causal[None]]), entropy_ratio([causal[None]])) == [["broad head"]]
    # a head that puts 60% on one key and spreads the rest is neither dominated by a pattern nor broad
    peaked = torch.full((6, 6), 0.4 / 5, dtype=torch.float64)
    peaked[:, 2] = 0.6
    assert head_labels(head_stats([peaked[None]]), entropy_ratio([peaked[None]])) == [[None]]


def test_rollout_equals_a_matrix_product_loop():
    att = softmax_attention(3, 2, 5, 5, seed=2)
    got = rollout(list(att))
    want = loop_rollout(att.tolist())
    assert got.shape == (3, 5, 5)
    assert (got - torch.tensor(want, dtype=torch.float64)).abs().max() <= 1e-12
    assert (got.sum(-1) - 1).abs().max() <= 1e-12
    cross = softmax_attention(2, 3, 4, 5, seed=3)  # decoder layers over the 5 source tokens
    want_cross = [matmul(mean_heads_renormalised(layer, residual=False), want[-1]) for layer in cross.tolist()]
    got_cross = cross_rollout(list(cross), got[-1])
    assert (got_cross - torch.tensor(want_cross, dtype=torch.float64)).abs().max() <= 1e-12


# ---- the explorers' documents -------------------------------------------------------------------


@pytest.fixture(scope="module")
def seq2seq():
    tokenizer = WordTokenizer(["a", "dog", "runs", "on", "the", "beach", "ein", "hund", "läuft", "am", "strand"])
    torch.manual_seed(3)
    config = TransformerConfig(
        src_vocab_size=15,
        tgt_vocab_size=15,
        d_model=16,
        num_heads=2,
        num_encoder_layers=2,
        num_decoder_layers=2,
        d_ff=32,
        max_len=16,
        dropout=0.0,
    )
    return Transformer(config).eval(), tokenizer


def check_view_fields(doc_view: dict, view: AttentionView, *, cross: bool = False, encoder_flow=None) -> None:
    """The document's stats and rollout against loops over the unrounded weights of the same pass."""
    delimiters = [i for i, t in enumerate(view.keys) if t in ("[CLS]", "[SEP]", "<s>", "</s>")]
    assert doc_view["delimiters"] == delimiters
    layers = [a.double().tolist() for a in view.attentions]
    for layer, heads in enumerate(layers):
        for head, att in enumerate(heads):
            for name, value in loop_stats(att, delimiters, cross=cross).items():
                assert abs(doc_view["stats"][name][layer][head] - value) <= 5e-5 + 1e-6, (view.name, name)
    if cross:
        want = [matmul(mean_heads_renormalised(layer, residual=False), encoder_flow) for layer in layers]
    else:
        want = loop_rollout(layers)
    assert (torch.tensor(doc_view["rollout"]) - torch.tensor(want)).abs().max() <= 5e-5 + 1e-6


def test_seq2seq_example_fields(seq2seq):
    model, tokenizer = seq2seq
    explorer = Seq2SeqExplorer(model=model, tokenizer=tokenizer, name="tiny")
    example = explorer.example("a dog runs on", target="ein hund läuft")
    check_data(explorer_data([example]))
    encoder, decoder, cross = explorer.views("a dog runs on", target="ein hund läuft")
    assert cross.queries == ["ein", "hund", "läuft", "</s>"] and cross.keys == ["a", "dog", "runs", "on", "</s>"]
    check_view_fields(example["views"][0], encoder)
    check_view_fields(example["views"][1], decoder)
    flow = loop_rollout([a.double().tolist() for a in encoder.attentions])[-1]
    check_view_fields(example["views"][2], cross, cross=True, encoder_flow=flow)
    # saliency: the log-probability of each predicted token, differentiated here by autograd
    src = torch.tensor([tokenizer.encode("a dog runs on", add_eos=True)])
    tgt = torch.tensor([[1, *tokenizer.encode("ein hund läuft")]])
    predicted = [*tokenizer.encode("ein hund läuft"), 2]

    def log_probs(factors):
        with scaled_embeddings(model.src_embed.embedding, factors):
            memory = model.encode(src)
        logits = model.decode(tgt, memory).logits[0]
        return logits.log_softmax(-1)[torch.arange(4), torch.tensor(predicted)]

    (want,) = autograd_scores(log_probs, [5], 4)
    saliency = example["saliency"]
    assert saliency["inputs"] == cross.keys and saliency["outputs"] == cross.queries
    got = torch.tensor(saliency["scores"])
    assert (got - want).abs().max() <= 1e-3 * want.abs().max() + 1e-6
    assert (torch.tensor(saliency["attention"]) - cross.attentions[-1].mean(0)).abs().max() <= 5e-5 + 1e-7


def test_translation_saliency_equals_finite_differences_in_float64(seq2seq):
    model = copy.deepcopy(seq2seq[0]).double()
    src, tgt, predicted = torch.tensor([[4, 5, 6, 4, 2]]), torch.tensor([[1, 9, 10]]), [9, 10, 2]

    def log_probs(factors):
        with scaled_embeddings(model.src_embed.embedding, factors):
            memory = model.encode(src)
        return model.decode(tgt, memory).logits[0].log_softmax(-1)[torch.arange(3), torch.tensor(predicted)]

    got = translation_saliency(model, src, tgt, predicted)
    (numeric,) = finite_difference_scores(log_probs, [5], 3)
    (exact,) = autograd_scores(log_probs, [5], 3, dtype=torch.float64)
    assert got.dtype == torch.float64 and got.shape == (3, 5)
    assert (got - exact).abs().max() <= 1e-12
    assert (got - numeric).abs().max() <= 1e-7 * max(1.0, float(numeric.abs().max()))
    assert float(got.abs().max()) > 1e-3  # a real signal, not zeros


@pytest.fixture(scope="module")
def tiny_lm():
    torch.manual_seed(5)
    config = CausalLMConfig(vocab_size=12, d_model=16, num_heads=2, num_layers=2, d_ff=32, context=16, dropout=0.0)
    return CausalLM(config).eval(), CharTokenizer("abcdefgh ,.\n")


def test_lm_example_fields_and_saliency(tiny_lm):
    model, tokenizer = tiny_lm
    explorer = CausalLMExplorer(model=model, tokenizer=tokenizer, name="tiny-lm")
    text = "bad cafe, head"
    example = explorer.example(text)
    check_data(explorer_data([example]))
    (view,) = explorer.views(text)
    check_view_fields(example["views"][0], view)
    ids = torch.tensor([tokenizer.encode(text)])
    with torch.no_grad():
        best = int(model(ids).logits[0, -1].argmax())

    def next_log_prob(factors):
        with scaled_embeddings(model.token_embedding, factors):
            return model(ids).logits[0, -1].log_softmax(-1)[best : best + 1]

    (want,) = autograd_scores(next_log_prob, [ids.size(1)], 1)
    saliency = example["saliency"]
    assert saliency["outputs"] == [visible(tokenizer.chars[best])] and saliency["inputs"] == view.keys
    assert (torch.tensor(saliency["scores"]) - want).abs().max() <= 1e-3 * want.abs().max() + 1e-6
    assert (torch.tensor(saliency["attention"][0]) - view.attentions[-1].mean(0)[-1]).abs().max() <= 5e-5 + 1e-7
    # float64: the library's gradient against central finite differences
    model64 = copy.deepcopy(model).double()

    def next_log_prob64(factors):
        with scaled_embeddings(model64.token_embedding, factors):
            return model64(ids).logits[0, -1].log_softmax(-1)[best : best + 1]

    (numeric,) = finite_difference_scores(next_log_prob64, [ids.size(1)], 1)
    got = next_token_saliency(model64, ids, best)
    assert (got - numeric[0]).abs().max() <= 1e-7 * max(1.0, float(numeric.abs().max()))


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    folder = make_tiny_bert(tmp_path_factory.mktemp("models") / "tiny-bert")
    return folder, qkv.load_pretrained(folder, device="cpu")


def cosine_of(encoder, batches):
    def function(factors):
        with scaled_embeddings(encoder.embeddings.word_embeddings, factors):
            pooled = [
                mean_pool(encoder(b.input_ids, b.attention_mask, b.token_type_ids).last_hidden_state, b.attention_mask)
                for b in batches
            ]
        return torch.nn.functional.cosine_similarity(pooled[0], pooled[1], dim=-1)  # (1,)

    return function


def test_encoder_cosine_saliency(tiny_bert):
    _, encoder = tiny_bert
    a, b = "the dog runs on the mat", "a cat sleeps"
    explorer = EncoderExplorer(model=encoder, name="tiny-bert")
    example = explorer.example(a, paired_with=b)
    assert "saliency" not in explorer.example(a)  # one sentence: no cosine to explain
    check_data(explorer_data([example]))
    (view,) = explorer.views(a)
    check_view_fields(example["views"][0], view)
    batches = [encoder.tokenizer([a]), encoder.tokenizer([b])]
    want_a, _ = autograd_scores(cosine_of(encoder, batches), [8, 5], 1)
    saliency = example["saliency"]
    assert saliency["inputs"] == ["[CLS]", "the", "dog", "runs", "on", "the", "mat", "[SEP]"]
    assert (torch.tensor(saliency["scores"]) - want_a).abs().max() <= 1e-3 * want_a.abs().max() + 1e-7
    with torch.no_grad():
        cosine = float(cosine_of(encoder, batches)([torch.ones(8), torch.ones(5)]))
    assert saliency["outputs"] == [f"cosine similarity {cosine:.3f}"]
    assert (torch.tensor(saliency["attention"][0]) - view.attentions[-1].mean(0)[0]).abs().max() <= 5e-5 + 1e-7
    # float64: both sentences' scores against central finite differences
    encoder64 = copy.deepcopy(encoder).double()
    got_a, got_b, _ = cosine_saliency(encoder64, *batches)
    numeric_a, numeric_b = finite_difference_scores(cosine_of(encoder64, batches), [8, 5], 1)
    for got, numeric in ((got_a, numeric_a[0]), (got_b, numeric_b[0])):
        assert (got - numeric).abs().max() <= 1e-7 * max(1.0, float(numeric.abs().max()))


@pytest.fixture(scope="module")
def minilm():
    from qkv.pretrained import default_model_path

    try:
        path = default_model_path()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    return path, qkv.load_pretrained(path, device="cpu")


def test_minilm_cosine_saliency_matches_hugging_face(minilm):
    transformers = pytest.importorskip("transformers")
    path, encoder = minilm
    a, b = "time flies like an arrow", "fruit flies like a banana"
    saliency = EncoderExplorer(model=encoder, name="all-MiniLM-L6-v2").example(a, paired_with=b)["saliency"]
    hf = transformers.BertModel.from_pretrained(str(path), attn_implementation="eager").eval()
    embeds, pooled = [], []
    for text in (a, b):
        batch = encoder.tokenizer([text])
        e = hf.embeddings.word_embeddings(batch.input_ids).detach().requires_grad_(True)
        hidden = hf(inputs_embeds=e, attention_mask=batch.attention_mask).last_hidden_state
        embeds.append(e)
        pooled.append(mean_pool(hidden, batch.attention_mask))
    cosine = torch.nn.functional.cosine_similarity(pooled[0], pooled[1], dim=-1)[0]
    (grad,) = torch.autograd.grad(cosine, embeds[0])
    want = (grad * embeds[0]).sum(-1)[0]
    assert saliency["outputs"] == [f"cosine similarity {cosine.item():.3f}"]
    assert (torch.tensor(saliency["scores"][0]) - want).abs().max() <= 2e-3 * want.abs().max()


# ---- readable token labels --------------------------------------------------------------------


def test_byte_level_tokens_are_readable():
    data = pytest.importorskip("qkv.data.tokenizer")
    tokenizer = data.Tokenizer.train(["a dog runs on the beach", "ein hund läuft am strand"] * 5, vocab_size=300)
    ids = tokenizer.encode("a dog  läuft", add_eos=True)
    labels = token_strings(tokenizer, ids)
    assert labels[-1] == "</s>" and all(labels)
    assert "".join(labels[:-1]).replace("\u2423", " ") == "a dog  läuft"  # every byte shown, spaces as ␣
    assert any(label.startswith("\u2423") for label in labels)
    from tokenizers import decoders

    class Backend:  # a byte-level BPE encoder tokenizer, as a RoBERTa-style folder would have
        decoder = decoders.ByteLevel()

    class ByteLevelTokenizer:
        backend = Backend()

    assert encoder_token_labels(ByteLevelTokenizer(), ["<s>", "\u0120flies", "\u00c3\u00a9", "\u0120"]) == [
        "<s>",
        "\u2423flies",
        "\u00e9",
        "\u2423",
    ]
    # a tokenizer that is not byte-level (WordPiece) keeps "é" as it is; a tab is made visible
    assert encoder_token_labels(WordTokenizer([]), ["caf\u00e9", "##s", "a\tb"]) == ["caf\u00e9", "##s", "a\u21e5b"]


# ---- two sentences ------------------------------------------------------------------------------


def tv_loop(row_a: list[float], row_b: list[float], cols_a: list[int], cols_b: list[int]) -> float:
    """Total variation over the shared columns plus one bucket for everything else."""
    p = [row_a[c] for c in cols_a] + [sum(row_a) - sum(row_a[c] for c in cols_a)]
    q = [row_b[c] for c in cols_b] + [sum(row_b) - sum(row_b[c] for c in cols_b)]
    return 0.5 * sum(abs(x - y) for x, y in zip(p, q))


def test_compare_finds_the_head_made_to_differ():
    first = ["[CLS]", "time", "flies", "like", "an", "arrow", "[SEP]"]
    second = ["[CLS]", "fruit", "flies", "like", "a", "banana", "[SEP]"]
    same = softmax_attention(2, 3, 7, 7, seed=4).float()
    other = same.clone()
    other[1, 2] = softmax_attention(1, 1, 7, 7, seed=5)[0, 0].float()  # layer 1 head 2 differs
    examples = [
        make_example(" ".join(first[1:-1]), [AttentionView("self-attention", first, first, list(same))]),
        make_example(" ".join(second[1:-1]), [AttentionView("self-attention", second, second, list(other))]),
    ]
    compare = compare_field(examples)
    assert compare["shared"] == [[0, 0], [2, 2], [3, 3], [6, 6]]
    top, *rest = compare["heads"]
    assert (top["layer"], top["head"]) == (1, 2) and all(row["difference"] == 0 for row in rest)
    a = torch.tensor(examples[0]["views"][0]["attention"][1][2]).tolist()
    b = torch.tensor(examples[1]["views"][0]["attention"][1][2]).tolist()
    cols = [0, 2, 3, 6]
    want = [tv_loop(a[i], b[i], cols, cols) for i in cols]
    assert max(abs(g - w) for g, w in zip(top["per_token"], want)) <= 1e-4
    assert abs(top["difference"] - sum(want) / 4) <= 1e-4 and top["difference"] > 0.05
    data = explorer_data(examples)
    data["compare"] = compare
    check_data(data)
    assert shared_tokens(["a", "b", "c", "b"], ["b", "a", "b"]) in ([[0, 1], [1, 2]], [[1, 0], [3, 2]])
    with pytest.raises(ValueError, match="share no token"):
        compare_field(
            [
                make_example("x", [AttentionView("v", ["x"], ["x"], [torch.ones(1, 1, 1)])]),
                make_example("y", [AttentionView("v", ["y"], ["y"], [torch.ones(1, 1, 1)])]),
            ]
        )


# ---- qkv attend --compare / --corpus, /api/attend -------------------------------------------------


def read_data(html) -> dict:
    """The document inside an explorer page, its packed weights unpacked (qkv.viz.html.pack_weights)."""
    return page_document(html.read_text())


def test_attend_compare_and_corpus_end_to_end(tiny_bert, tmp_path, capsys):
    folder, encoder = tiny_bert
    corpus = tmp_path / "sentences.txt"
    lines = ["the dog runs on the beach", "", "a cat sleeps on the mat", "time flies like an arrow"]
    corpus.write_text("\n".join(lines) + "\n", encoding="utf-8")
    html, out_json = tmp_path / "out.html", tmp_path / "out.json"
    assert (
        main(
            [
                "attend",
                "the dog runs",
                "a dog sleeps",
                "--compare",
                "--corpus",
                str(corpus),
                "--model",
                str(folder),
                "-o",
                str(html),
                "--json",
                str(out_json),
            ]
        )
        == 0
    )
    assert "heads whose shared tokens attend most differently: layer" in capsys.readouterr().err
    data = json.loads(out_json.read_text())
    check_data(data)
    assert_page_holds(read_data(html), data)  # weights under 0.01 within 0.0002 in the page
    first, second = (e["views"][0] for e in data["examples"])
    compare = data["compare"]
    assert compare["examples"] == [0, 1] and compare["view"] == "self-attention"
    assert compare["shared"] == [[0, 0], [2, 2], [4, 4]]  # [CLS], dog, [SEP]
    cols = [0, 2, 4]
    for row in compare["heads"]:
        a, b = first["attention"][row["layer"]][row["head"]], second["attention"][row["layer"]][row["head"]]
        want = sum(tv_loop(a[i], b[i], cols, cols) for i in cols) / 3
        assert abs(row["difference"] - want) <= 2e-4
    assert [r["difference"] for r in compare["heads"]] == sorted(
        (r["difference"] for r in compare["heads"]), reverse=True
    )
    assert data["examples"][0]["saliency"]["about"].startswith("cosine similarity with \u201ca dog sleeps\u201d")
    # the corpus: each statistic averaged over the three sentences, by loops over their own weights
    explorer = EncoderExplorer(model=encoder, name="tiny-bert")
    sentences = [line for line in lines if line]
    assert data["corpus"]["file"] == str(corpus) and data["corpus"]["sentences"] == 3
    stats = data["corpus"]["views"]["self-attention"]["stats"]
    per_sentence = []
    for text in sentences:
        (view,) = explorer.views(text)
        delimiters = [0, len(view.keys) - 1]
        per_sentence.append(
            [[loop_stats(head.double().tolist(), delimiters) for head in layer] for layer in view.attentions]
        )
    for name in stats:
        for layer in range(3):
            for head in range(4):
                want = sum(s[layer][head][name] for s in per_sentence) / 3
                assert abs(stats[name][layer][head] - want) <= 5e-5 + 1e-6, name
    assert len(data["corpus"]["views"]["self-attention"]["labels"]) == 3
    # --corpus alone shows the corpus's first sentence
    assert main(["attend", "--corpus", str(corpus), "--model", str(folder), "-o", str(html)]) == 0
    assert [e["text"] for e in read_data(html)["examples"]] == ["the dog runs on the beach"]


def test_attend_bad_compare_and_corpus_inputs(tiny_bert, tmp_path, capsys):
    folder, _ = tiny_bert
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    (tmp_path / "blank.txt").write_text("\n  \n")
    (tmp_path / "long.txt").write_text("ok\n" + "x" * 30 + "\n")
    out = tmp_path / "out.html"
    out.write_text("keep me")
    for argv, words in (
        (["attend", "one sentence", "--compare"], "exactly two sentences"),
        (["attend", "a", "b", "c", "--compare"], "exactly two sentences"),
        (["attend"], "at least one sentence"),
        (["attend", "x", "--corpus", str(tmp_path / "missing.txt")], "not found"),
        (["attend", "x", "--corpus", str(tmp_path)], "is a folder"),
        (["attend", "x", "--corpus", str(tmp_path / "latin1.txt")], "not UTF-8"),
        (["attend", "x", "--corpus", str(tmp_path / "blank.txt")], "no sentences"),
        (["attend", "x", "--corpus", str(tmp_path / "long.txt"), "--max-chars", "20"], "line 2"),
    ):
        assert main([*argv, "--model", str(folder), "-o", str(out)]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("qkv attend: error:") and "\n" not in err and words in err, err
    assert out.read_text() == "keep me"  # nothing written on bad input


def test_api_attend_answers_with_the_fields_and_compares(tiny_bert):
    _, encoder = tiny_bert
    app = ExplorerApp(explorers={"tiny-bert": EncoderExplorer(model=encoder, name="tiny-bert")}, max_chars=40)
    single = app.attend({"text": "the dog runs"})["example"]
    assert {"stats", "labels", "rollout", "delimiters"} <= set(single["views"][0]) and "saliency" not in single
    answer = app.attend({"text": "the dog runs", "compare": "a dog sleeps"})
    assert answer["example"] == answer["examples"][0]
    assert answer["compare"]["examples"] == [0, 1] and answer["compare"]["shared"] == [[0, 0], [2, 2], [4, 4]]
    assert answer["examples"][1]["saliency"]["about"].startswith("cosine similarity with \u201cthe dog runs\u201d")
    data = explorer_data(answer["examples"])
    data["compare"] = answer["compare"]
    check_data(data)
    for payload, words in (
        ({"text": "the dog", "compare": ""}, "'compare' must be a non-empty string"),
        ({"text": "the dog", "compare": "x" * 41}, "'compare' has 41 characters"),
        ({"text": "the dog", "compare": 3}, "'compare' must be a non-empty string"),
    ):
        with pytest.raises(RequestError) as err:
            app.attend(payload)
        assert err.value.status == 400 and words in err.value.message


# ---- the document checker -------------------------------------------------------------------------


def test_check_data_names_the_bad_field(seq2seq):
    model, tokenizer = seq2seq
    example = Seq2SeqExplorer(model=model, tokenizer=tokenizer, name="tiny").example("a dog runs", target="ein hund")
    good = explorer_data([example, copy.deepcopy(example)])
    good["compare"] = compare_field(good["examples"])
    good["corpus"] = {
        "file": "f.txt",
        "sentences": 2,
        "views": {
            "encoder self-attention": {
                "stats": copy.deepcopy(example["views"][0]["stats"]),
                "labels": copy.deepcopy(example["views"][0]["labels"]),
            }
        },
    }
    check_data(good)

    def broken(edit) -> str:
        data = copy.deepcopy(good)
        edit(data)
        with pytest.raises(ValueError) as err:
            check_data(data)
        assert "\n" not in str(err.value)
        return str(err.value)

    view = lambda d: d["examples"][0]["views"][0]  # noqa: E731
    assert "'stats'['entropy']" in broken(lambda d: view(d)["stats"]["entropy"].pop())
    assert "'delimiters'" in broken(lambda d: view(d).update(delimiters=[99]))
    assert "'labels'" in broken(lambda d: view(d)["labels"][0].__setitem__(0, "mystery head"))
    assert "'rollout'" in broken(lambda d: view(d)["rollout"][0].pop())
    assert "'saliency': 'scores'" in broken(lambda d: d["examples"][0]["saliency"]["scores"][0].append(1.0))
    assert "'saliency' has no 'about'" in broken(lambda d: d["examples"][0]["saliency"].pop("about"))
    assert "'compare': 'examples'" in broken(lambda d: d["compare"].update(examples=[0, 5]))
    assert "'compare': 'view'" in broken(lambda d: d["compare"].update(view="nope"))
    assert "'compare': 'shared'" in broken(lambda d: d["compare"]["shared"].append([0, 99]))
    assert "'compare': 'heads'" in broken(lambda d: d["compare"]["heads"][0].update(layer=7))
    assert "'corpus': 'sentences'" in broken(lambda d: d["corpus"].update(sentences=0))
    assert "'corpus' view 'encoder self-attention': 'labels'" in broken(
        lambda d: d["corpus"]["views"]["encoder self-attention"]["labels"].pop()
    )

"""Greedy decoding and beam search: beam 1 = greedy, beam search = a plain one-sentence implementation of
its rules, batched = one sentence at a time, cached = uncached, scores = teacher-forced log-probabilities,
length limits and EOS handling; sacreBLEU."""

import math

import pytest
import sacrebleu
import torch

from qkv.data.batching import pad_sequences
from qkv.data.dates import generate_dates
from qkv.data.tokenizer import Tokenizer
from qkv.decoding.search import beam_search, greedy_decode, length_penalty
from qkv.decoding.translate import length_batches, translate_texts
from qkv.metrics.scores import exact_match, score_translations
from qkv.models.transformer import Transformer, TransformerConfig
from qkv.training import TrainConfig, Trainer, TranslationTask

BOS, EOS = 1, 2


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny model trained for a few seconds on dates: it emits EOS, and its choices are not ties."""
    torch.manual_seed(0)
    pairs = generate_dates(400, seed=11)
    tokenizer = Tokenizer.train(pairs.src + pairs.tgt, vocab_size=300, split_digits=True)
    config = TransformerConfig(
        src_vocab_size=tokenizer.vocab_size,
        tgt_vocab_size=tokenizer.vocab_size,
        d_model=32,
        num_heads=2,
        num_encoder_layers=1,
        num_decoder_layers=1,
        d_ff=64,
        dropout=0.0,
        max_len=64,
        norm_first=True,
        share_embeddings=True,
    )
    run_dir = tmp_path_factory.mktemp("decode") / "run"
    run_dir.mkdir()
    task = TranslationTask(tokenizer, pairs, None, max_len=config.max_len, pad_id=config.pad_id)
    trainer = Trainer(
        Transformer(config), task, TrainConfig(max_tokens=1500, warmup_steps=20, max_steps=60, progress=False), run_dir
    )
    trainer.train()
    model = trainer.model.eval()
    sources = generate_dates(12, seed=12, split="test").src
    src = pad_sequences([tokenizer.encode(s, add_eos=True) for s in sources], 0)
    out = greedy_decode(model, src, bos_id=BOS, eos_id=EOS)
    assert sum(len(o) <= 12 for o in out) >= 6  # it learned to stop: EOS handling is exercised
    return model, tokenizer, sources, src


@pytest.fixture(scope="module")
def untrained():
    torch.manual_seed(3)
    config = TransformerConfig(
        src_vocab_size=40,
        tgt_vocab_size=40,
        d_model=32,
        num_heads=4,
        num_encoder_layers=2,
        num_decoder_layers=2,
        d_ff=64,
        dropout=0.0,
        max_len=40,
    )
    model = Transformer(config).eval()
    src = torch.randint(3, 40, (5, 9))
    src[1, 6:] = 0  # padding
    src[3, 2:] = 0
    return model, src


def sequence_log_prob(model, src_row, tokens, ended: bool) -> float:
    """Teacher-forced log p(tokens [+ EOS] | src), computed from scratch (no cache)."""
    tgt_in = torch.tensor([[BOS] + tokens])
    with torch.no_grad():
        logits = model(src_row[None], tgt_in)[0].double()
    log_p = torch.log_softmax(logits, dim=-1)
    targets = tokens + ([EOS] if ended else [])
    return float(sum(log_p[i, t] for i, t in enumerate(targets)))


@pytest.mark.parametrize("which", ["trained", "untrained"])
def test_cached_equals_uncached(which, trained, untrained):
    model, src = (trained[0], trained[3]) if which == "trained" else untrained
    kwargs = dict(bos_id=BOS, eos_id=EOS, extra_len=12)
    assert greedy_decode(model, src, use_cache=True, **kwargs) == greedy_decode(model, src, use_cache=False, **kwargs)
    cached = beam_search(model, src, beam_size=3, use_cache=True, return_all=True, **kwargs)
    uncached = beam_search(model, src, beam_size=3, use_cache=False, return_all=True, **kwargs)
    assert [[h.tokens for h in hs] for hs in cached] == [[h.tokens for h in hs] for hs in uncached]
    for hs_a, hs_b in zip(cached, uncached):
        for a, b in zip(hs_a, hs_b):
            assert a.score == pytest.approx(b.score, abs=1e-4)


def test_cached_logits_equal_full_decode(untrained):
    model, src = untrained
    memory = model.encode(src)
    tgt = torch.randint(3, 40, (5, 7))
    tgt[:, 0] = BOS
    with torch.no_grad():
        full = model.decode(tgt, memory).logits
        cache, steps = None, []
        for t in range(tgt.size(1)):
            out = model.decode(tgt[:, t : t + 1], memory, cache=cache)
            cache = out.cache
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("which", ["trained", "untrained"])
def test_beam_one_equals_greedy(which, trained, untrained):
    model, src = (trained[0], trained[3]) if which == "trained" else untrained
    for use_cache in (True, False):
        kwargs = dict(bos_id=BOS, eos_id=EOS, extra_len=15, use_cache=use_cache)
        assert beam_search(model, src, beam_size=1, **kwargs) == greedy_decode(model, src, **kwargs)


@pytest.mark.parametrize("beam_size", [2, 4])
def test_batched_beam_equals_one_sentence_at_a_time(trained, beam_size):
    model, _, _, src = trained
    batched = beam_search(model, src, bos_id=BOS, eos_id=EOS, beam_size=beam_size, return_all=True)
    for i in range(src.size(0)):
        row = src[i : i + 1, : int((src[i] != 0).sum())]  # the sentence alone, no padding
        single = beam_search(model, row, bos_id=BOS, eos_id=EOS, beam_size=beam_size, return_all=True)[0]
        assert [h.tokens for h in single] == [h.tokens for h in batched[i]]
        assert [h.score for h in single] == pytest.approx([h.score for h in batched[i]], abs=1e-4)


def test_batched_greedy_equals_one_sentence_at_a_time(trained, untrained):
    """Sentences leave the batch as they end (EOS or their length limit): those still decoding must get
    what they get alone."""
    for model, src in ((trained[0], trained[3]), untrained):
        batched = greedy_decode(model, src, bos_id=BOS, eos_id=EOS, extra_len=6)
        lengths = {len(tokens) for tokens in batched}
        assert len(lengths) > 1  # sentences end at different steps: some leave while others go on
        for i in range(src.size(0)):
            row = src[i : i + 1, : int((src[i] != 0).sum())]
            assert greedy_decode(model, row, bos_id=BOS, eos_id=EOS, extra_len=6)[0] == batched[i]


def test_beam_scores_are_teacher_forced_log_probs(trained, untrained):
    for model, src in ((trained[0], trained[3][:4]), untrained):
        hyps = beam_search(model, src, bos_id=BOS, eos_id=EOS, beam_size=3, alpha=0.6, extra_len=10, return_all=True)
        max_len = (src != 0).sum(1) + 10
        for i, sentence in enumerate(hyps):
            assert len(sentence) >= 1
            normalized = [h.normalized for h in sentence]
            assert normalized == sorted(normalized, reverse=True)  # best first
            for h in sentence:
                assert EOS not in h.tokens and len(h.tokens) <= int(max_len[i])
                ended = len(h.tokens) < int(max_len[i])  # else cut at the length limit, without EOS
                expected = sequence_log_prob(model, src[i, : int((src[i] != 0).sum())], h.tokens, ended)
                assert h.score == pytest.approx(expected, abs=1e-3)
                length = len(h.tokens) + (1 if ended else 0)
                assert h.normalized == pytest.approx(h.score / length_penalty(length, 0.6))


def reference_beam_search(model, src_row, k: int, alpha: float, max_len: int) -> list[tuple[list[int], float]]:
    """Beam search for one sentence as the textbook states it, every score from a fresh teacher-forced
    pass (no batch, no cache, float64 log-softmax): extend each live prefix by every token, take the
    2k best candidates; one ending in EOS is finished if it ranks within the first k, the first k
    others stay live; stop at k finished or at ``max_len`` tokens (live prefixes end there).
    Returns the finished (tokens, log p), best length-normalised first."""
    live, finished = [([], 0.0)], []
    for step in range(max_len):
        candidates = []
        for prefix, score in live:
            with torch.no_grad():
                logits = model(src_row[None], torch.tensor([[BOS] + prefix]))[0, -1].double()
            log_p = torch.log_softmax(logits, dim=-1).tolist()
            candidates += [(score + lp, prefix, token) for token, lp in enumerate(log_p)]
        candidates.sort(key=lambda c: -c[0])
        live = []
        for rank, (score, prefix, token) in enumerate(candidates[: 2 * k]):
            if token == EOS:
                if rank < k:
                    finished.append((prefix, score, score / length_penalty(len(prefix) + 1, alpha)))
            elif len(live) < k:
                live.append((prefix + [token], score))
        if len(finished) >= k:
            break
        if step + 1 >= max_len:
            finished += [(prefix, score, score / length_penalty(len(prefix), alpha)) for prefix, score in live]
    return [(tokens, score) for tokens, score, _ in sorted(finished, key=lambda h: -h[2])]


@pytest.mark.parametrize("k, alpha", [(2, 0.0), (5, 0.0), (5, 0.6)])
def test_beam_search_matches_the_textbook_one_sentence_at_a_time(trained, k, alpha):
    """Beam search is not bound to beat greedy decoding (the greedy prefix can fall out of the beam: on
    one machine's float rounding it did, for one of these sentences), so it is checked against an
    independent, plain implementation of the same rules instead."""
    model, _, _, src = trained
    beams = beam_search(model, src, bos_id=BOS, eos_id=EOS, beam_size=k, alpha=alpha, extra_len=8, return_all=True)
    for i, hypotheses in enumerate(beams):
        row = src[i, : int((src[i] != 0).sum())]
        reference = reference_beam_search(model, row, k, alpha, len(row) + 8)
        assert [h.tokens for h in hypotheses] == [tokens for tokens, _ in reference]
        assert [h.score for h in hypotheses] == pytest.approx([score for _, score in reference], abs=1e-4)


def test_length_limit_and_eos_handling(untrained):
    model, src = untrained
    lengths = (src != 0).sum(1)
    for extra in (0, 3):
        out = greedy_decode(model, src, bos_id=BOS, eos_id=EOS, extra_len=extra)
        assert all(len(o) <= int(n) + extra and EOS not in o for o, n in zip(out, lengths))
    # a model that always prefers EOS stops at once; one that never does runs to source length + extra.
    # The hook on output_proj runs where the model's own decode does (use_cache=False): an InferenceModel
    # computes the projection with its own packed copy and calls no module hook
    with torch.no_grad():
        bias_eos = torch.zeros(40)
        bias_eos[EOS] = 1e4
        hook = model.output_proj.register_forward_hook(lambda m, i, o: o + bias_eos)
        assert greedy_decode(model, src, bos_id=BOS, eos_id=EOS, use_cache=False) == [[]] * 5
        assert beam_search(model, src, bos_id=BOS, eos_id=EOS, beam_size=3, use_cache=False) == [[]] * 5
        hook.remove()
        hook = model.output_proj.register_forward_hook(lambda m, i, o: o - bias_eos)
        out = greedy_decode(model, src, bos_id=BOS, eos_id=EOS, extra_len=4, use_cache=False)
        assert [len(o) for o in out] == (lengths + 4).tolist()
        out = beam_search(model, src, bos_id=BOS, eos_id=EOS, beam_size=2, extra_len=4, use_cache=False)
        assert [len(o) for o in out] == (lengths + 4).tolist()
        hook.remove()
    with pytest.raises(ValueError, match="beam_size"):
        beam_search(model, src, bos_id=BOS, eos_id=EOS, beam_size=0)


def test_length_penalty_values():
    assert length_penalty(1, 0.6) == 1.0
    assert length_penalty(7, 0.6) == pytest.approx(2.0**0.6)
    assert length_penalty(10, 0.0) == 1.0


def test_translate_texts_order_batches_and_bf16(trained):
    model, tokenizer, sources, src = trained
    expected = [tokenizer.decode(t) for t in greedy_decode(model, src, bos_id=BOS, eos_id=EOS)]
    # tiny batches (one sentence each) and reversed order give the same translations, in input order
    assert translate_texts(model, tokenizer, sources, max_tokens=1) == expected
    assert translate_texts(model, tokenizer, sources[::-1]) == expected[::-1]
    beam = translate_texts(model, tokenizer, sources, beam_size=3)
    assert len(beam) == len(sources) and all(isinstance(b, str) for b in beam)
    bf16 = translate_texts(model, tokenizer, sources, bf16=True)
    assert len(bf16) == len(sources)
    assert exact_match(bf16, expected) >= 0.5  # bf16 rounding may flip a few close calls, not most
    assert translate_texts(model, tokenizer, []) == []


@pytest.mark.parametrize("budget", [1, 7, 20, 1000])
def test_length_batches_hold_every_sentence_once_within_the_budget(budget):
    lengths = [5, 1, 9, 3, 3, 12, 7, 2, 8, 4]
    ids = [[4] * n for n in lengths]
    batches = length_batches(ids, budget)
    assert sorted(i for batch in batches for i in batch) == list(range(len(ids)))
    flat = [lengths[i] for batch in batches for i in batch]
    assert flat == sorted(lengths)  # shortest first, each batch a run of similar lengths
    for batch in batches:  # padded to its longest: within the budget, unless one sentence alone
        assert len(batch) == 1 or max(lengths[i] for i in batch) * len(batch) <= budget
    for first, second in zip(batches, batches[1:]):  # a batch closes only when the next sentence would not fit
        assert lengths[second[0]] * (len(first) + 1) > budget
    assert length_batches([], budget) == []


def test_scores_match_sacrebleu_directly():
    hyps = ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee", "Eine Frau liest."]
    refs = ["Ein Mann fährt ein Fahrrad.", "Zwei Hunde spielen im Schnee.", "Eine Frau liest ein Buch."]
    scores = score_translations(hyps, refs)
    assert scores["bleu"] == round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2)
    assert scores["chrf"] == round(sacrebleu.corpus_chrf(hyps, [refs]).score, 2)
    assert "case:mixed" in scores["bleu_signature"] and "tok:13a" in scores["bleu_signature"]
    assert "nrefs:1" in scores["bleu_signature"] and "nc:6|nw:0" in scores["chrf_signature"]
    assert score_translations(refs, refs)["bleu"] == 100.0
    assert exact_match(hyps, refs) == 0.0 and exact_match(refs, refs) == 1.0
    with pytest.raises(ValueError, match="2 hypotheses but 3 references"):
        score_translations(hyps[:2], refs)
    assert math.isclose(exact_match(["a", "b"], ["a", "c"]), 0.5)


def test_power_length_penalty_is_length_to_the_alpha():
    from qkv.decoding.search import length_penalty

    assert length_penalty(7, 0.6, "power") == pytest.approx(7**0.6)
    assert length_penalty(7, 0.6) == pytest.approx((12 / 6) ** 0.6)
    assert length_penalty(7, 0.0, "power") == 1.0
    with pytest.raises(ValueError, match="gnmt, power"):
        length_penalty(7, 0.6, "fairseq")  # type: ignore[arg-type]

"""benchmarks/rerank_nbest.py: n-best scores against teacher-forced float64 log-probabilities of each
sentence alone, the channel's scores the same way in the other direction, and the reranking rule
against a hand computation."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from bench_loader import load_benchmark

from qkv.models.transformer import Transformer, TransformerConfig

rerank = load_benchmark("rerank_nbest")
BOS, EOS = 1, 2
TOKENS = SimpleNamespace(bos_id=BOS, eos_id=EOS)


def random_model(seed: int) -> Transformer:
    torch.manual_seed(seed)
    config = TransformerConfig(
        src_vocab_size=30,
        tgt_vocab_size=30,
        d_model=32,
        num_heads=4,
        num_encoder_layers=1,
        num_decoder_layers=2,
        d_ff=64,
        dropout=0.0,
        max_len=24,
    )
    return Transformer(config).eval()


def log_prob_alone(model, src: list[int], tgt: list[int], *, eos: bool = True) -> float:
    """log p(tgt + EOS | src + EOS) for one unpadded pair, summed in float64 (without EOS's term: ``eos=False``)."""
    with torch.no_grad():
        logits = model(torch.tensor([src + [EOS]]), torch.tensor([[BOS] + tgt])).double()[0]
    picked = torch.log_softmax(logits, dim=-1)[torch.arange(len(tgt) + 1), torch.tensor(tgt + [EOS])]
    return float(picked.sum() if eos else picked[:-1].sum())


def test_sequence_log_probs_equal_each_pair_scored_alone():
    model = random_model(0)
    gen = torch.Generator().manual_seed(1)
    src = [torch.randint(3, 30, (n,), generator=gen).tolist() for n in (4, 9, 1, 6, 12)]
    tgt = [torch.randint(3, 30, (n,), generator=gen).tolist() for n in (7, 2, 5, 0, 10)]
    got = rerank.sequence_log_probs(model, TOKENS, src, tgt, bf16=False, batch_size=2)
    assert got == pytest.approx([log_prob_alone(model, s, t) for s, t in zip(src, tgt)], abs=1e-4)


def test_nbest_scores_are_the_teacher_forced_log_probs_of_each_hypothesis():
    model = random_model(2)
    gen = torch.Generator().manual_seed(3)
    src_ids = [torch.randint(3, 30, (n,), generator=gen).tolist() + [EOS] for n in (3, 8, 5)]
    lists = rerank.nbest_lists(model, TOKENS, src_ids, beam=3, alpha=0.6, bf16=False, max_tokens=12)
    assert len(lists) == 3
    for src, hyps in zip(src_ids, lists):
        assert len(hyps) >= 3
        limit = min(len(src) + 50, model.config.max_len - 1)  # beam search's length limit
        for tokens, score in hyps:  # ended by EOS (whose log-probability counts) or cut at the limit
            expected = log_prob_alone(model, src[:-1], tokens, eos=len(tokens) < limit)
            assert score == pytest.approx(expected, abs=1e-3)


def test_pick_adds_the_channel_per_source_token_to_the_length_normalised_score():
    lists = object.__new__(rerank.Lists)
    lists.text = ["a", "b", "c", "d"]
    lists.groups = [np.array([0, 1]), np.array([2, 3])]
    lists.forward = np.array([-2.0, -3.0, -1.0, -1.2])
    lists.tgt_len = np.array([2, 8, 3, 3])
    lists.channel = np.array([-9.0, -1.0, -4.0, -2.0])
    lists.src_len = np.array([4, 4, 2, 2])

    def by_hand(alpha, lam):
        score = [
            f / ((5 + n) / 6) ** alpha + lam * c / m
            for f, n, c, m in zip(lists.forward, lists.tgt_len, lists.channel, lists.src_len)
        ]
        return [lists.text[max(g, key=lambda j: score[j])] for g in lists.groups]

    assert lists.pick(0.0, 0.0) == ["a", "c"]  # raw log-probabilities
    assert lists.pick(0.0, 1.0) == ["b", "d"]  # the channel prefers b and d
    for alpha in (0.0, 0.6, 2.0, 5.0):
        for lam in (0.0, 0.3, 1.0):
            assert lists.pick(alpha, lam) == by_hand(alpha, lam)


def test_bad_run_folders_and_outputs_are_one_line_errors_that_write_nothing(tmp_path):
    script = str(rerank.__file__)
    out = tmp_path / "o.json"
    done = subprocess.run(
        [sys.executable, script, "--forward", str(tmp_path / "missing"), "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert done.returncode != 0 and done.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'missing' / 'config.json'}: not a qkv run folder (config.json missing)"
    ]
    done = subprocess.run(
        [sys.executable, script, "--forward", str(tmp_path), "--out", str(tmp_path)], capture_output=True, text=True
    )
    assert done.returncode != 0 and "--out names a directory" in done.stderr and "Traceback" not in done.stderr
    assert not out.exists()

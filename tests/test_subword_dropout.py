"""Subword dropout (qkv.data.subword_dropout): the merge table against the tokenizer's own token
strings, splits that never change the text, a split rate that matches p (binomial bounds), the
all-the-way-down case against the bytes of the text, and segmentations that depend only on
(seed, epoch, example), never on the batch they land in."""

import math

import pytest

from qkv.data.dates import generate_dates
from qkv.data.spec import DataSpec
from qkv.data.subword_dropout import SubwordDropout, merge_parts
from qkv.data.tokenizer import Tokenizer
from qkv.runs.translation import start_run
from qkv.training import TrainConfig, TranslationTask

SENTENCES = [
    "A man in an orange hat starring at something.",
    "Two young, White males are outside near many bushes.",
    "Eine Gruppe von Männern lädt Baumwolle auf einen Lastwagen.",
    "Ein kleines Mädchen klettert in ein Spielhaus aus Holz.",
    "Un homme en chemise bleue se tient sur une échelle.",
] * 40


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.train(SENTENCES + generate_dates(300, seed=3).src, vocab_size=600)


def token_text(tokenizer, i):
    return tokenizer.backend.id_to_token(int(i))


def test_each_merged_token_is_its_two_parts_joined(tokenizer):
    parts = merge_parts(tokenizer)
    merged = parts[:, 0] >= 0
    assert merged.sum() > 200  # most of the vocabulary is merges
    for token in range(tokenizer.vocab_size):
        if merged[token]:
            left, right = parts[token]
            assert token_text(tokenizer, left) + token_text(tokenizer, right) == token_text(tokenizer, token)
    for token in range(260):  # 4 specials and the 256 byte symbols are no merge
        symbol = token_text(tokenizer, token)
        assert not merged[token] or len(symbol) > 1


def test_splitting_never_changes_the_text_and_is_a_refinement(tokenizer):
    ids = tokenizer.encode_batch(SENTENCES)
    dropout = SubwordDropout(tokenizer, 0.3, seed=0, max_len=255)
    split = dropout.split(ids, list(range(len(ids))), epoch=0, side=0)
    assert split != ids and sum(map(len, split)) > sum(map(len, ids))
    for original, pieces, text in zip(ids, split, SENTENCES):
        assert tokenizer.decode(pieces) == text
        # every piece boundary of the original segmentation is still a boundary
        ends = {sum(len(token_text(tokenizer, t)) for t in original[:k]) for k in range(len(original) + 1)}
        new_ends = {sum(len(token_text(tokenizer, t)) for t in pieces[:k]) for k in range(len(pieces) + 1)}
        assert ends <= new_ends


def test_the_share_of_tokens_split_matches_p(tokenizer):
    ids = tokenizer.encode_batch(SENTENCES)
    parts = merge_parts(tokenizer)
    splittable = sum(int(parts[t, 0] >= 0) for seq in ids for t in seq)
    for p in (0.1, 0.4):
        dropout = SubwordDropout(tokenizer, p, seed=7, max_len=255)
        kept_whole = 0
        for epoch in range(5):
            for original, pieces in zip(ids, dropout.split(ids, list(range(len(ids))), epoch=epoch, side=1)):
                kept = set(pieces)
                kept_whole += sum(1 for t in original if parts[t, 0] >= 0 and t in kept)
        # a token kept whole is one not split at its top (a piece equal to another token of the
        # sentence can make this count a little high, never low)
        n = 5 * splittable
        expected, sd = n * (1 - p), math.sqrt(n * p * (1 - p))
        assert expected - 4 * sd <= kept_whole <= expected + 4 * sd + 0.02 * n, (p, kept_whole, expected)


def test_p_near_one_cuts_everything_into_the_text_s_bytes(tokenizer):
    ids = tokenizer.encode_batch(SENTENCES[:5])
    dropout = SubwordDropout(tokenizer, 0.999999, seed=0, max_len=255)
    for pieces, text in zip(dropout.split(ids, [0, 1, 2, 3, 4], epoch=0, side=0), SENTENCES[:5]):
        assert len(pieces) == len(text.encode("utf-8"))  # byte-level BPE: one symbol a byte
        assert all(pieces.count(t) and len(token_text(tokenizer, t)) == 1 for t in pieces)
        assert tokenizer.decode(pieces) == text


def test_a_sequence_that_would_outgrow_the_model_stays_whole(tokenizer):
    ids = tokenizer.encode_batch(SENTENCES[:2])
    dropout = SubwordDropout(tokenizer, 0.999999, seed=0, max_len=len(SENTENCES[0].encode()))
    first, second = dropout.split(ids, [0, 1], epoch=0, side=0)
    assert len(first) == len(SENTENCES[0].encode())  # fits exactly: split
    assert second == ids[1]  # longer than max_len once split: left as it was


def test_the_cut_depends_on_seed_epoch_example_and_side_never_on_the_batch(tokenizer):
    ids = tokenizer.encode_batch(SENTENCES[:60])
    dropout = SubwordDropout(tokenizer, 0.2, seed=1, max_len=255)
    whole = dropout.split(ids, list(range(60)), epoch=3, side=0)
    assert dropout.split(ids[20:30], list(range(20, 30)), epoch=3, side=0) == whole[20:30]
    assert dropout.split(ids[::-1], list(range(60))[::-1], epoch=3, side=0) == whole[::-1]
    assert dropout.split(ids, list(range(60)), epoch=4, side=0) != whole
    assert dropout.split(ids, list(range(60)), epoch=3, side=1) != whole
    assert SubwordDropout(tokenizer, 0.2, seed=2, max_len=255).split(ids, list(range(60)), epoch=3, side=0) != whole


def test_bad_probabilities_are_refused(tokenizer):
    for p in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match="subword dropout"):
            SubwordDropout(tokenizer, p, seed=0, max_len=10)
    with pytest.raises(ValueError, match="subword_dropout"):
        TrainConfig(subword_dropout=1.0)


def test_training_batches_are_split_and_validation_is_not(tokenizer):
    pairs = generate_dates(50, seed=5)
    task = TranslationTask(tokenizer, pairs, None, max_len=64, pad_id=0)
    plain = task.make_batch(list(range(50)), epoch=2)
    task.set_subword_dropout(0.5, seed=0)
    split = task.make_batch(list(range(50)), epoch=2)
    assert split.src.shape[1] > plain.src.shape[1] and split.num_tgt_tokens > plain.num_tgt_tokens
    assert task.make_batch(list(range(50)), epoch=2).src.equal(split.src)
    task.set_subword_dropout(0.0, seed=0)
    assert task.make_batch(list(range(50)), epoch=2).src.equal(plain.src)


def test_an_epoch_s_batches_are_bucketed_by_the_lengths_of_its_cut(tokenizer):
    pairs = generate_dates(400, seed=6)
    task = TranslationTask(tokenizer, pairs, None, max_len=64, pad_id=0)
    task.set_subword_dropout(0.4, seed=0)
    for epoch in (0, 1):
        plan = task.batches(epoch, 300, seed=0)
        assert sorted(i for batch in plan for i in batch) == list(range(400))
        for indices in plan:  # bucket_batches' bound, on the batches as training builds them
            batch = task.make_batch(indices, epoch)
            padded = max(batch.src.shape[1], batch.tgt_in.shape[1])
            assert len(indices) == 1 or len(indices) * padded <= 300


def test_a_language_model_run_refuses_subword_dropout_and_leaves_no_folder(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 50, encoding="utf-8")
    with pytest.raises(ValueError, match="subword"):
        start_run(
            tmp_path / "run",
            data=DataSpec(source="text", train_text=str(text)),
            model_options={"d_model": 32, "num_heads": 2, "num_layers": 1, "d_ff": 64, "context": 16},
            train_options={"subword_dropout": 0.1, "max_steps": 1, "progress": False},
            device="cpu",
        )
    assert not (tmp_path / "run").exists()

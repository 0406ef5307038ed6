"""Ensembles (qkv.decoding.ensemble): next-token log-probabilities against the average of the members'
softmaxes computed in float64 from their full forward passes; greedy decoding against a
from-scratch loop over the members; beam scores against teacher-forced ensemble log-probabilities;
cached = uncached; the commands' --ensemble; mismatched runs refused."""

import json
import math

import pytest
import torch

from qkv.cli import main
from qkv.data.batching import pad_sequences
from qkv.data.dates import generate_dates
from qkv.data.tokenizer import Tokenizer
from qkv.decoding.ensemble import Ensemble
from qkv.decoding.search import beam_search, greedy_decode
from qkv.models.transformer import Transformer, TransformerConfig
from qkv.runs.folder import load_translator
from qkv.training import TrainConfig, Trainer, TranslationTask

BOS, EOS = 1, 2


def random_model(seed: int, d_model: int, layers: int, vocab: int = 40) -> Transformer:
    torch.manual_seed(seed)
    config = TransformerConfig(
        src_vocab_size=vocab,
        tgt_vocab_size=vocab,
        d_model=d_model,
        num_heads=4,
        num_encoder_layers=layers,
        num_decoder_layers=layers,
        d_ff=2 * d_model,
        dropout=0.0,
        max_len=40,
    )
    return Transformer(config).eval()


def reference_log_probs(models, src, tgt) -> torch.Tensor:
    """log of the members' averaged next-token probabilities, every position, in float64."""
    with torch.no_grad():
        probs = [torch.softmax(m(src, tgt).double(), dim=-1) for m in models]
    return torch.stack(probs).mean(dim=0).log()


def test_log_probs_are_the_log_of_the_members_averaged_probabilities():
    models = [random_model(0, 32, 2), random_model(1, 48, 1)]  # different widths and depths
    ensemble = Ensemble(models).eval()
    src = torch.randint(3, 40, (3, 7))
    src[1, 5:] = 0
    tgt = torch.cat([torch.full((3, 1), BOS), torch.randint(3, 40, (3, 5))], dim=1)
    expected = reference_log_probs(models, src, tgt)
    with torch.no_grad():
        memory = ensemble.encode(src)
        whole = ensemble.decode(tgt, memory).logits
        torch.testing.assert_close(whole.double(), expected, atol=1e-5, rtol=0)
        cache = None  # one token at a time through the members' KV caches
        for t in range(tgt.size(1)):
            out = ensemble.decode(tgt[:, t : t + 1], memory, cache=cache)
            cache = out.cache
            torch.testing.assert_close(out.logits[:, -1].double(), expected[:, t], atol=1e-5, rtol=0)


def test_members_must_share_the_vocabulary():
    with pytest.raises(ValueError, match="model 2 has src_vocab_size 50 but model 1 has 40"):
        Ensemble([random_model(0, 32, 1), random_model(1, 32, 1, vocab=50)])
    with pytest.raises(ValueError, match="at least 2"):
        Ensemble([random_model(0, 32, 1)])


@pytest.fixture(scope="module")
def trained_pair(tmp_path_factory):
    """Two tiny date models, trained from different seeds on the same data and tokenizer."""
    pairs = generate_dates(400, seed=11)
    tokenizer = Tokenizer.train(pairs.src + pairs.tgt, vocab_size=300, split_digits=True)
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
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
        task = TranslationTask(tokenizer, pairs, None, max_len=config.max_len, pad_id=config.pad_id)
        trainer = Trainer(
            Transformer(config),
            task,
            TrainConfig(max_tokens=1500, warmup_steps=20, max_steps=60, seed=seed, progress=False),
            tmp_path_factory.mktemp(f"seed{seed}"),
        )
        trainer.train()
        models.append(trainer.model.eval())
    sources = generate_dates(10, seed=12, split="test").src
    src = pad_sequences([tokenizer.encode(s, add_eos=True) for s in sources], 0)
    return models, src


def test_greedy_matches_a_from_scratch_loop_over_the_members(trained_pair):
    models, src = trained_pair
    got = greedy_decode(Ensemble(models), src, bos_id=BOS, eos_id=EOS, extra_len=10)
    ended = 0
    for row, tokens in zip(src, got):
        row = row[row != 0][None]  # one sentence alone, unpadded
        prefix = [BOS]
        for _ in range(row.size(1) + 10):
            nxt = int(reference_log_probs(models, row, torch.tensor([prefix]))[0, -1].argmax())
            if nxt == EOS:
                ended += 1
                break
            prefix.append(nxt)
        assert tokens == prefix[1:]
    assert ended >= 5  # the models learned to stop: EOS handling is exercised


def test_beam_scores_are_teacher_forced_ensemble_log_probs(trained_pair):
    models, src = trained_pair
    ensemble = Ensemble(models)
    cached = beam_search(ensemble, src, bos_id=BOS, eos_id=EOS, beam_size=3, alpha=0.6, extra_len=10, return_all=True)
    uncached = beam_search(
        ensemble, src, bos_id=BOS, eos_id=EOS, beam_size=3, alpha=0.6, extra_len=10, use_cache=False, return_all=True
    )
    assert [[h.tokens for h in hyps] for hyps in cached] == [[h.tokens for h in hyps] for hyps in uncached]
    for row, hyps in zip(src, cached):
        row = row[row != 0][None]
        for hyp in hyps:
            tgt = torch.tensor([[BOS, *hyp.tokens]])
            log_probs = reference_log_probs(models, row, tgt)[0]
            targets = hyp.tokens + [EOS]
            steps = len(targets) if len(hyp.tokens) < row.size(1) + 10 else len(hyp.tokens)  # cut: no EOS
            expected = sum(log_probs[i, targets[i]].item() for i in range(steps))
            assert math.isclose(hyp.score, expected, abs_tol=1e-4)


def test_one_model_twice_decodes_as_the_model_alone(trained_pair):
    models, src = trained_pair
    alone = beam_search(models[0], src, bos_id=BOS, eos_id=EOS, beam_size=4)
    twice = beam_search(Ensemble([models[0], models[0]]), src, bos_id=BOS, eos_id=EOS, beam_size=4)
    assert twice == alone


TINY = [
    "--d-model",
    "32",
    "--heads",
    "2",
    "--encoder-layers",
    "1",
    "--decoder-layers",
    "1",
    "--d-ff",
    "64",
    "--max-tokens",
    "800",
    "--no-progress",
    "--threads",
    "1",
    "--max-steps",
    "20",
    "--minutes",
    "0",
]


def test_commands_decode_with_an_ensemble_and_refuse_foreign_runs(tmp_path, capsys):
    first, other = tmp_path / "first", tmp_path / "other"
    assert main(["train", "--data", "dates", "--run-dir", str(first), *TINY]) == 0
    assert main(["train", "--data", "dates", "--seed", "5", "--run-dir", str(other), *TINY]) == 0  # other dates
    capsys.readouterr()
    split = ["--split", "test", "--limit", "30", "--beam", "2", "--json"]
    assert main(["evaluate", str(first), *split]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert main(["evaluate", str(first), *split, "--ensemble", str(first)]) == 0
    twice = json.loads(capsys.readouterr().out)
    assert twice["ensemble"] == [str(first), str(first)] and twice["bleu"] == alone["bleu"]
    source = tmp_path / "in.txt"
    source.write_text("3 March 1998\n12/25/04\n", encoding="utf-8")
    assert main(["translate", str(first), str(source), "--beam", "1"]) == 0
    expected = capsys.readouterr().out
    assert main(["translate", str(first), str(source), "--beam", "1", "--ensemble", str(first)]) == 0
    assert capsys.readouterr().out == expected
    assert main(["translate", str(first), str(source), "--ensemble", str(other)]) == 2
    assert "its tokenizer differs" in capsys.readouterr().err
    with pytest.raises(ValueError, match="its tokenizer differs"):
        load_translator([first, other])

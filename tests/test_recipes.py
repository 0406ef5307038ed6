"""The paper's recipes (qkv.runs.recipes) and `qkv train --recipe`: sizes against Table 3 and the
parameter counts the paper states (computed here from the layer formulas), the split of a step's
tokens over processes, that a named recipe replaces the data's whole, and the CLI. The recipe files
themselves (their values, their checks, qkv recipes) are tested in test_recipe_files.py."""

from __future__ import annotations

import json

import pytest
import torch

from qkv.models.transformer import Transformer, TransformerConfig
from qkv.runs.recipes import load_recipe, step_batches, translation_recipes
from qkv.runs.recipes.choice import choose_recipe
from qkv.training import TrainConfig


def expected_parameters(vocab: int, d: int, d_ff: int, layers: int) -> int:
    """Parameters of the paper's encoder-decoder with one embedding table shared by both languages
    and the output projection (no output bias), written out: each attention block has four d x d
    projections with biases, each feed-forward d x d_ff and d_ff x d with biases, each LayerNorm a
    scale and a shift; encoder layers have one attention block and two norms, decoder layers two
    attention blocks and three norms; post-LN, so no final norms."""
    attention = 4 * (d * d + d)
    feed_forward = d * d_ff + d_ff + d_ff * d + d
    norm = 2 * d
    encoder_layer = attention + feed_forward + 2 * norm
    decoder_layer = 2 * attention + feed_forward + 3 * norm
    return vocab * d + layers * (encoder_layer + decoder_layer)


@pytest.mark.parametrize(
    "name,d,heads,d_ff,dropout,paper_millions,tolerance",
    [
        ("paper-base", 512, 8, 2048, 0.1, 65, 0.05),
        ("paper-big", 1024, 16, 4096, 0.3, 213, 0.01),
    ],
)
def test_paper_models_match_table_3(name, d, heads, d_ff, dropout, paper_millions, tolerance):
    recipe = load_recipe(name)
    vocab = recipe.vocab_size
    assert vocab == 37000  # shared source-target BPE of about 37,000 tokens (section 5.1)
    config = TransformerConfig(**recipe.model, src_vocab_size=vocab, tgt_vocab_size=vocab)
    assert (config.d_model, config.num_heads, config.d_ff, config.dropout) == (d, heads, d_ff, dropout)
    assert (config.num_encoder_layers, config.num_decoder_layers, config.norm_first) == (6, 6, False)
    assert config.share_embeddings and config.tie_output and config.positional == "sinusoidal"
    with torch.device("meta"):  # counts without allocating 0.9 GB for big
        model = Transformer(config)
    count = sum(p.numel() for p in model.parameters())
    assert count == expected_parameters(vocab, d, d_ff, 6)
    assert abs(count / 1e6 - paper_millions) <= tolerance * paper_millions  # Table 3: 65M and 213M


def test_paper_training_settings():
    base, big = TrainConfig(**load_recipe("paper-base").train), TrainConfig(**load_recipe("paper-big").train)
    for config in (base, big):
        assert config.adam_betas == (0.9, 0.98) and config.adam_eps == 1e-9  # section 5.3
        assert (config.warmup_steps, config.lr_factor, config.schedule) == (4000, 1.0, "inverse_sqrt")
        assert config.label_smoothing == 0.1 and config.bf16  # section 5.4; start_run keeps bf16 where fast
    assert (base.max_steps, base.average_last, big.max_steps, big.average_last) == (100_000, 5, 300_000, 20)
    for name in ("paper-base", "paper-big"):
        assert load_recipe(name).decode == {"beam_size": 4, "alpha": 0.6, "penalty": "gnmt"}  # section 6.1
        assert load_recipe(name).tokens_per_step == 25000


def test_step_batches_split_a_step_over_processes():
    for world in range(1, 17):
        max_tokens, accum = step_batches(25000, world)
        assert max_tokens <= 12500
        assert 25000 <= world * accum * max_tokens < 25000 + world * accum  # the step, rounded up per batch
        if world > 1:
            assert accum == 1  # two or more processes carry 25k tokens without accumulating
    assert step_batches(25000, 1) == (12500, 2) and step_batches(25000, 8) == (3125, 1)
    assert step_batches(25000, 2, max_tokens=4000) == (4000, 3)  # 24,000: the closest to 25k
    assert step_batches(25000, 1, accum_steps=4) == (6250, 4)
    assert step_batches(25000, 8, max_tokens=1000, accum_steps=1) == (1000, 1)  # both given: both kept
    with pytest.raises(ValueError, match="world_size must be an integer >= 1, got 0"):
        step_batches(25000, 0)


def test_step_options_follow_the_processes_and_keep_what_is_given():
    paper = load_recipe("paper-base")
    assert paper.step_options(8) == {"max_tokens": 3125, "accum_steps": 1}
    assert paper.step_options(1, max_tokens=3000) == {"max_tokens": 3000, "accum_steps": 8}
    assert paper.step_options(1, max_tokens=3000, accum_steps=2) == {"max_tokens": 3000, "accum_steps": 2}
    assert load_recipe("multi30k").step_options(8) == {}  # no tokens_per_step: its own max_tokens stands


def test_choose_recipe_refuses_unknown_names_and_the_other_task():
    assert {"paper-base", "paper-big", "multi30k", "multi30k-bf16", "multi30k-gpu", "dates"} == set(
        translation_recipes()
    )
    with pytest.raises(ValueError, match="unknown recipe 'paper-huge'; choose one of dates, multi30k"):
        choose_recipe("paper-huge", "files")
    with pytest.raises(ValueError, match="paper-base is a translation recipe, and tinyshakespeare data trains a"):
        choose_recipe("paper-base", "tinyshakespeare")
    with pytest.raises(ValueError, match="tinyshakespeare is a language-model recipe, and files data"):
        choose_recipe("tinyshakespeare", "files")
    # without a name, the data's own; a prepared folder trains with the files' recipe
    chosen = choose_recipe(None, "prepared")
    assert (chosen.recipe.name, chosen.named, chosen.why) == ("multi30k", False, "the default recipe for prepared data")
    assert choose_recipe(None, "text").recipe.name == "tinyshakespeare"
    assert choose_recipe("paper-big", "dates").record() == {
        "name": "paper-big",
        "file": "qkv/runs/recipes/paper-big.toml",
        "why": "named (--recipe paper-big)",
    }


def _run_cli(argv):
    from qkv.cli import main

    try:
        return main([str(a) for a in argv])
    except SystemExit as exit_:  # argparse's own refusals
        return exit_.code


@pytest.fixture
def corpus(tmp_path):
    src = ["ein kleiner test .", "noch ein satz hier .", "das ist gut ."] * 30
    tgt = ["a small test .", "one more sentence here .", "that is good ."] * 30
    (tmp_path / "train.en").write_text("\n".join(src) + "\n")
    (tmp_path / "train.de").write_text("\n".join(tgt) + "\n")
    return ["--train-src", tmp_path / "train.en", "--train-tgt", tmp_path / "train.de"]


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
    "--vocab-size",
    "300",
    "--max-steps",
    "1",
    "--no-progress",
]


def test_cli_trains_with_the_named_recipe(tmp_path, corpus):
    from qkv.runtime.precision import bf16_is_fast

    run = tmp_path / "run"
    assert _run_cli(["train", *corpus, "--run-dir", run, "--recipe", "paper-big", *TINY, "--max-tokens", "3000"]) == 0
    config = json.loads((run / "config.json").read_text())
    model, train = config["model"], config["train"]
    assert (model["d_model"], model["num_heads"], model["d_ff"]) == (32, 2, 64)  # explicit options win
    assert (model["dropout"], model["max_len"], model["share_embeddings"]) == (0.3, 256, True)  # the recipe's
    assert (train["warmup_steps"], train["lr_factor"], train["clip_norm"], train["label_smoothing"]) == (
        4000,
        1.0,
        0.0,
        0.1,
    )
    assert (train["average_last"], train["checkpoint_every_steps"], train["max_minutes"]) == (20, 600, 0.0)
    assert (train["max_tokens"], train["accum_steps"], train["max_steps"]) == (3000, 8, 1)  # 8 x 3,000 on 1 process
    assert train["bf16"] == bf16_is_fast("cpu")
    assert config["recipe"] == {
        "name": "paper-big",
        "file": "qkv/runs/recipes/paper-big.toml",
        "why": "named (--recipe paper-big)",
    }
    # without --recipe, the data's own recipe (files: the Multi30k one), on every machine
    default = tmp_path / "default"
    assert _run_cli(["train", *corpus, "--run-dir", default, *TINY, "--attention-dropout", "0.1"]) == 0
    config = json.loads((default / "config.json").read_text())
    train, own = config["train"], load_recipe("multi30k")
    assert (train["warmup_steps"], train["max_tokens"], train["accum_steps"]) == (800, 2000, 1)
    assert (train["lr_factor"], config["model"]["dropout"], config["model"]["activation"]) == (0.7, 0.1, "gelu")
    assert (config["model"]["attention_dropout"], "attention_dropout" in own.model) == (0.1, False)
    assert config["recipe"] == {
        "name": "multi30k",
        "file": "qkv/runs/recipes/multi30k.toml",
        "why": "the default recipe for files data",
    }


def test_a_named_recipe_replaces_the_data_recipe_whole(tmp_path):
    """--recipe paper-base on the date task: the run's model and training configs are the paper
    recipe's with the options given over them (library defaults where the recipe says nothing),
    nothing of the dates recipe behind; its decoding settings and tokenizer rule too."""
    from dataclasses import asdict

    from qkv.runtime.precision import bf16_is_fast

    run = tmp_path / "run"
    argv = ["train", "--data", "dates", "--run-dir", run, "--recipe", "paper-base", *TINY, "--max-tokens", "500"]
    assert _run_cli(argv) == 0
    config = json.loads((run / "config.json").read_text())
    paper = load_recipe("paper-base")
    tiny = dict(d_model=32, num_heads=2, num_encoder_layers=1, num_decoder_layers=1, d_ff=64)
    vocab = config["model"]["src_vocab_size"]
    expected_model = TransformerConfig(**{**paper.model, **tiny}, src_vocab_size=vocab, tgt_vocab_size=vocab)
    assert config["model"] == json.loads(json.dumps(asdict(expected_model)))
    expected_train = TrainConfig(
        **{
            **paper.train,
            "max_tokens": 500,
            "accum_steps": 50,
            "max_steps": 1,
            "progress": False,
            "bf16": bf16_is_fast("cpu"),
        }
    )  # 50 x 500: the paper's 25,000 tokens a step on one process
    assert config["train"] == json.loads(json.dumps(asdict(expected_train)))
    assert config["decode"] == {"beam_size": 4, "alpha": 0.6, "penalty": "gnmt"}  # saved whole
    # the named recipe's tokenizer rule too: digits are not split (the dates recipe splits them)
    assert '"Digits"' not in (run / "tokenizer.json").read_text(encoding="utf-8")


def test_cli_refuses_an_unknown_recipe(tmp_path, corpus, capsys):
    run = tmp_path / "run"
    assert _run_cli(["train", *corpus, "--run-dir", run, "--recipe", "paper-huge"]) == 2
    err = capsys.readouterr().err.strip()
    assert "unknown recipe 'paper-huge'" in err and len(err.splitlines()) == 1
    assert _run_cli(["train", "--data", "tinyshakespeare", "--run-dir", run, "--recipe", "paper-base"]) == 2
    err = capsys.readouterr().err.strip()
    assert "translation recipe" in err and len(err.splitlines()) == 1
    assert not run.exists()
    assert _run_cli(["train", "--run-dir", run, "--resume", "--recipe", "paper-base"]) == 2
    assert "--recipe" in capsys.readouterr().err

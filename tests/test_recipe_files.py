"""The recipe files (src/qkv/runs/recipes/*.toml): every one resolves to exactly the values of the
Python dicts they replaced (copied below from src/qkv/runs/recipes.py as it was at commit 66c0514),
the loader refuses a bad file in one line naming the file and the key, `qkv recipes` lists and shows
them, and `qkv train --recipe FILE.toml` trains with a file of one's own."""

from __future__ import annotations

import json
import logging
import re
import shutil
import sys
from dataclasses import FrozenInstanceError, asdict
from pathlib import Path

import pytest
import torch

from qkv.models.causal_lm import CausalLMConfig
from qkv.models.transformer import TransformerConfig
from qkv.runs import recipes as recipes_module
from qkv.runs.recipes import RECIPE_DIR, Recipe, list_recipes, load_recipe, recipe_for_data
from qkv.runs.recipes.choice import differences
from qkv.training.config import TrainConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, from PyPI, as qkv.runs.recipes reads them with
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------------------------
# the reference: the dicts of src/qkv/runs/recipes.py at commit 66c0514, copied by hand

OLD_MULTI30K = {
    "vocab_size": 8000,
    "split_digits": False,
    "model": dict(
        d_model=256,
        num_heads=4,
        num_encoder_layers=3,
        num_decoder_layers=3,
        d_ff=1024,
        dropout=0.1,
        activation="gelu",
        max_len=256,
        share_embeddings=True,
        tie_output=True,
    ),
    "train": dict(
        max_tokens=2000,
        warmup_steps=800,
        lr_factor=0.7,
        schedule="budget",
        decay_fraction=0.3,
        bf16=True,
        max_minutes=60.0,
        eval_every_minutes=6.0,
        checkpoint_every_minutes=3.0,
        average_last=2,
    ),
    "decode": {"beam_size": 5, "alpha": 2.2},
}
# what start_run applied on top of it where the run was in bf16 and bf16 was fast
OLD_MODEL_WHERE_BF16_IS_FAST = dict(dropout=0.2, activation="relu")
OLD_TRAIN_WHERE_BF16_IS_FAST = dict(lr_factor=0.5)
OLD_DATES = {
    "vocab_size": 600,
    "split_digits": True,
    "model": dict(
        d_model=64,
        num_heads=4,
        num_encoder_layers=2,
        num_decoder_layers=2,
        d_ff=256,
        dropout=0.0,
        max_len=64,
        norm_first=True,
        share_embeddings=True,
        tie_output=True,
    ),
    "train": dict(
        max_tokens=1500,
        warmup_steps=100,
        lr_factor=0.5,
        max_minutes=2.5,
        eval_every_steps=100,
        eval_sentences=1000,
        stop_at_exact_match=0.995,
        average_last=1,
    ),
}
OLD_TINYSHAKESPEARE = {
    "task": "lm",
    "lm": {"tokenizer": "char", "windows": "random"},
    "vocab_size": 2000,
    # 1.2.0: the medium size and the cosine schedule (the size now follows the budget: tests/test_lm_budget.py)
    # 2.0: the Llama layout with Muon, chosen on validation and a held-out play (lm_parts_10min_held_out_play_zen3_1core.json)
    "model": dict(
        d_model=128,
        num_heads=4,
        num_layers=4,
        d_ff=512,
        context=64,
        dropout=0.1,  # 2.0: the medium size's (lm_parts_30min_held_out_play_zen3_2cores.json); tiny, small 0.0
        norm="rms",
        positional="rotary",
        activation="swiglu",
        bias=False,
    ),  # fmt: skip
    "train": dict(
        max_tokens=2048,
        optimizer="muon",
        warmup_steps=100,
        lr_factor=0.35,
        schedule="cosine",
        weight_decay=0.1,  # 1.3.0, chosen on validation (lm_weight_decay_epyc_avx2.json)
        label_smoothing=0.0,
        max_minutes=30.0,
        eval_every_minutes=2.0,
        eval_sentences=200,
        checkpoint_every_minutes=3.0,
        average_last=1,
        bf16=True,
        final_weights="best",
    ),
}
OLD_PAPER_MODEL = dict(
    d_model=512,
    num_heads=8,
    num_encoder_layers=6,
    num_decoder_layers=6,
    d_ff=2048,
    dropout=0.1,
    max_len=256,
    norm_first=False,
    positional="sinusoidal",
    share_embeddings=True,
    tie_output=True,
)
OLD_PAPER_TRAIN = dict(
    warmup_steps=4000,
    lr_factor=1.0,
    schedule="inverse_sqrt",
    adam_betas=(0.9, 0.98),
    adam_eps=1e-9,
    label_smoothing=0.1,
    clip_norm=0.0,
    bf16=True,
    max_steps=100_000,
    checkpoint_every_steps=1400,
    average_last=5,
    eval_every_steps=5000,
    eval_sentences=500,
)
OLD_PAPER_BASE = {
    "vocab_size": 37000,
    "split_digits": False,
    "tokens_per_step": 25000,
    "decode": {"beam_size": 4, "alpha": 0.6},
    "model": OLD_PAPER_MODEL,
    "train": OLD_PAPER_TRAIN,
}
OLD_PAPER_BIG = {
    **OLD_PAPER_BASE,
    "model": {**OLD_PAPER_MODEL, "d_model": 1024, "num_heads": 16, "d_ff": 4096, "dropout": 0.3},
    "train": {**OLD_PAPER_TRAIN, "max_steps": 300_000, "checkpoint_every_steps": 600, "average_last": 20},
}
OLD_DEFAULT_DECODE = {"beam_size": 5, "alpha": 0.6}
REFERENCE = {
    "multi30k": OLD_MULTI30K,
    "multi30k-bf16": {
        **OLD_MULTI30K,
        "model": {**OLD_MULTI30K["model"], **OLD_MODEL_WHERE_BF16_IS_FAST},
        "train": {**OLD_MULTI30K["train"], **OLD_TRAIN_WHERE_BF16_IS_FAST},
    },
    "dates": OLD_DATES,
    "tinyshakespeare": OLD_TINYSHAKESPEARE,
    "paper-base": OLD_PAPER_BASE,
    "paper-big": OLD_PAPER_BIG,
    "files": OLD_MULTI30K,  # the old aliases, now the data sources these recipes are the default of
    "text": OLD_TINYSHAKESPEARE,
}


def _typed(values: dict) -> dict:
    """Values with their types, so that 60 and 60.0 (or a list and a tuple) do not compare equal."""
    return {key: (type(value).__name__, value) for key, value in values.items()}


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_every_recipe_resolves_to_the_values_of_the_dicts_it_replaced(name):
    old, recipe = REFERENCE[name], load_recipe(name)
    task = old.get("task", "translation")
    assert recipe.task == task and recipe.vocab_size == old["vocab_size"]
    assert _typed(recipe.model) == _typed(old["model"])
    assert _typed(recipe.train) == _typed(old["train"])
    # the configs a run builds from them, the library's defaults filled in
    assert TrainConfig(**recipe.train) == TrainConfig(**old["train"])
    if task == "lm":
        assert recipe.lm == old["lm"] and recipe.decode == {} and recipe.tokens_per_step is None
        assert CausalLMConfig(**recipe.model) == CausalLMConfig(**old["model"])
    else:
        assert recipe.split_digits is old["split_digits"] and recipe.lm == {}
        assert recipe.tokens_per_step == old.get("tokens_per_step")
        # what start_run stored as the run's decoding settings: the recipe's, else the default's
        # the length-penalty form is now part of a recipe's decode; 1.x always decoded with gnmt
        assert _typed(recipe.decode) == _typed({**OLD_DEFAULT_DECODE, "penalty": "gnmt", **old.get("decode", {})})
        assert TransformerConfig(**recipe.model) == TransformerConfig(**old["model"])
    # RECIPES, the plain form kept for scripts, by name and by data source, holds the same
    plain = recipes_module.RECIPES[name]
    assert (plain["vocab_size"], plain["model"], plain["train"]) == (old["vocab_size"], old["model"], old["train"])


def test_the_recipes_are_the_eight_files_and_each_data_source_has_one():
    assert list_recipes() == [
        "dates",
        "multi30k",
        "multi30k-bf16",
        "multi30k-gpu",
        "paper-base",
        "paper-big",
        "tinyshakespeare",
        "tinyshakespeare-gpu",
    ]
    defaults = {
        source: recipe_for_data(source).name
        for source in ("multi30k", "files", "prepared", "dates", "tinyshakespeare", "text")
    }
    assert defaults == {
        "multi30k": "multi30k",
        "files": "multi30k",
        "prepared": "multi30k",
        "dates": "dates",
        "tinyshakespeare": "tinyshakespeare",
        "text": "tinyshakespeare",
    }
    claimed: list[str] = []
    for name in list_recipes():
        claimed += tomllib.loads((RECIPE_DIR / f"{name}.toml").read_text()).get("default_for", [])
    assert len(claimed) == len(set(claimed))  # no data source is the default of two recipes
    with pytest.raises(ValueError, match="no recipe is declared for data source 'wmt'"):
        recipe_for_data("wmt")


def test_the_bf16_variant_is_multi30k_with_three_values_changed():
    multi30k = load_recipe("multi30k")
    assert multi30k.bf16_variant == "multi30k-bf16"
    assert differences(multi30k, load_recipe("multi30k-bf16")) == {
        "dropout": 0.2,
        "activation": "relu",
        "lr_factor": 0.5,
    }
    # only multi30k suggests a variant, and every variant named is a recipe
    for name in list_recipes():
        variant = load_recipe(name).bf16_variant
        assert variant is None or variant in list_recipes()
        assert (variant is not None) == (name == "multi30k")


def test_a_recipe_is_frozen_and_built_by_keyword():
    recipe = load_recipe("dates")
    with pytest.raises(FrozenInstanceError):
        recipe.vocab_size = 700  # type: ignore[misc]
    with pytest.raises(TypeError):
        Recipe("dates", "d", "translation", 600, {}, {}, recipe.source)  # type: ignore[misc]
    assert recipe.source == RECIPE_DIR / "dates.toml" and recipe.file == "qkv/runs/recipes/dates.toml"


RESULT_NAME = re.compile(r"[\w.-]+\.json")


@pytest.mark.parametrize("name", ["dates", "multi30k", "multi30k-bf16", "paper-base", "paper-big", "tinyshakespeare"])
def test_each_file_is_short_and_says_where_its_reasons_are(name):
    text = (RECIPE_DIR / f"{name}.toml").read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= 45
    assert "docs/history/multi30k-recipe-log.md" in "\n".join(line for line in lines if line.startswith("#"))
    assert (REPO / "docs" / "history" / "multi30k-recipe-log.md").read_text().count(
        "## Why the recipe files hold these values"
    ) == 1
    results = {p.name for p in (REPO / "benchmarks" / "results").rglob("*.json")}
    for line in lines:
        if "=" in line and not line.startswith("#"):
            value, _, comment = line.partition("#")
            assert "[" not in value or value.rstrip().endswith("]"), line  # a value is whole on its line
            for named in RESULT_NAME.findall(comment):  # a results file named beside a value exists
                assert named in results, (name, named)


# ---------------------------------------------------------------------------------------------
# bad files: one line, naming the file and the key

GOOD = (RECIPE_DIR / "dates.toml").read_text(encoding="utf-8")


def _edited(old: str, new: str) -> str:
    assert GOOD.count(old) == 1, old
    return GOOD.replace(old, new)


BAD = [
    (_edited("vocab_size = 600", "vocab_size = 600\ndropout = 0.1"), "dropout: unknown key"),
    (_edited("dropout = 0.0", "dropuot = 0.0"), "model.dropuot: unknown key; TransformerConfig fields are"),
    (_edited("lr_factor = 0.5", 'lr_factor = "high"'), "train.lr_factor: must be a number, got 'high'"),
    (_edited("d_model = 64", "d_model = 64.5"), "model.d_model: must be an integer, got 64.5"),
    (_edited("max_tokens = 1500", "max_tokens = true"), "train.max_tokens: must be an integer, got True"),
    (_edited("share_embeddings = true", "share_embeddings = 1"), "model.share_embeddings: must be true or false"),
    (_edited("average_last = 1", "average_last = 1\nadam_betas = [0.9]"), "train.adam_betas: must be a list of 2"),
    (_edited("vocab_size = 600", "vocab_size = 100"), "vocab_size: must be >= 260"),
    (_edited("vocab_size = 600  # enough that month and day names become whole tokens\n", ""), "vocab_size: missing"),
    (_edited('task = "translation"', 'task = "lm"'), "split_digits: a key of translation recipes only"),
    (_edited('task = "translation"', 'task = "summary"'), "task: must be one of translation, lm"),
    (_edited("lr_factor = 0.5", "lr_factor = -1.0"), "train: lr_factor (--lr-factor) must be >= 0"),
    (_edited("d_model = 64", 'activation = "swish"\nd_model = 64'), "model: unknown activation 'swish'"),
    (_edited("average_last = 1", "average_last = 1\n\n[decode]\nbeam_size = 0"), "decode.beam_size must be"),
    (_edited('default_for = ["dates"]', 'default_for = ["wmt"]'), "default_for: 'wmt' is not a data source"),
    (_edited('default_for = ["dates"]', 'default_for = "dates"'), "default_for: must be a list"),
    (_edited("[model]", "[model"), "not a TOML file"),
]


@pytest.mark.parametrize("text,message", BAD, ids=[message.split(":")[0] for _, message in BAD])
def test_a_bad_file_is_refused_in_one_line_naming_the_file_and_key(tmp_path, text, message):
    path = tmp_path / "mine.toml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError) as error:
        load_recipe(path)
    assert str(error.value).startswith(f"{path}: ") and message in str(error.value), str(error.value)
    assert "\n" not in str(error.value)


def test_a_language_model_file_is_checked_against_its_own_fields(tmp_path):
    text = (RECIPE_DIR / "tinyshakespeare.toml").read_text(encoding="utf-8")
    for old, new, message in [
        ("num_layers = 4", "num_encoder_layers = 4", "model.num_encoder_layers: unknown key; CausalLMConfig"),
        ('tokenizer = "char"', 'tokenizer = "word"', "lm.tokenizer: must be one of char, bpe, got 'word'"),
        ('windows = "random"', 'window = "random"', "lm.window: unknown key"),
        ("[lm]", "[decode]\nbeam_size = 4\n\n[lm]", "decode: a key of translation recipes only"),
    ]:
        path = tmp_path / "lm.toml"
        path.write_text(text.replace(old, new), encoding="utf-8")
        with pytest.raises(ValueError, match=re.escape(message)):
            load_recipe(path)


def test_names_and_files_are_told_apart(tmp_path):
    with pytest.raises(ValueError, match="unknown recipe 'mine'; choose one of dates, multi30k, multi30k-bf16"):
        load_recipe("mine")
    with pytest.raises(FileNotFoundError, match="mine.toml: no such recipe file"):
        load_recipe("mine.toml")
    copy = tmp_path / "copy.toml"
    shutil.copy(RECIPE_DIR / "multi30k.toml", copy)
    mine, shipped = load_recipe(copy), load_recipe("multi30k")
    assert (mine.name, mine.source, mine.file) == ("copy", copy, str(copy.resolve()))
    assert (mine.model, mine.train, mine.decode, mine.vocab_size) == (
        shipped.model,
        shipped.train,
        shipped.decode,
        shipped.vocab_size,
    )
    assert load_recipe(str(copy)).model == shipped.model  # a path given as text


# ---------------------------------------------------------------------------------------------
# the command line


def _cli(capsys, *argv) -> tuple[int, str, str]:
    from qkv.cli import main

    try:
        code = main([str(a) for a in argv])
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def test_qkv_recipes_lists_them(capsys):
    code, out, _ = _cli(capsys, "recipes")
    assert code == 0
    rows = {line.split()[0]: line.split()[1] for line in out.splitlines()[1 : 1 + len(list_recipes())]}
    assert rows == {name: load_recipe(name).task for name in list_recipes()}
    for name in list_recipes():
        assert load_recipe(name).description in out
    assert "--data multi30k, --train-src/--train-tgt or --prepared: multi30k" in out
    assert _cli(capsys, "recipes", "list")[:2] == (0, out)


@pytest.mark.parametrize("fast", [True, False])
def test_qkv_recipes_show_resolves_a_recipe_for_this_machine(capsys, monkeypatch, fast):
    import qkv.runtime.device
    import qkv.runtime.precision

    monkeypatch.setattr(qkv.runtime.precision, "bf16_is_fast", lambda device="cpu": fast)
    monkeypatch.setattr(qkv.runtime.precision, "slow_bf16_reason", lambda device="cpu": "emulated (test)")
    monkeypatch.setattr(qkv.runtime.device, "pick_device", lambda device=None: torch.device("cpu"))
    code, out, _ = _cli(capsys, "recipes", "show", "multi30k")
    assert code == 0
    shown = tomllib.loads(out)  # the output is TOML, every model and training field filled in
    recipe = load_recipe("multi30k")
    model = json.loads(json.dumps(asdict(TransformerConfig(**recipe.model))))
    skip = ("src_vocab_size", "tgt_vocab_size", "pad_id")  # the tokenizer's; an unset option (None) is a comment
    assert shown["model"] == {k: v for k, v in model.items() if k not in skip and v is not None}
    assert "# num_kv_heads = (unset)  # library default" in out
    train = json.loads(json.dumps(asdict(TrainConfig(**{**recipe.train, "bf16": fast}))))
    assert shown["train"] == train  # bf16 as a run here would have it
    assert shown["decode"] == {"beam_size": 5, "alpha": 2.2, "penalty": "gnmt"}
    assert ("cpu here: on" in out) is fast and ("cpu here: off, float32 (emulated (test))" in out) is not fast
    assert ("--recipe multi30k-bf16 is this recipe tuned for it" in out) is fast
    assert "attention_dropout = 0.0  # library default" in out and "d_model = 256\n" in out


def test_qkv_recipes_show_prints_the_file_and_reads_ones_own(capsys, tmp_path):
    code, out, _ = _cli(capsys, "recipes", "show", "paper-big", "--toml")
    assert code == 0 and out == (RECIPE_DIR / "paper-big.toml").read_text(encoding="utf-8")
    mine = tmp_path / "mine.toml"
    mine.write_text(out.replace("dropout = 0.3", "dropout = 0.25"), encoding="utf-8")
    code, out, _ = _cli(capsys, "recipes", "show", mine)
    assert code == 0 and tomllib.loads(out)["model"]["dropout"] == 0.25
    assert f"# file: {mine}" in out
    assert "max_tokens = 12500" in out and "accum_steps = 2" in out  # 25,000 tokens a step on one process
    for argv, message in [
        (["recipes", "show"], "qkv recipes show needs a recipe"),
        (["recipes", "show", "nope"], "unknown recipe 'nope'"),
        (["recipes", "show", tmp_path / "none.toml"], "none.toml: no such recipe file"),
        (["recipes", "dates"], "invalid choice: 'dates'"),
        (["recipes", "list", "dates"], "name a recipe with show"),
    ]:
        code, _, err = _cli(capsys, *argv)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, (argv, err)


def test_qkv_train_with_a_recipe_file_of_ones_own(capsys, caplog, tmp_path):
    mine = tmp_path / "tiny-dates.toml"
    text = (RECIPE_DIR / "dates.toml").read_text(encoding="utf-8")
    mine.write_text(text.replace("d_model = 64", "d_model = 32").replace("d_ff = 256", "d_ff = 96"), encoding="utf-8")
    run = tmp_path / "run"
    caplog.set_level(logging.INFO, logger="qkv")
    argv = ["train", "--data", "dates", "--recipe", mine, "--run-dir", run, "--d-ff", 64, "--max-steps", 1]
    code, _, err = _cli(capsys, *argv, "--no-progress")
    assert code == 0, err
    config = json.loads((run / "config.json").read_text())
    assert config["model"]["d_model"] == 32  # the file's
    assert config["model"]["d_ff"] == 64  # the command line wins
    assert config["train"]["max_steps"] == 1 and config["train"]["max_minutes"] == 2.5
    assert config["recipe"] == {"name": "tiny-dates", "file": str(mine.resolve()), "why": f"named (--recipe {mine})"}
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("recipe ")]
    assert said == [f"recipe tiny-dates ({mine.resolve()}): named (--recipe {mine}); bf16 autocast off"]
    # the data's own recipe, said at the start as well
    caplog.clear()
    code, _, err = _cli(
        capsys, "train", "--data", "dates", "--run-dir", tmp_path / "own", "--max-steps", 1, "--no-progress"
    )
    assert code == 0, err
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("recipe ")]
    assert said == ["recipe dates (qkv/runs/recipes/dates.toml): the default recipe for dates data; bf16 autocast off"]

"""One resolve step (qkv.runs.resolve): a recipe, its step's split over the processes and the options
given are merged once, each value knows where it came from, and the run prints the result first;
the recipe's tables are typed sections (qkv.runs.recipes.sections) that still read as 1.x's dicts."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from qkv.data.spec import DataSpec
from qkv.inference.decode import DecodeConfig
from qkv.models.transformer import TransformerConfig
from qkv.runs import lifecycle
from qkv.runs.recipes import DecodeSection, ModelSection, Recipe, StepsSection, TrainSection, load_recipe
from qkv.runs.recipes.steps import step_batches
from qkv.runs.resolve import ResolvedOptions, as_resolved, resolve_run_options
from qkv.runs.translation_kind import TRANSLATION
from qkv.runtime import precision
from qkv.training.config import TrainConfig


@pytest.mark.parametrize(("world", "expected"), [(1, (12_500, 2)), (2, (12_500, 1)), (8, (3_125, 1))])
def test_a_recipe_s_step_is_split_over_the_processes_once(world, expected):
    """paper-base's 25,000 tokens a step (section 5.1): the split the docstring of step_batches gives."""
    resolved = resolve_run_options(load_recipe("paper-base"), world_size=world)
    assert (resolved.train["max_tokens"], resolved.train["accum_steps"]) == expected
    assert resolved.origin("max_tokens") == resolved.origin("accum_steps") == "recipe"


def test_options_given_win_and_each_value_says_where_it_came_from():
    recipe = load_recipe("paper-base")
    resolved = resolve_run_options(recipe, {"max_tokens": 3000, "max_steps": 7}, world_size=1)
    # the other half of the split fills the recipe's step around the given one
    assert resolved.train["accum_steps"] == step_batches(25_000, 1, max_tokens=3000)[1] == 8
    assert resolved.origin("max_tokens") == resolved.origin("max_steps") == "command line"
    assert resolved.origin("accum_steps") == "recipe" and resolved.origin("warmup_steps") == "recipe"
    assert resolved.origin("dropout_start") == "default" and "dropout_start" not in resolved.train
    assert resolved.given == {"max_tokens": 3000, "max_steps": 7}
    # the config built from it: the recipe's table with the resolved values over it
    expected = TrainConfig(**{**dict(recipe.train), "max_tokens": 3000, "accum_steps": 8, "max_steps": 7})
    assert resolved.train_config() == expected


def test_bf16_is_the_machine_s_where_the_recipe_asked_for_it_and_kept_where_given():
    recipe = load_recipe("multi30k")
    assert recipe.train["bf16"] is True
    slow = resolve_run_options(recipe, bf16_fast=False)
    assert slow.train["bf16"] is False and slow.origin("bf16") == "machine"
    assert resolve_run_options(recipe, bf16_fast=True).train["bf16"] is True
    asked = resolve_run_options(recipe, {"bf16": True}, bf16_fast=False)
    assert asked.train["bf16"] is True and asked.origin("bf16") == "command line"
    assert resolve_run_options(recipe).origin("bf16") == "recipe"  # the machine not yet known


def test_the_lines_name_each_group_and_its_values():
    resolved = resolve_run_options(load_recipe("paper-base"), {"max_steps": 7}, world_size=2)
    lines = resolved.lines()
    assert len(lines) == 3
    assert lines[0].startswith("options from the recipe paper-base: ") and "warmup_steps 4000" in lines[0]
    assert "a step: 2 x 1 x 12500 = 25000 of the recipe's 25000 tokens" in lines[0]
    assert lines[1] == "options from the command line: max_steps 7"
    assert lines[2] == "options from the machine: 2 processes"


def test_a_start_hook_receives_the_resolved_options(tmp_path, monkeypatch, caplog):
    calls = []

    def start(run_dir, **keywords):
        calls.append(keywords)
        logging.getLogger("qkv.runs.translation_kind").info("model: built")
        return "trainer"

    monkeypatch.setattr(lifecycle, "kind_for_source", lambda source: replace(TRANSLATION, start=start))
    with caplog.at_level(logging.INFO, logger="qkv"):
        got = lifecycle.start_run(
            tmp_path / "run",
            data=DataSpec(source="multi30k"),
            train_options={"max_tokens": 3000},
            recipe="paper-base",
            device="cpu",
        )
    assert got == "trainer"
    (keywords,) = calls
    resolved = keywords["train_options"]
    assert isinstance(resolved, ResolvedOptions)
    here = precision.bf16_is_fast("cpu")  # the machine's part: bf16 where it is fast
    expected = resolve_run_options(load_recipe("paper-base"), {"max_tokens": 3000}, bf16_fast=here)
    assert resolved.train == expected.train and resolved.origin("bf16") == ("recipe" if here else "machine")


@pytest.mark.parametrize("source", ["dates", "text"])
def test_a_run_says_its_options_once_its_inputs_are_checked(tmp_path, caplog, source):
    """A run's opening lines are its resolved options (before the model's line); a refused input
    is one line with nothing before it (the options are said only once the data is usable)."""
    text = tmp_path / "t.txt"
    text.write_text("to be or not to be, that is the question\n" * 400, encoding="utf-8")
    data = (
        DataSpec(source="dates", train_size=200, valid_size=20)
        if source == "dates"
        else DataSpec(source="text", train_text=str(text))
    )
    small = {"max_steps": 1, "max_minutes": 0, "progress": False, "max_tokens": 600, "eval_every_steps": 0}
    model = {"d_model": 16, "num_heads": 2, "d_ff": 32}
    model |= (
        {"num_layers": 1, "context": 32} if source == "text" else {"num_encoder_layers": 1, "num_decoder_layers": 1}
    )
    with caplog.at_level(logging.INFO, logger="qkv"):
        lifecycle.start_run(tmp_path / "run", data=data, model_options=model, train_options=small, device="cpu")
    messages = [record.getMessage() for record in caplog.records]
    said = [m for m in messages if m.startswith("options from ")]
    assert said and "options from the command line: " in said[1 if said[0].startswith("options from the recipe") else 0]
    model_line = next(i for i, m in enumerate(messages) if m.startswith("model: "))
    assert all(messages.index(m) < model_line for m in said)
    empty = tmp_path / "empty.txt"
    empty.write_text("", encoding="utf-8")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="qkv"), pytest.raises(ValueError, match="empty"):
        lifecycle.start_run(tmp_path / "run2", data=DataSpec(source="text", train_text=str(empty)), device="cpu")
    assert not [r for r in caplog.records if r.getMessage().startswith("options from ")]


def test_a_hook_called_directly_resolves_its_options_over_the_recipe():
    recipe = load_recipe("multi30k")
    resolved = as_resolved(recipe, {"max_steps": 3})
    assert resolved.train == {**dict(recipe.train), "max_steps": 3}
    assert as_resolved(recipe, resolved) is resolved


def test_a_recipe_s_tables_are_typed_sections_that_read_as_dicts():
    recipe = load_recipe("multi30k")
    assert isinstance(recipe.model, ModelSection) and isinstance(recipe.train, TrainSection)
    assert isinstance(recipe.decode, DecodeSection)
    assert recipe.decode == {"beam_size": 5, "alpha": 2.2, "penalty": "gnmt"}
    assert recipe.decode.config() == DecodeConfig(beam_size=5, alpha=2.2, penalty="gnmt")
    assert recipe.train.config() == TrainConfig(**dict(recipe.train))
    assert recipe.model["d_model"] == 256 and recipe.model.config_class() is TransformerConfig
    assert recipe.steps is None and recipe.step_options(4) == {}
    paper = load_recipe("paper-base")
    assert paper.steps == StepsSection(25_000)
    split = step_batches(25_000, 8)
    assert paper.steps.split(8) == {"max_tokens": split[0], "accum_steps": split[1]}
    # a Recipe made by hand from plain dicts (1.x scripts did) gets the same sections
    by_hand = Recipe(
        name="mine",
        description="d",
        task="translation",
        vocab_size=600,
        model=dict(recipe.model),
        train={"max_steps": 3},
        source=recipe.source,
    )
    assert isinstance(by_hand.train, TrainSection) and by_hand.train == {"max_steps": 3}
    assert isinstance(by_hand.model, ModelSection) and by_hand.model == recipe.model

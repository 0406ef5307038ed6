"""``qkv train --help`` is short and says what each option defaults to; ``--help-all`` lists every option.

The flags are checked against a list written here by hand from ``qkv train`` as it was before the
help was split (66c0514: 68 options besides ``-h``), so that none is lost or changes its meaning. The
defaults the help prints are checked against the recipe files read here with ``tomllib``, not
through qkv's own recipe loader.
"""

from __future__ import annotations

import argparse
import io
import math
import re
import sys
from contextlib import redirect_stdout
from dataclasses import fields
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, from PyPI
    import tomli as tomllib

from qkv.cli import build_parser, main
from qkv.cli.reference import render_markdown
from qkv.training import TrainConfig

RECIPES = Path(__file__).resolve().parents[1] / "src" / "qkv" / "runs" / "recipes"

# every option of qkv train at 66c0514: (flags, dest, what it takes)
OLD_OPTIONS = [
    (("--task",), "task", "choice:translation,lm"),
    (("--data",), "data", "choice:multi30k,dates,tinyshakespeare"),
    (("--prepared",), "prepared", "str"),
    (("--data-dir",), "data_dir", "str"),
    (("--src-lang",), "src_lang", "choice:en,de,fr"),
    (("--tgt-lang",), "tgt_lang", "choice:en,de,fr"),
    (("--both-directions",), "both_directions", "true"),
    (("--train-src",), "train_src", "str"),
    (("--train-tgt",), "train_tgt", "str"),
    (("--val-src",), "val_src", "str"),
    (("--val-tgt",), "val_tgt", "str"),
    (("--train-text",), "train_text", "str"),
    (("--val-text",), "val_text", "str"),
    (("--test-text",), "test_text", "str"),
    (("--tokenizer",), "tokenizer", "choice:char,bpe"),
    (("--windows",), "windows", "choice:random,strided"),
    (("--run-dir",), "run_dir", "str"),
    (("--resume",), "resume", "true"),
    (("--trust-checkpoint",), "trust_checkpoint", "true"),
    (("--overwrite",), "overwrite", "true"),
    (("--recipe",), "recipe", "choice:dates,files,multi30k,paper-base,paper-big"),
    (("--vocab-size",), "vocab_size", "int"),
    (("--d-model",), "d_model", "int"),
    (("--heads",), "heads", "int"),
    (("--encoder-layers",), "encoder_layers", "int"),
    (("--decoder-layers",), "decoder_layers", "int"),
    (("--layers",), "layers", "int"),
    (("--d-ff",), "d_ff", "int"),
    (("--dropout",), "dropout", "float"),
    (("--attention-dropout",), "attention_dropout", "float"),
    (("--activation",), "activation", "choice:gelu"),
    (("--norm-first", "--no-norm-first"), "norm_first", "bool"),
    (("--max-len",), "max_len", "int"),
    (("--context",), "context", "int"),
    (("--share-embeddings", "--no-share-embeddings"), "share_embeddings", "bool"),
    (("--max-tokens",), "max_tokens", "int"),
    (("--accum-steps",), "accum_steps", "int"),
    (("--lr-factor",), "lr_factor", "float"),
    (("--warmup",), "warmup_steps", "int"),
    (("--schedule",), "schedule", "choice:inverse_sqrt,budget"),
    (("--decay-fraction",), "decay_fraction", "float"),
    (("--weight-decay",), "weight_decay", "float"),
    (("--label-smoothing",), "label_smoothing", "float"),
    (("--rdrop",), "rdrop", "float"),
    (("--rdrop-start",), "rdrop_start", "float"),
    (("--dropout-start",), "dropout_start", "float"),
    (("--both-directions-until",), "both_directions_until", "float"),
    (("--subword-dropout",), "subword_dropout", "float"),
    (("--clip-norm",), "clip_norm", "float"),
    (("--bf16", "--no-bf16"), "bf16", "bool"),
    (("--compile", "--no-compile"), "compile", "bool"),
    (("--max-steps",), "max_steps", "int"),
    (("--epochs",), "max_epochs", "float"),
    (("--minutes",), "max_minutes", "float"),
    (("--eval-every-steps",), "eval_every_steps", "int"),
    (("--eval-every-minutes",), "eval_every_minutes", "float"),
    (("--eval-sentences",), "eval_sentences", "int"),
    (("--checkpoint-every-steps",), "checkpoint_every_steps", "int"),
    (("--checkpoint-every-minutes",), "checkpoint_every_minutes", "float"),
    (("--average-last",), "average_last", "int"),
    (("--ema-decay",), "ema_decay", "float"),
    (("--final-weights",), "final_weights", "choice:average,best,ema"),
    (("--log-every-steps",), "log_every_steps", "int"),
    (("--seed",), "seed", "int"),
    (("--strategy",), "strategy", "choice:ddp,fsdp"),
    (("--threads",), "threads", "int"),
    (("--device",), "device", "str"),
    (("--no-progress",), "no_progress", "true"),
]
RESEARCH = [
    "--both-directions",
    "--rdrop",
    "--rdrop-start",
    "--dropout-start",
    "--both-directions-until",
    "--subword-dropout",
]
# the model field each model option sets: (translation field, language-model field)
MODEL_FIELDS = {
    "--d-model": ("d_model", "d_model"),
    "--heads": ("num_heads", "num_heads"),
    "--encoder-layers": ("num_encoder_layers", None),
    "--decoder-layers": ("num_decoder_layers", None),
    "--layers": (None, "num_layers"),
    "--d-ff": ("d_ff", "d_ff"),
    "--dropout": ("dropout", "dropout"),
    "--max-len": ("max_len", None),
    "--context": (None, "context"),
    "--share-embeddings": ("share_embeddings", None),
    "--activation": ("activation", "activation"),
    "--attention-dropout": ("attention_dropout", "attention_dropout"),
    "--norm-first": ("norm_first", "norm_first"),
    "--norm": ("norm", "norm"),
    "--positional": ("positional", "positional"),
    "--kv-heads": ("num_kv_heads", "num_kv_heads"),
    "--sliding-window": (None, "sliding_window"),
    "--qk-norm": (None, "qk_norm"),
    "--bias": (None, "bias"),
}


def help_text(monkeypatch, *argv: str) -> str:
    """What ``qkv train ARGV`` prints (help, so it exits 0), unwrapped: one line per option."""
    monkeypatch.setenv("COLUMNS", "2000")  # argparse wraps at the terminal width
    out = io.StringIO()
    with redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        main(["train", *argv])
    assert exit_.value.code == 0
    return out.getvalue()


def option_lines(text: str) -> dict[str, str]:
    """``{first flag: "INVOCATION  HELP"}`` of every option the help lists (a help that argparse puts
    on the lines below its invocation joined to it)."""
    entries: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("  -"):
            current = line.split()[0].rstrip(",")
            entries[current] = line.strip()
        elif current is not None and line.startswith("   "):
            entries[current] += "  " + line.strip()
        else:
            current = None
    return entries


def sections(text: str) -> dict[str, list[str]]:
    """``{group heading: the first flag of each option under it}``."""
    found: dict[str, list[str]] = {}
    heading = None
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            heading = line[:-1]
            found[heading] = []
        elif line.startswith("  -") and heading is not None:
            found[heading].append(line.split()[0].rstrip(","))
    return found


def shown(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def test_help_lists_at_most_30_options_in_four_groups(monkeypatch):
    text = help_text(monkeypatch, "--help")
    lines = [line for line in text.splitlines() if line.lstrip().startswith("-") and line.startswith("  -")]
    assert 20 <= len(lines) <= 30, len(lines)
    groups = [heading.split(" (")[0] for heading in sections(text)]
    assert groups == ["options", "data", "model", "training", "run folder and budget"]
    flags = option_lines(text)
    for flag in (
        "--data",
        "--train-src",
        "--train-text",
        "--prepared",
        "--run-dir",
        "--resume",
        "--minutes",
        "--max-tokens",
    ):
        assert flag in flags
    for flag in [*RESEARCH, "--attention-dropout", "--compile", "--strategy", "--ema-decay", "--threads", "--device"]:
        assert flag not in flags, f"{flag} is in --help"
    assert "qkv train --help-all" in text


def test_help_all_lists_every_old_option_and_the_research_methods_in_their_own_group(monkeypatch):
    text = help_text(monkeypatch, "--help-all")
    listed = {
        flag
        for line in option_lines(text).values()
        for flag in line.split("  ")[0].replace(",", " ").split()
        if flag.startswith("-")
    }
    for flags, _, _ in OLD_OPTIONS:
        for flag in flags:
            assert flag in listed, f"{flag} is not in --help-all"
    research = [heading for heading in sections(text) if heading.startswith("research methods")]
    assert research == ["research methods (off by default; did not help on Multi30k, see docs/history)"]
    assert sorted(sections(text)[research[0]]) == sorted(RESEARCH)


def parsed(argv: list[str]) -> argparse.Namespace:
    return build_parser("train").parse_args(["train", "--run-dir", "r", *argv])


@pytest.mark.parametrize("flags,dest,takes", OLD_OPTIONS, ids=[o[0][0] for o in OLD_OPTIONS])
def test_every_old_option_parses_to_the_same_dest_and_value(flags, dest, takes):
    if takes == "true":
        assert getattr(parsed([flags[0]]), dest) is True
        return
    if takes == "bool":
        assert getattr(parsed([flags[0]]), dest) is True
        assert getattr(parsed([flags[1]]), dest) is False
        assert getattr(parsed([]), dest) is None  # not given: the recipe's
        return
    plain = {"int": ("3", 3), "float": ("0.25", 0.25), "str": ("some/where", "some/where")}
    value, expected = plain[takes] if takes in plain else (takes.split(":")[1].split(",")[-1],) * 2
    args = parsed([flags[0], value])
    assert getattr(args, dest) == expected
    if dest != "run_dir":
        assert getattr(parsed([]), dest) in (None, False)  # not given: the recipe's (or off)


def test_research_flags_still_set_the_same_training_values(tmp_path):
    from qkv.cli.train import data_spec, train_options_from

    args = parsed(
        [
            "--rdrop",
            "3",
            "--rdrop-start",
            "0.2",
            "--dropout-start",
            "0.1",
            "--both-directions-until",
            "0.5",
            "--subword-dropout",
            "0.1",
        ]
    )
    options = train_options_from(args)
    assert options == {
        "rdrop": 3.0,
        "rdrop_start": 0.2,
        "dropout_start": 0.1,
        "both_directions_until": 0.5,
        "subword_dropout": 0.1,
    }
    config = TrainConfig.from_dict(options)
    assert (config.rdrop, config.rdrop_start, config.dropout_start) == (3.0, 0.2, 0.1)
    assert (config.both_directions_until, config.subword_dropout) == (0.5, 0.1)
    for name in ("s", "t"):
        (tmp_path / name).write_text("a\n", encoding="utf-8")
    files = ["--train-src", str(tmp_path / "s"), "--train-tgt", str(tmp_path / "t")]
    assert data_spec(parsed([*files, "--both-directions"])).both_directions is True
    assert not data_spec(parsed(files)).both_directions


def recipe(name: str) -> dict:
    return tomllib.loads((RECIPES / f"{name}.toml").read_text(encoding="utf-8"))


def check_defaults(text: str, name: str, task: str) -> int:
    """Every "(default: V from the NAME recipe)" the help prints is NAME's value; returns how many."""
    own, train_flags = (
        recipe(name),
        {
            f.metadata["flag"] or "--" + f.name.replace("_", "-"): f.name
            for f in fields(TrainConfig)
            if f.metadata.get("cli")
        },
    )
    checked = 0
    for flag, line in option_lines(text).items():
        match = re.search(r"\(default: (.+?) from the (\S+) recipe\)$", line)
        if match is None or match.group(2) != name:
            continue
        value = match.group(1)
        if flag == "--vocab-size":
            expected = own["vocab_size"]
        elif flag in ("--tokenizer", "--windows"):
            expected = own["lm"][flag[2:]]
        elif flag in MODEL_FIELDS:
            expected = own["model"][MODEL_FIELDS[flag][task == "lm"]]
        elif flag == "--bf16":
            assert own["train"]["bf16"] is True and value.startswith("on where bf16 is fast")
            checked += 1
            continue
        else:
            expected = own["train"][train_flags[flag]]
        assert value == shown(expected), f"{flag}: {value} against {name}'s {expected}"
        checked += 1
    return checked


@pytest.mark.parametrize(
    "argv,name,task",
    [
        (["--help"], "multi30k", "translation"),
        (["--help-all"], "multi30k", "translation"),
        (["--data", "dates", "--help-all"], "dates", "translation"),
        (["--help-all", "--data", "tinyshakespeare"], "tinyshakespeare", "lm"),  # named after --help too
        (["--train-text", "corpus.txt", "--help-all"], "tinyshakespeare", "lm"),
        (["--prepared", "folder", "--help-all"], "multi30k", "translation"),
        (["--recipe", "paper-big", "--help-all"], "paper-big", "translation"),
        (["--data", "multi30k", "--recipe", "multi30k-bf16", "--help-all"], "multi30k-bf16", "translation"),
    ],
)
def test_the_defaults_shown_are_the_recipes_values(monkeypatch, argv, name, task):
    text = help_text(monkeypatch, *argv)
    assert f"Defaults shown: the {name} recipe's" in text
    assert check_defaults(text, name, task) >= (5 if argv[0] == "--help" else 12)
    lines = option_lines(text)
    # the options a run sets most often say what they default to
    for flag in (
        "--d-model",
        "--dropout",
        "--max-tokens",
        "--lr-factor",
        "--warmup",
        "--minutes",
        "--max-steps",
        "--seed",
    ):
        assert "(default: " in lines[flag], flag


def test_without_data_the_help_says_the_defaults_are_the_multi30k_recipes(monkeypatch):
    text = help_text(monkeypatch, "--help")
    assert "Defaults shown: the multi30k recipe's (the recipe of --data multi30k" in text
    assert "(default: 2000 from the multi30k recipe)" in option_lines(text)["--max-tokens"]


def test_max_tokens_comes_from_the_recipe_and_the_paper_recipes_split_their_step(monkeypatch):
    for name in ("multi30k", "dates", "tinyshakespeare"):
        line = option_lines(
            help_text(monkeypatch, "--recipe" if name != "tinyshakespeare" else "--data", name, "--help")
        )["--max-tokens"]
        assert line.endswith(f"(default: {recipe(name)['train']['max_tokens']} from the {name} recipe)")
        assert "6000" not in line
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    paper = recipe("paper-base")
    assert "max_tokens" not in paper["train"]
    lines = option_lines(help_text(monkeypatch, "--recipe", "paper-base", "--help-all"))
    # one process: the 25,000 tokens a step in the fewest batches of at most 12,500
    accum = math.ceil(paper["tokens_per_step"] / 12_500)
    assert (
        f"(default: {paper['tokens_per_step'] // accum}: the paper-base recipe's 25000 tokens a step"
        in lines["--max-tokens"]
    )
    assert f"(default: {accum}: the paper-base recipe's" in lines["--accum-steps"]


def test_the_cli_reference_lists_what_help_all_lists(monkeypatch):
    text = help_text(monkeypatch, "--help-all")
    reference = render_markdown()
    section = reference[reference.index("## qkv train") :]
    section = section[: section.index("\n## qkv ", 1)]
    for flag in option_lines(text):
        assert f"`{flag}" in section, flag
    assert "research methods (off by default" in section.lower()


def test_a_recipe_that_cannot_be_read_is_named_and_the_next_one_shown(monkeypatch):
    text = help_text(monkeypatch, "--recipe", "no-such-recipe", "--data", "dates", "--help")
    assert "Defaults shown: the dates recipe's (--data dates)." in text
    assert "Not shown: --recipe no-such-recipe: unknown recipe 'no-such-recipe'" in text
    text = help_text(monkeypatch, "--recipe", "no-such-recipe", "--help")
    assert "Defaults shown: the multi30k recipe's" in text and "Not shown: --recipe no-such-recipe" in text

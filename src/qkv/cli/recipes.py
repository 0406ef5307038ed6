"""``qkv recipes``: the recipes ``qkv train`` starts from, listed, or one shown as it would run here.

qkv recipes                                   # every recipe shipped with qkv: name, task, what it is for
qkv recipes show multi30k                     # its model, training and decoding settings on this machine
qkv recipes show multi30k --toml > my.toml    # the file itself, to copy and edit
qkv recipes show my.toml                      # a recipe file of your own, checked and resolved
qkv train --data multi30k --recipe my.toml --run-dir runs/mine
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from dataclasses import fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from qkv.runs.recipes import Recipe

# what each data source is called on qkv train's command line, for the list's last lines
SOURCE_FLAGS = {
    "multi30k": "--data multi30k",
    "files": "--train-src/--train-tgt or --prepared",
    "dates": "--data dates",
    "tinyshakespeare": "--data tinyshakespeare",
    "text": "--train-text",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``qkv recipes``'s flags: the action (``list``, the default, or ``show``), the recipe
    to show (a name or a ``.toml`` file) and ``--toml``.

    Args:
        parser: the ``recipes`` subcommand's parser, to add the flags to.
    """
    parser.add_argument(
        "action", nargs="?", choices=("list", "show"), default="list", help="list the recipes (default) or show one"
    )
    parser.add_argument("recipe", nargs="?", metavar="NAME|FILE.toml", help="with show: a recipe's name or a file")
    parser.add_argument(
        "--toml", action="store_true", help="with show: print the recipe's file as it is (to copy and edit)"
    )


def run(args: argparse.Namespace) -> int:
    """Run ``qkv recipes``: print the shipped recipes (:func:`list_lines`), or one recipe resolved
    as a run here would have it (:func:`show_lines`), or with ``--toml`` its file as it is.

    Args:
        args: the options :func:`add_arguments` declared, as parsed.

    Returns:
        The exit code: 0 once printed. ``show`` without a recipe, a recipe given to ``list``, or
        an unknown or invalid recipe raise, which the CLI reports as exit code 2.
    """
    from qkv.runs.recipes import load_recipe

    if args.action == "list":
        if args.recipe or args.toml:
            raise ValueError("name a recipe with show: qkv recipes show NAME|FILE.toml")
        print("\n".join(list_lines()))
        return 0
    if not args.recipe:
        raise ValueError("qkv recipes show needs a recipe: a name (qkv recipes lists them) or a .toml file")
    recipe = load_recipe(args.recipe)
    if args.toml:
        print(recipe.source.read_text(encoding="utf-8"), end="")
        return 0
    print("\n".join(show_lines(recipe)))
    return 0


def list_lines() -> list[str]:
    """One line per shipped recipe (name, task, description), then which data trains with which."""
    from qkv.runs.recipes import list_recipes, load_recipe

    recipes = [load_recipe(name) for name in list_recipes()]
    width = max(len(recipe.name) for recipe in recipes) + 2
    lines = [f"{'NAME':<{width}}{'TASK':<13}DESCRIPTION"]
    lines += [f"{recipe.name:<{width}}{recipe.task:<13}{recipe.description}" for recipe in recipes]
    defaults = [
        f"{', '.join(SOURCE_FLAGS.get(source, source) for source in recipe.default_for)}: {recipe.name}"
        for recipe in recipes
        if recipe.default_for
    ]
    on_gpu = [f"{recipe.gpu_variant} in place of {recipe.name}" for recipe in recipes if recipe.gpu_variant]
    return [
        *lines,
        "",
        "Without --recipe, qkv train uses the data's: " + "; ".join(defaults) + ".",
        *([f"On a CUDA device it trains with {', '.join(on_gpu)} (and says so)."] if on_gpu else []),
        "qkv recipes show NAME prints one as it would run here; qkv train --recipe NAME|FILE.toml trains with it.",
    ]


def show_lines(recipe: Recipe) -> list[str]:
    """A recipe resolved as a run would have it on this machine's default device, written as TOML:
    every model and training field (the library's default where the recipe says nothing, marked),
    bf16 as it would be here, and the decoding settings; what it is and why bf16 is what it is, in
    comments."""
    from qkv.runs.kinds import TRANSLATION, kind_named
    from qkv.runs.resolve import resolve_run_options
    from qkv.runtime.device import pick_device

    device = pick_device(None)
    resolved = resolve_run_options(recipe, world_size=1, device=device)  # as a run here would have it
    fast = bool(resolved.bf16_fast)
    given, train = resolved.train, resolved.train_config()
    lines = [
        f"# recipe {recipe.name}, resolved as a run on this machine would have it (itself a recipe file)",
        f"# file: {recipe.source}",
        f"# bf16: {_bf16_note(recipe, fast, device)}",
    ]
    if recipe.bf16_variant and train.bf16 and fast:
        lines.append(f"# bf16 is fast here: --recipe {recipe.bf16_variant} is this recipe tuned for it")
    if recipe.gpu_variant and device.type == "cuda":
        lines.append(f"# CUDA here: qkv train without --recipe trains with {recipe.gpu_variant} in place of this one")
    lines += [f"description = {_toml(recipe.description)}", f"task = {_toml(recipe.task)}"]
    lines.append(f"vocab_size = {recipe.vocab_size}")
    kind = kind_named(recipe.task)
    model_class = kind.model_config
    if kind is TRANSLATION:
        lines.append(f"split_digits = {_toml(recipe.split_digits)}")
        tokenizer_fields: tuple[str, ...] = ("src_vocab_size", "tgt_vocab_size", "pad_id")
    else:
        tokenizer_fields = ("vocab_size",)
        lines += ["", "[lm]", *(f"{key} = {_toml(value)}" for key, value in recipe.lm.items())]
    model = model_class(**recipe.model)
    lines += ["", f"[model]  # {model_class.__name__}; the tokenizer sets {', '.join(tokenizer_fields)}"]
    lines += _table(model, recipe.model, skip=tokenizer_fields)
    lines += ["", "[train]  # TrainConfig"]
    # only a recipe that asks for bf16 can differ from what runs here (a missing key is the library's false)
    asked = bool(recipe.train.get("bf16"))
    here = {"bf16": "off here: the recipe's true applies where bf16 is fast"} if asked and not train.bf16 else {}
    lines += _table(train, given, notes=here)
    if recipe.tokens_per_step is not None:
        lines.append(f"# max_tokens x accum_steps: the recipe's {recipe.tokens_per_step} tokens a step on 1 process")
    if kind is TRANSLATION:
        lines += ["", "[decode]", *(f"{key} = {_toml(value)}" for key, value in recipe.decode.items())]
    if recipe.budget is not None:  # [model] above is where a size option given starts; else the budget picks
        rule = recipe.budget
        lines += ["", "[budget]  # the size a run's budget affords replaces [model]'s sizes and max_tokens"]
        lines += [f"tokens_per_parameter = {rule.tokens_per_parameter!r}", "", "[budget.sizes]"]
        for name, size in zip(rule.names, rule.sizes, strict=True):
            lines.append(f"{name} = {{{', '.join(f'{k} = {_toml(v)}' for k, v in size.items())}}}")
    return lines


def _bf16_note(recipe: Recipe, fast: bool, device: torch.device) -> str:
    from qkv.runtime import precision

    if not recipe.train.get("bf16"):
        return "the recipe trains in float32"
    if fast:
        return f"the recipe asks for bf16 autocast where it is fast; {device} here: on"
    return f"the recipe asks for bf16 autocast where it is fast; {device} here: off, float32 ({precision.slow_bf16_reason(device)})"


def _table(config: Any, given: Mapping, *, skip: tuple[str, ...] = (), notes: dict | None = None) -> list[str]:
    """Every field of ``config`` as ``key = value``, those ``given`` does not set marked as defaults."""
    lines = []
    for f in fields(config):
        if f.name in skip:
            continue
        note = (notes or {}).get(f.name) or ("" if f.name in given else "library default")
        value = getattr(config, f.name)
        if value is None:  # TOML has no null: an unset option is a comment (its absence is the default)
            lines.append(f"# {f.name} = (unset)" + (f"  # {note}" if note else ""))
            continue
        lines.append(f"{f.name} = {_toml(value)}" + (f"  # {note}" if note else ""))
    return lines


def _toml(value: Any) -> str:
    """``value`` written as TOML (booleans, numbers, strings, and tuples as arrays)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)

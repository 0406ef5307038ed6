"""The bf16 rule in one place: where bfloat16 products are slow, a recipe's bf16 is turned off and one
the user gave is kept (with a warning). The resolve step (qkv.runs.resolve) applies it once; the run
kinds read its result, and a language model's budget is measured in that same precision."""

from __future__ import annotations

import ast
import json
import logging

import pytest
from test_import_layers import SRC

from qkv.data.spec import DataSpec
from qkv.runs import language_model, lifecycle
from qkv.runs.recipes import load_recipe
from qkv.runs.resolve import as_resolved
from qkv.runtime import precision

RULE = "runs/resolve.py"


def callers(function: str) -> set[str]:
    """The files under src/qkv that call ``function`` (by name or as an attribute: ``precision.f(...)``)."""
    found = set()
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
                if name == function:
                    found.add(path.relative_to(SRC).as_posix())
    return found


def test_the_bf16_rule_is_applied_by_the_resolve_step_alone():
    """No module applies bf16_where_fast's rule but the resolve step: nothing else in the package calls
    it, and among the runs' modules only the resolve step asks whether bf16 is fast."""
    assert callers("bf16_where_fast") <= {RULE}
    assert {name for name in callers("bf16_is_fast") if name.startswith("runs/")} == {RULE}


def test_callers_finds_both_forms_of_call(tmp_path, monkeypatch):
    import test_bf16_rule

    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "a.py").write_text("precision.bf16_where_fast(True, 'cpu', asked=False)\n")
    (tmp_path / "b.py").write_text("from x import bf16_where_fast\nbf16_where_fast(True, 'cpu', asked=False)\n")
    monkeypatch.setattr(test_bf16_rule, "SRC", tmp_path)
    assert callers("bf16_where_fast") == {"runs/a.py", "b.py"}


def test_a_hook_called_directly_gets_the_machine_s_bf16_from_the_resolve_step(monkeypatch):
    monkeypatch.setattr(precision, "bf16_is_fast", lambda device="cpu": False)
    recipe = load_recipe("multi30k")
    assert recipe.train["bf16"] is True
    dropped = as_resolved(recipe, {"max_steps": 3}, device="cpu")
    assert dropped.train_config().bf16 is False and dropped.origin("bf16") == "machine"
    assert dropped.lines()[-1] == "options from the machine: 1 process, bf16 off" and dropped.warnings() == []
    kept = as_resolved(recipe, {"bf16": True}, device="cpu")
    assert kept.train_config().bf16 is True and kept.origin("bf16") == "command line"
    (warning,) = kept.warnings()
    assert "slower than float32 on this cpu" in warning and "expect slow steps" in warning
    monkeypatch.setattr(precision, "bf16_is_fast", lambda device="cpu": True)
    assert as_resolved(recipe, {}, device="cpu").train_config().bf16 is True


@pytest.mark.parametrize("given", [False, True])
def test_where_bf16_is_slow_a_language_model_keeps_a_given_bf16_and_drops_the_recipe_s(
    tmp_path, monkeypatch, caplog, given
):
    """The tinyshakespeare recipe asks for bf16; on a machine where it is slow the run trains in
    float32 unless --bf16 was given, its budget's speeds are measured in the precision it trains in,
    and the run says so once its text is read (a warning for a bf16 given)."""
    monkeypatch.setattr(precision, "bf16_is_fast", lambda device="cpu": False)
    assert load_recipe("tinyshakespeare").train["bf16"] is True
    measured = []

    def speeds(*args, bf16, **keywords):
        measured.append(bf16)
        return lambda size: 1e5

    monkeypatch.setattr(language_model, "measured_speeds", speeds)
    text = tmp_path / "t.txt"
    text.write_text("to be or not to be, that is the question\n" * 200, encoding="utf-8")
    train = {"max_steps": 2, "max_minutes": 0.0, "progress": False, "eval_every_minutes": 0.0}
    train |= {"checkpoint_every_minutes": 0.0, **({"bf16": True} if given else {})}
    with caplog.at_level(logging.INFO, logger="qkv"):
        trainer = lifecycle.start_run(
            tmp_path / "run", data=DataSpec(source="text", train_text=str(text)), train_options=train, device="cpu"
        )
    assert trainer.config.bf16 is given and measured == [given]
    assert json.loads((tmp_path / "run" / "config.json").read_text())["train"]["bf16"] is given
    messages = [(record.levelno, record.getMessage()) for record in caplog.records]
    slow = [text for level, text in messages if level == logging.WARNING and "expect slow steps" in text]
    assert len(slow) == (1 if given else 0)
    assert any(text.startswith("options from the machine: 1 process, bf16 off") for _, text in messages) is not given

"""The registry of run kinds (qkv.runs.kinds): every kind registered, every data source in exactly one
kind, a new kind found by the lookups without touching other modules, the lifecycle calling a
kind's hooks (checked against the kinds' own modules and the data package's source lists), the
registry importable without the trainer, and the string switches on a kind's name gone."""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from test_import_layers import RANK, SRC

from qkv.data.sources import SOURCES
from qkv.data.spec import DataSpec
from qkv.data.text import TEXT_SOURCES
from qkv.inference import kinds as model_kinds
from qkv.inference.kinds import CAUSAL_LM, SEQ2SEQ
from qkv.models.causal_lm import CausalLMConfig
from qkv.models.transformer import TransformerConfig
from qkv.runs import kinds, lifecycle, translation
from qkv.runs.language_model import LANGUAGE_MODEL, start_lm_run
from qkv.runs.run_kind import Hook, loaded
from qkv.runs.translation_kind import TRANSLATION, start_translation_run
from qkv.training import LanguageModelTask, TranslationTask


def test_both_kinds_are_registered_under_the_names_run_folders_store():
    assert kinds.kind_names() == ("translation", "lm")
    assert kinds.kind_named("translation") is TRANSLATION is kinds.TRANSLATION
    assert kinds.kind_named("lm") is LANGUAGE_MODEL is kinds.LANGUAGE_MODEL
    assert (TRANSLATION.model, LANGUAGE_MODEL.model) == (SEQ2SEQ, CAUSAL_LM)
    assert (TRANSLATION.model_config, loaded(TRANSLATION.task_class)) == (TransformerConfig, TranslationTask)
    assert (LANGUAGE_MODEL.model_config, loaded(LANGUAGE_MODEL.task_class)) == (CausalLMConfig, LanguageModelTask)
    assert (TRANSLATION.serve_kind, LANGUAGE_MODEL.serve_kind) == ("seq2seq", "lm")
    assert (TRANSLATION.title, LANGUAGE_MODEL.title) == ("translation", "language model")
    assert model_kinds.MODEL_KINDS == {"translation": SEQ2SEQ, "lm": CAUSAL_LM}
    with pytest.raises(ValueError, match="unknown kind of run 'nope'"):
        kinds.kind_named("nope")


def test_a_run_folders_kind_comes_from_its_config():
    assert kinds.run_kind({"qkv_run": 2, "model": {}}) is TRANSLATION  # 0.1 and 1.x folders store no task
    assert kinds.run_kind({"task": "translation"}) is TRANSLATION
    assert kinds.run_kind({"task": "lm"}) is LANGUAGE_MODEL
    assert not TRANSLATION.stored and LANGUAGE_MODEL.stored
    assert model_kinds.model_kind({"model": {}}) is SEQ2SEQ and model_kinds.model_kind({"task": "lm"}) is CAUSAL_LM
    with pytest.raises(ValueError, match=r"run/config.json: unknown task 'nope'; qkv knows translation, lm"):
        model_kinds.model_kind({"task": "nope"}, "run/config.json")


@pytest.mark.parametrize("source", SOURCES + TEXT_SOURCES)
def test_every_data_source_belongs_to_exactly_one_kind(source):
    owners = [kind.name for kind in kinds.KINDS.values() if source in kind.sources]
    assert owners == (["lm"] if source in TEXT_SOURCES else ["translation"])
    assert kinds.kind_for_source(source).name == owners[0]


def test_an_unknown_source_is_refused():
    with pytest.raises(ValueError, match="unknown data source 'nope'"):
        kinds.kind_for_source("nope")


def _fake_kind(name: str = "fake", sources: tuple[str, ...] = ("fake-text",)) -> kinds.RunKind:
    return replace(LANGUAGE_MODEL, model=replace(CAUSAL_LM, name=name, title="fake model"), sources=sources)


@pytest.fixture
def registries(monkeypatch):
    """Both registries (run kinds, kinds of model) as they were, after the test."""
    monkeypatch.setattr(kinds, "KINDS", dict(kinds.KINDS))
    monkeypatch.setattr(model_kinds, "MODEL_KINDS", dict(model_kinds.MODEL_KINDS))


def test_a_new_kind_is_found_by_every_lookup(registries):
    fake = kinds.register_kind(_fake_kind())
    assert kinds.kind_for_source("fake-text") is fake
    assert kinds.run_kind({"task": "fake"}) is fake
    assert model_kinds.model_kind({"task": "fake"}) is fake.model  # its run folders open for inference
    assert kinds.kind_names() == ("translation", "lm", "fake")
    with pytest.raises(ValueError, match="registered already"):
        kinds.register_kind(_fake_kind())
    with pytest.raises(ValueError, match=r"\['text'\] belong to 'lm'"):
        kinds.register_kind(_fake_kind("other", ("text",)))


def test_start_run_calls_the_sources_kind_with_its_own_options(monkeypatch, registries, tmp_path):
    calls = []

    def start(run_dir: Path, **keywords):
        calls.append((run_dir, keywords))
        return "trainer"

    def start_options(data, options):
        if options.get("decode"):
            raise ValueError("decode is not a fake option")
        return {"fake_options": options["lm_options"]}

    kinds.register_kind(replace(_fake_kind(), start=start, start_options=start_options))
    monkeypatch.setattr(lifecycle, "choose_recipe", lambda recipe, source, device: _Choice())
    data = DataSpec(source="fake-text")
    got = lifecycle.start_run(tmp_path / "run", data=data, lm_options={"windows": "strided"}, device="cpu")
    assert got == "trainer"
    ((run_dir, keywords),) = calls
    assert run_dir == tmp_path / "run" and keywords["fake_options"] == {"windows": "strided"}
    assert keywords["data"] is data and keywords["choice"].recipe is _Choice.recipe
    with pytest.raises(ValueError, match="decode is not a fake option"):
        lifecycle.start_run(tmp_path / "run", data=data, decode={"beam_size": 2}, device="cpu")


class _Recipe:
    name, train, steps, tokens_per_step = "fake", {}, None, None  # what the one resolve step reads


class _Choice:
    recipe = _Recipe()


def test_options_of_the_other_kind_are_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match="tokenizer: options of a language model"):
        lifecycle.start_run(tmp_path / "a", data=DataSpec(source="dates"), lm_options={"tokenizer": "char"})
    with pytest.raises(ValueError, match="--both-directions is for translation.*not a language model"):
        lifecycle.start_run(tmp_path / "b", data=DataSpec(source="tinyshakespeare", both_directions=True))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_the_old_names_are_the_same_objects():
    assert translation.start_run is lifecycle.start_run
    assert translation.resume_run is lifecycle.resume_run
    assert translation.run_training is lifecycle.run_training
    assert translation.start_translation_run is start_translation_run is loaded(TRANSLATION.start)
    assert loaded(LANGUAGE_MODEL.start) is start_lm_run


def test_every_hook_names_an_object_that_exists():
    for kind in kinds.KINDS.values():
        for name in ("task_class", "start", "start_options", "open_task"):
            hook = getattr(kind, name)
            assert isinstance(hook, Hook) and callable(hook.load()), (kind, name)


LIGHT = """
import sys
import qkv.runs.kinds, qkv.runs.run_kind, qkv.inference.kinds
from qkv.runs import is_run_folder, kinds
import qkv.viz.explorers, qkv.viz.lm_explorer, qkv.viz.app, qkv.cli.recipes, qkv.cli.attend
kind = kinds.run_kind({"task": "lm"})
print(kind.name, kind.title, kind.serve_kind, kind.model_config.__name__, kind.stored, kinds.kind_for_source("text").name)
print(sorted(m for m in sys.modules if m.startswith("qkv.training") or m in ("qkv.runs.lifecycle", "qkv.runs.translation_kind", "qkv.runs.language_model")))
"""


def test_the_registry_imports_no_trainer():
    """In a fresh process: the registry, what a kind says of itself and the modules of the explorer
    and the commands that read it leave the trainer and the runs' start code unimported; the
    lifecycle's names are still there, imported when used."""
    result = subprocess.run([sys.executable, "-c", LIGHT], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    said, imported = result.stdout.strip().splitlines()[-2:]
    assert said == "lm language model lm CausalLMConfig True lm"
    assert imported == "[]"
    code = "import qkv.runs, sys; qkv.runs.start_run; print('qkv.training' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "True"


# The string literals naming a kind of run ("translation", "lm") or an explorer's kind ("seq2seq") that
# remain in the packages above runs/, per file: a ceiling, so a new switch on a kind's name fails here.
# Decide by the registries instead: qkv.inference.kinds (SEQ2SEQ, CAUSAL_LM, model_kind(config): what
# inference, serve and the explorer need, below the trainer) and qkv.runs.kinds (TRANSLATION,
# LANGUAGE_MODEL, run_kind(config), kind_for_source: light too, its training hooks imported when called).
KIND_LITERALS = {
    # the benchmark's section of a language model is named "lm" (a section's name, which the JSON
    # results are keyed by, not a switch on the kind: its kind is LANGUAGE_MODEL.name)
    "bench/gpu.py": 2,
    "bench/gpu_models.py": 3,
    # qkv train's own words for each --task in its errors and help (which describe the kinds to the
    # user by the names they type): the train command's files, outside this registry's change
    "cli/train/data.py": 2,
    "cli/train/help.py": 11,
}


def kind_literals(source: str) -> int:
    """How many string constants in ``source`` are exactly a kind's name ("translation", "lm", "seq2seq")."""
    words = {kind.name for kind in kinds.KINDS.values()} | {kind.serve_kind for kind in kinds.KINDS.values()}
    return sum(isinstance(node, ast.Constant) and node.value in words for node in ast.walk(ast.parse(source)))


def test_kind_literals_are_counted_in_code_and_not_in_text():
    assert kind_literals('x = "lm"\nif task == "translation" or kind != "seq2seq": pass') == 3
    assert kind_literals('"""a lm run"""\nx = "lms"\ny = LANGUAGE_MODEL.name') == 0


def test_no_new_kind_name_literals_above_runs():
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC).parts
        if len(parts) > 1 and RANK.get(parts[0], -1) > RANK["runs"]:
            count = kind_literals(path.read_text(encoding="utf-8"))
            if count:
                found["/".join(parts)] = count
    over = {
        name: (count, KIND_LITERALS.get(name, 0)) for name, count in found.items() if count > KIND_LITERALS.get(name, 0)
    }
    assert not over, f"new kind-name string literals (found, allowed): {over}; decide by qkv.runs.kinds instead"

"""qkv.inference: one Translator protocol over three engines (qkv's own, CTranslate2, ONNX Runtime),
each giving the translations of the path it replaces; the engine policy's refusals; open_run; the old
import paths; and nothing that only decodes importing the trainer."""

import importlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qkv.decoding.translate import translate_texts
from qkv.inference import (
    ENGINES,
    DecodeConfig,
    QkvTranslator,
    Translator,
    check_engine,
    open_run,
    open_translator,
)
from qkv.models.weights import save_weights

FIXTURES = Path(__file__).parent / "fixtures" / "runs_v0_1"
SOURCES = ["A man rides a bike.", "Two dogs play in the snow.", "A woman reads.", "Hi", "Children are running."] * 2


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """The v0.1 fixture run with random weights large enough that its translations differ from one
    sentence to the next (the fixture's own weights give the same string for every sentence)."""
    folder = shutil.copytree(FIXTURES / "translation_run", tmp_path_factory.mktemp("inference") / "run")
    model, _, _ = open_run(folder)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    save_weights(model, folder / "model.safetensors")
    return folder


def qkv_path(run_dir, texts, **decode):
    """Today's qkv path: the run loaded and decoded by translate_texts."""
    model, tokenizer, _ = open_run(run_dir)
    return translate_texts(model, tokenizer, texts, **decode)


def test_the_qkv_engine_translates_as_translate_texts(run_dir):
    translator = QkvTranslator.open([run_dir])
    assert isinstance(translator, Translator) and translator.name == "qkv"
    greedy = translator.translate(SOURCES, DecodeConfig(beam_size=1))
    assert len(set(greedy)) > 3  # varied: a real comparison
    assert greedy == qkv_path(run_dir, SOURCES, beam_size=1)
    for penalty in ("gnmt", "power"):
        got = translator.translate(SOURCES, DecodeConfig(beam_size=3, alpha=1.0, penalty=penalty, max_batch_tokens=50))
        assert got == qkv_path(run_dir, SOURCES, beam_size=3, alpha=1.0, penalty=penalty, max_batch_tokens=50)
    run = json.loads((run_dir / "config.json").read_text())["decode"]  # None: the run's recipe decodes
    default = qkv_path(run_dir, SOURCES, beam_size=run["beam_size"], alpha=run["alpha"])
    assert translator.translate(SOURCES) == default
    assert open_translator("qkv", run_dir).translate(SOURCES) == default
    translator.close()


def test_the_ctranslate2_engine_translates_as_before_and_as_qkv(run_dir, tmp_path):
    pytest.importorskip("ctranslate2")
    from qkv.export.ctranslate2 import export_ctranslate2

    folder = export_ctranslate2(run_dir, tmp_path / "ct2")
    translator = open_translator("ctranslate2", folder, threads=1)
    assert isinstance(translator, Translator) and translator.name == "ctranslate2"
    for beam in (1, 3):
        decode = DecodeConfig(beam_size=beam, alpha=1.0)  # penalty None: CTranslate2's own, the power form
        got = translator.translate(SOURCES, decode)
        assert got == translator.translate(SOURCES, beam_size=beam, alpha=1.0)  # the 1.x call
        assert got == qkv_path(run_dir, SOURCES, beam_size=beam, alpha=1.0, penalty="power")
    with pytest.raises(ValueError, match="len \\*\\* alpha only"):
        translator.translate(SOURCES, DecodeConfig(penalty="gnmt"))
    translator.close()


@pytest.mark.slow
def test_the_onnx_engine_translates_as_before_and_as_qkv_greedy(run_dir, tmp_path):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from qkv.export.onnx import export_onnx

    folder = export_onnx(run_dir, tmp_path / "onnx")
    translator = open_translator("onnx", folder, threads=1)
    assert isinstance(translator, Translator) and translator.name == "onnx"
    got = translator.translate(SOURCES, DecodeConfig(beam_size=1, max_batch_tokens=40))
    assert got == translator.translate(SOURCES, max_tokens=40)  # the 1.x call
    assert got == qkv_path(run_dir, SOURCES, beam_size=1, max_tokens=40)
    with pytest.raises(ValueError, match="greedily only"):
        translator.translate(SOURCES, DecodeConfig(beam_size=2))
    translator.close()


@pytest.mark.parametrize(
    "engine, options, message",
    [
        ("qkv", dict(quantization="int8"), "applies to --engine ctranslate2 only"),
        ("ctranslate2", dict(penalty="gnmt"), "divides by len ** alpha only"),
        ("ctranslate2", dict(ensemble=True), "CTranslate2 decodes one model"),
        ("ctranslate2", dict(bf16=True), "use --quantization bfloat16"),
        ("ctranslate2", dict(other_runs=["runs/b"]), "--against runs/b: other runs are decoded by qkv"),
        ("onnx", dict(beam_size=4), "decodes greedily only"),
        ("onnx", dict(ensemble=True), "decodes one model"),
        ("marian", {}, "choose one of qkv, ctranslate2, onnx"),
    ],
)
def test_the_policy_refuses_what_an_engine_cannot_do(engine, options, message):
    with pytest.raises(ValueError) as err:
        check_engine(engine, **options)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_policy_gives_each_engine_its_penalty_form():
    assert [check_engine(name) for name in ENGINES] == ["gnmt", "power", "gnmt"]
    assert check_engine("qkv", penalty="power", ensemble=True, bf16=True) == "power"
    assert check_engine("ctranslate2", quantization="int8", beam_size=5) == "power"


@pytest.mark.parametrize(
    "options",
    [dict(beam_size=0), dict(beam_size=101), dict(alpha=-1.0), dict(penalty="linear"), dict(max_batch_tokens=0)],
)
def test_a_decode_config_is_checked_when_made(options):
    with pytest.raises(ValueError):
        DecodeConfig(**options)


OLD_NAMES = {  # every name qkv 1.x users imported from the paths this package replaced
    "qkv.runs.folder": ["load_run", "load_translator", "build_run_model", "read_run_config", "read_model_config"]
    + ["is_run_folder", "run_task", "RUN_MARKER", "RUN_FORMAT", "create_run", "check_replaceable", "write_config"],
    "qkv.runs": ["load_run", "is_run_folder", "read_run_config"],
    "qkv.runs.recipes": ["decode_settings", "check_decode", "DEFAULT_DECODE", "MAX_SAVED_BEAM"],
    "qkv.runs.recipes.steps": ["decode_settings", "check_decode", "DEFAULT_DECODE", "step_batches"],
    "qkv.training.checkpoint_files": ["save_weights", "load_weights", "read_weights", "average_weight_files"]
    + ["check_saved_weights", "RUN_FORMAT", "CHECKPOINT_FILE", "save_checkpoint", "load_checkpoint", "saved_step"],
    "qkv.export.ctranslate2": ["Ct2Translator", "open_translator", "export_ctranslate2", "vocabulary", "MANIFEST"],
    "qkv.export.onnx_runtime": ["OnnxTranslator", "MANIFEST_FORMAT", "pad_batch"],
    "qkv.export.onnx": ["OnnxTranslator", "MANIFEST_FORMAT", "export_onnx"],
    "qkv.models.causal_lm": ["check_sampling", "sample_next", "MIN_TEMPERATURE", "MAX_TEMPERATURE", "MIN_TOP_P"],
    "qkv.serve.streaming": ["TextStream", "Sampling", "stream_events", "generate_text"],
    "qkv.cli.options": ["check_engine", "ct2_translator", "ENGINES", "COMPUTE_TYPES", "add_engine_options"],
}
NEW_HOMES = {
    ("qkv.runs.folder", "load_run"): "qkv.inference.runs",
    ("qkv.training.checkpoint_files", "load_weights"): "qkv.models.weights",
    ("qkv.export.ctranslate2", "Ct2Translator"): "qkv.inference.ctranslate2",
    ("qkv.export.onnx_runtime", "OnnxTranslator"): "qkv.inference.onnx_runtime",
    ("qkv.models.causal_lm", "sample_next"): "qkv.models.sampling",
    ("qkv.serve.streaming", "TextStream"): "qkv.inference.generation",
    ("qkv.runs.recipes", "decode_settings"): "qkv.inference.decode",
}


@pytest.mark.parametrize("module", sorted(OLD_NAMES))
def test_the_old_import_paths_still_work(module):
    pytest.importorskip("ctranslate2")
    found = importlib.import_module(module)
    missing = [name for name in OLD_NAMES[module] if not hasattr(found, name)]
    assert not missing, f"{module} lacks {missing}"
    for (old, name), home in NEW_HOMES.items():
        if old == module:  # the same object, not a copy
            assert getattr(found, name) is getattr(importlib.import_module(home), name)


def test_what_only_decodes_never_imports_the_trainer(tmp_path):
    """In a fresh process: the inference package, opening a translation run and a language model (as
    qkv translate's engine and qkv generate do), every engine's module, qkv serve's opening of both
    runs (its explorer and endpoints) and a whole ``qkv translate`` leave qkv.training unimported."""
    pytest.importorskip("fastapi")
    sources = tmp_path / "sources.txt"
    sources.write_text("A man.\nTwo dogs.\n")
    code = f"""
import sys
import qkv.inference, qkv.inference.ctranslate2, qkv.inference.onnx_runtime
from qkv.inference import QkvTranslator, open_run
QkvTranslator.open([{str(FIXTURES / "translation_run")!r}]).translate(["A man."])
open_run({str(FIXTURES / "lm_run")!r})
from qkv.cli.generate import open_language_model
open_language_model({str(FIXTURES / "lm_run")!r})
from qkv.serve.models import open_models
import qkv.serve.app, qkv.serve.streaming, qkv.export.onnx_runtime
open_models([{str(FIXTURES / "translation_run")!r}, {str(FIXTURES / "lm_run")!r}])
from qkv.cli import main
assert main(["translate", {str(FIXTURES / "translation_run")!r}, {str(sources)!r}, "-o", {str(sources) + ".out"!r}]) == 0
print(sorted(m for m in sys.modules if m.startswith("qkv.training")))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"
    assert len((tmp_path / "sources.txt.out").read_text().splitlines()) == 2  # qkv translate did translate

"""ONNX export of a translation run (qkv.export.onnx): the graphs compute qkv's encoder output and decoder
steps (with an empty and a growing cache) to 1e-4, and greedy decoding over onnxruntime gives exactly
qkv's greedy translations. Two runs: a dates run trained here (pre-LN, its own embeddings) and the
v0.1 fixture run (post-LN, GELU, shared embeddings) on Multi30k sentences."""

import gzip
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxscript")

from qkv.cli import main  # noqa: E402  (after the skips: without onnxruntime nothing here runs)
from qkv.data.batching import pad_sequences  # noqa: E402
from qkv.data.dates import generate_dates  # noqa: E402
from qkv.decoding.search import greedy_decode  # noqa: E402
from qkv.decoding.translate import translate_texts  # noqa: E402
from qkv.export.onnx import OnnxTranslator, check_output_folder, export_onnx  # noqa: E402
from qkv.runs.folder import load_run  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "runs_v0_1"
TOL = 1e-4

TINY = ["--d-model", "32", "--heads", "2", "--encoder-layers", "1", "--decoder-layers", "1", "--d-ff", "64"]
TINY += ["--max-tokens", "800", "--no-progress", "--threads", "1"]


@pytest.fixture(scope="module")
def dates_export(tmp_path_factory):
    """A dates run trained long enough (150 steps) to give varied translations, and its export."""
    root = tmp_path_factory.mktemp("onnx_dates")
    run_dir = root / "run"
    args = ["train", "--data", "dates", "--run-dir", str(run_dir), "--max-steps", "150", "--minutes", "0"]
    assert main([*args, "--eval-every-steps", "0", *TINY]) == 0
    torch.set_num_threads(1)  # the CLI call set all cores (see conftest)
    return run_dir, export_onnx(run_dir, root / "onnx")


@pytest.fixture(scope="module")
def fixture_export(tmp_path_factory):
    root = tmp_path_factory.mktemp("onnx_fixture")
    run_dir = shutil.copytree(FIXTURES / "translation_run", root / "run")
    return run_dir, export_onnx(run_dir, root / "onnx")


def dates_sentences(n: int) -> tuple[list[str], list[str]]:
    pairs = generate_dates(n, seed=3, split="test")
    return pairs.src, pairs.tgt


def compare_steps(run_dir: Path, folder: Path, sources: list[str], targets: list[str]) -> float:
    """Encode a padded batch and run five teacher-forced decoder steps (the first with an empty cache)
    through qkv and through onnxruntime; asserts every output within TOL and returns the largest difference."""
    model, tokenizer, _ = load_run(run_dir)
    translator = OnnxTranslator(folder, threads=1)
    limit = model.config.max_len - 1  # cut as translate_texts cuts: the fixture's table is short
    ids = [s[:limit] + [tokenizer.eos_id] for s in tokenizer.encode_batch(sources)]
    src = pad_sequences(ids, model.config.pad_id)
    tgt = pad_sequences(tokenizer.encode_batch(targets, add_bos=True), model.config.pad_id)[:, :5]
    assert (src == model.config.pad_id).any() and tgt.size(1) == 5  # padding is exercised
    worst = 0.0
    with torch.no_grad():
        memory = model.encode(src)
        memory_onnx, *cross = translator.encode(src.numpy())
        worst = max(worst, float(np.abs(memory_onnx - memory.hidden.numpy()).max()))
        src_mask = src.numpy() != model.config.pad_id
        h = model.config.num_heads
        shape = (len(sources), h, 0, model.config.d_model // h)
        self_kv = [np.zeros(shape, np.float32) for _ in range(2 * model.config.num_decoder_layers)]
        cache = None
        for step in range(tgt.size(1)):
            out = model.decode(tgt[:, step : step + 1], memory, cache=cache)
            cache = out.cache
            logits, self_kv = translator.step(tgt[:, step : step + 1].numpy(), src_mask, self_kv, cross)
            # the cache-free decoder over the whole prefix: an independent reference for the step's logits
            full = model.decode(tgt[:, : step + 1], memory).logits[:, -1]
            for mine, theirs in [(logits, out.logits[:, -1]), (logits, full)]:
                worst = max(worst, float(np.abs(mine - theirs.numpy()).max()))
            for i, (self_cache, cross_cache) in enumerate(cache):
                assert self_kv[2 * i].shape[2] == step + 1
                worst = max(worst, float(np.abs(self_kv[2 * i] - self_cache.key.numpy()).max()))
                worst = max(worst, float(np.abs(self_kv[2 * i + 1] - self_cache.value.numpy()).max()))
                worst = max(worst, float(np.abs(cross[2 * i] - cross_cache.key.numpy()).max()))
                worst = max(worst, float(np.abs(cross[2 * i + 1] - cross_cache.value.numpy()).max()))
    assert worst < TOL
    return worst


def test_export_folder(dates_export):
    run_dir, folder = dates_export
    assert {p.name for p in folder.iterdir()} == {
        "encoder.onnx",
        "decoder_step.onnx",
        "manifest.json",
        "tokenizer.json",
        ".qkv-export.json",  # the marker --overwrite recognises qkv's own export by (tests/test_overwrite.py)
    }
    assert (folder / "tokenizer.json").read_bytes() == (run_dir / "tokenizer.json").read_bytes()
    manifest = json.loads((folder / "manifest.json").read_text())
    config = json.loads((run_dir / "config.json").read_text())["model"]
    assert (manifest["pad_id"], manifest["bos_id"], manifest["eos_id"]) == (0, 1, 2)
    assert manifest["max_len"] == config["max_len"] and manifest["extra_len"] == 50
    for name in ("encoder", "decoder_step"):
        graph = onnx.load(str(folder / f"{name}.onnx"))
        onnx.checker.check_model(graph)
        assert [i.name for i in graph.graph.input] == manifest[name]["inputs"]
        assert [o.name for o in graph.graph.output] == manifest[name]["outputs"]
    # the cache length is a symbol, not the length the graph was traced with
    past = onnx.load(str(folder / "decoder_step.onnx")).graph.input[2].type.tensor_type.shape.dim[2]
    assert past.dim_param and not past.HasField("dim_value")


def test_steps_match_qkv_on_dates(dates_export):
    sources, targets = dates_sentences(6)
    compare_steps(*dates_export, sources, targets)


def test_steps_match_qkv_on_multi30k(fixture_export, multi30k_file):
    with gzip.open(multi30k_file("val.en.gz"), "rt", encoding="utf-8") as f:
        english = [next(f).strip() for _ in range(6)]
    with gzip.open(multi30k_file("val.de.gz"), "rt", encoding="utf-8") as f:
        german = [next(f).strip() for _ in range(6)]
    compare_steps(*fixture_export, english, german)


def test_greedy_translations_equal_qkv(dates_export):
    run_dir, folder = dates_export
    sources, references = dates_sentences(200)
    model, tokenizer, _ = load_run(run_dir)
    expected = translate_texts(model, tokenizer, sources, beam_size=1)
    assert len(set(expected)) > 100 and sum(e == r for e, r in zip(expected, references)) > 10  # a real test
    assert OnnxTranslator(folder, threads=1).translate(sources) == expected
    # one batch of token ids too, against greedy_decode itself
    src = pad_sequences(tokenizer.encode_batch(sources[:16], add_eos=True), 0)
    expected_ids = greedy_decode(model, src, bos_id=1, eos_id=2)
    assert OnnxTranslator(folder, threads=1).greedy(src.numpy()) == expected_ids


def test_greedy_stops_at_the_length_limit(fixture_export, multi30k_file):
    """The fixture run (6 steps) never says EOS: every sentence runs to qkv's limit, source length + 50
    capped by the positional table, and long sources are cut as qkv cuts them."""
    run_dir, folder = fixture_export
    with gzip.open(multi30k_file("val.en.gz"), "rt", encoding="utf-8") as f:
        sources = [next(f).strip() for _ in range(50)]
    model, tokenizer, _ = load_run(run_dir)
    expected = translate_texts(model, tokenizer, sources, beam_size=1)
    assert OnnxTranslator(folder, threads=1).translate(sources) == expected


def test_refusals(tmp_path, fixture_export):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    for overwrite in (False, True):  # --overwrite replaces an earlier export, never other files
        with pytest.raises(ValueError, match="busy: not empty, and it has no .qkv-export.json") as refused:
            export_onnx(fixture_export[0], busy, overwrite=overwrite)
        assert "pass --overwrite" not in str(refused.value)
    assert [p.name for p in busy.iterdir()] == ["notes.txt"]
    with pytest.raises(ValueError, match="holds an earlier ONNX export; pass --overwrite to replace it"):
        check_output_folder(fixture_export[1], overwrite=False)
    check_output_folder(fixture_export[1], overwrite=True)
    check_output_folder(tmp_path / "new", overwrite=False)
    with pytest.raises(ValueError, match="language-model run"):
        export_onnx(FIXTURES / "lm_run", tmp_path / "lm")
    assert not (tmp_path / "lm").exists()
    with pytest.raises(FileNotFoundError, match="manifest.json missing"):
        OnnxTranslator(busy)
    manifest = json.loads((fixture_export[1] / "manifest.json").read_text())
    old = shutil.copytree(fixture_export[1], tmp_path / "old")
    (old / "manifest.json").write_text(json.dumps({**manifest, "qkv_onnx": 99}))
    with pytest.raises(ValueError, match="format 99"):
        OnnxTranslator(old)

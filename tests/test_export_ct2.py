"""CTranslate2 export (qkv.export.ctranslate2): the saved model scores target tokens as qkv does, greedy and
beam-4 decoding (alpha 0, and the run's alpha with qkv's power form) give exactly qkv's translations on a
trained dates run, an empty translation (EOS first) is kept as qkv keeps it, every configuration
kind (pre-/post-LN, sinusoidal/learned/no positions, biases or none, shared or tied embeddings, a
vocabulary wider than the tokenizer) exports exactly, and what cannot be exported is refused in one line."""

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("ctranslate2")

from qkv.cli import main  # noqa: E402  (after the skip: without ctranslate2 nothing here runs)
from qkv.data.batching import pad_sequences  # noqa: E402
from qkv.data.dates import generate_dates  # noqa: E402
from qkv.decoding.search import beam_search, greedy_decode  # noqa: E402
from qkv.decoding.translate import translate_texts  # noqa: E402
from qkv.export.ctranslate2 import (  # noqa: E402
    Ct2Translator,
    _check_folder,
    check_model,
    ct2_refusal,
    export_ctranslate2,
    write_model,
)
from qkv.models.transformer import Transformer, TransformerConfig  # noqa: E402
from qkv.runs.folder import load_run  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "runs_v0_1"
TINY = ["--d-model", "32", "--heads", "2", "--encoder-layers", "1", "--decoder-layers", "1", "--d-ff", "64"]
TINY += ["--max-tokens", "800", "--no-progress", "--threads", "1"]
SENTENCES = [
    "A man is riding a bicycle down the street.",
    "Two dogs play in the snow.",
    "A woman in a red dress sings on a stage.",
    "Children are playing soccer in a park.",
    "An old man reads a newspaper on a bench.",
    "The team celebrates after winning the game.",
]


@pytest.fixture(scope="module")
def dates_export(tmp_path_factory):
    """A pre-LN dates run trained 150 steps (varied, partly right translations), exported through the CLI
    as float32 and as int8."""
    root = tmp_path_factory.mktemp("ct2_dates")
    run_dir = root / "run"
    args = ["train", "--data", "dates", "--run-dir", str(run_dir), "--max-steps", "150", "--minutes", "0"]
    assert main([*args, "--eval-every-steps", "0", *TINY]) == 0
    torch.set_num_threads(1)  # the CLI call set all cores (see conftest)
    assert main(["export", str(run_dir), "--to", "ctranslate2", str(root / "f32")]) == 0
    assert main(["export", str(run_dir), "--to", "ctranslate2", str(root / "i8"), "--quantization", "int8"]) == 0
    return run_dir, root / "f32", root / "i8"


def dates_sources(n: int) -> list[str]:
    return generate_dates(n, seed=3, split="test").src


def test_greedy_translations_equal_qkv(dates_export):
    run_dir, folder, _ = dates_export
    sources = dates_sources(100)
    model, tokenizer, _ = load_run(run_dir)
    expected = translate_texts(model, tokenizer, sources, beam_size=1)
    assert len(set(expected)) > 50  # varied outputs: a real comparison
    translator = Ct2Translator(folder)
    assert translator.translate(sources, beam_size=1) == expected
    ids = tokenizer.encode_batch(sources[:16], add_eos=True)
    expected_ids = greedy_decode(model.eval(), pad_sequences(ids, 0), bos_id=1, eos_id=2)
    assert translator.translate_ids(ids, beam_size=1) == expected_ids


def test_beam_search(dates_export):
    """alpha 0 ranks beams by log-probability in both: identical. At the run's alpha CTranslate2 divides by
    length ** alpha: identical to qkv's beam search with the same (power) form."""
    run_dir, folder, _ = dates_export
    sources = dates_sources(100)
    model, tokenizer, config = load_run(run_dir)
    translator = Ct2Translator(folder)
    expected = translate_texts(model, tokenizer, sources, beam_size=4, alpha=0.0)
    assert translator.translate(sources, beam_size=4, alpha=0.0) == expected
    alpha = translator.manifest["decode"]["alpha"]
    ours = translate_texts(model, tokenizer, sources, beam_size=4, alpha=alpha, penalty="power")
    assert translator.translate(sources, beam_size=4, alpha=alpha) == ours


def test_empty_translation_as_qkv(dates_export, tmp_path):
    """A model that often says EOS first: an empty translation is a finished hypothesis in qkv's search (and
    Hugging Face's), so CTranslate2 is told so (its default forbids EOS at the first step, and then it searches
    on where qkv has its beam_size finished hypotheses): greedy and beam 4 (power form) ids equal qkv's."""
    _, tokenizer, _ = load_run(dates_export[0])
    torch.manual_seed(0)
    vocab = tokenizer.vocab_size
    config = TransformerConfig(
        src_vocab_size=vocab, tgt_vocab_size=vocab, d_model=16, num_heads=2, num_encoder_layers=1,
        num_decoder_layers=1, d_ff=32, max_len=40, tie_output=False,
    )  # fmt: skip
    model = Transformer(config).eval()
    with torch.no_grad():  # EOS's output row a multiple of another token's: EOS is likely at every step
        model.output_proj.weight[tokenizer.eos_id] = 3 * model.output_proj.weight[5]
    write_model(model, tokenizer, tmp_path, decode={"beam_size": 4, "alpha": 0.6})
    shutil.copyfile(dates_export[0] / "tokenizer.json", tmp_path / "tokenizer.json")
    ids = [s[:39] + [tokenizer.eos_id] for s in tokenizer.encode_batch(dates_sources(100))]
    src = pad_sequences(ids, 0)
    translator = Ct2Translator(tmp_path)
    for beam in (1, 4):
        ours = beam_search(model, src, bos_id=1, eos_id=2, beam_size=beam, alpha=0.6, penalty="power")
        assert any(not out for out in ours) and any(out for out in ours)  # empty ones and others
        assert translator.translate_ids(ids, beam_size=beam, alpha=0.6) == ours


def test_int8_loads_and_translates(dates_export):
    run_dir, f32, i8 = dates_export
    manifest = json.loads((i8 / "qkv_ct2.json").read_text())
    assert manifest["quantization"] == "int8"
    assert (i8 / "model.bin").stat().st_size < (f32 / "model.bin").stat().st_size
    sources = dates_sources(100)
    model, tokenizer, _ = load_run(run_dir)
    expected = translate_texts(model, tokenizer, sources, beam_size=1)
    got = Ct2Translator(i8).translate(sources, beam_size=1)
    assert len(got) == 100 and all(isinstance(t, str) for t in got)
    print(f"int8 greedy: {sum(a == b for a, b in zip(expected, got))}/100 identical to float32 qkv")


CONFIGS = {
    "post-LN, gelu, shared and tied": dict(norm_first=False, activation="gelu", share_embeddings=True),
    "pre-LN, learned, no bias, untied": dict(positional="learned", bias=False, tie_output=False),
    "post-LN, no positions, gelu_tanh, eps": dict(
        norm_first=False, positional="none", activation="gelu_tanh", layer_norm_eps=0.1
    ),
}


@pytest.mark.parametrize("options", CONFIGS.values(), ids=CONFIGS.keys())
def test_configurations_export_exactly(options, dates_export, tmp_path):
    """Random models of each kind: the export's own score check passes, and greedy ids equal qkv's. Their
    untrained output rarely says EOS, so sentences run to qkv's limit, here the 20-position table."""
    _, tokenizer, _ = load_run(dates_export[0])
    torch.manual_seed(0)
    vocab = tokenizer.vocab_size + 3  # rows the tokenizer never produces get placeholder tokens
    config = TransformerConfig(
        src_vocab_size=vocab, tgt_vocab_size=vocab, d_model=16, num_heads=2, num_encoder_layers=2,
        num_decoder_layers=2, d_ff=32, max_len=20, **{"norm_first": True, **options},
    )  # fmt: skip
    model = Transformer(config).eval()
    with torch.no_grad():  # LayerNorms away from their identity initialisation, so that they are checked
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    write_model(model, tokenizer, tmp_path, decode={"beam_size": 4, "alpha": 0.6})
    shutil.copyfile(dates_export[0] / "tokenizer.json", tmp_path / "tokenizer.json")
    assert _check_folder(model, tokenizer, tmp_path) < 1e-4
    ids = [s[:19] + [2] for s in tokenizer.encode_batch(dates_sources(12))]
    expected = greedy_decode(model, pad_sequences(ids, 0), bos_id=1, eos_id=2)
    assert Ct2Translator(tmp_path).translate_ids(ids, beam_size=1) == expected


def test_fixture_run_at_the_length_limit(tmp_path):
    """The 0.1 fixture run (post-LN, GELU, shared embeddings, a short table) never says EOS: every sentence
    stops where qkv stops it."""
    run_dir = shutil.copytree(FIXTURES / "translation_run", tmp_path / "run")
    folder = export_ctranslate2(run_dir, tmp_path / "ct2")
    model, tokenizer, _ = load_run(run_dir)
    assert Ct2Translator(folder).translate(SENTENCES, beam_size=1) == translate_texts(model, tokenizer, SENTENCES)
    limit = model.config.max_len - 1
    ids = [s[:limit] + [2] for s in tokenizer.encode_batch(SENTENCES)]
    expected = greedy_decode(model.eval(), pad_sequences(ids, 0), bos_id=1, eos_id=2)
    assert Ct2Translator(folder).translate_ids(ids, beam_size=1) == expected


def test_check_catches_a_different_model(dates_export, tmp_path):
    run_dir, folder, _ = dates_export
    model, tokenizer, _ = load_run(run_dir)
    other = Transformer(model.config).eval()  # same shapes, other weights
    with pytest.raises(ValueError, match="differs from the run"):
        check_model(other, tokenizer, folder, quantization="float32")


def test_refusals(dates_export, tmp_path, capsys):
    lm_out = tmp_path / "lm"  # a language-model run: a Generator folder (tests/test_export_llama.py)
    assert main(["export", str(FIXTURES / "lm_run"), "--to", "ctranslate2", str(lm_out)]) == 0
    assert (lm_out / "qkv_ct2_lm.json").is_file() and not (lm_out / "qkv_ct2.json").exists()
    capsys.readouterr()
    onnx_out = tmp_path / "onnx"
    assert main(["export", str(dates_export[0]), "--to", "onnx", str(onnx_out), "--quantization", "int8"]) == 2
    assert "applies to --to ctranslate2 only" in capsys.readouterr().err and not onnx_out.exists()
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    for overwrite in (False, True):  # --overwrite replaces an earlier export, never other files
        with pytest.raises(ValueError, match="not empty, and it has no .qkv-export.json") as refused:
            export_ctranslate2(dates_export[0], busy, overwrite=overwrite)
        assert "pass --overwrite" not in str(refused.value)
    assert [p.name for p in busy.iterdir()] == ["notes.txt"]
    with pytest.raises(ValueError, match="pass --overwrite"):
        export_ctranslate2(dates_export[0], dates_export[1])
    with pytest.raises(ValueError, match="quantization 'int3'"):
        export_ctranslate2(dates_export[0], tmp_path / "q", quantization="int3")
    with pytest.raises(FileNotFoundError, match="qkv_ct2.json missing"):
        Ct2Translator(busy)
    swish = SimpleNamespace(activation="swish", positional="sinusoidal")  # an option qkv may add one day
    assert ct2_refusal(swish) == "activation='swish': CTranslate2 has no activation of that name"  # type: ignore[arg-type]

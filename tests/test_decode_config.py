"""DecodeConfig: every decoding option declared once (its range, help and flag), the one beam limit
shared by the command line, the recipes and the server, a run's decode section saved whole (the
length-penalty form included) and read back by translate, evaluate and serve, and an old run folder
without the form decoding as qkv 1.x did (gnmt)."""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from qkv.cli import main
from qkv.cli import options as cli_options
from qkv.decoding.translate import translate_texts
from qkv.inference import DecodeConfig, QkvTranslator, open_run
from qkv.inference import decode as decode_module
from qkv.models.transformer import Transformer, TransformerConfig
from qkv.models.weights import save_weights

FIXTURES = Path(__file__).parent / "fixtures" / "runs_v0_1"
SOURCES = ["A man rides a bike.", "Two dogs play in the snow.", "A woman reads.", "Hi", "Children are running."]

# each field: a value at each end of its declared range that is taken, and one past each that is not
BOUNDS = {
    "beam_size": ([1, decode_module.MAX_BEAM], [0, decode_module.MAX_BEAM + 1, 2.0, True]),
    "alpha": ([0, 0.0, 10, 10.0], [-0.01, 10.01, float("nan"), float("inf"), "1"]),
    "penalty": ([None, "gnmt", "power"], ["GNMT", "linear"]),
    "max_batch_tokens": ([1, 10**9], [0, -1, 1.5]),
}


def test_every_field_is_declared_with_its_flag_and_bounds():
    assert [option.name for option in fields(DecodeConfig)] == list(BOUNDS)
    for option in fields(DecodeConfig):
        assert option.metadata["flag"].startswith("--") and option.metadata["help"]


@pytest.mark.parametrize("name", sorted(BOUNDS))
def test_each_field_is_held_to_its_declared_range_in_one_line_naming_its_flag(name):
    taken, refused = BOUNDS[name]
    flag = DecodeConfig.option(name).metadata["flag"]
    for value in taken:
        assert getattr(DecodeConfig(**{name: value}), name) == value
    for value in refused:
        with pytest.raises(ValueError) as err:
            DecodeConfig(**{name: value})
        message = str(err.value)
        assert "\n" not in message and name in message and flag in message, message


@pytest.mark.parametrize(
    ("parse", "name"),
    [(cli_options.beam_size, "beam_size"), (cli_options.length_penalty, "alpha")],
)
def test_the_command_line_flags_take_the_declared_ranges(parse, name):
    taken, refused = BOUNDS[name]
    for value in taken:
        if not isinstance(value, bool) and isinstance(value, (int, float)):
            assert parse(str(value)) == value
    for text in (
        "0" if name == "beam_size" else "-0.01",
        str(decode_module.MAX_BEAM + 1) if name == "beam_size" else "10.01",
    ):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)


def test_the_beam_limit_is_one_for_the_command_line_the_recipes_and_the_server():
    from qkv.runs.recipes import MAX_SAVED_BEAM, check_decode

    pytest.importorskip("fastapi")
    from qkv.serve.models import Limits

    limit = decode_module.MAX_BEAM
    assert cli_options.MAX_BEAM == MAX_SAVED_BEAM == limit
    assert DecodeConfig.option("beam_size").metadata["maximum"] == limit
    # the same limit, by behaviour: taken at the limit, refused one past it, by each of the three
    assert cli_options.beam_size(str(limit)) == limit
    with pytest.raises(argparse.ArgumentTypeError):
        cli_options.beam_size(str(limit + 1))
    assert check_decode({"beam_size": limit}, "recipe.toml")["beam_size"] == limit
    with pytest.raises(ValueError, match="decode.beam_size must be"):
        check_decode({"beam_size": limit + 1}, "recipe.toml")
    assert Limits(max_beam=limit).max_beam == limit
    with pytest.raises(ValueError, match="max-beam"):
        Limits(max_beam=limit + 1)


def test_qkv_serve_max_beam_is_checked_against_the_one_limit(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--max-beam", str(decode_module.MAX_BEAM + 1)])
    assert f"from 1 to {decode_module.MAX_BEAM}" in capsys.readouterr().err


def test_the_old_keyword_max_tokens_of_translate_texts_still_works_and_warns(monkeypatch):
    """qkv 1.x's ``translate_texts(..., max_tokens=)`` is ``max_batch_tokens=`` now."""
    import qkv.decoding.translate as translate

    seen = []
    monkeypatch.setattr(translate, "length_batches", lambda ids, budget: seen.append(budget) or [])
    model = Transformer(
        TransformerConfig(
            src_vocab_size=300,
            tgt_vocab_size=300,
            d_model=16,
            num_heads=2,
            d_ff=32,
            num_encoder_layers=1,
            num_decoder_layers=1,
        )
    ).eval()
    tokenizer = SimpleNamespace(encode_batch=lambda texts: [[5] for _ in texts], eos_id=2, bos_id=1)
    with pytest.warns(DeprecationWarning, match="max_batch_tokens"):
        translate.translate_texts(model, tokenizer, ["a"], max_tokens=77)
    assert seen == [77]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """The v0.1 fixture run (saved without a penalty form) with random weights that make its
    translations differ from one sentence to the next."""
    folder = shutil.copytree(FIXTURES / "translation_run", tmp_path_factory.mktemp("decode") / "run")
    model, _, _ = open_run(folder)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    save_weights(model, folder / "model.safetensors")
    return folder


def with_decode(run_dir: Path, tmp_path: Path, decode: dict) -> Path:
    """A copy of ``run_dir`` whose config.json saves ``decode``."""
    folder = shutil.copytree(run_dir, tmp_path / "saved")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "decode": decode}))
    return folder


def reference(run_dir: Path, **decode) -> list[str]:
    model, tokenizer, _ = open_run(run_dir)
    return translate_texts(model, tokenizer, SOURCES, **decode)


def test_an_old_run_without_a_form_decodes_with_gnmt(run_dir):
    config = json.loads((run_dir / "config.json").read_text())
    assert "penalty" not in (config.get("decode") or {})  # as qkv 0.1 and 1.x saved it
    decode = DecodeConfig.of_run(config)
    assert decode.penalty == "gnmt"
    assert QkvTranslator.open([run_dir]).translate(SOURCES) == reference(
        run_dir, beam_size=decode.beam_size, alpha=decode.alpha, penalty="gnmt"
    )


@pytest.fixture
def forms(monkeypatch):
    """The length-penalty forms beam search is called with (this fixture run's random weights stop no
    sentence before its length limit, so the form cannot change its translations: the call says it)."""
    import qkv.decoding.translate as translate_module

    called: list[str] = []
    search = translate_module.beam_search

    def spy(*args, **kwargs):
        called.append(kwargs["penalty"])
        return search(*args, **kwargs)

    monkeypatch.setattr(translate_module, "beam_search", spy)
    return called


def test_the_saved_form_is_read_back_by_the_library_and_qkv_translate(run_dir, tmp_path, forms):
    saved = {"beam_size": 3, "alpha": 2.0, "penalty": "power"}
    folder = with_decode(run_dir, tmp_path, saved)
    assert DecodeConfig.of_run(json.loads((folder / "config.json").read_text())).saved() == saved
    power, gnmt = reference(folder, beam_size=3, alpha=2.0, penalty="power"), reference(folder, beam_size=3, alpha=2.0)
    forms.clear()
    assert QkvTranslator.open([folder]).translate(SOURCES) == power
    assert set(forms) == {"power"}
    forms.clear()
    src, out = tmp_path / "src.txt", tmp_path / "out.txt"
    src.write_text("".join(line + "\n" for line in SOURCES))
    assert main(["translate", str(folder), str(src), "-o", str(out), "--threads", "1"]) == 0
    assert out.read_text().splitlines() == power and set(forms) == {"power"}
    forms.clear()
    flag = ["--length-penalty-form", "gnmt", "--threads", "1"]
    assert main(["translate", str(folder), str(src), "-o", str(out), *flag]) == 0
    assert out.read_text().splitlines() == gnmt and set(forms) == {"gnmt"}  # the flag goes over the saved form


def test_a_recipe_with_a_form_is_checked_and_saved_whole():
    from qkv.runs.recipes import check_decode, decode_settings

    assert check_decode({"penalty": "power"}, "r.toml") == {"beam_size": 5, "alpha": 0.6, "penalty": "power"}
    with pytest.raises(ValueError, match="r.toml: decode.penalty"):
        check_decode({"penalty": "linear"}, "r.toml")
    assert decode_settings({"decode": {"beam_size": 4}}, alpha=1.0) == {"beam_size": 4, "alpha": 1.0, "penalty": "gnmt"}


def test_serve_decodes_with_the_saved_form_through_one_inference_object(run_dir, tmp_path, monkeypatch, forms):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from qkv.decoding.inference import InferenceModel
    from qkv.serve.app import create_app
    from qkv.serve.models import Limits, open_models
    from qkv.viz.app import ExplorerApp

    folder = with_decode(run_dir, tmp_path, {"beam_size": 3, "alpha": 2.0, "penalty": "power"})
    built = []
    build = InferenceModel.build.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(
        InferenceModel, "build", classmethod(lambda cls, *a, **k: built.append(1) or build(cls, *a, **k))
    )
    models = open_models([folder])
    explorer = ExplorerApp(explorers={name: m.explorer for name, m in models.items()}, max_chars=200)
    with TestClient(create_app(models, explorer, Limits(max_batch_wait_ms=0))) as client:
        first = client.post("/v1/translate", json={"texts": SOURCES}).json()
        assert forms == ["power"]
        second = client.post("/v1/translate", json={"texts": SOURCES, "penalty": "gnmt", "beam_size": 2}).json()
        assert forms == ["power", "gnmt"]
    assert (first["beam_size"], first["alpha"], first["penalty"]) == (3, 2.0, "power")
    assert first["translations"] == reference(folder, beam_size=3, alpha=2.0, penalty="power")
    assert second["translations"] == reference(folder, beam_size=2, alpha=2.0)

"""The recipes for one GPU (multi30k-gpu, tinyshakespeare-gpu): they load and check; on a CUDA device
a data source's default recipe gives way to them, and the start line and config.json say so; a named
recipe stays; on a CPU nothing changes. benchmarks/gpu_recipes.py, the command that chooses their
values on validation, runs its whole path on a CPU (--smoke) and writes a result JSON.

No test here needs a GPU: the device is passed to choose_recipe, and where start_run's own choice is
checked, qkv's one test of "is this CUDA" (choice.on_cuda) is patched for the test alone."""

from __future__ import annotations

import gzip
import json
import logging
import math

import pytest
import torch
from bench_loader import load_benchmark

from qkv.data.dates import generate_dates
from qkv.data.spec import DataSpec
from qkv.models.causal_lm import CausalLM, CausalLMConfig
from qkv.runs.recipes import choice as choice_module
from qkv.runs.recipes import list_recipes, load_recipe, recipe_for_data
from qkv.runs.recipes.choice import choose_recipe
from qkv.runs.translation import start_run

TINY = dict(d_model=32, num_heads=2, num_encoder_layers=1, num_decoder_layers=1, d_ff=64, max_len=64)
TINY_LM = dict(d_model=32, num_heads=2, num_layers=1, d_ff=64, context=32)
ONE_STEP = dict(max_steps=1, progress=False)


def test_the_gpu_recipes_load_and_are_the_variants_of_the_data_defaults():
    for cpu_name, gpu_name in (("multi30k", "multi30k-gpu"), ("tinyshakespeare", "tinyshakespeare-gpu")):
        cpu, gpu = load_recipe(cpu_name), load_recipe(gpu_name)
        assert cpu.gpu_variant == gpu_name and gpu.task == cpu.task
        assert gpu.default_for == () and gpu.gpu_variant is None and gpu.bf16_variant is None
        assert gpu.train["bf16"] is True and "not yet chosen on a GPU" in gpu.description
    assert load_recipe("multi30k-gpu").train["max_minutes"] == 10.0
    assert load_recipe("tinyshakespeare-gpu").train["max_minutes"] == 5.0
    # only the two defaults name one, and every variant named is a shipped recipe
    named = {name: load_recipe(name).gpu_variant for name in list_recipes()}
    assert {k: v for k, v in named.items() if v} == {
        "multi30k": "multi30k-gpu",
        "tinyshakespeare": "tinyshakespeare-gpu",
    }


def test_the_language_model_recipe_has_nanogpts_shape():
    """nanoGPT's shakespeare_char model (6 layers, 6 heads, 384 wide, context 256): the same number of
    weights as Hugging Face's GPT-2 of that shape over tiny Shakespeare's 65 characters."""
    transformers = pytest.importorskip("transformers")
    recipe = load_recipe("tinyshakespeare-gpu")
    ours = CausalLM(CausalLMConfig(**recipe.model, vocab_size=65))
    m = recipe.model
    theirs = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=65,
            n_positions=m["context"],
            n_embd=m["d_model"],
            n_layer=m["num_layers"],
            n_head=m["num_heads"],
            n_inner=m["d_ff"],
        )
    )
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in theirs.parameters())
    assert 10.6e6 < count < 10.9e6  # nanoGPT's "10.7M"


@pytest.mark.parametrize("device", ["cuda", "cuda:1", torch.device("cuda", 0)])
def test_on_cuda_the_data_default_gives_way_to_its_gpu_variant(device):
    for source, cpu_name, gpu_name in (
        ("multi30k", "multi30k", "multi30k-gpu"),
        ("files", "multi30k", "multi30k-gpu"),
        ("tinyshakespeare", "tinyshakespeare", "tinyshakespeare-gpu"),
        ("text", "tinyshakespeare", "tinyshakespeare-gpu"),
    ):
        chosen = choose_recipe(None, source, device)
        assert chosen.recipe.name == gpu_name and not chosen.named
        record = chosen.record()
        assert record["file"] == f"qkv/runs/recipes/{gpu_name}.toml"
        assert record["why"].startswith(f"the default recipe for {source} data on a CUDA device ({device})")
        assert f"in place of the CPU recipe {cpu_name} (--recipe {cpu_name} keeps that one)" in record["why"]
        (line,) = chosen.start_notes(bf16=True, bf16_fast=True)  # no bf16 variant to suggest
        assert line == f"recipe {gpu_name} (qkv/runs/recipes/{gpu_name}.toml): {record['why']}; bf16 autocast on"
        # a named recipe is never replaced: not the CPU's, not another
        assert choose_recipe(cpu_name, source, device).recipe.name == cpu_name
        assert choose_recipe(cpu_name, source, device).record()["why"] == f"named (--recipe {cpu_name})"
    assert choose_recipe("paper-base", "multi30k", device).recipe.name == "paper-base"
    assert choose_recipe(None, "dates", device).recipe.name == "dates"  # no gpu variant: as on a CPU


@pytest.mark.parametrize("device", [None, "cpu", torch.device("cpu")])
def test_on_a_cpu_nothing_changes(device):
    for source in ("multi30k", "files", "prepared", "dates", "tinyshakespeare", "text"):
        chosen = choose_recipe(None, source, device)
        assert chosen.recipe == recipe_for_data(source)
        assert chosen.record()["why"] == f"the default recipe for {source} data"
    assert not choice_module.on_cuda("cpu") and choice_module.on_cuda("cuda:0")


@pytest.fixture
def date_files(tmp_path):
    pairs = generate_dates(60, seed=3)
    (tmp_path / "s.txt").write_text("\n".join(pairs.src) + "\n", encoding="utf-8")
    (tmp_path / "t.txt").write_text("\n".join(pairs.tgt) + "\n", encoding="utf-8")
    return DataSpec(source="files", train_src=str(tmp_path / "s.txt"), train_tgt=str(tmp_path / "t.txt"))


def _started(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("recipe ")]


def test_start_run_picks_the_gpu_recipe_where_its_device_is_cuda(tmp_path, date_files, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="qkv")
    # this CPU made to count as CUDA for the choice alone (the model still builds on the CPU)
    monkeypatch.setattr(choice_module, "on_cuda", lambda device: str(device) == "cpu")
    gpu = load_recipe("multi30k-gpu")
    start_run(tmp_path / "gpu", data=date_files, model_options=TINY, vocab_size=300, train_options=ONE_STEP)
    config = json.loads((tmp_path / "gpu" / "config.json").read_text())
    assert config["recipe"]["name"] == "multi30k-gpu"
    assert config["recipe"]["why"].startswith("the default recipe for files data on a CUDA device (cpu)")
    assert (config["train"]["weight_decay"], config["train"]["max_minutes"]) == (
        gpu.train["weight_decay"],
        gpu.train["max_minutes"],
    )
    assert config["model"]["dropout"] == gpu.model["dropout"] and config["decode"] == gpu.decode
    (line,) = _started(caplog)
    assert line.startswith("recipe multi30k-gpu (qkv/runs/recipes/multi30k-gpu.toml): the default recipe for files")
    caplog.clear()
    named = tmp_path / "named"
    start_run(named, data=date_files, model_options=TINY, vocab_size=300, train_options=ONE_STEP, recipe="multi30k")
    config = json.loads((named / "config.json").read_text())
    assert config["recipe"] == {
        "name": "multi30k",
        "file": "qkv/runs/recipes/multi30k.toml",
        "why": "named (--recipe multi30k)",
    }
    assert (
        config["train"]["weight_decay"] == 0.0
        and config["model"]["dropout"] == load_recipe("multi30k").model["dropout"]
    )
    caplog.clear()
    text = tmp_path / "play.txt"
    text.write_text("ROMEO: what light through yonder window breaks?\n" * 80, encoding="utf-8")
    lm = tmp_path / "lm"
    start_run(lm, data=DataSpec(source="text", train_text=str(text)), model_options=TINY_LM, train_options=ONE_STEP)
    config = json.loads((lm / "config.json").read_text())
    assert config["recipe"]["name"] == "tinyshakespeare-gpu" and "on a CUDA device" in config["recipe"]["why"]
    assert config["train"]["max_minutes"] == 5.0 and config["train"]["adam_betas"] == [0.9, 0.99]
    assert _started(caplog)[0].startswith("recipe tinyshakespeare-gpu (qkv/runs/recipes/tinyshakespeare-gpu.toml)")


def test_start_run_on_a_cpu_keeps_the_data_default(tmp_path, date_files, caplog):
    caplog.set_level(logging.INFO, logger="qkv")
    start_run(
        tmp_path / "cpu", data=date_files, model_options=TINY, vocab_size=300, train_options=ONE_STEP, device="cpu"
    )
    config = json.loads((tmp_path / "cpu" / "config.json").read_text())
    assert config["recipe"] == {
        "name": "multi30k",
        "file": "qkv/runs/recipes/multi30k.toml",
        "why": "the default recipe for files data",
    }
    assert _started(caplog)[0].startswith("recipe multi30k (qkv/runs/recipes/multi30k.toml): the default recipe")


# ---------------------------------------------------------------------------------------------
# benchmarks/gpu_recipes.py


@pytest.fixture(scope="module")
def gpu_recipes():
    return load_benchmark("gpu_recipes")


@pytest.fixture
def tiny_data(tmp_path):
    """A Multi30k-shaped folder of date pairs, and a text folder, small enough for seconds on a CPU."""
    multi30k = tmp_path / "multi30k"
    multi30k.mkdir()
    for stem, size, seed in (("train", 200, 0), ("val", 12, 1), ("test_2016_flickr", 12, 2)):
        pairs = generate_dates(size, seed=seed)
        for lang, lines in (("en", pairs.src), ("de", pairs.tgt)):
            with gzip.open(multi30k / f"{stem}.{lang}.gz", "wt", encoding="utf-8") as f:
                f.write("\n".join(lines) + "\n")
    text = tmp_path / "shakespeare"
    text.mkdir()
    lines = generate_dates(700, seed=4).src
    (text / "input.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return multi30k, text


def test_gpu_recipes_refuses_bad_arguments_in_one_line(gpu_recipes, tmp_path, capsys):
    out = tmp_path / "r.json"
    for argv, message in (
        (["--device", "cpu", "--tasks", "wmt"], "--tasks: wmt; choose from multi30k, tinyshakespeare"),
        (["--device", "cpu", "--only", "bigger"], "--only: bigger; candidates are"),
        (["--device", "tpu"], "unknown device 'tpu'"),
    ):
        with pytest.raises(SystemExit) as exit_:
            gpu_recipes.main([*argv, "--out", str(out)])
        assert exit_.value.code == 2 and message in capsys.readouterr().err
    out.write_text("{}")
    with pytest.raises(SystemExit):  # an existing result is kept unless --overwrite, before any work
        gpu_recipes.main(["--device", "cpu", "--smoke", "--out", str(out)])
    assert "--overwrite" in capsys.readouterr().err and out.read_text() == "{}"


def test_gpu_recipes_chooses_on_validation_and_scores_test_once(gpu_recipes, tiny_data, tmp_path):
    from qkv.bench.provenance import missing_fields

    multi30k, text = tiny_data
    out, root = tmp_path / "gpu_recipes.json", tmp_path / "runs"
    argv = ["--device", "cpu", "--smoke", "--only", "recipe,lr03", "--minutes", "0.5", "--data", str(multi30k)]
    argv += ["--text-dir", str(text), "--run-root", str(root), "--out", str(out)]
    assert gpu_recipes.main(argv) == 0
    report = json.loads(out.read_text())
    assert missing_fields(report) == [] and report["smoke"] is True and report["device"] == "cpu"
    assert report["candidates_asked"] == {"multi30k": ["recipe"], "tinyshakespeare": ["recipe", "lr03"]}
    for task, entry in report["tasks"].items():
        rows = entry["candidates"]
        assert entry["chosen"] == max(rows, key=lambda n: rows[n]["val_score"])  # on validation only
        assert entry["test"]["split"] == "test" and "--split test" in entry["test"]["command"]
        for name, row in rows.items():
            config = json.loads((root / task / name / "config.json").read_text())
            assert config["recipe"]["name"] == entry["recipe"] and row["steps"] == 2
            assert config["train"]["max_minutes"] == 0.5 == entry["budget_minutes"]
            assert row["val"]["split"] == "val"
    lm = report["tasks"]["tinyshakespeare"]
    assert json.loads((root / "tinyshakespeare" / "lr03" / "config.json").read_text())["train"]["lr_factor"] == 0.3
    for row in lm["candidates"].values():
        assert math.isclose(row["val"]["nats_per_char"], row["val"]["bits_per_char"] * math.log(2))
        assert row["val_score"] == -row["val"]["nats_per_char"]
    assert lm["met_target"] is None  # --minutes: not the recipe's budget, so no target is judged
    mt = report["tasks"]["multi30k"]
    tried = mt["alpha"]["tried_on_validation_bleu"]
    assert set(tried) == {str(a) for a in gpu_recipes.ALPHAS} and mt["alpha"]["recipe"] == 2.2
    assert tried[str(mt["alpha"]["chosen"])] == max(tried.values())
    assert f"--alpha {mt['alpha']['chosen']}" in mt["test"]["command"]


def _cli(capsys, *argv: str) -> tuple[int, str]:
    from qkv.cli import main

    code = main(list(argv))
    return code, capsys.readouterr().out


def test_qkv_recipes_lists_the_gpu_recipes_and_names_the_swap(capsys):
    code, out = _cli(capsys, "recipes")
    assert code == 0
    listed = {line.split()[0] for line in out.splitlines()[1:] if line.strip()}
    assert {"multi30k-gpu", "tinyshakespeare-gpu"} <= listed
    assert (
        "On a CUDA device it trains with multi30k-gpu in place of multi30k, tinyshakespeare-gpu in place of "
        "tinyshakespeare (and says so)." in out
    )


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_qkv_recipes_show_says_what_cuda_trains_with(capsys, monkeypatch, device):
    import qkv.runtime.device
    import qkv.runtime.precision

    monkeypatch.setattr(qkv.runtime.device, "pick_device", lambda requested=None: torch.device(device))
    monkeypatch.setattr(qkv.runtime.precision, "bf16_is_fast", lambda where="cpu": device == "cuda")
    monkeypatch.setattr(qkv.runtime.precision, "slow_bf16_reason", lambda where="cpu": "emulated (test)")
    code, out = _cli(capsys, "recipes", "show", "multi30k")
    assert code == 0
    note = "# CUDA here: qkv train without --recipe trains with multi30k-gpu in place of this one"
    assert (note in out) is (device == "cuda")
    assert "CUDA here" not in _cli(capsys, "recipes", "show", "multi30k-gpu")[1]


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_qkv_train_help_says_what_cuda_trains_with(capsys, monkeypatch, device):
    """The help shows the CPU recipe's defaults; on a CUDA device it says which recipe trains in its place,
    unless --recipe names one (never replaced)."""
    import qkv.runtime.device

    monkeypatch.setattr(qkv.runtime.device, "pick_device", lambda requested=None: torch.device(device))
    line = "On this machine's CUDA device, qkv train trains with {} in its place (its defaults: qkv train --recipe {} --help)."

    def help_text(*given: str) -> str:
        with pytest.raises(SystemExit) as done:
            _cli(capsys, "train", *given, "--help")
        assert done.value.code == 0
        return " ".join(capsys.readouterr().out.split())

    for given, gpu in [((), "multi30k-gpu"), (("--data", "tinyshakespeare"), "tinyshakespeare-gpu")]:
        out = help_text(*given)
        assert (line.format(gpu, gpu) in out) is (device == "cuda"), out[:600]
    assert "CUDA device" not in help_text("--recipe", "multi30k")

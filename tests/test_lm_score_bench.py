"""benchmarks/lm_score.py, the scorer behind the language-model figures (lm_vs_nanogpt.py's ``score``):
every character of a split predicted once, checked against a reference written another way (the model's
logits and log-softmax, window by window); and runs grouped by recipe, seeds together."""

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from bench_loader import load_benchmark

from qkv.bench.provenance import stamp
from qkv.cli import main as qkv_main
from qkv.models.causal_lm import CausalLM, CausalLMConfig
from qkv.runs.recipes import load_recipe

DEFAULT_DROPOUT = load_recipe("tinyshakespeare").model["dropout"]  # a size option given starts from [model]


def reference_nats_per_char(model: CausalLM, ids: list[int], context: int) -> float:
    """Character j (from 1) is predicted inside window ``(j - 1) // context`` while full windows cover
    it, else inside the last window, which ends at the last character."""
    n, total = len(ids), 0.0
    full = (n - 1) // context
    with torch.no_grad():
        for j in range(1, n):
            w = (j - 1) // context
            start = w * context if w < full else n - 1 - context
            window = torch.tensor(ids[start : start + context])[None]
            log_probs = F.log_softmax(model(window).logits[0].double(), dim=-1)  # (context, V)
            total -= float(log_probs[j - 1 - start, ids[j]])
    return total / (n - 1)


@pytest.mark.parametrize("n", [65, 70, 33])  # windows that end exactly, a leftover, a leftover of one window
def test_the_scorer_predicts_every_character_once_as_the_reference_does(n):
    bench = load_benchmark("lm_vs_nanogpt")
    torch.manual_seed(0)
    model = CausalLM(CausalLMConfig(vocab_size=11, d_model=16, num_heads=2, num_layers=1, d_ff=32, context=16)).eval()
    ids = torch.randint(0, 11, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    got = bench.score(model, ids, 16, batch=3)
    assert got["chars_scored"] == n - 1 and got["context"] == 16
    assert got["nats_per_char"] == pytest.approx(reference_nats_per_char(model, ids, 16), abs=1e-4)


def test_runs_are_grouped_by_recipe_seeds_together(tinyshakespeare_dir, tmp_path):
    tiny = ["--d-model", "16", "--heads", "2", "--layers", "1", "--d-ff", "32", "--context", "16"]
    tiny += ["--max-tokens", "256", "--max-steps", "2", "--no-progress", "--threads", "1"]
    runs = {"seed0": ["--seed", "0"], "seed1": ["--seed", "1"], "dropout": ["--seed", "0", "--dropout", "0.3"]}
    for name, extra in runs.items():
        argv = ["train", "--data", "tinyshakespeare", "--run-dir", str(tmp_path / name), *tiny, *extra]
        assert qkv_main(argv) == 0
    out = tmp_path / "scores.json"
    bench = load_benchmark("lm_score")
    assert bench.main([a for name in runs for a in ("--run", str(tmp_path / name))] + ["--out", str(out)]) == 0
    report = json.loads(out.read_text())
    for field in ("machine", "command", "date", "commit"):
        assert report[field]
    assert [r["seed"] for r in report["runs"]] == [0, 1, 0]
    first, second = report["summary"]
    assert first["seeds"] == [0, 1] and first["differs_from_first_group"] == {}
    assert second["seeds"] == [0] and second["differs_from_first_group"] == {"model.dropout": [DEFAULT_DROPOUT, 0.3]}
    for split in ("val", "test"):
        values = [r["scores"][split]["nats_per_char"] for r in report["runs"][:2]]
        assert first[split]["mean"] == pytest.approx(sum(values) / 2, abs=1e-4)
        assert first[split]["sample_std"] == pytest.approx(abs(values[0] - values[1]) / math.sqrt(2), abs=1e-4)
        assert second[split]["sample_std"] is None and second[split]["runs"] == 1
        assert all(0 < r["scores"][split]["nats_per_char"] < 10 for r in report["runs"])


@pytest.mark.parametrize("cut", [False, True])
def test_nanogpts_checkpoint_is_copied_at_the_first_iteration_past_the_budget(tmp_path, cut):
    # lm_vs_nanogpt.py scores nanoGPT at equal minutes from this copy; its schedule may end later
    bench = load_benchmark("lm_vs_nanogpt")
    watch = bench.CheckpointAtBudget(tmp_path, 10.0, cut=cut)
    (tmp_path / "ckpt.pt").write_bytes(b"iteration 0")
    assert not watch(3.0, "iter 0: loss 4.2, time 90.00ms, mfu -100.00%")  # before the loop: not counted
    assert not watch(5.0, "number of parameters: 0.80M")  # the loop starts at 5 s
    assert not watch(14.0, "iter 1: loss 4.1, time 80.00ms, mfu -100.00%")
    (tmp_path / "ckpt.pt").write_bytes(b"iteration 250")
    assert not watch(15.5, "saving checkpoint to out")  # past the budget, but not between two iterations
    assert watch(15.6, "iter 251: loss 2.0, time 80.00ms, mfu 0.10%") is cut
    (tmp_path / "ckpt.pt").write_bytes(b"iteration 500")
    assert not watch(20.0, "iter 501: loss 1.9, time 80.00ms, mfu 0.10%")  # copied once
    assert watch.iter == 251 and watch.loop_seconds == pytest.approx(10.6) and watch.copied
    assert watch.path.read_bytes() == b"iteration 250"


def test_nothing_is_copied_when_nanogpt_saved_nothing_by_the_budget(tmp_path):
    bench = load_benchmark("lm_vs_nanogpt")
    watch = bench.CheckpointAtBudget(tmp_path, 1.0)
    watch(0.0, "using fused AdamW: False")
    watch(2.0, "iter 7: loss 3.0, time 80.00ms, mfu 0.10%")
    assert watch.iter == 7 and not watch.copied and not watch.path.exists()


def _earlier_report(machine: dict, splits: dict, scored: tuple[str, ...]) -> dict:
    scores = {name: {"nats_per_char": 1.5, "chars_scored": 10, "context": 64} for name in scored}
    nanogpt = {"at_budget": {"scores": scores}, "scores": scores}
    return {"machine": machine, "text": {"splits_chars": splits}, "commit": "abc", "date": "d",
            "budgets": [{"minutes": 30.0, "seed": 0, "nanogpt": nanogpt}]}  # fmt: skip


def test_earlier_nanogpt_runs_are_taken_only_from_a_machine_of_this_kind(tmp_path):
    bench = load_benchmark("lm_vs_nanogpt")
    machine = {"cpu_model": "AMD EPYC", "cpu_family": "25", "cpu_model_number": "1", "avx2": True,
               "avx512_bf16": False, "amx": False, "threads": 2, "torch": "2.13.0+cpu", "time": "t"}  # fmt: skip
    splits = {"train": [0, 90], "val": [90, 95], "test": [95, 100]}
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps(_earlier_report(machine, splits, ("val", "test"))))
    runs, source = bench.earlier_nanogpt(path, machine, {"splits_chars": splits}, ["val", "test"])
    assert list(runs) == [(30.0, 0)] and source["commit"] == "abc"
    with pytest.raises(SystemExit, match="avx512_bf16"):
        bench.earlier_nanogpt(path, {**machine, "avx512_bf16": True}, {"splits_chars": splits}, ["val"])
    with pytest.raises(SystemExit, match="splits"):
        bench.earlier_nanogpt(path, machine, {"splits_chars": {**splits, "val": [90, 96]}}, ["val"])
    path.write_text(json.dumps(_earlier_report(machine, splits, ("val",))))  # scored without test
    assert bench.earlier_nanogpt(path, machine, {"splits_chars": splits}, ["val", "test"])[0] == {}


def test_this_machine_has_every_key_an_earlier_report_is_compared_on():
    bench = load_benchmark("lm_vs_nanogpt")
    here = bench.this_machine()
    assert all(here.get(key) is not None for key in bench.MACHINE_KEYS)
    assert {k: stamp({"machine": here})["machine"][k] for k in bench.MACHINE_KEYS} == {
        k: here[k] for k in bench.MACHINE_KEYS
    }


def _scored_report(machine, splits, commit, seeds, ours, theirs):
    def scores(value):
        return {name: {"nats_per_char": value, "chars_scored": 10, "context": 64} for name in ("val", "test")}

    budgets = [{"minutes": 30.0, "seed": seed, "nanogpt": {"at_budget": {"scores": scores(t)}, "scores": scores(t)},
                "qkv": {"scores": scores(o)}} for seed, o, t in zip(seeds, ours, theirs, strict=True)]  # fmt: skip
    return {"machine": machine, "text": {"splits_chars": splits}, "commit": commit, "date": "d", "budgets": budgets}


def test_reports_of_one_kind_of_machine_and_one_recipe_are_combined_over_their_seeds(tmp_path):
    bench = load_benchmark("lm_vs_nanogpt")
    machine = {"cpu_model": "AMD EPYC", "cpu_family": "25", "cpu_model_number": "1", "avx2": True,
               "avx512_bf16": False, "amx": False, "threads": 2, "torch": "2.13.0+cpu"}  # fmt: skip
    splits = {"train": [0, 90], "val": [90, 95], "test": [95, 100]}
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_scored_report(machine, splits, "aaaaaaa", [0, 1], [1.40, 1.42], [1.46, 1.48])))
    b.write_text(json.dumps(_scored_report(machine, splits, "bbbbbbb", [2], [1.44], [1.50])))
    recipes = {"aaaaaaa": "recipe", "bbbbbbb": "recipe"}
    report = bench.combine([b, a], recipes.__getitem__)
    assert [x["seed"] for x in report["budgets"]] == [0, 1, 2]
    summary = report["summary"]["30"]
    assert summary["seeds"] == [0, 1, 2]
    for name in ("val", "test"):
        assert summary[name]["qkv_mean"] == pytest.approx(1.42) and summary[name]["nanogpt_mean"] == pytest.approx(1.48)
        assert summary[name]["qkv_ahead"] == pytest.approx(0.06)
        assert summary[name]["qkv_spread"] == pytest.approx(math.sqrt(2 / 3) * 0.02, abs=1e-4)
    assert [s["runs"] for s in report["combined_from"]] == [[[30.0, 2]], [[30.0, 0], [30.0, 1]]]
    with pytest.raises(SystemExit, match="again"):
        bench.combine([a, a], recipes.__getitem__)
    c = tmp_path / "c.json"  # seed 0 again, in another report: left out of a, a's seed 0 comes from c
    c.write_text(json.dumps(_scored_report(machine, splits, "bbbbbbb", [0], [1.30], [1.50])))
    left = bench.combine([a, c], recipes.__getitem__, leave_out=[(a, 30.0, 0, "not a side by side")])
    assert [(x["seed"], x["qkv"]["scores"]["val"]["nats_per_char"]) for x in left["budgets"]] == [(0, 1.30), (1, 1.42)]
    assert left["combined_from"][0]["runs"] == [[30.0, 1]]
    assert left["combined_from"][0]["left_out"] == [{"minutes": 30.0, "seed": 0, "why": "not a side by side"}]
    assert left["summary"]["30"]["val"]["qkv_mean"] == pytest.approx(1.36)
    for wrong, match in [((b, 30.0, 0, "x"), "not one of"), ((a, 30.0, 2, "x"), "no run"), ((a, 30.0, 0, " "), "why")]:
        with pytest.raises(SystemExit, match=match):
            bench.combine([a, c], recipes.__getitem__, leave_out=[wrong])
    with pytest.raises(SystemExit, match="recipe"):
        bench.combine([a, b], {"aaaaaaa": "recipe", "bbbbbbb": "another"}.__getitem__)
    b.write_text(json.dumps(_scored_report({**machine, "threads": 1}, splits, "bbbbbbb", [2], [1.44], [1.50])))
    with pytest.raises(SystemExit, match="threads"):
        bench.combine([a, b], recipes.__getitem__)
    with pytest.raises(SystemExit, match="not a clean commit"):
        bench.recipe_at("abc1234-dirty")
    head = subprocess.run(
        ["git", "-C", str(Path(__file__).parent), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    if head.returncode == 0:  # in a git checkout (CI's clean clone is one)
        assert "[budget.sizes]" in bench.recipe_at(head.stdout.strip())


def test_earlier_nanogpt_runs_are_refused_from_a_machine_of_another_speed():
    bench = load_benchmark("lm_vs_nanogpt")
    source = {"path": "earlier.json", "nanogpt_timing_run": {"seconds_per_iter": 0.041}}
    bench.same_speed(source, {"seconds_per_iter": 0.043})  # within 10%
    with pytest.raises(SystemExit, match="84.0 ms here, 41.0 ms"):
        bench.same_speed(source, {"seconds_per_iter": 0.084})
    with pytest.raises(SystemExit, match="not the same speed"):
        bench.same_speed({"path": "old.json", "nanogpt_timing_run": None}, {"seconds_per_iter": 0.04})

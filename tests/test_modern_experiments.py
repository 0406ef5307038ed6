"""The experiments on today's attention (positions past the trained length, grouped-query attention's
cache against its quality, sliding windows on long-range recall): each runs in --quick mode, writes
its results.json and figure, and its claims are the checks of its own measurements (a changed
measurement changes the claim). One test per experiment run, so that pytest-xdist never runs one twice."""

import copy
import json

import pytest
import torch

from qkv.experiments import EXPERIMENTS, gqa_memory_quality, positions_extrapolation, run_experiment, window_recall
from qkv.models.causal_lm import IGNORE


def _written(result, out):
    folder = out / result.name
    data = json.loads((folder / "results.json").read_text())
    assert data["schema"] == "qkv-experiment/1" and data["experiment"] == result.name and data["quick"] is True
    assert data["claims"] == result.claims and data["results"] == result.results
    for name in result.figures:
        assert (folder / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(folder.glob(".*")), "temporary files left behind"
    return data


def test_registered():
    for name, module in (
        ("positions-extrapolation", positions_extrapolation),
        ("gqa-memory-quality", gqa_memory_quality),
        ("window-recall", window_recall),
    ):
        assert EXPERIMENTS[name][0] == module.__name__ and name == module.NAME


# ---------------------------------------------------------------- positions-extrapolation


def test_positions_extrapolation_quick(tmp_path):
    result = run_experiment("positions-extrapolation", out=tmp_path, quick=True, seed=0, progress=False)
    data = _written(result, tmp_path)
    r, config = data["results"], positions_extrapolation.QUICK
    assert r["kinds"] == ["learned", "sinusoidal", "rotary", "alibi"]
    assert r["eval_length"] == 4 * r["train_length"] == 4 * config.train_length
    for kind in r["kinds"]:
        per_position = r["accuracy_by_position"][kind]
        assert len(per_position) == r["eval_length"] - r["offset"]
        assert all(0.0 <= a <= 1.0 for a in per_position)
        # the summaries are means of the per-position accuracies
        length = r["train_length"]
        trained = per_position[: length - r["offset"]]
        assert r["accuracy"][kind]["trained"] == pytest.approx(sum(trained) / len(trained), abs=2e-3)
        assert r["accuracy"][kind]["length_4x"] == pytest.approx(sum(per_position) / len(per_position), abs=2e-3)
        assert r["training"][kind]["steps"] == config.steps
    # a model whose table was trained on L positions copies at the trained length even in --quick
    assert r["accuracy"]["learned"]["trained"] > 0.9
    # the claims are the checks of these numbers ...
    assert result.claims == positions_extrapolation.claims_of(r)
    # ... and move with them
    lost = "learned positions lose the rule past the trained length"
    changed = copy.deepcopy(r)
    changed["accuracy"]["learned"]["beyond"] = 1.0 - r["accuracy"]["learned"]["beyond"]
    assert positions_extrapolation.claims_of(changed)[lost] is not result.claims[lost]
    kept = "ALiBi keeps the rule up to 4x the trained length"
    changed["accuracy"]["alibi"]["to_4x"] = 0.0 if result.claims[kept] else 1.0
    assert positions_extrapolation.claims_of(changed)[kept] is not result.claims[kept]


def test_positions_task():
    config = positions_extrapolation.QUICK
    ids, targets = positions_extrapolation.make_batch(config, 8, 20, torch.Generator().manual_seed(0))
    k = config.offset
    assert ids.shape == targets.shape == (8, 20)
    assert bool((targets[:, :k] == IGNORE).all()) and torch.equal(targets[:, k:], ids[:, :-k])
    summary = positions_extrapolation.summarise(
        [1.0] * (config.train_length - k) + [0.0] * 3 * config.train_length, config
    )
    assert summary["trained"] == 1.0 and summary["beyond"] == 0.0 and summary["to_2x"] == 0.0
    assert summary["length_1x"] == 1.0 and 0.0 < summary["length_2x"] < 1.0


# ---------------------------------------------------------------- gqa-memory-quality


def test_gqa_memory_quality_quick(tmp_path, tinyshakespeare_dir):
    result = run_experiment(
        "gqa-memory-quality", out=tmp_path, quick=True, seed=0, progress=False, data_dir=tinyshakespeare_dir
    )
    data = _written(result, tmp_path)
    r, config = data["results"], gqa_memory_quality.QUICK
    assert r["kv_heads"] == list(config.kv_heads) and str(tinyshakespeare_dir) in r["data"]
    head_dim = config.d_model // config.num_heads
    for kv in config.kv_heads:
        m = r["models"][str(kv)]
        # measured from the cache tensors: one layer's keys are (b, h_kv, s, d_head), float32
        assert m["cache"]["shape"] == [1, kv, config.context, head_dim] and m["cache"]["dtype"] == "float32"
        assert m["cache"]["bytes_per_token"] == 2 * config.num_layers * kv * head_dim * 4
        assert m["cache_ratio"] == pytest.approx(kv / config.num_heads)
        assert len(m["val_loss_by_seed"]) == len(config.seeds)
        full = r["models"][str(config.num_heads)]["val_loss_by_seed"]
        paired = [a - b for a, b in zip(m["val_loss_by_seed"], full)]
        assert m["loss_over_full_by_seed"] == pytest.approx(paired, abs=1e-5)
        assert 1.0 < m["val_loss"] < 4.5  # learning characters: below uniform's log(65) = 4.17 after training
    # fewer key/value heads: fewer parameters (smaller k_proj and v_proj)
    counts = [r["models"][str(kv)]["parameters"] for kv in config.kv_heads]
    assert counts == sorted(counts, reverse=True)
    memory = "the cache shrinks by h / h_kv"
    assert result.claims[memory] and result.claims["the cache holds 2 x layers x h_kv x d_head numbers per token"]
    assert result.claims == gqa_memory_quality.claims_of(r)
    # the quality claims read the measured losses: change them and the claims change
    cost = "fewer key/value heads cost some loss: above full attention at every seed"
    changed = copy.deepcopy(r)
    changed["models"]["1"]["loss_over_full_by_seed"] = [-1.0 if result.claims[cost] else 1.0]
    for kv in config.kv_heads[1:-1]:
        changed["models"][str(kv)]["loss_over_full_by_seed"] = [1.0]
    assert gqa_memory_quality.claims_of(changed)[cost] is not result.claims[cost]
    mqa = "multi-query attention loses under 0.05 nats per character"
    changed["models"]["1"]["loss_over_full"] = 1.0 if result.claims[mqa] else 0.0
    assert gqa_memory_quality.claims_of(changed)[mqa] is not result.claims[mqa]
    changed["models"]["1"]["cache"]["bytes_per_token"] += 1
    assert (
        gqa_memory_quality.claims_of(changed)["the cache holds 2 x layers x h_kv x d_head numbers per token"] is False
    )


def test_gqa_cache_of_a_model():
    config = gqa_memory_quality.QUICK
    for kv in (4, 1):
        model = gqa_memory_quality.build_model(config, 20, kv)
        measured = gqa_memory_quality.cache_bytes_per_token(model, torch.randint(0, 20, (3, 10)))
        assert measured["shape"] == [3, kv, 10, config.d_model // config.num_heads]
        assert measured["bytes_per_token"] == gqa_memory_quality.expected_bytes_per_token(config, kv)


# ---------------------------------------------------------------- window-recall


def test_window_recall_quick(tmp_path):
    result = run_experiment("window-recall", out=tmp_path, quick=True, seed=0, progress=False)
    data = _written(result, tmp_path)
    r, config = data["results"], window_recall.QUICK
    w = config.window
    assert r["window"] == w and r["distances"] == list(range(1, config.max_distance + 1))
    assert list(r["models"]) == [v.name for v in config.variants]
    for name, m in r["models"].items():
        assert len(m["accuracy"]) == config.max_distance
        # the mask decides the reach, trained or not: n (W - 1) for n windowed layers, all with a full one
        assert m["reach_gradient"] == m["reach_gradient_at_init"] == m["reach_expected"], name
    assert r["models"]["window x1"]["reach_gradient"] == w - 1
    assert r["models"]["window x2"]["reach_gradient"] == 2 * (w - 1)
    assert r["models"]["full attention"]["reach_gradient"] == r["length"] - 1
    # a single windowed layer cannot recall what it cannot see, however it was trained
    beyond = r["models"]["window x1"]["accuracy"][w - 1 :]
    assert sum(beyond) / len(beyond) < 0.4
    assert result.claims == window_recall.claims_of(r)
    claim = "one full layer among windowed ones recalls at every distance"
    changed = copy.deepcopy(r)
    changed["models"]["window, then full"]["accuracy"] = [0.0 if result.claims[claim] else 1.0] * config.max_distance
    assert window_recall.claims_of(changed)[claim] is not result.claims[claim]
    reach = "the gradients reach n (W - 1) tokens back through n windowed layers"
    changed["models"]["window x2"]["reach_gradient"] += 1
    assert window_recall.claims_of(changed)[reach] is False


def test_window_recall_task_and_reach():
    config = window_recall.QUICK
    distances = torch.tensor([1, 5, config.max_distance])
    ids, answers = window_recall.make_batch(config, distances, torch.Generator().manual_seed(0))
    assert ids.shape == (3, config.length) and bool((ids[:, -1] == config.query_id).all())
    for row, d in enumerate(distances.tolist()):
        symbols = (ids[row] < config.num_symbols).nonzero().flatten().tolist()
        assert symbols == [config.length - 1 - d] and ids[row, symbols[0]] == answers[row]
    assert window_recall.recalled_reach([1.0, 0.95, 0.5, 1.0]) == 2 and window_recall.recalled_reach([0.2]) == 0
    variant = window_recall.Variant("window x3", 3, None)
    model = window_recall.build_model(config, variant)
    probe = torch.randint(config.num_symbols, config.query_id, (2, config.length))
    assert (
        window_recall.gradient_reach(model, probe)
        == 3 * (config.window - 1)
        == window_recall.expected_reach(config, variant)
    )

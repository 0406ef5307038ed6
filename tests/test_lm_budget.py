"""A language model that knows its budget: the cosine schedule against PyTorch's, the size rule of a
recipe's ``[budget]`` table (which size a budget's tokens afford), the per-machine speed cache (numbers
only, anything else measured again), and a run whose model the rule sizes, recorded in config.json."""

import json
import logging
import math
from pathlib import Path

import pytest
import torch

from qkv.models.causal_lm import CausalLMConfig
from qkv.runs.recipes import budget, load_recipe
from qkv.runs.recipes.budget import BudgetRule, choose_size, measured_speeds, parameters, read_budget_rule
from qkv.training import TrainConfig
from qkv.training.schedule import learning_rate

MODEL = {"num_heads": 2, "num_layers": 1, "d_ff": 64, "context": 16, "dropout": 0.0}
NAMED = {
    "s": {"d_model": 16, "max_tokens": 64},
    "m": {"d_model": 32, "max_tokens": 64},
    "l": {"d_model": 64, "max_tokens": 128},
}
SIZES = list(NAMED.values())
TEXT = "".join(f"{'To be, or not to be' if i % 3 else 'that is the question'}: line {i}.\n" for i in range(300))


def test_cosine_schedule_follows_pytorchs_cosine_annealing_after_the_warmup():
    warmup, steps, d_model = 10, 200, 64
    config = TrainConfig(schedule="cosine", warmup_steps=warmup, lr_factor=0.5, max_steps=steps)
    peak = 0.5 * d_model**-0.5 * warmup**-0.5
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=peak)
    reference = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps, eta_min=0.0)
    for step in range(1, steps + 1):
        optimizer.step()
        reference.step()
        ours = learning_rate(config, step, d_model, progress=step / steps)
        if step < warmup:
            assert ours == pytest.approx(peak * step / warmup)
        else:
            assert ours == pytest.approx(optimizer.param_groups[0]["lr"], abs=1e-12)
    assert learning_rate(config, steps, d_model, progress=1.0) == 0.0


def _rule(ratio=4.0):
    return read_budget_rule(Path("r.toml"), {"tokens_per_parameter": ratio, "sizes": NAMED}, MODEL)


def test_the_largest_size_the_budgets_tokens_cover_is_chosen():
    rule = _rule()
    counts = [parameters(CausalLMConfig(**{**MODEL, "d_model": s["d_model"], "vocab_size": 65})) for s in SIZES]
    speeds = [1000.0, 500.0, 100.0]

    def choose(**budget_):
        kwargs = {"minutes": 0.0, "max_steps": 0, "epochs": 0.0, "train_tokens": 10_000, **budget_}
        return choose_size(rule, MODEL, 65, speed=lambda i: speeds[i], **kwargs)

    # minutes: tokens = 60 x minutes x the size's own speed
    minutes = 4.0 * counts[1] / (60 * speeds[1]) * 1.01  # just enough for the middle size, not the largest
    assert 4.0 * counts[2] > 60 * minutes * speeds[2]
    chosen = choose(minutes=minutes)
    assert chosen.index == 1 and chosen.parameters == counts[1]
    assert chosen.tokens == pytest.approx(60 * minutes * speeds[1])
    assert "the largest of 3 sizes with >= 4 tokens per parameter" in chosen.why
    # steps: tokens = steps x the size's tokens a step (whole windows of its context)
    assert choose(max_steps=10**6).index == 2
    assert choose(max_steps=1).index == 0 and "the smallest of 3 sizes" in choose(max_steps=1).why
    # several budgets: the smallest affordable tokens decide
    assert choose(max_steps=10**6, minutes=minutes).index == 1
    assert choose(epochs=1.0).tokens == 10_000


@pytest.mark.parametrize(
    "values, message",
    [
        ({"tokens_per_parameter": 4, "sizes": NAMED, "extra": 1}, "budget.extra: unknown key"),
        ({"tokens_per_parameter": 0, "sizes": NAMED}, "budget.tokens_per_parameter: must be a number > 0"),
        ({"tokens_per_parameter": 4, "sizes": []}, "budget.sizes: must be a table of named sizes"),
        ({"tokens_per_parameter": 4, "sizes": {"a": {"width": 3}}}, "budget.sizes[a].width: not a language model's"),
        ({"tokens_per_parameter": 4, "sizes": {"a": {"d_model": 15}}}, "budget.sizes[a]:"),
        ({"tokens_per_parameter": 4, "sizes": {"a": {"max_tokens": 0}}}, "budget.sizes[a].max_tokens"),
        ({"tokens_per_parameter": 4, "sizes": dict(reversed(NAMED.items()))}, "smallest first"),
    ],
)
def test_a_bad_budget_table_is_refused_in_one_line(values, message):
    with pytest.raises(ValueError, match="^r.toml: ") as err:
        read_budget_rule(Path("r.toml"), values, MODEL)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_default_language_model_recipe_has_a_valid_budget_rule():
    recipe = load_recipe("tinyshakespeare")
    assert isinstance(recipe.budget, BudgetRule)
    assert recipe.train["schedule"] in ("budget", "cosine")
    assert list(recipe.as_dict()["budget"]["sizes"].values()) == [dict(s) for s in recipe.budget.sizes]


class _Task:
    def __init__(self, context):
        from qkv.data.text import CharTokenizer
        from qkv.training import LanguageModelTask

        tokenizer = CharTokenizer.train(TEXT)
        ids = torch.tensor(tokenizer.encode(TEXT)).numpy()
        self.task = LanguageModelTask(tokenizer, ids, None, context=context)


@pytest.mark.parametrize("cache_text", [None, "not json", "[1, 2]", '{"k": "import os"}', '{"k": true}', "{}"])
def test_speeds_are_measured_once_and_a_foreign_cache_is_measured_again(tmp_path, monkeypatch, cache_text):
    measured = []

    def fake_measure(size, model, task_for, **kwargs):
        measured.append(size["d_model"])
        return 1234.5

    monkeypatch.setattr(budget, "_measure", fake_measure)
    if cache_text is not None:
        (tmp_path / budget.CACHE_NAME).write_text(cache_text)
    rule, device = _rule(), torch.device("cpu")

    def speeds():
        return measured_speeds(
            rule, MODEL, lambda c: _Task(c).task, vocab_size=65, device=device, bf16=False, cache_dir=tmp_path
        )

    speed = speeds()
    assert [speed(1), speed(1), speed(0)] == [1234.5, 1234.5, 1234.5] and measured == [16, 32]  # the smallest first
    kept = json.loads((tmp_path / budget.CACHE_NAME).read_text())
    assert sorted(kept.values()) == [1234.5, 1234.5] and all(isinstance(k, str) for k in kept)
    # from the cache, once the smallest size, timed again, shows the machine at the cache's speed
    assert speeds()(1) == 1234.5 and measured == [16, 32, 16]
    assert speeds()(2) == 1234.5 and measured == [16, 32, 16, 16, 64]  # a size not in the cache is measured


def test_a_cache_from_a_slower_or_faster_day_is_measured_again(tmp_path, monkeypatch, caplog):
    rate = {"now": 1000.0}
    measured = []

    def fake_measure(size, model, task_for, **kwargs):
        measured.append(size["d_model"])
        return rate["now"] * 16 / size["d_model"]

    monkeypatch.setattr(budget, "_measure", fake_measure)
    rule, device = _rule(), torch.device("cpu")

    def speeds():
        return measured_speeds(
            rule, MODEL, lambda c: _Task(c).task, vocab_size=65, device=device, bf16=False, cache_dir=tmp_path
        )

    assert speeds()(2) == 250.0 and measured == [16, 64]  # nothing cached: the smallest, then the one asked for
    rate["now"] = 1100.0  # within DRIFT: the cache holds
    assert speeds()(2) == 250.0 and measured == [16, 64, 16]
    rate["now"] = 500.0  # half the speed: every size asked for is timed again and kept
    caplog.set_level(logging.INFO, logger="qkv")
    speed = speeds()
    assert speed(2) == 125.0 and speed(0) == 500.0 and measured == [16, 64, 16, 16, 64]
    assert "at 45% of the speed in qkv's cache" in caplog.text  # against the 1100 the probe last kept
    assert sorted(json.loads((tmp_path / budget.CACHE_NAME).read_text()).values()) == [125.0, 500.0]


def test_speeds_are_measured_with_the_runs_weight_decay_and_kept_apart(tmp_path, monkeypatch):
    """A recipe with weight decay trains with AdamW (two parameter groups): its speed is measured with
    it, and kept under its own key; without weight decay the key is the one Adam runs always had."""
    seen = []
    monkeypatch.setattr(budget, "_measure", lambda size, model, task_for, **kw: seen.append(kw["weight_decay"]) or 1.0)

    def speeds(**kw):
        return measured_speeds(
            _rule(),
            MODEL,
            lambda c: _Task(c).task,
            vocab_size=65,
            device=torch.device("cpu"),
            bf16=False,
            cache_dir=tmp_path,
            **kw,
        )

    speeds()(0)
    speeds(weight_decay=0.1)(0)
    assert seen == [0.0, 0.1]  # not the speed cached without weight decay
    plain = budget._speed_key(SIZES[0], MODEL, 65, torch.device("cpu"), False, 0.0)
    assert plain != budget._speed_key(SIZES[0], MODEL, 65, torch.device("cpu"), False, 0.1)
    assert plain == budget._speed_key(SIZES[0], MODEL, 65, torch.device("cpu"), False, 0.0, "adamw")
    muon = budget._speed_key(SIZES[0], MODEL, 65, torch.device("cpu"), False, 0.1, "muon")
    assert muon != budget._speed_key(SIZES[0], MODEL, 65, torch.device("cpu"), False, 0.1)


def test_measuring_a_speed_uses_adamw_with_the_weight_decay(monkeypatch):
    import qkv.training as training

    configs = []
    original = training.Trainer

    def recording(model, task, config, *args, **kwargs):
        configs.append(config)
        return original(model, task, config, *args, **kwargs)

    monkeypatch.setattr(training, "Trainer", recording)
    task = _Task(16).task
    budget._measure(
        SIZES[0],
        MODEL,
        lambda c: task,
        vocab_size=task.tokenizer.vocab_size,
        device=torch.device("cpu"),
        bf16=False,
        weight_decay=0.1,
    )
    assert [c.weight_decay for c in configs] == [0.1]


def test_measuring_a_speed_uses_the_runs_optimizer(monkeypatch):
    """Muon's steps are slower than AdamW's: a Muon run's budget is sized by Muon's speed."""
    import qkv.training as training

    optimizers = []
    original = training.Trainer

    def recording(model, task, config, *args, **kwargs):
        trainer = original(model, task, config, *args, **kwargs)
        optimizers.append(type(trainer.optimizer).__name__)
        return trainer

    monkeypatch.setattr(training, "Trainer", recording)
    task = _Task(16).task
    budget._measure(
        SIZES[0],
        MODEL,
        lambda c: task,
        vocab_size=task.tokenizer.vocab_size,
        device=torch.device("cpu"),
        bf16=False,
        weight_decay=0.1,
        optimizer="muon",
    )
    assert optimizers == ["MuonWithAdamW"]


def test_measuring_a_speed_leaves_the_random_state_as_it_was():
    task = _Task(16).task
    before = torch.random.get_rng_state()
    speed = budget._measure(
        SIZES[0], MODEL, lambda c: task, vocab_size=task.tokenizer.vocab_size, device=torch.device("cpu"), bf16=False
    )
    assert speed > 0 and math.isfinite(speed)
    assert torch.equal(torch.random.get_rng_state(), before)


def test_a_run_takes_the_size_its_budget_affords_and_says_why(tmp_path):
    from qkv.data.spec import DataSpec
    from qkv.runs.recipes import Recipe
    from qkv.runs.translation import start_run

    (tmp_path / "train.txt").write_text(TEXT, encoding="utf-8")
    base = load_recipe("tinyshakespeare")
    rule = _rule(ratio=1.0)
    recipe = Recipe(
        **{
            **{f: getattr(base, f) for f in base.__dataclass_fields__},
            "model": {**base.model, **MODEL},
            "budget": rule,
            "default_for": (),
        }
    )
    train = {
        "max_steps": 40,
        "max_minutes": 0.0,
        "progress": False,
        "eval_every_minutes": 0.0,
        "checkpoint_every_minutes": 0.0,
        "bf16": False,
    }
    data = DataSpec(source="text", train_text=str(tmp_path / "train.txt"))
    trainer = start_run(
        tmp_path / "run", data=data, model_options=None, train_options=train, device="cpu", recipe=recipe
    )
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    sizing = config["recipe"]["sizing"]
    counts = [
        parameters(
            CausalLMConfig(
                **{**base.model, **MODEL, "d_model": s["d_model"], "vocab_size": trainer.task.tokenizer.vocab_size}
            )
        )
        for s in SIZES
    ]
    tokens = [40 * s["max_tokens"] for s in SIZES]  # 40 steps of whole 16-token windows
    expected = max(i for i in range(3) if tokens[i] >= counts[i]) if tokens[0] >= counts[0] else 0
    assert sizing["size"] == SIZES[expected] and sizing["parameters"] == counts[expected]
    assert config["model"]["d_model"] == SIZES[expected]["d_model"]
    assert config["train"]["max_tokens"] == SIZES[expected]["max_tokens"]
    # a size option given turns the rule off
    trainer = start_run(
        tmp_path / "given", data=data, model_options={"d_model": 16}, train_options=train, device="cpu", recipe=recipe
    )
    config = json.loads((tmp_path / "given" / "config.json").read_text())
    assert "sizing" not in config["recipe"] and config["model"]["d_model"] == 16


def test_a_sizes_dropout_is_its_own_unless_given_and_giving_it_keeps_the_rule(tmp_path):
    from qkv.data.spec import DataSpec
    from qkv.runs.recipes import Recipe
    from qkv.runs.translation import start_run

    (tmp_path / "train.txt").write_text(TEXT, encoding="utf-8")
    base = load_recipe("tinyshakespeare")
    named = {"s": {"dropout": 0.0, "d_model": 16, "max_tokens": 64}, "m": {"d_model": 32, "max_tokens": 64}}
    model = {**base.model, **MODEL, "dropout": 0.1}
    rule = read_budget_rule(Path("r.toml"), {"tokens_per_parameter": 1e9, "sizes": named}, model)  # always "s"
    fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
    recipe = Recipe(**{**fields, "model": model, "budget": rule, "default_for": ()})
    train = {"max_steps": 2, "max_minutes": 0.0, "progress": False, "eval_every_minutes": 0.0, "bf16": False}
    train["checkpoint_every_minutes"] = 0.0
    data = DataSpec(source="text", train_text=str(tmp_path / "train.txt"))
    for name, options, dropout in (("own", None, 0.0), ("given", {"dropout": 0.25}, 0.25)):
        start_run(tmp_path / name, data=data, model_options=options, train_options=train, device="cpu", recipe=recipe)
        config = json.loads((tmp_path / name / "config.json").read_text())
        assert config["recipe"]["sizing"]["size"]["d_model"] == 16  # chosen by the rule, not turned off
        assert config["model"]["dropout"] == config["recipe"]["sizing"]["size"]["dropout"] == dropout
    assert budget.with_settings(rule, {"dropout": 0.3, "d_model": 8}).sizes == (
        {"dropout": 0.3, "d_model": 16, "max_tokens": 64},
        {"dropout": 0.3, "d_model": 32, "max_tokens": 64},
    )


def test_the_budgets_end_is_validated_and_can_be_the_runs_best(tmp_path):
    """eval every 4 steps over a 6-step budget: validations at steps 4 and 6 (the end), the last one's
    loss is that of the final weights (computed here with F.cross_entropy), and the run's model is the
    better of the two."""
    import torch.nn.functional as F
    from safetensors.torch import load_file

    from qkv.data.spec import DataSpec
    from qkv.runs.folder import load_run
    from qkv.runs.translation import run_training, start_run

    (tmp_path / "train.txt").write_text(TEXT, encoding="utf-8")
    train = {"max_steps": 6, "max_minutes": 0.0, "max_tokens": 128, "warmup_steps": 2, "progress": False,
             "eval_every_steps": 4, "eval_every_minutes": 0.0, "eval_sentences": 8, "checkpoint_every_minutes": 0.0,
             "final_weights": "best", "bf16": False, "average_last": 1}  # fmt: skip
    data = DataSpec(source="text", train_text=str(tmp_path / "train.txt"))
    run = tmp_path / "run"
    trainer = start_run(run, data=data, model_options={**MODEL, "d_model": 16}, train_options=train, device="cpu")
    run_training(trainer)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    valid = [r for r in records if r["event"] == "valid"]
    assert [r["step"] for r in valid] == [4, 6]
    last, _, _ = load_run(run, "last", task="lm")
    task = trainer.task
    starts = list(range(0, len(task.valid_tokens) - task.context, task.context))[:8]
    rows = torch.stack([torch.as_tensor(task.valid_tokens[s : s + task.context + 1], dtype=torch.long) for s in starts])
    with torch.no_grad():
        logits = last(rows[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1))
    assert valid[-1]["val_loss"] == pytest.approx(float(loss), abs=1e-4)
    best = min(valid, key=lambda r: r["val_loss"])
    expected = "last.safetensors" if best["step"] == 6 else "best.safetensors"
    assert load_file(run / "model.safetensors").keys() == load_file(run / expected).keys()
    model, saved = load_file(run / "model.safetensors"), load_file(run / "best.safetensors")
    assert all(torch.equal(model[k], saved[k]) for k in model)


def test_qkv_recipes_show_keeps_the_budget_rule(tmp_path):
    """``qkv recipes show`` prints a resolved recipe that is itself a recipe file: its [budget] loads back whole."""
    from qkv.cli.recipes import show_lines

    shipped = load_recipe("tinyshakespeare")
    path = tmp_path / "resolved.toml"
    path.write_text("\n".join(show_lines(shipped)) + "\n", encoding="utf-8")
    assert load_recipe(path).budget == shipped.budget

"""The Trainer's parts: research methods as step hooks outside Trainer.step (qkv.training.hooks,
qkv.training.methods), and the checkpoints as an object the Trainer owns (qkv.training.checkpointing).

The hooks are checked against the code they replaced: the objective they choose against
:func:`qkv.training.objectives.step_objective`, a hook's objective against the same run configured
with the option, and the engine's source for any research option or method named in it."""

import ast
import contextlib
import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_training import tiny_run
from torch import nn

from qkv.data.dates import generate_dates
from qkv.models.transformer import Transformer
from qkv.training import TrainConfig, Trainer, TrainState, checkpoint_files
from qkv.training.checkpointing import Checkpoints
from qkv.training.distributed import Distributed
from qkv.training.hooks import StepHook, StepHooks
from qkv.training.methods import METHODS, BothDirectionsUntil, LateDropout, RDropFrom, step_hooks
from qkv.training.objectives import DEFAULT_OBJECTIVE, RDrop, make_objective, step_objective

ENGINE = Path(__file__).resolve().parent.parent / "src" / "qkv" / "training" / "engine.py"
RESEARCH = sorted(f.name for f in dataclasses.fields(TrainConfig) if f.metadata.get("group") == "research")


def _model(dropout: float = 0.1) -> nn.Module:
    model = nn.Linear(4, 4)
    model.config = SimpleNamespace(dropout=dropout, d_model=4)  # what the methods read of a model
    return model


# --------------------------------------------------------------------------- the step carries no method
def test_the_engine_names_no_research_option_and_no_method():
    """engine.py (Trainer.step, the loop) mentions none of the options `qkv train --help-all` lists as
    research, nor a method's name: every method reaches the step through the hooks. The code before
    the hooks (``step_objective(c, ...)``, ``self.late_dropout``, ``drop_reversed_pairs_when_due``)
    fails this test."""
    assert {"rdrop", "dropout_start", "both_directions_until", "subword_dropout"} <= set(RESEARCH)
    tree = ast.parse(ENGINE.read_text(encoding="utf-8"))
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    names |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    method_names = {"late_dropout", "LateDropout", "step_objective", "drop_reversed_pairs_when_due"}
    method_names |= {"drop_reversed_pairs", "set_subword_dropout", "RDrop", "check_methods"}
    assert not names & (set(RESEARCH) | method_names)
    assert Trainer.__mro__ == (Trainer, object)  # no mixin: the checkpoints are an attribute


def test_a_default_run_has_no_hooks_and_each_option_registers_its_own():
    task = SimpleNamespace(both_directions=False)
    assert len(step_hooks(_model(), task, TrainConfig())) == 0
    assert len(METHODS) == 4

    def kinds(config, task=task):
        return [type(h) for h in step_hooks(_model(), task, config)]

    assert kinds(TrainConfig(rdrop=3.0)) == [RDropFrom]
    assert kinds(TrainConfig(dropout_start=0.2)) == [LateDropout]
    assert kinds(TrainConfig(rdrop=3.0, rdrop_start=0.3, dropout_start=0.2)) == [RDropFrom, LateDropout]
    assert kinds(TrainConfig(), SimpleNamespace(both_directions=True)) == [BothDirectionsUntil]
    with pytest.raises(ValueError, match="--both-directions"):
        step_hooks(_model(), task, TrainConfig(both_directions_until=0.5))
    with pytest.raises(ValueError, match="subword"):
        step_hooks(_model(), task, TrainConfig(subword_dropout=0.1))
    cut = []
    with_pieces = SimpleNamespace(both_directions=False, set_subword_dropout=lambda p, seed: cut.append((p, seed)))
    assert kinds(TrainConfig(subword_dropout=0.1, seed=7), with_pieces) == []  # set on the task, no hook
    assert cut == [(0.1, 7)]


@pytest.mark.parametrize(
    "options", [{}, {"rdrop": 3.0}, {"rdrop": 2.0, "rdrop_start": 0.4}, {"rdrop": 1.0, "label_smoothing": 0.0}]
)
def test_the_hooks_choose_the_objective_step_objective_chooses(options):
    """Over the budget, the run's hooks give each step the objective step_objective (the one
    function that picked it before the hooks) gives."""
    config = TrainConfig(**options)
    hooks = step_hooks(_model(), SimpleNamespace(), config)
    default = make_objective(DEFAULT_OBJECTIVE, label_smoothing=config.label_smoothing)
    for progress in (0.0, 0.1, 0.39, 0.4, 0.41, 0.9, 1.0):
        assert hooks.objective(default, progress) == step_objective(config, progress), progress


# --------------------------------------------------------------------------- hooks in a Trainer
class Recording(StepHook):
    """Notes every call, and what the loss call saw of it."""

    def __init__(self, trainer: Trainer) -> None:
        self.calls: list[tuple] = []
        self.inside = False
        loss = trainer.task.loss

        def recording_loss(module, batch, objective):
            self.calls.append(("loss", self.inside))
            return loss(module, batch, objective)

        trainer.task.loss = recording_loss

    @contextlib.contextmanager
    def _around(self, step):
        self.calls.append(("enter", step))
        self.inside = True
        try:
            yield
        finally:
            self.inside = False
            self.calls.append(("exit", step))

    def around_step(self, trainer, step):
        return self._around(step)

    def epoch_started(self, trainer):
        self.calls.append(("epoch", trainer.state.epoch))

    def resumed(self, trainer):
        self.calls.append(("resumed", trainer.state.step))


def test_a_hook_is_called_at_its_four_points(tmp_path):
    """A hook added to a Trainer's hooks wraps every step's forward and backward passes, hears of each
    new epoch before its batches are built, and of a resume once the state is restored."""
    pairs = generate_dates(24, seed=5)  # a few batches an epoch: 6 steps cross an epoch's end
    train = TrainConfig(max_tokens=200, warmup_steps=4, max_steps=6, progress=False, average_last=1)
    trainer = tiny_run(tmp_path, pairs, train)
    hook = Recording(trainer)
    trainer.hooks = StepHooks([*trainer.hooks, hook])
    trainer.train()
    steps = [c[1] for c in hook.calls if c[0] == "enter"]
    assert steps == [1, 2, 3, 4, 5, 6]
    losses = [c for c in hook.calls if c[0] == "loss"]
    assert losses and all(inside for _, inside in losses)  # every loss call ran inside the hook's context
    epochs = [c[1] for c in hook.calls if c[0] == "epoch"]
    assert epochs and epochs == list(range(1, trainer.state.epoch + 1))
    again = Trainer(Transformer(trainer.model.config), trainer.task, train, trainer.run_dir)
    resumed = Recording(again)
    again.hooks = StepHooks([resumed])
    again.resume()
    assert resumed.calls == [("resumed", 6)] and again.state.step == 6


def test_a_hook_s_objective_reaches_the_step(tmp_path):
    """A hook that hands the step R-Drop's objective takes the step a run configured with --rdrop
    takes (same weights, same dropout stream): the objective the hooks return is what the task's
    loss minimises."""

    class AlwaysRDrop(StepHook):
        def objective(self, objective, progress):
            return RDrop(alpha=2.0, label_smoothing=objective.label_smoothing)

    pairs = generate_dates(32, seed=5)
    options = dict(max_tokens=300, warmup_steps=4, max_steps=1, progress=False, average_last=1)
    configured = tiny_run(tmp_path, pairs, TrainConfig(rdrop=2.0, **options), name="a")
    hooked = tiny_run(tmp_path, pairs, TrainConfig(**options), name="b")
    hooked.hooks = StepHooks([AlwaysRDrop()])
    plain = tiny_run(tmp_path, pairs, TrainConfig(**options), name="c")
    torch.manual_seed(1)
    want = configured.step(configured._next_group())
    torch.manual_seed(1)
    got = hooked.step(hooked._next_group())
    torch.manual_seed(1)
    other = plain.step(plain._next_group())
    assert (got.loss, got.grad_norm, got.tokens) == (want.loss, want.grad_norm, want.tokens)
    assert other.loss != want.loss  # R-Drop changes the step: the comparison above could fail


def test_around_step_contexts_nest_in_order_and_all_close_on_an_error():
    order: list[str] = []

    class Named(StepHook):
        def __init__(self, name):
            self.name = name

        @contextlib.contextmanager
        def _around(self):
            order.append(f"enter {self.name}")
            try:
                yield
            finally:
                order.append(f"exit {self.name}")

        def around_step(self, trainer, step):
            return self._around()

    hooks = StepHooks([Named("a"), Named("b")])
    with pytest.raises(RuntimeError, match="in the step"), hooks.around_step(SimpleNamespace(), 1):
        order.append("step")
        raise RuntimeError("in the step")
    assert order == ["enter a", "enter b", "step", "exit b", "exit a"]


# --------------------------------------------------------------------------- the checkpoints object
def test_checkpoints_save_and_resume_on_their_own(tmp_path):
    """Checkpoints, built from what it needs alone (no Trainer), writes state.pt with the keys a
    Trainer's has and resumes weights, optimizer state and position into a fresh model."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    dist = Distributed(device=torch.device("cpu"))
    saving = Checkpoints(run_dir=tmp_path, model=model, optimizer=optimizer, dist=dist, average_last=2)
    state = TrainState(step=3, epoch=1, batch_in_epoch=2, tokens=99, kept_checkpoints=[])
    saving.keep(state)
    state.step = 4
    saving.keep(state)
    saved = checkpoint_files.load_checkpoint(tmp_path, clean=False)
    assert set(saved) == {"train_state", "optimizer", "rng", "world_size", "format", "step", "model"}
    assert set(saved["train_state"]) == {f.name for f in dataclasses.fields(TrainState)}
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_3.safetensors", "step_4.safetensors"]

    fresh = nn.Linear(3, 2)
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.1)
    loading = Checkpoints(run_dir=tmp_path, model=fresh, optimizer=fresh_optimizer, dist=dist, average_last=2)
    restored = loading.resume()
    assert dataclasses.asdict(restored) == dataclasses.asdict(state)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    exp_avg = [fresh_optimizer.state[p]["exp_avg"] for p in fresh.parameters()]
    assert all(torch.equal(a, optimizer.state[p]["exp_avg"]) for a, p in zip(exp_avg, model.parameters()))
    with pytest.raises(TypeError):
        Checkpoints(tmp_path, model, optimizer, dist)  # keyword-only
    with pytest.raises(ValueError, match="run_dir=None"):
        Checkpoints(run_dir=None, model=model, optimizer=optimizer, dist=dist).save(state)

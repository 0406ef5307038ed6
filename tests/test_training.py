"""Training: the schedule and the loss against hand computations and torch, overfitting, exact
resume (also after Ctrl-C), checkpoints and averaging, and run folders that appear whole or not at all."""

import json
import logging
import math
from dataclasses import asdict, replace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from qkv.data.dates import generate_dates
from qkv.data.parallel import ParallelText
from qkv.data.spec import DataSpec
from qkv.data.tokenizer import Tokenizer
from qkv.decoding.translate import translate_texts
from qkv.models.transformer import Transformer, TransformerConfig
from qkv.nn.loss import label_smoothed_cross_entropy
from qkv.runs import folder
from qkv.runs.recipes import load_recipe
from qkv.runs.translation import resume_run, start_run
from qkv.training import TrainConfig, Trainer, TranslationTask, checkpoint_files, inverse_sqrt_lr

TINY = dict(
    d_model=32,
    num_heads=2,
    num_encoder_layers=1,
    num_decoder_layers=1,
    d_ff=64,
    max_len=64,
    norm_first=True,
    share_embeddings=True,
)


def tiny_run(tmp_path, pairs: ParallelText, train: TrainConfig, name="run", dropout=0.1, **model):
    tokenizer = Tokenizer.train(pairs.src + pairs.tgt, vocab_size=300, split_digits=True)
    config = TransformerConfig(
        src_vocab_size=tokenizer.vocab_size,
        tgt_vocab_size=tokenizer.vocab_size,
        dropout=dropout,
        pad_id=tokenizer.pad_id,
        **{**TINY, **model},
    )
    run_dir = tmp_path / name
    folder.create_run(
        run_dir, {"model": asdict(config), "train": asdict(train), "data": {"source": "dates"}}, tokenizer
    )
    torch.manual_seed(0)
    return Trainer(Transformer(config), translation(tokenizer, pairs, config), train, run_dir)


def translation(tokenizer, pairs, config, valid=None):
    return TranslationTask(tokenizer, pairs, valid, max_len=config.max_len, pad_id=config.pad_id)


# --------------------------------------------------------------------------- schedule and loss
def test_inverse_sqrt_schedule_by_hand():
    d, warmup = 256, 800
    assert inverse_sqrt_lr(1, d, warmup) == pytest.approx(256**-0.5 * 1 * 800**-1.5)
    assert inverse_sqrt_lr(400, d, warmup) == pytest.approx(256**-0.5 * 400 * 800**-1.5)
    peak = 256**-0.5 * 800**-0.5  # both branches meet at the end of warmup: 0.00221
    assert inverse_sqrt_lr(800, d, warmup) == pytest.approx(peak) and peak == pytest.approx(0.0022097, rel=1e-4)
    assert inverse_sqrt_lr(3200, d, warmup) == pytest.approx(peak / 2)  # 1/sqrt(4x the steps)
    assert inverse_sqrt_lr(800, d, warmup, factor=0.5) == pytest.approx(peak / 2)
    values = [inverse_sqrt_lr(s, d, warmup) for s in range(1, 3000)]
    assert max(values) == pytest.approx(peak) and values.index(max(values)) == 799


@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.3])
def test_label_smoothed_loss_against_torch_and_by_hand(smoothing):
    torch.manual_seed(1)
    logits = torch.randn(3, 5, 11)
    target = torch.randint(1, 11, (3, 5))
    target[0, 3:] = 0  # padding
    target[2, 1:] = 0
    got = label_smoothed_cross_entropy(logits, target, smoothing, ignore_index=0)
    real = target != 0
    reference = F.cross_entropy(logits[real], target[real], label_smoothing=smoothing, reduction="sum")
    torch.testing.assert_close(got, reference)
    # by hand: (1 - eps) * NLL + eps * mean over the vocabulary of -log p (Szegedy et al. 2016)
    log_p = torch.log_softmax(logits.double(), dim=-1)[real]
    nll = -log_p.gather(1, target[real][:, None]).squeeze(1)
    uniform = -log_p.mean(dim=1)
    hand = ((1 - smoothing) * nll + smoothing * uniform).sum()
    assert float(got) == pytest.approx(float(hand), rel=1e-5)


def test_trainer_applies_schedule_and_adam_settings(tmp_path):
    pairs = generate_dates(64, seed=0)
    train = TrainConfig(
        max_tokens=400, warmup_steps=4, lr_factor=2.0, max_steps=6, progress=False, average_last=1, log_every_steps=1
    )
    trainer = tiny_run(tmp_path, pairs, train)
    trainer.train()
    group = trainer.optimizer.param_groups[0]
    assert group["betas"] == (0.9, 0.98) and group["eps"] == 1e-9
    logged = [json.loads(x) for x in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 5, 6]
    for r in logged:  # step s uses lr(s): warmup to step 4, then 1/sqrt(s)
        assert r["lr"] == pytest.approx(2.0 * 32**-0.5 * min(r["step"] ** -0.5, r["step"] * 4**-1.5))
    assert group["lr"] == pytest.approx(logged[-1]["lr"])


@pytest.mark.parametrize("decay", [1.0, 0.25])
def test_budget_schedule_falls_to_zero_at_the_end_of_the_budget(tmp_path, decay):
    """Step s of an 8-step budget is taken with s - 1 of 8 steps spent: the paper's rate times
    min(1, (1 - spent) / decay), computed here by hand."""
    pairs = generate_dates(64, seed=0)
    train = TrainConfig(
        max_tokens=400,
        warmup_steps=2,
        lr_factor=2.0,
        max_steps=8,
        progress=False,
        average_last=1,
        log_every_steps=1,
        schedule="budget",
        decay_fraction=decay,
    )
    trainer = tiny_run(tmp_path, pairs, train)
    trainer.train()
    logged = [json.loads(x) for x in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == list(range(1, 9))
    for r in logged:
        s = r["step"]
        paper = 2.0 * 32**-0.5 * min(s**-0.5, s * 2**-1.5)
        assert r["lr"] == pytest.approx(paper * min(1.0, (1 - (s - 1) / 8) / decay))
    assert logged[-1]["lr"] < logged[0]["lr"]  # ends low: 1/8 of the paper's rate (decay 1) or 1/2 (decay 0.25)


def test_budget_progress_is_the_largest_share_spent():
    from qkv.training.schedule import budget_progress, learning_rate

    config = TrainConfig(max_minutes=10, max_steps=1000, max_epochs=4, schedule="budget", decay_fraction=0.5)
    assert budget_progress(config, step=100, seconds=300, epochs=1) == pytest.approx(0.5)  # minutes lead
    assert budget_progress(config, step=900, seconds=60, epochs=1) == pytest.approx(0.9)  # steps lead
    assert budget_progress(config, step=0, seconds=0, epochs=5) == 1.0  # capped
    assert learning_rate(config, 2000, 64, 0.75) == pytest.approx(inverse_sqrt_lr(2000, 64, 800) * 0.5)
    assert learning_rate(config, 2000, 64, 0.4) == pytest.approx(inverse_sqrt_lr(2000, 64, 800))
    with pytest.raises(ValueError, match="schedule"):
        TrainConfig(schedule="linear")


# --------------------------------------------------------------------------- learning
def test_tiny_model_overfits_64_pairs(tmp_path):
    pairs = generate_dates(64, seed=5)
    # 600 steps: at 400, a 2-core AVX512 Xeon's float32 kernels still got 1 of the 64 dates wrong
    # (an AVX2 EPYC none); 500 and 600 got all 64 on both
    train = TrainConfig(
        max_tokens=2000,
        warmup_steps=30,
        lr_factor=1.0,
        max_steps=600,
        label_smoothing=0.0,
        progress=False,
        average_last=1,
        log_every_steps=50,
    )
    trainer = tiny_run(tmp_path, pairs, train, dropout=0.0, d_model=64, d_ff=128)
    trainer.train()
    assert trainer.state.epoch >= 300  # one batch an epoch
    outputs = translate_texts(trainer.model, trainer.task.tokenizer, pairs.src)
    assert outputs == pairs.tgt
    losses = [json.loads(x)["loss"] for x in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert losses[-1] < 0.05 < losses[0]


# --------------------------------------------------------------------------- resume
RESUME = dict(
    max_tokens=300, accum_steps=2, warmup_steps=5, max_steps=12, progress=False, average_last=1, log_every_steps=100
)


def params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0, msg=k)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    pairs = generate_dates(200, seed=1)
    trainer = tiny_run(tmp_path_factory.mktemp("full"), pairs, TrainConfig(**RESUME))
    assert (
        len(trainer.task.batches(0, RESUME["max_tokens"], 0)) > 3
    )  # several batches an epoch, so the epoch position matters
    trainer.train()
    return pairs, params(trainer.model), trainer.state


def test_stop_and_resume_equals_uninterrupted(tmp_path, uninterrupted):
    pairs, expected, state = uninterrupted
    first = tiny_run(tmp_path, pairs, TrainConfig(**{**RESUME, "max_steps": 5}))
    first.train()
    torch.manual_seed(123)  # a fresh process would not share the RNG: resume must restore it
    second = Trainer(
        Transformer(first.model.config),
        translation(first.task.tokenizer, pairs, first.model.config),
        TrainConfig(**RESUME),
        first.run_dir,
    )
    second.resume()
    assert second.state.step == 5
    second.train()
    assert second.state.step == 12 and second.state.tokens == state.tokens
    assert (second.state.epoch, second.state.batch_in_epoch) == (state.epoch, state.batch_in_epoch)
    assert_same_weights(params(second.model), expected)


def stopped_and_resumed(tmp_path, pairs, options: dict, *, stop_at: int = 5, name: str = "first") -> Trainer:
    """A run trained ``stop_at`` steps, then resumed in a new Trainer (a fresh RNG, as a new process
    would have) that trains to the end of ``options``' budget."""
    first = tiny_run(tmp_path, pairs, TrainConfig(**{**options, "max_steps": stop_at}), name=name)
    first.train()
    torch.manual_seed(123)
    second = Trainer(
        Transformer(first.model.config),
        translation(first.task.tokenizer, pairs, first.model.config),
        TrainConfig(**options),
        first.run_dir,
    )
    second.resume()
    second.train()
    return second


def test_a_run_with_subword_dropout_resumes_exactly_and_trains_on_split_tokens(tmp_path, uninterrupted):
    pairs, plain, _ = uninterrupted
    options = {**RESUME, "subword_dropout": 0.3}
    whole = tiny_run(tmp_path, pairs, TrainConfig(**options), name="whole")
    whole.train()
    second = stopped_and_resumed(tmp_path, pairs, options)
    assert second.state.step == 12 and second.state.tokens == whole.state.tokens
    assert_same_weights(params(second.model), params(whole.model))
    # the dates' targets are digits (no merges); their sources split, so the run trained differently
    assert any(not torch.allclose(a, b) for a, b in zip(params(whole.model).values(), plain.values()))


def test_a_run_saved_before_best_score_was_renamed_resumes_with_its_score(tmp_path, uninterrupted):
    pairs, _, _ = uninterrupted
    first = tiny_run(tmp_path, pairs, TrainConfig(**{**RESUME, "max_steps": 3}))
    first.train()
    state_file = first.run_dir / "state.pt"
    saved = torch.load(state_file, weights_only=True)
    saved["train_state"]["best_bleu"] = 12.5  # the field's name in runs saved before
    del saved["train_state"]["best_score"]
    torch.save(saved, state_file)
    second = Trainer(
        Transformer(first.model.config),
        translation(first.task.tokenizer, pairs, first.model.config),
        TrainConfig(**RESUME),
        first.run_dir,
    )
    second.resume()
    assert (second.state.step, second.state.best_score) == (3, 12.5)


# --------------------------------------------------------------------------- moving average of the weights
def test_the_moving_average_of_the_weights_against_the_formula(tmp_path):
    """ema_1 = w_1, ema_k = d * ema_(k-1) + (1 - d) * w_k over the weights after each step, in float64."""
    pairs, decay = generate_dates(200, seed=1), 0.9
    trainer = tiny_run(tmp_path, pairs, TrainConfig(**{**RESUME, "ema_decay": decay}))
    expected = None
    for _ in range(6):
        trainer.step(trainer._next_group())
        weights = {n: p.detach().double() for n, p in trainer.model.named_parameters()}
        if expected is not None:
            weights = {n: decay * expected[n] + (1 - decay) * w for n, w in weights.items()}
        expected = weights
    averaged = dict(trainer.ema.module.named_parameters())
    assert averaged.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(averaged[name].double(), value, rtol=0, atol=1e-6, msg=name)
    assert any(not torch.equal(averaged[n], p) for n, p in trainer.model.named_parameters())


def test_a_resumed_run_keeps_its_moving_average_and_writes_it(tmp_path):
    pairs = generate_dates(200, seed=1)
    options = {**RESUME, "ema_decay": 0.8, "final_weights": "ema"}
    full = tiny_run(tmp_path, pairs, TrainConfig(**options), name="full")
    full.train()
    full.finish()
    second = stopped_and_resumed(tmp_path, pairs, options, name="split")
    second.finish()
    expected = params(full.ema.module)
    assert all(torch.equal(params(second.ema.module)[k], v) for k, v in expected.items())
    for name in ("ema.safetensors", "model.safetensors"):  # final_weights ema: the run's model is the average
        written = checkpoint_files.read_weights(second.run_dir / name)  # (tied weights are stored once)
        assert written and all(torch.equal(v, expected[k]) for k, v in written.items()), name
    model, _, _ = folder.load_run(second.run_dir, "ema")
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())
    assert not all(torch.equal(v, expected[k]) for k, v in params(second.model).items())


def test_ema_decay_given_on_resume_starts_the_average_there(tmp_path):
    pairs = generate_dates(200, seed=1)
    first = tiny_run(tmp_path, pairs, TrainConfig(**{**RESUME, "max_steps": 5}))
    first.train()
    second = Trainer(
        Transformer(first.model.config),
        translation(first.task.tokenizer, pairs, first.model.config),
        TrainConfig(**{**RESUME, "max_steps": 6, "ema_decay": 0.9}),
        first.run_dir,
    )
    second.resume()
    second.train()  # one step: the average is that step's weights
    assert all(torch.equal(v, params(second.model)[k]) for k, v in params(second.ema.module).items())


def test_rdrop_starts_when_its_share_of_the_budget_is_spent(tmp_path, monkeypatch):
    """--rdrop-start 0.5 of 4 steps: steps 1-2 run each batch once, steps 3-4 twice (R-Drop); the
    step's loss is the model's R-Drop loss of its batch then."""
    pairs = generate_dates(64, seed=5)
    train = TrainConfig(
        max_tokens=400, warmup_steps=4, max_steps=4, progress=False, average_last=1, rdrop=2.0, rdrop_start=0.5
    )
    trainer = tiny_run(tmp_path, pairs, train, dropout=0.1)
    seen, loss = [], TranslationTask.loss

    def recording(module, batch, objective):
        seen.append(getattr(objective, "alpha", 0.0))
        return loss(module, batch, objective)

    monkeypatch.setattr(trainer.task, "loss", recording)
    trainer.train()
    assert seen == [0.0, 0.0, 2.0, 2.0]
    with pytest.raises(ValueError, match="--rdrop"):
        TrainConfig(rdrop_start=0.5)
    with pytest.raises(ValueError, match="rdrop"):
        TrainConfig(rdrop=-1.0)


def test_dropout_starts_when_its_share_of_the_budget_is_spent(tmp_path, monkeypatch):
    """--dropout-start 0.5 of 4 steps: steps 1-2 train with every dropout at 0, so their training loss
    equals the same model's loss in eval mode (the dropout-free reference); steps 3-4 drop again
    (residual and attention dropout), and the model's rates are the configured ones afterwards."""
    pairs = generate_dates(64, seed=5)
    train = TrainConfig(max_tokens=400, warmup_steps=4, max_steps=4, progress=False, average_last=1, dropout_start=0.5)
    trainer = tiny_run(tmp_path, pairs, train, dropout=0.3, attention_dropout=0.2)

    def rates() -> list[float]:
        """The model's distinct dropout rates now (Dropout modules' p, attention's float dropout)."""
        return sorted(
            {
                round(float(getattr(m, "p", getattr(m, "dropout", 0.0))), 3)
                for m in trainer.model.modules()
                if hasattr(m, "p") or isinstance(getattr(m, "dropout", None), float)
            }
        )

    assert rates() == [0.2, 0.3]
    seen, loss = [], TranslationTask.loss

    def recording(module, batch, objective):
        got = loss(module, batch, objective)
        module.eval()
        with torch.no_grad():
            reference = loss(module, batch, objective)
        module.train()
        seen.append((rates(), math.isclose(float(got.detach()), float(reference), rel_tol=1e-5)))
        return got

    monkeypatch.setattr(trainer.task, "loss", recording)
    trainer.train()
    assert seen == [([0.0], True), ([0.0], True), ([0.2, 0.3], False), ([0.2, 0.3], False)]
    assert rates() == [0.2, 0.3]
    with pytest.raises(ValueError, match="--dropout-start"):
        TrainConfig(rdrop=3.0, rdrop_start=0.2, dropout_start=0.5)
    with pytest.raises(ValueError, match="dropout_start"):
        TrainConfig(dropout_start=1.0)


def test_final_weights_ema_needs_a_decay():
    with pytest.raises(ValueError, match="--ema-decay"):
        TrainConfig(final_weights="ema")
    with pytest.raises(ValueError, match="ema_decay"):
        TrainConfig(ema_decay=1.0)


def test_ctrl_c_mid_step_saves_and_resumes_exactly(tmp_path, uninterrupted, monkeypatch):
    pairs, expected, _ = uninterrupted
    first = tiny_run(tmp_path, pairs, TrainConfig(**RESUME))
    calls = {"n": 0}
    original = first.model.loss

    def loss_then_interrupt(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 14:  # the second batch of step 7 (accum_steps=2): a step half done
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(first.model, "loss", loss_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        first.train()
    saved = json.loads(json.dumps(torch.load(first.run_dir / "state.pt", weights_only=True)["train_state"]))
    assert saved["step"] == 6  # the half-done step is dropped
    second = Trainer(
        Transformer(first.model.config),
        translation(first.task.tokenizer, pairs, first.model.config),
        TrainConfig(**RESUME),
        first.run_dir,
    )
    second.resume()
    second.train()
    assert_same_weights(params(second.model), expected)


# --------------------------------------------------------------------------- checkpoints
def test_checkpoint_averaging_and_best(tmp_path):
    pairs = generate_dates(100, seed=2)
    valid = generate_dates(20, seed=3, split="test")
    train = TrainConfig(
        max_tokens=400,
        warmup_steps=5,
        max_steps=8,
        checkpoint_every_steps=2,
        average_last=3,
        eval_every_steps=4,
        eval_sentences=20,
        progress=False,
    )
    trainer = tiny_run(tmp_path, pairs, train)
    trainer.task.valid = valid
    trainer.train()
    model_path = trainer.finish()
    kept = sorted(p.name for p in (trainer.run_dir / "checkpoints").iterdir())
    assert kept == ["step_4.safetensors", "step_6.safetensors", "step_8.safetensors"]
    files = [load_file(trainer.run_dir / "checkpoints" / k) for k in kept]
    averaged = load_file(model_path)
    for name, tensor in averaged.items():
        torch.testing.assert_close(tensor, sum(f[name] for f in files) / 3)
    model, tokenizer, config = folder.load_run(trainer.run_dir)  # loads (tied weights stored once)
    assert config["model"]["d_model"] == 32 and not model.training
    state = model.state_dict()
    for name, tensor in averaged.items():
        torch.testing.assert_close(state[name], tensor)
    assert model.output_proj.weight is model.tgt_embed.embedding.weight  # still tied after loading
    assert (trainer.run_dir / "best.safetensors").is_file()
    events = [json.loads(x) for x in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    valid_events = [e for e in events if e["event"] == "valid"]
    assert [e["step"] for e in valid_events] == [4, 8]
    assert all(0 <= e["val_exact_match"] <= 1 and math.isfinite(e["val_loss"]) for e in valid_events)
    assert not list(trainer.run_dir.rglob("*.tmp"))  # atomic writes leave no temporaries


def test_stop_at_exact_match(tmp_path):
    pairs = generate_dates(64, seed=5)
    train = TrainConfig(
        max_tokens=2000,
        warmup_steps=1,
        lr_factor=1e-12,
        max_steps=5,
        eval_every_steps=1,
        eval_sentences=8,
        stop_at_exact_match=0.99,
        progress=False,
        average_last=1,
    )
    trainer = tiny_run(tmp_path, pairs, train, dropout=0.0)
    # references = the model's own translations, and a learning rate too small to change them
    trainer.task.valid = ParallelText(
        pairs.src[:8], translate_texts(trainer.model, trainer.task.tokenizer, pairs.src[:8])
    )
    trainer.train()
    assert trainer.state.stopped_early and trainer.state.step == 1
    trainer.task.valid = ParallelText(pairs.src[:8], ["never produced"] * 8)
    trainer.state.stopped_early = False
    trainer.train()
    assert trainer.state.step == 5 and not trainer.state.stopped_early


def test_bf16_autocast_training(tmp_path):
    from qkv.runtime.precision import autocast_context

    pairs = generate_dates(64, seed=5)
    train = TrainConfig(
        max_tokens=2000, warmup_steps=10, max_steps=20, bf16=True, progress=False, average_last=1, log_every_steps=1
    )
    trainer = tiny_run(tmp_path, pairs, train, dropout=0.0)
    batch_src = torch.tensor([trainer.task.src_ids[0] + [2]])
    with autocast_context("cpu", True):
        assert trainer.model(batch_src, torch.tensor([[1]])).dtype == torch.bfloat16
    trainer.train()
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in trainer.model.parameters())
    losses = [json.loads(x)["loss"] for x in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 20 and losses[-1] < 0.7 * losses[0]


def test_compiled_training_follows_the_eager_run(tmp_path, monkeypatch):
    """``TrainConfig(compile=True)`` trains through ``torch.compile(model.loss)``: without dropout
    the same losses and weights as the eager run from the same start (aot_eager backend here, which
    traces forward and backward like inductor; inductor's code generation is a slow test elsewhere),
    compiled once for batches of every shape."""
    compiled_fns, torch_compile = [], torch.compile

    def compile_with_aot_eager(fn, **kwargs):
        compiled_fns.append(fn)
        return torch_compile(fn, backend="aot_eager", **kwargs)

    pairs = generate_dates(64, seed=5)
    runs = {}
    for compile_loss in (False, True):
        torch._dynamo.reset()
        train = TrainConfig(
            max_tokens=600,
            warmup_steps=4,
            max_steps=6,
            compile=compile_loss,
            progress=False,
            average_last=1,
            log_every_steps=1,
        )
        # batches of varied shapes, some above padded_linear.ROW_MULTIPLE rows: one graph serves them all
        with monkeypatch.context() as patch, torch._dynamo.config.patch(error_on_recompile=True):
            patch.setattr(torch, "compile", compile_with_aot_eager)
            trainer = tiny_run(tmp_path, pairs, train, name=f"compile-{compile_loss}", dropout=0.0)
            trainer.train()
        losses = [json.loads(x)["loss"] for x in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
        runs[compile_loss] = (losses, trainer.model.state_dict())
    assert len(compiled_fns) == 1  # only the compile=True run compiled
    assert len(runs[True][0]) == 6
    assert runs[True][0] == pytest.approx(runs[False][0], rel=1e-4)
    for name, weight in runs[False][1].items():
        if name.endswith("k_proj.bias"):  # its gradient is 0 in exact arithmetic (softmax ignores a
            continue  # per-query shift); Adam's update of the rounding noise is +-lr, in either run
        torch.testing.assert_close(
            runs[True][1][name], weight, atol=1e-4, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}"
        )


# --------------------------------------------------------------------------- run folders
@pytest.mark.parametrize(
    "bad, expected",
    [
        ("misaligned", "misaligned parallel files"),
        ("empty", "file is empty"),
        ("latin1", "line 2: not valid UTF-8"),
        ("blank", "line 3: empty line"),
    ],
)
def test_bad_data_leaves_no_run_folder(tmp_path, bad, expected):
    src = tmp_path / "train.src"
    tgt = tmp_path / "train.tgt"
    src.write_text("a\nb\nc\n", encoding="utf-8")
    tgt.write_text("A\nB\nC\n", encoding="utf-8")
    if bad == "misaligned":
        tgt.write_text("A\nB\n", encoding="utf-8")
    elif bad == "empty":
        tgt.write_bytes(b"")
    elif bad == "latin1":
        tgt.write_bytes("A\nGrüße\nC\n".encode("latin-1"))
    else:
        tgt.write_text("A\nB\n \n", encoding="utf-8")
    spec = DataSpec(source="files", train_src=str(src), train_tgt=str(tgt), val_src=None, val_tgt=None)
    with pytest.raises(ValueError, match=expected):
        start_run(tmp_path / "run", data=spec, model_options=TINY)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.src", "train.tgt"]


def test_start_and_resume_run_from_files(tmp_path):
    pairs = generate_dates(120, seed=7)
    (tmp_path / "s.txt").write_text("\n".join(pairs.src) + "\n", encoding="utf-8")
    (tmp_path / "t.txt").write_text("\n".join(pairs.tgt) + "\n", encoding="utf-8")
    spec = DataSpec(
        source="files",
        train_src=str(tmp_path / "s.txt"),
        train_tgt=str(tmp_path / "t.txt"),
        val_src=None,
        val_tgt=None,
    )
    trainer = start_run(
        tmp_path / "run",
        data=spec,
        model_options=TINY,
        vocab_size=300,
        train_options=dict(max_steps=3, max_minutes=0, max_tokens=500, progress=False, bf16=False),
    )
    trainer.train()
    with pytest.raises(ValueError, match="run folder exists"):
        start_run(tmp_path / "run", data=spec, model_options=TINY)
    again = resume_run(tmp_path / "run", train_options={"max_steps": 5})
    assert again.state.step == 3
    again.train()
    assert again.state.step == 5
    assert json.loads((tmp_path / "run" / "config.json").read_text())["train"]["max_steps"] == 5
    with pytest.raises(FileNotFoundError, match="config.json"):
        resume_run(tmp_path)


@pytest.mark.parametrize("fast", [True, False])
def test_recipe_bf16_only_where_it_is_fast(tmp_path, monkeypatch, caplog, fast):
    import qkv.runtime.precision

    monkeypatch.setattr(qkv.runtime.precision, "bf16_is_fast", lambda device: fast)
    caplog.set_level(logging.INFO, logger="qkv")
    pairs = generate_dates(60, seed=3)
    (tmp_path / "s.txt").write_text("\n".join(pairs.src) + "\n", encoding="utf-8")
    (tmp_path / "t.txt").write_text("\n".join(pairs.tgt) + "\n", encoding="utf-8")
    spec = DataSpec(
        source="files",
        train_src=str(tmp_path / "s.txt"),
        train_tgt=str(tmp_path / "t.txt"),
        val_src=None,
        val_tgt=None,
    )
    options = dict(max_steps=1, progress=False)
    recipe = start_run(tmp_path / "recipe", data=spec, model_options=TINY, vocab_size=300, train_options=options)
    assert recipe.config.bf16 is fast  # the files recipe asks for bf16; kept only where it pays
    saved = json.loads((tmp_path / "recipe" / "config.json").read_text())["train"]["bf16"]
    assert saved is fast
    asked = start_run(
        tmp_path / "asked", data=spec, model_options=TINY, vocab_size=300, train_options={**options, "bf16": True}
    )
    assert asked.config.bf16 is True  # an explicit request is honoured (with a warning when slow)
    # the same recipe on every machine: where bf16 is fast, the variant tuned for it is suggested, never taken
    files, variant = load_recipe("multi30k"), load_recipe("multi30k-bf16")
    assert (files.model["dropout"], files.train["lr_factor"]) != (variant.model["dropout"], variant.train["lr_factor"])
    for run in ("recipe", "asked"):
        config = json.loads((tmp_path / run / "config.json").read_text())
        assert (config["model"]["dropout"], config["train"]["lr_factor"]) == (0.1, 0.7)  # multi30k's
        assert config["recipe"]["name"] == "multi30k"
    assert recipe.config.lr_factor == files.train["lr_factor"]
    suggested = [r.getMessage() for r in caplog.records if "--recipe multi30k-bf16" in r.getMessage()]
    assert len(suggested) == (2 if fast else 0)  # each run of the data's recipe in fast bf16 (recipe, asked)
    if fast:
        assert suggested[0].startswith("bf16 is fast here") and "this run keeps multi30k" in suggested[0]
    caplog.clear()
    named = start_run(
        tmp_path / "named", data=spec, model_options=TINY, vocab_size=300, train_options=options, recipe="multi30k-bf16"
    )
    assert (named.model.config.dropout, named.model.config.activation, named.config.lr_factor) == (0.2, "relu", 0.5)
    assert named.config.bf16 is fast  # on every machine the variant's values; bf16 only where it pays
    assert not [r for r in caplog.records if "bf16 is fast here" in r.getMessage()]  # named: nothing to suggest
    plain = start_run(
        tmp_path / "fp32", data=spec, model_options=TINY, vocab_size=300, train_options={**options, "bf16": False}
    )
    assert plain.model.config.dropout == files.model["dropout"]
    assert plain.config.lr_factor == files.train["lr_factor"]
    given = start_run(
        tmp_path / "given",
        data=spec,
        model_options={**TINY, "dropout": 0.05},
        vocab_size=300,
        train_options={**options, "lr_factor": 0.3},
        recipe="multi30k-bf16",
    )
    assert (given.model.config.dropout, given.config.lr_factor) == (0.05, 0.3)  # explicit options win


def test_bf16_probe_reports_its_figures():
    from qkv.runtime.precision import bf16_is_fast, cpu_bf16_probe, slow_bf16_reason

    fp32, bf16 = cpu_bf16_probe()
    assert fp32 > 0 and bf16 > 0 and cpu_bf16_probe() == (fp32, bf16)  # probed once per process
    reason = slow_bf16_reason("cpu")
    assert (reason is None) == bf16_is_fast("cpu")
    if reason is not None:
        assert f"{bf16 / fp32:.0f}x the float32 time" in reason


def test_first_step_after_the_step0_checkpoint_equals_a_hand_written_adam_step(tmp_path):
    """The step-0 checkpoint (written when a run is created) must not touch the optimizer: asking
    torch for an optimizer state dict before the first step steps Adam with zero gradients, and
    its first real step is then bias-corrected as a second one. Reference: one step by hand."""
    import copy

    pairs = generate_dates(64, seed=5)
    train = TrainConfig(
        max_tokens=400, warmup_steps=4, max_steps=1, progress=False, average_last=1, label_smoothing=0.1
    )
    trainer = tiny_run(tmp_path, pairs, train, dropout=0.0)
    reference = copy.deepcopy(trainer.model)
    trainer.save()  # what start_run does when it creates the run folder
    batch = trainer.task.make_batch(trainer.task.batches(0, train.max_tokens, train.seed)[0])
    trainer.step([batch])

    optimizer = torch.optim.Adam(reference.parameters(), lr=inverse_sqrt_lr(1, 32, 4), betas=(0.9, 0.98), eps=1e-9)
    loss = reference.loss(batch.src, batch.tgt_in, batch.tgt_out, label_smoothing=0.1)
    (loss / batch.num_tgt_tokens).backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    optimizer.step()
    assert_same_weights(params(trainer.model), params(reference))


def test_the_loop_returns_freed_heap_memory_and_logs_resident_memory(tmp_path, monkeypatch):
    import qkv.runtime.heap

    calls = []
    monkeypatch.setattr(qkv.runtime.heap, "trim_heap", lambda: calls.append(1) or True)
    pairs = generate_dates(64, seed=5)
    train = TrainConfig(
        max_tokens=400, warmup_steps=4, max_steps=100, progress=False, average_last=1, log_every_steps=50
    )
    tiny_run(tmp_path, pairs, train).train()
    assert len(calls) == 2  # after steps 50 and 100
    logged = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["rss_mb"] > 10 for r in logged)


def test_options_with_choices_are_choices_on_the_command_line():
    """``--strategy`` and ``--schedule`` take their names (not numbers) and refuse others."""
    from qkv.cli import build_parser

    parser = build_parser("train")
    args = parser.parse_args(
        ["train", "--run-dir", "r", "--strategy", "fsdp", "--schedule", "budget", "--decay-fraction", "0.3"]
    )
    assert (args.strategy, args.schedule, args.decay_fraction) == ("fsdp", "budget", 0.3)
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--run-dir", "r", "--schedule", "linear"])


def _fake_clock(monkeypatch, module, timings: list[float]) -> None:
    """perf_counter for ``module``: each pair of calls brackets the next of ``timings`` (seconds)."""
    ticks = iter([t for k, d in enumerate(timings) for t in (float(k), k + d)])
    monkeypatch.setattr(module.time, "perf_counter", lambda: next(ticks))


def test_bf16_probe_outlasts_one_hiccup(monkeypatch):
    """Where bf16 is fast the probe's products take ~0.1 ms: one slow timing (a scheduler hiccup, 10x
    longer) must not turn bf16 off; the best of several decides. Emulated bf16 (30 ms a product)
    stops the repeats at the 50 ms budget."""
    import qkv.runtime.precision as precision

    probe = precision.cpu_bf16_probe.__wrapped__  # not the per-process cache
    _fake_clock(monkeypatch, precision, [1e-4] * 5 + [1e-3] + [5e-5] * 4)  # float32 x5, then bf16 x5
    assert probe(32) == pytest.approx((1e-4, 5e-5))
    _fake_clock(monkeypatch, precision, [1e-4] * 5 + [0.03, 0.03])  # a third bf16 timing would exhaust the clock
    assert probe(32) == pytest.approx((1e-4, 0.03))


def test_keep_first_trains_on_the_first_pairs_held_only():
    src = [f"w{i} " * (30 if i == 1 else 2) for i in range(10)]  # pair 1 is too long for max_len 16: not held
    pairs = ParallelText(src=src, tgt=[f"v{i}" for i in range(10)])
    tokenizer = Tokenizer.train(pairs.src + pairs.tgt, vocab_size=300, split_digits=True)
    task = TranslationTask(tokenizer, pairs, None, max_len=16, pad_id=tokenizer.pad_id)
    task.keep_first(4)
    assert task.num_examples == 4
    plan = task.batches(0, max_tokens=64, seed=0)
    assert sorted(i for batch in plan for i in batch) == [0, 1, 2, 3]
    assert task.pairs.read([0, 1, 2, 3])[0] == [tokenizer.encode(src[i]) for i in (0, 2, 3, 4)]


def test_ctrl_c_inside_signals_held_raises_keyboard_interrupt_after_the_block():
    import os
    import signal

    from qkv.training.engine import signals_held

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own (a background job ignores it)
    finished = False
    try:
        with pytest.raises(KeyboardInterrupt), signals_held():
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(100000):
                pass
            finished = True
        assert finished and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


def test_signals_held_delays_sigterm_until_the_update_is_done():
    """A SIGTERM sent while the weights are being updated is handled right after, not in the middle,
    also when the process has other threads (torch, tokenizers and tqdm start some) that would take a
    signal the main thread blocks: the C-level handler then still trips Python's main thread."""
    import os
    import signal
    import threading
    import time

    from qkv.training.engine import signals_held

    seen = []
    stop = threading.Event()
    other = threading.Thread(target=stop.wait, daemon=True)  # a thread that does not block SIGTERM
    other.start()
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        for _ in range(3):
            with signals_held():
                os.kill(os.getpid(), signal.SIGTERM)
                for _ in range(20):  # time for the other thread to take it, and bytecodes to run a handler at
                    time.sleep(0.01)
                assert seen == []
            for _ in range(1000):
                pass
            assert seen == [signal.SIGTERM]
            seen.clear()
        assert signal.getsignal(signal.SIGTERM) is not None and signal.getsignal(signal.SIGINT) is not None
    finally:
        signal.signal(signal.SIGTERM, previous)
        stop.set()


def test_both_directions_trains_on_the_pairs_then_the_same_pairs_reversed(tmp_path):
    """``"both_directions"``: the run's training pairs are the given ones followed by the reversed ones,
    tokenised by the tokenizer a one-way run makes (it saw each sentence once either way), and a resume
    reads the same doubled pairs; validation stays one way; a prepared folder is refused."""
    from qkv.data.sources import check_spec

    pairs = generate_dates(60, seed=4)
    (tmp_path / "s.txt").write_text("\n".join(pairs.src) + "\n", encoding="utf-8")
    (tmp_path / "t.txt").write_text("\n".join(pairs.tgt) + "\n", encoding="utf-8")
    spec = DataSpec(
        source="files",
        train_src=str(tmp_path / "s.txt"),
        train_tgt=str(tmp_path / "t.txt"),
        val_src=str(tmp_path / "s.txt"),
        val_tgt=str(tmp_path / "t.txt"),
    )
    options = dict(
        model_options=TINY, vocab_size=300, train_options=dict(max_steps=1, progress=False, bf16=False), device="cpu"
    )
    one_way = start_run(tmp_path / "one", data=spec, **options)
    both = start_run(tmp_path / "both", data=replace(spec, both_directions=True), **options)
    tokenizer = Tokenizer.load(tmp_path / "both" / "tokenizer.json")
    assert (tmp_path / "both" / "tokenizer.json").read_text() == (tmp_path / "one" / "tokenizer.json").read_text()
    want_src = [tokenizer.encode(s) for s in pairs.src + pairs.tgt]
    want_tgt = [tokenizer.encode(t) for t in pairs.tgt + pairs.src]
    for trainer in (both, resume_run(tmp_path / "both", device="cpu")):
        assert trainer.task.num_examples == 120 == 2 * one_way.task.num_examples
        src, tgt = trainer.task.pairs.read(list(range(120)))
        assert [list(x) for x in src] == want_src and [list(x) for x in tgt] == want_tgt
        assert trainer.task.valid.src == pairs.src and trainer.task.valid.tgt == pairs.tgt
    with pytest.raises(ValueError, match="prepared folder"):
        check_spec(DataSpec(source="prepared", folder=str(tmp_path), both_directions=True))


def test_both_directions_until_drops_the_reversed_pairs_and_a_resume_keeps_them_dropped(tmp_path, monkeypatch):
    """--both-directions-until 0.5 of 12 steps: the epochs that start before step 6 train on both
    halves, the first one that starts at or after it, and every later one, on the given pairs alone
    (the first half); a run stopped after the switch and resumed ends with the uninterrupted run's
    weights."""
    pairs = generate_dates(24, seed=9)
    (tmp_path / "s.txt").write_text("\n".join(pairs.src) + "\n", encoding="utf-8")
    (tmp_path / "t.txt").write_text("\n".join(pairs.tgt) + "\n", encoding="utf-8")
    spec = DataSpec(
        source="files",
        train_src=str(tmp_path / "s.txt"),
        train_tgt=str(tmp_path / "t.txt"),
        val_src=None,
        val_tgt=None,
        both_directions=True,
    )
    train = dict(
        max_steps=12,
        max_tokens=150,
        warmup_steps=4,
        progress=False,
        bf16=False,
        average_last=1,
        log_every_steps=100,
        both_directions_until=0.5,
    )
    options = dict(data=spec, model_options=TINY, vocab_size=300, train_options=train, device="cpu")
    torch.manual_seed(0)  # the same initial weights for both runs
    full = start_run(tmp_path / "full", **options)
    assert full.task.num_examples == 48
    seen, make_batch = [], full.task.make_batch

    def recording(indices, epoch=0):
        seen.append((full.state.step, epoch, list(indices)))
        return make_batch(indices, epoch)

    monkeypatch.setattr(full.task, "make_batch", recording)
    full.train()
    switch = full.state.one_way_from_epoch
    first_step = {epoch: min(step for step, e, _ in seen if e == epoch) for _, epoch, _ in seen}
    assert first_step[switch] >= 6 and first_step[switch - 1] < 6  # the first epoch to start past half the budget
    assert max(i for _, e, ix in seen if e < switch for i in ix) >= 24  # reversed pairs before
    after = [i for _, e, ix in seen if e >= switch for i in ix]
    assert sorted(set(after)) == list(range(24))  # each given pair, no reversed one
    full.task.kept = None
    full.task.keep_first(3)  # smoke tests' first pairs: each way
    assert full.task.kept.tolist() == [0, 1, 2, 24, 25, 26]
    full.task.drop_reversed_pairs()
    assert full.task.kept.tolist() == [0, 1, 2]

    torch.manual_seed(0)
    cut = start_run(tmp_path / "cut", **options)
    calls, loss = {"n": 0}, cut.model.loss

    def loss_then_interrupt(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 11:  # step 11: after the switch
            raise KeyboardInterrupt
        return loss(*args, **kwargs)

    monkeypatch.setattr(cut.model, "loss", loss_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        cut.train()
    resumed = resume_run(tmp_path / "cut", device="cpu")
    assert resumed.state.step == 10 and resumed.state.one_way_from_epoch == switch
    assert resumed.task.num_examples == 24  # dropped again on resume
    resumed.train()
    assert_same_weights(params(resumed.model), params(full.model))
    with pytest.raises(ValueError, match="--both-directions"):
        tiny_run(tmp_path, pairs, TrainConfig(max_steps=2, both_directions_until=0.5), name="one_way")


def test_weight_decay_steps_equal_hand_written_adamw_on_matrices_only(tmp_path):
    """--weight-decay 0.1, two steps: each parameter moves as decoupled weight decay (Loshchilov &
    Hutter 2019: p <- p - lr * wd * p, matrices and embeddings only) followed by Adam's bias-corrected
    step, written out here by hand from the same gradients."""
    import copy

    pairs = generate_dates(64, seed=5)
    wd, b1, b2, eps = 0.1, 0.9, 0.98, 1e-9
    train = TrainConfig(
        max_tokens=400,
        warmup_steps=4,
        max_steps=2,
        progress=False,
        average_last=1,
        label_smoothing=0.1,
        weight_decay=wd,
    )
    trainer = tiny_run(tmp_path, pairs, train, dropout=0.0)
    reference = copy.deepcopy(trainer.model)
    batches = [trainer.task.make_batch(b) for b in trainer.task.batches(0, train.max_tokens, train.seed)[:2]]
    m = {n: torch.zeros_like(p) for n, p in reference.named_parameters()}
    v = {n: torch.zeros_like(p) for n, p in reference.named_parameters()}
    for t, batch in enumerate(batches, start=1):
        trainer.step([batch])
        reference.zero_grad()
        loss = reference.loss(batch.src, batch.tgt_in, batch.tgt_out, label_smoothing=0.1)
        (loss / batch.num_tgt_tokens).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        lr = inverse_sqrt_lr(t, 32, 4)
        with torch.no_grad():
            for n, p in reference.named_parameters():
                g = p.grad
                m[n] = b1 * m[n] + (1 - b1) * g
                v[n] = b2 * v[n] + (1 - b2) * g * g
                if p.ndim >= 2:  # weights and embeddings decay; biases and layer-norm gains do not
                    p.mul_(1 - lr * wd)
                p -= lr * (m[n] / (1 - b1**t)) / ((v[n] / (1 - b2**t)).sqrt() + eps)
    # a key bias shifts every score of a query alike, which softmax ignores: its gradient is zero but for
    # rounding, which Adam's normalisation blows up to +-lr whatever its size; those are left out
    ours, theirs = (
        {k: w for k, w in params(model).items() if not k.endswith("k_proj.bias")}
        for model in (trainer.model, reference)
    )
    assert_same_weights(ours, theirs)
    # and the decay mattered: the same two steps without it end elsewhere
    plain = tiny_run(tmp_path, pairs, TrainConfig(**{**asdict(train), "weight_decay": 0.0}), name="plain", dropout=0.0)
    for batch in batches:
        plain.step([batch])
    assert isinstance(plain.optimizer, torch.optim.Adam) and len(plain.optimizer.param_groups) == 1
    assert not torch.allclose(
        params(plain.model)["encoder.layers.0.feed_forward.linear1.weight"],
        params(trainer.model)["encoder.layers.0.feed_forward.linear1.weight"],
        atol=1e-6,
    )


def test_a_run_with_weight_decay_resumes_exactly(tmp_path, uninterrupted):
    pairs = uninterrupted[0]
    options = {**RESUME, "weight_decay": 0.5}
    whole = tiny_run(tmp_path, pairs, TrainConfig(**options), name="whole")
    whole.train()
    second = stopped_and_resumed(tmp_path, pairs, options)
    assert second.state.step == 12
    assert [g["weight_decay"] for g in second.optimizer.param_groups] == [0.5, 0.0]
    assert_same_weights(params(second.model), params(whole.model))

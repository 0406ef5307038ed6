"""Training objectives (qkv.training.objectives): every training option takes the same step as before
R-Drop moved out of the models (against tests/fixtures/steps_before_objectives.json, made with the old
code), objectives chosen by name and scheduled by the budget, R-Drop's loss against its reference on
logits (by hand, PyTorch's F.cross_entropy and F.kl_div), and no research method left in the models."""

import importlib.util
import json
import math
import re
from pathlib import Path

import pytest
import torch
from test_loss import _reference, _tiny_transformer_and_batch

from qkv.data.batching import Batch
from qkv.models.causal_lm import IGNORE, CausalLM, CausalLMConfig
from qkv.training import TrainConfig, Trainer
from qkv.training.distributed import LossForward
from qkv.training.language_model_task import language_model_loss
from qkv.training.objectives import (
    OBJECTIVES,
    LabelSmoothedCrossEntropy,
    Predictions,
    RDrop,
    cross_entropy_smoothing,
    loss_keywords,
    make_objective,
    only_one_smoothing,
    step_objective,
)
from qkv.training.rdrop import fused_linear_rdrop_cross_entropy, rdrop_cross_entropy
from qkv.training.tasks import TranslationTask, translation_loss

FIXTURES = Path(__file__).parent / "fixtures"
SRC = Path(__file__).resolve().parent.parent / "src" / "qkv"


def _steps_module():
    spec = importlib.util.spec_from_file_location("make_steps", FIXTURES / "make_steps_before_objectives.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


STEPS = _steps_module()
BEFORE = json.loads((FIXTURES / "steps_before_objectives.json").read_text(encoding="utf-8"))


# --------------------------------------------------------------------------- the same steps as before
def test_the_fixture_covers_every_scenario_and_the_scenarios_differ():
    """Every scenario was recorded, and the options changed the step (a fixture of identical steps
    would prove nothing): R-Drop, late dropout and subword dropout each move the loss."""
    got = BEFORE["scenarios"]
    assert set(got) == set(STEPS.SCENARIOS)
    loss = {name: record["loss"] for name, record in got.items()}
    for changed in ("translation_rdrop3", "translation_dropout_held_off", "translation_subword_dropout"):
        assert loss[changed] != loss["translation_plain"]
    assert loss["translation_rdrop3_before_its_start"] == loss["translation_plain"]
    assert loss["translation_rdrop3_after_its_start"] == loss["translation_rdrop3"]
    assert loss["lm_fused_rdrop3"] != loss["lm_fused_plain"] and loss["lm_logits_rdrop3"] != loss["lm_logits_plain"]


@pytest.mark.parametrize("name", sorted(STEPS.SCENARIOS))
def test_each_training_option_takes_the_same_step_as_before_the_objectives(name):
    """One step of each scenario with today's code against the step the code before the move took:
    loss, gradient norm, and per parameter the sum and norm of its clipped gradient and the sum of its
    updated values, to float32 rounding (the same operations run; on the CPU the fixture was made on
    they agree to the last bit). Two allowances let it hold on other CPUs (an AVX512 one sums in
    another order): an attention key bias's gradient is zero in exact arithmetic (it adds the same
    amount to every score of a query, which softmax ignores), so its recorded gradient is that CPU's
    rounding and is only checked to be negligible; and Adam's first step moves an element whose
    gradient is near Adam's epsilon by a rounding-dependent part of the learning rate, so a value sum
    may move by a tenth of it. bf16 scenarios round in bf16, natively on CPUs with AVX512-BF16 or AMX
    and emulated elsewhere: their gradients are held to 1% of their norm and their values to 8 steps."""
    before, now = BEFORE["scenarios"][name], STEPS.run_scenario(name)
    assert now["tokens"] == before["tokens"] and now["batch_shapes"] == before["batch_shapes"]
    assert now["lr"] == before["lr"]
    assert now["loss"] == pytest.approx(before["loss"], rel=1e-6)
    bf16 = "bf16" in name
    grad_rel, value_abs = (1e-2, 8 * now["lr"]) if bf16 else (1e-6, 1e-6 + 0.1 * now["lr"])
    assert now["grad_norm"] == pytest.approx(before["grad_norm"], rel=grad_rel)
    assert set(now["params"]) == set(before["params"])
    for key, (grad_sum, grad_norm, value_sum) in before["params"].items():
        got_sum, got_norm, got_value = now["params"][key]
        if key.endswith("k_proj.bias"):
            assert got_norm <= 1e-3 * now["grad_norm"], key  # zero but for rounding
            continue
        # a sum of gradients can be ~0 by cancellation: its tolerance is relative to the gradient's norm
        assert got_sum == pytest.approx(grad_sum, rel=grad_rel, abs=grad_rel * grad_norm + 1e-12), key
        assert got_norm == pytest.approx(grad_norm, rel=grad_rel, abs=1e-12), key
        assert got_value == pytest.approx(value_sum, rel=1e-6, abs=value_abs), key


# --------------------------------------------------------------------------- objectives by name
def test_objectives_are_chosen_by_name_and_check_their_options():
    assert set(OBJECTIVES) == {"label_smoothed_cross_entropy", "rdrop"}
    assert make_objective("rdrop", alpha=3.0, label_smoothing=0.1) == RDrop(alpha=3.0, label_smoothing=0.1)
    assert make_objective("label_smoothed_cross_entropy") == LabelSmoothedCrossEntropy(0.0)
    assert (RDrop(alpha=1.0).copies, LabelSmoothedCrossEntropy().copies) == (2, 1)
    with pytest.raises(ValueError, match="'dropconnect'"):
        make_objective("dropconnect")
    with pytest.raises(ValueError, match="alpha"):
        make_objective("label_smoothed_cross_entropy", alpha=3.0)
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="alpha"):
            RDrop(alpha=bad)
    with pytest.raises(ValueError, match="1.0"):
        LabelSmoothedCrossEntropy(1.0)


def test_a_step_s_objective_follows_rdrop_and_rdrop_start():
    plain = TrainConfig(label_smoothing=0.2)
    assert step_objective(plain, 0.9) == LabelSmoothedCrossEntropy(0.2)
    late = TrainConfig(rdrop=3.0, rdrop_start=0.5, label_smoothing=0.1)
    assert step_objective(late, 0.0) == LabelSmoothedCrossEntropy(0.1)
    assert step_objective(late, 0.4999) == LabelSmoothedCrossEntropy(0.1)
    assert step_objective(late, 0.5) == RDrop(alpha=3.0, label_smoothing=0.1)
    assert step_objective(TrainConfig(rdrop=2.0), 0.0) == RDrop(alpha=2.0, label_smoothing=0.1)


def test_label_smoothing_reaches_a_loss_function_through_the_objective_alone():
    """One channel: every objective is passed itself, the default one too, and a loss function that
    knows only label-smoothed cross-entropy (a benchmark's other contender) reads its smoothing from
    it and refuses another objective rather than drop its term."""
    default, rdrop = LabelSmoothedCrossEntropy(0.1), RDrop(alpha=2.0, label_smoothing=0.1)
    assert loss_keywords(default) == {"objective": default}
    assert loss_keywords(rdrop) == {"objective": rdrop}
    assert cross_entropy_smoothing(default) == 0.1 and cross_entropy_smoothing(None) == 0.0
    with pytest.raises(ValueError, match="rdrop"):
        cross_entropy_smoothing(rdrop)
    only_one_smoothing(rdrop, 0.1)  # kept importable; nothing calls it with two smoothings any more


@pytest.mark.parametrize("options", [{}, {"rdrop": 3.0}], ids=["plain", "rdrop"])
def test_a_training_step_passes_no_label_smoothing_beside_its_objective(options):
    """Every loss call of a real Trainer step gets the objective and nothing else, so no call can hold
    two smoothings (the refusal that guarded against it has nothing left to refuse)."""
    model, task = STEPS._translation({})
    calls = []

    def recording_loss(model, *tensors, **keywords):
        calls.append(keywords)
        return translation_loss(model, *tensors, **keywords)

    task.loss_fn = recording_loss  # what the Trainer wraps
    config = TrainConfig(max_tokens=300, warmup_steps=4, label_smoothing=0.1, progress=False, **options)
    trainer = Trainer(model, task, config)
    trainer.step([task.make_batch(task.batches(0, config.max_tokens, config.seed)[0], 0)])
    assert calls and all(set(keywords) == {"objective"} for keywords in calls)
    expected = RDrop(alpha=3.0, label_smoothing=0.1) if options else LabelSmoothedCrossEntropy(0.1)
    assert all(keywords["objective"] == expected for keywords in calls)


def _loss_and_grads(model, loss):
    model.zero_grad()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_the_default_objective_and_an_explicit_one_take_bit_identical_steps():
    """The engine's default objective (from TrainConfig), ``LabelSmoothedCrossEntropy(0.1)`` given
    explicitly (as the task's loss call passes it, and by name), and an old caller's
    ``label_smoothing=0.1`` with no objective: the same loss and gradients to the last bit, and the
    loss is PyTorch's label-smoothed cross-entropy (with 0.1, not 0)."""
    config, model, src, tgt_in, tgt_out = _tiny_transformer_and_batch(dropout=0.0, seed=2)
    forward = LossForward(model, translation_loss)
    batch = Batch(src, tgt_in, tgt_out, int((tgt_out != config.pad_id).sum()))
    objectives = [
        step_objective(TrainConfig(label_smoothing=0.1), 0.0),
        LabelSmoothedCrossEntropy(0.1),
        make_objective("label_smoothed_cross_entropy", label_smoothing=0.1),
    ]
    runs = [_loss_and_grads(model, TranslationTask.loss(forward, batch, objective)) for objective in objectives]
    runs.append(_loss_and_grads(model, translation_loss(model, src, tgt_in, tgt_out, label_smoothing=0.1)))
    want_loss, want_grads = runs[0]
    for loss, grads in runs[1:]:
        assert torch.equal(loss, want_loss)
        assert all(torch.equal(a, b) for a, b in zip(grads, want_grads))
    with torch.no_grad():
        hidden, weight = model.hidden_states(src, tgt_in), model.output_proj.weight
        smoothed, plain = (_reference(hidden, weight, tgt_out, eps, config.pad_id) for eps in (0.1, 0.0))
    assert float(want_loss) == pytest.approx(float(smoothed), rel=1e-5)
    assert float(want_loss) != pytest.approx(float(plain), rel=1e-3)


@pytest.mark.parametrize("vocab", [20, 100])  # the language model's logits path and its chunked one
def test_the_default_objective_given_as_an_objective_is_the_models_own_loss(vocab):
    """The task losses hand the default objective to the model's ``loss``; the objective itself, called
    on the hidden states as another objective is, computes the same numbers, to the last bit."""
    config, model, src, tgt_in, tgt_out = _tiny_transformer_and_batch(dropout=0.0, seed=2)
    objective = make_objective("label_smoothed_cross_entropy", label_smoothing=0.1)
    plain = model.loss(src, tgt_in, tgt_out, label_smoothing=0.1)
    assert torch.equal(translation_loss(model, src, tgt_in, tgt_out, objective=objective), plain)
    hidden = model.hidden_states(src, tgt_in)
    assert torch.equal(objective(Predictions(hidden, model.output_proj.weight, tgt_out, config.pad_id)), plain)
    lm = CausalLM(
        CausalLMConfig(vocab_size=vocab, d_model=32, num_heads=4, num_layers=1, d_ff=64, context=8, dropout=0.0)
    )
    ids = torch.randint(0, vocab, (3, 8))
    targets = torch.roll(ids, -1, dims=1)
    targets[1, 5:] = IGNORE
    assert lm.chunked_loss == (vocab > 32)
    plain = lm.loss(ids, targets, label_smoothing=0.1)
    assert torch.equal(language_model_loss(lm, ids, targets, objective=objective), plain)
    assert torch.equal(language_model_loss(lm, ids, targets, label_smoothing=0.1), plain)
    predictions = Predictions(lm.hidden_states(ids), lm.output_proj.weight, targets, IGNORE, chunked=lm.chunked_loss)
    assert torch.equal(objective(predictions), plain)


def test_the_models_loss_knows_no_rdrop_and_no_research_method_is_left_in_models_or_nn():
    config, model, src, tgt_in, tgt_out = _tiny_transformer_and_batch(dropout=0.0, seed=2)
    with pytest.raises(TypeError, match="rdrop"):
        model.loss(src, tgt_in, tgt_out, label_smoothing=0.1, rdrop=2.0)
    lm = CausalLM(CausalLMConfig(vocab_size=20, d_model=32, num_heads=4, num_layers=1, d_ff=64, context=8))
    ids = torch.randint(0, 20, (2, 8))
    with pytest.raises(TypeError, match="rdrop"):
        lm.loss(ids, ids, rdrop=2.0)
    # the training options' names, and R-Drop's maths, appear in no source file of the lower layers
    method = re.compile(r"rdrop|r-drop|kl_div|dropout_start|both_directions|subword", re.IGNORECASE)
    files = [*(SRC / "models").glob("*.py"), *(SRC / "nn").glob("*.py")]
    assert len(files) >= 7
    for path in files:
        assert not method.findall(path.read_text(encoding="utf-8")), path.name


# --------------------------------------------------------------------------- R-Drop's loss (qkv.training.rdrop)
def test_rdrop_reference_by_hand():
    """One position, three classes: (CE_a + CE_b) / 2 + alpha / 4 * (KL(a||b) + KL(b||a)) written out."""
    import math

    za, zb, y, eps, alpha = [1.0, -0.5, 2.0], [0.3, 0.9, -1.2], 2, 0.1, 3.0

    def probs(z):
        e = [math.exp(v) for v in z]
        return [v / sum(e) for v in e]

    pa, pb = probs(za), probs(zb)
    q = [eps / 3 + (1 - eps) * (c == y) for c in range(3)]
    ce = [-sum(qc * math.log(pc) for qc, pc in zip(q, p)) for p in (pa, pb)]
    kl_ab = sum(a * math.log(a / b) for a, b in zip(pa, pb))
    kl_ba = sum(b * math.log(b / a) for a, b in zip(pa, pb))
    expected = 0.5 * (ce[0] + ce[1]) + alpha / 4 * (kl_ab + kl_ba)
    got = rdrop_cross_entropy(
        torch.tensor([za], dtype=torch.float64),
        torch.tensor([zb], dtype=torch.float64),
        torch.tensor([y]),
        eps,
        -1,
        alpha,
    )
    assert got.item() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("alpha", [0.0, 1.0, 5.0])
@pytest.mark.parametrize("chunk_rows", [1, 7, 4096])
def test_fused_rdrop_loss_and_gradients_match_torch(smoothing, alpha, chunk_rows):
    torch.manual_seed(4)
    hidden_a = torch.randn(4, 9, 16, dtype=torch.float64, requires_grad=True)
    hidden_b = (hidden_a.detach() + 0.5 * torch.randn(4, 9, 16, dtype=torch.float64)).requires_grad_()
    weight = torch.randn(30, 16, dtype=torch.float64, requires_grad=True)
    target = torch.randint(1, 30, (4, 9))
    target[1, 5:] = 0
    target[3, :] = 0
    inputs = (hidden_a, hidden_b, weight)
    reference = rdrop_cross_entropy(hidden_a @ weight.T, hidden_b @ weight.T, target, smoothing, 0, alpha)
    grads_ref = torch.autograd.grad(reference * 0.37, inputs)
    got = fused_linear_rdrop_cross_entropy(
        hidden_a, hidden_b, weight, target, smoothing, 0, alpha, chunk_rows=chunk_rows
    )
    grads = torch.autograd.grad(got * 0.37, inputs)
    # the fused loss makes its logits in float32
    assert got.item() == pytest.approx(reference.item(), rel=1e-6)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-4)
    assert grads[0][3].abs().max() == 0 and grads[1][3].abs().max() == 0
    if alpha == 0.0:  # no KL: the mean of the two passes' plain losses
        plain = [_reference(h, weight, target, smoothing, 0) for h in (hidden_a, hidden_b)]
        assert got.item() == pytest.approx(0.5 * float((plain[0] + plain[1]).detach()), rel=1e-6)


def test_fused_rdrop_loss_under_bf16_autocast_is_close_to_float32():
    torch.manual_seed(5)
    hidden_a, hidden_b = torch.randn(300, 32), torch.randn(300, 32)
    weight = torch.randn(64, 32, requires_grad=True)
    target = torch.randint(1, 64, (300,))
    reference = rdrop_cross_entropy(hidden_a @ weight.T, hidden_b @ weight.T, target, 0.1, 0, 3.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fused_linear_rdrop_cross_entropy(hidden_a, hidden_b, weight, target, 0.1, 0, 3.0)
    got.backward()
    assert got.dtype == torch.float32 and weight.grad.dtype == torch.float32
    assert got.item() == pytest.approx(reference.item(), rel=2e-2)
    with pytest.raises(ValueError, match="disagree on positions"):
        fused_linear_rdrop_cross_entropy(hidden_a, hidden_b[:2], weight, target, 0.1, 0, 3.0)


def check_transformer_rdrop_loss(model, src, tgt_in, tgt_out, pad_id):
    """R-Drop's objective on the model: loss and gradients against the reference on the logits of the stacked batch
    drawn with the same random stream (also run on the GPU by tests/test_cuda.py)."""
    torch.manual_seed(7)
    got = translation_loss(model, src, tgt_in, tgt_out, objective=RDrop(alpha=2.0, label_smoothing=0.1))
    grads = torch.autograd.grad(got, list(model.parameters()))
    torch.manual_seed(7)
    logits_a, logits_b = model(torch.cat([src, src]), torch.cat([tgt_in, tgt_in])).chunk(2)
    assert (logits_a - logits_b).abs().max() > 0.1  # each copy drew its own dropout
    reference = rdrop_cross_entropy(logits_a, logits_b, tgt_out, 0.1, pad_id, 2.0)
    grads_ref = torch.autograd.grad(reference, list(model.parameters()))
    assert got.item() == pytest.approx(reference.item(), rel=1e-5)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, atol=2e-5, rtol=1e-4)


def test_transformer_rdrop_loss_runs_two_dropout_passes():
    """With dropout the two copies differ, and the loss is R-Drop's reference on the logits of the
    stacked batch drawn with the same random stream; without dropout it is the plain loss."""
    config, model, src, tgt_in, tgt_out = _tiny_transformer_and_batch(dropout=0.3, seed=6)
    check_transformer_rdrop_loss(model, src, tgt_in, tgt_out, config.pad_id)
    model.eval()
    plain = model.loss(src, tgt_in, tgt_out, label_smoothing=0.1)
    rdrop = translation_loss(model, src, tgt_in, tgt_out, objective=RDrop(alpha=2.0, label_smoothing=0.1))
    assert rdrop.item() == pytest.approx(plain.item(), rel=1e-5)


@pytest.mark.parametrize("vocab", [20, 100])  # below and above d_model: the plain and the fused path
def test_causal_lm_rdrop_loss_against_the_reference(vocab):
    config = CausalLMConfig(vocab_size=vocab, d_model=32, num_heads=4, num_layers=2, d_ff=64, context=16, dropout=0.2)
    torch.manual_seed(8)
    model = CausalLM(config)
    ids = torch.randint(0, vocab, (3, 16))
    targets = torch.roll(ids, -1, dims=1)
    targets[2, 10:] = IGNORE
    torch.manual_seed(9)
    got = language_model_loss(model, ids, targets, objective=RDrop(alpha=1.5, label_smoothing=0.1))
    torch.manual_seed(9)
    logits_a, logits_b = model(torch.cat([ids, ids])).logits.chunk(2)
    reference = rdrop_cross_entropy(logits_a, logits_b, targets, 0.1, IGNORE, 1.5)
    assert got.item() == pytest.approx(reference.item(), rel=1e-5)

"""Muon for the layers' weight matrices beside AdamW for the rest (``TrainConfig(optimizer="muon")``):
steps against the algorithm written out here, which parameters go where, a short run whose loss
falls, a resume that equals the uninterrupted run, and the option through a recipe file and ``qkv
train``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from qkv.cli import main
from qkv.data.text import CharTokenizer
from qkv.models.causal_lm import CausalLM, CausalLMConfig
from qkv.models.transformer import Transformer, TransformerConfig
from qkv.runs.recipes import RECIPE_DIR, load_recipe
from qkv.training import LanguageModelTask, TrainConfig, Trainer
from qkv.training.checkpoint_files import load_checkpoint
from qkv.training.optimizer import LR_SCALE, MuonWithAdamW, make_optimizer, muon_matrices
from qkv.training.schedule import learning_rate

TEXT = "".join(f"line {i}: to be, or not to be, that is the question.\n" for i in range(200))
TINY_LM = dict(d_model=32, num_heads=4, num_layers=2, d_ff=64, context=32)
TRAIN = dict(max_tokens=256, warmup_steps=5, progress=False, average_last=1, log_every_steps=1, optimizer="muon")

# the quintic Newton-Schulz iteration's coefficients (Jordan et al., "Muon", 2024)
NS_A, NS_B, NS_C = 3.4445, -4.7750, 2.0315


# --------------------------------------------------------------------------- the step, written out
def to_bf16(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to bfloat16, held as float32."""
    return x.bfloat16().float()


def newton_schulz(update: torch.Tensor, steps: int = 5, eps: float = 1e-7, bf16: bool = True) -> torch.Tensor:
    """The matrix ``update`` orthogonalised as Muon does it: scaled to Frobenius norm 1, then
    ``steps`` times X <- a X + (b X X^T + c (X X^T)^2) X on the wide orientation. ``bf16``: the
    iteration runs in bfloat16 (torch's Muon; qkv's on CUDA): every product sums in float32 and each
    of the three results is rounded to bfloat16 once (a matrix product with its addition fused, as
    torch.addmm's), written here as float32 arithmetic with those roundings. Else float32 (qkv's
    Muon on a CPU)."""
    round_ = to_bf16 if bf16 else (lambda t: t)
    x = round_(update)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = round_(x / round_(x.norm()).clamp(min=eps))
    for _ in range(steps):
        gram = round_(x @ x.T)
        poly = round_(NS_B * gram + NS_C * (gram @ gram))
        x = round_(NS_A * x + poly @ x)
    return x.T if tall else x


class Stacked(nn.Module):
    """A weight matrix inside a layer stack (Muon's) beside an embedding (AdamW's)."""

    def __init__(self, rows: int, cols: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(5, cols)
        self.layers = nn.ModuleList([nn.Linear(cols, rows, bias=False)])


@pytest.mark.parametrize("shape", [(8, 4), (4, 8)])  # tall (orthogonalised transposed, rate x sqrt(2)) and wide
def test_three_steps_equal_the_algorithm_written_out(shape):
    """Each step: the momentum buffer B <- mu B + (1 - mu) g, Nesterov's update (1 - mu) g + mu B,
    orthogonalised (:func:`newton_schulz`, in float32 on a CPU); the weight decays by lr x wd, then
    moves by -lr x sqrt(max(1, rows / cols)) x the orthogonalised update. A momentum of 3/4 and
    gradients in eighths keep the momentum exact."""
    rows, cols = shape
    mu, wd = 0.75, 0.1
    config = TrainConfig(optimizer="muon", muon_lr=0.02, muon_momentum=mu, weight_decay=wd, warmup_steps=4)
    module = Stacked(rows, cols)
    optimizer = make_optimizer(module, config, fused=None, d_model=16)
    assert isinstance(optimizer, MuonWithAdamW)
    matrix = module.layers[0].weight
    weight, buffer = matrix.detach().clone(), torch.zeros(shape)
    schedule = learning_rate(config, 4, 16)  # the peak: Muon's rate there is muon_lr
    gen = torch.Generator().manual_seed(sum(shape))
    for _ in range(3):
        grad = torch.randint(-16, 17, shape, generator=gen).float() / 8
        matrix.grad = grad.clone()
        module.embedding.weight.grad = torch.ones_like(module.embedding.weight)
        for group in optimizer.param_groups:  # as the engine sets them
            group["lr"] = schedule * group.get(LR_SCALE, 1.0)
        optimizer.step()
        lr = optimizer.muon.param_groups[0]["lr"]
        assert lr == pytest.approx(0.02, rel=1e-12)
        buffer = mu * buffer + (1 - mu) * grad
        update = newton_schulz((1 - mu) * grad + mu * buffer, bf16=False)
        weight = weight * (1 - lr * wd) - lr * math.sqrt(max(1.0, rows / cols)) * update
        torch.testing.assert_close(optimizer.state[matrix]["momentum_buffer"], buffer, atol=0, rtol=0)
        torch.testing.assert_close(matrix.detach(), weight, atol=1e-5, rtol=0)
    # and the embedding took AdamW's steps at the schedule's own rate
    assert optimizer.adamw.param_groups[0]["lr"] == schedule
    assert int(optimizer.state[module.embedding.weight]["step"]) == 3


@pytest.mark.parametrize("shape", [(8, 4), (4, 8), (24, 16)])
def test_the_bfloat16_iteration_equals_the_written_out_one_and_torchs_muon(shape):
    """qkv's Muon with ``ns_dtype=torch.bfloat16`` (what it runs on CUDA) takes the written-out
    bfloat16 steps, and the very steps of ``torch.optim.Muon``, whose iteration is always bfloat16."""
    from qkv.training.muon import Muon

    mu, wd, lr = 0.75, 0.1, 0.02
    ours, theirs = (nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(1))) for _ in range(2))
    with torch.no_grad():
        theirs.copy_(ours)
    mine = Muon([ours], lr=lr, weight_decay=wd, momentum=mu, ns_dtype=torch.bfloat16)
    torchs = torch.optim.Muon([theirs], lr=lr, weight_decay=wd, momentum=mu)
    weight, buffer = ours.detach().clone(), torch.zeros(shape)
    gen = torch.Generator().manual_seed(sum(shape))
    for _ in range(3):
        grad = torch.randint(-16, 17, shape, generator=gen).float() / 8
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        mine.step()
        torchs.step()
        buffer = mu * buffer + (1 - mu) * grad
        update = newton_schulz((1 - mu) * grad + mu * buffer, bf16=True)
        weight = weight * (1 - lr * wd) - lr * math.sqrt(max(1.0, shape[0] / shape[1])) * update
        torch.testing.assert_close(ours.detach(), weight, atol=1e-5, rtol=0)
        torch.testing.assert_close(ours.detach(), theirs.detach(), atol=0, rtol=0)
        torch.testing.assert_close(mine.state[ours]["momentum_buffer"], torchs.state[theirs]["momentum_buffer"])


def test_the_step_test_tells_the_bfloat16_iteration_from_a_float32_one():
    """The same iteration in float32 throughout moves a weight, at the step test's rate, by more than
    that test's tolerance away from the bfloat16 one: the test pins the precision, not only the algebra."""
    for shape in [(8, 4), (4, 8)]:
        g = torch.randint(-16, 17, shape, generator=torch.Generator().manual_seed(sum(shape))).float() / 8
        x = g.T / g.norm() if shape[0] > shape[1] else g / g.norm()
        for _ in range(5):
            gram = x @ x.T
            x = NS_A * x + (NS_B * gram + NS_C * gram @ gram) @ x
        float32 = x.T if shape[0] > shape[1] else x
        assert 0.02 * float((float32 - newton_schulz(g)).abs().max()) > 1e-5


# --------------------------------------------------------------------------- which parameters go where
def test_the_split_on_a_causal_lm():
    config = CausalLMConfig(vocab_size=40, **TINY_LM, tie_output=False, qk_norm=True, activation="swiglu")
    model = CausalLM(config)
    optimizer = make_optimizer(model, TrainConfig(optimizer="muon", weight_decay=0.1), fused=True, d_model=32)
    assert isinstance(optimizer, MuonWithAdamW)
    name = {id(p): n for n, p in model.named_parameters()}
    muon = {name[id(p)] for g in optimizer.muon.param_groups for p in g["params"]}
    adamw = [name[id(p)] for g in optimizer.adamw.param_groups for p in g["params"]]
    projections = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj"]
    feed_forward = sorted(
        n.removeprefix("decoder.layers.0.").removesuffix(".weight")
        for n in name.values()
        if n.startswith("decoder.layers.0.feed_forward.") and n.endswith("weight")
    )
    assert len(feed_forward) == 3  # SwiGLU: the gate, the up and the down projections
    assert muon == {f"decoder.layers.{i}.{m}.weight" for i in range(2) for m in projections + feed_forward}
    assert len(adamw) == len(set(adamw)) and set(adamw) == set(name.values()) - muon
    for kept in ("token_embedding.weight", "positional.embedding.weight", "output_proj.weight", "decoder.norm.weight"):
        assert kept in adamw
    assert all(
        n.endswith(("bias", "norm1.weight", "norm2.weight", "q_norm.weight", "k_norm.weight"))
        for n in adamw
        if n.startswith("decoder.layers.")
    )
    # AdamW as without Muon: its fused kernel, the matrices (embeddings, output projection) decayed
    assert all(g["fused"] for g in optimizer.adamw.param_groups)
    decayed = {name[id(p)] for p in optimizer.adamw.param_groups[0]["params"]}
    assert decayed == {"token_embedding.weight", "positional.embedding.weight", "output_proj.weight"}
    assert optimizer.muon.param_groups[0]["weight_decay"] == 0.1


def test_the_split_on_a_translation_model_takes_both_stacks_and_not_the_shared_embedding():
    config = TransformerConfig(
        src_vocab_size=30,
        tgt_vocab_size=30,
        d_model=16,
        num_heads=2,
        num_encoder_layers=1,
        num_decoder_layers=1,
        d_ff=32,
    )
    model = Transformer(config)
    name = {id(p): n for n, p in model.named_parameters()}
    chosen = {name[id(p)] for p in muon_matrices(model)}
    expected = {
        n
        for n, p in model.named_parameters()
        if p.ndim == 2 and (n.startswith("encoder.layers.") or n.startswith("decoder.layers."))
    }
    assert chosen == expected and any("cross_attn" in n or "encoder_attn" in n for n in chosen)
    assert not any("embed" in n for n in chosen)


# --------------------------------------------------------------------------- training and resuming
def lm_trainer(run_dir: Path, **options) -> Trainer:
    tokenizer = CharTokenizer(sorted(set(TEXT)))
    ids = np.asarray(tokenizer.encode(TEXT), dtype=np.int64)
    task = LanguageModelTask(tokenizer, ids[:6000], None, context=32)
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = CausalLM(CausalLMConfig(vocab_size=tokenizer.vocab_size, **TINY_LM))  # dropout 0.1: the RNG matters
    return Trainer(model, task, TrainConfig(**{**TRAIN, **options}), run_dir)


def losses(trainer: Trainer) -> list[float]:
    assert trainer.run_dir is not None
    lines = (trainer.run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["loss"] for line in lines if json.loads(line)["event"] == "train"]


def test_a_short_run_learns_and_muon_follows_the_schedule(tmp_path):
    trainer = lm_trainer(tmp_path, max_steps=30, muon_lr=0.03, weight_decay=0.1, schedule="cosine")
    trainer.train()
    loss = losses(trainer)
    assert len(loss) == 30 and sum(loss[-5:]) / 5 < 0.7 * loss[0], loss
    peak = learning_rate(trainer.config, trainer.config.warmup_steps, 32)
    last = trainer.optimizer.param_groups
    assert last[0][LR_SCALE] == pytest.approx(0.03 / peak)
    assert last[0]["lr"] == pytest.approx(0.03 * last[-1]["lr"] / peak) and 0 < last[0]["lr"] < 0.03


def test_a_resumed_run_equals_the_uninterrupted_one(tmp_path):
    options = dict(max_steps=12, weight_decay=0.1, accum_steps=2)
    whole = lm_trainer(tmp_path / "whole", **options)
    whole.train()
    first = lm_trainer(tmp_path / "split", **{**options, "max_steps": 5})
    first.train()
    saved = load_checkpoint(tmp_path / "split")["optimizer"]
    assert any("momentum_buffer" in s for s in saved["state"].values())  # Muon's state is in state.pt
    torch.manual_seed(123)  # a fresh process would not share the RNG: resume must restore it
    second = lm_trainer(tmp_path / "split", **options)
    second.resume()
    assert second.state.step == 5
    second.train()
    assert second.state.step == 12
    ours, theirs = second.model.state_dict(), whole.model.state_dict()
    for key in theirs:
        torch.testing.assert_close(ours[key], theirs[key], atol=1e-6, rtol=0, msg=key)
    for p, q in zip(second.model.parameters(), whole.model.parameters()):
        for key, value in whole.optimizer.state[q].items():
            torch.testing.assert_close(second.optimizer.state[p][key], value, atol=1e-6, rtol=0, msg=key)
    assert losses(second) == losses(whole)  # the log was cut back to step 5 and continued


@pytest.mark.parametrize(("saved", "resumed"), [("adamw", "muon"), ("muon", "adamw")])
def test_resuming_with_the_other_optimizer_is_refused_in_one_line(tmp_path, saved, resumed):
    first = lm_trainer(tmp_path, max_steps=2, optimizer=saved)
    first.train()
    second = lm_trainer(tmp_path, max_steps=4, optimizer=resumed)
    expected = f"the run was saved with optimizer (--optimizer) {saved}, and this run's is {resumed}: resume with --optimizer {saved}"
    with pytest.raises(ValueError) as refused:
        second.resume()
    assert str(refused.value) == expected
    if resumed == "muon":  # and the optimizer itself, given another's state directly
        with pytest.raises(ValueError, match=r"^the saved optimizer state is not Muon's[^\n]*saved with$"):
            second.optimizer.load_state_dict(first.optimizer.state_dict())


def test_muon_with_fsdp_is_refused_in_one_line():
    """FSDP2 shards each matrix across processes; Muon orthogonalises whole matrices (torch's Muon,
    stepped on the sharded parameters, does not give the whole matrix's step)."""
    with pytest.raises(ValueError, match=r"^optimizer \(--optimizer\) muon [^\n]*--strategy ddp"):
        TrainConfig(optimizer="muon", strategy="fsdp")
    assert TrainConfig(optimizer="muon", strategy="ddp").optimizer == "muon"
    with pytest.raises(ValueError, match="optimizer"):
        TrainConfig(optimizer="sgd")


# --------------------------------------------------------------------------- recipe and command line
def qkv_train(tmp_path: Path, run: str, *extra: str) -> dict:
    """``qkv train`` on TEXT for 2 steps of a tiny model; the run's state.pt."""
    text = tmp_path / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    args = ["train", "--task", "lm", "--train-text", str(text), "--run-dir", str(tmp_path / run)]
    args += ["--max-steps", "2", "--minutes", "0", "--no-bf16", "--d-model", "32", "--heads", "2", "--layers", "1"]
    args += ["--d-ff", "64", "--context", "16", "--max-tokens", "256", "--no-progress", "--threads", "1", *extra]
    assert main(args) == 0
    config = json.loads((tmp_path / run / "config.json").read_text(encoding="utf-8"))
    return {"train": config["train"], "optimizer": load_checkpoint(tmp_path / run)["optimizer"]}


def is_muon(saved: dict) -> bool:
    groups = saved["param_groups"]
    return "ns_steps" in groups[0] and all("betas" in g for g in groups[1:])


def test_optimizer_muon_from_a_recipe_file_and_from_the_command_line(tmp_path):
    """The shipped language-model recipe trains with Muon (2.0); a recipe file's ``optimizer`` and
    the command line's ``--optimizer`` choose either."""
    shipped = (RECIPE_DIR / "tinyshakespeare.toml").read_text(encoding="utf-8")
    assert load_recipe("tinyshakespeare").train.config().optimizer == "muon"
    assert is_muon(qkv_train(tmp_path, "shipped")["optimizer"])
    assert shipped.count('\noptimizer = "muon"') == 1
    recipe_file = tmp_path / "adamw.toml"
    recipe_file.write_text(shipped.replace('\noptimizer = "muon"', '\noptimizer = "adamw"'), encoding="utf-8")
    assert load_recipe(recipe_file).train.config().optimizer == "adamw"
    from_recipe = qkv_train(tmp_path, "recipe", "--recipe", str(recipe_file))
    assert from_recipe["train"]["optimizer"] == "adamw" and not is_muon(from_recipe["optimizer"])
    from_flag = qkv_train(
        tmp_path,
        "flag",
        "--recipe",
        str(recipe_file),
        "--optimizer",
        "muon",
        "--muon-momentum",
        "0.9",
        "--muon-lr",
        "0.01",
    )
    assert from_flag["train"]["optimizer"] == "muon" and from_flag["train"]["muon_lr"] == 0.01
    assert is_muon(from_flag["optimizer"]) and from_flag["optimizer"]["param_groups"][0]["momentum"] == 0.9
    bad = recipe_file.read_text(encoding="utf-8").replace('optimizer = "adamw"', 'optimizer = "lion"')
    recipe_file.write_text(bad, encoding="utf-8")
    with pytest.raises(ValueError, match=r"adamw\.toml: train: optimizer \(--optimizer\) must be one of adamw, muon"):
        load_recipe(recipe_file)

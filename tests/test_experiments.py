"""The explanatory experiments: each runs in --quick mode and its claim is asserted from the numbers
it computed. Helpers are checked against independent references (autograd, nn.RNN, a full
EncoderLayer, F.unfold). One test per experiment run, so that pytest-xdist never runs one twice."""

import json
import re

import pytest
import torch
import torch.nn.functional as F

from qkv.cli import main
from qkv.experiments import EXPERIMENTS, long_range, run_experiment, scaling, softmax_scaling, vit_digits
from qkv.experiments.common import fit_power_law
from qkv.experiments.permutation import offset_spread
from qkv.experiments.report import build_report
from qkv.nn.positional import sinusoidal_table


def _written(result, out):
    folder = out / result.name
    data = json.loads((folder / "results.json").read_text())
    assert data["schema"] == "qkv-experiment/1" and data["experiment"] == result.name and data["quick"] is True
    for name in result.figures:
        assert (folder / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(folder.glob(".*")), "temporary files left behind"
    return data


# ---------------------------------------------------------------- softmax-scaling


def test_softmax_scaling_claims(tmp_path):
    result = run_experiment("softmax-scaling", out=tmp_path, quick=True, seed=0)
    r = _written(result, tmp_path)["results"]
    dims, un, sc = r["dims"], r["unscaled"], r["scaled"]
    assert dims[0] == 4 and dims[-1] == 1024
    for d, v_un, v_sc in zip(dims, un["variance"], sc["variance"]):
        assert 0.8 * d < v_un < 1.2 * d  # var(q.k) = d_k for unit-variance components
        assert 0.8 < v_sc < 1.2  # ... and 1 after dividing by sqrt(d_k)
    # unscaled: the largest weight tends to 1, the gradient norm to 0
    assert un["max_weight"][-1] > 0.95 and un["max_weight"][-1] > un["max_weight"][0] + 0.4
    assert un["grad_norm"][-1] < 0.25 * un["grad_norm"][0]
    assert un["grad_norm_median"][-1] < 1e-2 * un["grad_norm_median"][0]
    assert un["entropy"][-1] < 0.2 * un["entropy"][0]
    # scaled: they stay put
    for key in ("max_weight", "grad_norm", "entropy"):
        assert max(sc[key]) < 1.25 * min(sc[key]), key
    demo = r["demo"]
    assert demo["multiplied"]["max_weight"] > 0.999 and demo["multiplied"]["grad_norm"] < 1e-6
    assert demo["plain"]["max_weight"] < 0.9 and demo["plain"]["grad_norm"] > 0.1
    assert all(result.claims.values()), result.claims


def test_softmax_jacobian_matches_autograd():
    scores = torch.randn(3, 7, dtype=torch.float64)
    p = torch.softmax(scores, -1)
    ours = softmax_scaling.softmax_jacobian(p)
    for i in range(3):
        ref = torch.autograd.functional.jacobian(lambda s: torch.softmax(s, -1), scores[i])
        torch.testing.assert_close(ours[i], ref)


# ---------------------------------------------------------------- long-range


def test_long_range_claims(tmp_path):
    result = run_experiment("long-range", out=tmp_path, quick=True, seed=0, progress=False)
    r = _written(result, tmp_path)["results"]
    acc = r["accuracy"]
    # attention's accuracy at the longest N beats the RNN's (which is near chance there)
    assert acc["attention"][-1] > acc["rnn"][-1] + 0.3
    assert acc["attention"][-1] > 0.9 and acc["rnn"][-1] < 0.4
    # the RNN's gradient norm ||dh_T/dh_t|| falls with distance, at init and after training
    for when in ("init", "trained"):
        norms = r["rnn_jacobian_norm"][when]
        assert norms[-1] < 1e-3 * norms[0], when
        assert norms[9] < norms[0] and norms[-1] < norms[9], when
    # attention: the gradient from the last position reaches the first token in one step
    grads = r["input_gradient_norm"]
    assert grads["attention_trained"][-1] > 1e3 * grads["rnn_trained"][-1]
    # matched parameter counts
    counts = r["parameters"]
    assert max(counts.values()) < 1.05 * min(counts.values()), counts
    assert all(result.claims.values()), result.claims


def test_long_range_task_and_models():
    config = long_range.QUICK
    tokens, targets = long_range.make_batch(config, 32, 10, torch.Generator().manual_seed(0))
    assert tokens.shape == (32, 12)
    assert torch.equal(targets, tokens[:, 0]) and bool((targets < config.num_symbols).all())
    noise = tokens[:, 1:-1]
    assert bool((noise >= config.num_symbols).all() and (noise < config.query_id).all())
    assert bool((tokens[:, -1] == config.query_id).all())
    models = long_range.build_models(config, 12)
    for kind in ("rnn", "lstm"):
        counted = sum(p.numel() for p in models[kind].parameters())
        formula = long_range.recurrent_parameters(
            kind,
            vocab_size=config.vocab_size,
            embed_dim=config.embed_dim,
            hidden_size=models[kind].rnn.hidden_size,
            num_classes=config.num_symbols,
        )
        assert counted == formula
    # the attention model computes only the last row: equal to the full EncoderLayer's last row
    attention = models["attention"].eval()
    x = attention.embed(tokens)
    full = attention.layer(x).output[:, -1]
    torch.testing.assert_close(attention.features(x), full, atol=1e-5, rtol=1e-5)


def test_rnn_jacobian_matches_autograd():
    torch.manual_seed(1)
    model = long_range.RecurrentClassifier(kind="rnn", vocab_size=5, embed_dim=3, hidden_size=4, num_classes=2)
    model.rnn.weight_hh_l0.data.mul_(3.0)  # a less contractive recurrence, so the norms are not tiny
    tokens = torch.randint(0, 5, (2, 7))
    # the float64 recurrence reproduces nn.RNN
    states = long_range.rnn_hidden_states(model, tokens)
    reference, _ = model.rnn(model.embed(tokens))
    torch.testing.assert_close(states.float(), reference, atol=1e-5, rtol=1e-5)
    norms = long_range.rnn_jacobian_norms(model, tokens)
    assert len(norms) == 6
    # reference: autograd Jacobian of h_T with respect to h_t, through the recurrence from t on
    rnn = model.rnn
    w_ih, w_hh = rnn.weight_ih_l0.double(), rnn.weight_hh_l0.double()
    bias = (rnn.bias_ih_l0 + rnn.bias_hh_l0).double()
    x = (model.embed(tokens).double() @ w_ih.T + bias).detach()
    for distance in (1, 3, 6):
        t = 6 - distance
        per_sequence = []
        for b in range(2):

            def from_t(h, b=b, t=t):
                for s in range(t + 1, 7):
                    h = torch.tanh(x[b, s] + w_hh @ h)
                return h

            jac = torch.autograd.functional.jacobian(from_t, states[b, t].detach())
            per_sequence.append(torch.linalg.matrix_norm(jac, ord=2).item())
        assert norms[distance - 1] == pytest.approx(sum(per_sequence) / 2, rel=1e-9)


def test_input_gradient_norms_match_jacobian():
    torch.manual_seed(2)
    model = long_range.build_models(long_range.QUICK, 12)["lstm"]
    tokens, _ = long_range.make_batch(long_range.QUICK, 3, 6, torch.Generator().manual_seed(0))
    ours = long_range.input_gradient_norms(model, tokens)
    m64 = long_range.RecurrentClassifier(
        kind="lstm",
        vocab_size=long_range.QUICK.vocab_size,
        embed_dim=32,
        hidden_size=model.rnn.hidden_size,
        num_classes=8,
    ).double()
    m64.load_state_dict(model.state_dict())
    x = m64.embed(tokens).detach()
    jac = torch.autograd.functional.jacobian(m64.features, x)  # (b, f, b, T, e)
    ref = torch.stack([jac[b, :, b].pow(2).sum((0, 2)).sqrt() for b in range(3)]).mean(0).flip(0)
    torch.testing.assert_close(torch.tensor(ours, dtype=torch.float64), ref, rtol=1e-9, atol=0)

    class Tiny(torch.nn.Module):  # a gradient of 1e-170: its square underflows float64
        def embed(self, tokens):
            return torch.ones(tokens.shape + (4,), dtype=torch.float64)

        def features(self, x):
            return x[:, 0] * 1e-170

    norms = long_range.input_gradient_norms(Tiny(), torch.zeros(2, 5, dtype=torch.long))
    assert norms[4] == pytest.approx(2e-170, rel=1e-12, abs=0) and norms[0] == 0.0  # ||1e-170 I_4||_F


# ---------------------------------------------------------------- scaling


def test_scaling_claims(tmp_path):
    # on the CPU: the quick lengths are too short for a GPU, whose time there is launch overhead, not n^2
    result = run_experiment("scaling", out=tmp_path, quick=True, seed=0, progress=False, device="cpu")
    r = _written(result, tmp_path)["results"]
    assert min(r["lengths"][1:]) >= 1024  # large n: the n^2 term dominates
    exponent = r["exponent_in_n_large"]["attention"]["forward"]
    assert 1.5 <= exponent <= 2.5, (exponent, r["by_length"])
    assert r["sequential_steps"]["rnn"] == r["lengths"] and set(r["sequential_steps"]["attention"]) == {1}
    for kind in ("attention", "rnn"):
        for mode in ("forward", "backward"):
            times = r["by_length"][kind][mode]
            per_token = r["time_per_token"][kind][mode]
            assert all(t > 0 for t in times) and len(r["by_dim"][kind][mode]) == len(r["dims"])
            assert per_token == pytest.approx([t / n for t, n in zip(times, r["lengths"])], rel=1e-4)


def test_power_law_fit_and_layers():
    sizes = [64, 128, 512, 4096]
    exponent, coefficient = fit_power_law(sizes, [3e-9 * n**2 for n in sizes])
    assert exponent == pytest.approx(2.0) and coefficient == pytest.approx(3e-9)
    with pytest.raises(ValueError, match="positive"):
        fit_power_law([1, 2], [0.0, 1.0])
    layer = scaling.build_layer("attention", 256, 64, torch.device("cpu"))
    assert layer.num_heads == 4
    with pytest.raises(ValueError, match="large_length"):
        scaling.ScalingConfig(lengths=(64, 128), large_length=1024)


# ---------------------------------------------------------------- permutation


def test_permutation_claims(tmp_path):
    result = run_experiment("permutation", out=tmp_path, quick=True, seed=0)
    r = _written(result, tmp_path)["results"]
    errors = r["errors"]
    assert errors["none"]["float64"] < 1e-6  # equivariant without positional encoding
    assert errors["none"]["float32"] < 1e-4  # ... up to float32 rounding
    assert errors["sinusoidal"]["float64"] > 1e-2  # not with it
    assert errors["learned"]["float64"] > 1e-3
    assert r["offset_spread_sinusoidal"] < 1e-4
    assert all(result.claims.values()), result.claims


def test_offset_spread_reference():
    # PE(p) . PE(p + k) = sum_i cos(w_i k): independent of p for the sinusoidal table ...
    assert offset_spread(sinusoidal_table(50, 16)) < 1e-5
    # ... and not for an arbitrary table
    assert offset_spread(torch.randn(50, 16)) > 1.0


# ---------------------------------------------------------------- vit-digits


def test_vit_digits_quick(tmp_path):
    result = run_experiment("vit-digits", out=tmp_path, quick=True, seed=0, progress=False)
    r = _written(result, tmp_path)["results"]
    assert r["test_images"] == 360 and r["train_images"] == 1437 and r["tokens"] == 17
    assert r["test_accuracy"] > 0.6  # chance is 0.1; the full run is held to 0.95 (test_vit_digits_full)
    assert r["loss_per_epoch"][-1] < 0.7 * r["loss_per_epoch"][0]
    low, high = r["cls_attention_row_sums"]
    assert low == pytest.approx(1.0, abs=1e-5) and high == pytest.approx(1.0, abs=1e-5)
    for example in r["examples"]:
        assert len(example["cls_attention_last_layer"]) == 16
        assert sum(example["cls_attention_rollout"]) <= 1.0 + 1e-5


@pytest.mark.slow
def test_vit_digits_full(tmp_path):
    result = run_experiment("vit-digits", out=tmp_path, quick=False, seed=0, progress=False)
    assert result.results["test_accuracy"] >= 0.95


def test_patches_and_rollout():
    images = torch.arange(2 * 64, dtype=torch.float32).view(2, 8, 8)
    ours = vit_digits.patchify(images, 2)  # (b, 16, 4)
    reference = F.unfold(images[:, None], kernel_size=2, stride=2).transpose(1, 2)  # (b, 16, 4)
    torch.testing.assert_close(ours, reference)
    shifted = vit_digits.random_shift(images, 1, torch.Generator().manual_seed(0))
    assert shifted.shape == images.shape
    # rollout through layers that attend uniformly is uniform (rows of (I + U) / 2 products)
    uniform = torch.full((1, 2, 5, 5), 0.2)
    rollout = vit_digits.attention_rollout([uniform, uniform])
    torch.testing.assert_close(rollout.sum(-1), torch.ones(1, 5))
    expected = (0.5 * torch.eye(5) + 0.1) @ (0.5 * torch.eye(5) + 0.1)
    torch.testing.assert_close(rollout[0], expected)


# ---------------------------------------------------------------- report and CLI


def test_cli_and_report(tmp_path, capsys):
    out = tmp_path / "exp"
    assert main(["experiment", "softmax-scaling", "--quick", "--out", str(out), "--no-progress"]) == 0
    assert main(["experiment", "permutation", "--quick", "--out", str(out), "--seed", "3"]) == 0
    printed = capsys.readouterr().out
    assert "scores x100" in printed and "[holds]" in printed and "FAILS" not in printed
    (out / "loose").mkdir()
    (out / "loose" / "extra.png").write_bytes((out / "permutation" / "permutation.png").read_bytes())
    assert main(["report", "--out", str(out)]) == 0
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 3  # two experiments' figures and the loose one
    assert "softmax-scaling" in page and "permutation" in page and "Other figures" in page
    assert "--seed 3" in page
    # self-contained: nothing is fetched from anywhere
    assert not re.search(r"(src|href)=['\"]?(https?:)?//", page) and "<script" not in page
    assert "default-src 'none'" in page
    assert build_report(out).count("<section") == 3


def test_report_and_experiment_errors(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["report", "--out", str(empty)]) == 2
    assert "no results.json" in capsys.readouterr().err
    assert main(["report", "--out", str(tmp_path / "missing")]) == 2
    with pytest.raises(ValueError, match="unknown experiment"):
        run_experiment("nope", out=tmp_path)
    assert set(EXPERIMENTS) == {"softmax-scaling", "long-range", "scaling", "permutation", "vit-digits"} | {
        "positions-extrapolation",  # tests/test_modern_experiments.py
        "gqa-memory-quality",
        "window-recall",
    }
    assert main(["experiment", "permutation", "--quick", "--threads", "0", "--out", str(tmp_path)]) == 2

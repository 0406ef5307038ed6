"""Long-range dependencies: recurrent networks forget, attention connects any two tokens in one step.

The task: the first token is one of ``K`` symbols, then come ``N`` noise tokens, then a query
token; the answer is the first symbol. Its information has to travel ``N + 1`` steps through a
recurrence, or one step through attention. A vanilla tanh RNN, an LSTM and a one-layer attention
model, with matched parameter counts, are trained for each ``N`` and tested on fresh sequences.

The gradient that reaches step ``t`` from the last step passes through ``dh_T/dh_t =
prod_s diag(1 - h_s^2) W_hh`` in a tanh RNN: a product of ``T - t`` matrices whose norm shrinks
geometrically when the recurrent weights are contractive (the vanishing gradient, Bengio et al.,
1994). Attention's output at ``T`` depends on every input through one softmax-weighted sum, so
its gradient does not depend on the distance (section 4 of the paper: path length O(1)).

Shape legend: ``b`` batch, ``T`` sequence length (``N + 2``), ``e`` embedding size, ``h`` hidden
size, ``d`` d_model.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import asdict
from pathlib import Path

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from qkv.experiments.common import (
    ExperimentResult,
    Stopwatch,
    experiment_dir,
    flush_denormals,
    new_figure,
    pick_device,
    rounded,
    save_figure,
    seeded,
    write_results,
)
from qkv.experiments.long_range_models import (  # the task and its models; re-exported from here
    QUICK,
    AttentionClassifier,
    Classifier,
    LongRangeConfig,
    RecurrentClassifier,
    accuracy,
    build_models,
    count_parameters,
    make_batch,
    matched_hidden_size,  # noqa: F401  (re-exported)
    recurrent_parameters,  # noqa: F401  (re-exported)
    train_model,
)

logger = logging.getLogger(__name__)

NAME = "long-range"
MODELS = ("rnn", "lstm", "attention")


def _tanh_rnn(model: Classifier) -> nn.RNN:
    """``model``'s tanh RNN; ValueError for any other model."""
    if not isinstance(model, RecurrentClassifier) or not isinstance(model.rnn, nn.RNN):
        kind = model.kind if isinstance(model, RecurrentClassifier) else type(model).__name__
        raise ValueError(f"hidden-state Jacobians are computed for the tanh RNN, got kind={kind!r}")
    return model.rnn


def rnn_hidden_states(model: Classifier, tokens: Tensor) -> Tensor:
    """The tanh RNN's hidden states recomputed step by step in float64, ``(b, T, h)``."""
    rnn = _tanh_rnn(model)
    w_ih, w_hh = rnn.get_parameter("weight_ih_l0").double(), rnn.get_parameter("weight_hh_l0").double()
    bias = (rnn.get_parameter("bias_ih_l0") + rnn.get_parameter("bias_hh_l0")).double()
    x = model.embed(tokens).double() @ w_ih.T + bias  # (b, T, h)
    h = x.new_zeros(x.size(0), w_hh.size(0))
    states = []
    for t in range(x.size(1)):
        h = torch.tanh(x[:, t] + h @ w_hh.T)  # (b, h)
        states.append(h)
    return torch.stack(states, dim=1)  # (b, T, h)


@torch.no_grad()
def rnn_jacobian_norms(model: Classifier, tokens: Tensor) -> list[float]:
    """Spectral norm of ``dh_T / dh_t`` for ``T - t = 1 .. T - 1``, averaged over the batch.

    ``dh_s / dh_{s-1} = diag(1 - h_s^2) W_hh``, so ``dh_T / dh_t`` is the product of these
    Jacobians for ``s = T, T-1, ..., t+1``, accumulated from the end in float64.

    Returns:
        ``norms[k - 1]`` for distance ``k``.
    """
    states = rnn_hidden_states(model, tokens)  # (b, T, h)
    w_hh = _tanh_rnn(model).get_parameter("weight_hh_l0").double()
    b, length, hidden = states.shape
    product = torch.eye(hidden, dtype=torch.float64, device=states.device).expand(b, hidden, hidden)
    norms = []
    for s in range(length - 1, 0, -1):  # s = T .. 2 (0-based: T-1 .. 1); the result is dh_T / dh_{s-1}
        step_jacobian = (1 - states[:, s] ** 2)[:, :, None] * w_hh  # (b, h, h): diag(1 - h_s^2) W_hh
        product = product @ step_jacobian  # (b, h, h)
        norms.append(torch.linalg.matrix_norm(product, ord=2).mean().item())
    return norms


def input_gradient_norms(model: Classifier, tokens: Tensor) -> list[float]:
    """Frobenius norm of ``d features_T / d x_t`` (the last representation against each input
    vector), averaged over the batch, for ``T - t = 0 .. T - 1``.

    Computed on a float64 copy of the model, and summed in the log domain: a vanishing gradient
    underflows float32 (below ~1e-45) long before it reaches the start of a 512-step sequence,
    and its square (~1e-316) underflows float64.

    Returns:
        ``norms[k]`` for distance ``k``.
    """
    model64 = copy.deepcopy(model).double().eval()
    x = model64.embed(tokens).detach().requires_grad_(True)  # (b, T, e), float64
    with torch.backends.cudnn.flags(enabled=False):  # cuDNN's RNN has no backward in eval mode
        features = model64.features(x)  # (b, f)
    log_squared = torch.full(x.shape[:2], float("-inf"), dtype=torch.float64, device=x.device)  # (b, T)
    for i in range(features.size(-1)):
        (grad,) = torch.autograd.grad(features[:, i].sum(), x, retain_graph=True)  # rows are independent
        grad = grad.double()
        largest = grad.abs().amax(-1, keepdim=True)  # (b, T, 1)
        scale = largest.clamp_min(torch.finfo(torch.float64).tiny)
        log_norm = scale[..., 0].log() + (grad / scale).norm(dim=-1).log()  # log ||grad|| without underflow
        both_zero = torch.isneginf(log_squared) & torch.isneginf(log_norm)  # logaddexp(-inf, -inf) is nan
        log_squared = torch.where(both_zero, log_squared, torch.logaddexp(log_squared, 2 * log_norm))
    norms = (log_squared / 2).exp().mean(0)  # (T,)
    return norms.flip(0).tolist()  # index = distance T - t


def run(
    *,
    out: str | Path,
    quick: bool = False,
    seed: int = 0,
    device: str | None = None,
    config: LongRangeConfig | None = None,
    progress: bool = True,
) -> ExperimentResult:
    """Train the three models at every distance; measure accuracy and gradient norms; write
    ``results.json`` and ``long_range.png`` under ``<out>/long-range``."""
    config = config or (QUICK if quick else LongRangeConfig())
    dev = pick_device(device)
    folder = experiment_dir(out, NAME)
    longest = max(config.distances)
    accuracy_by_model: dict[str, list[float]] = {m: [] for m in MODELS}
    training: dict[str, list[dict]] = {m: [] for m in MODELS}
    with Stopwatch() as watch, seeded(seed, dev), flush_denormals():
        generator = torch.Generator().manual_seed(seed)
        jacobian_tokens, _ = make_batch(config, config.jacobian_batch, longest, generator)
        jacobian_tokens = jacobian_tokens.to(dev)
        init_models = {k: m.to(dev) for k, m in build_models(config, longest + 2).items()}
        parameters = {k: count_parameters(m) for k, m in init_models.items()}
        rnn_init = rnn_jacobian_norms(init_models["rnn"], jacobian_tokens)
        attention_init = input_gradient_norms(init_models["attention"], jacobian_tokens)
        trained: dict[str, Classifier] = {}
        jobs = [(n, m) for n in config.distances for m in MODELS]
        models: dict[str, Classifier] = {}
        for distance, kind in tqdm(jobs, desc=NAME, unit="run", disable=not progress):
            if kind == MODELS[0]:  # fresh models for each distance; the longest reuses the measured ones
                models = init_models if distance == longest else build_models(config, distance + 2)
            model = models[kind]
            info = train_model(model, config, distance, generator, dev)
            test_tokens, test_targets = (t.to(dev) for t in make_batch(config, config.eval_size, distance, generator))
            acc = accuracy(model, test_tokens, test_targets)
            accuracy_by_model[kind].append(acc)
            training[kind].append({"distance": distance, "accuracy": acc, **info})
            logger.debug("%s N=%d: accuracy %.3f after %d steps", kind, distance, acc, info["steps"])
            if distance == longest:
                trained[kind] = model
            if kind == "rnn" and distance == min(config.distances):
                rnn_shortest = rnn_jacobian_norms(model, jacobian_tokens)  # an RNN that solved its task
        rnn_trained = rnn_jacobian_norms(trained["rnn"], jacobian_tokens)
        input_trained = {k: input_gradient_norms(m, jacobian_tokens) for k, m in trained.items()}
    results = {
        "distances": list(config.distances),
        "accuracy": accuracy_by_model,
        "chance": 1.0 / config.num_symbols,
        "parameters": parameters,
        "training": training,
        "rnn_jacobian_norm": {
            "distance": list(range(1, len(rnn_init) + 1)),
            "init": rnn_init,
            "trained": rnn_trained,
            "trained_shortest": rnn_shortest,
        },
        "input_gradient_norm": {
            "distance": list(range(len(attention_init))),
            "attention_init": attention_init,
            **{f"{k}_trained": v for k, v in input_trained.items()},
        },
    }
    claims = _claims(results)
    summary = _summary(results, config)
    fig_name = "long_range.png"
    _plot(results, config, folder / fig_name)
    result = ExperimentResult(
        name=NAME,
        quick=quick,
        seed=seed,
        config=asdict(config) | {"device": str(dev)},
        results=_jsonable(results),
        claims=claims,
        summary=summary,
        figures=[fig_name],
        seconds=watch.seconds,
    )
    write_results(result, folder)
    return result


def _jsonable(results: dict) -> dict:
    """Round floats; tiny Jacobian norms keep their exponent (they underflow float32 on purpose)."""
    return rounded(results, 6)


def _at(norms: list[float], distance: int) -> float:
    return norms[min(distance, len(norms)) - 1]


def _claims(results: dict) -> dict[str, bool]:
    acc = results["accuracy"]
    rnn = results["rnn_jacobian_norm"]
    return {
        "attention beats the RNN at the longest distance": acc["attention"][-1] > acc["rnn"][-1],
        "the RNN's gradient norm falls with distance (init)": rnn["init"][-1] < 1e-3 * rnn["init"][0],
        "the RNN's gradient norm falls with distance (trained)": rnn["trained"][-1] < 1e-3 * rnn["trained"][0],
    }


def _longest_solved(distances: list[int], accuracies: list[float], threshold: float = 0.9) -> int | None:
    solved = [n for n, a in zip(distances, accuracies) if a >= threshold]
    return max(solved) if solved else None


def _summary(results: dict, config: LongRangeConfig) -> list[str]:
    distances = results["distances"]
    lines = [
        f"recall the first of {config.num_symbols} symbols after N noise tokens; chance {results['chance']:.3f}; "
        f"parameters " + ", ".join(f"{k} {v:,}" for k, v in results["parameters"].items())
    ]
    for kind in MODELS:
        accs = " ".join(f"{n}:{a:.2f}" for n, a in zip(distances, results["accuracy"][kind]))
        solved = _longest_solved(distances, results["accuracy"][kind])
        lines.append(f"{kind:>9} accuracy by N  {accs}  (longest N with >= 0.9: {solved})")
    rnn = results["rnn_jacobian_norm"]
    labels = {
        "init": "at init",
        "trained": f"trained at N={max(distances)}",
        "trained_shortest": f"trained at N={min(distances)}",
    }
    for when, label in labels.items():
        norms = rnn[when]
        picks = [k for k in (1, 10, 50, len(norms)) if k <= len(norms)]
        text = ", ".join(f"T-t={k}: {_at(norms, k):.2e}" for k in picks)
        lines.append(f"RNN ||dh_T/dh_t|| ({label}): {text}")
    grads = results["input_gradient_norm"]
    far = len(grads["attention_trained"]) - 1
    text = ", ".join(f"{kind} {grads[f'{kind}_trained'][far]:.2e}" for kind in MODELS)
    lines.append(f"gradient from the last step to the first token (T-t={far}), trained models: {text}")
    return lines


def _plot(results: dict, config: LongRangeConfig, path: Path) -> None:
    fig = new_figure(12, 4.4)
    ax_acc, ax_rnn, ax_in = fig.subplots(1, 3)
    colors = {"rnn": "tab:red", "lstm": "tab:orange", "attention": "tab:blue"}
    for kind in MODELS:
        ax_acc.plot(
            results["distances"],
            results["accuracy"][kind],
            "o-",
            color=colors[kind],
            label=f"{kind} ({results['parameters'][kind]:,} params)",
        )
    ax_acc.axhline(results["chance"], color="gray", ls=":", label="chance")
    ax_acc.set_xscale("log", base=2)
    ax_acc.set_xlabel("N (tokens between the symbol and the question)")
    ax_acc.set_ylabel("test accuracy")
    ax_acc.set_ylim(0, 1.05)
    ax_acc.set_title(f"recall after N steps (<= {config.max_steps} training steps)")
    ax_acc.legend(fontsize=8)

    rnn = results["rnn_jacobian_norm"]
    tiny = 1e-300  # keep log plots finite where the product underflows to exactly 0
    ax_rnn.semilogy(rnn["distance"], [max(v, tiny) for v in rnn["init"]], color="tab:red", ls="--", label="RNN at init")
    longest, shortest = max(results["distances"]), min(results["distances"])
    ax_rnn.semilogy(
        rnn["distance"], [max(v, tiny) for v in rnn["trained"]], color="tab:red", label=f"RNN trained at N = {longest}"
    )
    ax_rnn.semilogy(
        rnn["distance"],
        [max(v, tiny) for v in rnn["trained_shortest"]],
        color="tab:purple",
        ls=":",
        label=f"RNN trained at N = {shortest}",
    )
    ax_rnn.set_xlabel("T - t")
    ax_rnn.set_ylabel("||dh_T / dh_t||  (spectral norm)")
    ax_rnn.set_title("the RNN's gradient vanishes with distance")
    ax_rnn.legend(fontsize=8)

    grads = results["input_gradient_norm"]
    d = grads["distance"]
    ax_in.semilogy(
        d, [max(v, tiny) for v in grads["attention_init"]], color="tab:blue", ls="--", label="attention at init"
    )
    for kind in MODELS:
        ax_in.semilogy(d, [max(v, tiny) for v in grads[f"{kind}_trained"]], color=colors[kind], label=f"{kind} trained")
    ax_in.set_xlabel("T - t")
    ax_in.set_ylabel("||d output_T / d input_t||")
    ax_in.set_title(f"gradient reaching input t (N = {max(results['distances'])})")
    ax_in.legend(fontsize=8)
    save_figure(fig, path)


__all__ = [
    "QUICK",
    "AttentionClassifier",
    "LongRangeConfig",
    "RecurrentClassifier",
    "build_models",
    "input_gradient_norms",
    "make_batch",
    "rnn_jacobian_norms",
    "run",
]

"""Muon (Jordan et al., 2024): momentum, orthogonalised by a quintic Newton-Schulz iteration, for
weight matrices. qkv's own, because ``torch.optim.Muon`` runs the iteration in bfloat16 always,
which a CPU without AVX512-BF16 emulates: on the 2-core AVX2 EPYC one iteration over a 512 x 128
matrix took 66 ms in bfloat16 and 2 ms in float32, so torch's Muon made a training step of the
medium character model several times slower than AdamW's. This one is torch's algorithm, its
hyperparameters and its state (``momentum_buffer``; a checkpoint of either resumes into the other),
with the iteration's precision a choice: bfloat16 (torch's) or float32."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

#: the quintic iteration's coefficients (torch's and Keller Jordan's)
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def orthogonalise(update: torch.Tensor, steps: int, dtype: torch.dtype, eps: float = 1e-7) -> torch.Tensor:
    """``update`` scaled to Frobenius norm 1, then ``steps`` times X <- a X + (b X X^T + c (X X^T)^2) X
    on its wide orientation, in ``dtype``; returned in ``dtype``."""
    a, b, c = NS_COEFFICIENTS
    x = update.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class Muon(torch.optim.Optimizer):
    """Muon over two-dimensional parameters: per step, the momentum buffer B <- mu B + (1 - mu) g,
    Nesterov's update g + mu (B - g), :func:`orthogonalise`'d in ``ns_dtype``; the weight decays by
    lr x weight_decay, then moves by -lr x sqrt(max(1, rows / cols)) x that update (torch's
    ``adjust_lr_fn="original"``).

    Args:
        params: the matrices.
        lr: the rate (the engine sets it each step).
        weight_decay: decoupled, as AdamW's.
        momentum: mu.
        ns_steps: Newton-Schulz iterations.
        ns_dtype: the iteration's precision: ``torch.bfloat16`` (torch's Muon) where bfloat16 is
            fast (CUDA), ``torch.float32`` on a CPU.
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        ns_steps: int = 5,
        ns_dtype: torch.dtype = torch.float32,
    ) -> None:
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=True, ns_steps=ns_steps)
        super().__init__(params, defaults)
        self.ns_dtype = ns_dtype
        for group in self.param_groups:
            if any(p.ndim != 2 for p in group["params"]):
                raise ValueError("Muon trains two-dimensional parameters only")

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One step over every matrix that has a gradient.

        Args:
            closure: recomputes the loss (called once, with gradients enabled), or None.

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, mu = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                buffer = state["momentum_buffer"]
                buffer.lerp_(p.grad, 1 - mu)
                update = p.grad.lerp(buffer, mu) if group["nesterov"] else buffer
                update = orthogonalise(update, group["ns_steps"], self.ns_dtype)
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update.to(p.dtype), alpha=-lr * math.sqrt(max(1.0, p.size(0) / p.size(1))))
        return loss

"""The optimizer a run trains with (:class:`~qkv.training.config.TrainConfig`'s ``optimizer``, its Adam
options and ``weight_decay``): Adam or AdamW for every parameter, or Muon for the weight matrices of
the layers beside AdamW for the rest (:class:`MuonWithAdamW`)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from qkv.training.config import TrainConfig
from qkv.training.muon import Muon
from qkv.training.schedule import learning_rate

#: the key of a parameter group whose rate is the schedule's times this factor (the engine reads it;
#: Muon's groups: its own base rate over the schedule's peak)
LR_SCALE = "lr_scale"


def make_optimizer(
    module: nn.Module, config: TrainConfig, *, fused: bool | None, d_model: int | None = None
) -> torch.optim.Optimizer:
    """The run's optimizer.

    ``config.optimizer == "adamw"``: Adam (section 5.3), or with ``config.weight_decay`` AdamW whose
    decay falls on the matrices (weights and embeddings, two dimensions or more) and not on biases or
    layer-norm gains. ``"muon"``: :class:`MuonWithAdamW`, qkv's :class:`~qkv.training.muon.Muon` for
    :func:`muon_matrices` (with ``config.muon_momentum`` and the same decoupled ``weight_decay``; its
    iteration in bfloat16 on CUDA as torch's Muon, in float32 on a CPU) and the above for every other
    parameter; Muon's rate is ``config.muon_lr`` at the schedule's peak and follows the schedule's shape.

    Args:
        module: what the engine trains (its parameters; under DDP or FSDP2 the wrapped module).
        config: the run's options.
        fused: PyTorch's fused Adam kernel (one over all parameters; 3x faster than the default
            per-tensor loop on a 2-core CPU), None for the default (FSDP2's sharded parameters).
        d_model: the width the schedule is scaled by (needed with ``optimizer="muon"``: the
            schedule's peak, which ``muon_lr`` stands for).

    Returns:
        The optimizer; every parameter group starts at rate 0 (the engine sets the schedule's rate
        before each step).
    """
    if config.optimizer == "adamw":
        return _adam(list(module.parameters()), config, fused)
    if d_model is None:
        raise ValueError("optimizer muon: make_optimizer needs d_model (the schedule's peak is muon_lr)")
    matrices = muon_matrices(module)
    if not matrices:
        raise ValueError(
            "optimizer (--optimizer) muon: the model has no weight matrices in a layer stack (a ModuleList "
            "named layers) for Muon to train; use --optimizer adamw"
        )
    chosen = {id(p) for p in matrices}
    rest = [p for p in module.parameters() if id(p) not in chosen]
    peak = learning_rate(config, config.warmup_steps, d_model)  # every schedule's rate at the end of warmup
    ns_dtype = torch.bfloat16 if matrices[0].device.type == "cuda" else torch.float32
    muon = Muon(matrices, lr=0.0, weight_decay=config.weight_decay, momentum=config.muon_momentum, ns_dtype=ns_dtype)
    muon.param_groups[0][LR_SCALE] = config.muon_lr / peak if peak > 0 else 0.0
    return MuonWithAdamW(muon, _adam(rest, config, fused))


def _adam(params: list[nn.Parameter], config: TrainConfig, fused: bool | None) -> torch.optim.Optimizer:
    """Adam over ``params`` in one group, or with ``weight_decay`` AdamW with the matrices decayed."""
    options: dict[str, Any] = dict(lr=0.0, betas=config.adam_betas, eps=config.adam_eps, fused=fused)
    if not config.weight_decay:  # one parameter group, as every run before the option (their checkpoints resume)
        return torch.optim.Adam(params, **options)
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": config.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], **options)


def muon_matrices(module: nn.Module) -> list[nn.Parameter]:
    """The parameters Muon trains: the two-dimensional weights inside the layer stacks (every
    ``nn.ModuleList`` named ``layers``: the attention projections and the feed-forward layers), but
    not an ``nn.Embedding``'s table. The embeddings, the output projection, norms and biases lie
    outside them or have one dimension; AdamW trains those.

    Args:
        module: the model, or the engine's module around it.

    Returns:
        The matrices, each once, in the order ``module.parameters()`` yields them.
    """
    tables = {id(p) for m in module.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    inside = {
        id(p)
        for name, stack in module.named_modules()
        if isinstance(stack, nn.ModuleList) and name.rsplit(".", 1)[-1] == "layers"
        for p in stack.parameters()
        if p.ndim == 2 and id(p) not in tables
    }
    return [p for p in module.parameters() if id(p) in inside]


def check_resumable(optimizer: torch.optim.Optimizer, saved: dict | None) -> None:
    """Refuse, in one line, a saved optimizer state that the other ``optimizer`` choice made (a run
    saved with Muon resumed with ``--optimizer adamw``, or the other way round).

    Args:
        optimizer: this run's optimizer.
        saved: the optimizer state the checkpoint holds (``param_groups`` and ``state``), or None.

    Raises:
        ValueError: naming the option and the choice the run was saved with.
    """
    if not isinstance(saved, dict) or not isinstance(saved.get("param_groups"), list):
        return  # nothing saved yet, or FSDP2's shards (which Muon never writes)

    def kind(groups: list) -> str:  # "ns_steps" is a hyperparameter of Muon's groups only
        return "muon" if any(isinstance(g, dict) and "ns_steps" in g for g in groups) else "adamw"

    was, now = kind(saved["param_groups"]), kind(optimizer.param_groups)
    if was != now:
        raise ValueError(
            f"the run was saved with optimizer (--optimizer) {was}, and this run's is {now}: resume with "
            f"--optimizer {was}"
        )


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon for some parameters and AdamW (or Adam) for the others, as one optimizer: one
    ``step``, ``zero_grad``, ``state_dict`` and ``load_state_dict`` over both, so the engine, the
    checkpoints and ``torch.distributed.checkpoint`` handle it like any other.

    Its ``param_groups`` are Muon's followed by AdamW's (the same dicts: setting a group's ``lr``
    sets that optimizer's), and one ``state`` mapping serves all three (each parameter is in one
    optimizer), so ``state_dict`` has torch's usual layout, the parameters numbered over all groups
    in that order, and a checkpoint of it resumes into another built the same way.

    Args:
        muon: the :class:`~qkv.training.muon.Muon` (or ``torch.optim.Muon``) of the weight matrices.
        adamw: the optimizer of every other parameter (``torch.optim.AdamW`` or ``Adam``).
    """

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer) -> None:
        self.muon, self.adamw = muon, adamw
        # the base class sets up hooks and bookkeeping; its groups are replaced by the two optimizers' own
        super().__init__([p for opt in (muon, adamw) for g in opt.param_groups for p in g["params"]], {})
        self._link(defaultdict(dict))

    def _link(self, state: defaultdict) -> None:
        """Share ``state`` and this object's groups with the two optimizers."""
        self.state = self.muon.state = self.adamw.state = state
        self.param_groups = [*self.muon.param_groups, *self.adamw.param_groups]

    @torch.no_grad()  # (one signature in place of torch's two overloads, hence the ignore)
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One step of both optimizers.

        Args:
            closure: recomputes the loss (called once, with gradients enabled), or None.

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned (the saved hyperparameters with it, as torch's
        optimizers do, except each group's ``lr_scale``, which stays this run's).

        Args:
            state_dict: ``{"state": ..., "param_groups": [...]}``, Muon's groups first.
        """
        saved, count = state_dict.get("param_groups", []), len(self.muon.param_groups)
        kinds = ["ns_steps"] * count + ["betas"] * len(self.adamw.param_groups)  # a key only that optimizer has
        if len(saved) != len(kinds) or any(key not in group for key, group in zip(kinds, saved)):
            raise ValueError(
                "the saved optimizer state is not Muon's beside AdamW's as this run's optimizer (--optimizer "
                "muon) is: resume with the optimizer the run was saved with"
            )
        scales = [g.get(LR_SCALE) for g in self.param_groups]
        super().load_state_dict(state_dict)  # new group dicts (saved values, these parameters) and state
        self.muon.param_groups, self.adamw.param_groups = self.param_groups[:count], self.param_groups[count:]
        self._link(self.state)
        for group, scale in zip(self.param_groups, scales):
            if scale is not None:
                group[LR_SCALE] = scale

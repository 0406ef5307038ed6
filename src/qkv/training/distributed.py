"""One process or many, through PyTorch's own distributed stack: the process group comes from
torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``...), gradients
are averaged by DDP or sharded by FSDP2 (``fully_shard``), and every collective is torch's.

With no torchrun environment everything here is a no-op on one process, so the same engine runs
on a laptop and on a cluster. gloo on CPUs, NCCL on CUDA (one device per local rank).
"""

from __future__ import annotations

import copy
import datetime
import logging
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from qkv.runtime.device import pick_device
from qkv.runtime.fileio import fsync_dir

logger = logging.getLogger(__name__)
T = TypeVar("T")

STRATEGIES = ("ddp", "fsdp")


@dataclass
class Distributed:
    """Where this process stands among the processes of one run."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def enabled(self) -> bool:
        """True when several processes train (``world_size > 1``): the collectives then communicate."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that logs, validates and writes files."""
        return self.rank == 0

    # ---------------------------------------------------------------- collectives (no-ops alone)
    def barrier(self) -> None:
        """Wait until every process has reached this point (nothing to wait for on one process)."""
        if self.enabled:
            dist.barrier()

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Sum each value over the processes (float64, so token counts stay exact)."""
        if not self.enabled:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.float64, device=self._collective_device)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor.tolist()

    def broadcast(self, obj: T) -> T:
        """Rank 0's ``obj`` on every process."""
        if not self.enabled:
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src=0)
        return holder[0]

    def gather(self, obj: object) -> list | None:
        """Every process's ``obj``, as a list on rank 0 (None elsewhere)."""
        if not self.enabled:
            return [obj]
        out: list | None = [None] * self.world_size if self.is_main else None
        dist.gather_object(obj, out, dst=0)
        return out

    @property
    def _collective_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")


def init_distributed(device: str | torch.device | None = None, *, timeout_minutes: float = 30.0) -> Distributed:
    """Join the process group that torchrun describes in the environment, or stay alone.

    Args:
        device: ``cpu`` forces gloo on CPUs; None/``auto``/``cuda`` uses one GPU per local rank
            (NCCL) when CUDA is present.
        timeout_minutes: how long a collective waits for a process that does not come (then
            every process fails with an error instead of hanging).
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1 and not dist.is_initialized():
        return Distributed(device=pick_device(device))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))  # the rank itself comes from the process group
    use_cuda = torch.cuda.is_available() and (device is None or str(device) == "auto" or str(device).startswith("cuda"))
    if device is not None and str(device).startswith("cuda") and not torch.cuda.is_available():
        pick_device(device)  # raises the one-line error
    if use_cuda:
        if local_rank >= torch.cuda.device_count():
            raise ValueError(
                f"local rank {local_rank} but only {torch.cuda.device_count()} CUDA "
                f"device{'' if torch.cuda.device_count() == 1 else 's'} here; "
                "start at most that many processes per machine (--nproc_per_node)"
            )
        torch.cuda.set_device(local_rank)
        chosen = torch.device("cuda", local_rank)
    else:
        chosen = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if use_cuda else "gloo",
            timeout=datetime.timedelta(minutes=timeout_minutes),
            device_id=chosen if use_cuda else None,
        )
    info = Distributed(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank, device=chosen)
    if info.is_main:
        logger.info("training on %d processes (%s, %s)", info.world_size, dist.get_backend(), chosen.type)
    return info


def shutdown() -> None:
    """Leave the process group (at the end of a run, so torchrun sees a clean exit)."""
    if dist.is_initialized():
        dist.destroy_process_group()


class LossForward(nn.Module):
    """Routes a model's loss through ``forward``, because DDP and FSDP2 act in ``__call__``
    (gradient hooks, parameter gathering): ``module(*args) == loss_fn(model, *args)``."""

    def __init__(self, model: nn.Module, loss_fn: Callable) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        """The loss of the wrapped model on one batch.

        Args:
            *args: what ``loss_fn`` takes after the model (e.g. the batch).
            **kwargs: passed to ``loss_fn`` too.

        Returns:
            ``loss_fn(model, *args, **kwargs)``.
        """
        return self.loss_fn(self.model, *args, **kwargs)


def wrap(model: nn.Module, loss_fn: Callable, ctx: Distributed, strategy: str = "ddp") -> nn.Module:
    """The module the training step calls: ``LossForward(model)``, under DDP or FSDP2 when
    several processes train. FSDP2 shards each encoder/decoder layer, then the root (the
    embeddings, the tied output projection and the final norms), the order PyTorch documents."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {STRATEGIES}")
    module = LossForward(model, loss_fn)
    if not ctx.enabled:
        return module
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(module, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # the mesh named for this process's device: left to itself, FSDP2 builds it on CUDA whenever CUDA
    # is present, and a gloo run on such a machine's CPUs then fails (rank 1 asks for a second GPU)
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    for stack in (getattr(model, "encoder", None), getattr(model, "decoder", None)):
        for layer in getattr(stack, "layers", []):
            fully_shard(layer, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module


@contextmanager
def gradient_sync(module: nn.Module, enabled: bool) -> Iterator[None]:
    """Skip the gradient all-reduce (DDP ``no_sync``) or reduce-scatter (FSDP2) of a micro-batch
    that is not the last of its step; the last one synchronises the accumulated gradients."""
    if enabled:
        yield
        return
    wrapped: Any = module  # DDP's and FSDP2's methods, found by name
    if hasattr(wrapped, "no_sync"):  # DDP
        with wrapped.no_sync():
            yield
    elif hasattr(wrapped, "set_requires_gradient_sync"):  # FSDP2
        wrapped.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            wrapped.set_requires_gradient_sync(True)
    else:  # one process: nothing to synchronise
        yield


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, sharded: bool) -> tuple[dict, dict | None]:
    """Full (unsharded) CPU copies of the model's and the optimizer's state, keyed by parameter
    name, whatever the strategy. A collective under FSDP2: every process must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    if optimizer is not None and not optimizer.state:
        # before the first step there is nothing to save, and get_optimizer_state_dict would create
        # the state by stepping with zero gradients: Adam's step count 1, its first real step then
        # bias-corrected as a second one
        optimizer = None
    if not sharded:  # the live tensors: torch.save writes them at once, tied weights stored once
        optim = get_optimizer_state_dict(model, optimizer) if optimizer is not None else None
        return model.state_dict(), optim
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options)
    optim = get_optimizer_state_dict(model, optimizer, options=options) if optimizer is not None else None
    return weights, optim


def load_full_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, weights: dict, optim: dict | None, sharded: bool
) -> None:
    """Load what :func:`full_state` returned (on every process) into a plain or sharded model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, strict=True)
    if sharded:  # each process keeps its shard of every tensor (tied weights are one parameter: set once)
        from torch.distributed.tensor import DTensor, distribute_tensor

        with torch.no_grad():
            persistent = [(n, b) for n, b in model.named_buffers() if n in weights]  # others are rebuilt
            for name, tensor in [*model.named_parameters(), *persistent]:
                full = weights[name].to(tensor.dtype)
                if isinstance(tensor, DTensor):
                    tensor.copy_(distribute_tensor(full.to(tensor.device), tensor.device_mesh, tensor.placements))
                else:
                    tensor.copy_(full)
    else:
        model.load_state_dict(weights, strict=True)
    if optimizer is not None and optim is not None:
        if all(isinstance(k, int) for k in optim.get("state", {})):  # a plain optimizer.state_dict() (older runs)
            optimizer.load_state_dict(optim)
        else:
            set_optimizer_state_dict(model, optimizer, optim, options=options)


SHARDS_PREFIX, SHARDS_SUFFIX = "optimizer-step", ".dcp"


def save_optimizer_shards(
    model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path, step: int, ctx: Distributed
) -> dict | None:
    """Write the optimizer state with ``torch.distributed.checkpoint``: every process writes its
    own shard (no process ever holds the whole state), plus the metadata that lets any number of
    processes, sharded or not, read it back. The folder ``optimizer-step<N>-<tag>.dcp`` is made
    under a temporary name and renamed when whole; the caller's ``state.pt`` then names it, and
    only after that does :func:`remove_optimizer_shards` drop older ones. A collective.

    Returns what ``state.pt`` stores (``{"shards": folder name}``), or None before the first step.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    if not optimizer.state:
        return None
    name = ctx.broadcast(f"{SHARDS_PREFIX}{step}-{secrets.token_hex(4)}{SHARDS_SUFFIX}")
    partial = Path(folder) / f".{name}.partial"
    dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=str(partial))
    if ctx.is_main:
        os.replace(partial, Path(folder) / name)
        fsync_dir(Path(folder))
    return {"shards": name}


def remove_optimizer_shards(folder: Path, keep: str | None) -> None:
    """Remove the optimizer-shard folders other than ``keep`` (older saves, and the partly
    written ones of a killed run). Rank 0, after ``state.pt`` names ``keep``."""
    for path in [
        *Path(folder).glob(f"{SHARDS_PREFIX}*{SHARDS_SUFFIX}"),
        *Path(folder).glob(f".{SHARDS_PREFIX}*.partial"),
    ]:
        if path.name != keep and path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)


def load_optimizer_shards(model: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Read the folder :func:`save_optimizer_shards` wrote into ``optimizer``, resharded to this
    process's share (or whole, on one process). A collective when several processes run."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    from qkv.runtime.safe_load import safe_dcp_load

    # the template: the optimizer's state laid out for this process (created here if still empty;
    # every value in it is then overwritten by the saved one)
    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    safe_dcp_load(state, path, no_dist=not (dist.is_available() and dist.is_initialized()))  # runs no pickled code
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


def plain_copy(model: nn.Module) -> nn.Module:
    """An unsharded CPU copy of ``model`` (made before sharding), for rank 0 to validate and save with."""
    return copy.deepcopy(model).to("cpu")

"""One contender of the GPU benchmark (:mod:`qkv.bench.gpu`) stepping through its batches, and the
figures drawn from its timed steps: tokens/s, TFLOP/s, MFU, ratios between contenders, and how the
``paper-base`` figures stand against the targets (40% MFU on an H100 in bf16, 1.3x MarianMT)."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch import nn

from qkv.bench.competitors import count_parameters
from qkv.bench.timing import peak_memory_bytes, synchronize
from qkv.training import Trainer

MFU_TARGET = 0.40  # qkv paper-base, bf16, on an H100
MARIAN_TARGET = 1.3  # qkv paper-base's tokens/s over MarianMT's


def describe_error(err: BaseException) -> str:
    """``Type: first line`` of an error (out of memory, an unsupported kernel), at most 200 characters."""
    lines = str(err).strip().splitlines() or [""]
    return f"{type(err).__name__}: {lines[0][:200]}"


class Runner:
    """Steps ``trainer`` through ``batches`` in order, cycling, and adds up its timed steps.

    Every contender of a section makes the same number of steps (warm-up, profile, rounds), so the
    ``k``-th step of each trains on the same batch; ``flops[i]`` is batch ``i``'s model FLOPs.
    """

    def __init__(self, name: str, trainer: Trainer, batches: list, flops: list[int], device: torch.device) -> None:
        self.name, self.trainer, self.batches, self.flops, self.device = name, trainer, batches, flops, device
        self.position = 0
        self.ready = True  # False once it failed, or its compilation was skipped
        self.warm_step_s = 0.0  # a warm step's duration, to plan rounds with
        self.samples: list[float] = []  # seconds of each timed sample
        self.steps = self.tokens = self.flops_done = 0

    @staticmethod
    def count_parameters(model: nn.Module) -> int:
        """The number of parameters of ``model``."""
        return count_parameters(model)

    def _step(self) -> int:
        index = self.position % len(self.batches)
        self.position += 1
        self.trainer.step([self.batches[index]])
        return index

    def one_step(self) -> None:
        """One untimed step (for the profiler)."""
        self._step()

    def warm_up(self) -> dict[str, Any]:
        """One untimed step on every distinct batch, the last one measuring peak memory."""
        durations = []
        for _ in range(len(self.batches) - 1):
            synchronize(self.device)
            start = time.perf_counter()
            self._step()
            synchronize(self.device)
            durations.append(time.perf_counter() - start)
        start = time.perf_counter()
        peak = peak_memory_bytes(self._step, self.device)
        durations.append(time.perf_counter() - start)
        warm = durations[1:] or durations
        self.warm_step_s = statistics.median(warm)
        return {
            "warmup_steps": len(durations),
            "warmup_s": sum(durations),
            "first_step_s": durations[0],
            "peak_step_bytes": peak,
        }

    def timed(self, steps: int) -> float:
        """``steps`` timed steps (one sample); returns their seconds."""
        synchronize(self.device)
        start = time.perf_counter()
        done = [self._step() for _ in range(steps)]
        synchronize(self.device)
        seconds = time.perf_counter() - start
        self.samples.append(seconds)
        self.steps += steps
        self.tokens += sum(self.batches[i].num_tgt_tokens for i in done)
        self.flops_done += sum(self.flops[i] for i in done)
        return seconds

    def figures(self, peak_flops: float | None) -> dict[str, Any]:
        """Tokens/s, TFLOP/s and MFU over every timed step so far."""
        seconds = sum(self.samples)
        tflops = self.flops_done / seconds / 1e12 if seconds else None
        return {
            "steps_timed": self.steps,
            "seconds": seconds,
            "target_tokens": self.tokens,
            "flops": self.flops_done,
            "tokens_per_s": self.tokens / seconds if seconds else None,
            "tflops_per_s": tflops,
            "mfu": tflops * 1e12 / peak_flops if tflops is not None and peak_flops else None,
            "median_step_s": statistics.median(self.samples) / (self.steps / len(self.samples)),
        }


def section_ratios(entry: dict[str, Any], section: Any) -> dict[str, Any]:
    """Tokens/s ratios of the section's contenders (``a_vs_b``: a's over b's), over all timed steps
    and as the median of the per-round ratios (both ran the same batches in a round)."""
    qkv, compiled, hf = section.contenders
    figures = entry["contenders"]
    out: dict[str, Any] = {}
    for a, b in ((qkv, hf), (compiled, hf), (compiled, qkv)):
        tps_a, tps_b = figures.get(a, {}).get("tokens_per_s"), figures.get(b, {}).get("tokens_per_s")
        if not (tps_a and tps_b):
            continue
        rounds = [r["seconds"] for r in entry["rounds"] if a in r["seconds"] and b in r["seconds"]]
        out[f"{a}_vs_{b}"] = {
            "tokens_per_s": tps_a / tps_b,
            "median_per_round": statistics.median(r[b] / r[a] for r in rounds) if rounds else None,
        }
    return out


def targets(sections: dict[str, Any], gpu: str | None) -> dict[str, Any]:
    """``paper-base`` against the targets: the better of qkv eager and compiled, each target's
    measured value and whether it is met (None where it was not measured)."""
    base = sections.get("paper-base", {}).get("contenders", {})
    ratios = sections.get("paper-base", {}).get("ratios", {})
    mfu = {n: base[n].get("mfu") for n in ("qkv", "qkv+compile") if base.get(n, {}).get("mfu") is not None}
    speed = {n: ratios[f"{n}_vs_marian"]["tokens_per_s"] for n in ("qkv", "qkv+compile") if f"{n}_vs_marian" in ratios}
    out: dict[str, Any] = {"gpu": gpu, "note": "the targets are for an H100 in bf16"}
    for key, target, values in (("paper_base_mfu", MFU_TARGET, mfu), ("paper_base_vs_marian", MARIAN_TARGET, speed)):
        best = max(values, key=lambda n: values[n]) if values else None
        measured = values[best] if best is not None else None
        out[key] = {
            "target": target,
            "measured": measured,
            "by": best,
            "met": None if measured is None else measured >= target,
        }
        if out[key]["met"] is False and best is not None:  # where it falls short: the step's profile says why
            out[key]["limits"] = base[best].get("profile", {}).get("summary")
    return out

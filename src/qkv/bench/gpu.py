"""The GPU benchmark in one call (``benchmarks/gpu.py``): training steps of qkv, eager and compiled,
against Hugging Face's models of the same sizes, within a fixed wall time, the JSON rewritten after
every measurement so that a run cut short keeps what it measured.

For each section (``paper-base``, ``paper-big``, ``lm``; :mod:`qkv.bench.gpu_models`) the run
builds the contenders, warms each up over every distinct batch (compilation, autotuning and the
allocator's growth happen there, untimed), profiles one step of each (``paper-base`` by default),
then times interleaved rounds: each round every contender trains ``steps_per_round`` steps on the
same batches, the order rotating. A contender's figures are over all its timed steps:

* ``tokens_per_s``: target tokens trained per second (the paper's batches count target tokens);
* ``tflops_per_s``: model FLOPs (:mod:`qkv.models.flops`, real tokens only, the same count for
  qkv's and Hugging Face's model) per second, / 1e12; ``mfu``: that over the device's peak in the
  compute dtype (:func:`qkv.runtime.peaks.peak_flops`; None where no peak is known);
* ``peak_memory_bytes``: the parameters and optimizer state plus what one step allocates at its
  peak above them (CUDA's allocator; the resident set's high-water mark on a Linux CPU).

The time budget is split between the sections (45%, 30%, 25%, what one leaves going to the next);
``torch.compile`` gets at most ``compile_seconds`` of it and is skipped, with the reason recorded,
when it takes longer. A round starts only when the previous one's duration fits the section's time.
"""

from __future__ import annotations

import copy
import gc
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from qkv.bench.deadline import Clock, TimeUp
from qkv.bench.gpu_models import (
    SECTIONS,
    Section,
    batch_flops,
    build_model,
    build_trainer,
    generated_batches,
    lm_batches,
    prepared_batches,
    sections,
    state_bytes,
)
from qkv.bench.gpu_runner import Runner, describe_error, section_ratios, targets
from qkv.bench.provenance import provenance, utc_now
from qkv.bench.step_profile import profile_step
from qkv.models.transformer import TransformerConfig
from qkv.runs.language_model import LANGUAGE_MODEL
from qkv.runtime.fileio import write_json
from qkv.runtime.peaks import peak_flops

WEIGHTS = {"paper-base": 0.45, "paper-big": 0.30, "lm": 0.25}  # shares of the time budget


@dataclass
class Settings:
    """What one run measures and how long it may take (the CLI's options)."""

    device: str = "cuda"
    sizes: str = "paper"
    sections: tuple[str, ...] = SECTIONS
    seconds: float = 480.0  # the whole run, imports and model builds included
    batches: int = 8  # distinct batches, each warmed up on once per contender before timing
    steps_per_round: int = 5
    max_rounds: int = 20
    compile: bool = True
    compile_seconds: float = 200.0
    profile: tuple[str, ...] = ("paper-base",)
    prepared: str | None = None
    seed: int = 0
    commit: str | None = None  # the commit to record where the copy that runs is not a git checkout

    def __post_init__(self) -> None:
        unknown = [s for s in (*self.sections, *self.profile) if s not in SECTIONS]
        if unknown:
            raise ValueError(f"unknown section {unknown[0]!r}; choose from {', '.join(SECTIONS)}")
        if self.batches < 1 or self.steps_per_round < 1 or self.max_rounds < 1:
            raise ValueError("--batches, --steps-per-round and --rounds must be at least 1")


class Report:
    """The result being built, written atomically to ``out`` after every measurement."""

    def __init__(self, out: Path, settings: Settings, argv: list[str] | None, clock: Clock) -> None:
        self.out, self.clock = out, clock
        device = torch.device(settings.device)
        found = provenance(argv)
        if found["commit"] == "unknown" and settings.commit:
            found.update(commit=settings.commit, commit_source="--commit (the copy that ran had no git history)")
        found["machine"].update(_device_details(device))
        peak = peak_flops(device, torch.bfloat16 if device.type == "cuda" else torch.float32)
        self.data: dict[str, Any] = {
            "benchmark": "gpu: training steps of qkv (eager, torch.compile) against Hugging Face MarianMT and "
            "GPT-2 of the same sizes, interleaved",
            "status": "running",
            "settings": {
                **{k: list(v) if isinstance(v, tuple) else v for k, v in asdict(settings).items()},
                "dtype": "bfloat16 autocast" if device.type == "cuda" else "float32",
            },
            "peak_flops": None if peak is None else {"flops_per_s": peak[0], "source": peak[1]},
            "sections": {},
            "targets": {},
            **found,
        }
        self.peak = peak[0] if peak is not None else None

    def write(self) -> None:
        """Write the report's JSON, with the elapsed time, the date and the targets met."""
        self.data["elapsed_s"] = round(self.clock.elapsed(), 2)
        self.data["date"] = utc_now()
        self.data["targets"] = targets(self.data["sections"], self.data["machine"].get("gpu"))
        write_json(self.out, self.data)


def _device_details(device: torch.device) -> dict[str, Any]:
    details: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        details.update(
            gpu_capability=f"{props.major}.{props.minor}",
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            gpu_count=torch.cuda.device_count(),
            cudnn=torch.backends.cudnn.version(),
        )
    try:
        import transformers

        details["transformers"] = transformers.__version__
    except ImportError:
        details["transformers"] = None
    return details


def run_benchmark(settings: Settings, out: str | Path, *, clock: Clock, argv: list[str] | None = None) -> dict:
    """Measure every section of ``settings`` within ``clock``'s budget, writing ``out`` as it goes.

    Returns:
        The report as written last: ``status`` is ``complete``, or ``cut`` with ``cut`` naming what
        was running when the budget ran out (everything measured before it is kept).
    """
    report = Report(Path(out), settings, argv, clock)
    report.write()
    cut: TimeUp | None = None
    try:
        with clock:
            try:
                for index, name in enumerate(settings.sections):
                    later = sum(WEIGHTS[s] for s in settings.sections[index:])
                    until = time.monotonic() + clock.left() * WEIGHTS[name] / later
                    try:
                        run_section(_section(settings, name), settings, report, until)
                    except Exception as err:  # one section's failure (out of memory, a library's bug) ends it only
                        traceback.print_exc()
                        report.data["sections"].setdefault(name, {})["error"] = describe_error(err)
                        _release(torch.device(settings.device))
                report.data["status"] = "complete"
            except TimeUp as up:
                cut = up
    except TimeUp as up:  # fired while the timer was being disarmed
        cut = cut or up
    if cut is not None:
        report.data["status"] = "cut"
        report.data["cut"] = {"while": cut.what, "at_s": round(clock.elapsed(), 2)}
    report.write()
    return report.data


def _section(settings: Settings, name: str) -> Section:
    if settings.prepared and name != "lm":
        from qkv.data.prepared import PreparedCorpus

        tokenizer = PreparedCorpus(settings.prepared).tokenizer()
        return sections(settings.sizes, vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id)[name]
    return sections(settings.sizes)[name]


def _batches(section: Section, settings: Settings) -> list:
    if section.task == LANGUAGE_MODEL.name:
        return lm_batches(section, settings.batches, settings.seed)
    if settings.prepared:
        return prepared_batches(settings.prepared, section, settings.batches, settings.seed)
    return generated_batches(section, settings.batches, settings.seed)


def run_section(section: Section, settings: Settings, report: Report, until: float) -> None:
    """Build, warm up, profile and time one section's contenders, recording into ``report``."""
    clock, device = report.clock, torch.device(settings.device)
    clock.check(f"{section.name}: data")
    batches = [b.to(device) for b in _batches(section, settings)]
    entry: dict[str, Any] = {
        "model": asdict(section.config),
        "task": section.task,
        "data": _data_info(section, batches, settings),
        "contenders": {},
        "rounds": [],
    }
    entry["started_at_s"], entry["budget_s"] = round(clock.elapsed(), 2), round(until - time.monotonic(), 2)
    report.data["sections"][section.name] = entry
    flops = [batch_flops(section, b) for b in batches]
    runners = _build_runners(section, settings, batches, flops, entry, report)
    for runner in list(runners.values()):
        _warm_up(runner, section, settings, entry, report, until)
    runners = {name: r for name, r in runners.items() if r.ready}
    if section.name in settings.profile:
        for runner in runners.values():
            clock.check(f"{section.name}: profiling {runner.name}")
            try:
                entry["contenders"][runner.name]["profile"] = profile_step(runner.one_step, device)
            except Exception as err:  # the profiler is a diagnosis: the timing goes on without it
                entry["contenders"][runner.name]["profile"] = {"error": describe_error(err)}
            report.write()
    _rounds(runners, section, settings, entry, report, until)
    del runners
    _release(device)


def _release(device: torch.device) -> None:
    """Free the finished section's models, compiled graphs and cached device memory."""
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()  # compiled graphs hold on to the weights they were traced with
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _data_info(section: Section, batches: list, settings: Settings) -> dict[str, Any]:
    tokens = [b.num_tgt_tokens for b in batches]
    info: dict[str, Any] = {
        "source": "generated"
        if section.task == LANGUAGE_MODEL.name or not settings.prepared
        else f"prepared folder {settings.prepared}",
        "batches": len(batches),
        "tokens_per_step": section.tokens_per_step,
        "mean_target_tokens_per_batch": statistics.fmean(tokens),
    }
    if isinstance(section.config, TransformerConfig):
        real = sum(int((b.tgt_in != section.config.pad_id).sum()) for b in batches)
        info["mean_sentences_per_batch"] = statistics.fmean(float(b.src.size(0)) for b in batches)
        info["target_padding_share"] = 1 - real / sum(b.tgt_in.numel() for b in batches)
    return info


def _build_runners(
    section: Section, settings: Settings, batches: list, flops: list[int], entry: dict, report: Report
) -> dict[str, Runner]:
    """qkv's model, its compiled twin (the same initial weights) and the Hugging Face one; the
    parameter counts of qkv's and Hugging Face's must agree."""
    device = torch.device(settings.device)
    bf16 = device.type == "cuda"
    qkv_name, compiled_name, hf_name = section.contenders
    report.clock.check(f"{section.name}: building models")
    torch.manual_seed(settings.seed)
    with device:  # qkv's model initialised where it trains: a GPU's seconds, not a CPU's minute for paper-big
        qkv_model = build_model(section, "qkv").to(device)
    # Hugging Face's on the CPU, then moved: MarianMT's positional table is built from CPU tensors
    torch.manual_seed(settings.seed)
    hf_model = build_model(section, hf_name).to(device)
    models = {qkv_name: qkv_model, hf_name: hf_model}
    if settings.compile:
        models[compiled_name] = copy.deepcopy(qkv_model)
    counts = {name: Runner.count_parameters(m) for name, m in models.items()}
    entry["parameters"] = counts
    if counts[qkv_name] != counts[hf_name]:
        raise ValueError(f"{section.name}: qkv has {counts[qkv_name]} parameters but {hf_name} {counts[hf_name]}")
    runners = {}
    for name, model in models.items():
        family = "qkv" if name.startswith("qkv") else name
        trainer = build_trainer(section, family, model, bf16=bf16, compile_model=name == compiled_name)
        runners[name] = Runner(name, trainer, batches, flops, device)
        entry["contenders"][name] = {"parameters": counts[name], "compiled": name == compiled_name}
    hf_config: Any = getattr(hf_model, "model", hf_model).config  # MarianMT is wrapped, GPT-2 is not
    entry["contenders"][hf_name]["attention"] = hf_config._attn_implementation
    if not settings.compile:
        entry["contenders"][compiled_name] = {"skipped": "--no-compile"}
    return runners


def _warm_up(runner: Runner, section: Section, settings: Settings, entry: dict, report: Report, until: float) -> None:
    """One untimed step on every distinct batch; for the compiled contender within its compile limit."""
    clock, record = report.clock, entry["contenders"][runner.name]
    doing = f"{section.name}: warming up {runner.name}"
    limit = max(min(settings.compile_seconds, 0.75 * (until - time.monotonic())), 0.0)  # the rest: rounds
    try:
        if record["compiled"]:
            with clock.limit(limit, doing + " (torch.compile)"):
                record.update(runner.warm_up())
        else:
            clock.check(doing)
            record.update(runner.warm_up())
        record["state_bytes"] = state_bytes(runner.trainer)
        record["peak_memory_bytes"] = (
            record["state_bytes"] + record["peak_step_bytes"] if record.get("peak_step_bytes") is not None else None
        )
    except TimeUp as up:
        if up.whole:
            raise
        record["skipped"] = f"torch.compile and its warm-up took more than the {limit:.0f} s allowed"
        runner.ready = False
        torch._dynamo.reset()
    except Exception as err:  # out of memory, a compiler's error: this contender is left out
        record["error"] = describe_error(err)
        runner.ready = False
    report.write()


def _rounds(
    runners: dict[str, Runner], section: Section, settings: Settings, entry: dict, report: Report, until: float
) -> None:
    """Interleaved timed rounds until ``max_rounds`` or the section's time; JSON after each sample."""
    names = list(runners)
    last_round = sum(r.warm_step_s for r in runners.values()) * settings.steps_per_round
    for index in range(settings.max_rounds):
        if index and time.monotonic() + last_round > until:
            break
        started = time.monotonic()
        shift = index % max(len(names), 1)
        order = names[shift:] + names[:shift]
        entry["rounds"].append({"order": order, "seconds": {}})
        for name in order:
            runner = runners[name]
            if not runner.ready:
                continue
            report.clock.check(f"{section.name}: round {index + 1}, {name}")
            try:
                seconds = runner.timed(settings.steps_per_round)
            except Exception as err:  # out of memory: this contender is left out of later rounds
                entry["contenders"][name]["error"] = describe_error(err)
                runner.ready = False
                continue
            entry["rounds"][-1]["seconds"][name] = seconds
            entry["contenders"][name].update(runner.figures(report.peak))
            entry["ratios"] = section_ratios(entry, section)
            report.write()
        last_round = time.monotonic() - started

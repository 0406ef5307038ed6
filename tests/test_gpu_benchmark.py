"""benchmarks/gpu.py, checked on the CPU at tiny sizes: the JSON it writes (every contender, figures
consistent with each other, Hugging Face models of qkv's parameter count, a profile), a run cut short
keeps what it measured, torch.compile over its limit is skipped with the reason, an existing result
is refused before any work. The GPU figures themselves need a GPU (docs/gpu.md)."""

from __future__ import annotations

import math
import random
import time

import pytest
import torch
from bench_loader import load_benchmark

from qkv.bench.deadline import Clock, TimeUp
from qkv.bench.gpu import Settings, run_benchmark
from qkv.bench.gpu_models import BOS, EOS, PAD, generated_batches, prepared_batches, sections
from qkv.bench.provenance import missing_fields
from qkv.bench.step_profile import CATEGORIES, category
from qkv.data.batching import make_batch
from qkv.runtime.fileio import read_json

HF = {"paper-base": "marian", "paper-big": "marian", "lm": "gpt2"}


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny products on a shared CPU: a second thread only waits (the script's --dry-run does the same)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny(**overrides) -> Settings:
    fields = dict(device="cpu", sizes="tiny", batches=2, steps_per_round=1, max_rounds=2, compile=False, profile=())
    return Settings(**{**fields, **overrides})


def check_figures(figures: dict, peak: float | None) -> None:
    """tokens/s, TFLOP/s and MFU are what the counts and seconds say."""
    seconds = figures["seconds"]
    assert seconds > 0 and figures["steps_timed"] >= 1
    assert math.isclose(figures["tokens_per_s"], figures["target_tokens"] / seconds, rel_tol=1e-9)
    assert math.isclose(figures["tflops_per_s"] * 1e12 * seconds, figures["flops"], rel_tol=1e-9)
    if peak is None:
        assert figures["mfu"] is None
    else:
        assert math.isclose(figures["mfu"], figures["tflops_per_s"] * 1e12 / peak, rel_tol=1e-9)
    assert figures["state_bytes"] >= 3 * 4 * figures["parameters"]  # float32 weights and Adam's two moments


def test_dry_run_writes_every_contender_with_consistent_figures(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    gpu = load_benchmark("gpu")
    assert gpu.main(["--dry-run", "--out", str(out)]) == 0
    report = read_json(out)
    assert report["status"] == "complete" and missing_fields(report) == []
    assert report["command"] == f"python benchmarks/gpu.py --dry-run --out {out}"
    assert report["machine"]["torch"] == torch.__version__ and report["settings"]["dtype"] == "float32"
    peak = report["peak_flops"]["flops_per_s"] if report["peak_flops"] else None
    for name, hf in HF.items():
        section = report["sections"][name]
        # Hugging Face's own count of its model's parameters equals qkv's
        assert section["parameters"]["qkv"] == section["parameters"][hf] > 0
        figures = section["contenders"]
        assert figures["qkv+compile"] == {"skipped": "--no-compile"}
        for contender in ("qkv", hf):
            check_figures(figures[contender], peak)
        # every contender trained on the same batches: the same tokens, the same FLOPs
        assert figures["qkv"]["target_tokens"] == figures[hf]["target_tokens"]
        assert figures["qkv"]["flops"] == figures[hf]["flops"] > 0
        assert [r["order"] for r in section["rounds"]] == [["qkv", hf], [hf, "qkv"]]
        ratio = section["ratios"][f"qkv_vs_{hf}"]
        assert math.isclose(ratio["tokens_per_s"], figures["qkv"]["tokens_per_s"] / figures[hf]["tokens_per_s"])
    profile = report["sections"]["paper-base"]["contenders"]["qkv"]["profile"]
    assert math.isclose(sum(profile["shares"].values()), 1.0, rel_tol=1e-6)
    assert profile["shares"]["matmul"] > 0 and set(profile["shares"]) == set(CATEGORIES)
    assert math.isclose(profile["outside_matmul_share"], 1 - profile["shares"]["matmul"])
    tops = [t["seconds"] for t in profile["top"]]
    assert tops == sorted(tops, reverse=True)
    assert report["targets"]["paper_base_vs_marian"]["measured"] == pytest.approx(
        report["sections"]["paper-base"]["ratios"]["qkv_vs_marian"]["tokens_per_s"]
    )
    mfu = report["targets"]["paper_base_mfu"]  # a tiny CPU model is far from 40% of the measured peak
    assert mfu["met"] is False and mfu["limits"] == profile["summary"] and mfu["by"] == "qkv"
    assert "complete after" in capsys.readouterr().out


class CutClock(Clock):
    """A clock whose budget runs out at its ``cut_at``-th check, wherever that falls."""

    def __init__(self, cut_at: int) -> None:
        super().__init__(3600, alarm=False)
        self.cut_at, self.checks = cut_at, 0

    def check(self, doing: str) -> None:
        self.checks += 1
        self.doing = doing
        if self.checks >= self.cut_at:
            raise TimeUp(doing, whole=True)


def test_a_cut_run_keeps_what_it_measured(tmp_path):
    out = tmp_path / "cut.json"
    # checks: data, models, warm-up qkv, warm-up marian, round 1 qkv, round 1 marian <- cut there
    report = run_benchmark(tiny(sections=("paper-base", "lm")), out, clock=CutClock(6))
    assert read_json(out) == report
    assert report["status"] == "cut" and report["cut"]["while"] == "paper-base: round 1, marian"
    base = report["sections"]["paper-base"]["contenders"]
    check_figures(base["qkv"], report["peak_flops"] and report["peak_flops"]["flops_per_s"])
    assert "tokens_per_s" not in base["marian"] and "lm" not in report["sections"]


def test_the_alarm_cuts_a_run_anywhere_and_the_json_stays_valid(tmp_path):
    out = tmp_path / "alarm.json"
    report = run_benchmark(tiny(), out, clock=Clock(0.3))  # far too short for three sections
    assert report["status"] == "cut" and read_json(out) == report
    assert missing_fields(report) == []


def test_compilation_over_its_limit_is_skipped_with_the_reason(tmp_path):
    out = tmp_path / "compile.json"
    settings = tiny(sections=("paper-base",), compile=True, compile_seconds=0.5, max_rounds=1)
    report = run_benchmark(settings, out, clock=Clock(600))
    figures = report["sections"]["paper-base"]["contenders"]
    assert report["status"] == "complete"
    assert figures["qkv+compile"]["skipped"].startswith("torch.compile and its warm-up took more than")
    assert figures["qkv"]["tokens_per_s"] and figures["marian"]["tokens_per_s"]


def test_clock_limits_a_part_and_then_the_whole():
    with Clock(60) as clock:
        with pytest.raises(TimeUp) as up, clock.limit(0.1, "a slow part"):
            while True:
                time.sleep(0.01)
        assert up.value.what == "a slow part" and not up.value.whole
    clock = Clock(0.1)
    with pytest.raises(TimeUp) as up, clock:
        clock.check("working")
        while True:
            time.sleep(0.01)
    assert up.value.whole and up.value.what == "working"


def test_a_part_whose_timeup_was_converted_or_swallowed_still_ends_in_timeup():
    # PyTorch's C argument parsing turns an exception raised by a signal handler into a TypeError,
    # which the compiler may swallow; the part's limit must hold either way (a CI run met this).
    with Clock(60) as clock:
        with pytest.raises(TimeUp) as up, clock.limit(0.05, "converted"):
            try:
                while True:
                    time.sleep(0.01)
            except TimeUp as err:
                raise TypeError(f"failed to unpack: {err}") from None
        assert up.value.what == "converted" and not up.value.whole
        with pytest.raises(TimeUp) as up, clock.limit(0.05, "swallowed"):
            try:
                while True:
                    time.sleep(0.01)
            except BaseException:  # noqa: BLE001  (what a fallback path does)
                pass
        assert up.value.what == "swallowed" and not up.value.whole
        with pytest.raises(ValueError), clock.limit(5, "an error of its own"):
            raise ValueError("not the timer's")
        with clock.limit(5, "in time"):
            pass


def test_generated_batches_are_framed_as_make_batch_frames_them():
    section = sections("tiny")["paper-base"]
    batches = generated_batches(section, 3, seed=1)
    assert len(batches) == 3
    for batch in batches:
        src = [row[row != PAD].tolist()[:-1] for row in batch.src]  # without EOS
        tgt = [row[row != PAD].tolist()[1:] for row in batch.tgt_in]  # without BOS
        again = make_batch(src, tgt, pad_id=PAD, bos_id=BOS, eos_id=EOS)
        for field in ("src", "tgt_in", "tgt_out"):
            assert torch.equal(getattr(batch, field), getattr(again, field))
        assert batch.num_tgt_tokens == again.num_tgt_tokens
        # cut at the step's target tokens: off by less than one sentence (at most 64 positions here)
        assert abs(batch.num_tgt_tokens - section.tokens_per_step) < 64
        assert all(4 <= i < section.config.src_vocab_size for row in src for i in row)


def test_kernel_names_fall_into_categories():
    assert category("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "matmul"
    assert category("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN") == "matmul"
    assert category("aten::addmm") == category("aten::mm") == "matmul"
    assert category("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>") == "attention"
    assert category("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdam>") == "optimizer"
    assert category("Memcpy HtoD (Pageable -> Device)") == "memory"
    assert category("aten::native_layer_norm") == category("triton_poi_fused_add_relu_0") == "other"


def test_an_existing_result_is_refused_before_any_work(tmp_path, capsys):
    old = tmp_path / "gpu.json"
    old.write_text('{"measured": "on a GPU"}\n')
    gpu = load_benchmark("gpu")
    with pytest.raises(SystemExit) as stop:
        gpu.main(["--dry-run", "--out", str(old)])
    assert stop.value.code == 2 and "exists; pass --overwrite" in capsys.readouterr().err
    assert old.read_text() == '{"measured": "on a GPU"}\n'


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")
def test_without_cuda_the_default_run_says_so_in_one_line(tmp_path, capsys):
    gpu = load_benchmark("gpu")
    with pytest.raises(SystemExit) as stop:
        gpu.main(["--out", str(tmp_path / "gpu.json")])
    assert stop.value.code == 2 and "no CUDA device here" in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "gpu.json").exists()


def test_batches_from_a_prepared_folder_hold_its_pairs(tmp_path):
    from qkv.data.prepared import PreparedCorpus
    from qkv.data.prepared.preparing import prepare_corpus

    rng = random.Random(0)
    words = ["haus", "katze", "the", "cat", "sat", "on", "mat", "und", "ein", "hund"]
    for side in ("src", "tgt"):
        lines = [" ".join(rng.choices(words, k=rng.randint(2, 9))) for _ in range(300)]
        (tmp_path / f"train.{side}").write_text("\n".join(lines) + "\n")
    folder = tmp_path / "prepared"
    prepare_corpus(tmp_path / "train.src", tmp_path / "train.tgt", folder, vocab_size=300, max_len=64, progress=False)
    corpus = PreparedCorpus(folder)
    split, tokenizer = corpus.split("train"), corpus.tokenizer()
    pairs = {(tuple(s), tuple(t)) for s, t in zip(*split.read(range(len(split))))}
    settings = tiny(sections=("paper-base",), prepared=str(folder), max_rounds=1)
    report = run_benchmark(settings, tmp_path / "prepared.json", clock=Clock(600))
    base = report["sections"]["paper-base"]
    assert report["status"] == "complete" and base["data"]["source"] == f"prepared folder {folder}"
    assert base["model"]["src_vocab_size"] == tokenizer.vocab_size and base["contenders"]["marian"]["tokens_per_s"]
    section = sections("tiny", vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id)["paper-base"]
    for batch in prepared_batches(folder, section, 2):
        for src, tgt in zip(batch.src, batch.tgt_out):
            pad = tokenizer.pad_id
            pair = (tuple(src[src != pad].tolist()[:-1]), tuple(tgt[tgt != pad].tolist()[:-1]))
            assert pair in pairs  # every row is one of the folder's training pairs, EOS-framed


def test_a_failing_section_is_recorded_and_the_next_one_runs(tmp_path, monkeypatch):
    import qkv.bench.gpu as gpu_module

    real = gpu_module.build_model

    def failing(section, family):
        if family == "marian":
            raise RuntimeError("CUDA out of memory. Tried to allocate 3.70 GiB\nmore detail")
        return real(section, family)

    monkeypatch.setattr(gpu_module, "build_model", failing)
    report = run_benchmark(tiny(sections=("paper-base", "lm")), tmp_path / "fail.json", clock=Clock(600))
    assert report["status"] == "complete"
    assert report["sections"]["paper-base"]["error"] == "RuntimeError: CUDA out of memory. Tried to allocate 3.70 GiB"
    assert report["sections"]["lm"]["contenders"]["gpt2"]["tokens_per_s"] > 0


def test_a_folder_that_is_not_prepared_is_refused_in_one_line(tmp_path, capsys):
    gpu = load_benchmark("gpu")
    with pytest.raises(SystemExit) as stop:
        gpu.main(["--dry-run", "--prepared", str(tmp_path), "--out", str(tmp_path / "gpu.json")])
    assert stop.value.code == 2
    assert "not a folder written by `qkv prepare`" in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "gpu.json").exists()

"""The benchmark machinery: interleaved timing, peak memory, JSON, the comparison models (torch's
nn.Transformer wrapper computes qkv's function with copied weights), and smoke runs of every
suite on tiny synthetic data. Nothing here asserts on a timing."""

import json
import platform
import re
import subprocess
from pathlib import Path

import pytest
import torch

import qkv
from qkv.bench import timing
from qkv.bench.competitors import TorchTransformerMT, count_parameters
from qkv.bench.data import synthetic_data
from qkv.bench.suites import run_suite, summarize
from qkv.bench.training import _ContenderTask, parse_contender, training_benchmark
from qkv.runtime.device import pick_device
from qkv.training.objectives import LabelSmoothedCrossEntropy, RDrop

CPU = torch.device("cpu")


def test_time_interleaved_rotates_order_and_counts_calls():
    order = []
    contenders = {name: (lambda name=name: order.append(name)) for name in "abc"}
    results = timing.time_interleaved(contenders, device=CPU, repeats=3, warmup=2)
    assert order[:6] == ["a", "a", "b", "b", "c", "c"]  # warm-up, one contender after another
    assert order[6:] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]  # each round starts one later
    for name in "abc":
        assert len(results[name].times) == 3 and results[name].error is None
        assert results[name].median == sorted(results[name].times)[1]


def test_settle_makes_each_long_timed_call_follow_its_own_twin():
    order = []
    contenders = {name: (lambda name=name: order.append(name)) for name in "ab"}
    timing.time_interleaved(contenders, device=CPU, repeats=2, warmup=1, settle=True)
    assert order[2:] == ["a", "a", "b", "b", "b", "b", "a", "a"]  # untimed twin, then the timed call


def test_failing_contender_is_recorded_and_dropped():
    calls = {"ok": 0, "bad": 0}

    def bad():
        calls["bad"] += 1
        if calls["bad"] > 1:
            raise RuntimeError("out of memory\nmore detail")

    results = timing.time_interleaved(
        {"ok": lambda: calls.__setitem__("ok", calls["ok"] + 1), "bad": bad}, device=CPU, repeats=4, warmup=1
    )
    assert results["bad"].error == "RuntimeError: out of memory"
    assert results["bad"].times == [] and results["bad"].median is None
    assert len(results["ok"].times) == 4 and calls["bad"] == 2


def test_min_sample_raises_inner_calls_and_bad_arguments_raise():
    calls = []
    results = timing.time_interleaved(
        {"tiny": lambda: calls.append(1)}, device=CPU, repeats=2, warmup=0, min_sample_s=0.002
    )
    assert len(calls) > 3  # one calibration call, then more than one call per timed sample
    assert len(results["tiny"].times) == 2
    with pytest.raises(ValueError, match="repeats"):
        timing.time_interleaved({"a": lambda: None}, device=CPU, repeats=0)
    with pytest.raises(ValueError, match="no contenders"):
        timing.time_interleaved({}, device=CPU)


def test_peak_memory_sees_a_large_temporary_allocation():
    size = 64 * 2**20

    def allocate():
        x = torch.ones(size // 4)  # 64 MiB, touched
        return float(x[-1])

    peak = timing.peak_memory_bytes(allocate, CPU)
    if peak is None:
        pytest.skip("no peak-memory counter on this platform")
    assert 0.9 * size <= peak <= 3 * size
    assert timing.peak_memory_bytes(lambda: None, CPU) < size / 2


def test_ratio_environment_and_device(monkeypatch):
    assert timing.ratio(3.0, 1.5) == 2.0
    assert timing.ratio(None, 1.0) is None and timing.ratio(1.0, 0.0) is None
    # per-round ratios: a load spike in round 2 slows both contenders alike and drops out
    assert timing.paired_ratio([2.0, 8.0, 2.2], [1.0, 4.0, 1.0]) == 2.0
    assert timing.paired_ratio([], []) is None
    env = timing.environment()
    assert env["torch"] == torch.__version__ and env["torch_threads"] == torch.get_num_threads()
    if Path("/proc/cpuinfo").is_file() and platform.machine() == "x86_64":  # against lscpu's own reading
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for field, key in (("Model name", "cpu_model"), ("CPU family", "cpu_family"), ("Model", "cpu_model_number")):
            line = re.search(rf"^{field}:\s*(.+)$", lscpu, flags=re.MULTILINE)
            if line:
                assert env[key] == line.group(1).strip(), field
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert "isa_limits" not in timing.environment()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # a run kept to an AVX2 machine's kernels says so
    assert timing.environment()["isa_limits"] == {"ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert "bf16_probe_seconds_256" not in env  # the probe runs only when asked for
    probed = timing.environment(probe_bf16=True)["bf16_probe_seconds_256"]
    assert probed["float32"] > 0 and probed["bfloat16"] > 0
    if Path("/proc/meminfo").is_file():  # against the kernel's own count (MemTotal, in kB)
        total_kib = int(
            re.search(r"^MemTotal:\s*(\d+)", Path("/proc/meminfo").read_text(), flags=re.MULTILINE).group(1)
        )
        assert abs(env["memory_gib"] - total_kib / 2**20) < 0.2
    assert timing.pick_device is pick_device  # qkv.bench re-exports the one device picker
    assert timing.pick_device("cpu") == CPU
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            timing.pick_device("cuda")


def _copy_into_torch(ours: qkv.Transformer, theirs: TorchTransformerMT) -> None:
    def mha(dst: torch.nn.MultiheadAttention, src: qkv.MultiHeadAttention) -> None:
        dst.in_proj_weight.copy_(torch.cat([src.q_proj.weight, src.k_proj.weight, src.v_proj.weight]))
        dst.in_proj_bias.copy_(torch.cat([src.q_proj.bias, src.k_proj.bias, src.v_proj.bias]))
        dst.out_proj.load_state_dict(src.out_proj.state_dict())

    with torch.no_grad():
        theirs.embedding.weight.copy_(ours.src_embed.embedding.weight)
        pairs = list(zip(theirs.transformer.encoder.layers, ours.encoder.layers)) + list(
            zip(theirs.transformer.decoder.layers, ours.decoder.layers)
        )
        for dst, src in pairs:
            mha(dst.self_attn, src.self_attn)
            if hasattr(dst, "multihead_attn"):
                mha(dst.multihead_attn, src.cross_attn)
                dst.norm3.load_state_dict(src.norm3.state_dict())
            dst.linear1.load_state_dict(src.feed_forward.linear1.state_dict())
            dst.linear2.load_state_dict(src.feed_forward.linear2.state_dict())
            dst.norm1.load_state_dict(src.norm1.state_dict())
            dst.norm2.load_state_dict(src.norm2.state_dict())
        for dst, src in (
            (theirs.transformer.encoder.norm, ours.encoder.norm),
            (theirs.transformer.decoder.norm, ours.decoder.norm),
        ):
            assert (dst is None) == (src is None)
            if dst is not None:
                dst.load_state_dict(src.state_dict())


@pytest.mark.parametrize("norm_first", [False, True])
def test_torch_transformer_competitor_computes_qkvs_function(norm_first):
    """Same weights -> same logits: the training comparison times the same model."""
    config = qkv.TransformerConfig(
        src_vocab_size=50,
        tgt_vocab_size=50,
        d_model=16,
        num_heads=2,
        num_encoder_layers=2,
        num_decoder_layers=2,
        d_ff=32,
        max_len=32,
        share_embeddings=True,
        norm_first=norm_first,
    )
    ours, theirs = qkv.Transformer(config).eval(), TorchTransformerMT(config).eval()
    _copy_into_torch(ours, theirs)
    assert count_parameters(ours) == count_parameters(theirs)
    src = torch.randint(4, 50, (3, 7))
    src[1, 4:] = 0
    tgt = torch.randint(4, 50, (3, 5))
    torch.testing.assert_close(theirs(src, tgt), ours(src, tgt), atol=1e-5, rtol=1e-5)


def test_marian_competitor_has_the_same_sizes():
    pytest.importorskip("transformers")
    from qkv.bench.competitors import build_marian

    config = qkv.TransformerConfig(
        src_vocab_size=60,
        tgt_vocab_size=60,
        d_model=16,
        num_heads=2,
        num_encoder_layers=2,
        num_decoder_layers=1,
        d_ff=24,
        max_len=32,
        share_embeddings=True,
    )
    marian = build_marian(config, bos_id=1, eos_id=2)
    hf = marian.model.config
    assert (hf.d_model, hf.encoder_layers, hf.decoder_layers, hf.encoder_ffn_dim, hf.encoder_attention_heads) == (
        16,
        2,
        1,
        24,
        2,
    )
    assert hf.activation_function == "relu" and hf.scale_embedding and hf.attention_dropout == 0.0
    # the same trainable weights as qkv's model (Marian's sinusoidal positions are a frozen table)
    assert count_parameters(marian) == count_parameters(qkv.Transformer(config))
    logits = marian(torch.randint(4, 60, (2, 5)), torch.randint(4, 60, (2, 4)))
    assert logits.shape == (2, 4, 60)


def test_parse_contender():
    assert parse_contender("qkv") == ("qkv", False, False)
    assert parse_contender("torch+bf16") == ("torch", True, False)
    assert parse_contender("qkv+compile+bf16") == ("qkv", True, True)
    for bad in ("jax", "qkv+fp8"):
        with pytest.raises(ValueError, match="bad contender"):
            parse_contender(bad)


def test_training_benchmark_counts_tokens_of_the_timed_batches():
    data = synthetic_data(vocab_size=40, num_batches=3, batch_size=3, src_len=6, tgt_len=5)
    config = qkv.TransformerConfig(
        src_vocab_size=40,
        tgt_vocab_size=40,
        d_model=16,
        num_heads=2,
        num_encoder_layers=1,
        num_decoder_layers=1,
        d_ff=32,
        max_len=32,
        share_embeddings=True,
    )
    report = training_benchmark(data, config, contenders=("qkv", "torch", "qkv+bf16"), device=CPU, repeats=4, warmup=1)
    tokens = [b.num_tgt_tokens for b in data.batches]
    timed = sum(tokens[(1 + i) % 3] for i in range(4))  # one warm-up batch, then four timed
    for result in report["contenders"].values():
        assert result["steps_timed"] == 4 and result["error"] is None
        assert result["tokens_per_s"] == pytest.approx(timed / sum(result["times_s"]))
    assert set(report["ratios"]) == set(report["paired_ratios"]) == {"qkv_vs_torch", "qkv+bf16_vs_qkv"}


def test_a_contender_reads_its_label_smoothing_from_the_step_s_objective():
    """The torch contender's loss takes the objective's smoothing (PyTorch's F.cross_entropy on its
    logits is the reference) and refuses R-Drop, which it cannot compute, rather than drop its term."""
    data = synthetic_data(vocab_size=40, num_batches=2, batch_size=3, src_len=6, tgt_len=5)
    config = qkv.TransformerConfig(
        src_vocab_size=40, tgt_vocab_size=40, d_model=16, num_heads=2, num_encoder_layers=1,
        num_decoder_layers=1, d_ff=32, max_len=32, share_embeddings=True, dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model, batch = TorchTransformerMT(config).eval(), data.batches[0]
    task = _ContenderTask(model, data.pad_id)
    got = task.loss_fn(model, batch.src, batch.tgt_in, batch.tgt_out, objective=LabelSmoothedCrossEntropy(0.1))
    logits = model(batch.src, batch.tgt_in)
    want = torch.nn.functional.cross_entropy(
        logits.reshape(-1, 40), batch.tgt_out.reshape(-1), ignore_index=data.pad_id, label_smoothing=0.1,
        reduction="sum",
    )  # fmt: skip
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="rdrop"):
        task.loss_fn(model, batch.src, batch.tgt_in, batch.tgt_out, objective=RDrop(alpha=2.0))


@pytest.mark.parametrize("suite", ["attention", "decoding", "precision"])
def test_quick_suites_write_json_and_plot(tmp_path, suite, monkeypatch):
    if suite == "attention":  # a smaller grid than --quick, to keep the test short
        import qkv.bench.attention as attention

        original = attention.attention_benchmark
        monkeypatch.setattr(
            attention,
            "attention_benchmark",
            lambda **kw: original(
                **{**kw, "seq_lens": (16,), "dtypes": ("float32",), "repeats": 1, "warmup": 1, "min_sample_s": 0.0}
            ),
        )
    data = synthetic_data(vocab_size=50, num_batches=2, batch_size=3, src_len=8, tgt_len=8, num_sources=6)
    report, summary = run_suite(suite, out_dir=tmp_path, device=CPU, quick=True, data=data, progress=False)
    saved = json.loads((tmp_path / f"{suite}.json").read_text())
    assert saved["suite"] == suite and saved["environment"]["torch"] == torch.__version__
    assert (tmp_path / f"{suite}.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{suite}.json", f"{suite}.png"]  # no temporaries left
    assert summary == summarize(saved) and summary.startswith(f"**{suite}**")
    if suite == "attention":
        point = saved["results"][0]
        assert set(point["timings"]) >= {"qkv_reference", "qkv_fast", "torch_sdpa", "qkv_mha", "torch_mha"}
    if suite == "decoding":  # every contender did the same number of decoder steps
        for name, result in saved["contenders"].items():
            assert result["tokens_per_sentence"] == [saved["config"]["new_tokens"]], name


def test_attention_contenders_and_sizes_from_the_command_line(tmp_path, capsys):
    from qkv.cli import main

    assert (
        main(
            [
                "bench",
                "attention",
                "--quick",
                "--seq-lens",
                "24",
                "--contenders",
                "qkv_fast,torch_sdpa",
                "--dtypes",
                "float32",
                "--passes",
                "forward",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    saved = json.loads((tmp_path / "attention.json").read_text())
    assert {(p["seq_len"], p["dtype"], p["pass"]) for p in saved["results"]} == {(24, "float32", "forward")}
    assert all(set(p["timings"]) == {"qkv_fast", "torch_sdpa"} for p in saved["results"])
    assert main(["bench", "attention", "--contenders", "qkv_slow", "--out", str(tmp_path / "other")]) == 2
    assert "unknown attention contenders" in capsys.readouterr().err


def test_cli_bench_errors(capsys):
    from qkv.cli import main

    assert main(["bench", "attention", "--threads", "0"]) == 2
    assert "--threads must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "nonsense"])

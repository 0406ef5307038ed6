"""Model FLOPs counted from a configuration (qkv.models.flops) against what PyTorch's FlopCounterMode
counts while the real model runs; the peaks MFU is measured against (qkv.runtime.peaks); and the
tflops_per_s / mfu / padding figures a training run writes into metrics.jsonl (qkv.training.throughput).

FlopCounterMode counts matrix products (mm, bmm, addmm, SDPA kernels), 2 m n k each, and nothing else:
the quantity qkv.models.flops counts, so the two must agree exactly. The models run with the plain
attention products (qkv.attention.backends.use_backend("reference")): PyTorch's fused CPU attention
kernel (aten._scaled_dot_product_flash_attention_for_cpu) has no formula in FlopCounterMode, which would
count its products as 0; the plain products form the same full score squares. The fused kernels of a
GPU are compared separately (skipped without one).
"""

import json
import math

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from qkv.attention.backends import use_backend
from qkv.data.batching import make_batch
from qkv.data.dates import generate_dates
from qkv.data.text import CharTokenizer
from qkv.data.tokenizer import Tokenizer
from qkv.models import flops
from qkv.models.causal_lm import CausalLM, CausalLMConfig
from qkv.models.transformer import EncoderModel, Transformer, TransformerConfig
from qkv.pretrained.bert import BertConfig, BertEncoder
from qkv.runtime import peaks
from qkv.training import LanguageModelTask, TrainConfig, Trainer, TranslationTask
from qkv.training.throughput import Throughput, batch_work


def counted(fn, *args) -> int:
    """Matrix-product FLOPs FlopCounterMode sees while ``fn(*args)`` runs, with the plain attention products."""
    with use_backend("reference"), FlopCounterMode(display=False) as counter:
        fn(*args)
    return counter.get_total_flops()


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Every test measures and caches the CPU peak in its own folder, never the user's cache, on a
    machine taken as idle (a peak measured under load is not cached: tests/test_newcomer.py)."""
    monkeypatch.setenv("QKV_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(peaks, "machine_load", lambda: (0.0, 2))
    peaks.cpu_peak.cache_clear()
    yield
    peaks.cpu_peak.cache_clear()


# --------------------------------------------------------------------------- counts against FlopCounterMode
SEQ2SEQ = [
    dict(tie_output=False, norm_first=False, bias=True),
    dict(tie_output=True, norm_first=True, bias=False, share_embeddings=True, activation="gelu"),
]


@pytest.mark.parametrize("options", SEQ2SEQ)
def test_encoder_decoder_count_matches_flop_counter(options):
    """Pairs of unequal source and target lengths, each run alone (no padding): forward (logits for every
    target position) and a training pass (the fused loss, then backward)."""
    vocab = 90 if options.get("share_embeddings") else 60
    config = TransformerConfig(
        src_vocab_size=90,
        tgt_vocab_size=vocab,
        d_model=32,
        num_heads=4,
        d_ff=48,
        num_encoder_layers=2,
        num_decoder_layers=3,
        dropout=0.0,
        **options,
    )
    torch.manual_seed(0)
    model = Transformer(config)
    pairs = [(7, 5), (3, 11), (12, 1)]
    forward = train = 0
    for s, t in pairs:
        src, tgt_in, tgt_out = torch.randint(1, 60, (1, s)), torch.randint(1, 60, (1, t)), torch.randint(1, 60, (1, t))
        forward += counted(model, src, tgt_in)
        train += counted(lambda *a: model.loss(*a).backward(), src, tgt_in, tgt_out)
    src_lengths, tgt_lengths = [s for s, _ in pairs], [t for _, t in pairs]
    assert flops.transformer_forward_flops(config, src_lengths, tgt_lengths) == forward
    assert flops.transformer_train_flops(config, src_lengths, tgt_lengths) == train
    # a batch of equal lengths counts as its sentences
    src, tgt = torch.randint(1, 60, (4, 6)), torch.randint(1, 60, (4, 9))
    assert flops.transformer_train_flops(config, [6] * 4, [9] * 4) == counted(
        lambda *a: model.loss(*a).backward(), src, tgt, tgt
    )


@pytest.mark.parametrize("vocab", [70, 20])  # the fused chunked loss (V > d) and the plain one (V <= d)
def test_causal_lm_count_matches_flop_counter(vocab):
    config = CausalLMConfig(vocab_size=vocab, d_model=32, num_heads=4, num_layers=2, d_ff=40, context=24, dropout=0.0)
    torch.manual_seed(0)
    model = CausalLM(config)
    forward = train = 0
    for s in (24, 9):
        ids = torch.randint(0, vocab, (2, s))
        forward += counted(model, ids)
        train += counted(lambda x: model.loss(x, x.roll(-1, dims=1)).backward(), ids)
    assert flops.causal_lm_forward_flops(config, [24, 24, 9, 9]) == forward
    assert flops.causal_lm_train_flops(config, [24, 24, 9, 9]) == train


def test_encoder_counts_match_flop_counter():
    """qkv's encoder-only model and a BERT-style encoder (with its [CLS] pooler), forward and a training pass."""
    config = TransformerConfig(src_vocab_size=50, d_model=32, num_heads=4, d_ff=64, num_encoder_layers=3, dropout=0.0)
    torch.manual_seed(0)
    encoder = EncoderModel(config)
    bert = BertEncoder(
        config=BertConfig(
            vocab_size=50,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=80,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
    )
    lengths = [5, 17]
    enc_forward = enc_train = bert_forward = bert_train = 0
    for s in lengths:
        ids = torch.randint(1, 50, (1, s))
        enc_forward += counted(encoder, ids)
        enc_train += counted(lambda x: encoder(x).last_hidden_state.sum().backward(), ids)
        bert_forward += counted(bert, ids)
        bert_train += counted(lambda x: bert(x).pooler_output.sum().backward(), ids)
    assert flops.encoder_forward_flops(32, 64, 3, lengths) == enc_forward
    assert flops.encoder_train_flops(32, 64, 3, lengths) == enc_train
    assert flops.encoder_forward_flops(32, 80, 2, lengths, pooled=True) == bert_forward
    assert flops.encoder_train_flops(32, 80, 2, lengths, pooled=True) == bert_train


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the fused attention kernels FlopCounterMode knows run on GPUs"
)
def test_fused_attention_on_a_gpu_computes_the_counted_squares_and_recomputes_the_scores():
    """With the GPU's fused kernel, the forward is the count; its backward recomputes the scores
    (FlopCounterMode: 5 products where the plain backward has 4), which is not model work: the counter
    sees the training count plus one ``2 s s d`` product per attention layer and sequence."""
    config = CausalLMConfig(vocab_size=100, d_model=64, num_heads=4, num_layers=2, d_ff=128, context=96, dropout=0.0)
    model = CausalLM(config).cuda()
    ids = torch.randint(0, 100, (3, 96), device="cuda")
    with use_backend("torch_sdpa"), FlopCounterMode(display=False) as counter:
        model(ids)
    assert counter.get_total_flops() == flops.causal_lm_forward_flops(config, [96] * 3)
    with use_backend("torch_sdpa"), FlopCounterMode(display=False) as counter:
        model.loss(ids, ids).backward()
    recompute = 3 * config.num_layers * 2 * 96 * 96 * 64
    assert counter.get_total_flops() == flops.causal_lm_train_flops(config, [96] * 3) + recompute


def test_lengths_are_checked():
    config = TransformerConfig(src_vocab_size=10, tgt_vocab_size=10, d_model=8, num_heads=2, d_ff=8)
    with pytest.raises(ValueError, match="2 source lengths but 1 target"):
        flops.transformer_train_flops(config, [3, 4], [5])
    with pytest.raises(ValueError, match="non-negative"):
        flops.transformer_train_flops(config, [-1], [5])


# --------------------------------------------------------------------------- a batch's figures
def test_a_padded_batch_counts_its_real_tokens_and_its_padding():
    """The work of a padded batch: the FLOPs of its pairs run one by one without padding (FlopCounterMode),
    and its padded positions counted from the token lists."""
    config = TransformerConfig(
        src_vocab_size=40, tgt_vocab_size=40, d_model=16, num_heads=2, d_ff=24, dropout=0.0, num_encoder_layers=1
    )
    model = Transformer(config)
    src = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14]]
    tgt = [[20, 21, 22, 23], [24], [25, 26]]
    batch = make_batch(src, tgt, pad_id=0, bos_id=1, eos_id=2)
    alone = 0
    for s, t in zip(src, tgt):
        pair = make_batch([s], [t], pad_id=0, bos_id=1, eos_id=2)
        alone += counted(lambda p: model.loss(p.src, p.tgt_in, p.tgt_out).backward(), pair)
    real = sum(len(s) + 1 for s in src) + sum(len(t) + 1 for t in tgt)  # EOS on the source, EOS/BOS on the target
    positions = 3 * (6 + 1) + 3 * (4 + 1)
    assert batch_work(config, batch) == (alone, real, positions)
    meter = Throughput(model, torch.device("cpu"), bf16=False)
    meter.add(meter.work([batch, batch]))
    record = meter.window(2.0)
    assert record["padding"] == pytest.approx(1 - real / positions, abs=1e-4)
    assert record["tflops_per_s"] == pytest.approx(2 * alone / 2.0 / 1e12, rel=1e-3)


def test_a_model_without_a_count_logs_nulls():
    meter = Throughput(torch.nn.Linear(3, 3), torch.device("cpu"), bf16=False)
    batch = make_batch([[3, 4]], [[5]], pad_id=0, bos_id=1, eos_id=2)
    meter.add(meter.work([batch]))
    assert meter.peak is None
    assert meter.window(1.0) == {"tflops_per_s": None, "mfu": None, "padding": None}


# --------------------------------------------------------------------------- peaks
def test_gpu_names_find_their_datasheet_rows():
    assert peaks.gpu_peak("NVIDIA H100 80GB HBM3", torch.bfloat16)[0] == 989.5e12
    assert peaks.gpu_peak("NVIDIA H100 PCIe", torch.bfloat16)[0] == 756.5e12
    assert peaks.gpu_peak("NVIDIA H200", torch.float32)[0] == 67e12
    assert peaks.gpu_peak("NVIDIA A100-SXM4-80GB", torch.bfloat16)[0] == 312e12
    assert peaks.gpu_peak("NVIDIA L4", torch.bfloat16)[0] == 121e12
    assert peaks.gpu_peak("NVIDIA L40S", torch.bfloat16)[0] == 362.05e12
    for unknown in ("NVIDIA A10G", "NVIDIA GH200 480GB", "Tesla T4"):
        assert peaks.gpu_peak(unknown, torch.bfloat16) is None


@pytest.mark.parametrize(
    "content",
    [
        b"\x80\x04\x95 not json (a pickle's first bytes)",
        b'{"version": 1, "peaks": {"KEY": {"flops": "1e12", "size": 1024, "source": "x"}}}',
        b'{"version": 1, "peaks": {"KEY": {"flops": -5.0, "size": 1024, "source": "x"}}}',
        b'{"version": 1, "peaks": {"KEY": {"flops": 1e300, "size": 1024, "source": "x"}}}',
        b'{"version": 2, "peaks": {"KEY": {"flops": 1.0e12, "size": 1024, "source": "x"}}}',
        b"[1, 2, 3]",
        b"[" * 100000,
    ],
)
def test_a_corrupt_or_foreign_peak_cache_is_measured_again_and_rewritten(tmp_path, content):
    path = peaks.cache_path()
    path.parent.mkdir(parents=True)
    key = peaks.machine_key(torch.float32, torch.get_num_threads())
    path.write_bytes(content.replace(b"KEY", key.encode()))
    flops_per_s, source = peaks.peak_flops("cpu", torch.float32)
    assert source.startswith("measured") and "cached" not in source
    assert math.isfinite(flops_per_s) and flops_per_s > 1e6
    assert json.loads(path.read_text())["peaks"][key]["flops"] == flops_per_s


def test_a_cached_peak_is_used_without_measuring(monkeypatch):
    peaks.peak_flops("cpu", torch.float32)  # measures and writes the cache
    peaks.cpu_peak.cache_clear()

    def refuse(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(peaks, "measure_matmul", refuse)
    flops_per_s, source = peaks.peak_flops("cpu", torch.float32)
    assert "cached in" in source and flops_per_s > 0


# --------------------------------------------------------------------------- metrics.jsonl of real runs
def read_train_records(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == "train"]


def test_a_translation_run_logs_flops_mfu_and_padding(tmp_path):
    pairs = generate_dates(64, seed=0)
    tokenizer = Tokenizer.train(pairs.src + pairs.tgt, vocab_size=300, split_digits=True)
    config = TransformerConfig(
        src_vocab_size=tokenizer.vocab_size,
        tgt_vocab_size=tokenizer.vocab_size,
        d_model=32,
        num_heads=2,
        num_encoder_layers=1,
        num_decoder_layers=1,
        d_ff=64,
        max_len=64,
        pad_id=tokenizer.pad_id,
    )
    task = TranslationTask(tokenizer, pairs, None, max_len=config.max_len, pad_id=config.pad_id)
    train = TrainConfig(max_tokens=400, max_steps=3, progress=False, average_last=1, log_every_steps=1)
    trainer = Trainer(Transformer(config), task, train, tmp_path)
    trainer.train()
    records = read_train_records(tmp_path)
    assert len(records) == 3
    for r in records:
        assert r["tflops_per_s"] > 0 and 0 < r["mfu"] < 1.5  # a busy 2-core machine may beat its measured peak
        assert 0 <= r["padding"] < 1
    assert any(r["padding"] > 0 for r in records)  # dates of different lengths share batches


def test_a_language_model_run_logs_no_padding(tmp_path):
    text = "".join(f"line {i}: to be, or not to be.\n" for i in range(200))
    tokenizer = CharTokenizer(sorted(set(text)))
    ids = np.asarray(tokenizer.encode(text), dtype=np.int64)
    task = LanguageModelTask(tokenizer, ids[:4000], None, context=32)
    config = CausalLMConfig(vocab_size=tokenizer.vocab_size, d_model=32, num_heads=4, num_layers=1, d_ff=64, context=32)
    train = TrainConfig(max_tokens=256, max_steps=2, progress=False, average_last=1, log_every_steps=1)
    trainer = Trainer(CausalLM(config), task, train, tmp_path)
    trainer.train()
    for r in read_train_records(tmp_path):
        assert r["padding"] == 0 and r["tflops_per_s"] > 0 and r["mfu"] > 0

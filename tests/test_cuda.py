"""The CUDA paths against the CPU: attention through PyTorch's GPU kernels (flash, memory-efficient)
against the float64 reference on the CPU, the models' logits and incremental decoding on the GPU
against the CPU (an ensemble's too), the fused losses (plain and R-Drop) against the float64
reference on the CPU, an R-Drop step of the Transformer on the GPU against its reference, training
steps on the GPU against the same steps on the CPU, a run saved on the GPU resumed on the CPU, and
DDP and FSDP2 over NCCL (one process: NCCL will not put two ranks on one GPU) against one plain
process.

Every test here is skipped on a machine without CUDA (CI has none); on a GPU machine run
``python -m pytest tests/test_cuda.py -q``.
"""

import math
import shutil

import dist_workers
import pytest
import torch
from test_loss import _tiny_transformer_and_batch
from test_training_objectives import check_transformer_rdrop_loss

import qkv
from qkv.attention import select_backend
from qkv.attention.functional import attention_reference
from qkv.data.dates import generate_dates
from qkv.data.spec import DataSpec
from qkv.decoding.search import beam_search, greedy_decode
from qkv.models.transformer import Transformer, TransformerConfig
from qkv.nn.loss import fused_linear_cross_entropy, label_smoothed_cross_entropy
from qkv.runs.translation import resume_run, start_run
from qkv.training.rdrop import fused_linear_rdrop_cross_entropy, rdrop_cross_entropy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CUDA = torch.device("cuda")
MODEL = dict(
    d_model=32, num_heads=2, num_encoder_layers=2, num_decoder_layers=1, d_ff=64, dropout=0.0, max_len=64, bias=False
)
TRAIN = dict(
    max_tokens=300,
    warmup_steps=4,
    lr_factor=0.02,
    max_steps=3,
    max_minutes=0.0,
    bf16=False,
    progress=False,
    average_last=1,
    eval_every_minutes=0.0,
    checkpoint_every_minutes=0.0,
    log_every_steps=1,
    label_smoothing=0.1,
)


@pytest.fixture(autouse=True)
def exact_float32_products():
    """Full float32 products on the GPU (no TF32), so that the CPU is a fair reference."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _inputs(b=3, h=4, s_q=9, s_k=9, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, s, d, generator=g, dtype=torch.float64) for s in (s_q, s_k, s_k)]


def _masks(b, s_q, s_k):
    keep = qkv.padding_mask_from_lengths([s_k, max(1, s_k - 3), 2][:b], s_k)[:, None, None, :]
    fully = keep.expand(b, 1, s_q, s_k).clone()
    fully[0, 0, s_q // 2, :] = False  # one query that sees no key: qkv's rule is a zero output
    additive = torch.zeros(b, 1, s_q, s_k, dtype=torch.float64).masked_fill(~fully, float("-inf"))
    return {"none": None, "padding": keep, "fully_masked_row": fully, "additive": additive}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask", ["none", "padding", "fully_masked_row", "additive"])
@pytest.mark.parametrize("causal,s_q,s_k", [(False, 9, 9), (True, 9, 9), (True, 4, 11), (False, 1, 7)])
def test_cuda_attention_matches_float64_reference(dtype, mask, causal, s_q, s_k):
    q, k, v = _inputs(s_q=s_q, s_k=s_k)
    attn_mask = _masks(3, s_q, s_k)[mask]
    truth = attention_reference(q, k, v, attn_mask=attn_mask, is_causal=causal)[0]
    qc, kc, vc = (t.to(CUDA, dtype).requires_grad_(True) for t in (q, k, v))
    mask_c = None if attn_mask is None else attn_mask.to(CUDA, dtype if attn_mask.is_floating_point() else None)
    assert select_backend(qc, kc, vc, mask_c, causal, 0.0, False).backend == "torch_sdpa"
    got = qkv.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask_c, is_causal=causal)
    assert torch.isfinite(got).all()
    # the bound: twice the error of the plain reference computed in the same dtype on the GPU
    own = attention_reference(*(t.detach() for t in (qc, kc, vc)), attn_mask=mask_c, is_causal=causal)[0]
    own_error = float((own.double().cpu() - truth).abs().max())
    bound = 2 * own_error + (1e-6 if dtype == torch.float32 else 1e-3)
    assert float((got.double().cpu() - truth).abs().max()) <= bound
    # gradients: against float64 autograd on the CPU
    grad = torch.randn(truth.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    q64, k64, v64 = (t.clone().requires_grad_(True) for t in (q, k, v))
    attention_reference(q64, k64, v64, attn_mask=attn_mask, is_causal=causal)[0].backward(grad)
    got.backward(grad.to(CUDA, dtype))
    tol = 1e-4 if dtype == torch.float32 else 0.08
    for name, mine, ref in (("q", qc, q64), ("k", kc, k64), ("v", vc, v64)):
        assert torch.isfinite(mine.grad).all(), name
        err = float((mine.grad.double().cpu() - ref.grad).abs().max())
        assert err <= tol * max(1.0, float(ref.grad.abs().max())), f"d{name}: {err:.3g}"


def test_unmasked_causal_attention_runs_on_the_flash_kernel():
    """The common training call (no mask, causal self-attention, bf16) runs when only the flash
    kernel is allowed: qkv passes it nothing that would push PyTorch off it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (t.to(CUDA, torch.bfloat16).requires_grad_(True) for t in _inputs(b=2, h=4, s_q=128, s_k=128, d=64))
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        out = qkv.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.float().sum().backward()
    truth = attention_reference(*(t.detach().double().cpu() for t in (q, k, v)), is_causal=True)[0]
    assert float((out.double().cpu() - truth).abs().max()) < 0.02


@pytest.fixture(scope="module")
def untrained():
    torch.manual_seed(3)
    config = TransformerConfig(
        src_vocab_size=40,
        tgt_vocab_size=40,
        d_model=32,
        num_heads=4,
        num_encoder_layers=2,
        num_decoder_layers=2,
        d_ff=64,
        dropout=0.0,
        max_len=40,
    )
    model = Transformer(config).eval()
    src = torch.randint(3, 40, (5, 9))
    src[1, 6:] = 0
    src[3, 2:] = 0
    return model, src


def test_transformer_logits_and_cached_decoding_on_cuda_match_the_cpu(untrained):
    import copy

    model, src = untrained
    gpu = copy.deepcopy(model).to(CUDA)
    tgt = torch.randint(3, 40, (5, 7))
    tgt[:, 0] = 1
    with torch.no_grad():
        want = model(src, tgt)
        got = gpu(src.to(CUDA), tgt.to(CUDA))
        torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)
        memory = gpu.encode(src.to(CUDA))
        cache, steps = None, []
        for t in range(tgt.size(1)):
            out = gpu.decode(tgt[:, t : t + 1].to(CUDA), memory, cache=cache)
            cache = out.cache
            steps.append(out.logits)
        torch.testing.assert_close(torch.cat(steps, dim=1).cpu(), want, atol=1e-4, rtol=1e-4)
    kwargs = dict(bos_id=1, eos_id=2, extra_len=10)
    assert greedy_decode(gpu, src.to(CUDA), **kwargs) == greedy_decode(model, src, **kwargs)
    assert beam_search(gpu, src.to(CUDA), beam_size=3, **kwargs) == beam_search(model, src, beam_size=3, **kwargs)


def test_an_ensemble_on_cuda_decodes_as_on_the_cpu(untrained):
    import copy

    from qkv.decoding.ensemble import Ensemble

    model, src = untrained
    torch.manual_seed(4)
    other = Transformer(model.config).eval()
    cpu = Ensemble([model, other])
    gpu = copy.deepcopy(cpu).to(CUDA)
    tgt = torch.randint(3, 40, (5, 7))
    tgt[:, 0] = 1
    with torch.no_grad():
        want = cpu.decode(tgt, cpu.encode(src)).logits
        got = gpu.decode(tgt.to(CUDA), gpu.encode(src.to(CUDA))).logits
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)
    kwargs = dict(bos_id=1, eos_id=2, extra_len=10)
    assert beam_search(gpu, src.to(CUDA), beam_size=3, **kwargs) == beam_search(cpu, src, beam_size=3, **kwargs)


@pytest.mark.parametrize("rdrop", [None, 3.0])
@pytest.mark.parametrize("bf16", [False, True])
def test_fused_losses_on_cuda_match_the_float64_reference(rdrop, bf16):
    """The fused output projection + loss on the GPU (chunks with a padded last one, as the training
    step runs them) against PyTorch on the full logits in float64 on the CPU: loss and gradients."""
    g = torch.Generator().manual_seed(8)
    hidden_a = torch.randn(300, 64, generator=g, dtype=torch.float64)
    hidden_b = hidden_a + 0.3 * torch.randn(300, 64, generator=g, dtype=torch.float64)
    weight = 0.2 * torch.randn(1000, 64, generator=g, dtype=torch.float64)
    target = torch.randint(1, 1000, (300,), generator=g)
    target[::7] = 0  # padding
    cpu = [t.clone().requires_grad_() for t in (hidden_a, hidden_b, weight)]
    if rdrop is None:
        reference = label_smoothed_cross_entropy(cpu[0] @ cpu[2].T, target, 0.1, 0)
        inputs_ref = (cpu[0], cpu[2])
    else:
        reference = rdrop_cross_entropy(cpu[0] @ cpu[2].T, cpu[1] @ cpu[2].T, target, 0.1, 0, rdrop)
        inputs_ref = tuple(cpu)
    grads_ref = torch.autograd.grad(reference, inputs_ref)
    gpu = [t.float().to(CUDA).requires_grad_() for t in (hidden_a, hidden_b, weight)]
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        if rdrop is None:
            got = fused_linear_cross_entropy(gpu[0], gpu[2], target.to(CUDA), 0.1, 0, chunk_rows=128)
            inputs = (gpu[0], gpu[2])
        else:
            got = fused_linear_rdrop_cross_entropy(
                gpu[0], gpu[1], gpu[2], target.to(CUDA), 0.1, 0, rdrop, chunk_rows=128
            )
            inputs = tuple(gpu)
    grads = torch.autograd.grad(got, inputs)
    assert got.dtype == torch.float32 and all(x.dtype == torch.float32 for x in grads)
    tolerance = dict(rel=2e-2) if bf16 else dict(rel=1e-5)
    assert got.item() == pytest.approx(reference.item(), **tolerance)
    for grad, grad_ref in zip(grads, grads_ref):
        scale = float(grad_ref.abs().max())
        worst = float((grad.double().cpu() - grad_ref).abs().max())
        assert worst <= (3e-2 if bf16 else 1e-5) * scale, (worst, scale)


@pytest.mark.parametrize("bf16", [False, True])
def test_fused_loss_on_cuda_is_deterministic(bf16):
    """Two calls on the same inputs give bitwise the same loss and gradients, though many positions
    share a target (CUDA's atomic adds into shared rows would not): a resumed run must end on the
    uninterrupted run's weights (tests/test_crash_consistency.py)."""
    g = torch.Generator().manual_seed(9)
    hidden = torch.randn(2000, 64, generator=g).to(CUDA)
    weight = (0.2 * torch.randn(500, 64, generator=g)).to(CUDA)
    target = torch.randint(1, 6, (2000,), generator=g).to(CUDA)  # 5 ids for 2,000 positions

    def loss_and_grads():
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = fused_linear_cross_entropy(h, w, target, 0.1, 0, chunk_rows=256)
        return (loss, *torch.autograd.grad(loss, (h, w)))

    for first, second in zip(loss_and_grads(), loss_and_grads()):
        assert torch.equal(first, second)


def test_transformer_rdrop_loss_on_cuda_matches_its_reference():
    """R-Drop's stacked pass on the GPU (each copy its own dropout from CUDA's random stream) against
    the reference on the logits of the same stacked batch drawn with the same stream."""
    config, model, src, tgt_in, tgt_out = _tiny_transformer_and_batch(dropout=0.3, seed=6)
    check_transformer_rdrop_loss(model.to(CUDA), src.to(CUDA), tgt_in.to(CUDA), tgt_out.to(CUDA), config.pad_id)


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda")
    pairs = generate_dates(400, seed=21)
    (root / "s.txt").write_text("\n".join(pairs.src) + "\n", encoding="utf-8")
    (root / "t.txt").write_text("\n".join(pairs.tgt) + "\n", encoding="utf-8")
    spec = DataSpec(
        source="files",
        train_src=str(root / "s.txt"),
        train_tgt=str(root / "t.txt"),
        val_src=None,
        val_tgt=None,
    )
    torch.manual_seed(0)
    start_run(root / "base", data=spec, model_options=MODEL, vocab_size=300, train_options=TRAIN, device="cpu")
    return root


def _weights(trainer):
    return {k: v.detach().double().cpu() for k, v in trainer.plain_model().state_dict().items()}


def _worst(a, b):
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_training_steps_on_cuda_match_the_cpu_and_resume_on_the_cpu(base_run):
    for name in ("cpu", "cuda"):
        shutil.copytree(base_run / "base", base_run / name)
    on_cpu = resume_run(base_run / "cpu", device="cpu")
    on_cpu.train()
    on_gpu = resume_run(base_run / "cuda", device="cuda")
    assert next(on_gpu.plain_model().parameters()).device.type == "cuda"
    on_gpu.train()
    assert _worst(_weights(on_gpu), _weights(on_cpu)) < 1e-5
    # a run saved on the GPU goes on on the CPU, and matches the CPU going on
    again_gpu = resume_run(base_run / "cuda", train_options={"max_steps": 6}, device="cpu")
    again_gpu.train()
    again_cpu = resume_run(base_run / "cpu", train_options={"max_steps": 6}, device="cpu")
    again_cpu.train()
    assert _worst(_weights(again_gpu), _weights(again_cpu)) < 1e-5


def test_bf16_training_on_cuda_learns(base_run):
    shutil.copytree(base_run / "base", base_run / "bf16")
    trainer = resume_run(
        base_run / "bf16",
        train_options={"bf16": True, "max_steps": 80, "lr_factor": 0.2, "max_tokens": 1500},
        device="cuda",
    )
    losses = []
    for epoch in range(20):
        for batch in trainer.task.batches(epoch, 1500, 0):
            stats = trainer.step([trainer.task.make_batch(batch)])
            losses.append(stats.loss / stats.tokens)
    assert all(math.isfinite(x) for x in losses)
    assert len(losses) >= 60
    assert sum(losses[-10:]) / 10 < 0.6 * sum(losses[:5]) / 5


def _nccl_scenario(rank, world, port, out, run_dir, strategy):
    import dataclasses
    import os

    import torch.distributed as dist

    from qkv.training.distributed import Distributed, init_distributed, shutdown

    class AsIfSeveral(Distributed):
        """One rank that takes the distributed path: the DDP or FSDP2 wrapper, and every collective
        over NCCL (qkv trains a lone process unwrapped, and NCCL puts no two ranks on one GPU)."""

        @property
        def enabled(self) -> bool:
            return True

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))  # world 1 is otherwise not distributed
    try:
        ctx = init_distributed("cuda")  # joins the group made above: the NCCL path, set_device and all
        assert dist.get_backend() == "nccl" and ctx.device == torch.device("cuda", 0)
        ctx = AsIfSeveral(**dataclasses.asdict(ctx))
        trainer = resume_run(run_dir, train_options={"strategy": strategy}, device="cuda", dist=ctx)
        trainer.train()
        torch.save(
            {k: v.detach().double().cpu() for k, v in trainer.plain_model().state_dict().items()},
            f"{out}/{strategy}.pt",
        )
    finally:
        shutdown()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_ddp_and_fsdp2_over_nccl_match_one_plain_process(base_run, strategy):
    shutil.copytree(base_run / "base", base_run / f"plain_{strategy}")
    shutil.copytree(base_run / "base", base_run / strategy)
    plain = resume_run(base_run / f"plain_{strategy}", device="cuda")
    plain.train()
    # one spawned process (a failure in it raises here, with its traceback)
    torch.multiprocessing.start_processes(
        _nccl_scenario,
        args=(1, dist_workers.free_port(), str(base_run), str(base_run / strategy), strategy),
        nprocs=1,
        start_method="spawn",
    )
    shared = torch.load(base_run / f"{strategy}.pt")
    assert _worst(shared, _weights(plain)) < 1e-5

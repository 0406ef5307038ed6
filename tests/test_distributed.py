"""Training on two processes (gloo, CPU) against one process, the equivalences PyTorch's own DDP
tests and fairseq assert: 2 ranks x batch B == 1 process x batch 2B; accumulation of 2
micro-batches == one batch; an epoch that does not divide among the ranks finishes without a
hang (and equals one process); a run saved by 2 processes resumes on 1 and the other way round;
FSDP2 matches DDP; the moving average of the weights (--ema-decay) on 2 ranks equals 1 process's.
Float32, dropout 0, the same initial weights everywhere, Adam with a peak learning
rate of 1.8e-3.

The models have no biases: a key projection's bias has a zero gradient in exact arithmetic (softmax
ignores a shift shared by a query's scores), so Adam turns its rounding noise into steps of +-lr
that differ between ANY two numerically different but equal computations (one batch of 2B vs two
of B on one process already differ by 0.05 there); every other weight agrees to 1e-7.

All 2-process work runs in one spawned pair of processes (tests/dist_workers.py), started once.
"""

import shutil
import subprocess
import sys
import time

import dist_workers
import pytest
import torch
from safetensors.torch import load_file

from qkv.data.dates import generate_dates
from qkv.data.spec import DataSpec
from qkv.runs.translation import resume_run, start_run

# ReLU, not the float32 recipe's GELU: GELU's gradients for negative inputs are tiny but not zero, so, like the
# key bias's, their rounding noise reaches Adam (4e-6 after 3 steps here); ReLU's are exactly zero
MODEL = dict(
    d_model=32,
    num_heads=2,
    num_encoder_layers=2,
    num_decoder_layers=1,
    d_ff=64,
    dropout=0.0,
    max_len=64,
    bias=False,
    activation="relu",
)
LM_MODEL = dict(d_model=32, num_heads=2, num_layers=2, d_ff=64, context=32, dropout=0.0, bias=False)
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
EMA = {"ema_decay": 0.8}  # a short memory, so that 6 steps move the average well away from the first weights


def weights(path):
    return torch.load(path, weights_only=True, map_location="cpu")["model"]


def assert_close(a, b, atol, what):
    assert a.keys() == b.keys(), what
    worst = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
    assert worst <= atol, f"{what}: largest weight difference {worst:.3g} > {atol}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run folders from one start (same initial weights), the 2-process work done in one launch,
    and the 1-process references."""
    root = tmp_path_factory.mktemp("dist")
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
    base = start_run(root / "base", data=spec, model_options=MODEL, vocab_size=300, train_options=TRAIN, device="cpu")
    batches = base.task.batches(0, TRAIN["max_tokens"], 0)
    uneven_tokens = next(t for t in range(200, 400, 10) if len(base.task.batches(0, t, 0)) % 2 == 1)
    for name in (
        "ddp",
        "subword_ddp",
        "subword_1",
        "resumed_on_1",
        "resumed_on_2",
        "uneven",
        "uneven_1",
        "fsdp",
        "steps",
        "steps_fsdp",
        "fsdp_resumed_on_2",
        "ema_ddp",
        "ema_1",
        "ema_resumed_on_2",
    ):
        shutil.copytree(root / "base", root / name)
    steps = [[batches[2 * k], batches[2 * k + 1]] for k in range(5)]
    # the language model through the same engine
    (root / "lm.txt").write_text("".join(f"{p} -> {q}\n" for p, q in zip(pairs.src, pairs.tgt)), encoding="utf-8")
    torch.manual_seed(0)
    lm = start_run(
        root / "lm_base",
        data=DataSpec(source="text", train_text=str(root / "lm.txt")),
        model_options=LM_MODEL,
        train_options={**TRAIN, "max_tokens": 128},
        device="cpu",
    )
    lm_batches = lm.task.batches(0, 128, 0)
    lm_steps = [[lm_batches[2 * k], lm_batches[2 * k + 1]] for k in range(5)]
    shutil.copytree(root / "lm_base", root / "lm_steps")
    # 1 process, first half of "resumed_on_2" (accumulating the 2 batches that 2 processes share)
    resume_run(root / "resumed_on_2", train_options={"accum_steps": 2, "max_steps": 3}, device="cpu").train()
    resume_run(root / "ema_resumed_on_2", train_options={"accum_steps": 2, "max_steps": 3, **EMA}, device="cpu").train()
    plan = [
        ("steps", str(root / "steps"), steps, "ddp", "ddp_steps"),
        ("steps", str(root / "steps_fsdp"), steps, "fsdp", "fsdp_steps"),
        ("steps", str(root / "lm_steps"), lm_steps, "ddp", "lm_ddp_steps"),
        ("train", str(root / "ddp"), {"max_steps": 6}),
        ("train", str(root / "fsdp"), {"max_steps": 6, "strategy": "fsdp"}),
        ("train", str(root / "subword_ddp"), {"max_steps": 6, "subword_dropout": 0.3}),
        ("train", str(root / "resumed_on_1"), {"max_steps": 3}),
        ("train", str(root / "resumed_on_2"), {"max_steps": 6, "accum_steps": 1}),
        ("finish", str(root / "ema_ddp"), {"max_steps": 6, **EMA}),
        ("finish", str(root / "ema_resumed_on_2"), {"max_steps": 6, "accum_steps": 1, **EMA}),
        ("train", str(root / "uneven"), {"max_steps": 0, "max_epochs": 1.0, "max_tokens": uneven_tokens}),
        # FSDP2 saves its optimizer in shards: 3 steps, a copy resumed later on 1 process, 3 more on 2
        ("train", str(root / "fsdp_resumed_on_2"), {"max_steps": 3, "strategy": "fsdp"}),
        ("copy", str(root / "fsdp_resumed_on_2"), str(root / "fsdp_resumed_on_1")),
        ("train", str(root / "fsdp_resumed_on_2"), {"max_steps": 6, "strategy": "fsdp"}),
    ]
    out = root / "out"
    out.mkdir()
    try:
        dist_workers.launch(dist_workers.run_scenarios, (str(out), plan), timeout=300)
    except Exception:
        errors = "\n".join(p.read_text() for p in out.glob("error-*.txt"))
        raise AssertionError(f"the 2-process run failed:\n{errors}") from None
    # 1 process: the second half of "resumed_on_1", and the references
    resume_run(root / "resumed_on_1", train_options={"max_steps": 6, "accum_steps": 2}, device="cpu").train()
    resume_run(root / "ema_1", train_options={"max_steps": 6, "accum_steps": 2, **EMA}, device="cpu").train()
    resume_run(
        root / "subword_1", train_options={"max_steps": 6, "accum_steps": 2, "subword_dropout": 0.3}, device="cpu"
    ).train()
    resume_run(root / "fsdp_resumed_on_1", train_options={"max_steps": 6, "accum_steps": 2}, device="cpu").train()
    resume_run(
        root / "uneven_1",
        train_options={"max_steps": 0, "max_epochs": 1.0, "accum_steps": 2, "max_tokens": uneven_tokens},
        device="cpu",
    ).train()
    return root, steps, lm_steps


def one_process_steps(root, steps, *, split, run="base"):
    """5 steps on 1 process: each step's two batches as one batch of 2B (``split=False``) or as two
    accumulated micro-batches (``split=True``)."""
    trainer = resume_run(root / run, train_options={"progress": False}, device="cpu")
    for first, second in steps:
        task = trainer.task
        trainer.step([task.make_batch(first), task.make_batch(second)] if split else [task.make_batch(first + second)])
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_two_ranks_with_batch_b_equal_one_process_with_batch_2b(runs):
    root, steps, _ = runs
    ddp = torch.load(root / "out" / "ddp_steps.pt")
    assert_close(ddp, one_process_steps(root, steps, split=False), 1e-6, "DDP 2 x B vs 1 x 2B")
    initial = weights(root / "base" / "state.pt")
    assert max(float((ddp[k] - initial[k]).abs().max()) for k in ddp) > 1e-3  # it did train


def test_a_language_model_on_two_ranks_equals_one_process_with_both_batches(runs):
    root, _, lm_steps = runs
    ddp = torch.load(root / "out" / "lm_ddp_steps.pt")
    assert_close(ddp, one_process_steps(root, lm_steps, split=False, run="lm_base"), 1e-6, "LM: DDP 2 x B vs 1 x 2B")
    initial = weights(root / "lm_base" / "state.pt")
    assert max(float((ddp[k] - initial[k]).abs().max()) for k in ddp) > 1e-3  # it did train


def test_accumulating_two_micro_batches_equals_one_batch(runs):
    root, steps, _ = runs
    assert_close(
        one_process_steps(root, steps, split=True),
        one_process_steps(root, steps, split=False),
        1e-6,
        "2 micro-batches of B/2 vs one batch of B",
    )


def test_subword_dropout_cuts_the_same_on_two_ranks_as_on_one_process(runs):
    root, _, _ = runs
    two = weights(root / "subword_ddp" / "state.pt")
    assert_close(two, weights(root / "subword_1" / "state.pt"), 1e-6, "subword dropout: 2 processes vs 1")
    plain = weights(root / "ddp" / "state.pt")
    assert max(float((two[k] - plain[k]).abs().max()) for k in two) > 1e-4  # the split batches trained differently


def averaged_weights(ema_state):
    """An AveragedModel's state dict as the model's own: ``module.`` dropped, the step count left out."""
    return {k.removeprefix("module."): v for k, v in ema_state.items() if k != "n_averaged"}


def test_the_moving_average_of_the_weights_on_two_ranks_equals_one_process(runs):
    root, _, _ = runs
    reference = torch.load(root / "ema_1" / "state.pt", weights_only=True)["ema"]  # 1 process, 2 micro-batches
    for name in ("ema_ddp", "ema_resumed_on_2"):
        saved = torch.load(root / name / "state.pt", weights_only=True)["ema"]
        assert int(saved["n_averaged"]) == int(reference["n_averaged"]) == 6, name
        assert_close(saved, reference, 1e-6, f"EMA: {name} vs 1 process")
        # the average the run hands on, written by rank 0 (tied tensors stored once)
        written, average = load_file(root / name / "ema.safetensors"), averaged_weights(saved)
        assert_close(written, {k: average[k] for k in written}, 0.0, f"{name}: ema.safetensors vs the checkpoint")
    last, average = weights(root / "ema_ddp" / "state.pt"), averaged_weights(reference)
    assert max(float((last[k] - average[k]).abs().max()) for k in last) > 1e-4  # an average, not the last weights


def test_fsdp2_matches_ddp(runs):
    root, _, _ = runs
    assert_close(
        torch.load(root / "out" / "fsdp_steps.pt"),
        torch.load(root / "out" / "ddp_steps.pt"),
        1e-5,
        "FSDP2 vs DDP, Trainer.step",
    )
    assert_close(
        weights(root / "fsdp" / "state.pt"),
        weights(root / "ddp" / "state.pt"),
        1e-5,
        "FSDP2 vs DDP, the training loop with its checkpoint",
    )


def test_runs_resume_on_another_number_of_processes(runs):
    root, _, _ = runs
    reference = weights(root / "ddp" / "state.pt")  # 2 processes, 6 steps, uninterrupted
    assert_close(weights(root / "resumed_on_1" / "state.pt"), reference, 1e-6, "2 processes, then 1")
    assert_close(weights(root / "resumed_on_2" / "state.pt"), reference, 1e-6, "1 process, then 2")
    for name in ("ddp", "resumed_on_1", "resumed_on_2"):
        saved = torch.load(root / name / "state.pt", weights_only=True)
        assert saved["train_state"]["step"] == 6 and saved["optimizer"]["state"]  # Adam moments travelled


def test_fsdp2_saves_its_optimizer_in_shards_that_resume_on_any_number_of_processes(runs):
    root, _, _ = runs
    # resumed from the step-3 shards on one process, which saves its optimizer whole in state.pt
    one = torch.load(root / "fsdp_resumed_on_1" / "state.pt", weights_only=True)
    assert one["optimizer"]["state"] and not list((root / "fsdp_resumed_on_1").glob("optimizer-step*"))
    saved = torch.load(root / "fsdp_resumed_on_2" / "state.pt", weights_only=True)
    folder = root / "fsdp_resumed_on_2" / saved["optimizer"]["shards"]
    assert saved["train_state"]["step"] == 6 and "state" not in saved["optimizer"]
    assert len(list(folder.glob("*.distcp"))) == 2 and (folder / ".metadata").is_file()  # one shard per process
    assert [p.name for p in folder.parent.glob("optimizer-step*")] == [folder.name]  # the step-3 shards are gone
    reference = weights(root / "fsdp" / "state.pt")  # FSDP2, 6 steps, uninterrupted
    assert_close(weights(root / "fsdp_resumed_on_2" / "state.pt"), reference, 1e-6, "FSDP2 resumed on 2")
    assert_close(weights(root / "fsdp_resumed_on_1" / "state.pt"), reference, 1e-6, "FSDP2 resumed on 1")


def test_an_epoch_that_does_not_divide_among_ranks_finishes_like_one_process(runs):
    root, _, _ = runs
    state = torch.load(root / "uneven" / "state.pt", weights_only=True)["train_state"]
    assert state["epoch"] == 0 and state["step"] > 0  # one epoch, its last step half empty
    assert_close(
        weights(root / "uneven" / "state.pt"),
        weights(root / "uneven_1" / "state.pt"),
        1e-6,
        "uneven epoch on 2 processes vs 1 process accumulating 2",
    )


@pytest.mark.skipif(sys.platform != "linux", reason="uses pgrep")
def test_a_killed_rank_stops_the_launcher_quickly(tmp_path):
    pairs = generate_dates(200, seed=1)
    (tmp_path / "s.txt").write_text("\n".join(pairs.src) + "\n", encoding="utf-8")
    (tmp_path / "t.txt").write_text("\n".join(pairs.tgt) + "\n", encoding="utf-8")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "qkv",
        "train",
        "--train-src",
        str(tmp_path / "s.txt"),
        "--train-tgt",
        str(tmp_path / "t.txt"),
        "--run-dir",
        str(tmp_path / "run"),
        "--max-steps",
        "100000",
        "--minutes",
        "0",
        "--vocab-size",
        "300",
        "--d-model",
        "32",
        "--heads",
        "2",
        "--encoder-layers",
        "1",
        "--decoder-layers",
        "1",
        "--d-ff",
        "64",
        "--no-bf16",
        "--no-progress",
        "--max-tokens",
        "300",
        "--device",
        "cpu",
    ]
    launcher = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "run" / "metrics.jsonl").exists():  # training under way on both ranks
            assert launcher.poll() is None, launcher.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.2)
        workers = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True).stdout.split()
        assert len(workers) == 2, workers
        killed_at = time.monotonic()
        subprocess.run(["kill", "-9", workers[-1]], check=True)
        code = launcher.wait(timeout=60)
        assert code != 0 and time.monotonic() - killed_at < 60
    finally:
        if launcher.poll() is None:
            launcher.kill()


def test_fsdp2_shards_on_a_mesh_of_the_processes_own_device(monkeypatch):
    """FSDP2 left to itself builds its device mesh on CUDA whenever CUDA is present, so a gloo run on a
    GPU machine's CPUs asked rank 1 for a second GPU (seen on an H200): ``wrap`` names the mesh's device."""
    import torch.distributed.device_mesh as device_mesh
    import torch.distributed.fsdp as fsdp

    from qkv.models.transformer import Transformer, TransformerConfig
    from qkv.training.distributed import Distributed, wrap

    meshes, sharded = [], []
    monkeypatch.setattr(device_mesh, "init_device_mesh", lambda kind, shape: meshes.append((kind, shape)) or "mesh")
    monkeypatch.setattr(fsdp, "fully_shard", lambda module, *, mesh=None: sharded.append(mesh))
    model = Transformer(TransformerConfig(src_vocab_size=40, tgt_vocab_size=40, **MODEL))
    wrap(model, lambda m, *a: None, Distributed(rank=0, world_size=2, device=torch.device("cpu")), "fsdp")
    assert meshes == [("cpu", (2,))]
    assert sharded == ["mesh"] * 4  # 2 encoder layers, 1 decoder layer, the root

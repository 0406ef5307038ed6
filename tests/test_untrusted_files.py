"""Files from someone else: a run folder, a model folder or an optimizer shard folder can never run
code, and a config that asks for a huge model is refused in one line before memory is spent.

Each payload here is a real attack on the loader it targets; the tests also show, where it is
cheap, that the plain (unsafe) loader would have run it, so they cannot pass vacuously.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from test_reliability import one_line_error, train_args, write_pairs

from qkv.cli import main


class Payload:
    """Pickles to a call of ``os.system`` that creates ``marker``: loading it with full unpickling runs it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished two-step translation run (its folder)."""
    root = tmp_path_factory.mktemp("untrusted")
    src, tgt = write_pairs(root / "data")
    assert main(train_args(src, tgt, root / "run", "--average-last", "1")) == 0
    return root / "run"


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    """A finished two-step character language-model run (its folder)."""
    root = tmp_path_factory.mktemp("untrusted_lm")
    text = root / "train.txt"
    text.write_text("".join(f"to be or not to be, line {i}.\n" for i in range(200)), encoding="utf-8")
    assert (
        main(
            [
                "train",
                "--train-text",
                str(text),
                "--run-dir",
                str(root / "lm"),
                "--max-steps",
                "2",
                "--minutes",
                "0",
                "--no-bf16",
                "--d-model",
                "32",
                "--heads",
                "2",
                "--layers",
                "1",
                "--d-ff",
                "64",
                "--context",
                "16",
                "--max-tokens",
                "256",
                "--no-progress",
                "--threads",
                "1",
            ]
        )
        == 0
    )
    return root / "lm"


def copy_of(folder: Path, tmp_path: Path, name: str = "copy") -> Path:
    target = tmp_path / name
    shutil.copytree(folder, target)
    return target


def test_a_pickled_payload_in_state_pt_is_refused_and_never_runs(run, tmp_path, capsys):
    copy = copy_of(run, tmp_path)
    marker = tmp_path / "marker"
    saved = torch.load(copy / "state.pt", weights_only=True)
    torch.save({**saved, "extra": Payload(marker)}, copy / "state.pt")
    before = (copy / "state.pt").read_bytes()

    line = one_line_error(
        capsys,
        "train",
        main(["train", "--run-dir", str(copy), "--resume", "--max-steps", "3", "--no-progress", "--threads", "1"]),
    )
    assert "state.pt" in line and "posix.system" in line and "--trust-checkpoint" in line
    assert not marker.exists() and (copy / "state.pt").read_bytes() == before
    # the premise: the loader qkv used before (full unpickling) runs the payload
    torch.load(copy / "state.pt", weights_only=False)
    assert marker.exists()


def test_trust_checkpoint_converts_an_older_state_once(run, tmp_path, capsys):
    """A state.pt holding objects the safe loader refuses (numpy's random state, as an older version
    might have kept it) resumes only with --trust-checkpoint, which rewrites it in the safe form once;
    an object that form cannot hold stays refused even then."""
    import numpy as np

    copy = copy_of(run, tmp_path)
    saved = torch.load(copy / "state.pt", weights_only=True)
    torch.save(
        {
            **saved,
            "numpy_rng": np.random.default_rng(0).bit_generator.state["state"]["state"],
            "np_state": np.random.RandomState(0).get_state(),
        },
        copy / "state.pt",
    )
    args = ["train", "--run-dir", str(copy), "--resume", "--max-steps", "3", "--no-progress", "--threads", "1"]
    line = one_line_error(capsys, "train", main(args))
    assert "numpy" in line and "--trust-checkpoint" in line
    assert main([*args, "--trust-checkpoint"]) == 0
    resumed = torch.load(copy / "state.pt", weights_only=True)  # the safe form now, with training gone on
    assert resumed["train_state"]["step"] == 3
    later = ["train", "--run-dir", str(copy), "--resume", "--max-steps", "4", "--no-progress", "--threads", "1"]
    assert main(later) == 0  # no flag needed any more

    from fractions import Fraction  # a class qkv never writes: not convertible

    torch.save({**saved, "extra": Fraction(1, 3)}, copy / "state.pt")
    assert "cannot be converted" in one_line_error(capsys, "train", main([*args, "--trust-checkpoint"]))


def test_trust_checkpoint_needs_resume(tmp_path, capsys):
    src, tgt = write_pairs(tmp_path / "data")
    line = one_line_error(capsys, "train", main([*train_args(src, tgt, tmp_path / "new"), "--trust-checkpoint"]))
    assert "--resume" in line and not (tmp_path / "new").exists()


def test_optimizer_shard_metadata_and_items_never_unpickle_code(tmp_path):
    """An FSDP run's optimizer shards (torch.distributed.checkpoint): a pickled payload in the
    folder's .metadata, or stored as a non-tensor item, is refused; a real folder loads exactly."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from qkv.runtime.safe_load import read_dcp_metadata, safe_dcp_load

    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.25)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    real = {"state": optimizer.state_dict()["state"], "lr": 0.25}
    dcp.save(real, checkpoint_id=str(tmp_path / "real"), no_dist=True)
    loaded = {"state": {k: {n: torch.zeros_like(t) for n, t in v.items()} for k, v in real["state"].items()}, "lr": 0}
    safe_dcp_load(loaded, tmp_path / "real", no_dist=True)
    assert loaded["lr"] == 0.25
    for k, v in real["state"].items():
        for n, t in v.items():
            assert torch.equal(loaded["state"][k][n], t)

    marker = tmp_path / "marker"
    dcp.save({"lr": Payload(marker)}, checkpoint_id=str(tmp_path / "item"), no_dist=True)  # a non-tensor item
    with pytest.raises(ValueError, match=r"item: not readable optimizer shards \(refused to load posix\.system\)$"):
        safe_dcp_load({"lr": 0}, tmp_path / "item", no_dist=True)
    assert not marker.exists()

    import pickle

    bad = tmp_path / "real" / ".metadata"
    bad.write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(
        ValueError,
        match=r"\.metadata: not a readable optimizer shard index \(refused to load "
        r"posix\.system\)",
    ):
        read_dcp_metadata(bad)
    assert not marker.exists()
    dcp.load({"lr": 0}, checkpoint_id=str(tmp_path / "item"), no_dist=True)  # the premise: torch's own loader runs it
    assert marker.exists()


# --- sizes checked before memory is spent -------------------------------------------------------

# Run in a fresh process so its peak resident memory is this check's alone: every loader of the
# folder, each expected to fail in one line. A hang or a run-away allocation is what is being caught.
CHILD = textwrap.dedent("""
    import contextlib, io, json, resource, sys
    from qkv.cli import main
    results = []
    for args in json.loads(sys.argv[1]):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = main(args)
            except SystemExit as stop:
                code = stop.code
        results.append({"args": args, "code": code, "stderr": err.getvalue()})
    # this process's own peak: VmHWM starts afresh at exec, while ru_maxrss keeps the forking parent's
    # (a pytest worker that earlier tests made large)
    status = open("/proc/self/status").read() if sys.platform == "linux" else ""
    hwm = [int(line.split()[1]) / 1024 for line in status.splitlines() if line.startswith("VmHWM:")]
    peak = hwm[0] if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"results": results, "peak_mb": peak}))
""")

PEAK_MB = 1500  # importing torch and qkv takes ~400 MB; the refused configs asked for 4-120 GB


def run_loaders(commands: list[list[str]], cwd: Path) -> tuple[list[dict], float]:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(commands)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    return report["results"], report["peak_mb"]


def edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    change(data)
    path.write_text(json.dumps(data), encoding="utf-8")


def translation_loaders(folder: Path) -> list[list[str]]:
    text = folder.parent / "input.txt"
    text.write_text("12/05/1999\n", encoding="utf-8")
    return [
        ["translate", str(folder), str(text), "--threads", "1"],
        ["evaluate", str(folder), "--src", str(text), "--ref", str(text), "--threads", "1"],
        ["attend", "12/05/1999", "--model", str(folder), "-o", str(folder.parent / "a.html")],
        ["serve", "--model", str(folder), "--port", "0"],
        ["train", "--run-dir", str(folder), "--resume", "--max-steps", "3", "--no-progress", "--threads", "1"],
    ]


# sizes within qkv's bounds (qkv.runtime.limits) that the weights cannot fill, refused by comparing the
# config with the weights file; and sizes beyond the bounds, refused by the config's own check
HUGE = {
    "layers": (lambda m: m.update(num_encoder_layers=1000, num_decoder_layers=1000), "num_encoder_layers is 1000"),
    "d_model": (lambda m: m.update(d_model=2**16), "d_model = 65536"),
    "vocabulary": (lambda m: m.update(src_vocab_size=2**21, tgt_vocab_size=2**21), "vocab_size = 2097152"),
    "positions": (lambda m: m.update(max_len=10**9), "max_len must be at most 1,048,576"),
    "layers beyond the bound": (lambda m: m.update(num_encoder_layers=10_000), "num_encoder_layers must be at most"),
}


@pytest.mark.parametrize("what", sorted(HUGE))
def test_a_config_asking_for_a_huge_model_is_refused_by_every_loader_in_small_memory(run, tmp_path, what):
    change, expected = HUGE[what]
    copy = copy_of(run, tmp_path)
    edit_json(copy / "config.json", lambda c: change(c["model"]))
    results, peak_mb = run_loaders(translation_loaders(copy), tmp_path)
    for result in results:
        lines = [line for line in result["stderr"].splitlines() if ": error: " in line]
        assert result["code"] == 2 and len(lines) == 1 and "Traceback" not in result["stderr"], result
        assert "config.json" in lines[0] and expected in lines[0], result
    assert peak_mb < PEAK_MB


def test_a_language_model_config_asking_for_a_huge_model_is_refused(lm_run, tmp_path):
    copy = copy_of(lm_run, tmp_path)
    edit_json(copy / "config.json", lambda c: c["model"].update(num_layers=1000))
    commands = [
        ["generate", str(copy), "--prompt", "to", "--max-new-tokens", "5"],
        ["evaluate", str(copy), "--threads", "1"],
        ["attend", "to be", "--model", str(copy), "-o", str(tmp_path / "a.html")],
        ["train", "--run-dir", str(copy), "--resume", "--max-steps", "3", "--no-progress"],
    ]
    results, peak_mb = run_loaders(commands, tmp_path)
    for result in results:
        lines = [line for line in result["stderr"].splitlines() if ": error: " in line]
        assert result["code"] == 2 and len(lines) == 1, result
        assert "config.json: num_layers is 1000" in lines[0], result
    assert peak_mb < PEAK_MB


def test_tokenizer_ids_past_the_embedding_are_refused_at_load(run, tmp_path, capsys):
    """A valid tokenizer.json whose ids leave a gap (one id far past the model's vocabulary, the
    token count unchanged) once passed the size check and failed later with a bare IndexError."""
    copy = copy_of(run, tmp_path)

    def far_id(data):
        vocab = data["model"]["vocab"]
        vocab[max(vocab, key=vocab.get)] = 10**6

    edit_json(copy / "tokenizer.json", far_id)
    text = tmp_path / "in.txt"
    text.write_text("12/05/1999\n", encoding="utf-8")
    line = one_line_error(capsys, "translate", main(["translate", str(copy), str(text), "--threads", "1"]))
    assert "tokenizer.json" in line and "ids must be 0..299" in line


def test_a_pretrained_folder_asking_for_a_huge_model_is_refused_before_building(tmp_path):
    """GPT-2 and BERT folders: the config's sizes are compared with the weights on the meta device."""
    from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel

    from qkv.pretrained import load_pretrained

    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=50, n_positions=32)).save_pretrained(gpt2)
    bert = tmp_path / "bert"
    BertModel(
        BertConfig(
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            vocab_size=50,
            max_position_embeddings=32,
        )
    ).save_pretrained(bert)
    cases = [
        # within qkv's size bounds, beyond what the weights hold
        (gpt2, {"n_embd": 2**16}, "tensor shapes disagree with config.json"),
        (gpt2, {"n_layer": 1000}, "config.json: n_layer is 1000"),
        (gpt2, {"n_positions": 2**20}, "tensor shapes disagree"),
        (bert, {"hidden_size": 2**16, "num_attention_heads": 1}, "tensor shapes disagree with config.json"),
        (bert, {"intermediate_size": 2**18}, "tensor shapes disagree"),
        (bert, {"num_hidden_layers": 1000}, "config.json: num_hidden_layers is 1000"),
        # beyond the bounds
        (gpt2, {"n_embd": 10**6}, "must be at most"),
        (bert, {"hidden_size": 10**6, "num_attention_heads": 1}, "must be at most|tensor shapes disagree"),
    ]
    for folder, change, expected in cases:
        copy = tmp_path / "copy"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(folder, copy)
        edit_json(copy / "config.json", lambda c, change=change: c.update(change))
        with pytest.raises(ValueError, match=expected) as err:
            load_pretrained(copy, device="cpu")
        assert len(str(err.value).splitlines()) == 1
    # every command that reads such folders, in a fresh process whose peak memory is measured
    for folder, name in ((gpt2, "big_gpt2"), (bert, "big_bert")):
        shutil.copytree(folder, tmp_path / name)
        edit_json(
            tmp_path / name / "config.json",
            lambda c: c.update(
                {"n_embd": 2**16} if "n_embd" in c else {"hidden_size": 2**16, "num_attention_heads": 1}
            ),
        )
    commands = [
        ["generate", str(tmp_path / "big_gpt2"), "--prompt", "a", "--max-new-tokens", "2"],
        ["attend", "a b", "--model", str(tmp_path / "big_gpt2"), "-o", str(tmp_path / "a.html")],
        ["embed", "a b", "--model", str(tmp_path / "big_bert")],
        ["attend", "a b", "--model", str(tmp_path / "big_bert"), "-o", str(tmp_path / "b.html")],
        ["serve", "--model", str(tmp_path / "big_bert"), "--port", "0"],
    ]
    results, peak_mb = run_loaders(commands, tmp_path)
    for result in results:
        lines = [line for line in result["stderr"].splitlines() if ": error: " in line]
        assert result["code"] == 2 and len(lines) == 1 and "disagree with config.json" in lines[0], result
    assert peak_mb < PEAK_MB

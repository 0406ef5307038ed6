"""qkv.pretrained.nanogpt: nanoGPT's ckpt.pt in qkv's CausalLM gives nanoGPT's own logits.

The reference is nanoGPT's ``model.py`` itself, from a checkout at ``$QKV_NANOGPT`` (default
/tmp/nanoGPT); without one those tests skip (CI has none). The refusals need no checkout.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
from pathlib import Path
from types import ModuleType

import pytest
import torch

from qkv.pretrained.nanogpt import load_nanogpt

NANOGPT = Path(os.environ.get("QKV_NANOGPT", "/tmp/nanoGPT"))


def nanogpt_module() -> ModuleType:
    path = NANOGPT / "model.py"
    if not path.is_file():
        pytest.skip(f"no nanoGPT checkout at {NANOGPT} (set QKV_NANOGPT)")
    spec = importlib.util.spec_from_file_location("nanogpt_model_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("bias", [False, True])
def test_logits_equal_nanogpt(tmp_path: Path, bias: bool) -> None:
    nano = nanogpt_module()
    torch.manual_seed(0)
    args = dict(n_layer=2, n_head=4, n_embd=32, block_size=16, bias=bias, vocab_size=65, dropout=0.0)
    reference = nano.GPT(nano.GPTConfig(**args)).eval()
    with torch.no_grad():  # LayerNorms away from their ones/zeros start, so a misplaced one shows
        for name, param in reference.named_parameters():
            if ".ln_" in name or "ln_f" in name:
                param.add_(0.3 * torch.randn_like(param))
    checkpoint = {
        "model": reference.state_dict(),
        "model_args": args,
        "iter_num": 7,
        "best_val_loss": torch.tensor(1.5),
    }
    torch.save(checkpoint, tmp_path / "ckpt.pt")
    model, info = load_nanogpt(tmp_path)
    assert info["iter_num"] == 7 and info["best_val_loss"] == pytest.approx(1.5)
    ids = torch.randint(0, 65, (3, 16))
    with torch.no_grad():
        want, _ = reference(ids, ids)  # with targets: the logits at every position
        got = model(ids).logits
    assert got is not None
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_compiled_prefix_accepted(tmp_path: Path) -> None:
    nano = nanogpt_module()
    args = dict(n_layer=1, n_head=2, n_embd=16, block_size=8, bias=False, vocab_size=11, dropout=0.0)
    reference = nano.GPT(nano.GPTConfig(**args)).eval()
    state = {"_orig_mod." + k: v for k, v in reference.state_dict().items()}
    torch.save({"model": state, "model_args": args}, tmp_path / "ckpt.pt")
    model, _ = load_nanogpt(tmp_path / "ckpt.pt")
    ids = torch.randint(0, 11, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids, ids)[0], atol=1e-5, rtol=1e-5)


class Payload:  # any class: weights_only=True must refuse to build it
    pass


def test_refuses_arbitrary_pickle(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    with open(path, "wb") as f:
        pickle.dump({"model": {}, "model_args": {}, "extra": Payload()}, f)
    with pytest.raises(ValueError, match="weights_only=True") as err:
        load_nanogpt(path)
    assert "\n" not in str(err.value)


def test_refuses_other_layout(tmp_path: Path) -> None:
    args = dict(n_layer=1, n_head=2, n_embd=16, block_size=8, bias=False, vocab_size=11, dropout=0.0)
    torch.save({"model": {"transformer.wte.weight": torch.zeros(11, 16)}, "model_args": args}, tmp_path / "ckpt.pt")
    with pytest.raises(ValueError, match="not nanoGPT's layout"):
        load_nanogpt(tmp_path)
    with pytest.raises(FileNotFoundError):
        load_nanogpt(tmp_path / "nothing.pt")

"""ONNX export of a language model with its attention weights as outputs (qkv.export.onnx_attention), the
graph docs/live.md runs: onnxruntime's weights are qkv's (CausalLM.forward with need_weights=True) for a
GPT-2 layout and a Llama one with a sliding window on one layer; the parameters come back from the graph;
a run folder exports. Slow (each export traces the model with the dynamo exporter): ``-m slow``."""

import json

import numpy as np
import pytest
import torch

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")
pytest.importorskip("onnxscript")

from qkv.cli import main  # noqa: E402  (after the skips)
from qkv.export.onnx_attention import (  # noqa: E402
    _export_graph,
    check_attention_onnx,
    export_onnx_attention,
    model_from_onnx,
)
from qkv.models.causal_lm import CausalLM, CausalLMConfig  # noqa: E402

pytestmark = pytest.mark.slow

TEXT = "First Citizen: Before we proceed any further, hear me speak. All: Speak, speak.\n" * 8
BASE = dict(vocab_size=40, d_model=32, num_heads=4, num_layers=2, d_ff=48, context=16, dropout=0.0)
LLAMA_WINDOW = dict(
    norm="rms", activation="swiglu", positional="rotary", bias=False, tie_output=False, num_kv_heads=2
) | dict(sliding_window=5, sliding_window_layers=[1])


@pytest.mark.parametrize("change", [{}, LLAMA_WINDOW], ids=["gpt2", "llama-window"])
def test_the_graph_returns_qkvs_weights(tmp_path, change):
    torch.manual_seed(0)
    model = CausalLM(CausalLMConfig(**{**BASE, **change})).eval()
    with torch.no_grad():
        for param in model.parameters():  # away from the initial weights: attention far from uniform
            param.add_(torch.randn_like(param) * 0.3)
    path = tmp_path / "attention.onnx"
    _export_graph(model, path)
    worst = check_attention_onnx(model, path)  # every length 1..16 within 1e-5
    assert worst["weights"] <= 1e-5
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ids = torch.randint(0, 40, (3, 11), generator=torch.Generator().manual_seed(1))
    logits, *weights = session.run(None, {"ids": ids.numpy()})
    # by hand: each layer's rows sum to 1 and nothing lies above the diagonal (or outside the window)
    for i, w in enumerate(weights):
        assert w.shape == (3, 4, 11, 11)
        np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-5)
        q, k = np.indices((11, 11))
        window = model.config.window(i)
        outside = (k > q) if window is None else (k > q) | (q - k >= window)
        assert np.all(w[..., outside] == 0)
    with torch.no_grad():
        out = model(ids, need_weights=True)
    np.testing.assert_allclose(logits, out.logits[:, -1].numpy(), atol=1e-4, rtol=0)


def test_a_run_exports_and_its_model_comes_back_from_the_graph(tmp_path):
    (tmp_path / "train.txt").write_text(TEXT, encoding="utf-8")
    run = tmp_path / "run"
    options = ["--task", "lm", "--train-text", str(tmp_path / "train.txt"), "--tokenizer", "char"]
    options += ["--d-model", "32", "--heads", "4", "--layers", "2", "--d-ff", "48", "--context", "16"]
    options += ["--max-steps", "2", "--minutes", "0", "--no-bf16", "--no-progress", "--threads", "1"]
    assert main(["train", *options, "--run-dir", str(run)]) == 0
    out = export_onnx_attention(run, tmp_path / "live")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["outputs"] == ["logits", "attention_0", "attention_1"] and manifest["inputs"] == ["ids"]
    assert manifest["chars"] == "".join(sorted(set(TEXT)))
    from qkv.inference.runs import open_run

    model, _, _ = open_run(run, "model", task="lm")
    rebuilt = model_from_onnx(out)
    for (name, a), b in zip(model.state_dict().items(), rebuilt.state_dict().values(), strict=True):
        assert torch.equal(a.float(), b), name
    with pytest.raises(ValueError, match="not empty|exists|overwrite"):
        export_onnx_attention(run, tmp_path / "live")

"""ONNX export of a language-model run (qkv.export.onnx_lm): one decoder-step graph with its cache whose
greedy generations with onnxruntime are qkv's on 200 prompts, for a GPT-2 layout and a Llama one
(rotary, RMSNorm, SwiGLU, grouped-query heads), for ALiBi, sliding windows (on every layer or some)
and for the other parts of today's models; the CLI exports a trained run, windowed or not."""

import json
from pathlib import Path

import pytest
import torch

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")
pytest.importorskip("onnxscript")

from qkv.cli import main  # noqa: E402  (after the skips: without onnxruntime nothing here runs)
from qkv.data.text import CharTokenizer  # noqa: E402
from qkv.export.onnx_lm import (  # noqa: E402
    LMStepGraph,
    check_lm_onnx,
    export_onnx_lm,
    onnx_greedy,
    write_lm_onnx,
)
from qkv.models.causal_lm import CausalLM, CausalLMConfig  # noqa: E402
from qkv.runs.folder import load_run  # noqa: E402

TEXT = (
    "First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. First Citizen: You are "
    "all resolved rather to die than to famish? All: Resolved. resolved. First Citizen: First, you know Caius "
    "Marcius is chief enemy to the people.\n"
)
TOKENIZER = CharTokenizer(TEXT)
GPT2 = dict(vocab_size=TOKENIZER.vocab_size, d_model=32, num_heads=4, num_layers=2, d_ff=48, context=32, dropout=0.0)
LLAMA = dict(
    norm="rms",
    activation="swiglu",
    positional="rotary",
    bias=False,
    tie_output=False,
    num_kv_heads=2,
    layer_norm_eps=1e-6,
)
SHAPES = {
    "gpt2": {},
    "llama-gqa": LLAMA,
    "mistral-window": {**LLAMA, "sliding_window": 4},
    "alibi-mqa-window-on-one-layer": dict(
        positional="alibi", num_kv_heads=1, sliding_window=3, sliding_window_layers=[1]
    ),
    "qk-norm-softcap-relu2-llama3": dict(
        positional="rotary",
        qk_norm=True,
        logit_softcap=5.0,
        activation="relu2",
        rotary_scaling="llama3",
        rotary_scaling_factor=4.0,
        rotary_original_context=16,
    ),
}


def _model(**change) -> CausalLM:
    """A random model, every weight moved by 0.3 from its initial value: logits far apart, so that greedy
    choices are rarely near-ties that other kernels' rounding could flip."""
    torch.manual_seed(0)
    model = CausalLM(CausalLMConfig(**{**GPT2, **change})).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.3)
    return model


def _session(folder: Path):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(folder / "decoder_step.onnx"), options, providers=["CPUExecutionProvider"])
    return session, json.loads((folder / "manifest.json").read_text())


@pytest.fixture(scope="module", params=list(SHAPES))
def exported(request, tmp_path_factory):
    model = _model(**SHAPES[request.param])
    folder = tmp_path_factory.mktemp(request.param)
    write_lm_onnx(model, TOKENIZER, folder)
    # the export holds the window in its mask: the model's own attention keeps its windows
    assert [layer.self_attn.window for layer in model.decoder.layers] == [
        model.config.window(i) for i in range(model.config.num_layers)
    ]
    return model, folder


def test_the_graph_gives_qkvs_logits_and_cache_with_an_empty_and_a_full_cache(exported):
    model, folder = exported
    session, manifest = _session(folder)
    assert manifest["num_layers"] == 2 and manifest["vocab_size"] == TOKENIZER.vocab_size
    assert manifest["head_dim"] == 8 and manifest["num_kv_heads"] == (model.config.num_kv_heads or 4)
    names = manifest["decoder_step"]
    ids = torch.randint(0, TOKENIZER.vocab_size, (3, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids)
        assert full.logits is not None and full.cache is not None
    empty = [torch.zeros(3, manifest["num_kv_heads"], 0, 8) for _ in names["inputs"][1:]]
    logits, *cache = session.run(
        names["outputs"], dict(zip(names["inputs"], [ids.numpy()] + [t.numpy() for t in empty]))
    )
    torch.testing.assert_close(torch.from_numpy(logits), full.logits[:, -1], atol=1e-4, rtol=0)
    expected = [t for c in full.cache for t in (c.key, c.value)]
    for got, want in zip(cache, expected, strict=True):  # the graph keeps every key; a window, its last ones
        assert got.shape[2] == 7
        torch.testing.assert_close(torch.from_numpy(got[:, :, 7 - want.size(-2) :]), want, atol=1e-4, rtol=0)
    # the last two ids after the first five: positions continue at 5, the mask bottom-right aligned
    with torch.no_grad():
        head = LMStepGraph(model)(ids[:, :5], *empty)[1:]
    step, *_ = session.run(
        names["outputs"], dict(zip(names["inputs"], [ids[:, 5:].numpy()] + [t.numpy() for t in head]))
    )
    torch.testing.assert_close(torch.from_numpy(step), full.logits[:, -1], atol=1e-4, rtol=0)


def test_greedy_generation_is_qkvs_on_200_prompts(exported):
    model, folder = exported
    check_lm_onnx(model, folder)
    session, manifest = _session(folder)
    new = 16
    for length in (1, 3, 8):  # shorter and longer than the windows; prompt + new within the context
        prompts = torch.randint(0, TOKENIZER.vocab_size, (200, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            expected = model.generate(prompts, new, temperature=0)[:, length:].tolist()
        assert onnx_greedy(session, manifest, prompts.tolist(), new) == expected


def test_a_prompt_past_the_context_is_refused(exported):
    _, folder = exported
    session, manifest = _session(folder)
    with pytest.raises(ValueError, match="does not fit the context 32"):
        onnx_greedy(session, manifest, [[1] * 30], 4)


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    """A Llama-shaped character language model trained for 2 steps by ``qkv train``."""
    root = tmp_path_factory.mktemp("lm_run")
    (root / "train.txt").write_text(TEXT * 8, encoding="utf-8")
    model = {**GPT2, **LLAMA, "context": 64}
    model_table = "\n".join(f"{key} = {json.dumps(value)}" for key, value in model.items() if key != "vocab_size")
    (root / "llama.toml").write_text(
        'description = "a tiny Llama-shaped language model"\ntask = "lm"\nvocab_size = 300\n\n'
        f'[lm]\ntokenizer = "char"\n\n[model]\n{model_table}\n\n[train]\nmax_tokens = 256\nwarmup_steps = 2\n',
        encoding="utf-8",
    )
    run_dir = root / "run"
    options = ["--task", "lm", "--train-text", str(root / "train.txt"), "--recipe", str(root / "llama.toml")]
    options += ["--max-steps", "2", "--minutes", "0", "--no-bf16", "--no-progress", "--threads", "1"]
    assert main(["train", *options, "--run-dir", str(run_dir)]) == 0
    return run_dir


def test_the_cli_exports_a_language_model_run_to_onnx(lm_run, tmp_path):
    from qkv.export.ctranslate2_lm import same_up_to_ties

    out = tmp_path / "onnx"
    assert main(["export", str(lm_run), "--to", "onnx", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        ".qkv-export.json",
        "decoder_step.onnx",
        "manifest.json",
        "tokenizer.json",
    ]
    assert json.loads((out / ".qkv-export.json").read_text())["qkv_export"] == "onnx"
    model, tokenizer, _ = load_run(lm_run)
    session, manifest = _session(out)
    assert manifest["context"] == 64 and manifest["num_kv_heads"] == 2
    for text in ("First", "All: S", "You are all"):  # a model trained 2 steps is close to uniform: near-ties
        prompt = tokenizer.encode(text)
        expected = model.generate(torch.tensor([prompt]), 24, temperature=0)[0, len(prompt) :].tolist()
        assert same_up_to_ties(model, prompt, expected, onnx_greedy(session, manifest, [prompt], 24)[0])
    # a second export into the same folder needs --overwrite (refused before any work)
    assert main(["export", str(lm_run), "--to", "onnx", str(out)]) == 2
    # the same weights with a window on every layer: exported, the window in its graph
    config = json.loads((lm_run / "config.json").read_text())
    config["model"]["sliding_window"] = 4
    other = tmp_path / "window"
    other.mkdir()
    for name in ("tokenizer.json", "model.safetensors"):
        (other / name).write_bytes((lm_run / name).read_bytes())
    (other / "config.json").write_text(json.dumps(config))
    assert main(["export", str(other), "--to", "onnx", str(tmp_path / "windowed")]) == 0
    windowed, _, _ = load_run(other)
    session, manifest = _session(tmp_path / "windowed")
    prompt = tokenizer.encode("First Citizen")  # longer than the window
    expected = windowed.generate(torch.tensor([prompt]), 24, temperature=0)[0, len(prompt) :].tolist()
    assert same_up_to_ties(windowed, prompt, expected, onnx_greedy(session, manifest, [prompt], 24)[0])


def test_export_onnx_lm_refuses_a_translation_run(tmp_path):
    fixtures = Path(__file__).parent / "fixtures" / "runs_v0_1" / "translation_run"
    with pytest.raises(ValueError, match="translation"):
        export_onnx_lm(fixtures, tmp_path / "out")
    assert not (tmp_path / "out").exists()

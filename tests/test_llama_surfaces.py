"""Llama-family folders (transformers' Llama, Mistral and Qwen2 layout) through qkv's commands, as a
GPT-2 folder goes through them: ``qkv generate`` prints transformers' greedy continuation, ``qkv attend
--model`` writes a page whose causal self-attention is transformers' ``output_attentions=True`` (eager
attention: every query head, each key/value head shared by its group, the window of a Mistral folder),
and ``qkv serve --model`` answers ``/v1/generate`` with the same greedy text and draws the explorer.

The folders are tiny random models with a byte-level BPE trained here, so the test needs no download
and no data set."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qkv.cli import main
from qkv.viz.explorers import open_explorer
from qkv.viz.html import page_document
from qkv.viz.lm_explorer import CausalLMExplorer

transformers = pytest.importorskip("transformers")
pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

from qkv.serve.app import create_app  # noqa: E402
from qkv.serve.models import Limits, open_models  # noqa: E402
from qkv.viz.app import ExplorerApp  # noqa: E402

CORPUS = [
    "the cat sat on the mat and the dog sat on the log.\n",
    "attention is all you need, said the paper; the heads attend to the keys.\n",
    "a query meets every key before it, and the values are mixed by the weights.\n",
]
SIZES = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # grouped-query: two query heads share each key/value head
    max_position_embeddings=96,
    bos_token_id=0,
    eos_token_id=None,  # transformers' generate stops at an EOS; qkv's runs its full length
    pad_token_id=None,
)
WINDOW = 6
# family -> (config class, model class, config options, whether its tokenizer puts <s> first)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, True),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": WINDOW}, True),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}, False),
}
PROMPT = "the cat sat"
TEXT = "the heads attend to the keys before them, and the values are mixed."  # longer than the window
NEW_TOKENS = 30


def train_tokenizer() -> Tokenizer:
    """A byte-level BPE over :data:`CORPUS`'s characters only (so every token decodes to whole UTF-8
    text); ``<s>`` is id 0, ``</s>`` id 1."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    assert tok.token_to_id("<s>") == 0
    return tok


def make_folder(folder: Path, family: str, tok: Tokenizer):
    """Save a random ``family`` model and ``tok`` as transformers does; returns the transformers model
    with eager attention (the plainest reference, and the one that returns weights) in eval mode."""
    config_name, model_name, options, bos = FAMILIES[family]
    config = getattr(transformers, config_name)(vocab_size=tok.get_vocab_size(), **SIZES, **options)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # norms start at ones: move every parameter so a misplaced one shows
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.1)
    model.save_pretrained(folder)
    backend = Tokenizer.from_str(tok.to_str())
    if bos:  # Llama and Mistral tokenizers put <s> before a text; Qwen2's nothing
        backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)
    model.set_attn_implementation("eager")
    return model.eval()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """family -> (folder, transformers model, transformers tokenizer of the folder)."""
    tok = train_tokenizer()
    out = {}
    for family in FAMILIES:
        folder = tmp_path_factory.mktemp("llama_surfaces") / f"tiny-{family}"
        model = make_folder(folder, family, tok)
        out[family] = (folder, model, transformers.AutoTokenizer.from_pretrained(folder))
    return out


def greedy_continuation(model, tokenizer, prompt: str, n: int) -> tuple[str, list[int]]:
    """transformers' greedy continuation of ``prompt``, decoded with the folder's tokenizer."""
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n)
    new = out[0, ids.shape[1] :].tolist()
    assert len(new) == n
    return tokenizer.decode(new, skip_special_tokens=False, clean_up_tokenization_spaces=False), new


def reference_attentions(model, tokenizer, text: str) -> torch.Tensor:
    """transformers' attention weights of ``text``, every layer: ``(layers, heads, s, s)``."""
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        attentions = model(ids, output_attentions=True).attentions
    return torch.stack([a[0] for a in attentions]).double()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_generate_prints_transformers_greedy_continuation(folders, family, capsys):
    folder, model, tokenizer = folders[family]
    expected, new = greedy_continuation(model, tokenizer, PROMPT, NEW_TOKENS)
    assert len(set(new)) >= 3  # not one token repeated: the test can tell continuations apart
    args = ["generate", str(folder), "--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", str(NEW_TOKENS)]
    assert main([*args, "--device", "cpu", "--threads", "1"]) == 0
    assert capsys.readouterr().out == PROMPT + expected + "\n"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_attend_page_holds_transformers_attention(folders, family, tmp_path, capsys):
    folder, model, tokenizer = folders[family]
    want = reference_attentions(model, tokenizer, TEXT)  # (layers, heads, s, s)
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    assert want.shape[1] == heads > kv_heads  # weights per query head, though keys/values are grouped

    explorer = open_explorer(folder)  # what qkv attend and qkv serve open
    assert isinstance(explorer, CausalLMExplorer) and explorer.name == folder.name
    explorer.model.cpu()
    (view,) = explorer.views(TEXT)
    own = torch.stack(list(view.attentions)).double()  # per layer (heads, s, s), unrounded
    assert own.shape == want.shape
    assert (own - want).abs().max().item() <= 1e-5

    page, data = tmp_path / "a.html", tmp_path / "a.json"
    assert main(["attend", TEXT, "--model", str(folder), "-o", str(page), "--json", str(data)]) == 0
    assert f"lm model {folder.name}" in capsys.readouterr().err
    (stored,) = json.loads(data.read_text(encoding="utf-8"))["examples"][0]["views"]
    assert (stored["layers"], stored["heads"]) == (model.config.num_hidden_layers, heads)
    got = torch.tensor(stored["attention"], dtype=torch.float64)  # rounded to 4 decimals
    assert got.shape == want.shape
    assert (got[0] - want[0]).abs().max().item() <= 5e-5 + 1e-5  # layer 0: the rounding, then 1e-5
    assert (got - want).abs().max().item() <= 5e-5 + 1e-5  # and every other layer
    (drawn,) = page_document(page.read_text(encoding="utf-8"))["examples"][0]["views"]
    drawn = torch.tensor(drawn["attention"], dtype=torch.float64)
    lines = got >= 0.01  # the page keeps every weight it draws a line for (qkv.viz.html.pack_weights): the same
    # 4 decimals, one float32 rounding apart (the page's and the JSON's number paths differ: 3e-8 seen)
    assert drawn.shape == got.shape and (drawn[lines] - got[lines]).abs().max().item() <= 1e-6

    s = want.shape[-1]
    far = torch.ones(s, s).tril(-WINDOW).bool()  # keys a window of WINDOW leaves out
    assert s > 2 * WINDOW and far.any()
    if "sliding_window" in FAMILIES[family][2]:  # a Mistral window: the far keys get exactly 0
        assert want[..., far].abs().max() == 0 and got[..., far].abs().max() == 0
    else:  # no window: they are attended to, so the check above can fail
        assert got[..., far].min() > 0


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_serve_answers_generate_with_the_greedy_text(folders, family):
    folder, model, tokenizer = folders[family]
    expected, _ = greedy_continuation(model, tokenizer, PROMPT, NEW_TOKENS)
    served = open_models([folder])  # as qkv serve --model FOLDER opens it
    assert [(name, m.endpoint) for name, m in served.items()] == [(folder.name, "/v1/generate")]
    served[folder.name].model.cpu()
    explorer = ExplorerApp(explorers={n: m.explorer for n, m in served.items()}, max_chars=200, initial_text=TEXT)
    with TestClient(create_app(served, explorer, Limits(max_chars=200)), raise_server_exceptions=False) as client:
        body = {"prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0, "stream": False}
        answer = client.post("/v1/generate", json=body)
        assert answer.status_code == 200, answer.text
        assert answer.json()["text"] == expected and answer.json()["tokens"] == NEW_TOKENS
        attend = client.post("/api/attend", json={"text": TEXT, "model": folder.name})
        assert attend.status_code == 200, attend.text
        (view,) = attend.json()["example"]["views"]
        got = torch.tensor(view["attention"], dtype=torch.float64)
        assert (got - reference_attentions(model, tokenizer, TEXT)).abs().max().item() <= 5e-5 + 1e-5
        page = client.get("/")
        assert page.status_code == 200 and folder.name in page.text

"""qkv.runtime.meta.meta_device: models built with every tensor's shape and dtype as PyTorch builds them,
on the meta device, without the compiler import PyTorch's meta ``normal_`` makes (2.5 s of start-up)."""

import subprocess
import sys

import pytest
import torch

from qkv.models.causal_lm import CausalLM, CausalLMConfig
from qkv.models.transformer import Transformer, TransformerConfig
from qkv.runtime.meta import meta_device

BUILDS = {
    "causal_lm": lambda: CausalLM(CausalLMConfig(vocab_size=67, d_model=32, num_heads=2, num_layers=2, context=16)),
    "transformer": lambda: Transformer(
        TransformerConfig(src_vocab_size=50, tgt_vocab_size=60, d_model=32, num_heads=2, d_ff=64)
    ),
}


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_meta_build_has_the_cpu_builds_tensors(name):
    cpu = BUILDS[name]()
    with meta_device():
        meta = BUILDS[name]()
    want = {k: (v.shape, v.dtype) for k, v in cpu.state_dict().items()}
    assert {k: (v.shape, v.dtype) for k, v in meta.state_dict().items()} == want
    assert all(v.is_meta for v in meta.state_dict().values())
    assert torch.empty(0).device.type == "cpu"  # the device is the default again afterwards


def test_meta_builds_do_not_import_the_compiler():
    """A language model (the budget rule's parameter counts) and a translation model with sinusoidal
    positions (every run's load), both built on the meta device, in a fresh process."""
    code = (
        "import sys\n"
        "from qkv.models.causal_lm import CausalLM, CausalLMConfig\n"
        "from qkv.models.transformer import Transformer, TransformerConfig\n"
        "from qkv.runtime.meta import meta_device\n"
        "with meta_device():\n"
        "    CausalLM(CausalLMConfig(vocab_size=67, d_model=32, num_heads=2, num_layers=2, context=16))\n"
        "    t = Transformer(TransformerConfig(src_vocab_size=50, tgt_vocab_size=60, d_model=32, num_heads=2))\n"
        "print(type(t.src_embed.positional).__name__, 'torch._dynamo' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "SinusoidalPositionalEncoding False"

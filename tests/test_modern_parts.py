"""The parts of today's decoder-only models, each against Hugging Face's implementation and against a
formula written here: RMSNorm, the gated and ReLU^2 feed-forward networks, rotary positions, ALiBi."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qkv.attention.alibi import alibi_bias, alibi_slopes
from qkv.nn import layers
from qkv.nn.feedforward import ACTIVATIONS, GATED, FeedForward
from qkv.nn.norms import NORMS, RMSNorm, build_norm
from qkv.nn.rotary import RotaryEmbedding

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, PhiConfig  # noqa: E402
from transformers.models.bloom.modeling_bloom import build_alibi_tensor  # noqa: E402
from transformers.models.llama.modeling_llama import (  # noqa: E402
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)
from transformers.models.phi.modeling_phi import PhiRotaryEmbedding  # noqa: E402
from transformers.models.phi.modeling_phi import apply_rotary_pos_emb as phi_apply_rotary  # noqa: E402


def generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- RMSNorm ----


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weight_dtype", ["same", "float32"])
def test_rms_norm_is_exactly_llamas(dtype, weight_dtype):
    """Bit for bit the Hugging Face Llama norm, for float32 and half inputs (the float32 statistics and the
    cast before the weight included), with a half weight or a float32 one."""
    d, eps = 48, 1e-5
    x = (torch.randn(3, 7, d, generator=generator()) * 4).to(dtype)
    weight = torch.rand(d, generator=generator(1)) + 0.5
    ours, theirs = RMSNorm(d, eps=eps), LlamaRMSNorm(d, eps=eps)
    with torch.no_grad():
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
    if weight_dtype == "same":
        ours.to(dtype)
        theirs.to(dtype)
    got, want = ours(x), theirs(x)
    assert got.dtype == want.dtype
    assert torch.equal(got, want)


def test_rms_norm_formula_and_options():
    """``x / sqrt(mean(x^2) + eps) * weight`` in float64; weight initialised to ones; the options checked."""
    x = torch.randn(4, 16, generator=generator(), dtype=torch.float64)
    norm = RMSNorm(16, eps=1e-6)
    assert torch.equal(norm.weight, torch.ones(16))
    want = x / torch.sqrt((x**2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(norm.double()(x), want, rtol=1e-12, atol=1e-12)
    assert "16, eps=1e-06" in repr(norm)
    with pytest.raises(ValueError, match="d must be positive"):
        RMSNorm(0)


def test_build_norm_makes_each_kind_and_names_the_choices():
    assert NORMS == ("layer", "rms")
    layer = build_norm("layer", 8, 1e-5)
    assert isinstance(layer, nn.LayerNorm) and layer.eps == 1e-5 and layer.bias is not None
    rms = build_norm("rms", 8, 1e-6)
    assert isinstance(rms, RMSNorm) and rms.eps == 1e-6 and set(dict(rms.named_parameters())) == {"weight"}
    with pytest.raises(ValueError, match=r"unknown norm 'batch'; choose one of \['layer', 'rms'\]"):
        build_norm("batch", 8, 1e-5)


# ---- feed-forward ----


def test_layers_keeps_exporting_the_feed_forward():
    """Code importing the network from qkv.nn.layers gets the very objects of qkv.nn.feedforward."""
    assert layers.FeedForward is FeedForward and layers.ACTIVATIONS is ACTIVATIONS
    assert GATED == ("swiglu", "geglu")
    assert set(ACTIVATIONS) == {"relu", "gelu", "gelu_tanh", "relu2", "silu", "swiglu", "geglu"}


@pytest.mark.parametrize(("activation", "hidden_act"), [("swiglu", "silu"), ("geglu", "gelu")])
@pytest.mark.parametrize("bias", [False, True])
def test_gated_feed_forward_is_llamas_mlp(activation, hidden_act, bias):
    """With the Llama MLP's weights copied (gate_proj -> gate, up_proj -> linear1, down_proj -> linear2),
    the gated network computes what it computes; geglu is the exact erf GELU (Hugging Face's "gelu")."""
    d, f = 32, 80
    config = LlamaConfig(hidden_size=d, intermediate_size=f, hidden_act=hidden_act, mlp_bias=bias)
    torch.manual_seed(0)
    theirs = LlamaMLP(config)
    ours = FeedForward(d, f, activation=activation, bias=bias)
    assert ours.gated and ours.gate is not None
    expected = {"linear1.weight", "gate.weight", "linear2.weight"}
    if bias:
        expected |= {"linear1.bias", "gate.bias", "linear2.bias"}
    assert set(ours.state_dict()) == expected
    with torch.no_grad():
        for mine, hf in (
            (ours.gate, theirs.gate_proj),
            (ours.linear1, theirs.up_proj),
            (ours.linear2, theirs.down_proj),
        ):
            mine.weight.copy_(hf.weight)
            if bias:
                mine.bias.copy_(hf.bias)
    x = torch.randn(2, 5, d, generator=generator())
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=1e-6)


@pytest.mark.parametrize("activation", GATED)
def test_the_gating_rule_is_the_forward_one(activation):
    """``FeedForward.gating`` over the two products (as a fused inference product gives them) is the
    hidden layer the module's own forward computes; a plain activation has no gating rule."""
    ff = FeedForward(12, 20, activation=activation)
    assert ff.gate is not None
    x = torch.randn(6, 12, generator=generator())
    gate_and_up = F.linear(
        x, torch.cat([ff.gate.weight, ff.linear1.weight]), torch.cat([ff.gate.bias, ff.linear1.bias])
    )
    gate, up = gate_and_up.split(20, dim=-1)
    hidden = FeedForward.gating(activation)(gate, up)
    act = F.silu if activation == "swiglu" else F.gelu
    torch.testing.assert_close(hidden, act(ff.gate(x)) * ff.linear1(x), rtol=0, atol=1e-6)
    torch.testing.assert_close(ff.linear2(hidden), ff(x), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="activation 'silu' is not gated"):
        FeedForward.gating("silu")


@pytest.mark.parametrize(
    ("activation", "formula"),
    [
        ("relu2", lambda h: torch.where(h > 0, h * h, torch.zeros_like(h))),
        ("silu", lambda h: h / (1 + torch.exp(-h))),
        ("relu", lambda h: h.clamp(min=0)),
        ("gelu", lambda h: 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))),
    ],
)
def test_plain_activations_follow_their_formulas(activation, formula):
    """A plain network is ``act(x W_1 + b_1) W_2 + b_2`` with no gate; relu2 is ``relu(x)^2``."""
    ff = FeedForward(10, 24, activation=activation).double()
    assert not ff.gated and ff.gate is None and "gate.weight" not in ff.state_dict()
    x = torch.randn(3, 4, 10, generator=generator(), dtype=torch.float64)
    want = ff.linear2(formula(ff.linear1(x)))
    torch.testing.assert_close(ff(x), want, rtol=1e-12, atol=1e-12)


def test_feed_forward_rejects_an_unknown_activation():
    with pytest.raises(ValueError, match="unknown activation 'swish'"):
        FeedForward(4, 8, activation="swish")


# ---- rotary ----


def _llama_rotary(head_dim: int, rope: dict) -> LlamaRotaryEmbedding:
    config = LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=16384,
        rope_parameters=rope,
    )
    return LlamaRotaryEmbedding(config)


ROPES = {
    "none": ({"rope_type": "default", "rope_theta": 10000.0}, {}),
    "linear": (
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {"scaling": "linear", "scaling_factor": 4.0},
    ),
    "llama3": (
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        {"base": 500000.0, "scaling": "llama3", "scaling_factor": 8.0},
    ),
    "llama3_other_bounds": (
        {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 32.0,
            "low_freq_factor": 2.0,
            "high_freq_factor": 8.0,
            "original_max_position_embeddings": 256,
        },
        {
            "scaling": "llama3",
            "scaling_factor": 32.0,
            "low_freq_factor": 2.0,
            "high_freq_factor": 8.0,
            "original_context": 256,
        },
    ),
}


@pytest.mark.parametrize("name", sorted(ROPES))
def test_rotary_is_llamas(name):
    """Frequencies and rotated queries and keys as Hugging Face's Llama computes them (default, linear and
    llama3 frequencies), at per-row positions running past the original context."""
    rope, options = ROPES[name]
    head_dim = 64
    theirs = _llama_rotary(head_dim, rope)
    ours = RotaryEmbedding(head_dim, **options)
    torch.testing.assert_close(ours.inv_freq, theirs.inv_freq, rtol=0, atol=1e-6)
    q = torch.randn(2, 4, 9, head_dim, generator=generator())
    k = torch.randn(2, 2, 9, head_dim, generator=generator(1))  # fewer key heads: grouped-query attention
    positions = torch.stack([torch.arange(9), torch.arange(9000, 9009)])  # (b, s)
    cos, sin = theirs(q, positions)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k = ours(q, k, positions)
    torch.testing.assert_close(got_q, want_q, rtol=0, atol=1e-6)
    torch.testing.assert_close(got_k, want_k, rtol=0, atol=1e-6)
    # (s,) positions: the same for every row
    one_q = ours.rotate(q, torch.arange(9000, 9009))
    torch.testing.assert_close(one_q[1], got_q[1], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("rope_type", "options"), [("default", {}), ("linear", {"scaling": "linear", "scaling_factor": 2.0})]
)
@pytest.mark.parametrize("fraction", [0.25, 0.5])
def test_partial_rotary_is_phis(rope_type, options, fraction):
    """A partial rotary (Phi's ``partial_rotary_factor``): the first ``int(head_dim * fraction)`` dims rotated
    as Hugging Face's Phi attention rotates them, the rest passed through untouched."""
    head_dim = 32
    rope = {"rope_type": rope_type, "rope_theta": 10000.0, "partial_rotary_factor": fraction}
    if rope_type == "linear":
        rope["factor"] = 2.0
    config = PhiConfig(hidden_size=head_dim * 4, num_attention_heads=4, rope_parameters=rope)
    theirs = PhiRotaryEmbedding(config)
    ours = RotaryEmbedding(head_dim, fraction=fraction, **options)
    rotated = int(head_dim * fraction)
    assert ours.rotated == rotated and ours.inv_freq.shape == (rotated // 2,)
    q = torch.randn(1, 4, 7, head_dim, generator=generator())
    k = torch.randn(1, 4, 7, head_dim, generator=generator(1))
    positions = torch.arange(100, 107)[None]  # (1, s)
    cos, sin = theirs(q, positions)
    q_rot, k_rot = phi_apply_rotary(q[..., :rotated], k[..., :rotated], cos, sin)
    got_q, got_k = ours(q, k, positions)
    torch.testing.assert_close(got_q, torch.cat([q_rot, q[..., rotated:]], -1), rtol=0, atol=1e-6)
    torch.testing.assert_close(got_k, torch.cat([k_rot, k[..., rotated:]], -1), rtol=0, atol=1e-6)
    assert torch.equal(got_q[..., rotated:], q[..., rotated:])


def _complex_rotation(x: torch.Tensor, positions: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """Each pair ``(x_i, x_{i + r/2})`` as the complex number ``x_i + i x_{i + r/2}``, times ``e^{i p theta_i}``
    (float64)."""
    r = 2 * theta.numel()
    z = torch.complex(x[..., : r // 2].double(), x[..., r // 2 : r].double())  # (..., s, r/2)
    turned = z * torch.exp(1j * positions.double()[:, None] * theta)  # (..., s, r/2)
    return torch.cat([turned.real, turned.imag, x[..., r:].double()], dim=-1)


@pytest.mark.parametrize(("head_dim", "fraction", "base"), [(16, 1.0, 10000.0), (24, 0.5, 500.0), (10, 0.4, 10000.0)])
def test_rotary_is_a_complex_rotation_of_pairs(head_dim, fraction, base):
    r = int(head_dim * fraction)
    theta = torch.tensor([base ** (-2 * i / r) for i in range(r // 2)], dtype=torch.float64)
    ours = RotaryEmbedding(head_dim, fraction=fraction, base=base)
    torch.testing.assert_close(ours.inv_freq.double(), theta, rtol=1e-6, atol=0)
    x = torch.randn(2, 3, 12, head_dim, generator=generator())
    positions = torch.arange(5, 17)
    torch.testing.assert_close(
        ours.rotate(x, positions).double(), _complex_rotation(x, positions, theta), rtol=0, atol=2e-5
    )


def test_llama3_frequencies_follow_the_formula():
    """Each frequency on its own: kept above the short wavelength bound, divided by the factor below the long
    one, blended linearly in ``context / wavelength`` between them."""
    factor, low, high, context, base, r = 8.0, 1.0, 4.0, 8192, 500000.0, 128
    want = []
    for i in range(r // 2):
        freq = base ** (-2 * i / r)
        wavelength = 2 * math.pi / freq
        if wavelength < context / high:
            want.append(freq)
        elif wavelength > context / low:
            want.append(freq / factor)
        else:
            blend = (context / wavelength - low) / (high - low)
            want.append((1 - blend) * freq / factor + blend * freq)
    ours = RotaryEmbedding(r, base=base, scaling="llama3", scaling_factor=factor)
    torch.testing.assert_close(ours.inv_freq.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=0)


def test_rotary_scores_depend_on_the_distance_only():
    """``<R(p) q, R(p') k>`` is the same for every pair of positions the same distance apart."""
    ours = RotaryEmbedding(32)
    q = torch.randn(1, 1, 1, 32, generator=generator(), dtype=torch.float64)
    k = torch.randn(1, 1, 1, 32, generator=generator(1), dtype=torch.float64)
    scores = [
        (ours.rotate(q, torch.tensor([p + 3])) * ours.rotate(k, torch.tensor([p]))).sum().item() for p in (0, 7, 250)
    ]
    assert scores == pytest.approx([scores[0]] * 3, abs=1e-4)


def test_rotary_angles_computed_once_serve_queries_and_keys():
    """``cos_sin`` then ``rotate_by`` (what an attention computing the angles once per step calls) is
    ``rotate``; the module keeps ``nn.Module.apply``."""
    ours = RotaryEmbedding(16)
    x = torch.randn(2, 3, 4, 16, generator=generator())
    positions = torch.tensor([[0, 1, 2, 3], [5, 6, 7, 8]])
    cos, sin = ours.cos_sin(positions)
    assert cos.shape == (2, 1, 4, 16) and cos.dtype == torch.float32
    assert torch.equal(ours.rotate_by(x, cos, sin), ours.rotate(x, positions))
    seen: list[nn.Module] = []
    nn.Sequential(ours).apply(seen.append)
    assert ours in seen


def test_rotary_keeps_the_dtype_and_rotates_in_float32():
    ours = RotaryEmbedding(16, fraction=0.5)
    x = torch.randn(2, 2, 5, 16, generator=generator()).to(torch.bfloat16)
    positions = torch.arange(1000, 1005)
    got = ours.rotate(x, positions)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, ours.rotate(x.float(), positions).to(torch.bfloat16))
    assert torch.equal(got[..., 8:], x[..., 8:])


def test_rotary_frequencies_stay_float32_and_are_not_saved():
    """A model cast to bfloat16 keeps exact float32 frequencies; they are not in the state dict; a module
    built on the meta device and materialized with ``to_empty`` has them computed."""
    fresh = RotaryEmbedding(64, scaling="llama3", scaling_factor=8.0)
    cast = RotaryEmbedding(64, scaling="llama3", scaling_factor=8.0).to(torch.bfloat16)
    assert cast.inv_freq.dtype == torch.float32 and torch.equal(cast.inv_freq, fresh.inv_freq)
    assert torch.equal(cast.half().double().inv_freq, fresh.inv_freq)
    assert fresh.state_dict() == {}
    with torch.device("meta"):
        meta = RotaryEmbedding(64, scaling="llama3", scaling_factor=8.0)
    assert meta.inv_freq.is_meta
    assert torch.equal(meta.to_empty(device="cpu").inv_freq, fresh.inv_freq)


@pytest.mark.parametrize(
    ("head_dim", "options", "field"),
    [
        (16, {"fraction": 0.0}, "fraction"),
        (16, {"fraction": 1.5}, "fraction"),
        (10, {"fraction": 0.3}, "fraction"),  # int(10 * 0.3) = 3 rotated dims: odd
        (16, {"scaling": "yarn"}, "scaling"),
        (16, {"scaling_factor": 0.0}, "scaling_factor"),
        (16, {"base": -1.0}, "base"),
        (16, {"scaling": "llama3", "low_freq_factor": 4.0, "high_freq_factor": 4.0}, "high_freq_factor"),
    ],
)
def test_rotary_rejects_bad_options(head_dim, options, field):
    with pytest.raises(ValueError, match=field):
        RotaryEmbedding(head_dim, **options)


def test_rotary_rejects_bad_shapes():
    ours = RotaryEmbedding(8)
    with pytest.raises(ValueError, match="head_dim=8"):
        ours.rotate(torch.zeros(1, 1, 2, 6), torch.arange(2))
    with pytest.raises(ValueError, match="positions must be"):
        ours.rotate(torch.zeros(1, 1, 2, 8), torch.zeros(1, 1, 2, dtype=torch.long))


# ---- ALiBi ----


def test_alibi_slopes_of_eight_heads():
    assert alibi_slopes(8).tolist() == [1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64, 1 / 128, 1 / 256]
    assert alibi_slopes(8).dtype == torch.float32


def test_alibi_slopes_of_twelve_heads():
    """The eight of 8 heads, then the 1st, 3rd, 5th and 7th of 16 heads' ``2^(-8j/16) = 2^(-j/2)``."""
    want = [2.0 ** -(j + 1) for j in range(8)] + [2.0 ** (-j / 2) for j in (1, 3, 5, 7)]
    torch.testing.assert_close(alibi_slopes(12), torch.tensor(want), rtol=1e-7, atol=0)


@pytest.mark.parametrize("num_heads", [1, 2, 3, 5, 6, 7, 12, 16, 20, 24, 32, 40, 71])
def test_alibi_slopes_are_blooms(num_heads):
    """Hugging Face's BLOOM builds ``slope * key position``; at key position 1 that is the slope."""
    built = build_alibi_tensor(torch.ones(1, 2), num_heads, torch.float32)  # (h, 1, 2)
    torch.testing.assert_close(alibi_slopes(num_heads), built[:, 0, 1], rtol=1e-6, atol=0)


@pytest.mark.parametrize(("s_q", "s_k", "offset"), [(5, 5, 0), (1, 7, 6), (3, 9, 6), (4, 6, 0)])
def test_alibi_bias_is_the_loop(s_q, s_k, offset):
    slopes = alibi_slopes(6)
    got = alibi_bias(slopes, s_q, s_k, offset=offset)
    assert got.shape == (6, s_q, s_k) and got.dtype == torch.float32
    for h in range(6):
        for i in range(s_q):
            for k in range(s_k):
                distance = offset + i - k
                want = -slopes[h].item() * distance if distance >= 0 else 0.0
                assert got[h, i, k].item() == pytest.approx(want, abs=1e-7), (h, i, k)


def test_alibi_bias_under_softmax_is_blooms():
    """BLOOM adds ``slope * k`` instead: per query, a constant apart from ``-slope * (i - k)``, so the causal
    attention weights are the same."""
    h, s = 4, 6
    scores = torch.randn(h, s, s, generator=generator())
    future = torch.ones(s, s, dtype=torch.bool).triu(1)
    ours = (scores + alibi_bias(alibi_slopes(h), s, s)).masked_fill(future, -math.inf).softmax(-1)
    bloom = build_alibi_tensor(torch.ones(1, s), h, torch.float32)  # (h, 1, s)
    theirs = (scores + bloom).masked_fill(future, -math.inf).softmax(-1)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def test_alibi_rejects_bad_arguments():
    with pytest.raises(ValueError, match="num_heads"):
        alibi_slopes(0)
    with pytest.raises(ValueError, match="slopes must be"):
        alibi_bias(torch.ones(2, 2), 2, 2)
    with pytest.raises(ValueError, match="offset"):
        alibi_bias(torch.ones(2), 2, 2, offset=-1)

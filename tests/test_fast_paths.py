"""The fast paths compute what the reference computes: fused projections against separate ones,
the float32 kernel for low-precision CPU training against the fp64 truth (bounded by the low-
precision reference's own error), SDPA dispatch in the models, and torch.compile (no graph breaks,
same outputs as eager)."""

import pytest
import torch
import torch.nn.functional as F

import qkv
from qkv.attention import backends, select_backend
from qkv.attention.functional import attention_reference
from qkv.attention.masks import broadcast_shape


def _unfused(module: qkv.MultiHeadAttention) -> qkv.MultiHeadAttention:
    """The same weights, with a no-op hook on each projection: hooked projections are never fused."""
    import copy

    other = copy.deepcopy(module)
    for proj in (other.q_proj, other.k_proj, other.v_proj):
        proj.register_forward_hook(lambda mod, args, out: None)
    return other


@pytest.mark.parametrize("bias", [True, False])
def test_fused_qkv_projection_equals_separate_projections(bias):
    fused = qkv.MultiHeadAttention(32, 4, bias=bias)
    separate = _unfused(fused)
    x = torch.randn(3, 6, 32, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    keep = qkv.padding_mask_from_lengths([6, 4, 2])
    out_fused = fused(x, key_padding_mask=keep, is_causal=True).output
    out_separate = separate(x2, key_padding_mask=keep, is_causal=True).output
    torch.testing.assert_close(out_fused, out_separate, atol=1e-6, rtol=0)
    grad = torch.randn_like(out_fused)
    out_fused.backward(grad)
    out_separate.backward(grad)
    torch.testing.assert_close(x.grad, x2.grad, atol=1e-6, rtol=0)
    for name in ("q_proj", "k_proj", "v_proj"):
        for param in ("weight", "bias") if bias else ("weight",):
            got = getattr(getattr(fused, name), param).grad
            want = getattr(getattr(separate, name), param).grad
            torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_fused_kv_cross_attention_equals_separate_and_cache_keeps_it():
    fused = qkv.MultiHeadAttention(24, 3)
    separate = _unfused(fused)
    query, memory = torch.randn(2, 4, 24), torch.randn(2, 7, 24)
    keep = qkv.padding_mask_from_lengths([7, 3])
    got = fused(query, memory, key_padding_mask=keep)
    want = separate(query, memory, key_padding_mask=keep)
    torch.testing.assert_close(got.output, want.output, atol=1e-6, rtol=0)
    torch.testing.assert_close(got.cache.key, want.cache.key, atol=1e-6, rtol=0)
    torch.testing.assert_close(got.cache.value, want.cache.value, atol=1e-6, rtol=0)
    # the static cache from the fused call serves the next step exactly like recomputing
    step = torch.randn(2, 1, 24)
    torch.testing.assert_close(
        fused(step, memory, key_padding_mask=keep, cache=got.cache).output,
        separate(step, memory, key_padding_mask=keep).output,
        atol=1e-6,
        rtol=0,
    )


def test_broadcast_shape_agrees_with_torch():
    cases = [
        ((2, 1, 5), (3, 1)),
        ((1,), (4, 3)),
        ((), (2, 3)),
        ((2, 3, 4, 5), (1, 1, 5)),
        ((7,), (7,)),
        ((2, 1, 1, 6), (2, 4, 3, 6), (3, 1)),
    ]
    for shapes in cases:
        assert broadcast_shape(*shapes) == tuple(torch.broadcast_shapes(*shapes))
    for shapes in [((2, 3), (3, 2)), ((4,), (5,)), ((2, 1, 5), (3, 4))]:
        with pytest.raises(RuntimeError):
            torch.broadcast_shapes(*shapes)
        assert broadcast_shape(*shapes) is None


def test_upcast_decision():
    lo = torch.randn(1, 2, 8, 16, dtype=torch.float16, requires_grad=True)
    assert backends.upcast_for_cpu_backward(lo, lo, lo)
    with torch.no_grad():
        assert not backends.upcast_for_cpu_backward(lo, lo, lo)  # inference: the fp16 kernel is fine
    assert not backends.upcast_for_cpu_backward(lo.detach(), lo.detach(), lo.detach())
    assert not backends.upcast_for_cpu_backward(lo.float(), lo.float(), lo.float())
    long = torch.randn(1, 1, backends.UPCAST_MAX_LEN, 8, dtype=torch.float16, requires_grad=True)
    assert not backends.upcast_for_cpu_backward(lo, long, long)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_plain_path_decision(dtype):
    limit = backends.PLAIN_MAX_LEN
    short = torch.randn(1, 2, limit - 1, 8, dtype=dtype, requires_grad=True)
    long = torch.randn(1, 2, limit, 8, dtype=dtype, requires_grad=True)
    assert backends.plain_is_faster(short, short, short)
    assert not backends.plain_is_faster(short, long, long)  # the longer of queries and keys decides
    assert not backends.plain_is_faster(short.detach(), short.detach(), short.detach())
    with torch.no_grad():
        assert not backends.plain_is_faster(short, short, short)  # inference: the fused kernel
    assert select_backend(short, short, short, None, False, 0.0, False).backend == "reference"
    assert select_backend(long, long, long, None, False, 0.0, False).backend == "torch_sdpa"


def _errors(fn, q, k, v, grad, truth_out, truth_grads):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(grad)
    err_out = (out.double() - truth_out).abs().max().item()
    err_grad = max((t.grad.double() - g).abs().max().item() for t, g in zip((q, k, v), truth_grads))
    return err_out, err_grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_low_precision_training_path_error_is_within_the_references_own(dtype, causal):
    """FlashAttention-style bound: the fast path's error against fp64 is at most twice the error
    of torch's own low-precision kernel against fp64 (forward and gradients)."""
    q, k, v = (torch.randn(2, 3, 40, 16, dtype=torch.float64) for _ in range(3))
    keep = qkv.padding_mask_from_lengths([40, 29])[:, None, None, :]  # (b, 1, 1, s_k)
    grad = torch.randn(2, 3, 40, 16, dtype=torch.float64)
    qd, kd, vd = (t.clone().requires_grad_(True) for t in (q, k, v))
    truth = attention_reference(qd, kd, vd, attn_mask=keep, is_causal=causal)[0]
    truth.backward(grad)
    truth_grads = (qd.grad, kd.grad, vd.grad)
    low = [t.to(dtype) for t in (q, k, v)]
    ours = _errors(
        lambda a, b, c: qkv.scaled_dot_product_attention(a, b, c, attn_mask=keep, is_causal=causal),
        *low,
        grad.to(dtype),
        truth,
        truth_grads,
    )
    theirs = _errors(
        lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=keep, is_causal=causal),
        *low,
        grad.to(dtype),
        truth,
        truth_grads,
    )
    assert ours[0] <= 2 * theirs[0] + 1e-6
    assert ours[1] <= 2 * theirs[1] + 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_training_path_runs_in_float32_even_under_autocast(dtype):
    q, k, v = (torch.randn(2, 2, 12, 8, requires_grad=True) for _ in range(3))
    keep = qkv.padding_mask_from_lengths([12, 7])[:, None, None, :]
    with torch.autocast("cpu", dtype=dtype):
        low = [t.to(dtype) for t in (q, k, v)]
        out = qkv.scaled_dot_product_attention(*low, attn_mask=keep)
    assert out.dtype == dtype
    want = attention_reference(*(t.float() for t in low), attn_mask=keep)[0].to(dtype)
    assert torch.equal(out, want)  # bit for bit: the plain products ran in float32, then one rounding
    out.float().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    long = [torch.randn(1, 2, backends.PLAIN_MAX_LEN, 8, dtype=dtype, requires_grad=True) for _ in range(3)]
    with torch.autocast("cpu", dtype=dtype):
        out = qkv.scaled_dot_product_attention(*long, is_causal=True)  # longer: the kernel, upcast
    want = F.scaled_dot_product_attention(*(t.float() for t in long), is_causal=True).to(dtype)
    assert torch.equal(out, want)


def _tiny_model(**overrides) -> qkv.Transformer:
    config = dict(
        src_vocab_size=40,
        tgt_vocab_size=40,
        d_model=16,
        num_heads=2,
        num_encoder_layers=2,
        num_decoder_layers=2,
        d_ff=32,
        max_len=32,
    )
    config.update(overrides)
    return qkv.Transformer(qkv.TransformerConfig(**config))


def _batch():
    src = torch.randint(4, 40, (3, 7))
    src[1, 5:] = 0
    src[2, 2:] = 0
    tgt = torch.randint(4, 40, (3, 6))
    return src, tgt


def test_models_run_every_attention_on_the_fused_kernel(monkeypatch):
    """Key-padding masks and causal masks go to SDPA: the eager reference never runs in a forward
    pass without weights, and every attention (encoder self, decoder self and cross) is fused
    (with the CPU's short-sequence plain path turned off; the next test has it on)."""
    monkeypatch.setattr(backends, "PLAIN_MAX_LEN", 0)
    calls = []
    original = F.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(kwargs.get("is_causal", False))
        return original(*args, **kwargs)

    def forbidden(*args, **kwargs):
        raise AssertionError("the eager reference ran")

    monkeypatch.setattr(backends.F, "scaled_dot_product_attention", counting)
    monkeypatch.setattr("qkv.attention.functional.attention_reference", forbidden)
    model = _tiny_model().train()
    src, tgt = _batch()
    model(src, tgt).sum().backward()
    assert len(calls) == 2 + 2 * 2  # 2 encoder self, 2 decoder self (causal), 2 cross
    assert sum(calls) == 2  # decoder self-attention used the kernel's is_causal, not a mask


def test_cpu_training_on_short_sequences_runs_every_attention_on_the_plain_path(monkeypatch):
    plain = []
    original = qkv.attention.functional.attention_reference

    def counting(*args, **kwargs):
        plain.append(args[0].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr("qkv.attention.functional.attention_reference", counting)
    model = _tiny_model().train()
    src, tgt = _batch()
    model(src, tgt).sum().backward()
    assert len(plain) == 2 + 2 * 2
    with torch.no_grad():
        model(src, tgt)  # inference: the fused kernel
    assert len(plain) == 6


def test_transformer_forward_has_no_graph_breaks():
    model = _tiny_model().eval()
    src, tgt = _batch()
    explanation = torch._dynamo.explain(model)(src, tgt)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_compiled_training_step_equals_eager():
    """fullgraph=True fails on any graph break; aot_eager traces forward and backward through
    AOTAutograd (inductor's code generation is left to the slow test)."""
    torch._dynamo.reset()
    model = _tiny_model(norm_first=True, dropout=0.0).train()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    src, tgt = _batch()
    want = model(src, tgt)
    want.square().mean().backward()
    want_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    got = compiled(src, tgt)
    got.square().mean().backward()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for param, grad in zip(model.parameters(), want_grads):
        torch.testing.assert_close(param.grad, grad, atol=1e-5, rtol=1e-5)


def test_compiled_loss_compiles_once_for_batches_of_any_shape():
    """The trainer's ``Transformer.loss`` under ``torch.compile(dynamic=True)``: the fused loss is
    left out of the graph, so batches with other lengths and other numbers of real target positions
    reuse the first compilation (no recompile per batch), and the loss and gradients equal the
    plain ``F.cross_entropy`` of the eager model's logits."""
    torch._dynamo.reset()
    model = _tiny_model(dropout=0.0).train()
    compiled = torch.compile(model.loss, dynamic=True, backend="eager")
    gen = torch.Generator().manual_seed(0)
    shapes = [(3, 9, 6), (4, 7, 8), (2, 5, 11), (5, 12, 3)]  # first: no two sizes equal (duck sizing)
    for i, (b, s_src, s_tgt) in enumerate(shapes):
        src = torch.randint(4, 40, (b, s_src), generator=gen)
        tgt = torch.randint(4, 40, (b, s_tgt + 1), generator=gen)
        tgt[0, s_tgt // 2 + 1 :] = 0  # padding: fewer real positions than b * s_tgt
        tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]
        model.zero_grad()
        want = F.cross_entropy(
            model(src, tgt_in).reshape(-1, 40),
            tgt_out.reshape(-1),
            ignore_index=0,
            label_smoothing=0.1,
            reduction="sum",
        )
        want.backward()
        want_grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        stance = "default" if i == 0 else "fail_on_recompile"
        with torch.compiler.set_stance(stance):
            got = compiled(src, tgt_in, tgt_out, label_smoothing=0.1)
        got.backward()
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
        for param, grad in zip(model.parameters(), want_grads):
            torch.testing.assert_close(param.grad, grad, atol=1e-5, rtol=1e-4)


def test_compiled_cached_decoding_step_has_no_graph_breaks():
    torch._dynamo.reset()
    model = _tiny_model().eval()
    src, tgt = _batch()
    with torch.no_grad():
        memory = model.encode(src)
        first = model.decode(tgt[:, :3], memory)
        step = torch.compile(model.decode, fullgraph=True, backend="eager")
        got = step(tgt[:, 3:4], memory, cache=first.cache).logits
        want = model.decode(tgt[:, :4], memory).logits[:, -1:]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_compiled_forward_under_bf16_autocast_has_no_graph_breaks():
    torch._dynamo.reset()
    model = _tiny_model(dropout=0.0).train()
    src, tgt = _batch()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = compiled(src, tgt)
        want = model(src, tgt)
    torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=0)
    got.float().sum().backward()


@pytest.mark.slow
def test_inductor_compiled_model_equals_eager():
    torch._dynamo.reset()
    model = _tiny_model(dropout=0.0).train()
    src, tgt = _batch()
    compiled = torch.compile(model, fullgraph=True)
    torch.testing.assert_close(compiled(src, tgt), model(src, tgt), atol=1e-4, rtol=1e-4)

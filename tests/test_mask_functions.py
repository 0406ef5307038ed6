"""qkv.attention.mask_functions: each mask function against a mask written out position by position,
their composition, offsets (cached decoding, a cache that dropped its oldest keys), fully masked rows,
and FlexAttention's path against the boolean one."""

from __future__ import annotations

import warnings

import pytest
import torch

from qkv.attention import mask_functions as mf
from qkv.attention.functional import scaled_dot_product_attention
from qkv.attention.masks import causal_mask

B, H = 2, 3


def looped(allowed, b: int, h: int, s_q: int, s_k: int, q_offset: int = 0, kv_offset: int = 0) -> torch.Tensor:
    """The mask written out: ``allowed(batch, head, i, j)`` at every absolute query ``i`` and key ``j``."""
    mask = torch.zeros(b, h, s_q, s_k, dtype=torch.bool)
    for n in range(b):
        for head in range(h):
            for qi in range(s_q):
                for kj in range(s_k):
                    mask[n, head, qi, kj] = bool(allowed(n, head, q_offset + qi, kv_offset + kj))
    return mask


def dense(fn, s_q: int, s_k: int, q_offset: int = 0, kv_offset: int = 0) -> torch.Tensor:
    """``to_bool_mask`` expanded to (B, H, s_q, s_k) for comparison with :func:`looped`."""
    mask = mf.to_bool_mask(fn, B, H, s_q, s_k, q_offset=q_offset, kv_offset=kv_offset)
    assert mask.dtype == torch.bool and mask.shape[2:] == (s_q, s_k)
    return mask.expand(B, H, s_q, s_k)


DOC_IDS = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 3], [0, 1, 1, 1, 1, 1, 2, 2, 3, 3, 3, 3]])
REAL = torch.tensor([[True] * 12, [True] * 9 + [False] * 3])
PREFIX = torch.tensor([3, 5])


@pytest.mark.parametrize(
    ("s_q", "s_k", "q_offset", "kv_offset"), [(7, 7, 0, 0), (3, 9, 6, 0), (4, 6, 8, 4), (6, 3, 0, 0)]
)
def test_each_mask_function_is_the_mask_written_out(s_q, s_k, q_offset, kv_offset):
    cases = {
        "causal": (mf.causal(), lambda n, h, i, j: j <= i),
        "window 1": (mf.sliding_window(1), lambda n, h, i, j: j == i),
        "window 3": (mf.sliding_window(3), lambda n, h, i, j: i - 3 < j <= i),
        "document": (mf.document(DOC_IDS), lambda n, h, i, j: DOC_IDS[n, i] == DOC_IDS[n, j]),
        "prefix 2": (mf.prefix(2), lambda n, h, i, j: j < 2 or j <= i),
        "prefix per row": (mf.prefix(PREFIX), lambda n, h, i, j: j < PREFIX[n] or j <= i),
        "padding": (mf.padding(REAL), lambda n, h, i, j: REAL[n, j]),
    }
    for name, (fn, allowed) in cases.items():
        expected = looped(allowed, B, H, s_q, s_k, q_offset, kv_offset)
        assert torch.equal(dense(fn, s_q, s_k, q_offset, kv_offset), expected), name


def test_compositions_are_the_logical_and_and_or():
    s_q, s_k, q_offset = 5, 12, 7
    packed = mf.and_masks(mf.causal(), mf.document(DOC_IDS), mf.padding(REAL))
    expected = looped(
        lambda n, h, i, j: j <= i and DOC_IDS[n, i] == DOC_IDS[n, j] and REAL[n, j], B, H, s_q, s_k, q_offset
    )
    assert torch.equal(dense(packed, s_q, s_k, q_offset), expected)
    either = mf.or_masks(mf.sliding_window(2), mf.prefix(PREFIX))
    expected = looped(lambda n, h, i, j: i - 2 < j <= i or j < PREFIX[n] or j <= i, B, H, s_q, s_k, q_offset)
    assert torch.equal(dense(either, s_q, s_k, q_offset), expected)
    nested = mf.and_masks(mf.or_masks(mf.sliding_window(2), mf.prefix(1)), mf.padding(REAL))
    expected = looped(lambda n, h, i, j: (i - 2 < j <= i or j < 1 or j <= i) and REAL[n, j], B, H, s_q, s_k, q_offset)
    assert torch.equal(dense(nested, s_q, s_k, q_offset), expected)
    assert torch.equal(dense(mf.and_masks(mf.causal()), 4, 4), dense(mf.causal(), 4, 4))


def test_leading_dims_stay_one_where_the_function_does_not_read_them():
    assert mf.to_bool_mask(mf.causal(), B, H, 4, 5).shape == (1, 1, 4, 5)
    assert mf.to_bool_mask(mf.document(DOC_IDS), B, H, 4, 5).shape == (B, 1, 4, 5)
    assert mf.to_bool_mask(mf.padding(REAL), B, H, 4, 5).shape == (B, 1, 4, 5)

    def per_head(b, h, q_idx, kv_idx):  # head h sees a window of h + 1 keys
        return (kv_idx <= q_idx) & (q_idx - kv_idx <= h)

    mask = mf.to_bool_mask(per_head, B, H, 6, 6)
    assert mask.shape == (1, H, 6, 6)
    assert torch.equal(mask.expand(B, H, 6, 6), looped(lambda n, h, i, j: 0 <= i - j <= h, B, H, 6, 6))
    assert torch.equal(mf.to_bool_mask(lambda b, h, q, k: q >= 0, B, H, 2, 3), torch.ones(1, 1, 2, 3, dtype=torch.bool))


def test_offsets_agree_with_the_bottom_right_causal_and_window_masks():
    from qkv.attention.masks import sliding_window_mask

    for s_q, s_k in [(1, 9), (4, 9), (9, 9)]:
        offset = s_k - s_q  # the new queries follow the cached keys
        assert torch.equal(mf.to_bool_mask(mf.causal(), 1, 1, s_q, s_k, q_offset=offset)[0, 0], causal_mask(s_q, s_k))
        for window in (1, 3, 20):
            got = mf.to_bool_mask(mf.sliding_window(window), 1, 1, s_q, s_k, q_offset=offset)[0, 0]
            assert torch.equal(got, sliding_window_mask(s_q, s_k, window)), (s_q, s_k, window)
    # a cache of the last 4 keys (positions 6..9) and the query at 9: window 4 sees all 4, window 2 the last 2
    assert mf.to_bool_mask(mf.sliding_window(4), 1, 1, 1, 4, q_offset=9, kv_offset=6).tolist() == [[[[True] * 4]]]
    assert mf.to_bool_mask(mf.sliding_window(2), 1, 1, 1, 4, q_offset=9, kv_offset=6).flatten().tolist() == [
        False,
        False,
        True,
        True,
    ]


def test_bad_arguments_are_one_line_errors_naming_the_field():
    with pytest.raises(ValueError, match="window"):
        mf.sliding_window(0)
    with pytest.raises(ValueError, match="doc_ids"):
        mf.document(torch.zeros(3))
    with pytest.raises(ValueError, match="length"):
        mf.prefix(-1)
    with pytest.raises(ValueError, match="length"):
        mf.prefix(torch.ones(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="real"):
        mf.padding(torch.ones(2, 3))
    with pytest.raises(ValueError, match="at least one"):
        mf.and_masks()
    with pytest.raises(ValueError, match="at least one"):
        mf.or_masks()
    with pytest.raises(ValueError, match="bool"):
        mf.to_bool_mask(lambda b, h, q, k: q - k, 1, 1, 2, 2)
    with pytest.raises(ValueError, match="q_offset"):
        mf.to_bool_mask(mf.causal(), 1, 1, 2, 2, q_offset=-1)
    with pytest.raises(ValueError, match="broadcastable"):
        mf.to_bool_mask(lambda b, h, q, k: torch.ones(3, 1, 2, 2, dtype=torch.bool), B, H, 2, 2)


def qkv_inputs(s_q: int, s_k: int, *, b: int = B, h: int = H, d: int = 8, grad: bool = False, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(b, h, s_q, d), (b, h, s_k, d), (b, h, s_k, d)]
    return [torch.randn(*shape, generator=generator).requires_grad_(grad) for shape in shapes]


def test_fully_masked_rows_give_zeros_and_zero_gradients_on_the_boolean_path():
    # rows 0..2 of the second sequence see nothing: its first real key is at position 3
    real = torch.tensor([[True] * 6, [False] * 3 + [True] * 3])
    fn = mf.and_masks(mf.causal(), mf.padding(real))
    q, k, v = qkv_inputs(6, 6, grad=True)
    out = mf.attend_with_mask_function(q, k, v, fn, use_flex=False)
    assert not out.isnan().any()
    assert torch.equal(out[1, :, :3], torch.zeros_like(out[1, :, :3]))
    expected = scaled_dot_product_attention(q, k, v, attn_mask=mf.to_bool_mask(fn, B, H, 6, 6))
    torch.testing.assert_close(out, expected)
    out.square().sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))
    assert torch.equal(q.grad[1, :, :3], torch.zeros_like(q.grad[1, :, :3]))
    assert torch.equal(k.grad[1, :, :3], torch.zeros_like(k.grad[1, :, :3]))  # keys nobody sees


def test_the_rule_keeps_the_boolean_path_where_flex_was_not_measured_faster(monkeypatch):
    monkeypatch.setattr(mf, "_flex_failed", [])
    q, k, v = qkv_inputs(mf.FLEX_MIN_QUERIES, mf.FLEX_MIN_QUERIES, b=1, h=1, d=4)
    assert mf.flex_is_faster(q, k, v) is mf.flex_available()  # long CPU inference in float32
    assert not mf.flex_is_faster(q, k, v, dropout_p=0.1)  # no dropout in FlexAttention
    assert not mf.flex_is_faster(q.clone().requires_grad_(), k, v)  # no backward on CPU
    short = qkv_inputs(mf.FLEX_MIN_QUERIES - 1, mf.FLEX_MIN_QUERIES, b=1, h=1, d=4)
    assert not mf.flex_is_faster(*short)  # decoding steps, short prompts: a compile per shape
    assert not mf.flex_is_faster(*(t.to(torch.bfloat16) for t in (q, k, v)))  # not measured
    monkeypatch.setattr(mf, "_flex_failed", ["InductorError: no compiler"])
    assert not mf.flex_is_faster(q, k, v)


def refusing_compile():
    def compiled(*args, **kwargs):
        raise RuntimeError("no C++ compiler here")

    return compiled


@pytest.mark.skipif(not mf.flex_available(), reason="this torch has no flex_attention")
def test_a_failed_compile_is_logged_once_and_the_boolean_path_serves(monkeypatch, caplog):
    monkeypatch.setattr(mf, "_flex_failed", [])
    monkeypatch.setattr(mf, "_flex_compiled", set())
    monkeypatch.setattr(mf, "_compiled_flex", refusing_compile)
    q, k, v = qkv_inputs(mf.FLEX_MIN_QUERIES, mf.FLEX_MIN_QUERIES, b=1, h=1, d=4)
    fn = mf.sliding_window(100)
    expected = mf.attend_with_mask_function(q, k, v, fn, use_flex=False)
    with caplog.at_level("WARNING", logger="qkv.attention.mask_functions"):
        assert torch.equal(mf.attend_with_mask_function(q, k, v, fn), expected)
        assert torch.equal(mf.attend_with_mask_function(q, k, v, fn), expected)  # not tried again
    assert mf._flex_failed == ["RuntimeError: no C++ compiler here"]
    assert len(caplog.records) == 1 and "no C++ compiler" in caplog.records[0].getMessage()
    with pytest.raises(RuntimeError, match="compiler"):  # a caller that asked for flex is told
        mf.attend_with_mask_function(q, k, v, fn, use_flex=True)
    with pytest.raises(ValueError, match="dropout"):
        mf.attend_with_mask_function(q, k, v, fn, use_flex=True, dropout_p=0.1)


@pytest.mark.skipif(not mf.flex_available(), reason="this torch has no flex_attention")
def test_new_kernels_past_torchs_recompile_limit_take_the_boolean_path(monkeypatch):
    monkeypatch.setattr(mf, "_flex_failed", [])
    monkeypatch.setattr(mf, "_flex_compiled", {("compiled", i) for i in range(mf.FLEX_MAX_SHAPES)})
    monkeypatch.setattr(mf, "_compiled_flex", refusing_compile)  # would raise if the flex path were taken
    q, k, v = qkv_inputs(mf.FLEX_MIN_QUERIES, mf.FLEX_MIN_QUERIES, b=1, h=1, d=4)
    out = mf.attend_with_mask_function(q, k, v, mf.causal())
    assert torch.equal(out, mf.attend_with_mask_function(q, k, v, mf.causal(), use_flex=False))
    assert mf._flex_failed == []


needs_flex = pytest.mark.skipif(not mf.flex_available(), reason="this torch has no flex_attention")

_random = torch.Generator().manual_seed(1)
# causal + window, documents, a prefix with padding; offsets of cached decoding and of a dropped cache
FLEX_CASES = {
    "window": (mf.sliding_window(130), 300, 300, 0, 0),
    "documents": (
        mf.and_masks(mf.causal(), mf.document(torch.randint(0, 3, (B, 400), generator=_random).sort(-1).values)),
        200,
        200,
        0,
        0,
    ),
    "prefix, padding": (
        mf.and_masks(mf.prefix(PREFIX * 20), mf.padding(torch.rand(B, 400, generator=_random) > 0.2)),
        150,
        260,
        110,
        0,
    ),
    "dropped cache": (mf.sliding_window(64), 40, 200, 300, 140),
    "empty rows": (mf.and_masks(mf.causal(), lambda b, h, q, k: q >= 140), 256, 256, 0, 0),  # a whole empty tile too
}


@needs_flex
@pytest.mark.parametrize("name", list(FLEX_CASES))
def test_the_block_mask_tiles_are_torchs(name):
    from torch.nn.attention.flex_attention import create_block_mask

    fn, s_q, s_k, q_offset, kv_offset = FLEX_CASES[name]
    ours = mf.flex_block_mask(fn, B, H, s_q, s_k, q_offset=q_offset, kv_offset=kv_offset)
    theirs = create_block_mask(mf.shifted(fn, q_offset, kv_offset), B, H, s_q, s_k, device="cpu")
    assert torch.equal(ours.to_dense().expand_as(theirs.to_dense()), theirs.to_dense())
    assert torch.equal(ours.full_kv_num_blocks.expand_as(theirs.full_kv_num_blocks), theirs.full_kv_num_blocks)


@needs_flex
@pytest.mark.parametrize("name", list(FLEX_CASES))
def test_eager_flex_attention_with_a_mask_function_is_the_boolean_path(name):
    from torch.nn.attention.flex_attention import flex_attention

    fn, s_q, s_k, q_offset, kv_offset = FLEX_CASES[name]
    q, k, v = qkv_inputs(s_q, s_k)
    block_mask = mf.flex_block_mask(fn, B, H, s_q, s_k, q_offset=q_offset, kv_offset=kv_offset)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's advice to compile
        out = flex_attention(q, k, v, block_mask=block_mask)
    expected = mf.attend_with_mask_function(q, k, v, fn, q_offset=q_offset, kv_offset=kv_offset, use_flex=False)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert not out.isnan().any()


def compiled(q, k, v, fn, **kwargs):
    """The flex path (compiled), or a skip where torch.compile cannot build kernels here (no compiler)."""
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._inductor.exc import InductorError

    try:
        return mf.attend_with_mask_function(q, k, v, fn, use_flex=True, **kwargs)
    except (BackendCompilerFailed, InductorError) as err:
        pytest.skip(f"torch.compile of flex_attention does not run here: {type(err).__name__}")


@needs_flex
@pytest.mark.slow
@pytest.mark.parametrize("name", list(FLEX_CASES))
def test_compiled_flex_attention_is_the_boolean_path(name):
    fn, s_q, s_k, q_offset, kv_offset = FLEX_CASES[name]
    q, k, v = qkv_inputs(s_q, s_k)
    out = compiled(q, k, v, fn, q_offset=q_offset, kv_offset=kv_offset)
    expected = mf.attend_with_mask_function(q, k, v, fn, q_offset=q_offset, kv_offset=kv_offset, use_flex=False)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert not out.isnan().any()


@needs_flex
def test_compiled_flex_gives_fully_masked_rows_zeros_as_the_boolean_path_does():
    fn, s_q, s_k, _, _ = FLEX_CASES["empty rows"]
    q, k, v = qkv_inputs(s_q, s_k, b=1)
    out = compiled(q, k, v, fn, scale=0.3)
    assert torch.equal(out[:, :, :140], torch.zeros_like(out[:, :, :140]))
    expected = mf.attend_with_mask_function(q, k, v, fn, use_flex=False, scale=0.3)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@needs_flex
def test_flex_backward_on_cpu_is_refused_so_the_automatic_choice_never_takes_it():
    q, k, v = qkv_inputs(64, 64, b=1, h=1, grad=True)
    with pytest.raises(NotImplementedError, match="backward"):
        mf.attend_with_mask_function(q, k, v, mf.causal(), use_flex=True)
    out = mf.attend_with_mask_function(q, k, v, mf.causal())  # the boolean path
    out.sum().backward()
    assert q.grad is not None


@needs_flex
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's backward needs CUDA")
def test_flex_forward_and_backward_on_cuda_are_the_boolean_paths():
    _, s_q, s_k, q_offset, _ = FLEX_CASES["prefix, padding"]
    fn = mf.and_masks(mf.prefix(PREFIX.cuda() * 20), mf.padding(torch.rand(B, 400, device="cuda") > 0.2))
    grads = []
    outs = []
    for use_flex in (True, False):
        q, k, v = (t.cuda().requires_grad_() for t in qkv_inputs(s_q, s_k))
        out = mf.attend_with_mask_function(q, k, v, fn, q_offset=q_offset, use_flex=use_flex)
        out.square().sum().backward()
        outs.append(out.detach())
        grads.append([t.grad for t in (q, k, v)])
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    for flex_grad, bool_grad in zip(*grads, strict=True):
        torch.testing.assert_close(flex_grad, bool_grad, atol=1e-5, rtol=1e-5)

"""benchmarks/decoding_products.py --quick: every product is computed by the three engines (PyTorch's
F.linear, oneDNN packed, onnxruntime's MatMul), which must agree with F.linear; the result JSON has its
provenance and a time for every engine and product. No timing is asserted."""

import json

import pytest
from bench_loader import load_benchmark

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

ENGINES = {"torch_linear", "torch_onednn_packed", "onnxruntime"}


def test_quick_run_times_every_product_with_every_engine(tmp_path):
    bench = load_benchmark("decoding_products")
    out = tmp_path / "products.json"
    assert bench.main(["--quick", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    for field in ("machine", "command", "date", "commit"):
        assert report[field]
    shapes = report["settings"]["shapes"]
    assert shapes["self q/k/v (fused)"] == [96, 32] and shapes["vocabulary projection"] == [100, 32]
    r = report["threads"]["1"]["16"]
    assert set(r["alone_us"]) == set(shapes)
    for per in r["alone_us"].values():
        assert set(per) >= ENGINES and all(per[e] > 0 for e in ENGINES)
    assert set(r["in_step_us"]) >= ENGINES and r["max_relative_difference"] <= 1e-4


def test_the_onnx_product_computes_the_linear_layer():
    import numpy as np

    bench = load_benchmark("decoding_products")
    rng = np.random.default_rng(0)
    weight, bias, x = (rng.standard_normal(s).astype(np.float32) for s in ((5, 3), (5,), (4, 3)))
    got = bench.onnx_product(weight, bias, 4, 1)(x)
    np.testing.assert_allclose(got, x @ weight.T + bias, rtol=1e-5, atol=1e-5)

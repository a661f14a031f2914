"""The few-row verify matmul (nodes/backends/few_rows.py): built here, right, row-independent,
and installed on the verifier's model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nodes.backends import few_rows
from tests.engine.conftest import needs_kernel


@needs_kernel
@pytest.mark.parametrize("n,k", [(1, 8), (7, 13), (50, 576), (97, 1000), (192, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_kernel_computes_x_times_w_transposed(kernel, n, k, bias):
    gen = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    for m in range(1, few_rows.MAX_ROWS + 1):
        x = torch.randn(m, k, generator=gen)
        exact = F.linear(x.double(), w.double(), None if b is None else b.double())
        got = kernel.linear(x, w, b)
        assert got.shape == (m, n) and got.dtype == torch.float32
        # float32 sums of k products: within a few ulps of the exact sum's scale
        scale = (x.abs().double() @ w.abs().double().T) + (0 if b is None else b.abs().double())
        assert ((got.double() - exact).abs() <= 1e-5 * scale + 1e-6).all(), (m, n, k)


@needs_kernel
def test_each_row_gets_the_result_it_gets_alone(kernel):
    """Why verify and batching may use it: a row's output does not depend on its neighbours."""
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(300, 576, generator=gen)
    x = torch.randn(few_rows.MAX_ROWS, 576, generator=gen)
    together = kernel.linear(x, w, None)
    for i in range(x.shape[0]):
        assert torch.equal(kernel.linear(x[i:i + 1].clone(), w, None)[0], together[i])
    shuffled = torch.randperm(x.shape[0], generator=gen)
    assert torch.equal(kernel.linear(x[shuffled].contiguous(), w, None), together[shuffled])


@needs_kernel
def test_the_kernel_refuses_what_it_cannot_do(kernel):
    with pytest.raises(RuntimeError, match="float32 only"):
        kernel.linear(torch.ones(2, 8, dtype=torch.float64), torch.ones(3, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"x \[M, K\] and w \[N, K\]"):
        kernel.linear(torch.ones(2, 8), torch.ones(3, 9))


@needs_kernel
def test_installed_linears_serve_few_rows_and_leave_the_rest_to_torch(kernel):
    layer = torch.nn.Linear(64, 40)
    plain = torch.nn.Linear(64, 40)
    plain.load_state_dict(layer.state_dict())
    model = torch.nn.Sequential(layer, torch.nn.ReLU())
    assert few_rows.install(model) == 1
    assert few_rows.installed(layer) and type(layer) is torch.nn.Linear
    with torch.inference_mode():
        few = torch.randn(1, 3, 64)
        assert torch.equal(layer(few), kernel.linear(few[0], layer.weight, layer.bias)[None])
        many = torch.randn(2, few_rows.MAX_ROWS, 64)  # 2 x MAX_ROWS rows: torch's, bit for bit
        assert torch.equal(layer(many), plain(many))


@needs_kernel
def test_training_through_an_installed_linear_gets_weight_gradients(kernel):
    """The kernel has no backward: with grad mode on and weights requiring grad, torch's
    matmul serves (weight gradients as a plain Linear's); under no_grad the kernel does, even
    though the weights still require grad (every serving path runs so)."""
    layer = torch.nn.Linear(32, 16)
    plain = torch.nn.Linear(32, 16)
    plain.load_state_dict(layer.state_dict())
    few_rows.install(torch.nn.Sequential(layer))
    x = torch.randn(3, 32)  # an input that does not require grad: only the weights do
    layer(x).square().sum().backward()
    plain(x).square().sum().backward()
    assert layer.weight.grad is not None
    assert torch.allclose(layer.weight.grad, plain.weight.grad, atol=1e-6)
    with torch.no_grad():
        assert torch.equal(layer(x), kernel.linear(x, layer.weight, layer.bias))


@needs_kernel
@pytest.mark.slow
def test_the_cpu_verifier_model_uses_it(kernel):
    from nodes.backends.torch_backend import TorchBackend

    backend = TorchBackend.load(None, "cpu")
    linears = [m for m in backend.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(few_rows.installed(m) for m in linears)


def test_bench_forward_measures_both_matmuls_on_a_real_model(tiny_folder, tmp_path, capsys):
    import json

    from tools import bench_forward

    out = tmp_path / "forward.json"
    assert bench_forward.main(["--model", str(tiny_folder), "--fed", "1,2,5", "--repeat", "1",
                               "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    # the lean forward needs the kernel too (torch_lean.supported)
    modes = {"torch", "few-rows", "lean"} if few_rows.load() is not None else {"torch"}
    assert set(result["seconds"]) == modes
    assert all(set(v) == {"1", "2", "5"} and min(v.values()) > 0
               for v in result["seconds"].values())
    assert "forward cost by tokens fed" in capsys.readouterr().out


def test_bench_forward_refuses_bad_counts():
    from tools import bench_forward

    with pytest.raises(SystemExit):
        bench_forward.main(["--fed", "1,x"])
    with pytest.raises(SystemExit):
        bench_forward.main(["--fed", "0,2"])
    with pytest.raises(SystemExit):
        bench_forward.main(["--fed", "1,100000"])
    with pytest.raises(SystemExit):
        bench_forward.main(["--fed", "1,2", "--context", "0"])

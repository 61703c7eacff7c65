"""oneDNN packed linears on CPU: same outputs as torch's nn.Linear, applied only where they can run."""

import pytest
import torch
from torch import nn

from shardline.engine.cpu.linear import FusedGatedMLP, PackedLinear, onednn_linear_available, pack_linears

from .paths_taken import taken_unless_forced_off

pytestmark = pytest.mark.skipif(not onednn_linear_available(), reason="torch built without oneDNN")


def make_model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 96), nn.ReLU(), nn.Linear(96, 40, bias=False)).to(dtype)
    model.embed = nn.Embedding(10, 48).to(dtype)
    return model.eval()


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("shape", [(1, 48), (7, 48), (1, 300, 48), (2, 3, 48)])
def test_packed_linear_matches_torch(dtype, tolerance, shape):
    if not onednn_linear_available(dtype):
        pytest.skip(f"oneDNN runs no {dtype} linear on this CPU (test_cpu_paths covers the fallback)")
    model = make_model(dtype)
    weight = model[0].weight
    x = torch.randn(*shape).to(dtype)
    with torch.inference_mode():
        expected = model[:3](x)
        assert pack_linears(model, rows_hint=64) == 2
        assert isinstance(model[0], PackedLinear) and model[0].weight is weight  # the same parameter
        out = model[:3](x)
    assert out.shape == expected.shape and out.dtype == dtype
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("shape", [(1, 48), (7, 48), (1, 300, 48)])
def test_bfloat16_linears_packed_as_float32_copies_match_torch(shape):
    """The path for hosts where oneDNN has no bfloat16: float32 packed copies, bfloat16
    in and out, within a bfloat16 step of torch's own bfloat16 linear."""
    model = make_model(torch.bfloat16)
    x = torch.randn(*shape).to(torch.bfloat16)
    with torch.inference_mode():
        expected = model[:3](x)
        assert pack_linears(model, rows_hint=64, dtypes=(torch.bfloat16,), packed_dtype=torch.float32) == 2
        assert model[0].packed_weight.dtype == torch.float32 and model[0].weight.dtype == torch.bfloat16
        assert model[0].packed_bias.dtype == torch.float32
        out = model[:3](x)
    assert out.shape == expected.shape and out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)


def test_float64_keeps_torch_linear():
    model = make_model(torch.float64)
    assert pack_linears(model, rows_hint=64) == 0
    assert type(model[0]) is nn.Linear


def test_gradients_still_flow_through_the_original_weight():
    model = make_model(torch.float32)
    pack_linears(model, rows_hint=8)
    out = model[:3](torch.randn(2, 48))
    out.sum().backward()
    assert model[0].weight.grad is not None


@taken_unless_forced_off("packed_linears")
def test_engine_packs_linears_on_cpu(tiny_llama_dir):
    from shardline import LLM

    llm = LLM(tiny_llama_dir, dtype="float32")
    packed = [m for m in llm.llm_engine.model.modules() if isinstance(m, PackedLinear)]
    model = llm.llm_engine.model
    assert packed and isinstance(model.lm_head, PackedLinear) and model.lm_head.weight.dtype == torch.float32


def test_row_counts_fall_into_few_buckets():
    """oneDNN caches a kernel per row count: a continuous batch's row counts (any number
    up to the token budget) must reach it as a few dozen, or its memory grows with the run."""
    from shardline.engine.kernels.onednn_rows import row_bucket

    buckets = {row_bucket(rows) for rows in range(1, 8193)}
    assert len(buckets) <= 50
    assert all(row_bucket(rows) >= rows for rows in range(1, 8193))
    assert row_bucket(64) == 64 and row_bucket(8192) == 8192  # full decode and prefill steps pad nothing
    assert [row_bucket(rows) for rows in (1, 4, 5, 8, 9, 16)] == [4, 4, 8, 8, 16, 16]  # few rows, few padded


def test_a_step_past_large_rows_pads_fewer_than_small_rows():
    """Past LARGE_ROWS a step runs its multiple of LARGE_ROWS and the rest as two calls:
    the row counts oneDNN meets stay few, and a step pads fewer than SMALL_ROWS rows."""
    from shardline.engine.kernels.onednn_rows import LARGE_ROWS, SMALL_ROWS, row_bucket, row_parts

    assert row_parts(600) == (512, 88) and row_parts(512) == (512,) and row_parts(200) == (200,)
    seen = set()
    for rows in range(1, 8193):
        parts = row_parts(rows)
        assert sum(parts) == rows and all(part > 0 for part in parts)
        assert all(part % LARGE_ROWS == 0 for part in parts[:-1])
        padded = sum(row_bucket(part) for part in parts) - rows
        assert padded < (SMALL_ROWS if rows >= SMALL_ROWS else rows + 4)
        seen.update(row_bucket(part) for part in parts)
    assert len(seen) <= 50


def test_a_split_step_gives_each_row_the_product_of_one_call(monkeypatch):
    """A 600-row input reaches oneDNN as 512 rows and 88 padded to 96, not 768; its rows
    are those of one padded call wherever oneDNN's rows do not depend on the other rows
    of the call (checked on a probe), and within float32 error of torch's linear anyway."""
    import shardline.engine.cpu.linear as linear

    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(40, 48, generator=generator), torch.randn(40, generator=generator)
    x = torch.randn(600, 48, generator=generator)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 256)
    one_call = linear.onednn_linear(torch.cat([x, x.new_zeros(168, 48)]), packed, bias)[:600]
    row_independent = torch.equal(linear.onednn_linear(x[:256].contiguous(), packed, bias), one_call[:256])
    calls: list[int] = []
    original = linear.onednn_linear

    def recorded(flat: torch.Tensor, *rest) -> torch.Tensor:
        calls.append(flat.shape[0])
        return original(flat, *rest)

    monkeypatch.setattr(linear, "onednn_linear", recorded)
    with torch.inference_mode():
        out = linear.packed_matmul(x.view(2, 300, 48), packed, bias)
    assert calls == [512, 96] and out.shape == (2, 300, 40)
    torch.testing.assert_close(out.view(600, 40), nn.functional.linear(x, weight, bias), atol=1e-4, rtol=1e-4)
    if row_independent:
        assert torch.equal(out.view(600, 40), one_call)


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, inner: int, act: nn.Module) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)
        self.act_fn = act

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class GatedMLPOtherWay(GatedMLP):
    """Same modules, another formula: must keep its own forward."""

    def forward(self, x):
        return self.down_proj(self.gate_proj(x) * self.act_fn(self.up_proj(x)))


@pytest.mark.parametrize("rows", [1, 5, 64, 300])
@pytest.mark.parametrize("act", [nn.SiLU(), nn.GELU(approximate="tanh")])
def test_gated_mlp_runs_gate_and_up_as_one_matmul_with_the_same_output(rows, act):
    from shardline.engine.cpu.linear import fuse_gated_mlps

    torch.manual_seed(0)
    holder = nn.Module()
    holder.mlp = mlp = GatedMLP(48, 96, act)
    x = torch.randn(2, rows, 48)
    with torch.no_grad():
        expected = mlp(x)
        pack_linears(holder, rows_hint=16)
        assert fuse_gated_mlps(holder, rows_hint=16) == 1
        got = holder.mlp(x)
    # The pair's own packed copies are dropped: only the side-by-side one is read.
    assert isinstance(holder.mlp, FusedGatedMLP) and not isinstance(mlp.gate_proj, PackedLinear)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    holder.mlp(x).sum().backward()  # with gradients on, torch's own matmuls
    assert mlp.gate_proj.weight.grad is not None


def test_an_mlp_with_another_formula_keeps_its_forward():
    from shardline.engine.cpu.linear import fuse_gated_mlps

    torch.manual_seed(0)
    holder = nn.Module()
    holder.mlp = mlp = GatedMLPOtherWay(48, 96, nn.SiLU())
    pack_linears(holder, rows_hint=16)
    assert fuse_gated_mlps(holder, rows_hint=16) == 0
    assert holder.mlp is mlp
    x = torch.randn(3, 48)
    with torch.no_grad():
        torch.testing.assert_close(mlp(x), GatedMLPOtherWay.forward(mlp, x))


@taken_unless_forced_off("packed_linears")
def test_engine_fuses_the_llama_mlp(tiny_llama_dir):
    from shardline import LLM

    llm = LLM(tiny_llama_dir, dtype="float32")
    mlps = [m for m in llm.llm_engine.model.modules() if isinstance(m, FusedGatedMLP)]
    assert mlps and len(mlps) == llm.llm_engine.hf_config.num_hidden_layers
    llm.close()

"""The small-batch linear kernel (kernels/cpu_small_linear.c) against its plain-torch
reference, built for every target this host runs: AVX-512 with and without
AVX512_BF16's dot-product instruction, AVX2 and the SSE2 baseline."""

import platform
from pathlib import Path

import pytest
import torch

from shardline.engine.kernels import native
from shardline.engine.kernels.cpu_small_linear import (
    allow_amx_tiles,
    amx_tiles_ready,
    onednn_view,
    pack_small_linear,
    small_linear,
    small_linear_available,
    small_linear_reference,
    vector_width,
)

from .conftest import _instruction_macros


def _targets() -> list[str]:
    """native, and the narrower x86 targets this compiler builds and this CPU runs
    (those whose code paths differ from native's: conftest's _instruction_macros)."""
    compiler = native._compiler()
    if compiler is None or platform.machine() != "x86_64":
        return ["native"]
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    narrower = (["x86-64-v4"] if " avx512f" in flags else []) + ["x86-64-v3", "x86-64"]
    own = _instruction_macros(compiler, "native")  # a target building the host's own code paths is left out
    return ["native"] + [target for target in narrower if native.compiler_vector_isa(compiler, target) != "scalar"
                         and _instruction_macros(compiler, target) != own]


pytestmark = pytest.mark.skipif(not small_linear_available(torch.float32), reason="needs a C compiler")


@pytest.fixture(params=_targets())
def target(request, monkeypatch) -> str:
    monkeypatch.setenv("SHARDLINE_CPU_TARGET", request.param)
    return request.param


def _check(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """out within float32 summation error (either side's order) of the reference,
    and one bfloat16 unit in the last place apart for bfloat16 outputs (both rounded)."""
    expected = small_linear_reference(x, weight, bias).double()
    magnitude = x.double().abs() @ weight.double().abs().T + (0 if bias is None else bias.double().abs())
    allowed = 2e-5 * magnitude + (2.0 ** -7 * expected.abs() if out.dtype == torch.bfloat16 else 0)
    assert out.dtype == x.dtype and out.shape == expected.shape
    assert ((out.double() - expected).abs() <= allowed).all(), (out.double() - expected).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_row_count_and_odd_shapes_match_the_reference(target, dtype):
    """Blocks of two, four and eight vectors of outputs (4 x 16 is oneDNN's on AVX-512), k
    padded or not and over several chunks, rows 1-16, past a tile and past a group
    of tiles, odd sizes, bias or none."""
    generator = torch.Generator().manual_seed(0)
    width = 2 * vector_width()
    for out_features, in_features in ((1, 1), (37, 19), (64, 64), (100, 257)):
        weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
        bias = torch.randn(out_features, generator=generator).to(dtype)
        for packed in (pack_small_linear(weight), pack_small_linear(weight, 2 * width, in_features + 7 + (
                in_features + 7) % 2), pack_small_linear(weight, 4 * width)):
            for rows in (*range(1, 17), 33, 97):
                # x's rows are a slice of wider rows holding NaN past in_features: a read past K shows.
                wide = torch.full((rows, in_features + 3), float("nan"), dtype=dtype)
                wide[:, :in_features] = torch.randn(rows, in_features, generator=generator).to(dtype)
                x = wide[:, :in_features]
                for b in (None, bias):
                    _check(small_linear(x, packed, b), x, weight, b)


def test_leading_dimensions_are_kept_and_inputs_matter(target):
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(48, 40, generator=generator)
    packed = pack_small_linear(weight)
    x = torch.randn(2, 3, 40, generator=generator)
    out = small_linear(x, packed, None)
    assert out.shape == (2, 3, 48)
    _check(out.view(6, 48), x.view(6, 40), weight, None)
    assert not torch.equal(out[0, 0], out[0, 1])  # each row its own product


def test_packed_layout_holds_the_weight_in_blocks_of_outputs():
    """float32 [NB, Kp, BN], bfloat16 [NB, Kp / 2, BN, 2], zero past the weight."""
    weight = torch.arange(5 * 3, dtype=torch.float32).view(5, 3) + 1
    packed = pack_small_linear(weight)
    width = packed.block
    blocks = packed.storage.view(1, 3, width)
    assert (packed.block_stride, packed.out_features, packed.in_features) == (3 * width, 5, 3)
    assert torch.equal(blocks[0, :, :5], weight.T) and not blocks[0, :, 5:].any()
    bf16 = pack_small_linear(weight.bfloat16()).storage.view(1, 2, width, 2)
    assert torch.equal(bf16[0, :, :5, :].permute(1, 0, 2).reshape(5, 4)[:, :3], weight.bfloat16())
    assert not bf16[0, 1, :, 1].any()  # the odd K's pair partner


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_onednn_packed_weights_are_read_in_place_only_where_their_bytes_are_the_layout(dtype):
    """Where oneDNN's packed bytes equal the kernel's packing (AVX-512 hosts), the view
    reads them and gives the reference; a packed copy of another weight is refused."""
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN has no bfloat16 here")
    generator = torch.Generator().manual_seed(4)
    viewed = 0
    for out_features, in_features in ((37, 19), (256, 96), (100, 257)):
        weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
        view = onednn_view(packed, weight)
        assert onednn_view(packed, weight + 1) is None
        if view is None:
            continue
        viewed += 1
        x = torch.randn(5, in_features, generator=generator).to(dtype)
        _check(small_linear(x, view, None), x, weight, None)
    if platform.machine() == "x86_64" and " avx512f" in Path("/proc/cpuinfo").read_text():
        assert viewed == 3  # oneDNN packs in blocks of 64 outputs there


@pytest.mark.parametrize("tiles", [True, False], ids=["amx", "no_amx"])
def test_bfloat16_through_amx_tiles_and_without(tiles):
    """Where the host grants AMX tiles, bfloat16 calls of 2 rows and more with K whole
    runs of 32 multiply through them (16-row tiles, the rows past the last whole 16
    padded); with the tiles disallowed the vector kernel runs the same calls, as on a
    host without AMX. Blocks of 32, 64 and 128 outputs, outputs past N, bias or none."""
    if tiles and not amx_tiles_ready():
        pytest.skip("no AMX tiles for the small-batch kernel on this host")
    allow_amx_tiles(tiles)
    try:
        assert amx_tiles_ready() == tiles
        generator = torch.Generator().manual_seed(5)
        width = 2 * vector_width()
        for out_features, in_features in ((64, 64), (100, 96), (130, 512)):
            weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
            bias = torch.randn(out_features, generator=generator).bfloat16()
            for block in {width, 64, 128}:
                packed = pack_small_linear(weight, block)
                for rows in (1, 2, 3, 15, 16, 17, 33, 64, 97):
                    wide = torch.full((rows, in_features + 3), float("nan"), dtype=torch.bfloat16)
                    wide[:, :in_features] = torch.randn(rows, in_features, generator=generator).bfloat16()
                    x = wide[:, :in_features]
                    for b in (None, bias):
                        _check(small_linear(x, packed, b), x, weight, b)
    finally:
        allow_amx_tiles(True)

"""The quantized bfloat16 kernels (kernels/cpu_quant_bf16.c) of a git revision against
the working tree's, side by side in one process: what a change to their tiles gains.

    python bench/bench_quant_ab.py [--base HEAD] [--rows 1,4,8] [--formats int4,int4 zeros,int8,fp8]
                                   [--hidden 1024] [--intermediate 4096] [--layers 12] [--repeat 5]

Both sides are built with the engine's flags for this host (the base from ``git
archive`` of engine/kernels at ``--base``, headers included) and called on the same
weights: bench_quant's linear shapes (o_proj, gate and up packed together,
down_proj) in ``--layers`` copies each, read in turn as a decode step reads them (from
memory), x of each ``--rows`` in bfloat16, on one thread timed by its CPU time,
interleaved round by round, best of ``--repeat``. Each row count takes the kernel the
launcher takes for it (kernels/cpu_quant.py): the decode tiles up to DECODE_MAX_ROWS,
the register-blocked kernel (cpu_quant_blocked.h) above. Formats: "int4" (groups of 128,
symmetric: no zero points), "int4 zeros" (groups of 128, integer zero points), "int8"
and "fp8" (per-channel scales). Prints milliseconds per call of each side, base /
tree, and whether the outputs are the same bits (else their largest difference).
Needs AVX512_BF16 (the kernels' bfloat16 tiles) and git.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from shardline.engine.kernels import cpu_quant, native

ROOT = Path(__file__).resolve().parents[1]
SOURCE = "cpu_quant_bf16.c"
FORMATS = ("int4", "int4 zeros", "int8", "fp8")


def build(kernels_dir: Path, out_dir: Path, name: str) -> ctypes.CDLL:
    """``kernels_dir``'s cpu_quant_bf16.c built as the engine builds it, its decode
    functions declared."""
    compiler = native._compiler()  # noqa: SLF001 - the engine's own build, outside its cache
    if compiler is None:
        raise SystemExit("no C compiler")
    library_path = native._compile(kernels_dir / SOURCE, compiler, native.kernel_target(),  # noqa: SLF001
                                   out_dir / f"{name}.so")
    library = ctypes.CDLL(str(library_path))
    cpu_quant._declare_bf16(library)  # noqa: SLF001
    if not library.quant_bf16_dot():
        raise SystemExit("this host's build has no AVX512_BF16 decode tiles")
    return library


def base_kernels(revision: str, out_dir: Path) -> Path:
    """engine/kernels at ``revision``, extracted under ``out_dir``."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision, "engine/kernels"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out_dir)], input=archive, check=True)
    return out_dir / "engine" / "kernels"


def weights(kind: str, rows: int, cols: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """One random weight of ``kind`` in the kernels' layout (a W4 weight's zero points
    under "zeros" where it has them)."""
    if kind.startswith("int4"):
        groups = (rows, cols // 128)
        layer = {"packed": torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=generator),
                 "scales": torch.rand(groups, generator=generator) * 1e-2}
        if kind == "int4 zeros":
            layer["zeros"] = torch.randint(0, 16, groups, generator=generator).float()
        return layer
    if kind == "int8":
        codes = torch.randint(-128, 128, (rows, cols), dtype=torch.int8, generator=generator)
    else:
        codes = (torch.randn(rows, cols, generator=generator) * 100).to(torch.float8_e4m3fn)
    return {"codes": codes.view(torch.uint8).contiguous(), "scale": torch.rand(rows, 1, generator=generator) * 1e-3}


def call(library: ctypes.CDLL, kind: str, x: torch.Tensor, layer: dict[str, torch.Tensor], out: torch.Tensor,
         sums: torch.Tensor) -> None:
    rows, cols = x.shape
    n = out.shape[1]
    decode = rows <= cpu_quant.DECODE_MAX_ROWS
    if kind.startswith("int4"):
        zeros = layer.get("zeros")
        w4 = library.w4_linear_bf16 if decode else library.w4_blocked_bf16
        w4(x.data_ptr(), cols, rows, sums.data_ptr(), layer["packed"].data_ptr(), layer["scales"].data_ptr(),
           None if zeros is None else zeros.data_ptr(), 128, None, out.data_ptr(), n, n, cols, 1)
        return
    codes = int(kind == "fp8") | (cpu_quant.W8_NO_DIGITS if decode else 0)  # bfloat16 tiles at every row count
    w8 = library.w8_linear_bf16 if decode else library.w8_blocked_bf16
    w8(x.data_ptr(), cols, rows, layer["codes"].data_ptr(), codes, layer["scale"].data_ptr(), 1, 1, cols, None,
       out.data_ptr(), n, n, cols, 1)


def ms_per_call(library: ctypes.CDLL, kind: str, x: torch.Tensor, layers: list[dict[str, torch.Tensor]],
                out: torch.Tensor, sums: torch.Tensor) -> float:
    """Milliseconds per call over one call on each copy of the weight in turn."""
    start = time.process_time()
    for layer in layers:
        call(library, kind, x, layer, out, sums)
    return (time.process_time() - start) / len(layers) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description="cpu_quant_bf16.c at a revision against the working tree")
    parser.add_argument("--base", default="HEAD")
    parser.add_argument("--rows", default="1,4,8")
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated, of {', '.join(FORMATS)}")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    kinds = args.formats.split(",")
    if unknown := [kind for kind in kinds if kind not in FORMATS]:
        raise SystemExit(f"unknown format(s) {unknown}: choose from {list(FORMATS)}")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="shardline-quant-ab-") as scratch:
        scratch_dir = Path(scratch)
        sides = {"base": build(base_kernels(args.base, scratch_dir), scratch_dir, "base"),
                 "tree": build(ROOT / "engine" / "kernels", scratch_dir, "tree")}
        generator = torch.Generator().manual_seed(0)
        shapes = {"o_proj": (args.hidden, args.hidden), "gate_up": (2 * args.intermediate, args.hidden),
                  "down_proj": (args.hidden, args.intermediate)}
        print(f"{SOURCE} at {args.base} (base) against the working tree (tree); one thread, CPU time, "
              f"{args.layers} copies of each weight, best of {args.repeat}")
        for shape, (n, k) in shapes.items():
            for kind in kinds:
                layers = [weights(kind, n, k, generator) for _ in range(args.layers)]
                for rows in (int(r) for r in args.rows.split(",")):
                    x = torch.randn(rows, k, generator=generator).bfloat16()
                    sums = torch.empty(rows, k // 128)
                    outs = {side: torch.empty(rows, n, dtype=torch.bfloat16) for side in sides}
                    for side, library in sides.items():  # each side's first calls untimed
                        ms_per_call(library, kind, x, layers, outs[side], sums)
                    best = dict.fromkeys(sides, float("inf"))
                    for _ in range(args.repeat):  # interleaved: a slow phase of the host hits both
                        for side, library in sides.items():
                            best[side] = min(best[side], ms_per_call(library, kind, x, layers, outs[side], sums))
                    same = torch.equal(outs["base"], outs["tree"])
                    difference = "same bits" if same else (
                        f"largest difference {(outs['base'].float() - outs['tree'].float()).abs().max().item():.2e}")
                    print(f"{shape:9s} [{n}, {k}] {kind:10s} M={rows:<3d} base {best['base']:.4f} ms, "
                          f"tree {best['tree']:.4f} ms ({best['base'] / best['tree']:.2f}x), {difference}",
                          flush=True)


if __name__ == "__main__":
    main()

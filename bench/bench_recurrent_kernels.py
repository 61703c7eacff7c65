"""GPU micro-benchmark of the hybrid models' Triton scans against their torch paths.

    python bench/bench_recurrent_kernels.py [--smoke]

For the chunked gated delta rule (gated delta-net), Kimi delta attention, the SSD scan
(Mamba-2; lightning attention's shape too) and the decode steps, at model sizes
(Qwen3-Next's and Kimi Linear's 32 heads of 128 x 128, a Mamba-2 of 64 heads of
64 x 128 in 8 groups, MiniMax's 64 heads of 128), over a fresh prefill, continued
chunks and a decode step: checks each launcher against the torch path run in float64,
then prints time per call of the launcher and of the torch path, float32, side by
side (the torch path is reached by hiding Triton from the dispatch). ``--smoke`` runs
tiny shapes through Triton's interpreter on CPU: the checks only, no timing.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys

import torch


@contextlib.contextmanager
def torch_path():
    """The dispatch's Triton test answers False inside: the torch path runs."""
    from shardline.engine.recurrent import delta_rule, kda, ssd

    modules = (delta_rule, kda, ssd)
    saved = [module.triton_available for module in modules]
    for module in modules:
        module.triton_available = lambda: False
    try:
        yield
    finally:
        for module, original in zip(modules, saved):
            module.triton_available = original


def delta_rule_inputs(lengths, heads, key_dim, value_dim, per_key, device, gen):
    from shardline.engine.kernels.recurrent_reference import l2_normalize

    total = sum(lengths)
    q = l2_normalize(torch.randn(total, heads, key_dim, generator=gen)) * key_dim ** -0.5
    k = l2_normalize(torch.randn(total, heads, key_dim, generator=gen))
    v = torch.randn(total, heads, value_dim, generator=gen)
    g = -torch.rand(total, heads, *((key_dim,) if per_key else ()), generator=gen) * 0.5
    beta = torch.rand(total, heads, generator=gen)
    state = torch.randn(len(lengths), heads, key_dim, value_dim, generator=gen) * 0.1
    cu = torch.tensor([0, *lengths]).cumsum(0)
    return [t.to(device) for t in (q, k, v, g, beta, cu, state)]


def ssd_inputs(lengths, heads, head_dim, groups, state_size, lightning, device, gen):
    total = sum(lengths)
    x = torch.randn(total, heads, head_dim, generator=gen)
    dt = torch.ones(total, heads) if lightning else torch.rand(total, heads, generator=gen) * 0.1
    A = -torch.rand(heads, generator=gen)
    B, C = (torch.randn(total, groups, state_size, generator=gen) * state_size ** -0.5 for _ in range(2))
    D = None if lightning else torch.randn(heads, generator=gen)
    state = torch.randn(len(lengths), heads, head_dim, state_size, generator=gen) * 0.1
    cu = torch.tensor([0, *lengths]).cumsum(0)
    return [t.to(device) if t is not None else None for t in (x, dt, A, B, C, D, cu, state)]


def cases(smoke: bool):
    """(name, run(path) -> (outputs, final states)) pairs, path "triton" (the launcher),
    "torch" (the torch path, float32) or "float64" (the torch path in float64); each
    run starts from a fresh copy of its states."""
    from shardline.engine.kernels.delta_rule import chunk_gated_delta_rule_triton
    from shardline.engine.kernels.delta_rule_step import delta_rule_step_triton
    from shardline.engine.kernels.kda import chunk_kda_triton
    from shardline.engine.kernels.ssd_scan import ssd_chunk_scan_triton
    from shardline.engine.recurrent.delta_rule import chunk_gated_delta_rule_varlen, gated_delta_rule_step
    from shardline.engine.recurrent.kda import chunk_kda_varlen, kda_decode_step
    from shardline.engine.recurrent.ssd import ssd_chunk_scan_varlen

    device = "cpu" if smoke else "cuda"
    gen = torch.Generator().manual_seed(0)
    if smoke:
        workloads = {"prefill 2 fresh": [20, 5], "decode 3": [1, 1, 1]}
        delta_shape, ssd_shape, lightning_shape = (2, 16, 16), (4, 16, 2, 16), (2, 16, 2, 16)
    else:
        workloads = {"prefill 4 x 2048": [2048] * 4, "chunks 32 x 128": [128] * 32, "decode 256": [1] * 256}
        delta_shape, ssd_shape, lightning_shape = (32, 128, 128), (64, 64, 8, 128), (64, 128, 64, 128)
    for workload, lengths in workloads.items():
        decode = max(lengths) == 1
        for label, per_key in (("gated delta rule", False), ("kimi delta attention", True)):
            q, k, v, g, beta, cu, state = delta_rule_inputs(lengths, *delta_shape, per_key, device, gen)

            def run(path, q=q, k=k, v=v, g=g, beta=beta, cu=cu, state=state, per_key=per_key, decode=decode):
                wide = path == "float64"
                args = [t.double() if wide else t for t in (q, k, v, g, beta)]
                initial = state.double() if wide else state.clone()
                if decode:
                    if path == "triton":
                        return delta_rule_step_triton(*args, initial), initial
                    step = kda_decode_step if per_key else (lambda s, *a: gated_delta_rule_step(*a, s)[0])
                    return step(initial, *args), initial
                if path == "triton":
                    return (chunk_kda_triton if per_key else chunk_gated_delta_rule_triton)(*args, cu, initial)
                return (chunk_kda_varlen if per_key else chunk_gated_delta_rule_varlen)(*args, cu, initial)
            yield f"{label}: {workload}", run
        if decode:
            continue  # Mamba-2 and lightning attention decode through the selective-scan kernel
        for label, shape, lightning in (("ssd scan", ssd_shape, False), ("lightning", lightning_shape, True)):
            x, dt, A, B, C, D, cu, state = ssd_inputs(lengths, *shape, lightning, device, gen)

            def run(path, x=x, dt=dt, A=A, B=B, C=C, D=D, cu=cu, state=state):
                if path == "triton":
                    return ssd_chunk_scan_triton(x, dt, A, B, C, D, cu, state)
                compute = torch.float64 if path == "float64" else torch.float32
                args = [t.to(compute) if t is not None else None for t in (x, dt, A, B, C, D)]
                return ssd_chunk_scan_varlen(*args, 64, cu, state.to(compute), compute_dtype=compute)
            yield f"{label}: {workload}", run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, interpreted on CPU, checks only")
    args = parser.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        if "triton" in sys.modules:
            raise SystemExit("--smoke must set TRITON_INTERPRET before triton is imported")
    from shardline.engine.kernels._triton import triton_available

    if not triton_available() or not (args.smoke or torch.cuda.is_available()):
        raise SystemExit("bench_recurrent_kernels needs triton and a CUDA GPU (or --smoke)")
    if not args.smoke:
        import triton.testing
    print(f"{'case':<42} {'triton':>10} {'torch':>10}  max|diff| vs float64")
    for name, run in cases(args.smoke):
        out, final = run("triton")
        with torch_path():
            expected, expected_final = run("float64")
        diff = max((out.double() - expected).abs().max().item(), (final.double() - expected_final).abs().max().item())
        if args.smoke:
            print(f"{name:<42} {'-':>10} {'-':>10}  {diff:.1e}")
            continue
        triton_ms = triton.testing.do_bench(functools.partial(run, "triton"))
        with torch_path():
            torch_ms = triton.testing.do_bench(functools.partial(run, "torch"))
        print(f"{name:<42} {triton_ms * 1e3:8.0f}us {torch_ms * 1e3:8.0f}us  {diff:.1e}")


if __name__ == "__main__":
    main()

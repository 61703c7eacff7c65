"""The CPU paths chosen at load: only what the host can run, raced where two correct
paths exist, every fallback giving transformers' greedy tokens."""

import dataclasses
import json
import os
import platform
import shutil
import subprocess
import sys

import pytest
import torch
import transformers

from shardline.engine.cpu import capability as cpu_capability
from shardline.engine.cpu import paths as cpu_paths
from shardline.engine.cpu.capability import HostCpu, ModelShape, host_cpu
from shardline.engine.cpu.layers import FusedDecoderLayer
from shardline.engine.cpu.linear import FusedGatedMLP, PackedLinear
from shardline.engine.cpu.norms import FusedRMSNorm
from shardline.engine.cpu.paths import PATH_NAMES, choose_cpu_paths, path_settings
from shardline.engine.kernels import native
from shardline.engine.kernels.cpu_quant_int8 import cpu_w8a8_available

from .paths_taken import taken_unless_forced_off

SHAPE = ModelShape(hidden_size=64, widest_linear=192, num_heads=4, num_kv_heads=2, head_dim=16)
PROMPTS = [[5, 6, 7], list(range(3, 60)), [(7 * i) % 200 + 3 for i in range(90)]]


def greedy(llm, max_tokens: int = 8) -> list[list[int]]:
    from shardline import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def hf_float32_tokens(tiny_llama_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    tokens = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                                 do_sample=False, pad_token_id=2)
            tokens.append(out[0, len(prompt):].tolist())
    return tokens


def test_host_is_described_by_what_the_libraries_report():
    host = host_cpu()
    assert host.torch_isa == torch.backends.cpu.get_cpu_capability()
    assert host.onednn == torch.backends.mkldnn.is_available()
    assert host.onednn_bfloat16 == (host.onednn and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert host.machine in host.describe() and host.torch_isa in host.describe()


@pytest.mark.parametrize("path", PATH_NAMES + ("all",))
def test_each_fallback_gives_transformers_tokens(tiny_llama_dir, hf_float32_tokens, monkeypatch, path):
    """With one path off (or all of them), the engine loads in float32 and bfloat16,
    says why, and float32 gives transformers' own greedy tokens."""
    from shardline import LLM

    monkeypatch.setenv("SHARDLINE_CPU_PATHS", f"{path}=off")
    llm = LLM(tiny_llama_dir, dtype="float32")
    paths = llm.llm_engine.cpu_paths
    off = PATH_NAMES if path == "all" else (path,)
    assert not any(getattr(paths, name) for name in off)
    assert all(why == "turned off by SHARDLINE_CPU_PATHS" for name, why in paths.reasons if name in off)
    model = llm.llm_engine.model
    if "packed_linears" in off:
        assert not any(isinstance(m, (PackedLinear, FusedGatedMLP)) for m in model.modules())
    if "fused_kernels" in off:
        assert not any(isinstance(m, (FusedDecoderLayer, FusedRMSNorm)) for m in model.modules())
    assert greedy(llm) == hf_float32_tokens
    llm.close()
    llm = LLM(tiny_llama_dir, dtype="bfloat16")
    assert all(len(tokens) == 8 for tokens in greedy(llm))
    llm.close()


def test_unknown_path_setting_names_the_item(monkeypatch):
    monkeypatch.setenv("SHARDLINE_CPU_PATHS", "prefill_kernel=off, decode=on")
    with pytest.raises(ValueError, match="'decode=on'"):
        path_settings()
    monkeypatch.setenv("SHARDLINE_CPU_PATHS", "all=off,decode_kernel=on")
    assert path_settings() == {"packed_linears": False, "fused_kernels": False, "decode_kernel": True,
                               "prefill_kernel": False, "recurrent_kernel": False, "quant_kernels": False,
                               "quant_int8_kernel": False, "quant_digits_kernel": False,
                               "small_linear_kernel": False, "decode_programs": False}


@pytest.mark.skipif(not torch.backends.mkldnn.is_available() or shutil.which("cc") is None,
                    reason="needs oneDNN and a C compiler to race anything")
def test_races_are_measured_once_cached_and_decide(tmp_path, monkeypatch):
    """Without settings, packed linears, the prefill kernel and the quantized kernels
    race their torch alternatives; the result is cached per host and shape, and a
    cached ratio below the margin keeps the torch path."""
    monkeypatch.delenv("SHARDLINE_CPU_PATHS")
    monkeypatch.setenv("SHARDLINE_CACHE_DIR", str(tmp_path))
    paths = choose_cpu_paths(torch.float32, SHAPE, rows_hint=64)
    reasons = dict(paths.reasons)
    assert all(reasons[name].startswith("measured ") for name in ("packed_linears", "prefill_kernel", "quant_kernels"))
    cache = tmp_path / "cpu_paths.json"
    measured = json.loads(cache.read_text())
    raced = 3 + int(cpu_w8a8_available(torch.float32))  # the W8A8 int8 kernel where it builds
    assert len(measured) == raced and all(isinstance(ratio, float) and ratio > 0 for ratio in measured.values())
    # Ratios the other side of the margin, as a host where torch wins would measure.
    cache.write_text(json.dumps({key: 0.5 for key in measured}))
    slower = choose_cpu_paths(torch.float32, SHAPE, rows_hint=64)
    assert not slower.packed_linears and not slower.prefill_kernel and not slower.quant_kernels
    assert dict(slower.reasons)["packed_linears"] == "measured 0.50x torch's matmul"
    assert dict(slower.reasons)["prefill_kernel"] == "measured 0.50x SDPA"
    assert dict(slower.reasons)["quant_kernels"] == "measured 0.50x the torch tile path"
    assert not slower.quant_int8_kernel
    assert slower.decode_kernel == paths.decode_kernel  # not raced
    cache.write_text(json.dumps({key: 2.0 for key in measured}))
    faster = choose_cpu_paths(torch.float32, SHAPE, rows_hint=64)
    assert faster.packed_linears and faster.prefill_kernel and faster.quant_kernels
    assert faster.quant_int8_kernel == cpu_w8a8_available(torch.float32)
    # Other C kernel sources or build flags: the cached ratios are not theirs; both race again.
    monkeypatch.setattr(native, "kernel_sources_digest", lambda: "other kernels")
    cpu_paths._host_key.cache_clear()
    try:
        choose_cpu_paths(torch.float32, SHAPE, rows_hint=64)
    finally:
        cpu_paths._host_key.cache_clear()
    assert len(json.loads(cache.read_text())) == 2 * raced


def test_float64_takes_no_packed_or_fused_path(monkeypatch):
    monkeypatch.delenv("SHARDLINE_CPU_PATHS", raising=False)  # the capability's reason, not an override's
    paths = choose_cpu_paths(torch.float64, SHAPE, rows_hint=64)
    assert not paths.packed_linears and not paths.fused_kernels and not paths.prefill_kernel
    assert dict(paths.reasons)["packed_linears"] == "oneDNN has no float64 matmul"


def test_the_choice_is_logged_once_at_load(tiny_llama_dir, caplog):
    from shardline import LLM

    with caplog.at_level("INFO", logger=cpu_paths.__name__):
        LLM(tiny_llama_dir, dtype="float32").close()
    lines = [r.getMessage() for r in caplog.records
             if r.name == cpu_paths.__name__ and r.getMessage().startswith("CPU paths for ")]
    assert len(lines) == 1 and lines[0].startswith("CPU paths for float32 on ")
    assert all(name in lines[0] for name in PATH_NAMES)


AVX2_HOST = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
             "SHARDLINE_CPU_TARGET": "x86-64-v3"}


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("cc") is None
                    or native.compiler_vector_isa(native._compiler(), "x86-64-v3") != "avx2",
                    reason="an AVX2 configuration needs an x86-64 host and a compiler that targets AVX2")
@pytest.mark.skipif(platform.machine() == "x86_64" and torch.backends.cpu.get_cpu_capability() == "AVX2"
                    and native.compiler_vector_isa(native._compiler() or "cc", "native") == "avx2",
                    reason="this host is an AVX2 one: the whole suite runs the configuration this test emulates")
@taken_unless_forced_off("packed_linears", "prefill_kernel")
def test_an_avx2_host_loads_bfloat16_and_gives_the_same_tokens(tiny_llama_dir, hf_float32_tokens):
    """oneDNN limited to AVX2, torch's kernels at AVX2 and the C kernels built for
    x86-64-v3, as on an AVX2 host: bfloat16 loads (its linears through torch's
    matmul, since oneDNN has no bfloat16 there) and float32 gives transformers'
    tokens. oneDNN reads its limit once per process, hence a child process."""
    script = (
        "import json, sys\n"
        "from shardline import LLM, SamplingParams\n"
        "prompts = json.loads(sys.argv[2])\n"
        "params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)\n"
        "result = {}\n"
        "for dtype in ('float32', 'bfloat16'):\n"
        "    llm = LLM(sys.argv[1], dtype=dtype)\n"
        "    outputs = llm.generate([{'prompt_token_ids': p} for p in prompts], params, use_tqdm=False)\n"
        "    paths = llm.llm_engine.cpu_paths\n"
        "    result[dtype] = {'tokens': [list(o.outputs[0].token_ids) for o in outputs],\n"
        "                     'reasons': dict(paths.reasons), 'prefill': paths.prefill_kernel}\n"
        "print(json.dumps(result))\n"
    )
    env = {**os.environ, **AVX2_HOST}
    run = subprocess.run([sys.executable, "-c", script, tiny_llama_dir, json.dumps(PROMPTS)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["float32"]["tokens"] == hf_float32_tokens
    assert result["float32"]["prefill"]  # the AVX2 build of the prefill kernel runs
    assert result["bfloat16"]["reasons"]["packed_linears"].endswith("oneDNN has no bfloat16 on this CPU")
    assert all(len(tokens) == 8 for tokens in result["bfloat16"]["tokens"])


def host_without_onednn_bfloat16() -> HostCpu:
    """This host as one whose oneDNN has no bfloat16 (AVX2 without AVX-NE-CONVERT)."""
    return dataclasses.replace(host_cpu(), onednn_bfloat16=False)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
@taken_unless_forced_off("packed_linears")
def test_bfloat16_without_onednn_bfloat16_packs_float32_copies_where_they_fit(monkeypatch):
    monkeypatch.setattr(cpu_paths, "host_cpu", host_without_onednn_bfloat16)
    shape = dataclasses.replace(SHAPE, linear_weights=1 << 20)
    paths = choose_cpu_paths(torch.bfloat16, shape, rows_hint=64)
    assert paths.packed_linears and paths.packed_dtype == torch.float32
    assert "as float32 copies (0.00 GiB)" in dict(paths.reasons)["packed_linears"]
    assert choose_cpu_paths(torch.float32, shape, rows_hint=64).packed_dtype is None
    # Copies that would not fit twice in the memory free are not made.
    monkeypatch.setattr(cpu_capability, "available_memory", lambda: 6 << 30)
    huge = dataclasses.replace(SHAPE, linear_weights=1 << 30)  # 4 GiB of float32 copies
    paths = choose_cpu_paths(torch.bfloat16, huge, rows_hint=64)
    assert not paths.packed_linears and paths.packed_dtype is None
    assert dict(paths.reasons)["packed_linears"] == (
        "oneDNN has no bfloat16 on this CPU and float32 copies of the linears (4.0 GiB) do not fit 2x in the "
        "6.0 GiB free")


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
def test_bfloat16_engine_on_float32_copies_gives_torch_bfloat16_tokens(tiny_llama_dir, monkeypatch):
    """A bfloat16 engine whose linears run on float32 copies (as where oneDNN has no
    bfloat16) keeps the bfloat16 weights as its parameters, fuses its layers on the
    copies, and gives the tokens of torch's own bfloat16 matmul."""
    from shardline import LLM

    monkeypatch.setenv("SHARDLINE_CPU_PATHS", "packed_linears=off")
    reference = LLM(tiny_llama_dir, dtype="bfloat16")
    expected = greedy(reference)
    reference.close()
    monkeypatch.setenv("SHARDLINE_CPU_PATHS", "all=on")
    monkeypatch.setattr(cpu_paths, "host_cpu", host_without_onednn_bfloat16)
    llm = LLM(tiny_llama_dir, dtype="bfloat16")
    model = llm.llm_engine.model
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert llm.llm_engine.cpu_paths.packed_dtype == torch.float32 and packed
    assert all(m.packed_weight.dtype == torch.float32 and m.weight.dtype == torch.bfloat16 for m in packed)
    layers = [m for m in model.modules() if isinstance(m, FusedDecoderLayer)]
    if layers:
        assert all(layer.packed_qkv is not None and layer.packed_qkv.dtype == torch.float32 for layer in layers)
    assert greedy(llm) == expected
    llm.close()


@pytest.mark.skipif(not host_cpu().onednn_bfloat16, reason="needs oneDNN's bfloat16")
@taken_unless_forced_off("packed_linears")
def test_bfloat16_packs_float32_copies_where_onednns_bfloat16_measures_slower(tmp_path, monkeypatch):
    """On a CPU without bfloat16 units oneDNN emulates bfloat16 and float32 copies run
    faster: the engine races the two packings (here the race's result is set as such a
    CPU measures it) and packs copies where they fit, bfloat16 elsewhere."""
    monkeypatch.delenv("SHARDLINE_CPU_PATHS", raising=False)
    monkeypatch.setenv("SHARDLINE_CACHE_DIR", str(tmp_path))
    real_speedup = cpu_paths.linear_speedup
    packing_ratio = {"value": 0.37}  # as oneDNN limited to AVX512_CORE measures it on this host

    def speedup(dtype, packed_dtype, shape, rows_hint, alternative=None):
        if alternative is not None:  # bfloat16 packing against float32 copies
            return packing_ratio["value"]
        if packed_dtype != dtype:  # float32 copies against torch's (emulated) bfloat16 matmul
            return 1 / packing_ratio["value"]
        return real_speedup(dtype, packed_dtype, shape, rows_hint)

    monkeypatch.setattr(cpu_paths, "linear_speedup", speedup)
    shape = dataclasses.replace(SHAPE, linear_weights=1 << 20)
    paths = choose_cpu_paths(torch.bfloat16, shape, rows_hint=64)
    assert paths.packed_linears and paths.packed_dtype == torch.float32
    assert "float32 copies (0.00 GiB): oneDNN's bfloat16 measured 0.37x them" in dict(paths.reasons)["packed_linears"]
    # Where bfloat16 packing measures as fast, it stays (a fresh cache: measured again).
    monkeypatch.setenv("SHARDLINE_CACHE_DIR", str(tmp_path / "again"))
    packing_ratio["value"] = 1.5
    assert choose_cpu_paths(torch.bfloat16, shape, rows_hint=64).packed_dtype is None
    # Copies that would not fit twice in the memory free are not raced.
    packing_ratio["value"] = 0.37
    monkeypatch.setattr(cpu_capability, "available_memory", lambda: 6 << 30)
    huge = dataclasses.replace(SHAPE, linear_weights=1 << 30)
    assert choose_cpu_paths(torch.bfloat16, huge, rows_hint=64).packed_dtype is None


@pytest.mark.slow
@pytest.mark.skipif(not host_cpu().onednn_bfloat16 or "avx512f" not in open("/proc/cpuinfo").read(),
                    reason="needs an AVX-512 host whose oneDNN has bfloat16")
@taken_unless_forced_off("packed_linears")
def test_emulated_bfloat16_runs_on_float32_copies(tiny_llama_dir):
    """oneDNN limited to AVX512_CORE (as on an AVX-512 CPU without AVX512_BF16 or AMX)
    emulates bfloat16: the measured race packs float32 copies. A child process, since
    oneDNN reads its limit once."""
    script = ("import sys\nfrom shardline import LLM\n"
              "print(dict(LLM(sys.argv[1], dtype='bfloat16').llm_engine.cpu_paths.reasons)['packed_linears'])\n")
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}
    run = subprocess.run([sys.executable, "-c", script, tiny_llama_dir], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "as float32 copies" in run.stdout.strip().splitlines()[-1]

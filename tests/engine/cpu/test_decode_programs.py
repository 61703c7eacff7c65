"""Decode steps replayed from recorded kernel calls (engine/cpu/decode_programs.py,
engine/kernels/programs.py)."""

import shutil
import threading

import pytest
import torch
import transformers

from shardline import LLM, SamplingParams
from shardline.engine.cpu import layers as cpu_layers
from shardline.engine.cpu.decode_programs import DecodePrograms
from shardline.engine.cpu.fused_decoder import FusedDecoder
from shardline.engine.kernels import programs
from shardline.engine.kernels.cpu_fused import add_, fused_kernels_available, kv_write, rms_norm
from shardline.engine.kernels.programs import CallProgram, CallRecorder, executor_source_for, signature_codes
from shardline.engine.model.tiny import build_tiny_model

from .paths_taken import taken_unless_forced_off

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler: the engine keeps its torch ops")

@pytest.fixture(autouse=True)
def fused_kernels_loaded():
    """The fused kernels' library loaded before a test records: a recorder watches the
    functions declared when it starts (as an engine's warm steps load them)."""
    assert fused_kernels_available(torch.float32)


PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [40, 41, 42, 43, 44, 45, 46], [70, 71]]
MAX_TOKENS = [20, 14, 10, 6]  # requests finish apart: 4 or more steps each of 4, 3, 2 and 1 rows


def generate(llm: LLM) -> list[list[int]]:
    params = [SamplingParams(max_tokens=count, temperature=0.0, ignore_eos=True) for count in MAX_TOKENS]
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in PROMPTS], params, use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


def decoder_of(llm: LLM) -> FusedDecoder:
    decoder = llm.llm_engine.model.model
    assert isinstance(decoder, FusedDecoder)
    return decoder


def eager_tokens(model_dir: str, monkeypatch: pytest.MonkeyPatch, **options: object) -> list[list[int]]:
    with monkeypatch.context() as patch:
        patch.setenv("SHARDLINE_CPU_PATHS", "decode_programs=off")
        llm = LLM(model_dir, **options)
        assert decoder_of(llm).programs is None
        tokens = generate(llm)
        llm.close()
    return tokens


def run_recorded(model_dir: str) -> tuple[list[list[int]], DecodePrograms]:
    """generate's tokens on a fresh float32 engine, and its decoder's programs after."""
    llm = LLM(model_dir, dtype="float32")
    tokens = generate(llm)
    programs_ = decoder_of(llm).programs
    assert programs_ is not None
    llm.close()
    return tokens, programs_


@taken_unless_forced_off("fused_kernels", "decode_programs")
@pytest.mark.parametrize("arch, config, options", [
    ("llama", {}, dict(dtype="float32")),
    ("qwen3", {}, dict(dtype="bfloat16")),
    ("llama", {}, dict(dtype="bfloat16", quantization="int8")),
    ("qwen2", {}, dict(dtype="float32", quantization="fp8")),  # q/k/v biases
    ("mistral", dict(sliding_window=8), dict(dtype="float32")),  # contexts past the window
    # A full and a windowed layer: two cache groups, each with its own block tables.
    ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1,
                   layer_types=["full_attention", "sliding_attention"]), dict(dtype="float32")),
], ids=["llama-float32", "qwen3-bfloat16", "llama-bfloat16-int8", "qwen2-float32-fp8", "mistral-window-float32",
        "qwen2-window-groups-float32"])
def test_decode_steps_replay_and_give_the_eager_paths_tokens(tmp_path, monkeypatch, arch, config, options):
    model_dir = str(build_tiny_model(tmp_path, arch, **config))
    expected = eager_tokens(model_dir, monkeypatch, **options)
    llm = LLM(model_dir, **options)
    tokens = generate(llm)
    programs_ = decoder_of(llm).programs
    assert programs_ is not None
    replays, refused = programs_.replays, dict(programs_._refused)
    sizes = sorted(key[0] for key in programs_._programs)
    whole_steps = all(program.tables is not None for program in programs_._programs.values())
    groups = {len(program.tables.tables) for program in programs_._programs.values() if program.tables}
    cut_attention = dict(programs_._cut_attention)
    llm.close()
    assert tokens == expected
    assert not refused and not cut_attention
    assert sizes == [1, 2, 3, 4] and replays >= 7
    assert whole_steps  # each step's attention among the recorded calls: one C call a step
    assert groups == {2 if "sliding_window" in config else 1}  # a windowed group: tables of its own
    if options["dtype"] == "float32" and "quantization" not in options:  # and the model's own greedy tokens
        reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
        reference.generation_config.eos_token_id = None  # as ignore_eos: EOS may come and the run goes on
        for prompt, count, got in zip(PROMPTS, MAX_TOKENS, tokens, strict=True):
            want = reference.generate(torch.tensor([prompt]), max_new_tokens=count,
                                      do_sample=False)[0, len(prompt):].tolist()
            assert got == want


@taken_unless_forced_off("fused_kernels", "decode_programs")
def test_attention_cutting_the_record_gives_the_same_tokens(tmp_path, monkeypatch):
    """With the attention left out of the records (as where its calls cannot be
    recorded), each stretch between attention calls replays in one call."""
    model_dir = str(build_tiny_model(tmp_path, "llama"))
    expected = eager_tokens(model_dir, monkeypatch, dtype="float32")
    monkeypatch.setattr(DecodePrograms, "records_attention", False)
    tokens, programs_ = run_recorded(model_dir)
    programs = list(programs_._programs.values())
    assert tokens == expected
    assert len(programs) == 4 and programs_.replays >= 7 and not programs_._refused
    assert all(program.tables is None and len(program.stretches) == len(program.cuts) + 1 for program in programs)


@taken_unless_forced_off("fused_kernels", "decode_programs")
def test_recorded_attention_that_differs_from_the_usual_path_cuts_the_record(tmp_path, monkeypatch):
    """The recorded decode attention given another scale: its output differs from the
    layer's usual one at the record, and each size is recorded again around its
    attention calls."""
    from shardline.engine.cpu import decode_attention_record

    model_dir = str(build_tiny_model(tmp_path, "llama"))
    expected = eager_tokens(model_dir, monkeypatch, dtype="float32")
    attend = decode_attention_record.decode_attention
    monkeypatch.setattr(decode_attention_record, "decode_attention",
                        lambda *args, **kwargs: attend(*args[:8], args[8] * 1.5, *args[9:], **kwargs))
    tokens, programs_ = run_recorded(model_dir)
    assert tokens == expected
    assert sorted(key[0] for key in programs_._programs) == [1, 2, 3, 4] and programs_.replays >= 3
    assert all(program.tables is None for program in programs_._programs.values())
    assert set(programs_._cut_attention.values()) == {
        "attention layer 0's recorded calls did not give its usual output"}


@taken_unless_forced_off("fused_kernels", "decode_programs")
def test_block_tables_past_the_buffers_width_record_the_size_again_wider(tmp_path, monkeypatch):
    """Blocks of two tokens and buffers as narrow as the first recorded step's tables:
    as contexts grow, each size's program is dropped and recorded again with tables
    twice as wide, and the tokens stay the eager path's."""
    from shardline.engine.cpu import decode_attention_record

    model_dir = str(build_tiny_model(tmp_path, "llama"))
    expected = eager_tokens(model_dir, monkeypatch, dtype="float32", block_size=2)
    monkeypatch.setattr(decode_attention_record, "MIN_WIDTH", 1)
    llm = LLM(model_dir, dtype="float32", block_size=2)
    tokens = generate(llm)
    programs_ = decoder_of(llm).programs
    assert programs_ is not None
    widths = dict(programs_._widths)
    kept = {key[0]: program.tables.width for key, program in programs_._programs.items() if program.tables}
    llm.close()
    assert tokens == expected
    assert widths and sorted(kept) == [1, 2, 3, 4]
    assert all(kept[key[0]] >= width for key, width in widths.items() if key[0] in kept)


@taken_unless_forced_off("fused_kernels", "decode_programs")
def test_a_replayed_step_with_a_slot_outside_the_cache_raises_and_moved_caches_are_not_replayed(
        tmp_path, monkeypatch):
    """A replayed step's KV writes cannot raise inside the replay: they count the slots
    out of range, and the replay raises after, as the usual path's write would. A step
    over other caches than the record's is not replayed."""
    from dataclasses import replace

    model_dir = str(build_tiny_model(tmp_path, "llama"))
    llm = LLM(model_dir, dtype="float32")
    steps = []
    forward = DecodePrograms.forward

    def noting(self, hidden, position_embeddings, run_layers, ctx):
        steps.append((hidden.clone(), tuple(table.clone() for table in position_embeddings), run_layers, ctx))
        return forward(self, hidden, position_embeddings, run_layers, ctx)

    monkeypatch.setattr(DecodePrograms, "forward", noting)
    generate(llm)
    programs_ = decoder_of(llm).programs
    assert programs_ is not None
    hidden, position_embeddings, run_layers, ctx = steps[-1]  # a step of one row, replayed
    assert (1, torch.float32, torch.get_num_threads()) in programs_._programs
    k_cache = ctx.kv_caches[0][0]
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    outside = replace(ctx, slot_mapping=torch.tensor([num_slots]))
    with torch.inference_mode():  # as the engine's steps run
        with pytest.raises(IndexError, match=f"1 of 1 KV cache slots outside the cache's {num_slots}"):
            forward(programs_, hidden, position_embeddings, run_layers, outside)
        moved = replace(ctx, kv_caches=[(k.clone(), v.clone()) for k, v in ctx.kv_caches])
        assert forward(programs_, hidden, position_embeddings, run_layers, moved) is None
    dropped = (1, torch.float32, torch.get_num_threads()) not in programs_._programs
    llm.close()
    assert dropped


@taken_unless_forced_off("fused_kernels", "decode_programs")
def test_a_kernel_call_the_recorder_misses_leaves_the_size_unrecorded(tmp_path, monkeypatch):
    """The residual add's kernel hidden from the recorder: the check replays over NaN
    buffers, finds the output differs, and every size keeps running as usual."""
    model_dir = str(build_tiny_model(tmp_path, "llama"))
    expected = eager_tokens(model_dir, monkeypatch, dtype="float32")
    monkeypatch.setattr(programs, "DECLARED",
                        [function for function in programs.DECLARED if not function.__name__.startswith("add_rows")])
    tokens, programs_ = run_recorded(model_dir)
    assert tokens == expected
    assert programs_.replays == 0 and not programs_._programs
    assert set(programs_._refused.values()) == {"a replay did not give the step's own outputs"}


@taken_unless_forced_off("fused_kernels", "decode_programs")
def test_torch_operations_between_attention_calls_are_replayed_too(tmp_path, monkeypatch):
    """The residual add through torch's add_ (as a path without its kernel would run it):
    the operation is replayed in its place among the kernel calls."""
    model_dir = str(build_tiny_model(tmp_path, "llama"))
    expected = eager_tokens(model_dir, monkeypatch, dtype="float32")
    monkeypatch.setattr(cpu_layers, "_add_residual", lambda out, residual: out.add_(residual))
    tokens, programs_ = run_recorded(model_dir)
    program = programs_._programs[(1, torch.float32, torch.get_num_threads())]
    steps = [str(item.func) for items in program.stretches for item in items if not isinstance(item, tuple)]
    assert tokens == expected
    assert programs_.replays >= 7 and not programs_._refused
    assert steps == ["aten.add_.Tensor"] * len(program.cuts)


@taken_unless_forced_off("fused_kernels", "decode_programs")
def test_a_torch_result_python_reads_leaves_the_size_unrecorded(tmp_path, monkeypatch):
    model_dir = str(build_tiny_model(tmp_path, "llama"))
    expected = eager_tokens(model_dir, monkeypatch, dtype="float32")

    def add_unless_nan(out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return out if bool(residual.isnan().any()) else out.add_(residual)

    monkeypatch.setattr(cpu_layers, "_add_residual", add_unless_nan)
    tokens, programs_ = run_recorded(model_dir)
    assert tokens == expected
    assert programs_.replays == 0 and not programs_._programs
    assert {why.split(" in torch")[0] for why in programs_._refused.values()} == {
        "the layers compute aten.is_nonzero.default"}


@taken_unless_forced_off("decode_programs")  # else that is the reason given
def test_enforce_eager_records_nothing(tmp_path):
    llm = LLM(str(build_tiny_model(tmp_path, "llama")), dtype="float32", enforce_eager=True)
    paths = llm.llm_engine.cpu_paths
    decoder = llm.llm_engine.model.model
    llm.close()
    assert not paths.decode_programs and ("decode_programs", "turned off by enforce_eager") in paths.reasons
    assert getattr(decoder, "programs", None) is None


def doubled_norm_tokens(llm: LLM, how: str) -> list[list[int]]:
    """Tokens after the first layer's second norm weight is doubled into new storage
    (``how``: "storage", the parameter's data replaced; "parameter", a new parameter
    in its place), where a kept program would still read the old."""
    generate(llm)
    norm = decoder_of(llm).layers[0].get_submodule("layer.post_attention_layernorm")
    norm = getattr(norm, "norm", norm)  # the fused norm's own (cpu/norms.py)
    with torch.no_grad():
        if how == "storage":
            norm.weight.data = norm.weight.data * 2
        else:
            norm.weight = torch.nn.Parameter(norm.weight * 2, requires_grad=False)
    return generate(llm)


@taken_unless_forced_off("fused_kernels", "decode_programs")
@pytest.mark.parametrize("how", ["storage", "parameter"])
def test_weights_replaced_drop_the_programs(tmp_path, monkeypatch, how):
    model_dir = str(build_tiny_model(tmp_path, "llama"))
    with monkeypatch.context() as patch:
        patch.setenv("SHARDLINE_CPU_PATHS", "decode_programs=off")
        eager = LLM(model_dir, dtype="float32")
        expected = doubled_norm_tokens(eager, how)
        eager.close()
    llm = LLM(model_dir, dtype="float32")
    programs_ = decoder_of(llm).programs
    assert programs_ is not None
    tokens = doubled_norm_tokens(llm, how)
    kept = list(programs_._programs)
    llm.close()
    assert tokens == expected
    assert tokens != generate_fresh(model_dir)
    assert len(kept) == 4  # recorded again over the new storage


def generate_fresh(model_dir: str) -> list[list[int]]:
    llm = LLM(model_dir, dtype="float32")
    tokens = generate(llm)
    llm.close()
    return tokens


# --------------------------------------------------------------- the recorder itself


def test_a_recorded_program_replays_its_calls_in_order():
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    delta = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    weight = torch.rand(64, generator=torch.Generator().manual_seed(2))
    with CallRecorder() as recorder:
        add_(x, delta)
        normed = rms_norm(x, weight, 1e-6)
    assert recorder.error is None
    assert [call.name for call in recorder.calls] == ["add_rows_f32", "rms_norm_f32"]
    assert recorder.calls[1].reals == (1e-6,)
    program = CallProgram.build(recorder.calls)
    assert program is not None
    first, second = x.clone(), normed.clone()
    normed.zero_()
    program.run(1, 2)  # the norm alone, over x as it is
    assert torch.equal(normed, second)
    program.run(0, 2)  # x += delta again, then the norm of that
    assert torch.equal(x, first + delta)
    assert torch.equal(normed, rms_norm(first + delta, weight, 1e-6))


def test_a_kernel_that_returns_a_status_cannot_be_replayed():
    key = torch.randn(2, 1, 4)
    k_cache = torch.zeros(2, 4, 1, 4)
    v_cache = torch.zeros(2, 4, 1, 4)
    with CallRecorder() as recorder:
        kv_write(key, key, k_cache, v_cache, torch.tensor([0, 5]))
    assert not recorder.calls
    assert recorder.error == "kernel kv_write returns a value, which a replay would not check"


def test_calls_of_other_threads_are_not_recorded():
    x, delta = torch.zeros(1, 16), torch.ones(1, 16)
    with CallRecorder() as recorder:
        worker = threading.Thread(target=add_, args=(x, delta))
        worker.start()
        worker.join()
    assert torch.equal(x, delta) and not recorder.calls and recorder.error is None


def test_one_recorder_at_a_time():
    from shardline.engine.kernels.programs import RecorderBusy

    with CallRecorder():
        with pytest.raises(RecorderBusy):
            CallRecorder().__enter__()
    with CallRecorder() as recorder:  # free again once the first one ends
        add_(torch.zeros(1, 16), torch.ones(1, 16))
    assert [call.name for call in recorder.calls] == ["add_rows_f32"]


@taken_unless_forced_off("fused_kernels", "decode_programs")
def test_a_step_while_another_thread_records_runs_as_usual(tmp_path, monkeypatch):
    model_dir = str(build_tiny_model(tmp_path, "llama"))
    expected = eager_tokens(model_dir, monkeypatch, dtype="float32")
    llm = LLM(model_dir, dtype="float32")
    with CallRecorder():  # as another engine's recording would hold it
        tokens = generate(llm)
    programs_ = decoder_of(llm).programs
    assert programs_ is not None
    nothing_recorded = not programs_._programs and not programs_._refused
    assert generate(llm) == expected  # and recorded once the recorder is free
    replays = programs_.replays
    llm.close()
    assert tokens == expected and nothing_recorded and replays > 0


def test_the_executor_calls_each_function_through_its_own_prototype():
    import ctypes

    codes = signature_codes([ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_double,
                             ctypes.POINTER(ctypes.c_float), ctypes.c_uint8])
    assert codes == "pqifdpB"
    source = executor_source_for([codes])
    assert ("((void (*)(void *, int64_t, int32_t, float, double, void *, uint8_t))function)"
            "((void *)(uintptr_t)i[0], (int64_t)i[1], (int32_t)i[2], (float)r[0], (double)r[1], "
            "(void *)(uintptr_t)i[3], (uint8_t)i[4]); break;") in source
    with pytest.raises(TypeError, match="c_char_p"):
        signature_codes([ctypes.c_char_p])


@taken_unless_forced_off("fused_kernels", "decode_programs")
@pytest.mark.parametrize("bound", ["count", "bytes"])
def test_past_either_bound_the_least_recently_replayed_program_goes(tmp_path, monkeypatch, bound):
    from shardline.engine.cpu import decode_programs

    model_dir = str(build_tiny_model(tmp_path, "llama"))
    expected = eager_tokens(model_dir, monkeypatch, dtype="float32")
    llm = LLM(model_dir, dtype="float32")
    programs_ = decoder_of(llm).programs
    assert programs_ is not None
    generate(llm)  # every size recorded: what one program keeps, measured
    one = max(program.held_bytes for program in programs_._programs.values())
    programs_.clear()
    if bound == "count":
        monkeypatch.setattr(decode_programs, "MAX_PROGRAMS", 2)
    else:
        monkeypatch.setattr(decode_programs, "MAX_HELD_BYTES", one + one // 8)  # the largest, and a little
    replays = programs_.replays
    tokens = generate(llm)
    kept = sorted(key[0] for key in programs_._programs)
    llm.close()
    assert tokens == expected
    assert kept == [1, 2]  # the last two sizes of the batch as it drains
    assert programs_.replays > replays and not programs_._refused

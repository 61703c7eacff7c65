"""Formats the engine does not run are refused with one line naming the format and what
would run it: by the scheme reader, the engine's verdict (``shardline check``, the
pipeline's pre-flight) and the loader alike."""

from __future__ import annotations

import json

import pytest

from shardline import LLM
from shardline.cli import main
from shardline.engine.config import EngineConfig
from shardline.engine.errors import UnsupportedModelError
from shardline.engine.model.loader import load_hf_config
from shardline.engine.model.support import model_support
from shardline.engine.model.tiny import build_tiny_model
from shardline.engine.quantization.methods import parse_quantization_config, resolve_scheme
from shardline.tasks.errors import PipelineError
from shardline.tasks.job import BatchJob
from shardline.tasks.preflight import check_model

from .checkpoints import compressed_config

_INT8_CHANNEL = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
_INT8_TOKEN = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
REFUSED = {
    "bitsandbytes": ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes"),
    "nvfp4_modelopt": ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "NVFP4"),
    "nvfp4_compressed": (compressed_config("nvfp4-pack-quantized", {"num_bits": 4, "type": "float",
                                                                    "strategy": "tensor_group", "group_size": 16}),
                         "NVFP4"),
    "gguf": ({"quant_method": "gguf"}, "GGUF"),
    "unknown_method": ({"quant_method": "hqq"}, "quant_method 'hqq'"),
    "gptq_3_bits": ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits=3"),
    "gptq_8_bits_asymmetric": ({"quant_method": "gptq", "bits": 8, "group_size": 128, "sym": False},
                               "asymmetric 8-bit gptq"),
    "awq_gemv": ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version 'gemv'"),
    "pack_quantized_3_bits": (compressed_config("pack-quantized", {"num_bits": 3, "type": "int", "symmetric": True,
                                                                   "strategy": "group", "group_size": 32}),
                              "num_bits 3"),
    "pack_quantized_int8_per_tensor": (compressed_config("pack-quantized", {**_INT8_CHANNEL, "strategy": "tensor"}),
                                       "pack-quantized, strategy 'tensor'"),
    "fp8_e5m2": ({"quant_method": "fp8", "fmt": "e5m2"}, "'e5m2'"),
    # input activations quantized other than per token, dynamically and symmetrically
    "int8_static_inputs": (compressed_config("int-quantized", _INT8_CHANNEL, {**_INT8_TOKEN, "strategy": "tensor",
                                                                              "dynamic": False}),
                           "input_activations int8 (strategy 'tensor', dynamic False"),
    "int8_asymmetric_inputs": (compressed_config("int-quantized", _INT8_CHANNEL, {**_INT8_TOKEN, "symmetric": False}),
                               "symmetric False"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_formats_name_the_format(name):
    config, named = REFUSED[name]
    with pytest.raises(UnsupportedModelError) as error:
        parse_quantization_config(config)
    message = str(error.value)
    assert named in message and "\n" not in message
    assert "vLLM" in message or "transformers" in message or "llama.cpp" in message  # what would run it


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("float"), "llama")


def _with_quantization_config(float_dir, tmp_path, quantization_config):
    import shutil

    shutil.copytree(float_dir, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_verdict_check_preflight_and_loader_refuse_bitsandbytes(float_dir, tmp_path, capsys):
    model_dir = _with_quantization_config(float_dir, tmp_path / "bnb", REFUSED["bitsandbytes"][0])
    support = model_support(load_hf_config(EngineConfig(str(model_dir))))
    assert not support.ok and "bitsandbytes" in support.message
    assert main(["check", str(model_dir)]) == 1
    assert f"refused: {support.message}" in capsys.readouterr().out
    job = BatchJob(input=str(tmp_path / "in"), output=str(tmp_path / "out"), model=str(model_dir))
    with pytest.raises(PipelineError, match="bitsandbytes"):
        check_model(job)
    with pytest.raises(UnsupportedModelError, match="bitsandbytes"):
        LLM(str(model_dir), device="cpu")


def test_mxfp4_of_a_model_type_other_than_gpt_oss_is_refused_before_loading(float_dir, tmp_path, capsys):
    model_dir = _with_quantization_config(float_dir, tmp_path / "mxfp4", {"quant_method": "mxfp4"})
    named = "mxfp4 weights of model type 'llama' are not run by shardline"
    support = model_support(load_hf_config(EngineConfig(str(model_dir))))
    assert not support.ok and named in support.message and "\n" not in support.message
    assert main(["check", str(model_dir)]) == 1
    assert f"refused: {support.message}" in capsys.readouterr().out
    job = BatchJob(input=str(tmp_path / "in"), output=str(tmp_path / "out"), model=str(model_dir))
    with pytest.raises(PipelineError, match=named):
        check_model(job)
    with pytest.raises(UnsupportedModelError, match=named):
        LLM(str(model_dir), device="cpu")


def test_quantization_option_must_match_the_checkpoint(float_dir, tmp_path, capsys):
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}
    model_dir = _with_quantization_config(float_dir, tmp_path / "gptq", gptq)
    hf_config = load_hf_config(EngineConfig(str(model_dir)))
    assert resolve_scheme(hf_config, "gptq") is not None
    refused = model_support(hf_config, quantization="fp8")
    assert not refused.ok and "quantization='fp8' does not match" in refused.message
    assert main(["check", str(model_dir), "--quantization", "int8"]) == 1
    assert "does not match" in capsys.readouterr().out
    assert model_support(hf_config, task="embed").reason is not None
    assert main(["check", str(float_dir), "--quantization", "int8"]) == 0
    job = BatchJob(input=str(tmp_path / "in"), output=str(tmp_path / "out"), model=str(model_dir),
                   quantization="fp8")
    with pytest.raises(PipelineError, match="does not match"):
        check_model(job)


def test_batch_job_takes_quantization(tmp_path):
    job = BatchJob(input=str(tmp_path / "in"), output=str(tmp_path / "out"), model="m", quantization="int8")
    assert job.engine_kwargs()["quantization"] == "int8"
    with pytest.raises(ValueError, match="quantization must be one of"):
        BatchJob(input=str(tmp_path / "in"), output=str(tmp_path / "out"), model="m", quantization="int3")
    with pytest.raises(ValueError, match="job's own field"):
        BatchJob(input=str(tmp_path / "in"), output=str(tmp_path / "out"), model="m",
                 engine_options={"quantization": "fp8"})


def test_command_line_and_fingerprint_carry_quantization(tmp_path):
    from shardline.cli import build_parser, job_from_args
    from shardline.tasks.fingerprint import fingerprint_fields
    from shardline.tasks.storage import Shard

    args = build_parser().parse_args(["run", str(tmp_path / "in"), str(tmp_path / "out"), "--model", "m",
                                      "--quantization", "fp8"])
    job = job_from_args(args)
    assert job.quantization == "fp8"
    shard = Shard(uri=str(tmp_path / "in" / "a.jsonl"), key="a", format="jsonl", size=1)
    plain = job.model_copy(update={"quantization": None})
    assert fingerprint_fields(job, shard, {})["quantization"] == "fp8"
    assert "quantization" not in fingerprint_fields(plain, shard, {})


def test_gguf_files_are_refused_naming_the_format(tmp_path, capsys):
    gguf_file = tmp_path / "model-Q4_K_M.gguf"
    gguf_file.write_bytes(b"GGUF")
    with pytest.raises(UnsupportedModelError, match="is a GGUF model, which shardline does not read"):
        LLM(str(gguf_file), device="cpu")
    assert main(["check", str(tmp_path)]) == 2  # a directory of GGUF files: the check cannot read a config
    assert "is a GGUF model" in capsys.readouterr().err
    job = BatchJob(input=str(tmp_path / "in"), output=str(tmp_path / "out"), model=str(gguf_file))
    with pytest.raises(PipelineError, match="llama.cpp runs GGUF files"):
        check_model(job)

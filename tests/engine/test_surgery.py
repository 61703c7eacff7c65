"""Module surgery: replacement by name, refused paths, the decoder-layer finder, probed
replacements and the one preparation order."""

import pytest
import torch
import transformers
from torch import nn

from shardline.engine.cpu.layers import LayerReplacement
from shardline.engine.cpu.linear import PackedLinear, onednn_linear_available
from shardline.engine.cpu.paths import CpuPaths, optimize_for_cpu
from shardline.engine.lora.layers import BatchedLoRALinear
from shardline.engine.lora.manager import LoRAManager
from shardline.engine.model.adapters import adapt_attention
from shardline.engine.model.tiny import tiny_config
from shardline.engine.surgery import (
    PREPARATION_ORDER,
    Preparation,
    SubmoduleNotFoundError,
    called_on,
    decoder_layers,
    prepare_model,
    probe_matches,
    replace,
    replace_if_reproduces,
    submodule,
)


def tiny_model(arch: str, **overrides) -> nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(tiny_config(arch, 64, **overrides)).eval()


class Wrapper(LayerReplacement):
    """A stand-in that answers for its layer's attributes without registering them."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer


def test_replace_puts_the_module_at_its_name_and_returns_the_old_one():
    model = tiny_model("llama")
    old_mlp = model.model.layers[1].mlp
    new_mlp = nn.Identity()
    assert replace(model, "model.layers.1.mlp", new_mlp) is old_mlp
    assert model.model.layers[1].mlp is new_mlp
    assert submodule(model, "model.layers.1.mlp") is new_mlp
    assert dict(model.named_modules())["model.layers.1.mlp"] is new_mlp
    new_layer = nn.Identity()
    replace(model, "model.layers.0", new_layer)  # a ModuleList's element, by position
    assert model.model.layers[0] is new_layer


@pytest.mark.parametrize("name", ["model.layers.2.mlp", "model.layers.0.nothing", "model.decoder", ""])
def test_a_missing_path_is_refused_naming_it(name):
    model = tiny_model("llama")
    before = dict(model.named_modules())
    with pytest.raises(SubmoduleNotFoundError, match=repr(name).replace(".", r"\.")):
        replace(model, name, nn.Identity())
    assert dict(model.named_modules()) == before  # nothing was added


def test_a_path_through_an_attribute_a_module_answers_for_is_refused():
    """A LayerReplacement answers for its layer's self_attn without holding it: a
    replacement there would shadow the real one, which lives under ``layer``."""
    model = tiny_model("llama")
    replace(model, "model.layers.0", Wrapper(model.model.layers[0]))
    with pytest.raises(SubmoduleNotFoundError, match="no registered child 'self_attn'"):
        replace(model, "model.layers.0.self_attn", nn.Identity())
    replaced = replace(model, "model.layers.0.layer.self_attn", nn.Identity())
    assert type(replaced).__name__ == "LlamaAttention"
    assert isinstance(model.model.layers[0].self_attn, nn.Identity)


@pytest.mark.parametrize(("arch", "overrides", "name"), [
    ("llama", {"num_hidden_layers": 3}, "model.layers"),
    ("gpt2", {}, "transformer.h"),
    ("falcon", {"num_hidden_layers": 3}, "transformer.h"),
    ("qwen3_moe", {"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32}, "model.layers"),
])
def test_the_decoder_layers_are_the_longest_module_list(arch, overrides, name):
    model = tiny_model(arch, **overrides)
    found_name, layers = decoder_layers(model)
    assert found_name == name
    assert layers is submodule(model, name)
    assert len(layers) == model.config.num_hidden_layers


def test_a_model_without_a_module_list_has_no_decoder_layers():
    name, layers = decoder_layers(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    assert name == "" and len(layers) == 0


def test_a_probed_replacement_goes_in_only_where_it_reproduces_the_module():
    model = nn.Sequential(nn.Linear(4, 3))
    original = model[0]
    probe = called_on(torch.randn(5, 4, generator=torch.Generator().manual_seed(0)))
    off = nn.Linear(4, 3)
    with torch.no_grad():
        off.weight.copy_(original.weight * 1.01)
        off.bias.copy_(original.bias)
    assert not replace_if_reproduces(model, "0", off, probe)
    assert model[0] is original
    assert not probe_matches(original, nn.Linear(5, 3), probe)  # raises on the probe: no match
    same = nn.Linear(4, 3)
    same.load_state_dict(original.state_dict())
    assert replace_if_reproduces(model, "0", same, probe)
    assert model[0] is same


def test_prepare_model_runs_the_steps_in_the_written_order():
    calls = []

    def step(name):
        return lambda model: calls.append(name) or name

    prepared = prepare_model(nn.Linear(1, 1), Preparation(**{name: step(name) for name in PREPARATION_ORDER}))
    assert calls == list(PREPARATION_ORDER)
    assert [getattr(prepared, name) for name in PREPARATION_ORDER] == list(PREPARATION_ORDER)
    calls.clear()
    prepared = prepare_model(nn.Linear(1, 1), Preparation(lora=step("lora")))
    assert calls == ["lora"] and prepared.cpu_layers is None and prepared.attention_adapters is None


@pytest.mark.skipif(not onednn_linear_available(torch.float32), reason="oneDNN's packed linear does not run here")
def test_the_cpu_step_packs_the_linears_inside_the_lora_wrappers():
    """LoRA comes before the CPU step: the wrappers stay the modules LoRA slots write,
    and the packed linears go inside them."""
    model = tiny_model("xglm")
    paths = CpuPaths(torch.float32, packed_linears=True)
    prepared = prepare_model(model, Preparation(
        attention_adapters=adapt_attention,
        lora=lambda m: LoRAManager(m, max_loras=2, max_lora_rank=4, device="cpu", dtype=torch.float32),
        cpu_layers=lambda m: optimize_for_cpu(m, paths, rows_hint=16)))
    assert prepared.attention_adapters == model.config.num_hidden_layers
    # Every linear is packed: those LoRA wraps, inside their wrappers, and the LM head.
    assert prepared.lora.layers and prepared.cpu_layers.packed_linears == len(prepared.lora.layers) + 1
    for name, wrapper in prepared.lora.layers.items():
        assert submodule(model, name) is wrapper
        assert isinstance(wrapper, BatchedLoRALinear) and isinstance(wrapper.base_layer, PackedLinear)
    assert adapt_attention(model) == 0  # an adapted model is not adapted again

"""Whether ``tensor_parallel_size`` ranks can split a model: every refusal the load
would raise, answered from the config and the model built on the meta device, before
any weight is read or any rank starts (the engine's rank 0 and the pipeline's
pre-flight ask it).

The config's refusals (``check_tensor_parallel``: heads; an unknown
quantization) come first; then the sharding step itself runs on
the meta-device model with the engine's attention adapters, as the first and last
rank would run it at load, so a projection it does not split (a fused query-key-value
projection of a layout it does not know, a size that does not divide, an expert layout
it does not know) is refused
with the load's own line. A quantized checkpoint's linear whose share would cut a
scale block or group (the block and group sizes are in its config) is refused with
the load's line too (quantized_bounds.py); what only its tensors show (act-order
groups mixing the ranks' columns) is refused when the ranks load.
"""

from __future__ import annotations

import logging

import torch
import transformers

from ..attention.context import register as register_attention
from ..model.adapters import adapt_attention, has_adapter
from ..model.kv_cache_spec import KVCacheSpec
from ..model.support import auto_class_for
from ..quantization.methods import resolve_scheme
from .group import RankGroup, ShardingError
from .heads import layer_heads, model_heads
from .quantized_bounds import configured_linears, refuse_cut_blocks
from .sharding import shard_model

logger = logging.getLogger(__name__)


def tensor_parallel_verdict(hf_config: transformers.PretrainedConfig, size: int, *, quantization: str | None,
                            task: str, trust_remote_code: bool = False) -> None:
    """Raise what loading the model of ``hf_config`` over ``size`` ranks would raise
    (ShardingError, or UnsupportedModelError for its quantization), one line naming the
    model or module and why; return where the split can be made."""
    check_tensor_parallel(hf_config, size, quantization=quantization, task=task)
    scheme = resolve_scheme(hf_config, quantization)
    num_attention_layers = sum(1 for layer in KVCacheSpec.from_hf_config(hf_config, torch.float32).layers
                               if layer.num_kv_heads)
    for rank in sorted({0, size - 1}):
        try:
            model = meta_model(hf_config, trust_remote_code, task)
            if task != "embed":  # the pooling engine's packed attention takes the models as they are
                adapt_attention(model)
            group = RankGroup(rank, size, lambda: "")
            if scheme is not None:
                refuse_cut_blocks(model, group, scheme, configured_linears(model, hf_config, scheme))
            shard_model(model, group, num_attention_layers)
        except ShardingError:
            raise
        except Exception as error:  # noqa: BLE001 - what only real weights answer: the load decides
            logger.debug("tensor-parallel verdict left to the load: %s: %s", type(error).__name__, error)
            return


def check_tensor_parallel(hf_config: transformers.PretrainedConfig, size: int, *, quantization: str | None,
                          task: str) -> None:
    """Refuse, from the config alone, what ``size`` ranks cannot run exactly: one line
    naming the model or option and why (UnsupportedModelError for an unknown
    quantization). LoRA adapters and quantized checkpoints split with the layers they
    belong to (engine/lora/layers.py, quantized.py, experts.py)."""
    model_type = hf_config.get_text_config().model_type
    prefix = f"tensor_parallel_size={size}"
    resolve_scheme(hf_config, quantization)
    heads = model_heads(hf_config)
    for layer in dict.fromkeys(layer_heads(hf_config) or ([heads] if heads is not None else [])):
        if layer.num_heads % size:
            raise ShardingError(f"{prefix}: {model_type} has {layer.num_heads} attention heads, which do not "
                                f"split over {size} ranks")
        if layer.num_kv_heads % size and size % layer.num_kv_heads:
            raise ShardingError(f"{prefix}: {model_type} has {layer.num_kv_heads} key-value heads; they split "
                                f"over ranks only when one count divides the other")


def meta_model(hf_config: transformers.PretrainedConfig, trust_remote_code: bool,
               task: str = "generate") -> torch.nn.Module:
    """The model of ``hf_config`` on the meta device (``task`` "embed": the base model
    the pooling engine runs, else the generation model), with the attention
    implementation the loader gives it."""
    auto_class = auto_class_for(hf_config, "embed" if task == "embed" else "generate")
    model_class = auto_class._model_mapping.get(type(hf_config), None)
    implementation = "eager" if model_class is not None and has_adapter(model_class) else register_attention()
    with torch.device("meta"):
        return auto_class.from_config(hf_config, trust_remote_code=trust_remote_code,
                                      attn_implementation=implementation)

"""Write the new tokens' keys and values into the paged KV cache.

Cache layout (fixed by the engine), per layer: k_cache is
[num_blocks, block_size, num_kv_heads, head_dim] and v_cache
[num_blocks, block_size, num_kv_heads, value_head_dim], contiguous (the value head
size may differ, as in multi-head latent attention). Token t goes to
slot = slot_mapping[t] = block_id * block_size + offset; slot -1 means "do not
store" (padding, or a token whose KV is already cached).
"""

from __future__ import annotations

import torch

from ._triton import check_kernel_dtype, launcher, next_power_of_2, require_triton, tl, triton

if triton is not None:

    @triton.jit
    def _store_kv_cache_kernel(
        k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
        stride_k_token, stride_k_head, stride_v_token, stride_v_head,
        stride_cache_block, stride_cache_slot, stride_cache_head,
        stride_v_cache_block, stride_v_cache_slot, stride_v_cache_head,
        NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
        NUM_KV_HEADS_P: tl.constexpr, HEAD_DIM_P: tl.constexpr,
        HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_P: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
    ):
        # One program per token copies its [num_kv_heads, head_dim] key and value rows.
        token = tl.program_id(0)
        slot = tl.load(slot_mapping_ptr + token)  # int64
        if slot < 0:
            return
        block_id = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE

        heads = tl.arange(0, NUM_KV_HEADS_P)
        dims = tl.arange(0, HEAD_DIM_P)
        dims_v = tl.arange(0, HEAD_DIM_V_P)
        mask = (heads < NUM_KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
        v_mask = (heads < NUM_KV_HEADS)[:, None] & (dims_v < HEAD_DIM_V)[None, :]
        token = token.to(tl.int64)
        k_offs = token * stride_k_token + heads[:, None] * stride_k_head + dims[None, :]
        v_offs = token * stride_v_token + heads[:, None] * stride_v_head + dims_v[None, :]
        cache_offs = (
            block_id * stride_cache_block
            + offset * stride_cache_slot
            + heads[:, None] * stride_cache_head
            + dims[None, :]
        )
        v_cache_offs = block_id * stride_v_cache_block + offset * stride_v_cache_slot \
            + heads[:, None] * stride_v_cache_head + dims_v[None, :]
        # Pure copies: no arithmetic on the values, so every dtype moves bit for bit.
        tl.store(k_cache_ptr + cache_offs, tl.load(k_ptr + k_offs, mask=mask), mask=mask)
        tl.store(v_cache_ptr + v_cache_offs, tl.load(v_ptr + v_offs, mask=v_mask), mask=v_mask)


def _check_layout(k, v, k_cache, v_cache, slot_mapping) -> None:
    assert k.dim() == 3 and v.dim() == 3 and k.shape[:2] == v.shape[:2], f"k {tuple(k.shape)}, v {tuple(v.shape)}"
    assert k_cache.dim() == 4 and v_cache.dim() == 4 and k_cache.shape[:3] == v_cache.shape[:3], (
        f"k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
    )
    assert k.shape[1:] == k_cache.shape[2:] and v.shape[1:] == v_cache.shape[2:], (
        f"new k {tuple(k.shape)}, v {tuple(v.shape)} does not match cache {tuple(k_cache.shape)}, "
        f"{tuple(v_cache.shape)}"
    )
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "caches must be contiguous"
    assert k.stride(2) == 1 and v.stride(2) == 1, "k/v head_dim must be contiguous"
    assert k.dtype == v.dtype == k_cache.dtype == v_cache.dtype, (
        f"dtypes differ: k {k.dtype}, v {v.dtype}, caches {k_cache.dtype}/{v_cache.dtype}"
    )
    assert slot_mapping.dtype == torch.int64 and slot_mapping.shape == (k.shape[0],), (
        f"slot_mapping must be int64 [T={k.shape[0]}], got {slot_mapping.dtype} "
        f"{tuple(slot_mapping.shape)}"
    )
    assert slot_mapping.is_contiguous(), "slot_mapping must be contiguous"
    block_size = k_cache.shape[1]
    assert block_size & (block_size - 1) == 0, f"block_size {block_size} is not a power of 2"
    devices = {t.device for t in (k, v, k_cache, v_cache, slot_mapping)}
    assert len(devices) == 1, f"tensors on several devices: {devices}"


def store_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k [T, Hkv, D] and v [T, Hkv, Dv] into k_cache/v_cache at slot_mapping [T]
    (-1 skips), in place."""
    # k, v: [T, Hkv, D | Dv] (may be strided views of a fused qkv); caches: [NB, BS, Hkv, D | Dv]
    require_triton()
    check_kernel_dtype("k", k)
    _check_layout(k, v, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    launcher(_store_kv_cache_kernel, (num_tokens,))(
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        NUM_KV_HEADS_P=next_power_of_2(num_kv_heads), HEAD_DIM_P=next_power_of_2(head_dim),
        HEAD_DIM_V=v.shape[2], HEAD_DIM_V_P=next_power_of_2(v.shape[2]),
        BLOCK_SIZE=k_cache.shape[1],
    )


def store_kv_cache_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Plain-torch store_kv_cache: same contract, any dtype and device."""
    # k, v: [T, Hkv, D]; caches: [NB, BS, Hkv, D] contiguous, viewed as [NB * BS, Hkv, D]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep]
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep]

"""Launcher of xLSTM's mLSTM step recurrence on the CPU (cpu_xlstm.c), float32; its
plain-torch reference is xlstm_mlstm.py's ``step_loop_varlen`` (same arguments).
``mlstm_kernel_available`` says whether the library built here; without it the mLSTM
kind keeps the torch step loop."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .native import NativeLibrary, declare

SOURCE = Path(__file__).with_name("cpu_xlstm.c")
_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = [_P, _I, _P, _I, _P, _I, _P, _I, _P, _I, _P, _I, _P, _P, _P, _P, _P, _I, _I, _I, _I,
             ctypes.c_float, ctypes.c_int]


def _declare(library: ctypes.CDLL) -> None:
    declare(library, ["mlstm_steps_f32"], _ARGTYPES, None)


_LIBRARY = NativeLibrary(SOURCE, _declare, "mLSTM layers keep their torch step loop")


def mlstm_kernel_available() -> bool:
    """Whether the library builds and loads on this host."""
    return _LIBRARY.load() is not None


def _per_token(tensor: torch.Tensor, name: str, dim: int) -> torch.Tensor:
    """``tensor`` float32 with its trailing dims packed (a copy where they are not):
    only the token stride is free."""
    assert tensor.dim() == dim and tensor.dtype == torch.float32, f"{name}: {tuple(tensor.shape)} {tensor.dtype}"
    return tensor if tensor[0].is_contiguous() else tensor.contiguous()


def mlstm_step_loop_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, i: torch.Tensor, f: torch.Tensor,
                        starts: torch.Tensor, lengths: torch.Tensor, c: torch.Tensor, n: torch.Tensor,
                        m: torch.Tensor, eps: float, state_dtype: torch.dtype) -> torch.Tensor:
    """xlstm_mlstm.step_loop_varlen through C, float32: q, k [T, NH, DQK]; v [T, NH, DV];
    i, f [T, NH]; starts, lengths [B]; c [B, NH, DQK, DV], n [B, NH, DQK], m [B, NH]
    contiguous float32, updated in place for requests with tokens. Returns h [T, NH, DV]
    (zero at tokens no request runs here)."""
    library = _LIBRARY.load()
    assert library is not None, "cpu_xlstm.c did not build: check mlstm_kernel_available() first"
    assert state_dtype == torch.float32, f"the C step loop computes in float32, not {state_dtype}"
    q, k, v = _per_token(q, "q", 3), _per_token(k, "k", 3), _per_token(v, "v", 3)
    i, f = _per_token(i, "igate", 2), _per_token(f, "fgate", 2)
    tokens, heads, dqk = q.shape
    dv = v.shape[2]
    assert k.shape == q.shape and v.shape[:2] == (tokens, heads), f"k {tuple(k.shape)}, v {tuple(v.shape)}"
    assert i.shape == f.shape == (tokens, heads), f"gates {tuple(i.shape)}, {tuple(f.shape)} for {tokens} tokens"
    requests = starts.shape[0]
    for name, state, shape in (("c", c, (requests, heads, dqk, dv)), ("n", n, (requests, heads, dqk)),
                               ("m", m, (requests, heads))):
        assert state.shape == shape and state.dtype == torch.float32 and state.is_contiguous(), \
            f"mLSTM state {name} must be {list(shape)} contiguous float32, got {tuple(state.shape)} {state.dtype}"
    starts, lengths = starts.to(torch.int64).contiguous(), lengths.to(torch.int64).contiguous()
    assert lengths.shape == (requests,), f"lengths {tuple(lengths.shape)} for {requests} requests"
    assert bool(((starts >= 0) & (starts + lengths <= tokens)).all()), "a request's tokens lie outside the batch"
    h = torch.zeros_like(v)
    library.mlstm_steps_f32(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                            h.data_ptr(), h.stride(0), i.data_ptr(), i.stride(0), f.data_ptr(), f.stride(0),
                            starts.data_ptr(), lengths.data_ptr(), c.data_ptr(), n.data_ptr(), m.data_ptr(),
                            requests, heads, dqk, dv, eps, torch.get_num_threads())
    return h

"""Every recurrent layer kind the engine runs, registered on import (see base.py)."""

from . import (
    gated_delta_net,
    kda,
    linear_attention,
    mamba,
    mamba2,
    olmo_hybrid,
    recurrent_gemma,
    rwkv,
    short_conv,
    xlstm,
    zaya_cca,
)

# The kinds' modules, whose import registered their kinds.
KIND_MODULES = (gated_delta_net, kda, linear_attention, mamba, mamba2, olmo_hybrid, recurrent_gemma, rwkv,
                short_conv, xlstm, zaya_cca)

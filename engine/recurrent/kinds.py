"""Every recurrent layer kind the engine runs, registered on import (see base.py)."""

from . import (gated_delta_net, kda, linear_attention, mamba, mamba2, olmo_hybrid, recurrent_gemma,  # noqa: F401
               short_conv, zaya_cca)

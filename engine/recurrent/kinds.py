"""Every recurrent layer kind the engine runs, registered on import (see base.py)."""

from . import gated_delta_net, kda, linear_attention, mamba, mamba2, recurrent_gemma, short_conv  # noqa: F401

"""Every recurrent layer kind the engine runs, registered on import (see base.py)."""

from . import gated_delta_net, short_conv  # noqa: F401  (registration)

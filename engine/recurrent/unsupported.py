"""Recurrent model types shardline refuses, each with the reason a user is told."""

from __future__ import annotations

UNSUPPORTED_RECURRENT_MODELS: dict[str, str] = {
    "rwkv": (
        "RWKV's model calls its blocks without handing keyword arguments on, so the engine "
        "cannot give a block its requests' state (the previous token of both time-shift "
        "mixes, and the WKV numerator, denominator and running maximum); running it needs "
        "a rewrite of the model, not a layer kind"
    ),
}


def unsupported_reason(model_type: str) -> str | None:
    """Why ``model_type`` is refused, or None when it is not on the list."""
    return UNSUPPORTED_RECURRENT_MODELS.get(model_type)

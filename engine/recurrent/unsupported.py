"""Recurrent model types shardline refuses, each with the reason a user is told."""

from __future__ import annotations

UNSUPPORTED_RECURRENT_MODELS: dict[str, str] = {
    "rwkv": (
        "no recurrent kind runs RWKV's blocks yet: each keeps, per request, the previous token of its "
        "time-mix and channel-mix shifts and the WKV numerator, denominator and running maximum, and "
        "the time-mix and channel-mix halves of a block would each need their own kind"
    ),
    "xlstm": (
        "its mLSTM blocks keep, per request, a matrix memory, its normaliser and a running maximum of "
        "the input gates (recurrent state, not keys and values), and no recurrent kind runs them yet"
    ),
}


def unsupported_reason(model_type: str) -> str | None:
    """Why ``model_type`` is refused, or None when it is not on the list."""
    return UNSUPPORTED_RECURRENT_MODELS.get(model_type)

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

_INKLING_BIAS = (
    "its attention layers ('hybrid' and 'hybrid_sliding') add to each score a relative position bias computed "
    "from the query token's hidden state (a per-head projection mixing a learned bank of bias-by-distance profiles, "
    "up to rel_extent keys back), which shardline's paged attention takes no input for"
)
_INKLING_CONVS = (
    "and each layer keeps four short convolutions (over its keys, values, attention output and MLP output), "
    "where the engine keeps the recurrent state of one module per layer"
)
_INKLING2_CONVS = (
    "and its full-attention layers convolve keys and values with taps projected from each token (dynamic short "
    "convolutions), which no recurrent kind runs yet"
)
UNSUPPORTED_RECURRENT_MODELS.update({
    **{name: f"{_INKLING_BIAS}, {_INKLING_CONVS}" for name in ("inkling", "inkling_text")},
    **{name: f"{_INKLING_BIAS}, {_INKLING2_CONVS}" for name in ("inkling2", "inkling2_text", "inkling2_loop",
                                                                "inkling2_loop_text")},
})


def unsupported_reason(model_type: str) -> str | None:
    """Why ``model_type`` is refused, or None when it is not on the list."""
    return UNSUPPORTED_RECURRENT_MODELS.get(model_type)

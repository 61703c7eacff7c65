"""Errors raised by more than one layer of the engine.

This module imports nothing from the engine, so any layer (the loader, the
recurrent kinds, the CPU paths, the pre-flight check) can raise or catch these
without importing a layer above it.
"""

from __future__ import annotations


class ModelLoadError(ValueError):
    """The model, its tokenizer or its architecture cannot be used by the engine."""


class UnsupportedModelError(ModelLoadError):
    """The engine cannot run this architecture exactly (its attention, a layer or an
    option it refuses); the message names the model and why."""


class UnsupportedLayerError(UnsupportedModelError):
    """A model layer keeps state the engine's cache has no place for, or attends in a
    way its paged attention does not."""

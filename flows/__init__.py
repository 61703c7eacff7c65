"""Prefect flows (orchestration only): batch_inference and backfill."""

from .backfill import backfill
from .batch_inference import batch_inference

__all__ = ["backfill", "batch_inference"]

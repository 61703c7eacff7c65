"""Orchestrator providers that reuse shardline's Prefect-free shard functions."""

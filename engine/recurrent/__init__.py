"""Recurrent layer kinds (per-request state beside the paged KV cache): the contract in base.py, one module per kind."""

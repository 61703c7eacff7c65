"""Embeddings: the pooling engine, poolers and packed attention over whole prompts."""

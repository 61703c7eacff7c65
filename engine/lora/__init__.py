"""LoRA: adapter requests, loading, batched LoRA layers and the adapter slot cache."""

"""Tensor parallelism inside one engine: the model's linears, embeddings, attention heads
and experts split over ranks, one process per rank, one scheduler (on rank 0) driving all.

``group.py`` holds a rank's place in the group and the collectives its layers call;
``layers.py`` the parallel modules; ``sharding.py`` which module of a model is split how
(transformers' tensor-parallel plan, else shape rules) and the load-time refusals;
``ranks.py`` the rank processes: rank 0 starts the others and sends them each step's
inputs, and each other rank runs its shard of the model on them.
"""

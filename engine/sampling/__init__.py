"""Sampling: one record per running sequence, the vectorised sampler, structured-output
grammars, reasoning parsers, detokenization and the output processor that turns sampled
tokens into outputs."""

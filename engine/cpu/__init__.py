"""The CPU path: which fast paths a host takes, and the modules that replace a model's to take them."""

"""Training a GPT from a typed config: the config tree, the loop, checkpoints, metrics."""

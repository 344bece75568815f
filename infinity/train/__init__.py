"""`infinity train`: the front door. Builds a transformers model from a named shape or a config file, trains it
with the engine on synthetic or byte-level text tokens, shows progress and ends with a summary."""

"""intellect3-recipe: the INTELLECT-3 recipe (SFT, asynchronous GRPO, evaluation), from a laptop to a cluster."""

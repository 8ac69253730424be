"""Launching the stages at every scale: the per-role commands (roles) and the dry run with the SLURM script (plan).

    python -m recipe.launch preset=intellect3 [overrides]     (or: make plan PRESET=intellect3)
"""

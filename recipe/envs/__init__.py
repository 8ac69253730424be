"""Verifiable environments: a dataset's rows, a parser for the model's answer and a rubric of weighted rewards."""
from recipe.envs.base import Environment, RewardResult, parse_final_answer
from recipe.envs.logic import LogicEnv
from recipe.envs.math import MathEnv

ENVIRONMENTS = {"math": MathEnv, "logic": LogicEnv}


def get_env(name: str) -> Environment:
    if name not in ENVIRONMENTS:
        raise KeyError(f"unknown environment '{name}' (known: {sorted(ENVIRONMENTS)})")
    return ENVIRONMENTS[name]()


__all__ = ["Environment", "RewardResult", "parse_final_answer", "get_env", "ENVIRONMENTS"]

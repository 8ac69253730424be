"""Verifiable environments: a dataset's rows, a parser for the model's answer and a rubric of weighted rewards."""
from recipe.envs.base import Environment, MaskSample, RewardResult
from recipe.envs.code import CodeEnv
from recipe.envs.exact import ExactEnv
from recipe.envs.logic import LogicEnv
from recipe.envs.math import MathEnv
from recipe.envs.science import ScienceEnv
from recipe.envs.tools import ToolsEnv
from recipe.envs.vf_adapter import VerifiersEnv

# verifiers: a taskset of Prime Intellect's verifiers library (the optional extra; recipe/envs/vf_adapter.py)
ENVIRONMENTS = {"math": MathEnv, "logic": LogicEnv, "science": ScienceEnv, "code": CodeEnv, "exact": ExactEnv,
                "tools": ToolsEnv, "verifiers": VerifiersEnv}


def get_env(name: str, judge=None, **options) -> Environment:
    """A new environment `name`; `judge` (recipe.envs.judge.Judge) re-checks the rule-negative answers of the
    environments that take one (math, science), and is ignored by the others; options go to its constructor
    (code: max_tests)."""
    if name not in ENVIRONMENTS:
        raise KeyError(f"unknown environment '{name}' (known: {sorted(ENVIRONMENTS)})")
    cls = ENVIRONMENTS[name]
    return cls(judge=judge, **options) if cls.uses_judge else cls(**options)


__all__ = ["Environment", "MaskSample", "RewardResult", "get_env", "ENVIRONMENTS"]

"""The errors a user sees as one line (`error: ...`, exit code 2) instead of a traceback.

Every module raises these or a subclass; the stage entry point (recipe.runs.stage_main) prints them.
"""
from __future__ import annotations


class RecipeError(Exception):
    """Bad input or a missing prerequisite: the message names the file, row or key and says what to do."""


class ConfigError(RecipeError, ValueError):
    """A config key, value or combination that the schema refuses."""


class StageError(RecipeError, RuntimeError):
    """A stage cannot run: an unfinished upstream stage, a run finished under another config, a bad model."""


class DataError(StageError):
    """A data file or row that cannot be read or converted."""


class HubError(StageError):
    """A hub reference that cannot be resolved (unpinned, unknown, or the hub is out of reach)."""


class SandboxError(StageError):
    """No sandbox here can isolate model-written code (and the user did not accept running it unisolated)."""

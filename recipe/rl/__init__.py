"""Asynchronous GRPO as INTELLECT-3 ran it: an orchestrator feeding a trainer from an inference engine."""

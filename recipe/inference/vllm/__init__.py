"""The vllm engine: vLLM servers spoken to over HTTP, their weights reloaded in place from the trainer's files.

- server: the server's command line and environment, its process (started, health-checked, stopped with
  everything it started), and HTTP calls to it with retries. Also hf_server_command: the command line of
  recipe.inference.serve, the hf engine behind the same endpoints (a CPU stand-in where vLLM is not installed).
- worker_ext: what runs inside the server's worker processes (the weight reload). The only code that imports
  `vllm`, and only when it runs there: the rest of the package, and so the project, imports without vllm.
- client: VLLMEngine, the Engine contract of recipe.inference.engine (and generate() for eval) over HTTP.

Written against vLLM 0.32 (its sources read in vllm-project/vllm); each module's docstring says what it relies
on there. tests/test_vllm_engine.py::test_real_vllm_server checks the whole against a real server.
"""
from recipe.inference.vllm.client import LOGPROBS, TOKEN_PREFIX, VLLMEngine, completion_body, parse_completion
from recipe.inference.vllm.server import (MAX_LOGPROBS, REPO_ROOT, SERVED_MODEL_NAME, ServerProcess, TimedOut,
                                          Unavailable, hf_server_command, read_stop_ids, run_servers_on,
                                          server_command, server_env)
from recipe.inference.vllm.worker_ext import EXTENSION_CLS, RELOAD_METHOD, WeightLoaderExtension, checkpoint_format

__all__ = ["EXTENSION_CLS", "LOGPROBS", "MAX_LOGPROBS", "RELOAD_METHOD", "REPO_ROOT", "SERVED_MODEL_NAME",
           "ServerProcess", "TOKEN_PREFIX", "TimedOut", "Unavailable", "VLLMEngine", "WeightLoaderExtension",
           "checkpoint_format", "completion_body", "hf_server_command", "parse_completion", "read_stop_ids",
           "run_servers_on", "server_command", "server_env"]
# The retry settings (RETRY_TRIES, RETRY_BASE_DELAY_S, ...) live in recipe.inference.vllm.server, read there at
# each call: set them on that module, not on this package.

"""The GPU check (recipe/gpu_check.py, scripts/gpu_check.sh), proven on the CPU: the same code path at the tiny
size, through the shell script the device machine runs."""
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _script(args, tmp_path, **env):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable,
           "GPU_CHECK_SITE": str(tmp_path / "site"), **env}
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


def test_cpu_tiny_check_through_the_script(tmp_path):
    r = _script(["--device", "cpu", "--size", "tiny", "--sft-steps", "2", "--rl-steps", "1", "--threads", "1"],
                tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    log = (tmp_path / "out" / "gpu_check.log").read_text()
    assert "gpu_check: ok" in log and "rl generate" in log  # the table went to the log too
    assert out["ok"] is True and out["device"] == "cpu" and out["torch"] and out["transformers"]
    assert out["peak_tflops"] == 989.0 and "mfu" in out["sft"]
    m = out["model"]
    assert m["class"] == "Glm4MoeForCausalLM"
    assert 0 < m["params_active"] < m["params_total"] - m["params_embedding"]  # top-k of the experts, no embedding
    assert out["sft"]["tokens_per_s"] > 0 and out["sft"]["mfu"] > 0 and math.isfinite(out["sft"]["loss"])
    rl = out["rl"]
    assert rl["generate"]["tokens_per_s"] > 0 and rl["train"]["tokens_per_s"] > 0 and "mfu" in rl["train"]
    assert rl["generate"]["tokens"] > 0 and math.isfinite(rl["loss"])
    assert rl["settings"]["optimizer"] == "muon"  # the recipe's build_optimizer: Muon + AdamW
    assert rl["steps"][0]["changed_fraction"] > 0
    # the engine reloaded what training wrote: the same weights, and a probe it scores differently than before
    assert rl["engine_matches_trainer"] is True
    assert rl["probe_logprob_after"] != rl["probe_logprob_before"]
    assert rl["probe_logprob_after"] == rl["probe_logprob_trainer"]
    assert rl["publish_s"] > 0 and rl["reload_s"] > 0


def test_cuda_without_a_gpu_is_one_line_and_fails(tmp_path):
    r = _script([], tmp_path, CUDA_VISIBLE_DEVICES="")
    assert r.returncode == 2
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip() and "nvidia-smi" not in ln]
    assert len(lines) == 1 and lines[0].startswith("gpu_check: error: --device cuda, but torch"), lines
    assert not (tmp_path / "out" / "gpu_check.json").exists()


def test_scripts_parse_and_wheel_pins_match_the_lock():
    for name in ("gpu_check.sh", "fetch_gpu_wheels.sh"):
        subprocess.run(["bash", "-n", str(ROOT / "scripts" / name)], check=True)

    def norm(name):
        return re.sub(r"[-_.]+", "-", name).lower()

    lock = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==")
            lock[norm(name)] = version.strip()
    fetch = (ROOT / "scripts" / "fetch_gpu_wheels.sh").read_text()
    specs = re.findall(r"^\s+([A-Za-z0-9_.-]+)==([\w.]+)\s*$", fetch, re.M)
    assert {norm(n) for n, _ in specs} == {"hydra-core", "omegaconf", "antlr4-python3-runtime", "math-verify",
                                           "latex2sympy2-extended"}
    header = (ROOT / "scripts" / "gpu_check.sh").read_text()
    for name, version in specs:
        assert lock[norm(name)] == version, (name, version, lock.get(norm(name)))
        assert f"{name}=={version}" in header  # the script's comment lists what it installs

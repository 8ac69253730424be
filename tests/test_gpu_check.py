"""The GPU check (recipe/gpu_check.py, scripts/gpu_check.sh), proven on the CPU: the same code path at the tiny
size, through the shell script the device machine runs."""
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

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
    assert out["trainer"] == "fsdp" and out["finished"] is True and "rl_steps_so_far" not in out
    assert out["sft"]["mfu_with_attention"] > out["sft"]["mfu"] and rl["train"]["mfu_with_attention"] > rl["train"]["mfu"]
    assert rl["settings"]["shared_prompt_pass"] is False  # the ranks' train_step: no shared-prompt pass

    # the same check with the one-process trainer (autocast: off in float32) and the profiler: in float32 the
    # one-rank FSDP2 group trains exactly as one process does, step for step
    r = _script(["--device", "cpu", "--size", "tiny", "--sft-steps", "2", "--rl-steps", "1", "--threads", "1",
                 "--trainer", "autocast", "--profile", "--out", str(tmp_path / "autocast.json")], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    one = json.loads((tmp_path / "autocast.json").read_text())
    assert one["trainer"] == "autocast" and one["ok"] is True
    assert one["sft"]["losses"] == pytest.approx(out["sft"]["losses"], rel=1e-6, abs=1e-6)
    for prof in (one["sft"]["profile"], one["rl"]["train_profile"]):
        assert prof["op_s"] > 0 and 0 < prof["busy_share"] and prof["top"] and prof["optimizer_s"] > 0
        assert prof["by_kind_s"] and all(t["s"] > 0 for t in prof["top"])
    assert "gpu_check: profile of an SFT step" in (tmp_path / "out" / "gpu_check.log").read_text()

    # the levers the H200 profiles point at (gpu_sweep.sh's sft_large_tuned): each layer's gathered weights kept
    # from forward to backward, a fused AdamW; the same training, to float rounding
    r = _script(["--device", "cpu", "--size", "tiny", "--sft-steps", "2", "--rl-steps", "1", "--threads", "1",
                 "--keep-gathered", "--fused-adamw", "--out", str(tmp_path / "tuned.json")], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    tuned = json.loads((tmp_path / "tuned.json").read_text())
    assert tuned["keep_gathered"] is True and tuned["fused_adamw"] is True and tuned["ok"] is True
    assert tuned["sft"]["losses"] == pytest.approx(out["sft"]["losses"], rel=1e-5)
    assert tuned["rl"]["engine_matches_trainer"] is True


def test_settings_that_do_not_go_together_are_one_line_each(tmp_path):
    for args, says in ((["--compile"], "--compile times SFT only: add --rl-steps 0"),
                       (["--trainer", "autocast", "--keep-gathered"], "--keep-gathered is a setting of --trainer fsdp")):
        # Python lists every import (the script puts stderr on stdout): the flags are refused before torch loads
        r = _script(["--device", "cpu", "--size", "tiny", *args], tmp_path, PYTHONPROFILEIMPORTTIME="1")
        assert r.returncode == 2 and says in r.stdout + r.stderr, args
        assert not re.search(r"\|\s+(torch|transformers)$", r.stdout + r.stderr, re.M), args
        assert not (tmp_path / "out" / "gpu_check.json").exists()


def test_attention_pairs_and_flops():
    from types import SimpleNamespace

    from recipe.gpu_check import attention_flops, attention_pairs

    assert attention_pairs(0, 1) == 1 and attention_pairs(0, 4) == 10  # 1 + 2 + 3 + 4
    for p, n in ((0, 7), (5, 1), (128, 256)):  # a prompt then its completion: one causal sequence
        assert attention_pairs(p, n) == attention_pairs(0, p + n)
    cfg = SimpleNamespace(num_attention_heads=2, head_dim=8, num_hidden_layers=3)
    assert attention_flops(10, cfg, 1) == 4 * 8 * 2 * 3 * 10 and attention_flops(10, cfg, 3) == 3 * 4 * 8 * 2 * 3 * 10


def test_kernel_kinds_of_the_h200_runs_kernel_names():
    from recipe.gpu_profile import is_annotation, kernel_kind

    names = {  # as the H200 check's profiles named them (results/gpu/)
        "_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel13GemmUniversalINS5_"
        "17GroupProblem": "grouped matmul (routed experts)",
        "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT": "matmul",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64_1x4x1_cga1x1x1_kernel0_0":
            "attention",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::Tens":
            "optimizer",
        "Memcpy DtoD (Device -> Device)": "copy, cast, collectives",
        "triton_poi_fused__to_copy__unsafe_view_clone_expand_index_put_new_zeros_unsqueeze_view_2":
            "copy, cast, collectives",  # (first match wins: a fused kernel named for its copy)
        "triton_poi_fused_cat_masked_fill_mul_silu_silu_backward_6": "copy, cast, collectives",
        "triton_per_fused_add_mean_mul_pow_rsqrt_3": "compiled elementwise (triton)",
        "void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16>, std::a":
            "other elementwise, reductions",
    }
    for name, kind in names.items():
        assert kernel_kind(name) == kind, name
        assert not is_annotation(name)
    assert is_annotation("Optimizer.step#AdamW.step") and is_annotation("Optimizer.step#Muon.step")


def test_every_variant_of_the_sweep_is_a_valid_check(tmp_path):
    from recipe.gpu_check import parse_args

    text = (ROOT / "scripts" / "gpu_sweep.sh").read_text().replace("\\\n", " ")
    variants = re.findall(r"^\s*run (\w+) (\d+) (.*?)\s*\"\$@\"\s*$", text, re.M)
    assert {v[0] for v in variants} >= {"gpu_check", "sft_compile", "rl_batch512"}
    for name, limit, args in variants:
        a = parse_args(["--device", "cpu", "--out", str(tmp_path / f"{name}.json"), *args.split()])
        assert int(limit) > 0 and (a.rl_steps == 0 or not a.compile), name
    subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_sweep.sh")], check=True)


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


def test_results_md_shows_what_the_report_makes_of_the_committed_gpu_runs(tmp_path):
    from recipe.eval.report import GPU_RESULTS, gpu_runs, gpu_section

    runs = gpu_runs(ROOT)
    assert len(runs) == len(list((ROOT / GPU_RESULTS).glob("*/*.json"))) >= 1
    section = gpu_section(ROOT)
    rows = [ln for ln in section.splitlines() if ln.startswith("| ") and "`" in ln]
    assert len(rows) == len(runs)
    for (commit, name, record), row in zip(runs, rows):
        assert row.startswith(f"| {commit[:10]} | {name} (") and f"{100 * record['sft']['mfu']:.1f}%" in row
    # RESULTS.md's GPU section is the report's, byte for byte (make report writes it last)
    assert (ROOT / "RESULTS.md").read_text().endswith("\n## Performance: one H200 GPU\n\n" + section)
    assert gpu_section(tmp_path).startswith("_No GPU check yet")


def test_report_takes_annotations_out_and_reads_a_stopped_checks_steps():
    from recipe.eval.report import gpu_profile_kinds, gpu_rl_partial

    profile = {"kernel_s": 1.0, "by_kind_s": {"optimizer": 0.5, "matmul": 0.2, "grouped matmul (routed experts)": 0.1,
                                              "other elementwise, reductions": 0.2},
               "top": [{"name": "Optimizer.step#AdamW.step", "s": 0.25}, {"name": "nvjet_sm90_x", "s": 0.2}]}
    busy, kinds = gpu_profile_kinds(profile)
    assert busy == pytest.approx(0.75) and kinds["optimizer"] == pytest.approx(0.25)
    assert kinds["matmul"] == pytest.approx(0.3) and "grouped matmul (routed experts)" not in kinds
    step = {"gen_tokens": 100, "gen_s": 2.0, "train_s": 4.0, "publish_s": 1.0, "reload_s": 0.5, "train_tokens": 400}
    record = {"rl_steps_so_far": [dict(step, gen_s=9.0), step, step], "model": {"params_active": 1e9},
              "peak_tflops": 1.0, "argv": []}
    got = gpu_rl_partial(record)  # the steps after the first
    assert got["generate_tps"] == pytest.approx(50) and got["train_tps"] == pytest.approx(100)
    assert got["train_mfu"] == pytest.approx(6 * 1e9 * 100 / 1e12) and got["reload_s"] == 0.5
    assert gpu_rl_partial({"argv": []}) is None  # a check older than the steps' record

"""What guards a stage folder: upstream stages made under another config are refused, one run at a time holds
the folder (flock on <stage>/.lock), and SIGTERM stops RL and SFT at a step boundary with a checkpoint, one line
and exit code 143, from which the next run resumes."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fakes import TokenEngine, save_tiny_qa_model
from recipe.config import load_config
from recipe.data.schema import message, write_rows
from recipe.runs import Stage, StageError, Stopped, require_done, stage_argv, stage_dir, stage_main, write_atomic

ROOT = Path(__file__).resolve().parent.parent


def nothing(stage, upstream):
    return {"inputs": {}, "outputs": {}}


# -- upstream config ---------------------------------------------------------------------------------------------

def test_an_upstream_made_under_another_config_is_refused_and_the_hashes_consumed_are_recorded(cfg_factory):
    cfg = cfg_factory()
    Stage(cfg, "data").run(nothing)
    manifest = Stage(cfg, "base").run(nothing, requires=("data",))
    data_hash = Stage(cfg, "data").hash
    assert manifest["upstream"] == {"data": data_hash}
    assert json.loads((stage_dir(cfg, "base") / "DONE.json").read_text())["upstream"] == {"data": data_hash}

    other = cfg_factory("data.seed=7")  # sft on data made from another seed
    ran = []
    with pytest.raises(StageError) as e:
        Stage(other, "sft").run(lambda st, up: ran.append(1), requires=("data", "base"))
    msg = str(e.value)
    assert "\n" not in msg and not ran and not (stage_dir(other, "sft") / "DONE.json").exists()
    assert msg.startswith("sft: stage 'data' in ") and str(stage_dir(cfg, "data")) in msg
    assert data_hash in msg and Stage(other, "data").hash in msg
    assert "make data" in msg and "force=true" in msg and "run_root=" in msg
    # a config change the upstream does not read is no change to it
    assert require_done(cfg_factory("sft.lr=0.5"), "base") == stage_dir(cfg, "base")


def test_a_stage_records_the_machines_load_as_it_began_and_ended(cfg_factory, monkeypatch):
    import recipe.runs

    loads = iter([(0.53, 0.4, 0.3), (1.71, 1.2, 0.9)])
    monkeypatch.setattr(recipe.runs.os, "getloadavg", lambda: next(loads))
    manifest = Stage(cfg_factory(), "data").run(nothing)
    assert (manifest["load_avg_1m_at_start"], manifest["load_avg_1m_at_end"]) == (0.53, 1.71)

    def no_load_average():
        raise OSError("no load average here")

    monkeypatch.setattr(recipe.runs.os, "getloadavg", no_load_average)  # an OS without one: recorded as None
    manifest = Stage(cfg_factory(), "base").run(nothing, requires=("data",))
    assert manifest["load_avg_1m_at_start"] is None and manifest["load_avg_1m_at_end"] is None


def test_a_stage_knows_the_arguments_it_was_called_with_and_forgets_them_after(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["prog", "from=the-command-line"])
    seen = []

    @stage_main
    def fake(cfg):
        seen.append(stage_argv())
        if cfg.rl.max_steps == 1:
            raise StageError("stop here")

    fake([f"run_root={tmp_path}", "rl.max_steps=3"])
    with pytest.raises(SystemExit):
        fake([f"run_root={tmp_path}", "rl.max_steps=1"])
    assert seen == [[f"run_root={tmp_path}", "rl.max_steps=3"], [f"run_root={tmp_path}", "rl.max_steps=1"]]
    assert stage_argv() == ["from=the-command-line"]  # outside a stage (and after a failed one): the command line


def test_a_stages_last_line_is_one_write_so_that_ranks_sharing_stderr_do_not_interleave(tmp_path, monkeypatch):
    """Each rank of `launcher.num_processes=2` says why it stopped on the stderr they share: one write(2) a line,
    newline included, else another rank's line can land between a line and its newline (seen in CI)."""
    writes, real_write = [], os.write
    monkeypatch.setattr(os, "write", lambda fd, data: writes.append((fd, bytes(data))) or real_write(fd, data))
    err = open(tmp_path / "stderr", "w")
    monkeypatch.setattr(sys, "stderr", err)
    err.write("a progress bar without its newline")  # buffered: it goes out before the line, not inside it

    @stage_main
    def stopped(cfg):
        raise Stopped(signal.SIGTERM, "rank 1 stopped with rank 0 after step 3")

    with pytest.raises(SystemExit) as e:
        stopped([f"run_root={tmp_path}"])
    assert e.value.code == 143
    ours = [data for fd, data in writes if fd == err.fileno()]
    assert ours[-1] == b"test_stage_guard: stopped by SIGTERM; rank 1 stopped with rank 0 after step 3\n"
    assert (tmp_path / "stderr").read_text().endswith("newline" + ours[-1].decode())


# a rank's stage command: a thread nobody joins blocks interpreter finalization, as the teardown deadlock of
# pytorch/pytorch#190489 does (torchrun SIGKILLs such a rank 30 s after its SIGTERM); and a stage that fails holds
# an object whose freeing blocks, as freeing the trainer's DDP model (its gloo process group) can
RANK_STAGE = """
import atexit, os, sys, threading
import recipe.runs
from recipe.errors import StageError
from recipe.runs import Stopped, stage_main
threading.Thread(target=threading.Event().wait, name="never-ends").start()
atexit.register(lambda: open("atexit", "w").write("atexit ran"))
recipe.runs.LEAVE_RANK_DUMP_S = int(os.environ.get("DUMP_S", "20"))
if "ATEXIT_S" in os.environ:  # a slow way out: every thread's stack is written to stderr after DUMP_S
    import time
    atexit.register(time.sleep, float(os.environ["ATEXIT_S"]))

class FreeingBlocks:
    def __del__(self):
        threading.Event().wait()

@stage_main
def stage(cfg):
    print("the stage's last output", end="")  # buffered: the exit must flush it
    how = os.environ["HOW"]
    held = FreeingBlocks() if how != "done" else None  # the failing stage's frame, kept by its traceback
    if how == "stop":
        raise Stopped(15, "the next run resumes")
    if how == "refused":
        raise StageError("refused")
    if how == "crash":
        raise RuntimeError("a bug")

stage(None if os.environ["CALL"] == "cli" else sys.argv[1:])  # the command line, or main(argv)
open("returned", "w").close()
"""


@pytest.mark.parametrize("how, code", [("done", 0), ("stop", 143), ("refused", 2), ("crash", 1)])
def test_a_rank_leaves_with_its_exit_code_without_waiting_on_interpreter_teardown(tmp_path, how, code):
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "PYTHONPATH": str(ROOT), "CALL": "cli",
           "HOW": how}
    marker = tmp_path / "atexit"
    out = subprocess.run([sys.executable, "-c", RANK_STAGE, f"run_root={tmp_path}"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == code, out.stderr[-2000:]
    assert out.stdout == "the stage's last output"
    assert marker.read_text() == "atexit ran"
    assert not (tmp_path / "returned").exists()  # the process ended inside the stage's entry point
    assert {"stop": "stopped by SIGTERM; the next run resumes", "refused": "error: refused",
            "crash": "RuntimeError: a bug", "done": ""}[how] in out.stderr
    assert "most recent call first" not in out.stderr  # no stacks: the way out was quick


FREEZE_STAGE = """
import gc, sys
from recipe.runs import stage_main

@stage_main
def stage(cfg):
    print(gc.get_freeze_count())

stage(sys.argv[1:])
"""


def test_a_stage_in_its_own_process_freezes_its_imports_and_one_called_from_python_does_not(tmp_path):
    """A stage's own process (its entry point in __main__) takes what its imports made out of the cyclic collector's
    full walks (gc.freeze); a stage called from a longer-lived process (a test, a notebook) leaves its collector be:
    garbage there not yet collected would be kept for good."""
    import gc

    out = subprocess.run([sys.executable, "-c", FREEZE_STAGE, f"run_root={tmp_path}"], env={
        **os.environ, "PYTHONPATH": str(ROOT)}, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout) > 10_000  # the imports' objects (omegaconf, hydra, the recipe's modules)
    gc.unfreeze()
    stage_main(lambda cfg: None)([f"run_root={tmp_path}"])
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize("stage", ["data", "base", "sft", "rl", "eval"])
def test_every_stage_run_as_a_rank_from_its_command_line_leaves_through_leave_rank(monkeypatch, stage):
    """`python -m recipe.<stage>` under torchrun (the process's own command line) ends in leave_rank; called from
    Python with overrides it does not (the caller's process goes on)."""
    import importlib

    import recipe.runs

    class Left(BaseException):
        pass

    def leave(body):  # the real one never returns: it ends the process
        raise Left

    module = importlib.import_module(f"recipe.{stage}.__main__")
    monkeypatch.setattr(recipe.runs, "leave_rank", leave)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(sys, "argv", [f"recipe.{stage}", "no_such_key=1"])  # refused at once, exit code 2
    with pytest.raises(Left):
        module.main()
    with pytest.raises(SystemExit) as e:
        module.main(["no_such_key=1"])
    assert e.value.code == 2


def test_a_rank_slow_to_leave_writes_every_threads_stack_before_torchrun_kills_it(tmp_path):
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "PYTHONPATH": str(ROOT), "CALL": "cli",
           "HOW": "stop", "DUMP_S": "1", "ATEXIT_S": "3"}
    out = subprocess.run([sys.executable, "-c", RANK_STAGE, f"run_root={tmp_path}"], env={**env, "HOW": "done"},
                         cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "Timeout" not in out.stderr, out.stderr[-2000:]  # no signal: no SIGKILL to beat
    out = subprocess.run([sys.executable, "-c", RANK_STAGE, f"run_root={tmp_path}"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 143, out.stderr[-2000:]
    dump = out.stderr[out.stderr.index("stopped by SIGTERM"):]
    # faulthandler's dump after DUMP_S: the main thread in leave_rank (running the atexit handlers), and the thread
    # nobody joins
    assert "Timeout (0:00:01)!" in dump and dump.count("(most recent call first)") == 2, dump
    assert "in leave_rank" in dump and "in wait" in dump, dump


def test_a_stage_called_from_python_or_as_one_process_is_left_to_the_interpreter(tmp_path):
    """The same script where leave_rank does not apply (one process, or main(argv) from Python under a rank's
    environment): finalization waits on the thread, as Python does."""
    for env in [{"CALL": "cli"}, {"RANK": "1", "WORLD_SIZE": "2", "CALL": "python"}]:
        (tmp_path / "returned").unlink(missing_ok=True)
        proc = subprocess.Popen([sys.executable, "-c", RANK_STAGE, f"run_root={tmp_path}"], cwd=tmp_path,
                                env={**os.environ, **env, "HOW": "done", "PYTHONPATH": str(ROOT)},
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.time() + 60
            while not (tmp_path / "returned").exists() and time.time() < deadline and proc.poll() is None:
                time.sleep(0.05)
            time.sleep(1)
            assert (tmp_path / "returned").exists() and proc.poll() is None, env  # the caller went on, then waits
        finally:
            proc.kill()
            proc.wait()


def test_eval_refuses_a_checkpoint_made_under_another_config(cfg_factory):
    from recipe.eval.models import model_for

    cfg = cfg_factory()
    Stage(cfg, "sft").finish(inputs={}, outputs={})
    assert model_for(cfg, "sft").path == stage_dir(cfg, "sft") / "model"
    assert model_for(cfg, "rl") is None  # not finished: skipped, as before
    with pytest.raises(StageError, match=r"eval: stage 'sft' .* another config .*make sft"):
        model_for(cfg_factory("sft.lr=0.5"), "sft")


# -- the folder lock ---------------------------------------------------------------------------------------------

HOLDER = """
import sys, time
sys.path.insert(0, {root!r})
from recipe.config import load_config
from recipe.runs import Stage

def body(stage, upstream):
    print("holding", flush=True)
    time.sleep(120)

Stage(load_config(sys.argv[1:]), "data").run(body, fresh=True)  # fresh: begin wipes the folder, not the lock
"""


def test_a_second_run_on_a_held_folder_names_the_holder_and_a_killed_holder_blocks_no_one(cfg_factory, tmp_path,
                                                                                             capsys):
    cfg = cfg_factory()
    script = tmp_path / "holder.py"
    script.write_text(HOLDER.format(root=str(ROOT)))
    holder = subprocess.Popen([sys.executable, str(script), f"run_root={cfg.run_root}"], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        with pytest.raises(StageError) as e:
            Stage(cfg, "data").run(nothing)
        msg = str(e.value)
        assert f"pid {holder.pid} on {socket.gethostname()}" in msg and "holder.py" in msg
        assert msg.startswith(f"data: {stage_dir(cfg, 'data')} is in use by another run") and "\n" not in msg

        # through an entry point: one line on stderr, exit code 2
        main = stage_main(lambda c: Stage(c, "data").run(nothing))
        with pytest.raises(SystemExit) as exit_:
            main([f"run_root={cfg.run_root}"])
        assert exit_.value.code == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and err.startswith("error: data: ") and f"pid {holder.pid}" in err
    finally:
        holder.kill()  # SIGKILL: no handler runs, the lock file stays behind
        holder.wait()
    lock = stage_dir(cfg, "data") / ".lock"
    assert json.loads(lock.read_text())["pid"] == holder.pid
    assert Stage(cfg, "data").run(nothing) is not None  # the stale lock file blocks no one
    assert Stage(cfg, "data").is_done() and json.loads(lock.read_text())["pid"] == os.getpid()


def test_a_process_forked_from_the_holder_does_not_keep_its_lock(tmp_path):
    """The hf engine is forked from the stage's process: it closes its copy of the lock's descriptor, so a holder
    killed while its fork still runs blocks no one (the fork ends with it soon after, but not at the same instant)."""
    from recipe.runs import StageLock

    lock = StageLock(tmp_path, "rl")
    lock.acquire()
    fd = lock.fd
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the fork: says whether it still has the descriptor, then lives on a while
        os.close(read)
        try:
            os.fstat(fd)
            os.write(write, b"open")
        except OSError:
            os.write(write, b"closed")
        time.sleep(5)
        os._exit(0)
    try:
        os.close(write)
        assert os.read(read, 16) == b"closed" and lock.fd == fd
        os.close(lock.fd)  # the holder dies (no unlock) while its fork runs
        lock.fd = None
        StageLock.held.discard(lock)
        again = StageLock(tmp_path, "rl")
        again.acquire()  # would raise StageError ("in use by another run") were the fork holding it
        again.release()
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        os.close(read)


# -- SIGTERM -----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_world(tmp_path_factory):
    """A tiny start model and tokenizer, and sft/rl rows asking `Q<n>`."""
    root = tmp_path_factory.mktemp("guard")
    model = root / "model"
    tok = save_tiny_qa_model(model)
    rows = {split: [{"id": f"q{i}", "env": "math", "task": "add", "split": split,
                     "prompt": [message("user", f"Q{i}")],
                     "completion": [message("assistant", f"<think>t</think>{i}")] if split == "sft" else [],
                     "answer": str(i), "info": "{}", "difficulty": 0.0, "tools": "[]"} for i in range(40)]
            for split in ("sft", "rl")}
    return {"root": root, "tok": tok, "model": model, "rows": rows}


def finished(cfg, name: str, files: dict | None = None) -> Path:
    """A stage folder that looks finished under cfg: `files` ({name: source folder}) copied in, DONE.json."""
    import shutil

    d = stage_dir(cfg, name)
    for target, src in (files or {}).items():
        shutil.copytree(src, d / target)
    write_atomic(d / "DONE.json", json.dumps({"config_hash": Stage(cfg, name).hash}))
    return d


def data_stage(cfg, world) -> None:
    d = stage_dir(cfg, "data")
    manifest = {f"{s}.parquet": {"rows": len(r), "sha256": write_rows(r, d / f"{s}.parquet")}
                for s, r in world["rows"].items()}
    write_atomic(d / "data_manifest.json", json.dumps({"files": manifest}))
    finished(cfg, "data")


def run_until_metrics_then_sigterm(cmd, metrics: Path, lines: int, env=None):
    """Start cmd, wait for `lines` records in metrics, SIGTERM it: (exit code, stderr)."""
    err_path = metrics.parent.parent / f"{metrics.parent.name}.stderr"
    with open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, env=env)
        try:
            deadline = time.time() + 120
            while time.time() < deadline and proc.poll() is None:
                if metrics.exists() and len(metrics.read_text().splitlines()) >= lines:
                    break
                time.sleep(0.05)
            assert proc.poll() is None, f"ended early ({proc.returncode}):\n{err_path.read_text()[-3000:]}"
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return rc, err_path.read_text()


def the_one_line(stderr: str, stage: str) -> re.Match:
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [ln for ln in re.split(r"[\r\n]", stderr) if ln.startswith(f"{stage}: stopped")]
    assert len(lines) == 1, stderr[-3000:]
    m = re.fullmatch(rf"{stage}: stopped by SIGTERM; the next run resumes from checkpoint (\S+)(?: \(step \d+\))?",
                     lines[0])
    assert m, lines[0]
    return m


RL_DRIVER = """
import os, runpy, sys
sys.path[:0] = [{root!r}, {tests!r}]
from transformers import AutoTokenizer
from fakes import TokenEngine
from recipe.rl import loop

def make_engine(cfg, model_path, version, log_dir):
    closed = lambda: open(os.environ["ENGINE_CLOSED"], "w").close()
    return TokenEngine(AutoTokenizer.from_pretrained(str(model_path)), version, delay=0.02, on_close=closed)

loop.make_engine = make_engine  # `python -m recipe.rl` with a scripted engine in place of the engine process
sys.argv = ["recipe.rl", *sys.argv[1:]]
runpy.run_module("recipe.rl", run_name="__main__", alter_sys=True)
"""

RL_ARGS = ["rl.batch_size=2", "rl.rollouts_per_example=2", "rl.max_new_tokens=8", "rl.micro_batch_size=4",
           "rl.pin_cores=false", "rl.seed=0", "rl.checkpoint_every=1000", "~rl.env_mix.logic", "~rl.env_mix.code",
           "~rl.env_mix.tools", "rl.env_mix.math=1.0"]


def test_sigterm_stops_rl_at_a_step_with_a_checkpoint_and_the_rerun_resumes(tiny_world, tmp_path, monkeypatch,
                                                                            capsys):
    from recipe.rl import __main__ as rl_main
    from recipe.rl import loop

    args = [f"run_root={tmp_path / 'runs'}", *RL_ARGS]
    cfg = load_config(args)
    data_stage(cfg, tiny_world)
    finished(cfg, "sft", {"model": tiny_world["model"]})
    script, closed = tmp_path / "rl_driver.py", tmp_path / "engine_closed"
    script.write_text(RL_DRIVER.format(root=str(ROOT), tests=str(ROOT / "tests")))
    rl_dir = stage_dir(cfg, "rl")
    rc, err = run_until_metrics_then_sigterm([sys.executable, str(script), *args, "rl.max_steps=100000"],
                                             rl_dir / "metrics.jsonl", 2,
                                             env={**os.environ, "ENGINE_CLOSED": str(closed)})
    assert rc == 128 + signal.SIGTERM
    ckpt = Path(the_one_line(err, "rl").group(1))
    step = json.loads((ckpt / "meta.json").read_text())["step"]
    assert ckpt.parent == rl_dir / "checkpoints" and step >= 2  # checkpoint_every=1000: the signal's checkpoint
    steps = [json.loads(x)["step"] for x in (rl_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, step + 1))
    assert closed.exists() and not (rl_dir / "DONE.json").exists()

    monkeypatch.setattr(loop, "make_engine", lambda c, path, version, log_dir: TokenEngine(tiny_world["tok"], version))
    rl_main.main([*args, f"rl.max_steps={step + 2}"])
    assert f"rl: resuming from {ckpt} (step {step})" in capsys.readouterr().out
    steps = [json.loads(x)["step"] for x in (rl_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, step + 3)) and (rl_dir / "DONE.json").exists()


SFT_ARGS = ["sft.save_steps=100000", "sft.logging_steps=1", "sft.batch_size=2", "sft.rows_per_sequence=2", "sft.max_length=64", "sft.threads=1",
            "sft.warmup_ratio=0"]


def test_sigterm_stops_sft_at_a_step_with_a_checkpoint_and_the_rerun_resumes(tiny_world, tmp_path, capsys):
    from recipe.sft import __main__ as sft_main

    args = [f"run_root={tmp_path / 'runs'}", *SFT_ARGS]
    cfg = load_config(args)
    data_stage(cfg, tiny_world)
    finished(cfg, "base", {"model": tiny_world["model"]})
    sft_dir = stage_dir(cfg, "sft")
    rc, err = run_until_metrics_then_sigterm([sys.executable, "-m", "recipe.sft", *args, "sft.max_steps=100000"],
                                             sft_dir / "metrics.jsonl", 2)
    assert rc == 128 + signal.SIGTERM
    ckpt = Path(the_one_line(err, "sft").group(1))
    step = json.loads((ckpt / "trainer_state.json").read_text())["global_step"]
    assert ckpt == sft_dir / "checkpoints" / f"checkpoint-{step}" and step >= 2  # save_steps: the signal's one
    logged = [json.loads(x)["step"] for x in (sft_dir / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(x)]
    assert logged == list(range(1, step + 1)) and not (sft_dir / "DONE.json").exists()

    sft_main.main([*args, f"sft.max_steps={step + 2}"])
    assert f"resuming from {ckpt} (step {step})" in capsys.readouterr().out
    logged = [json.loads(x)["step"] for x in (sft_dir / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(x)]
    assert logged == list(range(1, step + 3)) and (sft_dir / "DONE.json").exists()

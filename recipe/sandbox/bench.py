"""`make bench-sandbox`: how many small correct programs a second the sandbox runs (start, run, verdict), with a
pool of 2 workers as the RL verifier would on the tiny preset's 2 cores, in warm sandboxes (warm.py: one sandbox
per worker, a fresh process for each program) and in a sandbox started for each program, rounds of the two
alternated. Writes runs/<preset>/bench/sandbox.json and rewrites RESULTS.md.
"""
from __future__ import annotations

import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from recipe.cores import busy_seconds
from recipe.errors import StageError
from recipe.eval.report import write_bench
from recipe.runs import Began, environ, stage_main
from recipe.sandbox import Limits, backend, run_python, runner, warm

PROGRAMS = 200
WORKERS = 2
ROUNDS = 2  # of each mode, alternated
PROGRAM = "n = int(input())\nprint(sum(map(int, input().split())) + n)\n"


def one_round(programs: int, workers: int) -> dict:
    cases = [(f"{i % 7}\n{' '.join(map(str, range(i % 50)))}\n", str(i % 7 + sum(range(i % 50))))
             for i in range(programs)]
    limits = Limits()

    def one(case):
        stdin, want = case
        res = run_python(PROGRAM, stdin, limits)
        return res.status == "ok" and res.stdout.strip() == want

    cores = list(range(os.cpu_count() or 1))
    busy0, t0 = busy_seconds(cores), time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        ok = sum(pool.map(one, cases))
    seconds, busy1 = time.perf_counter() - t0, busy_seconds(cores)
    if ok != programs:
        raise StageError(f"bench-sandbox: {programs - ok} of {programs} correct programs did not pass")
    cpu_ms = None if busy0 is None or busy1 is None else round((busy1 - busy0) / programs * 1000, 2)
    return {"seconds": round(seconds, 3), "programs_per_s": round(programs / seconds, 2), "cpu_ms": cpu_ms}


def bench(programs: int = PROGRAMS, workers: int = WORKERS, rounds: int = ROUNDS) -> dict:
    use = backend()  # probe before the clock starts
    modes = ["warm", "cold"] if use == "bwrap" and runner.warm_usable() else ["cold"]
    runs = []
    for i in range(rounds * len(modes)):
        mode = modes[i % len(modes)]
        with environ({warm.SWITCH: "1" if mode == "warm" else "0"}):
            one_round(8, workers)  # the warm sandboxes started, the interpreter's files cached
            runs.append({"mode": mode, **one_round(programs, workers)})
    warm.close_all()
    out = {"backend": use, "programs": programs, "workers": workers, "rounds": runs}
    for mode in modes:
        mine = [r for r in runs if r["mode"] == mode]
        cpu = [r["cpu_ms"] for r in mine if r["cpu_ms"] is not None]
        out[mode] = {"programs_per_s": round(statistics.mean(r["programs_per_s"] for r in mine), 2),
                     "cpu_ms_per_program": round(statistics.mean(cpu), 2) if cpu else None}
    return out


@stage_main
def main(cfg):
    began = Began.now()
    out = bench()
    for mode in ("warm", "cold"):
        if mode in out:
            print(f"bench-sandbox: {mode}: {out[mode]['programs_per_s']:.1f} programs/s with {out['workers']} "
                  f"workers, {out[mode]['cpu_ms_per_program']} ms of the machine's CPU a program ({out['backend']})")
    print(f"bench-sandbox: wrote {write_bench(cfg, 'bench-sandbox', 'sandbox', out, began)}")


if __name__ == "__main__":
    main()

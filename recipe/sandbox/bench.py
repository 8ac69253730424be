"""`make bench-sandbox`: how many small correct programs a second the sandbox runs (start, run, verdict),
with a pool of 2 workers as the RL verifier would on the tiny preset's 2 cores. Writes
runs/<preset>/bench/sandbox.json and rewrites RESULTS.md.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from recipe.errors import StageError
from recipe.eval.report import write_bench
from recipe.runs import Began, stage_main
from recipe.sandbox import Limits, backend, run_python

PROGRAMS = 200
WORKERS = 2
PROGRAM = "n = int(input())\nprint(sum(map(int, input().split())) + n)\n"


def bench(programs: int = PROGRAMS, workers: int = WORKERS) -> dict:
    cases = [(f"{i % 7}\n{' '.join(map(str, range(i % 50)))}\n", str(i % 7 + sum(range(i % 50))))
             for i in range(programs)]
    use = backend()  # probe before the clock starts
    limits = Limits()

    def one(case):
        stdin, want = case
        res = run_python(PROGRAM, stdin, limits)
        return res.status == "ok" and res.stdout.strip() == want

    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        ok = sum(pool.map(one, cases))
    seconds = time.perf_counter() - t0
    if ok != programs:
        raise StageError(f"bench-sandbox: {programs - ok} of {programs} correct programs did not pass")
    return {"backend": use, "programs": programs, "seconds": round(seconds, 3),
            "programs_per_s": round(programs / seconds, 2), "workers": workers}


@stage_main
def main(cfg):
    began = Began.now()
    out = bench()
    print(f"bench-sandbox: {out['programs']} programs in {out['seconds']:.2f} s with {out['workers']} workers: "
          f"{out['programs_per_s']:.1f} programs/s ({out['backend']})")
    print(f"bench-sandbox: wrote {write_bench(cfg, 'bench-sandbox', 'sandbox', out, began)}")


if __name__ == "__main__":
    main()

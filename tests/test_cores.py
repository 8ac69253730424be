"""recipe.cores: torch's threads follow the cores other processes leave free, in base, SFT and eval on CPU."""
import json
import os
import subprocess
import sys
import time

import pytest
import torch
from datasets import Dataset

import recipe.sft as sft
from recipe import cores
from recipe.config import EvalConfig, TrainConfig, config_hash, load_config
from recipe.cores import ThreadGovernor, busy_seconds, threads_for
from recipe.eval.__main__ import held_out_hash
from recipe.eval.runner import evaluate
from recipe.model import build_tiny_model, build_tokenizer
from tests.fakes import CharTokenizer
from tests.test_eval_runner import ScriptedEvalEngine, rows
from tests.test_sft_resume import ARCH, TEXTS  # the tiny model and texts of the SFT resume tests

HZ = os.sysconf("SC_CLK_TCK")
# user nice system idle iowait irq softirq steal guest guest_nice
STAT = f"""cpu  400 0 200 900 100 0 0 0 0 0
cpu0 {HZ} 0 {HZ} 700 50 {HZ} 0 0 0 0
cpu1 100 {2 * HZ} 0 200 50 0 0 {HZ} 7 0
intr 12345
"""


def test_busy_seconds_count_every_state_but_idle_and_iowait_of_the_cores_asked_for():
    assert busy_seconds([0], STAT) == pytest.approx(3.0)
    assert busy_seconds([1], STAT) == pytest.approx(100 / HZ + 3.0)  # guest time is inside user already
    assert busy_seconds([0, 1], STAT) == pytest.approx(6.0 + 100 / HZ)
    assert busy_seconds([0, 2], STAT) is None  # a core /proc/stat does not list


@pytest.mark.parametrize("others, cpus, most, expected", [
    (0.0, 2, 2, 2), (0.2, 2, 2, 2), (0.3, 2, 2, 1), (1.0, 2, 2, 1), (5.0, 2, 2, 1), (0.0, 2, 1, 1),
    (0.0, 8, 4, 4), (3.0, 8, 8, 5), (8.0, 8, 8, 1),
])
def test_threads_for_leave_the_cores_others_keep_busy_and_stay_within_one_and_the_configured(others, cpus, most,
                                                                                              expected):
    assert threads_for(others, cpus, most) == expected


class FakeMachine:
    """A clock, the cores' busy seconds and this process's CPU seconds, moved by the test."""

    def __init__(self):
        self.now, self.busy, self.own = 100.0, 1000.0, 10.0
        self.readable = True

    def run(self, seconds, own_cores, other_cores):
        self.now += seconds
        self.own += seconds * own_cores
        self.busy += seconds * (own_cores + other_cores)

    def governor(self, most=2, interval_s=5.0):
        self.set_to = []
        return ThreadGovernor(most, interval_s, cores=[0, 1], read_busy=lambda c: self.busy if self.readable else None,
                              own_cpu=lambda: self.own, clock=lambda: self.now, set_threads=self.set_to.append)


def test_the_governor_drops_to_one_thread_while_another_process_holds_a_core_and_comes_back_after():
    m = FakeMachine()
    g = m.governor()
    m.run(4.9, own_cores=1.1, other_cores=0.9)
    assert g.step() is None and m.set_to == []  # not yet interval_s since the last sample
    m.run(0.2, own_cores=1.1, other_cores=0.9)
    assert g.step() == 1 and m.set_to == [1]
    assert g.others_busy == pytest.approx(0.9)
    m.run(5, own_cores=1.0, other_cores=1.0)
    assert g.step() is None and m.set_to == [1]  # still busy: no change, no call
    m.run(5, own_cores=1.0, other_cores=0.0)
    assert g.step() == 2 and m.set_to == [1, 2]
    assert g.changes == [(1, 0.9), (2, 0.0)]


def test_this_process_own_threads_are_not_taken_for_others():
    m = FakeMachine()
    g = m.governor()
    m.run(6, own_cores=2.0, other_cores=0.0)  # both cores busy, all of it this process
    assert g.step() is None and g.others_busy == pytest.approx(0.0) and m.set_to == []


def test_without_proc_stat_the_threads_stay_as_they_are():
    m = FakeMachine()
    m.readable = False
    g = m.governor()
    m.run(10, own_cores=1.0, other_cores=1.0)
    assert g.step() is None and m.set_to == []
    m = FakeMachine()
    g = m.governor()
    m.readable = False  # gone after the first sample: the governor stops there, even if it comes back
    m.run(10, own_cores=1.0, other_cores=1.0)
    assert g.step() is None
    m.readable = True
    m.run(10, own_cores=1.0, other_cores=1.0)
    assert g.step() is None and m.set_to == []


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2
                    or busy_seconds([0]) is None, reason="needs 2 cores and /proc/stat")
def test_a_real_busy_process_on_one_of_two_cores_takes_a_thread_away():
    two = sorted(os.sched_getaffinity(0))[:2]
    hog = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{two[1]}}})\nwhile True: pass"])
    try:
        time.sleep(0.5)  # the hog is running
        set_to = []
        g = ThreadGovernor(2, interval_s=1.0, cores=two, set_threads=set_to.append)
        time.sleep(1.2)  # this process idle meanwhile
        assert g.step() == 1 and set_to == [1]
        assert 0.75 <= g.others_busy <= 2.05
    finally:
        hog.kill()
        hog.wait()


def test_a_child_process_that_ended_is_this_process_own_work_not_another_load():
    """The eval stage's sandboxed programs are its children: their CPU counts as its own (own_cpu_s), not as a
    reason to drop threads."""
    before = cores.own_cpu_s()
    subprocess.run([sys.executable, "-c", "import time\nt = time.process_time()\n"
                    "while time.process_time() - t < 0.5: pass"], check=True)
    assert cores.own_cpu_s() - before >= 0.5
    assert ThreadGovernor(2).own_cpu is cores.own_cpu_s


def test_the_cpu_of_a_running_process_tree():
    """A warm sandbox stays up between the programs it runs: what it and its children used, before anything ends."""
    burn = ("import subprocess, sys\nsubprocess.run([sys.executable, '-c', 'import time\\nt = time.process_time()"
            "\\nwhile time.process_time() - t < 0.5: pass'])\nprint('done', flush=True)\nsys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "done\n"
        assert 0.45 <= cores.tree_cpu_s([child.pid]) < 5  # its grandchild (reaped by it), its own start; in ticks
        assert cores.tree_cpu_s([]) == 0
    finally:
        child.stdin.close()
        child.wait()

"""The LLM judge (recipe/envs/judge.py) of the math and science environments, against a stand-in judge: a small
HTTP server in this file that speaks the part of vLLM's OpenAI API the client uses (GET /v1/models, POST
/v1/chat/completions) and grades by a rule (A when the reference number appears in the candidate's answer, else
B); it can also fail on purpose (down, HTTP 500 or 400, slow, no verdict). That tests the protocol and the
fallbacks, not CompassVerifier's judgement. The last test puts the project's own server (recipe.inference.serve,
the hf engine behind /v1/chat/completions) on a tiny random model in its place: its verdict is noise, so it only
shows the real path round-trips: the request is taken, a reply comes back, and is read or falls back."""
import json
import re
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from recipe.envs import get_env
from recipe.envs import judge as judge_mod
from recipe.envs.judge import (COT, DIRECT, Judge, base_url, build_prompt, judge_from_config, parse_verdict,
                               question_of)
from recipe.errors import ConfigError

WRONG_BY_RULES = "<think>t</think>the count is 12, I think"  # math-verify: not 12; the stand-in: 12 is in it
WRONG = "<think>t</think>twelve"  # neither
RIGHT = "<think>t</think>\\boxed{12}"


def row(answer="12", info="{}"):
    return {"id": "q", "env": "math", "prompt": [{"role": "system", "content": "be brief"},
                                                  {"role": "user", "content": "How many apples? {x}"}],
            "answer": answer, "info": info}


def section(prompt: str, name: str) -> str:
    return prompt.split(f"<{name} Begin>\n", 1)[1].split(f"\n<{name} End>", 1)[0]


class StandIn:
    """The stand-in judge. mode: rule | letter (direct-style replies) | garbage | 500 | 400 | slow;
    fail_first: that many chat requests answered 500 before the mode applies."""

    def __init__(self):
        self.mode, self.fail_first, self.delay = "rule", 0, 0.0
        self.bodies, self.models_asked = [], 0
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def send(self, status, payload):
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/v1/models":
                    standin.models_asked += 1
                    self.send(200, {"object": "list", "data": [{"id": "opencompass/CompassVerifier-7B"}]})
                else:
                    self.send(404, {"detail": "Not Found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/v1/chat/completions":
                    return self.send(404, {"detail": "Not Found"})
                standin.bodies.append(body)
                if standin.fail_first > 0:
                    standin.fail_first -= 1
                    return self.send(500, {"error": {"message": "engine dead"}})
                if standin.mode == "500":
                    return self.send(500, {"error": {"message": "engine dead"}})
                if standin.mode == "400":
                    return self.send(400, {"error": {"message": "too long for the context"}})
                if standin.mode == "slow":
                    time.sleep(standin.delay)
                prompt = body["messages"][-1]["content"]
                ref, cand = section(prompt, "Standard Answer"), section(prompt, "Candidate's Answer")
                ok = re.search(rf"(?<!\d){re.escape(ref)}(?!\d)", cand) is not None
                reply = {"rule": f"The candidate says {cand!r}.\nFinal Judgment: \\boxed{{{'A' if ok else 'B'}}}"
                                 f" - {'CORRECT' if ok else 'INCORRECT'}",
                         "letter": "A" if ok else "B", "garbage": "I am not sure.", "slow": "\\boxed{A}"}[standin.mode]
                self.send(200, {"object": "chat.completion", "model": body["model"],
                                "choices": [{"index": 0, "message": {"role": "assistant", "content": reply},
                                             "finish_reason": "stop"}]})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def standin():
    s = StandIn()
    yield s
    s.close()


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch):
    monkeypatch.setattr(judge_mod, "BACKOFF_S", (0.01, 0.02))


def free_port_url():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # closed again: nothing listens there


# -- the environments with a judge -------------------------------------------------------------------------
def test_a_rule_positive_answer_never_calls_the_judge(standin):
    env = get_env("math", judge=Judge(standin.url))
    res = env.score(RIGHT, row())
    assert res.reward == 1.0 and res.counts == {} and "judge" not in res.metrics
    assert standin.bodies == [] and standin.models_asked == 0


def test_a_rule_negative_answer_the_judge_finds_right_scores_1(standin):
    env = get_env("math", judge=Judge(standin.url, max_tokens=512))
    assert get_env("math").score(WRONG_BY_RULES, row()).reward == 0.0  # the rules alone
    res = env.score(WRONG_BY_RULES, row())
    assert res.reward == 1.0 and res.metrics == {"formatted": 1.0, "correct": 1.0, "judge": 1.0}
    assert res.counts == {"judge_calls": 1, "judge_flips": 1, "judge_errors": 0} and not res.errors
    (body,) = standin.bodies
    assert body["model"] == "opencompass/CompassVerifier-7B"  # the name the server lists
    assert body["temperature"] == 0.0 and body["max_tokens"] == 512
    (msg,) = body["messages"]
    assert msg["role"] == "user"
    assert section(msg["content"], "Original Question") == "How many apples? {x}"  # the last user message
    assert section(msg["content"], "Standard Answer") == "12"
    assert section(msg["content"], "Candidate's Answer") == "the count is 12, I think"  # after </think>
    assert "\\boxed{A}" in msg["content"]  # cot: the verdict comes boxed


def test_a_judge_verdict_of_b_leaves_0(standin):
    res = get_env("math", judge=Judge(standin.url)).score(WRONG, row())
    assert res.reward == 0.0 and res.metrics["judge"] == 0.0 and res.metrics["correct"] == 0.0
    assert res.counts == {"judge_calls": 1, "judge_flips": 0, "judge_errors": 0}


def test_no_final_answer_is_not_judged(standin):
    env = get_env("math", judge=Judge(standin.url))
    for text in ("<think>12 is it, cut off", "<think>t</think>   "):
        res = env.score(text, row())
        assert res.reward == 0.0 and res.counts == {}
    assert standin.bodies == []


def test_a_judge_that_is_down_leaves_the_rule_verdict_counted_then_is_left_alone():
    judge = Judge(free_port_url(), tries=2, cooldown_s=60.0)
    env = get_env("math", judge=judge)
    t0 = time.monotonic()
    res = env.score(WRONG_BY_RULES, row())
    assert res.reward == 0.0 and res.counts == {"judge_calls": 1, "judge_flips": 0, "judge_errors": 1}
    assert not res.errors and not res.masked  # not a reward-function error: the rules judged it
    again = env.score(WRONG_BY_RULES, row())  # cooling down: not asked at all
    assert again.reward == 0.0 and again.counts["judge_errors"] == 1
    assert judge.ask("q", "1", "1").error.startswith("judge down, not asked")
    assert time.monotonic() - t0 < 5.0
    assert env.score(RIGHT, row()).reward == 1.0  # the rules still work


def test_http_500_is_tried_again_and_a_judge_back_up_is_used(standin):
    standin.fail_first = 2
    res = get_env("math", judge=Judge(standin.url, tries=3)).score(WRONG_BY_RULES, row())
    assert res.reward == 1.0 and res.counts["judge_errors"] == 0 and len(standin.bodies) == 3


def test_a_judge_failing_every_try_falls_back_and_cools_down_then_recovers(standin):
    standin.mode = "500"
    judge = Judge(standin.url, tries=2, cooldown_s=0.2)
    env = get_env("math", judge=judge)
    res = env.score(WRONG_BY_RULES, row())
    assert res.reward == 0.0 and res.counts["judge_errors"] == 1 and len(standin.bodies) == 2
    standin.mode = "rule"
    assert env.score(WRONG_BY_RULES, row()).counts["judge_errors"] == 1 and len(standin.bodies) == 2  # left alone
    time.sleep(0.25)
    assert env.score(WRONG_BY_RULES, row()).reward == 1.0  # asked again after the cooldown


def test_a_refused_request_is_not_tried_again(standin):
    standin.mode = "400"
    v = Judge(standin.url, tries=3).ask("q", "12", "12")
    assert v.letter is None and "HTTP 400" in v.error and "too long" in v.error and len(standin.bodies) == 1


def test_a_slow_judge_times_out(standin):
    standin.mode, standin.delay = "slow", 1.0
    judge = Judge(standin.url, timeout_s=0.2, tries=1)
    judge.model = "m"  # skip the listing
    v = judge.ask("q", "12", "12")
    assert v.letter is None and "timed out" in v.error


def test_a_reply_without_a_verdict_falls_back(standin):
    standin.mode = "garbage"
    res = get_env("math", judge=Judge(standin.url)).score(WRONG_BY_RULES, row())
    assert res.reward == 0.0 and res.counts == {"judge_calls": 1, "judge_flips": 0, "judge_errors": 1}
    v = Judge(standin.url).ask("q", "12", "12")
    assert v.reply == "I am not sure." and v.error.startswith("judge: no verdict")


def test_the_direct_prompt_reads_a_bare_letter(standin):
    standin.mode = "letter"
    judge = Judge(standin.url + "/v1/", style=DIRECT, max_tokens=4)  # prime-rl's judge_base_url form
    assert judge.url == standin.url
    assert get_env("math", judge=judge).score(WRONG_BY_RULES, row()).reward == 1.0
    assert get_env("math", judge=judge).score(WRONG, row()).reward == 0.0
    assert standin.models_asked == 1  # the model name is asked once
    assert "\\boxed" not in standin.bodies[0]["messages"][0]["content"]


def test_science_judges_free_form_rows_only(standin):
    env = get_env("science", judge=Judge(standin.url))
    free = dict(row(), env="science")
    assert env.score(WRONG_BY_RULES, free).reward == 1.0
    mc = dict(row(answer="B"), env="science", info=json.dumps({"letters": "ABCD"}))
    res = env.score("<think>t</think>the answer is probably C, or B", mc)
    assert res.reward == 0.0 and res.counts == {} and len(standin.bodies) == 1


def test_environments_without_a_judge_are_unchanged(standin):
    for name in ("math", "science"):
        env = get_env(name)
        assert env.judge is None and not env.score_in_parallel
        assert env.score(WRONG_BY_RULES, row()).counts == {}
    assert get_env("math", judge=Judge(standin.url)).score_in_parallel
    assert not hasattr(get_env("logic", judge=Judge(standin.url)), "judge")  # others take none
    assert standin.bodies == []


# -- the prompt and the verdict ------------------------------------------------------------------------------
def test_parse_verdict():
    assert parse_verdict("...\nFinal Judgment: \\boxed{A} - CORRECT") == "A"
    assert parse_verdict("\\boxed{B} at first; Final Judgment: \\boxed{\\text{C}} - INCOMPLETE") == "C"
    assert parse_verdict("A careful look shows it matches.") is None  # cot: only a boxed verdict counts
    assert parse_verdict("Final Judgment: \\boxed{D}") is None
    for reply, letter in [("A", "A"), (" (B) ", "B"), ("**C**", "C"), ("A: CORRECT", "A"), ("B - incorrect.", "B"),
                          ("INCORRECT", "B"), ("Correct.", "A"), ("invalid", "C"), ("\\boxed{A}", "A"),
                          ("A careful look", None), ("a", None), ("", None), ("AB", None)]:
        assert parse_verdict(reply, DIRECT) == letter, reply


def test_build_prompt_takes_the_texts_as_they_are():
    p = build_prompt("Is {reference} a set {1, 2}?", "\\frac{1}{2}", "x = {question}", COT)
    assert section(p, "Original Question") == "Is {reference} a set {1, 2}?"
    assert section(p, "Standard Answer") == "\\frac{1}{2}" and section(p, "Candidate's Answer") == "x = {question}"
    assert p.rstrip().endswith("Final Judgment:")
    assert "letter of your verdict alone" in build_prompt("q", "r", "s", DIRECT)
    assert question_of(row()["prompt"]) == "How many apples? {x}"
    assert base_url("http://h:8000/v1") == base_url("http://h:8000/") == "http://h:8000"


# -- configuration ---------------------------------------------------------------------------------------------
def test_intellect3_turns_the_judge_on_at_the_judge_jobs_address(cfg_factory):
    cfg = cfg_factory("preset=intellect3")
    j = cfg.rl.judge
    assert j.enabled and j.url is None and j.hub_id == "opencompass/CompassVerifier-7B" and str(j.prompt) == "cot"
    judge = judge_from_config(j, environ={"RECIPE_JUDGE_URL": f"http://node44:{j.port}"})  # launch/judge_url
    assert judge.url == "http://node44:8000" and judge.style == COT and judge.max_tokens == j.max_tokens
    with pytest.raises(ConfigError, match="RECIPE_JUDGE_URL"):
        judge_from_config(j, environ={})  # the judge job has not written its address
    pinned = cfg_factory("preset=intellect3", "rl.judge.url=http://judge:9000/v1", "rl.judge.prompt=direct")
    judge = judge_from_config(pinned.rl.judge, environ={"RECIPE_JUDGE_URL": "http://elsewhere:1"})
    assert judge.url == "http://judge:9000" and judge.style == DIRECT


def test_tiny_has_no_judge(cfg_factory):
    cfg = cfg_factory("preset=tiny")
    assert not cfg.rl.judge.enabled
    assert judge_from_config(cfg.rl.judge, environ={"RECIPE_JUDGE_URL": "http://node44:8000"}) is None


def test_bad_judge_settings_are_refused(cfg_factory):
    with pytest.raises(ConfigError, match="rl.judge.url"):
        cfg_factory("rl.judge.url=node44:8000")
    with pytest.raises(ConfigError, match="rl.judge.tries"):
        cfg_factory("rl.judge.tries=0")
    with pytest.raises(ConfigError):
        cfg_factory("rl.judge.prompt=long")


# -- the RL orchestrator's counters ------------------------------------------------------------------------
def test_the_orchestrator_counts_judge_calls_flips_and_errors(standin):
    from recipe.config import RLConfig
    from recipe.rl.orchestrator import Orchestrator
    from tests.fakes import CharTokenizer, ScriptedEngine

    rows = [{"id": f"q{i}", "env": "math", "task": "add", "prompt": [{"role": "user", "content": f"Q{i}"}],
             "answer": str(i + 10), "info": "{}", "difficulty": 0.5} for i in range(8)]

    def answer(prompt, rid):  # per group of 4: right by the rules, right by the judge only, wrong twice
        i = int(prompt.split("Q")[1].split("<")[0]) + 10
        return ["<think>t</think>\\boxed{%d}" % i, f"<think>t</think>it is {i}, I think", "<think>t</think>no",
                "<think>t</think>none"][rid % 4]

    cfg = RLConfig(batch_size=2, rollouts_per_example=4, env_mix={"math": 1.0}, max_async_level=0)
    cfg.judge.enabled, cfg.judge.url = True, standin.url
    orch = Orchestrator(rows, CharTokenizer(), cfg, ScriptedEngine(answer), seed=0)
    samples, stats = orch.next_batch(0)
    assert len(samples) == 8 and [s.reward for s in samples] == [1.0, 1.0, 0.0, 0.0] * 2
    assert stats["judge_calls"] == 6 and stats["judge_flips"] == 2 and stats["judge_errors"] == 0
    assert stats["reward_errors"] == 0


# -- the real path: the project's own server on a tiny model -------------------------------------------------
def test_serve_turns_a_chat_request_into_a_completion_request():
    from recipe.chat import CHAT_TEMPLATE
    from recipe.inference.serve import HTTPError, chat_request, chat_response
    from tests.fakes import CharTokenizer

    class Tok(CharTokenizer):  # renders "<role>content" and opens "<assistant>"
        chat_template = CHAT_TEMPLATE

    tok = Tok()
    body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3,
            "max_tokens": 9, "temperature": 0.0, "logprobs": False}
    out = chat_request(body, tok)
    assert out == {"model": "policy", "temperature": 0.0, "max_tokens": 3, "prompt": tok.encode("<user>hi<assistant>")}
    assert chat_request({"messages": body["messages"]}, tok)["max_tokens"] is None  # up to the context
    for bad in ({"messages": []}, {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
                {**body, "tools": [{"type": "function"}]}, {**body, "logprobs": True},
                {**body, "chat_template": "{{ x }}"}):
        with pytest.raises(HTTPError) as e:
            chat_request(bad, tok)
        assert e.value.status == 400
    with pytest.raises(HTTPError, match="no chat template"):
        chat_request(body, CharTokenizer())
    done = {"created": 1, "model": "policy", "usage": {"prompt_tokens": 2}, "choices": [
        {"index": 0, "text": "A", "finish_reason": "stop", "stop_reason": None, "logprobs": None}]}
    answer = chat_response(done)
    assert answer["object"] == "chat.completion" and answer["usage"] == {"prompt_tokens": 2}
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": "A", "tool_calls": []}


def test_the_projects_own_server_answers_the_judge_end_to_end(tmp_path):
    """recipe.inference.serve on a tiny random model with a chat template: the judge's request goes through the
    chat template and the hf engine, and the reply is read (a verdict, or none: the rule's verdict stands)."""
    from recipe.config import TinyArch
    from recipe.envs.base import RewardResult
    from recipe.model import build_tiny_model, build_tokenizer

    folder = tmp_path / "judge"
    tok = build_tokenizer([build_prompt("Q", "12", "12", DIRECT)] * 4 + ["A", "B", "C"], vocab_size=400)
    arch = TinyArch(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=16, moe_intermediate_size=16, n_routed_experts=4,
                    max_position_embeddings=4096)
    build_tiny_model(arch, tok, seed=0).save_pretrained(folder)
    tok.save_pretrained(folder)
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "recipe.inference.serve", str(folder), "--port", "0",
                                 "--threads", "1", "--batch-size", "4"], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (m := re.search(r"serving \S+ on (http://\S+)", log.read_text(errors="replace"))):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.1)
        judge = Judge(m.group(1), style=DIRECT, max_tokens=4, timeout_s=60, tries=1)
        v = judge.ask("How many apples?", "12", "the count is 12, I think")
        assert judge.model == "policy"  # the stand-in's served name, from /v1/models
        assert v.reply is not None, v.error  # the request was taken and answered
        assert v.letter in ("A", "B", "C") or v.error.startswith("judge: no verdict")
        res = judge.recheck(RewardResult(reward=0.0, metrics={"correct": 0.0}), "the count is 12, I think", "q", "12")
        assert res.counts["judge_calls"] == 1 and res.reward == (1.0 if res.counts["judge_flips"] else 0.0)
    finally:
        proc.terminate()
        proc.wait(30)

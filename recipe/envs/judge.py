"""The LLM judge: a second opinion on the answers the rule-based check marked wrong (math, science).

INTELLECT-3 (prime-rl PR 1272, configs/int3/prod/orch.toml) gives its math environment `judge_model =
"opencompass/CompassVerifier-7B"` and the address of a vLLM server of its own (llm-judge.sh: a 1-node job, DP 8,
TP 1). The environment (prime-environments' i3-math, read in a public copy) checks an answer with math-verify
first; only an answer math-verify rejects goes to the judge, and a judge verdict of A (correct) makes it right.
The science environment does likewise. This module does the same for recipe/envs/math.py and science.py:

- The question: the last user message of the row's prompt (the instruction included, as i3-math passes it).
  The reference: the row's answer. The response: the final answer, the text after </think>
  (recipe.chat.parse_final_answer), not only its \\boxed{} part: the judge reads the whole final answer, as in
  i3-math. An answer without one (no </think>, or nothing after it) is not judged.
- The prompt follows CompassVerifier's published format (open-compass/CompassVerifier src/prompts.py): the
  question, the standard answer and the candidate's answer between `<... Begin>` / `<... End>` markers, and a
  verdict of A (CORRECT), B (INCORRECT) or C (INVALID: cut off, repetitive, a refusal). `cot` (i3-math's
  choice, CV_COT_PROMPT there) asks for an analysis ending in `Final Judgment: \\boxed{A}`; `direct` (CV_PROMPT)
  for the letter alone. The wording here is the project's own, not the published text: how much CompassVerifier's
  verdicts depend on the exact wording is **unverified** (its model card claims robustness to prompt styles).
- The request: POST /v1/chat/completions, one user message, greedy (temperature 0), at most rl.judge.max_tokens
  tokens; vLLM renders the judge model's own chat template. The model name is the first one GET /v1/models
  lists (vLLM serves the hub id; recipe.inference.serve, the CPU stand-in, "policy"). i3-math sends no
  sampling arguments at all (the server's defaults); greedy decoding is this project's choice.
- The verdict (parse_verdict): the letter in the last \\boxed{...}; for `direct`, also a reply that is the
  letter alone ("A", "(B)", "C: INVALID") or one of the words CORRECT / INCORRECT / INVALID. Only A changes
  anything: B and C leave the rule's 0.
- Failures never stop a run: a connection refused, HTTP 5xx or a timeout is tried again (rl.judge.tries in
  all, with a short backoff); after the last try, or on any other error (HTTP 4xx, e.g. a prompt longer than
  the judge's context, an answer without a verdict), the sample keeps the rule's verdict and the failure is
  counted (judge_errors). After a verdict that failed every try the judge is left alone for
  rl.judge.cooldown_s: while it is down the verifier costs nothing more than the rules (each skipped sample
  counted as an error too).

Every judged sample carries counts (RewardResult.counts) that the RL orchestrator adds to its counters and
reports each step: judge_calls (samples sent to the judge, or skipped while it cools down), judge_flips (wrong
by the rules, right by the judge) and judge_errors (no verdict: the rule's stands).
"""
from __future__ import annotations

import http.client
import json
import logging
import os
import re
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, replace

from recipe.envs.answers import last_boxed, unwrap_tex
from recipe.chat import parse_final_answer
from recipe.envs.base import Environment, RewardResult
from recipe.errors import ConfigError

log = logging.getLogger(__name__)

URL_ENV = "RECIPE_JUDGE_URL"  # written by the judge job (launch/judge_url), exported by the RL job
BACKOFF_S = (0.5, 2.0)  # the wait after the first failed try, doubled after each further one, up to the second
COT, DIRECT = "cot", "direct"

_HEAD = """\
You grade answers. Decide whether the candidate's final answer agrees with the standard answer.

Rules:
1. The standard answer is right and the question is sound: never dispute them, and do not solve the question
   again; only compare.
2. Look only at the candidate's final answer. Errors in its reasoning do not matter.
3. Form does not matter: equivalent expressions, numbers that agree when rounded sensibly, and answers that
   mean the same thing all match. For formulas, check step by step whether the two are equal.
4. Where the question asks for several parts (blanks, selected options, sub-questions), every part must match;
   a partial match is incorrect. For multiple choice, compare the chosen option and what it says.
5. An answer that is cut off mid-sentence, repeats itself in a loop, or refuses to answer is invalid.

Verdicts:
A - CORRECT: the final answer matches the standard answer.
B - INCORRECT: it does not, or only in part.
C - INVALID: cut off, repetitive, or a refusal.
"""

_COT_TAIL = """\
First analyse step by step: is the answer valid; what does the question require; does the final answer match
the standard answer. Then end with one line, the letter boxed:
Final Judgment: \\boxed{A} - CORRECT, or \\boxed{B} - INCORRECT, or \\boxed{C} - INVALID
"""

_DIRECT_TAIL = """\
Reply with the letter of your verdict alone (A, B or C), nothing else.
"""

_TASK = """
<Original Question Begin>
{question}
<Original Question End>

<Standard Answer Begin>
{reference}
<Standard Answer End>

<Candidate's Answer Begin>
{response}
<Candidate's Answer End>

"""

TEMPLATES = {
    COT: _HEAD + "\n" + _COT_TAIL + _TASK + "Analysis step by step, then Final Judgment:\n",
    DIRECT: _HEAD + "\n" + _DIRECT_TAIL + _TASK + "Verdict:\n",
}
_FIELD = re.compile(r"\{(question|reference|response)\}")
_WORDS = {"CORRECT": "A", "INCORRECT": "B", "INVALID": "C"}
_LETTER = re.compile(r"^[\s*_]*[(\[]?\s*([ABC])\s*[)\]]?(?:\s*[-:.]\s*(?i:correct|incorrect|invalid))?[\s*_.]*$")


def build_prompt(question: str, reference: str, response: str, style: str = COT) -> str:
    """The judge's prompt. The three texts go in as they are, in one pass (braces or a `{reference}` inside
    them are left alone)."""
    values = {"question": question, "reference": reference, "response": response}
    return _FIELD.sub(lambda m: values[m.group(1)], TEMPLATES[style])


def parse_verdict(reply: str, style: str = COT) -> str | None:
    """"A", "B" or "C", or None when the reply holds no verdict (rules in the module docstring)."""
    boxed = last_boxed(reply)
    if boxed is not None:
        v = unwrap_tex(boxed).strip().strip("()[]* ").upper()
        return v if v in ("A", "B", "C") else None
    if style != DIRECT:  # a cot reply may open with "A careful look...": only its boxed verdict counts
        return None
    m = _LETTER.match(reply)  # "A", "(B)", "**A**", "C: INVALID"
    if m:
        return m.group(1)
    return _WORDS.get(reply.strip().strip("*_.").upper())  # "CORRECT", "Incorrect."


@dataclass(frozen=True)
class Verdict:
    letter: str | None  # "A" correct, "B" incorrect, "C" invalid; None: no verdict (error says why)
    reply: str | None = None  # the judge's text; None when no answer came back
    error: str | None = None

    @property
    def correct(self) -> bool:
        return self.letter == "A"


class JudgeUnavailable(Exception):
    """No answer: connection refused or dropped, HTTP 5xx, or a timeout (worth trying again)."""


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the judge is on the cluster's network


def _call(url: str, path: str, body: dict | None, timeout: float):
    """One HTTP call (POST with a JSON body, GET without one); the decoded JSON answer. JudgeUnavailable for
    what may pass, RuntimeError for the rest (HTTP 4xx, an answer that is not JSON)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json"})
    what = f"judge: {req.get_method()} {path} to {url}"
    try:
        with _OPENER.open(req, timeout=timeout) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        detail = " ".join(e.read().decode(errors="replace").split())[:300]
        cls = JudgeUnavailable if e.code >= 500 else RuntimeError
        raise cls(f"{what} failed with HTTP {e.code}: {detail}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        reason = getattr(e, "reason", e)
        if isinstance(reason, TimeoutError) or isinstance(e, TimeoutError):
            raise JudgeUnavailable(f"{what} timed out after {timeout:g} s") from None
        raise JudgeUnavailable(f"{what} failed: {str(reason) or type(reason).__name__}") from None
    try:
        return json.loads(raw)
    except ValueError:
        raise RuntimeError(f"{what}: the answer is not JSON: {raw[:200]!r}") from None


def base_url(url: str) -> str:
    """http://host:8000, http://host:8000/ and http://host:8000/v1 (prime-rl's judge_base_url) alike."""
    url = url.strip().rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


class Judge:
    """A client of one OpenAI-compatible judge server. Thread-safe: samples are judged several at a time."""

    def __init__(self, url: str, *, style: str = COT, max_tokens: int = 1024, timeout_s: float = 120.0,
                 tries: int = 3, cooldown_s: float = 30.0, model: str | None = None):
        if style not in TEMPLATES:
            raise ValueError(f"judge prompt style {style!r}: one of {sorted(TEMPLATES)}")
        self.url = base_url(url)
        self.style = style
        self.max_tokens = int(max_tokens)
        self.timeout_s = float(timeout_s)
        self.tries = max(1, int(tries))
        self.cooldown_s = float(cooldown_s)
        self.model = model  # None: the first model the server lists, asked once
        self._lock = threading.Lock()
        self._down_until = 0.0  # time.monotonic() before which the judge is not asked
        self._down_reason = ""

    def __repr__(self) -> str:
        return f"Judge({self.url}, {self.style}, max_tokens={self.max_tokens})"

    def _model(self) -> str:
        if self.model is None:
            listed = _call(self.url, "/v1/models", None, self.timeout_s)
            try:
                name = listed["data"][0]["id"]
            except (KeyError, IndexError, TypeError):
                raise RuntimeError(f"judge: GET /v1/models at {self.url} lists no model: {str(listed)[:200]}")
            with self._lock:
                self.model = name
        return self.model

    def _reply(self, prompt: str) -> str:
        body = {"model": self._model(), "messages": [{"role": "user", "content": prompt}],
                "max_tokens": self.max_tokens, "temperature": 0.0}
        answer = _call(self.url, "/v1/chat/completions", body, self.timeout_s)
        try:
            content = answer["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise RuntimeError(f"judge: no choices[0].message.content in the answer: {str(answer)[:200]}")
        return content or ""

    def ask(self, question: str, reference: str, response: str) -> Verdict:
        """The judge's verdict on `response`; never raises (a failure is a Verdict without a letter)."""
        with self._lock:
            down = time.monotonic() < self._down_until
            reason = self._down_reason
        if down:
            return Verdict(None, error=f"judge down, not asked (last: {reason})")
        prompt = build_prompt(question, reference, response, self.style)
        wait = BACKOFF_S[0]
        for attempt in range(1, self.tries + 1):
            try:
                reply = self._reply(prompt)
            except JudgeUnavailable as e:
                if attempt < self.tries:
                    time.sleep(wait)
                    wait = min(2 * wait, BACKOFF_S[1])
                    continue
                with self._lock:
                    self._down_until = time.monotonic() + self.cooldown_s
                    self._down_reason = str(e)
                log.warning("%s (%d %s); the rules' verdicts stand, the judge is left alone for %g s", e,
                            self.tries, "try" if self.tries == 1 else "tries", self.cooldown_s)
                return Verdict(None, error=f"{e} ({self.tries} tries)")
            except Exception as e:  # a refused request, an odd answer: this sample only
                log.warning("judge: %s", e)
                return Verdict(None, error=str(e))
            letter = parse_verdict(reply, self.style)
            if letter is None:
                return Verdict(None, reply, error=f"judge: no verdict in the reply: {reply[-200:]!r}")
            return Verdict(letter, reply)
        raise AssertionError("unreachable")

    def recheck(self, result: RewardResult, answer: str | None, question: str, reference: str) -> RewardResult:
        """`result` of a rule-based rubric whose one reward function is `correct` (weight 1), judged again when
        the rules said wrong: a verdict of A makes it right. Masked results, right ones and samples without a
        final answer are returned as they are."""
        if result.masked or result.reward >= 1.0 or not answer or not answer.strip():
            return result
        v = self.ask(question, str(reference), answer)
        counts = dict(result.counts)
        for key, n in (("judge_calls", 1), ("judge_flips", int(v.correct)), ("judge_errors", int(v.letter is None))):
            counts[key] = counts.get(key, 0) + n
        metrics = {**result.metrics, "judge": float(v.correct)}
        if v.correct:
            metrics["correct"] = 1.0
            return replace(result, reward=1.0, metrics=metrics, counts=counts)
        return replace(result, metrics=metrics, counts=counts)


def question_of(prompt: list[dict]) -> str:
    """The last user message's text (i3-math hands the judge the last prompt message)."""
    users = [m for m in prompt if m.get("role") == "user"] or prompt
    return str(users[-1].get("content") or "") if users else ""


def judge_from_config(judge_cfg, environ=None) -> Judge | None:
    """The judge rl.judge asks for, or None when it is off. Its address: rl.judge.url, else $RECIPE_JUDGE_URL
    (the judge job's). ConfigError when the judge is on and neither gives one."""
    if judge_cfg is None or not judge_cfg.enabled:
        return None
    environ = os.environ if environ is None else environ
    url = judge_cfg.url or environ.get(URL_ENV) or None
    if not url:
        raise ConfigError(f"rl.judge.enabled is true but there is no judge to call: set rl.judge.url, or run the "
                          f"judge job first (its address reaches the RL job as ${URL_ENV}), or set "
                          f"rl.judge.enabled=false")
    if not re.match(r"https?://[^/\s]+", url):
        raise ConfigError(f"the judge's address must be http(s)://host:port, got {url!r}")
    return Judge(url, style=str(judge_cfg.prompt), max_tokens=judge_cfg.max_tokens, timeout_s=judge_cfg.timeout_s,
                 tries=judge_cfg.tries, cooldown_s=judge_cfg.cooldown_s)


class JudgedEnvironment(Environment):
    """An environment whose rule-based verdicts a judge may re-check (math, science): with a judge, a sample the
    rubric scores wrong goes to it (Judge.recheck), for the rows `judgeable` accepts."""

    uses_judge = True

    def __init__(self, judge: Judge | None = None):
        self.judge = judge
        self.score_in_parallel = judge is not None  # a judge call waits on the network: several at a time

    def judgeable(self, row: dict) -> bool:
        return True

    def score(self, completion: str, row: dict) -> RewardResult:
        result = super().score(completion, row)
        if self.judge is None or not self.judgeable(row):
            return result
        return self.judge.recheck(result, parse_final_answer(completion), question_of(self.prompt(row)),
                                  row["answer"])

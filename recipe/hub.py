"""Hugging Face Hub access, in one place: the offline switch, a fast reachability check, and one message.

Every hub reference of the recipe (datasets, models, the paper's benchmarks) is pinned to a revision. Before
anything is downloaded the hub is asked to confirm each pinned revision, so a machine without network fails in
seconds with one line that names the references and says what to do, instead of hanging in retries.
With HF_HUB_OFFLINE=1 nothing is asked and only the local cache serves.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

from recipe.errors import HubError

TRUE_VALUES = {"1", "true", "yes", "on"}
HOWTO = ("fill the HF cache on a machine with network (same HF_HOME; `python -m recipe.eval.benchmarks NAME...` "
         "does it for the paper's benchmarks, datasets.load_dataset / from_pretrained at the pinned revision for "
         "the rest), copy that cache here and rerun with HF_HUB_OFFLINE=1")


@dataclass(frozen=True)
class Ref:
    """A pinned hub reference. kind: 'datasets' or 'models' (the hub API's path segment)."""

    kind: str
    id: str
    revision: str

    def __str__(self) -> str:
        return f"{self.id}@{self.revision}"


def offline() -> bool:
    """HF_HUB_OFFLINE / HF_DATASETS_OFFLINE, read at call time (the libraries read them once, at import)."""
    return any(os.environ.get(v, "").strip().lower() in TRUE_VALUES for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def revision_url(base: str, ref: Ref) -> str:
    return f"{base}/api/{ref.kind}/{ref.id}/revision/{urllib.parse.quote(ref.revision, safe='')}"


def _ask(url: str, timeout: float, outcome: dict) -> None:
    """GET url; record the status and the hub's X-Error-Code, or why no HTTP answer came."""
    from huggingface_hub.utils import build_hf_headers

    try:
        request = urllib.request.Request(url, headers=build_hf_headers())  # the token, if one is configured
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            outcome.update(status=resp.status, code=None)
    except urllib.error.HTTPError as e:
        outcome.update(status=e.code, code=e.headers.get("X-Error-Code"))
    except Exception as e:  # URLError, socket errors, bad URLs: all mean "no answer"
        outcome.update(status=None, reason=f"{type(e).__name__}: {getattr(e, 'reason', e)}")


def probe(urls: list[str], timeout: float) -> list[dict]:
    """Ask every url at once; each answer is {status, code} or {status: None, reason}. The requests run in
    daemon threads joined against one deadline, because a socket timeout does not bound DNS resolution."""
    outcomes: list[dict] = [{} for _ in urls]
    workers = [threading.Thread(target=_ask, args=(u, timeout, o), daemon=True) for u, o in zip(urls, outcomes)]
    for w in workers:
        w.start()
    deadline = time.monotonic() + timeout
    for w in workers:
        w.join(max(0.0, deadline - time.monotonic()))
    return [o if o else {"status": None, "reason": f"no answer within {timeout:g}s"} for o in outcomes]


def ensure_reachable(refs: list[Ref], timeout: float, error: type[Exception] = HubError) -> None:
    """Return when the hub confirms every pinned revision (or offline mode is on); else raise `error` with one
    line naming the references. An HTTP answer without the hub's X-Error-Code header comes from a proxy or a
    firewall, not from the hub."""
    if offline():
        return
    base = endpoint()
    answers = probe([revision_url(base, r) for r in refs], timeout)
    unreachable = []
    for ref, answer in zip(refs, answers):
        status, code = answer["status"], answer.get("code")
        if status is not None and 200 <= status < 300:
            continue
        if code or status == 401:  # the hub answered: the id or the revision is wrong (or private)
            said = f"{status} {code}" if code else str(status)
            raise error(f"the Hugging Face Hub ({base}) answered {said} for {ref}: check the id and the pinned "
                        f"revision (a private repository needs HF_TOKEN)")
        unreachable.append((ref, answer.get("reason") or f"HTTP {status} from something that is not the hub"))
    if unreachable:
        names = " and ".join(str(r) for r, _ in unreachable)
        raise error(f"cannot load {names}: the Hugging Face Hub ({base}) is unreachable ({unreachable[0][1]}); "
                    f"{HOWTO}")


@contextlib.contextmanager
def libraries_offline():
    """Make datasets and huggingface_hub honour an offline flag set after they were imported; restored after."""
    import datasets
    from huggingface_hub import constants

    saved = datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE = saved

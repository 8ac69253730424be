"""The models `make eval` evaluates, one an entry of eval.checkpoints, each with its own results folder, key and
provenance.

    base, sft, rl                      this run's stages (base of a hub preset is model.hub_id at model.revision)
    a name of eval.released            a released model of the paper's table (`intellect3`: INTELLECT-3,
                                       GLM-4.5-Air) at the revision the preset pins
    hub:<org>/<name>@<40-hex commit>   any hub model at a pinned revision
    a path with a /                    a local model folder (what save_pretrained writes)

A hub model is read through the Hugging Face cache at its revision. Before any work every hub entry is located:
offline (HF_HUB_OFFLINE=1) in the cache alone, online by asking the hub to confirm the revision (seconds when it
cannot be reached) and fetching the small files (config, tokenizer, generation_config.json, the weights' index).
Its weights are fetched only when there is something to evaluate; offline, every file the index names must be in
the cache. A hub model's key is its id and commit, which name its bytes; a folder's is the sha256 of its files
(recipe.runs.sha256_tree). Each results.json records the model in its provenance, `provenance.model`
(describe): the entry, the kind, the hub id, the revision and whether a primary source confirms it, and the
sha256 of the weights' index (or of the one weights file) where the folder has one.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from pathlib import Path

from recipe import hub
from recipe.config import CheckpointName, checkpoint_entry
from recipe.errors import HubError, StageError
from recipe.model import check_model_folder
from recipe.runs import HASH_LIMIT, require_done, sha256_file, sha256_tree, stage_dir
from recipe.weights import INDEX_NAME

SINGLE_WEIGHTS = "model.safetensors"
# what is fetched of a hub model before any work: all but the weights (the index is a .json)
METADATA = ["*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken", "*.py", "*.md"]
STAGES = [c.value for c in CheckpointName]


@dataclass(frozen=True)
class EvalModel:
    entry: str  # as eval.checkpoints names it
    folder: str  # its results folder under eval/
    kind: str  # stage (a model folder of this run), hub, local
    stage: str | None = None  # base, sft or rl: the stage it is (base of a hub preset is kind hub)
    hub_id: str | None = None
    revision: str | None = None
    revision_verified: bool | None = None  # eval.released's flag; None: pinned by the entry or the model config
    revision_source: str | None = None
    paper_row: str | None = None  # the paper's row its benchmark scores are set beside (RESULTS.md)
    path: Path | None = None  # the model folder (a hub model's snapshot in the HF cache once located)

    @property
    def ref(self) -> str:
        """What the model is, in one word: id@revision of a hub model, else its folder."""
        return f"{self.hub_id}@{self.revision}" if self.kind == "hub" else str(self.path)

    def key(self) -> str:
        """The model's part of every results key: id@commit of a hub model (the commit fixes the bytes), else a
        digest of the sha256 of every file of the folder (a changed file starts the eval over)."""
        if self.kind == "hub":
            return self.ref
        return hashlib.sha256(json.dumps(sha256_tree(self.path), sort_keys=True).encode()).hexdigest()[:16]

    def describe(self) -> dict:
        """What a results.json records about the model."""
        out = {"entry": self.entry, "kind": self.kind, "folder": self.folder, "stage": self.stage,
               "hub_id": self.hub_id, "revision": self.revision, "paper_row": self.paper_row}
        if self.revision_verified is not None:
            out.update(revision_verified=self.revision_verified, revision_source=self.revision_source)
        if self.kind == "local":
            out["path"] = str(self.path)
        return {**out, **(weights_digest(self.path) if self.path is not None else {})}


def weights_digest(folder: Path) -> dict:
    """sha256 of the weights' index (model.safetensors.index.json), or of the one weights file when there is no
    index and it is small enough to hash; {} when the folder has neither (yet)."""
    folder = Path(folder)
    if (folder / INDEX_NAME).is_file():
        return {"index_sha256": sha256_file(folder / INDEX_NAME)}
    single = folder / SINGLE_WEIGHTS
    if single.is_file() and single.stat().st_size <= HASH_LIMIT:
        return {"weights_sha256": sha256_file(single)}
    return {}


def folder_name(kind: str, entry: str, hub_id: str | None = None, revision: str | None = None) -> str:
    """The results folder of an entry: a stage's or a released model's own name; hub--<org>--<name>--<commit
    head> for a hub reference; local--<folder name>--<digest of its absolute path> for a folder (two folders of
    one name do not share results)."""
    if kind in ("stage", "released"):
        return entry
    if kind == "hub":
        return f"hub--{hub_id.replace('/', '--')}--{revision[:12]}"
    path = Path(entry).expanduser().resolve()
    return f"local--{path.name or 'model'}--{hashlib.sha256(str(path).encode()).hexdigest()[:8]}"


def paper_rows(ev) -> dict[str, str]:
    """hub id -> the paper's row of that model (eval.released names both)."""
    return {m.hub_id: m.name for m in ev.released}


def model_for(cfg, entry: str) -> EvalModel | None:
    """The model of one eval.checkpoints entry, its folder checked (a hub model located: locate); None for a
    stage of this run that has not finished. A stage finished under another config is refused
    (recipe.runs.require_done)."""
    ev = cfg.eval
    released = {m.name: m for m in ev.released}
    kind, hub_id, revision = checkpoint_entry(entry, list(released))
    if kind == "stage":
        if entry == "base" and cfg.model.hub_id:
            return locate(EvalModel(entry, entry, "hub", stage="base", hub_id=cfg.model.hub_id,
                                    revision=cfg.model.revision, paper_row=paper_rows(ev).get(cfg.model.hub_id)),
                          ev.hub_timeout_s)
        if not (stage_dir(cfg, entry) / "DONE.json").exists():
            return None
        return EvalModel(entry, entry, "stage", stage=entry, path=require_done(cfg, entry, by="eval") / "model")
    if kind == "released":
        m = released[entry]
        return locate(EvalModel(entry, folder_name(kind, entry), "hub", hub_id=m.hub_id, revision=m.revision,
                                revision_verified=bool(m.revision_verified), revision_source=m.revision_source,
                                paper_row=m.name), ev.hub_timeout_s)
    if kind == "hub":
        return locate(EvalModel(entry, folder_name(kind, entry, hub_id, revision), "hub", hub_id=hub_id,
                                revision=revision, paper_row=paper_rows(ev).get(hub_id)), ev.hub_timeout_s)
    path = Path(entry).expanduser()
    if not path.is_dir():
        raise StageError(f"eval.checkpoints: model folder {entry} does not exist (a hub model is written "
                         f"hub:<org>/<name>@<40-hex commit>)")
    check_model_folder(path)
    return EvalModel(entry, folder_name(kind, entry), "local", path=path.resolve())


def _failure(model: EvalModel, what: str) -> HubError:
    return HubError(f"eval.checkpoints '{model.entry}': {what}")


def locate(model: EvalModel, timeout: float) -> EvalModel:
    """The hub model with its snapshot folder in the HF cache: offline, the cache's (an error naming the model
    when it is not there); online, once the hub has confirmed the revision, with every file but the weights
    fetched. Fails in seconds without network: the hub is asked with a timeout before anything is downloaded."""
    from huggingface_hub import constants, snapshot_download

    if not model.revision:
        raise _failure(model, f"model {model.hub_id} has no revision; every hub reference must be pinned")
    if hub.offline():
        try:
            path = snapshot_download(model.hub_id, revision=model.revision, local_files_only=True)
        except Exception as e:  # LocalEntryNotFoundError, and anything else the cache lookup raises
            raise _failure(model, f"{model.ref} is not in the local HF cache ({constants.HF_HUB_CACHE}; offline mode "
                                  f"is on: {type(e).__name__}); {hub.HOWTO}") from None
        return replace(model, path=Path(path))
    try:
        hub.ensure_reachable([hub.Ref("models", model.hub_id, model.revision)], timeout)
    except HubError as e:
        raise _failure(model, str(e)) from None
    return replace(model, path=Path(_download(model, allow_patterns=METADATA)))


def _download(model: EvalModel, allow_patterns=None) -> str:
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(model.hub_id, revision=model.revision, allow_patterns=allow_patterns)
    except Exception as e:  # connection, gated repository, disk: one line that names the model
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise _failure(model, f"cannot download {model.ref}: {type(e).__name__}: {first[:200]}") from None


def fetch_weights(model: EvalModel) -> None:
    """A hub model's weights in its snapshot folder, before an engine loads it: downloaded online (files already
    in the cache are kept), checked offline against the index (or the one weights file). A no-op for folders."""
    if model.kind != "hub":
        return
    if not hub.offline():
        print(f"eval: {model.entry}: fetching {model.ref} into the HF cache (files already there are kept)")
        _download(model)
        return
    index = model.path / INDEX_NAME
    if index.is_file():
        try:
            needed = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError) as e:
            raise _failure(model, f"{index} is not a weights index ({type(e).__name__}: {e})") from None
    else:
        needed = [SINGLE_WEIGHTS]
    missing = [n for n in needed if not (model.path / n).is_file()]
    if missing:
        raise _failure(model, f"the HF cache's snapshot of {model.ref} lacks {missing[0]}"
                              f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''} (offline mode is on; "
                              f"{hub.HOWTO})")

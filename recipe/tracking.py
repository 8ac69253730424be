"""Experiment tracking: logging.report_to is none (the default), tensorboard, wandb or trackio, for every stage.

base and sft log through the Trainer's own integration of that name (TrainingArguments.report_to: TrainerTracking
points it at the stage folder); RL and eval log through a Tracker (open_tracker) that writes the same backends.
Each stage is one run, named <preset>-<stage>, with the resolved config attached, and writes under
<stage folder>/tracking/, so a fresh or forced run of the stage wipes it with the rest of the folder:

- tensorboard/: event files (`tensorboard --logdir runs/<preset>` shows every stage);
- wandb/: wandb's own folder; online or offline as WANDB_MODE says (offline: `wandb sync` uploads it later);
- trackio/: trackio's local store (TRACKIO_DIR; `trackio show` reads it).

Only rank 0 logs (the Trainer's integrations check it themselves; RL opens its tracker on rank 0 alone).
metrics.jsonl stays the record the recipe reads; a tracker is a view of the same numbers. Progress bars are
untouched.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
from pathlib import Path

from omegaconf import OmegaConf
from transformers import TrainerCallback

from recipe.config import ReportTo
from recipe.errors import ConfigError, StageError
from recipe.runs import environ

EXTRA = "pip install -e .[tracking]"
PACKAGES = {ReportTo.tensorboard: "tensorboard", ReportTo.wandb: "wandb", ReportTo.trackio: "trackio"}


def tracking_dir(stage_dir) -> Path:
    return Path(stage_dir) / "tracking"


def run_name(cfg, stage: str) -> str:
    return f"{cfg.preset}-{stage}"


def require_package(report_to) -> None:
    """A backend whose package is missing stops the stage before it does any work, in one line."""
    package = PACKAGES.get(report_to)
    if package and importlib.util.find_spec(package) is None:
        raise ConfigError(f"config error: logging.report_to={report_to} needs the {package} package, which is not "
                          f"installed: {EXTRA} (the `tracking` extra)")


def scalars(record: dict, prefix: str = "") -> dict[str, float]:
    """The numbers of a record, a nested dict's as prefix/key (reward_by_env/math); text and flags left out."""
    out = {}
    for k, v in record.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(scalars(v, f"{key}/"))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[key] = v
    return out


def _config(cfg) -> dict:
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)


def _config_text(cfg) -> str:
    """The resolved config as TensorBoard's text tab shows it (markdown: indented is verbatim)."""
    return "\n".join("    " + line for line in OmegaConf.to_yaml(cfg, resolve=True).splitlines())


def _import_trackio(store: Path):
    """trackio reads its store's folder (TRACKIO_DIR) once, when first imported: set it before. Each stage runs in
    a process of its own, so a process that imported it for another folder is a misuse, said as such."""
    os.environ["TRACKIO_DIR"] = str(store)
    import trackio
    from trackio import utils

    if Path(utils.TRACKIO_DIR).resolve() != store:
        raise StageError(f"trackio was imported in this process for the store {utils.TRACKIO_DIR}, not {store}: "
                         f"run each stage in a process of its own")
    return trackio


class Tracker:
    """logging.report_to=none: logs nothing and writes nothing. The backends below write a run."""

    def log(self, metrics: dict, step: int) -> None:
        """The numbers of `metrics` (a metrics.jsonl record: its own `step` key is the x axis, not a metric)."""
        numbers = scalars({k: v for k, v in metrics.items() if k != "step"})
        if numbers:
            self._write(numbers, step)

    def _write(self, numbers: dict[str, float], step: int) -> None:
        pass

    def close(self, failed: bool = False) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc) -> None:
        # an error fails the run; a stop request (Stopped, Ctrl-C: BaseExceptions) ends it for the next run to resume
        self.close(failed=exc_type is not None and issubclass(exc_type, Exception))


class TensorBoardTracker(Tracker):
    def __init__(self, cfg, folder: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(folder / "tensorboard"))
        self.writer.add_text("config", _config_text(cfg))

    def _write(self, numbers, step):
        for k, v in numbers.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()  # readable while the stage runs, and nothing lost to a kill

    def close(self, failed=False):
        self.writer.close()


class WandbTracker(Tracker):
    def __init__(self, cfg, folder: Path, stage: str):
        import wandb

        self.run = wandb.init(project=cfg.logging.project, name=run_name(cfg, stage), group=cfg.preset,
                              job_type=stage, config=_config(cfg), dir=str(folder))

    def _write(self, numbers, step):
        self.run.log(numbers, step=step)

    def close(self, failed=False):
        self.run.finish(exit_code=1 if failed else 0)  # wandb shows a failed stage as failed, not finished


class TrackioTracker(Tracker):
    def __init__(self, cfg, folder: Path, stage: str):
        trackio = _import_trackio(folder / "trackio")
        # resume="allow": a resumed stage continues its run, as the Trainer's integration does for SFT
        self.run = trackio.init(project=cfg.logging.project, name=run_name(cfg, stage), group=cfg.preset,
                                config=_config(cfg), resume="allow")

    def _write(self, numbers, step):
        self.run.log(numbers, step=step)

    def close(self, failed=False):
        self.run.finish()  # (trackio's runs have no exit status)


def open_tracker(cfg, stage: str, stage_dir) -> Tracker:
    """The tracker of one stage's run (rank 0 only). A context manager: the run is closed however the stage
    ends."""
    report_to = cfg.logging.report_to
    if report_to == ReportTo.none:
        return Tracker()
    require_package(report_to)
    folder = tracking_dir(stage_dir).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    if report_to == ReportTo.tensorboard:
        return TensorBoardTracker(cfg, folder)
    if report_to == ReportTo.wandb:
        return WandbTracker(cfg, folder, stage)
    return TrackioTracker(cfg, folder, stage)


class TrainerTracking:
    """The Trainer's side (base, sft): TrainingArguments' report_to, run_name and project, the environment that
    points its integration at the stage folder, and a callback that attaches the recipe's config to the run (the
    integrations attach the Trainer's arguments and the model's config). Built on every rank: the integrations
    log on rank 0 alone."""

    def __init__(self, cfg=None, stage: str = "sft", stage_dir=None):
        self.report_to = cfg.logging.report_to if cfg is not None else ReportTo.none
        self.cfg, self.stage = cfg, stage
        if self.report_to == ReportTo.none:
            return
        require_package(self.report_to)
        self.folder = tracking_dir(stage_dir).resolve()

    @property
    def args(self) -> dict:
        if self.report_to == ReportTo.none:
            return {"report_to": "none"}
        args = {"report_to": str(self.report_to), "run_name": run_name(self.cfg, self.stage),
                "project": self.cfg.logging.project}
        if self.report_to == ReportTo.trackio:
            args["trackio_static_space_id"] = False  # local only: no Space on the hub, even at a hub push
        return args

    @property
    def callbacks(self) -> list:
        return [] if self.report_to == ReportTo.none else [RunCallback(self)]

    @contextlib.contextmanager
    def environment(self):
        """The integrations take their folders (and wandb its project) from the environment: set for the block,
        which must hold both the Trainer's construction and its train() (they read them at either)."""
        env = {}
        if self.report_to == ReportTo.tensorboard:
            env["TENSORBOARD_LOGGING_DIR"] = str(self.folder / "tensorboard")
        elif self.report_to == ReportTo.wandb:
            env.update(WANDB_DIR=str(self.folder), WANDB_PROJECT=self.cfg.logging.project,
                       WANDB_RUN_GROUP=self.cfg.preset, WANDB_JOB_TYPE=self.stage)
        elif self.report_to == ReportTo.trackio:
            env["TRACKIO_DIR"] = str(self.folder / "trackio")
        if env:
            self.folder.mkdir(parents=True, exist_ok=True)
        with environ(env):
            if self.report_to == ReportTo.trackio:
                _import_trackio(self.folder / "trackio")  # (the integration imports it when the Trainer is built)
            elif self.report_to == ReportTo.wandb:
                import wandb

                wandb.teardown()  # wandb reads the environment at its first run in a process: read it afresh, ours
            yield


class RunCallback(TrainerCallback):
    """Attaches the recipe's resolved config to the run the Trainer's integration opened (it runs after the
    integrations' own on_train_begin, which set the run up), and ends a wandb run with the training (the
    integration leaves it open until the process exits)."""

    def __init__(self, tracking: TrainerTracking):
        self.tracking = tracking

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        t = self.tracking
        if t.report_to == ReportTo.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # a second event file in the integration's folder: TensorBoard reads both as one run
            with SummaryWriter(log_dir=str(t.folder / "tensorboard")) as writer:
                writer.add_text("config", _config_text(t.cfg))
        elif t.report_to == ReportTo.wandb:
            import wandb

            wandb.run.config.update({"recipe": _config(t.cfg)}, allow_val_change=True)
        elif t.report_to == ReportTo.trackio:
            import trackio

            trackio.config.update({"recipe": _config(t.cfg)})

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self.tracking.report_to == ReportTo.wandb:
            import wandb

            wandb.finish()

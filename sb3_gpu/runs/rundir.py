"""A run directory: the one place that names its files, makes it, locks it, and finds the states saved in it."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from sb3_gpu.common.errors import ConfigError
from sb3_gpu.common.io import (
    atomic_write_text,
    check_dir_creatable,
    check_utf8,
    companion_of,
    make_dir,
    open_no_follow,
    refuse_links,
    temporary_owner,
)

try:
    import fcntl
except ImportError:  # Windows: msvcrt's byte-range lock instead
    fcntl = None  # type: ignore[assignment]


def _taken(path: Path) -> str:
    return f"run dir {path} already exists; choose a new --run-dir (runs are never overwritten)"


def _lock_or_raise(f: Any) -> None:
    """Take ``f``'s exclusive lock without waiting, or raise BlockingIOError where another process holds it."""
    if fcntl is not None:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
    import msvcrt  # type: ignore[import-not-found,unused-ignore]

    f.seek(_WINDOWS_LOCK_BYTE)  # a byte past the pid, so that the process refused can still read who holds it
    try:
        msvcrt.locking(f.fileno(), msvcrt.LK_NBLCK, 1)  # type: ignore[attr-defined,unused-ignore]
    except OSError as e:
        raise BlockingIOError(str(e)) from None
    finally:
        f.seek(0)


_WINDOWS_LOCK_BYTE = 1 << 20


@dataclass(frozen=True)
class SavedState:
    """One resumable point of a run: a model and the files saved with it (None where absent)."""

    model: Path
    timesteps: int
    vecnormalize: Path | None
    replay_buffer: Path | None


def _drop_episodes_after(path: Path, cutoff: float) -> int:
    """Rewrite a Monitor file without the episodes that ended after ``cutoff`` (seconds since the epoch, as its
    header's ``t_start`` plus each episode's ``t``), which are appended to ``N.segK.dropped.csv``; the number moved. A
    file it cannot read is left as it is."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        start = float(json.loads(lines[0][1:])["t_start"])
    except (OSError, UnicodeDecodeError, ValueError, KeyError, IndexError, TypeError):
        return 0
    kept, dropped = lines[:2], list[str]()
    for line in lines[2:]:
        try:
            ended = start + float(line.split(",")[2])
        except (ValueError, IndexError):
            ended = math.inf  # a half-written last line: set aside with the episodes after the checkpoint
        (kept if ended <= cutoff else dropped).append(line if line.endswith("\n") else line + "\n")
    if dropped:
        aside = path.with_name(path.name.removesuffix(".monitor.csv") + ".dropped.csv")
        with aside.open("a", encoding="utf-8") as f:  # before the rewrite: a stop between the two loses nothing
            f.writelines(lines[:2] if f.tell() == 0 else [])
            f.writelines(dropped)
        atomic_write_text(path, "".join(kept))
    return len(dropped)


@dataclass(frozen=True)
class StateFiles:
    """Where a model and the files saved with it go."""

    model: Path
    vecnormalize: Path
    replay_buffer: Path


# SB3 keeps a model's hyperparameters as JSON in the zip's `data` member: kilobytes. A larger one is refused before
# it is inflated (a zip can inflate a few bytes into gigabytes).
MAX_ZIP_DATA_BYTES = 16 << 20


def read_zip_data(path: Path) -> dict[str, Any]:
    """A model zip's ``data`` JSON, after checking every member against its CRC; ConfigError when unreadable."""
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()  # inflates each member in chunks: a directory that lies is caught here
            with archive.open("data") as member:
                raw = member.read(MAX_ZIP_DATA_BYTES + 1)
    except Exception as e:  # a truncated, foreign or lying zip fails in many ways inside zipfile and zlib
        raise ConfigError(f"{path} is not a readable SB3 model zip ({type(e).__name__}: {e})") from None
    if damaged is not None:
        raise ConfigError(f"{path} is damaged: its member {damaged!r} fails its CRC check")
    if len(raw) > MAX_ZIP_DATA_BYTES:
        raise ConfigError(f"{path}: its 'data' member inflates past {MAX_ZIP_DATA_BYTES >> 20} MiB; SB3 writes kilobytes")
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise ConfigError(f"{path} is not a readable SB3 model zip (its 'data' entry is not JSON: {e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is not a readable SB3 model zip (its 'data' entry is not a JSON object)")
    return data


def zip_timesteps(path: Path) -> int | None:
    """``num_timesteps`` recorded in a model zip, read without loading the model (None if unreadable)."""
    try:
        value = read_zip_data(path).get("num_timesteps")
    except ConfigError:
        return None
    return value if isinstance(value, int) else None


def zip_saved_at(path: Path) -> float | None:
    """When sb3_gpu saved a model zip (seconds since the epoch, by the saving process's clock); None where it did
    not say (an older or a foreign zip) or the zip is unreadable."""
    try:
        value = read_zip_data(path).get("_sb3_gpu_saved_at")
    except ConfigError:
        return None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


class RunDir:
    """A run directory written by ``sb3_gpu.train``; every file name in it is spelled here and nowhere else."""

    DEFAULT_PARENT = Path("runs")  # where a run dir goes when none is named
    # The names SB3's EvalCallback gives these two.
    BEST_MODEL = "best_model.zip"
    EVALUATIONS = "evaluations.npz"
    # Where SB3's EvalCallback writes evaluations.npz before it is complete and renamed into place.
    SCRATCH = ".partial"
    _CHECKPOINT = re.compile(r"model_(\d+)_steps\.zip")
    _CHECKPOINT_BUFFER = re.compile(r"model_replay_buffer_(\d+)_steps\.pkl")

    def __init__(self, path: str | Path):
        if not isinstance(path, (str, os.PathLike)):
            raise ConfigError(f"run dir: expected a folder path, got {path!r}")
        self.path = Path(path)

    def __str__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    # ------------------------------------------------------------------ names
    @property
    def config(self) -> Path:
        return self.path / "config.yaml"

    @property
    def summary(self) -> Path:
        return self.path / "summary.json"

    @property
    def final(self) -> StateFiles:
        """The model saved when the run ended, stopped or crashed, and its companions."""
        return StateFiles(self.path / "model.zip", self.path / "vecnormalize.pkl", self.path / "replay_buffer.pkl")

    @property
    def best_model(self) -> Path:
        return self.path / self.BEST_MODEL

    @property
    def best_vecnormalize(self) -> Path:
        return self.path / "best_vecnormalize.pkl"

    @property
    def curves(self) -> Path:
        return self.path / "curves.png"

    @property
    def tensorboard(self) -> Path:
        return self.path / "tb"

    @property
    def videos(self) -> Path:
        return self.path / "videos"

    def video_for(self, model: Path) -> Path:
        """Where ``evaluate --video`` writes a model's video: named after the model's file."""
        return self.videos / f"{model.stem}.mp4"

    @property
    def monitor(self) -> Path:
        return self.path / "monitor"

    @property
    def eval(self) -> Path:
        return self.path / "eval"

    @property
    def evaluations(self) -> Path:
        return self.eval / self.EVALUATIONS

    @property
    def best_record(self) -> Path:
        """How the best model was chosen and its figure (written after the model)."""
        return self.eval / "best.json"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def lock_file(self) -> Path:
        return self.path / ".lock"

    def checkpoint(self, timesteps: int) -> StateFiles:
        """The files of the checkpoint at ``timesteps`` (SB3's CheckpointCallback names, prefix ``model``)."""
        folder = self.checkpoints
        return StateFiles(
            folder / f"model_{timesteps}_steps.zip",
            folder / f"model_vecnormalize_{timesteps}_steps.pkl",
            folder / f"model_replay_buffer_{timesteps}_steps.pkl",
        )

    def drop_older_checkpoint_buffers(self, timesteps: int) -> list[Path]:
        """Remove the replay buffers of the checkpoints before ``timesteps``; the removed files.

        Each is a whole copy of the buffer (gigabytes for a large one), and ``--resume`` takes the newest state, so
        only the newest checkpoint's is kept; its older models stay, to resume from with an empty buffer.
        """
        removed = []
        for path in self.checkpoints.glob("model_replay_buffer_*_steps.pkl"):
            match = self._CHECKPOINT_BUFFER.fullmatch(path.name)
            if match and int(match.group(1)) < timesteps:
                path.unlink(missing_ok=True)
                removed.append(path)
        return removed

    def drop_older_final_buffer(self, timesteps: int) -> Path | None:
        """Remove the final model's replay buffer where that model is older than ``timesteps`` or cannot be read (a
        resumed run's newer checkpoint was just written whole): ``--resume`` takes the newer checkpoint, and keeping
        this buffer made a third copy on disk."""
        buffer = self.final.replay_buffer
        steps = zip_timesteps(self.final.model) if buffer.is_file() else None
        if buffer.is_file() and (steps is None or steps < timesteps):
            buffer.unlink(missing_ok=True)
            return buffer
        return None

    def remove_stale_temporaries(self) -> list[Path]:
        """Remove the temp files of writes that a kill cut short (a half-written replay buffer, gigabytes under a
        hidden name): only those of models and pickles, which only training writes, under the lock (``plot`` writes
        ``curves.png`` here without it), and only those whose writing process is gone."""
        import psutil

        removed = []
        for folder in (self.path, self.checkpoints):
            for path in folder.glob(".*.tmp-*") if folder.is_dir() else ():
                owner = temporary_owner(path.name)
                target = path.name.rsplit(".tmp-", 1)[0]
                if owner is None or not target.endswith((".zip", ".pkl")) or not path.is_file():
                    continue
                if owner != os.getpid() and psutil.pid_exists(owner):
                    continue
                path.unlink(missing_ok=True)
                removed.append(path)
        return removed

    # ------------------------------------------------------------------ making and locking
    @classmethod
    def create(cls, requested: str | Path | None, algo: str, env_name: str) -> RunDir:
        """A new run dir: ``requested``, which must not exist, or ``runs/ALGO-ENV-TIMESTAMP``. Never one in use."""
        if requested is not None:
            path = cls.check_new(requested)
            try:
                return cls(make_dir(path, "run dir", exist_ok=False))
            except FileExistsError:  # made since the check: another run started with the same --run-dir
                raise ConfigError(_taken(path)) from None
        env = re.sub(r"[^A-Za-z0-9_.-]+", "_", env_name)
        base = cls.DEFAULT_PARENT / f"{algo}-{env}-{datetime.now():%Y%m%d-%H%M%S}"
        for i in range(1, 1000):
            path = base if i == 1 else base.with_name(f"{base.name}-{i}")
            try:
                return cls(make_dir(path, "run dir", exist_ok=False))
            except FileExistsError:
                continue
        raise ConfigError(f"could not find a free run dir name beside {base}")  # pragma: no cover

    @classmethod
    def check_default(cls) -> None:
        """Refuse, before any planning, a working folder where :meth:`create` could make no run dir of its own."""
        check_dir_creatable(cls.DEFAULT_PARENT, "the runs folder")

    @staticmethod
    def check_new(requested: str | Path) -> Path:
        """Refuse, before any planning, a requested run dir that :meth:`create` would refuse: one that exists, or one
        that cannot be made."""
        if not isinstance(requested, (str, os.PathLike)):
            raise ConfigError(f"run dir: expected a folder path, got {requested!r}")
        path = Path(requested)
        try:
            taken = path.exists() or path.is_symlink()
        except OSError:  # a name too long, say: check_dir_creatable says so in its words
            taken = False
        if taken:
            raise ConfigError(_taken(path))
        return check_dir_creatable(path, "run dir", utf8=True)

    def check_resumable(self) -> None:
        """Refuse, in one line, a ``--resume`` target that is no run dir: missing, a file, or without its config."""
        if self.path.exists() and not self.path.is_dir():
            raise ConfigError(f"cannot resume {self}: it is a file; give the run dir that holds config.yaml")
        if not self.path.is_dir():
            raise ConfigError(f"cannot resume {self}: no such run dir")
        if not self.config.is_file() and (pid := self.holder()) is not None:
            raise ConfigError(f"cannot resume {self}: a run is starting there (pid {pid}) and has not written its config.yaml")
        if not self.config.is_file():
            raise ConfigError(f"cannot resume {self}: it holds no config.yaml; is it a run dir written by sb3_gpu.train?")
        check_utf8(self.path, "run dir")  # before its model is built: TensorBoard would fail on it once training began

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """One process per run dir: a second ``--resume`` of a running run would interleave their files. The lock
        file exists while a process works in the run dir and is removed when it is done."""
        self.refuse_links()
        try:
            with os.fdopen(open_no_follow(self.lock_file), "r+") as f:
                try:
                    _lock_or_raise(f)
                except BlockingIOError:
                    pid = f.read().strip() or "?"
                    raise ConfigError(f"{self.path} is in use by another sb3_gpu process (pid {pid})") from None
                try:
                    current = os.stat(self.lock_file)
                except FileNotFoundError:
                    current = None
                if current is None or not os.path.samestat(os.fstat(f.fileno()), current):
                    # The process that held it removed it as it finished: the lock it released belongs to no one now.
                    raise ConfigError(f"{self.path} was in use by another sb3_gpu process that just finished; try again")
                try:
                    f.truncate()
                    f.write(str(os.getpid()))
                    f.flush()
                except OSError as e:  # a full disk: the error names no file of its own
                    raise OSError(e.errno, e.strerror, str(self.lock_file)) from None
                self.remove_stale_temporaries()
                try:
                    yield
                finally:
                    # Removed while still held: a process that opened it before finds it locked, then gone (above).
                    with contextlib.suppress(OSError):
                        self.lock_file.unlink()
        finally:
            if fcntl is None:  # Windows removes no open file: once closed (one another process opened stays, as it must)
                with contextlib.suppress(OSError):
                    self.lock_file.unlink()

    def holder(self) -> int | None:
        """The process at work in this run dir (the pid its lock file names, where the lock is held), for the messages
        that refuse what it has not written yet; None where there is none. A killed run leaves its lock file, whose
        pid another process may have by now: the lock itself says whether anyone holds it."""
        import psutil

        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)  # a FIFO must not block
        try:
            fd = os.open(self.lock_file, flags)
        except OSError:
            return None
        with os.fdopen(fd, "rb") as f:
            try:
                pid = int(f.read(64).strip())
            except (OSError, ValueError):
                return None
            if fcntl is not None:  # the lock says (a run on another machine of a shared disk too); held an instant
                try:
                    fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:
                    return pid
                fcntl.flock(f, fcntl.LOCK_UN)
                return None
        # Windows: its lock is on a byte past the pid; the pid's process alive must do
        return pid if pid != os.getpid() and psutil.pid_exists(pid) else None

    def refuse_links(self) -> None:
        """Refuse a run dir that holds a symbolic link: sb3_gpu and SB3 write inside it and would write through it."""
        refuse_links(self.path, "run dir")

    def set_monitor_files_aside(self) -> None:
        """Keep the earlier segments' episodes (SB3's Monitor truncates its file); the plots read every segment."""
        if not self.monitor.is_dir():
            return
        segment = 1 + len({p.name.split(".")[1] for p in self.monitor.glob("*.seg*.monitor.csv")})
        for path in self.monitor.glob("*.monitor.csv"):
            if ".seg" not in path.name:
                path.rename(path.with_name(path.name.replace(".monitor.csv", f".seg{segment}.monitor.csv")))

    def set_episodes_aside_after(self, saved_at: float) -> int:
        """Move the earlier segments' episodes that ended after ``saved_at`` (a checkpoint resumed from, which trains
        their steps again) out of the curves, into ``N.segK.dropped.csv`` beside them; how many."""
        return sum(_drop_episodes_after(path, saved_at) for path in sorted(self.monitor.glob("*.seg*.monitor.csv")))

    # ------------------------------------------------------------------ finding what was saved
    def saved_states(self, on_skip: Callable[[str], None] | None = None) -> list[SavedState]:
        """Every readable model of the run (the final one and the checkpoints), newest first.

        :param on_skip: told why each unreadable model zip was passed over
        """
        candidates = [self.final] if self.final.model.is_file() else []
        if self.checkpoints.is_dir():
            for path in self.checkpoints.glob("model_*_steps.zip"):
                match = self._CHECKPOINT.fullmatch(path.name)
                if match:
                    candidates.append(self.checkpoint(int(match.group(1))))
        found = []
        for files in candidates:
            steps = zip_timesteps(files.model)
            if steps is None and on_skip is not None:
                try:
                    read_zip_data(files.model)
                    on_skip(f"skipped {files.model}: it records no num_timesteps")
                except ConfigError as e:
                    on_skip(f"skipped {e}")
            if steps is not None:
                vecnormalize = companion_of(files.vecnormalize, files.model)
                replay_buffer = files.replay_buffer if files.replay_buffer.is_file() else None
                found.append(SavedState(files.model, steps, vecnormalize, replay_buffer))
        # Newest first; at equal timesteps the final model (written at the stop) wins over a checkpoint of that step.
        return sorted(found, key=lambda s: (s.timesteps, s.model == self.final.model), reverse=True)

    def last_good(self) -> str:
        """Which complete model the run holds, for messages after a save failed or was refused."""
        newest = self.saved_states()
        if newest:
            return f"the last complete model is {newest[0].model} ({newest[0].timesteps:,} timesteps)"
        if zip_timesteps(self.best_model) is not None:
            return f"the last complete model is {self.best_model}"
        return "no complete model was saved"

    def vecnormalize_for(self, model: Path) -> Path | None:
        """The VecNormalize statistics saved with ``model``, if the run normalised; None where they are missing, rather
        than another model's, which moved on since and would feed the policy differently scaled observations."""
        pair = self._vecnormalize_pair(model)
        return None if pair is None else companion_of(*pair)

    def missing_vecnormalize(self, model: Path) -> str:
        """Why :meth:`vecnormalize_for` found no statistics for ``model``, for a message."""
        pair = self._vecnormalize_pair(model)
        if pair is None:
            return f"{model.name} is none of its own models, so which statistics go with it is not known"
        return f"it holds no {pair[0].name}, the statistics saved with {model.name}"

    def _vecnormalize_pair(self, model: Path) -> tuple[Path, Path] | None:
        """(statistics, model) as the run saves them, for a model the run wrote; None for a file of another name."""
        if model.name == self.BEST_MODEL:
            return self.best_vecnormalize, self.best_model
        if model.name == self.final.model.name:
            return self.final.vecnormalize, self.final.model
        match = self._CHECKPOINT.fullmatch(model.name)
        if match and model.parent.name == self.checkpoints.name:
            checkpoint = self.checkpoint(int(match.group(1)))
            return checkpoint.vecnormalize, checkpoint.model
        return None

    @classmethod
    def find_model(cls, target: str | Path, which: str = "auto") -> tuple[Path, RunDir]:
        """(model zip, run dir) for a run dir or a zip somewhere inside one. In a run dir, ``which`` picks: ``auto``
        its best model, else its final one; ``best`` or ``final`` that one only."""
        if which not in ("auto", "best", "final"):
            raise ConfigError(f"which must be 'auto', 'best' or 'final', got {which!r}")
        target = Path(target)
        if target.is_dir():
            run = cls(target)
            names = {"auto": [run.best_model, run.final.model], "best": [run.best_model], "final": [run.final.model]}[which]
            for path in names:
                if path.is_file():
                    return path, run
            if which == "best" and run.final.model.is_file():  # asked for by name, the final model does not stand in
                raise ConfigError(f"{target} has no {cls.BEST_MODEL} (no evaluation saved one); which='final': model.zip")
            if which == "final" and run.best_model.is_file():
                why = "its final save did not happen" if (pid := run.holder()) is None else f"it is still training (pid {pid})"
                raise ConfigError(f"{target} has no model.zip ({why}); which='best': {cls.BEST_MODEL}")
            raise ConfigError(
                f"{target} holds no {' or '.join(p.name for p in names)}; is it a run dir written by sb3_gpu.train?"
            )
        if not target.is_file():
            raise ConfigError(f"no such run dir or model file: {target}")
        if which != "auto":
            raise ConfigError(f"which={which!r} picks a model in a run dir; {target} names one already")
        if not zipfile.is_zipfile(target):  # SB3 saves a model as a zip archive, whatever its name
            raise ConfigError(f"{target} is not a zip archive, as SB3 saves a model (a damaged model, or another file)")
        for parent in (*target.parents, *target.resolve().parents):  # the run dir as given (a relative path stays one)
            if cls(parent).config.is_file():
                return target, cls(parent)
        raise ConfigError(f"{target}: no config.yaml beside it or above it, so its algorithm and env are unknown")

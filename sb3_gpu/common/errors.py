"""The one error type that sb3_gpu raises for bad input."""

from __future__ import annotations

import difflib
import functools
import importlib.metadata
import re
import shlex
import signal
import sys
import warnings
from collections.abc import Iterable
from typing import TypeVar

_E = TypeVar("_E", bound=BaseException)


class ConfigError(ValueError):
    """Bad input: an unknown name, a value outside its domain, a file that cannot be read.

    The message is one line that says what was wrong and what is accepted; the CLIs print it and exit with code 2.
    """


def closest(name: str, choices: Iterable[str], n: int = 3) -> str:
    """Return ``"; did you mean 'x'?"`` (or ``""``) for the choices closest to ``name``."""
    matches = difflib.get_close_matches(name, list(choices), n=n, cutoff=0.6)
    if not matches:
        return ""
    return "; did you mean " + " or ".join(repr(m) for m in matches) + "?"


@functools.cache
def install_hint(extra: str) -> str:
    """``pip install 'optuna>=4.0' ... (sb3_gpu's [tune] extra)``: the extra's packages as the installed metadata lists
    them, so the command works wherever sb3_gpu came from (a checkout, a git URL)."""
    try:
        requires = importlib.metadata.requires("sb3-gpu") or []
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        requires = []
    marker = re.compile(rf"""extra\s*==\s*['"]{re.escape(extra)}['"]""")
    packages = [r.split(";")[0].strip() for r in requires if ";" in r and marker.search(r.split(";", 1)[1])]
    if not packages:
        return f"install sb3_gpu's [{extra}] extra"
    return f"pip install {shlex.join(packages)} (sb3_gpu's [{extra}] extra)"


def gist(e: BaseException, limit: int = 160) -> str:
    """``e``'s first line of text, for a one-line message; a longer one keeps its start and its end (where a
    compiler's error ends in what went wrong, after a long path)."""
    text = str(e).strip()
    first = text.splitlines()[0] if text else ""
    if len(first) <= limit:
        return first
    half = (limit - 5) // 2
    return f"{first[:half]} ... {first[-half:]}"


def named(e: BaseException, limit: int = 160) -> str:
    """``Type: gist``, or the type alone where the error has no text (a MemoryError)."""
    text = gist(e, limit)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def cause_of(e: BaseException, kind: type[_E]) -> _E | None:
    """``e``, or the first exception that caused it (raised from, or while handling), that is a ``kind``."""
    seen: set[int] = set()
    current: BaseException | None = e
    while current is not None and id(current) not in seen:
        if isinstance(current, kind):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


# Frames of these packages are passed over when a warning looks for the line to name: SB3's learn() calls sb3_gpu's
# steps, torch calls its compiled ones, Gymnasium its envs.
_LIBRARIES = frozenset({"sb3_gpu", "stable_baselines3", "sb3_contrib", "gymnasium", "torch"})


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn``, attributed to the caller's own line (``make_model(...)``, ``model.learn(...)``), the first
    frame outside sb3_gpu and the libraries it runs inside, so that a filter by module and Python's once per line
    work as for a direct call."""
    frame, level = sys._getframe(1), 2
    while frame.f_back is not None and str(frame.f_globals.get("__name__", "")).partition(".")[0] in _LIBRARIES:
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


class EnvWorkerError(RuntimeError):
    """An env in a worker process raised, or the worker died; the message names the env index and the cause.

    :ivar env_index: the failing env's index in the vec env (the worker's first env when the worker died)
    :ivar worker_traceback: the worker's formatted traceback, when it raised
    :ivar exit_code: the worker's exit code when it died (negative: minus the signal that killed it)
    """

    def __init__(
        self, message: str, env_index: int | None = None, worker_traceback: str | None = None, exit_code: int | None = None
    ):
        super().__init__(message)
        self.env_index, self.worker_traceback, self.exit_code = env_index, worker_traceback, exit_code


class TrainingDiverged(RuntimeError):
    """A gradient, TD error or parameter became NaN or inf (or an observation given to the policy); raised before it
    reaches the model's parameters where possible, so that the model in memory is still the last finite one."""


class StopNow(KeyboardInterrupt):
    """A second SIGINT or SIGTERM while a run was already stopping: quit at once, writing nothing more.

    :ivar signum: the second signal's number, for the exit status (128 + it, as the shell reports a signal)
    """

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(signum)
        self.signum = signum


class ResultsNotWritten(OSError):
    """A bench or an evaluation ran, but its results (files, a video) could not be written (a full disk, say); the
    message is one line naming the file or folder and the cause, which the CLI prints, exiting with code 1."""


class BenchCannotRun(OSError):
    """The machine refused what a bench needs to run (a process it starts: a process limit, no memory); the message is
    one line naming what and why, which the CLI prints, exiting with code 1."""

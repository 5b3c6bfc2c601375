"""What the CLIs share: one-line argument errors with exit code 2, number parsing, and commands to print."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from sb3_gpu.common.checks import MAX_COUNT, algo_name
from sb3_gpu.common.errors import ConfigError

if TYPE_CHECKING:
    from rich.console import Console


class Parser(argparse.ArgumentParser):
    """argparse that reports bad input in one line and exits 2 (not a usage dump)."""

    def __init__(self, prog: str | None = None, *args: Any, **kwargs: Any):
        # Run as its console script (sb3-gpu-train for `python -m sb3_gpu.train`): its usage names that command.
        script = Path(sys.argv[0]).name.removesuffix(".exe") if sys.argv and sys.argv[0] else ""
        if script.startswith("sb3-gpu-") and prog == f"python -m sb3_gpu.{script.removeprefix('sb3-gpu-')}":
            prog = script
        super().__init__(prog, *args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        if args is None:  # the command line of a program run, not a call from Python: its warnings read as its messages
            plain_warnings()
            forgiving_output()
        return super().parse_args(args, namespace)

    def _get_value(self, action: argparse.Action, arg_string: str) -> Any:
        # An empty value (`--env ""`, a shell variable left unset) would read as "not given" and fall back to a default.
        if arg_string == "" and not isinstance(action, argparse._SubParsersAction):  # a subcommand's parser checks its own
            raise argparse.ArgumentError(action, "expected a value, got an empty string")
        return super()._get_value(action, arg_string)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def forgiving_output() -> None:
    """Make stdout write the characters its encoding cannot show as backslash escapes (``rü`` as ``r\\xfc``), as
    stderr already does, rather than fail a finished run on its folder's name (an ASCII locale,
    ``PYTHONIOENCODING=ascii``)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError, OSError):  # replaced by a caller, or closed
            stream.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]


def plain_warnings() -> None:
    """Print each warning as one ``warning: ...`` line, as the commands print their other messages (Python's own form
    is the file and line of the code that warned, then that line of code)."""

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None, line: Any = None):
        target = file if file is not None else sys.stderr
        if target is None:  # no stderr (pythonw, a detached daemon): as Python's own handler, drop it
            return
        # Gymnasium colours its warnings and starts them with its own "WARN: ": neither belongs in a log file.
        text = _ANSI.sub("", str(message)).removeprefix("WARN: ")
        with contextlib.suppress(OSError):  # a closed pipe must not turn a warning into an error mid-training
            print(f"warning: {text}", file=target, flush=True)

    warnings.showwarning = show


def _finite(text: str, what: str) -> float:
    try:
        value = float(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def _integer(text: str, low: int, what: str, high: int = MAX_COUNT) -> int:
    value = _finite(text, what)
    if value < low or value != int(value):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    if value > high:
        raise argparse.ArgumentTypeError(f"expected {what} up to {high:,}, got {text!r}")
    return int(value)


def positive_int(text: str) -> int:
    """``1000``, ``1e5`` and ``100_000`` are accepted; zero, negatives, fractions and infinities are not."""
    return _integer(text, 1, "a positive integer")


def threads_arg(text: str) -> int | str:
    """torch's CPU threads: ``auto`` or a positive integer."""
    return "auto" if text.strip().lower() == "auto" else positive_int(text)


def count_int(text: str) -> int:
    """A count that may be zero: ``0``, ``30``, ``1e3``."""
    return _integer(text, 0, "an integer >= 0")


def algo_arg(text: str) -> str:
    """An algorithm's name, any case: ``SAC``, ``qrdqn``; one sb3_gpu does not train is named as such."""
    try:
        return algo_name(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def name_arg(text: str) -> str:
    """A name from a fixed list (``--amp BF16``, ``--vec-env Dummy``): read in any case, as algorithm names are."""
    return text.strip().lower()


def seed_int(text: str) -> int:
    """A seed: an integer in [0, 2**32)."""
    return _integer(text, 0, "a seed, an integer >= 0", high=2**32 - 1)


def finite_float(text: str) -> float:
    """A return to reach: any finite number (``-200``, ``1e3``); not ``nan`` or ``inf``, which no run can compare to."""
    return _finite(text, "a finite number")


def print_error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is, so that it stops there as Ctrl-C would (its cleanup runs)."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


def _signal_of(stop: KeyboardInterrupt) -> signal.Signals:
    """The signal a stop came from: SIGTERM for :class:`Terminated` or one named so (a bench worker's), else what its
    first argument names (StopNow's number), else Ctrl-C."""
    first = stop.args[0] if stop.args else None
    if isinstance(stop, Terminated) or first == "SIGTERM":
        return signal.SIGTERM
    return signal.Signals(first) if first in (signal.SIGINT, signal.SIGTERM) else signal.SIGINT


def keep_stops() -> Callable[[sys.UnraisableHookArgs], Any]:
    """From now on a stop that a signal handler raised inside a finalizer (a weakref callback, a ``__del__``: the
    garbage collector runs them anywhere), where Python only prints it and runs on, is raised again where the main
    thread runs next, as the same signal would be. Returns the hook it replaced."""
    import _thread

    previous = sys.unraisablehook

    def hook(unraisable: sys.UnraisableHookArgs) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            # The same signal again, to the main thread, from another thread a moment later: sent now, its handler
            # would run at once, inside this hook, and be swallowed for good; a real signal (not interrupt_main's)
            # also ends a wait the main thread is in. Should it land in a finalizer again, this hook sends it again.
            signum, main = _signal_of(unraisable.exc_value), threading.main_thread().ident
            if hasattr(signal, "pthread_kill") and main is not None:
                later = threading.Timer(0.01, signal.pthread_kill, args=(main, signum))
            else:  # Windows
                later = threading.Timer(0.01, _thread.interrupt_main, args=(signum,))
            later.daemon = True
            later.start()
            return
        previous(unraisable)

    sys.unraisablehook = hook
    return previous


@contextlib.contextmanager
def stops_not_swallowed() -> Iterator[None]:
    """:func:`keep_stops` inside the block."""
    previous = keep_stops()
    try:
        yield
    finally:
        sys.unraisablehook = previous


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises ``Terminated`` inside the block (the main thread only: elsewhere signals cannot be set).

    Without it SIGTERM's default action ends the process at once, past every ``finally``: a half-made run dir
    would keep its lock. A training session sets its own handlers inside the block and restores this one after.
    """
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if main_thread else None
    try:
        with stops_not_swallowed():
            yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


_STOPS = (signal.SIGINT, signal.SIGTERM)


def _let_pass(signum: int, frame: object) -> None:
    pass


@contextlib.contextmanager
def stops_held(handler: Callable[[int, Any], None] | int = _let_pass) -> Iterator[None]:
    """SIGINT and SIGTERM that come inside the block are dropped (the main thread only, which alone sets handlers): a
    second Ctrl-C cannot cut short the write of the results the first one stopped for.

    :param handler: what takes them meanwhile: a handler that does nothing, or ``signal.SIG_IGN``, which a program
        started inside the block inherits through its exec
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, handler) for signum in _STOPS}
    try:
        yield
    finally:
        for signum, before in previous.items():
            signal.signal(signum, before)


def ignore_stop_signals() -> None:
    """In an env worker process: let SIGINT and SIGTERM pass. Both reach a whole process group (Ctrl-C, a job's
    SIGTERM); the parent stops after its current step, which needs the workers, and then closes them. A handler that
    does nothing rather than SIG_IGN, which a program an env starts would inherit through its exec (a simulator that
    ``terminate()`` could no longer stop); system calls under way go on (no EINTR)."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _let_pass)
        if hasattr(signal, "siginterrupt"):  # POSIX only
            signal.siginterrupt(signum, False)


def interrupted(code: int = 130) -> int:
    """``code``, the exit status for a stop by a signal, made to hold once ``main`` returns it.

    CPython remembers a KeyboardInterrupt that left code run from a string (``exec`` of source, as sympy's import
    does) even when a caller caught it, and then ends the process by SIGINT instead of with the status ``main``
    returned. Running source again resets that memory.
    """
    exec("pass")  # a constant: nothing from the user is run
    return code


def command(program: str = "python") -> str:
    """How the user's shell starts ``program`` (``python``, ``tensorboard``) of the environment running this one: its
    bare name where the shell finds this environment's own, else its path (a virtual environment that is not active),
    quoted for the shell."""
    bin_dir = Path(sys.executable).parent
    here = Path(sys.executable) if program == "python" else bin_dir / program
    if program != "python" and not here.exists():  # a script installed elsewhere (pip --user): run its module
        return f"{command()} -m {program}.main"
    found = shutil.which(program)
    # The folders, not the files: a venv's python is a link to the base interpreter, which the shell may find too.
    if found is not None and Path(found).parent.resolve() == bin_dir.resolve():
        return program
    return _quoted([str(here)])


def shell_line(*words: object, program: str = "python") -> str:
    """``python -m sb3_gpu.evaluate 'my run'``: ``program`` as :func:`command` finds it, then each word quoted for
    the shell, so that a printed command runs as pasted whatever its paths hold (spaces, quotes, a newline). A path
    (any word that is no ``str``) that starts with ``-`` is written ``./-...``, which no parser takes for a flag."""
    texts = [str(word) for word in words]
    texts = [
        os.path.join(os.curdir, t) if t.startswith("-") and not isinstance(w, str) else t
        for w, t in zip(words, texts, strict=True)
    ]
    return " ".join([command(program), _quoted(texts)])


def _quoted(words: list[str]) -> str:
    # Windows' shells take no single quotes (and a path's backslashes are no escapes there): its own quoting rules.
    return " ".join(_windows_word(word) for word in words) if os.name == "nt" else shlex.join(words)


def _windows_word(word: str) -> str:
    """A word as Windows programs split their command line (quotes and backslashes by the C runtime's rules), quoted
    also where cmd.exe would read it (``&``, ``|``, ``<``, ``>``, ``^``, parentheses); ``%`` is expanded even in quotes."""
    quoted = subprocess.list2cmdline([word])
    if quoted.startswith('"') or not re.search(r"[&|<>^()]", word):
        return quoted
    return '"' + re.sub(r"(\\+)$", r"\1\1", quoted) + '"'  # backslashes before the closing quote are doubled


OUTPUT_CLOSED = "the program reading the output (head, or a pager that quit) closed it"
_MIN_COLUMNS = 20  # below it no table reads: a COLUMNS under it is taken for none


def console() -> Console:
    """A rich console for the CLIs' output: its own width in a terminal or a notebook; in a log file (CI, nohup, a
    cluster's job log), which has none, 160 columns rather than rich's 80, so that tables are not folded."""
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            # As rich does (stdout to /dev/null, so that Python's flush at exit raises nothing more; exit code 1),
            # with a word of why: rich exits without one.
            self.quiet = True
            with contextlib.suppress(OSError, ValueError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            print_error(f"stopped: {OUTPUT_CLOSED}")
            raise SystemExit(1)

    columns = os.environ.get("COLUMNS")
    if columns is not None and columns.isdigit() and int(columns) >= _MIN_COLUMNS:
        return _Console()  # the width the user gave
    out = _Console()
    if watched(out):  # a COLUMNS that is no width (fish's 0, a word) is passed over: rich would print at 0
        return out if columns is None else _Console(width=_terminal_width(out))
    return _Console(width=160)


def _terminal_width(out: Console) -> int:
    """The terminal's own width, whatever COLUMNS says."""
    try:
        return os.get_terminal_size(out.file.fileno()).columns
    except (AttributeError, ValueError, OSError):
        return 80


def watched(out: Console) -> bool:
    """Whether a person watches ``out``: a terminal (not a file that FORCE_COLOR makes rich call one) or a notebook."""
    isatty = getattr(out.file, "isatty", None)
    return out.is_jupyter or (out.is_terminal and callable(isatty) and bool(isatty()))

"""Where a study lives: optuna storages that many processes and machines share, and the trials of dead workers."""

from __future__ import annotations

import json
import os
import re
import socket
import time
import urllib.parse
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil

from sb3_gpu.common.errors import ConfigError, install_hint
from sb3_gpu.common.io import make_dir


def import_optuna() -> Any:
    try:
        import optuna
    except ImportError:
        raise ConfigError(f"tuning needs optuna: {install_hint('tune')}") from None
    return optuna


_SECRET_KEYS = ("password", "passwd", "pwd", "passfile", "sslpassword", "token", "secret")


def _secrets(url: str) -> list[tuple[str | None, str]]:
    """The password (key None) and the secret query values (key: their name) of a database URL, as they appear in it."""
    try:
        from sqlalchemy.engine import make_url

        parsed = make_url(url)
    except Exception:  # not a database URL (a journal file's path, a typo): nothing in it is a secret
        return []
    found: list[tuple[str | None, str]] = [(None, str(parsed.password))] if parsed.password else []
    for key, value in parsed.query.items():
        if any(secret in key.lower() for secret in _SECRET_KEYS):
            found += [(key, str(v)) for v in ([value] if isinstance(value, str) else value) if v]
    return found


def mask_url(url: str, text: str | None = None) -> str:
    """``text`` (by default the URL itself) with the URL's password and secret query values replaced by ``***``.

    The URL is parsed by SQLAlchemy, as optuna's storage parses it, so a password holding ``/`` or ``@``, an empty
    user name or ``?password=`` are all found. The URL itself, wherever ``text`` quotes it, is masked where its
    secrets stand (its scheme and user name kept whole); elsewhere a secret of 6 or more characters is masked wherever
    it occurs, and a shorter one where it stands as one (``:SECRET@``, ``password=SECRET``, ``'pwd': 'SECRET'``):
    masking every occurrence of one or two letters would garble the message and show where the secret's letters fall.
    """
    found = sorted(_secrets(url), key=lambda secret: len(secret[1]), reverse=True)
    masked = _mask(url, found, everywhere=False)
    if text is None:
        return masked
    return masked.join(_mask(piece, found, everywhere=True) for piece in text.split(url))


def _mask(text: str, found: list[tuple[str | None, str]], everywhere: bool) -> str:
    names = "|".join(re.escape(name) for name in dict.fromkeys([*(key for key, _ in found if key), *_SECRET_KEYS]))
    for _key, secret in found:
        for form in dict.fromkeys((secret, urllib.parse.quote(secret, safe=""), urllib.parse.quote_plus(secret))):
            if everywhere and len(secret) >= 6:
                text = text.replace(form, "***")
                continue
            escaped = re.escape(form)
            text = re.sub(rf":{escaped}@", ":***@", text)
            text = re.sub(rf"""((?:{names})['"]?\s*[=:]\s*['"]?){escaped}(?!\w)""", r"\g<1>***", text, flags=re.IGNORECASE)
    return text


_ACCEPTED = "accepted: sqlite:///FILE, postgresql://..., mysql://..., journal:FILE"


def journal_lock(url: str) -> Callable[[Path], bool]:
    """Whether a link is optuna's lock on the journal file of ``url``: a link beside it, named after it, that points
    at it, made and removed as the workers take turns (and renamed on its way out). Nothing is written through it."""
    if not url.startswith("journal:"):
        return lambda path: False
    journal = Path(url.removeprefix("journal:"))

    def is_lock(path: Path) -> bool:
        named = path.name == f"{journal.name}.lock" or (
            path.name.startswith(f"{journal.name}.lock") and path.name.endswith(".rename")
        )
        try:
            return named and os.readlink(path) == str(journal) and path.parent.resolve() == journal.parent.resolve()
        except FileNotFoundError:  # released in the meantime
            return named

    return is_lock


def _check_journal(path: Path, url: str) -> None:
    """Refuse a file that is no optuna journal (its first line a JSON record), before optuna reads it through."""
    try:
        with path.open("rb") as f:
            first = f.readline(1 << 20)
    except FileNotFoundError:
        return  # a new journal
    except OSError as e:
        raise ConfigError(f"storage {url!r}: cannot read the journal file {path}: {e.strerror or e}") from None
    if not first.endswith(b"\n"):
        return  # empty, or a first record still being written
    try:
        record = json.loads(first)
    except ValueError:  # UnicodeDecodeError too
        record = None
    if not isinstance(record, dict) or "op_code" not in record:
        raise ConfigError(
            f"storage {url!r}: {path} is not an optuna journal (its first line is no journal record); give a new file's "
            "path, or the journal other workers write"
        )


def close_storage(storage: Any) -> None:
    """Close an RDB storage's database connections (a journal holds none open): one dropped unclosed held them until
    the garbage collector came by, as its study's reference cycles keep its engine."""
    if hasattr(storage, "engine"):
        storage.remove_session()  # the connection its session holds
        storage.engine.dispose()


def make_storage(url: str, heartbeat_s: int) -> Any:
    """An optuna storage: ``journal:PATH`` (a journal file), or any SQLAlchemy URL (sqlite, postgresql, mysql)."""
    optuna = import_optuna()
    if url.startswith("journal:"):
        from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock, JournalStorage

        path = Path(url.removeprefix("journal:"))
        if not path.name or path.is_dir():
            raise ConfigError(f"storage {url!r}: journal:PATH names a file to write, and {path} is a folder")
        make_dir(path.parent, "the journal's folder")
        _check_journal(path, url)
        try:
            # optuna's default lock is a symbolic link, which Windows lets only administrators (or Developer Mode) make.
            lock = JournalFileOpenLock(str(path)) if os.name == "nt" else None
            return JournalStorage(JournalFileBackend(str(path), lock_obj=lock))
        except OSError as e:
            raise ConfigError(f"storage {url!r}: cannot open the journal file {path}: {e.strerror or e}") from None
    if "://" not in url:
        raise ConfigError(f"storage {url!r} is not a URL ({_ACCEPTED})")
    if url.startswith("sqlite") and url.partition("://")[2].lstrip("/") in ("", ":memory:"):
        # Optuna's heartbeat thread opens its own connection, which sees another, empty in-memory database.
        raise ConfigError(f"storage {url!r} is an in-memory database, which workers cannot share; give sqlite:///FILE")
    if url.startswith("sqlite"):  # a file's folder, made as a journal's is (as SQLAlchemy reads the URL: %20 a space)
        from sqlalchemy.engine import make_url

        try:
            database = make_url(url).database
        except Exception:  # SQLAlchemy's own error follows, as the storage opens
            database = None
        if database and not database.startswith("file:"):  # not a URI (uri=true): a path
            make_dir(Path(database).parent, "the database's folder")
    for attempt in range(5):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # heartbeats: stable in practice
                storage = optuna.storages.RDBStorage(
                    url, heartbeat_interval=heartbeat_s, grace_period=2 * heartbeat_s, engine_kwargs={"pool_pre_ping": True}
                )
                return storage
        except ImportError:
            raise ConfigError(
                f"storage {mask_url(url)}: its database driver is not installed "
                f"(PostgreSQL: {install_hint('tune')}; MySQL: pip install PyMySQL)"
            ) from None
        except Exception as e:  # SQLAlchemy raises many kinds: refused connection, bad credentials, unknown database
            text = str(e).lower()
            if attempt < 4 and ("already exists" in text or "duplicate" in text):
                # Workers started together on an empty database race to create optuna's tables: the loser retries.
                time.sleep(0.5 * (attempt + 1))
                continue
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"cannot open storage {mask_url(url)}: {mask_url(url, first)} ({_ACCEPTED})") from None
    raise AssertionError("unreachable")  # pragma: no cover


def fail_left_running(url: str, heartbeat_s: int, name: str, numbers: Sequence[int]) -> int:
    """Mark failed those of trials ``numbers`` of study ``name`` still RUNNING, through a new connection to ``url``;
    return how many. A signal that stops a worker can land inside one of its storage writes and leave its own
    connection unusable, so that optuna cannot record the trial's end itself."""
    optuna = import_optuna()
    storage = make_storage(url, heartbeat_s)
    try:
        study = optuna.load_study(study_name=name, storage=storage)
        running = {t.number for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))}
        left = [n for n in numbers if n in running]
        for number in left:
            study.tell(number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
    finally:
        close_storage(storage)
    return len(left)


def worker_attrs() -> dict[str, Any]:
    """What a trial records of the worker running it: ``host:pid``, and what tells its process apart on that host,
    its pid namespace (containers on one host name have their own) and its start (a pid is reused): on Linux in clock
    ticks since boot, which no correction of the clock moves (psutil's time moves by a second or more), elsewhere
    psutil's time, each under a name of its own."""
    pid, ticks = os.getpid(), _start_ticks(os.getpid())
    start = {"worker_start_ticks": ticks} if ticks is not None else {"worker_started": psutil.Process(pid).create_time()}
    return {"worker": f"{socket.gethostname()}:{pid}", "worker_pid_ns": _pid_namespace(), **start}


def _start_ticks(pid: int) -> float | None:
    """Process ``pid``'s start in clock ticks since boot (``/proc/PID/stat``); None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return float(f.read().rpartition(b")")[2].split()[19])  # starttime, the 22nd field
    except (OSError, IndexError, ValueError):
        return None


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:  # no /proc (macOS, Windows): one namespace
        return None


def fail_dead_local_trials(study: Any) -> int:
    """Mark failed the RUNNING trials of workers on this host whose process is gone; return how many.

    For a journal file, which has no heartbeats (RDB storages fail a dead worker's trial by its heartbeat). A worker
    in another pid namespace (a container sharing the host name) cannot be seen from here, so its trials are left.
    """
    optuna = import_optuna()
    host, namespace, failed = socket.gethostname(), _pid_namespace(), 0
    for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        attrs = trial.user_attrs
        worker_host, _, pid = str(attrs.get("worker", "")).rpartition(":")
        if worker_host != host or not pid.isdigit() or attrs.get("worker_pid_ns", namespace) != namespace:
            continue
        if _process_gone(int(pid), attrs):
            # skip_if_finished: another worker may have failed it first.
            study.tell(trial.number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
            failed += 1
    return failed


def _process_gone(pid: int, attrs: dict[str, Any]) -> bool:
    """Whether the worker process ``pid`` of a trial's ``attrs`` has ended: a process of that pid that started at
    another time took the pid over."""
    try:
        process = psutil.Process(pid)
        ticks, started = attrs.get("worker_start_ticks"), attrs.get("worker_started")
        if isinstance(ticks, (int, float)):
            now = _start_ticks(pid)
            return now is not None and now != ticks
        return isinstance(started, (int, float)) and abs(process.create_time() - started) > 2.0
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:  # another user's process, say: it lives
        return False

"""Atomic file writes: a crash leaves the old file or the new one, never half of one."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import pickle
import re
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import yaml

from sb3_gpu.common.errors import ConfigError

if TYPE_CHECKING:
    from stable_baselines3.common.base_class import BaseAlgorithm


def out_of_space(e: BaseException) -> bool:
    """Whether ``e`` is a write that found no room: a full disk, a quota, a file-size limit."""
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to a new temp file beside ``path``, fsync it, then rename it over ``path``.

    Neither the temp file nor ``path`` is ever opened through a symbolic link: the temp file is created afresh
    (``O_EXCL | O_NOFOLLOW``), and the rename replaces a link at ``path`` rather than writing to its target.
    """
    return atomic_write(path, lambda f: f.write(data))


def replace(src: str | Path, dst: str | Path) -> None:
    """``os.replace``; on Windows, where it fails while another process has ``dst`` open (a plot reading it, an
    indexer, an antivirus scan), tried again for up to a second before the error stands."""
    for wait in (0.05, 0.1, 0.2, 0.3, 0.4) if os.name == "nt" else ():
        try:
            os.replace(src, dst)
            return
        except PermissionError:
            time.sleep(wait)
    os.replace(src, dst)


def atomic_write(path: str | Path, write: Callable[[BinaryIO], object]) -> Path:
    """``atomic_write_bytes`` for a writer that streams into the file (a pickle of a large replay buffer, which
    would otherwise be built whole in memory first). Any error in ``write`` removes the temp file, ``path`` untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp: Path | None = None
    try:
        tmp, fd = _create_new(path)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        replace(tmp, path)
        tmp = None
    except OSError as e:  # a full disk says so without a file name; name the file that was not written
        raise OSError(e.errno, e.strerror or str(e), str(path)) from e
    finally:
        if tmp is not None:  # only the file this call created: another writer's temp file is its own
            tmp.unlink(missing_ok=True)
    return path


# Never through a link, never inherited by a child; binary on Windows, where os.open's default text mode would write
# each b"\n" of a zip or pickle as b"\r\n". (Windows has neither of the first two: links are refused by refuse_links.)
_SAFE_FLAGS = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)


def temporary_owner(name: str) -> int | None:
    """The process id in a temp file's name as :func:`_create_new` gives it (a write a kill may have cut short), or
    None for another name."""
    match = _TEMPORARY.fullmatch(name)
    return int(match.group(1)) if match else None


_TEMPORARY = re.compile(r"\..+\.tmp-(\d+)-[0-9a-f]{8}")


def _create_new(path: Path) -> tuple[Path, int]:
    """A temp file beside ``path`` that no one else has: its name is random (two writers of one pid, in two
    containers sharing a folder, or two threads, never meet), and a name that exists is passed over, never removed."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _SAFE_FLAGS
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            return tmp, os.open(tmp, flags, 0o644)
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temp file name beside it", str(path))


def keep_previous(path: Path) -> Callable[[bool], None]:
    """Keep the file at ``path`` as it is now, for a write of it that must be undone if a later write fails.

    Returns ``restore``: ``restore(True)`` puts the kept file back (or removes a new one where there was none),
    ``restore(False)`` forgets it. A hard link keeps it (a full disk that failed the later write leaves no room for a
    copy); a file system without hard links gets a copy, written atomically (a copy cut short is no copy).
    """
    kept = _kept(path)
    kept.unlink(missing_ok=True)
    existed = path.exists()
    if existed:
        try:
            os.link(path, kept)  # atomic writes replace the file by a rename: the link keeps the old one
        except OSError:
            with contextlib.suppress(OSError), open(path, "rb") as old:
                atomic_write(kept, lambda f: shutil.copyfileobj(old, f))

    def restore(failed: bool) -> None:
        with contextlib.suppress(OSError):  # the write that failed already says why
            if failed and kept.exists():
                replace(kept, path)  # a no-op where both name one file (path was never replaced)
            elif failed and not existed:
                path.unlink(missing_ok=True)
            # An old file that could not be kept is left as it is: it may still be the old one, and is never removed.
            kept.unlink(missing_ok=True)

    return restore


def _kept(path: Path) -> Path:
    return path.with_name(f".{path.name}.previous")


def companion_of(companion: Path, main: Path) -> Path | None:
    """The file that pairs with ``main``, where ``companion`` is written first and ``main`` after it, with
    :func:`keep_previous` keeping the old companion until ``main`` is written (a model's VecNormalize statistics): the
    companion, or the kept old one where a SIGKILL or a power loss cut the pair's write short after the companion's,
    so that ``main`` is older than it. None where there is no companion."""
    kept = _kept(companion)
    try:
        if kept.is_file() and main.stat().st_mtime_ns < companion.stat().st_mtime_ns:
            return kept
    except FileNotFoundError:
        pass
    return companion if companion.is_file() else None


def put_back_cut_short(companion: Path, main: Path) -> None:
    """Before a new write of the pair: where the last one was cut short (:func:`companion_of`), put the companion that
    pairs with ``main`` back in its place, for :func:`keep_previous` to keep."""
    if companion_of(companion, main) == _kept(companion):
        replace(_kept(companion), companion)


def check_utf8(path: str | os.PathLike[str], what: str) -> None:
    """Refuse a path that cannot be written as UTF-8 text (TensorBoard names its files so, and fails on it once a run
    has begun): bytes that are no UTF-8, or UTF-8 that Python here reads as another encoding (a C locale without
    UTF-8 mode)."""
    text = os.fspath(path)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        try:
            os.fsencode(text).decode("utf-8")
        except UnicodeDecodeError:
            raise ConfigError(f"cannot use {what} {text!r}: its name is not valid UTF-8; choose a UTF-8 name") from None
        raise ConfigError(
            f"cannot use {what} {text!r}: Python here reads file names as {sys.getfilesystemencoding()}, not UTF-8 "
            "(a C locale without UTF-8 mode): set PYTHONUTF8=1, or choose an ASCII name"
        ) from None


def check_dir_creatable(path: str | Path, what: str, *, utf8: bool = False) -> Path:
    """Refuse, in one line, a folder that :func:`make_dir` could not make later: checked before long work, without
    making it (the work may yet stop on bad input).

    :param utf8: refuse a path that is not valid UTF-8 (a run dir: TensorBoard fails on it once training has begun)
    """
    path = Path(path)
    if utf8:
        check_utf8(path, what)
    too_long = False
    for folder in (path, *path.parents):
        try:
            if folder.exists() or folder.is_symlink():
                break
        except OSError as e:  # a name or path too long is said below; others here (a folder that denies a look)
            if e.errno != errno.ENAMETOOLONG:
                raise ConfigError(f"cannot create {what} {path}: {e.strerror or e}") from None
            too_long = True
    new = path.relative_to(folder).parts if folder != path else ()
    name_max = _name_max(folder)
    if long := [part for part in new if _name_length(part) > name_max]:
        unit, shown = "UTF-16 units" if os.name == "nt" else "bytes", long[0] if len(long[0]) <= 24 else long[0][:20] + "..."
        raise ConfigError(
            f"cannot create {what} {path}: its part {shown!r} is {_name_length(long[0])} {unit} long, and this file "
            f"system takes at most {name_max}; choose a shorter name"
        )
    if too_long:
        raise ConfigError(f"cannot create {what} {path}: the path is too long for the file system")
    if not folder.is_dir():
        raise ConfigError(f"cannot create {what} {path}: {folder} is in the way (not a folder)")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot create {what} {path}: {folder} is not writable")
    if folder == path:  # there already: nothing to create (a writer sharing it sees no stray folder)
        return path
    try:  # os.access says yes to root everywhere, a read-only mount and /proc included: make a folder to be sure
        probe = tempfile.mkdtemp(prefix=".sb3_gpu-check-", dir=folder)
    except OSError as e:
        raise ConfigError(f"cannot create {what} {path}: {folder} takes no new folder ({e.strerror or e})") from None
    with contextlib.suppress(OSError):  # an append-only folder keeps it: harmless, and no reason to refuse
        os.rmdir(probe)
    return path


def _name_length(name: str) -> int:
    """A file name's length as its file system counts it: UTF-16 units on Windows, bytes elsewhere."""
    return len(name.encode("utf-16-le", "surrogatepass")) // 2 if os.name == "nt" else len(os.fsencode(name))


def _name_max(folder: Path) -> int:
    """The longest file name ``folder``'s file system takes (255, the usual limit, where it does not say)."""
    try:
        found = os.pathconf(folder, "PC_NAME_MAX") if hasattr(os, "pathconf") and folder.is_dir() else -1
    except (OSError, ValueError):
        found = -1
    return found if found > 0 else 255


def make_dir(path: str | os.PathLike[str], what: str, *, exist_ok: bool = True) -> Path:
    """``mkdir -p``, with a one-line error naming the folder and the cause (a file in the way, a read-only disk)."""
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"{what}: expected a folder path, got {path!r}")
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=exist_ok)
    except FileExistsError:
        if path.is_dir() and not exist_ok:
            raise
        raise ConfigError(f"cannot create {what} {path}: a file is in the way") from None
    except OSError as e:
        raise ConfigError(f"cannot create {what} {path}: {e.strerror or e}") from None
    return path


def refuse_links(folder: str | Path, what: str, allowed: Callable[[Path], bool] | None = None) -> None:
    """Refuse a folder that holds a symbolic link: files written inside it would be written through the link.

    :param allowed: links that nothing writes through (another program's lock, say), passed over
    """
    for root, dirs, files in os.walk(folder):  # links to directories are listed, not entered
        for name in (*dirs, *files):
            path = Path(root) / name
            if path.is_symlink() and not (allowed is not None and allowed(path)):
                raise ConfigError(f"{path} is a symbolic link; sb3_gpu does not write through links in a {what} (remove it)")


def open_no_follow(path: str | Path) -> int:
    """Open ``path`` for reading and writing, creating it, but never through a symbolic link (one-line error)."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | _SAFE_FLAGS, 0o644)
    except OSError as e:
        if Path(path).is_symlink():
            raise ConfigError(f"{path} is a symbolic link; sb3_gpu does not write through links (remove it)") from None
        raise ConfigError(f"cannot open {path}: {e.strerror or e}") from None


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def write_yaml(path: str | Path, data: Any) -> Path:
    return atomic_write_text(path, yaml.safe_dump(data, sort_keys=False))


def write_json(path: str | Path, data: Any) -> Path:
    return atomic_write_text(path, json.dumps(data, indent=2) + "\n")


def save_pickle(path: str | Path, obj: Any) -> Path:
    """Pickle ``obj`` (VecNormalize statistics, a replay buffer) with one atomic write, streamed to the file."""
    return atomic_write(path, lambda f: pickle.dump(obj, f, protocol=pickle.HIGHEST_PROTOCOL))


def load_pickle(
    path: str | Path, allowed: Mapping[str, Collection[str]], what: str, moved: Mapping[str, str] | None = None
) -> Any:
    """Unpickle ``path``, refusing every class or function that ``allowed`` (module -> names) does not list.

    Unpickling calls whatever the file names, so a file from elsewhere could run any code; this runs only the
    constructors of the data types listed. ``moved`` maps a module an older file names to where its classes are now.
    """

    class Restricted(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            now = (moved or {}).get(module, module)
            if name not in allowed.get(now, ()):
                raise ConfigError(
                    f"{path} names {module}.{name}, which no {what} holds; sb3_gpu does not unpickle it (it could run code)"
                )
            return super().find_class(now, name)

    try:
        with open(path, "rb") as f:
            return Restricted(f).load()
    except ConfigError:
        raise
    except Exception as e:  # a truncated or foreign file fails in many ways
        raise ConfigError(f"{path} is not a readable {what} ({type(e).__name__}: {e})") from None


def save_model(model: BaseAlgorithm, path: str | Path) -> Path:
    """``model.save`` into memory, then one atomic write (SB3 itself writes the zip in place). The zip records when it
    was saved, by the clock its run's Monitor files use (a file's mtime is the file system's, and copies change it)."""
    model._sb3_gpu_saved_at = time.time()  # type: ignore[attr-defined]
    buffer = io.BytesIO()
    model.save(buffer)
    return atomic_write_bytes(path, buffer.getvalue())


@contextlib.contextmanager
def temporary_environ(**values: str) -> Iterator[None]:
    """Set environment variables for the duration of a block, then put back what was there (or nothing)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

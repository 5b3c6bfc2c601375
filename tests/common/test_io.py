from __future__ import annotations

import errno

import pytest

from sb3_gpu.common import io
from sb3_gpu.common.errors import ConfigError
from sb3_gpu.common.io import check_dir_creatable


def test_a_folder_that_takes_no_new_folder_is_refused_though_access_allows_it(tmp_path, monkeypatch):
    assert check_dir_creatable(tmp_path / "a" / "b", "run dir") == tmp_path / "a" / "b"
    assert list(tmp_path.iterdir()) == [], "the check leaves nothing behind"

    def read_only(**kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(io.tempfile, "mkdtemp", read_only)  # as a read-only mount answers root, whom access() lets in
    with pytest.raises(
        ConfigError, match=rf"^cannot create run dir {tmp_path}/a/b: {tmp_path} takes no new folder \(Read-only"
    ):
        check_dir_creatable(tmp_path / "a" / "b", "run dir")


def test_a_folder_that_is_there_is_not_probed_and_a_probe_that_stays_is_no_refusal(tmp_path, monkeypatch):
    def refuse(**kwargs):
        raise AssertionError("no folder is made in one that is there already (another writer may share it)")

    monkeypatch.setattr(io.tempfile, "mkdtemp", refuse)
    assert check_dir_creatable(tmp_path, "study dir") == tmp_path
    monkeypatch.undo()

    def append_only(path):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(io.os, "rmdir", append_only)
    assert check_dir_creatable(tmp_path / "new", "run dir") == tmp_path / "new"


def test_a_name_or_path_too_long_or_not_utf8_is_refused_before_any_work(tmp_path, monkeypatch):
    with pytest.raises(
        ConfigError,
        match=r"^cannot create run dir .*: its part 'b{20}\.\.\.' is 256 bytes long, and this file system takes at most 255",
    ):
        check_dir_creatable(tmp_path / "a" / ("b" * 256), "run dir")
    with pytest.raises(ConfigError, match=r"is 256 bytes long"):
        check_dir_creatable(tmp_path / ("é" * 128), "run dir")  # bytes, not characters
    assert check_dir_creatable(tmp_path / ("b" * 255), "run dir")
    with pytest.raises(ConfigError, match=r"^cannot create run dir .*: the path is too long for the file system$"):
        check_dir_creatable(tmp_path.joinpath(*["d" * 250] * 20), "run dir")  # each name fits, the whole does not
    undecodable = tmp_path / b"bad\xffbyte".decode("utf-8", "surrogateescape")  # what Linux's argv gives Python
    with pytest.raises(ConfigError, match=r"^cannot use run dir '.*bad\\udcffbyte': its name is not valid UTF-8"):
        check_dir_creatable(undecodable, "run dir", utf8=True)
    assert list(tmp_path.iterdir()) == []
    undecodable.mkdir()  # where only a file is written (a plot, a video), such a folder serves
    assert check_dir_creatable(undecodable, "the plot's folder") == undecodable
    monkeypatch.setattr(io.os, "pathconf", lambda path, name: -1, raising=False)  # "no limit": not a limit of -1
    assert check_dir_creatable(tmp_path / "new", "run dir") == tmp_path / "new"


def test_a_utf8_name_that_python_reads_in_another_encoding_is_told_how_to_read_it(tmp_path):
    from sb3_gpu.common.io import check_utf8

    # What a C locale without UTF-8 mode makes of "rü": the UTF-8 bytes, each escaped.
    with pytest.raises(
        ConfigError, match=r"reads file names as .*, not UTF-8 \(a C locale without UTF-8 mode\): set PYTHONUTF8="
    ):
        check_utf8(tmp_path / "r\udcc3\udcbc", "run dir")
    check_utf8(tmp_path / "rü", "run dir")


def test_a_write_that_fails_without_naming_a_file_is_reported_with_the_file_it_was_for(tmp_path):
    # A full disk's OSError from write() names no file: "could not write None (No space left on device)".
    import errno

    from sb3_gpu.common.io import atomic_write

    path = tmp_path / "model.zip"
    path.write_bytes(b"previous")

    def full(f):
        f.write(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError) as caught:
        atomic_write(path, full)
    assert (caught.value.errno, caught.value.filename) == (errno.ENOSPC, str(path))
    assert path.read_bytes() == b"previous" and [p.name for p in tmp_path.iterdir()] == ["model.zip"]

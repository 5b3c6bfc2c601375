"""Videos of a trained policy: gymnasium's RecordVideo on the env itself, under the preprocessing of training."""

from __future__ import annotations

import contextlib
import glob
import importlib
import os
import shutil
import struct
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.wrappers import RecordVideo
from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.vec_env import VecEnv, VecNormalize

from sb3_gpu.common.checks import bool_arg, count_arg, seed_arg
from sb3_gpu.common.errors import ConfigError, ResultsNotWritten, install_hint, named
from sb3_gpu.common.io import make_dir, out_of_space, replace, temporary_environ
from sb3_gpu.envs.build import make_vec_env
from sb3_gpu.envs.spec import EnvSpec, rendering, resolve_env

# Frames are held in memory until the video is written (an Atari frame is 100 KB): a bound on a recording that is
# given no length, whose episode might be long.
MAX_EPISODE_FRAMES = 2_000


@dataclass(frozen=True)
class Video:
    """A recorded mp4: where it is, how many frames and at what frame rate."""

    path: Path
    frames: int
    fps: int


def record_video(
    model: BaseAlgorithm,
    env: str | Callable[[], gym.Env] | EnvSpec,
    path: str | Path,
    *,
    video_length: int = 0,
    deterministic: bool = True,
    seed: int | None = None,
    frame_stack: int | None = None,
    max_episode_steps: int | None = None,
    normalization: VecNormalize | None = None,
) -> Video:
    """Record ``model`` acting on ``env`` into the mp4 ``path``: its first episode (at most 2,000 frames), or
    ``video_length`` frames across episodes.

    The frames are the env's own renders (``render_mode="rgb_array"``, every emulator frame of an Atari game), while
    the policy sees what it saw in training: Atari games through SB3's AtariWrapper, ``frame_stack`` frames stacked,
    observations normalised with ``normalization``'s statistics (frozen), or the model's own VecNormalize's.

    :raises ConfigError: where the env cannot render, moviepy (the ``video`` extra) is missing, or the folder cannot be
        made
    """
    if not isinstance(model, BaseAlgorithm):
        raise TypeError(
            f"record_video takes a loaded SB3 model, got {model!r}; for a run dir or its zip, evaluate_run(..., video=True)"
        )
    count_arg(video_length, "video_length (0: the first episode)", low=0)
    seed_arg(seed)
    count_arg(frame_stack, "frame_stack", optional=True)
    count_arg(max_episode_steps, "max_episode_steps", optional=True)
    bool_arg(deterministic, "deterministic")
    if normalization is not None and not isinstance(normalization, VecNormalize):
        raise TypeError(f"normalization takes a VecNormalize (its statistics) or None, got {normalization!r}")
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"path: expected the mp4 file's path, got {path!r}")
    path = Path(path)
    if path.suffix != ".mp4":
        raise ConfigError(f"a video is written as mp4: give a path ending in .mp4, got {path}")
    spec = recordable(env)
    make_dir(path.parent, "video folder")
    _remove_abandoned(path)
    # A folder of this recording's own: two recordings of one model at once (evaluations of several seeds) each
    # write their own, and the last rename wins.
    try:
        scratch = Path(tempfile.mkdtemp(prefix=f".{path.name}.recording-", dir=path.parent))
    except OSError as e:
        if out_of_space(e):  # no room for even a folder: said as the incomplete video is
            raise ResultsNotWritten(f"could not write {e.filename or path.parent}: {e.strerror}") from None
        raise
    # From the first reset on: the first episode, or (a length given) that many frames across episodes.
    recorder_kwargs: dict[str, Any] = {
        "video_folder": str(scratch / "video"),  # a folder RecordVideo makes: one already there, it warns of
        "name_prefix": "video",
        "disable_logger": True,
        "episode_trigger": lambda episode: episode == 0,
        "video_length": video_length,
        # The console draws 60 frames a second, each one recorded here (ALE's render_fps would play them at half speed).
        "fps": 60 if spec.is_atari else None,
    }
    recorders: list[_Recorder] = []

    def make() -> gym.Env:
        recorder = _Recorder(spec.make(), video_length or MAX_EPISODE_FRAMES, **recorder_kwargs)
        recorders.append(recorder)
        return recorder

    with _headless():
        try:
            venv: VecEnv = make_vec_env(
                EnvSpec(spec.name, make, spec.is_atari),
                1,
                seed=seed,
                vec_env="dummy",
                frame_stack=frame_stack,
                max_episode_steps=max_episode_steps,
            )
            try:
                _check_fits(model, venv, spec.name, frame_stack)
                _play(model, _normalized(venv, normalization or model.get_vec_normalize_env()), recorders[0], deterministic)
            except BaseException:
                recorders[0].discard()  # Ctrl-C or an error: no video, and no time spent encoding one
                raise
            finally:
                venv.close()  # writes the video where the recording was still open
            written = list((scratch / "video").glob("*.mp4"))
            if len(written) != 1:
                raise ConfigError(f"env {spec.name} rendered no frames to record (render() returned no image)")
            if not complete_mp4(written[0]):  # ffmpeg's failure to finish it does not reach us otherwise
                raise ResultsNotWritten(
                    f"could not write {path}: ffmpeg left the video incomplete (is the disk full?); any earlier one is kept"
                )
            replace(written[0], path)  # the complete file, renamed over any earlier one
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return Video(path, recorders[0].captured, recorders[0].frames_per_sec)


def complete_mp4(path: Path) -> bool:
    """Whether ``path``'s top-level mp4 boxes fill it exactly and include the media and its index (``mdat``, ``moov``):
    an encoder that ran out of disk leaves a file cut short, or without its index, that players refuse."""
    size, at, kinds = path.stat().st_size, 0, set()
    with path.open("rb") as f:
        while at < size:
            f.seek(at)
            head = f.read(16)
            if len(head) < 8:
                return False
            length, kind = struct.unpack(">I4s", head[:8])
            if length == 1:  # a 64-bit size follows
                length = struct.unpack(">Q", head[8:16])[0] if len(head) == 16 else 0
            elif length == 0:  # the box runs to the end of the file
                length = size - at
            if length < 8:
                return False
            kinds.add(kind)
            at += length
    return at == size and {b"mdat", b"moov"} <= kinds


ABANDONED_S = 86_400.0  # a recording's scratch folder this old was left by a killed process: none takes a day


def _remove_abandoned(path: Path) -> None:
    """Remove the scratch folders of ``path``'s recordings that a killed process left (older than ABANDONED_S; a
    half-written mp4 in each)."""
    for folder in path.parent.glob(f".{glob.escape(path.name)}.recording-*"):
        with contextlib.suppress(OSError):
            if folder.is_dir() and not folder.is_symlink() and time.time() - folder.stat().st_mtime > ABANDONED_S:
                shutil.rmtree(folder)


def _check_fits(model: BaseAlgorithm, venv: VecEnv, env: str, frame_stack: int | None) -> None:
    """Refuse an env whose spaces differ from the model's, before its first frame: SB3 would say so mid-recording, in
    terms of its own reshaping."""

    def same(a: gym.spaces.Space, b: gym.spaces.Space) -> bool:
        if isinstance(a, gym.spaces.Box) and isinstance(b, gym.spaces.Box):
            return sorted(a.shape) == sorted(b.shape)  # an image is channel-first in the model: SB3 transposes it
        if isinstance(a, gym.spaces.Dict) and isinstance(b, gym.spaces.Dict):
            return set(a.spaces) == set(b.spaces) and all(same(a[k], b[k]) for k in a.spaces)
        return type(a) is type(b) and getattr(a, "n", None) == getattr(b, "n", None)

    def shown(space: gym.spaces.Space) -> str:
        return f"Box{space.shape}" if isinstance(space, gym.spaces.Box) else str(space)

    if not (same(model.observation_space, venv.observation_space) and same(model.action_space, venv.action_space)):
        raise ConfigError(
            f"the model takes observations {shown(model.observation_space)} and actions {shown(model.action_space)}; "
            f"env {env!r} (frame_stack={frame_stack}) gives {shown(venv.observation_space)} and "
            f"{shown(venv.action_space)}: record it on the env (and frame_stack) it trained on"
        )


@contextlib.contextmanager
def _headless() -> Iterator[None]:
    """Frames are drawn off screen: pygame (the classic-control and Box2D envs) needs no display or sound, and where
    it looks for them on a headless machine, SDL prints an error line. The settings last only while frames are drawn,
    so a later ``render_mode="human"`` window in the same process (a notebook's) still opens."""
    with temporary_environ(**{name: "dummy" for name in ("SDL_VIDEODRIVER", "SDL_AUDIODRIVER") if name not in os.environ}):
        yield


def recordable(env: str | Callable[[], gym.Env] | EnvSpec) -> EnvSpec:
    """``env`` made to render ``rgb_array`` frames; the one-line ConfigError a recording would meet, before anything
    else runs: moviepy or ffmpeg missing, or an env that cannot render."""
    # The mp4 is written with imageio-ffmpeg, and RecordVideo needs moviepy, whose import looks for ffmpeg itself (and
    # raises where there is none): imageio-ffmpeg and its ffmpeg are checked first.
    for package in ("imageio_ffmpeg", "moviepy"):
        try:
            importlib.import_module(package)
        except ImportError:
            raise ConfigError(f"recording a video needs {package}: {install_hint('video')}") from None
        except Exception as e:  # moviepy's FFMPEG_BINARY naming no program, say
            raise ConfigError(f"recording a video needs {package}, whose import failed: {named(e)}") from None
        if package == "imageio_ffmpeg":
            _check_ffmpeg()
    with _headless():
        return rendering(resolve_env(env))


def _check_ffmpeg() -> None:
    """Refuse an ffmpeg that cannot run (none found, IMAGEIO_FFMPEG_EXE naming no program, a binary for another
    platform) now: found when the mp4 is written, it would end the evaluation whose episodes had all run."""
    import imageio_ffmpeg

    try:
        exe = imageio_ffmpeg.get_ffmpeg_exe()
    except RuntimeError:
        raise ConfigError(
            "recording a video needs ffmpeg, and imageio-ffmpeg found none: install ffmpeg, or set IMAGEIO_FFMPEG_EXE to one"
        ) from None
    # evaluate --video checks before the evaluation, then records. By the program's own path: a relative or bare
    # IMAGEIO_FFMPEG_EXE names another (or none) after a chdir or a PATH change; one that is found nowhere is run.
    found = shutil.which(exe)
    program = os.path.realpath(found) if found is not None else None
    if program in _FFMPEG_RAN:
        return
    given = " (IMAGEIO_FFMPEG_EXE)" if os.environ.get("IMAGEIO_FFMPEG_EXE") else ""
    try:
        subprocess.run([exe, "-version"], capture_output=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError) as e:
        reason = f"exit status {e.returncode}" if isinstance(e, subprocess.CalledProcessError) else str(e)
        raise ConfigError(f"recording a video needs ffmpeg, and {exe}{given} does not run: {reason}") from None
    if program is not None:
        _FFMPEG_RAN.add(program)


_FFMPEG_RAN: set[str] = set()  # ffmpeg programs seen to run in this process (one that failed is tried again)


def _normalized(venv: VecEnv, normalization: VecNormalize | None) -> VecEnv:
    """``venv`` normalising observations with ``normalization``'s statistics, frozen (or as it is, without)."""
    if normalization is None:
        return venv
    frozen = VecNormalize(
        venv,
        training=False,
        norm_obs=normalization.norm_obs,
        norm_reward=False,
        clip_obs=normalization.clip_obs,
        epsilon=normalization.epsilon,
        norm_obs_keys=normalization.norm_obs_keys,
    )
    if normalization.norm_obs:  # VecNormalize has no obs_rms where it scales rewards only
        frozen.obs_rms = normalization.obs_rms  # read, never updated (training=False)
    return frozen


class _Recorder(RecordVideo):
    """RecordVideo that counts its frames, stops after ``limit`` of them (RecordVideo's own length keeps one more),
    and writes every frame it holds: moviepy, which RecordVideo writes through, drops the last frame of many clips
    (11 frames at 50 fps, 6 at 60: a rounding of the clip's duration), so the file is written by moviepy's own
    ffmpeg backend, imageio-ffmpeg, frame by frame."""

    def __init__(self, env: gym.Env, limit: int, **kwargs: Any):
        super().__init__(env, **kwargs)
        self.limit, self.captured = limit, 0
        self._name = "video"

    def start_recording(self, video_name: str) -> None:
        super().start_recording(video_name)
        self._name = video_name

    def stop_recording(self) -> None:
        frames = [np.asarray(frame) for frame in self.recorded_frames]  # RGB arrays, as _capture_frame keeps them
        self.discard()  # first: a failed write must not be tried again when the env closes
        if frames:
            _write_mp4(Path(self.video_folder) / f"{self._name}.mp4", frames, self.frames_per_sec)

    def discard(self) -> None:
        """End the recording without writing it."""
        self.recorded_frames = []
        self.recording = False

    def _capture_frame(self) -> None:
        before = len(self.recorded_frames)
        super()._capture_frame()  # stops the recording itself where render() gives no image
        if self.recording and len(self.recorded_frames) > before:
            self.captured += 1
            if self.captured >= self.limit:
                self.stop_recording()


def _write_mp4(path: Path, frames: list[np.ndarray], fps: int) -> None:
    """``frames`` (RGB, all one size) as an H.264 mp4 of exactly as many frames."""
    import imageio_ffmpeg  # moviepy's own dependency: installed with the video extra

    shape = frames[0].shape
    if frames[0].dtype != np.uint8 or len(shape) != 3 or shape[2] != 3 or any(f.shape != shape for f in frames):
        got = sorted({f"{f.dtype} {f.shape}" for f in frames})[:3]
        raise ConfigError(f"a video takes RGB frames of one size (uint8, height x width x 3); the env rendered {got}")
    # H.264 in yuv420p takes even sizes only: an odd height or width gets its last row or column once more.
    height, width = shape[0], shape[1]
    pad = ((0, height % 2), (0, width % 2), (0, 0))
    writer = imageio_ffmpeg.write_frames(
        str(path), (width + width % 2, height + height % 2), fps=fps, macro_block_size=1, output_params=["-loglevel", "error"]
    )
    writer.send(None)  # starts ffmpeg
    try:
        for frame in frames:
            writer.send(np.ascontiguousarray(np.pad(frame, pad, mode="edge") if height % 2 or width % 2 else frame))
    finally:
        writer.close()
    if not path.is_file() or path.stat().st_size == 0:  # ffmpeg's exit status does not reach us
        raise ConfigError(f"ffmpeg wrote no video to {path}")


def _play(model: BaseAlgorithm, venv: VecEnv, recorder: _Recorder, deterministic: bool) -> None:
    """Step ``venv`` with ``model`` from its first reset until ``recorder`` has finished its recording."""
    obs = venv.reset()
    while recorder.recording:
        action, _ = model.predict(obs, deterministic=deterministic)  # type: ignore[arg-type]
        obs, _, _, _ = venv.step(action)

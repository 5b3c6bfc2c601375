"""Videos of a trained policy: the quick start's run recorded by ``evaluate --video``, Atari through training's
preprocessing, and the errors a user meets."""

from __future__ import annotations

import os
import re
import sys
import time
import warnings

import cv2
import gymnasium as gym
import numpy as np
import pytest
from stable_baselines3 import PPO

from sb3_gpu.common.errors import ConfigError, ResultsNotWritten
from sb3_gpu.evaluate import main as evaluate_main
from sb3_gpu.runs.video import complete_mp4, record_video
from tests.conftest import run_cli


def read_back(path) -> tuple[int, int, int]:
    """An mp4's frame count, width and height, as a video player reads them."""
    video = cv2.VideoCapture(str(path))
    try:
        assert video.isOpened(), path
        frames = 0
        while video.read()[0]:
            frames += 1
        return frames, int(video.get(cv2.CAP_PROP_FRAME_WIDTH)), int(video.get(cv2.CAP_PROP_FRAME_HEIGHT))
    finally:
        video.release()


@pytest.mark.heavy
def test_the_quick_start_run_is_recorded_into_its_run_dir(tmp_path, call_main, monkeypatch):
    run_dir = tmp_path / "quickstart"
    # The quick start's command (make quickstart), on a short budget.
    args = ("ppo", "--env", "CartPole-v1", "--device", "auto", "--timesteps", "2048", "--no-progress")
    trained = run_cli("sb3_gpu.train", *args, "--run-dir", str(run_dir), "--eval-episodes", "2")
    assert trained.returncode == 0, trained.stderr
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call_main(evaluate_main, str(run_dir), "--episodes", "2", "--video")
    assert result.returncode == 0, result.stderr
    # Loading the model for 2 evaluation envs (training had 8) warns of no minibatch size: nothing is trained.
    assert not [w for w in caught if "mini-batch" in str(w.message)]
    match = re.search(r"video: (\S+) \(([\d,]+) frames at (\d+) fps\)", result.stdout)
    assert match is not None, result.stdout
    path, frames = run_dir / "videos" / "best_model.mp4", int(match[2].replace(",", ""))
    assert match[1] == str(path) and int(match[3]) == 50  # CartPole renders at 50 fps
    # The first episode: its reset frame and one frame per step, 600x400 as CartPole draws them.
    assert read_back(path) == (frames, 600, 400) and frames >= 9
    assert sorted(p.name for p in path.parent.iterdir()) == ["best_model.mp4"]  # no scratch folder left behind

    result = call_main(evaluate_main, str(run_dir), "--model", "final", "--episodes", "1", "--video-length", "30")
    assert result.returncode == 0 and read_back(run_dir / "videos" / "model.mp4") == (30, 600, 400)

    # A run dir where the video cannot be written is refused in one line, before any episode is played.
    for video in path.parent.iterdir():
        video.unlink()
    path.parent.rmdir()
    path.parent.write_text("")
    result = call_main(evaluate_main, str(run_dir), "--episodes", "2", "--video")
    assert result.returncode == 2 and result.stdout == "", result.stdout
    refused = f"error: cannot create video folder {path.parent}: {path.parent} is in the way (not a folder)"
    assert result.stderr.strip() == refused
    path.parent.unlink()

    # So is an ffmpeg that does not run: found when the mp4 was written, it ended the evaluation in a traceback.
    missing = tmp_path / "no-ffmpeg"
    monkeypatch.setenv("IMAGEIO_FFMPEG_EXE", str(missing))
    result = call_main(evaluate_main, str(run_dir), "--episodes", "2", "--video")
    assert result.returncode == 2 and result.stdout == "", result.stdout
    assert result.stderr.startswith(f"error: recording a video needs ffmpeg, and {missing} (IMAGEIO_FFMPEG_EXE) does not run")
    assert result.stderr.count("\n") == 1


@pytest.mark.parametrize("length", [6, 11, 12, 31])  # clip lengths whose last frame moviepy's writer drops
def test_every_recorded_frame_is_in_the_file(tmp_path, length):
    model = PPO("MlpPolicy", "CartPole-v1", device="cpu", seed=0)
    video = record_video(model, "CartPole-v1", tmp_path / "v.mp4", video_length=length, seed=0)
    assert video.frames == length and read_back(video.path) == (length, 600, 400)


def test_frames_of_odd_size_are_padded_to_the_even_size_h264_takes(tmp_path):
    from sb3_gpu.runs.video import _write_mp4

    _write_mp4(tmp_path / "odd.mp4", [np.full((21, 15, 3), 9 * i, np.uint8) for i in range(7)], fps=30)
    assert read_back(tmp_path / "odd.mp4") == (7, 16, 22)


def test_an_atari_game_is_recorded_frame_by_frame_while_the_policy_sees_its_training_preprocessing(tmp_path):
    from sb3_gpu.envs.build import make_vec_env

    # A CNN policy for what training gives it: SB3's AtariWrapper (84x84 grey) and 4 stacked frames.
    train_env = make_vec_env("ALE/Pong-v5", 1, vec_env="dummy", frame_stack=4)
    model = PPO("CnnPolicy", train_env, n_steps=16, batch_size=16, device="cpu", seed=0)
    train_env.close()
    video = record_video(model, "ALE/Pong-v5", tmp_path / "pong.mp4", video_length=40, frame_stack=4, seed=0)
    # Every emulator frame, in colour at the game's own size: AtariWrapper skips 4 frames per policy step.
    assert video.frames == 40 and read_back(video.path) == (40, 160, 210) and video.fps == 60


class NoRender(gym.Env):
    observation_space = gym.spaces.Box(-1, 1, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, render_mode=None):
        self.render_mode = render_mode


def test_an_env_that_cannot_render_frames_is_refused_in_one_line(tmp_path):
    model = PPO("MlpPolicy", "CartPole-v1", device="cpu")
    with pytest.raises(ConfigError, match=r"env tests.runs.test_video:NoRender cannot render 'rgb_array' frames"):
        record_video(model, "tests.runs.test_video:NoRender", tmp_path / "x.mp4")
    with pytest.raises(ConfigError, match="a video is written as mp4"):
        record_video(model, "CartPole-v1", tmp_path / "x.gif")
    (tmp_path / "taken").write_text("")
    with pytest.raises(ConfigError, match=r"cannot create video folder \S+taken: a file is in the way"):
        record_video(model, "CartPole-v1", tmp_path / "taken" / "x.mp4")


def test_a_missing_moviepy_names_the_extra_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "moviepy", None)  # import moviepy now raises ImportError
    model = PPO("MlpPolicy", "CartPole-v1", device="cpu")
    with pytest.raises(ConfigError, match=r"needs moviepy: pip install .*'moviepy>=[\d.]+'.*\[video\] extra"):
        record_video(model, "CartPole-v1", tmp_path / "x.mp4")
    assert list(tmp_path.iterdir()) == []  # neither a video nor a scratch folder
    # moviepy imports imageio-ffmpeg: where that one is missing, it is the one named.
    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)
    with pytest.raises(ConfigError, match=r"needs imageio_ffmpeg: pip install"):
        record_video(model, "CartPole-v1", tmp_path / "x.mp4")


@pytest.mark.parametrize("ffmpeg", ["missing", "fails", "none found"])
def test_an_ffmpeg_that_does_not_run_is_refused_before_recording(tmp_path, monkeypatch, ffmpeg):
    import imageio_ffmpeg

    # As in a new process: moviepy's import looks for ffmpeg itself, and raised before the check where it found none.
    for name in [name for name in sys.modules if name == "moviepy" or name.startswith("moviepy.")]:
        monkeypatch.delitem(sys.modules, name)
    exe = tmp_path / "ffmpeg"
    if ffmpeg == "fails":
        exe.write_text("#!/bin/sh\nexit 3\n")
        exe.chmod(0o755)
    if ffmpeg == "none found":
        monkeypatch.delenv("IMAGEIO_FFMPEG_EXE", raising=False)
        monkeypatch.setattr(imageio_ffmpeg, "get_ffmpeg_exe", lambda: (_ for _ in ()).throw(RuntimeError("No ffmpeg exe")))
        expected = "recording a video needs ffmpeg, and imageio-ffmpeg found none: install ffmpeg, or set IMAGEIO_FFMPEG_EXE"
    else:
        monkeypatch.setenv("IMAGEIO_FFMPEG_EXE", str(exe))
        reason = "exit status 3" if ffmpeg == "fails" else "No such file or directory"
        expected = re.escape(f"recording a video needs ffmpeg, and {exe} (IMAGEIO_FFMPEG_EXE) does not run: ") + f".*{reason}"
    model = PPO("MlpPolicy", "CartPole-v1", device="cpu")
    with pytest.raises(ConfigError, match=expected):
        record_video(model, "CartPole-v1", tmp_path / "videos" / "x.mp4")
    assert not (tmp_path / "videos").exists()


class BlankRender(NoRender):
    metadata = {"render_modes": ["rgb_array"], "render_fps": 30}

    def reset(self, *, seed=None, options=None):
        return np.zeros(2, np.float32), {}

    def step(self, action):
        return np.zeros(2, np.float32), 0.0, False, False, {}

    def render(self):
        return None  # claims rgb_array, draws nothing


def test_an_env_that_renders_no_image_is_refused_before_it_plays_and_leaves_nothing_behind(tmp_path):
    model = PPO("MlpPolicy", BlankRender(), device="cpu")
    with pytest.raises(ConfigError, match=r"among its render modes, but its render\(\) returned NoneType, not an image"):
        record_video(model, "tests.runs.test_video:BlankRender", tmp_path / "x.mp4")
    assert list(tmp_path.iterdir()) == []


class NeedsPygame(BlankRender):
    def render(self):
        raise gym.error.DependencyNotInstalled("pygame is not installed")


def test_an_env_whose_drawing_needs_a_missing_package_is_refused_before_recording(tmp_path):
    model = PPO("MlpPolicy", NeedsPygame(), device="cpu")
    with pytest.raises(ConfigError, match=r"pygame is not installed; pip install .*'pygame>=.*\[video\] extra\)$"):
        record_video(model, "tests.runs.test_video:NeedsPygame", tmp_path / "x.mp4")
    assert list(tmp_path.iterdir()) == []


def test_env_kwargs_that_set_a_render_mode_are_named():
    from sb3_gpu.envs.spec import rendering, resolve_env

    with pytest.raises(ConfigError, match="its env_kwargs set render_mode; remove it"):
        rendering(resolve_env("CartPole-v1", {"render_mode": "human"}))


def test_ctrl_c_while_recording_writes_nothing_and_leaves_the_process_as_it_was(tmp_path, monkeypatch):
    monkeypatch.delenv("SDL_VIDEODRIVER", raising=False)
    monkeypatch.delenv("SDL_AUDIODRIVER", raising=False)
    model = PPO("MlpPolicy", "CartPole-v1", device="cpu")
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return PPO.predict(model, *args, **kwargs)

    monkeypatch.setattr(model, "predict", interrupted)
    from sb3_gpu.runs import video

    encoded = []
    monkeypatch.setattr(video, "_write_mp4", lambda *args: encoded.append(args))
    with pytest.raises(KeyboardInterrupt):
        record_video(model, "CartPole-v1", tmp_path / "x.mp4", video_length=100)
    assert list(tmp_path.iterdir()) == [] and encoded == []  # no video, no scratch folder, no time spent encoding
    # Drawing off screen lasted only while frames were drawn: a later window in this process still opens.
    assert "SDL_VIDEODRIVER" not in os.environ and "SDL_AUDIODRIVER" not in os.environ


@pytest.mark.parametrize(
    "env, frame_stack, gives",
    [
        ("Pendulum-v1", None, "env 'Pendulum-v1' (frame_stack=None) gives Box(3,) and Box(1,)"),
        ("MountainCar-v0", None, "env 'MountainCar-v0' (frame_stack=None) gives Box(2,) and Discrete(3)"),
        ("CartPole-v1", 4, "env 'CartPole-v1' (frame_stack=4) gives Box(16,) and Discrete(2)"),
    ],
)
def test_an_env_other_than_the_models_is_refused_before_its_first_frame(tmp_path, env, frame_stack, gives):
    model = PPO("MlpPolicy", "CartPole-v1", device="cpu")
    with pytest.raises(ConfigError) as refused:
        record_video(model, env, tmp_path / "x.mp4", frame_stack=frame_stack, video_length=10)
    assert str(refused.value) == (
        f"the model takes observations Box(4,) and actions Discrete(2); {gives}: record it on the env (and frame_stack) "
        "it trained on"
    )
    assert list(tmp_path.iterdir()) == []


def test_an_unseeded_evaluations_video_plays_its_first_episode(tmp_path, monkeypatch):
    # Asked for no seed, the evaluation envs took one from the OS and the video env none: the video was another
    # episode than the first one evaluated. Seeded, both take the evaluation's seed.
    from types import SimpleNamespace

    from sb3_gpu import make_plan
    from sb3_gpu.runs import evaluation
    from sb3_gpu.runs.training import train_run

    overrides = {"n_envs": 1, "n_steps": 64, "batch_size": 64, "n_timesteps": 64, "probe": False}
    train_run(make_plan("ppo", "CartPole-v1", "cpu", vec_env="dummy", overrides=overrides), tmp_path / "run", progress=False)
    seeds: list[tuple[str, int | None]] = []

    def recorded(model, env, path, seed=None, **kwargs):
        seeds.append(("video", seed))
        return SimpleNamespace(path=path, frames=1, fps=50)

    monkeypatch.setattr(evaluation, "record_video", recorded)
    monkeypatch.setattr(evaluation.secrets, "randbits", lambda bits: 4321)
    evaluation.evaluate_run(tmp_path / "run", episodes=1, video=True)
    evaluation.evaluate_run(tmp_path / "run", episodes=1, video=True, seed=7)
    assert seeds == [("video", 4321), ("video", evaluation.offset_seed(7, evaluation.EVAL_SEED_OFFSET))]


def test_a_recording_writes_in_a_folder_of_its_own_and_removes_no_other(tmp_path):
    # Its scratch folder had a fixed name, removed first as an interrupted recording's: two evaluations of one model
    # at once (several seeds) removed each other's recording, and the second one failed with a traceback.
    other = tmp_path / ".v.mp4.recording"  # another recording's, under way
    other.mkdir()
    (other / "video-episode-0.mp4").write_bytes(b"frames")
    model = PPO("MlpPolicy", "CartPole-v1", device="cpu", seed=0)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*Overwriting existing videos")  # gymnasium's, of a folder there
        video = record_video(model, "CartPole-v1", tmp_path / "v.mp4", video_length=5, seed=0)
    assert read_back(video.path)[0] == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == [".v.mp4.recording", "v.mp4"]
    assert (other / "video-episode-0.mp4").read_bytes() == b"frames"
    # One a killed recording left a day ago goes, its half-written mp4 with it; a folder of another name stays.
    abandoned = tmp_path / ".v.mp4.recording-k1ll3d"
    abandoned.mkdir()
    (abandoned / "video-episode-0.mp4").write_bytes(b"half")
    day_old = time.time() - 86_401
    for folder in (other, abandoned):
        os.utime(folder, (day_old, day_old))
    record_video(model, "CartPole-v1", tmp_path / "v.mp4", video_length=5, seed=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".v.mp4.recording", "v.mp4"]


def test_a_working_ffmpeg_is_run_once_per_process_a_failing_one_each_time(tmp_path, monkeypatch):
    # evaluate --video checks before the evaluation, then the recording checks again: a slow ffmpeg cost twice.
    import subprocess

    from sb3_gpu.runs import video

    runs = []
    real = subprocess.run
    monkeypatch.setattr(subprocess, "run", lambda args, **kw: runs.append(args) or real(args, **kw))
    monkeypatch.setattr(video, "_FFMPEG_RAN", set())
    video.recordable("CartPole-v1")
    video.recordable("CartPole-v1")
    assert len(runs) == 1
    exe = tmp_path / "ffmpeg"
    exe.write_text("#!/bin/sh\nexit 3\n")
    exe.chmod(0o755)
    monkeypatch.setenv("IMAGEIO_FFMPEG_EXE", str(exe))
    for _ in range(2):
        with pytest.raises(ConfigError, match="does not run: exit status 3"):
            video.recordable("CartPole-v1")
    assert len(runs) == 3


def test_a_relative_ffmpeg_that_ran_is_checked_again_from_another_folder(tmp_path, monkeypatch):
    import imageio_ffmpeg

    from sb3_gpu.runs import video

    monkeypatch.delenv("IMAGEIO_FFMPEG_EXE", raising=False)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "ffmpeg").symlink_to(imageio_ffmpeg.get_ffmpeg_exe())
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.setattr(video, "_FFMPEG_RAN", set())
    monkeypatch.setenv("IMAGEIO_FFMPEG_EXE", "a/ffmpeg")
    monkeypatch.chdir(tmp_path)
    video.recordable("CartPole-v1")
    monkeypatch.chdir(tmp_path / "elsewhere")  # a notebook's chdir: a/ffmpeg is no program from here
    with pytest.raises(ConfigError, match=r"a/ffmpeg \(IMAGEIO_FFMPEG_EXE\) does not run"):
        video.recordable("CartPole-v1")
    # A bare name is looked for on PATH, never in the current folder, however the folder's file of that name ran.
    monkeypatch.setenv("IMAGEIO_FFMPEG_EXE", "ffmpeg")
    monkeypatch.setenv("PATH", f"{tmp_path / 'a'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.chdir(tmp_path / "a")
    video.recordable("CartPole-v1")
    monkeypatch.setenv("PATH", str(tmp_path / "elsewhere"))
    with pytest.raises(ConfigError, match=r"ffmpeg \(IMAGEIO_FFMPEG_EXE\) does not run"):
        video.recordable("CartPole-v1")


def test_an_mp4_cut_short_anywhere_is_not_complete(tmp_path):
    model = PPO("MlpPolicy", "CartPole-v1", device="cpu", seed=0)
    video = record_video(model, "CartPole-v1", tmp_path / "v.mp4", video_length=5, seed=0)
    data = video.path.read_bytes()
    assert complete_mp4(video.path)
    cut = tmp_path / "cut.mp4"
    for size in range(len(data)):
        cut.write_bytes(data[:size])
        assert not complete_mp4(cut), size
    cut.write_bytes(data + b"\0" * 4)  # trailing bytes that are no box
    assert not complete_mp4(cut)


def test_an_mp4_box_with_a_64_bit_size_is_read(tmp_path):
    import struct

    payload = b"\xab" * 40
    data = struct.pack(">I4s", 16, b"ftyp") + b"isom" * 2
    data += struct.pack(">I4sQ", 1, b"mdat", 16 + len(payload)) + payload  # a long video's media: over 4 GiB
    data += struct.pack(">I4s", 8, b"moov")
    path = tmp_path / "long.mp4"
    path.write_bytes(data)
    assert complete_mp4(path)
    for size in range(16, 33):  # cut inside the big box's 16-byte header
        path.write_bytes(data[:size])
        assert not complete_mp4(path), size


def test_a_video_the_encoder_left_incomplete_keeps_the_earlier_one_and_says_so(tmp_path, monkeypatch):
    # On a full disk ffmpeg leaves the mp4 cut short and exits with an error that does not reach sb3_gpu: the cut file
    # was renamed over the good one and reported as written.
    from sb3_gpu.runs import video

    model = PPO("MlpPolicy", "CartPole-v1", device="cpu", seed=0)
    path = tmp_path / "v.mp4"
    good = record_video(model, "CartPole-v1", path, video_length=5, seed=0).path.read_bytes()
    real = video._write_mp4

    def disk_full(path, frames, fps):
        real(path, frames, fps)
        path.write_bytes(path.read_bytes()[:-100])

    monkeypatch.setattr(video, "_write_mp4", disk_full)
    with pytest.raises(ResultsNotWritten, match=f"^could not write {re.escape(str(path))}: ffmpeg left the video incomplete"):
        record_video(model, "CartPole-v1", path, video_length=5, seed=0)
    assert path.read_bytes() == good
    assert [p.name for p in tmp_path.iterdir()] == ["v.mp4"]  # no scratch folder left


def test_no_room_for_the_recordings_folder_is_one_line_too(tmp_path, monkeypatch):
    import errno

    from sb3_gpu.runs import video

    def full(prefix, dir):
        raise OSError(errno.ENOSPC, "No space left on device", f"{dir}/{prefix}x")

    monkeypatch.setattr(video.tempfile, "mkdtemp", full)
    model = PPO("MlpPolicy", "CartPole-v1", device="cpu", seed=0)
    with pytest.raises(ResultsNotWritten, match=r"^could not write .*/\.v\.mp4\.recording-x: No space left on device$"):
        record_video(model, "CartPole-v1", tmp_path / "v.mp4", video_length=5, seed=0)

"""A subprocess VecEnv that steps several envs per worker and passes observations through shared memory.

SB3's SubprocVecEnv runs one process per env and pickles every observation both ways, so on a machine with few
cores most of a step is pipe traffic. Here W workers each own a contiguous slice of the envs: one message per
worker per step carries the actions out and the infos back, and the observations, rewards and dones are written
into one shared-memory block that the parent reads. Semantics are DummyVecEnv's: auto-reset with
``terminal_observation`` in the info, ``TimeLimit.truncated``, seeds and options applied at the next reset.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import multiprocessing as mp
import operator
import os
import signal
import statistics
import sys
import threading
import time
import traceback
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from multiprocessing import shared_memory
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

import cloudpickle
import gymnasium as gym
import numpy as np
from stable_baselines3.common.env_util import is_wrapped
from stable_baselines3.common.vec_env.base_vec_env import VecEnv, VecEnvIndices, VecEnvObs, VecEnvStepReturn
from stable_baselines3.common.vec_env.patch_gym import _patch_env
from stable_baselines3.common.vec_env.util import dict_to_obs, obs_space_info

from sb3_gpu.common.cli import ignore_stop_signals, stops_held
from sb3_gpu.common.errors import EnvWorkerError, warn
from sb3_gpu.common.hardware import logical_cores
from sb3_gpu.common.io import temporary_environ

# Preloaded by the forkserver, so that each worker forks with torch and SB3 already imported instead of importing
# them itself (3.4 s per worker on a 2-core Xeon, which is most of SubprocVecEnv's start-up).
_PRELOAD = ["sb3_gpu.envs.spec", "sb3_gpu.envs.batched"]


@contextlib.contextmanager
def main_kept_from_workers() -> Iterator[None]:
    """Workers started inside the block do not try to run a ``__main__`` that is no file on disk (a script piped to
    ``python -``: "<stdin>"), as spawn and forkserver have them run the script again, so no worker started at all.
    A real script is run again in them as before: its imports and top level register the envs they make. Threads
    hide it together: the name comes back when the last one is done (one that looked while another had hidden it
    found nothing to hide, and started its workers after the name came back)."""
    main = sys.modules.get("__main__")
    with _HIDDEN_LOCK:  # held for the bookkeeping only: threads start their workers side by side
        if _hidden["users"]:
            if _hidden["main"] is main:
                _hidden["users"] += 1
            else:  # another __main__ is hidden (runpy swapped it meanwhile): this one is left as it is
                main = None
        else:
            path = getattr(main, "__file__", None)
            if main is None or not isinstance(path, str) or os.path.isfile(path):
                main = None
            else:
                del main.__file__
                _hidden.update(users=1, main=main, path=path)
    if main is None:
        yield
        return
    try:
        yield
    finally:
        with _HIDDEN_LOCK:
            _hidden["users"] -= 1
            if not _hidden["users"]:
                main.__file__ = _hidden.pop("path")
                _hidden["main"] = None


_HIDDEN_LOCK = threading.Lock()
_hidden: dict[str, Any] = {"users": 0, "main": None}  # the __main__ whose file name is hidden, and by how many


def _unlocked_in_child() -> None:
    """A child forked while another thread held the lock would wait for it for good: that thread is not in it."""
    global _HIDDEN_LOCK
    _HIDDEN_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_unlocked_in_child)


def worker_start_method(start_method: str | None) -> str:
    """``start_method``, by default ``forkserver`` where available, else ``spawn`` (SB3's SubprocVecEnv's choice).

    For ``forkserver``, the server is asked to preload torch and SB3 if it is not up yet, whichever subprocess VecEnv
    starts it: a server started without them (by a plain SubprocVecEnv, say) would make every later worker import
    them itself. A server already up keeps what it preloads.
    """
    if getattr(mp.current_process(), "_inheriting", False):
        # A worker re-running a script that starts workers outside an ``if __name__ == "__main__":`` guard: it exits,
        # as multiprocessing intends, and quietly: the parent's fallback warning says why, once (each worker printed
        # a page of traceback before it).
        raise SystemExit(1)
    if start_method is None:
        start_method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    if start_method == "forkserver":
        from multiprocessing import forkserver

        # Add to (not replace) what the process preloads already.
        current = getattr(getattr(forkserver, "_forkserver", None), "_preload_modules", ["__main__"])
        mp.get_context("forkserver").set_forkserver_preload(list(dict.fromkeys([*current, *_PRELOAD])))
        _start_forkserver(forkserver)
    return start_method


def _start_forkserver(forkserver: Any) -> None:
    """Start the forkserver, if it is not up, marked so that it shields itself from SIGTERM (:func:`_shield_server`)."""
    # The shield mark is read and removed by the server as it imports this module. Libraries that size their thread
    # pools at import (OpenBLAS, MKL) do so in the server, for every worker it forks: one thread each, whoever starts
    # it (a build, a plan timing the workers' overhead).
    # The server's children get Ctrl-C as this process has it: ignored where it ignores it (a job started with &).
    mark = _IGNORES_INT if signal.getsignal(signal.SIGINT) == signal.SIG_IGN else "1"
    # SIGINT and SIGTERM ignored while it starts: the server inherits that through its exec, so a Ctrl-C during its
    # imports (seconds: torch) cannot end it with a traceback; it takes its own handlers once it shields itself.
    with temporary_environ(**{_SHIELD: mark, "OMP_NUM_THREADS": "1"}), stops_held(signal.SIG_IGN):
        forkserver.ensure_running()


def _shield_server(mark: str) -> None:
    """In the forkserver, which imports this module as it starts: ignore SIGTERM, as the workers do. It reaches a whole
    process group or job; a server that died of it would take its workers with it (they die with their parent) and
    leave the run unable to read how they ended, a clean stop turned into an env crash. The processes it forks get
    the default back (anyone's: only sb3_gpu's workers ignore it, themselves). It ignores SIGINT on its own, and
    exits with the training process still (its pipe closes)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.register_at_fork(after_in_child=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
    # Started with SIGINT ignored (stops_held(signal.SIG_IGN)), as its imports ran: the processes it forks get what a
    # server started without would give them (it ignores SIGINT itself, and gives them what it had).
    signal.signal(signal.SIGINT, signal.SIG_IGN if mark == _IGNORES_INT else signal.default_int_handler)


_SHIELD, _IGNORES_INT = "SB3_GPU_SHIELD_FORKSERVER", "1-sigint-ignored"
if (_mark := os.environ.pop(_SHIELD, None)) in ("1", _IGNORES_INT):
    _shield_server(_mark)


def batched_workers(n_envs: int, limit: int | None = None) -> int:
    """Worker processes for ``n_envs`` envs: ``limit`` (default one per logical core), at most one per env."""
    return max(1, min(n_envs, limit or logical_cores()))


def env_indices(indices: VecEnvIndices, n_envs: int) -> list[int]:
    """SB3's ``indices`` (None for all, an int, or ints) as non-negative ints, Python-style: ``-1`` is the last env.

    :raises IndexError: for an index outside ``-n_envs .. n_envs - 1``, before the caller touches any env
    """
    if indices is None:
        return list(range(n_envs))
    wanted = [indices] if isinstance(indices, (int, np.integer)) else list(indices)
    out = []
    for raw in wanted:
        i = operator.index(raw)
        if not -n_envs <= i < n_envs:
            raise IndexError(f"env index {i} is out of range for {n_envs} envs (valid: {-n_envs} to {n_envs - 1})")
        out.append(i % n_envs)
    return out


class _Layout:
    """Where each array lives in the shared block: observations per key, rewards, dones."""

    def __init__(self, observation_space: gym.Space, n_envs: int):
        self.keys, shapes, dtypes = obs_space_info(observation_space)
        fields: list[tuple[Any, tuple[int, ...], np.dtype]] = [
            (("obs", key), (n_envs, *shapes[key]), np.dtype(dtypes[key])) for key in self.keys
        ]
        fields += [("rewards", (n_envs,), np.dtype(np.float32)), ("dones", (n_envs,), np.dtype(bool))]
        self.fields, offset = [], 0
        for name, shape, dtype in fields:
            offset = -(-offset // 64) * 64  # cache-line aligned, so no two arrays share a line
            self.fields.append((name, shape, dtype.str, offset))
            offset += int(np.prod(shape)) * dtype.itemsize
        self.nbytes = max(offset, 1)

    def views(self, buf: memoryview) -> dict[Any, np.ndarray]:
        return {
            name: np.ndarray(shape, dtype=np.dtype(dtype), buffer=buf, offset=offset)
            for name, shape, dtype, offset in self.fields
        }


def _die_with_parent() -> None:
    # Linux only: the kernel kills this worker when the process that forked it dies, even by SIGKILL. (Under the
    # forkserver that is the server, which itself exits when the training process dies.)
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _worker(conn: Connection, payload: bytes, first: int) -> None:
    """A worker process: build its envs, map its slice of the shared block, then answer commands until closed."""
    # Ctrl-C, or a SIGTERM sent to the job, reaches the whole process group; the parent decides when to stop, and
    # closes the workers itself.
    ignore_stop_signals()
    _die_with_parent()
    worker = _Worker(first)
    try:
        worker.start(conn, payload)
        while worker.serve(conn):
            pass
    except BaseException as e:  # reported to the parent, which raises it with the env's index
        with contextlib.suppress(Exception):
            conn.send(("error", (worker.current, f"{type(e).__name__}: {e}", traceback.format_exc())))


class _Worker:
    """The envs of one worker, from index ``first`` on; ``current`` is the env being run, for error reports."""

    def __init__(self, first: int):
        self.first = self.current = first
        self.envs: list[gym.Env] = []
        self.handlers: dict[str, Callable[[Any], Any]] = {"step": self._step, "reset": self._reset, "call": self._call}

    def start(self, conn: Connection, payload: bytes) -> None:
        built: dict[int, int] = {}  # id of each env's unwrapped env -> its index
        for fn in cloudpickle.loads(payload):
            env = _patch_env(fn())
            # One object stepped as several envs corrupts every episode; DummyVecEnv refuses it, and so do we.
            # (The factories of a worker are unpickled together, so an env they all close over is one object here.)
            same = built.setdefault(id(env.unwrapped), self.current)
            if same != self.current:
                raise ValueError(
                    f"the env factory returned the same env object for envs {same} and {self.current}; "
                    "return a new env on each call (e.g. gym.make(...) inside the factory, not `lambda: env`)"
                )
            self.envs.append(env)
            self.current += 1
        conn.send(("ok", (self.envs[0].observation_space, self.envs[0].action_space)))
        _, (name, layout) = conn.recv()
        # Workers share the parent's resource tracker, which registers the block once and forgets it at unlink.
        self.shm = shared_memory.SharedMemory(name=name)
        views = layout.views(self.shm.buf)
        lo, hi = self.first, self.first + len(self.envs)
        self.obs = {key: views[("obs", key)][lo:hi] for key in layout.keys}
        self.rewards, self.dones = views["rewards"][lo:hi], views["dones"][lo:hi]
        conn.send(("ok", None))

    def serve(self, conn: Connection) -> bool:
        """Answer one command; False once closed or the parent is gone."""
        try:
            cmd, data = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return False
        self.current = self.first
        if cmd == "close":
            self._close()
            conn.send(("ok", None))
            return False
        reply = self.handlers[cmd](data)
        try:
            conn.send(("ok", reply))  # pickled whole before a byte is sent
        except Exception:
            self.current = self._unsendable(cmd, data, reply)
            raise
        return True

    def _unsendable(self, cmd: str, data: Any, reply: Any) -> int:
        """The env whose part of ``reply`` cannot be pickled (a lambda in its info, say): the reply is sent once all
        the worker's envs have run, so ``current`` is the last one's."""
        if cmd == "step":
            infos, reset_infos = reply
            parts = [(j, (info, reset_infos.get(j))) for j, info in enumerate(infos)]
        else:  # reset: one info per env; call: one result per env asked, in ``local``'s order
            parts = list(enumerate(reply)) if cmd == "reset" else list(zip(data[1], reply, strict=True))
        for j, part in parts:
            try:
                ForkingPickler.dumps(part)
            except Exception:
                return self.first + j
        return self.current

    def _each(self, indices: Any) -> Any:
        for j in indices:
            self.current = self.first + j
            yield j, self.envs[j]

    def _save(self, j: int, observation: Any) -> None:
        for key, array in self.obs.items():
            array[j] = observation if key is None else observation[key]

    def _step(self, actions: np.ndarray) -> tuple[list[dict[str, Any]], dict[int, dict[str, Any]]]:
        infos, reset_infos = [], {}
        for j, env in self._each(range(len(self.envs))):
            observation, reward, terminated, truncated, info = env.step(actions[j])
            info["TimeLimit.truncated"] = truncated and not terminated
            done = terminated or truncated
            if done:
                info["terminal_observation"] = observation
                observation, reset_infos[j] = env.reset()
            self._save(j, observation)
            self.rewards[j], self.dones[j] = reward, done
            infos.append(info)
        return infos, reset_infos

    def _reset(self, data: tuple[list[int | None], list[dict[str, Any]]]) -> list[dict[str, Any]]:
        seeds, options = data
        infos = []
        for j, env in self._each(range(len(self.envs))):
            kwargs = {"options": options[j]} if options[j] else {}
            observation, info = env.reset(seed=seeds[j], **kwargs)
            self._save(j, observation)
            infos.append(info)
        return infos

    def _call(self, data: tuple[str, list[int], tuple[Any, ...]]) -> list[Any]:
        kind, local, args = data
        return [_call(env, kind, args) for _, env in self._each(local)]

    def _close(self) -> None:
        """Close every env, as SB3's SubprocVecEnv does, even where one raises; the first error is raised after."""
        failed: tuple[int, BaseException] | None = None
        for j, env in self._each(range(len(self.envs))):
            try:
                env.close()
            except Exception as e:
                failed = failed or (j, e)
        del self.obs, self.rewards, self.dones
        self.shm.close()
        if failed is not None:
            self.current = self.first + failed[0]
            raise failed[1]


def _call(env: gym.Env, kind: str, args: tuple[Any, ...]) -> Any:
    if kind == "render":
        return env.render()
    if kind == "get_attr":
        return env.get_wrapper_attr(args[0])
    if kind == "has_attr":
        try:
            env.get_wrapper_attr(args[0])
        except AttributeError:
            return False
        return True
    if kind == "set_attr":
        return setattr(env, args[0], args[1])
    if kind == "env_method":
        name, method_args, method_kwargs = args
        return env.get_wrapper_attr(name)(*method_args, **method_kwargs)
    if kind == "is_wrapped":
        return is_wrapped(env, args[0])
    raise NotImplementedError(kind)


def _exit_cause(process: mp.process.BaseProcess) -> str:
    process.join(timeout=2)
    code = process.exitcode
    if code is None:
        return "stopped answering"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _shutdown(processes: list[Any], conns: list[Connection], shm: list[shared_memory.SharedMemory]) -> None:
    """Stop every worker and free the shared block; safe to call twice, and at interpreter exit."""
    for process in processes:  # SIGKILL: workers let SIGTERM pass (see ignore_stop_signals)
        if process.is_alive():
            process.kill()
    for process in processes:
        process.join(timeout=5)
    for conn in conns:
        conn.close()
    for block in shm:
        with contextlib.suppress(Exception):
            block.close()
        with contextlib.suppress(FileNotFoundError):
            block.unlink()
    shm.clear()


class BatchedSubprocVecEnv(VecEnv):
    """Envs stepped by ``n_workers`` processes, each owning a slice of them; observations in shared memory.

    :param env_fns: one factory per env (picklable with cloudpickle)
    :param n_workers: worker processes (default: one per logical core, at most one per env)
    :param start_method: multiprocessing start method (default: ``forkserver`` where available, else ``spawn``)
    """

    def __init__(self, env_fns: list[Callable[[], gym.Env]], n_workers: int | None = None, start_method: str | None = None):
        n_envs = len(env_fns)
        if n_envs == 0:
            raise ValueError("BatchedSubprocVecEnv needs at least one env factory")
        workers = batched_workers(n_envs, n_workers)
        bounds = np.linspace(0, n_envs, workers + 1).round().astype(int)
        self.slices = [(int(lo), int(hi)) for lo, hi in itertools.pairwise(bounds)]
        payloads = [cloudpickle.dumps(env_fns[lo:hi]) for lo, hi in self.slices]  # fails here, in the parent
        ctx = mp.get_context(worker_start_method(start_method))
        self.waiting, self.closed = False, False
        self._owed: set[int] = set()  # workers that were sent a command and have not answered yet
        self.processes: list[Any] = []
        self.conns: list[Connection] = []
        self._shm: list[shared_memory.SharedMemory] = []
        self._finalizer = weakref.finalize(self, _shutdown, self.processes, self.conns, self._shm)
        try:
            for w, ((lo, _), payload) in enumerate(zip(self.slices, payloads, strict=True)):
                parent_end, child_end = ctx.Pipe()
                # Closed by _abort whatever happens next: a worker whose start was interrupted (Ctrl-C while the
                # forkserver replies) runs without its pid known here, and ends when its pipe does.
                self.conns.append(parent_end)
                process = ctx.Process(  # type: ignore[attr-defined]
                    target=_worker, args=(child_end, payload, lo), daemon=True, name=f"sb3_gpu-env-worker-{w}"
                )
                try:
                    with main_kept_from_workers():
                        process.start()
                finally:
                    child_end.close()
                self.processes.append(process)
            spaces = [self._recv(w) for w in range(workers)]
            observation_space, action_space = spaces[0]
            self._layout = _Layout(observation_space, n_envs)
            block = shared_memory.SharedMemory(create=True, size=self._layout.nbytes)
            self._shm.append(block)
            self._views = self._layout.views(block.buf)  # type: ignore[arg-type]
            for w in range(workers):
                self._send(w, ("buffers", (block.name, self._layout)))
            for w in range(workers):
                self._recv(w)
            super().__init__(n_envs, observation_space, action_space)
        except BaseException:
            self._abort()
            raise

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids."""
        return [p.pid for p in self.processes]

    def _died(self, w: int) -> EnvWorkerError:
        lo, hi = self.slices[w]
        cause = _exit_cause(self.processes[w])
        self._abort()
        process = self.processes[w]
        return EnvWorkerError(
            f"env worker {w} (envs {lo}-{hi - 1}, pid {process.pid}) {cause}", env_index=lo, exit_code=process.exitcode
        )

    def _send(self, w: int, message: Any) -> None:
        try:
            self.conns[w].send(message)
        except OSError:  # a worker that died between steps (killed for memory, say): a closed pipe
            raise self._died(w) from None
        self._owed.add(w)

    def _recv(self, w: int) -> Any:
        try:
            status, payload = self.conns[w].recv()
        except (EOFError, OSError):
            raise self._died(w) from None
        self._owed.discard(w)
        if status == "error":
            index, summary, trace = payload
            self._abort()
            raise EnvWorkerError(f"env {index} (worker {w}) raised {summary}", env_index=index, worker_traceback=trace)
        return payload

    def _abort(self) -> None:
        self.closed, self.waiting = True, False
        self._finalizer()

    def _check_open(self) -> None:
        if self.closed:
            raise EnvWorkerError("this BatchedSubprocVecEnv is closed (after close() or a worker's failure)")

    def _obs(self) -> VecEnvObs:
        return dict_to_obs(self.observation_space, {key: self._views[("obs", key)].copy() for key in self._layout.keys})

    def step_async(self, actions: np.ndarray) -> None:
        self._check_open()
        for w, (lo, hi) in enumerate(self.slices):
            self._send(w, ("step", actions[lo:hi]))
        self.waiting = True

    def step_wait(self) -> VecEnvStepReturn:
        infos: list[dict[str, Any]] = []
        for w, (lo, _) in enumerate(self.slices):
            worker_infos, reset_infos = self._recv(w)
            infos.extend(worker_infos)
            for j, info in reset_infos.items():
                self.reset_infos[lo + j] = info
        self.waiting = False
        return self._obs(), self._views["rewards"].copy(), self._views["dones"].copy(), infos

    def reset(self) -> VecEnvObs:
        self._check_open()
        for w, (lo, hi) in enumerate(self.slices):
            self._send(w, ("reset", (self._seeds[lo:hi], self._options[lo:hi])))
        for w, (lo, hi) in enumerate(self.slices):
            self.reset_infos[lo:hi] = self._recv(w)
        self._reset_seeds()
        self._reset_options()
        return self._obs()

    def close(self) -> None:
        if self.closed:
            return
        try:
            # Workers still owing an answer (a step cut short by Ctrl-C) finish it first; they ignore SIGINT.
            for w in sorted(self._owed):
                if not self.conns[w].poll(30):
                    self._abort()  # a worker stuck in its env: terminated
                    return
                self._recv(w)
            for w in range(len(self.conns)):
                self._send(w, ("close", None))
        except BaseException as e:
            self._abort()  # joins the workers (terminating any that did not exit) and unlinks the shared block
            if isinstance(e, (EnvWorkerError, OSError)):
                return  # a dead worker: nothing left to close politely
            raise
        failed = []
        try:
            for w in range(len(self.conns)):
                # Each worker's answer read here, not by _recv, which would end every worker at the first error or
                # death while others still close theirs.
                try:
                    if self.conns[w].poll(30):
                        status, payload = self.conns[w].recv()
                        if status == "error":  # an env's own close() raised: its data may not be flushed
                            failed.append(f"env {payload[0]} (worker {w}) raised {payload[1]} while closing")
                except (EOFError, OSError):
                    continue  # a worker that died: the others still close
        finally:
            self._abort()  # joins the workers (terminating any that did not exit) and unlinks the shared block
            for failure in failed:
                warn(failure)

    def _call(self, kind: str, indices: VecEnvIndices, *args: Any) -> list[Any]:
        self._check_open()
        # All indices are checked before any worker is asked, so a bad one leaves every env as it was.
        targets = env_indices(indices, self.num_envs)
        asked = []
        for w, (lo, hi) in enumerate(self.slices):
            positions = [p for p, i in enumerate(targets) if lo <= i < hi]
            if positions:
                self._send(w, ("call", (kind, [targets[p] - lo for p in positions], args)))
                asked.append((w, positions))
        results: list[Any] = [None] * len(targets)
        for w, positions in asked:
            for p, value in zip(positions, self._recv(w), strict=True):
                results[p] = value
        return results

    def get_images(self) -> Sequence[np.ndarray | None]:
        if self.render_mode != "rgb_array":
            warnings.warn(f"The render mode is {self.render_mode}, but get_images() needs 'rgb_array'", stacklevel=2)
            return [None] * self.num_envs
        return self._call("render", None)

    def has_attr(self, attr_name: str) -> bool:
        return all(self._call("has_attr", None, attr_name))

    def get_attr(self, attr_name: str, indices: VecEnvIndices = None) -> list[Any]:
        return self._call("get_attr", indices, attr_name)

    def set_attr(self, attr_name: str, value: Any, indices: VecEnvIndices = None) -> None:
        self._call("set_attr", indices, attr_name, value)

    def env_method(
        self, method_name: str, *method_args: Any, indices: VecEnvIndices = None, **method_kwargs: Any
    ) -> list[Any]:
        return self._call("env_method", indices, method_name, method_args, method_kwargs)

    def env_is_wrapped(self, wrapper_class: type[gym.Wrapper], indices: VecEnvIndices = None) -> list[bool]:
        return self._call("is_wrapped", indices, wrapper_class)


class _IdleEnv(gym.Env):
    """An env whose step costs next to nothing: what :func:`measure_overhead` steps, so that the time is the vec env's."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (8,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        return np.zeros(8, np.float32), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        return np.zeros(8, np.float32), 0.0, False, False, {}


def measure_overhead(workers: int, steps: int = 200) -> tuple[float, float]:
    """Seconds that a step of this VecEnv costs besides its envs' own steps, on this machine: (a round trip to
    ``workers`` workers, each extra env). Timed with one env per worker and with 32 per worker, in alternating rounds
    (a busy spell falls on both); medians of 5 rounds each."""
    sizes = (workers, 32 * workers)
    venvs: list[BatchedSubprocVecEnv] = []
    try:
        for n_envs in sizes:
            venvs.append(BatchedSubprocVecEnv([_IdleEnv] * n_envs, n_workers=workers))
        actions = [np.zeros(n_envs, dtype=np.int64) for n_envs in sizes]
        for venv, action in zip(venvs, actions, strict=True):
            venv.reset()
            for _ in range(steps // 10):  # warm-up: the workers' first wake-ups are slower
                venv.step(action)
        rounds: list[list[float]] = [[], []]
        for _ in range(5):
            for i, (venv, action) in enumerate(zip(venvs, actions, strict=True)):
                start = time.perf_counter()
                for _ in range(steps // 5):
                    venv.step(action)
                rounds[i].append((time.perf_counter() - start) / (steps // 5))
    finally:
        for venv in venvs:
            venv.close()
    few, many = (statistics.median(r) for r in rounds)
    per_env = max(many - few, 0.0) / (sizes[1] - sizes[0])
    return max(few - workers * per_env, 0.0), per_env

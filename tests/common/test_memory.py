"""Free heap pages given back to the system: the C call, and the callback every training runs."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest
from stable_baselines3 import PPO

from sb3_gpu.common import memory
from sb3_gpu.runs.callbacks import ReturnFreeMemory
from sb3_gpu.runs.session import Session

glibc = pytest.mark.skipif(not memory.can_return_free_memory(), reason="malloc_trim is glibc's")


def _resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@glibc
def test_free_pages_under_a_live_block_go_back():
    # 200 MB of 100 kB blocks (under glibc's mmap threshold: they come from the heap), each written so its pages are
    # resident; freeing all but the last leaves the free space under a live block, where free() cannot shrink the heap.
    blocks = [b"x" * 100_000 for _ in range(2_000)]
    last = blocks.pop()
    before = _resident_mib()
    del blocks
    held = _resident_mib()
    assert held > before - 50, "free() already gave the pages back: the test no longer builds a held heap"
    assert memory.return_free_memory()
    assert _resident_mib() < held - 100
    assert last  # kept alive until here


def test_without_glibc_it_is_a_no_op(monkeypatch):
    memory._malloc_trim.cache_clear()
    monkeypatch.setattr(sys, "platform", "darwin")
    try:
        assert not memory.can_return_free_memory()
        assert memory.return_free_memory() is False
    finally:
        memory._malloc_trim.cache_clear()


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_the_callback_trims_once_per_interval_between_steps(monkeypatch):
    calls = []
    monkeypatch.setattr("sb3_gpu.runs.callbacks.return_free_memory", lambda: calls.append(1) or True)
    clock = _Clock()
    callback = ReturnFreeMemory(every_s=30.0, clock=clock)
    callback.model = SimpleNamespace(num_timesteps=0)  # all that on_step reads from the model
    callback.on_training_start({}, {})
    for now in (100.0, 129.9):  # not yet due
        clock.now = now
        assert callback.on_step()
    assert calls == []
    clock.now = 130.0
    callback.on_step()
    clock.now = 159.0  # due again only 30 s after the last call
    callback.on_step()
    assert len(calls) == 1 and callback.returned == 1
    clock.now = 160.0
    callback.on_step()
    assert len(calls) == 2 and callback.returned == 2


def test_every_session_gives_free_memory_back():
    model = PPO("MlpPolicy", "CartPole-v1", n_steps=16, batch_size=16, n_epochs=1, device="cpu")
    with Session(model) as session:
        kinds = [type(c) for c in session._callbacks(64)]
    assert ReturnFreeMemory in kinds


def test_a_plain_learn_takes_it_as_a_callback(monkeypatch):
    from sb3_gpu import ReturnFreeMemory as public

    calls = []

    def counted() -> bool:
        calls.append(1)
        return memory.return_free_memory()  # the real call: a no-op where the C library has none

    monkeypatch.setattr("sb3_gpu.runs.callbacks.return_free_memory", counted)
    model = PPO("MlpPolicy", "CartPole-v1", n_steps=16, batch_size=16, n_epochs=1, device="cpu")
    callback = public(every_s=0.0)  # due at every step
    model.learn(32, callback=callback)
    assert callback.n_calls == len(calls) == 32 and 0 <= callback.returned <= 32

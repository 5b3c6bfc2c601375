"""Host reads counted (the waits a GPU would see, counted on the CPU), and logged figures that wait for the log write."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import torch as th

from sb3_gpu.extensions.devicelog import DeviceLog
from sb3_gpu.extensions.hostreads import HostReads


def test_every_kind_of_read_is_counted_at_its_line_and_transfers_to_the_device_are_not():
    t = th.arange(4.0)
    with HostReads() as reads:
        t.sum().item()
        bool(t.sum() > 0)
        float(t[0])
        int(t[1])
        t.cpu()
        t.numpy()
        t.tolist()
        np.asarray(t)
        t.nonzero()
        t.to("cpu", dtype=th.float64)  # a transfer: on a GPU, the host does not wait for it
        t * 2 + 1
    assert reads.kinds == {
        "item": 1,
        "__bool__": 1,
        "__float__": 1,
        "__int__": 1,
        "cpu": 1,
        "numpy": 1,
        "tolist": 1,
        "__array__": 1,
        "nonzero": 1,
    }
    assert reads.total == 9 and all(site.split(" at ")[1].startswith(__file__) for site in reads.sites)


def test_an_optimizers_host_step_counters_are_not_reads_but_the_loss_is():
    weight = th.nn.Parameter(th.ones(3))
    optimizer = th.optim.Adam([weight])
    with HostReads() as reads:
        for _ in range(3):
            optimizer.zero_grad()
            loss = (weight**2).sum()
            loss.backward()
            optimizer.step()  # reads state["step"], which torch keeps on the host
        loss.item()
    assert reads.kinds == {"item": 1}


def test_the_log_keeps_means_and_latest_values_and_reads_them_all_at_once():
    log = DeviceLog()
    for loss in (1.0, 2.0, 6.0):
        log.mean("train/loss", th.tensor(loss))
    log.latest("per/max_priority", th.tensor(3.0, dtype=th.float64))
    log.latest("per/max_priority", th.tensor(4.0, dtype=th.float64))
    with HostReads() as reads:
        values = log.read()
    assert values == {"train/loss": 3.0, "per/max_priority": 4.0}
    assert reads.total == 1  # one stacked tensor read, however many figures
    assert log.read() == {}  # the next write starts a new mean
    log.mean("train/loss", th.tensor(5.0))
    assert log.read() == {"train/loss": 5.0}


def test_the_log_copies_and_pickles_with_its_pending_figures():
    log = DeviceLog()
    log.mean("train/loss", th.tensor(2.0))
    for other in (copy.deepcopy(log), pickle.loads(pickle.dumps(log))):
        other.mean("train/loss", th.tensor(4.0))
        assert other.read() == {"train/loss": 3.0}
    assert log.read() == {"train/loss": 2.0}

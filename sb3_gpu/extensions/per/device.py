"""Prioritized replay whose priorities, like its storage, live on the model's device: trees searched and updated with
batched tensor ops, and no host round trip when sampling, adding or writing back TD errors."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3.common.vec_env import VecNormalize

from sb3_gpu.common.checks import PER_CHECKS
from sb3_gpu.common.errors import ConfigError, TrainingDiverged, install_hint
from sb3_gpu.extensions.per.buffer import check_per_values
from sb3_gpu.extensions.per.tree import kernels, last_positive_before, level_offsets, level_sizes
from sb3_gpu.extensions.replay import DeviceReplayBuffer, ready_to_sample


class DeviceSumMinTree:
    """Sums and minima over ``capacity`` non-negative leaves, as float64 tensors on ``device``; empty leaves count 0 in
    sums and +inf in minima.

    The layout is :class:`SumMinTree`'s: ``fanout``-ary levels from the leaves up to a top of at most ``top`` nodes,
    all in one flat tensor per statistic (``sums``; ``mins`` from the first level up). A batch is searched or updated
    one level at a time with a few tensor ops per level, so a million leaves cost a cumulative sum over the top and two
    levels of gathers, whatever the batch size: few kernel launches on a GPU. Leaves set by ``update_range`` (what each
    env step adds) refresh their ancestors only when the tree is next read, so the steps between two samples cost one
    refresh.

    ``backend``: ``torch`` (those tensor ops, on any device) or ``numba``, the host tree's compiled loops run on the
    same memory, which on the CPU take a fraction of the tensor ops' per-call overhead. ``auto`` picks numba on the
    CPU where it is installed (the ``fast`` extra), else torch; a move off the CPU switches to torch.
    """

    def __init__(
        self, capacity: int, device: th.device | str = "cpu", fanout: int = 16, top: int | None = None, backend: str = "auto"
    ):
        if capacity < 1 or fanout < 2:
            raise ValueError(f"capacity must be >= 1 and fanout >= 2, got {capacity} and {fanout}")
        if backend not in ("auto", "torch", "numba"):
            raise ValueError(f"backend must be auto, torch or numba, got {backend!r}")
        if backend == "numba" and (kernels is None or th.device(device).type != "cpu"):
            raise ConfigError(f"the numba backend runs on the CPU and needs numba: {install_hint('fast')}")
        on_cpu = th.device(device).type == "cpu"
        self.backend = backend if backend != "auto" else "numba" if on_cpu and kernels is not None else "torch"
        self.capacity, self.fanout = capacity, fanout
        # float64 as the host tree: float32 sums carry ~7 digits, so over 10^6 leaves a small priority's share of
        # the total would be lost in rounding and the draws would no longer follow the priorities. The search and
        # updates are a few gathers per level, bound by launches and memory, not by float64 arithmetic.
        # A top of 256 suits the compiled loops (they pass over it per search), 4096 one cumulative sum per batch.
        self._sizes = level_sizes(capacity, fanout, top or (256 if self.backend == "numba" else 4096))
        self._sum_offsets, self._min_offsets = level_offsets(self._sizes)
        self.sums = th.zeros(sum(self._sizes), dtype=th.float64, device=device)
        self.mins = th.full((sum(self._sizes[1:]),), th.inf, dtype=th.float64, device=device)
        self._stale: tuple[int, int] | None = None  # leaves whose ancestors are out of date
        self._make_views()

    def _make_views(self) -> None:
        sizes, sums, mins = self._sizes, self.sums, self.mins
        self._level_sums = [sums[o : o + n] for o, n in zip(self._sum_offsets.tolist(), sizes, strict=True)]
        self._level_mins = [mins[o : o + n] for o, n in zip(self._min_offsets.tolist(), sizes[1:], strict=True)]
        # 1-based positions in a group and in the top: times "is non-empty", their max is the last non-empty one.
        self._ranks = th.arange(1, self.fanout + 1, device=sums.device)
        self._top_ranks = th.arange(1, sizes[-1] + 1, device=sums.device)

    @property
    def device(self) -> th.device:
        return self.sums.device

    def to(self, device: th.device | str) -> None:
        self.sums, self.mins = self.sums.to(device), self.mins.to(device)
        if self.sums.device.type != "cpu":
            self.backend = "torch"
        self._make_views()

    def __getstate__(self) -> dict[str, Any]:
        self._refresh()
        state = {k: v for k, v in self.__dict__.items() if k not in ("_level_sums", "_level_mins", "_ranks", "_top_ranks")}
        return {**state, "sums": self.sums.cpu().numpy(), "mins": self.mins.cpu().numpy()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "_sizes" not in state:  # saved by an earlier sb3_gpu, as a binary tree: rebuilt from its leaves
            first = state["leaves"]
            self.__init__(state["capacity"])  # type: ignore[misc]
            self.update_range(0, th.from_numpy(state["sums"][first : first + state["capacity"]]))
            return
        self.__dict__.update(state)
        self.sums, self.mins = th.from_numpy(self.sums), th.from_numpy(self.mins)
        if self.backend == "numba" and kernels is None:  # saved where numba was installed, loaded where it is not
            self.backend = "torch"
        self._make_views()

    @property
    def total(self) -> th.Tensor:
        """The sum of the leaves, a 0-dim tensor (reading it as a number waits for the device)."""
        self._refresh()
        return self._level_sums[-1].sum()

    @property
    def min(self) -> th.Tensor:
        """The smallest non-empty leaf (+inf if none), a 0-dim tensor."""
        self._refresh()
        if self._level_mins:
            return self._level_mins[-1].amin()
        leaves = self._level_sums[0]
        return th.where(leaves > 0, leaves, th.inf).amin()

    def __getitem__(self, indices: th.Tensor | np.ndarray) -> th.Tensor:
        return self._level_sums[0][th.as_tensor(indices, device=self.device)]

    def clear(self) -> None:
        self.sums.zero_()
        self.mins.fill_(th.inf)
        self._stale = None

    def update_range(self, start: int, values: th.Tensor) -> None:
        """Set the consecutive leaves from ``start``; their ancestors are refreshed when the tree is next read."""
        end = start + len(values)
        self._level_sums[0][start:end] = values
        # One span over all stale leaves: tight for a ring's consecutive adds; across its wrap, a whole rebuild.
        low, high = self._stale or (start, end)
        self._stale = (min(low, start), max(high, end))

    def _refresh(self) -> None:
        if self._stale is None:
            return
        low, high = self._stale
        self._stale = None
        fanout = self.fanout
        for level in range(1, len(self._sizes)):
            low, high = low // fanout, (high - 1) // fanout + 1
            # The children of nodes [low, high) are one contiguous slice of the level below, in groups of fanout.
            children = self._level_sums[level - 1][low * fanout : high * fanout].view(-1, fanout)
            th.sum(children, dim=1, out=self._level_sums[level][low:high])
            below = (
                th.where(children > 0, children, th.inf)
                if level == 1
                else self._level_mins[level - 2][low * fanout : high * fanout].view(-1, fanout)
            )
            th.amin(below, dim=1, out=self._level_mins[level - 1][low:high])

    def update(self, indices: th.Tensor, values: th.Tensor) -> None:
        """Set leaves ``indices`` to ``values`` and recompute their ancestors from their children.

        Of repeated indices one write wins (the last on the CPU, any on CUDA); the ancestors are recomputed from the
        leaves as written, so the tree always equals one rebuilt from its leaves.
        """
        self._refresh()
        nodes = indices.to(device=self.device, dtype=th.int64).reshape(-1)
        values = values.to(device=self.device, dtype=th.float64).reshape(-1).expand(len(nodes))
        if self.backend == "numba":
            assert kernels is not None
            args = (self.sums.numpy(), self.mins.numpy(), self._sum_offsets, self._min_offsets, self.fanout)
            kernels.update(*args, nodes.numpy(), values.contiguous().numpy())
            return
        self._level_sums[0].index_copy_(0, nodes, values)
        for level in range(1, len(self._sizes)):
            # Repeated parents are written repeatedly with one value: cheaper than deduplicating.
            nodes = nodes // self.fanout
            children = self._level_sums[level - 1].view(-1, self.fanout).index_select(0, nodes)
            self._level_sums[level].index_copy_(0, nodes, children.sum(dim=1))
            if level > 1:
                children = self._level_mins[level - 2].view(-1, self.fanout).index_select(0, nodes)
            self._level_mins[level - 1].index_copy_(0, nodes, th.where(children > 0, children, th.inf).amin(dim=1))

    def find(self, prefix: th.Tensor) -> tuple[th.Tensor, th.Tensor]:
        """For each ``u`` in ``[0, total)``, the leaf ``i`` with ``sum(leaves[:i]) <= u < sum(leaves[:i+1])``, and its value.

        Never an empty leaf, even where rounding puts ``u`` at or past the total: past a group's end the search takes
        the last non-empty child. The tree must not be empty.
        """
        self._refresh()
        prefix = prefix.to(device=self.device, dtype=th.float64)
        top = self._level_sums[-1]
        if self.backend == "numba":
            return self._find_numba(prefix, th.cumsum(top, dim=0))
        if th.compiler.is_compiling():
            # Inductor runs a cumulative sum on the CPU as a library call of its own, between its fused kernels. So a
            # compiled search takes its running sums as masked sums, which fuse, and searches the top (up to 4096 nodes,
            # too many for a square mask) as one more level: its groups of ``fanout``, then the children of the group.
            groups = th.nn.functional.pad(top, (0, -len(top) % self.fanout)).view(-1, self.fanout)
            group, prefix = self._descend(groups.sum(dim=1).unsqueeze(0), prefix)
            child, prefix = self._descend(groups.index_select(0, group), prefix)
            nodes = group * self.fanout + child
        else:
            # The top, whose children are all of it: the first node whose running sum passes u (never empty), or where
            # rounding put u at or past the total, the last non-empty node.
            inclusive = th.cumsum(top, dim=0)
            last = (self._top_ranks * (top > 0)).amax() - 1
            nodes = th.minimum(th.searchsorted(inclusive, prefix, right=True), last)
            prefix = (prefix - (inclusive[nodes] - top[nodes])).clamp_(min=0)
        for level in range(len(self._sizes) - 2, -1, -1):
            child, prefix = self._descend(self._level_sums[level].view(-1, self.fanout).index_select(0, nodes), prefix)
            nodes = nodes * self.fanout + child
        return nodes, self._level_sums[0].index_select(0, nodes)

    def _descend(self, children: th.Tensor, prefix: th.Tensor) -> tuple[th.Tensor, th.Tensor]:
        """For each sample's group (a row of ``children``, or one row shared by all), the child whose running sum first
        passes its prefix, never an empty one (past the group's end, the last non-empty child), and what is left of the
        prefix within it."""
        width = children.shape[1]
        if th.compiler.is_compiling():
            ranks = th.arange(width, device=children.device)
            inclusive = th.where(ranks.unsqueeze(1) >= ranks, children.unsqueeze(1), 0.0).sum(dim=2)
            ranks = ranks + 1
        else:
            inclusive, ranks = children.cumsum(dim=1), self._ranks
        last = (ranks * (children > 0)).amax(dim=1) - 1
        child = th.minimum((inclusive <= prefix.unsqueeze(1)).sum(dim=1), last).unsqueeze(1)
        if len(children) < len(prefix):  # one group for all samples
            inclusive, children = inclusive.expand(len(prefix), -1), children.expand(len(prefix), -1)
        prefix = (prefix - (inclusive.gather(1, child) - children.gather(1, child)).squeeze(1)).clamp_(min=0)
        return child.squeeze(1), prefix

    def _find_numba(self, prefix: th.Tensor, top_inclusive: th.Tensor) -> tuple[th.Tensor, th.Tensor]:
        assert kernels is not None
        host_prefix = prefix.numpy().copy()  # the kernel consumes its prefixes
        nodes, values = np.empty(len(host_prefix), dtype=np.int64), np.empty(len(host_prefix))
        kernels.find(self.sums.numpy(), self._sum_offsets, self.fanout, top_inclusive.numpy(), host_prefix, nodes, values)
        if not (values > 0).all():
            nodes, values = last_positive_before(self._level_sums[0].numpy(), nodes, values)
        return th.from_numpy(nodes), th.from_numpy(values)


_TENSORS = ("max_priority", "_new_leaf", "_last_max_weight", "_strata", "refused_updates", "_beta")  # pickled as arrays


class DevicePrioritizedReplayBufferSamples(NamedTuple):
    """SB3's ReplayBufferSamples plus the importance weights and the flat indices, both tensors on the device."""

    observations: th.Tensor
    actions: th.Tensor
    next_observations: th.Tensor
    dones: th.Tensor
    rewards: th.Tensor
    discounts: th.Tensor | None
    weights: th.Tensor
    indices: th.Tensor


class DevicePrioritizedReplayBuffer(DeviceReplayBuffer):
    """``PrioritizedReplayBuffer`` on the device: the same arguments, sampling distribution and weights, with the trees
    as tensors (its draws come from a torch generator seeded from NumPy's, so not the host buffer's very draws).

    Transition ``(pos, env)`` has flat index ``pos * n_envs + env``; samples carry ``indices`` as a device tensor, and
    ``update_priorities`` takes them back with the TD errors as tensors. Nothing waits for the device except the
    statistics read as numbers (and :meth:`check`): a non-finite TD error is refused on the device. Unlike the
    host buffer it takes ``optimize_memory_usage``: the slot whose observation the next step overwrote has priority 0.
    ``alpha``, ``beta``, ``eps``, ``n_steps``, ``gamma`` and ``normalize`` mean what they mean for
    :class:`PrioritizedReplayBuffer`.
    """

    normalize: str = "buffer"  # buffers pickled before the choice of normalisation keep the one they had

    def __init__(
        self,
        buffer_size: int,
        observation_space: spaces.Space,
        action_space: spaces.Space,
        device: th.device | str = "auto",
        n_envs: int = 1,
        optimize_memory_usage: bool = False,
        handle_timeout_termination: bool = True,
        alpha: float = 0.6,
        beta: float = 0.4,
        eps: float = 1e-6,
        n_steps: int = 1,
        gamma: float = 0.99,
        normalize: str = "batch",
    ):
        alpha, beta, eps = check_per_values(alpha, beta, eps)
        normalize = PER_CHECKS["normalize"](normalize, "per.normalize")
        super().__init__(
            buffer_size,
            observation_space,
            action_space,
            device,
            n_envs,
            optimize_memory_usage,
            handle_timeout_termination,
            n_steps,
            gamma,
        )
        self.alpha, self.beta, self.eps, self.normalize = alpha, beta, eps, normalize
        self.tree = DeviceSumMinTree(self.buffer_size * self.n_envs, self.device)
        self.max_priority = th.ones((), dtype=th.float64, device=self.device)  # before alpha
        self._new_leaf = self.max_priority**self.alpha  # what add() writes: max_priority ** alpha
        self._last_max_weight = th.ones((), dtype=th.float64, device=self.device)
        self.refused_updates = th.zeros((), dtype=th.int64, device=self.device)
        # The last sample's (p_min, total, transitions), for last_max_weight: computed when read (by the logger,
        # once per train()), not at each of its gradient steps' samples.
        self._last_draw: tuple[th.Tensor, th.Tensor, int] | None = None
        self._strata = th.arange(0, dtype=th.float64, device=self.device)  # 0 .. batch_size - 1, kept between samples
        self._beta = th.zeros((), dtype=th.float64, device=self.device)  # beta for a compiled step (a float recompiles)

    @property
    def last_max_weight(self) -> th.Tensor:
        """The largest unnormalised weight ``(N * p_min / total) ** -beta`` at the last sample, a 0-dim tensor."""
        if self._last_draw is not None:
            smallest, total, n = self._last_draw
            self._last_max_weight, self._last_draw = (n * smallest / total).pow(-self.beta), None
        return self._last_max_weight

    def _place(self, arrays: dict[str, th.Tensor | np.ndarray | None], device: th.device) -> None:
        super()._place(arrays, device)
        if getattr(self, "tree", None) is not None:  # absent while the base class allocates the storage
            self.tree.to(device)
            self.max_priority, self._new_leaf = self.max_priority.to(device), self._new_leaf.to(device)
            self._last_max_weight = self.last_max_weight.to(device)
            self._strata, self._beta = self._strata.to(device), self._beta.to(device)
            self.refused_updates = self.refused_updates.to(device)

    def host_copy_bytes(self) -> int:
        """The storage's bytes, as :class:`DeviceReplayBuffer`'s, and the trees' (their sums and minimums)."""
        if self.device.type == "cpu":
            return 0
        tree = self.tree.sums.numel() * self.tree.sums.element_size() + self.tree.mins.numel() * self.tree.mins.element_size()
        return super().host_copy_bytes() + tree

    def __getstate__(self) -> dict[str, Any]:
        self.last_max_weight  # noqa: B018 -- computes the pending figure, so the pickle holds it
        state = super().__getstate__()
        for name in _TENSORS:
            state[name] = state[name].cpu().numpy()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name in _TENSORS:
            if name in state:  # a buffer saved by an earlier sb3_gpu lacks the newer ones
                state[name] = th.from_numpy(state[name])
        state.setdefault("_new_leaf", state["max_priority"] ** state["alpha"])
        state.setdefault("_strata", th.arange(0, dtype=th.float64))
        state.setdefault("_last_draw", None)
        # Refusals are the saving run's, reported by it when it stopped; its priorities stayed finite. Carried over,
        # they would stop a resumed run at its first log write whatever it did.
        state["refused_updates"] = th.zeros((), dtype=th.int64)
        state.setdefault("_beta", th.zeros((), dtype=th.float64))
        super().__setstate__(state)  # then _place moves them, and the tree, to the buffer's device

    def reset(self) -> None:
        super().reset()
        if getattr(self, "tree", None) is not None:
            self.tree.clear()
            # In place: a compiled step holds these tensors' addresses.
            self.max_priority.fill_(1.0)
            self._new_leaf.copy_(self.max_priority**self.alpha)
            self._last_max_weight.fill_(1.0)

    def add(
        self,
        obs: np.ndarray,
        next_obs: np.ndarray,
        action: np.ndarray,
        reward: np.ndarray,
        done: np.ndarray,
        infos: list[dict[str, Any]],
    ) -> None:
        first = self.pos * self.n_envs
        super().add(obs, next_obs, action, reward, done, infos)
        self.tree.update_range(first, self._new_leaf.expand(self.n_envs))
        if self.optimize_memory_usage:
            # One-copy storage just wrote this step's next observation over slot pos's observation: never draw it.
            self.tree.update_range(self.pos * self.n_envs, self.max_priority.new_zeros(self.n_envs))

    def _uniforms(self, shape: int | tuple[int, ...]) -> th.Tensor:
        return th.rand(shape, generator=self._rng(), dtype=th.float64, device=self.device)

    def sample(self, batch_size: int, env: VecNormalize | None = None) -> DevicePrioritizedReplayBufferSamples:  # type: ignore[override]
        """Stratified sampling: one draw from each of ``batch_size`` equal slices of the priority total."""
        ready_to_sample(self)
        if len(self._strata) == 0:
            self.size_strata(batch_size)
        samples, smallest, total = self._prioritized(self._uniforms(batch_size), self.beta, env)
        self._last_draw = (smallest, total, self.size() * self.n_envs)
        return samples

    def _prioritized(
        self, uniforms: th.Tensor, beta: float | th.Tensor, env: VecNormalize | None, newest: th.Tensor | None = None
    ) -> tuple[DevicePrioritizedReplayBufferSamples, th.Tensor, th.Tensor]:
        """The samples that ``uniforms`` (one per stratum) pick, with the tree's minimum and total they were drawn at."""
        total = self.tree.total
        n = len(uniforms)
        # A sample of another size (a user's) draws over strata of its own: the kept ones, whose address a compiled
        # step has fixed, stay as they are.
        strata = self._strata if len(self._strata) == n else th.arange(n, dtype=th.float64, device=self.device)
        indices, priorities = self.tree.find((strata + uniforms) * (total / n))
        # w_i = (N * P(i)) ** -beta divided by the largest weight, that of the smallest priority: (p_i / p_min) ** -beta,
        # p_min the batch's or the buffer's (see normalize).
        smallest = self.tree.min
        weights = (priorities / (priorities.amin() if self.normalize == "batch" else smallest)).pow(-beta).float()
        # With one env, a scalar env index makes the gathers cheaper than a tensor of zeros.
        batch_inds, env_inds = (indices, 0) if self.n_envs == 1 else (indices // self.n_envs, indices % self.n_envs)
        samples = self._get_samples_at(batch_inds, env_inds, env, newest)
        return DevicePrioritizedReplayBufferSamples(*samples, weights=weights, indices=indices), smallest, total

    # -- sampling and updating inside a compiled step ----------------------------------------------------------------

    def samples_in_graph(self, env: VecNormalize | None) -> bool:
        """As the uniform buffer's, and the trees searched by tensor ops (not the host's compiled loops)."""
        return super().samples_in_graph(env) and self.tree.backend == "torch"

    def storage(self) -> list[th.Tensor]:
        tree = self.tree
        state = [tree.sums, tree.mins, *tree._level_sums, *tree._level_mins, tree._ranks, tree._top_ranks]
        mine = [self.max_priority, self._new_leaf, self.refused_updates, self._beta, self._strata]
        return [*super().storage(), *state, *mine]

    def size_strata(self, batch_size: int) -> None:
        """The strata for batches of ``batch_size`` (a compiled step fixes their address once they are sized)."""
        if len(self._strata) != batch_size:
            self._strata = th.arange(batch_size, dtype=th.float64, device=self.device)

    def prepare_graph_sampling(self, batch_size: int) -> None:
        """Before a compiled step's draws: the tree's pending refreshes done, the strata and ``beta`` in place, and
        the logged weight's figures taken (at the first of this train()'s samples rather than the last)."""
        self.tree._refresh()
        self.size_strata(batch_size)
        self._beta.fill_(self.beta)
        self._last_draw = (self.tree.min, self.tree.total, self.size() * self.n_envs)

    def uniforms(self, batch_size: int, samples: int | None = None) -> th.Tensor:
        """One uniform draw per stratum, from the buffer's generator (what :meth:`sample` draws): one op;
        ``samples``: those of that many samples at once (the first dimension), still one op."""
        return self._uniforms(batch_size if samples is None else (samples, batch_size))

    def samples_at_uniforms(self, uniforms: th.Tensor, position: th.Tensor) -> DevicePrioritizedReplayBufferSamples:
        """What :meth:`sample` returns for these draws, by tensor ops only, with ``beta`` and the write position
        (``fill_position``) as tensors, so that a compiled step samples inside its graph and compiles once."""
        return self._prioritized(uniforms, self._beta, None, position[1])[0]

    def update_priorities(self, indices: th.Tensor | np.ndarray, td_errors: th.Tensor | np.ndarray) -> None:
        """Set the priorities of sampled transitions from their new TD errors (tensors, or arrays).

        A NaN or inf TD error would poison the sum tree (its total, so every later draw). Such an update is refused
        on the device, without waiting for it: its transitions keep their priorities and ``refused_updates`` counts
        it; :meth:`check` raises for it (the DQN family's training calls it when it writes its logs). The state is
        updated in place, so that a compiled step can do it inside its graph.
        """
        priorities = th.as_tensor(td_errors, device=self.device).detach().to(th.float64).abs().reshape(-1) + self.eps
        indices = th.as_tensor(indices, device=self.device)
        finite = th.isfinite(priorities).all()
        self.refused_updates.add_((~finite).long())
        self.max_priority.copy_(th.where(finite, th.maximum(self.max_priority, priorities.max()), self.max_priority))
        self._new_leaf.copy_(self.max_priority**self.alpha)
        self.tree.update(indices, th.where(finite, priorities**self.alpha, self.tree[indices]))

    def check(self, refused: float | None = None) -> None:
        """Raise :class:`TrainingDiverged` if an update was refused for a NaN or inf TD error.

        :param refused: ``refused_updates`` read already (else it is read now: a wait for the device)
        """
        if refused if refused is not None else bool(self.refused_updates):
            raise TrainingDiverged(
                "a TD error is NaN or inf, so priorities and weights were left unchanged (the loss diverged: "
                "look for NaN or inf in rewards or observations, or lower the learning rate)"
            )

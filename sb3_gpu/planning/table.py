"""The plan as one table: the decisions with their reasons, then every hyperparameter with its source."""

from __future__ import annotations

from typing import Any

from rich.table import Table
from rich.text import Text

from sb3_gpu.config.schema import get_algo
from sb3_gpu.planning.plan import Plan

# Console columns in which the reasons take the room the values do not need and setting names stay whole (narrower
# still, a whole name would leave the values no room).
NARROW = (72, 120)


def plan_table(plan: Plan, width: int | None = None) -> Table:
    """The plan as one table: decisions with reasons, then every hyperparameter with its source (``width``: the
    console's, so that a narrow one wraps the long reasons rather than every column alike)."""
    narrow = width is not None and NARROW[0] <= width < NARROW[1]
    table = Table(
        title=f"sb3_gpu plan: {plan.algo.upper()} on {plan.env.name}",
        show_lines=False,
        title_justify="left",
        expand=narrow,
    )
    table.add_column("setting", style="bold", no_wrap=narrow)
    table.add_column("value", ratio=2 if narrow else None)
    table.add_column("why / source", style="dim", ratio=3 if narrow else None)
    _row(table, "hardware", plan.hardware.describe(), plan.hardware.cpu)
    _row(table, "device", plan.device.device, plan.device.reason)
    _row(table, "profile", plan.preset.profile, f"{plan.preset.entry}: {plan.profile_reason}")
    _row(table, "vec_env", plan.vec_env, plan.vec_env_reason)
    _row(table, "seed", str(plan.seed) if plan.seed is not None else "none", "" if plan.seed is not None else "a random one")
    _row(table, "buffers", plan.buffers, plan.buffers_reason)
    if not get_algo(plan.algo).on_policy:
        _row(table, "training", plan.training, plan.training_reason)
    unit = "emulator frames" if plan.env.is_atari else "steps"
    cap = f"{plan.eval_step_cap:,} {unit}" if plan.eval_step_cap is not None else "none"
    warn = plan.eval_step_cap_reason.startswith("warning")
    _row(table, "eval episode cap", cap, plan.eval_step_cap_reason, style="yellow" if warn else None)
    for name, value, why in plan.speed.rows() if plan.speed else []:
        if why.startswith("asked for") and name in plan.preset.sources:  # its preset row is not listed below
            why = f"asked for ({plan.preset.sources[name]})" + why.removeprefix("asked for")
        _row(table, name, value, why, style="yellow" if "warning:" in why else None)
    if plan.probe is not None:
        _row(table, "probe", plan.probe.summary(), "; ".join(plan.probe.lines()[1:]))
    table.add_section()
    values = plan.preset.values()
    decided = _decided_above(plan)
    for key, value in values.items():
        if (key == "policy_kwargs" and not value) or (key == "env_kwargs" and not value) or key in decided:
            continue
        shown = _show(value)
        if value is None and key in ("net_arch", "activation_fn"):
            default = plan.sb3_network[key == "activation_fn"] if plan.sb3_network is not None else None
            shown = "SB3 default" if default is None else f"SB3 default: {default}"
        why, style = plan.preset.sources.get(key, ""), None
        if key == "learning_starts" and value >= plan.preset.n_timesteps:
            why, style = f"{why}; warning: not below n_timesteps ({plan.preset.n_timesteps:,}): no gradient step", "yellow"
        if key == "batch_size" and plan.algo == "ppo" and value > (rollout := values["n_steps"] * values["n_envs"]):
            why, style = f"{why}; warning: more than one rollout ({rollout:,}): each minibatch is the whole rollout", "yellow"
        elif key == "batch_size" and plan.algo == "ppo" and (rest := values["n_steps"] * values["n_envs"] % value):
            why, style = f"{why}; warning: not a factor of the rollout: each epoch ends on a minibatch of {rest:,}", "yellow"
        if key == "n_timesteps" and (trained := plan.preset.timesteps_trained) != value:
            block = "rollout of n_steps" if plan.preset.algo == "ppo" else "train_freq of vec steps"
            why = f"{why}; trains {trained:,}: SB3 completes each {block} * n_envs"
        elif key == "n_timesteps" and (freq := values.get("train_freq")) and isinstance(freq, list) and freq[1] == "episode":
            why = f"{why}; may train past it: SB3 completes the episodes of each train_freq"
        if key == "eval_freq":  # RunOptions.frequencies' interval, in whole steps of the vec env as EvalCallback counts
            asked = value if value is not None else max(plan.preset.n_timesteps // 10, 1)
            every = max(asked // plan.preset.n_envs, 1) * plan.preset.n_envs
            shown = f"{every:,}"
            why = f"a tenth of n_timesteps ({why})" if value is None else why
            if every != asked:
                why = f"{why}; {asked:,} rounded to whole steps of {plan.preset.n_envs} envs"
        _row(table, key, shown, why, style=style)
    return table


def _decided_above(plan: Plan) -> set[str]:
    """Preset keys whose decision the rows above show, with what was asked for in their reason: not listed again."""
    keys = {"eval_max_episode_steps", "device_buffers"}
    if plan.speed is not None:
        keys |= {"amp", "compile", "threads"}
    if plan.probe is not None:
        keys.add("probe")
    if not get_algo(plan.algo).on_policy:
        keys.add("overlap_training")
    return keys


def _show(value: Any) -> str:
    if isinstance(value, dict) and value.get("schedule") == "linear":
        return f"linear {value['start']:g} -> {value['end']:g}"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def _row(table: Table, *cells: str, **kwargs: Any) -> None:
    """A row of plain text: rich would read ``[plot]`` in a value as markup, and drop it."""
    table.add_row(*(Text(cell) for cell in cells), **kwargs)

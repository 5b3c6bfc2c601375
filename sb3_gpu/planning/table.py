"""The plan as one table: the decisions with their reasons, then every hyperparameter with its source."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from sb3_gpu.config.schema import get_algo
from sb3_gpu.planning.plan import Plan


def plan_table(plan: Plan) -> Table:
    """The plan as one table: decisions with reasons, then every hyperparameter with its source."""
    table = Table(title=f"sb3_gpu plan: {plan.algo.upper()} on {plan.env.name}", show_lines=False, title_justify="left")
    table.add_column("setting", style="bold")
    table.add_column("value")
    table.add_column("why / source", style="dim")
    table.add_row("hardware", plan.hardware.describe(), plan.hardware.cpu_model)
    table.add_row("device", plan.device.device, plan.device.reason)
    table.add_row("profile", plan.preset.profile, f"{plan.preset.entry}: {plan.profile_reason}")
    table.add_row("vec_env", plan.vec_env, plan.vec_env_reason)
    table.add_row("seed", str(plan.seed), "")
    table.add_row("buffers", plan.buffers, plan.buffers_reason)
    if not get_algo(plan.algo).on_policy:
        table.add_row("training", plan.training, plan.training_reason)
    cap = f"{plan.eval_step_cap:,} steps" if plan.eval_step_cap is not None else "none"
    warn = plan.eval_step_cap_reason.startswith("warning")
    table.add_row("eval episode cap", cap, plan.eval_step_cap_reason, style="yellow" if warn else None)
    for name, value, why in plan.speed.rows() if plan.speed else []:
        table.add_row(name, value, why)
    if plan.probe is not None:
        table.add_row("probe", plan.probe.summary(), "; ".join(plan.probe.lines()[1:]))
    table.add_section()
    values = plan.preset.values()
    for key, value in values.items():
        if (key == "policy_kwargs" and not value) or (key == "env_kwargs" and not value):
            continue
        shown = "SB3 default" if value is None and key in ("net_arch", "activation_fn") else _show(value)
        table.add_row(key, shown, plan.preset.sources.get(key, ""))
    return table


def _show(value: Any) -> str:
    if isinstance(value, dict) and value.get("schedule") == "linear":
        return f"linear {value['start']:g} -> {value['end']:g}"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)

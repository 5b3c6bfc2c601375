"""``python -m sb3_gpu.tune ALGO --env ID --trials N``: an optuna study that many processes and machines can share.

Every worker runs the same command with the same ``--storage`` URL; the study lives in that storage, so workers
join it, a killed worker's trial is marked failed (heartbeats), and running the command again resumes it. The
default storage is an SQLite file in the study dir: nothing to start.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import re
import socket
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil
import yaml
from rich.console import Console
from rich.table import Table
from stable_baselines3.common.callbacks import EvalCallback
from stable_baselines3.common.evaluation import evaluate_policy
from stable_baselines3.common.vec_env import sync_envs_normalization

from sb3_gpu._cli import Parser, positive_int, print_error, seed_int
from sb3_gpu._io import atomic_write_bytes, atomic_write_text
from sb3_gpu.envs import VEC_ENV_KINDS, resolve_env
from sb3_gpu.errors import ConfigError, closest
from sb3_gpu.plan import build_env, build_model, make_plan
from sb3_gpu.presets import (
    ALGOS,
    apply_override,
    get_algo,
    load_preset_file,
    presets_dir,
    read_yaml,
    select_entry,
    validate_flat,
)

SAMPLERS = ("tpe", "random")
PRUNERS = ("median", "halving", "none")
_SPEC_KEYS = {"low", "high", "log", "choices"}


def _optuna() -> Any:
    try:
        import optuna
    except ImportError:
        raise ConfigError("tuning needs optuna: pip install 'sb3-gpu[tune]'") from None
    return optuna


# --------------------------------------------------------------------------- search spaces
def load_space(algo: str, path: str | Path | None = None) -> dict[str, dict[str, Any]]:
    """Read and check a search space: every key a preset key, every bound and choice a valid value for it."""
    algo_ = get_algo(algo)
    path = Path(path) if path is not None else presets_dir() / "search" / f"{algo_.name}.yaml"
    data = read_yaml(path, "search space")
    if not isinstance(data, dict) or not data:
        raise ConfigError(f"{path}: a search space must be a mapping of preset keys to {{low, high}} or {{choices}}")
    for key, spec in data.items():
        where = f"{path}, key {key}"
        if not isinstance(spec, dict) or not spec or not set(spec) <= _SPEC_KEYS:
            bad = sorted(set(spec) - _SPEC_KEYS) if isinstance(spec, dict) else []
            hint = closest(bad[0], _SPEC_KEYS) if bad else ""
            raise ConfigError(f"{where}: expected {{low, high[, log]}} or {{choices: [...]}}, got {spec!r}{hint}")
        if "choices" in spec:
            if set(spec) != {"choices"} or not isinstance(spec["choices"], list) or not spec["choices"]:
                raise ConfigError(f"{where}: 'choices' must be a non-empty list and stand alone")
            candidates = spec["choices"]
        else:
            if not {"low", "high"} <= set(spec) or not all(isinstance(spec[b], (int, float)) for b in ("low", "high")):
                raise ConfigError(f"{where}: a range needs numeric 'low' and 'high'")
            if spec["low"] >= spec["high"] or (spec.get("log") and spec["low"] <= 0):
                raise ConfigError(f"{where}: need low < high (and low > 0 with log: true)")
            candidates = [spec["low"], spec["high"]]
        for value in candidates:  # the preset checks say whether the key exists and the value is in its domain
            flat: dict[str, Any] = {}
            apply_override(flat, str(key), value)
            validate_flat(algo_, flat, f"{path}")
    return {str(k): v for k, v in data.items()}


def _encode(value: Any) -> Any:
    # optuna's categorical choices must be scalars; lists (net_arch) travel as their YAML text.
    return (
        value
        if value is None or isinstance(value, (bool, int, float, str))
        else yaml.safe_dump(value, default_flow_style=True).strip()
    )


def sample(trial: Any, space: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Draw one set of overrides; ``X.y`` keys are skipped when ``X`` was drawn false (``per.alpha`` without PER)."""
    params: dict[str, Any] = {}
    for key, spec in space.items():
        head = key.partition(".")[0]
        if "." in key and params.get(head) is False:
            continue
        if "choices" in spec:
            encoded = [_encode(c) for c in spec["choices"]]
            value = trial.suggest_categorical(key, encoded)
            params[key] = spec["choices"][encoded.index(value)]
        elif isinstance(spec["low"], int) and isinstance(spec["high"], int) and not isinstance(spec["low"], bool):
            params[key] = trial.suggest_int(key, spec["low"], spec["high"], log=bool(spec.get("log")))
        else:
            params[key] = trial.suggest_float(key, float(spec["low"]), float(spec["high"]), log=bool(spec.get("log")))
    return params


# --------------------------------------------------------------------------- storage
def mask_url(url: str) -> str:
    """The URL without its password, for messages."""
    return re.sub(r"(://[^:/@]+):[^@/]*@", r"\1:***@", url)


def make_storage(url: str, heartbeat_s: int) -> Any:
    """An optuna storage: ``journal:PATH`` (a journal file), or any SQLAlchemy URL (sqlite, postgresql, mysql)."""
    optuna = _optuna()
    if url.startswith("journal:"):
        from optuna.storages.journal import JournalFileBackend, JournalStorage

        path = Path(url.removeprefix("journal:"))
        path.parent.mkdir(parents=True, exist_ok=True)
        return JournalStorage(JournalFileBackend(str(path)))
    if "://" not in url:
        raise ConfigError(
            f"storage {url!r} is not a URL (accepted: sqlite:///FILE, postgresql://..., mysql://..., journal:FILE)"
        )
    for attempt in range(5):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # heartbeats: stable in practice
                return optuna.storages.RDBStorage(
                    url, heartbeat_interval=heartbeat_s, grace_period=2 * heartbeat_s, engine_kwargs={"pool_pre_ping": True}
                )
        except ImportError:
            raise ConfigError(
                f"storage {mask_url(url)}: its database driver is not installed "
                "(PostgreSQL: pip install 'sb3-gpu[tune]'; MySQL: pip install PyMySQL)"
            ) from None
        except Exception as e:  # SQLAlchemy raises many kinds: refused connection, bad credentials, unknown database
            text = str(e).lower()
            if attempt < 4 and ("already exists" in text or "duplicate" in text):
                # Workers started together on an empty database race to create optuna's tables: the loser retries.
                time.sleep(0.5 * (attempt + 1))
                continue
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"cannot open storage {mask_url(url)}: {mask_url(first)}") from None
    raise AssertionError("unreachable")  # pragma: no cover


def fail_dead_local_trials(study: Any) -> int:
    """Mark failed the RUNNING trials of workers on this host whose process is gone; return how many.

    RDB storages do this by heartbeat; a journal file has no heartbeats, and this covers the one-machine case.
    """
    optuna = _optuna()
    host, failed = socket.gethostname(), 0
    for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        worker_host, _, pid = str(trial.user_attrs.get("worker", "")).rpartition(":")
        if worker_host == host and pid.isdigit() and not psutil.pid_exists(int(pid)):
            with contextlib.suppress(Exception):  # another worker may have failed it first
                study._storage.set_trial_state_values(trial._trial_id, state=optuna.trial.TrialState.FAIL)
                failed += 1
    return failed


# --------------------------------------------------------------------------- the objective
class TrialEvalCallback(EvalCallback):
    """SB3's EvalCallback that reports each evaluation to the trial and stops training when the pruner says so.

    :param eval_freq: evaluate every this many calls (env steps / n_envs), as EvalCallback counts
    """

    def __init__(self, trial: Any, eval_env: Any, eval_freq: int, episodes: int, step_offset: int = 0):
        super().__init__(eval_env, n_eval_episodes=episodes, eval_freq=eval_freq, deterministic=True, verbose=0)
        self.trial, self.step_offset, self.pruned = trial, step_offset, False

    def _on_step(self) -> bool:
        keep_going = super()._on_step()
        if self.n_calls % self.eval_freq == 0:
            self.trial.report(float(self.last_mean_reward), self.step_offset + self.num_timesteps)
            self.pruned = bool(self.trial.should_prune())
        return keep_going and not self.pruned


def make_objective(args: argparse.Namespace, space: dict[str, dict[str, Any]]) -> Any:
    optuna = _optuna()

    worker = f"{socket.gethostname()}:{os.getpid()}"

    def objective(trial: Any) -> float:
        trial.set_user_attr("worker", worker)
        params = sample(trial, space)
        scores = []
        for i in range(args.seeds):
            try:
                plan = make_plan(
                    args.algo, args.env, args.device, seed=args.seed + i, n_timesteps=args.timesteps,
                    vec_env=args.vec_env, overrides=params, override_source="search space",
                )  # fmt: skip
            except ConfigError as e:  # an invalid combination (say batch_size > n_steps * n_envs): not a result
                trial.set_user_attr("invalid", str(e))
                raise optuna.TrialPruned(f"invalid combination: {e}") from None
            env = build_env(plan)
            eval_env = None
            try:
                eval_env = build_env(plan, evaluation=True)
                model = build_model(plan, env)
                freq = args.eval_freq or max(plan.preset.n_timesteps // 5, 1)
                callback = TrialEvalCallback(
                    trial, eval_env, max(freq // plan.preset.n_envs, 1), args.eval_episodes, i * plan.preset.n_timesteps
                )
                model.learn(plan.preset.n_timesteps, callback=callback)
                if callback.pruned:
                    raise optuna.TrialPruned(f"pruned at {callback.num_timesteps} timesteps of seed {args.seed + i}")
                sync_envs_normalization(env, eval_env)
                mean, _ = evaluate_policy(model, eval_env, n_eval_episodes=args.eval_episodes, deterministic=True)
                scores.append(float(mean))  # type: ignore[arg-type]
            finally:
                env.close()
                if eval_env is not None:
                    eval_env.close()
        trial.set_user_attr("seed_scores", scores)
        score = statistics.fmean(scores)
        if not math.isfinite(score):
            raise RuntimeError(f"trial {trial.number} scored {score}")
        return score

    return objective


# --------------------------------------------------------------------------- results
def best_table(study: Any, top: int = 5) -> Table:
    optuna = _optuna()
    done = [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))]
    done.sort(key=lambda t: t.value, reverse=True)
    counts = {s.name.lower(): len(study.get_trials(deepcopy=False, states=(s,))) for s in optuna.trial.TrialState}
    summary = ", ".join(f"{n} {name}" for name, n in counts.items() if n)
    table = Table(title=f"study {study.study_name}: {summary}", title_justify="left")
    for column in ("trial", "score", "per seed", "params"):
        table.add_column(column)
    for t in done[:top]:
        seeds = ", ".join(f"{s:.1f}" for s in t.user_attrs.get("seed_scores", []))
        table.add_row(str(t.number), f"{t.value:.2f}", seeds, ", ".join(f"{k}={v}" for k, v in t.params.items()))
    return table


def export_preset(study: Any, algo: str, env: str, path: Path, timesteps: int) -> Path:
    """The best trial as a preset file: the bundled entry for ``env`` with the tuned keys set (profiles dropped)."""
    algo_ = get_algo(algo)
    best = study.best_trial
    entries, label = load_preset_file(algo_)
    spec = resolve_env(env)
    name = select_entry(entries, spec.name, spec.is_atari, label)
    raw = read_yaml(presets_dir() / f"{algo_.name}.yaml")[name]
    # Profiles would override the tuned values on some machines; the tuned values hold everywhere.
    entry = {k: v for k, v in raw.items() if k not in ("cpu", "gpu", "large")}
    for key, value in _decoded_params(best, study).items():
        apply_override(entry, key, value)
    header = (
        f"# Tuned by python -m sb3_gpu.tune {algo} --env {env}: trial {best.number} of study {study.study_name!r},\n"
        f"# mean score {best.value:.2f} over {len(best.user_attrs.get('seed_scores', [])) or 1} seed(s) at {timesteps} "
        f"timesteps each. Train it: python -m sb3_gpu.train {algo} --env {env} --preset {path.name}\n"
    )
    atomic_write_text(path, header + yaml.safe_dump({spec.name: entry}, sort_keys=False))
    load_preset_file(algo_, path)  # what we wrote must load as a preset
    return path


def _decoded_params(trial: Any, study: Any) -> dict[str, Any]:
    space = study.user_attrs.get("space", {})
    out = {}
    for key, value in trial.params.items():
        choices = space.get(key, {}).get("choices")
        out[key] = choices[[_encode(c) for c in choices].index(value)] if choices else value
    return out


def write_plots(study: Any, folder: Path) -> list[str]:
    """optuna's optimization history and parameter importances as PNGs; a note for each one not drawn."""
    notes = []
    try:
        import matplotlib

        matplotlib.use("Agg")
        from optuna.visualization import matplotlib as vis
    except ImportError as e:
        return [f"plots not drawn ({e}): pip install 'sb3-gpu[plot]'"]
    for name, draw in (
        ("optimization_history", vis.plot_optimization_history),
        ("param_importances", vis.plot_param_importances),
    ):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # optuna marks its matplotlib plots experimental
                ax: Any = draw(study)
            figure = ax.figure if hasattr(ax, "figure") else ax.flat[0].figure
            png = io.BytesIO()
            figure.savefig(png, format="png", dpi=100, bbox_inches="tight")
            atomic_write_bytes(folder / f"{name}.png", png.getvalue())
            notes.append(str(folder / f"{name}.png"))
        except Exception as e:  # importances need 2+ complete trials with varied params, for one
            notes.append(f"{name} not drawn: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    return notes


# --------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m sb3_gpu.tune", description="Tune a preset with optuna; share one storage across machines.")
    p.add_argument("algo", type=str.lower, choices=ALGOS, help=f"algorithm: {', '.join(ALGOS)}")
    p.add_argument("--env", default="CartPole-v1", help="Gymnasium id or 'module:Attr' (default CartPole-v1)")
    p.add_argument("--trials", type=positive_int, default=20, help="finished trials the study should reach (default 20)")
    p.add_argument("--storage", help="optuna storage URL shared by all workers (default: sqlite in the study dir)")
    p.add_argument("--study-name", help="default: ALGO-ENV")
    p.add_argument("--study-dir", help="results: preset, plots, default storage (default: tune/STUDY_NAME)")
    p.add_argument("--sampler", choices=SAMPLERS, default="tpe")
    p.add_argument("--pruner", choices=PRUNERS, default="median")
    p.add_argument("--seeds", type=positive_int, default=1, help="seeds per trial; the score is their mean (default 1)")
    p.add_argument("--seed", type=seed_int, default=0, help="first seed (default 0)")
    p.add_argument("--timesteps", type=positive_int, help="timesteps per seed (default: the preset's)")
    p.add_argument("--eval-episodes", type=positive_int, default=10, help="episodes per evaluation (default 10)")
    p.add_argument("--eval-freq", type=positive_int, help="evaluate (and maybe prune) every N timesteps (default: a fifth)")
    p.add_argument("--device", default="auto", help="auto (default), cpu, cuda, cuda:N or mps")
    p.add_argument("--vec-env", choices=VEC_ENV_KINDS, default="auto")
    p.add_argument("--space", metavar="FILE", help="a search-space YAML (default: the bundled one for ALGO)")
    p.add_argument(
        "--heartbeat", type=positive_int, default=60, help="seconds; a silent worker's trial fails after 2x (RDB storages)"
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console()
    try:
        optuna = _optuna()
        space = load_space(args.algo, args.space)
        plan = make_plan(args.algo, args.env, args.device, n_timesteps=args.timesteps, vec_env=args.vec_env)
        timesteps = plan.preset.n_timesteps
        name = args.study_name or re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{args.algo}-{plan.env.name}")
        folder = Path(args.study_dir or Path("tune") / name)
        folder.mkdir(parents=True, exist_ok=True)
        url = args.storage or f"sqlite:///{(folder / 'study.db').resolve()}"
        storage = make_storage(url, args.heartbeat)
        sampler = optuna.samplers.TPESampler(n_startup_trials=5) if args.sampler == "tpe" else optuna.samplers.RandomSampler()
        pruner = {
            "median": optuna.pruners.MedianPruner(n_startup_trials=5, n_warmup_steps=timesteps // 3),
            "halving": optuna.pruners.SuccessiveHalvingPruner(),
            "none": optuna.pruners.NopPruner(),
        }[args.pruner]
        study = optuna.create_study(
            study_name=name, storage=storage, sampler=sampler, pruner=pruner, direction="maximize", load_if_exists=True
        )
        made_for = (study.user_attrs.get("algo"), study.user_attrs.get("env"))
        if made_for[0] is None:
            study.set_user_attr("algo", args.algo)
            study.set_user_attr("env", plan.env.name)
            study.set_user_attr("space", space)
        elif made_for != (args.algo, plan.env.name):
            raise ConfigError(
                f"study {name!r} in {mask_url(url)} tunes {made_for[0]} on {made_for[1]}; choose another --study-name"
            )
    except ConfigError as e:
        print_error(str(e))
        return 2
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    finished = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    if dead := fail_dead_local_trials(study):
        console.print(f"marked {dead} trial(s) of dead workers on this host as failed")
    done = len(study.get_trials(deepcopy=False, states=finished))
    console.print(f"study {name} in {mask_url(url)}: {done} of {args.trials} trials finished; this worker joins in")
    if done < args.trials:
        optuna.logging.set_verbosity(optuna.logging.INFO)
        study.optimize(
            make_objective(args, space),
            n_trials=args.trials - done,
            callbacks=[optuna.study.MaxTrialsCallback(args.trials, states=finished)],
            gc_after_trial=True,
            # A trial that diverges (NaN logits) or runs out of memory fails alone; the worker and the study go on.
            catch=(Exception,),
        )
    console.print(best_table(study))
    if not study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        print_error("no trial completed, so there is no best preset to export")
        return 1
    preset = export_preset(study, args.algo, plan.env.name, folder / "best_preset.yaml", timesteps)
    console.print(f"best preset: {preset}  (python -m sb3_gpu.train {args.algo} --env {plan.env.name} --preset {preset})")
    for note in write_plots(study, folder):
        console.print(f"plot: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

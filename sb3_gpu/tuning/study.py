"""A study's trials: sampling overrides from a search space, scoring them through the same training Session as
``train`` (NaN guard, signals, telemetry), and exporting the best trial as a preset."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import shlex
import statistics
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from sb3_gpu.common.errors import ConfigError, install_hint
from sb3_gpu.common.io import atomic_write_bytes, atomic_write_text
from sb3_gpu.config.files import presets_dir, read_yaml
from sb3_gpu.config.presets import apply_override, load_preset_file, select_entry
from sb3_gpu.config.schema import PROFILES, Algo, get_algo, valid_keys
from sb3_gpu.envs.build import close_vec_envs
from sb3_gpu.envs.spec import resolve_env
from sb3_gpu.planning.build import build_env, build_model
from sb3_gpu.planning.plan import make_plan
from sb3_gpu.runs.evaluation import EvaluationStopped, TimedEvalCallback, confirm_count, eval_envs
from sb3_gpu.runs.session import Session
from sb3_gpu.runs.threshold import THRESHOLD_EVALUATIONS, UNREACHED_PENALTY_S, train_to_threshold
from sb3_gpu.tuning.storage import import_optuna, worker_attrs


@dataclass(frozen=True)
class TrialSettings:
    """How each trial trains and is scored.

    :ivar seeds: seeds per trial, from ``seed`` on; the score is the mean of their scores
    :ivar timesteps: timesteps per seed (None: the preset's)
    :ivar threads: torch's CPU threads (None: the plan's choice)
    :ivar eval_freq: evaluate (and maybe prune) every N timesteps (None: a fifth of the run; a fiftieth with
        ``threshold``)
    :ivar threshold: None: a seed scores its final evaluation's mean return. Else it trains until its best,
        confirmed on fresh episodes, reaches this return, and scores minus the training seconds that took (evaluation
        left out); a seed that never gets there scores minus its whole training time and UNREACHED_PENALTY_S more
    """

    algo: str
    env: str
    device: str = "auto"
    vec_env: str = "auto"
    timesteps: int | None = None
    seeds: int = 1
    seed: int = 0
    eval_episodes: int = 10
    eval_freq: int | None = None
    threshold: float | None = None
    threads: int | str | None = None


def encode_choice(value: Any) -> Any:
    # optuna's categorical choices must be scalars; lists (net_arch) travel as their YAML text.
    return (
        value
        if value is None or isinstance(value, (bool, int, float, str))
        else yaml.safe_dump(value, default_flow_style=True).strip()
    )


def sample(trial: Any, space: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Draw one set of overrides; ``X.y`` keys are skipped when ``X`` was drawn false (``per.alpha`` without PER)."""
    params: dict[str, Any] = {}
    # Whole keys first, whatever the file's order: a dotted one is skipped by what its whole drew.
    for key, spec in sorted(space.items(), key=lambda item: "." in item[0]):
        head = key.partition(".")[0]
        if "." in key and params.get(head) is False:
            continue
        if "choices" in spec:
            encoded = [encode_choice(c) for c in spec["choices"]]
            value = trial.suggest_categorical(key, encoded)
            params[key] = spec["choices"][encoded.index(value)]
        elif isinstance(spec["low"], int) and isinstance(spec["high"], int) and not isinstance(spec["low"], bool):
            params[key] = trial.suggest_int(key, spec["low"], spec["high"], log=bool(spec.get("log")))
        else:
            params[key] = trial.suggest_float(key, float(spec["low"]), float(spec["high"]), log=bool(spec.get("log")))
    return params


class TrialInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped a trial (optuna marks it failed and ends the worker)."""

    def __init__(self, signal_name: str, trial_number: int):
        super().__init__(f"stopped by {signal_name} in trial {trial_number}")
        self.signal_name = signal_name


class TrialEvalCallback(TimedEvalCallback):
    """SB3's EvalCallback that reports each evaluation to the trial and stops training when the pruner says so.

    :param step_offset: added to the reported step, so that the seeds of one trial report one rising curve: twice
        the budget per seed, as a seed reports past its budget (SB3 completes a rollout, which the plan keeps within
        the budget)
    :param kwargs: TimedEvalCallback's (``eval_freq`` counts calls, env steps / n_envs, as EvalCallback counts)
    """

    def __init__(self, eval_env: Any, *, trial: Any, step_offset: int = 0, **kwargs: Any):
        super().__init__(eval_env, **kwargs)
        self.trial, self.step_offset, self.pruned = trial, step_offset, False

    def _on_step(self) -> bool:
        keep_going = super()._on_step()
        if self.n_calls % self.eval_freq == 0 and not self.stopped:
            self.trial.report(float(self.last_mean_reward), self.step_offset + self.num_timesteps)
            self.pruned = bool(self.trial.should_prune())
        return keep_going and not self.pruned


def make_objective(settings: TrialSettings, space: dict[str, dict[str, Any]]) -> Any:
    """optuna's objective: sample overrides, train each seed, and return the mean final evaluation.

    A combination the preset checks refuse is pruned (not a result); a signal stops the trial, which optuna then
    marks failed, and ends the worker.
    """
    worker = worker_attrs()

    def objective(trial: Any) -> float:
        for key, value in worker.items():
            trial.set_user_attr(key, value)
        params = sample(trial, space)
        scores, reached = [], []
        for index in range(settings.seeds):
            score, got_there = _score(trial, settings, params, index)
            scores.append(score)
            reached.append(got_there)
            # Stored as each seed ends, so a long trial shows its progress to every worker and a failed one keeps it.
            trial.set_user_attr("seed_scores", scores)
            if settings.threshold is not None:
                trial.set_user_attr("seed_reached", reached)
            print(seed_progress(trial.number, settings.seed + index, score, got_there, settings.threshold), flush=True)
        score = statistics.fmean(scores)
        if not math.isfinite(score):
            raise RuntimeError(f"trial {trial.number} scored {score}")
        return score

    return objective


def _score(trial: Any, settings: TrialSettings, params: dict[str, Any], index: int) -> tuple[float, bool | None]:
    """Train seed ``settings.seed + index`` with ``params``: its score, and whether it reached the threshold (None
    without one)."""
    optuna = import_optuna()
    seed = settings.seed + index
    threads = {} if settings.threads is None else {"threads": settings.threads}
    try:
        plan = make_plan(
            settings.algo,
            settings.env,
            settings.device,
            seed=seed,
            n_timesteps=settings.timesteps,
            vec_env=settings.vec_env,
            overrides={**params, **threads},
            override_source={
                **{key: "search space" for key in params},
                **{key: "--threads" for key in threads},
                "n_timesteps": "--timesteps",
            },
        )
    except ConfigError as e:  # an invalid combination (say batch_size > buffer_size): not a result
        trial.set_user_attr("invalid", str(e))
        raise optuna.TrialPruned(f"invalid combination: {e}") from None
    timesteps, n_envs = plan.preset.n_timesteps, plan.preset.n_envs
    trial.set_user_attr("profile", plan.preset.profile)  # the export folds in what the trial trained with
    env = build_env(plan)
    eval_env = None
    try:
        eval_env = build_env(plan, evaluation=True, n_envs=eval_envs(settings.eval_episodes))
        model = build_model(plan, env)
        if settings.threshold is not None:
            freq = settings.eval_freq or max(timesteps // THRESHOLD_EVALUATIONS, 1)
            run, evaluator = train_to_threshold(
                model,
                eval_env,
                settings.threshold,
                timesteps,
                eval_freq=freq,
                episodes=settings.eval_episodes,
                confirm_episodes=confirm_count(settings.eval_episodes),
                evaluator_class=TrialEvalCallback,
                trial=trial,
                step_offset=index * 2 * timesteps,
            )
            _raise_if_cut_short(trial, run.stopped_by, evaluator, run.timesteps, seed)
            return -run.cost_seconds, run.reached
        freq = settings.eval_freq or max(timesteps // 5, 1)
        trial_evaluator = TrialEvalCallback(
            eval_env,
            trial=trial,
            step_offset=index * 2 * timesteps,
            n_eval_episodes=settings.eval_episodes,
            eval_freq=max(freq // n_envs, 1),
            verbose=0,
        )
        with Session(model, evaluator=trial_evaluator) as session:
            outcome = session.learn(timesteps)
            if outcome.error is not None:
                raise outcome.error
            _raise_if_cut_short(trial, outcome.stopped_by, trial_evaluator, outcome.timesteps, seed)
            try:
                mean, _ = session.evaluate(settings.eval_episodes)
            except EvaluationStopped:
                raise TrialInterrupted(session.stopped_by or "SIGINT", trial.number) from None
        return mean, None
    finally:
        close_vec_envs(env, eval_env)


def _raise_if_cut_short(trial: Any, stopped_by: str | None, evaluator: TimedEvalCallback, timesteps: int, seed: int) -> None:
    if stopped_by is not None:
        raise TrialInterrupted(stopped_by, trial.number)
    if isinstance(evaluator, TrialEvalCallback) and evaluator.pruned:
        raise import_optuna().TrialPruned(f"pruned at {timesteps} timesteps of seed {seed}")


# --------------------------------------------------------------------------- results
def export_preset(study: Any, algo: str, env: str, path: Path, timesteps: int) -> Path:
    """The best trial as a preset file: the bundled entry for ``env`` as its trials trained it (the profile they took
    folded into the shared keys, the other profiles dropped) with the tuned keys set.

    A tuned ``buffer_size`` at or beyond ``timesteps`` is no finding (such a buffer never evicts in a trial, as
    ``fit_to_budget`` notes), so a larger size of the entry's own stays: the exported run is longer than the trials.
    """
    algo_ = get_algo(algo)
    best = study.best_trial
    entries, label = load_preset_file(algo_)
    spec = resolve_env(env)
    name = select_entry(entries, spec.entry_key(entries), spec.is_atari, label)
    raw = read_yaml(presets_dir() / f"{algo_.name}.yaml")[name]
    profile = best.user_attrs.get("profile")
    # Profiles would override the tuned values on some machines; the tuned values hold everywhere.
    entry = {k: v for k, v in raw.items() if k not in PROFILES} | dict(raw.get(profile) or {})
    tuned = _decoded_params(best, study)
    notes = [f"# The {profile!r} profile's values, which the trials trained with, are folded in.\n"] if profile in raw else []
    if profile is None and any(p in raw for p in PROFILES):
        notes.append("# The trials' profile is not recorded (an older sb3_gpu's study): the entry's profiles are dropped.\n")
    size, own = tuned.get("buffer_size"), entry.get("buffer_size", _default(algo_, "buffer_size"))
    if isinstance(size, int) and size >= timesteps and isinstance(own, (int, float)) and own > size:
        del tuned["buffer_size"]
        notes.append(f"# buffer_size: the trials' {size:,} held all of each trial, so the entry's own {int(own):,} stays.\n")
    for key, value in tuned.items():
        if key == "per" and value is True and isinstance(entry.get("per"), dict):
            continue  # on with the entry's own settings (its normalize, say), as a plan takes it; per.x are set apart
        apply_override(entry, key, value)
    # YAML's 2.0e+4 reads as a float; a count is written as the integer the preset means.
    checks = valid_keys(algo_)
    for key, value in entry.items():
        if isinstance(value, float) and value.is_integer() and key in checks:
            checked = checks[key](value, key)
            entry[key] = checked if isinstance(checked, int) and not isinstance(checked, bool) else value
    env_word, preset_word = shlex.quote(env), shlex.quote(str(path.resolve()))
    header = (
        f"# Tuned by python -m sb3_gpu.tune {algo} --env {env_word}: trial {best.number} of study {study.study_name!r},\n"
        f"# mean score {best.value:.2f} over {len(best.user_attrs.get('seed_scores', [])) or 1} seed(s) at {timesteps} "
        f"timesteps each. Train it: python -m sb3_gpu.train {algo} --env {env_word} --preset {preset_word}\n"
    )
    atomic_write_text(path, header + "".join(notes) + yaml.safe_dump({spec.entry_name: entry}, sort_keys=False))
    load_preset_file(algo_, path)  # what we wrote must load as a preset
    return path


def _default(algo: Algo, key: str) -> Any:
    """SB3's default for ``key`` (None where the algorithm has no such key)."""
    return next((f.default for f in dataclasses.fields(algo.params_class) if f.name == key), None)


def study_markdown(study: Any, command: str, top: int = 10) -> str:
    """The study as evidence for a preset: the command, how its trials ended, and its best trials in a table."""
    counts, ranked = state_counts(study), ranked_trials(study, top)
    threshold = study.user_attrs.get("threshold")
    scored = (
        "the final mean return, averaged over seeds"
        if threshold is None
        else f"minus the training seconds until the best, confirmed on fresh episodes, reached {threshold:g}, averaged "
        f"over seeds; a seed that never did counts its whole time plus {UNREACHED_PENALTY_S:,.0f} s, so a trial ranks by "
        "how many of its seeds reached it, then by time"
    )
    lines = [
        f"`{command}`",
        "",
        f"Study {study.study_name!r} ({study.user_attrs.get('algo')} on {study.user_attrs.get('env')}): {counts}. "
        f"Score: {scored}.",
        "",
        "| trial | score | per seed | params |",
        "|---:|---:|---|---|",
    ]
    for t, params in ranked:
        lines.append(f"| {t.number} | {t.value:.2f} | {seed_cells(t, threshold)} | {params} |")
    return "\n".join(lines) + "\n"


def state_counts(study: Any) -> str:
    """How the study's trials ended (``3 complete, 1 pruned, 1 invalid``): an invalid combination, pruned before it
    trained, is counted apart from the pruner's."""
    optuna = import_optuna()
    trials = study.get_trials(deepcopy=False)
    counts = {state.name.lower(): sum(t.state == state for t in trials) for state in optuna.trial.TrialState}
    counts["invalid"] = sum(_invalid(t) for t in trials)
    counts["pruned"] -= counts["invalid"]
    return ", ".join(f"{n} {name}" for name, n in counts.items() if n)


def ranked_trials(study: Any, top: int) -> list[tuple[Any, str]]:
    """The ``top`` complete trials, best first, each with its parameters as the search space wrote them."""
    optuna = import_optuna()
    complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    done = sorted(complete, key=lambda t: t.value, reverse=True)  # stable: of equal scores the first, as best_trial
    return [(t, ", ".join(f"{k}={v}" for k, v in _decoded_params(t, study).items())) for t in done[:top]]


def _decoded_params(trial: Any, study: Any) -> dict[str, Any]:
    space = study.user_attrs.get("space", {})
    out = {}
    for key, value in trial.params.items():
        choices = space.get(key, {}).get("choices")
        out[key] = choices[[encode_choice(c) for c in choices].index(value)] if choices else value
    return out


def write_plots(study: Any, folder: Path) -> list[str]:
    """optuna's optimization history and parameter importances as PNGs; a note for each one not drawn."""
    notes = []
    try:
        import matplotlib

        matplotlib.use("Agg")
        from optuna.visualization import matplotlib as vis
    except ImportError as e:
        return [f"plots not drawn ({e}): {install_hint('plot')}"]
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


# --------------------------------------------------------------------------- the study
def open_study(
    name: str,
    storage: Any,
    *,
    sampler: str,
    pruner: str,
    timesteps: int,
    algo: str,
    env: str,
    space: dict[str, dict[str, Any]],
    where: str,
    threshold: float | None = None,
    sampler_seed: int | None = None,
    scoring: dict[str, int | None] | None = None,
) -> Any:
    """Create the study ``name`` in ``storage``, or join it; refuse one that tunes another algorithm or env, or
    scores another way (another threshold, another search space, other ``scoring`` settings).

    :param timesteps: of each seed's training; the median pruner waits for a third of them
    :param where: the storage as messages name it (without its password)
    :param threshold: the return a time-to-threshold study times (None: the study maximises the final return)
    :param scoring: what else a trial's score depends on, by CLI flag (``--timesteps``, ``--seeds``, ...): workers
        that differ would rank scores that cannot be compared
    """
    optuna = import_optuna()
    makers = {
        "tpe": lambda seed: optuna.samplers.TPESampler(n_startup_trials=5, seed=seed),
        "random": lambda seed: optuna.samplers.RandomSampler(seed=seed),
    }
    samplers = {
        name: (lambda make=make: make(None) if sampler_seed is None else per_trial_seeded(make, sampler_seed))
        for name, make in makers.items()
    }
    pruners = {
        "median": lambda: optuna.pruners.MedianPruner(n_startup_trials=5, n_warmup_steps=timesteps // 3),
        "halving": optuna.pruners.SuccessiveHalvingPruner,
        "none": optuna.pruners.NopPruner,
    }
    study = optuna.create_study(
        study_name=name,
        storage=storage,
        sampler=samplers[sampler](),
        pruner=pruners[pruner](),
        direction="maximize",
        load_if_exists=True,
    )
    attrs = study.user_attrs
    if attrs.get("algo") is None:
        # "algo" marks a study as set up, so it is written last: a worker that joins while the first one writes these
        # (each its own transaction) either sees no "algo" yet or sees them all.
        for key, value in (("env", env), ("space", space), ("threshold", threshold), ("scoring", scoring), ("algo", algo)):
            study.set_user_attr(key, value)
        return study
    if (attrs["algo"], attrs.get("env")) != (algo, env):
        raise ConfigError(f"study {name!r} in {where} tunes {attrs['algo']} on {attrs['env']}; choose another --study-name")
    if attrs.get("threshold") != threshold:
        made = "the final return" if attrs.get("threshold") is None else f"the time to a return of {attrs['threshold']:g}"
        raise ConfigError(f"study {name!r} in {where} scores {made}; give the same --threshold or another --study-name")
    made_with = attrs.get("scoring") or {}  # none in a study made before workers' scoring was compared
    for flag, value in (scoring or {}).items():
        if flag in made_with and made_with[flag] != value:
            theirs, mine = ("its default" if v is None else v for v in (made_with[flag], value))
            raise ConfigError(
                f"study {name!r} in {where} scores trials with {flag} {theirs} (this worker: {mine}); give the same, "
                "or another --study-name"
            )
    # As JSON, so that types count too: 1 and 1.0 draw from optuna's int and float ranges, which cannot share a name.
    if json.dumps(attrs.get("space", space), sort_keys=True) != json.dumps(space, sort_keys=True):
        raise ConfigError(
            f"study {name!r} in {where} was made with another search space (or a budget that narrowed it otherwise); "
            "give the same --space and --timesteps, or another --study-name"
        )
    return study


def per_trial_seeded(make: Any, seed: int) -> Any:
    """A sampler made by ``make(seed)`` anew for each trial, seeded from ``seed`` and the trial's number.

    One seeded sampler draws from one generator per process: a study resumed by the same command, or a second worker
    given the same seed, would draw the first trials' values again. Trial numbers are the study's, unique across
    workers, so the draws stay reproducible and never repeat. (TPE keeps nothing between trials but its generator:
    it reads the history from the study.)
    """
    import numpy as np

    optuna = import_optuna()

    class PerTrialSeeded(optuna.samplers.BaseSampler):  # type: ignore[name-defined]
        def __init__(self) -> None:
            self.inner = make(seed)

        def before_trial(self, study: Any, trial: Any) -> None:
            self.inner = make(int(np.random.SeedSequence([seed, trial.number]).generate_state(1)[0]))
            self.inner.before_trial(study, trial)

        def infer_relative_search_space(self, study: Any, trial: Any) -> Any:
            return self.inner.infer_relative_search_space(study, trial)

        def sample_relative(self, study: Any, trial: Any, search_space: Any) -> Any:
            return self.inner.sample_relative(study, trial, search_space)

        def sample_independent(self, study: Any, trial: Any, param_name: str, param_distribution: Any) -> Any:
            return self.inner.sample_independent(study, trial, param_name, param_distribution)

        def after_trial(self, study: Any, trial: Any, state: Any, values: Any) -> None:
            self.inner.after_trial(study, trial, state, values)

        def reseed_rng(self) -> None:
            self.inner.reseed_rng()

    return PerTrialSeeded()


def seed_progress(number: int, seed: int, score: float, reached: bool | None, threshold: float | None) -> str:
    """The line a worker prints as a trial's seed ends: its return, or its seconds to the threshold."""
    if threshold is None:
        return f"trial {number}, seed {seed}: mean return {score:.1f}"
    if reached:
        return f"trial {number}, seed {seed}: reached {threshold:g} in {-score:.1f} s of training"
    seconds = -score - UNREACHED_PENALTY_S
    return (
        f"trial {number}, seed {seed}: never reached {threshold:g} in {seconds:.1f} s of training (scored behind every "
        "seed that reached it)"
    )


def seed_cells(trial: Any, threshold: float | None) -> str:
    """A trial's per-seed scores as the results table shows them: returns, or seconds to the threshold."""
    scores = trial.user_attrs.get("seed_scores", [])
    if threshold is None:
        return ", ".join(f"{s:.1f}" for s in scores)
    reached = trial.user_attrs.get("seed_reached", [True] * len(scores))
    unreached = (-s - UNREACHED_PENALTY_S for s in scores)
    cells = (f"{-s:.1f} s" if r else f"not reached in {u:.1f} s" for s, u, r in zip(scores, unreached, reached, strict=False))
    return ", ".join(cells)


def finished_trials(study: Any) -> int:
    """Trials that count towards the study's target: complete, or pruned by the pruner (an invalid combination,
    pruned before it trained, is no result)."""
    return sum(_counts(trial) for trial in study.get_trials(deepcopy=False))


def _counts(trial: Any) -> bool:
    state = import_optuna().trial.TrialState
    return trial.state == state.COMPLETE or (trial.state == state.PRUNED and not _invalid(trial))


def _invalid(trial: Any) -> bool:
    """Pruned before it trained, for an invalid combination (see the objective): no result."""
    return trial.state == import_optuna().trial.TrialState.PRUNED and "invalid" in trial.user_attrs


@dataclass
class WorkerRun:
    """What one worker's :func:`run_trials` did: its latest trials in a row that failed or drew an invalid
    combination, and whether it stopped for them before the study had its target."""

    misses: int = 0
    gave_up: bool = False


# Trials in a row that failed or drew an invalid combination after which a worker stops, at the least: with fewer, a
# small study gave up on a space half of whose draws are valid (--trials 1: one invalid first draw).
MIN_MISSES = 10


def run_trials(study: Any, objective: Any, target: int) -> WorkerRun:
    """Run trials until the study, counting every worker's, has ``target`` finished ones.

    A trial that fails (a NaN, out of memory) or draws an invalid combination is tried again with new values; after
    ``target`` such trials in a row (at least MIN_MISSES) the worker stops: a study whose every trial fails ends.
    Workers finishing at once may each add a trial past ``target``.
    """
    run = WorkerRun()
    most = max(target, MIN_MISSES)

    def after(study: Any, trial: Any) -> None:
        run.misses = 0 if _counts(trial) else run.misses + 1
        if finished_trials(study) >= target:
            study.stop()
        elif run.misses >= most:
            run.gave_up = True
            study.stop()

    if finished_trials(study) < target:
        study.optimize(
            objective,
            callbacks=[after],
            gc_after_trial=True,
            # A trial that diverges (NaN logits) or runs out of memory fails alone; the worker and the study go on.
            catch=(Exception,),
        )
    return run

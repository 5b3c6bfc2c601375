"""Property-based fuzzing: any preset file or ``--set`` text either loads or raises ConfigError, nothing else."""

from __future__ import annotations

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sb3_gpu.common.errors import ConfigError
from sb3_gpu.config.files import parse_yaml
from sb3_gpu.config.presets import parse_override, resolve_preset
from sb3_gpu.config.schema import ALGOS, PROFILES, get_algo, valid_keys, validate_entry

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**12), max_value=10**12),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=10,
)
ALL_KEYS = sorted({k for algo in ALGOS for k in valid_keys(get_algo(algo))} | set(PROFILES))
keys = st.one_of(st.sampled_from(ALL_KEYS), st.text(max_size=12))
entries = st.dictionaries(keys, st.one_of(values, st.dictionaries(keys, values, max_size=4)), max_size=6)


def loads_or_config_error(fn, *args):
    try:
        return fn(*args)
    except ConfigError as e:
        message = str(e)
        assert message and "\n" not in message, f"error messages are one line: {message!r}"
        return None


@pytest.mark.heavy
@FUZZ
@given(algo=st.sampled_from(sorted(ALGOS)), entry=entries, profile=st.sampled_from(PROFILES))
def test_any_entry_validates_and_resolves_or_raises_config_error(algo, entry, profile):
    algo_ = get_algo(algo)
    validated = loads_or_config_error(validate_entry, algo_, entry, "fuzz.yaml, entry X")
    if validated is not None:
        loads_or_config_error(resolve_preset, algo_, validated, "fuzz.yaml:X", profile)


@FUZZ
@given(algo=st.sampled_from(sorted(ALGOS)), key=keys, value=values)
def test_any_override_resolves_or_raises_config_error(algo, key, value):
    algo_ = get_algo(algo)
    loads_or_config_error(resolve_preset, algo_, {}, "fuzz", "cpu", {key: (value, "--set")})


@FUZZ
@given(text=st.text(max_size=60))
@example(text="0\n0=[")  # a key across lines, echoed into the message for its value: once two lines
def test_any_set_text_parses_or_raises_config_error(text):
    parsed = loads_or_config_error(parse_override, text)
    if parsed is not None:
        assert parsed[0] == text.partition("=")[0].strip()


@FUZZ
@given(doc=st.one_of(st.text(max_size=200), values.map(lambda v: yaml.safe_dump(v))))
def test_any_yaml_text_loads_or_raises_config_error(doc):
    loads_or_config_error(parse_yaml, doc, "fuzz.yaml")

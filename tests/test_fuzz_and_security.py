"""Property-based fuzzing of the suite loader, and the security rules (safe YAML, escaping, contained ids)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zbench.errors import UsageError
from zbench.report import render
from zbench.results.run_info import Environment, RunInfo, SuiteInfo
from zbench.results.store import RunDir
from zbench.run.aggregate import failed_record
from zbench.suite import config as suite
from zbench.suite import preflight

KEYS = [*suite.SuiteConfig.model_fields, "bogus", "stage", "world"]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 10),
    st.floats(allow_nan=True),
    st.text(max_size=12),
    st.sampled_from(["tiny", "ddp", "fsdp", "fp32", "cpu", "cuda", "none", "zero9", "a:b"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.sampled_from([*KEYS, "name", "lr"]), inner, max_size=3)
    ),
    max_leaves=8,
)
documents = st.dictionaries(st.sampled_from(KEYS), values, max_size=8)


def outcome_of(load) -> str:
    """Parse, then pre-flight (implementations, device, NVMe) and expand, as ``zbench run`` does before any case."""
    try:
        preflight.prepare(suite.from_flags(load()))
    except UsageError as exc:
        message = str(exc)
        assert message and "\n" not in message, message  # one line
        return "clean error"
    return "valid"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(documents)
def test_any_mapping_is_a_valid_suite_or_one_clean_error(doc):
    assert outcome_of(lambda: suite.from_dict(doc, source="fuzz.yaml")) in ("valid", "clean error")


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_any_text_file_is_a_valid_suite_or_one_clean_error(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("fuzz") / "s.yaml"
    path.write_text(text)
    assert outcome_of(lambda: suite.read(path).config) in ("valid", "clean error")


def test_yaml_tags_that_construct_objects_are_refused(tmp_path):
    path = tmp_path / "evil.yaml"
    path.write_text("!!python/object/apply:os.system ['echo pwned']\n")
    try:
        suite.read(path)
    except UsageError as exc:
        assert "malformed YAML" in str(exc)
    else:
        raise AssertionError("an object-constructing tag was accepted")


def test_report_escapes_everything_it_did_not_write(tmp_path):
    run = RunDir(tmp_path, "r")
    run.start(
        RunInfo(
            run_id="r",
            suite=SuiteInfo(name="<b>suite</b>", sha256="0" * 64, config={"warmup_steps": 1}),
            environment=Environment(zbench_version="x", torch="t", python="p", host="<i>h</i>", cpu_count=1),
        )
    )
    evil = "<script>alert(1)</script>"
    config = suite.from_dict({"device": "cpu", "models": "tiny", "implementations": "ddp", "world_sizes": 1})
    case = preflight.prepare(suite.from_flags(config)).cases[0]
    run.write_case(failed_record(case, evil, stderr_tail=evil))
    html = render(run, tmp_path / "report").read_text()
    assert evil not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "<b>suite</b>" not in html and "<i>h</i>" not in html


def test_safe_load_is_the_only_yaml_loader_used():
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    for path in [*root.glob("zbench/**/*.py"), *root.glob("implementations/**/*.py")]:  # the symlink is not followed
        text = path.read_text()
        assert "yaml.load(" not in text and "yaml.unsafe_load" not in text and "shell=True" not in text, path
        assert "torch.load(" not in text or "weights_only=True" in text, path

"""The filtering exposition parser agrees with prometheus_client, and never raises on garbage."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import VLLM_FIXTURES
from tests.expositions import multi_engine
from vllm_guardian.formats import promtext
from vllm_guardian.sources.vllm_metrics import WANTED

CAPTURES = sorted(VLLM_FIXTURES.glob("metrics-*.prom"))  # real vLLM 0.32 scrapes
FIXTURE_FILES = sorted(
    VLLM_FIXTURES.glob("*.prom")
)  # plus V0/V1-0.10 files built from the reference


def reference(
    text: str, wanted: frozenset[str]
) -> list[tuple[str, tuple[tuple[str, str], ...], float]]:
    return [
        (s.name, tuple(sorted(s.labels.items())), s.value)
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name in wanted
    ]


def mine(text: str, wanted: frozenset[str]) -> list[tuple[str, tuple[tuple[str, str], ...], float]]:
    return [(s.name, s.labels, s.value) for s in promtext.parse(text, wanted).samples]


def same(a: list, b: list) -> bool:  # type: ignore[type-arg]
    if len(a) != len(b):
        return False
    for (n1, l1, v1), (n2, l2, v2) in zip(a, b, strict=True):
        if n1 != n2 or l1 != l2:
            return False
        if not (v1 == v2 or (math.isnan(v1) and math.isnan(v2))):
            return False
    return True


@pytest.mark.parametrize("path", FIXTURE_FILES, ids=lambda p: p.name)
def test_agrees_with_prometheus_client_on_every_fixture(path):
    text = path.read_text()
    got = mine(text, WANTED)
    if path in CAPTURES:
        assert len(got) > 20
    assert same(got, reference(text, WANTED))
    # And on every family, not just the guardian's: the parser is general.
    every = frozenset(s.name for fam in text_string_to_metric_families(text) for s in fam.samples)
    assert same(mine(text, every), reference(text, every))


def test_agrees_on_eight_engines():
    text = multi_engine((VLLM_FIXTURES / "metrics-under-load-05.prom").read_text(), 8)
    got = mine(text, WANTED)
    assert {dict(labels).get("engine") for _, labels, _ in got} >= {str(i) for i in range(8)}
    assert same(got, reference(text, WANTED))


def test_parser_reused_across_scrapes_gives_the_same_result():
    p = promtext.Parser(WANTED, ("vllm:",))
    for path in FIXTURE_FILES:
        text = path.read_text()
        assert p.parse(text) == promtext.parse(text, WANTED, ("vllm:",))


EDGE_CASES = [
    # (exposition, wanted names, expected samples, expected malformed count)
    ('m{a="x\\"y",b="p\\\\q"} 1\n', {"m"}, [("m", (("a", 'x"y'), ("b", "p\\q")), 1.0)], 0),
    ('m{a="line\\nbreak"} 2\n', {"m"}, [("m", (("a", "line\nbreak"),), 2.0)], 0),
    ('m{a="has } brace"} 3\n', {"m"}, [("m", (("a", "has } brace"),), 3.0)], 0),
    ('m{a="has # hash"} 4\n', {"m"}, [("m", (("a", "has # hash"),), 4.0)], 0),
    ("m 5 1712345678000\n", {"m"}, [("m", (), 5.0)], 0),
    ('m{le="+Inf"} +Inf\n', {"m"}, [("m", (("le", "+Inf"),), math.inf)], 0),
    ("m NaN\n", {"m"}, [("m", (), math.nan)], 0),
    ("m -Inf\n", {"m"}, [("m", (), -math.inf)], 0),
    ('m{a="1",} 6\n', {"m"}, [("m", (("a", "1"),), 6.0)], 0),
    ('m{a = "1", b="2"} 7\n', {"m"}, [("m", (("a", "1"), ("b", "2")), 7.0)], 0),
    (
        'm_bucket{le="1"} 8 # {trace_id="abc"} 0.5 1712345678\n',
        {"m_bucket"},
        [("m_bucket", (("le", "1"),), 8.0)],
        0,
    ),
    ("m 1_000\n", {"m"}, [], 1),
    ("m abc\n", {"m"}, [], 1),
    ('m{a="1" 9\n', {"m"}, [], 1),
    ("m\n", {"m"}, [], 1),
    ("m 1 2 3\n", {"m"}, [], 1),
    ("<html><body>oops</body></html>\n", {"m"}, [], 1),
    ("m 1\nm 2", {"m"}, [("m", (), 1.0)], 1),  # truncated body: no final newline
    ("m 1\r\nn 2\r\n", {"m", "n"}, [("m", (), 1.0), ("n", (), 2.0)], 0),
    ("# HELP m doc\n# TYPE m gauge\nm 1\n\n", {"m"}, [("m", (), 1.0)], 0),
    ("# TYPE x counter\nx_total 1\nm 2\n", {"m"}, [("m", (), 2.0)], 0),  # untyped after typed
]


# Lines the text format allows that the parser used to drop: leading blanks, a tab
# between name and value, an empty label set written `{,}`. Each is compared with
# prometheus_client, alone and inside a typed family (the block path and the line path).
ALLOWED_SHAPES = [
    "  m 1\n",
    "\tm 2\n",
    "m\t3\n",
    "m \t4\n",
    "m{,} 5\n",
    "m{ , } 6\n",
    'm{a="1"}\t7\n',
    '\t m{a="1"} 8\n',
    "  # HELP m doc\n  m 9\n",
    "\t\n m 10\n",
    "m\t11\t1712345678000\n",
]


@pytest.mark.parametrize("shape", ALLOWED_SHAPES)
@pytest.mark.parametrize("typed", [False, True], ids=["untyped", "typed"])
def test_agrees_with_prometheus_client_on_allowed_shapes(shape: str, typed: bool) -> None:
    text = ("# TYPE m gauge\n" if typed else "") + shape + "other 1\n"
    wanted = frozenset({"m"})
    got = promtext.parse(text, wanted)
    assert same(mine(text, wanted), reference(text, wanted)) and got.samples, got
    assert got.malformed_lines == 0


@pytest.mark.parametrize("path", CAPTURES[:3], ids=lambda p: p.name)
@pytest.mark.parametrize(
    "mutate",
    [
        lambda line: "  " + line,
        lambda line: "\t" + line,
        lambda line: line.replace("} ", "}\t", 1) if "}" in line else line.replace(" ", "\t", 1),
    ],
    ids=["leading-spaces", "leading-tab", "tab-before-value"],
)
def test_agrees_on_real_captures_written_with_allowed_blanks(path, mutate) -> None:  # type: ignore[no-untyped-def]
    lines = path.read_text().splitlines()
    text = "".join((line if line.startswith("#") else mutate(line)) + "\n" for line in lines)
    got = mine(text, WANTED)
    assert len(got) > 20
    assert same(got, reference(text, WANTED))
    assert promtext.parse(text, WANTED).malformed_lines == 0


@pytest.mark.parametrize(("text", "wanted", "expected", "bad"), EDGE_CASES)
def test_edge_cases(text, wanted, expected, bad):
    result = promtext.parse(text, frozenset(wanted))
    assert same([(s.name, s.labels, s.value) for s in result.samples], expected)
    assert result.malformed_lines == bad


def test_prefix_presence_is_reported():
    assert promtext.parse("vllm:x 1\n", set(), ("vllm:",)).prefixes_seen == {"vllm:"}
    assert promtext.parse("# HELP vllm:x doc\nother 1\n", set(), ("vllm:",)).prefixes_seen == set()


# --- generated expositions -------------------------------------------------------------------

label_value = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12
)
label_name = st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True).filter(
    lambda s: not s.startswith("__")
)
metric_name = st.from_regex(r"[a-z_:][a-z0-9_:]{0,10}", fullmatch=True)
value = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=64),
    st.integers(min_value=-(10**12), max_value=10**12).map(float),
)


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(v)


@st.composite
def exposition(draw):  # type: ignore[no-untyped-def]
    names = draw(st.lists(metric_name, min_size=1, max_size=5, unique=True))
    lines = []
    for name in names:
        if draw(st.booleans()):
            lines.append(f"# HELP {name} some help")
            lines.append(f"# TYPE {name} {draw(st.sampled_from(['gauge', 'untyped']))}")
        seen_sets = set()
        for _ in range(draw(st.integers(min_value=1, max_value=4))):
            labels = draw(st.dictionaries(label_name, label_value, max_size=3))
            key = tuple(sorted(labels.items()))
            if key in seen_sets:
                continue
            seen_sets.add(key)
            body = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
            ts = (
                f" {draw(st.integers(min_value=0, max_value=2**40))}" if draw(st.booleans()) else ""
            )
            lines.append(
                f"{name}{{{body}}} {_fmt(draw(value))}{ts}"
                if labels
                else f"{name} {_fmt(draw(value))}{ts}"
            )
    return "\n".join(lines) + "\n", names


@settings(max_examples=300, deadline=None)
@given(exposition(), st.data())
def test_agrees_with_prometheus_client_on_generated_expositions(exp, data):
    text, names = exp
    # (Counter families are left out: prometheus_client renames their samples to *_total.)
    wanted = frozenset(data.draw(st.lists(st.sampled_from(names), unique=True)))
    try:
        ref = reference(text, wanted)
    except ValueError:
        return  # prometheus_client rejects it (e.g. a counter without _total); not our case
    assert same(mine(text, wanted), ref)


@settings(max_examples=500, deadline=None)
@given(st.text(max_size=400))
def test_never_raises_on_arbitrary_text(text):
    result = promtext.parse(text, frozenset({"m", "vllm:num_requests_running"}), ("vllm:",))
    assert result.malformed_lines >= 0

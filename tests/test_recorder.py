"""The flight recorder's delta encoding (formats 2 and 3): what a delta line holds, and that the reader
rebuilds exactly the JSON a whole line would have held, for every kind of change."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from vllm_guardian.formats.recorder import (
    FlightRecorder,
    apply_delta,
    delta,
    read_records,
    snapshot_from_record,
    to_jsonable,
)
from vllm_guardian.model import (
    EngineMetrics,
    HealthProbe,
    HealthState,
    Histogram,
    ServiceSnapshot,
    Snapshot,
    VllmScrape,
)

INF = math.inf
H1 = Histogram(((0.1, 1.0), (1.0, 3.0), (INF, 4.0)), 2.5, 4.0)


def engine(**kw: Any) -> EngineMetrics:
    return EngineMetrics("m", "0", **kw)


def snap(t: float, *engines: EngineMetrics, health: HealthProbe | None = None) -> Snapshot:
    scrape = VllmScrape(engines, True, 1.0, 100)
    return Snapshot(t, (ServiceSnapshot("a", vllm=scrape, health=health),), None)


PAIRS: dict[str, tuple[Any, Any, Any]] = {
    # old, new, the delta expected (None: only the round trip is checked)
    "same object": (H1, H1, "same"),
    "equal objects": (engine(requests_running=1.0), engine(requests_running=1.0), "same"),
    "one float": (engine(requests_running=1.0), engine(requests_running=2.0),
                  {"requests_running": 2.0}),
    "None to a value": (engine(), engine(requests_waiting=3.0), {"requests_waiting": 3.0}),
    "a value to None": (engine(requests_waiting=3.0), engine(), {"requests_waiting": None}),
    "None to a histogram": (engine(), engine(time_to_first_token=H1), None),
    # A histogram whose bounds stay: its new counts only (format 3).
    "one bucket": (H1, Histogram(((0.1, 1.0), (1.0, 4.0), (INF, 5.0)), 3.0, 5.0),
                   {"buckets": {"#": [1.0, 4.0, 5.0]}, "sum": 3.0, "count": 5.0}),
    "integer counts": (H1, Histogram(((0.1, 1), (1.0, 4), (INF, 5)), 2.5, 4.0),
                       {"buckets": {"#": [1, 4, 5]}}),
    "bucket count changes": (H1, Histogram(((INF, 4.0),), 2.5, 4.0),
                             {"buckets": {"=": [["+Inf", 4.0]]}}),
    "a bound moves": (H1, Histogram(((0.2, 1.0), (1.0, 3.0), (INF, 4.0)), 2.5, 4.0),
                      {"buckets": {"=": [[0.2, 1.0], [1.0, 3.0], ["+Inf", 4.0]]}}),
    "a NaN count": (H1, Histogram(((0.1, 1.0), (1.0, math.nan), (INF, 4.0)), 2.5, 4.0),
                    {"buckets": {"=": [[0.1, 1.0], [1.0, "NaN"], ["+Inf", 4.0]]}}),
    "an infinite count": (H1, Histogram(((0.1, 1.0), (1.0, 3.0), (INF, INF)), 2.5, 4.0),
                          {"buckets": {"=": [[0.1, 1.0], [1.0, 3.0], ["+Inf", "+Inf"]]}}),
    "counts too large to add up": ((("a", 1e308), ("b", 1.0)), (("a", 1e308), ("b", 1e308)),
                                   {"=": [["a", 1e308], ["b", 1e308]]}),
    "a boolean count": ((("a", 1), ("b", 1)), (("a", True), ("b", 2)),
                        {"=": [["a", True], ["b", 2]]}),
    "pairs become triples": ((("a", 1), ("b", 2)), (("a", 1, 0), ("b", 3, 0)),
                             {"=": [["a", 1, 0], ["b", 3, 0]]}),
    "triples become pairs": ((("a", 1, 0), ("b", 2, 0)), (("a", 1), ("b", 3)),
                             {"=": [["a", 1], ["b", 3]]}),
    "a pair among other things": ((("a", 1), 5), (("a", 2), 5), {"=": [["a", 2], 5]}),
    "pairs of records": (((engine(), 1.0),), ((engine(), 2.0),), {"#": [2.0]}),
    "infinite and NaN values": (engine(), engine(requests_running=INF, requests_waiting=math.nan),
                                {"requests_running": "+Inf", "requests_waiting": "NaN"}),
    "an enum": (HealthProbe(HealthState.UP, 200, 0.1), HealthProbe(HealthState.REFUSED, None, 0.1),
                {"state": "refused", "status_code": None}),
    "an engine added": (snap(1.0, engine()), snap(2.0, engine(), EngineMetrics("m", "1")), None),
    "health appears": (snap(1.0, engine()),
                       snap(2.0, engine(), health=HealthProbe(HealthState.UP, 200, 0.1)), None),
    "int to bool in a field": (HealthProbe(HealthState.UP, 1, 0.1),
                               HealthProbe(HealthState.UP, True, 0.1),
                               {"status_code": True}),
    "dicts": ({"a": 1}, {"a": 2}, {"=": {"a": 2}}),
}  # fmt: skip


@pytest.mark.parametrize("name", PAIRS)
def test_delta_round_trip(name: str) -> None:
    old, new, expected = PAIRS[name]
    d = delta(new, old)
    rebuilt = to_jsonable(old) if expected == "same" else apply_delta(to_jsonable(old), d)
    if expected == "same":
        assert d is delta(old, old)  # the "nothing changed" marker
    elif expected is not None:
        assert d == expected
    # NaN is not equal to itself: compare the JSON text.
    assert json.dumps(rebuilt, sort_keys=True) == json.dumps(to_jsonable(new), sort_keys=True)
    assert json.loads(json.dumps(d if expected != "same" else 0)) is not None


def test_numbers_equal_inside_a_tuple_are_unchanged() -> None:
    # Documented: a tuple is first compared whole (one C-level comparison), so 1, 1.0 and True
    # inside one count as unchanged; decoding is typed by the model, so they read back alike.
    assert delta((1.0, 2.0), (1, 2)) is delta(H1, H1)


@pytest.mark.parametrize(("old", "d"), [(None, {"@": {"0": 1}}), ([1], {"@": {"5": 2}}),
                                        (3, {"x": 1}), (None, {"#": [1]}), ([[1, 2]], {"#": 3}),
                                        ([[1, 2]], {"#": [1, 2]}), ([[1, 2, 3]], {"#": [1]}),
                                        ([5], {"#": [1]})])  # fmt: skip
def test_a_delta_that_does_not_fit_is_an_error(old: Any, d: Any) -> None:
    with pytest.raises(ValueError):
        apply_delta(old, d)


def test_keyframes_rotation_and_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "f.jsonl"
    rec = FlightRecorder(path, 64 * 1024, 2, keyframe_every=4)
    snaps = [snap(float(i), engine(requests_running=float(i % 3), time_to_first_token=H1))
             for i in range(1, 400)]  # fmt: skip
    for s in snaps:
        assert rec.write({"time": s.time_seconds, "snapshot": s, "signals": None})
    files = [tmp_path / "f.jsonl.2", tmp_path / "f.jsonl.1", path]
    kinds: list[str] = []
    for f in files:
        lines = [json.loads(line) for line in f.read_text().splitlines()]
        assert lines[0]["kind"] == "key"  # each file reads on its own
        kinds.extend(line["kind"] for line in lines)
    assert kinds[:9] == ["key", "delta", "delta", "delta", "key", "delta", "delta", "delta", "key"]
    got = [snapshot_from_record(r) for r in read_records(path, now_seconds=1000.0)
           if isinstance(r, dict)]  # fmt: skip
    assert got and got == snaps[-len(got) :]


def test_a_failed_write_is_followed_by_a_keyframe(tmp_path: Path) -> None:
    path = tmp_path / "dir" / "f.jsonl"
    rec = FlightRecorder(path, 1 << 20, 1)
    assert rec.write({"time": 1.0, "snapshot": snap(1.0, engine()), "signals": None})
    path.unlink()
    path.mkdir()  # the file is now a directory: writing fails
    assert not rec.write({"time": 2.0, "snapshot": snap(2.0, engine()), "signals": None})
    path.rmdir()
    assert rec.write({"time": 3.0, "snapshot": snap(3.0, engine()), "signals": None})
    assert json.loads(path.read_text())["kind"] == "key"

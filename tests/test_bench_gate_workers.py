"""bench/gate_workers.py drives a one-worker and a two-worker gate with several client and
stub processes and reports events/s, each worker's CPU and the streams each worker holds (a
tiny load: the harness works, not a figure)."""

from __future__ import annotations

from tests.support import run_quick_bench


def test_the_workers_bench_measures_one_and_two_workers() -> None:
    out = run_quick_bench("gate_workers.py")
    rows = {
        cells[0]: cells
        for line in out.splitlines()
        if line.startswith("| ")
        and len(cells := [c.strip() for c in line.strip("|").split("|")]) == 14
    }
    one, two = rows["1"], rows["2"]
    # Events reached the clients through each gate; each worker's CPU share and the streams
    # it held are given (two of each for two workers), and stalls are counted.
    for row in (one, two):
        assert float(row[1].split()[0]) > 0, row
        assert row[11].isdigit(), row
    assert len(one[4].split()) == 1 and len(two[4].split()) == 2, (one, two)
    assert len(two[8].split("/")) == 2 and all(s.isdigit() for s in two[8].split("/")), two
    assert "2 workers ÷ 1 worker:" in out, out

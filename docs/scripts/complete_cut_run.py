"""Finish a ``gradseam bench --family`` run that was cut by its time limit: its JSON rows in, the full-depth rows out.

``python docs/scripts/complete_cut_run.py FAMILY CUT.json OUT.json "why it was cut"``

bench writes its rows to the JSON as it measures them (a partial payload), and the full-depth rows (the fit through
the two depths, the figure at the family's real depth) only at the end. A run stopped after every row it will be
compared by was measured at both fit depths, but before a last row, loses nothing that bench's own code cannot
compute afterwards: this script rebuilds the run (:class:`gradseam.tools.results.RealRun`, the depth plan from the
preset's model built on the meta device) and calls :func:`gradseam.tools.bench_report.full_depth_rows` and
``depth_info`` on it, as bench does. A row measured at one depth only comes out "not measured: cut by the run's time
limit" (no growth, no full-depth figure). The JSON says so in ``completed_after_the_run``. Mochi's, Allegro's and Wan VACE's runs on the
H100 were completed this way (docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

CUT = "not measured: cut by the run's time limit"


def complete(family_name: str, data: dict[str, Any], note: str) -> dict[str, Any]:
    """``data`` (a bench JSON, partial or not) with ``full_depth`` and ``depth`` computed from its rows."""
    from gradseam.testing import preset_model
    from gradseam.tools import bench_report as report
    from gradseam.tools.depth import plan_for
    from gradseam.tools.results import RealRun, Result

    family, _, model = preset_model(family_name, data.get("preset"))
    fields = {f.name for f in dataclasses.fields(Result)}
    results = [Result(**{k: v for k, v in row.items() if k in fields}) for row in data["rows"]]
    depths = tuple(sorted({r.depth for r in results if r.depth is not None}))
    if len(depths) != 2:
        raise SystemExit(f"the run measured depths {list(depths)}: the full depth needs exactly two fit depths")
    plan = plan_for(model, family)
    run = RealRun(plan, depths, plan.full, results)
    rows = [{**row, "status": CUT} if row.get("status") == "not measured" else row for row in report.full_depth_rows(run)]
    return {**data, "title": data["title"].removesuffix(report.PARTIAL),
            "depth": report.depth_info(run, measured_full=False), "full_depth": rows,
            "completed_after_the_run": note}


def main() -> None:
    family_name, source, out, note = sys.argv[1:5]
    with open(source, encoding="utf-8") as f:
        done = complete(family_name, json.load(f), note)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(done, f, indent=1)
    for row in done["full_depth"]:
        print(row["strategy"], row.get("status"), row.get("peak_gib"), row.get("step_ms"))


if __name__ == "__main__":
    main()

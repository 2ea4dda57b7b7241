"""docs/results/cpu/light_load.json and the table of docs/benchmarks.md "Light load, CPU" from the sweeps here.

python summarize.py      (reads */*_iter0.json.gz: one folder per sweep command, see ../light_load.json's "runs")

Per sweep folder, input length and mode: median and p99 TTFT, median TPOT, the first inter-token gap (median and
p99: cost moved out of TTFT stays visible), TTFT drift, and the sweep's phase medians ("where the time goes").
"""

import gzip
import json
from pathlib import Path

HERE = Path(__file__).parent
OUT = HERE.parent / "light_load.json"
MODES = ("colocated", "push", "pull")


def main() -> None:
    meta = json.loads(OUT.read_text()) if OUT.exists() else {}
    points = []
    for path in sorted(HERE.glob("*/*_iter0.json.gz")):
        d = json.load(gzip.open(path))
        points.append(
            {
                "run": path.parent.name,
                "mode": d["mode"],
                "qps": d["qps"],
                "input_len": d["input_len"],
                "output_len": d["output_len"],
                "completed": d["completed"],
                "median_ttft_ms": d["median_ttft_ms"],
                "p99_ttft_ms": d["p99_ttft_ms"],
                "median_tpot_ms": d["median_tpot_ms"],
                "median_first_itl_ms": d["median_first_itl_ms"],
                "p99_first_itl_ms": d["p99_first_itl_ms"],
                "ttft_quarter_medians_ms": d["ttft_quarter_medians_ms"],
                "ttft_drift": d["ttft_drift"],
                "phase_medians_ms": d["phase_medians_ms"],
                "phase_splits_ms": d["phase_splits_ms"],
            }
        )
    points.sort(key=lambda p: (p["run"], p["input_len"], MODES.index(p["mode"])))
    meta["points"] = points
    OUT.write_text(json.dumps(meta, indent=1) + "\n")
    for p in points:
        phases = " | ".join(f"{k} {v:.1f}" for k, v in p["phase_medians_ms"].items())
        print(
            f"{p['run']:10s} {p['qps']:>4s} qps {p['input_len']:5d} {p['mode']:9s} TTFT {p['median_ttft_ms']:8.1f} "
            f"p99 {p['p99_ttft_ms']:8.1f} TPOT {p['median_tpot_ms']:5.1f} 1st gap {p['median_first_itl_ms']:5.1f} / "
            f"{p['p99_first_itl_ms']:5.1f} drift {p['ttft_drift']:.2f} | {phases}"
        )


if __name__ == "__main__":
    main()

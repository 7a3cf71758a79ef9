"""Draw a Grafana board's panels from a live Prometheus, as one PNG: each panel's queries over
a time range (Grafana's ``$__rate_interval`` given a value), one line per series, titled and
labelled as the board does. For looking at the board where no Grafana runs.

    python -m bench.board --prometheus http://127.0.0.1:9090 --minutes 10 --out board.png
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
from pathlib import Path

import httpx
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

BOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "dashboards" / "kvserve.json"
UNITS = {"percentunit": "fraction", "s": "seconds", "short": "", "bytes": "bytes"}


def query_range(url: str, expr: str, start: float, end: float, step: float) -> list[dict]:
    params = {"query": expr, "start": start, "end": end, "step": step}
    r = httpx.get(f"{url}/api/v1/query_range", params=params, timeout=30)
    body = r.json()
    if r.status_code != 200 or body.get("status") != "success":
        raise RuntimeError(f"{expr}: {body.get('error', r.text)}")
    return body["data"]["result"]


def legend(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template)


def render(
    prometheus: str, board: dict, start: float, end: float, rate_interval: str = "30s"
) -> Figure:
    panels = board["panels"]
    cols = 2
    rows = math.ceil(len(panels) / cols)
    fig = Figure(figsize=(14, 3.2 * rows), layout="constrained")
    fig.suptitle(f"{board['title']} (rendered from Prometheus at {prometheus})")
    step = max(1.0, (end - start) / 300)
    for i, panel in enumerate(panels):
        ax = fig.add_subplot(rows, cols, i + 1)
        ax.set_title(panel["title"], fontsize=10)
        ax.set_ylabel(UNITS.get(panel["fieldConfig"]["defaults"].get("unit", ""), ""))
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", rate_interval)
            for series in query_range(prometheus, expr, start, end, step):
                t = [float(v[0]) - start for v in series["values"]]
                y = [float(v[1]) for v in series["values"]]
                ax.plot(t, y, label=legend(target.get("legendFormat", ""), series["metric"]))
        ax.set_xlabel("seconds")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper left")
    return fig


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.board", description=__doc__.split("\n")[0])
    p.add_argument("--prometheus", default="http://127.0.0.1:9090")
    p.add_argument("--board", type=Path, default=BOARD)
    p.add_argument("--minutes", type=float, default=10.0, help="the range, ending now")
    p.add_argument("--rate-interval", default="30s", help="the value of $__rate_interval")
    p.add_argument("--out", type=Path, default=Path("board.png"))
    args = p.parse_args(argv)
    end = time.time()
    board = json.loads(args.board.read_text())
    fig = render(args.prometheus, board, end - args.minutes * 60, end, args.rate_interval)
    FigureCanvasAgg(fig)
    fig.savefig(args.out, dpi=80)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

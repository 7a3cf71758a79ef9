"""The shipped Prometheus config, rules and Grafana board against a real Prometheus scraping a
real kvserve under load: promtool accepts them, and every expression returns data (no panel or
rule names a metric kvserve does not export)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from engine.args import EngineArgs
from tests.helpers import free_port, random_prompt, serve_in_thread

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
MISSING = [b for b in ("prometheus", "promtool") if shutil.which(b) is None]
pytestmark = pytest.mark.skipif(
    bool(MISSING),
    reason=f"{', '.join(MISSING)} not installed (Debian: apt-get install prometheus; "
    "`make install` does it where it can)",
)
RATE_INTERVAL = "30s"  # Grafana's $__rate_interval, for a 1 s scrape


def promtool(*args: str) -> None:
    done = subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_accepts_the_shipped_config_and_rules():
    promtool("check", "config", str(DEPLOY / "prometheus" / "prometheus.yml"))
    promtool("check", "rules", str(DEPLOY / "prometheus" / "rules.yml"))


@pytest.fixture(scope="module")
def prometheus(tiny_llama_dir, tmp_path_factory):
    """(Prometheus URL, kvserve URL): the shipped config and rules, pointed at a real kvserve
    on loopback, scraping and evaluating every second."""
    from engine.async_engine import AsyncEngine
    from server.app import build_app

    args = EngineArgs(model=str(tiny_llama_dir), device="cpu", max_model_len=128,
                      num_kv_blocks=24, block_size=8, max_num_seqs=8)  # fmt: skip
    engine = AsyncEngine(args)
    work = tmp_path_factory.mktemp("prometheus")
    try:
        with serve_in_thread(build_app(engine)) as kvserve:
            config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
            config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
            config["scrape_configs"][0]["static_configs"] = [
                {"targets": [kvserve.removeprefix("http://")]}
            ]
            (work / "prometheus.yml").write_text(yaml.safe_dump(config))
            shutil.copy(DEPLOY / "prometheus" / "rules.yml", work / "rules.yml")
            promtool("check", "config", str(work / "prometheus.yml"))
            port = free_port()
            proc = subprocess.Popen(
                ["prometheus", f"--config.file={work / 'prometheus.yml'}",
                 f"--storage.tsdb.path={work / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            url = f"http://127.0.0.1:{port}"
            try:
                wait_until(lambda: httpx.get(f"{url}/-/ready").status_code == 200)
                yield url, kvserve
            finally:
                proc.terminate()
                proc.wait(timeout=30)
    finally:
        engine.shutdown()


def wait_until(ready, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if ready():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError("timed out")


def query(url: str, expr: str) -> list:
    r = httpx.get(f"{url}/api/v1/query", params={"query": expr})
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", (expr, body)
    return body["data"]["result"]


@pytest.fixture(scope="module")
def loaded(prometheus):
    """Prometheus after a few seconds of load on kvserve (preemptions included: 24 blocks)."""
    url, kvserve = prometheus
    wait_until(lambda: query(url, 'up{job="kvserve"} == 1'))

    def one(i: int) -> None:
        body = {"prompt": random_prompt(20 + i % 7, 120, seed=i), "max_tokens": 24,
                "ignore_eos": True, "temperature": 0.5}  # fmt: skip
        assert httpx.post(f"{kvserve}/v1/completions", json=body, timeout=60).status_code == 200

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(32)))
    time.sleep(3)  # a few more scrapes and rule evaluations after the load
    return url


def dashboard_expressions() -> list[str]:
    board = json.loads((DEPLOY / "grafana" / "dashboards" / "kvserve.json").read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    return [e.replace("$__rate_interval", RATE_INTERVAL) for e in exprs]


def rules() -> list[dict]:
    groups = yaml.safe_load((DEPLOY / "prometheus" / "rules.yml").read_text())["groups"]
    return [rule for g in groups for rule in g["rules"]]


def test_every_dashboard_expression_returns_data(loaded):
    exprs = dashboard_expressions()
    assert len(exprs) >= 20
    empty = [e for e in exprs if not query(loaded, e)]
    assert not empty, empty
    tokens = query(loaded, "sum(increase(kvserve:generation_tokens_total[1m]))")
    assert float(tokens[0]["value"][1]) > 0


def test_every_recording_rule_records_and_every_alert_reads_exported_series(loaded):
    for rule in rules():
        if "record" in rule:
            assert query(loaded, rule["record"]), rule["record"]
            continue
        query(loaded, rule["expr"])  # parses and evaluates
        for series in set(re.findall(r"kvserve:[a-z_]+", rule["expr"])) | {"up"}:
            assert query(loaded, series), (rule["alert"], series)


def test_the_board_renders_from_prometheus(loaded, tmp_path):
    from bench import board

    out = tmp_path / "board.png"
    board.main(["--prometheus", loaded, "--minutes", "1", "--out", str(out)])
    panels = json.loads(board.BOARD.read_text())["panels"]
    fig = board.render(loaded, json.loads(board.BOARD.read_text()), time.time() - 60, time.time())
    assert len(fig.axes) == len(panels)
    assert sum(len(ax.lines) for ax in fig.axes) >= len(panels)  # every panel drew a series
    assert out.stat().st_size > 10_000

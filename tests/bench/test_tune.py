"""`kvserve tune`: sweep parsing against EngineArgs, best-point choice, the written report, and
one real sweep over SmolLM2."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import gc
import json
import math
import weakref

import pytest

from bench import tune
from bench.loadtest import SLO, BenchConfig, MetricsSeries, RequestRecord, summarize
from bench.tune import (
    PointMetrics,
    PointResult,
    Sweep,
    TuneReport,
    best_point,
    engine_fields,
    main,
    markdown_table,
    parse_sweep,
    parse_value,
    sweep_points,
)
from engine.args import EngineArgs

FIELDS = engine_fields()
BASE = EngineArgs(model="some-model", max_num_batched_tokens=512)


def metrics(**kw) -> PointMetrics:
    values = dict(
        completed=10,
        failed=0,
        request_throughput=1.0,
        output_throughput=100.0,
        goodput=None,
        p99_ttft_ms=500.0,
        p99_itl_ms=50.0,
        mean_tpot_ms=40.0,
        prefix_hit_pct=None,
        spec_accept_pct=None,
        preemptions=0.0,
        context_overflows=0.0,
        rejected=0,
        errors=0,
    )
    return PointMetrics(**{**values, **kw})


def point(index: int, error: str | None = None, **kw) -> PointResult:
    m = None if error else metrics(**kw)
    return PointResult(index, {"max_num_seqs": index}, BASE, metrics=m, error=error)


# --- sweep parsing ------------------------------------------------------------------------


def test_sweepable_settings_are_every_engine_args_field():
    assert list(FIELDS) == [f.name for f in dataclasses.fields(EngineArgs)]
    assert {"max_num_seqs", "kv_cache_memory_gib", "context_overflow"} <= FIELDS.keys()


@pytest.mark.parametrize(
    "text, name, values",
    [
        ("max_num_seqs=4,16", "max_num_seqs", (4, 16)),
        ("max-num-seqs=4,16", "max_num_seqs", (4, 16)),
        (" kv-cache-memory-gib = 0.05, 0.2 ", "kv_cache_memory_gib", (0.05, 0.2)),
        ("num_kv_blocks=none,64", "num_kv_blocks", (None, 64)),
        ("context_overflow=error,shift", "context_overflow", ("error", "shift")),
        ("attention_backend=None,torch", "attention_backend", (None, "torch")),
        ("swap_space_gib=4", "swap_space_gib", (4.0,)),
    ],
)
def test_sweep_values_take_the_type_of_their_field(text, name, values):
    sweep = parse_sweep(text, FIELDS)
    assert sweep == Sweep(name, values)
    assert [type(v) for v in sweep.values] == [type(v) for v in values]


def test_speculation_settings_sweep_into_valid_points():
    base = EngineArgs(model="m")
    sweeps = [
        parse_sweep("speculative-method=ngram", FIELDS),
        parse_sweep("num-speculative-tokens=none,2,4", FIELDS),
    ]
    points = sweep_points(base, sweeps)
    configs = [args.speculative_config() for _, args in points]
    assert [c.method for c in configs] == ["ngram"] * 3
    assert [c.num_tokens for c in configs] == [None, 2, 4] and configs[0].adaptive
    with pytest.raises(ValueError, match="needs a speculative method"):
        sweep_points(base, [parse_sweep("num_speculative_tokens=2", FIELDS)])


def test_int_or_float_fields_keep_integers_integral():
    assert parse_value("4", int | float) == 4 and type(parse_value("4", int | float)) is int
    assert parse_value("4.5", int | float) == 4.5
    assert parse_value("2", float) == 2.0 and type(parse_value("2", float)) is float


def test_bool_settings_read_the_usual_words():
    fields = {"enable_thing": bool}
    assert parse_sweep("enable-thing=true,off", fields).values == (True, False)
    with pytest.raises(ValueError, match="'maybe' is not a bool"):
        parse_sweep("enable_thing=maybe", fields)


def test_unknown_setting_names_the_valid_ones_and_a_near_miss():
    with pytest.raises(ValueError) as err:
        parse_sweep("max_num_seq=4,8", FIELDS)
    message = str(err.value)
    assert "did you mean max_num_seqs?" in message
    assert all(name in message for name in FIELDS)


@pytest.mark.parametrize(
    "text, error",
    [
        ("max_num_seqs", "expected NAME=V1,V2"),
        ("max_num_seqs=", "empty value"),
        ("max_num_seqs=4,,8", "empty value"),
        ("max_num_seqs=four", "'four' is not a int"),
        ("max_num_seqs=none", "'none' is not a int"),
        ("max_num_seqs=4,4", "given twice"),
    ],
)
def test_malformed_sweeps_are_refused(text, error):
    with pytest.raises(ValueError, match=error):
        parse_sweep(text, FIELDS)


def test_points_are_the_cartesian_product_over_the_base_first_sweep_slowest():
    sweeps = [Sweep("max_num_seqs", (1, 4)), Sweep("context_overflow", ("error", "shift"))]
    points = sweep_points(BASE, sweeps)
    assert [s for s, _ in points] == [
        {"max_num_seqs": 1, "context_overflow": "error"},
        {"max_num_seqs": 1, "context_overflow": "shift"},
        {"max_num_seqs": 4, "context_overflow": "error"},
        {"max_num_seqs": 4, "context_overflow": "shift"},
    ]
    for settings, args in points:
        assert args == dataclasses.replace(BASE, **settings)
        assert args.max_num_batched_tokens == 512 and args.model == "some-model"


def test_an_invalid_point_is_refused_before_any_engine_starts():
    with pytest.raises(ValueError, match="point max_num_seqs=0: invalid max_num_seqs"):
        sweep_points(BASE, [Sweep("max_num_seqs", (4, 0))])
    with pytest.raises(ValueError, match="swept twice"):
        sweep_points(BASE, [Sweep("max_num_seqs", (1,)), Sweep("max_num_seqs", (2,))])


def test_a_memory_sweep_that_num_kv_blocks_would_override_is_refused():
    base = dataclasses.replace(BASE, num_kv_blocks=64)
    with pytest.raises(ValueError, match="num_kv_blocks overrides kv_cache_memory_gib"):
        sweep_points(base, [Sweep("kv_cache_memory_gib", (0.05, 0.2))])


# --- the CLI refuses bad plans without loading a model -----------------------------------


def cli(*extra: str) -> list[str]:
    return ["--model", "no-such-model", "--num-prompts", "2", *extra]


@pytest.mark.parametrize(
    "argv, error",
    [
        (cli(), "at least one --sweep"),
        (
            cli("--sweep", "max_num_seqs=1,2,4", "--sweep", "block_size=8,16", "--max-points", "4"),
            "6 points, over --max-points 4",
        ),
        (cli("--sweep", "max_num_seqs=1,2", "--objective", "goodput"), "needs --slo"),
        (cli("--sweep", "max_num_seqs=1,2", "--dataset", "/no/such.jsonl"), "cannot read"),
        (cli("--sweep", "num_blocks=1,2"), "unknown engine setting 'num_blocks'"),
    ],
)
def test_cli_refuses_bad_plans_with_usage_status(argv, error, capsys):
    assert main(argv) == 2
    assert error in capsys.readouterr().err


def test_a_quality_sweep_of_kv_dtypes_alone_scores_the_grid_under_each():
    (kv,) = [parse_sweep("kv-cache-dtype=float32,int8,int8/int4,int4", FIELDS)]
    assert tune.kv_dtype_sweep(BASE, [kv]) == ["float32", "int8", "int8/int4", "int4"]
    other = parse_sweep("max_num_seqs=1,2", FIELDS)
    assert tune.kv_dtype_sweep(BASE, [kv, other]) is None  # the throughput sweep
    assert tune.kv_dtype_sweep(BASE, [other]) is None
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        tune.kv_dtype_sweep(BASE, [parse_sweep("kv_cache_dtype=float32,int9", FIELDS)])


def test_a_quality_sweep_refuses_an_unknown_kv_dtype_before_loading_a_model(capsys):
    argv = ["--model", "no-such-model", "--objective", "quality", "--text", "alice",
            "--max-model-len", "64", "--sweep", "kv_cache_dtype=float32,int9"]  # fmt: skip
    assert main(argv) == 2
    assert "kv_cache_dtype" in capsys.readouterr().err


def test_default_grid_limit_is_sixteen_points(capsys):
    argv = cli("--sweep", "max_num_seqs=1,2,3,4,5,6,7,8,9", "--sweep", "block_size=8,16")
    assert main(argv) == 2
    assert "18 points, over --max-points 16" in capsys.readouterr().err


def test_list_settings_needs_no_model(capsys):
    assert main(["--list-settings"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in FIELDS)
    assert "max_num_seqs" in out and "int" in out


def test_objective_defaults_to_goodput_with_an_slo():
    args = tune.build_parser().parse_args(cli("--sweep", "max_num_seqs=1,2"))
    assert tune.plan_from_args(args).objective == "throughput"
    args = tune.build_parser().parse_args(cli("--sweep", "max_num_seqs=1,2", "--slo", "ttft=9"))
    plan = tune.plan_from_args(args)
    assert plan.objective == "goodput" and plan.workload.slo == SLO(ttft_ms=9.0)
    assert [p.settings for p in plan.points] == [{"max_num_seqs": 1}, {"max_num_seqs": 2}]
    assert plan.workload.num_prompts == 2 and not plan.workload.show_progress


# --- choosing the best point ----------------------------------------------------------------


def test_throughput_and_goodput_pick_the_largest():
    points = [
        point(1, output_throughput=90.0, goodput=0.8),
        point(2, output_throughput=120.0, goodput=0.5),
        point(3, output_throughput=100.0, goodput=0.9),
    ]
    assert best_point(points, "throughput").index == 2
    assert best_point(points, "goodput").index == 3


def test_latency_objectives_pick_the_smallest():
    points = [
        point(1, p99_ttft_ms=300.0, p99_itl_ms=80.0),
        point(2, p99_ttft_ms=200.0, p99_itl_ms=90.0),
        point(3, p99_ttft_ms=400.0, p99_itl_ms=40.0),
    ]
    assert best_point(points, "p99_ttft").index == 2
    assert best_point(points, "p99_itl").index == 3


def test_latency_cannot_be_won_by_refusing_requests():
    points = [
        point(1, p99_ttft_ms=300.0),
        point(2, p99_ttft_ms=50.0, completed=6, failed=4, rejected=4),
    ]
    assert best_point(points, "p99_ttft").index == 1


def test_ties_go_to_fewer_failures_then_the_secondary_then_sweep_order():
    # Within TIE_TOLERANCE of the best throughput: a tie.
    near = 100.0 * (1 - tune.TIE_TOLERANCE / 2)
    fewer_failures = [
        point(1, output_throughput=100.0, failed=1, errors=1),
        point(2, output_throughput=near),
    ]
    assert best_point(fewer_failures, "throughput").index == 2
    lower_ttft = [
        point(1, output_throughput=100.0),
        point(2, output_throughput=near, p99_ttft_ms=9),
    ]
    assert best_point(lower_ttft, "throughput").index == 2
    faster = [point(1, p99_ttft_ms=100.0), point(2, p99_ttft_ms=100.5, output_throughput=150.0)]
    assert best_point(faster, "p99_ttft").index == 2
    same = [point(1), point(2), point(3)]
    assert best_point(same, "throughput").index == 1
    clear_win = [point(1, output_throughput=100.0), point(2, output_throughput=90.0, p99_ttft_ms=1)]
    assert best_point(clear_win, "throughput").index == 1


def test_points_that_did_not_run_or_measure_never_win():
    points = [
        point(1, error="RuntimeError: out of memory"),
        point(2, completed=0, failed=10, errors=10, output_throughput=0.0),
        point(3, output_throughput=5.0, p99_itl_ms=None),
    ]
    assert best_point(points, "throughput").index == 3
    assert best_point(points, "p99_itl") is None
    assert best_point(points[:2], "throughput") is None
    assert best_point(points, "goodput") is None  # no SLO: no goodput anywhere


# --- one point's numbers ------------------------------------------------------------------


def test_point_metrics_split_429s_from_errors_and_sum_counters_over_labels():
    def rec(i: int, failure: str | None = None) -> RequestRecord:
        r = RequestRecord(i, 0.0, start_s=0.0, end_s=1.0, ttft_s=0.1, output_tokens=8)
        r.success = failure is None
        r.failure = failure
        r.itl_s = [0.1] * 7
        return r

    records = [rec(0), rec(1), rec(2, "429"), rec(3, "429"), rec(4, "400")]
    summary = summarize(records, 2.0, SLO(ttft_ms=50.0), planned=5)
    result = tune.BenchResult(BenchConfig(), "m", "t", summary, records, MetricsSeries())
    counters = {
        'kvserve:num_preemptions_total{mode="recompute"}': 2.0,
        'kvserve:num_preemptions_total{mode="swap"}': 1.0,
        'kvserve:context_overflows_total{policy="shift"}': 4.0,
        "kvserve:generation_tokens_total": 99.0,
    }
    m = PointMetrics.from_result(result, counters)
    assert (m.completed, m.failed, m.rejected, m.errors) == (2, 3, 2, 1)
    assert (m.preemptions, m.context_overflows) == (3.0, 4.0)
    assert m.request_throughput == 1.0 and m.output_throughput == 8.0
    assert m.goodput == 0.0  # every TTFT (100 ms) misses the 50 ms objective
    assert m.p99_itl_ms == pytest.approx(100.0) and m.mean_tpot_ms == pytest.approx(900 / 7)


# --- the sweep loop, with a stand-in for the engine ---------------------------------------


def test_a_point_that_fails_to_start_is_reported_and_the_sweep_goes_on(monkeypatch):
    records = [RequestRecord(0, 0.0, start_s=0.0, end_s=1.0, success=True, output_tokens=4)]
    result = tune.BenchResult(
        BenchConfig(), "m", "t", summarize(records, 1.0, SLO(), 1), records, MetricsSeries()
    )
    seen = []

    def fake_measure(args, workload, warmup):
        seen.append(args.max_num_seqs)
        if args.max_num_seqs == 2:
            raise RuntimeError("KV cache too small")
        return result, {"kvserve:num_preemptions_total": 3.0}

    monkeypatch.setattr(tune, "measure", fake_measure)
    points = [PointResult(i, {"max_num_seqs": i}, dataclasses.replace(BASE, max_num_seqs=i))
              for i in (1, 2, 3)]  # fmt: skip
    lines: list[str] = []
    done = tune.run_sweep(points, BenchConfig(), warmup=0, progress=lines.append)
    assert seen == [1, 2, 3] and len(done) == 3
    assert done[1].error == "RuntimeError: KV cache too small" and done[1].metrics is None
    assert done[0].metrics.preemptions == 3.0 and done[2].metrics.output_throughput == 4.0
    assert lines[3] == "[2/3] max_num_seqs=2: failed (RuntimeError: KV cache too small) in " + (
        f"{done[1].wall_s:.1f} s"
    )
    assert lines[1].startswith("[1/3] max_num_seqs=1: 1/1 ok, 1.00 req/s, 4.0 tok/s")
    assert "3 preempted" in lines[1]


def test_ctrl_c_keeps_the_points_already_measured(monkeypatch):
    def fake_measure(args, workload, warmup):
        if args.max_num_seqs == 2:
            raise KeyboardInterrupt
        records = [RequestRecord(0, 0.0, start_s=0.0, end_s=1.0, success=True)]
        summary = summarize(records, 1.0, SLO(), 1)
        return tune.BenchResult(BenchConfig(), "m", "t", summary, records, MetricsSeries()), {}

    monkeypatch.setattr(tune, "measure", fake_measure)
    points = [PointResult(i, {"max_num_seqs": i}, dataclasses.replace(BASE, max_num_seqs=i))
              for i in (1, 2, 3)]  # fmt: skip
    lines: list[str] = []
    done = tune.run_sweep(points, BenchConfig(), progress=lines.append)
    assert [p.index for p in done] == [1]
    assert lines[-1] == "interrupted: reporting 1 of 3 points"


# --- the report -----------------------------------------------------------------------------


def report(objective: str = "throughput", slo: SLO | None = None) -> TuneReport:
    slo = slo or SLO()
    sweeps = [Sweep("max_num_seqs", (1, 4)), Sweep("context_overflow", ("error", "shift"))]
    points = [
        PointResult(i, settings, args)
        for i, (settings, args) in enumerate(sweep_points(BASE, sweeps), 1)
    ]
    goodput = 0.5 if slo.defined else None
    points[0].metrics = metrics(output_throughput=40.0, goodput=goodput, p99_itl_ms=None)
    points[1].metrics = metrics(output_throughput=80.0, goodput=goodput, context_overflows=3.0)
    points[2].error = "RuntimeError: out of memory"
    points[3].metrics = metrics(output_throughput=60.0, goodput=goodput, rejected=2, failed=2)
    return TuneReport(objective, sweeps, BASE, BenchConfig(slo=slo), points, planned=4)


def test_markdown_table_has_a_row_per_point_and_stars_the_best():
    r = report()
    table = markdown_table(r.points, r.names, r.best)
    lines = table.splitlines()
    assert len({len(line) for line in lines}) == 1  # padded into straight columns
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header[:3] == ["#", "max_num_seqs", "context_overflow"]
    assert "goodput req/s" not in header  # no SLO, no goodput column
    assert {"req/s", "out tok/s", "p99 TTFT ms", "p99 ITL ms", "mean TPOT ms"} <= set(header)
    assert {"preempt", "ctx overflow", "429", "errors"} <= set(header)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    assert [row[0] for row in rows] == ["1", "2 ★", "3", "4"]
    cell = dict(zip(header, rows[1]))
    assert cell["out tok/s"] == "80.0" and cell["ctx overflow"] == "3"
    assert dict(zip(header, rows[0]))["p99 ITL ms"] == "-"
    assert rows[2][3] == "failed"
    assert dict(zip(header, rows[3]))["429"] == "2"


def test_markdown_names_the_best_point_and_points_that_did_not_run():
    text = report().markdown()
    best = "#2 max_num_seqs=1 context_overflow=shift (output 80 tok/s, the highest)"
    assert f"Best for throughput: {best}\n" in text
    assert "#3 did not run: RuntimeError: out of memory" in text
    text = report("goodput", SLO(ttft_ms=100.0)).markdown()
    assert "goodput req/s" in text
    best = "#1 max_num_seqs=1 context_overflow=error (goodput 0.5 req/s, the highest)"
    tie = "#2, #4 within 2%, ties broken by fewer failures, then lower p99 TTFT"
    assert f"Best for goodput: {best}; {tie}\n" in text


def test_a_point_that_completed_nothing_shows_its_first_error():
    records = [RequestRecord(0, 0.0, start_s=0.0, end_s=0.1), RequestRecord(1, 0.0)]
    records[0].fail("400", "The KV cache cannot hold 40 tokens of one request", 400)
    result = tune.BenchResult(
        BenchConfig(), "m", "t", summarize(records, 1.0, SLO(), 2), records, MetricsSeries()
    )
    p = PointResult(1, {"num_kv_blocks": 1}, BASE, PointMetrics.from_result(result, {}))
    p.bench = result
    lines = tune.summary_lines([p], "throughput", None)
    assert lines == [
        "No best point for throughput: no point completed requests with a measured output tok/s.",
        "#1 completed no request: 400 The KV cache cannot hold 40 tokens of one request",
    ]


def test_one_value_sweeps_are_named_once_above_the_table_not_as_columns():
    sweeps = [Sweep("max_num_seqs", (1, 4)), Sweep("swap_space_gib", (0.05,))]
    points = [
        PointResult(i, s, a, metrics()) for i, (s, a) in enumerate(sweep_points(BASE, sweeps), 1)
    ]
    r = TuneReport("throughput", sweeps, BASE, BenchConfig(), points, planned=2)
    head, table = r.markdown().split("\n\n")[:2]
    assert head.endswith("; every point with swap_space_gib=0.05")
    assert "swap_space_gib" not in table and "max_num_seqs" in table
    assert r.fixed == {"swap_space_gib": 0.05} and r.varying == ["max_num_seqs"]


def test_report_files_csv_json_and_png(tmp_path):
    r = report("goodput", SLO(ttft_ms=100.0))
    paths = r.write(tmp_path / "out")
    assert [p.name for p in paths] == ["tune.md", "tune.csv", "tune.json", "tune.png"]
    assert (tmp_path / "out" / "tune.md").read_text().startswith("kvserve tune: some-model")

    with open(tmp_path / "out" / "tune.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [row["index"] for row in rows] == ["1", "2", "3", "4"]
    assert rows[0]["max_num_seqs"] == "1" and rows[3]["context_overflow"] == "shift"
    assert float(rows[1]["output_throughput"]) == 80.0 and rows[0]["p99_itl_ms"] == ""
    assert float(rows[3]["rejected"]) == 2 and float(rows[0]["goodput"]) == 0.5
    assert [row["best"] for row in rows] == ["1", "0", "0", "0"]  # goodput tie: sweep order
    assert rows[2]["error"] == "RuntimeError: out of memory" and rows[2]["completed"] == ""

    def no_nan(token: str) -> float:
        raise ValueError(f"non-finite number {token} in JSON")

    data = json.loads((tmp_path / "out" / "tune.json").read_text(), parse_constant=no_nan)
    assert data["objective"] == "goodput" and data["best"] == 1
    assert data["sweep"] == {"max_num_seqs": [1, 4], "context_overflow": ["error", "shift"]}
    assert data["base_engine_args"]["max_num_batched_tokens"] == 512
    assert data["workload"]["request_rate"] is None and data["workload"]["slo"]["ttft_ms"] == 100
    assert [p["settings"] for p in data["points"]][1] == {
        "max_num_seqs": 1,
        "context_overflow": "shift",
    }
    assert data["points"][1]["engine_args"]["context_overflow"] == "shift"
    assert data["points"][2]["metrics"] is None and data["points"][2]["error"]

    png = (tmp_path / "out" / "tune.png").read_bytes()
    assert png.startswith(b"\x89PNG") and 10_000 < len(png) < 200_000


# --- a real sweep -----------------------------------------------------------------------------


@pytest.mark.slow
def test_real_two_point_sweep_over_smollm2(smollm2_dir, tmp_path, capsys, monkeypatch):
    out = tmp_path / "tune"
    n = 4
    engines: list[weakref.ref] = []
    earlier_alive: list[bool] = []
    serve_engine = tune.serve_engine

    @contextlib.contextmanager
    def watched(args):
        earlier_alive.extend(ref() is not None for ref in engines)
        with serve_engine(args) as (engine, url, name):
            engines.append(weakref.ref(engine))
            yield engine, url, name

    monkeypatch.setattr(tune, "serve_engine", watched)
    code = main(
        [
            "--model", str(smollm2_dir), "--device", "cpu", "--max-model-len", "256",
            "--num-kv-blocks", "64", "--sweep", "max-num-seqs=1,4",
            "--num-prompts", str(n), "--input-len", "32", "--output-len", "8",
            "--scrape-interval", "0", "--warmup", "1", "--out", str(out),
        ]
    )  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "[1/2] max_num_seqs=1 ..." in captured.err and "[2/2] max_num_seqs=4: " in captured.err
    assert sorted(p.name for p in out.iterdir()) == ["tune.csv", "tune.json", "tune.md", "tune.png"]

    with open(out / "tune.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [row["max_num_seqs"] for row in rows] == ["1", "4"]
    assert [int(row["completed"]) for row in rows] == [n, n]
    assert [int(row["errors"]) + int(row["rejected"]) for row in rows] == [0, 0]
    assert sum(int(row["best"]) for row in rows) == 1
    best = next(row for row in rows if row["best"] == "1")
    assert f"Best for throughput: #{best['index']} max_num_seqs=" in captured.out

    data = json.loads((out / "tune.json").read_text())
    assert data["best"] == int(best["index"])
    for p in data["points"]:
        summary = p["bench"]["summary"]
        assert summary["total_output_tokens"] == n * 8  # every request ran to its max_tokens
        assert summary["ttft"]["p99_ms"] > 0 and math.isfinite(summary["output_throughput"])
        assert p["engine_args"]["max_num_seqs"] == p["settings"]["max_num_seqs"]
    # Each point's model and KV cache are freed before the next point loads its own.
    assert len(engines) == 2 and earlier_alive == [False]
    gc.collect()
    assert engines[1]() is None

"""`kvserve bench`'s door: both base-URL conventions, and one line when nothing succeeded."""

from __future__ import annotations

import socket

import pytest

from bench.cli import main
from bench.loadtest import BenchConfig, normalize_base_url
from tests.bench.test_loadtest import MODEL, Fake, serve

QUICK = ["--num-prompts", "4", "--input-len", "8", "--output-len", "3", "--no-progress"]


@pytest.mark.parametrize(
    "given",
    [
        "http://127.0.0.1:8000",
        "http://127.0.0.1:8000/",
        "http://127.0.0.1:8000/v1",
        "http://127.0.0.1:8000/v1/",
        " http://127.0.0.1:8000 ",
    ],
)
def test_host_and_port_or_api_root_name_the_same_endpoint(given):
    assert normalize_base_url(given) == "http://127.0.0.1:8000/v1"
    config = BenchConfig(base_url=given)
    assert config.endpoint_url == "http://127.0.0.1:8000/v1/completions"
    assert config.root_url == "http://127.0.0.1:8000"


def test_a_path_prefix_keeps_its_place_and_other_schemes_stay_as_given():
    assert normalize_base_url("https://gw.example/llm/") == "https://gw.example/llm/v1"
    assert normalize_base_url("https://gw.example/llm/v1") == "https://gw.example/llm/v1"
    assert normalize_base_url("localhost:8000") == "localhost:8000"


@pytest.mark.parametrize("suffix", ["", "/", "/v1", "/v1/"])
def test_cli_reaches_the_server_with_either_form(suffix, capsys):
    fake = Fake()
    with serve(fake) as url:
        root = url.removesuffix("/v1")
        code = main(["--base-url", root + suffix, *QUICK])
    assert code == 0, capsys.readouterr().err
    assert len(fake.bodies) == 4 and all(b["model"] == MODEL for b in fake.bodies)
    assert "Successful requests:" in capsys.readouterr().out


def test_all_requests_failing_exits_non_zero_with_the_reason(capsys):
    with serve(Fake()) as url:
        wrong = url.removesuffix("/v1") + "/api"  # the server has no /api/v1/completions
        code = main(["--base-url", wrong, "--model", MODEL, *QUICK])
    assert code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith(
        f"kvserve bench: all 4 requests failed: HTTP 404 from {wrong}/v1/completions"
    )
    assert err[0].endswith("is --base-url right?")


def test_nothing_listening_says_it_cannot_connect(capsys):
    with socket.socket() as s:  # a port that was free a moment ago, now closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = main(["--base-url", f"http://127.0.0.1:{port}", "--model", MODEL, *QUICK])
    assert code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvserve bench: all 4 requests failed: ")
    assert f"cannot connect to http://127.0.0.1:{port}/v1/completions" in err[0]

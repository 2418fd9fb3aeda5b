"""The `stemlm serve` command: lazy imports, one-line errors, and SIGTERM draining a real server process."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from stemlm.cli import main as cli_main
from stemlm.serve.server import free_port

from serve_helpers import tiny_checkpoint

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("serve_cli") / "tiny")


def test_importing_stemlm_does_not_import_fastapi():
    code = "import sys, stemlm, stemlm.cli, stemlm.cli.serve, stemlm.serve; print('fastapi' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.stdout.strip() == "False"


def test_without_the_extra_the_error_names_it(ckpt, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "fastapi", None)  # import fastapi now raises ImportError
    assert cli_main(["serve", "--model", str(ckpt)]) == 2
    err = capsys.readouterr().err.strip()
    assert "pip install 'stemlm[serve]'" in err and len(err.splitlines()) == 1


def test_no_model_and_no_default_run_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli_main(["serve"]) == 2
    err = capsys.readouterr().err.strip()
    assert "no --ckpt given" in err and len(err.splitlines()) == 1


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        cli_main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for text in ("(default: 8000)", "(default: 16)", "(default: 127.0.0.1)", "(default: device)", "(default: cpu)"):
        assert text in out


def test_sigterm_drains_a_streaming_request(ckpt):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "stemlm", "serve", "--model", str(ckpt), "--port", str(port),
                             "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if requests.get(url + "/health", timeout=1).ok:
                    break
            except requests.ConnectionError:
                time.sleep(0.1)
        body = {"model": "tiny", "prompt": "The cat", "max_tokens": 400, "temperature": 0, "stream": True}
        with requests.post(url + "/v1/completions", json=body, stream=True) as resp:
            lines = resp.iter_lines(decode_unicode=True)
            first = next(line for line in lines if line)
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert first.startswith("data: ") and rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] in ("length", "stop")
        assert proc.wait(60) == 0
        assert f"{url}/v1" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_tier_and_model_are_aliases_and_tier_says_it_is_deprecated(capsys):
    from stemlm.cli import ArgumentParser
    from stemlm.cli import serve
    from stemlm.cli.options import placement_from_args
    from stemlm.store import Placement

    parser = ArgumentParser(prog="stemlm serve")
    serve.add_arguments(parser)
    args = parser.parse_args(["--model", "runs/x", "--tier", "host", "--cache-rows", "8", "--no-prefetch"])
    assert args.ckpt == "runs/x" and args.tables == "host"
    assert "--tier is deprecated; use --tables" in capsys.readouterr().err
    assert placement_from_args(args) == Placement("host", cache_rows=8, prefetch=False, device="cpu")

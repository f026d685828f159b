"""The command line a new user meets: every `serve` flag explained and grouped, unknown
architectures refused with the known list (issue 34, CLI hygiene)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from server.cli import build_parser
from tests.router_harness import ROOT
from workers.contract import TopologySpecError, parse_simulate

GROUPS = {"model", "network and auth", "devices", "engine and memory", "routing", "failures", "numerics",
          "observability", "budgets", "chat", "protocols", "compile", "LoRA adapters", "disaggregation"}


def _serve_parser():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices["serve"]


def test_every_serve_flag_has_help_and_a_named_group():
    """Guards server/cli.py's groups: no flag left in argparse's catch-all `options`, none without help."""
    serve = _serve_parser()
    placed = {}
    for group in serve._action_groups:
        for action in group._group_actions:
            if action.dest != "help":
                placed[action.option_strings[0]] = group.title
    assert len(placed) == len([a for a in serve._actions if a.dest != "help"]) >= 50
    assert {flag: title for flag, title in placed.items() if title not in GROUPS} == {}
    assert [a.option_strings[0] for a in serve._actions if a.dest != "help" and not (a.help or "").strip()] == []
    assert placed["--served-model-name"] == "model" and placed["--gpu-memory-utilization"] == "engine and memory"
    assert placed["--host"] == "network and auth" and placed["--simulate"] == "devices"
    assert placed["--otlp-endpoint"] == "observability" and placed["--dtype"] == "model"


@pytest.mark.parametrize("spec", ["sm_99", "sm_80,sm_99:16GiB", "gfx999"])
def test_an_architecture_that_does_not_exist_is_refused_with_the_known_ones(spec):
    """Guards `simulated_device`'s KNOWN_CUDA / KNOWN_ROCM check (workers/contract/topology.py)."""
    with pytest.raises(TopologySpecError) as e:
        parse_simulate(spec)
    bad = spec.split(",")[-1].split(":")[0]
    assert f"Unknown simulated architecture `{bad}`" in str(e.value)
    assert "Known: sm_35," in str(e.value) and "sm_90, sm_100" in str(e.value) and "gfx942" in str(e.value)
    assert [d.arch for d in parse_simulate("sm_70,sm_86:24GiB,sm_103,sm_121,gfx90a,gfx950,cpu")] == [
        "sm_70", "sm_86", "sm_103", "sm_121", "gfx90a", "gfx950", "cpu"]


def test_serve_with_an_unknown_architecture_exits_2_with_one_line():
    r = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--simulate", "sm_99", "--port", "0"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("hetserve serve: error: Unknown simulated architecture `sm_99`. Known: sm_35")


@pytest.mark.parametrize(("host", "url"), [("0.0.0.0", "http://127.0.0.1:8000"), ("::", "http://[::1]:8000"),
                                           ("10.1.2.3", "http://10.1.2.3:8000"), ("::1", "http://[::1]:8000")])
def test_the_ready_url_opens_from_this_host(host, url):
    """Guards `_ANY_ADDRESS` in server/commands/serve.py `_url`: with `--host 0.0.0.0` the ready
    line printed `http://0.0.0.0:8000`, which opens nothing in most browsers."""
    from server.commands.serve import _url

    assert _url(host, 8000) == url

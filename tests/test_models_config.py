"""`hetserve serve`'s model flags, validated once (server/config/models.py), and `hetserve plan`
placing several models (server/commands/plan_model.py `attach_models`)."""

from __future__ import annotations

import json
import shutil

import pytest

from server.cli import build_parser, main
from server.commands.plan import _render
from server.config.models import ModelEntry
from server.config.settings import RouterSettings
from server.errors import UsageError
from workers.contract import DEFAULT_MODEL_DIR


def settings(*argv: str) -> RouterSettings:
    return RouterSettings.from_args(build_parser().parse_args(["serve", *argv]))


def model_dir(root, name: str):
    path = root / name
    path.mkdir(parents=True)
    shutil.copy(DEFAULT_MODEL_DIR / "config.json", path / "config.json")
    return path


def test_named_and_bare_models_the_first_is_the_default(tmp_path):
    chat, coder = model_dir(tmp_path, "llama-chat"), model_dir(tmp_path, "coder-1b")
    s = settings("--model", f"chat={chat}", "--model", str(coder))
    assert s.models.catalog() == (ModelEntry("chat", chat.resolve()), ModelEntry("coder-1b", coder.resolve()))
    assert s.model_dir == chat.resolve() and not s.models.on_demand


def test_no_model_is_the_embedded_one():
    s = settings()
    assert s.models.catalog() == (ModelEntry("default_model", DEFAULT_MODEL_DIR),) and s.model_dir == DEFAULT_MODEL_DIR


def test_models_dir_offers_every_model_directory_below_it_after_the_named_ones(tmp_path):
    root = tmp_path / "models"
    for name in ("b", "a", "chat"):
        model_dir(root, name)
    (root / "notes").mkdir()  # no config.json: no model
    s = settings("--model", f"chat={model_dir(tmp_path, 'elsewhere')}", "--models-dir", str(root))
    assert [e.name for e in s.models.catalog()] == ["chat", "a", "b"] and s.models.on_demand
    assert s.models.catalog()[0].path == (tmp_path / "elsewhere").resolve()


def test_place_pin_model_and_max_loaded(tmp_path):
    a, b = model_dir(tmp_path, "a"), model_dir(tmp_path, "b")
    s = settings("--model", str(a), "--model", str(b), "--place", "a=gpu0, 2", "--pin-model", "b",
                 "--max-loaded-models", "2")
    assert s.models.pins_of("a") == ("gpu0", "2") and s.models.pins_of("b") == ()
    assert s.models.pinned == ("b",) and s.models.max_loaded == 2 and s.models.on_demand


@pytest.mark.parametrize(("argv", "needle"), [
    (["--model", "/nonexistent/model"], "Model directory `/nonexistent/model` does not exist"),
    (["--model", "a={a}", "--model", "a={b}"], "Model name `a` is given twice"),
    (["--model", "bad name={a}"], "is no model name"),
    (["--model", "{a}", "--place", "a=gpu0+"], "`+` joins devices into one pipeline replica"),
    (["--model", "{a}", "--place", "x=gpu0"], "no model `x`. Models: a"),
    (["--model", "{a}", "--place", "a="], "write NAME=DEV[,DEV...]"),
    (["--model", "{a}", "--place", "a=gpu0", "--place", "a=gpu1"], "is given twice"),
    (["--model", "{a}", "--pin-model", "zz"], "`--pin-model zz`: no model `zz`"),
    (["--model", "{a}", "--model", "{b}", "--pin-model", "a", "--pin-model", "b", "--max-loaded-models", "1"],
     "at least the 2 pinned models"),
    (["--max-loaded-models", "0"], "`--max-loaded-models 0` must be at least 1"),
    (["--models-dir", "{a}"], "holds no model directory"),
])
def test_bad_model_flags_name_the_value(tmp_path, argv, needle):
    a, b = model_dir(tmp_path, "a"), model_dir(tmp_path, "b")
    with pytest.raises(UsageError) as e:
        settings(*(arg.format(a=a, b=b) for arg in argv))
    assert needle in str(e.value)


# --- hetserve plan with several models --------------------------------------------------------
def _plan(capsys, *argv) -> tuple[int, dict]:
    code = main(["plan", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_plan_places_several_models_with_bytes_and_reasons(tmp_path, capsys):
    from tests.checkpoints import make_checkpoint

    big = make_checkpoint(tmp_path / "big", vocab_size=4096, hidden_size=256, intermediate_size=1024)
    small = make_checkpoint(tmp_path / "small")
    code, plan = _plan(capsys, "--simulate", "sm_75:6MiB,sm_86:24MiB,sm_90:80GiB",
                       "--model", f"big={big}", "--model", f"small={small}", "--place", "small=gpu0")
    assert code == 0
    assert plan["placement"]["models"] == {"big": ["gpu1", "gpu2"], "small": ["gpu0"]}
    assert [d["model"] for d in plan["devices"]] == ["small", "big", "big"]
    assert [m["name"] for m in plan["models"]] == ["big", "small"] and "model" not in plan
    gpu1 = plan["placement"]["devices"][1]
    assert gpu1["role"] == "first" and gpu1["need"]["total_bytes"] <= gpu1["usable_bytes"] < 24 << 20
    assert "smallest free device that holds big" in gpu1["reason"]
    for entry in plan["devices"]:  # each device's attention plan is its own model's
        assert entry["attention"][0]["layers"] == [0, 1]
    text = _render(plan)  # what `hetserve plan` prints without --json
    assert "placement: big on gpu1, gpu2; small on gpu0" in text and "serves big" in text
    assert "  gpu1 (8.6, 24 MiB): big [first] the smallest free device that holds big" in text
    assert "model small = " in text and "  gpu0 (7.5, 6 MiB): small [pinned] pinned by --place small=gpu0" in text


def test_plan_of_a_model_that_fits_nowhere_shows_why_and_exits_1(tmp_path, capsys):
    from tests.checkpoints import make_checkpoint

    code, plan = _plan(capsys, "--simulate", "sm_90:256KiB", "--model", str(make_checkpoint(tmp_path / "m")))
    assert code == 1 and "`m` fits no device" in plan["placement"]["error"]
    assert plan["devices"][0]["attention"] and plan["model"]["architecture"] == "llama"  # the rest of the plan

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from autoprec.cli import main
from autoprec.defaults import check_compile_environment, env_seconds
from autoprec.kernels import FORMATS


def test_formats_json_lists_the_registry(capsys):
    assert main(["formats", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == list(FORMATS)
    e4m3 = rows[4]
    assert e4m3["max_finite"] == 448.0 and e4m3["overflow"] == "saturate"


def test_formats_table(capsys):
    assert main(["formats"]) == 0
    out = capsys.readouterr().out
    assert "fp8_e4m3" in out and "5.734e+04" in out


def test_usage_errors_exit_2_in_one_line(capsys):
    assert main(["no-such-command"]) == 2
    err = capsys.readouterr().err
    assert "No such command" in err and "Traceback" not in err


def test_console_script_help_and_version():
    out = subprocess.run(
        [sys.executable, "-m", "autoprec", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "formats" in out
    version = subprocess.run(
        [sys.executable, "-m", "autoprec", "--version"], capture_output=True, text=True, check=True
    ).stdout
    assert "0.1.0" in version


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("AUTOPREC_COMPILE", "yes"),
        ("AUTOPREC_COMPILE_BUDGET", "abc"),
        ("AUTOPREC_COMPILE_PAYBACK", "-1"),
        ("AUTOPREC_COMPILE_PAYBACK", "nan"),
    ],
)
def test_a_bad_compile_setting_is_one_line_before_any_work(name, value, monkeypatch, capsys):
    monkeypatch.setenv(name, value)
    # analyze would train the model first; the check comes before the command runs at all
    assert main(["analyze", "--model", "no-such-model"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"autoprec: error: {name} must be") and repr(value) in err
    assert "\n" not in err


def test_good_compile_settings_pass_the_check(monkeypatch):
    for name, value in [("AUTOPREC_COMPILE", "0"), ("AUTOPREC_COMPILE_BUDGET", "2.5")]:
        monkeypatch.setenv(name, value)
    check_compile_environment()
    assert env_seconds("AUTOPREC_COMPILE_BUDGET", 60.0) == 2.5
    monkeypatch.delenv("AUTOPREC_COMPILE_BUDGET")
    assert env_seconds("AUTOPREC_COMPILE_BUDGET", 60.0) == 60.0

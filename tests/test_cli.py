from __future__ import annotations

import json
import subprocess
import sys

from autoprec.cli import main
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

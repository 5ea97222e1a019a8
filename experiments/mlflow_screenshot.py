"""Screenshots of the MLflow UI on real autoprec searches, for the README.

Runs three small real searches of tinycnn (agents random, tpe and baseline; budget 6) into a
fresh SQLite MLflow store, serves it with `mlflow ui`, and has headless Chromium (Debian's
`chromium` package) capture two pages: the experiment's runs table (one parent run per search,
nested runs per evaluated policy) and MLflow's compare view of the three parent runs.

    python experiments/mlflow_screenshot.py            # writes docs/mlflow-*.png
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_searches(work: Path, uri: str) -> None:
    env = {**os.environ, "AUTOPREC_CACHE_DIR": str(work / "cache")}
    cli = str(Path(sys.executable).with_name("autoprec"))
    for agent in ("random", "tpe", "baseline"):
        cmd = [cli, "search", "--model", "tinycnn", "--agent", agent, "--budget", "6"]
        cmd += ["--tracking-uri", uri, "--out", str(work / f"{agent}.yaml")]
        cmd += ["--storage", f"sqlite:///{work / 'optuna.db'}"]
        subprocess.run(cmd, check=True, cwd=work, env=env, capture_output=True)


def wait_for(url: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"mlflow ui did not answer at {url}")


def api(base: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(
        f"{base}/api/2.0/mlflow/{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.load(resp)


def shoot(chromium: str, url: str, out: Path, size: str) -> None:
    profile = tempfile.mkdtemp(prefix="autoprec-chromium-")
    cmd = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={size}"]
    cmd += ["--virtual-time-budget=20000", f"--screenshot={out}", url]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    shutil.rmtree(profile, ignore_errors=True)
    print(f"wrote {out}", file=sys.stderr)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    args = p.parse_args()
    if not Path(args.chromium).exists():
        raise SystemExit("needs Chromium: apt-get install chromium")
    work = Path(tempfile.mkdtemp(prefix="autoprec-mlflow-shot-"))
    uri = f"sqlite:///{work / 'mlflow.db'}"
    run_searches(work, uri)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri, "--port", str(port)],
        cwd=work,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(base)
        found = api(base, "experiments/search", {"max_results": 100})
        exp = next(e for e in found["experiments"] if e["name"] == "autoprec/tinycnn")
        runs = api(
            base,
            "runs/search",
            {
                "experiment_ids": [exp["experiment_id"]],
                "filter": "tags.`autoprec.agent` != ''",
                "max_results": 100,
            },
        )["runs"]
        parents = [
            r["info"]["run_id"]
            for r in runs
            if not any(t["key"] == "mlflow.parentRunId" for t in r["data"].get("tags", []))
        ]
        eid = exp["experiment_id"]
        shoot(
            args.chromium, f"{base}/#/experiments/{eid}/runs", DOCS / "mlflow-runs.png", "1600,900"
        )
        query = urllib.parse.urlencode(
            {"runs": json.dumps(parents), "experiments": json.dumps([eid])}
        )
        shoot(
            args.chromium,
            f"{base}/#/compare-runs?{query}",
            DOCS / "mlflow-compare.png",
            "1600,1400",
        )
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()

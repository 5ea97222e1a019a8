"""Real services for the multi-machine tests: a throwaway PostgreSQL cluster and MLflow servers.

Import the fixtures into a test module (``from services import postgres_url, mlflow_server``).

* :func:`postgres_url` (module scope): a cluster made with Debian's ``postgresql`` binaries
  (``initdb`` into a temporary folder, ``pg_ctl start`` on a free 127.0.0.1 port, its unix
  socket in that folder, password authentication over TCP) and a fresh database in it; the URL
  is ``postgresql://autoprec:<password>@127.0.0.1:<port>/<db>``, as the README tells users to
  pass to ``--storage``. PostgreSQL refuses to run as root: as root the cluster belongs to the
  ``postgres`` system user that the package creates (commands run through ``runuser``).
* :func:`mlflow_server` (function scope): ``mlflow server`` on a free 127.0.0.1 port with a
  SQLite backend and a local folder as the artifact destination (served over HTTP, as a remote
  server would), in its own process group so that a test can kill it as a crash would
  (:meth:`MlflowServer.kill`).

Without the binaries (or the Python driver) the tests are skipped with the reason; under CI
(``CI`` set, where ``.ci/run`` installs them) a missing service fails instead, so that a green
CI never hides skipped multi-machine tests.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

START_TIMEOUT_S = 90


def unavailable(reason: str) -> None:
    """Skip the test, or fail it under CI, which must run it."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI must run this test: .ci/run installs postgresql)")
    pytest.skip(reason)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- PostgreSQL -----------------------------------------------------------------------------
def postgres_bin() -> Path | None:
    """The folder of ``initdb`` and ``pg_ctl``: Debian's newest, else the PATH's."""
    versions = [Path(p).parent.parent for p in glob.glob("/usr/lib/postgresql/*/bin/pg_ctl")]
    versions.sort(key=lambda v: int(v.name) if v.name.isdigit() else 0)
    if versions:
        return versions[-1] / "bin"
    pg_ctl = shutil.which("pg_ctl")
    return Path(pg_ctl).resolve().parent if pg_ctl else None


class PostgresCluster:
    """A throwaway cluster in a temporary folder; :meth:`start` returns nothing, :meth:`url`
    the URL of a database in it."""

    user = "autoprec"

    def __init__(self, bin_dir: Path) -> None:
        self.bin = bin_dir
        self.password = secrets.token_hex(8)
        self.port = 0
        self.as_user: str | None = None
        if os.geteuid() == 0:
            try:
                pwd.getpwnam("postgres")
            except KeyError:
                unavailable("running as root and there is no 'postgres' user to own the cluster")
            if shutil.which("runuser") is None:
                unavailable("running as root and runuser is missing")
            self.as_user = "postgres"
        # not under pytest's tmp_path (nor a $TMPDIR of root's): its folders are 0700 and
        # root's, out of the cluster owner's reach
        parent = "/tmp" if self.as_user is not None and os.path.isdir("/tmp") else None
        self.root = Path(tempfile.mkdtemp(prefix="autoprec-pg-", dir=parent))
        if self.as_user is not None:
            owner = pwd.getpwnam(self.as_user)
            os.chown(self.root, owner.pw_uid, owner.pw_gid)
        self.data = self.root / "data"
        self.log = self.root / "postgres.log"

    def _run(self, *args: str) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.bin / args[0]), *args[1:]]
        if self.as_user is not None:
            cmd = ["runuser", "-u", self.as_user, "--", *cmd]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=START_TIMEOUT_S)

    def start(self) -> None:
        pwfile = self.root / "pw"
        pwfile.write_text(self.password + "\n")
        if self.as_user is not None:
            owner = pwd.getpwnam(self.as_user)
            os.chown(pwfile, owner.pw_uid, owner.pw_gid)
        done = self._run(
            "initdb",
            "-D",
            str(self.data),
            "-U",
            self.user,
            f"--pwfile={pwfile}",
            "--auth-host=scram-sha-256",
            "--auth-local=trust",
            "-E",
            "UTF8",
            "--no-sync",
        )
        pwfile.unlink()
        if done.returncode != 0:
            pytest.fail(f"initdb failed: {done.stderr.strip()[-800:]}")
        for _ in range(3):  # the free port may be taken between the probe and the start
            self.port = free_port()
            options = (
                f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 "
                "-c fsync=off -c synchronous_commit=off -c full_page_writes=off"
            )
            done = self._run(
                "pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60",
                "-o", options, "start",
            )  # fmt: skip
            if done.returncode == 0:
                return
        log = self.log.read_text()[-800:] if self.log.exists() else ""
        pytest.fail(f"pg_ctl start failed: {done.stdout.strip()} {done.stderr.strip()} {log}")

    def create_database(self, name: str) -> str:
        """Create database ``name``; returns its URL (with the password)."""
        import psycopg

        with psycopg.connect(
            host="127.0.0.1",
            port=self.port,
            user=self.user,
            password=self.password,
            dbname="postgres",
            autocommit=True,
        ) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return f"postgresql://{self.user}:{self.password}@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        if self.data.exists():
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="module")
def postgres_url() -> Iterator[str]:
    """The URL of a fresh database on a throwaway local PostgreSQL server."""
    bin_dir = postgres_bin()
    if bin_dir is None or not (bin_dir / "initdb").exists():
        unavailable(
            "PostgreSQL is not installed (no pg_ctl under /usr/lib/postgresql/*/bin or on "
            "PATH): apt-get install postgresql"
        )
    try:
        import psycopg  # noqa: F401
    except ImportError:
        unavailable('the PostgreSQL driver is missing: pip install -e ".[dev]" (psycopg)')
    cluster = PostgresCluster(bin_dir)
    try:
        cluster.start()
        yield cluster.create_database("autoprec_study")
    finally:
        cluster.stop()


# -- MLflow server --------------------------------------------------------------------------
@dataclass
class MlflowServer:
    """A running ``mlflow server``; :attr:`uri` is its tracking URI."""

    uri: str
    process: subprocess.Popen[bytes]
    root: Path

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL the server and its workers at once, as a crash would."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)  # workers left behind, if any
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=15)

    def log(self) -> str:
        path = self.root / "server.log"
        return path.read_text(errors="replace") if path.exists() else ""


def start_mlflow_server(root: Path) -> MlflowServer:
    """Start ``mlflow server`` on 127.0.0.1 (SQLite backend, artifacts under ``root``) and
    wait until it answers ``/health``."""
    executable = Path(sys.executable).parent / "mlflow"
    if not executable.exists():
        unavailable(f"mlflow's server command is missing ({executable})")
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"  # no job consumers: a lean server
    cmd = [
        str(executable), "server", "--host", "127.0.0.1", "--port", str(port),
        "--workers", "1", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
        "--artifacts-destination", str(root / "artifacts"),
    ]  # fmt: skip
    with (root / "server.log").open("wb") as log:
        process = subprocess.Popen(
            cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    server = MlflowServer(f"http://127.0.0.1:{port}", process, root)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if not server.alive():
            pytest.fail(f"mlflow server exited {process.returncode}: {server.log()[-1500:]}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"{server.uri}/health", timeout=2) as answer:
                if answer.status == 200:
                    return server
        time.sleep(0.3)
    server.stop()
    pytest.fail(f"mlflow server did not answer within {START_TIMEOUT_S} s: {server.log()[-1500:]}")


@pytest.fixture
def mlflow_server(tmp_path_factory) -> Iterator[MlflowServer]:
    """A fresh MLflow tracking server for one test (which may kill it)."""
    server = start_mlflow_server(tmp_path_factory.mktemp("mlflow-server"))
    try:
        yield server
    finally:
        server.stop()

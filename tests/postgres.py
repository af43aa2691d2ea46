"""A PostgreSQL cluster of the tests' own: initialised in a temporary folder, listening on a
unix socket there only (no port to collide with), run as a non-root user (PostgreSQL refuses
root; as root, the ``postgres`` user Debian's package creates), stopped and removed after, and
by a watchdog process if the process that started it dies without stopping it (pytest killed)."""

from __future__ import annotations

import glob
import itertools
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SUPERUSER = "kvdb"
# Waits for the starting process to end; then, unless told the cluster was stopped (its stdin
# closed with a word), stops it immediately and removes its folder.
WATCHDOG = """
import os, shutil, subprocess, sys, threading, time
parent, folder, *stop = sys.argv[1:]
done = threading.Event()
threading.Thread(target=lambda: sys.stdin.read() and done.set(), daemon=True).start()
while not done.is_set():
    try:
        os.kill(int(parent), 0)
    except ProcessLookupError:
        subprocess.run(stop, capture_output=True, cwd=folder)
        shutil.rmtree(folder, ignore_errors=True)
        break
    time.sleep(0.5)
"""


class PostgresMissing(RuntimeError):
    """PostgreSQL's binaries are not on this machine."""


def _bindir() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    if initdb is None:
        raise PostgresMissing(
            "needs Debian's postgresql (the DuckLake tests start a cluster of their own): "
            "`sudo apt-get install postgresql`, or `make install` as root"
        )
    return Path(initdb).resolve().parent


class Cluster:
    def __init__(self):
        self.bin = _bindir()
        self.folder = Path(tempfile.mkdtemp(prefix="kvdb-pg-"))
        self.data = self.folder / "data"
        self._as = [] if os.geteuid() != 0 else ["runuser", "-u", "postgres", "--"]
        if self._as:
            os.chown(self.folder, pwd.getpwnam("postgres").pw_uid, -1)
        self._names = itertools.count(1)
        self._watchdog: subprocess.Popen | None = None

    def _run(self, *argv: str) -> None:
        subprocess.run([*self._as, *argv], check=True, capture_output=True, cwd=self.folder)

    def start(self) -> Cluster:
        self._run(str(self.bin / "initdb"), "-D", str(self.data), "-A", "trust", "-U", SUPERUSER, "--no-sync")
        stop = [*self._as, str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop"]
        self._watchdog = subprocess.Popen(
            [sys.executable, "-c", WATCHDOG, str(os.getpid()), str(self.folder), *stop],
            stdin=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.start_again()
        return self

    def stop(self) -> None:
        """Stop (immediately: nothing here is kept) and remove the folder."""
        if (self.data / "postmaster.pid").exists():
            subprocess.run(
                [*self._as, str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop"],
                capture_output=True,
                cwd=self.folder,
            )
        shutil.rmtree(self.folder, ignore_errors=True)
        if self._watchdog is not None:
            self._watchdog.communicate("stopped")  # its work is done
            self._watchdog = None

    def pause(self) -> None:
        """Stop the server, keeping its data: ``start_again`` brings it back."""
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")

    def start_again(self) -> None:
        options = f"-c listen_addresses='' -k {self.folder} -c fsync=off -c max_connections=200"
        self._run(
            str(self.bin / "pg_ctl"), "-D", str(self.data), "-o", options, "-l", str(self.folder / "log"), "-w", "start"
        )

    def conninfo(self, dbname: str) -> str:
        return f"dbname={dbname} host={self.folder} user={SUPERUSER}"

    def new_database(self) -> str:
        """A fresh, empty database's conninfo."""
        name = f"lake_{next(self._names)}"
        self._run(str(self.bin / "createdb"), "-h", str(self.folder), "-U", SUPERUSER, name)
        return self.conninfo(name)

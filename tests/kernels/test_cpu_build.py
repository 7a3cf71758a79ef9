"""The C++ kernels' builds survive a build killed midway: torch's ``lock`` file left behind must
not stall the next build forever, and a build in progress in another process must still be
waited for."""

from __future__ import annotations

import subprocess
import sys
import threading

from kernels import cpu

HOLDER = """
import sys
from pathlib import Path
from kernels.cpu import build_lock
with build_lock(Path(sys.argv[1])):
    (Path(sys.argv[1]) / "lock").touch()  # torch's mark of a build in progress
    print("held", flush=True)
    sys.stdin.read()
"""


def test_a_lock_file_left_by_a_killed_build_is_cleared(tmp_path):
    (tmp_path / "lock").touch()
    with cpu.build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_a_build_in_progress_elsewhere_is_waited_for(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        entered = threading.Event()

        def build():
            with cpu.build_lock(tmp_path):
                entered.set()

        waiter = threading.Thread(target=build)
        waiter.start()
        assert not entered.wait(1.0)
        assert (tmp_path / "lock").exists()
        holder.stdin.close()  # the other build ends without removing its mark, as if killed
        assert entered.wait(30)
        waiter.join()
        assert not (tmp_path / "lock").exists()
    finally:
        holder.kill()
        holder.wait()

"""SIGTERM ends a command the way an error does: staging removed, lock released, one line."""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_sigterm_ends_a_command_with_one_line(tmp_path):
    """SIGTERM unwinds (staging removed, lock released) and says so in one line."""
    import signal
    import subprocess
    import sys
    import time

    fifo_free_wait = "import time, sys; from normswap.cli.main import main; sys.argv=['normswap']; "
    code = (
        fifo_free_wait
        + "import normswap.processes as m; m.stop_on_signals(); print('ready', flush=True); time.sleep(60)"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert p.stdout.readline().strip() == "ready"
    time.sleep(0.1)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 128 + signal.SIGTERM and err.strip() == "normswap: stopped by SIGTERM", err

"""examples/payments/run.py, the one-command payments example, run as a user would run it."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.support.processes import assert_all_gone, interrupt_when

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "examples" / "payments" / "run.py"


def test_the_payments_example_charges_once_and_refuses_the_paused_worker():
    # When the example runs end to end
    proc = subprocess.run([sys.executable, str(RUN)], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    out = proc.stdout
    # Then it succeeds, with exactly one charge and the paused worker's write refused
    assert proc.returncode == 0, out + proc.stderr
    assert "[ok] exactly one card charge" in out
    assert "[ok] A's late fenced write was refused" in out
    assert re.search(r"worker A's late write was refused: fenced write to orders\.id='order-1001' "
                     r"with token \d+ refused", out), out
    assert "FAILED" not in out
    # And every process it started is gone
    assert_all_gone(out)


def test_the_payments_example_cleans_up_on_ctrl_c():
    # Given the example running, with worker A paused mid-charge
    # When the user presses Ctrl-C
    code, out = interrupt_when([sys.executable, str(RUN)], "paused it with SIGSTOP", cwd=ROOT)
    # Then it stops every process it started and exits with 130
    assert code == 130, out
    assert "stopped every process this example started" in out
    assert_all_gone(out)

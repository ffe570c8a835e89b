"""Runs one benchmark script in quick mode, as the bench smoke tests do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_quick_bench(script: str, redis_url: str, tmp_path: Path, timeout: float,
                    args: tuple[str, ...] = ()) -> tuple[str, dict]:
    """Run ``bench/SCRIPT --quick`` on ``redis_url``, JSON results in ``tmp_path``.

    Asserts that it succeeded and printed its Markdown table; returns its
    stdout and the results it wrote.
    """
    results = tmp_path / f"results-{Path(script).stem}.json"
    env = {**os.environ, "REDIS_URL": redis_url}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), "--quick", "--json", str(results), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "| measurement" in out and "| result" in out
    return out, json.loads(results.read_text())

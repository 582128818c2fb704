"""Short CI version of the sustained-load test (the 2-minute run is `bench/serving/load.py`)."""

import subprocess
import sys
from pathlib import Path

import pytest

from afd.local.children import free_port_block

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_64_clients_no_failed_request_and_bounded_rss():
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "serving" / "load.py"), "--clients", "64", "--seconds", "10",
         "--port", str(free_port_block(1))],
        capture_output=True, text=True, timeout=280,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "failed 0" in done.stdout

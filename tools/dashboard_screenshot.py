"""Screenshot of the TensorBoard "Custom Scalars" dashboard of a log dir, taken by headless Chromium.

    python tools/dashboard_screenshot.py LOGDIR OUT.png [--chromium PATH]

Starts TensorBoard on a free 127.0.0.1 port, waits until it serves a run, lets Chromium (Debian's ``chromium``:
``--headless --no-sandbox --disable-gpu``) render the dashboard, writes the PNG and stops the server. Exit code 2
with one line when Chromium or the log dir is missing.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for_runs(port: int, timeout_s: float) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/runs", timeout=5) as response:
                runs = json.loads(response.read())
            if runs:
                return list(runs)
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"TensorBoard on port {port} served no run within {timeout_s:.0f} s")


def screenshot(logdir: Path, out: Path, chromium: str, timeout_s: float = 120) -> Path:
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for_runs(port, timeout_s)
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                "--window-size=1600,1300", "--virtual-time-budget=20000", f"--screenshot={out.resolve()}",
                f"http://127.0.0.1:{port}/?darkMode=false#custom_scalars",
            ],
            check=True, capture_output=True, timeout=timeout_s,
        )  # fmt: skip
    finally:
        server.terminate()
        server.wait(timeout=30)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logdir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--chromium", default=shutil.which("chromium") or shutil.which("chromium-browser"))
    args = parser.parse_args()
    if not args.chromium:
        print("error: no chromium found; on Debian: apt-get install chromium (or pass --chromium PATH)", file=sys.stderr)
        return 2
    if not any(args.logdir.rglob("events.out.tfevents.*")):
        print(f"error: {args.logdir} holds no TensorBoard event files", file=sys.stderr)
        return 2
    print(f"wrote {screenshot(args.logdir, args.out, args.chromium)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

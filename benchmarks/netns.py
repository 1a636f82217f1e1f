"""The emulated link: a network namespace whose loopback is rate-limited with a tbf qdisc."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Any


def unavailable() -> str | None:
    """Why the emulated link cannot be set up here, or None if it can."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found (package iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root"
    return None


def _run(*cmd: str) -> str:
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return done.stdout


@contextlib.contextmanager
def rate_limited(rate: str, burst: str = "512kb", latency: str = "100ms") -> Iterator[str]:
    """A fresh namespace with loopback up and shaped to ``rate``; removed on exit."""
    name = f"fddpbench{os.getpid()}"
    _run("ip", "netns", "add", name)
    try:
        inside = ("ip", "netns", "exec", name)
        _run(*inside, "ip", "link", "set", "lo", "up")
        shape = ("tc", "qdisc", "replace", "dev", "lo", "root", "tbf")
        _run(*inside, *shape, "rate", rate, "burst", burst, "latency", latency)
        yield name
    finally:
        subprocess.run(("ip", "netns", "del", name), check=False, capture_output=True)


def qdisc_stats(name: str) -> str:
    """``tc -s qdisc show dev lo`` inside the namespace: proves the traffic went through tbf."""
    return _run("ip", "netns", "exec", name, "tc", "-s", "qdisc", "show", "dev", "lo").strip()


def run_behind(rate: str, script: str, argv: list[str]) -> dict[str, Any]:
    """``python script ARGV --regime-json PATH`` inside a namespace shaped to ``rate``: the JSON
    the script writes to PATH, with the qdisc's statistics and the rate."""
    with rate_limited(rate) as name, tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "link.json")
        cmd = ["ip", "netns", "exec", name, sys.executable, os.path.abspath(script)]
        subprocess.run([*cmd, *argv, "--regime-json", path], check=True)
        with open(path) as f:
            result = json.load(f)
        result["qdisc"] = qdisc_stats(name)
    result["rate"] = rate
    return result

"""The cache lock: processes that share a cache take turns, and a killed holder frees it."""
import subprocess
import sys

HOLD = """
import sys, time
from pathlib import Path
from tandem.paths import exclusive
with exclusive(Path(sys.argv[1])):
    start = time.time()
    print("in", flush=True)
    time.sleep(float(sys.argv[2]))
    print(start, time.time(), flush=True)
"""


def hold(lock, seconds):
    return subprocess.Popen([sys.executable, "-c", HOLD, str(lock), str(seconds)],
                            stdout=subprocess.PIPE, text=True)


def test_holders_take_turns(tmp_path):
    lock = tmp_path / "sub" / "x.lock"              # its folder is made
    procs = [hold(lock, 0.5) for _ in range(3)]
    spans = sorted(tuple(map(float, p.communicate(timeout=60)[0].split()[1:])) for p in procs)
    assert all(p.returncode == 0 for p in procs)
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert start >= end, spans                  # no two inside at once


def test_a_killed_holder_frees_the_lock(tmp_path):
    lock = tmp_path / "x.lock"
    first = hold(lock, 600)
    assert first.stdout.readline() == "in\n"
    first.kill()
    first.wait()
    second = hold(lock, 0)
    assert second.communicate(timeout=60)[0].startswith("in") and second.returncode == 0

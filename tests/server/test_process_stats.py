"""The CPU seconds /status reports per process, against the process's own count (os.times).

CPU time only grows, so a read taken between two of the process's own counts lies between them:
no tolerance on how long anything took."""
import math
import os
import subprocess
import sys

from tandem.server.app import cpu_seconds, process_stats

# burns about half a second of CPU, a part of it in the kernel (random bytes), prints what it
# used by its own count (user and system), waits to be read, and prints its count again
CHILD = """
import os, sys, time
t = time.process_time()
while time.process_time() - t < 0.5:
    sum(i * i for i in range(20000))
    os.urandom(1 << 20)
u = os.times()
print(u.user, u.system, flush=True)
sys.stdin.readline()
u = os.times()
print(u.user + u.system, flush=True)
"""
def between(low: float, seen: float, high: float) -> bool:
    """``seen`` (cpu_seconds: clock ticks, in hundredths of a second) lies between two counts of
    the same process's CPU time taken just before and just after it, each cut to the hundredth
    below and above: CPU time only grows, so no time that passed is allowed for."""
    return math.floor(round(low * 100, 6)) / 100 <= seen <= math.ceil(round(high * 100, 6)) / 100


def _child_cpu(tmp_path, name: str) -> tuple[float, float, float]:
    """(the child's own CPU seconds before the read, cpu_seconds of it, its own count after) for a
    Python started under ``name``."""
    exe = tmp_path / name
    exe.symlink_to(sys.executable)
    p = subprocess.Popen([str(exe), "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        user, system = map(float, p.stdout.readline().split())
        seen = cpu_seconds(p.pid)
        stats = process_stats(p.pid)
        p.stdin.write("\n")
        p.stdin.flush()
        after = float(p.stdout.readline())
    finally:
        p.stdin.close()
        p.wait(timeout=30)
    assert stats is not None and between(seen, stats["cpu_s"], after)
    assert system >= 0.1            # both counts are read: a system-time slip would show
    return user + system, seen, after


def test_cpu_seconds_match_the_process_own_count(tmp_path):
    before, seen, after = _child_cpu(tmp_path, "py")
    assert before >= 0.5
    assert between(before, seen, after)


def test_a_name_with_spaces_and_parentheses_is_read_past(tmp_path):
    """The process name field may hold ') ' itself: the fields are counted from its last ')'."""
    assert between(*_child_cpu(tmp_path, "a) b c (d"))


def test_own_process():
    t0 = os.times()
    seen = cpu_seconds(os.getpid())
    t1 = os.times()
    assert between(t0.user + t0.system, seen, t1.user + t1.system)


def test_cpu_used_counts_a_restarted_worker_from_zero():
    """Between two reads a worker restarted under a new pid: its seconds count from zero, the
    old one's last seconds are lost, and the sum never goes below zero."""
    from tandem.bench.online import cpu_used
    before = {"client": 1.0, "server": 5.0, "workers": {10: 30.0, 11: 40.0}}
    after = {"client": 1.5, "server": 6.0, "workers": {10: 32.5, 12: 3.0}}
    assert cpu_used(before, after) == {"client": 0.5, "server": 1.0, "workers": 5.5}
    assert cpu_used({"client": 1.0}, after) == {"client": 0.5}          # a peer: no /status

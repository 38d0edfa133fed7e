"""MLX_MOE_FIX_SHARD (tests/conftest.py), which scripts/pytest-shards.sh uses to run the GPU tests
in processes side by side: the shards split the selected tests, none lost, none run twice."""

import os
import subprocess
import sys
from pathlib import Path


def collected(shard=None):
    env = dict(os.environ)
    env.pop("MLX_MOE_FIX_SHARD", None)
    if shard:
        env["MLX_MOE_FIX_SHARD"] = shard
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "tests/parity/test_greedy_tokens.py", "-k", "greedy_tokens_match"],
        capture_output=True, text=True, env=env, check=True)
    return [line for line in result.stdout.splitlines() if "::" in line]


def test_shards_partition_the_selection():
    everything = collected()
    shards = [collected(f"{i}/3") for i in range(3)]
    assert len(everything) >= 6
    assert sorted(sum(shards, [])) == sorted(everything)
    assert all(shards)


def test_shards_that_ignore_sigint_are_killed_after_shard_kill_after(tmp_path):
    """A shard stuck where SIGINT does not reach it (here a fake pytest ignoring it, with a child)
    is killed, its children with it, SHARD_KILL_AFTER seconds after the signal, and its log still
    printed: none goes on beside gpu-check.sh's next part."""
    fake = tmp_path / "bin" / "python3"
    fake.parent.mkdir()
    fake.write_text('#!/usr/bin/env bash\ntrap "" INT\necho "stuck shard $MLX_MOE_FIX_SHARD"\n'
                    f'sleep 60 & echo $! > {tmp_path}/child-$$\nwait\n')
    fake.chmod(0o755)
    env = dict(os.environ, SHARD_KILL_AFTER="1", PATH=f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    result = subprocess.run(
        ["timeout", "-s", "INT", "-k", "15", "1", "bash", "scripts/pytest-shards.sh", "2", "unused"],
        capture_output=True, text=True, env=env, timeout=30)
    assert result.returncode == 124  # timeout's SIGINT, not its SIGKILL (137)
    assert "---- shard 0/2 (exit 137)" in result.stdout and "---- shard 1/2 (exit 137)" in result.stdout
    assert "stuck shard 1/2" in result.stdout
    children = [int(path.read_text()) for path in tmp_path.glob("child-*")]
    assert len(children) == 2
    assert not [child for child in children if running(child)]


def running(pid):
    """Alive and not a zombie (a killed orphan stays one until this container's init reaps it)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status

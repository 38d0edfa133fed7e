"""MLX_MOE_FIX_SHARD (tests/conftest.py), which scripts/pytest-shards.sh uses to run the GPU tests
in processes side by side: the shards split the selected tests, none lost, none run twice."""

import os
import subprocess
import sys


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


def test_shard_logs_stay_where_shard_logs_names(tmp_path):
    """SHARD_LOGS keeps each shard's own log, which a killed run (gpu-check.sh's SIGKILL) would
    otherwise never print."""
    logs = tmp_path / "shards"
    stale = logs / "5.log"
    logs.mkdir()
    stale.write_text("an earlier run's shard")
    env = dict(os.environ, SHARD_LOGS=str(logs),
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    env.pop("MLX_MOE_FIX_SHARD", None)
    result = subprocess.run(
        ["bash", "scripts/pytest-shards.sh", "2", "--collect-only", "-q", "-p", "no:cacheprovider",
         "tests/parity/test_greedy_tokens.py", "-k", "greedy_tokens_match"],
        capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(path.name for path in logs.iterdir()) == ["0.log", "1.log"]
    shard_logs = [(logs / f"{i}.log").read_text() for i in range(2)]
    assert all("::" in text for text in shard_logs)
    assert result.stdout.rstrip().splitlines()[-1].startswith("shard 0/2: ")

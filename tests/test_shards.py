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

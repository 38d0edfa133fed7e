"""The environment for a test's child Python: the repo first on PYTHONPATH, then whatever it
already holds (where MLX may be, as on the GPU machine, whose bundle puts it there)."""

import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def repo_env(**overrides) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])), **overrides}

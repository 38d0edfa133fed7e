"""scripts/source-ab.sh: each alternative's files replace the tree's for its run only, and
--prepare takes from a branch the files it changed (under mlx_moe_fix/) since it left HEAD."""

import os
import pathlib
import subprocess

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "source-ab.sh"


def git(cwd, *args):
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                   env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t"})


def test_prepare_then_run_each_alternative_and_restore_the_tree(tmp_path):
    kernel = tmp_path / "mlx_moe_fix" / "k.cu"
    kernel.parent.mkdir()
    kernel.write_text("main\n")
    (tmp_path / "mlx_moe_fix" / "other.py").write_text("same\n")
    git(tmp_path, "init", "-q", "-b", "main")
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-qm", "main")
    git(tmp_path, "checkout", "-qb", "alt")
    kernel.write_text("alt\n")
    git(tmp_path, "commit", "-qam", "alt")
    git(tmp_path, "checkout", "-q", "main")

    subprocess.run([str(SCRIPT), "--prepare", "alt"], cwd=tmp_path, check=True, capture_output=True)
    prepared = sorted(p.relative_to(tmp_path / ".ab").as_posix() for p in (tmp_path / ".ab").rglob("*") if p.is_file())
    assert prepared == ["alt/mlx_moe_fix/k.cu"]

    out = tmp_path / "out"
    subprocess.run([str(SCRIPT), "cat", "mlx_moe_fix/k.cu"], cwd=tmp_path, check=True, capture_output=True,
                   env={**os.environ, "OUT": str(out)})
    assert (out / "ab-main.log").read_text() == "main\n"
    assert (out / "ab-alt.log").read_text() == "alt\n"
    assert kernel.read_text() == "main\n"

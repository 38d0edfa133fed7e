"""The README's environment table lists every switch the package reads, with its default."""

import pathlib
import re

from mlx_moe_fix import env

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_lists_every_switch_with_its_default():
    rows = {}
    for line in README.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[1] in ("on", "off"):
            for name in re.findall(r"`(MLX_MOE_FIX_\w+)`", cells[0]):
                rows[name] = cells[1] == "on"
    assert rows == env.SWITCHES

"""The decode launches' block shapes (moe_decode.BlockShape: warps a block, rows a warp, resident
warps an SM) set from a benchmark's command line. Not a script.

    gate_up=4x2x24,one_pair_down=8x4x16     # STAGE=WARPSxROWSxRESIDENT, comma-separated

Stages: gate_up (GATE_UP_BLOCK: every gate+up launch, routed or not), down (DOWN_BLOCK: the downs
one_pair_down does not take), one_pair_down (ONE_PAIR_A_WARP_DOWN: the combining down of 4-bit
experts in fixed point at top-k >= its warps). A shape applies to launch plans made while it is
set: plans are cached on an experts object (MoEExperts.memo), so time fresh experts objects."""

import contextlib
import importlib

decode_module = importlib.import_module("mlx_moe_fix.kernels.moe_decode")

STAGES = {"gate_up": "GATE_UP_BLOCK", "down": "DOWN_BLOCK", "one_pair_down": "ONE_PAIR_A_WARP_DOWN"}


def parse(text: str) -> dict:
    """'gate_up=4x2x24,down=8x4x16' -> {'GATE_UP_BLOCK': BlockShape(4, 2, 24), ...}; '' -> {}."""
    shapes = {}
    for setting in filter(None, text.split(",")):
        stage, _, value = setting.partition("=")
        numbers = value.split("x")
        if stage not in STAGES or len(numbers) != 3 or not all(n.isdigit() and int(n) > 0 for n in numbers):
            raise ValueError(f"{setting!r}: expected STAGE=WARPSxROWSxRESIDENT with STAGE one of {', '.join(STAGES)}")
        warps, rows, resident = map(int, numbers)
        if resident % warps:
            raise ValueError(f"{setting!r}: resident warps an SM must be a multiple of the block's warps")
        shapes[STAGES[stage]] = decode_module.BlockShape(warps, rows, resident)
    return shapes


def varied(rows=None, warps=None, resident=None) -> dict:
    """Production's shapes with `rows` a warp and `warps` a block on the gate+up's and the plain
    down's (the one-pair down keeps its own) and `resident` warps an SM on all three, where given."""
    shapes = {}
    for constant in STAGES.values():
        shape = getattr(decode_module, constant)
        if constant != "ONE_PAIR_A_WARP_DOWN":
            shape = shape._replace(rows=rows or shape.rows, warps=warps or shape.warps)
        shapes[constant] = shape._replace(resident=resident or shape.resident)
    return shapes


def label(shapes: dict) -> str:
    """The shapes as parse() reads them, or 'production' where none is set."""
    names = {constant: stage for stage, constant in STAGES.items()}
    return ",".join(f"{names[c]}={s.warps}x{s.rows}x{s.resident}" for c, s in shapes.items()) or "production"


@contextlib.contextmanager
def block_shapes(shapes: dict):
    """moe_decode's block shapes set to `shapes` ({constant: BlockShape}) within the block."""
    saved = {constant: getattr(decode_module, constant) for constant in shapes}
    try:
        for constant, shape in shapes.items():
            setattr(decode_module, constant, shape)
        yield
    finally:
        for constant, shape in saved.items():
            setattr(decode_module, constant, shape)

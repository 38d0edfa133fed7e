"""The kernel sources as cuda_kernel receives them: sections, and no comments or blank lines."""

import re
from importlib import resources

from mlx_moe_fix.kernels.sources import compact, sections

CUDA_FILES = ("moe_decode.cu", "moe_prefill.cu", "moe_router.cu", "moe_routed_decode.cu")


def test_compact_drops_comments_indentation_and_blank_lines_and_keeps_code_lines():
    source = "// about\n#pragma unroll\n\n    int a = 1;  // why\n  asm volatile(\"mov %0;\\n\");\n"
    assert compact(source) == "#pragma unroll\nint a = 1;\nasm volatile(\"mov %0;\\n\");\n"


def test_no_string_literal_in_the_sources_holds_a_comment_marker():
    # compact() strips from `//` to the line's end, which would cut such a literal.
    folder = resources.files("mlx_moe_fix.kernels").joinpath("cuda")
    for name in (*CUDA_FILES, "common.cuh"):
        code = [re.sub(r"^\s*//.*", "", line) for line in folder.joinpath(name).read_text().splitlines()]
        literals = re.findall(r'"(?:[^"\\]|\\.)*"', "\n".join(code))
        assert not [s for s in literals if "//" in s], name


def test_every_file_has_a_header_and_its_kernels_and_they_are_compact():
    for name, kernels in (("moe_decode.cu", {"gate_up", "down", "routed_down"}), ("moe_prefill.cu", {"grouped", "route", "combine"}),
                          ("moe_router.cu", {"topk", "sigmoid_topk"}), ("moe_routed_decode.cu", {"routed_gate_up"})):
        parts = sections("cuda", name)
        assert set(parts) == {"header", *kernels}
        for text in parts.values():
            assert "//" not in text and "\n\n" not in text and text.strip()


def test_a_source_that_uses_others_gets_their_headers_after_the_common_helpers_once():
    routed = sections("cuda", "moe_routed_decode.cu")["header"]
    common = sections("cuda", "moe_router.cu")["header"].split("namespace moe_router {")[0]
    assert routed.startswith(common) and routed.count("namespace moe_common {") == 1
    for used in ("moe_router.cu", "moe_decode.cu"):
        own = sections("cuda", used)["header"][len(common):]
        assert routed.count(own) == 1, used
    assert routed.index("namespace moe_router {") < routed.index("namespace moe_decode {")

"""The kernel sources as cuda_kernel receives them: sections, and no comments or blank lines."""

import os
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
    for name, kernels in (("moe_decode.cu", {"gate_up", "down", "routed_down", "shared_gate_up", "shared_down", "routed_shared_down"}), ("moe_prefill.cu", {"grouped", "grouped_wgmma", "route", "k_order", "combine"}),
                          ("moe_router.cu", {"topk", "sigmoid_topk", "sqrtsoftplus_topk", "sqrtsoftplus_hash"}), ("moe_routed_decode.cu", {"routed_gate_up", "router_gate_up", "sigmoid_shared_gate_up"})):
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


def test_a_cuda_kernel_gets_only_the_declarations_its_body_reaches():
    from mlx_moe_fix.kernels.sources import cuda_kernel_source

    down, body = cuda_kernel_source("moe_decode.cu", "routed_down")
    assert "down_rows" in body and "down_rows" in down and "RoutingTail" in down
    assert "gate_up_rows" not in down and "activate" not in down
    routed, _ = cuda_kernel_source("moe_routed_decode.cu", "routed_gate_up")
    assert {"route_token", "stock_position", "gate_up_rows", "activate"} <= set(re.findall(r"\w+", routed))
    assert "mlx_logsumexp" not in routed and "down_rows" not in routed  # Inkling's routing, the down launch's
    for header in (down, routed):
        assert header.count("{") == header.count("}")
        # shorter than the whole header by at least the declarations named above as left out
        full = sections("cuda", "moe_routed_decode.cu" if header is routed else "moe_decode.cu")["header"]
        left_out = ("gate_up_rows", "activate") if header is down else ("down_rows", "mlx_logsumexp")
        assert all(name in full for name in left_out) and len(header) < len(full) - 500
    # a `using` alias is a declaration like any: kept with what it names where reached, else left out
    grouped, _ = cuda_kernel_source("moe_prefill.cu", "grouped")
    assert {"KeptScale", "DEQUANT_IN_PLACE", "GroupScale"} <= set(re.findall(r"\w+", grouped))
    route, _ = cuda_kernel_source("moe_prefill.cu", "route")
    assert "KeptScale" not in route and "DEQUANT_IN_PLACE" not in route


def test_declarations_keep_what_they_cannot_name_and_blanks_that_matter():
    from mlx_moe_fix.kernels.sources import _declarations, _tight

    source = ("namespace n {\n\ntemplate <int A,\n          int B>\n__device__ int f() { return A; }\n"
              "static_assert(sizeof(int) == 4);\n__device__ int operator+(X a, X b) {\n  return 0;\n}\n}  // namespace n\n")
    declarations = _declarations(source)
    # a line that starts no declaration stays with the one before; the operator's name is not
    # read, so it is kept, as the namespace's own lines are
    assert [name for name, _ in declarations] == [None, "f", None, None]
    assert declarations[1][1].startswith("template <int A,\nint B>\n__device__") and "static_assert" in declarations[1][1]
    assert declarations[2][1].startswith("__device__ int operator+") and declarations[3][1] == "}\n"
    # an aligned struct is named by its own name, not by its alignment's keyword
    aligned = _declarations("template <int B>\nstruct alignas(16) Split {\n  int f[B];\n};\nstruct __align__(8) Pair {};\n")
    assert [name for name, _ in aligned] == ["Split", "Pair"]
    aliases = _declarations("template <bool F>\nusing Kept = cuda::std::conditional_t<F, int, float>;\nusing namespace n;\n")
    assert [name for name, _ in aliases] == ["Kept", None]
    assert _tight("x = a - -b + f( c );\n") == "x=a- -b+f(c);\n"
    assert _tight("#pragma unroll\n") == "#pragma unroll\n"
    # inline PTX keeps its spacing: `wait_group %0` must not become `wait_group1`
    assert _tight('asm volatile("wgmma.wait_group.sync.aligned %0, \\"x\\";" :: "n"(N - 1));\n') == \
        'asm volatile("wgmma.wait_group.sync.aligned %0, \\"x\\";" :: "n"(N-1));\n'


def _directive(monkeypatch, cache_home, header):
    from mlx_moe_fix.kernels.sources import cuda_header_directive

    monkeypatch.setenv("XDG_CACHE_HOME", str(cache_home))
    cuda_header_directive.cache_clear()
    try:
        return cuda_header_directive(header)
    finally:
        cuda_header_directive.cache_clear()


def test_a_cuda_header_becomes_an_include_of_a_file_holding_exactly_it(tmp_path, monkeypatch):
    from mlx_moe_fix.kernels.sources import cuda_kernel_source, header_directory

    header, _ = cuda_kernel_source("moe_routed_decode.cu", "routed_gate_up")
    directive = _directive(monkeypatch, tmp_path, header)
    (path,) = re.fullmatch(r'#include "([^"]+)"\n', directive).groups()
    assert os.path.dirname(path) == str(header_directory()) and header_directory().is_relative_to(tmp_path)
    assert open(path).read() == header and len(directive) < 200 < len(header)
    # a file that differs (cut short, edited) is written again before it is used
    with open(path, "w") as f:
        f.write(header[:100])
    assert _directive(monkeypatch, tmp_path, header) == directive and open(path).read() == header
    assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]  # no partial file left behind


def test_a_cuda_header_stays_inline_where_no_file_can_hold_it(tmp_path, monkeypatch):
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    assert _directive(monkeypatch, not_a_directory, "namespace a {}\n") == "namespace a {}\n"
    quote = tmp_path / 'a"b'
    assert _directive(monkeypatch, quote, "namespace b {}\n") == "namespace b {}\n"

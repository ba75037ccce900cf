"""The one table of `cuda-w4a16` kernels, and the files generated from it.

    python csrc/gen_kernels.py          # rewrites the three files below
    python csrc/gen_kernels.py --check  # exit 1 if any checked-in copy differs from what the table gives

- csrc/w4a16.cu: the translation unit nvcc builds: the family headers and one `extern "C"` entry point per row
  and dtype (the driver API looks kernels up by these names);
- csrc/wgmma_rs.cuh: wgmma.mma_async wrappers with A from registers (an m64nNk16 instruction takes N/2 fp32
  accumulator operands per thread, which nobody should type by hand);
- qtool/kernels/cuda/built.py: the same rows as Python data, which launch.py plans against.

A row is a kernel shape; each is built for fp16 and bf16 activations. Rows marked sm_90a exist only in the
Hopper build (wgmma, thread-block clusters). tests/test_kernels_cuda.py checks the generated files are current.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
HEADERS = ("common.cuh", "epilogue.cuh", "mma.cuh", "xr.cuh", "sk.cuh", "wgmma.cuh")
DTYPES = (("f16", "false"), ("bf16", "true"))

# mma_small: (batch tiles of 8, 16-row tiles per warp, one group per 64-k block ("post"), ring depth)
MMA = [(nt, tn, post, 6 if post else 4) for nt in (1, 2, 4) for tn in (1, 2) for post in (True, False)
       if (nt, tn) != (4, 1)] + [(nt, tn, True, 12) for nt in (1, 2) for tn in (1, 2)]
# sk_small: (64-k blocks per work unit, ring depth, zero point subtracted per fragment)
SK = [(2, 4, False), (2, 6, False), (2, 4, True), (2, 6, True)]
# mma_xs: (batch tiles, tiles per warp, ring depth, 64-k blocks per x chunk); 4 chunk slots
XS = [(nt, tn, d, xc) for nt in (2,) for tn in (1, 2) for d, xc in ((6, 2), (12, 4))]
# xr_small: (batch tiles, blocks per warp, ring depth, tiles per unit, partial slots, lag, most threads, biased,
# cluster of 2 (sm_90a))
XR = [(2, 4, 3, 1, 4, 2, 512, False, False), (2, 4, 4, 1, 4, 2, 512, False, False),
      (2, 2, 4, 1, 4, 2, 512, False, False), (1, 4, 4, 1, 4, 2, 512, False, False),
      (2, 8, 3, 1, 4, 2, 256, False, False), (2, 8, 2, 2, 4, 2, 256, False, False),
      (2, 8, 3, 1, 4, 2, 256, True, False), (2, 8, 2, 2, 4, 2, 256, True, False),
      (2, 8, 2, 2, 4, 2, 256, True, True), (2, 8, 3, 1, 4, 2, 256, False, True),
      (2, 8, 2, 2, 4, 2, 256, False, True),
      # M <= 8 (one batch tile), M 17-32 (four) and M 33-64 (eight, 2 blocks a warp): 8 warps, 64, 128 and 128
      # registers of x a thread
      (1, 8, 3, 1, 4, 2, 256, False, False), (4, 4, 3, 1, 4, 2, 256, False, False),
      (8, 2, 3, 1, 4, 2, 256, False, False)]
# wg_large (sm_90a): (batch columns BN, consumer warpgroups, x-tile stages, x by the tensor memory accelerator);
# each with one group per block ("blk") and one per k16 step ("step")
WG = [(24, 2, 6, True), (24, 3, 6, True), (24, 4, 6, True), (32, 2, 6, True), (32, 3, 6, True), (32, 4, 6, True),
      (40, 2, 6, True), (40, 3, 6, True), (40, 4, 6, True), (48, 2, 6, True), (48, 3, 6, True), (48, 4, 6, True),
      (64, 2, 6, True), (64, 3, 6, True), (64, 4, 6, True), (96, 2, 6, True), (96, 3, 6, True), (96, 4, 6, True),
      (112, 2, 6, True), (112, 3, 6, True), (112, 4, 6, True), (128, 3, 6, True), (128, 2, 6, True),
      (128, 2, 4, True), (160, 2, 6, True), (192, 2, 6, True), (224, 2, 6, True), (256, 2, 4, True), (256, 2, 6, True),
      (128, 2, 4, False), (128, 4, 6, False)]

ARGS = ("const uint4 *qw, const uint32_t *msc, const uint4 *mzp, const int *gtab, const uint16_t *x, uint16_t *y, "
        "float *ws, int *cnt, int M, int N, int K, int KB, int kbps, int NG, int gshift, int flags, int bx0")
PACK = "{qw, msc, mzp, gtab, x, y, ws, cnt, M, N, K, KB, kbps, NG, gshift, flags, bx0}"


def mma_name(dt: str, nt: int, tn: int, post: bool, d: int) -> str:
    return f"qt_mma_{dt}_nt{nt}_tn{tn}_{'post' if post else 'step'}{f'_d{d}' if post and d != 6 else ''}"


def sk_name(dt: str, ub: int, d: int, zsub: bool) -> str:
    return f"qt_sk_{'z_' if zsub else ''}{dt}_u{ub}_d{d}"


def xs_name(dt: str, nt: int, tn: int, d: int, xc: int) -> str:
    return f"qt_xs_{dt}_nt{nt}_tn{tn}_d{d}_x{xc}"


def xr_name(dt: str, nt: int, r: int, d: int, t: int, slots: int, bias: bool, cluster: bool) -> str:
    tail = (f"_t{t}_s{slots}" if t > 1 else "") + ("_b" if bias else "") + ("_c" if cluster else "")
    return f"qt_xr_{dt}_nt{nt}_r{r}_d{d}{tail}"


def wg_name(dt: str, bn: int, wgs: int, stages: int, ns: int, tma: bool) -> str:
    return f"qt_wg_{dt}_bn{bn}_wg{wgs}_s{stages}_{'blk' if ns == 1 else 'step'}{'_tma' if tma else ''}"


def entry(name: str, attrs: str, call: str, extra: str = "") -> tuple[str, str]:
    return name, (f'extern "C" __global__ void {attrs} {name}(QT_ARGS{extra}) {{\n'
                  f"  const qt::Args a = QT_PACK; {call};\n}}\n")


def entries() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(name, source) of the entry points of every build, and of those of the sm_90a build only."""
    common, sm90 = [], []
    for dt, bf in DTYPES:
        for nt, tn, post, d in MMA:
            common.append(entry(mma_name(dt, nt, tn, post, d), "__launch_bounds__(256)",
                                f"qt::mma_small<{nt}, {bf}, {str(post).lower()}, {d}, {tn}>(a)"))
        for ub, d, z in SK:
            bounds = "__launch_bounds__(512, QT_SK_MINB4)" if d <= 4 else "__launch_bounds__(512, 1)"
            common.append(entry(sk_name(dt, ub, d, z), bounds, f"qt::sk_small<{bf}, {ub}, {d}, {str(z).lower()}>(a)"))
        for nt, tn, d, xc in XS:
            common.append(entry(xs_name(dt, nt, tn, d, xc), f"__maxnreg__({80 if tn == 1 else 128})",
                                f"qt::mma_xs<{nt}, {bf}, {d}, {tn}, {xc}, 4>(a)"))
        for nt, r, d, t, sl, lag, th, b, c in XR:
            (sm90 if c else common).append(
                entry(xr_name(dt, nt, r, d, t, sl, b, c), f"__launch_bounds__({th}, 1)",
                      f"qt::xr_small<{bf}, {nt}, {r}, {d}, {sl}, {lag}, {t}, {str(b).lower()}, {str(c).lower()}>(a)"))
        for bn, wgs, st, tma in WG:
            for ns in (1, 4):
                d = st if ns == 1 else st - 1
                name = wg_name(dt, bn, wgs, st, ns, tma)
                if tma:  # x's tensor map, and with one group a block those of the weights, scales and zeros
                    maps = "xwsz" if ns == 1 else "x"
                    sm90.append(entry(name, f"__launch_bounds__({128 * wgs + 128}, 1)",
                                      f"qt::wg_large<{bn}, {wgs}, {st}, {bf}, {ns}, {d}, true>"
                                      f"({', '.join(['a', *(f'&{m}map' for m in maps)])})",
                                      "".join(f", const __grid_constant__ qt::TMap {m}map" for m in maps)))
                else:
                    sm90.append(entry(name, f"__launch_bounds__({128 * wgs}, 1)",
                                      f"qt::wg_large<{bn}, {wgs}, {st}, {bf}, {ns}, {d}, false>(a)"))
    return common, sm90


def names() -> tuple[list[str], list[str]]:
    common, sm90 = entries()
    return [n for n, _ in common], [n for n, _ in sm90]


def render_cu() -> str:
    common, sm90 = entries()
    head = f"""\
// Generated by csrc/gen_kernels.py from its kernel table; do not edit.
// W4A16 GEMM kernels of qtool's `cuda-w4a16` (y[M, N] = x[M, K] @ W^T), one translation unit: the family headers
// and an `extern "C"` entry point per kernel shape and dtype, which the driver API looks up by name. Every entry
// takes the arguments of qt::Args in order; the TMA forms of the wgmma kernel take x's tensor map after them, and
// with one group a block (blk) those of the weights, scales and zeros after that.
// qtool/kernels/cuda/build.py compiles this file to a cubin for one architecture.

{chr(10).join(f'#include "{h}"' for h in HEADERS)}

#define QT_ARGS {ARGS}
#define QT_PACK {PACK}

// The stream-K kernel's 16-warp CTAs with 4-slot rings must fit two to an SM on Hopper (64 registers a
// thread): the next layer's CTA (programmatic dependent launch) is resident beside this one while it runs.
// 6-slot rings take too much shared memory for that anyway, and elsewhere there is no such launch.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
#define QT_SK_MINB4 2
#else
#define QT_SK_MINB4 1
#endif

"""
    return (head + "\n".join(t for _, t in common) + "\n// sm_90a only: wgmma, and the x-in-registers kernels whose two K groups meet "
            "in a\n// thread-block cluster (launched as clusters of 2).\n#ifdef QT_WGMMA\n\n" + "\n".join(t for _, t in sm90)
            + "\n#endif  // QT_WGMMA\n")


def wgmma_wrapper(n: int, ty: str) -> str:
    nacc = n // 2
    acc = ", ".join(f"%{i}" for i in range(nacc))
    a = ", ".join(f"%{nacc + i}" for i in range(4))
    desc = f"%{nacc + 4}"
    one = f"%{nacc + 5}"  # scale-d is a predicate: always accumulate
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(nacc))
    return f'''
// D[64 x {n}] (fp32, wgmma accumulator layout) += A[64 x 16] ({ty}, registers, mma A-fragment layout per warp)
//                                                * B[16 x {n}] ({ty}, shared memory, K-major, described by desc)
__device__ __forceinline__ void wgmma_rs_m64n{n}k16_{ty}(float (&d)[{nacc}], uint32_t a0, uint32_t a1, uint32_t a2,
                                                        uint32_t a3, uint64_t desc) {{
  asm volatile(
      "{{\\n"
      ".reg .pred p;\\n"
      "setp.ne.b32 p, {one}, 0;\\n"
      "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ty}.{ty} "
      "{{{acc}}}, {{{a}}}, {desc}, p, 1, 1, 0;\\n"
      "}}\\n"
      : {outs}
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(1));
}}
'''


def wgmma_dispatch(shapes: list[int]) -> str:
    """wgmma_rs<N, BF16>: the wrapper of width N and x's dtype; a width the table lacks does not compile."""
    def chain(ty: str) -> str:
        return "".join(f"    {'' if i == 0 else 'else '}if constexpr (N == {n}) wgmma_rs_m64n{n}k16_{ty}(d, a[0], a[1], "
                       f"a[2], a[3], desc);\n" for i, n in enumerate(shapes))
    widths = " || ".join(f"N == {n}" for n in shapes)
    return f"""
// The wrapper above of batch width N for x's dtype (the widths csrc/gen_kernels.py's WG table builds)
template <int N, bool BF16>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc) {{
  static_assert({widths},
                "no wgmma wrapper of this width: add it to WG in csrc/gen_kernels.py");
  if constexpr (BF16) {{
{chain("bf16")}  }} else {{
{chain("f16")}  }}
}}
"""


def render_wgmma() -> str:
    parts = ["// Generated by csrc/gen_kernels.py; do not edit.\n#pragma once\n#include <stdint.h>\n"]
    shapes = sorted({bn for bn, *_ in WG})
    for ty, _ in DTYPES:
        for n in shapes:
            parts.append(wgmma_wrapper(n, ty))
    parts.append(wgmma_dispatch(shapes))
    return "".join(parts)


def render_py() -> str:
    common, sm90 = names()
    xr = {(nt, r, d, t, b, c): sl for nt, r, d, t, sl, _, _, b, c in XR}

    def block(name: str, rows) -> list[str]:
        if isinstance(rows, dict):
            return [f"{name} = {{", *(f"    {k!r}: {v!r}," for k, v in sorted(rows.items())), "}"]
        return [f"{name} = frozenset({{", *(f"    {r!r}," for r in sorted(rows)), "})"]

    return "\n".join([
        '"""The kernels csrc/w4a16.cu instantiates, as data: generated by csrc/gen_kernels.py; do not edit."""',
        "",
        "# mma_small: (batch tiles of 8, 16-row tiles per warp, one group per 64-k block, ring depth)",
        *block("MMA", MMA),
        "# sk_small: (64-k blocks per unit, ring depth, zero point subtracted per fragment)",
        *block("SK", SK),
        "# mma_xs: (batch tiles, tiles per warp, ring depth, 64-k blocks per x chunk)",
        *block("XS", XS),
        "# xr_small: (batch tiles, blocks per warp, ring depth, tiles per unit, biased, cluster of 2) -> partial slots",
        *block("XR", xr),
        "# wg_large (sm_90a): (batch columns, consumer warpgroups, x-tile stages, x by the tensor memory accelerator)",
        *block("WG", WG),
        "# entry points of every build",
        *block("NAMES", common),
        "# entry points of the sm_90a build only",
        *block("NAMES_SM90A", sm90),
        "",
    ])


def outputs() -> dict[Path, str]:
    return {CSRC / "w4a16.cu": render_cu(), CSRC / "wgmma_rs.cuh": render_wgmma(),
            ROOT / "qtool" / "kernels" / "cuda" / "built.py": render_py()}


def main() -> int:
    stale = [p for p, text in outputs().items() if not p.is_file() or p.read_text() != text]
    if "--check" in sys.argv[1:]:
        for p in stale:
            print(f"{p.relative_to(ROOT)} is not what csrc/gen_kernels.py generates: run python csrc/gen_kernels.py")
        return 1 if stale else 0
    for p, text in outputs().items():
        p.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

// FP8 E4M3 weight-only GEMV for small batches (M <= 8): y[M, N] = x[M, K] @ (s * W[N, K])^T, with W the
// checkpoint's E4M3 codes exactly as stored (row-major, K contiguous), x fp16 or bf16 as given (no activation
// quantization), fp32 accumulation on the tensor core, one rounding to x's dtype. Launched by
// qtool/kernels/cuda_fp8.py (which plans the grid); compiled by qtool/kernels/cuda/build.py like csrc/w4a16.cu.
//
// Why a GEMV of its own: at M <= 8 an FP8 layer is a stream of weight bytes. The W8A8 path (x quantized to E4M3
// per call, then cuBLAS's FP8 GEMM) pays one more launch for the quantizer and a GEMM tiled for large M; this
// kernel reads each weight byte once, in 16-byte pieces, and spends a few integer instructions per code.
//
// Work: a warp owns a tile of 16 weight rows and walks K in steps of 128: lane l = 4 r + g loads 32 codes of row
// r and 32 of row r + 8 (k = 128 j + 32 g .. + 31; each row's step is one 128-byte line). The m16n8k16 mma sums
// over k in any order, as long as the A (weight) and B (x) fragments agree; every lane with the same g supplies
// the same k, so lane (r, g) feeds rows r and r + 8 from its own bytes, and column r of B (batch row r; zeros
// for r >= M) from x at the same k.
// Per 32-bit word of 4 codes c0..c3 one mma takes (c0, c2) and (c1, c3) as its two k pairs: that is the order
// the bit splice below produces, so x's pairs are permuted to (x0, x2), (x1, x3) to match.
//
// Decoding E4M3 into 16-bit floats (exact: E4M3 has 3 mantissa bits and exponents 2^-9 .. 2^8): the sign stays
// at bit 15 and the 7 exponent-and-mantissa bits move to the top of the 16-bit float's exponent-and-mantissa
// field (>> 1 for fp16, >> 4 for bf16), which reads the code's value times 2^(7 - 15) (fp16) or 2^(7 - 127)
// (bf16), subnormal codes included (they land on 16-bit subnormals). One multiply by 2^8 or 2^120 (exact: a
// power of two, result in range) gives the value itself.
//
// Scales: per tensor or per row (applied to the fp32 sum once), or per 128 x 128 block (applied to each
// 128-k step's sum: a step is one block column, and a 16-row tile lies in one block row).
// K splits: the grid is (tiles, splits); a CTA's warps share its K range, reduce through shared memory, and
// with splits > 1 the last CTA of a tile to finish (an atomic counter per tile, reset by that CTA) adds the
// others' partial sums from the fp32 workspace [splits][M][N].
#include "common.cuh"

namespace qt {

enum { FP8_SCALE_TENSOR = 0, FP8_SCALE_ROW = 1, FP8_SCALE_BLOCK = 2 };

struct Fp8Args {
  const uint8_t* w;   // [N][K] E4M3 codes
  const uint16_t* x;  // [M][K]
  uint16_t* y;        // [M][N]
  const float* s;     // [1] | [N] | [ceil(N / 128)][KS]
  float* ws;          // [splits][M][N] partial sums (splits > 1)
  int* cnt;           // [ceil(N / 16)] arrival counters, zero between calls
  int M, N, K, KS;    // KS: the block scales' row stride (ceil(K / 128))
  int steps;          // 128-k steps per split
  int flags;          // for pdl_wait (common.cuh); the launch passes 0: the next grid may start after the wait
};

// Two codes of each 16-bit half of q (bytes 1 and 3) -> their exact 16-bit floats (sign and magnitude spliced
// into place, then the exponent bias difference multiplied back)
template <bool BF16>
DEVI uint32_t e4m3_hi_pair(uint32_t q) {
  constexpr int SHIFT = BF16 ? 4 : 1;
  const uint32_t h = lop3_and_or(q, 0x80008000u, (q & 0x7F007F00u) >> SHIFT);
  // 2^8 in fp16 is 0x5C00; 2^120 in bf16 is 0x7B80
  return fma2<BF16>(h, BF16 ? 0x7B807B80u : 0x5C005C00u, 0x80008000u);
}

// A warp's place: its tile's rows r and r + 8 (clamped: rows past N read row N - 1, never stored), its 128-k
// steps j0 + warp, j0 + warp + WARPS, ... below j1, and its batch row of x (r < M).
struct Fp8Place {
  int lane, warp, r, g, tile, split, j0, j1;
  const uint8_t* w0;
  const uint8_t* w1;
  const uint16_t* xr;
  bool has_x;
  DEVI explicit Fp8Place(const Fp8Args& p)
      : lane(threadIdx.x & 31), warp(threadIdx.x >> 5), r(lane >> 2), g(lane & 3), tile(blockIdx.x),
        split(blockIdx.y), j0(blockIdx.y * p.steps), j1(min((p.K + 127) >> 7, j0 + p.steps)),
        w0(p.w + (size_t)min(tile * 16 + r, p.N - 1) * p.K + 32 * g),
        w1(p.w + (size_t)min(tile * 16 + r + 8, p.N - 1) * p.K + 32 * g),
        xr(p.x + (size_t)(r < p.M ? r : 0) * p.K + 32 * g), has_x(r < p.M) {}
  // whether piece h (16 codes at k = 128 j + 32 g + 16 h) of step j is inside K and this split
  DEVI bool in(int j, int h, int K) const { return j < j1 && 128 * j + 32 * g + 16 * h < K; }
};

// What step j reads besides the codes, loaded a step ahead with them: x at the step's k for this lane (4 x 8
// values, zeros outside K or past M) and, for block scales, the step's scale (0 past the split: adds nothing).
template <int MODE>
DEVI void load_x(uint4 (&b)[4], float& sc, const Fp8Place& pl, const float* sb, int j, int K) {
  const uint4* xp = reinterpret_cast<const uint4*>(pl.xr + 128 * (size_t)j);
#pragma unroll
  for (int q = 0; q < 4; ++q) b[q] = pl.has_x && pl.in(j, q >> 1, K) ? __ldg(xp + q) : make_uint4(0, 0, 0, 0);
  if constexpr (MODE == FP8_SCALE_BLOCK) sc = j < pl.j1 ? __ldg(sb + j) : 0.f;
}

// One 128-k step: w = {row r piece 0, row r piece 1, row r + 8 piece 0, row r + 8 piece 1}, eight mmas.
template <bool BF16, int MODE>
DEVI void step_mma(float (&acc)[4], const uint4 (&w)[4], const uint4 (&b)[4], float sc) {
  float d[4] = {0.f, 0.f, 0.f, 0.f};  // this step's sums (block scales: a 128-k step is one block column)
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const uint32_t q0 = word(w[h], s), q1 = word(w[2 + h], s);
      // x words (x0, x1), (x2, x3) of this piece of 4 codes
      const uint4& xv = b[2 * h + (s >> 1)];
      const uint32_t xa = (s & 1) ? xv.z : xv.x, xb = (s & 1) ? xv.w : xv.y;
      uint32_t fa[4];
      fa[0] = e4m3_hi_pair<BF16>(q0 << 8);  // row r: (c0, c2)
      fa[1] = e4m3_hi_pair<BF16>(q1 << 8);  // row r + 8: (c0, c2)
      fa[2] = e4m3_hi_pair<BF16>(q0);       // row r: (c1, c3)
      fa[3] = e4m3_hi_pair<BF16>(q1);       // row r + 8: (c1, c3)
      const uint32_t b0 = __byte_perm(xa, xb, 0x5410), b1 = __byte_perm(xa, xb, 0x7632);  // (x0, x2), (x1, x3)
      if constexpr (MODE == FP8_SCALE_BLOCK) {
        mma16816<BF16>(d, fa, b0, b1);
      } else {
        mma16816<BF16>(acc, fa, b0, b1);
      }
    }
  }
  if constexpr (MODE == FP8_SCALE_BLOCK) {
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[i] = fmaf(d[i], sc, acc[i]);
  }
}

// The CTA's sums: warps reduced through shared memory; with K splits, the partials go to the workspace and the
// tile's last CTA adds them; then the scale and one rounding to x's dtype.
template <bool BF16, int MODE, int WARPS>
DEVI void finish(const Fp8Args& p, const Fp8Place& pl, const float (&acc)[4]) {
  __shared__ float red[WARPS][16][8];
  __shared__ int last;
  // acc: rows r (0, 1) and r + 8 (2, 3), batch columns 2 g and 2 g + 1
#pragma unroll
  for (int i = 0; i < 4; ++i) red[pl.warp][pl.r + 8 * (i >> 1)][2 * pl.g + (i & 1)] = acc[i];
  __syncthreads();
  const int t = threadIdx.x;
  const int orow = t >> 3, ocol = t & 7, n = pl.tile * 16 + orow;
  const bool mine = t < 128 && ocol < p.M && n < p.N;
  float v = 0.f;
  if (t < 128) {
#pragma unroll
    for (int w = 0; w < WARPS; ++w) v += red[w][orow][ocol];
  }
  if (gridDim.y > 1) {
    if (mine) p.ws[((size_t)pl.split * p.M + ocol) * p.N + n] = v;
    __threadfence();
    __syncthreads();
    if (t == 0) {
      const int prev = atomicAdd(p.cnt + pl.tile, 1);
      last = prev == (int)gridDim.y - 1;
      if (last) p.cnt[pl.tile] = 0;  // ready for the next call (stream order keeps calls apart)
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    if (mine) {
      v = 0.f;
      for (int sp = 0; sp < (int)gridDim.y; ++sp) v += __ldcg(p.ws + ((size_t)sp * p.M + ocol) * p.N + n);
    }
  }
  if (!mine) return;
  if constexpr (MODE == FP8_SCALE_TENSOR) v *= __ldg(p.s);
  if constexpr (MODE == FP8_SCALE_ROW) v *= __ldg(p.s + n);
  p.y[(size_t)ocol * p.N + n] = from_f32<BF16>(v);
}

// The weight loads are allocated in L1, unlike the other kernels' streamed loads: lane g's pieces h = 0 and 1 of a
// row step are the two halves of the same 32-byte sector, so without L1 the sector crosses from L2 twice; with it
// the second load is served by L1 and the weight bytes leave L2 once (4 % on the Llama-3-70B layer at M = 1:
// benchmarks/results/fp.md).
// The step loop: each lane's four 16-byte weight loads, x and the block scale for the warp's next step are in
// flight while it computes this one.
template <bool BF16, int MODE, int WARPS>
DEVI void fp8_gemv(const Fp8Args& p) {
  const Fp8Place pl(p);
  const float* sb = p.s + (size_t)(pl.tile * 16 / 128) * p.KS;
  uint4 a[4], b[4];
  float sc = 0.f;
  auto load = [&](int j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const bool v = pl.in(j, h, p.K);
      const uint4 z = make_uint4(0, 0, 0, 0);
      a[h] = v ? __ldg(reinterpret_cast<const uint4*>(pl.w0 + 128 * (size_t)j + 16 * h)) : z;
      a[2 + h] = v ? __ldg(reinterpret_cast<const uint4*>(pl.w1 + 128 * (size_t)j + 16 * h)) : z;
    }
  };
  int j = pl.j0 + pl.warp;
  load(j);  // the weights are never written by an earlier kernel: the first ones stream before the dependency wait
  pdl_wait(p.flags);
  load_x<MODE>(b, sc, pl, sb, j, p.K);
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (; j < pl.j1; j += WARPS) {
    uint4 cw[4], cx[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      cw[q] = a[q];
      cx[q] = b[q];
    }
    const float cs = sc;
    load(j + WARPS);
    load_x<MODE>(b, sc, pl, sb, j + WARPS, p.K);
    step_mma<BF16, MODE>(acc, cw, cx, cs);
  }
  finish<BF16, MODE, WARPS>(p, pl, acc);
}

}  // namespace qt

// W: warps per CTA (they share the tile's K range); the launch (qtool/kernels/cuda_fp8.py) picks it per layer.
// On sm_90 both keep to 64 registers a thread, so an SM holds 32 warps of either: the plan counts on that.
// Elsewhere nvcc would spill at 64, and the kernels take what they need (fewer warps an SM, no spills).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define QT_FP8_MIN_CTAS(W) (32 / (W))
#else
#define QT_FP8_MIN_CTAS(W) 1
#endif
#define QT_FP8_ENTRY(DT, BF16, MODE, MODEC, W)                                     \
  extern "C" __global__ void __launch_bounds__(32 * W, QT_FP8_MIN_CTAS(W))        \
      qt_fp8_gemv_##DT##_##MODE##_w##W(qt::Fp8Args p) {                          \
    qt::fp8_gemv<BF16, qt::MODEC, W>(p);                                          \
  }
#define QT_FP8_SHAPES(DT, BF16, MODE, MODEC) \
  QT_FP8_ENTRY(DT, BF16, MODE, MODEC, 4)     \
  QT_FP8_ENTRY(DT, BF16, MODE, MODEC, 8)
#define QT_FP8_ENTRIES(DT, BF16)                    \
  QT_FP8_SHAPES(DT, BF16, tensor, FP8_SCALE_TENSOR) \
  QT_FP8_SHAPES(DT, BF16, row, FP8_SCALE_ROW)       \
  QT_FP8_SHAPES(DT, BF16, block, FP8_SCALE_BLOCK)

QT_FP8_ENTRIES(f16, false)
QT_FP8_ENTRIES(bf16, true)

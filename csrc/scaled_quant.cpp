// Dense weights -> E4M3 or INT8 codes under given per-block scales, on the CPU, one pass per step.
//
// Plain C ABI (no torch headers), loaded through ctypes by qtool.packing.scaled_quant, like e4m3_dequant.cpp.
// The torch path of qtool.quant.scaled.quantize_scaled makes the same codes in about nine passes over memory
// (a float32 copy, |w|, the block max, the multiply, the clamp, the cast, and three for the error sums) and
// torch's scalar float8 conversion; on two cores that packed FP8 at a tenth of the goal. Here each weight is
// read twice (block max, then codes), as bf16 or fp32, and its code and its error are made in registers.
//
// The scales are not made here: the caller turns the block maxima into stored scales with the torch code
// (rounding to the scale type, zero and underflow rules), so both paths share one definition of a scale, and
// passes each block's scale and its fp32 reciprocal. Codes are then
//   e4m3: x = w * recip, clamped to +-448, rounded to nearest-even E4M3 (subnormals included)
//   int8: x = w * recip, clamped to +-127, rounded to nearest-even integer
// which is what torch computes (the cast rounds to nearest-even; a value within 464 of zero never reaches NaN
// once clamped), so the bytes are the torch path's: tests compare them over every rounding case.
//
// w:      fp32 (dtype 0) or bf16 (dtype 1) [rows, cols], row-major
// amax:   fp32 [rows, groups]: max |w| over each row's group of `group` columns (groups = ceil(cols / group))
// scales, recips: fp32 [ceil(rows / bo), groups]
// codes:  uint8 [rows, cols]; sums[0] += sum ((code - x) * scale)^2, sums[1] += sum w^2 (doubles)

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

// Compiled for x86-64-v4 (AVX-512 with its byte and word instructions: the bf16 loads and byte stores need
// them; plain avx512f measured no faster than AVX2), x86-64-v3 (AVX2) and the baseline, chosen at load time.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define QTOOL_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define QTOOL_CLONES
#endif

template <int kDtype>
inline float load(const void* w, int64_t i) {
  if (kDtype == 1) {
    const uint32_t u = static_cast<uint32_t>(static_cast<const uint16_t*>(w)[i]) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  return static_cast<const float*>(w)[i];
}

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// |x| <= 448 -> E4M3 code and the bits of its value; round to nearest even. Normal range (|x| >= 2^-6): the
// fp32 mantissa rounded to 3 bits in place (a carry moves into the exponent, as it should); below: a multiple
// of 2^-9, rounded by the 2^23 trick (exact for the 0..8 here). Masks instead of branches, so the loops
// vectorize.
struct Coded {
  uint32_t code;
  float value;
};

inline Coded e4m3(float x) {
  const uint32_t u = float_to_bits(x);
  const uint32_t sign = u & 0x80000000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  const uint32_t r = (a + 0x7FFFFu + ((a >> 20) & 1u)) & 0xFFF00000u;
  const float sub = (bits_to_float(a) * 512.0f + 8388608.0f) - 8388608.0f;  // 0..8 (8: the least normal, 0x08)
  const uint32_t normal = 0u - static_cast<uint32_t>(static_cast<int32_t>(a) >= 0x3C800000);  // >= 2^-6
  const uint32_t code = (((r >> 20) - 960u) & normal) |
                        (static_cast<uint32_t>(static_cast<int32_t>(sub)) & ~normal);
  const uint32_t vbits = (r & normal) | (float_to_bits(sub * (1.0f / 512.0f)) & ~normal);
  return Coded{code | (sign >> 24), bits_to_float(vbits | sign)};
}

inline Coded int8(float x) {
  const float v = (x + 12582912.0f) - 12582912.0f;  // the nearest even integer (|x| < 2^22)
  return Coded{static_cast<uint32_t>(static_cast<int32_t>(v)), v};
}

template <int kDtype>
QTOOL_CLONES int row_amax(const void* w, int64_t base, int64_t cols, int64_t group, float* out) {
  int bad = 0;
  for (int64_t c0 = 0, g = 0; c0 < cols; c0 += group, ++g) {
    const int64_t c1 = (c0 + group < cols) ? c0 + group : cols;
    float m = 0.0f;
#pragma omp simd reduction(max : m) reduction(| : bad)
    for (int64_t c = c0; c < c1; ++c) {
      const float a = std::fabs(load<kDtype>(w, base + c));
      bad |= !(a <= 3.4028234663852886e38f);  // NaN or inf
      m = a > m ? a : m;
    }
    out[g] = m;
  }
  return bad;
}

// One row's codes (kElement 0: e4m3, 1: int8) and its error sums.
template <int kDtype, int kElement>
QTOOL_CLONES void row_codes(const void* w, int64_t base, int64_t cols, int64_t group, const float* s,
                            const float* rs, uint8_t* q, double* err2, double* ref2) {
  const float top = kElement == 0 ? 448.0f : 127.0f;
  double e2 = 0.0, r2 = 0.0;
  for (int64_t c0 = 0, g = 0; c0 < cols; c0 += group, ++g) {
    const int64_t c1 = (c0 + group < cols) ? c0 + group : cols;
    const float sc = s[g], rc = rs[g];
    float fe = 0.0f, fr = 0.0f;
    // the error sums in SIMD lanes (OpenMP's reduction licenses the reordering); the codes do not depend on it
#pragma omp simd reduction(+ : fe, fr)
    for (int64_t c = c0; c < c1; ++c) {
      const float wv = load<kDtype>(w, base + c);
      const float x = wv * rc;
      const float xc = x > top ? top : (x < -top ? -top : x);
      const Coded k = kElement == 0 ? e4m3(xc) : int8(xc);
      q[c] = static_cast<uint8_t>(k.code);
      const float d = k.value - x;
      fe += d * d;
      fr += wv * wv;
    }
    e2 += static_cast<double>(fe) * sc * sc;
    r2 += fr;
  }
  *err2 = e2;
  *ref2 = r2;
}

template <int kDtype>
int64_t amax_rows(const void* w, int64_t rows, int64_t cols, int64_t group, float* amax, int threads) {
  const int64_t groups = (cols + group - 1) / group;
  int64_t bad = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : bad)
  for (int64_t r = 0; r < rows; ++r) bad += row_amax<kDtype>(w, r * cols, cols, group, amax + r * groups);
  return bad;
}

template <int kDtype, int kElement>
void code_rows(const void* w, int64_t rows, int64_t cols, int64_t bo, int64_t group, const float* scales,
               const float* recips, uint8_t* codes, double* sums, int threads) {
  const int64_t groups = (cols + group - 1) / group;
  double err2 = 0.0, ref2 = 0.0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : err2, ref2)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t b = (r / bo) * groups;
    double e = 0.0, f = 0.0;
    row_codes<kDtype, kElement>(w, r * cols, cols, group, scales + b, recips + b, codes + r * cols, &e, &f);
    err2 += e;
    ref2 += f;
  }
  sums[0] += err2;
  sums[1] += ref2;
}

}  // namespace

extern "C" {

int qtool_scaled_quant_abi() { return 1; }

// Row-group maxima of |w| (dtype 0: fp32, 1: bf16); returns the number of rows holding a NaN or inf weight.
int64_t qtool_row_amax(const void* w, int dtype, int64_t rows, int64_t cols, int64_t group, float* amax,
                       int threads) {
  return dtype == 1 ? amax_rows<1>(w, rows, cols, group, amax, threads)
                    : amax_rows<0>(w, rows, cols, group, amax, threads);
}

// element 0: e4m3, 1: int8. bo: rows per scale row.
void qtool_scaled_quant(const void* w, int dtype, int64_t rows, int64_t cols, int64_t bo, int64_t group,
                        const float* scales, const float* recips, int element, uint8_t* codes, double* sums,
                        int threads) {
  if (dtype == 1 && element == 0) code_rows<1, 0>(w, rows, cols, bo, group, scales, recips, codes, sums, threads);
  if (dtype == 1 && element == 1) code_rows<1, 1>(w, rows, cols, bo, group, scales, recips, codes, sums, threads);
  if (dtype == 0 && element == 0) code_rows<0, 0>(w, rows, cols, bo, group, scales, recips, codes, sums, threads);
  if (dtype == 0 && element == 1) code_rows<0, 1>(w, rows, cols, bo, group, scales, recips, codes, sums, threads);
}

}  // extern "C"

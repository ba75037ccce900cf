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
// amax:   fp32 [ceil(rows / bo), groups]: max |w| over each block of bo rows and `group` columns
//         (groups = ceil(cols / group))
// scales, recips: fp32 [ceil(rows / bo), groups]
// codes:  uint8 [rows, cols]; sums[0] += sum ((code - x) * scale)^2, sums[1] += sum w^2 (doubles)
//
// Three builds of each loop: AVX-512 (F, BW, VL), AVX2 with FMA, and portable C++; the best the CPU runs is
// chosen once, at load. The vector loops are written with intrinsics: GCC's own vectorization of the portable
// loop used 128-bit registers and spilled (2.3 ns a weight); these take 16 weights a step. Their error sums
// keep 16 fp32 lanes per row in the same order in both vector builds, so AVX2 and AVX-512 machines report the
// same sums.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#define QTOOL_X86 1
#include <immintrin.h>
#define QTOOL_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define QTOOL_AVX2 __attribute__((target("avx2,fma")))
#endif

namespace {

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
// of 2^-9, rounded by the 2^23 trick (exact for the 0..8 here). The vector builds below do the same steps.
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

// --- portable loops ------------------------------------------------------------------------------------------
template <int kDtype>
int row_amax_ref(const void* w, int64_t base, int64_t cols, int64_t group, float* out) {
  int bad = 0;
  for (int64_t c0 = 0, g = 0; c0 < cols; c0 += group, ++g) {
    const int64_t c1 = (c0 + group < cols) ? c0 + group : cols;
    float m = 0.0f;
    for (int64_t c = c0; c < c1; ++c) {
      const float a = std::fabs(load<kDtype>(w, base + c));
      bad |= !(a <= 3.4028234663852886e38f);  // NaN or inf
      m = a > m ? a : m;
    }
    out[g] = m;
  }
  return bad;
}

template <int kDtype, int kElement>
void row_codes_ref(const void* w, int64_t base, int64_t cols, int64_t group, const float* s, const float* rs,
                   uint8_t* q, double* err2, double* ref2) {
  const float top = kElement == 0 ? 448.0f : 127.0f;
  double e2 = 0.0, r2 = 0.0;
  for (int64_t c0 = 0, g = 0; c0 < cols; c0 += group, ++g) {
    const int64_t c1 = (c0 + group < cols) ? c0 + group : cols;
    const float sc = s[g], rc = rs[g];
    float fe = 0.0f, fr = 0.0f;
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

#ifdef QTOOL_X86
// --- AVX-512 -------------------------------------------------------------------------------------------------
// |w| as integers: for floats of one sign the bit patterns order as the values do, so the group maximum is an
// unsigned integer maximum of the bits without the sign (32 bf16 or 16 fp32 lanes a step), and NaN or inf is a
// maximum at or past the exponent's all-ones pattern.
template <int kDtype>
QTOOL_AVX512 int row_amax_512(const void* w, int64_t base, int64_t cols, int64_t group, float* out) {
  int bad = 0;
  for (int64_t c0 = 0, g = 0; c0 < cols; c0 += group, ++g) {
    const int64_t c1 = (c0 + group < cols) ? c0 + group : cols;
    uint32_t m;
    if (kDtype == 1) {
      const uint16_t* p = static_cast<const uint16_t*>(w) + base;
      const __m512i keep = _mm512_set1_epi16(0x7FFF);
      __m512i acc = _mm512_setzero_si512();
      for (int64_t c = c0; c < c1; c += 32) {
        const int64_t n = c1 - c < 32 ? c1 - c : 32;
        const __mmask32 k = n == 32 ? ~__mmask32(0) : static_cast<__mmask32>((1ull << n) - 1);
        acc = _mm512_max_epu16(acc, _mm512_and_si512(_mm512_maskz_loadu_epi16(k, p + c), keep));
      }
      // the 32 words widened to two halves of 16 dwords, then the dword maximum
      const __m512i lo = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(acc));
      const __m512i hi = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(acc, 1));
      m = _mm512_reduce_max_epu32(_mm512_max_epu32(lo, hi)) << 16;
    } else {
      const uint32_t* p = static_cast<const uint32_t*>(w) + base;
      const __m512i keep = _mm512_set1_epi32(0x7FFFFFFF);
      __m512i acc = _mm512_setzero_si512();
      for (int64_t c = c0; c < c1; c += 16) {
        const int64_t n = c1 - c < 16 ? c1 - c : 16;
        const __mmask16 k = static_cast<__mmask16>((1u << n) - 1);
        acc = _mm512_max_epu32(acc, _mm512_and_si512(_mm512_maskz_loadu_epi32(k, p + c), keep));
      }
      m = _mm512_reduce_max_epu32(acc);
    }
    bad |= m >= 0x7F800000u;
    out[g] = bits_to_float(m);
  }
  return bad;
}

// E4M3 by one rounding add: |x| + C - C with C = 2^(e + 20), e the exponent of |x| (at least -6, the least
// normal's), rounds |x| to nearest-even at 2^(e - 3), E4M3's step in that binade (subnormals included, and a
// carry into the next binade lands on its first value); the code is then the value's exponent and top three
// mantissa bits, or below 2^-6 its count of 2^-9 steps. The same codes as e4m3() above, in fewer steps.
template <int kElement>
QTOOL_AVX512 inline __m512i code_512(__m512 xc, __m512* value) {
  if (kElement == 1) {
    const __m512 big = _mm512_set1_ps(12582912.0f);
    const __m512 v = _mm512_sub_ps(_mm512_add_ps(xc, big), big);
    *value = v;
    return _mm512_cvttps_epi32(v);
  }
  const __m512i u = _mm512_castps_si512(xc);
  const __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF));
  const __m512i sign = _mm512_xor_si512(u, a);
  const __m512i e = _mm512_max_epi32(_mm512_and_si512(a, _mm512_set1_epi32(0x7F800000)),
                                     _mm512_set1_epi32(0x3C800000));
  const __m512 c = _mm512_castsi512_ps(_mm512_add_epi32(e, _mm512_set1_epi32(20 << 23)));
  const __m512 v = _mm512_sub_ps(_mm512_add_ps(_mm512_castsi512_ps(a), c), c);
  const __m512i vb = _mm512_castps_si512(v);
  const __mmask16 sub = _mm512_cmplt_epi32_mask(vb, _mm512_set1_epi32(0x3C800000));
  const __m512i code = _mm512_mask_mov_epi32(_mm512_sub_epi32(_mm512_srli_epi32(vb, 20), _mm512_set1_epi32(960)),
                                             sub, _mm512_cvttps_epi32(_mm512_mul_ps(v, _mm512_set1_ps(512.0f))));
  *value = _mm512_castsi512_ps(_mm512_or_si512(vb, sign));
  return _mm512_or_si512(code, _mm512_srli_epi32(sign, 24));
}

// 16 weights from p (kFull: all 16, else the lanes of k; lanes past them read 0: no code, no error).
template <int kDtype, int kElement, bool kFull>
QTOOL_AVX512 inline void step_512(const void* p, uint8_t* q, __mmask16 k, __m512 rc, __m512 sc, __m512* fe,
                                  __m512* fr) {
  const __m512 top = _mm512_set1_ps(kElement == 0 ? 448.0f : 127.0f);
  const __m512 ntop = _mm512_set1_ps(kElement == 0 ? -448.0f : -127.0f);
  __m512 wv;
  if (kDtype == 1) {
    const __m256i h = kFull ? _mm256_loadu_si256(static_cast<const __m256i*>(p))
                            : _mm256_maskz_loadu_epi16(k, p);
    wv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    wv = kFull ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(k, p);
  }
  const __m512 x = _mm512_mul_ps(wv, rc);
  const __m512 xc = _mm512_min_ps(_mm512_max_ps(x, ntop), top);  // x is finite: the maxima were checked
  __m512 value;
  const __m512i code = code_512<kElement>(xc, &value);
  if (kFull) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(code));
  } else {
    _mm512_mask_cvtepi32_storeu_epi8(q, k, code);
  }
  const __m512 d = _mm512_mul_ps(_mm512_sub_ps(value, x), sc);
  *fe = _mm512_fmadd_ps(d, d, *fe);
  *fr = _mm512_fmadd_ps(wv, wv, *fr);
}

template <int kDtype, int kElement>
QTOOL_AVX512 void row_codes_512(const void* w, int64_t base, int64_t cols, int64_t group, const float* s,
                                const float* rs, uint8_t* q, double* err2, double* ref2) {
  const int64_t esz = kDtype == 1 ? 2 : 4;
  const char* row = static_cast<const char*>(w) + base * esz;
  __m512 fe = _mm512_setzero_ps(), fr = _mm512_setzero_ps();
  for (int64_t c0 = 0, g = 0; c0 < cols; c0 += group, ++g) {
    const int64_t c1 = (c0 + group < cols) ? c0 + group : cols;
    const __m512 sc = _mm512_set1_ps(s[g]), rc = _mm512_set1_ps(rs[g]);
    int64_t c = c0;
    for (; c + 16 <= c1; c += 16) step_512<kDtype, kElement, true>(row + c * esz, q + c, 0, rc, sc, &fe, &fr);
    if (c < c1) {
      const __mmask16 k = static_cast<__mmask16>((1u << (c1 - c)) - 1);
      step_512<kDtype, kElement, false>(row + c * esz, q + c, k, rc, sc, &fe, &fr);
    }
  }
  alignas(64) float le[16], lr[16];
  _mm512_store_ps(le, fe);
  _mm512_store_ps(lr, fr);
  double e2 = 0.0, r2 = 0.0;
  for (int j = 0; j < 16; ++j) {
    e2 += le[j];
    r2 += lr[j];
  }
  *err2 = e2;
  *ref2 = r2;
}

// --- AVX2 ----------------------------------------------------------------------------------------------------
// 16 weights a step as two halves of 8, so that its 16 error lanes are the AVX-512 loop's.
template <int kDtype>
QTOOL_AVX2 inline __m256 load8_256(const void* w, int64_t at, int64_t n) {
  if (n == 8) {
    if (kDtype == 1) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(w) + at));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps(static_cast<const float*>(w) + at);
  }
  alignas(32) float t[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // a ragged tail: the lanes past it read 0
  for (int64_t j = 0; j < n; ++j) t[j] = load<kDtype>(w, at + j);
  return _mm256_load_ps(t);
}

template <int kDtype>
QTOOL_AVX2 int row_amax_256(const void* w, int64_t base, int64_t cols, int64_t group, float* out) {
  int bad = 0;
  for (int64_t c0 = 0, g = 0; c0 < cols; c0 += group, ++g) {
    const int64_t c1 = (c0 + group < cols) ? c0 + group : cols;
    const __m256i keep = _mm256_set1_epi32(0x7FFFFFFF);
    __m256i acc = _mm256_setzero_si256();
    for (int64_t c = c0; c < c1; c += 8) {
      const int64_t n = c1 - c < 8 ? c1 - c : 8;
      acc = _mm256_max_epu32(acc, _mm256_and_si256(_mm256_castps_si256(load8_256<kDtype>(w, base + c, n)), keep));
    }
    alignas(32) uint32_t l[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(l), acc);
    uint32_t m = 0;
    for (int j = 0; j < 8; ++j) m = l[j] > m ? l[j] : m;
    bad |= m >= 0x7F800000u;
    out[g] = bits_to_float(m);
  }
  return bad;
}

template <int kElement>
QTOOL_AVX2 inline __m256i code_256(__m256 xc, __m256* value) {  // code_512's steps
  if (kElement == 1) {
    const __m256 big = _mm256_set1_ps(12582912.0f);
    const __m256 v = _mm256_sub_ps(_mm256_add_ps(xc, big), big);
    *value = v;
    return _mm256_cvttps_epi32(v);
  }
  const __m256i u = _mm256_castps_si256(xc);
  const __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF));
  const __m256i sign = _mm256_xor_si256(u, a);
  const __m256i e = _mm256_max_epi32(_mm256_and_si256(a, _mm256_set1_epi32(0x7F800000)),
                                     _mm256_set1_epi32(0x3C800000));
  const __m256 c = _mm256_castsi256_ps(_mm256_add_epi32(e, _mm256_set1_epi32(20 << 23)));
  const __m256 v = _mm256_sub_ps(_mm256_add_ps(_mm256_castsi256_ps(a), c), c);
  const __m256i vb = _mm256_castps_si256(v);
  const __m256i sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x3C800000), vb);
  const __m256i code = _mm256_blendv_epi8(_mm256_sub_epi32(_mm256_srli_epi32(vb, 20), _mm256_set1_epi32(960)),
                                          _mm256_cvttps_epi32(_mm256_mul_ps(v, _mm256_set1_ps(512.0f))), sub);
  *value = _mm256_castsi256_ps(_mm256_or_si256(vb, sign));
  return _mm256_or_si256(code, _mm256_srli_epi32(sign, 24));
}

template <int kDtype, int kElement>
QTOOL_AVX2 inline void step8_256(const void* w, int64_t at, int64_t n, __m256 rc, __m256 sc, __m256 top,
                                 __m256 ntop, uint8_t* q, __m256* fe, __m256* fr) {
  const __m256 wv = load8_256<kDtype>(w, at, n);
  const __m256 x = _mm256_mul_ps(wv, rc);
  const __m256 xc = _mm256_min_ps(_mm256_max_ps(x, ntop), top);
  __m256 value;
  const __m256i code = code_256<kElement>(xc, &value);
  // the low byte of each dword: gathered within each 128-bit half, then the two halves' dwords side by side
  const __m256i bytes = _mm256_shuffle_epi8(code, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                                   -1, -1, -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1,
                                                                   -1, -1, -1, -1, -1, -1));
  const __m128i packed = _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 2, 3,
                                                                                                     5, 6, 7)));
  if (n == 8) {
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q), packed);
  } else {
    alignas(16) uint8_t t[16];
    _mm_store_si128(reinterpret_cast<__m128i*>(t), packed);
    for (int64_t j = 0; j < n; ++j) q[j] = t[j];
  }
  const __m256 d = _mm256_mul_ps(_mm256_sub_ps(value, x), sc);
  *fe = _mm256_fmadd_ps(d, d, *fe);
  *fr = _mm256_fmadd_ps(wv, wv, *fr);
}

template <int kDtype, int kElement>
QTOOL_AVX2 void row_codes_256(const void* w, int64_t base, int64_t cols, int64_t group, const float* s,
                              const float* rs, uint8_t* q, double* err2, double* ref2) {
  const __m256 top = _mm256_set1_ps(kElement == 0 ? 448.0f : 127.0f);
  const __m256 ntop = _mm256_set1_ps(kElement == 0 ? -448.0f : -127.0f);
  __m256 fe0 = _mm256_setzero_ps(), fr0 = _mm256_setzero_ps(), fe1 = _mm256_setzero_ps(),
         fr1 = _mm256_setzero_ps();
  for (int64_t c0 = 0, g = 0; c0 < cols; c0 += group, ++g) {
    const int64_t c1 = (c0 + group < cols) ? c0 + group : cols;
    const __m256 sc = _mm256_set1_ps(s[g]), rc = _mm256_set1_ps(rs[g]);
    for (int64_t c = c0; c < c1; c += 16) {
      const int64_t n = c1 - c < 16 ? c1 - c : 16;
      step8_256<kDtype, kElement>(w, base + c, n < 8 ? n : 8, rc, sc, top, ntop, q + c, &fe0, &fr0);
      if (n > 8) step8_256<kDtype, kElement>(w, base + c + 8, n - 8, rc, sc, top, ntop, q + c + 8, &fe1, &fr1);
    }
  }
  alignas(32) float le[16], lr[16];
  _mm256_store_ps(le, fe0);
  _mm256_store_ps(le + 8, fe1);
  _mm256_store_ps(lr, fr0);
  _mm256_store_ps(lr + 8, fr1);
  double e2 = 0.0, r2 = 0.0;
  for (int j = 0; j < 16; ++j) {
    e2 += le[j];
    r2 += lr[j];
  }
  *err2 = e2;
  *ref2 = r2;
}
#endif  // QTOOL_X86

// --- dispatch --------------------------------------------------------------------------------------------------
int isa() {  // 2: AVX-512 (F, BW, VL, DQ), 1: AVX2 + FMA, 0: neither
#ifdef QTOOL_X86
  static const int level = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
      return 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
    return 0;
  }();
  return level;
#else
  return 0;
#endif
}

template <int kDtype>
int row_amax(const void* w, int64_t base, int64_t cols, int64_t group, float* out, int level) {
#ifdef QTOOL_X86
  if (level == 2) return row_amax_512<kDtype>(w, base, cols, group, out);
  if (level == 1) return row_amax_256<kDtype>(w, base, cols, group, out);
#endif
  return row_amax_ref<kDtype>(w, base, cols, group, out);
}

template <int kDtype, int kElement>
void row_codes(const void* w, int64_t base, int64_t cols, int64_t group, const float* s, const float* rs,
               uint8_t* q, double* err2, double* ref2, int level) {
#ifdef QTOOL_X86
  if (level == 2) return row_codes_512<kDtype, kElement>(w, base, cols, group, s, rs, q, err2, ref2);
  if (level == 1) return row_codes_256<kDtype, kElement>(w, base, cols, group, s, rs, q, err2, ref2);
#endif
  row_codes_ref<kDtype, kElement>(w, base, cols, group, s, rs, q, err2, ref2);
}

// The maxima of each block of bo rows and `group` columns: row by row into a scratch row, then into the block's.
template <int kDtype>
int64_t amax_rows(const void* w, int64_t rows, int64_t cols, int64_t bo, int64_t group, float* amax, int threads,
                  int level) {
  const int64_t groups = (cols + group - 1) / group;
  const int64_t blocks = (rows + bo - 1) / bo;
  int64_t bad = 0;
#pragma omp parallel num_threads(threads) reduction(+ : bad) if (threads > 1)
  {
    std::vector<float> row(bo == 1 ? 0 : groups);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
      float* out = amax + b * groups;
      if (bo == 1) {
        bad += row_amax<kDtype>(w, b * cols, cols, group, out, level);
        continue;
      }
      const int64_t r1 = (b + 1) * bo < rows ? (b + 1) * bo : rows;
      for (int64_t g = 0; g < groups; ++g) out[g] = 0.0f;
      for (int64_t r = b * bo; r < r1; ++r) {
        bad += row_amax<kDtype>(w, r * cols, cols, group, row.data(), level);
        for (int64_t g = 0; g < groups; ++g) out[g] = row[g] > out[g] ? row[g] : out[g];
      }
    }
  }
  return bad;
}

template <int kDtype, int kElement>
void code_rows(const void* w, int64_t rows, int64_t cols, int64_t bo, int64_t group, const float* scales,
               const float* recips, uint8_t* codes, double* sums, int threads, int level) {
  const int64_t groups = (cols + group - 1) / group;
  double err2 = 0.0, ref2 = 0.0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : err2, ref2) if (threads > 1)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t b = (r / bo) * groups;
    double e = 0.0, f = 0.0;
    row_codes<kDtype, kElement>(w, r * cols, cols, group, scales + b, recips + b, codes + r * cols, &e, &f, level);
    err2 += e;
    ref2 += f;
  }
  sums[0] += err2;
  sums[1] += ref2;
}

}  // namespace

extern "C" {

int qtool_scaled_quant_abi() { return 2; }

// Which loops run: 2 AVX-512, 1 AVX2, 0 portable. The calls below take `level`: a negative one runs the best
// this CPU has, another at most that (tests run each build against the others).
int qtool_scaled_quant_isa() { return isa(); }

// Block maxima of |w| (dtype 0: fp32, 1: bf16) over bo rows by `group` columns, into amax fp32
// [ceil(rows / bo), groups]; returns the number of rows holding a NaN or inf weight.
int64_t qtool_row_amax(const void* w, int dtype, int64_t rows, int64_t cols, int64_t bo, int64_t group,
                       float* amax, int threads, int level) {
  const int l = level < 0 ? isa() : (level < isa() ? level : isa());
  return dtype == 1 ? amax_rows<1>(w, rows, cols, bo, group, amax, threads, l)
                    : amax_rows<0>(w, rows, cols, bo, group, amax, threads, l);
}

// element 0: e4m3, 1: int8. bo: rows per scale row.
void qtool_scaled_quant(const void* w, int dtype, int64_t rows, int64_t cols, int64_t bo, int64_t group,
                        const float* scales, const float* recips, int element, uint8_t* codes, double* sums,
                        int threads, int level) {
  const int l = level < 0 ? isa() : (level < isa() ? level : isa());
  if (dtype == 1 && element == 0) code_rows<1, 0>(w, rows, cols, bo, group, scales, recips, codes, sums, threads, l);
  if (dtype == 1 && element == 1) code_rows<1, 1>(w, rows, cols, bo, group, scales, recips, codes, sums, threads, l);
  if (dtype == 0 && element == 0) code_rows<0, 0>(w, rows, cols, bo, group, scales, recips, codes, sums, threads, l);
  if (dtype == 0 && element == 1) code_rows<0, 1>(w, rows, cols, bo, group, scales, recips, codes, sums, threads, l);
}

}  // extern "C"

// E4M3 codes times fp32 scales -> fp32 or bf16 on the CPU, in one pass over the bytes.
//
// Plain C ABI (no torch headers) so the library builds in seconds; qtool.packing.e4m3 loads it with
// torch.utils.cpp_extension.load(is_python_module=False) and calls it through ctypes. The torch path of
// qtool.formats.scaled.dequantize computes the same bits (codes.to(float32) * scale in fp32, then one
// round-to-nearest-even to bf16) in four passes over memory; on two cores that made dequantizing an FP8
// checkpoint several times slower than copying it. Tests compare the two bit for bit.
//
// codes:  uint8 [rows, cols], row-major (the E4M3 bytes)
// scales: fp32 [ceil((first + rows) / bo), groups], row-major: the scale of code (r, c) is
//         scales[(first + r) / bo, c / group] (groups = ceil(cols / group)); first: the first code row's place
//         within its block of bo rows, so a slice of rows passes its block rows' scales as they are stored
// out:    fp32 or bf16 (uint16) [rows, cols], row-major
// The decode counts the NaN codes it meets (S.1111.111): the caller refuses a weight that holds one without a
// second pass over the bytes.

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace {

// The 256 E4M3 (fn) values: sign bit 7, exponent bits 6..3 (bias 7), mantissa bits 2..0; exponent 0 is
// subnormal (m * 2^-9); S.1111.111 is NaN (no infinities). Every value is exact in fp32.
struct Table {
  float v[256];
  Table() {
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 0xF, m = b & 7;
      float x;
      if (e == 0xF && m == 7) {  // torch's float8 -> float32 conversion gives 0x7FF00000 (0xFFF00000 negative)
        const uint32_t bits = 0x7FF00000u;
        std::memcpy(&x, &bits, 4);
      } else if (e == 0) {
        x = std::ldexp(static_cast<float>(m), -9);
      } else {
        x = std::ldexp(1.0f + static_cast<float>(m) / 8.0f, e - 7);
      }
      v[b] = (b & 0x80) ? -x : x;
    }
  }
};
const Table kTable;

// fp32 -> bf16, round to nearest even; NaN becomes 0xFFFF, as torch's vectorized conversion writes it.
// Branch-free, so the loops below vectorize.
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? 0xFFFFu : r);
}

// One row: out[c] = value(q[c]) * s[c / group]; returns its NaN codes. Compiled for x86-64-v4 (AVX-512 with
// byte and word instructions), x86-64-v3 (AVX2) and the baseline, the best one chosen when the library loads
// (GCC function multi-versioning), so one build serves every x86 machine.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define QTOOL_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define QTOOL_CLONES
#endif

template <bool kBf16>
QTOOL_CLONES int64_t row(const uint8_t* q, const float* s, void* out, int64_t cols, int64_t group) {
  int64_t nans = 0;
  for (int64_t c0 = 0; c0 < cols; c0 += group) {
    const float sg = s[c0 / group];
    const int64_t c1 = (c0 + group < cols) ? c0 + group : cols;
    int32_t n = 0;  // NaN codes of this group, in 32-bit lanes like the values
#pragma omp simd reduction(+ : n)
    for (int64_t c = c0; c < c1; ++c) {
      const uint32_t b = q[c];
      const float v = kTable.v[b] * sg;
      n += (b & 0x7Fu) == 0x7Fu;
      if (kBf16) {
        static_cast<uint16_t*>(out)[c] = to_bf16(v);
      } else {
        static_cast<float*>(out)[c] = v;
      }
    }
    nans += n;
  }
  return nans;
}

#if defined(__x86_64__) && defined(__GNUC__)
// The same row with AVX-512 intrinsics, 16 codes a step: the value formed from the code's bits instead of the
// table (the table's lookups compile to gathers, about 1.3 ns a code): the magnitude's exponent and mantissa
// moved into fp32's place and rebiased (+120 in the exponent), below the least normal m * 2^-9, NaN codes
// torch's 0x7FF00000, then the sign; the product with the scale and its bf16 rounding are to_bf16's integer
// steps, so subnormal products round as the portable loop rounds them (the CPU's bf16 conversion would flush
// them to zero).
template <bool kBf16>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) int64_t row_512(const uint8_t* q, const float* s,
                                                                             void* out, int64_t cols,
                                                                             int64_t group) {
  const __m512i low7 = _mm512_set1_epi32(0x7F), bias = _mm512_set1_epi32(120 << 23);
  const __m512i nan_bits = _mm512_set1_epi32(0x7FF00000), eight = _mm512_set1_epi32(8);
  const __m512 step = _mm512_set1_ps(1.0f / 512.0f);
  __m512i nans = _mm512_setzero_si512();
  for (int64_t c0 = 0; c0 < cols; c0 += group) {
    const __m512 sg = _mm512_set1_ps(s[c0 / group]);
    const int64_t c1 = (c0 + group < cols) ? c0 + group : cols;
    for (int64_t c = c0; c < c1; c += 16) {
      const int64_t n = c1 - c < 16 ? c1 - c : 16;
      const __mmask16 k = static_cast<__mmask16>((1u << n) - 1);
      const __m512i b = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(k, q + c));
      const __m512i mag = _mm512_and_si512(b, low7);
      __m512i bits = _mm512_add_epi32(_mm512_slli_epi32(mag, 20), bias);
      const __mmask16 sub = _mm512_cmplt_epi32_mask(mag, eight);
      bits = _mm512_mask_mov_epi32(bits, sub, _mm512_castps_si512(_mm512_mul_ps(_mm512_cvtepi32_ps(mag), step)));
      const __mmask16 nan = _mm512_cmpeq_epi32_mask(mag, low7);
      bits = _mm512_mask_mov_epi32(bits, nan, nan_bits);
      nans = _mm512_mask_add_epi32(nans, nan & k, nans, _mm512_set1_epi32(1));
      bits = _mm512_or_si512(bits, _mm512_slli_epi32(_mm512_andnot_si512(low7, b), 24));
      const __m512 v = _mm512_mul_ps(_mm512_castsi512_ps(bits), sg);
      if (kBf16) {
        const __m512i u = _mm512_castps_si512(v);
        __m512i r = _mm512_srli_epi32(
            _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)),
                             _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))), 16);
        const __mmask16 isnan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        r = _mm512_mask_mov_epi32(r, isnan, _mm512_set1_epi32(0xFFFF));
        _mm512_mask_cvtepi32_storeu_epi16(static_cast<uint16_t*>(out) + c, k, r);
      } else {
        _mm512_mask_storeu_ps(static_cast<float*>(out) + c, k, v);
      }
    }
  }
  return _mm512_reduce_add_epi32(nans);
}

bool has_avx512() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  }();
  return yes;
}
#define QTOOL_ROW_512 1
#endif

// level: 1 the AVX-512 loop where the CPU has it, 0 the portable one (tests compare the two)
template <bool kBf16>
int64_t run(const uint8_t* codes, const float* scales, void* out, int64_t rows, int64_t cols, int64_t group,
            int64_t bo, int64_t first, int threads, int level) {
  const int64_t groups = (cols + group - 1) / group;
  const int64_t osz = kBf16 ? 2 : 4;
  int64_t nans = 0;
#ifdef QTOOL_ROW_512
  const bool wide = level != 0 && has_avx512();
#else
  const bool wide = false;
#endif
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : nans) if (threads > 1)
  for (int64_t r = 0; r < rows; ++r) {
    const float* sr = scales + ((first + r) / bo) * groups;
    void* o = static_cast<char*>(out) + r * cols * osz;
#ifdef QTOOL_ROW_512
    if (wide) {
      nans += row_512<kBf16>(codes + r * cols, sr, o, cols, group);
      continue;
    }
#endif
    nans += row<kBf16>(codes + r * cols, sr, o, cols, group);
  }
  (void)wide;
  return nans;
}

}  // namespace

extern "C" {

int qtool_e4m3_dequant_abi() { return 4; }

// How many of n bytes have (b & mask) == value: E4M3 NaN codes are mask 0x7F, value 0x7F (E5M2 NaN and inf:
// 0x7C, 0x7C). One read of the bytes, for the check that refuses NaN codes before they become NaN weights.
QTOOL_CLONES int64_t qtool_count_masked(const uint8_t* bytes, int64_t n, int mask, int value, int threads) {
  int64_t count = 0;
  const uint8_t m = static_cast<uint8_t>(mask), v = static_cast<uint8_t>(value);
#pragma omp parallel for num_threads(threads) reduction(+ : count) schedule(static)
  for (int64_t i = 0; i < n; ++i) count += (bytes[i] & m) == v;
  return count;
}

// Both return the number of NaN codes met. level: 0 the portable loop, anything else the best this CPU runs.
int64_t qtool_e4m3_dequant_f32(const uint8_t* codes, const float* scales, float* out, int64_t rows, int64_t cols,
                               int64_t group, int64_t bo, int64_t first, int threads, int level) {
  return run<false>(codes, scales, out, rows, cols, group, bo, first, threads, level);
}

int64_t qtool_e4m3_dequant_bf16(const uint8_t* codes, const float* scales, uint16_t* out, int64_t rows,
                                int64_t cols, int64_t group, int64_t bo, int64_t first, int threads, int level) {
  return run<true>(codes, scales, out, rows, cols, group, bo, first, threads, level);
}

// 1 where the AVX-512 loop runs, else 0.
int qtool_e4m3_dequant_isa() {
#ifdef QTOOL_ROW_512
  return has_avx512() ? 1 : 0;
#else
  return 0;
#endif
}

}  // extern "C"

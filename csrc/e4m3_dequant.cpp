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

template <bool kBf16>
int64_t run(const uint8_t* codes, const float* scales, void* out, int64_t rows, int64_t cols, int64_t group,
            int64_t bo, int64_t first, int threads) {
  const int64_t groups = (cols + group - 1) / group;
  const int64_t osz = kBf16 ? 2 : 4;
  int64_t nans = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : nans)
  for (int64_t r = 0; r < rows; ++r) {
    nans += row<kBf16>(codes + r * cols, scales + ((first + r) / bo) * groups,
                       static_cast<char*>(out) + r * cols * osz, cols, group);
  }
  return nans;
}

}  // namespace

extern "C" {

int qtool_e4m3_dequant_abi() { return 3; }

// How many of n bytes have (b & mask) == value: E4M3 NaN codes are mask 0x7F, value 0x7F (E5M2 NaN and inf:
// 0x7C, 0x7C). One read of the bytes, for the check that refuses NaN codes before they become NaN weights.
QTOOL_CLONES int64_t qtool_count_masked(const uint8_t* bytes, int64_t n, int mask, int value, int threads) {
  int64_t count = 0;
  const uint8_t m = static_cast<uint8_t>(mask), v = static_cast<uint8_t>(value);
#pragma omp parallel for num_threads(threads) reduction(+ : count) schedule(static)
  for (int64_t i = 0; i < n; ++i) count += (bytes[i] & m) == v;
  return count;
}

// Both return the number of NaN codes met.
int64_t qtool_e4m3_dequant_f32(const uint8_t* codes, const float* scales, float* out, int64_t rows, int64_t cols,
                               int64_t group, int64_t bo, int64_t first, int threads) {
  return run<false>(codes, scales, out, rows, cols, group, bo, first, threads);
}

int64_t qtool_e4m3_dequant_bf16(const uint8_t* codes, const float* scales, uint16_t* out, int64_t rows,
                                int64_t cols, int64_t group, int64_t bo, int64_t first, int threads) {
  return run<true>(codes, scales, out, rows, cols, group, bo, first, threads);
}

}  // extern "C"

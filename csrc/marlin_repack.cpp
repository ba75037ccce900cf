// GPTQ qweight <-> Marlin B on the CPU, one pass over the bytes.
//
// Plain C ABI (no torch headers) so the library builds in seconds; qtool.packing.marlin_perm loads it with
// torch.utils.cpp_extension.load(is_python_module=False) and calls it through ctypes. The pure-torch path
// in marlin_perm.py produces the same bytes; tests compare the two.
//
// GPTQ qweight: int32 [K*bits/32, N], codes of column n packed along K, code k at bits (k % pf)*bits of
// word row k / pf (pf = 32/bits). Marlin B: int32 [K/16, N*16/pf]. Per 16 rows (kt) and 64 columns (m),
// B holds 4 tiles j of 16x16; warp lane t = 4c + r owns tile column c (and c+8) at rows 2r+{0,1,8,9}, the
// mma.m16n8k16 B-fragment map. Words are laid out lane-major (word 4t+j at 4-bit, 8t+2j+half at 8-bit)
// with the values inside a word interleaved the way the kernel's LOP3 dequant reads them.
//
// The key fact used here: at 4-bit, the two codes of one GPTQ byte (rows 2r, 2r+1 of a column) land in
// the same Marlin word, so a Marlin word is 4 GPTQ bytes followed by a fixed nibble shuffle; at 8-bit it
// is two GPTQ half-words followed by a byte shuffle. Nothing is unpacked to one code per byte.

#include <cstdint>
#include <cstring>

namespace {

// Exchange the bit fields under `mask` with those `shift` bits above them.
inline uint32_t swap_fields(uint32_t x, uint32_t mask, int shift) {
  const uint32_t t = ((x >> shift) ^ x) & mask;
  return x ^ t ^ (t << shift);
}

// Nibbles [n0..n7] -> [n0, n2, n4, n6, n1, n3, n5, n7]: low nibbles of the 4 bytes first (the kernel
// dequantizes nibbles <0,4,1,5> then <2,6,3,7>, i.e. interleave 0,2,4,6,1,3,5,7 of the lane's values).
inline uint32_t unzip_nibbles(uint32_t x) {
  return swap_fields(swap_fields(x, 0x00F000F0u, 4), 0x0000FF00u, 8);
}
inline uint32_t zip_nibbles(uint32_t x) {
  return swap_fields(swap_fields(x, 0x0000FF00u, 8), 0x00F000F0u, 4);
}
// Bytes [b0, b1, b2, b3] -> [b0, b2, b1, b3] (8-bit interleave 0,2,1,3); its own inverse.
inline uint32_t swap_mid_bytes(uint32_t x) { return swap_fields(x, 0x0000FF00u, 8); }

inline uint16_t load16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
inline void store16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, 2); }

// 4x4 byte transpose: out[r] = byte r of x[0], x[1], x[2], x[3] (low to high). Its own inverse.
inline void transpose_bytes(const uint32_t x[4], uint32_t out[4]) {
  const uint32_t t0 = (x[0] & 0x00FF00FFu) | ((x[1] & 0x00FF00FFu) << 8);  // x0.b0 x1.b0 x0.b2 x1.b2
  const uint32_t t1 = ((x[0] >> 8) & 0x00FF00FFu) | (x[1] & 0xFF00FF00u);  // x0.b1 x1.b1 x0.b3 x1.b3
  const uint32_t t2 = (x[2] & 0x00FF00FFu) | ((x[3] & 0x00FF00FFu) << 8);
  const uint32_t t3 = ((x[2] >> 8) & 0x00FF00FFu) | (x[3] & 0xFF00FF00u);
  out[0] = (t0 & 0xFFFFu) | (t2 << 16);
  out[1] = (t1 & 0xFFFFu) | (t3 << 16);
  out[2] = (t0 >> 16) | (t2 & 0xFFFF0000u);
  out[3] = (t1 >> 16) | (t3 & 0xFFFF0000u);
}

inline uint32_t load32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline void store32(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }

}  // namespace

extern "C" {

// src: GPTQ qweight bytes (k/8 rows of n words); dst: B, k/16 rows of 2n words. k % 16 == 0, n % 64 == 0.
// Marlin word (c, r, j) = bytes r of the GPTQ words of columns 16j+c and 16j+c+8 in the low (rows 0-7) and
// high (rows 8-15) word rows of the tile, nibble-unzipped: one 4x4 byte transpose gives all four r at once.
void qtool_gptq_to_marlin_4(const uint8_t* src, uint32_t* dst, int64_t k, int64_t n, int threads) {
  const int64_t row_bytes = n * 4;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t kt = 0; kt < k / 16; ++kt) {
    const uint8_t* lo_rows = src + (2 * kt) * row_bytes;  // rows 16kt .. 16kt+7
    const uint8_t* hi_rows = lo_rows + row_bytes;           // rows 16kt+8 .. 16kt+15
    uint32_t* out = dst + kt * (2 * n);
    for (int64_t m = 0; m < n / 64; ++m) {
      const uint8_t* a = lo_rows + m * 256;
      const uint8_t* b = hi_rows + m * 256;
      uint32_t* o = out + m * 128;
      // For one j the 8 columns c = 0..7 are contiguous words: the c loop runs on whole vectors, and the
      // results are scattered to their lanes (stride 16 words) from a small staging tile.
      uint32_t y[4][4][8];  // [j][r][c]
      for (int j = 0; j < 4; ++j)
        for (int c = 0; c < 8; ++c) {
          const int col = 16 * j + c;
          const uint32_t x[4] = {load32(a + 4 * col), load32(b + 4 * col), load32(a + 4 * col + 32),
                                 load32(b + 4 * col + 32)};
          uint32_t t[4];
          transpose_bytes(x, t);
          for (int r = 0; r < 4; ++r) y[j][r][c] = unzip_nibbles(t[r]);
        }
      for (int c = 0; c < 8; ++c)
        for (int r = 0; r < 4; ++r)
          for (int j = 0; j < 4; ++j) o[16 * c + 4 * r + j] = y[j][r][c];
    }
  }
}

void qtool_marlin_to_gptq_4(const uint32_t* src, uint8_t* dst, int64_t k, int64_t n, int threads) {
  const int64_t row_bytes = n * 4;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t kt = 0; kt < k / 16; ++kt) {
    uint8_t* lo_rows = dst + (2 * kt) * row_bytes;
    uint8_t* hi_rows = lo_rows + row_bytes;
    const uint32_t* in = src + kt * (2 * n);
    for (int64_t m = 0; m < n / 64; ++m) {
      uint8_t* a = lo_rows + m * 256;
      uint8_t* b = hi_rows + m * 256;
      const uint32_t* w = in + m * 128;
      uint32_t y[4][4][8];  // [j][r][c], gathered from the lanes; then whole-vector work as above
      for (int c = 0; c < 8; ++c)
        for (int r = 0; r < 4; ++r)
          for (int j = 0; j < 4; ++j) y[j][r][c] = w[16 * c + 4 * r + j];
      for (int j = 0; j < 4; ++j)
        for (int c = 0; c < 8; ++c) {
          const int col = 16 * j + c;
          uint32_t t[4], x[4];
          for (int r = 0; r < 4; ++r) t[r] = zip_nibbles(y[j][r][c]);
          transpose_bytes(t, x);
          store32(a + 4 * col, x[0]);
          store32(b + 4 * col, x[1]);
          store32(a + 4 * col + 32, x[2]);
          store32(b + 4 * col + 32, x[3]);
        }
    }
  }
}

// src: GPTQ 8-bit qweight bytes (k/4 rows of n words); dst: B, k/16 rows of 4n words.
void qtool_gptq_to_marlin_8(const uint8_t* src, uint32_t* dst, int64_t k, int64_t n, int threads) {
  const int64_t row_bytes = n * 4;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t kt = 0; kt < k / 16; ++kt) {
    const uint8_t* rows = src + (4 * kt) * row_bytes;  // word row h holds rows 16kt + 4h .. +3
    uint32_t* out = dst + kt * (4 * n);
    for (int64_t m = 0; m < n / 64; ++m) {
      uint32_t* o = out + m * 256;
      for (int c = 0; c < 8; ++c)
        for (int r = 0; r < 4; ++r) {
          // rows 2r, 2r+1 sit in word row r/2, rows 2r+8, 2r+9 in word row 2 + r/2, half-word r%2
          const uint8_t* lo = rows + (r >> 1) * row_bytes + m * 256 + 2 * (r & 1);
          const uint8_t* hi = lo + 2 * row_bytes;
          for (int j = 0; j < 4; ++j)
            for (int half = 0; half < 2; ++half) {
              const int col = 16 * j + c + 8 * half;
              const uint32_t x = uint32_t(load16(lo + col * 4)) | uint32_t(load16(hi + col * 4)) << 16;
              o[8 * (4 * c + r) + 2 * j + half] = swap_mid_bytes(x);
            }
        }
    }
  }
}

void qtool_marlin_to_gptq_8(const uint32_t* src, uint8_t* dst, int64_t k, int64_t n, int threads) {
  const int64_t row_bytes = n * 4;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t kt = 0; kt < k / 16; ++kt) {
    uint8_t* rows = dst + (4 * kt) * row_bytes;
    const uint32_t* in = src + kt * (4 * n);
    for (int64_t m = 0; m < n / 64; ++m) {
      const uint32_t* w = in + m * 256;
      for (int c = 0; c < 8; ++c)
        for (int r = 0; r < 4; ++r) {
          uint8_t* lo = rows + (r >> 1) * row_bytes + m * 256 + 2 * (r & 1);
          uint8_t* hi = lo + 2 * row_bytes;
          for (int j = 0; j < 4; ++j)
            for (int half = 0; half < 2; ++half) {
              const int col = 16 * j + c + 8 * half;
              const uint32_t x = swap_mid_bytes(w[8 * (4 * c + r) + 2 * j + half]);
              store16(lo + col * 4, uint16_t(x));
              store16(hi + col * 4, uint16_t(x >> 16));
            }
        }
    }
  }
}

// Version of the ABI above; bumped when a signature changes so a stale build is never called.
int qtool_marlin_repack_abi() { return 1; }

}  // extern "C"

// W4A16 GEMM kernels for qtool's `cuda-w4a16`: y[M, N] = x[M, K] @ W^T, W 4-bit with per-group scales and
// zero points, stored in the "mma tile" layout that qtool/packing/mma_tiles.py writes at prepare time.
//
// Compiled to a cubin by qtool/kernels/cuda/build.py (nvcc -cubin, one architecture) and launched through
// the CUDA driver API (qtool/kernels/cuda/driver.py), so no host compiler or torch headers are needed.
//
// Layout (all little-endian, built once from GPTQ v2 tensors):
//   qw   uint4 [N16][KB][32]  N16 = ceil(N/16) tiles of 16 output rows, KB = ceil(K/64) blocks of 64 k
//                             (tile-major: a tile's K is one contiguous run, which the stream-K kernel walks
//                             tile after tile). Lane l = 4g + t of the warp that owns tile tn gets one uint4
//                             per block: word s
//                             (s = 0..3) is its mma A fragment for k16 step s (k0 = 64 kb + 16 s), nibbles
//                             0/4: (row g, k0+2t / k0+2t+1)     1/5: (row g+8, same k)
//                             2/6: (row g, k0+2t+8 / +9)        3/7: (row g+8, same k)
//                             which is the m16n8k16 (and wgmma m64nNk16, per warp) A-fragment order, so one
//                             16-byte load and four LOP3s give a lane the exact values it feeds the tensor core.
//   msc  uint32 [N16][NG][8]  {scale(16 tn + g), scale(16 tn + g + 8)} as two 16-bit values of x's dtype
//   mzp  uint4  [N16][NG]     16 zero points (0..15) of the tile, nibble r = row 16 tn + r (.z, .w: padding)
//                             (tile-major like qw: a warp walking a tile's K reads its records in order)
//   gtab int32  [KB*4]        group of each k16 step, for the per-step kernels (act-order, groups under 64 or not
//                             a power of two); the per-block kernels find the group by a shift (Args::gshift)
//
// Dequantization: a nibble q is spliced into the mantissa of a 16-bit float by LOP3 (fp16 0x6400 = 1024, or
// 16*q + 1024 for the high nibble of a byte; bf16 0x4300 = 128), and one FMA removes the bias and the zero
// point together: (1024 + q) - (1024 + z) = q - z, exact in fp16 and bf16 for 4-bit q and z. The scale is
// applied either to the fp32 accumulator once per block (groups of >= 64: exact products on the tensor core,
// one rounding fewer than the dense baseline) or to the 16-bit fragment (smaller groups, and the wgmma
// kernel, whose 128 accumulators per thread leave no room for a second set). The stream-K kernel skips the FMA:
// it feeds (bias + q) and removes (bias + z) * sum(x) from the fp32 sum of each unit (sk_small), or, in its ZSUB
// form, subtracts the zero by the same FMA.

#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define QT_WGMMA 1
#include "wgmma_rs.cuh"
#endif

#define DEVI __device__ __forceinline__

namespace qt {

DEVI uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// (a & b) | c in one instruction
DEVI uint32_t lop3_and_or(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

template <bool BF16>
DEVI uint32_t fma2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  if constexpr (BF16) {
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  } else {
    asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  }
  return d;
}

template <bool BF16>
DEVI float to_f32(uint32_t h16) {
  if constexpr (BF16) {
    return __uint_as_float(h16 << 16);
  } else {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(h16)));
  }
}

template <bool BF16>
DEVI uint16_t from_f32(float v) {
  if constexpr (BF16) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  } else {
    return __half_as_ushort(__float2half_rn(v));
  }
}

// Per-row constants of one group for the lane's two rows (g: zero z0, scale s0; g + 8: z1, s1).
struct RowConst {
  uint32_t nz0, nz1;  // negated biased zeros, as 16-bit pairs (see dequant)
  uint32_t s0, s1;    // scales broadcast to both halves
};

template <bool BF16>
DEVI RowConst row_const(uint32_t sc, uint2 zp, int g) {
  const uint32_t z0 = (zp.x >> (4 * g)) & 15u, z1 = (zp.y >> (4 * g)) & 15u;
  RowConst c;
  if constexpr (BF16) {
    c.nz0 = (0xC300u + z0) * 0x10001u;  // -(128 + z0)
    c.nz1 = (0xC300u + z1) * 0x10001u;
  } else {
    c.nz0 = (0xE400u + z0) * 0x10001u;       // -(1024 + z0)
    c.nz1 = (0xD400u + 16u * z1) * 0x10001u;  // -(64 + z1): the high nibble arrives as 1024 + 16 q, scaled by 1/16
  }
  c.s0 = (sc & 0xFFFFu) * 0x10001u;
  c.s1 = (sc >> 16) * 0x10001u;
  return c;
}

// One word -> the lane's A fragment a[0..3] = (q - z) as 16-bit pairs (exact), optionally times the scale.
template <bool BF16, bool SCALE>
DEVI void dequant(uint32_t w, const RowConst& c, uint32_t (&a)[4]) {
  if constexpr (BF16) {
    const uint32_t ONE = 0x3F803F80u, MAGIC = 0x43004300u;
    a[0] = fma2<true>(lop3_and_or(w, 0x000F000Fu, MAGIC), ONE, c.nz0);
    a[1] = fma2<true>(lop3_and_or(w >> 4, 0x000F000Fu, MAGIC), ONE, c.nz1);
    a[2] = fma2<true>(lop3_and_or(w >> 8, 0x000F000Fu, MAGIC), ONE, c.nz0);
    a[3] = fma2<true>(lop3_and_or(w >> 12, 0x000F000Fu, MAGIC), ONE, c.nz1);
  } else {
    const uint32_t ONE = 0x3C003C00u, SIXTEENTH = 0x2C002C00u, MAGIC = 0x64006400u;
    const uint32_t w8 = w >> 8;
    a[0] = fma2<false>(lop3_and_or(w, 0x000F000Fu, MAGIC), ONE, c.nz0);
    a[1] = fma2<false>(lop3_and_or(w, 0x00F000F0u, MAGIC), SIXTEENTH, c.nz1);
    a[2] = fma2<false>(lop3_and_or(w8, 0x000F000Fu, MAGIC), ONE, c.nz0);
    a[3] = fma2<false>(lop3_and_or(w8, 0x00F000F0u, MAGIC), SIXTEENTH, c.nz1);
  }
  if constexpr (SCALE) {
    const uint32_t NEG0 = 0x80008000u;  // a * s + (-0) = a * s, rounded once
    a[0] = fma2<BF16>(a[0], c.s0, NEG0);
    a[1] = fma2<BF16>(a[1], c.s1, NEG0);
    a[2] = fma2<BF16>(a[2], c.s0, NEG0);
    a[3] = fma2<BF16>(a[3], c.s1, NEG0);
  }
}

// One word -> the lane's A fragment with the bias left in: fp16 (1024 + q) for rows g, (1024 + 16 q) for rows
// g + 8 (the high nibble in place); bf16 (128 + q) for both. Four LOP3s (and shifts), exact; the stream-K kernel
// removes (bias + z) * sum(x) from the fp32 block sum instead (the products are exact in fp32).
template <bool BF16>
DEVI void biased(uint32_t w, uint32_t (&a)[4]) {
  if constexpr (BF16) {
    const uint32_t MAGIC = 0x43004300u;
    a[0] = lop3_and_or(w, 0x000F000Fu, MAGIC);
    a[1] = lop3_and_or(w >> 4, 0x000F000Fu, MAGIC);
    a[2] = lop3_and_or(w >> 8, 0x000F000Fu, MAGIC);
    a[3] = lop3_and_or(w >> 12, 0x000F000Fu, MAGIC);
  } else {
    const uint32_t MAGIC = 0x64006400u, w8 = w >> 8;
    a[0] = lop3_and_or(w, 0x000F000Fu, MAGIC);
    a[1] = lop3_and_or(w, 0x00F000F0u, MAGIC);
    a[2] = lop3_and_or(w8, 0x000F000Fu, MAGIC);
    a[3] = lop3_and_or(w8, 0x00F000F0u, MAGIC);
  }
}

template <bool BF16>
DEVI void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (BF16) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

DEVI void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// 16 bytes global -> shared, zero-filled when !valid (src must still be a mapped address)
DEVI void cp_async16(uint32_t saddr, const void* gptr, bool valid) {
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(saddr), "l"(gptr), "r"(n) : "memory");
}
// cp_async16 with an L2 cache policy (createpolicy): the same copy, with the policy as a hint
DEVI void cp_async16_hint(uint32_t saddr, const void* gptr, uint64_t policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, 16, %2;\n" ::"r"(saddr), "l"(gptr),
               "l"(policy) : "memory");
}
DEVI uint64_t l2_policy(bool evict_first) {
  uint64_t pol;
  if (evict_first)
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(pol));
  else
    asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;\n" : "=l"(pol));
  return pol;
}
DEVI void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// fp32 partial sums four at a time: a 16-byte shared-memory load, and a += b
DEVI float4 lds_f4(uint32_t saddr) {
  float4 v;
  asm volatile("ld.shared.v4.f32 {%0,%1,%2,%3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(saddr)
               : "memory");
  return v;
}
DEVI void add_to(float4& a, const float4& b) {
  a.x += b.x;
  a.y += b.y;
  a.z += b.z;
  a.w += b.w;
}

// mbarriers in shared memory (sm_80+; the wait spins on try_wait from sm_90, on test_wait before)
DEVI void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
DEVI void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
#define QT_MBAR_POLL "try_wait"
#else
#define QT_MBAR_POLL "test_wait"
#endif
DEVI void mbar_wait(uint32_t bar, uint32_t parity) {  // until the phase of this parity has completed
  asm volatile(
      "{\n .reg .pred p;\n"
      "QT_MBAR_WAIT:\n"
      " mbarrier." QT_MBAR_POLL ".parity.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra QT_MBAR_WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// Thread-block clusters (sm_90; only the xr_small CL kernels, built in the sm_90a section, use these): the CTA's
// rank in its cluster, the cluster's index, a local shared address mapped into CTA `rank`'s shared memory, a
// 16-byte store there, a release arrival on a barrier there, an acquire wait on a local barrier that CTAs of
// the cluster arrive on, and a barrier of every thread of the cluster.
DEVI uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
DEVI uint32_t cluster_index() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%clusterid.x;\n" : "=r"(r));
  return r;
}
DEVI uint32_t cluster_map(uint32_t saddr, uint32_t rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(saddr), "r"(rank));
  return r;
}
DEVI void st_cluster_f4(uint32_t caddr, const float4& v) {
  asm volatile("st.shared::cluster.v4.f32 [%0], {%1,%2,%3,%4};\n" ::"r"(caddr), "f"(v.x), "f"(v.y), "f"(v.z),
               "f"(v.w) : "memory");
}
DEVI void mbar_arrive_cluster(uint32_t cbar) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(cbar) : "memory");
}
DEVI void mbar_wait_cluster(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred p;\n"
      "QT_MBAR_WAITC:\n"
      " mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra QT_MBAR_WAITC;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
DEVI void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory"); }
DEVI void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory"); }
DEVI void cluster_sync() {
  cluster_arrive();
  cluster_wait();
}

template <int N>
DEVI void cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Programmatic dependent launch (sm_90+; launch.py sets the launch attribute there). Each kernel lets the next
// kernel in the stream launch while it still runs (pdl_trigger), and that next kernel streams its first weight
// blocks, which no earlier kernel writes, before griddepcontrol.wait, which returns once every earlier kernel has
// finished and its memory is visible: x, y, the workspace and the counters are touched only after it. So the
// next layer's weights start flowing during this one's tail (the tile hand-over, the last stores) instead of
// after a launch gap. Without the attribute both are no-ops; below sm_90 they are compiled out.
// Where the trigger goes is a launch flag (Args::flags): after the wait (default), which keeps at most two
// grids resident, or at the start (QT_PDL_EARLY): a grid that triggers at its start lets the next one launch,
// which triggers at its start too, a cascade of waiting grids whose CTAs take the SM slots as CTAs exit. The
// stream-K kernel's large layers measured faster that way (1-2 us a call, benchmarks/results/bench.md, sixth
// pass) when the grid gives every SM the same CTAs, and slower otherwise (launch.py only asks for it then).
// Args::flags: bit 0 QT_PDL_EARLY; bit 1 QT_EVICT_FIRST: the weight copies carry an L2 evict-first policy. Read
// once per call, they should be the first lines L2 lets go; at M = 1 this is worth ~20 us over a Llama-3-70B
// layer (bench.md, seventh pass). The scale and zero records keep the normal policy: four consecutive units
// share a 128-byte line of them, and evicting those early measured slower.
enum { QT_PDL_EARLY = 1, QT_EVICT_FIRST = 2 };
DEVI void pdl_trigger() {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
DEVI void pdl_start(int flags) {
  if (flags & QT_PDL_EARLY) pdl_trigger();
}
DEVI void pdl_wait(int flags) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
  if (!(flags & QT_PDL_EARLY)) pdl_trigger();
}

// The weight stream is read exactly once per call: keep it out of L1.
DEVI uint4 ld_stream(const uint4* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

DEVI uint32_t word(const uint4& v, int s) { return s == 0 ? v.x : s == 1 ? v.y : s == 2 ? v.z : v.w; }

struct Args {
  const uint4* qw;
  const uint32_t* msc;
  const uint4* mzp;  // [N16][NG]: the 16 zero nibbles in .x/.y, .z/.w padding
  const int* gtab;
  const uint16_t* x;
  uint16_t* y;
  float* ws;
  int* cnt;
  int M, N, K, KB, kbps, NG, gshift;  // gshift >= 0: group of element k = min(k >> gshift, NG - 1); else gtab
  int flags;                          // QT_PDL_EARLY | QT_EVICT_FIRST
};

// A warp's weight stream over TN adjacent 16-row tiles: a cp.async ring of D slots, each {the 32 lanes' 16
// bytes of weights per tile, NS metadata records per tile}. A record is the tile's 8 scale pairs (32 bytes) and
// its 16 zero nibbles (padded to 16 bytes), copied as three 16-byte pieces by lanes 3t..3t+2 for tile t; each
// lane waits for its own copies and __syncwarp() publishes them to the warp. D - 1 blocks are in flight per warp
// without holding registers.
// NS = 1: one group per 64-k block, found by a shift (group size a power of two >= 64, or one group);
// NS = 4: one group per k16 step, read from the group table (act-order, small or odd group sizes).
// The sources advance by running pointers: the loop is issue-bound at M = 1, so every instruction counts.
template <int D, int NS, int TN = 1>
struct Stream {
  static constexpr int META = 48;
  static constexpr int SLOT = TN * 512 + TN * NS * META;
  static constexpr int BYTES_PER_WARP = D * SLOT;
  uint32_t base, end, fill, read;  // shared: the ring, the next slot to fill and to read
  const uint4* gw;                 // next block's weights of tile 0 for this lane
  size_t tstride;                  // uint4s from one tile to the next (KB * 32; blocks are 32 apart)
  const char* mbase;               // this lane's metadata piece in group 0 (lanes < 3 TN)
  uint32_t mstride;                // bytes from one group's record to the next
  uint32_t mdst;                   // offset of this lane's piece in a slot
  const int* gtab;
  int kb_next, gshift, ngm1, lane, ntiles;  // ntiles: tiles of this warp inside N (1..TN), 0 = idle warp
  bool mlane;
  uint64_t pol;  // L2 policy of the weight copies (Args::flags QT_EVICT_FIRST)

  DEVI Stream(const Args& p, uint32_t warp_base, int lane_, int tn0, int n16, int kb0)
      : base(warp_base), end(warp_base + BYTES_PER_WARP), fill(warp_base), read(warp_base),
        gw(p.qw + ((size_t)tn0 * p.KB + kb0) * 32 + lane_), tstride((size_t)p.KB * 32), gtab(p.gtab),
        kb_next(kb0), gshift(p.gshift), ngm1(p.NG - 1), lane(lane_), pol(l2_policy(p.flags & QT_EVICT_FIRST)) {
    ntiles = max(0, min(TN, n16 - tn0));
    const int t = lane_ / 3, part = lane_ - 3 * t;
    mlane = t < ntiles;
    const int tile = tn0 + (mlane ? t : 0);
    mbase = part < 2 ? (const char*)(p.msc + (size_t)tile * p.NG * 8 + part * 4)
                     : (const char*)(p.mzp + (size_t)tile * p.NG);
    mstride = part < 2 ? 32 : 16;
    mdst = TN * 512 + t * NS * META + part * 16;
  }

  DEVI int group(int kb, int s) const {
    if constexpr (NS == 4) {
      return __ldg(gtab + kb * 4 + s);
    } else {
      return min((kb * 64) >> gshift, ngm1);
    }
  }
  DEVI void issue() {  // the next block into the next slot
#pragma unroll
    for (int t = 0; t < TN; ++t)
      if (t < ntiles) cp_async16_hint(fill + t * 512 + lane * 16, gw + t * tstride, pol);
    if (mlane) {
#pragma unroll
      for (int s = 0; s < NS; ++s)
        cp_async16(fill + mdst + s * META, mbase + (size_t)group(kb_next, s) * mstride, true);
    }
    gw += 32;
    ++kb_next;
    fill = fill + SLOT == end ? base : fill + SLOT;
  }
  DEVI uint4 weights(int t = 0) const {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(read + t * 512 + lane * 16));
    return v;
  }
  DEVI uint32_t scale(int s, int t = 0) const {  // {scale(row g), scale(row g + 8)} of tile t
    uint32_t v;
    asm volatile("ld.shared.u32 %0, [%1];\n"
                 : "=r"(v)
                 : "r"(read + TN * 512 + (t * NS + s) * META + (lane >> 2) * 4));
    return v;
  }
  DEVI uint2 zero(int s, int t = 0) const {
    uint2 v;
    asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];\n"
                 : "=r"(v.x), "=r"(v.y)
                 : "r"(read + TN * 512 + (t * NS + s) * META + 32));
    return v;
  }
  DEVI void next() { read = read + SLOT == end ? base : read + SLOT; }
};

}  // namespace qt

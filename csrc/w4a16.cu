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

// Epilogue shared by both kernels. acc[j][0..3] = rows (n0 + g, n0 + g, n0 + g + 8, n0 + g + 8) x batch columns
// (8 j + 2 t, 8 j + 2 t + 1, ...) of this warp's 16-row tile. With one split the lane stores y directly;
// otherwise it stores fp32 partials, and the last CTA of this output tile to arrive sums them in split order
// (deterministic) and resets the tile's counter for the next call (one launch, no memset).
// f(n, ml, value) for every accumulator element of the lane: output row n, batch row ml of the chunk
template <int NT, int TN, typename F>
DEVI void for_each_acc(const float (&acc)[TN][NT][4], int n0, F&& f) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int u = 0; u < TN; ++u)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) f(n0 + 16 * u + g + (e >> 1) * 8, 8 * j + 2 * t + (e & 1), acc[u][j][e]);
}

// nthr: the CTA's first nthr threads hold accumulators and sum the partials (the wgmma kernel's producer
// warpgroup, beyond them, only meets the two CTA barriers: epilogue_barriers). V: float4s of partials per thread
// per pass (see below; 2 where registers are capped at 80).
template <int NT, bool BF16, int TN = 1, int V = 4>
DEVI void epilogue(const Args& p, float (&acc)[TN][NT][4], int n0, int m0, int mc, int tile_n0, int tile_w,
                   int nthr) {
  const int splits = gridDim.y;
  if (splits == 1) {
    for_each_acc<NT, TN>(acc, n0, [&](int n, int ml, float v) {
      if (ml < mc && n < p.N) p.y[(size_t)(m0 + ml) * p.N + n] = from_f32<BF16>(v);
    });
    return;
  }
  const int np = ((p.N + 15) >> 4) * 16;
  const size_t slab = (size_t)(8 * NT) * np;  // one split's partials for this batch chunk: [8 NT][np]
  float* mine = p.ws + ((size_t)blockIdx.y * gridDim.z + blockIdx.z) * slab;
  for_each_acc<NT, TN>(acc, n0, [&](int n, int ml, float v) {
    if (ml < mc && n < np) mine[(size_t)ml * np + n] = v;
  });
  // The CTA barrier orders every thread's partials before thread 0's fence, which (being cumulative) releases
  // them at GPU scope before its arrival; the last CTA's thread 0 fences again (acquire) before the barrier
  // that lets its threads read the others' partials. One fence per CTA, not one per thread: with a fence in
  // every thread, the fence was 12 % of the warps' stall samples of Llama-3-70B gate/up at M = 16 (split 9;
  // Nsight Compute, tenth pass in bench.md).
  __shared__ int last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    int* c = p.cnt + blockIdx.z * gridDim.x + blockIdx.x;
    last = atomicAdd(c, 1) == splits - 1;
    if (last) {
      *c = 0;  // every other CTA of this tile has arrived: safe to re-arm
      __threadfence();
    }
  }
  __syncthreads();
  if (!last) return;
  // Four adjacent outputs per float4, V float4s per thread at once, so V x (unrolled) splits 16-byte loads are in
  // flight instead of one 4-byte load: this loop is latency-bound (an L2 round trip per pass), and with one
  // element per thread per pass it cost ~20 us of Llama-3-70B q/o at M = 256 (bench.md, ninth pass). Partials
  // are written for every n < np (np and tile_n0 multiples of 16), so a float4 never straddles the end.
  const int w4 = tile_w >> 2, total = mc * w4;
  const size_t stride = (size_t)gridDim.z * slab;
  for (int e0 = threadIdx.x; e0 < total; e0 += nthr * V) {
    const float4* src[V];
    int n[V], ml[V];
    bool ok[V];
    float4 sum[V];
#pragma unroll
    for (int u = 0; u < V; ++u) {
      const int e = e0 + u * nthr;
      ml[u] = e / w4;
      n[u] = tile_n0 + 4 * (e - ml[u] * w4);
      ok[u] = e < total && n[u] < np;
      src[u] = reinterpret_cast<const float4*>(p.ws + (size_t)blockIdx.z * slab + (size_t)(ok[u] ? ml[u] : 0) * np +
                                               (ok[u] ? n[u] : 0));
      sum[u] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll 4
    for (int s = 0; s < splits; ++s) {
#pragma unroll
      for (int u = 0; u < V; ++u) {
        add_to(sum[u], __ldcg(src[u] + s * (stride >> 2)));
      }
    }
#pragma unroll
    for (int u = 0; u < V; ++u) {
      if (!ok[u]) continue;
      uint16_t* dst = p.y + (size_t)(m0 + ml[u]) * p.N + n[u];
      const float f[4] = {sum[u].x, sum[u].y, sum[u].z, sum[u].w};
#pragma unroll
      for (int c = 0; c < 4; ++c)
        if (n[u] + c < p.N) dst[c] = from_f32<BF16>(f[c]);
    }
  }
}

// The wgmma kernel's producer warpgroup in the epilogue: it holds no accumulators and its registers were given to
// the consumers (setmaxnreg), so it only meets the epilogue's two CTA barriers (split K).
DEVI void epilogue_barriers() {
  if (gridDim.y > 1) {
    __syncthreads();
    __syncthreads();
  }
}

// A warp's place in the grid of the mma kernels (mma_small, mma_xs): x = CTAs of nwarps warps of TN 16-row tiles
// (this warp's first: tn0), y = K splits of p.kbps blocks (this one: nb blocks from kb0), z = batch tiles of 8 NT
// rows (this one: mc rows from m0).
template <int NT, int TN>
struct MmaPlace {
  int lane, warp, nwarps, g, n16, tn0, kb0, nb, m0, mc;
  DEVI explicit MmaPlace(const Args& p)
      : lane(threadIdx.x & 31), warp(threadIdx.x >> 5), nwarps(blockDim.x >> 5), g(lane >> 2),
        n16((p.N + 15) >> 4), tn0((blockIdx.x * nwarps + warp) * TN), kb0(blockIdx.y * p.kbps),
        nb(min(p.KB, kb0 + p.kbps) - kb0), m0(blockIdx.z * (8 * NT)), mc(min(8 * NT, p.M - m0)) {}
};

// One 64-k block of a warp's TN tiles, from the ring slot being read, into acc (the mma kernels' arithmetic).
// POST: one group per block; the block's fp32 sums of (q - z) x are scaled once into acc. Else one group per k16
// step, whose scale is applied to the 16-bit fragment. lds[j] + xoff: the ldmatrix row address of batch tile j
// at the block's first k.
template <int NT, bool BF16, bool POST, int TN, class R>
DEVI void mma_block(float (&acc)[TN][NT][4], const R& ws, int g, const uint32_t (&lds)[NT], uint32_t xoff) {
  uint4 wv[TN];
  uint32_t sc0[TN];
  RowConst rc[TN];
#pragma unroll
  for (int u = 0; u < TN; ++u) {
    wv[u] = ws.weights(u);
    sc0[u] = ws.scale(0, u);
    rc[u] = row_const<BF16>(sc0[u], ws.zero(0, u), g);
  }
  float accb[TN][NT][4];
  if constexpr (POST) {
#pragma unroll
    for (int u = 0; u < TN; ++u)
#pragma unroll
      for (int j = 0; j < NT; ++j) accb[u][j][0] = accb[u][j][1] = accb[u][j][2] = accb[u][j][3] = 0.f;
  }
  uint32_t bx[NT][4];
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    if (s % 2 == 0) {
#pragma unroll
      for (int j = 0; j < NT; ++j) ldsm_x4(bx[j], lds[j] + xoff + s * 32);
    }
#pragma unroll
    for (int u = 0; u < TN; ++u) {
      if constexpr (!POST) {
        if (s > 0) rc[u] = row_const<BF16>(ws.scale(s, u), ws.zero(s, u), g);
      }
      uint32_t a[4];
      dequant<BF16, !POST>(word(wv[u], s), rc[u], a);
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        if constexpr (POST) {
          mma16816<BF16>(accb[u][j], a, bx[j][(s & 1) * 2], bx[j][(s & 1) * 2 + 1]);
        } else {
          mma16816<BF16>(acc[u][j], a, bx[j][(s & 1) * 2], bx[j][(s & 1) * 2 + 1]);
        }
      }
    }
  }
  if constexpr (POST) {
#pragma unroll
    for (int u = 0; u < TN; ++u) {
      const float s0 = to_f32<BF16>(sc0[u] & 0xFFFFu), s1 = to_f32<BF16>(sc0[u] >> 16);
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        acc[u][j][0] = fmaf(s0, accb[u][j][0], acc[u][j][0]);
        acc[u][j][1] = fmaf(s0, accb[u][j][1], acc[u][j][1]);
        acc[u][j][2] = fmaf(s1, accb[u][j][2], acc[u][j][2]);
        acc[u][j][3] = fmaf(s1, accb[u][j][3], acc[u][j][3]);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Small-batch kernel (sm_80+): mma.sync m16n8k16 with the weight as the A operand (16 output rows per tile, TN
// adjacent tiles per warp sharing the x fragments) and x^T as B (NT tiles of 8 batch columns). The CTA's K
// range (one split) of x is staged in shared memory once; each warp streams its weight blocks from HBM
// through its cp.async ring. Grid: (ceil(N16 / (warps TN)), splits, ceil(M / 8NT)).
// POST: scale the fp32 block sums (one group per block); else scale the 16-bit fragment per k16 step.
// Never a programmatic dependent launch (launch.py): it has no pdl_wait. A version that had one, with the first
// weight blocks issued before it and x after, measured ~30 us slower over the 70B layer at M = 16 (all D - 1
// blocks then had to land before the first mma; bench.md, sixth pass) and was reverted to this one.
// ---------------------------------------------------------------------------------------------------------
template <int NT, bool BF16, bool POST, int D, int TN, bool NULLC = false>
DEVI void mma_small(const Args& p) {
  extern __shared__ uint4 smem4[];
  constexpr int NS = POST ? 1 : 4;
  using R = Stream<D, NS, TN>;
  const MmaPlace<NT, TN> at(p);
  const int pitch = p.kbps * 64 + 8;  // halves; +16 bytes so the 8 rows of an ldmatrix hit 8 bank groups
  const uint32_t xs_base = smem_u32(smem4);
  const uint32_t ring_base = xs_base + ((min(8 * NT, p.M) * pitch * 2 + 127) & ~127);
  R ws(p, ring_base + at.warp * R::BYTES_PER_WARP, at.lane, at.tn0, at.n16, at.kb0);

  {  // stage x[m0 : m0 + mc, 64 kb0 : 64 (kb0 + nb)] (zero beyond K): commit group 0
    const int cpr = at.nb * 8;
    const int total = at.mc * cpr;
    for (int c = threadIdx.x; c < total; c += blockDim.x) {
      const int r = c / cpr, q = c - r * cpr;
      const int k = at.kb0 * 64 + q * 8;
      const bool v = k < p.K;
      cp_async16(xs_base + (r * pitch + q * 8) * 2, p.x + (size_t)(at.m0 + r) * p.K + (v ? k : 0), v);
    }
    cp_commit();
  }
  const bool active = ws.ntiles > 0;
#pragma unroll
  for (int d = 0; d < D - 1; ++d) {  // groups 1 .. D-1: the first D-1 blocks
    if (active && d < at.nb) ws.issue();
    cp_commit();
  }

  float acc[TN][NT][4];
#pragma unroll
  for (int u = 0; u < TN; ++u)
#pragma unroll
    for (int j = 0; j < NT; ++j) acc[u][j][0] = acc[u][j][1] = acc[u][j][2] = acc[u][j][3] = 0.f;

  // ldmatrix.x4: lanes 8i..8i+7 give the rows of matrix i; matrices = (k 0-7, k 8-15) of steps s and s+1.
  uint32_t lds[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    int r = 8 * j + (at.lane & 7);
    if (r >= at.mc) r = 0;  // batch columns past M: any valid row (their outputs are never stored)
    const int mat = at.lane >> 3;
    lds[j] = xs_base + (r * pitch + (mat & 1) * 8 + (mat >> 1) * 16) * 2;
  }

  cp_wait<D - 1>();  // group 0 (x) has landed for this thread's copies ...
  __syncthreads();   // ... and for everyone's

  if (active) {
    for (int i = 0; i < at.nb; ++i) {
      if (i + D - 1 < at.nb) ws.issue();
      cp_commit();
      cp_wait<D - 1>();  // block i's slot is complete (this lane's copies) ...
      __syncwarp();      // ... and the metadata the warp's lanes copied
      if constexpr (NULLC) {  // benchmarks only: the same stream with no arithmetic (a bandwidth probe)
#pragma unroll
        for (int u = 0; u < TN; ++u) {
          const uint4 wv = ws.weights(u);
          const uint32_t sc0 = ws.scale(0, u);
          const RowConst rc = row_const<BF16>(sc0, ws.zero(0, u), at.g);
          acc[u][0][0] += __uint_as_float((wv.x ^ wv.y ^ wv.z ^ wv.w ^ sc0 ^ rc.nz0) & 0x3FFFFFu);
        }
      } else {
        mma_block<NT, BF16, POST>(acc, ws, at.g, lds, i * 128);
      }
      ws.next();
    }
  }
  cp_wait<0>();
  epilogue<NT, BF16, TN>(p, acc, at.tn0 * 16, at.m0, at.mc, blockIdx.x * at.nwarps * TN * 16, at.nwarps * TN * 16,
                         blockDim.x);
}

// ---------------------------------------------------------------------------------------------------------
// Small-batch kernel with x streamed (sm_80+): mma_small's warps and weight rings (POST: one group per 64-k
// block), but x goes through a ring of XS chunks of XC blocks in shared memory instead of being staged for the
// CTA's whole K slice before the first mma. So the K slice is not bounded by shared memory, and a grid of about
// one CTA per SM can own whole tiles (no split, no partials) or a few long K slices, each warp streaming one
// contiguous run of its tile: the shape the stream-K kernel uses at M = 1, for batches whose x (16 rows of all
// of K) is too large to stage whole. A barrier per chunk keeps the warps within XS - 1 chunks of each other;
// the weight rings run across it. Grid: (ceil(N16 / (warps TN)), splits, ceil(M / 8NT)).
// cp.async groups: the prologue is one group (the first D - 1 weight blocks and the first XS - 1 x chunks) and
// D - 2 empty ones; iteration i commits weights i + D - 1, and at a chunk start the chunk XS - 1 ahead. Waiting
// for block i's weights (D - 2 younger groups, before iteration i's commit) then also covers chunk i / XC, which
// was committed (XS - 1) XC >= D - 1 iterations earlier.
// Launched as a programmatic dependent launch or not (launch.py): its weights before the wait, x and y after it.
// PROBE (benchmarks only, wrong results): 1 = the same streams and barriers with no arithmetic, 2 = the full
// arithmetic with no barriers (chunk slots overwritten while read), 3 = the arithmetic on chunk 0 only (no x
// stream, no barriers)
// ---------------------------------------------------------------------------------------------------------
template <int NT, bool BF16, int D, int TN, int XC, int XS, int PROBE = 0>
DEVI void mma_xs(const Args& p) {
  static_assert((XS - 1) * XC >= D - 1, "a chunk lands no later than the weights of its first block");
  extern __shared__ uint4 smem4[];
  using R = Stream<D, 1, TN>;
  constexpr int XP = XC * 64 + 8;  // pitch in halves; +16 bytes so the 8 rows of an ldmatrix hit 8 bank groups
  constexpr int XSLOT = 8 * NT * XP * 2;
  const MmaPlace<NT, TN> at(p);
  const uint32_t xs_base = smem_u32(smem4);
  R ws(p, xs_base + XS * XSLOT + at.warp * R::BYTES_PER_WARP, at.lane, at.tn0, at.n16, at.kb0);
  const bool active = ws.ntiles > 0;

  pdl_start(p.flags);
#pragma unroll
  for (int d = 0; d < D - 1; ++d)
    if (active && d < at.nb) ws.issue();
  pdl_wait(p.flags);

  // A chunk is mc rows of XC x 8 16-byte pieces; this thread's first piece (row r0, piece q0) is worked out once
  // (with 8 x NT x XC x 8 <= threads, the only one), the rest per chunk.
  const int r0 = threadIdx.x / (XC * 8), q0 = threadIdx.x % (XC * 8);
  const uint16_t* xg0 = p.x + (size_t)(at.m0 + min(r0, at.mc - 1)) * p.K + at.kb0 * 64 + q0 * 8;
  const uint32_t xo0 = (r0 * XP + q0 * 8) * 2;
  auto load_x = [&](int c) {  // chunk c of the K slice (zero beyond K) into slot c % XS
    const uint32_t st = xs_base + (c % XS) * XSLOT;
    const int kc = (at.kb0 + c * XC) * 64;
    if (r0 < at.mc) {
      const bool v = kc + q0 * 8 < p.K;
      cp_async16(st + xo0, v ? xg0 + c * XC * 64 : p.x, v);
    }
    for (int e = threadIdx.x + blockDim.x; e < at.mc * XC * 8; e += blockDim.x) {
      const int r = e / (XC * 8), q = e - r * (XC * 8);
      const int k = kc + q * 8;
      const bool v = k < p.K;
      cp_async16(st + (r * XP + q * 8) * 2, p.x + (size_t)(at.m0 + r) * p.K + (v ? k : 0), v);
    }
  };
  const int nchunks = (at.nb + XC - 1) / XC;
#pragma unroll
  for (int c = 0; c < XS - 1; ++c)
    if (c < nchunks && (PROBE != 3 || c == 0)) load_x(c);
#pragma unroll
  for (int d = 0; d < D - 1; ++d) cp_commit();

  float acc[TN][NT][4];
#pragma unroll
  for (int u = 0; u < TN; ++u)
#pragma unroll
    for (int j = 0; j < NT; ++j) acc[u][j][0] = acc[u][j][1] = acc[u][j][2] = acc[u][j][3] = 0.f;

  // ldmatrix.x4 row addresses within a slot: lanes 8i..8i+7 give the rows of matrix i; matrices = (k 0-7,
  // k 8-15) of steps s and s+1.
  uint32_t lds[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    int r = 8 * j + (at.lane & 7);
    if (r >= at.mc) r = 0;  // batch columns past M: any valid row (their outputs are never stored)
    const int mat = at.lane >> 3;
    lds[j] = (r * XP + (mat & 1) * 8 + (mat >> 1) * 16) * 2;
  }

  // One chunk per iteration, its XC blocks unrolled (the block's place in the chunk is then a constant).
  for (int chunk = 0; chunk < nchunks; ++chunk) {
    if constexpr (PROBE != 3) {
      cp_wait<D - 2>();  // the chunk's first block's weights and the chunk (this thread's copies) ...
      if constexpr (PROBE != 2) __syncthreads();  // ... everyone's; every warp is done with the previous slot
      if (chunk + XS - 1 < nchunks) load_x(chunk + XS - 1);
    }
    const uint32_t xrow = xs_base + (PROBE == 3 ? 0 : (chunk % XS) * XSLOT);
#pragma unroll
    for (int ib = 0; ib < XC; ++ib) {
      const int i = chunk * XC + ib;
      if (i >= at.nb) break;  // the same for the whole CTA
      if (active && i + D - 1 < at.nb) ws.issue();
      cp_commit();
      cp_wait<D - 1>();  // block i's slot is complete (this lane's copies) ...
      __syncwarp();      // ... and the metadata the warp's lanes copied
      if (PROBE == 1 && active) {
#pragma unroll
        for (int u = 0; u < TN; ++u) {
          const uint4 wv = ws.weights(u);
          acc[u][0][0] += __uint_as_float((wv.x ^ wv.y ^ wv.z ^ wv.w ^ ws.scale(0, u) ^ ws.zero(0, u).x) & 0x3FFFFFu);
        }
      } else if (active) {
        mma_block<NT, BF16, true>(acc, ws, at.g, lds, xrow + ib * 128);
      }
      ws.next();
    }
  }
  cp_wait<0>();
  constexpr int V = TN == 1 ? 2 : 4;  // float4s per thread per pass of the split-K sum: 80 registers at TN = 1
  epilogue<NT, BF16, TN, V>(p, acc, at.tn0 * 16, at.m0, at.mc, blockIdx.x * at.nwarps * TN * 16,
                            at.nwarps * TN * 16, blockDim.x);
}

// Among the four lanes t = 0..3 of a row group: lane t's v[e] becomes lane e's v[t] (two butterfly rounds: in
// round m, a lane swaps with lane t ^ m the elements whose bit m differs from its own).
DEVI void transpose4(uint32_t& v0, uint32_t& v1, uint32_t& v2, uint32_t& v3, int t) {
  uint32_t* v[4] = {&v0, &v1, &v2, &v3};
#pragma unroll
  for (int m = 1; m <= 2; m <<= 1) {
    const bool hi = t & m;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (e & m) continue;
      const int e1 = e | m;  // the pair (e, e1): the lane keeps v[e] (hi: v[e1]) and takes its partner's other
      const uint32_t send = hi ? *v[e] : *v[e1];
      const uint32_t recv = __shfl_xor_sync(0xffffffffu, send, m);
      if (hi) {
        *v[e] = recv;
      } else {
        *v[e1] = recv;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Small-batch kernel with x held in registers (sm_80+, M <= 8 NT, one group per 64-k block or coarser): the work
// is cut along K first. A CTA of NW warps covers one "K group" of NW x R blocks, each warp R of them, and holds
// that x as mma B fragments in registers (R blocks x 4 k16 steps x NT x 2 words a lane, loaded once); it then
// walks units of T tiles, every warp streaming its R blocks of each tile (R x 512 contiguous bytes) through its
// cp.async ring. A weight word then meets x with no shared-memory read of x, no x stream and no CTA barrier: the
// dequantization and NT mmas. On Llama-3-70B gate/up at M = 16 the steady state runs within 1-2 us of the bare
// weight stream; each call pays ~5 us more than the stream once: the x load and the first unit's arithmetic
// before the ring moves, the last unit and the K groups' sums after it (benchmarks/results/bench.md, twelfth and
// thirteenth passes). Timed per warp (probe 12, fourteenth pass): x's load alone, every SM loading 128 KB of the
// same lines at once, took 4-7 us of a 18-47 us call before it went ahead of the ring's copies (3-4.5 us now).
// BIAS: the words enter the mmas biased (biased(): four LOP3s a word) and each group's fp32 sums are corrected by
// (bias + z) x the group's sum of x, made once per K group (mmas with an A of ones at the x load).
// CL (sm_90a, exactly two K groups): a cluster of 2 CTAs, rank r = K group r of one range of tile units; rank 1's
// sums of each unit go to rank 0's shared memory (distributed shared memory, remote mbarrier arrivals), rank 0
// adds them and stores y: no workspace, no counters, the same bits.
// The warps' fp32 partial sums of a unit meet in shared memory: S slots of [NW][T][NT][32 lanes] float4, each with
// a "full" mbarrier (lane 0 of every warp arrives) and an "empty" one. Warp f % NW sums the CTA's f-th unit in
// warp order L units later (so it seldom waits) and stores y, or, with several K groups, its K group's fp32
// partials to the workspace; after its loop each warp counts its units in, and the last K group of a unit to
// arrive sums its tiles' partials in K-group order (deterministic) and re-arms the unit's counter.
// (Summing by the last warp to arrive instead of a fixed warp made the slowest warp slower still; counting in
// within the loop put a fence, which waits for the ring's copies in flight, on the summing warp: both much
// slower, eleventh pass.)
// Work: units (K group kg, T tiles), kg-major, cut into one equal contiguous range per CTA (a persistent grid); a
// CTA whose range crosses into the next K group reloads its x registers there. The last unit of a K group may
// hold tiles past N: they copy the unit's first tile again and are never stored.
// Shared: the rings (NW x D slots of T x {R x 512 bytes of weights, R 48-byte records}, BIAS: each followed by
// the warp's sums of x), the S partial slots, 2 S mbarriers, then CL: S2 slots of rank 1's sums and 2 S2
// mbarriers. Workspace: ws [G][N16][32][NT] float4, cnt [units per K group]. The group of a block is found
// by a shift; GB = blocks per group inside a warp's range (min(R, group / 64), both powers of two): a record per
// GB blocks.
// PROBE (benchmarks only, wrong results): 1 = the same streams and hand-over with no arithmetic, 2 = the
// arithmetic with no hand-over, 3 = the full kernel with x never loaded (constant fragments), 4 = the finishing
// warp reads one warp's partial instead of summing all, 5 = the hand-over without its waits, 7 = the
// dequantization without the mmas (the fragments folded into the sums by LOP3s), 10 = the K groups' sums not
// summed (each K group stores its own as y), 12 = the full kernel (right results) that also writes each warp's
// timeline to the workspace past the partials: 16 u64 a warp (stamp_at)
// ---------------------------------------------------------------------------------------------------------
template <bool BF16, int NT, int R, int D, int S = 4, int L = 2, int PROBE = 0, int T = 1, bool BIAS = false,
          bool CL = false>
DEVI void xr_small(const Args& p) {
  static_assert(L < S && (!CL || (L >= 2 && L + 1 < S)), "a unit's partial slot is summed before it is reused");
  static_assert(!BIAS || (NT == 2 && (PROBE == 0 || PROBE == 10 || PROBE == 12)), "the biased form: two batch tiles");
  static_assert(!CL || PROBE == 0 || PROBE == 12, "no probes of the cluster form but the timeline");
  constexpr int S2 = 4;  // CL: remote partial slots (rank 1 runs at most S2 units ahead of rank 0)
  constexpr int META = 48, TS = R * (512 + META), SLOT = T * TS;
  extern __shared__ uint4 smem4[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int n16 = (p.N + 15) >> 4, ntu = (n16 + T - 1) / T;  // tiles; units of T tiles per K group
  const long long units = (long long)((p.KB + nw * R - 1) / (nw * R)) * ntu;  // K groups x units of T tiles
  // CL (exactly two K groups): a cluster of 2 CTAs takes one range of tile units, rank r its K group r, so the
  // two K groups' sums meet in rank 0's shared memory; else one range of units per CTA
  const int crank = CL ? (int)cluster_rank() : 0;
  const int ncl = CL ? (int)(gridDim.x >> 1) : (int)gridDim.x, cid = CL ? (int)cluster_index() : (int)blockIdx.x;
  const long long cu = CL ? ntu : units;  // units the ranges cut
  const int u0 = (int)(cid * cu / ncl) + crank * ntu, n = (int)((cid + 1) * cu / ncl) - (int)(cid * cu / ncl);
  const uint32_t base = smem_u32(smem4);
  // BIAS: each warp's ring is followed by its sums of x over each group of its blocks, [R groups][4 t][j 0, 1]
  // [2 columns] floats (at ring_end, a register the loop keeps anyway: r 8 is at 255 registers)
  constexpr int XS = BIAS ? R * 64 : 0;
  const uint32_t ring = base + warp * (D * SLOT + XS), ring_end = ring + D * SLOT, xsum = ring_end;
  const uint32_t pslot = nw * T * NT * 512;           // bytes of one partial slot: [nw][T][NT][32 lanes] float4
  const uint32_t part = base + nw * (D * SLOT + XS);  // S partial slots
  const uint32_t full = part + S * pslot, empty = full + S * 8;  // per slot: "full" and "empty" mbarriers
  // CL: S2 slots of rank 1's sums of a unit ([T][NT][32 lanes] float4) in rank 0, their "full" mbarriers (in rank
  // 0, arrived on by rank 1's finishing lanes) and "empty" ones (in rank 1, arrived on by rank 0's)
  const uint32_t rslot = empty + S * 8, rfull = rslot + S2 * (T * NT * 512), rempty = rfull + S2 * 8;
  const int lgb = min(max(p.gshift - 6, 0), 31 - __clz(R));  // log2 GB
  // PROBE 12: warp w's record at ws + G N16 32 NT float4s + 128 w bytes: u64 [0..5] %globaltimer (ns, one clock
  // for every SM) and [6..11] clock64 (this SM's cycles) at entry, after pdl_wait, with the first x in registers,
  // after the first unit, after the loop, at exit; [12] %smid, [13] units, [14] a value made from every x word
  // (so the x stamp waits for the loads); lane 0 writes
  // (the address made at each use from the arguments: a register kept for it spilled the cluster form)
  auto stamps = [&]() {
    return reinterpret_cast<uint64_t*>(reinterpret_cast<float4*>(p.ws) + (size_t)(units / ntu) * n16 * 32 * NT) +
           ((size_t)blockIdx.x * nw + warp) * 16;
  };
  auto stamp_at = [&](int k) {
    if constexpr (PROBE == 12) {
      uint64_t gt, ck;
      asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(gt) :: "memory");
      asm volatile("mov.u64 %0, %%clock64;\n" : "=l"(ck) :: "memory");
      if (lane == 0) {
        stamps()[k] = gt;
        stamps()[6 + k] = ck;
      }
    }
  };
  stamp_at(0);

  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < S; ++s) {
      mbar_init(full + s * 8, nw);
      mbar_init(empty + s * 8, 1);
    }
    if constexpr (CL) {
#pragma unroll
      for (int s = 0; s < S2; ++s) {
        mbar_init(rfull + s * 8, 32);
        mbar_init(rempty + s * 8, 32);
      }
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // before the other CTA arrives
    }
  }
  // CL: the cluster barrier that publishes both CTAs' mbarriers is split: arrived at here, waited for once x is
  // loaded (before the first mbarrier is used), so that its round trip does not hold up x's loads
  if constexpr (CL) cluster_arrive();
  pdl_start(p.flags);

  // Producer side of the ring, by running pointers (recomputed per unit, the addresses took about a quarter of the
  // first version's 572 instructions per warp and unit; ncu-v11-h200.txt): this lane's next weight piece and
  // record piece, advanced one tile per unit and reset at each K group. A warp whose range runs past K copies its
  // last in-range block again for the missing ones (x is 0 there, so they add 0 and the loop needs no bounds); a
  // warp wholly past K copies nothing and computes nothing.
  const uint4* wsrc = nullptr;
  const char* msrc = nullptr;
  int itile = u0 % ntu, ikg = u0 / ntu, inb = 0;  // the producer's unit of T tiles and K group
  const int rec = lane / 3, prt = lane - 3 * rec;  // lanes < 3 R / GB: piece prt of record rec
  const bool mlane = rec < (R >> lgb);
  auto k_group = [&]() {  // the producer enters K group ikg at tile itile
    const int kb0 = (ikg * nw + warp) * R;
    inb = min(R, p.KB - kb0);
    const int kbr = min(kb0 + (mlane ? rec << lgb : 0), p.KB - 1);  // the record's first block (clamped)
    const int grp = min((kbr * 64) >> p.gshift, p.NG - 1);
    wsrc = p.qw + ((size_t)itile * T * p.KB + kb0) * 32 + lane;
    msrc = prt < 2 ? (const char*)(p.msc + ((size_t)itile * T * p.NG + grp) * 8 + prt * 4)
                   : (const char*)(p.mzp + (size_t)itile * T * p.NG + grp);
  };
  const size_t wstep = (size_t)p.KB * 32, mstep = (size_t)p.NG * (prt < 2 ? 32 : 16);  // one tile further
  k_group();
  uint32_t fill = ring;
  auto issue = [&](bool copy) {  // the slot advances either way, so that the slot to read is always `fill`
    if (copy && inb > 0) {
      const uint64_t pol = l2_policy(p.flags & QT_EVICT_FIRST);
#pragma unroll
      for (int tt = 0; tt < T; ++tt) {
        // a unit's tiles past N (the last unit of a K group, N16 % T != 0) copy its first tile again
        const bool in = tt == 0 || itile * T + tt < n16;
        const uint4* ws = in ? wsrc + tt * wstep : wsrc;
        const char* ms = in ? msrc + tt * mstep : msrc;
        const uint32_t dst = fill + tt * TS;
        if (inb == R) {
#pragma unroll
          for (int b = 0; b < R; ++b) cp_async16_hint(dst + b * 512 + lane * 16, ws + b * 32, pol);
        } else {
#pragma unroll
          for (int b = 0; b < R; ++b) cp_async16_hint(dst + b * 512 + lane * 16, ws + min(b, inb - 1) * 32, pol);
        }
        if (mlane) cp_async16(dst + R * 512 + rec * META + prt * 16, ms, true);
      }
    }
    if (++itile == ntu) {
      itile = 0;
      ++ikg;
      k_group();
    } else {
      wsrc += T * wstep;
      msrc += T * mstep;
    }
    fill = fill + SLOT == ring_end ? ring : fill + SLOT;
  };
#pragma unroll
  for (int d = 0; d < D - 1; ++d) {  // groups 0 .. D-2: the first units (no earlier kernel writes them)
    issue(d < n);
    cp_commit();
  }
  pdl_wait(p.flags);  // x, y and the workspace come after the previous kernel
  stamp_at(1);
  if constexpr (!CL) __syncthreads();  // the mbarriers' initialization

  // x as B fragments: lane (g, t) of batch tile j holds x[8 j + g][k + 2t, k + 2t + 1] and [k + 2t + 8, + 9] for
  // each k16 step k of its R blocks (rows past M and k past K: 0)
  uint32_t xb[R][4][NT][2];
  auto load_x = [&](int kg) {
    if constexpr (PROBE == 3) {
#pragma unroll
      for (int b = 0; b < R; ++b)
#pragma unroll
        for (int s = 0; s < 4; ++s)
#pragma unroll
          for (int j = 0; j < NT; ++j) xb[b][s][j][0] = xb[b][s][j][1] = 0x3C003C00u ^ (lane * 0x10001u) ^ kg;
      return;
    }
    // Lane t of a row loads the row's 16-byte chunks t and t + 4 of each block (words 4t..4t+3, 16+4t..16+4t+3)
    // and the row's four lanes transpose them (transpose4), so that lane t holds words t, 4+t, .. 28+t: its
    // fragments. Four-byte loads of the fragments themselves (64 a lane, each warp load touching 8 rows' lines)
    // drew 13 % of the warps' stall samples (Nsight Compute, eleventh pass in benchmarks/results/bench.md).
    const int k0 = (kg * nw + warp) * R * 64 + 8 * t;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int row = 8 * j + g;
      const uint16_t* xr = p.x + (size_t)min(row, p.M - 1) * p.K;
#pragma unroll
      for (int b = 0; b < R; ++b)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int k = k0 + b * 64 + c * 32;
          uint4 v = make_uint4(0u, 0u, 0u, 0u);
          if (row < p.M && k < p.K) v = *reinterpret_cast<const uint4*>(xr + k);
          xb[b][2 * c][j][0] = v.x;
          xb[b][2 * c][j][1] = v.y;
          xb[b][2 * c + 1][j][0] = v.z;
          xb[b][2 * c + 1][j][1] = v.w;
        }
    }
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int b = 0; b < R; ++b)
#pragma unroll
        for (int c = 0; c < 2; ++c) transpose4(xb[b][2 * c][j][0], xb[b][2 * c][j][1], xb[b][2 * c + 1][j][0],
                                               xb[b][2 * c + 1][j][1], t);
    if constexpr (BIAS) {
      // The sums of x over each group of the warp's blocks, per batch row, for the zero-point correction: mmas
      // with an A of ones leave them in the accumulator layout (lane (g, t): rows 8 j + 2 t, + 1 in c[0], c[1]),
      // the fp16 products exact and summed in fp32, once per K group instead of per unit.
      const uint32_t ONES = BF16 ? 0x3F803F80u : 0x3C003C00u;
      const uint32_t ones[4] = {ONES, ONES, ONES, ONES};
      const int gm = (1 << lgb) - 1;
      __syncwarp();  // the lanes' reads of the previous K group's sums (compute) are done
#pragma unroll
      for (int j = 0; j < NT; ++j) {  // one batch tile at a time (r 8 is near 255 registers)
        float sx[4][4];  // four independent chains (one per k16 step), so the group's mmas overlap
#pragma unroll
        for (int b = 0; b < R; ++b) {
          if ((b & gm) == 0) {
#pragma unroll
            for (int s = 0; s < 4; ++s) sx[s][0] = sx[s][1] = sx[s][2] = sx[s][3] = 0.f;
          }
#pragma unroll
          for (int s = 0; s < 4; ++s) mma16816<BF16>(sx[s], ones, xb[b][s][j][0], xb[b][s][j][1]);
          if ((b & gm) == gm && g == 0)
            asm volatile("st.shared.v2.f32 [%0], {%1,%2};\n" ::"r"(xsum + (b >> lgb) * 64 + t * 16 + j * 8),
                         "f"((sx[0][0] + sx[1][0]) + (sx[2][0] + sx[3][0])),
                         "f"((sx[0][1] + sx[1][1]) + (sx[2][1] + sx[3][1])) : "memory");
        }
      }
      __syncwarp();  // the sums before any lane reads them
    }
  };

  const int G = (int)(units / ntu);  // K groups
  auto store_y = [&](int tile, const float4 (&v)[NT]) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const float e4[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = tile * 16 + g + (e >> 1) * 8, ml = 8 * j + 2 * t + (e & 1);
        if (ml < p.M && row < p.N) p.y[(size_t)ml * p.N + row] = from_f32<BF16>(e4[e]);
      }
    }
  };

  // the finishing warp's part: unit f's partials summed in warp order, then y, or with several K groups this
  // K group's fp32 partials in the workspace (ws [G][N16][32][NT] float4)
  auto finish = [&](int f) {
    const int slot = f % S;
    if constexpr (PROBE != 5) mbar_wait(full + slot * 8, (f / S) & 1);  // every warp's partial of unit f
    float4 sum[T][NT];
    const uint32_t src = part + slot * pslot + lane * 16;
#pragma unroll
    for (int c = 0; c < T * NT; ++c) sum[c / NT][c % NT] = lds_f4(src + c * 512);
    for (int w = 1; w < (PROBE == 4 ? 1 : nw); ++w) {
#pragma unroll
      for (int c = 0; c < T * NT; ++c) add_to(sum[c / NT][c % NT], lds_f4(src + (w * T * NT + c) * 512));
    }
    __syncwarp();  // the lanes' loads above are done with the slot before lane 0 releases it
    if (lane == 0) mbar_arrive(empty + slot * 8);
    const int u = u0 + f;
    if constexpr (CL) {  // rank 1 hands its sums to rank 0, which adds them to its own (K group 0 + 1) and stores y
      const int rs = f % S2;
      const uint32_t rsrc = rslot + rs * (T * NT * 512) + lane * 16;
      if (crank == 1) {
        if (f >= S2) mbar_wait_cluster(rempty + rs * 8, ((f / S2) - 1) & 1);  // rank 0 has read unit f - S2
        const uint32_t dst = cluster_map(rsrc, 0);
#pragma unroll
        for (int c = 0; c < T * NT; ++c) st_cluster_f4(dst + c * 512, sum[c / NT][c % NT]);
        mbar_arrive_cluster(cluster_map(rfull + rs * 8, 0));  // each lane releases its own stores
        return;
      }
      mbar_wait_cluster(rfull + rs * 8, (f / S2) & 1);
#pragma unroll
      for (int c = 0; c < T * NT; ++c) add_to(sum[c / NT][c % NT], lds_f4(rsrc + c * 512));
      mbar_arrive_cluster(cluster_map(rempty + rs * 8, 1));  // after this lane's reads
    }
#pragma unroll
    for (int tt = 0; tt < T; ++tt) {
      const int tile = (u % ntu) * T + tt;
      if (T > 1 && tile >= n16) break;
      if (CL || G == 1 || PROBE == 10) {
        store_y(tile, sum[tt]);
      } else {  // this K group's partial; counted and summed after the loop (tail)
        float4* ws = reinterpret_cast<float4*>(p.ws) + ((size_t)(u / ntu) * n16 + tile) * 32 * NT + lane * NT;
#pragma unroll
        for (int j = 0; j < NT; ++j) __stcg(ws + j, sum[tt][j]);
      }
    }
  };

  // One unit's sums from the slot at `read`, with GB blocks per group: acc = sum over groups of scale x (the
  // group's fp32 sums of (q - z) x). The record of group r is at read + R * 512 + r * META.
  auto compute = [&](auto gbc, uint32_t read, float (&acc)[NT][4]) {
    constexpr int GB = decltype(gbc)::value;
#pragma unroll
    for (int r = 0; r < R / GB; ++r) {
      const uint32_t rp = read + R * 512 + r * META;
      uint32_t sc;
      uint2 zp;
      asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(sc) : "r"(rp + g * 4));
      asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];\n" : "=r"(zp.x), "=r"(zp.y) : "r"(rp + 32));
      [[maybe_unused]] RowConst rc;
      if constexpr (!BIAS) rc = row_const<BF16>(sc, zp, g);
      float accb[NT][4];
#pragma unroll
      for (int j = 0; j < NT; ++j) accb[j][0] = accb[j][1] = accb[j][2] = accb[j][3] = 0.f;
#pragma unroll
      for (int bb = 0; bb < GB; ++bb) {
        const int b = r * GB + bb;
        uint4 wv;
        asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(wv.x), "=r"(wv.y), "=r"(wv.z), "=r"(wv.w)
                     : "r"(read + b * 512 + lane * 16));
        if constexpr (PROBE == 1) {
          accb[0][b & 3] += __uint_as_float((wv.x ^ wv.y ^ wv.z ^ wv.w ^ rc.nz0 ^ rc.s1) & 0x3FFFFFu);
        } else {
#pragma unroll
          for (int s = 0; s < 4; ++s) {
            uint32_t a[4];
            if constexpr (BIAS) {
              biased<BF16>(word(wv, s), a);
            } else {
              dequant<BF16, false>(word(wv, s), rc, a);
            }
            if constexpr (PROBE == 7) {  // no mma: the fragments folded into the sums by LOP3s
#pragma unroll
              for (int j = 0; j < NT; ++j)
                accb[j][s] =
                    __uint_as_float(__float_as_uint(accb[j][s]) ^ a[0] ^ a[1] ^ a[2] ^ a[3] ^ xb[b][s][j][0]);
            } else {
#pragma unroll
              for (int j = 0; j < NT; ++j) mma16816<BF16>(accb[j], a, xb[b][s][j][0], xb[b][s][j][1]);
            }
          }
        }
      }
      float s0 = to_f32<BF16>(sc & 0xFFFFu), s1 = to_f32<BF16>(sc >> 16);
      if constexpr (BIAS) {
        // accb = sum (bias + q) x (rows g), (bias + 16 q) x (rows g + 8, fp16): remove (bias + z) sum x (as
        // sk_small does), and s1 / 16 undoes the high nibble's factor 16 (a power of two, exact)
        const float z0 = (float)((zp.x >> (4 * g)) & 15u), z1 = (float)((zp.y >> (4 * g)) & 15u);
        const float c0 = BF16 ? 128.f + z0 : 1024.f + z0, c1 = BF16 ? 128.f + z1 : 1024.f + 16.f * z1;
        if constexpr (!BF16) s1 *= 0.0625f;
#pragma unroll
        for (int j = 0; j < NT; ++j) {  // batch rows 8 j + 2 t, + 1
          float2 xs;
          asm volatile("ld.shared.v2.f32 {%0,%1}, [%2];\n" : "=f"(xs.x), "=f"(xs.y)
                       : "r"(xsum + r * 64 + t * 16 + j * 8));
          accb[j][0] = fmaf(-c0, xs.x, accb[j][0]);
          accb[j][1] = fmaf(-c0, xs.y, accb[j][1]);
          accb[j][2] = fmaf(-c1, xs.x, accb[j][2]);
          accb[j][3] = fmaf(-c1, xs.y, accb[j][3]);
        }
      }
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        acc[j][0] = fmaf(s0, accb[j][0], acc[j][0]);
        acc[j][1] = fmaf(s0, accb[j][1], acc[j][1]);
        acc[j][2] = fmaf(s1, accb[j][2], acc[j][2]);
        acc[j][3] = fmaf(s1, accb[j][3], acc[j][3]);
      }
    }
  };

  int tile = u0 % ntu, kg = u0 / ntu;      // the unit's T tiles and K group
  bool live = (kg * nw + warp) * R < p.KB;  // this warp has blocks in K group kg
  // CL: rank 0 sums each unit one unit later, rank 1 one earlier, so rank 1's sums are usually waiting in rank
  // 0's shared memory when rank 0 needs them (the two SMs do not wait on each other unit by unit)
  const int lag = CL ? (crank == 0 ? L + 1 : L - 1) : L;
  int fw = ((-lag) % nw + nw) % nw;         // the warp that finishes unit i - lag, i.e. (i - lag) mod nw
  // The first K group's x is loaded before the loop's first ring copy is issued: at the start of a call every SM
  // loads x at once, 128 KB an SM of the same lines, and the copy queued ahead of it (L2 to SM bandwidth) held the
  // first mma back; x first took 1.5-1.75 us off q/o, gate/up and down at M = 16 (pdl_wait to x in registers
  // 4.5 -> 3.0, 7.25 -> 5.5, 5.5 -> 3.75 us; benchmarks/results/bench.md, fourteenth pass). Prefetching that
  // copy's weights into L2 meanwhile gave some of it back. (A K group entered later in the range, by one CTA
  // alone, loads its x after the copy, in the loop: one load_x site there keeps the loop's registers as they were,
  // and moving that one too spilled three of the biased kernels.)
  if (n > 0) {
    load_x(kg);
    live = (kg * nw + warp) * R < p.KB;
    if constexpr (PROBE == 12) {
      uint32_t v = 0;
#pragma unroll
      for (int b = 0; b < R; ++b)
#pragma unroll
        for (int s = 0; s < 4; ++s)
#pragma unroll
          for (int j = 0; j < NT; ++j) v ^= xb[b][s][j][0] ^ xb[b][s][j][1];
      v = __reduce_xor_sync(0xffffffffu, v);  // every lane's loads, before the stamp
      if (lane == 0) stamps()[14] = v;
      stamp_at(2);
    }
  }
  if constexpr (CL) cluster_wait();  // both CTAs' mbarriers are initialized
  for (int i = 0; i < n; ++i) {
    issue(i + D - 1 < n);  // unit i + D - 1 into the slot of unit i - 1; `fill` is now unit i's slot
    cp_commit();
    if (i > 0 && tile == 0) {  // a new K group (the same for every warp of the CTA)
      load_x(kg);
      live = (kg * nw + warp) * R < p.KB;
    }
    cp_wait<D - 1>();  // unit i's slot is complete (this lane's copies) ...
    __syncwarp();      // ... and the records the warp's lanes copied
    const int slot = i % S;
    if constexpr (PROBE != 2 && PROBE != 5) {
      if (i >= S) mbar_wait(empty + slot * 8, ((i / S) - 1) & 1);  // unit i - S's partials were summed
    }
    const uint32_t dst = part + slot * pslot + warp * (T * NT * 512) + lane * 16;
#pragma unroll
    for (int tt = 0; tt < T; ++tt) {  // each tile's sums go to the slot as soon as they are made
      float acc[NT][4];
#pragma unroll
      for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
      if (live) {  // GB = 1 << lgb as a constant (lgb <= log2 R; R is 2, 4 or 8)
        const uint32_t read = fill + tt * TS;
        if (R >= 8 && lgb >= 3) {
          compute(std::integral_constant<int, (R >= 8 ? 8 : 2)>{}, read, acc);
        } else if (R >= 4 && lgb >= 2) {
          compute(std::integral_constant<int, (R >= 4 ? 4 : 2)>{}, read, acc);
        } else if (lgb == 1) {
          compute(std::integral_constant<int, 2>{}, read, acc);
        } else {
          compute(std::integral_constant<int, 1>{}, read, acc);
        }
      }
      if constexpr (PROBE == 2) {
        // exchange nothing; the sums kept alive by a store no run takes (a NaN payload arithmetic never makes).
        // An empty asm taking them as inputs did not: ptxas dropped the arithmetic, 131 instructions a unit
        // against 434 (Nsight Compute, twelfth pass in benchmarks/results/bench.md).
        float v = 0.f;
#pragma unroll
        for (int j = 0; j < NT; ++j) v += (acc[j][0] + acc[j][1]) + (acc[j][2] + acc[j][3]);
        if (__float_as_uint(v) == 0x7FC00001u) p.y[0] = 0;
      } else {
#pragma unroll
        for (int j = 0; j < NT; ++j)
          asm volatile("st.shared.v4.f32 [%0], {%1,%2,%3,%4};\n" ::"r"(dst + (tt * NT + j) * 512), "f"(acc[j][0]),
                       "f"(acc[j][1]), "f"(acc[j][2]), "f"(acc[j][3]) : "memory");
      }
    }
    if constexpr (PROBE != 2) {
      __syncwarp();  // the lanes' stores before lane 0's arrival (a release at CTA scope)
      if (lane == 0) mbar_arrive(full + slot * 8);
      if (i >= lag && fw == warp) finish(i - lag);
      fw = fw + 1 == nw ? 0 : fw + 1;
    }
    if (++tile == ntu) {
      tile = 0;
      ++kg;
    }
    if (PROBE == 12 && i == 0) stamp_at(3);
  }
  stamp_at(4);
  if constexpr (PROBE == 12) {
    if (lane == 0) {
      uint32_t sm;
      asm volatile("mov.u32 %0, %%smid;\n" : "=r"(sm));
      stamps()[12] = sm;
      stamps()[13] = n;
    }
  }
  if constexpr (PROBE != 2) {
    for (int f = max(0, n - lag); f < n; ++f)
      if (f % nw == warp) finish(f);
  }
  cp_wait<0>();
  if constexpr (CL) cluster_sync();  // neither CTA leaves while the other may write to or arrive in its memory
  if (CL || PROBE == 2 || PROBE == 10 || G == 1) {
    stamp_at(5);
    return;
  }
  // The K-group hand-over, once per warp after its loop: a fence in the loop (a release per unit) waited for the
  // ring's copies in flight and held the finishing warp, and through the partial slots every warp, ~13 us of
  // Llama-3-70B gate/up at M = 16 (benchmarks/results/bench.md, eleventh pass). Lane l counts this warp's l-th
  // finished unit (units warp, warp + NW, ...) in; the last K group of a tile to arrive sums its G partials in
  // K-group order (deterministic) and re-arms the tile's counter.
  __syncwarp();      // the lanes' partial stores ...
  __threadfence();   // ... released before the counts below
  const int mine = n > warp ? (n - 1 - warp) / nw + 1 : 0;  // units f = warp + nw c, c < mine
  for (int c0 = 0; c0 < mine; c0 += 32) {
    int last = 0;
    const int c = c0 + lane;
    int ctile = 0;  // the unit's place in its K group (its tiles T ctile ..)
    if (c < mine) {
      ctile = (u0 + warp + nw * c) % ntu;
      last = atomicAdd(p.cnt + ctile, 1) == G - 1;
      if (last) p.cnt[ctile] = 0;  // every other K group of these tiles has arrived: safe to re-arm
    }
    unsigned todo = __ballot_sync(0xffffffffu, last);
    if (todo) {
      __syncwarp();      // the counting lanes' observations ...
      __threadfence();   // ... before every lane's reads of the other K groups' partials
    }
    while (todo) {
      const int src = __ffs(todo) - 1;
      todo &= todo - 1;
      const int tu = __shfl_sync(0xffffffffu, ctile, src);
      if constexpr (T >= 2) {
        // Two-tile units: the T tiles x G K groups of partials loaded KC K groups at a time, every load of a batch
        // in flight at once, then summed in K-group order (the same additions as one K group after the other); one
        // tile: a load per K group in turn (batching spilled the 8-block kernel at 255 registers)
        constexpr int KC = 8;  // Llama-3-70B's down has 7 K groups
        const size_t kstride = (size_t)n16 * 32 * NT;  // float4s from one K group's partials to the next
        float4 tot[T][NT];
        for (int k0 = 0; k0 < G; k0 += KC) {
          float4 v[T][KC][NT];
#pragma unroll
          for (int tt = 0; tt < T; ++tt) {
            const int tl = min(tu * T + tt, n16 - 1);  // a tile past N: any tile (never stored)
            const float4* ws = reinterpret_cast<const float4*>(p.ws) + (size_t)tl * 32 * NT + lane * NT;
#pragma unroll
            for (int kk = 0; kk < KC; ++kk)
#pragma unroll
              for (int j = 0; j < NT; ++j)
                if (k0 + kk < G) v[tt][kk][j] = __ldcg(ws + (k0 + kk) * kstride + j);
          }
#pragma unroll
          for (int tt = 0; tt < T; ++tt)
#pragma unroll
            for (int kk = 0; kk < KC; ++kk)
#pragma unroll
              for (int j = 0; j < NT; ++j) {
                if (k0 + kk == 0) {
                  tot[tt][j] = v[tt][kk][j];
                } else if (k0 + kk < G) {
                  add_to(tot[tt][j], v[tt][kk][j]);
                }
              }
        }
#pragma unroll
        for (int tt = 0; tt < T; ++tt) {
          const int tl = tu * T + tt;
          if (T > 1 && tl >= n16) break;
          store_y(tl, tot[tt]);
        }
      } else {
#pragma unroll
        for (int tt = 0; tt < T; ++tt) {
          const int tl = tu * T + tt;
          if (T > 1 && tl >= n16) break;
          const float4* ws = reinterpret_cast<const float4*>(p.ws) + (size_t)tl * 32 * NT + lane * NT;
          const size_t kstride = (size_t)n16 * 32 * NT;  // float4s from one K group's partials to the next
          float4 tot[NT];
#pragma unroll
          for (int j = 0; j < NT; ++j) tot[j] = __ldcg(ws + j);
          for (int k = 1; k < G; ++k) {
#pragma unroll
            for (int j = 0; j < NT; ++j) add_to(tot[j], __ldcg(ws + k * kstride + j));
          }
          store_y(tl, tot);
        }
      }
    }
  }
  stamp_at(5);
}

// ---------------------------------------------------------------------------------------------------------
// Stream-K kernel for the smallest batches (M <= 8, x staged whole): the weight stream as one contiguous run.
// Work unit: UB consecutive 64-k blocks of one tile (KB % UB == 0), with one group for the whole unit (group
// size a power of two >= 64 UB, or one group). The N16 x KB / UB units, tile-major, are cut into gridDim.x *
// warps equal contiguous ranges, one per warp, so every warp streams the same number of bytes from one
// contiguous piece of memory and there is no tail wave (a persistent grid of a few CTAs per SM). A unit pays
// the ring, the metadata and the fp32 scaling once for UB blocks, and the weight enters the tensor core with its
// bias (biased()): the unit's sum is corrected by (bias + z) * sum(x) instead of subtracting z per pair, so the
// per-word work is four LOP3s (the x sums are made once per CTA). A warp accumulates a tile until the tile or
// its range ends; a tile that lies wholly in one warp's range is stored directly, a tile shared by warps wa..wb
// gets one fp32 partial per warp and the last warp to arrive sums them in warp order (deterministic) and
// re-arms the tile's counter.
// A tile whose warps are all in one CTA is handed over the same way in shared memory; so when the grid gives
// each CTA whole tiles (launch.py, for the small layers), no partial leaves the SM.
// Workspace: ws [2 * warps in grid][32 lanes][4] (slot 2w: warp w's first tile, 2w + 1: its last), cnt [N16].
// Shared: x[0 : M, 64 kb_lo : 64 (kb_hi + 1)] (the blocks this CTA's warps touch; sized for all of K), the sums
// of x per unit (float [KB / UB][8]), the CTA-local partials (float4 [2 warps][32]) and counters (int [warps],
// padded to 128 bytes), then the warps' rings of D slots {UB x 512 bytes of weights, the unit's 48-byte
// metadata record}.
// ---------------------------------------------------------------------------------------------------------
// PROBE (benchmarks only, wrong results): 1 = the same streams with no arithmetic, 2 = also no metadata copies,
// 3 = also no x staging; 4 = the full kernel without the x sums; 5 = the full kernel staging a quarter of x
// ZSUB: the zero point is removed from each fragment by one FMA (dequant) instead of (bias + z) * sum(x) from
// the block sums: no x sums between the wait for the previous kernel and the first mma, no cancellation in
// fp32; four more instructions per k16 step. Faster on the grids of whole tiles per CTA (k/v, down), slower on
// the 1/sm grid (gate/up): benchmarks/results/bench.md, seventh pass.
template <bool BF16, int UB, int D, int PROBE = 0, bool ZSUB = false>
DEVI void sk_small(const Args& p) {
  constexpr bool NO_ARITH = PROBE >= 1 && PROBE <= 3, NO_META = PROBE == 2 || PROBE == 3, NO_X = PROBE == 3,
                 NO_XSUM = PROBE >= 3 || ZSUB;
  extern __shared__ uint4 smem4[];
  constexpr int META = 48, SLOT = UB * 512 + META;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int n16 = (p.N + 15) >> 4;
  const int upt = p.KB / UB;  // units per tile
  const long long units = (long long)n16 * upt, tw = (long long)gridDim.x * nwarps;
  auto start = [&](long long w) { return w * units / tw; };               // first unit of warp w
  auto owner = [&](long long u) { return ((u + 1) * tw - 1) / units; };  // the warp whose range holds u
  const long long gwarp = (long long)blockIdx.x * nwarps + warp;
  const long long u0 = start(gwarp), u1 = start(gwarp + 1);

  // x: the k blocks of the CTA's units (one tile's sub-range, or all of K when the CTA crosses a tile)
  const long long c0 = start((long long)blockIdx.x * nwarps), c1 = start((long long)(blockIdx.x + 1) * nwarps);
  int kb_lo = 0, kb_hi = p.KB - 1;
  if (c1 > c0 && c0 / upt == (c1 - 1) / upt) {
    kb_lo = (int)(c0 % upt) * UB;
    kb_hi = (int)((c1 - 1) % upt) * UB + UB - 1;
  }
  const int mc = min(8, p.M);
  const int pitch = p.KB * 64 + 8;  // halves, as sized by the host (whole K); +16 bytes against bank conflicts
  const uint32_t xs_base = smem_u32(smem4);
  const uint32_t xsum = xs_base + ((mc * pitch * 2 + 127) & ~127);  // float [upt][8]: x summed over each unit
  const uint32_t lpart = xsum + ((upt * 32 + 127) & ~127);  // float4 [2 nwarps][32]: partials of CTA-local tiles
  const uint32_t lcnt = lpart + nwarps * 1024;             // int [nwarps]: their arrival counters
  const uint32_t ring = lcnt + ((nwarps * 4 + 127) & ~127) + warp * (D * SLOT);
  const uint32_t ring_end = ring + D * SLOT;
  pdl_start(p.flags);
  if (threadIdx.x < nwarps)  // published to the other warps by the barrier before the main loop
    asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(lcnt + threadIdx.x * 4), "r"(0) : "memory");

  // producer side of the ring: the next unit (itile, iu), running pointers
  int itile = (int)(u0 / upt), iu = (int)(u0 % upt);
  const uint4* gw = p.qw + (size_t)u0 * (UB * 32) + lane;
  const int part = lane < 3 ? lane : 0;
  // lanes 0-1: the two 16-byte halves of the scale record, lane 2: the zero record ([N16][NG] tile-major)
  const uint32_t mstride = part < 2 ? 32 : 16;
  const char* mtile =
      (part < 2 ? (const char*)(p.msc + part * 4) : (const char*)p.mzp) + (size_t)itile * p.NG * mstride;
  const int ngm1 = p.NG - 1;
  uint32_t fill = ring, read = ring;
  const int n = (int)(u1 - u0);
  const uint64_t pol = l2_policy(p.flags & QT_EVICT_FIRST);
  auto issue = [&]() {
#pragma unroll
    for (int b = 0; b < UB; ++b) cp_async16_hint(fill + b * 512 + lane * 16, gw + b * 32, pol);
    if (!NO_META && lane < 3)
      cp_async16(fill + UB * 512 + lane * 16, mtile + min((iu * UB * 64) >> p.gshift, ngm1) * mstride, true);
    gw += UB * 32;
    if (++iu == upt) {
      iu = 0;
      mtile += (size_t)p.NG * mstride;
    }
    fill = fill + SLOT == ring_end ? ring : fill + SLOT;
  };
#pragma unroll
  for (int d = 0; d < D - 1; ++d) {  // groups 0 .. D-2: the first units (no earlier kernel writes them)
    if (d < n) issue();
    cp_commit();
  }
  pdl_wait(p.flags);  // x and everything written below come after the previous kernel
  {  // group D-1: x
    const int cpr = (kb_hi - kb_lo + 1) * 8;
    const int total = NO_X ? 0 : PROBE == 5 ? mc * cpr / 4 : mc * cpr;
    for (int c = threadIdx.x; c < total; c += blockDim.x) {
      const int r = c / cpr, q = c - r * cpr;
      const int k = kb_lo * 64 + q * 8;
      const bool v = k < p.K;
      cp_async16(xs_base + (r * pitch + q * 8) * 2, p.x + (size_t)r * p.K + (v ? k : 0), v);
    }
    cp_commit();
  }

  uint32_t lds;
  {
    int r = lane & 7;
    if (r >= mc) r = 0;  // batch columns past M: any valid row (their outputs are never stored)
    const int mat = lane >> 3;
    lds = xs_base + (r * pitch + (mat & 1) * 8 + (mat >> 1) * 16) * 2 - kb_lo * 128;
  }
  cp_wait<0>();  // x and the first units (the loop's wait<D - 1> stays right: x is one more younger group)
  __syncthreads();
  {  // the sum of x over each staged unit, per batch row (rows past M: 0), for the zero-point correction:
     // 16 threads per (row, unit), 8 elements each, then a shuffle tree (all threads busy: this is on the path
     // from pdl_wait to the first mma)
    constexpr int CH = UB * 8;  // 16-byte chunks of a unit's row
    static_assert(CH <= 32 && (CH & (CH - 1)) == 0, "a unit's row is reduced within one warp");
    const int u_lo = kb_lo / UB, nu = (kb_hi + 1) / UB - u_lo;
    const int items = NO_XSUM ? 0 : mc * nu * CH;
    for (int c0 = 0; c0 < items; c0 += blockDim.x) {  // uniform trip count: every lane reaches the shuffles
      const int c = c0 + threadIdx.x;
      const int q = c & (CH - 1), ru = c / CH;  // ru = r * nu + j
      const int r = ru / nu, j = ru - r * nu;
      float sum = 0.f;
      if (c < items) {
        uint4 v;
        asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "r"(xs_base + (r * pitch + j * UB * 64 + q * 8) * 2));
        sum = (to_f32<BF16>(v.x & 0xFFFFu) + to_f32<BF16>(v.x >> 16)) +
              (to_f32<BF16>(v.y & 0xFFFFu) + to_f32<BF16>(v.y >> 16)) +
              (to_f32<BF16>(v.z & 0xFFFFu) + to_f32<BF16>(v.z >> 16)) +
              (to_f32<BF16>(v.w & 0xFFFFu) + to_f32<BF16>(v.w >> 16));
      }
#pragma unroll
      for (int o = CH / 2; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      if (c < items && q == 0)
        asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(xsum + ((u_lo + j) * 8 + r) * 4), "f"(sum) : "memory");
    }
    for (int c = threadIdx.x; c < (NO_XSUM ? 0 : (8 - mc) * nu); c += blockDim.x) {  // rows past M
      const int r = mc + c / nu, j = c % nu;
      asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(xsum + ((u_lo + j) * 8 + r) * 4), "f"(0.f) : "memory");
    }
  }
  if constexpr (!ZSUB) __syncthreads();

  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  int tile = (int)(u0 / upt), u = (int)(u0 % upt);
  for (int i = 0; i < n; ++i) {
    if (i + D - 1 < n) issue();
    cp_commit();
    cp_wait<D - 1>();
    __syncwarp();
    uint4 wv[UB];
#pragma unroll
    for (int b = 0; b < UB; ++b)
      asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(wv[b].x), "=r"(wv[b].y), "=r"(wv[b].z),
                   "=r"(wv[b].w) : "r"(read + b * 512 + lane * 16));
    uint32_t sc;
    uint2 zp;
    asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(sc) : "r"(read + UB * 512 + g * 4));
    asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];\n" : "=r"(zp.x), "=r"(zp.y) : "r"(read + UB * 512 + 32));
    if constexpr (NO_ARITH) {
#pragma unroll
      for (int b = 0; b < UB; ++b)
        acc[0] += __uint_as_float((wv[b].x ^ wv[b].y ^ wv[b].z ^ wv[b].w ^ sc) & 0x3FFFFFu);
    } else {
      float accb[4] = {0.f, 0.f, 0.f, 0.f};
      const uint32_t xb = lds + u * (UB * 128);
      RowConst rc;
      if constexpr (ZSUB) rc = row_const<BF16>(sc, zp, g);
#pragma unroll
      for (int b = 0; b < UB; ++b) {
        uint32_t bx[4];
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          if (s % 2 == 0) ldsm_x4(bx, xb + b * 128 + s * 32);
          uint32_t a[4];
          if constexpr (ZSUB) {
            dequant<BF16, false>(word(wv[b], s), rc, a);
          } else {
            biased<BF16>(word(wv[b], s), a);
          }
          mma16816<BF16>(accb, a, bx[(s & 1) * 2], bx[(s & 1) * 2 + 1]);
        }
      }
      if constexpr (ZSUB) {  // accb = sum (q - z) x: only the scale is left
        const float s0 = to_f32<BF16>(sc & 0xFFFFu), s1 = to_f32<BF16>(sc >> 16);
        acc[0] = fmaf(s0, accb[0], acc[0]);
        acc[1] = fmaf(s0, accb[1], acc[1]);
        acc[2] = fmaf(s1, accb[2], acc[2]);
        acc[3] = fmaf(s1, accb[3], acc[3]);
      } else {
        // accb = sum (bias + q) x (rows g), (bias + 16 q) x (rows g + 8, fp16): remove (bias + z) sum x, then scale
        // (s1 / 16 undoes the high nibble's factor 16; a power of two, exact)
        float2 xs;
        asm volatile("ld.shared.v2.f32 {%0,%1}, [%2];\n" : "=f"(xs.x), "=f"(xs.y) : "r"(xsum + (u * 8 + 2 * t) * 4));
        const float z0 = (float)((zp.x >> (4 * g)) & 15u), z1 = (float)((zp.y >> (4 * g)) & 15u);
        const float c0 = BF16 ? 128.f + z0 : 1024.f + z0, c1 = BF16 ? 128.f + z1 : 1024.f + 16.f * z1;
        const float s0 = to_f32<BF16>(sc & 0xFFFFu), s1 = to_f32<BF16>(sc >> 16) * (BF16 ? 1.f : 0.0625f);
        acc[0] = fmaf(s0, fmaf(-c0, xs.x, accb[0]), acc[0]);
        acc[1] = fmaf(s0, fmaf(-c0, xs.y, accb[1]), acc[1]);
        acc[2] = fmaf(s1, fmaf(-c1, xs.x, accb[2]), acc[2]);
        acc[3] = fmaf(s1, fmaf(-c1, xs.y, accb[3]), acc[3]);
      }
    }
    read = read + SLOT == ring_end ? ring : read + SLOT;

    if (u == upt - 1 || i == n - 1) {  // the tile ends here for this warp: store or hand over its sum
      const long long wa = owner((long long)tile * upt), wb = owner((long long)tile * upt + upt - 1);
      const int n0 = tile * 16;
      auto store = [&](const float (&v)[4]) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = n0 + g + (e >> 1) * 8, ml = 2 * t + (e & 1);
          if (ml < mc && row < p.N) p.y[(size_t)ml * p.N + row] = from_f32<BF16>(v[e]);
        }
      };
      const long long cta0 = (long long)blockIdx.x * nwarps;  // the CTA's first warp in the grid
      if (wa == wb) {
        store(acc);
      } else if (wa >= cta0 && wb < cta0 + nwarps) {
        // Every warp of this tile is in this CTA: the same hand-over through shared memory (slot 2w for a warp's
        // first tile, 2w + 1 for its last; counter: the tile's first warp, which is the first warp of no other
        // shared tile), a few tens of cycles instead of an L2 round trip per step.
        const int lw = warp, la = (int)(wa - cta0), lb = (int)(wb - cta0);
        const int lslot = (u0 / upt == tile) ? 2 * lw : 2 * lw + 1;
        asm volatile("st.shared.v4.f32 [%0], {%1,%2,%3,%4};\n" ::"r"(lpart + (lslot * 32 + lane) * 16),
                     "f"(acc[0]), "f"(acc[1]), "f"(acc[2]), "f"(acc[3]) : "memory");
        __syncwarp();  // the lanes' stores before lane 0's release (as below, at CTA scope)
        int last = 0;
        if (lane == 0) {
          int old;
          asm volatile("atom.acq_rel.cta.shared.add.u32 %0, [%1], 1;\n"
                       : "=r"(old)
                       : "r"(lcnt + la * 4)
                       : "memory");
          last = old == lb - la;  // counters are used once per launch: no re-arming
        }
        last = __shfl_sync(0xffffffffu, last, 0);
        if (last) {
          __syncwarp();
          const uint32_t part = lpart + lane * 16;
          float4 v0;
          const int s0 = start(wa) == (long long)tile * upt ? 2 * la : 2 * la + 1;
          asm volatile("ld.shared.v4.f32 {%0,%1,%2,%3}, [%4];\n" : "=f"(v0.x), "=f"(v0.y), "=f"(v0.z), "=f"(v0.w)
                       : "r"(part + s0 * 512) : "memory");
          float sum[4] = {v0.x, v0.y, v0.z, v0.w};
          for (int w = la + 1; w <= lb; ++w) {
            float4 v;
            asm volatile("ld.shared.v4.f32 {%0,%1,%2,%3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                         : "r"(part + 2 * w * 512) : "memory");
            sum[0] += v.x;
            sum[1] += v.y;
            sum[2] += v.z;
            sum[3] += v.w;
          }
          store(sum);
        }
      } else {
        const long long slot = (u0 / upt == tile) ? 2 * gwarp : 2 * gwarp + 1;
        reinterpret_cast<float4*>(p.ws)[slot * 32 + lane] = make_float4(acc[0], acc[1], acc[2], acc[3]);
        // The warp barrier orders the lanes' stores before lane 0's release-acquire count (no full fence:
        // that would also wait for the ring's copies in flight); the last warp's lanes read after it.
        __syncwarp();
        int last = 0;
        if (lane == 0) {
          int old;
          asm volatile("atom.add.acq_rel.gpu.s32 %0, [%1], 1;\n" : "=r"(old) : "l"(p.cnt + tile) : "memory");
          last = old == (int)(wb - wa);
          if (last) p.cnt[tile] = 0;  // every other warp of this tile has arrived: safe to re-arm
        }
        last = __shfl_sync(0xffffffffu, last, 0);
        if (last) {
          __syncwarp();  // orders every lane's reads below after lane 0's acquire
          // warp wa's slot is its last tile's unless its range starts with this tile; every later warp's range
          // starts inside this tile (slot 2w). Independent loads, summed in warp order.
          const float4* part = reinterpret_cast<const float4*>(p.ws) + lane;
          const float4 v0 = __ldcg(part + (start(wa) == (long long)tile * upt ? 2 * wa : 2 * wa + 1) * 32);
          float sum[4] = {v0.x, v0.y, v0.z, v0.w};
#pragma unroll 8
          for (long long w = wa + 1; w <= wb; ++w) {
            const float4 v = __ldcg(part + 2 * w * 32);
            sum[0] += v.x;
            sum[1] += v.y;
            sum[2] += v.z;
            sum[3] += v.w;
          }
          store(sum);
        }
      }
      acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
    }
    if (++u == upt) {
      u = 0;
      ++tile;
    }
  }
  cp_wait<0>();
}

#ifdef QT_WGMMA
// ---------------------------------------------------------------------------------------------------------
// Large-batch kernel (sm_90a): wgmma m64nBNk16 with A = the dequantized weight from registers (each warp of a
// warpgroup owns a 16-row tile, same per-lane words as mma_small) and B = a BN x 64 tile of x in shared memory
// (K-major, 128-byte swizzle), streamed through STAGES slots, by the tensor memory accelerator from one more
// (producer) warpgroup (TMA_X) or by cp.async from every thread. WGS warpgroups share each x tile.
// Grid: (ceil(N16 / (4 WGS)), splits, ceil(M / BN)); block 128 WGS threads (+ 128 with TMA_X).
// ---------------------------------------------------------------------------------------------------------
// The descriptor of a K-major tile with 128-byte swizzle: its low word holds the start address / 16 (bits 0-13:
// shared addresses are below 2^18, so adding a k16 step's 2 never carries out) and the leading offset 1, its high
// word the stride (1024 bytes between 8-row groups) and the swizzle mode. The loops keep only the low word.
DEVI uint32_t sw128_lo(uint32_t saddr) { return ((saddr & 0x3FFFF) >> 4) | (1u << 16); }
DEVI uint64_t sw128_desc(uint32_t lo) { return ((uint64_t)((1024 >> 4) | (1u << 30)) << 32) | lo; }
DEVI void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
DEVI void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
DEVI void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
DEVI void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
DEVI void keep(const uint32_t (&a)[4]) { asm volatile("" ::"r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3])); }

// x through the tensor memory accelerator (TMA_X): the host encodes x [M][K] as a 2-D tensor map (box 64 k x BN
// rows, 128-byte swizzle: the layout sw128_lo / sw128_desc describe); a producer warpgroup copies each block's x tile (one
// lane, by the tensor map) and the CTA's weights and metadata for it (cp.async, all 128 threads) into a stage,
// completing the stage's "full" mbarrier; each consumer warp releases a stage on its "empty" mbarrier once the
// wgmmas that read it are done. The consumers copy nothing and meet at no CTA barrier and no proxy fence per
// block: the x path of the cp.async form (all threads copy, then fence and __syncthreads every block) cost ~70 us
// of 270 on Llama-3-70B gate/up at M = 256 (benchmarks/results/bench.md, ninth pass).
// The producer is a whole warpgroup so that it can give its registers to the consumers (setmaxnreg works per
// warpgroup): at 168 registers a thread for every warp of 3 warpgroups, ptxas had 38 beside the 128 accumulators
// and recomputed the loop's addresses, predicates and scale pairs every block and step; the consumers'
// instruction stream, not the tensor pipe, set the pace (Nsight Compute, tenth pass in bench.md).
struct alignas(64) TMap {  // CUtensorMap: 128 opaque bytes made by cuTensorMapEncodeTiled
  unsigned long long v[16];
};
DEVI void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
DEVI void tma_load_2d(uint32_t dst, const TMap* map, int c0, int c1, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

// The mbarrier's pending arrival count drops by one once every cp.async this thread issued so far has landed
// (noinc: the barrier's expected count includes this arrival).
DEVI void cp_async_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

template <int BN, bool BF16>
DEVI void wgmma_rs(float (&d)[BN / 2], const uint32_t (&a)[4], uint64_t desc) {
  if constexpr (BF16) {
    if constexpr (BN == 64) wgmma_rs_m64n64k16_bf16(d, a[0], a[1], a[2], a[3], desc);
    if constexpr (BN == 128) wgmma_rs_m64n128k16_bf16(d, a[0], a[1], a[2], a[3], desc);
    if constexpr (BN == 256) wgmma_rs_m64n256k16_bf16(d, a[0], a[1], a[2], a[3], desc);
  } else {
    if constexpr (BN == 64) wgmma_rs_m64n64k16_f16(d, a[0], a[1], a[2], a[3], desc);
    if constexpr (BN == 128) wgmma_rs_m64n128k16_f16(d, a[0], a[1], a[2], a[3], desc);
    if constexpr (BN == 256) wgmma_rs_m64n256k16_f16(d, a[0], a[1], a[2], a[3], desc);
  }
}

// PROBE (benchmarks only, wrong results): 1 = no async-proxy fence before the barrier, 2 = no x tiles, fence or
// barrier (slot 0 read throughout), 3 = 2 without the dequantization (the raw words enter the tensor core).
template <int BN, int WGS, int STAGES, bool BF16, int NS, int D, int PROBE = 0, bool TMA_X = false>
DEVI void wg_large(const Args& p, const TMap* xmap = nullptr) {
  extern __shared__ uint4 smem4[];
  constexpr int SLOT = BN * 128;  // bytes: BN rows of 64 halves
  constexpr int NTH = 128 * WGS;
  const uint32_t sbase = (smem_u32(smem4) + 1023u) & ~1023u;  // the swizzle pattern repeats every 1 KB
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2;
  const int n16 = (p.N + 15) >> 4;
  const int tn = blockIdx.x * (4 * WGS) + warp;
  const bool producer = TMA_X && warp >= 4 * WGS;  // TMA_X: one more warpgroup, which copies x and the weights
  const bool active = tn < n16;  // (the cp.async form's ring copies; that form has no producer)
  const int kb0 = blockIdx.y * p.kbps;
  const int nb = min(p.KB, kb0 + p.kbps) - kb0;
  const int m0 = blockIdx.z * BN;
  const int mc = min(BN, p.M - m0);
  using R = Stream<D, NS>;
  R ws(p, sbase + STAGES * SLOT + warp * R::BYTES_PER_WARP, lane, tn, n16, kb0);  // TN = 1

  auto load_x = [&](int slot, int kb) {
    const uint32_t st = sbase + slot * SLOT;
#pragma unroll
    for (int it = 0; it < BN * 8 / NTH; ++it) {
      const int c = tid + it * NTH;
      const int r = c >> 3, q = c & 7;
      const int k = kb * 64 + q * 8;
      const bool v = r < mc && k < p.K;
      cp_async16(st + r * 128 + ((q ^ (r & 7)) << 4), p.x + (v ? (size_t)(m0 + r) * p.K + k : 0), v);
    }
  };

  float acc[BN / 2];
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
  uint32_t a[2][4] = {{0, 0, 0, 0}, {0, 0, 0, 0}};

  // One 64-k block: the warp's slot of the weight ring against the x tile whose descriptor's low word is dlo
  // (sw128_lo), four k16 steps. after_step(s) runs once the previous step's wgmma is done. Idle warps (past N)
  // dequantize whatever their slot holds, without a branch: only their own accumulator rows see it, and those
  // are never stored.
  auto block = [&](uint32_t dlo, auto&& after_step) {
    const uint4 wv = ws.weights();
    RowConst rc = row_const<BF16>(ws.scale(0), ws.zero(0), g);
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const int b = s & 1;
      if constexpr (NS == 4) {
        if (s > 0) rc = row_const<BF16>(ws.scale(s), ws.zero(s), g);
      }
      if constexpr (PROBE == 3) {
        a[b][0] = word(wv, s) ^ rc.s0;
        a[b][1] = a[b][0] >> 1;
        a[b][2] = a[b][0] >> 2;
        a[b][3] = a[b][0] >> 3;
      } else {
        dequant<BF16, true>(word(wv, s), rc, a[b]);
      }
      wg_fence();
      wgmma_rs<BN, BF16>(acc, a[b], sw128_desc(dlo + 2 * s));  // + 32 bytes a step
      wg_commit();
      wg_wait<1>();          // the previous step's wgmma is done: its A registers may be rewritten
      keep(a[(s + 1) & 1]);  // ... and not before (the compiler must not reuse them earlier)
      after_step(s);
    }
    ws.next();
  };
  if constexpr (TMA_X) {
    static_assert(PROBE == 0, "the probes are of the cp.async form");
    // A stage holds x tile j (SLOT bytes at sbase + slot SLOT) and, after all x slots, block j's weights and
    // metadata for the CTA's 4 WGS warps (WSLOT each, laid out as a Stream slot: the warp reads it with the
    // same accessors). Barriers: full[STAGES] (the producer's expect_tx arrival, whose x bytes complete with the
    // copy, and one arrival per producer thread once its cp.asyncs have landed) and empty[STAGES] (one arrival
    // per consumer warp). Block j uses stage j % STAGES, phase j / STAGES.
    constexpr int WSLOT = R::SLOT, WSTAGE = 4 * WGS * WSLOT;
    const uint32_t wbase = sbase + STAGES * SLOT;
    __shared__ __align__(8) uint64_t bars[2 * STAGES];
    const uint32_t full = smem_u32(bars), empty = full + STAGES * 8;
    pdl_start(p.flags);
    if (tid == 0) {
#pragma unroll
      for (int j = 0; j < STAGES; ++j) {
        mbar_init(full + j * 8, 1 + 128);
        mbar_init(empty + j * 8, 4 * WGS);
      }
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // visible to the copy engine
    }
    __syncthreads();  // the barriers are initialized before anyone waits on them

    if (producer) {
      // The producer warpgroup fills each stage once the consumers have released its previous block: its 128
      // threads copy the CTA's weights and metadata (16-byte cp.asyncs, the same PPT pieces of each block per
      // thread) and arrive when they land; thread 0 arms the barrier with x's bytes and copies the x tile (tensor
      // map). Warps of their own, so the copies run ahead of every consumer warp, not of one, and the consumers
      // issue no copies at all: their own cp.async rings cost each consumer warp ~50 instructions a block.
      // (One 1-D bulk copy per tile's weights and per metadata record instead, 25 a block from one warp, was
      // correct and far slower: gate/up 347 us against 205, tenth pass.)
      if constexpr (WGS >= 2) asm volatile("setmaxnreg.dec.sync.aligned.u32 56;\n" ::: "memory");
      constexpr int PT = 32 + 3 * NS, PPT = (4 * WGS * PT + 127) / 128;  // pieces per tile, per thread
      const int ptid = tid - NTH, t0 = blockIdx.x * 4 * WGS;
      // piece c = ptid + 128 r: tile t = c / PT; q < 32: the tile's weights, 16 bytes q; else metadata record
      // (q - 32) / 3 (group step), part (q - 32) % 3 (scales 0-3, 4-7; zeros)
      const char* src[PPT];
      uint32_t dst[PPT];
      int step[PPT];  // -1: weights (src advances 512 bytes a block); else the record's group step ...
      uint32_t mstride[PPT];  // ... and the bytes from one group's record to the next (scales 32, zeros 16)
      bool valid[PPT];
#pragma unroll
      for (int r = 0; r < PPT; ++r) {
        const int c = ptid + 128 * r, t = c / PT, q = c - t * PT, tile = t0 + t;
        valid[r] = t < 4 * WGS && tile < n16;
        const int tl = valid[r] ? tile : 0;
        if (q < 32) {
          src[r] = reinterpret_cast<const char*>(p.qw + ((size_t)tl * p.KB + kb0) * 32 + q);
          dst[r] = t * WSLOT + q * 16;
          step[r] = -1;
          mstride[r] = 0;
        } else {
          const int rec = (q - 32) / 3, part = q - 32 - 3 * rec;
          src[r] = part < 2 ? reinterpret_cast<const char*>(p.msc + (size_t)tl * p.NG * 8 + part * 4)
                            : reinterpret_cast<const char*>(p.mzp + (size_t)tl * p.NG);
          dst[r] = t * WSLOT + 512 + rec * R::META + part * 16;
          step[r] = rec;
          mstride[r] = part < 2 ? 32 : 16;
        }
      }
      auto weights = [&](int j) {  // block j's pieces into its stage, then this thread's arrival
        const int slot = j % STAGES, kb = kb0 + j;
        const uint32_t base = wbase + slot * WSTAGE;
#pragma unroll
        for (int r = 0; r < PPT; ++r) {
          if (!valid[r]) continue;
          // No L2 policy hint (evict-first) here: with one, ptxas 13.0 gave these cp.asyncs an odd uniform
          // register as their memory descriptor, which faults (illegal instruction; compute-sanitizer, tenth pass).
          const size_t off = step[r] < 0 ? (size_t)j * 512 : (size_t)ws.group(kb, step[r]) * mstride[r];
          cp_async16(base + dst[r], src[r] + off, true);
        }
        cp_async_arrive(full + slot * 8);
      };
      // The first stages' weights before pdl_wait (no earlier kernel writes them); their x after it.
#pragma unroll 1
      for (int j = 0; j < min(nb, STAGES); ++j) weights(j);
      pdl_wait(p.flags);
#pragma unroll 1
      for (int j = 0; j < nb; ++j) {
        const int slot = j % STAGES;
        if (j >= STAGES) {
          if (lane == 0) mbar_wait(empty + slot * 8, ((j / STAGES) - 1) & 1);  // block j - STAGES released it
          __syncwarp();
          weights(j);
        }
        if (ptid == 0) {
          mbar_expect_tx(full + slot * 8, SLOT);
          tma_load_2d(sbase + slot * SLOT, xmap, (kb0 + j) * 64, m0, full + slot * 8);
        }
      }
      cp_wait<0>();
      epilogue_barriers();
      return;
    }
    pdl_wait(p.flags);  // before the epilogue writes y, the workspace and the counters
    // 3 warpgroups of 168 registers = 64512; the producer's 128 threads keep 56 and the 256 consumers get 224.
    static_assert(WGS <= 2, "setmaxnreg counts for at most two consumer warpgroups");
    if constexpr (WGS == 2) asm volatile("setmaxnreg.inc.sync.aligned.u32 224;\n" ::: "memory");
    int xslot = 0;
    uint32_t phase = 0, xdlo = sw128_lo(sbase), wread = wbase + warp * WSLOT;
    for (int i = 0; i < nb; ++i) {
      mbar_wait(full + xslot * 8, phase);  // x tile i, the weights and metadata of block i have landed
      ws.read = wread;
      const int prev = xslot == 0 ? STAGES - 1 : xslot - 1;
      block(xdlo, [&](int s) {
        // after step 0 every wgmma of block i - 1 is done (and its weights were read before): its stage is free
        if (s == 0 && i > 0 && lane == 0) mbar_arrive(empty + prev * 8);
      });
      if (++xslot == STAGES) {
        xslot = 0;
        phase ^= 1u;
        xdlo = sw128_lo(sbase);
        wread = wbase + warp * WSLOT;
      } else {
        xdlo += SLOT >> 4;
        wread += WSTAGE;
      }
    }
  } else {
    static_assert(D - 1 >= STAGES - 2, "the weight ring runs at least as far ahead as the x tiles");
    pdl_start(p.flags);
    // One group for the first D - 1 blocks of weights (issued before pdl_wait: no earlier kernel writes them) and
    // the first STAGES - 2 x tiles, then D - 2 empty groups: the loop's waits count groups as if group d held
    // weights d and x tile d (each of those is in this group or an older one, as there).
#pragma unroll
    for (int d = 0; d < D - 1; ++d)
      if (active && d < nb) ws.issue();
    pdl_wait(p.flags);
#pragma unroll
    for (int d = 0; d < STAGES - 2; ++d)
      if (d < nb && (PROBE < 2 || d == 0)) load_x(d, kb0 + d);
#pragma unroll
    for (int d = 0; d < D - 1; ++d) cp_commit();

    // Group committed in iteration i: x of block i + STAGES - 2 and weights of block i + D - 1, so waiting
    // for block i's x tile (STAGES - 3 younger groups) also covers its (older) weights.
    int xslot = 0;
    for (int i = 0; i < nb; ++i) {
      cp_wait<STAGES - 3>();  // block i's x tile, weights and metadata have landed (this thread's copies)
      if constexpr (PROBE < 2) {
        if constexpr (PROBE != 1) fence_proxy_async();  // ... and the x tile is visible to the tensor cores' reads
        __syncthreads();  // every thread's copies; every warpgroup is done with block i - 2's x slot
        if (i + STAGES - 2 < nb) load_x((i + STAGES - 2) % STAGES, kb0 + i + STAGES - 2);
      }
      if (active && i + D - 1 < nb) ws.issue();
      cp_commit();
      block(sw128_lo(sbase + (PROBE >= 2 ? 0 : xslot * SLOT)), [](int) {});
      xslot = xslot + 1 == STAGES ? 0 : xslot + 1;
    }
  }
  wg_wait<0>();
  keep(a[0]);
  keep(a[1]);
  cp_wait<0>();
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) asm volatile("" : "+f"(acc[i])::"memory");
  float (&acc4)[1][BN / 8][4] = *reinterpret_cast<float (*)[1][BN / 8][4]>(acc);
  epilogue<BN / 8, BF16, 1>(p, acc4, tn * 16, m0, mc, blockIdx.x * 4 * WGS * 16, 4 * WGS * 16, NTH);
}
#endif

}  // namespace qt

// ---------------------------------------------------------------------------------------------------------
// Entry points (extern "C": the driver API looks them up by these names; qtool/kernels/cuda/launch.py lists
// the same whitelist). Arguments in Args order.
// ---------------------------------------------------------------------------------------------------------
#define QT_ARGS                                                                                           \
  const uint4 *qw, const uint32_t *msc, const uint4 *mzp, const int *gtab, const uint16_t *x, uint16_t *y, \
      float *ws, int *cnt, int M, int N, int K, int KB, int kbps, int NG, int gshift, int flags
#define QT_PACK {qw, msc, mzp, gtab, x, y, ws, cnt, M, N, K, KB, kbps, NG, gshift, flags}

#define QT_MMA(NAME, NT, BF16, POST, D, TN)                                        \
  extern "C" __global__ void __launch_bounds__(256) NAME(QT_ARGS) {                \
    const qt::Args a = QT_PACK;                                                    \
    qt::mma_small<NT, BF16, POST, D, TN>(a);                                       \
  }

// The stream-K kernel's 16-warp CTAs with 4-slot rings must fit two to an SM on Hopper (64 registers a
// thread): the next layer's CTA (programmatic dependent launch) is resident beside this one while it runs.
// 6-slot rings take too much shared memory for that anyway, and elsewhere there is no such launch.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
#define QT_SK_MINB4 2
#else
#define QT_SK_MINB4 1
#endif
#define QT_SK_BOUNDS4 __launch_bounds__(512, QT_SK_MINB4)

#define QT_SK(NAME, BF16, UB, D)                                                   \
  extern "C" __global__ void __launch_bounds__(512, (D) <= 4 ? QT_SK_MINB4 : 1) NAME(QT_ARGS) { \
    const qt::Args a = QT_PACK;                                                    \
    qt::sk_small<BF16, UB, D>(a);                                                  \
  }

QT_SK(qt_sk_f16_u2_d4, false, 2, 4)
// Stream-K probes for benchmarks/tune_cuda_w4a16.py (wrong results by design; never dispatched): sk_small's PROBE.
#define QT_SK_PROBE(PR)                                                             \
  extern "C" __global__ void QT_SK_BOUNDS4 qt_sk_probe##PR##_f16_u2_d4(QT_ARGS) {   \
    const qt::Args a = QT_PACK;                                                     \
    qt::sk_small<false, 2, 4, PR>(a);                                               \
  }
QT_SK_PROBE(1)
QT_SK_PROBE(2)
QT_SK_PROBE(3)
QT_SK_PROBE(4)
QT_SK_PROBE(5)
QT_SK(qt_sk_f16_u2_d6, false, 2, 6)
// zero removed per fragment (ZSUB): qt_sk_z_{f16,bf16}_u2_d{D}
#define QT_SK_Z(D)                                                                       \
  extern "C" __global__ void __launch_bounds__(512, (D) <= 4 ? QT_SK_MINB4 : 1) qt_sk_z_f16_u2_d##D(QT_ARGS) {  \
    const qt::Args a = QT_PACK;                                                          \
    qt::sk_small<false, 2, D, 0, true>(a);                                               \
  }                                                                                      \
  extern "C" __global__ void __launch_bounds__(512, (D) <= 4 ? QT_SK_MINB4 : 1) qt_sk_z_bf16_u2_d##D(QT_ARGS) { \
    const qt::Args a = QT_PACK;                                                          \
    qt::sk_small<true, 2, D, 0, true>(a);                                                \
  }
QT_SK_Z(4)
QT_SK_Z(6)
QT_SK(qt_sk_bf16_u2_d4, true, 2, 4)
QT_SK(qt_sk_bf16_u2_d6, true, 2, 6)

// x streamed in chunks (mma_xs): 4 chunk slots; XC blocks per chunk with (4 - 1) XC >= D - 1. At most 80
// registers a thread with one tile per warp, so three CTAs of 8 warps fit an SM (launch.py's q/o and k/v grid).
#define QT_XS(NAME, NT, BF16, D, TN, XC)                                           \
  extern "C" __global__ void __maxnreg__((TN) == 1 ? 80 : 128) NAME(QT_ARGS) {     \
    const qt::Args a = QT_PACK;                                                    \
    qt::mma_xs<NT, BF16, D, TN, XC, 4>(a);                                         \
  }
QT_XS(qt_xs_f16_nt2_tn1_d6_x2, 2, false, 6, 1, 2)
QT_XS(qt_xs_f16_nt2_tn1_d12_x4, 2, false, 12, 1, 4)
QT_XS(qt_xs_f16_nt2_tn2_d6_x2, 2, false, 6, 2, 2)
QT_XS(qt_xs_f16_nt2_tn2_d12_x4, 2, false, 12, 2, 4)
QT_XS(qt_xs_bf16_nt2_tn1_d6_x2, 2, true, 6, 1, 2)
QT_XS(qt_xs_bf16_nt2_tn1_d12_x4, 2, true, 12, 1, 4)
QT_XS(qt_xs_bf16_nt2_tn2_d6_x2, 2, true, 6, 2, 2)
QT_XS(qt_xs_bf16_nt2_tn2_d12_x4, 2, true, 12, 2, 4)
// its probes (benchmarks only, wrong results): qt_xs_probe{PR}_f16_nt2_tn1_d6_x2
#define QT_XS_PROBE(PR)                                                               \
  extern "C" __global__ void __maxnreg__(80) qt_xs_probe##PR##_f16_nt2_tn1_d6_x2(QT_ARGS) {  \
    const qt::Args a = QT_PACK;                                                       \
    qt::mma_xs<2, false, 6, 1, 2, 4, PR>(a);                                          \
  }
QT_XS_PROBE(1)
QT_XS_PROBE(2)
QT_XS_PROBE(3)

// x in registers (xr_small): NT batch tiles, R blocks per warp and tile, rings of D units, at most TH threads a
// CTA, units of T tiles (one partial-sum exchange per T tiles), S partial slots summed L units late. R 4: at most
// 128 registers a thread (64 of them x at NT 2), so one CTA of 16 warps or two of 8 fit an SM; R 8: 128 registers
// of x, so at most 8 warps (255 registers a thread). Names: qt_xr_{dt}_nt{NT}_r{R}_d{D}{SUF}.
#define QT_XRX(SUF, NT, R, D, TH, T, S, L, B)                                                               \
  extern "C" __global__ void __launch_bounds__(TH, 1) qt_xr_f16_nt##NT##_r##R##_d##D##SUF(QT_ARGS) {        \
    const qt::Args a = QT_PACK;                                                                           \
    qt::xr_small<false, NT, R, D, S, L, 0, T, B>(a);                                                      \
  }                                                                                                       \
  extern "C" __global__ void __launch_bounds__(TH, 1) qt_xr_bf16_nt##NT##_r##R##_d##D##SUF(QT_ARGS) {       \
    const qt::Args a = QT_PACK;                                                                           \
    qt::xr_small<true, NT, R, D, S, L, 0, T, B>(a);                                                       \
  }
#define QT_XR(NT, R, D, TH) QT_XRX(, NT, R, D, TH, 1, 4, 2, false)  // one tile a unit: no suffix
#define QT_XRT(NT, R, D, TH, T, S, L) QT_XRX(_t##T##_s##S, NT, R, D, TH, T, S, L, false)
// the weights biased (4 LOP3s a word), corrected by (bias + z) x the group's sums of x: suffix _b
#define QT_XRB(NT, R, D, TH) QT_XRX(_b, NT, R, D, TH, 1, 4, 2, true)
#define QT_XRTB(NT, R, D, TH, T, S, L) QT_XRX(_t##T##_s##S##_b, NT, R, D, TH, T, S, L, true)
QT_XR(2, 4, 3, 512)
QT_XR(2, 4, 4, 512)
QT_XR(2, 2, 4, 512)
QT_XR(1, 4, 4, 512)
QT_XR(2, 8, 3, 256)
QT_XRT(2, 8, 2, 256, 2, 4, 2)
QT_XRB(2, 8, 3, 256)
QT_XRTB(2, 8, 2, 256, 2, 4, 2)
// its probes (benchmarks only, wrong results): qt_xr_probe{PR}_f16_nt{NT}_r{R}_d{D}
#define QT_XR_PROBE(PR, NT, R, D, TH)                                                                   \
  extern "C" __global__ void __launch_bounds__(TH, 1) qt_xr_probe##PR##_f16_nt##NT##_r##R##_d##D(QT_ARGS) { \
    const qt::Args a = QT_PACK;                                                                         \
    qt::xr_small<false, NT, R, D, 4, 2, PR>(a);                                                         \
  }
QT_XR_PROBE(1, 2, 4, 3, 512)
QT_XR_PROBE(2, 2, 4, 3, 512)
QT_XR_PROBE(3, 2, 4, 3, 512)
QT_XR_PROBE(4, 2, 4, 3, 512)
QT_XR_PROBE(5, 2, 4, 3, 512)
QT_XR_PROBE(7, 2, 4, 3, 512)
QT_XR_PROBE(1, 2, 8, 3, 256)
QT_XR_PROBE(2, 2, 8, 3, 256)
QT_XR_PROBE(3, 2, 8, 3, 256)
// probe 10 (the K groups' partials not summed: each K group stores its sum as y) on the biased two-tile shape
extern "C" __global__ void __launch_bounds__(256, 1) qt_xr_probe10_f16_nt2_r8_d2_t2_s4_b(QT_ARGS) {
  const qt::Args a = QT_PACK;
  qt::xr_small<false, 2, 8, 2, 4, 2, 10, 2, true>(a);
}
// probe 12 (right results and each warp's timeline) on the shapes launch.choose() takes at M = 9-16
extern "C" __global__ void __launch_bounds__(256, 1) qt_xr_probe12_f16_nt2_r8_d3(QT_ARGS) {
  const qt::Args a = QT_PACK;
  qt::xr_small<false, 2, 8, 3, 4, 2, 12, 1>(a);
}
extern "C" __global__ void __launch_bounds__(256, 1) qt_xr_probe12_f16_nt2_r8_d2_t2_s4(QT_ARGS) {
  const qt::Args a = QT_PACK;
  qt::xr_small<false, 2, 8, 2, 4, 2, 12, 2>(a);
}

// Bandwidth probes for benchmarks/tune_cuda_w4a16.py (wrong results by design; never dispatched).
extern "C" __global__ void __launch_bounds__(256) qt_probe_f16_nt1_tn1_post(QT_ARGS) {
  const qt::Args a = QT_PACK;
  qt::mma_small<1, false, true, 6, 1, true>(a);
}
extern "C" __global__ void __launch_bounds__(256) qt_probe_f16_nt1_tn2_post(QT_ARGS) {
  const qt::Args a = QT_PACK;
  qt::mma_small<1, false, true, 6, 2, true>(a);
}

QT_MMA(qt_mma_f16_nt1_tn1_post, 1, false, true, 6, 1)
QT_MMA(qt_mma_f16_nt1_tn1_step, 1, false, false, 4, 1)
QT_MMA(qt_mma_f16_nt1_tn2_post, 1, false, true, 6, 2)
QT_MMA(qt_mma_f16_nt1_tn2_step, 1, false, false, 4, 2)
QT_MMA(qt_mma_f16_nt2_tn1_post, 2, false, true, 6, 1)
QT_MMA(qt_mma_f16_nt2_tn1_step, 2, false, false, 4, 1)
QT_MMA(qt_mma_f16_nt2_tn2_post, 2, false, true, 6, 2)
QT_MMA(qt_mma_f16_nt2_tn2_step, 2, false, false, 4, 2)
QT_MMA(qt_mma_f16_nt4_tn1_post, 4, false, true, 6, 1)
QT_MMA(qt_mma_f16_nt4_tn1_step, 4, false, false, 4, 1)
QT_MMA(qt_mma_f16_nt4_tn2_post, 4, false, true, 6, 2)
QT_MMA(qt_mma_f16_nt4_tn2_step, 4, false, false, 4, 2)
QT_MMA(qt_mma_bf16_nt1_tn1_post, 1, true, true, 6, 1)
QT_MMA(qt_mma_bf16_nt1_tn1_step, 1, true, false, 4, 1)
QT_MMA(qt_mma_bf16_nt1_tn2_post, 1, true, true, 6, 2)
QT_MMA(qt_mma_bf16_nt1_tn2_step, 1, true, false, 4, 2)
QT_MMA(qt_mma_bf16_nt2_tn1_post, 2, true, true, 6, 1)
QT_MMA(qt_mma_bf16_nt2_tn1_step, 2, true, false, 4, 1)
QT_MMA(qt_mma_bf16_nt2_tn2_post, 2, true, true, 6, 2)
QT_MMA(qt_mma_bf16_nt2_tn2_step, 2, true, false, 4, 2)
QT_MMA(qt_mma_bf16_nt4_tn1_post, 4, true, true, 6, 1)
QT_MMA(qt_mma_bf16_nt4_tn1_step, 4, true, false, 4, 1)
QT_MMA(qt_mma_bf16_nt4_tn2_post, 4, true, true, 6, 2)
QT_MMA(qt_mma_bf16_nt4_tn2_step, 4, true, false, 4, 2)
// Deeper rings (11 blocks in flight per warp) for the weight-streaming regime.
QT_MMA(qt_mma_f16_nt1_tn1_post_d12, 1, false, true, 12, 1)
QT_MMA(qt_mma_f16_nt1_tn2_post_d12, 1, false, true, 12, 2)
QT_MMA(qt_mma_f16_nt2_tn1_post_d12, 2, false, true, 12, 1)
QT_MMA(qt_mma_f16_nt2_tn2_post_d12, 2, false, true, 12, 2)
QT_MMA(qt_mma_bf16_nt1_tn1_post_d12, 1, true, true, 12, 1)
QT_MMA(qt_mma_bf16_nt1_tn2_post_d12, 1, true, true, 12, 2)
QT_MMA(qt_mma_bf16_nt2_tn1_post_d12, 2, true, true, 12, 1)
QT_MMA(qt_mma_bf16_nt2_tn2_post_d12, 2, true, true, 12, 2)

// The wgmma kernels exist only in the sm_90a build (a lookup elsewhere fails, and launch.py never asks); so do the
// x-in-registers kernels whose two K groups meet in a thread-block cluster (suffix _c; launched as clusters of 2).
// Ring depth: D - 1 >= STAGES - 2 (the weights run at least as far ahead as x); D = STAGES keeps the
// smem of bn128 / 4 stages at 82 KB, two CTAs per SM.
#ifdef QT_WGMMA
#define QT_XRC(SUF, NT, R, D, TH, T, S, L, B)                                                                 \
  extern "C" __global__ void __launch_bounds__(TH, 1) qt_xr_f16_nt##NT##_r##R##_d##D##SUF##_c(QT_ARGS) {    \
    const qt::Args a = QT_PACK;                                                                           \
    qt::xr_small<false, NT, R, D, S, L, 0, T, B, true>(a);                                                \
  }                                                                                                       \
  extern "C" __global__ void __launch_bounds__(TH, 1) qt_xr_bf16_nt##NT##_r##R##_d##D##SUF##_c(QT_ARGS) {   \
    const qt::Args a = QT_PACK;                                                                           \
    qt::xr_small<true, NT, R, D, S, L, 0, T, B, true>(a);                                                 \
  }
QT_XRC(_b, 2, 8, 3, 256, 1, 4, 2, true)
QT_XRC(_t2_s4_b, 2, 8, 2, 256, 2, 4, 2, true)
QT_XRC(, 2, 8, 3, 256, 1, 4, 2, false)
QT_XRC(_t2_s4, 2, 8, 2, 256, 2, 4, 2, false)
extern "C" __global__ void __launch_bounds__(256, 1) qt_xr_probe12_f16_nt2_r8_d2_t2_s4_b_c(QT_ARGS) {
  const qt::Args a = QT_PACK;
  qt::xr_small<false, 2, 8, 2, 4, 2, 12, 2, true, true>(a);
}
#define QT_WGX(NAME, BN, WGS, ST, BF16, NS, PR)                                \
  extern "C" __global__ void __launch_bounds__(128 * WGS, 1) NAME(QT_ARGS) {   \
    const qt::Args a = QT_PACK;                                                \
    qt::wg_large<BN, WGS, ST, BF16, NS, (NS == 1 ? ST : ST - 1), PR>(a);       \
  }
#define QT_WG(NAME, BN, WGS, ST, BF16, NS) QT_WGX(NAME, BN, WGS, ST, BF16, NS, 0)
// x by the tensor memory accelerator (TMA_X): one more argument, x's tensor map (launch.py encodes it per call);
// qt_wg_{dt}_bn{BN}_wg{WGS}_s{ST}_{blk,step}_tma
#define QT_WGT1(NAME, BN, WGS, ST, BF16, NS)                                                \
  extern "C" __global__ void __launch_bounds__(128 * WGS + 128, 1)                            \
      NAME(QT_ARGS, const __grid_constant__ qt::TMap xmap) {                                   \
    const qt::Args a = QT_PACK;                                                              \
    qt::wg_large<BN, WGS, ST, BF16, NS, (NS == 1 ? ST : ST - 1), 0, true>(a, &xmap);        \
  }
#define QT_WGT(BN, WGS, ST)                                                         \
  QT_WGT1(qt_wg_f16_bn##BN##_wg##WGS##_s##ST##_blk_tma, BN, WGS, ST, false, 1)   \
  QT_WGT1(qt_wg_f16_bn##BN##_wg##WGS##_s##ST##_step_tma, BN, WGS, ST, false, 4)  \
  QT_WGT1(qt_wg_bf16_bn##BN##_wg##WGS##_s##ST##_blk_tma, BN, WGS, ST, true, 1)   \
  QT_WGT1(qt_wg_bf16_bn##BN##_wg##WGS##_s##ST##_step_tma, BN, WGS, ST, true, 4)
QT_WGT(64, 2, 6)
QT_WGT(128, 1, 6)
QT_WGT(128, 2, 6)
QT_WGT(128, 2, 4)
QT_WGT(256, 2, 4)
QT_WGT(256, 2, 6)
// its probes (benchmarks only, wrong results): qt_wg_probe{PR}_f16_bn{BN}_wg{WGS}_s{ST}_blk
#define QT_WG_PROBE(BN, WGS, ST, PR) \
  QT_WGX(qt_wg_probe##PR##_f16_bn##BN##_wg##WGS##_s##ST##_blk, BN, WGS, ST, false, 1, PR)
QT_WG_PROBE(128, 4, 6, 1)
QT_WG_PROBE(128, 4, 6, 2)
QT_WG_PROBE(128, 4, 6, 3)
QT_WG_PROBE(256, 2, 4, 1)
QT_WG_PROBE(256, 2, 4, 2)
QT_WG_PROBE(256, 2, 4, 3)

QT_WG(qt_wg_f16_bn64_wg2_s6_blk, 64, 2, 6, false, 1)
QT_WG(qt_wg_f16_bn64_wg2_s6_step, 64, 2, 6, false, 4)
QT_WG(qt_wg_f16_bn128_wg1_s6_blk, 128, 1, 6, false, 1)
QT_WG(qt_wg_f16_bn128_wg1_s6_step, 128, 1, 6, false, 4)
QT_WG(qt_wg_f16_bn128_wg2_s6_blk, 128, 2, 6, false, 1)
QT_WG(qt_wg_f16_bn128_wg2_s6_step, 128, 2, 6, false, 4)
QT_WG(qt_wg_f16_bn128_wg2_s4_blk, 128, 2, 4, false, 1)
QT_WG(qt_wg_f16_bn128_wg2_s4_step, 128, 2, 4, false, 4)
QT_WG(qt_wg_f16_bn128_wg4_s6_blk, 128, 4, 6, false, 1)
QT_WG(qt_wg_f16_bn128_wg4_s6_step, 128, 4, 6, false, 4)
QT_WG(qt_wg_f16_bn256_wg2_s4_blk, 256, 2, 4, false, 1)
QT_WG(qt_wg_f16_bn256_wg2_s4_step, 256, 2, 4, false, 4)
QT_WG(qt_wg_bf16_bn64_wg2_s6_blk, 64, 2, 6, true, 1)
QT_WG(qt_wg_bf16_bn64_wg2_s6_step, 64, 2, 6, true, 4)
QT_WG(qt_wg_bf16_bn128_wg1_s6_blk, 128, 1, 6, true, 1)
QT_WG(qt_wg_bf16_bn128_wg1_s6_step, 128, 1, 6, true, 4)
QT_WG(qt_wg_bf16_bn128_wg2_s6_blk, 128, 2, 6, true, 1)
QT_WG(qt_wg_bf16_bn128_wg2_s6_step, 128, 2, 6, true, 4)
QT_WG(qt_wg_bf16_bn128_wg2_s4_blk, 128, 2, 4, true, 1)
QT_WG(qt_wg_bf16_bn128_wg2_s4_step, 128, 2, 4, true, 4)
QT_WG(qt_wg_bf16_bn128_wg4_s6_blk, 128, 4, 6, true, 1)
QT_WG(qt_wg_bf16_bn128_wg4_s6_step, 128, 4, 6, true, 4)
QT_WG(qt_wg_bf16_bn256_wg2_s4_blk, 256, 2, 4, true, 1)
QT_WG(qt_wg_bf16_bn256_wg2_s4_step, 256, 2, 4, true, 4)
#endif

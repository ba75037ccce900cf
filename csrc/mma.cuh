// The mma.sync kernels that stage x in shared memory: mma_small (x staged per CTA) and mma_xs (x streamed in
// chunks).
#pragma once
#include "common.cuh"
#include "epilogue.cuh"

namespace qt {

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
// Never a programmatic dependent launch (launch.py): it has no pdl_wait. x is staged in the same commit group
// as, and ahead of, the first weight blocks; with a wait between them all D - 1 blocks would have to land before
// the first mma.
// ---------------------------------------------------------------------------------------------------------
template <int NT, bool BF16, bool POST, int D, int TN>
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
      mma_block<NT, BF16, POST>(acc, ws, at.g, lds, i * 128);
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
// ---------------------------------------------------------------------------------------------------------
template <int NT, bool BF16, int D, int TN, int XC, int XS>
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
    if (c < nchunks) load_x(c);
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
    cp_wait<D - 2>();  // the chunk's first block's weights and the chunk (this thread's copies) ...
    __syncthreads();   // ... everyone's; every warp is done with the previous slot
    if (chunk + XS - 1 < nchunks) load_x(chunk + XS - 1);
    const uint32_t xrow = xs_base + (chunk % XS) * XSLOT;
#pragma unroll
    for (int ib = 0; ib < XC; ++ib) {
      const int i = chunk * XC + ib;
      if (i >= at.nb) break;  // the same for the whole CTA
      if (active && i + D - 1 < at.nb) ws.issue();
      cp_commit();
      cp_wait<D - 1>();  // block i's slot is complete (this lane's copies) ...
      __syncwarp();      // ... and the metadata the warp's lanes copied
      if (active) mma_block<NT, BF16, true>(acc, ws, at.g, lds, xrow + ib * 128);
      ws.next();
    }
  }
  cp_wait<0>();
  constexpr int V = TN == 1 ? 2 : 4;  // float4s per thread per pass of the split-K sum: 80 registers at TN = 1
  epilogue<NT, BF16, TN, V>(p, acc, at.tn0 * 16, at.m0, at.mc, blockIdx.x * at.nwarps * TN * 16,
                            at.nwarps * TN * 16, blockDim.x);
}

}  // namespace qt

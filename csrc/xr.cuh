// The x-in-registers kernel (xr_small).
#pragma once
#include "common.cuh"

namespace qt {

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
// dequantization and NT mmas. The steady state runs close to the bare weight stream; what a call pays once is the
// x load and the first unit's arithmetic before the ring moves, and the last unit and the K groups' sums after it.
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
// (A fixed summing warp, not the last to arrive, keeps the slowest warp from getting slower still; counting in
// after the loop keeps a fence, which waits for the ring's copies in flight, off the summing warp.)
// Work: units (K group kg, T tiles), kg-major, cut into one equal contiguous range per CTA (a persistent grid); a
// CTA whose range crosses into the next K group reloads its x registers there. The last unit of a K group may
// hold tiles past N: they copy the unit's first tile again and are never stored.
// Shared: the rings (NW x D slots of T x {R x 512 bytes of weights, R 48-byte records}, BIAS: each followed by
// the warp's sums of x), the S partial slots, 2 S mbarriers, then CL: S2 slots of rank 1's sums and 2 S2
// mbarriers. Workspace: ws [G][N16][32][NT] float4, cnt [units per K group]. The group of a block is found
// by a shift; GB = blocks per group inside a warp's range (min(R, group / 64), both powers of two): a record per
// GB blocks.
// ---------------------------------------------------------------------------------------------------------
template <bool BF16, int NT, int R, int D, int S = 4, int L = 2, int T = 1, bool BIAS = false, bool CL = false>
DEVI void xr_small(const Args& p) {
  static_assert(L < S && (!CL || (L >= 2 && L + 1 < S)), "a unit's partial slot is summed before it is reused");
  static_assert(!BIAS || NT == 2, "the biased form: two batch tiles");
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

  // Producer side of the ring, by running pointers (addresses recomputed per unit would be about a quarter of the
  // instructions per warp and unit): this lane's next weight piece and
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
  if constexpr (!CL) __syncthreads();  // the mbarriers' initialization

  // x as B fragments: lane (g, t) of batch tile j holds x[8 j + g][k + 2t, k + 2t + 1] and [k + 2t + 8, + 9] for
  // each k16 step k of its R blocks (rows past M and k past K: 0)
  uint32_t xb[R][4][NT][2];
  auto load_x = [&](int kg) {
    // Lane t of a row loads the row's 16-byte chunks t and t + 4 of each block (words 4t..4t+3, 16+4t..16+4t+3)
    // and the row's four lanes transpose them (transpose4), so that lane t holds words t, 4+t, .. 28+t: its
    // fragments. Four-byte loads of the fragments themselves (64 a lane, each warp load touching 8 rows' lines)
    // would stall the warps far longer.
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
    mbar_wait(full + slot * 8, (f / S) & 1);  // every warp's partial of unit f
    float4 sum[T][NT];
    const uint32_t src = part + slot * pslot + lane * 16;
#pragma unroll
    for (int c = 0; c < T * NT; ++c) sum[c / NT][c % NT] = lds_f4(src + c * 512);
    for (int w = 1; w < nw; ++w) {
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
      if (CL || G == 1) {
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
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          uint32_t a[4];
          if constexpr (BIAS) {
            biased<BF16>(word(wv, s), a);
          } else {
            dequant<BF16, false>(word(wv, s), rc, a);
          }
#pragma unroll
          for (int j = 0; j < NT; ++j) mma16816<BF16>(accb[j], a, xb[b][s][j][0], xb[b][s][j][1]);
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
  // loads x at once, 128 KB an SM of the same lines, and a copy queued ahead of it (L2 to SM bandwidth) would hold
  // the first mma back. (A K group entered later in the range, by one CTA alone, loads its x after the copy, in
  // the loop: one load_x site there keeps the loop's registers within bounds; a second one spills the biased
  // kernels.)
  if (n > 0) {
    load_x(kg);
    live = (kg * nw + warp) * R < p.KB;
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
    if (i >= S) mbar_wait(empty + slot * 8, ((i / S) - 1) & 1);  // unit i - S's partials were summed
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
#pragma unroll
      for (int j = 0; j < NT; ++j)
        asm volatile("st.shared.v4.f32 [%0], {%1,%2,%3,%4};\n" ::"r"(dst + (tt * NT + j) * 512), "f"(acc[j][0]),
                     "f"(acc[j][1]), "f"(acc[j][2]), "f"(acc[j][3]) : "memory");
    }
    __syncwarp();  // the lanes' stores before lane 0's arrival (a release at CTA scope)
    if (lane == 0) mbar_arrive(full + slot * 8);
    if (i >= lag && fw == warp) finish(i - lag);
    fw = fw + 1 == nw ? 0 : fw + 1;
    if (++tile == ntu) {
      tile = 0;
      ++kg;
    }
  }
  for (int f = max(0, n - lag); f < n; ++f)
    if (f % nw == warp) finish(f);
  cp_wait<0>();
  if constexpr (CL) cluster_sync();  // neither CTA leaves while the other may write to or arrive in its memory
  if (CL || G == 1) return;
  // The K-group hand-over, once per warp after its loop: a fence in the loop (a release per unit) would wait for
  // the ring's copies in flight and hold the finishing warp, and through the partial slots every warp. Lane l
  // counts this warp's l-th finished unit (units warp, warp + NW, ...) in; the last K group of a tile to arrive
  // sums its G partials in K-group order (deterministic) and re-arms the tile's counter.
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
    unsigned pending = __ballot_sync(0xffffffffu, last);
    if (pending) {
      __syncwarp();      // the counting lanes' observations ...
      __threadfence();   // ... before every lane's reads of the other K groups' partials
    }
    while (pending) {
      const int src = __ffs(pending) - 1;
      pending &= pending - 1;
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
}

}  // namespace qt

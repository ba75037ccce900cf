// The stream-K kernel (sk_small).
#pragma once
#include "common.cuh"

namespace qt {

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
// ZSUB: the zero point is removed from each fragment by one FMA (dequant) instead of (bias + z) * sum(x) from
// the block sums: no x sums between the wait for the previous kernel and the first mma, no cancellation in
// fp32; four more instructions per k16 step. Faster on the grids of whole tiles per CTA (k/v, down), slower on
// the 1/sm grid (gate/up), where the x sums are made off the critical path.
template <bool BF16, int UB, int D, bool ZSUB = false>
DEVI void sk_small(const Args& p) {
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
    if (lane < 3)
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
    const int total = mc * cpr;
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
    const int items = ZSUB ? 0 : mc * nu * CH;
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
    for (int c = threadIdx.x; c < (ZSUB ? 0 : (8 - mc) * nu); c += blockDim.x) {  // rows past M
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

}  // namespace qt

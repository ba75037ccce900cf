// The wgmma kernel (sm_90a): wg_large.
#pragma once
#include "common.cuh"
#include "epilogue.cuh"

namespace qt {

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
// rows, 128-byte swizzle: the layout sw128_lo / sw128_desc describe); a producer warpgroup copies each block's x
// tile and the CTA's weights and metadata for it into a stage, completing the stage's "full" mbarrier; each
// consumer warp releases a stage on its "empty" mbarrier once the wgmmas that read it are done. The consumers copy
// nothing and meet at no CTA barrier and no proxy fence per block, which in the cp.async form (all threads copy,
// then fence and __syncthreads every block) hold the tensor cores back.
// With one group a block (NS == 1) the weights and metadata come by tensor maps too (TMA_W): three boxes a block
// from one thread (the CTA's tiles' 512-byte blocks of weights, their scale and zero records). Copied by cp.async
// from all 128 producer threads instead (the NS == 4 form, whose four records a block are each a group's), the
// consumers wait on a stage's "full" barrier for a fifth to a quarter of their time at M 32-64 (Nsight Compute,
// H100) and the weights stream at half the bandwidth; by tensor maps Llama-3-70B's gate_proj at M = 32 takes
// 60 us instead of 77.
// The producer is a whole warpgroup so that it can give its registers to the consumers (setmaxnreg works per
// warpgroup): at 168 registers a thread for every warp of 3 warpgroups, ptxas has 38 beside the 128 accumulators
// and recomputes the loop's addresses, predicates and scale pairs every block and step, so the consumers'
// instruction stream, not the tensor pipe, would set the pace.
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

// A 3-D box of the tensor map (innermost coordinate first) into shared memory at dst (128-byte aligned),
// completing `bar`'s transaction bytes.
DEVI void tma_load_3d(uint32_t dst, const TMap* map, int c0, int c1, int c2, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}

// A stage's weights and metadata as the tensor maps lay them (wg_large's TMA_W form): the CTA's T tiles' 512-byte
// blocks, then their 32-byte scale records, then their 16-byte zero records; a warp reads its own tile's.
template <int T>
struct BoxSlot {
  static constexpr int SCALES = T * 512, ZEROS = T * 544;
  static constexpr int BYTES = (T * 560 + 127) / 128 * 128;  // stages stay 128-byte aligned for the copies
  uint32_t read;
  int lane, warp;
  DEVI uint4 weights() const {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(read + warp * 512 + lane * 16));
    return v;
  }
  DEVI uint32_t scale(int) const {
    uint32_t v;
    asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(read + SCALES + warp * 32 + (lane >> 2) * 4));
    return v;
  }
  DEVI uint2 zero(int) const {
    uint2 v;
    asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(read + ZEROS + warp * 16));
    return v;
  }
  DEVI void next() {}
};

// The mbarrier's pending arrival count drops by one once every cp.async this thread issued so far has landed
// (noinc: the barrier's expected count includes this arrival).
DEVI void cp_async_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// Whether this launch's K splits form one thread-block cluster per output tile (qtool/kernels/cuda/launch.py
// _plan launches them so where the Config says).
DEVI bool split_cluster() { return gridDim.y > 1 && cluster_ctas() == gridDim.y; }

// Slice [e_begin, e_end) of the tile (float4s; tile rows of w floats, w4 float4s of them written) summed over
// the cluster's ranks into y: each thread has the R ranks' float4s of V elements in flight at once and adds them
// in rank order. (One rank at a time, a thread waits out a shared::cluster round trip per rank: with 8 splits
// that wait was most of a small layer's epilogue.)
template <int R, int V, bool BF16>
DEVI void cluster_sum(const Args& p, int ranks, int e_begin, int e_end, int w, int w4, int m0, int tile_n0,
                      int nthr, uint32_t sbase) {
  for (int e0 = e_begin + threadIdx.x; e0 < e_end; e0 += nthr * V) {
    uint32_t off[V];
    bool ok[V];
#pragma unroll
    for (int u = 0; u < V; ++u) {
      const int e = e0 + u * nthr, ml = e / w4;
      ok[u] = e < e_end;
      off[u] = sbase + (uint32_t)(ml * w + 4 * (e - ml * w4)) * 4u;
    }
    float4 part[R][V];
#pragma unroll
    for (int s = 0; s < R; ++s)
#pragma unroll
      for (int u = 0; u < V; ++u)
        if (s < ranks && ok[u]) part[s][u] = ld_cluster_f4(cluster_map(off[u], s));
#pragma unroll
    for (int u = 0; u < V; ++u) {
      if (!ok[u]) continue;
      float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int s = 0; s < R; ++s)
        if (s < ranks) add_to(sum, part[s][u]);
      const int e = e0 + u * nthr, ml = e / w4, n = tile_n0 + 4 * (e - ml * w4);
      uint16_t* dst = p.y + (size_t)(m0 + ml) * p.N + n;
      const float f[4] = {sum.x, sum.y, sum.z, sum.w};
#pragma unroll
      for (int c = 0; c < 4; ++c)
        if (n + c < p.N) dst[c] = from_f32<BF16>(f[c]);
    }
  }
}

// Split K summed on chip (sm_90a): the gridDim.y CTAs of one output tile are one cluster. Each writes its fp32
// tile [BN batch rows][tile_w + 4] (the pad spreads a warp's stores over all 32 banks) into its own shared memory
// at sbase, whose pipeline stages are done with; after a cluster barrier CTA r sums slice r of the tile over the
// ranks' copies in rank (= split) order, the same order and so the same bits as the workspace form, and writes
// y. No workspace, no counter, and the sum is spread over all the tile's CTAs instead of its last one, which
// reads every split's partials from L2 alone (at BN 128-256 that tail is several microseconds). The second
// cluster barrier keeps every CTA's shared memory alive until the others have read it; its arrival is relaxed,
// as the reads it follows are complete (their values are stored), so it does not wait for y's stores to drain.
template <int NT, bool BF16>
DEVI void epilogue_cluster(const Args& p, float (&acc)[1][NT][4], int n0, int m0, int mc, int tile_n0, int tile_w,
                           int nthr, uint32_t sbase) {
  const int w = tile_w + 4;
  fence_proxy_async();  // the stages' last TMA writes and wgmma reads precede these generic stores
  __syncthreads();      // every warp of this CTA is done with the stages
  float* tile = reinterpret_cast<float*>(__cvta_shared_to_generic(sbase));
  for_each_acc<NT, 1>(acc, n0, [&](int n, int ml, float v) { tile[ml * w + (n - tile_n0)] = v; });
  cluster_sync();
  const int ranks = gridDim.y, rank = (int)cluster_rank();
  const int w4 = tile_w >> 2, total = mc * w4, per = (total + ranks - 1) / ranks;
  const int e_begin = rank * per, e_end = min(total, e_begin + per);
  // 8-16 float4s in flight a thread (at most 64 registers: the accumulators are stored by now); at most 8 ranks, a
  // portable cluster (launch.WG_CLUSTER_MAX). With two ranks, 4 elements of 2 ranks took 2-8 % less time than 8 of
  // 2 (H100: Llama-3-70B TP=4's 2048 x 8192 at M 128-256, the MoE expert's 768 x 2048 at M 192-256).
  if (ranks <= 2)
    cluster_sum<2, 4, BF16>(p, ranks, e_begin, e_end, w, w4, m0, tile_n0, nthr, sbase);
  else if (ranks <= 4)
    cluster_sum<4, 4, BF16>(p, ranks, e_begin, e_end, w, w4, m0, tile_n0, nthr, sbase);
  else
    cluster_sum<8, 2, BF16>(p, ranks, e_begin, e_end, w, w4, m0, tile_n0, nthr, sbase);
  cluster_arrive_relaxed();
  cluster_wait();
}

template <int BN, int WGS, int STAGES, bool BF16, int NS, int D, bool TMA_X = false>
DEVI void wg_large(const Args& p, const TMap* xmap = nullptr, const TMap* wmap = nullptr, const TMap* smap = nullptr,
                   const TMap* zmap = nullptr) {
  constexpr bool TMA_W = TMA_X && NS == 1;  // the weights and metadata by tensor maps (wmap, smap, zmap)
  extern __shared__ uint4 smem4[];
  constexpr int SLOT = BN * 128;  // bytes: BN rows of 64 halves
  constexpr int NTH = 128 * WGS;
  const uint32_t sbase = (smem_u32(smem4) + 1023u) & ~1023u;  // the swizzle pattern repeats every 1 KB
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2;
  const int n16 = (p.N + 15) >> 4;
  const int bx = blockIdx.x + p.bx0;
  const int tn = bx * (4 * WGS) + warp;
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
  auto block = [&](auto& ws, uint32_t dlo, auto&& after_step) {
    const uint4 wv = ws.weights();
    RowConst rc = row_const<BF16>(ws.scale(0), ws.zero(0), g);
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const int b = s & 1;
      if constexpr (NS == 4) {
        if (s > 0) rc = row_const<BF16>(ws.scale(s), ws.zero(s), g);
      }
      dequant<BF16, true>(word(wv, s), rc, a[b]);
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
    // A stage holds x tile j (SLOT bytes at sbase + slot SLOT) and, after all x slots, block j's weights and
    // metadata for the CTA's 4 WGS warps (TMA_W: a BoxSlot; else WSLOT each, laid out as a Stream slot, read with
    // the same accessors). Barriers: full[STAGES] (the producer's expect_tx arrival, whose bytes complete with the
    // copies, and without TMA_W one arrival per producer thread once its cp.asyncs have landed) and empty[STAGES]
    // (one arrival per consumer warp). Block j uses stage j % STAGES, phase j / STAGES.
    constexpr int WSLOT = R::SLOT, WSTAGE = TMA_W ? BoxSlot<4 * WGS>::BYTES : 4 * WGS * WSLOT;
    // setmaxnreg shares out only the CTA's registers at launch (WGS + 1 warpgroups, a multiple of 8 a thread):
    // the producer keeps PRODUCER_REGS and the consumers split what it gives back (2 consumer warpgroups:
    // 168 -> 56 and 224 a thread; 3: 128 -> 56 and 152; 4: 96 -> 56 and 104).
    constexpr int LAUNCH_REGS = (65536 / (128 * (WGS + 1))) & ~7, PRODUCER_REGS = 56;
    constexpr int SHARED_OUT = (LAUNCH_REGS + (LAUNCH_REGS - PRODUCER_REGS) / WGS) & ~7;
    constexpr int CONSUMER_REGS = SHARED_OUT < 240 ? SHARED_OUT : 240;
    const uint32_t wbase = sbase + STAGES * SLOT;
    __shared__ __align__(8) uint64_t bars[2 * STAGES];
    const uint32_t full = smem_u32(bars), empty = full + STAGES * 8;
    pdl_start(p.flags);
    if (tid == 0) {
#pragma unroll
      for (int j = 0; j < STAGES; ++j) {
        mbar_init(full + j * 8, TMA_W ? 1 : 1 + 128);
        mbar_init(empty + j * 8, 4 * WGS);
      }
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // visible to the copy engine
    }
    __syncthreads();  // the barriers are initialized before anyone waits on them

    if (producer) {
      // The producer warpgroup fills each stage once the consumers have released its previous block: by tensor
      // maps (TMA_W, below), or its 128 threads copy the CTA's weights and metadata (16-byte cp.asyncs, the same
      // PPT pieces of each block per thread) and arrive when they land, thread 0 arming the barrier with x's bytes
      // and copying the x tile. Warps of their own, so the copies run ahead of every consumer warp, not of one,
      // and the consumers issue no copies at all: their own cp.async rings cost each consumer warp ~50
      // instructions a block. (One 1-D bulk copy per tile's weights and per record, 25 a block, is far slower.)
      if constexpr (WGS >= 2) asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER_REGS) : "memory");
      const int ptid = tid - NTH, t0 = bx * 4 * WGS;
      // The stages in order: weights(j) copies block j's weights and metadata into its stage once release(bar,
      // parity) has seen the consumers release the stage's previous block (the first stages' before pdl_wait: no
      // earlier kernel writes them); thread 0 copies its x tile after pdl_wait.
      auto stream = [&](auto&& weights, auto&& release) {
#pragma unroll 1
        for (int j = 0; j < min(nb, STAGES); ++j) weights(j);
        pdl_wait(p.flags);
#pragma unroll 1
        for (int j = 0; j < nb; ++j) {
          const int slot = j % STAGES;
          if (j >= STAGES) {
            release(empty + slot * 8, ((j / STAGES) - 1) & 1);  // block j - STAGES released it
            weights(j);
          }
          if (ptid == 0) {
            if constexpr (!TMA_W) mbar_expect_tx(full + slot * 8, SLOT);  // (TMA_W: armed with the weights)
            tma_load_2d(sbase + slot * SLOT, xmap, (kb0 + j) * 64, m0, full + slot * 8);
          }
        }
      };
      if constexpr (TMA_W) {
        // One thread copies each block: the CTA's T tiles' weights, scale and zero records as boxes of the three
        // tensor maps (tiles past N read as zeros, and count), arming the stage's barrier with them and x's tile.
        constexpr int T = 4 * WGS, BYTES = SLOT + T * 560;
        if (ptid == 0) {
          stream(
              [&](int j) {
                const int slot = j % STAGES, kb = kb0 + j, grp = min((kb * 64) >> p.gshift, p.NG - 1);
                const uint32_t st = wbase + slot * WSTAGE, bar = full + slot * 8;
                mbar_expect_tx(bar, BYTES);
                tma_load_3d(st, wmap, 0, kb, t0, bar);
                tma_load_3d(st + BoxSlot<T>::SCALES, smap, 0, grp, t0, bar);
                tma_load_3d(st + BoxSlot<T>::ZEROS, zmap, 0, grp, t0, bar);
              },
              [](uint32_t bar, uint32_t parity) { mbar_wait(bar, parity); });
        }
      } else {
        constexpr int PT = 32 + 3 * NS, PPT = (4 * WGS * PT + 127) / 128;  // pieces per tile, per thread
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
        stream(
            [&](int j) {  // block j's pieces into its stage, then this thread's arrival
              const int slot = j % STAGES, kb = kb0 + j;
              const uint32_t base = wbase + slot * WSTAGE;
#pragma unroll
              for (int r = 0; r < PPT; ++r) {
                if (!valid[r]) continue;
                // No L2 policy hint (evict-first) here: with one, ptxas 13.0 gives these cp.asyncs an odd uniform
                // register as their memory descriptor, which faults (illegal instruction under compute-sanitizer).
                const size_t off = step[r] < 0 ? (size_t)j * 512 : (size_t)ws.group(kb, step[r]) * mstride[r];
                cp_async16(base + dst[r], src[r] + off, true);
              }
              cp_async_arrive(full + slot * 8);
            },
            [&](uint32_t bar, uint32_t parity) {  // one lane of each warp waits, the warp follows
              if (lane == 0) mbar_wait(bar, parity);
              __syncwarp();
            });
        cp_wait<0>();
      }
      epilogue_barriers(split_cluster());
      return;
    }
    pdl_wait(p.flags);  // before the epilogue writes y, the workspace and the counters
    if constexpr (WGS >= 2) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER_REGS) : "memory");
    int xslot = 0;
    uint32_t phase = 0, xdlo = sw128_lo(sbase), wread = wbase + (TMA_W ? 0 : warp * WSLOT);
    BoxSlot<4 * WGS> bs{0, lane, warp};
    for (int i = 0; i < nb; ++i) {
      mbar_wait(full + xslot * 8, phase);  // x tile i, the weights and metadata of block i have landed
      const int prev = xslot == 0 ? STAGES - 1 : xslot - 1;
      // after step 0 every wgmma of block i - 1 is done (and its weights were read before): its stage is free
      auto release = [&](int s) {
        if (s == 0 && i > 0 && lane == 0) mbar_arrive(empty + prev * 8);
      };
      if constexpr (TMA_W) {
        bs.read = wread;
        block(bs, xdlo, release);
      } else {
        ws.read = wread;
        block(ws, xdlo, release);
      }
      if (++xslot == STAGES) {
        xslot = 0;
        phase ^= 1u;
        xdlo = sw128_lo(sbase);
        wread = wbase + (TMA_W ? 0 : warp * WSLOT);
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
      if (d < nb) load_x(d, kb0 + d);
#pragma unroll
    for (int d = 0; d < D - 1; ++d) cp_commit();

    // Group committed in iteration i: x of block i + STAGES - 2 and weights of block i + D - 1, so waiting
    // for block i's x tile (STAGES - 3 younger groups) also covers its (older) weights.
    int xslot = 0;
    for (int i = 0; i < nb; ++i) {
      cp_wait<STAGES - 3>();  // block i's x tile, weights and metadata have landed (this thread's copies)
      fence_proxy_async();  // ... and the x tile is visible to the tensor cores' reads
      __syncthreads();      // every thread's copies; every warpgroup is done with block i - 2's x slot
      if (i + STAGES - 2 < nb) load_x((i + STAGES - 2) % STAGES, kb0 + i + STAGES - 2);
      if (active && i + D - 1 < nb) ws.issue();
      cp_commit();
      block(ws, sw128_lo(sbase + xslot * SLOT), [](int) {});
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
  if (split_cluster())
    epilogue_cluster<BN / 8, BF16>(p, acc4, tn * 16, m0, mc, bx * 4 * WGS * 16, 4 * WGS * 16, NTH, sbase);
  else
    epilogue<BN / 8, BF16, 1>(p, acc4, tn * 16, m0, mc, bx * 4 * WGS * 16, 4 * WGS * 16, NTH);
}
#endif

}  // namespace qt

// The split-K epilogue shared by the mma and wgmma kernels.
#pragma once
#include "common.cuh"

namespace qt {

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
  // that lets its threads read the others' partials. One fence per CTA, not one per thread: a fence in every
  // thread stalls every warp on it.
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
  // flight instead of one 4-byte load: this loop is latency-bound (an L2 round trip per pass). Partials are
  // written for every n < np (np and tile_n0 multiples of 16), so a float4 never straddles the end.
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

// The wgmma kernel's producer warpgroup in the epilogue: it holds no accumulators and its registers are given to
// the consumers (setmaxnreg), so it only meets the epilogue's barriers (split K): two of the CTA, or as a cluster
// (epilogue_cluster) the CTA's and the cluster's two.
DEVI void epilogue_barriers(bool cluster = false) {
  if (gridDim.y > 1) {
    __syncthreads();
    if (cluster) {
#ifdef QT_WGMMA
      cluster_sync();
      cluster_arrive_relaxed();  // as epilogue_cluster's second barrier
      cluster_wait();
#endif
    } else {
      __syncthreads();
    }
  }
}

}  // namespace qt

// Read-bandwidth probe for the M = 1 weight stream (benchmarks/results/bench.md, fifth pass).
//
// How fast can an H200 *read* a 4 MB, 34 MB or 117 MB buffer (a Llama-3-70B k/v, q/o and MLP weight at 4 bits)
// in one kernel launch, by access shape? Each variant XORs what it reads into one word per thread (stored, so
// nothing is optimized away). Times are CUDA-graph replays of launches over rotating buffers (>= 3x the L2),
// as `qtool bench --graphs` times kernels.
//
//   nvcc -O3 -DALL_VARIANTS -gencode arch=compute_90a,code=sm_90a -o build/stream_probe benchmarks/stream_probe.cu
//   ./build/stream_probe > stream-probe-h200-rings.csv     (results/bench.md, fifth pass)
//
// Variants (always built):
//   cpring D:  per-warp cp.async ring of D 512-byte slots over the warp's contiguous range (the kernels' shape)
//   bwarp C S: per-warp ring of S slots of C bytes filled by cp.async.bulk (lane 0), same ranges
// and with -DALL_VARIANTS also (stream-probe-h200.csv holds these alone, from the first run):
//   contig U:  warp w reads its own contiguous range; each lane keeps U 16-byte loads in flight (stride 512 B)
//   front U:   grid-stride over 512-byte pieces: at any time the warps read one moving front of memory
//   bulk C S:  one thread per CTA issues cp.async.bulk copies of C bytes into an S-deep shared ring (mbarriers),
//              the CTA's warps read the ring; CTA b reads its own contiguous range
// each with W warps per CTA and P CTAs per SM (a grid of P * SMs CTAs).

#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>

#include <algorithm>
#include <vector>

#define CK(x)                                                                              \
  do {                                                                                     \
    cudaError_t e_ = (x);                                                                  \
    if (e_ != cudaSuccess) {                                                               \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      return 1;                                                                            \
    }                                                                                      \
  } while (0)

template <int HINT>
__device__ __forceinline__ uint4 ld16(const uint4* p) {
  uint4 v;
  if constexpr (HINT == 0) {
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  } else if constexpr (HINT == 1) {
    asm volatile("ld.global.nc.L1::no_allocate.L2::128B.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  } else {
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  }
  return v;
}

// n16: buffer size in uint4 (a multiple of 32 * U * total warps is not required: tails are masked)
template <int U, int HINT>
__global__ void contig(const uint4* __restrict__ buf, size_t n16, uint32_t* out) {
  const int lane = threadIdx.x & 31;
  const size_t tw = (size_t)gridDim.x * (blockDim.x >> 5);
  const size_t gw = (size_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const size_t pieces = n16 / 32;  // 512-byte pieces
  const size_t per = (pieces + tw - 1) / tw;
  const size_t p0 = gw * per, p1 = min(pieces, p0 + per);
  uint32_t acc = 0;
  for (size_t p = p0; p < p1; p += U) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const size_t q = min(p + u, p1 - 1);
      v[u] = ld16<HINT>(buf + q * 32 + lane);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}

template <int U, int HINT>
__global__ void front(const uint4* __restrict__ buf, size_t n16, uint32_t* out) {
  const int lane = threadIdx.x & 31;
  const size_t tw = (size_t)gridDim.x * (blockDim.x >> 5);
  const size_t gw = (size_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const size_t pieces = n16 / 32;
  uint32_t acc = 0;
  for (size_t p = gw; p < pieces; p += U * tw) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const size_t q = min(p + u * tw, pieces - 1);
      v[u] = ld16<HINT>(buf + q * 32 + lane);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}

__device__ __forceinline__ uint32_t su32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mb_init(uint32_t a, int n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(a), "r"(n) : "memory");
}
__device__ __forceinline__ void mb_expect(uint32_t a, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(a), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mb_arrive(uint32_t a) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(a) : "memory");
}
__device__ __forceinline__ void mb_wait(uint32_t a, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W;\n}\n" ::"r"(a),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void bulk_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t mbar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(mbar)
               : "memory");
}

// dynamic smem: S * C bytes of ring + 2 S mbarriers (full, empty)
template <int C, int S>
__global__ void bulk(const uint4* __restrict__ buf, size_t n16, uint32_t* out) {
  extern __shared__ __align__(128) unsigned char sm[];
  const int nw = blockDim.x >> 5, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint64_t* bars = reinterpret_cast<uint64_t*>(sm + S * C);
  const uint32_t ring = su32(sm), full = su32(bars), empty = su32(bars + S);
  const size_t nbytes = n16 * 16;
  const size_t chunks = nbytes / C;
  const size_t per = (chunks + gridDim.x - 1) / gridDim.x;
  const size_t c0 = blockIdx.x * per, c1 = min(chunks, c0 + per);
  const int nc = c1 > c0 ? (int)(c1 - c0) : 0;
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      mb_init(full + 8 * s, 1);
      mb_init(empty + 8 * s, nw);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  const char* src = reinterpret_cast<const char*>(buf) + c0 * C;
  if (threadIdx.x == 0) {
    for (int i = 0; i < min(S, nc); ++i) {
      mb_expect(full + 8 * i, C);
      bulk_g2s(ring + i * C, src + (size_t)i * C, C, full + 8 * i);
    }
  }
  uint32_t acc = 0;
  for (int i = 0; i < nc; ++i) {
    const int s = i % S;
    const uint32_t par = (i / S) & 1;
    mb_wait(full + 8 * s, par);
    for (int o = (warp * 32 + lane) * 16; o < C; o += nw * 512) {
      uint4 v;
      asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                   : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(ring + s * C + o));
      acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    __syncwarp();
    if (lane == 0) mb_arrive(empty + 8 * s);
    if (threadIdx.x == 0 && i + S < nc) {
      mb_wait(empty + 8 * s, par);
      mb_expect(full + 8 * s, C);
      bulk_g2s(ring + s * C, src + (size_t)(i + S) * C, C, full + 8 * s);
    }
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}

// per-warp rings over each warp's contiguous range (the stream-K kernel's access shape), no arithmetic
// cpring D: a cp.async ring of D 512-byte slots per warp (D - 1 in flight), as the cuda-w4a16 kernels stream
template <int D>
__global__ void cpring(const uint4* __restrict__ buf, size_t n16, uint32_t* out) {
  extern __shared__ __align__(128) unsigned char sm[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const size_t tw = (size_t)gridDim.x * (blockDim.x >> 5);
  const size_t gw = (size_t)blockIdx.x * (blockDim.x >> 5) + warp;
  const size_t pieces = n16 / 32;
  const size_t p0 = gw * pieces / tw, p1 = (gw + 1) * pieces / tw;
  const int n = (int)(p1 - p0);
  const uint32_t ring = su32(sm) + warp * D * 512;
  const uint4* src = buf + p0 * 32 + lane;
  for (int d = 0; d < D - 1; ++d) {
    if (d < n) {
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(ring + d * 512 + lane * 16), "l"(src + d * 32)
                   : "memory");
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
  }
  uint32_t acc = 0;
  for (int i = 0; i < n; ++i) {
    const int j = i + D - 1;
    if (j < n) {
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(ring + (j % D) * 512 + lane * 16),
                   "l"(src + (size_t)j * 32)
                   : "memory");
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
    asm volatile("cp.async.wait_group %0;\n" ::"n"(D - 1) : "memory");
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(ring + (i % D) * 512 + lane * 16));
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}

// bwarp CH S: lane 0 of each warp issues cp.async.bulk copies of CH bytes into the warp's S-slot ring (one
// mbarrier per slot); the warp reads a slot, then re-arms it
template <int CH, int S>
__global__ void bwarp(const uint4* __restrict__ buf, size_t n16, uint32_t* out) {
  extern __shared__ __align__(128) unsigned char sm[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const size_t tw = (size_t)gridDim.x * nw;
  const size_t gw = (size_t)blockIdx.x * nw + warp;
  const size_t chunks = n16 * 16 / CH;
  const size_t c0 = gw * chunks / tw, c1 = (gw + 1) * chunks / tw;
  const int n = (int)(c1 - c0);
  uint64_t* bars = reinterpret_cast<uint64_t*>(sm + nw * S * CH) + warp * S;
  const uint32_t ring = su32(sm) + warp * S * CH, full = su32(bars);
  const char* src = reinterpret_cast<const char*>(buf) + c0 * CH;
  if (lane == 0) {
    for (int s = 0; s < S; ++s) mb_init(full + 8 * s, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    for (int i = 0; i < min(S, n); ++i) {
      mb_expect(full + 8 * i, CH);
      bulk_g2s(ring + i * CH, src + (size_t)i * CH, CH, full + 8 * i);
    }
  }
  __syncwarp();
  uint32_t acc = 0;
  for (int i = 0; i < n; ++i) {
    const int s = i % S;
    mb_wait(full + 8 * s, (i / S) & 1);
#pragma unroll
    for (int o = lane * 16; o < CH; o += 512) {
      uint4 v;
      asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                   : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(ring + s * CH + o));
      acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    __syncwarp();
    if (lane == 0 && i + S < n) {
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      mb_expect(full + 8 * s, CH);
      bulk_g2s(ring + s * CH, src + (size_t)(i + S) * CH, CH, full + 8 * s);
    }
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}

typedef void (*Kern)(const uint4*, size_t, uint32_t*);

// Median milliseconds of `reps` CUDA-event-timed calls of f() on stream st, after `warm` untimed ones (errors
// surface at the caller's next cudaGetLastError).
template <typename F>
static float median_ms(cudaStream_t st, int warm, int reps, F&& f) {
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  std::vector<float> ts;
  for (int r = 0; r < warm + reps; ++r) {
    cudaEventRecord(e0, st);
    f();
    cudaEventRecord(e1, st);
    cudaEventSynchronize(e1);
    float ms = 0.f;
    cudaEventElapsedTime(&ms, e0, e1);
    if (r >= warm) ts.push_back(ms);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}

struct Variant {
  const char* name;
  int u;  // loads in flight per lane (contig/front) or chunk KB (bulk)
  int s;  // bulk stages
  int hint;
  Kern k;
  int smem;
};

int main() {
  int dev = 0, sms = 0;
  CK(cudaSetDevice(dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  int l2 = 0;
  CK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev));
  const size_t sizes[] = {(size_t)8192 * 1024 / 2, (size_t)8192 * 8192 / 2, (size_t)8192 * 28672 / 2};
  const size_t pool = std::max<size_t>(3 * (size_t)l2, (size_t)2 * sizes[2]) + sizes[2];
  char* base = nullptr;
  CK(cudaMalloc(&base, pool));
  CK(cudaMemset(base, 0x5a, pool));
  uint32_t* out = nullptr;
  CK(cudaMalloc(&out, 64u << 20));
  cudaStream_t st;
  CK(cudaStreamCreate(&st));

  std::vector<Variant> vs = {
      {"cpring", 4, 0, 0, cpring<4>, -4 * 512},  {"cpring", 8, 0, 0, cpring<8>, -8 * 512},
      {"cpring", 12, 0, 0, cpring<12>, -12 * 512},
      {"bwarp", 512, 8, 0, bwarp<512, 8>, -(8 * 512 + 64)},  {"bwarp", 1024, 4, 0, bwarp<1024, 4>, -(4 * 1024 + 32)},
      {"bwarp", 1024, 6, 0, bwarp<1024, 6>, -(6 * 1024 + 48)},  {"bwarp", 2048, 3, 0, bwarp<2048, 3>, -(3 * 2048 + 24)},
      {"bwarp", 2048, 4, 0, bwarp<2048, 4>, -(4 * 2048 + 32)},
#ifdef ALL_VARIANTS
      {"contig", 1, 0, 0, contig<1, 0>, 0},  {"contig", 2, 0, 0, contig<2, 0>, 0},
      {"contig", 4, 0, 0, contig<4, 0>, 0},  {"contig", 8, 0, 0, contig<8, 0>, 0},
      {"contig", 4, 0, 2, contig<4, 2>, 0},  {"contig", 8, 0, 2, contig<8, 2>, 0},
      {"front", 1, 0, 0, front<1, 0>, 0},    {"front", 2, 0, 0, front<2, 0>, 0},
      {"front", 4, 0, 0, front<4, 0>, 0},    {"front", 8, 0, 0, front<8, 0>, 0},
      {"front", 4, 0, 2, front<4, 2>, 0},
      {"bulk", 4, 4, 0, bulk<4096, 4>, 4 * 4096 + 64},     {"bulk", 4, 8, 0, bulk<4096, 8>, 8 * 4096 + 128},
      {"bulk", 8, 4, 0, bulk<8192, 4>, 4 * 8192 + 64},     {"bulk", 8, 8, 0, bulk<8192, 8>, 8 * 8192 + 128},
      {"bulk", 16, 4, 0, bulk<16384, 4>, 4 * 16384 + 64},  {"bulk", 16, 6, 0, bulk<16384, 6>, 6 * 16384 + 96},
      {"bulk", 32, 3, 0, bulk<32768, 3>, 3 * 32768 + 48},
#endif
  };
  for (auto& v : vs)  // smem < 0: bytes per warp
    CK(cudaFuncSetAttribute(v.k, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024));

  // reference: cudaMemcpy D2D of 1 GiB (counted read + write), as qtool bench's copy bandwidth
  {
    char *a, *b;
    const size_t n = (size_t)1 << 30;
    CK(cudaMalloc(&a, n));
    CK(cudaMalloc(&b, n));
    const float ms = median_ms(st, 3, 10, [&] { cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice, st); });
    CK(cudaGetLastError());
    printf("copy,1073741824,0,0,0,0,0,%.2f,%.1f\n", ms * 1e3, 2.0 * n / (ms * 1e-3) / 1e9);
    CK(cudaFree(a));
    CK(cudaFree(b));
  }
  printf("variant,bytes,u,stages,hint,warps,ctas_per_sm,us,GBps\n");
  const int warps_list[] = {4, 8, 16};  // x cps 1..8, at most 64 warps per SM
  const int cps_list[] = {1, 2, 4, 8};
  for (size_t bytes : sizes) {
    const int ncopy = (int)std::max<size_t>(2, std::min<size_t>(64, (3 * (size_t)l2 + bytes - 1) / bytes));
    for (auto& v : vs) {
      for (int w : warps_list) {
        for (int cps : cps_list) {
          const int smem = v.smem < 0 ? -v.smem * w : v.smem;
          if ((size_t)smem * cps > 220 * 1024) continue;
          if (w * cps > 64) continue;
          const int grid = sms * cps;
          cudaGraph_t g;
          cudaGraphExec_t ge;
          CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
          for (int r = 0; r < ncopy; ++r)
            v.k<<<grid, 32 * w, smem, st>>>(reinterpret_cast<const uint4*>(base + (size_t)r * bytes), bytes / 16,
                                               out);
          CK(cudaStreamEndCapture(st, &g));
          CK(cudaGraphInstantiate(&ge, g, 0));
          const double us = median_ms(st, 2, 10, [&] { cudaGraphLaunch(ge, st); }) * 1e3 / ncopy;
          CK(cudaGetLastError());
          printf("%s,%zu,%d,%d,%d,%d,%d,%.2f,%.1f\n", v.name, bytes, v.u, v.s, v.hint, w, cps, us,
                 bytes / (us * 1e-6) / 1e9);
          CK(cudaGraphExecDestroy(ge));
          CK(cudaGraphDestroy(g));
        }
      }
    }
    fflush(stdout);
  }
  return 0;
}

"""`cuda-w4a16`: CUDA C++ W4A16 kernels (csrc/*.cuh) over the mma tile layout (qtool/packing/mma_tiles.py).

Five kernel families (csrc/gen_kernels.py's table lists the built shapes), chosen per call by M and the layer
(rows.ROWS):
- `sk` (sm_80+, M <= 8): stream-K over the tile-major weight, one equal contiguous range per warp of a
  persistent grid, mma.sync fed the biased nibbles (four LOP3s per word) with the zero point removed from each
  unit's fp32 sum through sum(x), or (grids of whole tiles per CTA) from each fragment by one FMA; shared tiles
  finished by the last warp in the same launch (in shared memory when all its warps are in one CTA; small layers
  get one CTA per tile). Weight copies carry an L2 evict-first policy in every kernel.
- `xr` (sm_80+, chosen on sm_90 at M 1-64 per layer, groups of >= 128): x held in registers as mma fragments by the CTA
  of one K group, the weights streamed past it unit by unit; two K groups may meet in a cluster of 2 (sm_90a).
- `xs` (sm_80+, M 9-16 on layers of under 8 tiles per SM, one group per block): the `mma` kernel's warps with
  x streamed through a ring of chunks in shared memory instead of staged per CTA, so a grid of about one wave
  gives each warp one long run of its tile (no split, or a few long K slices).
- `mma` (sm_80+): mma.sync m16n8k16 with the weight as the A operand, dequantized in registers straight
  from a 16-byte load per lane (LOP3 + one FMA per pair), x staged in shared memory, split-K finished in the
  same launch. For small M that the others do not take (M 9-32, groups of 64, act-order).
- `wgmma` (sm_90a only): wgmma m64nNk16 with A from registers (the same per-lane words) and x tiles from
  shared memory, N the batch tile (32, 48, 64, 128 or 256 columns); from M 17 on the layers where its grid
  spreads as evenly as the others', and above M 32 on nearly all.

`prepare` converts the GPTQ v2 tensors once into the tile layout on the layer's device (as engines repack at
load time); nothing dense is kept. Importing this package imports neither ctypes bindings nor the build.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache

import torch

from qtool.kernels.base import Kernel, PackedLayer, register, unpack_gptq
from qtool.kernels.devices import cuda_index, live_cuda, load_profiles

MIN_CAPABILITY = (8, 0)  # mma.sync with bf16 operands


@cache
def hbm_gbps(index: int) -> float:
    """GPU `index`'s peak memory bandwidth in GB/s, from the configs/devices.yaml profile its name matches (as
    `qtool select cuda:N` finds it); 0 where none does."""
    return live_cuda(index, load_profiles()).hbm_gbps or 0.0


@dataclass
class CudaState:
    """A layer in the tile layout, on one CUDA device.

    qweight  int32 [N16, KB, 32, 4]; zeros int32 [N16, G, 4]; scales: dict dtype -> int32 [N16, G, 8] (tile-major)
    gtab     int32 [KB*4]: the group of each 16-k step (mma_tiles.step_groups, or the sorted act-order groups)
    perm     int64 [K] (act-order: x columns are gathered by it) or None
    """

    K: int  # noqa: N815
    N: int  # noqa: N815
    qweight: torch.Tensor
    zeros: torch.Tensor
    scales: dict
    gtab: torch.Tensor
    perm: torch.Tensor | None
    n_sm: int
    cc: tuple[int, int]
    n_groups: int = 1
    # group of block kb = (64 kb) >> gshift (clamped) when >= 0: the per-block ("post") kernels; else the
    # per-step kernels, which read gtab
    gshift_blk: int = -1
    scales_src: torch.Tensor | None = None  # GPTQ scales [G, N], tiled again for another activation dtype
    override: object = None  # a launch.Config forced on every call (tuning, tests)
    configs: dict = field(default_factory=dict)
    # split-K partials (fp32) and per-tile arrival counters (self-resetting); one state serves one stream at a time
    ws: torch.Tensor | None = None
    counters: torch.Tensor | None = None
    retired: list = field(default_factory=list)  # superseded buffers that captured graphs may still use
    tmaps: dict = field(default_factory=dict)  # tensor maps of the wgmma kernel's TMA form (launch.x_map, w_maps)
    cluster_slots: tuple = ()  # launch.cluster_slots: clusters of s CTAs resident at once (index s); () none
    hbm_gbps: float = 0.0  # memory bandwidth, GB/s, of the device's profile (hbm_gbps); 0 where none matches

    def config(self, m: int):
        from qtool.kernels.cuda.rows import choose

        if self.override is not None:
            return self.override
        if m not in self.configs:
            self.configs[m] = choose(m, self)
        return self.configs[m]


def group_shift(group_size: int, n_groups: int, smallest: int) -> int:
    """log2(group size) when the kernel can find a group by a shift (a power of two >= smallest), 30 for a
    single group (every shift lands on group 0 after clamping), else -1 (the kernel reads the group table)."""
    if n_groups == 1:
        return 30
    if group_size >= smallest and group_size & (group_size - 1) == 0:
        return group_size.bit_length() - 1
    return -1


def act_order_plan(g_idx: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor] | str:
    """Act-order: (perm, sorted groups) with perm = stable argsort of g_idx, or why the kernel cannot take it
    (a 16-k step of the sorted order would hold two groups)."""
    if k % 16:
        return f"act-order needs K % 16 == 0, K = {k}"
    gi = g_idx.to(torch.int64)
    perm = torch.argsort(gi, stable=True)
    sg = gi[perm]
    steps = sg.view(-1, 16)
    if not bool((steps == steps[:, :1]).all()):
        return "act-order groups do not fall on 16-row steps after sorting (uneven group sizes)"
    return perm, sg


@register
class CudaW4A16(Kernel):
    id = "cuda-w4a16"
    summary = ("CUDA C++ W4A16 (csrc/*.cuh): stream-K mma.sync for M <= 8, mma.sync with in-register LOP3 "
               "dequant for other small M (at M 9-16 x held in registers or streamed in chunks), wgmma (sm_90a) "
               "for large M; weights repacked once to the mma tile layout")
    devices = ("cuda",)
    bits = (4,)
    dtypes = (torch.float16, torch.bfloat16)
    scale_dtypes = (torch.float16, torch.bfloat16, torch.float32)
    min_capability = MIN_CAPABILITY

    def available(self, device: torch.device) -> str | None:
        why = super().available(device)
        if why:
            return why
        from qtool.kernels.cuda import build

        cc = torch.cuda.get_device_capability(device)
        if not build.sources_present():
            return "csrc/w4a16.cu is not installed (install qtool from its source tree)"
        if not build.cubin_path(cc).is_file() and build.find_nvcc() is None:
            return "cuda-w4a16 builds its kernels with nvcc on first use, and no nvcc was found"
        return None

    def check(self, layer: PackedLayer, dtype: torch.dtype, device: torch.device) -> list[str]:
        why = super().check(layer, dtype, device)
        if not isinstance(layer, PackedLayer):  # the base check has refused it: nothing below applies
            return why
        k, eff = layer.in_features, layer.effective_group_size
        if k % 8:
            why.append(f"cuda-w4a16 reads x in 16-byte pieces: K={k} is not a multiple of 8")
        if layer.n_groups > 1 and eff % 16:
            why.append(f"cuda-w4a16 applies one group per 16-k step: group size {eff} is not a multiple of 16")
        if layer.g_idx is not None:
            plan = act_order_plan(layer.g_idx, k)
            if isinstance(plan, str):
                why.append(f"cuda-w4a16: {plan}")
        return why

    def prepare(self, layer: PackedLayer) -> CudaState:
        from qtool.kernels.cuda.launch import cluster_slots
        from qtool.packing import mma_tiles

        dev = layer.device
        codes, zeros = unpack_gptq(layer)  # int32 [K, N], [G, N]
        perm = None
        k, n = layer.in_features, layer.out_features
        gtab = mma_tiles.step_groups(k, layer.group_size, layer.n_groups, dev)
        if layer.g_idx is not None:
            plan = act_order_plan(layer.g_idx, k)
            if isinstance(plan, str):
                from qtool.errors import FormatError

                raise FormatError(f"cuda-w4a16: {plan}", tensor="g_idx", fix="use triton-w4a16 or torch-ref")
            perm, sg = plan
            codes = codes.index_select(0, perm)
            gtab = torch.full((-(-k // 64) * 4,), int(sg[-1]), dtype=torch.int32, device=dev)
            gtab[: k // 16] = sg.view(-1, 16)[:, 0].to(torch.int32)
        qw = mma_tiles.tile_codes(codes.to(torch.uint8))
        del codes
        zt = mma_tiles.tile_zeros(zeros)
        scales = {}
        if layer.scales.dtype in (torch.float16, torch.bfloat16):
            scales[layer.scales.dtype] = mma_tiles.tile_scales(layer.scales)
        n_sm = torch.cuda.get_device_properties(dev).multi_processor_count
        eff = layer.effective_group_size
        # The kernels read these tensors before waiting for the previous kernel in the stream (programmatic
        # dependent launch, launch.py): they must be complete before the first launch.
        torch.cuda.current_stream(dev).synchronize()
        cc = torch.cuda.get_device_capability(dev)
        index = cuda_index(dev)
        return CudaState(k, n, qw, zt, scales, gtab, perm, n_sm, cc, layer.n_groups,
                         group_shift(eff, layer.n_groups, 64) if perm is None or layer.n_groups == 1 else -1,
                         scales_src=layer.scales, cluster_slots=cluster_slots(index, cc), hbm_gbps=hbm_gbps(index))

    def forward(self, x: torch.Tensor, state: CudaState, out: torch.Tensor | None = None) -> torch.Tensor:
        from qtool.kernels.cuda.launch import run

        return run(x, state, state.config(x.shape[0]), out)

    def describe(self, state: CudaState, m: int) -> str:
        from qtool.kernels.cuda.launch import plan, use_pdl

        cfg = state.config(m)
        p = plan(cfg, m, state)
        return cfg.label(p["splits"]) + (" x-tma" if p["tma"] else "") + (" pdl" if use_pdl(cfg, state) else "")

"""`triton-w4a16`: the fused Triton W4A16 kernel over GPTQ v2 tensors (kernel in w4a16.py, launch
table in launch.py).

Importing this package does not import triton: availability is checked when asked, so a machine without
triton still lists the kernel, with the reason it cannot run. On the CPU the kernel runs only under the
Triton interpreter (TRITON_INTERPRET=1 set before triton is first imported), which the tests use.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

import torch

from qtool.kernels.base import Kernel, PackedLayer, register

MIN_CAPABILITY = (8, 0)  # bf16 tensor-core dot and the bf16 bit trick need sm_80+


@dataclass
class TritonState:
    """The layer's GPTQ tensors on the device as stored, plus the launch choice per M (cached).

    override: a LaunchConfig forced on every call (tuning scripts), or None for the M-bucket table.
    """

    layer: PackedLayer
    n_sm: int
    override: object = None
    configs: dict = field(default_factory=dict)

    def config(self, m: int):
        from qtool.kernels.triton.launch import choose_config

        if self.override is not None:
            return self.override
        if m not in self.configs:
            lay = self.layer
            self.configs[m] = choose_config(m, lay.out_features, lay.in_features, self.n_sm,
                                            lay.effective_group_size, lay.g_idx is not None)
        return self.configs[m]


@register
class TritonW4A16(Kernel):
    id = "triton-w4a16"
    summary = ("fused Triton W4A16 reading GPTQ v2 qweight/qzeros/scales/g_idx as stored; "
               "M-bucketed launches, split-K, dequant+cuBLAS past the crossover")
    devices = ("cuda", "cpu")
    bits = (4,)
    dtypes = (torch.float16, torch.bfloat16)
    scale_dtypes = (torch.float16, torch.bfloat16, torch.float32)
    min_capability = MIN_CAPABILITY

    def available(self, device: torch.device) -> str | None:
        why = super().available(device)
        if why:
            return why
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (pip install 'qtool[triton]')"
        if device.type == "cpu":
            from qtool.kernels.triton.launch import interpreter_on

            if not interpreter_on():
                return "triton-w4a16 runs on CUDA; on the CPU only under TRITON_INTERPRET=1 (tests)"
        return None

    def check(self, layer: PackedLayer, dtype: torch.dtype, device: torch.device) -> list[str]:
        why = super().check(layer, dtype, device)
        if not isinstance(layer, PackedLayer):  # the base check has refused it: nothing below applies
            return why
        if layer.in_features % 8:
            why.append(f"triton-w4a16 reads whole int32 words: K={layer.in_features} is not a multiple of 8")
        if layer.out_features % 8:
            why.append(f"triton-w4a16 reads whole qzeros words: N={layer.out_features} is not a multiple of 8")
        return why

    def prepare(self, layer: PackedLayer) -> TritonState:
        dev = layer.device
        n_sm = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4
        return TritonState(layer, n_sm)

    def forward(self, x: torch.Tensor, state: TritonState, out: torch.Tensor | None = None) -> torch.Tensor:
        from qtool.kernels.triton.launch import run_w4a16

        lay = state.layer
        return run_w4a16(x, lay.qweight, lay.qzeros, lay.scales, lay.g_idx, lay.effective_group_size,
                         state.config(x.shape[0]), out=out)

    def describe(self, state: TritonState, m: int) -> str:
        return state.config(m).label()

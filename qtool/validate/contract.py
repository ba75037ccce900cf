"""The engine-contract check: does the config give each engine's loader what it needs, and does every
quantized layer get a kernel from `select` on each named target?

What the loaders read (seed 000, the engines' config parsers): GPTQ (transformers, GPTQModel, vLLM) reads
bits, group_size, desc_act, sym and checkpoint_format (absent = v1), and skips modules through `dynamic`
"-:" patterns; AWQ reads bits, group_size, zero_point, version and `modules_to_not_convert`;
compressed-tensors reads format and config_groups and skips `ignore`; llama.cpp reads general.architecture
and the architecture's block count and embedding length from GGUF metadata. For the float and int8 layouts,
qtool.validate.vllm_schemes adds which vLLM scheme each compressed-tensors group loads as, and the block-shape
rule of merged FP8 block-scaled layers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qtool.report.validate import CheckResult

NAME = "contract"

# quant_method -> keys its loaders need in the quantization config
REQUIRED_KEYS: dict[str, tuple[str, ...]] = {
    "gptq": ("bits", "group_size", "desc_act", "sym"),
    "awq": ("bits", "group_size", "zero_point", "version"),
    "compressed-tensors": ("format", "config_groups"),
    "fp8": ("activation_scheme",),
}
# keys a loader reads with a default that may not match the data: named when absent, not failed
DEFAULTED_KEYS: dict[str, tuple[tuple[str, str], ...]] = {
    "gptq": (("checkpoint_format", "gptq (v1)"),),
}
GGUF_REQUIRED = ("general.architecture", "{arch}.block_count", "{arch}.embedding_length")
# Without --engine, the layers are planned with the first of these that reads them at all: a GPTQ/AWQ file
# is GPTQModel's, a compressed-tensors or FP8 file vLLM's, and an engine that never loads a format says
# nothing about the file.
DEFAULT_ENGINES = ("gptqmodel", "vllm")


def check(report, quant_raw: dict | None, path: Path, engines: tuple[str, ...], targets: tuple[str, ...]
          ) -> list[CheckResult]:
    out: list[CheckResult] = []
    quantized = [m for m in report.modules if m.quantized]
    if report.container == "gguf":
        out += _gguf_keys(report.metadata)
    elif quantized:
        from qtool.validate import vllm_schemes

        out += _config_keys(quant_raw, report, path)
        out += vllm_schemes.check(quant_raw, report, path)
        out += _experts(report)
    if not quantized:
        return out + [CheckResult(NAME, None, "skip", "no quantized module: no kernel to select")]
    if not engines and report.container == "gguf":
        return out + [CheckResult(NAME, None, "skip", "GGUF is llama.cpp's format, whose kernels are not declared "
                                                     "here (its metadata keys are checked above); --engine "
                                                     "gptqmodel or vllm plans their GGUF kernels")]
    for target in targets:
        if engines:
            for engine in engines:
                out += _select(report, path, (engine,), target)
        else:
            out += _select(report, path, DEFAULT_ENGINES, target)
    return out


def _config_keys(raw: dict | None, report, path: Path) -> list[CheckResult]:
    if raw is None:
        return [CheckResult(NAME, None, "fail", "no quantization config (config.json quantization_config or "
                                               "quantize_config.json): engines load the checkpoint as dense and "
                                               "fail on qweight; fix: write the config qtool pack/repack writes")]
    method = str(raw.get("quant_method", "")).lower() or None
    if method is None:
        return [CheckResult(NAME, None, "fail", "the quantization config has no quant_method; engines cannot "
                                               "tell which loader to use")]
    out = []
    if method not in REQUIRED_KEYS:
        # no loader facts recorded for this method: say so rather than pass a config nothing was checked in
        out.append(CheckResult(NAME, None, "skip", f"quant_method {method}: which config keys its loaders read is "
                                                  "not recorded here, so its config is not checked (the layers' "
                                                  "kernels are, below)"))
        return out + _excluded(raw, method, report, path)
    missing = [k for k in REQUIRED_KEYS.get(method, ()) if k not in raw]
    if missing:
        out.append(CheckResult(NAME, None, "fail", f"quant_method {method}: the config lacks "
                                                  f"{', '.join(missing)}, which the {method} loaders read"))
    else:
        need = REQUIRED_KEYS.get(method, ())
        out.append(CheckResult(NAME, None, "pass", f"quant_method {method}"
                               + (f" with {', '.join(need)}" if need else "")))
    defaults = [f"{k} (read as {d})" for k, d in DEFAULTED_KEYS.get(method, ()) if k not in raw]
    if defaults:
        out.append(CheckResult(NAME, None, "pass", f"absent, loaders use the default: {', '.join(defaults)}"))
    out += _excluded(raw, method, report, path)
    return out


def _excluded(raw: dict, method: str, report, path: Path) -> list[CheckResult]:
    """Dense linear modules inside the numbered layers must be excluded in the config, or engines build
    them as quantized layers and find no qweight."""
    from qtool.inspect.detect import collapse_layers
    from qtool.io.config_regex import WorkBudget, compile_config_regex

    dense = [m for m in report.modules if m.scheme.format == "dense" and "#" in collapse_layers(m.name)]
    if not dense:
        return []
    if method == "gptq":
        dyn = raw.get("dynamic") if isinstance(raw.get("dynamic"), dict) else {}
        budget = WorkBudget()
        pats = [compile_config_regex(k[2:], path=path, key="dynamic", budget=budget) for k in dyn
                if isinstance(k, str) and k.startswith("-:")]
        skipped = lambda name: any(p.match(name) for p in pats)  # noqa: E731
        how = "a dynamic '-:' pattern"
    else:
        names = raw.get("modules_to_not_convert") or raw.get("ignore") or []
        names = [n for n in names if isinstance(n, str)] if isinstance(names, list) else []
        skipped = lambda name: any(name == n or name.endswith("." + n) or n in name.split(".") for n in names)  # noqa: E731
        how = "modules_to_not_convert / ignore"
    out = []
    for m in dense:
        if not skipped(m.name):
            out.append(CheckResult(NAME, m.name, "fail", f"dense inside the quantized layers but not excluded by "
                                                        f"{how}: engines expect quantized tensors here"))
    if not out:
        out.append(CheckResult(NAME, None, "pass", f"{len(dense)} dense layer modules excluded by {how}"))
    return out


def _experts(report) -> list[CheckResult]:
    """Mixture-of-experts layers: vLLM's and SGLang's FusedMoE build one quantization method for all the experts
    of a layer (w13 and w2 alike), so they must share one scheme, none of them dense; and the engines build the
    router unquantized (quant_config=None), so a packed one is not loaded."""
    from qtool.inspect.detect import moe_routers
    from qtool.io.checkpoint import EXPERT_MODULE

    mods = {m.name: m for m in report.modules}
    routers = sorted(moe_routers(f"{n}.weight" for n in mods))
    out = [CheckResult(NAME, r, "fail", "a mixture-of-experts router stored quantized: vLLM and SGLang build it "
                                       "unquantized and find no weight; fix: pack with the router dense (qtool's "
                                       "default)")
           for r in routers if mods[r].quantized]
    layers: dict[str, dict[tuple, list[str]]] = {}
    for name, m in mods.items():
        hit = EXPERT_MODULE.match(name)
        if hit:
            s = m.scheme
            key = ("dense",) if not m.quantized else (s.format, s.bits, s.group_size, s.sym, bool(s.desc_act))
            layers.setdefault(hit["parent"], {}).setdefault(key, []).append(name)
    mixed = {p: k for p, k in layers.items() if len(k) > 1}
    for parent, kinds in sorted(mixed.items()):
        (a, na), (b, nb) = sorted(kinds.items(), key=lambda kv: -len(kv[1]))[:2]
        out.append(CheckResult(NAME, parent, "fail", f"its experts mix schemes ({len(na)} {_scheme(a)}, {len(nb)} "
                                                    f"{_scheme(b)}, e.g. '{nb[0]}'): vLLM's and SGLang's fused MoE "
                                                    "layer takes one scheme for all experts; fix: pack them alike"))
    if layers and not out:
        said = f"; {len(routers)} routers, dense" if routers else "; no router found beside them"
        out.append(CheckResult(NAME, None, "pass", f"{len(layers)} mixture-of-experts layers: one scheme each{said}"))
    return out


def _scheme(key: tuple) -> str:
    if key == ("dense",):
        return "dense"
    fmt, bits, group, sym, desc = key
    return f"{fmt} {bits}-bit g{group}{' sym' if sym else ' asym'}{' act-order' if desc else ''}"


def _gguf_keys(kv: dict[str, Any]) -> list[CheckResult]:
    arch = kv.get("general.architecture")
    keys = [k.format(arch=arch) for k in GGUF_REQUIRED] if isinstance(arch, str) else list(GGUF_REQUIRED[:1])
    missing = [k for k in keys if k not in kv]
    if missing:
        return [CheckResult(NAME, None, "fail", f"GGUF metadata lacks {', '.join(missing)}, which llama.cpp "
                                               "reads to build the model")]
    return [CheckResult(NAME, None, "pass", f"GGUF metadata has {', '.join(keys)}")]


def _select(report, path: Path, engines: tuple[str, ...], target: str) -> list[CheckResult]:
    """Every quantized layer must get a kernel on `target` from the engine (one named: that one; several: the
    first that reads the checkpoint's formats at all, since an engine that never loads a format says nothing
    about the file)."""
    from qtool.errors import QtoolError
    from qtool.kernels.devices import resolve_device
    from qtool.select.plan import EXPERTS_NOT_PLANNED, path_groups, plan_select

    plans = []
    try:
        groups, notes, unplanned = path_groups(path, modules=report.modules)
        if not groups:  # nothing a linear kernel runs: expert stacks are fused-MoE weights, and fail nothing here
            stacks = next((n for n in notes if "stack(s) not planned" in n), None)
            return [CheckResult(NAME, None, "skip" if stacks else "fail",
                                f"{' or '.join(engines)} on {target}: no linear layer to plan ({stacks or notes[-1]})")]
        for engine in engines:
            sel = plan_select(groups, resolve_device(target), engine)
            plans.append((engine, sel))
            if any(row.selection.candidates for row in sel.layers) or (groups and not sel.layers):
                break
    except QtoolError as e:
        return [CheckResult(NAME, None, "fail", f"{' or '.join(engines)} on {target}: cannot plan kernels: "
                                               f"{e.problem}")]
    engine, sel = plans[-1]
    if groups and not sel.layers:  # every quantized layer is an expert the engine runs outside its linears
        why = next((n for n in sel.notes if EXPERTS_NOT_PLANNED in n), sel.notes[-1])
        return [CheckResult(NAME, None, "skip", f"{engine} on {target}: no linear layer to plan ({why})")]
    if len(engines) > 1 and not any(row.selection.candidates for row in sel.layers):
        why = "; ".join(f"{e}: {_refusal(p.layers[0].selection)}" for e, p in plans if p.layers)
        return [CheckResult(NAME, None, "fail", f"none of {', '.join(engines)} reads these layers ({why}); "
                                               f"--engine names another")]
    where = f"{engine} on {target}"
    out, picks = [], {}
    for e, p in plans[:-1]:
        out.append(CheckResult(NAME, None, "pass", f"{where}: planned with {engine}, since {e} reads none of "
                                                  f"these layers ({_refusal(p.layers[0].selection)})"))
    for row in sel.layers:
        s = row.selection
        if s.chosen is None:
            out.append(CheckResult(NAME, row.name, "fail", f"{where}: no kernel takes this layer ({_refusal(s)})",
                                   {"engine": engine, "target": target, "layers": row.count}))
        else:
            picks[s.chosen] = picks.get(s.chosen, 0) + row.count
    if picks:
        text = ", ".join(f"{k} for {n} layers" for k, n in sorted(picks.items()))
        out.append(CheckResult(NAME, None, "pass", f"{where}: select picks {text}",
                               {"engine": engine, "target": target, "picks": picks}))
    for pattern in unplanned:  # quantized, but no bits or [out, in] recorded: no engine can build a kernel for it
        out.append(CheckResult(NAME, pattern, "fail", f"{where}: no kernel can be chosen: the checkpoint records no "
                                                      "bits or [out, in] shape for this quantized module"))
    return out


def _refusal(s) -> str:
    """The first reason `select` gives for running nothing: a refusing candidate's, else its note."""
    first = next((c for c in s.candidates if not c.ok), None)
    if first is not None:
        return f"{first.kernel}: {first.reason}"
    return s.notes[0] if s.notes else "no candidate"

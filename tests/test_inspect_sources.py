"""Each source of truth for what it says (config.json, quantize_config.json, qtool's safetensors metadata),
and regexes from a config matched by the bounded engine (qtool.io.config_regex), never by `re`."""

from __future__ import annotations

import json
import random
import re

import pytest
from safetensors import safe_open
from safetensors.torch import save_file

from qtool.errors import InputError
from qtool.formats.detection import Claims, ct_scheme_for
from qtool.inspect import inspect_path
from qtool.inspect.detect import module_claims
from qtool.io.config_regex import BoundedRegex, UnsupportedRegex, WorkBudget, compile_config_regex
from tests.test_inspect import cli, write_gptq


def _set_metadata(root, meta: dict[str, str]) -> None:
    f = root / "model.safetensors"
    with safe_open(str(f), "pt") as h:
        tensors = {k: h.get_tensor(k) for k in h.keys()}
    save_file(tensors, str(f), metadata={"format": "pt", **meta})


def _errors(r):
    return [a.message for a in r.anomalies if a.severity == "error"]


# --- 22.3: config.json, quantize_config.json and qtool metadata, each reported for what it says ---------------

def test_metadata_does_not_override_config_json(tmp_path):
    """v2 data, config.json says gptq (v1), qtool metadata says gptq_v2: the config is what is reported (it is
    what engines read), the metadata is reported beside it, and the disagreement is an error without --deep."""
    root = write_gptq(tmp_path / "m", "v2", "gptq")
    _set_metadata(root, {"qtool.format": "gptq_v2"})
    r = inspect_path(root)
    assert r.format == "gptq" and {m.scheme.format for m in r.modules if m.quantized} == {"gptq"}
    errs = _errors(r)
    assert any("config.json quantization_config says format gptq but qtool's safetensors metadata says gptq_v2"
               in m and "engines read only the config" in m for m in errs), r.anomalies
    assert r.info_tail["config"].startswith("config.json quantization_config: quant_method gptq, format gptq")
    assert "gptq_v2" not in r.info_tail["config"]
    assert r.info_tail["qtool metadata"] == "safetensors metadata (qtool.*): format gptq_v2"
    assert r.info_tail["engines read"].startswith("config.json quantization_config")
    d = r.to_dict()
    assert [(s["source"], s["format"], s["read_by_engines"]) for s in d["metadata"]["qtool.sources"]] == [
        ("config.json quantization_config", "gptq", True), ("safetensors metadata (qtool.*)", "gptq_v2", False)]
    assert cli("inspect", str(root), "--strict")[1] == 1
    assert cli("inspect", str(root))[1] == 0
    # --deep keeps the error (and adds its own finding about the zeros)
    assert any("qtool's safetensors metadata says gptq_v2" in m for m in _errors(inspect_path(root, deep=True)))


def test_metadata_and_config_agree(tmp_path):
    root = write_gptq(tmp_path / "m", "v2", "gptq_v2")
    _set_metadata(root, {"qtool.format": "gptq_v2"})
    r = inspect_path(root)
    assert r.format == "gptq_v2" and _errors(r) == []
    assert cli("inspect", str(root), "--strict")[1] == 0


def test_metadata_bits_disagree_with_quantize_config(tmp_path):
    root = write_gptq(tmp_path / "m", "v2", "gptq_v2", config_name="quantize_config.json")
    _set_metadata(root, {"qtool.format": "gptq_v2", "qtool.bits": "8"})
    r = inspect_path(root)
    assert any(m.startswith("quantize_config.json says bits 4 but qtool's safetensors metadata says 8")
               for m in _errors(r)), r.anomalies
    assert r.info_tail["engines read"].startswith("quantize_config.json")


def test_metadata_alone_is_named_as_such(tmp_path):
    root = write_gptq(tmp_path / "m", "v2", None)
    _set_metadata(root, {"qtool.format": "gptq_v2"})
    r = inspect_path(root)
    assert r.format == "gptq_v2" and r.info_tail["config"] == "none"
    assert r.info_tail["engines read"].startswith("no quantization config")
    assert any(a.severity == "info" and "only qtool's safetensors metadata names the format" in a.message
               for a in r.anomalies)


# --- 22.10: config regexes run bounded ------------------------------------------------------------------------

PATTERNS = [r".*\.18\..*gate.*", r"model\.layers\.(0|1|2)\..*", r".*\.(q|k|v)_proj$", r"model.layers.[0-9]+.mlp",
            r"^a$", r"a$", r"a\Z", r"(a|ab)(c|bcd)(d*)", r"x*", r"", r"[^.]+\.\d+", r"\w+\s?\W", r"a{2,3}b?",
            r"(ab){1,}c", r"(?:a|b)*?c", r".*lm_head", r"(a+)+$", r"[a-c\d_]*z", r"\D\S", r"^$", r"a.c", r"(a*)*b",
            r"a{0}b", r"a{3}", r"(?P<x>a|b)+\.", r"[\w.]+_proj"]


def test_bounded_regex_agrees_with_re():
    """Differential: on the supported subset, match/search/fullmatch answer exactly as `re` does."""
    rnd = random.Random(7)
    alphabet = "ab.c1_ z\nxqkvgate8lm_hd"
    names = ["", "\n", "a\n", "model.layers.1.mlp", "model.layers.18.mlp.gate_proj", "abcd", "aaab", "aa"]
    names += ["".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 9))) for _ in range(1500)]
    for p in PATTERNS:
        b = BoundedRegex(p)
        for s in names:
            for how in ("match", "search", "fullmatch"):
                assert getattr(b, how)(s) == (getattr(re, how)(p, s) is not None), (p, s, how)


def test_catastrophic_pattern_is_linear():
    b = BoundedRegex(r"(a+)+$")
    assert b.match("a" * 100_000) and not b.match("a" * 100_000 + "!")
    assert not BoundedRegex(r"(.*a){30}x").search("a" * 3000)


def test_work_budget_is_shared_and_ends_in_an_input_error():
    """Names built to defeat the lazy DFA's cache cost at most the file's budget, then a clear error."""
    rnd = random.Random(3)
    budget = WorkBudget(200_000)
    rx = compile_config_regex(r"(a|b)*a(a|b){300}", path="m/config.json", key="dynamic", budget=budget)
    other = compile_config_regex(r"(a|b)*b(a|b){300}", path="m/config.json", key="dynamic", budget=budget)
    with pytest.raises(InputError, match=r"m/config.json: dynamic: regex .* took more than 200,000 automaton "
                                         r"steps against this file's module names"):
        for _ in range(100):
            name = "".join(rnd.choice("ab") for _ in range(2000))
            rx.search(name)
            other.search(name)
    assert budget.left < 0


@pytest.mark.parametrize("pattern,why", [
    (r"(a)\1", "backreferences"), (r"(?=a)b", "lookahead"), (r"(?<!a)b", "lookaround"), (r"(?i)abc", "flags"),
    (r"\bq_proj", "word boundary"), (r"(?>a+)b", "atomic groups"), (r"a*+b", "possessive"),
    (r"((a{100}){100}){100}", "more than"), (r"a{99999}", "more than"), (r"(a{3000}){2}", "more than"), ("x" * 5000, "characters"),
    (r"(a", "invalid regex"), ("(" * 2000 + ")" * 2000, "nests too deeply|characters")])
def test_refused_patterns(pattern, why):
    with pytest.raises(UnsupportedRegex, match=why):
        BoundedRegex(pattern)
    with pytest.raises(InputError) as e:
        compile_config_regex(pattern, path="ckpt/config.json", key="dynamic")
    msg = str(e.value)
    assert msg.startswith("ckpt/config.json: dynamic: regex ") and "cannot be matched safely" in msg
    assert "(rewrite the pattern" in msg and len(msg) < 400


def test_dynamic_overrides_match_from_the_start():
    """GPTQModel applies `dynamic` with re.match: a pattern matches at the start of the name only."""
    c = Claims(format="gptq", bits=4, raw={"dynamic": {r"+:layers\.1\.": {"bits": 8}, r"+:.*\.2\.": {"bits": 2}}})
    assert module_claims(c, "model.layers.1.mlp").bits == 4        # re.search would hit, re.match does not
    assert module_claims(c, "layers.1.mlp").bits == 8
    assert module_claims(c, "model.layers.2.mlp").bits == 2
    bad = Claims(format="gptq", raw={"dynamic": {r"+:.*": {"bits": "8"}}}, path="m/config.json")
    with pytest.raises(InputError, match=r"m/config.json: dynamic\['\+:\.\*'\]\.bits is '8', not int"):
        module_claims(bad, "x")


def test_ct_targets_use_the_bounded_engine():
    c = Claims(quant_method="compressed-tensors", ct_groups=[([r"re:.*\.(q|k)_proj$"], {"num_bits": 4}, None, {})],
               ct_ignore=[r"re:(a+)+$"], path="m/config.json")
    assert ct_scheme_for(c, "l.0.q_proj")[0] == {"num_bits": 4}
    assert ct_scheme_for(c, "a" * 5000 + "!") == (None, None, False)
    c.ct_ignore = [r"re:(x)\1"]
    with pytest.raises(InputError, match="m/config.json: compressed-tensors targets/ignore: regex"):
        ct_scheme_for(c, "l.0.q_proj")


def test_unsafe_dynamic_key_in_a_checkpoint_is_exit_2(tmp_path):
    root = write_gptq(tmp_path / "m", "v1", "gptq")
    cfg = json.loads((root / "config.json").read_text())
    cfg["quantization_config"]["dynamic"] = {r"-:(?=lm_head)": {}}
    (root / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match=r"config.json: dynamic: regex '\(\?=lm_head\)' cannot be matched"):
        inspect_path(root)

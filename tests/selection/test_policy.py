"""foundry_attn.selection.policy.choose against hand-built capabilities: which attention runs, and why."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest
import torch

from foundry_attn.attention.backends import EAGER, FA2, FLEX, NAMES, SDPA, TORCH_VARLEN, ModelNeeds
from foundry_attn.selection.backend_checks import Candidate
from foundry_attn.selection.capability import Capability, probe
from foundry_attn.selection.policy import AUTO, AttentionUnavailableError, Decision, choose
from foundry_attn.selection.surfaces import AXOLOTL, LLM_FOUNDRY, speaking
from foundry_attn.selection.traits import ModelTraits

LLAMA_TRAITS = ModelTraits("LlamaForCausalLM", 64, frozenset(NAMES))


def make_cap(
    cc: tuple[int, int] | None = (8, 0),
    name: str = "NVIDIA A100-SXM4-80GB",
    fa: str | None = "2.6.3",
    cuda: bool = True,
    fa_error: str | None = None,
) -> Capability:
    """A hand-built capability: an A100 with flash-attn 2.6.3 unless told otherwise."""
    return Capability(
        cuda=cuda,
        device_name=name,
        compute_capability=cc,
        torch_version="2.7.0+cu126",
        transformers_version="4.51.3",
        flash_attn_version=fa,
        flash_attn_error=fa_error,
        transformer_engine_version=None,
        host="node-1",
    )


T4 = make_cap((7, 5), "Tesla T4")
CPU = make_cap(None, "cpu", fa=None, cuda=False, fa_error="flash-attn is not installed (pip install flash-attn)")


def decide(cap: Capability, dtype: torch.dtype = torch.bfloat16, **kw) -> Decision:
    kw.setdefault("traits", LLAMA_TRAITS)
    kw.setdefault("smoke_test", None)
    return choose(cap=cap, dtype=dtype, **kw)


def failed(decision: Decision, name: str) -> Candidate:
    cand = next(c for c in decision.candidates if c.name == name)
    assert not cand.available
    return cand


def test_real_cpu_probe_falls_back_to_sdpa() -> None:
    """The CPU as probed (on a CUDA box too) falls back to sdpa and says why; the default probe names this
    machine's own device (tests/test_gpu.py checks the choice on a GPU with flash-attn)."""
    real = probe()
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        assert real.cuda and real.sm == f"sm{major}{minor}" and real.device_name == torch.cuda.get_device_name()
    else:
        assert not real.cuda and real.sm == "cpu"
    cap = probe("cpu")
    assert not cap.cuda and cap.sm == "cpu"
    assert json.loads(json.dumps(cap.as_dict()))["device_name"] == "cpu"
    d = choose(cap=cap, traits=LLAMA_TRAITS, smoke_test=None)
    assert d.chosen == SDPA and d.fell_back and d.reason.startswith(f"{FA2}: ")
    if cap.flash_attn_version is not None:  # a GPU box with flash-attn: the CPU still cannot run it
        assert failed(d, FA2).check == "CUDA device"
        return
    assert "not installed" in cap.flash_attn_error
    assert "flash-attn is not installed" in d.reason
    assert failed(d, FA2).check == "flash-attn installed"
    # the default argument (probe + real smoke test) must not call the kernel when flash-attn is missing
    if torch.cuda.is_available():  # a GPU box without flash-attn: whatever else it picks, not FA2
        assert choose().chosen != FA2
    else:
        assert choose().chosen == SDPA


def test_no_cuda() -> None:
    cap = make_cap(None, "cpu", cuda=False)  # flash-attn importable, but no GPU
    d = decide(cap)
    assert d.chosen == SDPA
    assert failed(d, FA2).check == "CUDA device"
    assert "no CUDA device" in d.reason


def test_turing_t4_is_rejected() -> None:
    d = decide(T4)
    assert d.chosen == SDPA and d.fell_back
    assert failed(d, FA2).check == "compute capability"
    assert d.reason == f"{FA2}: Tesla T4 sm75 < 8.0"
    sdpa = next(c for c in d.candidates if c.name == SDPA)
    assert sdpa.available and "Tesla T4 sm75" in sdpa.reason


def test_flash_attn_too_old() -> None:
    d = decide(make_cap(fa="2.0.4"))
    assert d.chosen == SDPA
    cand = failed(d, FA2)
    assert cand.check == "flash-attn version" and "2.0.4 < 2.1.0" in cand.reason and "pip install" in cand.fix


def test_ampere_recent_flash_attn_bf16_chooses_fa2() -> None:
    d = decide(make_cap(), torch.bfloat16)
    assert d.chosen == FA2 and not d.fell_back
    assert d.reason == "flash-attn 2.6.3 on NVIDIA A100-SXM4-80GB sm80"
    assert d.compute_dtype == "bfloat16"
    assert decide(make_cap((9, 0), "NVIDIA H100"), torch.float16).chosen == FA2


def test_fp32_compute_dtype_is_rejected() -> None:
    d = decide(make_cap(), torch.float32)
    assert d.chosen == SDPA
    cand = failed(d, FA2)
    assert cand.check == "dtype" and "float32" in cand.reason and "bf16" in cand.reason
    assert d.compute_dtype == "float32"


def test_head_dim_512_is_rejected() -> None:
    d = decide(make_cap(), traits=ModelTraits("Big", 512))
    assert d.chosen == SDPA
    cand = failed(d, FA2)
    assert cand.check == "head dim" and "512 > 256" in cand.reason
    assert decide(make_cap(), traits=ModelTraits("Ok", 256)).chosen == FA2


def test_model_class_without_fa2() -> None:
    traits = ModelTraits("OldModel", 64, frozenset({SDPA, EAGER}))
    d = decide(make_cap(), traits=traits)
    assert d.chosen == SDPA
    cand = failed(d, FA2)
    assert cand.check == "model class" and "OldModel" in cand.reason
    eager_only = ModelTraits("Ancient", 64, frozenset({EAGER}))
    d = decide(make_cap(), traits=eager_only)
    assert d.chosen == EAGER and failed(d, SDPA).check == "model class"


def test_kernel_call_smoke_test_failure() -> None:
    """A GPU that passes the static checks but fails at the first kernel call (pre-Ampere build, bad wheel)."""
    calls: list[tuple[torch.device, torch.dtype]] = []

    def broken(device: torch.device, dtype: torch.dtype) -> str | None:
        calls.append((device, dtype))
        return "RuntimeError: FlashAttention only supports Ampere GPUs or newer."

    d = decide(make_cap((8, 6), "NVIDIA A10"), smoke_test=broken)
    assert calls == [(torch.device("cuda"), torch.bfloat16)]
    cand = failed(d, FA2)
    assert d.chosen == SDPA and cand.check == "kernel call"
    assert "NVIDIA A10 sm86" in cand.reason and "Ampere GPUs or newer" in cand.reason
    # static checks fail first: the smoke test is never run on a T4
    decide(T4, smoke_test=broken)
    assert len(calls) == 1
    assert decide(make_cap(), smoke_test=lambda device, dtype: None).chosen == FA2


def test_strict_raises_with_check_device_and_fix() -> None:
    with speaking(LLM_FOUNDRY), pytest.raises(AttentionUnavailableError) as info:
        decide(T4, requested=FA2, strict=True)
    msg = str(info.value)
    assert "compute capability" in msg  # the failed check
    assert "Tesla T4" in msg and "sm75" in msg and "node-1" in msg  # device, sm, host
    assert "Fix:" in msg and "set attn_implementation: sdpa on this GPU" in msg and "set attn_strict: false" in msg
    # the same cause, its fix in the keys of the surface in use: axolotl's YAML, attach's keywords
    with speaking(AXOLOTL), pytest.raises(AttentionUnavailableError) as info:
        decide(T4, requested=FA2, strict=True)
    assert "set foundry_attn_backend: sdpa on this GPU; or set foundry_attn_strict: false" in str(info.value)
    assert not re.search(r"(?<!foundry_)attn_(strict|path|implementation)", str(info.value)), str(info.value)
    with pytest.raises(AttentionUnavailableError) as info:
        decide(T4, requested=FA2, strict=True)
    assert 'call attach(model, "sdpa") on this GPU; or pass strict=False to attach' in str(info.value)
    with pytest.raises(AttentionUnavailableError, match="kernel call"):
        decide(make_cap(), requested=FA2, strict=True, smoke_test=lambda device, dtype: "boom")
    ok = decide(make_cap(), requested=FA2, strict=True)
    assert ok.chosen == FA2 and ok.strict and not ok.fell_back


def test_non_strict_request_falls_back() -> None:
    d = decide(T4, requested=FA2)
    assert d.chosen == SDPA and d.fell_back and d.requested == FA2
    assert [c.name for c in d.candidates] == [FA2, TORCH_VARLEN, SDPA, EAGER]
    d = decide(T4, requested=EAGER)
    assert d.chosen == EAGER and not d.fell_back
    assert [c.name for c in d.candidates] == [EAGER, FA2, TORCH_VARLEN, SDPA]


def test_strict_auto_fails_only_when_nothing_runs() -> None:
    d = decide(T4, requested=AUTO, strict=True)
    assert d.chosen == SDPA and d.strict
    with pytest.raises(AttentionUnavailableError, match="model class"):
        decide(T4, requested=AUTO, strict=True, fallback=[FA2, SDPA], traits=ModelTraits("M", 64, frozenset({EAGER})))
    with speaking(LLM_FOUNDRY), pytest.raises(AttentionUnavailableError) as info:  # non-strict too: nothing runs
        decide(T4, fallback=[FA2])
    msg = str(info.value)
    assert "compute capability" in msg and "Tesla T4 (sm75)" in msg and "attn_fallback" in msg
    assert "attn_strict: false" not in msg  # it already is: that advice would not help


@pytest.mark.parametrize(
    ("kw", "key"),
    [
        ({"requested": "flash_attn_2"}, "attn_implementation"),
        ({"fallback": [FA2, "spda"]}, "attn_fallback"),
        ({"fallback": "xformers"}, "attn_fallback"),
    ],
)
def test_unknown_names_list_valid_names(kw: dict, key: str) -> None:
    with pytest.raises(ValueError) as info:
        decide(make_cap(), **kw)
    msg = str(info.value)
    assert key in msg
    for name in NAMES:
        assert name in msg


def test_empty_fallback_and_string_fallback() -> None:
    with pytest.raises(ValueError, match="empty"):
        decide(make_cap(), fallback=[])
    d = decide(T4, fallback=SDPA)
    assert d.chosen == SDPA and [c.name for c in d.candidates] == [SDPA]
    d = decide(T4, fallback=[SDPA, SDPA, EAGER])  # duplicates collapse
    assert [c.name for c in d.candidates] == [SDPA, EAGER]


def test_flex_needs_torch_25() -> None:
    old = Capability(True, "NVIDIA A100", (8, 0), "2.4.1", "4.51.3", None, "missing", None, "h")
    d = choose(FLEX, [FLEX, SDPA, EAGER], old, torch.float32, LLAMA_TRAITS, smoke_test=None)
    assert d.chosen == SDPA and failed(d, FLEX).check == "torch version"


def test_decision_as_dict() -> None:
    d = decide(T4)
    out = json.loads(json.dumps(d.as_dict()))
    assert out["requested"] == AUTO and out["chosen"] == SDPA and out["fell_back"] is True
    assert out["reason"] == d.reason and out["strict"] is False and out["compute_dtype"] == "bfloat16"
    assert [c["name"] for c in out["candidates"]] == [FA2, TORCH_VARLEN, SDPA, EAGER]
    assert out["candidates"][0]["check"] == "compute capability" and out["candidates"][0]["fix"]
    assert out["candidates"][1]["check"] == "torch version"  # torch_varlen: this capability's torch is 2.7
    assert out["candidates"][2]["available"] is True and out["candidates"][2]["check"] == ""


def test_with_rejection_moves_on() -> None:
    d = decide(make_cap())
    assert d.chosen == FA2
    later = d.with_rejection(FA2, "ImportError: flash_attn_2_cuda undefined symbol")
    assert later.chosen == SDPA and later.fell_back and "undefined symbol" in later.reason
    strict = decide(make_cap(), requested=FA2, strict=True)
    with pytest.raises(AttentionUnavailableError, match="undefined symbol"):
        strict.with_rejection(FA2, "undefined symbol")


def test_summarize_eight_ranks() -> None:
    from foundry_attn.observe.ranks import summarize_ranks

    dicts = []
    for rank in range(8):
        cap = T4 if rank in (3, 7) else make_cap()
        dicts.append({**decide(cap).as_dict(), "rank": rank})
    dicts.reverse()  # arrival order does not matter
    assert summarize_ranks(dicts) == (
        "attention: 6/8 ranks flash_attention_2, 2/8 sdpa; 2/8 fell back (rank 3, rank 7: Tesla T4 sm75 < 8.0)"
    )
    same = [{**decide(make_cap()).as_dict(), "rank": r} for r in range(2)]
    assert summarize_ranks(same) == "attention: 2/2 ranks flash_attention_2"


def test_model_traits_from_llama_class() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
    traits = ModelTraits.from_model_class(LlamaForCausalLM, config)
    assert traits.class_name == "LlamaForCausalLM"
    assert traits.head_dim == 8
    assert traits.supports == frozenset({FA2, TORCH_VARLEN, FLEX, SDPA, EAGER})
    assert ModelTraits.from_model_class(LlamaForCausalLM).head_dim is None

    class Plain:
        pass

    assert ModelTraits.from_model_class(Plain).supports == frozenset({EAGER})


def test_a_hub_kernel_is_taken_for_fa2_only_where_it_is_usable() -> None:
    """transformers 5.x loads kernels-community/flash-attn2 for a missing flash-attn: the chain treats it as FA2 only
    where it runs here (the kernels release transformers wants, CUDA, a cached copy), else says what is missing."""
    import dataclasses

    missing = "the kernels package is not installed (transformers 5.23.0 wants 0.18.2 <= kernels < 0.19.0)"
    cap = dataclasses.replace(
        make_cap(fa=None, fa_error="flash-attn is not installed"),
        hub_kernel="kernels-community/flash-attn2",
        hub_kernel_missing=missing,
    )
    d = decide(cap, fallback=[FA2, SDPA])
    assert d.chosen == SDPA and failed(d, FA2).check == "flash-attn installed"
    assert "hub kernel kernels-community/flash-attn2, is not usable here either" in d.reason and missing in d.reason
    usable = dataclasses.replace(cap, hub_kernel_missing=None)
    d = decide(usable, fallback=[FA2, SDPA])
    assert d.chosen == FA2 and "hub kernel kernels-community/flash-attn2" in d.reason
    assert decide(usable, torch.float32, fallback=[FA2, SDPA]).chosen == SDPA  # flash-attn's own checks still hold


def test_what_the_hub_kernel_lacks_here_is_read_from_the_install(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """The kernels release transformers wants (its own bounds), CUDA, a copy in the Hugging Face cache."""
    from foundry_attn.selection import capability

    transformers_utils = pytest.importorskip("transformers.utils.import_utils")
    if not hasattr(transformers_utils, "KERNELS_MIN_VERSION"):
        pytest.skip("this transformers has no hub kernels")
    low = transformers_utils.KERNELS_MIN_VERSION
    repo = "kernels-community/flash-attn2"
    versions = {"kernels": None}
    real = capability._dist_version
    monkeypatch.setattr(capability, "_dist_version", lambda name: versions.get(name, real(name)))
    assert "the kernels package is not installed" in capability.hub_kernel_missing(repo, True, env={})
    versions["kernels"] = "0.17.2"
    assert "kernels 0.17.2 is installed, and transformers" in capability.hub_kernel_missing(repo, True, env={})
    versions["kernels"] = low
    assert "no CUDA" in capability.hub_kernel_missing(repo, False, env={})
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    assert "is not in the Hugging Face cache" in capability.hub_kernel_missing(repo, True, env={})
    (tmp_path / "models--kernels-community--flash-attn2" / "snapshots" / "abc").mkdir(parents=True)
    assert capability.hub_kernel_missing(repo, True, env={}) is None
    assert capability.hub_kernel_missing(repo, True, env={"USE_HUB_KERNELS": "0"}) == "USE_HUB_KERNELS is off"


def test_flex_without_a_backward_here_is_refused_with_the_reason() -> None:
    import dataclasses

    cap = dataclasses.replace(CPU, flex_backward_error="torch 2.13.0 FlexAttention has no backward on cpu")
    d = decide(cap, torch.float32, requested=FLEX, fallback=[SDPA])
    assert d.chosen == SDPA and failed(d, FLEX).check == "flex backward"
    assert "no backward on cpu" in failed(d, FLEX).reason and "sdpa or eager" in failed(d, FLEX).fix
    assert decide(CPU, torch.float32, requested=FLEX, fallback=[SDPA]).chosen == FLEX  # torch 2.7: eager flex trains


def test_the_hub_kernel_transformers_would_load_is_read_from_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    """With `kernels` importable and flash-attn missing: 5.x names kernels-community/flash-attn2; 4.51 has none."""
    import importlib.util

    import transformers

    from foundry_attn.selection import capability

    real = importlib.util.find_spec
    monkeypatch.setattr(
        capability.importlib.util, "find_spec", lambda name, *a: object() if name == "kernels" else real(name, *a)
    )
    want = None if transformers.__version__.startswith("4.51") else "kernels-community/flash-attn2"
    assert capability._hub_kernel() == want


def test_one_strict_rule_and_one_message_on_every_path() -> None:
    """At build (our checks) and later (transformers' load, isolation, the first-forward dtype): the same format."""
    import re

    early = pytest.raises(AttentionUnavailableError)
    with early, speaking(LLM_FOUNDRY):
        decide(T4, requested=FA2, strict=True)
    strict = decide(make_cap(), requested=FA2, strict=True)
    assert strict.binding and not decide(make_cap(), requested=AUTO, strict=True).binding
    with pytest.raises(AttentionUnavailableError) as late, speaking(LLM_FOUNDRY):
        strict.with_rejection(FA2, "fp32 weights", check="dtype", fix="train with precision: amp_bf16")
    shape = r"attn_strict: flash_attention_2 cannot run on .+ \(sm\d+\) on node-1: check '[^']+' failed: .+\. Fix: .+"
    for message in (str(early.excinfo.value), str(late.value)):
        assert re.fullmatch(shape, message, re.S), message
    assert "check 'dtype' failed: fp32 weights. Fix: train with precision: amp_bf16" in str(late.value)


def test_torch_varlen_sits_between_flash_attn_and_sdpa() -> None:
    """PyTorch's varlen kernel keeps the unpad-once layout where flash-attn is missing or broken (torch >= 2.10)."""
    import dataclasses

    new_torch = dataclasses.replace(
        make_cap(fa=None, fa_error="flash-attn is not installed"), torch_version="2.11.0+cu128"
    )
    d = decide(new_torch)
    has_varlen = importlib.util.find_spec("torch.nn.attention.varlen") is not None
    assert d.chosen == (TORCH_VARLEN if has_varlen else SDPA), d.as_dict()
    t4 = decide(dataclasses.replace(new_torch, compute_capability=(7, 5)), fallback=[TORCH_VARLEN, SDPA])
    assert failed(t4, TORCH_VARLEN).check == ("compute capability" if has_varlen else "torch version")
    assert failed(decide(CPU, torch.float32, fallback=[TORCH_VARLEN, SDPA]), TORCH_VARLEN).check in (
        "torch version",
        "CUDA device",
    )
    softcapped = ModelTraits("Gemma2ForCausalLM", 64, frozenset(NAMES), ModelNeeds("Gemma2", softcap=50.0))
    if has_varlen:
        assert (
            failed(decide(new_torch, traits=softcapped, fallback=[TORCH_VARLEN, EAGER]), TORCH_VARLEN).check
            == "exactness"
        )


def test_a_class_whose_flash_attention_is_another_kernel_has_no_fa2() -> None:
    """5.x classes that list ``_compatible_flash_implementations`` without FA2 (gpt-oss, Flint, Granite-SWA: sinks)
    run a hub kernel when FA2 is asked for: flash-attn 2 cannot run them, so the policy does not offer it."""
    from transformers import LlamaForCausalLM

    from foundry_attn.selection.traits import ModelTraits

    class SinksModel(LlamaForCausalLM):
        _compatible_flash_implementations = ("kernels-community/vllm-flash-attn3",)

    assert "flash_attention_2" in ModelTraits.from_model_class(LlamaForCausalLM).supports
    assert "flash_attention_2" not in ModelTraits.from_model_class(SinksModel).supports

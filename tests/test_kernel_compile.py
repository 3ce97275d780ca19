"""The kernels compile for a Hopper GPU (sm_90) ahead of time, without a GPU.

CI has no GPU, and the interpreter accepts code the compiler rejects; compiling every
kernel variant to PTX for the H100's target catches that. The compile runs in a child
process (tests/aot_compile_kernels.py) because this session interprets the kernels.
"""
import pytest

from tritamp.kernels import registry


@pytest.fixture(scope="module")
def report(compiled_kernels):
    return compiled_kernels


# The multi-tensor sweeps: the specialisations their launchers really use, recorded by
# benchmarks/compile_report.py (every fused optimizer at O1/O2, fp16/bf16, aligned and
# odd-sized lists; every multi-tensor op of the op registry called directly), one family
# per kernel-name prefix the registry names.
SWEEP_FAMILIES = tuple(dict.fromkeys(op.kernel_family for op in registry.OPS
                                     if op.multi_tensor))


def _recorded(report, family):
    return {k: v for k, v in report.items()
            if k.startswith("recorded/") and v["kernel"].lstrip("_").startswith(family)}


def _summary(errors):
    """{error: scenarios} for the first few distinct errors (a readable failure)."""
    by_error = {}
    for scenario, err in errors.items():
        by_error.setdefault(err[:160], []).append(scenario)
    return {e: f"{len(s)} scenarios, e.g. {s[0]}" for e, s in list(by_error.items())[:4]}


@pytest.mark.parametrize("family", SWEEP_FAMILIES)
def test_every_recorded_multi_tensor_variant_compiles_for_sm90(report, family):
    variants = _recorded(report, family)
    assert variants, (f"no {family} kernel was launched; scenarios that failed: "
                      f"{_summary(report['recorded_errors'])}")
    bad = {k: (v["error"] or "")[-600:] for k, v in variants.items()
           if v["error"] or not v["sm90"]}
    assert bad == {}


def _writes_bf16_from_fp32(v):
    """The variant rounds fp32 arithmetic to a bf16 column it writes."""
    sig, cx = v["signature"], v["constexprs"]
    bf16 = {k for k, t in sig.items() if t == "*bf16" and k.endswith("_proto")}
    if not bf16:
        return False
    if v["kernel"].lstrip("_").startswith("check_unscale"):
        dst = [k for k in bf16 if k.startswith("dst")]
        src_bf16 = any(k.startswith("src") for k in bf16)
        identity = src_bf16 and not cx.get("HAS_SCALE") and not cx.get("HAS_ADD")
        return bool(dst) and cx.get("WRITE") is True and not identity  # bf16 copy folds away
    if any(k.startswith(("c_", "cop")) for k in bf16):
        if cx.get("HAS_COPIES", cx.get("HAS_COPY")) is True:
            return True
    # LAMB's moments stage and NovoGrad's norm stage read the parameters and write only
    # fp32 values (moments, partial norms): a bf16 parameter there is never stored.
    # Stochastic rounding (HAS_KEYS) stores the parameter rounded at random by design
    # (kernels/rounding.py): only its other bf16 columns (bf16 Adam moments) round to
    # nearest.
    if v["kernel"].lstrip("_").startswith(PARAMS_READ_ONLY):
        written = ("out", "dst")
    elif cx.get("HAS_KEYS") is True:
        written = ("m_", "v_", "out", "dst")
    else:
        written = ("p_", "m_", "v_", "out", "dst")
    return any(k.startswith(written) for k in bf16)


PARAMS_READ_ONLY = ("lamb_moments", "novograd_norm")


def test_bf16_stores_round_to_nearest_even_on_the_gpu(report):
    # Under the interpreter the kernels emulate RNE; on the GPU they must use the native
    # rounding conversion (cvt.rn.bf16.f32, or cvt.rn.bf16x2.f32 for packed pairs), which
    # is what makes both agree with torch's .to(bfloat16).
    checked = {k: v for k, v in report.items() if k.startswith("recorded/") and not v["error"]
               and _writes_bf16_from_fp32(v)}
    assert checked, "no recorded variant writes bf16"
    assert [k for k, v in checked.items() if not v["rn_bf16"]] == []


def test_scale_update_compiles_for_sm90(report):
    assert report["scale_update/dynamic=True"]["sm90"]
    assert report["scale_update/dynamic=False"]["sm90"]


@pytest.mark.parametrize("family", ["adam", "sgd", "adagrad", "lamb", "novograd",
                                    "l2norm_segment"])
def test_optimizer_math_uses_ieee_sqrt_and_division_on_the_gpu(report, family):
    # Plain tl.sqrt and / compile to sqrt.approx / div.full on NVIDIA; torch's kernels
    # are IEEE-rounded, and so are ours (tl.sqrt_rn, tl.div_rn).
    variants = {k: v for k, v in _recorded(report, family).items() if not v["error"]}
    assert variants, f"no compiled {family} variant"
    assert [k for k, v in variants.items() if v["approx"]] == []


def test_norm_kernels_compile_for_sm90_with_ieee_rounding(report):
    variants = {k: v for k, v in report.items() if k.startswith("layer_norm")}
    assert len(variants) == 5 * 2 * 2 * 3 + 3  # fwd, bwd from input and output; reduce per dtype
    for key, v in variants.items():
        assert v["sm90"] and not v["approx"], key


def test_syncbn_kernels_compile_for_sm90_with_ieee_math(report):
    variants = {k: v for k, v in report.items() if k.startswith("syncbn_")}
    assert len(variants) == 27
    assert all(v["sm90"] for v in variants.values())
    assert [k for k, v in variants.items() if v["approx"]] == []

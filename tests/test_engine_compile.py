"""The multi-tensor sweeps compile to what the engine promises on an H100 (sm_90).

benchmarks/compile_report.py runs every fused optimizer (O1/O2, fp16/bf16, and fp32 under
torch.amp.GradScaler, whose steps write the unscaled gradients back) and the
multi-tensor helpers under the launch recorder, so the variants checked here are the ones
the launchers really use, specialised by Triton as on the GPU, then compiles each for
sm_90 and reads the SASS. It runs once per session, in the child process that compiles
every kernel (conftest's ``compiled_kernels``: this session interprets the kernels). No
GPU needed.

On the aligned path (``VEC`` > 1: every address 16-byte aligned, every numel a multiple of
the vector width) each sweep kernel must:

- load its data columns 16 bytes at a time: ``LDG.E.128`` present, no 1- or 2-byte
  access at all, and every masked (predicated: the element mask) load 16 bytes wide, so
  no column is read 2, 4 or 8 bytes at a time (one narrower masked access each way is
  allowed for a conditional scalar, e.g. the last program's step-count write);
- store them 16 bytes at a time when it writes data (``STG.E.128``; the same rules);
- spill nothing (``STACK`` and ``LOCAL`` 0);
- stay within its register budget at BLOCK=1024, num_warps=4: 72 for Adam, LAMB,
  NovoGrad and Adagrad, 48 for SGD, check/unscale, l2norm, scale/axpby and LARC's rescale.

A sweep kernel not yet on the engine's signature (meta_ptr, blocks_ptr, counters_ptr,
protos..., args, HAS_<optional>, VEC, EMULATE_BF16_ROUNDING, BLOCK) fails here.
"""
import pytest

from tritamp.kernels import registry

# Register budgets per kernel family: the op registry's (docs/ops.md).
BUDGET = {op.kernel_family: op.register_budget for op in registry.OPS
          if op.register_budget is not None}


def test_every_sweep_family_has_a_budget_within_the_engine_ceiling():
    assert set(BUDGET) == {"adam", "lamb", "novograd", "adagrad", "sgd", "check_unscale",
                           "l2norm", "axpby", "count_nonfinite", "larc"}
    assert all(0 < b <= 72 for b in BUDGET.values())  # 4 warps at 72 keeps 7 blocks/SM


@pytest.fixture(scope="module")
def report(compiled_kernels):
    """benchmarks/compile_report.py's report, from the session's one compile of every
    kernel (conftest's compiled_kernels)."""
    return compiled_kernels["compile_report"]


def _family(name):
    for f in BUDGET:
        if name.lstrip("_").startswith(f):
            return f
    return None


def _sweeps(report, family):
    return [r for r in report["specialisations"]
            if r["sweep"] and _family(r["kernel"]) == family]


def _writes_data(row):
    # Reductions (l2norm partials, NovoGrad's gradient norms), check-only sweeps and the
    # non-finite counts write one value per program, not columns.
    return ("norm" not in row["kernel"] and "count_nonfinite" not in row["kernel"]
            and row["constexprs"].get("WRITE") is not False)


def _where(row):
    return f"{row['label']} (from {', '.join(row['sources'][:2])})"


def _summary(errors):
    """{error: scenarios} for the first few distinct errors (a readable failure)."""
    by_error = {}
    for scenario, err in errors.items():
        by_error.setdefault(err[:160], []).append(scenario)
    return {e: f"{len(s)} scenarios, e.g. {s[0]}" for e, s in list(by_error.items())[:4]}


@pytest.mark.parametrize("family", sorted(BUDGET))
def test_sweep_is_recorded_and_on_the_engine_signature(report, family):
    rows = _sweeps(report, family)
    assert rows, (f"no {family} sweep was launched; scenarios that failed: "
                  f"{_summary(report['errors'])}")
    legacy = sorted({r["kernel"] for r in rows if not r["engine"]})
    assert legacy == [], "not on the engine signature (meta_ptr, blocks_ptr, counters_ptr, ...)"
    no_vec = sorted({r["kernel"] for r in rows if "VEC" not in r["constexprs"]})
    assert no_vec == [], "no VEC constexpr"


@pytest.mark.parametrize("family", sorted(BUDGET))
def test_every_recorded_sweep_variant_compiles(report, family):
    bad = [f"{_where(r)}: {r['error'][:600]}" for r in _sweeps(report, family)
           if r.get("error")]
    assert bad == []


@pytest.mark.parametrize("family", sorted(BUDGET))
def test_aligned_path_is_taken_by_every_sweep_kernel(report, family):
    rows = _sweeps(report, family)
    kernels = {r["kernel"] for r in rows}
    aligned = {r["kernel"] for r in rows if (r.get("vec") or 1) > 1}
    assert kernels and aligned == kernels, f"never launched with VEC > 1: {kernels - aligned}"


@pytest.mark.parametrize("family", sorted(BUDGET))
def test_aligned_path_moves_data_16_bytes_at_a_time(report, family):
    rows = [r for r in _sweeps(report, family) if (r.get("vec") or 1) > 1 and "loads" in r]
    assert rows, f"no compiled aligned {family} variant"
    bad = []
    for r in rows:
        ints = lambda d: {int(k): v for k, v in d.items()}  # noqa: E731
        loads, stores = ints(r["loads"]), ints(r["stores"])
        masked_loads, masked_stores = ints(r["masked_loads"]), ints(r["masked_stores"])
        if not loads.get(16):
            bad.append(f"{_where(r)}: no 16-byte load ({loads})")
        if _writes_data(r) and not stores.get(16):
            bad.append(f"{_where(r)}: no 16-byte store ({stores})")
        for what, d in (("loads", loads), ("stores", stores)):
            if d.get(1) or d.get(2):
                bad.append(f"{_where(r)}: 1- or 2-byte {what} ({d})")
        # Element accesses are predicated by the mask; per-tensor scalars are read
        # unpredicated, except one conditional scalar access each way at most (the
        # last program's step-count write).
        for what, d in (("loads", masked_loads), ("stores", masked_stores)):
            narrow = sum(n for w, n in d.items() if w < 16)
            if narrow > 1:
                bad.append(f"{_where(r)}: {narrow} masked {what} narrower than 16 bytes ({d})")
    assert bad == []


@pytest.mark.parametrize("family", sorted(BUDGET))
def test_aligned_path_has_no_spills_and_fits_its_register_budget(report, family):
    rows = [r for r in _sweeps(report, family) if (r.get("vec") or 1) > 1 and "reg" in r]
    assert rows, f"no compiled aligned {family} variant"
    bad = []
    for r in rows:
        if r["spills"]:
            bad.append(f"{_where(r)}: spills (STACK {r['stack']}, LOCAL {r['local']})")
        if r["reg"] > BUDGET[family]:
            bad.append(f"{_where(r)}: {r['reg']} registers > {BUDGET[family]}")
        assert r["constexprs"]["BLOCK"] == 1024 and r["num_warps"] == 4, _where(r)
    assert bad == []


@pytest.mark.parametrize("family", ["adagrad", "adam", "lamb", "novograd", "sgd"])
def test_gradient_writing_variants_are_compiled_and_checked(report, family):
    # torch.amp.GradScaler's steps write the unscaled gradients back (WRITE_GRAD): those
    # variants are launched by the report's GradScaler scenarios, so the load-width,
    # spill and register checks above cover them too
    rows = [r for r in _sweeps(report, family) if r["constexprs"].get("WRITE_GRAD") is True]
    assert rows, f"no {family} variant with WRITE_GRAD=True was recorded"
    assert any((r.get("vec") or 1) > 1 and "reg" in r for r in rows), \
        f"no aligned {family} WRITE_GRAD variant compiled"
    assert all(any("GradScaler" in s for s in r["sources"]) for r in rows)


def test_report_stays_a_ci_sized_job(report):
    # The report must stay a CI-sized job on a 2-core machine: bounded by what it compiles
    # (194 variants, about 60 s on the development machine when quiet), not by a clock a
    # busy machine stretches (a timed bound of 120 s failed at 213 s under load).
    assert report["n_specialisations"] <= 220, report["n_specialisations"]


def test_sharded_norm_stages_compile_without_spills(report):
    # FusedLAMB / FusedNovoGrad over DTensor shards reduce their per-tensor norms across
    # processes between stages: NovoGrad's blend runs as STAGE 1 and STAGE 2 around the
    # reduce, LAMB's segment reduce without its square root. Both are recorded by the
    # report's sharded scenarios and held to the NovoGrad / LAMB register budgets.
    rows = [r for r in report["specialisations"]
            if any("sharded" in s for s in r["sources"])]
    blend = {r["constexprs"].get("STAGE") for r in rows if "blend" in r["kernel"]}
    assert blend >= {1, 2}, sorted(r["kernel"] for r in rows)
    assert any("segment" in r["kernel"] and r["constexprs"].get("SQRT") is False
               for r in rows), sorted(r["kernel"] for r in rows)
    for r in rows:
        if "blend" in r["kernel"] or "segment" in r["kernel"]:
            assert "reg" in r, (_where(r), r.get("error"))
            assert r["spills"] == 0, _where(r)
            assert r["reg"] <= BUDGET["novograd" if "blend" in r["kernel"] else "lamb"], \
                (_where(r), r["reg"])


@pytest.mark.parametrize("family", ["adagrad", "adam", "lamb", "novograd", "sgd"])
def test_rounding_variants_are_compiled_and_checked(report, family):
    # bf16 parameters without masters: the stochastic rounding (HAS_KEYS) and Kahan
    # (HAS_COMPS) variants are launched by the report's "bf16 stochastic" / "bf16 kahan"
    # scenarios, so the load-width, spill and register checks above cover them too
    rows = [r for r in _sweeps(report, family) if (r.get("vec") or 1) > 1 and "reg" in r]
    for flag in ("HAS_KEYS", "HAS_COMPS"):
        hits = [r for r in rows if r["constexprs"].get(flag) is True]
        assert hits, f"no aligned {family} variant with {flag}=True compiled"
        assert all(any("bf16" in s for s in r["sources"]) for r in hits)
    if family == "adam":  # state_dtype=torch.bfloat16: bf16 moment protos
        assert any(any("bf16 moments" in s for s in r["sources"]) for r in rows)

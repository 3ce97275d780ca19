"""benchmarks.profile_step: its variants swap the part they name, and a CPU run prints a
step's time, its host share and its busiest operators."""
import pytest
import torch

from benchmarks import opt_levels as ol
from benchmarks import profile_step

TINY_TRANSFORMER = dict(model="transformer", optimizer="adamw", batch_size=2, image_size=8,
                        width=16, depth=1, heads=2)


@pytest.fixture
def spies(monkeypatch):
    seen = {"norms": [], "optimizers": []}
    build_model, make_optimizer = ol.build_model, ol.make_optimizer

    def spy_model(*args, **kwargs):
        seen["norms"].append(kwargs.get("fused_norms"))
        return build_model(*args, **kwargs)

    def spy_optimizer(kind, name, params):
        opt = make_optimizer(kind, name, params)
        seen["optimizers"].append(type(opt).__module__.split(".")[0])
        return opt

    monkeypatch.setattr(ol, "build_model", spy_model)
    monkeypatch.setattr(ol, "make_optimizer", spy_optimizer)
    return seen


@pytest.mark.parametrize("name, norms, optimizers", [
    ("O1-bf16", [True], ["tritamp"]),
    ("O1-bf16+nn-norm", [False], ["tritamp"]),
    ("O1-bf16+torch-opt", [True], ["torch"]),
    ("torch.amp-bf16", [False], ["torch"]),
])
def test_a_variant_swaps_only_the_part_it_names(spies, name, norms, optimizers):
    spy_model, spy_optimizer = ol.build_model, ol.make_optimizer
    run = profile_step.build(name, TINY_TRANSFORMER, torch.device("cpu"))
    assert spies["norms"] == norms and spies["optimizers"] == optimizers
    # the benchmark's own builders are back in place afterwards
    assert ol.build_model is spy_model and ol.make_optimizer is spy_optimizer
    (step_s, host_s), = profile_step.timed(run, 1)
    assert 0 < host_s <= step_s


@pytest.mark.parametrize("name, message", [
    ("O9", "unknown configuration 'O9'"),
    ("torch.amp+nn-norm", "the variants apply to tritamp's configurations"),
])
def test_an_unknown_configuration_or_a_torch_variant_is_refused(name, message):
    with pytest.raises(SystemExit, match=message):
        profile_step.build(name, TINY_TRANSFORMER, torch.device("cpu"))


def test_a_cpu_run_prints_each_configuration_and_the_summary(capsys):
    rc = profile_step.main(["--device", "cpu", "--workload", "cnn-sgd",
                            "--configs", "O0,O2-bf16+torch-opt", "--warmup", "1",
                            "--steps", "2", "--profiled-steps", "1", "--top", "3"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "== O0: step " in out and "== O2-bf16+torch-opt: step " in out
    assert "operators a step" in out and "aten::" in out
    table = out[out.index("| config |"):].splitlines()
    assert table[0] == "| config | step ms | host ms | operators / step | operators ms / step |"
    assert [line.split(" | ")[0] for line in table[2:]] == ["| O0", "| O2-bf16+torch-opt"]


def test_bad_counts_are_refused():
    with pytest.raises(SystemExit):
        profile_step.main(["--device", "cpu", "--steps", "0"])

"""The layering of docs/architecture.md, read from the imports of every module:
examples -> tritamp -> tritamp.kernels -> torch; no package reaches into another
package's underscore modules; tritamp.amp does not import tritamp.parallel;
``triton.language`` only in kernels/; tests, benchmarks and examples reach amp's
internals only through ``tritamp.testing``."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
POLICY = ("tritamp.amp", "tritamp.optimizers", "tritamp.normalization", "tritamp.parallel",
          "tritamp.sharding",
          "tritamp.fp16_utils", "tritamp.convert", "tritamp.contract", "tritamp.testing")


def _module_name(path):
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "kernels":
        parts = ["tritamp", "kernels"] + parts[1:]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _package_of(module, is_init):
    """The package a module belongs to: itself for an __init__, else its parent."""
    return module if is_init else module.rpartition(".")[0]


def _imports(path):
    """(imported module, [names]) of every import in ``path``, relative ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    module = _module_name(path)
    package = _package_of(module, path.name == "__init__.py")
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            names = [a.name for a in node.names]
            yield target, names
            for name in names:  # "from pkg import _module" imports a module too
                yield f"{target}.{name}", []


def _files(*roots):
    for root in roots:
        yield from sorted((ROOT / root).rglob("*.py"))


def _private_module(target):
    """The first underscore component of a tritamp module path (``tritamp.amp._x`` ->
    ``tritamp.amp._x``), or None."""
    if not target or not target.startswith("tritamp"):
        return None
    parts = target.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[:i + 1])
    return None


def _is_module(dotted):
    rel = dotted.split(".")[1:]
    if rel and rel[0] == "kernels":
        base = ROOT / "kernels" / pathlib.Path(*rel[1:]) if len(rel) > 1 else ROOT / "kernels"
    else:
        base = ROOT / "tritamp" / pathlib.Path(*rel) if rel else ROOT / "tritamp"
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def test_no_package_imports_another_packages_private_module():
    found = []
    for path in _files("tritamp", "kernels"):
        package = _package_of(_module_name(path), path.name == "__init__.py")
        for target, _ in _imports(path):
            private = _private_module(target)
            if private is None or not _is_module(private):
                continue
            owner = private.rpartition(".")[0]
            if owner != package:
                found.append(f"{path.relative_to(ROOT)} imports {private}")
    assert found == []


def test_tests_benchmarks_and_examples_import_no_private_module():
    found = []
    for path in _files("tests", "benchmarks", "examples"):
        for target, _ in _imports(path):
            private = _private_module(target)
            if private is not None and _is_module(private):
                found.append(f"{path.relative_to(ROOT)} imports {private}")
    assert found == []


def _apex_spelling(node):
    """``amp._amp_state``: Apex's module attribute, which Apex scripts use to reach the
    loss scalers (tritamp.amp exports it for them): a public surface, not an internal."""
    return (node.attr == "_amp_state" and isinstance(node.value, ast.Name)
            and node.value.id == "amp")


def test_tests_reach_amp_internals_only_through_tritamp_testing():
    found = []
    for path in _files("tests", "benchmarks", "examples"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("_amp_stash", "_amp_state") \
                    and not _apex_spelling(node):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    assert found == []


def test_amp_does_not_import_parallel():
    found = [f"{path.relative_to(ROOT)} imports {target}"
             for path in _files("tritamp/amp") for target, _ in _imports(path)
             if target and target.startswith("tritamp.parallel")]
    assert found == []


@pytest.mark.parametrize("root", ["tritamp", "examples"])
def test_triton_language_only_in_kernels(root):
    found = [str(path.relative_to(ROOT)) for path in _files(root)
             for target, _ in _imports(path)
             if target and (target == "triton.language" or target.startswith("triton.language."))]
    assert found == []


def test_kernels_import_nothing_from_the_policy_layer():
    found = [f"{path.relative_to(ROOT)} imports {target}" for path in _files("kernels")
             for target, _ in _imports(path)
             if target and any(target == p or target.startswith(p + ".") for p in POLICY)]
    assert found == []


def test_examples_use_the_public_api_only():
    found = [f"{path.relative_to(ROOT)} imports {target}" for path in _files("examples")
             for target, _ in _imports(path)
             if target and (target.startswith("tritamp.testing")
                            or target.startswith("tritamp.kernels.engine"))]
    assert found == []


def test_the_checks_see_a_private_import(tmp_path):
    """The scan resolves relative imports and module-valued names (it would catch one)."""
    assert _private_module("tritamp.amp._x") == "tritamp.amp._x"
    assert _private_module("tritamp.kernels.syncbn") is None
    assert _is_module("tritamp.kernels._multi_tensor") and _is_module("tritamp.amp.state")
    assert not _is_module("tritamp.amp._no_such_module")
    imports = dict(_imports(ROOT / "tritamp" / "amp" / "optimizer.py"))
    assert "tritamp.kernels.engine" in imports and "tritamp.amp.model" in imports

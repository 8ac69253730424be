"""The package's layers only point down (docs/architecture.md): no import circle, no import that climbs back up,
and the project's own modules imported at the top of files, where a reader sees them."""
import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "recipe"

# lowest first; a module belongs to the longest prefix that names it
LAYERS = [
    ["recipe.errors"],
    ["recipe.config"],
    ["recipe.runs", "recipe.tracking", "recipe.cores", "recipe.gpu_profile"],
    ["recipe.launch.roles"],
    ["recipe.chat", "recipe.hub", "recipe.sandbox", "recipe.weights", "recipe.model_card"],
    ["recipe.envs", "recipe.model"],
    ["recipe.rollout"],
    ["recipe.inference"],
    ["recipe.data"],
    ["recipe.eval.metrics", "recipe.eval.runner", "recipe.eval.sampling", "recipe.eval.models", "recipe.rl.loss", "recipe.rl.muon",
     "recipe.rl.dist", "recipe.rl.trainer", "recipe.rl.orchestrator", "recipe.sft"],
    ["recipe.eval.benchmarks"],
    ["recipe.eval.report"],
    # stages: the entry points and what only they use
    ["recipe.data.__main__", "recipe.base", "recipe.sft.__main__", "recipe.rl.loop", "recipe.rl.eval_during",
     "recipe.rl.__main__",
     "recipe.rl.bench", "recipe.rl.bench_trl", "recipe.sft.bench", "recipe.rl.soak", "recipe.eval.__main__", "recipe.sandbox.bench", "recipe.inference.bench",
     "recipe.launch",
     "recipe.gpu_check"],
]
RANK = {prefix: i for i, names in enumerate(LAYERS) for prefix in names}
INSIDE_SANDBOX = {"recipe.sandbox._inside"}  # runs inside the sandbox's interpreter, not as part of the package


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PKG.rglob("*.py") if module_name(p) not in INSIDE_SANDBOX}


def rank(name: str) -> int:
    best = max((p for p in RANK if name == p or name.startswith(p + ".")), key=len, default=None)
    assert best is not None, f"{name} is in no layer of tests/test_layers.py"
    return RANK[best]


def project_imports(path: Path, known: set[str]) -> list[tuple[str, int, bool]]:
    """(imported project module, line, at the top of the file) for every import of a recipe module."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from recipe import hub` imports the module recipe.hub
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                     for a in node.names]
        for name in names:
            if name.split(".")[0] == "recipe":
                out.append((name, node.lineno, id(node) in top))
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: {m for m, _, _ in project_imports(path, set(mods)) if m in mods and m != name}
            for name, path in mods.items()}


def test_every_module_has_a_layer_and_imports_only_its_own_or_lower_layers():
    climbing = [f"{a} (layer {rank(a)}) imports {b} (layer {rank(b)})"
                for a, deps in graph().items() for b in sorted(deps) if rank(b) > rank(a)]
    assert not climbing, "\n".join(climbing)


def test_no_import_circle():
    g, state, stack = graph(), {}, []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for m in sorted(g[n]):
            if state.get(m) == "open":
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(m):] + [m]))
            if m not in state:
                visit(m)
        stack.pop()
        state[n] = "done"

    for n in sorted(g):
        if n not in state:
            visit(n)


def test_project_imports_sit_at_the_top_of_files_and_vllm_stays_lazy():
    mods = modules()
    inner = [f"{path.relative_to(ROOT)}:{line} imports {m} inside a function"
             for name, path in mods.items() for m, line, at_top in project_imports(path, set(mods)) if not at_top]
    assert not inner, "\n".join(inner)
    eager_vllm = []
    for path in mods.values():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                eager_vllm += [f"{path.relative_to(ROOT)}:{node.lineno}" for n in names if n.split(".")[0] == "vllm"]
    assert not eager_vllm, f"vllm imported at module level (it is optional): {eager_vllm}"


def test_the_checker_sees_a_climbing_import_and_a_circle(tmp_path, monkeypatch):
    """The checks above can fail: a low module importing a high one is caught, and so is a circle."""
    g = {"recipe.config": {"recipe.eval.benchmarks"}, "recipe.eval.benchmarks": {"recipe.config"}}
    assert rank("recipe.eval.benchmarks") > rank("recipe.config")
    monkeypatch.setattr(sys.modules[__name__], "graph", lambda: g)
    try:
        test_no_import_circle()
    except AssertionError as e:
        assert "recipe.config -> recipe.eval.benchmarks -> recipe.config" in str(e)
    else:
        raise AssertionError("the circle was not found")


def test_the_data_stage_and_the_sandbox_start_without_torch_or_sympy():
    """Imported only where used: `make data` (which imports the environments, they the sandbox and the math
    verifier) starts in about 1 s instead of 5, and a config error there is answered as fast."""
    probe = ("import sys, recipe.data.__main__, recipe.sandbox, recipe.envs; "
             "print(sorted(m for m in ('torch', 'sympy', 'math_verify') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "[]"

"""The package's shape: data flows one way (cli -> eval -> generation -> engine -> request -> spec/reuse ->
models -> hook -> methods -> cache -> attention/recipe/registry), with no import circle. Checked on the
source's import statements (every
``import``/``from`` anywhere in a file, lazy ones inside functions included)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "longlab"

# Layer of each module, lowest first; a module may import only from its own layer or lower ones.
# Within one layer the import graph must still be acyclic.
LAYERS: list[tuple[str, ...]] = [
    ("paths", "errors", "registry", "recipe", "safeio", "prompt", "tasks", "sparse.blockmask", "grammar",
     "sparse.synthetic", "quant.quantizer", "eval.store", "eval.identity"),
    # ops: the attention-kernel lab and compiled kernels (build, block_flash, qdecode; masks: LongCA slice
    # masks; context_parallel: ring attention over torch.distributed), below the method families that use them
    ("attention", "ops"),
    ("cache",),
    # method families; ops.kernels: LongCA-bench's kernels behind one call (it runs the sparse executor);
    # compress: context compressors (compress.api: above models); position: RoPE methods (position.train,
    # the training tool, sits with the tools)
    # adapter: LoRA adapter files, checked and merged into a base model's weights (models loads them)
    ("kv", "quant", "sparse", "decode", "ops.kernels", "compress", "position", "adapter"),
    ("hook",),
    ("models",),
    ("reuse",),  # per-document KV store, assembly and reuse methods: drive a model's layers, below pipeline
    ("compress.api",),  # applies context compressors for pipeline and eval; may load a scorer model
    ("spec",),  # speculative decoding: drives the model on the cache, below the engine that calls it
    ("request",),  # the one request: fields validated, method strings parsed with the registry
    ("engine",),  # the one engine: streams, prefill-once planner, decode lanes, submit/step/run
    ("generation",),  # generate(): a thin facade over the engine
    # tools and the harness drive models and pipelines (capture: q/k/v capture for calibration, training)
    ("capture", "kv.indexmem_train", "compress.comi_train", "quant.calibrate", "eval",
     "ops.cp_generate",  # CP prefill; compress.comi_train: `longlab train comi` (COMI's fusion layer)
     "position.train", "lab",  # lab: the layers lab (own LM + trainer), writes to eval.store
     "serve", "data", "memory", "adapter_train"),  # serve: the OpenAI server (drives the engine); data:
    # EntropyLong data; adapter_train: `longlab train lora` (LoRA on EntropyLong data, through peft);
    # memory: HGMem, C-DIC, PersistBench over a chat backend (the engine or an OpenAI-compatible endpoint)
    ("methods",),  # the one list of method modules (registers every family); the package face imports it
    ("eval.docs_tables", "eval.pages"),  # the docs site's generated tables: read stores and the registry
    ("cli",),
    ("",),  # the package face: longlab/__init__.py
]


def _modules() -> dict[str, Path]:
    mods = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").startswith("longlab"):
                target = node.module.removeprefix("longlab").lstrip(".")
            else:
                continue
            for cand in [target] + [f"{target}.{a.name}" if target else a.name for a in node.names]:
                if cand in mods and cand != name:
                    found.add(cand)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("longlab"):
                    target = alias.name.removeprefix("longlab").lstrip(".")
                    if target in mods and target != name:
                        found.add(target)
    # "from . import methods" inside a package __init__ names the module, not the package itself
    found.discard(name)
    return found


def _layer_of(name: str) -> int:
    best, best_len = None, -1
    for rank, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            hit = name == prefix or (prefix and name.startswith(prefix + "."))
            if hit and len(prefix) > best_len:
                best, best_len = rank, len(prefix)
    if best is None:
        raise AssertionError(f"module longlab.{name} has no layer in LAYERS")
    return best


GRAPH = {name: _imports(name, path, _modules()) for name, path in _modules().items()}


def test_every_module_has_a_layer():
    for name in GRAPH:
        _layer_of(name)


@pytest.mark.parametrize("name", sorted(GRAPH))
def test_imports_point_down(name):
    upward = [dep for dep in GRAPH[name] if _layer_of(dep) > _layer_of(name)]
    assert not upward, f"longlab.{name or '(package)'} imports higher layers: {sorted(upward)}"


def test_no_import_circle():
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(GRAPH[node]):
            if state.get(dep) == 1:
                cycle = stack[stack.index(dep):] + [dep] if dep in stack else [node, dep]
                raise AssertionError("import circle: " + " -> ".join(c or "longlab" for c in cycle))
            if dep not in state:
                visit(dep, stack + [dep])
        state[node] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])


def test_methods_never_import_the_hook_or_the_harness():
    for name, deps in GRAPH.items():
        if _layer_of(name) == 3:
            bad = {d for d in deps if d in ("hook", "models", "generation", "request", "cli")
                   or d.startswith(("eval", "engine"))}
            assert not bad, f"longlab.{name} imports {sorted(bad)}"

"""The import arrows of design.md/style.md, checked on module-level imports of every source file, and the
no-pickle rule (style.md P7), checked on every import, call and RQ object of the source packages."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

FORBIDDEN = {
    "batching": {"redis", "asyncio", "fastapi", "starlette", "torch", "time", "random", "fleet.clock",
                 "gateway", "workers"},
    # grpcio and tritonclient's gRPC package (its __init__ loads grpcio and the client): 12-19 MiB in every process
    # that imports them; the generated messages come from fleet/config_proto.py and gateway/grpc/service_proto.py.
    "fleet": {"fastapi", "starlette", "torch", "gateway", "workers", "grpc", "tritonclient.grpc"},
    "gateway": {"torch", "workers", "onnxruntime", "grpc", "tritonclient.grpc"},
    "workers": {"gateway", "fastapi", "starlette", "grpc", "tritonclient.grpc"},
}


def module_level_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in tree.body:  # top level only: lazy imports inside functions are the sanctioned escape hatch
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_import_arrows(package: str) -> None:
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name in module_level_imports(path):
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN[package]):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)


def test_redis_keys_are_built_only_in_keys_module() -> None:
    offenders = []
    for package in ("fleet", "gateway", "workers"):
        for path in (ROOT / package).rglob("*.py"):
            if path.name == "keys.py":
                continue
            text = path.read_text()
            if '"fleet:' in text or "f\"{self.prefix}:" in text:
                offenders.append(str(path.relative_to(ROOT)))
    assert not offenders


# --- no pickle: nothing from Redis or the network is unpickled (style.md P7) ---------------------------------
#
# Checked on the AST of every source file of the four packages, wherever the code sits (RQ's setup moves
# between packages): imports of a pickling module at any depth, calls that unpickle, `allow_pickle=True`,
# and every RQ object built without RQ's JSON serializer.

SCANNED = ("fleet", "gateway", "workers", "batching")
PICKLING_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "shelve", "joblib"}
UNPICKLING_FUNCTIONS = {"read_pickle"}  # pandas
# RQ callables that deserialize job data, so they take a `serializer` (RQ's default is pickle).
RQ_CLASSES = {"Queue", "Worker", "SimpleWorker", "SpawnWorker", "WorkerPool", "Job"}
RQ_CLASS_METHODS = {"fetch", "fetch_many", "create", "all", "find_by_key", "from_queue_key"}


def _root_module(name: str) -> str:
    return name.split(".")[0]


def _dotted(node: ast.expr) -> list[str]:
    """`a.b.c` as ["a", "b", "c"]; [] for anything that is not a plain dotted name."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return []
    return [node.id, *reversed(parts)]


def _is_rq_class(name: str) -> bool:
    return name in RQ_CLASSES or name.endswith("Registry")


class _RqNames:
    """What a module binds from RQ: module aliases (`import rq`) and RQ classes (`from rq import Queue`)."""

    def __init__(self, tree: ast.AST, subclasses: set[str]) -> None:
        self.modules: set[str] = set()
        self.classes: set[str] = set(subclasses)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if _root_module(alias.name) == "rq":
                        self.modules.add(alias.asname or "rq")
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                    and _root_module(node.module) == "rq":
                for alias in node.names:
                    if _is_rq_class(alias.name):
                        self.classes.add(alias.asname or alias.name)
                    elif alias.asname is None and alias.name in {"queue", "worker", "job", "registry"}:
                        self.modules.add(alias.name)  # `from rq import queue` -> queue.Queue(...)

    def is_class(self, node: ast.expr) -> bool:
        parts = _dotted(node)
        if len(parts) == 1:
            return parts[0] in self.classes
        return len(parts) > 1 and parts[0] in self.modules and _is_rq_class(parts[-1])

    def deserializes(self, call: ast.Call) -> bool:
        """`call` builds an RQ object or fetches jobs: it needs serializer=JSONSerializer."""
        if self.is_class(call.func):
            return True
        return isinstance(call.func, ast.Attribute) and call.func.attr in RQ_CLASS_METHODS \
            and self.is_class(call.func.value)


def rq_subclasses(trees: list[ast.AST]) -> set[str]:
    """Names of the classes these modules derive (at any depth) from an RQ class, e.g. a SimpleWorker."""
    found: set[str] = set()
    while True:
        before = len(found)
        for tree in trees:
            names = _RqNames(tree, found)
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef) and any(names.is_class(base) for base in node.bases):
                    found.add(node.name)
        if len(found) == before:
            return found


def _json_serializer(call: ast.Call) -> bool:
    for kw in call.keywords:
        if kw.arg == "serializer":
            parts = _dotted(kw.value)
            return bool(parts) and parts[-1] == "JSONSerializer"
    return False


def pickle_findings(tree: ast.AST, subclasses: set[str] | None = None) -> list[str]:
    """Everything in `tree` that may unpickle: one line per finding (line number and what)."""
    rq = _RqNames(tree, subclasses if subclasses is not None else rq_subclasses([tree]))
    aliases = set(PICKLING_MODULES)
    found: list[str] = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _root_module(alias.name) in PICKLING_MODULES:
                    found.append(f"{line}: import {alias.name}")
                    aliases.add(alias.asname or _root_module(alias.name))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and _root_module(node.module) in PICKLING_MODULES:
            found.append(f"{line}: from {node.module} import ...")
        elif isinstance(node, ast.Call):
            found.extend(f"{line}: {what}" for what in _call_findings(node, rq, aliases))
    return found


def _call_findings(call: ast.Call, rq: _RqNames, pickling: set[str]) -> list[str]:
    out: list[str] = []
    parts = _dotted(call.func)
    if parts in (["__import__"], ["importlib", "import_module"]) and call.args \
            and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str) \
            and _root_module(call.args[0].value) in PICKLING_MODULES:
        out.append(f"dynamic import of {call.args[0].value}")
    if len(parts) > 1 and parts[0] in pickling:
        out.append(f"call {'.'.join(parts)}")
    if parts and parts[-1] in UNPICKLING_FUNCTIONS:
        out.append(f"call {parts[-1]}")
    for kw in call.keywords:
        if kw.arg == "allow_pickle" and not (isinstance(kw.value, ast.Constant) and kw.value.value is False):
            out.append("allow_pickle not False")
        if kw.arg == "weights_only" and isinstance(kw.value, ast.Constant) and kw.value.value is False:
            out.append("weights_only=False (torch.load unpickles)")
    if rq.deserializes(call) and not _json_serializer(call):
        out.append(f"RQ {'.'.join(parts) or 'object'} built without serializer=JSONSerializer")
    return out


def rq_constructions(tree: ast.AST, subclasses: set[str]) -> list[str]:
    """The RQ objects `tree` builds or fetches (whatever their serializer), by callee name."""
    rq = _RqNames(tree, subclasses)
    return [".".join(_dotted(n.func)) for n in ast.walk(tree) if isinstance(n, ast.Call) and rq.deserializes(n)]


def source_trees() -> dict[Path, ast.AST]:
    return {path: ast.parse(path.read_text(), str(path))
            for package in SCANNED for path in sorted((ROOT / package).rglob("*.py"))}


def test_nothing_is_unpickled() -> None:
    trees = source_trees()
    subclasses = rq_subclasses(list(trees.values()))
    bad = [f"{path.relative_to(ROOT)}:{finding}" for path, tree in trees.items()
           for finding in pickle_findings(tree, subclasses)]
    assert not bad, "\n".join(bad)
    # Not vacuous: the checker does see where the bulk-job code builds its RQ queue and worker.
    built = [name for tree in trees.values() for name in rq_constructions(tree, subclasses)]
    assert "Queue" in built, built
    assert any(name in subclasses or name.endswith("Worker") for name in built), built


UNPICKLING_SNIPPETS = {
    "import in a function": "def f(b):\n    import pickle\n    return pickle.loads(b)\n",
    "from-import in a method": "class A:\n    def f(self, b):\n        from dill import loads\n"
                               "        return loads(b)\n",
    "aliased import": "import cloudpickle as cp\n",
    "submodule import": "import joblib.numpy_pickle\n",
    "dynamic import": "import importlib\nm = importlib.import_module('pickle')\n",
    "__import__": "m = __import__('_pickle')\n",
    "call on a module in scope": "def f(pickle, b):\n    return pickle.loads(b)\n",
    "np.load allow_pickle=True": "import numpy as np\nx = np.load('a.npy', allow_pickle=True)\n",
    "allow_pickle from a variable": "import numpy as np\ndef f(p, ok):\n    return np.load(p, allow_pickle=ok)\n",
    "allow_pickle anywhere": "def f(load):\n    return load('a.npz', mmap_mode='r', allow_pickle=True)\n",
    "read_pickle": "import pandas as pd\ndf = pd.read_pickle('x.pkl')\n",
    "torch.load weights_only=False": "import torch\nm = torch.load('m.pt', weights_only=False)\n",
    "RQ Queue without serializer": "from rq import Queue\nq = Queue('jobs', connection=c)\n",
    "RQ Queue in a function": "def f(c):\n    from rq import Queue\n    return Queue('jobs', connection=c)\n",
    "RQ Queue via the module": "import rq\nq = rq.Queue('jobs', connection=c)\n",
    "RQ Queue, pickle serializer": "from rq import Queue\nfrom rq.serializers import DefaultSerializer\n"
                                   "q = Queue('jobs', connection=c, serializer=DefaultSerializer)\n",
    "RQ Queue, **kwargs only": "from rq import Queue\nq = Queue('jobs', **options)\n",
    "RQ Worker without serializer": "from rq import Worker\nw = Worker([q], connection=c)\n",
    "RQ Worker, aliased": "from rq.worker import SimpleWorker as SW\nw = SW([q], connection=c)\n",
    "RQ Worker subclass": "from rq import SimpleWorker\nclass Mine(SimpleWorker):\n    pass\n"
                          "class Deeper(Mine):\n    pass\ndef f(q, c):\n    return Deeper([q], connection=c)\n",
    "RQ Job.fetch without serializer": "from rq.job import Job\nj = Job.fetch('id', connection=c)\n",
    "RQ registry without serializer": "from rq.registry import StartedJobRegistry\n"
                                      "r = StartedJobRegistry('jobs', connection=c)\n",
}

CLEAN_SNIPPETS = {
    "RQ with JSON": "from rq import Queue, SimpleWorker\nfrom rq.job import Job\n"
                    "from rq.serializers import JSONSerializer\nclass W(SimpleWorker):\n    pass\n"
                    "q = Queue('jobs', connection=c, serializer=JSONSerializer)\n"
                    "w = W([q], connection=c, serializer=JSONSerializer)\n"
                    "j = Job.fetch('id', connection=c, serializer=JSONSerializer)\n",
    "RQ via the module, with JSON": "import rq\nimport rq.serializers\n"
                                    "q = rq.Queue('jobs', connection=c, serializer=rq.serializers.JSONSerializer)\n",
    "other queues": "import asyncio\nfrom queue import Queue\nq1, q2 = asyncio.Queue(), Queue()\n",
    "np.load without pickle": "import numpy as np\nx = np.load('a.npy', mmap_mode='r', allow_pickle=False)\n",
    "json and msgpack": "import json\nimport msgpack\nx = json.loads(s)\ny = msgpack.unpackb(b, strict_map_key=True)\n",
    "shared memory": "from multiprocessing import shared_memory\n",
    "rq helpers that read nothing": "from rq import get_current_job\njob = get_current_job()\n",
}


@pytest.mark.parametrize("snippet", UNPICKLING_SNIPPETS.values(), ids=list(UNPICKLING_SNIPPETS))
def test_the_pickle_check_catches(snippet: str) -> None:
    assert pickle_findings(ast.parse(snippet))


@pytest.mark.parametrize("snippet", CLEAN_SNIPPETS.values(), ids=list(CLEAN_SNIPPETS))
def test_the_pickle_check_passes(snippet: str) -> None:
    assert pickle_findings(ast.parse(snippet)) == []

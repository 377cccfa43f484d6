"""The house's layout (docs/architecture.md): folders named for their jobs, imports running one way
from the commands down to the model, and the quickstart's commands reading neither fine-tuning, chat,
export nor evaluation code. Read from the code's own imports, as text, so nothing here runs it but the
two commands at the end."""

import ast
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import PROJECT_ROOT

COMMANDS = {"train", "sample", "serve", "eval", "plot", "data.prepare", "data.chat_tasks"}  # what users run
LIBRARY_FOLDERS = ("data", "evals", "finetune", "inference", "interop", "model", "optim", "rl", "server", "trainer")


def project_files() -> dict[str, Path]:
    """Every Python file of the project but the tests and benchmarks, by module name."""
    files = {}
    for path in sorted(PROJECT_ROOT.glob("*.py")) + sorted(PROJECT_ROOT.glob("*/*.py")):
        relative = path.relative_to(PROJECT_ROOT)
        if relative.parts[0] in ("tests", "bench") or relative.parts[0].startswith("."):
            continue
        module = ".".join(relative.with_suffix("").parts).removesuffix(".__init__")
        files[module] = path
    return files


def imports(path: Path, modules: set[str]) -> set[str]:
    """The project modules a file imports, at its top or inside a function."""
    found = set()
    package = ".".join(path.relative_to(PROJECT_ROOT).parent.parts)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], base]).strip(".")
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {name for name in names if name in modules}
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    files = project_files()
    return {module: imports(path, set(files)) - {module} for module, path in files.items()}


def test_no_two_modules_import_each_other_however_far_round(graph):
    """No import cycle, also through imports inside functions: when two modules need each other, the
    shared part moves down into a third."""
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        for imported in sorted(graph[module]):
            if imported in path:
                cycles.append(path[path.index(imported) :] + [imported])
            elif imported not in done:
                visit(imported, path + [imported])
        done.add(module)

    done: set[str] = set()
    for module in sorted(graph):
        if module not in done:
            visit(module, [module])
    assert not cycles, f"import cycles: {cycles[:3]}"


def test_no_library_file_imports_a_command(graph):
    offenders = {
        module: sorted(graph[module] & COMMANDS) for module in graph if module.split(".")[0] in LIBRARY_FOLDERS
    }
    assert not {m: c for m, c in offenders.items() if c and m not in COMMANDS}


def test_the_model_folder_imports_nothing_else_from_the_project(graph):
    """model/ is plain PyTorch: copied into another project, it works."""
    outside = {m: sorted(i for i in graph[m] if i.split(".")[0] != "model") for m in graph if m.startswith("model")}
    assert not any(outside.values()), outside


def test_no_folder_holds_more_than_a_quarter_of_the_code():
    lines = Counter()
    for path in project_files().values():
        relative = path.relative_to(PROJECT_ROOT)
        lines[relative.parts[0] if len(relative.parts) > 1 else "(commands)"] += len(path.read_text().splitlines())
    total = sum(lines.values())
    assert max(lines.values()) <= total / 4, lines.most_common(3)


def test_one_file_name_is_one_job():
    """Two files of one name (but __init__.py) would be two halves of one job, or two jobs under one name."""
    names = Counter(path.name for path in project_files().values() if path.name != "__init__.py")
    assert [name for name, count in names.items() if count > 1] == []


# the rooms the quickstart never needs: fine-tuning, conversations, export and import, evaluation, serving, RL
NOT_ON_THE_QUICKSTART = (
    "finetune", "interop", "evals", "server", "inference.chat", "data.conversations", "data.chat_dataset", "rl",
)  # fmt: skip
PROBE = """
import runpy, sys
sys.argv = {argv!r}
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as e:
    assert not e.code, e.code
print(sorted(name for name in sys.modules if name.split(".")[0] in {folders!r}))
"""


@pytest.mark.slow
def test_the_quickstarts_commands_read_no_fine_tuning_chat_export_or_evaluation_code(tmp_path):
    """python train.py --config ... and python sample.py --prompt ...: the modules they import at run time,
    in a subprocess of their own, hold none of those rooms'."""
    run = tmp_path / "run"
    commands = [
        ["train.py", "--config", "configs/shakespeare_char.toml", "--train.max_iters=1", "--train.eval_iters=1",
         "--train.eval_at_start=false", "--train.compile=false", f"--train.out_dir={run}",
         f"--data.data_dir={tmp_path / 'data'}"],
        ["sample.py", "--out-dir", str(run), "--prompt", "ROMEO:", "--max-new-tokens", "2"],
    ]  # fmt: skip
    for argv in commands:
        code = PROBE.format(argv=argv, folders=LIBRARY_FOLDERS)
        result = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        modules = ast.literal_eval(result.stdout.strip().splitlines()[-1])
        assert "model.gpt" in modules  # the probe sees the project's modules
        read = [m for m in modules if m.startswith(NOT_ON_THE_QUICKSTART)]
        assert read == [], f"{argv[0]} imports {read}"

"""ddp-triton does not depend on Lightning, Accelerate, Transformers or torchft; its integration modules say what to
install.

Tier: no device; runs whether or not the frameworks are installed (each check hides them or looks at the source).
"""

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "ddp_triton"
FRAMEWORKS = ("lightning", "pytorch_lightning", "accelerate", "lightning_fabric", "transformers", "torchft")


def _hide(monkeypatch, *names):
    """Make ``names`` unimportable in this process (None in sys.modules) and forget the integration modules."""
    for name in names:
        monkeypatch.setitem(sys.modules, name, None)
    for name in [m for m in sys.modules if m.startswith("ddp_triton.integrations.")]:
        monkeypatch.delitem(sys.modules, name)


def test_lightning_integration_without_lightning_says_what_to_install(monkeypatch):
    _hide(monkeypatch, "lightning", "lightning.pytorch", "pytorch_lightning")
    with pytest.raises(ImportError, match="needs PyTorch Lightning.*pip install lightning"):
        importlib.import_module("ddp_triton.integrations.lightning")


def test_accelerate_integration_without_accelerate_says_what_to_install(monkeypatch):
    _hide(monkeypatch, "accelerate")
    with pytest.raises(ImportError, match="needs Hugging Face Accelerate.*pip install accelerate"):
        importlib.import_module("ddp_triton.integrations.accelerate")


def test_transformers_integration_without_transformers_says_what_to_install(monkeypatch):
    _hide(monkeypatch, "transformers")
    with pytest.raises(ImportError, match="needs Hugging Face Transformers.*pip install transformers"):
        importlib.import_module("ddp_triton.integrations.transformers")


def test_torchft_integration_without_torchft_says_what_to_install(monkeypatch):
    _hide(monkeypatch, "torchft", "torchft.ddp", "torchft.process_group")
    with pytest.raises(ImportError, match=r"needs torchft.*pip install torchft \(or ddp-triton\[torchft\]\)"):
        importlib.import_module("ddp_triton.integrations.torchft")


def test_the_package_imports_no_framework():
    """The hook and the integrations package load none of them (a fresh interpreter: nothing loaded before)."""
    probe = ("import sys, ddp_triton, ddp_triton.integrations; ddp_triton.register; ddp_triton.CommState; "
             f"print(sorted(m for m in sys.modules if m.split('.')[0] in {FRAMEWORKS!r}))")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "[]"


def test_only_the_integration_modules_name_a_framework():
    """No module outside ``ddp_triton/integrations/`` imports a framework, at the top or inside a function."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.parent.name == "integrations":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            offenders += [f"{path.relative_to(PACKAGE)}: {n}" for n in names if n.split(".")[0] in FRAMEWORKS]
    assert not offenders, offenders

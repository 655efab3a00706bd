"""scripts/install.py hands pip's configuration to uv: the same indexes, find-links
locations, constraints and CA bundle, with pip's precedence; its ``warm`` caches the
bytecode of what runs import, every module of our packages and Ray's own processes
included."""

from __future__ import annotations

import importlib.util
import itertools
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "scripts" / "install.py"
spec = importlib.util.spec_from_file_location("install_script", SCRIPT)
assert spec is not None and spec.loader is not None
install = importlib.util.module_from_spec(spec)
spec.loader.exec_module(install)

LISTED = """\
:env:.default-timeout='180'
:env:.find-links='/opt/wheels'
global.cert='/etc/ssl/certs/ca.crt'
global.constraint='/etc/pip/constraints.txt'
global.extra-index-url='file:///opt/a/simple file:///opt/b/simple'
global.find-links='/ignored/by/env'
global.index-url='https://mirror.example/simple'
install.index-url='https://install.example/simple'
download.constraint='/not/for/install.txt'
"""


def test_the_effective_setting_of_each_key_is_taken() -> None:
    assert install.pip_config(LISTED) == {
        "find-links": ["/opt/wheels"],  # PIP_FIND_LINKS over the file's
        "cert": ["/etc/ssl/certs/ca.crt"],
        "constraint": ["/etc/pip/constraints.txt"],  # [download] is not pip install's
        "extra-index-url": ["file:///opt/a/simple", "file:///opt/b/simple"],
        "index-url": ["https://install.example/simple"],  # [install] over [global]
    }


def test_uv_installs_with_pips_settings_and_rules() -> None:
    command, env = install.uv_command("install", ["--quiet", "--no-deps", "pkg==1"], install.pip_config(LISTED))
    assert command[1:5] == ["pip", "install", "--python", sys.executable]
    assert command[-3:] == ["--quiet", "--no-deps", "pkg==1"] and command.count("--quiet") == 1
    pairs = list(itertools.pairwise(command))
    for pair in [("--index-strategy", "unsafe-best-match"), ("--index-url", "https://install.example/simple"),
                 ("--extra-index-url", "file:///opt/a/simple"), ("--extra-index-url", "file:///opt/b/simple"),
                 ("--find-links", "/opt/wheels"), ("--constraint", "/etc/pip/constraints.txt")]:
        assert pair in pairs, pair
    assert "--compile-bytecode" not in command  # `warm` compiles what runs import, not all of site-packages
    assert env["SSL_CERT_FILE"] == "/etc/ssl/certs/ca.crt"


def test_uninstall_takes_no_index_options() -> None:
    command, _ = install.uv_command("uninstall", ["--quiet", "torchvision"], install.pip_config(LISTED))
    assert command[1:3] == ["pip", "uninstall"] and command[-2:] == ["--quiet", "torchvision"]
    assert not any(arg.startswith("--index") or arg == "--find-links" for arg in command)


def test_warm_writes_the_bytecode_of_what_it_imports_and_skips_what_is_missing(tmp_path, monkeypatch, capsys) -> None:
    (tmp_path / "warm_probe_module.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # as PYTHONDONTWRITEBYTECODE sets it
    assert install.main(["warm", "warm_probe_module", "no_such_module_anywhere"]) == 0
    assert list((tmp_path / "__pycache__").glob("warm_probe_module.*.pyc"))
    assert "no_such_module_anywhere not imported (ModuleNotFoundError)" in capsys.readouterr().err


def test_warm_compiles_every_module_of_a_package_without_importing_it(tmp_path, monkeypatch, capsys) -> None:
    """``--package``: a package whose ``__init__`` imports none of its modules (as
    ours load their names on first use) gets every module's bytecode, nested ones
    included, and nothing of it runs."""
    package = tmp_path / "warm_probe_package"
    (package / "inner").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "_lazy.py").write_text("raise RuntimeError('imported')\n")
    (package / "inner" / "__init__.py").write_text("")
    (package / "inner" / "_deep.py").write_text("VALUE = 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    assert install.main(["warm", "--package", "warm_probe_package", "--package", "no_such_package_anywhere"]) == 0
    assert list((package / "__pycache__").glob("_lazy.*.pyc"))
    assert list((package / "inner" / "__pycache__").glob("_deep.*.pyc"))
    assert "warm_probe_package" not in sys.modules
    assert "package 'no_such_package_anywhere' not compiled" in capsys.readouterr().err


def test_warm_with_ray_caches_what_rays_own_processes_import(tmp_path) -> None:
    """``warm --ray`` starts Ray once: its dashboard agent (a process of its own) writes
    the bytecode of its modules although the environment says not to."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": str(tmp_path)}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run([sys.executable, str(SCRIPT), "warm", "--ray"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "not started" not in done.stderr, done.stderr
    assert list(tmp_path.rglob("reporter_agent.*.pyc")), "the dashboard agent cached nothing"

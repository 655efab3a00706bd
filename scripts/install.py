"""``pip install`` / ``pip uninstall`` for the Makefile, done by uv when it is there.

uv installs the same packages as pip three times faster on two cores (it unpacks
in parallel): about a minute instead of three for ``make``'s first install. It
byte-compiles nothing (pip compiles every module it installs: 85 s of CPU for
torch, vLLM, transformers and Ray here); ``warm`` then compiles, once, the few
thousand modules a run imports, and Python compiles any other on its first
import. It does not read pip's configuration, so this passes pip's
(``pip config list``: files and ``PIP_*`` variables) on as uv's options: the index,
extra indexes, find-links locations, constraint files and CA bundle, with pip's
rule for several indexes (the best version across all of them). Without uv in this
interpreter's environment it runs pip itself.

Usage: ``python scripts/install.py install|uninstall ARGS...`` (ARGS as for pip),
``python scripts/install.py warm [--ray] [--package NAME]... MODULES...`` (import
each module, writing Python's bytecode cache even where ``PYTHONDONTWRITEBYTECODE``
is set; ``--package NAME``: compile every module of package NAME without
importing it, for packages whose ``__init__`` loads its names on first use, so
that importing it compiles nothing else; ``--ray``: start Ray's processes once
too, which cache what they import).
"""

from __future__ import annotations

import importlib
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

UV_OPTION = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
}
"""pip's configuration keys that change what gets installed, and uv's options for them."""


SECTION_RANK = {"global": 0, "install": 1, ":env:": 2}
"""Which setting wins where ``pip config list`` names a key more than once: the
``[install]`` section over ``[global]``, a ``PIP_*`` variable over both (pip merges
its files itself, later over earlier, before it lists them)."""


def pip_config(listed: str) -> dict[str, list[str]]:
    """pip's effective setting of each key in :data:`UV_OPTION` and ``cert``, from
    what ``pip config list`` printed (``section.key='value'`` lines). A value that
    lists several (``extra-index-url``) is split."""
    found: dict[str, tuple[int, str]] = {}
    for line in listed.splitlines():
        name, _, value = line.partition("=")
        section, _, key = name.rpartition(".")
        rank = SECTION_RANK.get(section)
        if rank is not None and (key in UV_OPTION or key == "cert") and rank >= found.get(key, (-1, ""))[0]:
            found[key] = (rank, value.strip().strip("'\""))
    return {key: value.split() for key, (_, value) in found.items()}


def uv_command(action: str, args: list[str], config: dict[str, list[str]]) -> tuple[list[str], dict[str, str]]:
    """The uv command line and environment that do what ``pip ACTION ARGS`` would
    under pip's configuration ``config`` (:func:`pip_config`)."""
    uv = [str(Path(sys.executable).with_name("uv"))]
    command = [*uv, "pip", action, "--python", sys.executable]
    env = dict(os.environ)
    if action == "install":
        command += ["--index-strategy", "unsafe-best-match"]
        for key, option in UV_OPTION.items():
            for value in config.get(key, []):
                command += [option, value]
        if config.get("cert"):
            env["SSL_CERT_FILE"] = config["cert"][0]
    quiet = [arg for arg in args if arg in ("--quiet", "-q")][:1]  # uv's one level is pip's two
    return command + quiet + [arg for arg in args if arg not in ("--quiet", "-q")], env


RAY_PROCESSES = "--ray"
"""``warm``'s flag: start Ray once as well (:func:`warm_ray_processes`)."""

PACKAGE = "--package"
"""``warm``'s option: compile every module of the package it names (:func:`compile_package`)."""


def warm(args: list[str]) -> int:
    """Import the modules ``args`` names (each that imports: a missing optional one
    is skipped), writing the bytecode cache of everything they import; compile every
    module of each ``--package NAME`` (:func:`compile_package`); with ``--ray``, then
    start Ray's processes once as well (:func:`warm_ray_processes`)."""
    sys.dont_write_bytecode = False
    modules, packages = [], []
    words = iter(args)
    for word in words:
        if word == PACKAGE:
            packages.append(next(words, ""))
        elif word != RAY_PROCESSES:
            modules.append(word)
    for name in packages:
        if not compile_package(name):
            print(f"scripts/install.py warm: package {name!r} not compiled (not found, or a module "
                  "does not compile)", file=sys.stderr)
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:  # an optional package absent or broken: its users say so later
            print(f"scripts/install.py warm: {name} not imported ({type(e).__name__})", file=sys.stderr)
    if RAY_PROCESSES in args:
        warm_ray_processes()
    return 0


def compile_package(name: str) -> bool:
    """Write the bytecode cache of every module below the top-level package ``name``
    without importing it: a package whose ``__init__`` loads its names on first use
    (as ours do) imports none of its modules when a warm-up imports it, and a run
    would compile each module it uses in every process it starts wherever the
    environment keeps the cache from being written. False: not found, or a module
    did not compile."""
    import compileall
    import importlib.util

    spec = importlib.util.find_spec(name) if name and "." not in name else None
    if spec is None or not spec.submodule_search_locations:
        return False
    return all(compileall.compile_dir(path, quiet=1) for path in spec.submodule_search_locations)


def warm_ray_processes() -> None:
    """Start a local Ray instance, run one task and stop it: Ray's own processes
    (GCS, dashboard, agents, monitors, a worker) import a few hundred modules the
    driver never does (about 2 s of CPU to compile on every start where
    ``PYTHONDONTWRITEBYTECODE`` keeps them uncached); here they write their
    bytecode once. A failure is reported and skipped: runs start Ray themselves."""
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)  # Ray's processes inherit this environment
    try:
        import ray

        def answer() -> int:  # defined here: Ray sends it by value
            return 1

        ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level=logging.ERROR,
                 log_to_driver=False)
        try:
            ray.get(ray.remote(answer).remote(), timeout=300)
        finally:
            ray.shutdown()
    except Exception as e:
        print(f"scripts/install.py warm: Ray's processes not started ({type(e).__name__}: {e})", file=sys.stderr)


def main(argv: list[str]) -> int:
    action, *args = argv
    if action == "warm":
        return warm(args)
    if action not in ("install", "uninstall"):
        raise SystemExit(f"scripts/install.py: install, uninstall or warm, not {action!r}")
    if shutil.which("uv", path=str(Path(sys.executable).parent)) is None:
        return subprocess.call([sys.executable, "-m", "pip", action, *args])
    config = {}
    if action == "install":  # uninstalling reads no index
        listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                                check=True).stdout
        config = pip_config(listed)
    command, env = uv_command(action, [arg for arg in args if arg != "-y"], config)
    return subprocess.call(command, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

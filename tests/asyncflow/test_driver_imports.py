"""A driver imports what it plans with, not the model stack: the trainer, the
algorithms and the role classes load no transformers model class (seconds of CPU in
every driver and worker process) until a model is built, and building one works."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]

_PROBE = """
import sys, tempfile
import asyncflow.algos, asyncflow.cli, asyncflow.train, workers.roles, workers.rollout
print("LOADED", sorted(m for m in ("transformers.modeling_utils", "transformers.models.llama.modeling_llama")
                       if m in sys.modules))
from workers.models import TinyModelConfig, load_model, save_tiny_model
with tempfile.TemporaryDirectory() as tmp:
    model = load_model(save_tiny_model(tmp, TinyModelConfig()))
print("BUILT", type(model).__name__, "transformers.modeling_utils" in sys.modules)
"""


def test_the_drivers_modules_load_no_model_class_until_a_model_is_built() -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, capture_output=True, text=True,
                         check=True, timeout=300).stdout.splitlines()
    assert out[-2] == "LOADED []"
    assert out[-1] == "BUILT LlamaForCausalLM True"


_FILE_ERRORS = """
import sys
from asyncflow.cli import main
for path in sys.argv[1:]:
    print("RC", main(["train", path, "--no-progress"]))
from channels import ConfigError, DP
print("HEAVY", sorted(m for m in ("torch", "ray", "transformers", "workers.roles") if m in sys.modules))
"""


def test_a_config_files_own_errors_come_before_torch_imports(tmp_path: Path) -> None:
    # the command reads and decodes the file with msgspec alone: a typo in the path or
    # the syntax is reported in a fraction of a second, not after seconds of imports
    (tmp_path / "bad.toml").write_text("steps = [\n")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    (tmp_path / "run.json").write_text("{}")
    (tmp_path / "bad.yaml").write_text("train:\n  steps: 2\n  lr: a: 1\n")
    (tmp_path / "tab.yml").write_text("train:\n\tsteps: 2\n")
    (tmp_path / "configs").mkdir()
    paths = [str(tmp_path / "missing.toml"), str(tmp_path / "bad.toml"), str(tmp_path / "list.yaml"),
             str(tmp_path / "run.json"), str(tmp_path / "bad.yaml"), str(tmp_path / "tab.yml"),
             str(tmp_path / "configs")]
    done = subprocess.run([sys.executable, "-c", _FILE_ERRORS, *paths], cwd=ROOT, capture_output=True, text=True,
                          check=True, timeout=120)
    assert done.stdout.splitlines() == ["RC 2"] * 7 + ["HEAVY []"]  # nor does `from channels import ...`
    errors = done.stderr.splitlines()
    assert errors == [
        f"asyncflow: configuration error: config file {paths[0]} does not exist",
        f"asyncflow: configuration error: {paths[1]}: not valid TOML: Invalid value (at end of document)",
        f"asyncflow: configuration error: {paths[2]}: the file must hold a table of keys, not a list",
        f"asyncflow: configuration error: config {paths[3]} must end in .toml, .yaml or .yml",
        # PyYAML's problem and its place, on one line
        f"asyncflow: configuration error: {paths[4]}: not valid YAML: mapping values are not allowed in this "
        "context (line 3, column 8)",
        f"asyncflow: configuration error: {paths[5]}: not valid YAML: found character that cannot start any "
        "token (line 2, column 1)",
        f"asyncflow: configuration error: config {paths[6]} is a directory; name a .toml or .yaml file",
    ]


def test_a_malformed_set_pair_comes_before_torch_imports(tmp_path: Path) -> None:
    probe = ("import sys\nfrom asyncflow.cli import main\n"
             "print('RC', main(['train', sys.argv[1], '--set', 'actor.lr']))\n"
             "print('HEAVY', sorted(m for m in ('torch', 'ray') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "missing.toml")], cwd=ROOT,
                          capture_output=True, text=True, check=True, timeout=120)
    assert done.stdout.splitlines() == ["RC 2", "HEAVY []"]
    assert done.stderr.startswith("asyncflow: configuration error: --set expects key=value, got 'actor.lr'")


_SET_UP = """
import sys
from asyncflow.train import load_config
from asyncflow.train._config import response_width
from asyncflow.train._memory import check_memory
from asyncflow.train._prompts import run_prompts
from asyncflow.train._start_model import starting_model
config = load_config("examples/arith_grpo.toml", {"sft": None, "model.path": sys.argv[1]})
prompts = run_prompts(config, starting_model(config, say=print), response_width(config))
print("WARNINGS", check_memory(config, sys.argv[1], context=prompts.context))
print("TRANSFORMERS", "transformers" in sys.modules)
"""


def test_the_trainers_set_up_reads_checkpoints_without_transformers(tmp_path: Path) -> None:
    # the driver checks the model (heads, context, memory) from its config.json; the
    # workers import transformers to load it, the driver need not (seconds of CPU)
    from workers.models import TinyModelConfig, save_tiny_model

    model = save_tiny_model(tmp_path, TinyModelConfig())
    out = subprocess.run([sys.executable, "-c", _SET_UP, str(model)], cwd=ROOT, capture_output=True, text=True,
                         check=True, timeout=300).stdout.splitlines()
    assert out[-2:] == ["WARNINGS []", "TRANSFORMERS False"]


_RAYS_LIBRARIES = """
import importlib.util, sys, threading
from asyncflow.runtime import _forks, _ray_start
wanted = [m for m in (*_forks.RAY_LIBRARIES, "pyarrow") if importlib.util.find_spec(m.split(".")[0])]
print("BEFORE", sorted(m for m in wanted if m in sys.modules))
_ray_start._import_quietly((), 0, {}, threading.Event())  # start_ray's thread, beside ray.init
print("MISSING", sorted(m for m in wanted if m not in sys.modules))
"""


def test_start_rays_thread_imports_the_libraries_of_rays_serializers_while_ray_starts() -> None:
    # else the driver's first actor (the workers started ahead) imports them after Ray is up
    out = subprocess.run([sys.executable, "-c", _RAYS_LIBRARIES], cwd=ROOT, capture_output=True, text=True,
                         check=True, timeout=120).stdout.splitlines()
    before = out[-2].removeprefix("BEFORE ")
    assert "pydantic.v1.fields" not in before and "pyarrow" not in before  # what importing Ray leaves out
    assert out[-1] == "MISSING []"

"""Build ckptdoctor/pickle_verdict/allowlist.json: the pickle globals that files written by the real libraries import.

Usage::

    python bench/make_allowlist.py            # write ckptdoctor/pickle_verdict/allowlist.json
    python bench/make_allowlist.py --check    # exit 1 when the pinned file misses a global found now

Every global comes from a file the libraries really wrote: in each stack of the matrix (``STACKS``: transformers 4.40,
4.44, 4.46, 4.49, 4.51, 4.55, 4.57 and this environment's 5.x, each with TrainingArguments variants, a 2-step
Trainer run and peft adapters through the Trainer (bench/stack_writer.py); TRL 1.16 and 1.12 (the last with PPO);
DeepSpeed 0.19.8 over transformers 5.x, 4.51 and 4.40, as TrainingArguments and as a real Trainer run on its CPU
accelerator (tests/gate/deepspeed_trainer.py: ZeRO-1/2/3, CPU offload, bf16); numpy 1.26; bitsandbytes 0.50.2; as
``pip --target`` layers over this environment or venvs under ``--stacks``; a stack that is absent is recorded as
such, never guessed), and here (torch optimizers and schedulers, the Trainer's own checkpoint files from a 2-step
``transformers.Trainer`` run, accelerate ``save_state`` without and with mixed precision, a peft adapter saved as
``.bin``, numpy arrays, ``torch.distributed.checkpoint``, DeepSpeed ZeRO 1/2/3 engines when ``deepspeed`` is
installed), read back with
ckptdoctor's own static readers (nothing is unpickled). The versions each stack ran are recorded in the JSON
(``versions``, ``stacks``), with the cases a library refused and its own message. On top of that, the enum classes
of the modules whose classes appear in ``training_args.bin`` are listed by introspection, since another
TrainingArguments setting pickles another member of the same family (an enum member is rebuilt by value lookup: no
code of ours or theirs runs), and the classes of DCP's metadata and planner modules and numpy's dtype classes by exact
name (they replace the ``module.*`` entries the policy no longer has). ``called`` lists the globals those files call
with arguments; each must be reviewed in ``pickle_policy.REVIEWED_CALLS`` or ``CALLED_ENUMS`` (``--check``).
"""

from __future__ import annotations

import argparse
import enum
import importlib
import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ckptdoctor.model import PickleFacts  # noqa: E402
from ckptdoctor.readers import read_file  # noqa: E402
from ckptdoctor.readers.pickle_walk import BYTES_LOADER  # noqa: E402
from tests.helpers.te_recipe import LOAD_TE_RECIPE  # noqa: E402

OUT = ROOT / "ckptdoctor" / "pickle_verdict" / "allowlist.json"

# Modules whose enum classes can appear in training_args.bin / accelerate state for other settings, and modules
# whose every class is data a loader rebuilds (DCP metadata, numpy dtype classes): listed by exact name.
ENUM_MODULES = (
    "transformers.training_args",
    "transformers.trainer_utils",
    "transformers.debug_utils",
    "transformers.utils.generic",
    "accelerate.utils.dataclasses",
)
CLASS_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.planner",
    "numpy.dtypes",
)

# The matrix: (stack, layer or venv under --stacks, script). A layer is put on PYTHONPATH over this interpreter; a
# venv (a folder with bin/python) runs its own interpreter. Each script writes files into argv[1] the way the stack's
# Trainer does (``torch.save(args, "training_args.bin")``, optimizer state) and prints its versions as JSON.
_ARGS_COMMON = """
import json, os, sys, warnings, importlib
warnings.simplefilter("ignore")
import torch
out = sys.argv[1]; os.makedirs(out, exist_ok=True)
def versions(*names):
    v = {}
    for n in names:
        try: v[n] = importlib.import_module(n).__version__
        except Exception: v[n] = "not installed"
    return v
"""
_TRL = _ARGS_COMMON + """
os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
import trl
# TRL 1.x moved ORPO, PPO, CPO, BCO, GKD, online DPO ... to ``trl.experimental.<name>`` (PPO until 1.12)
def find(n):
    cls = getattr(trl, n, None)
    sub = {"OnlineDPOConfig": "online_dpo"}.get(n, n[: -len("Config")].lower())
    if cls is None and importlib.util.find_spec("trl.experimental") is not None:
        try: cls = getattr(importlib.import_module(f"trl.experimental.{sub}"), n, None)
        except Exception: cls = None
    return cls
done = []
for n in ["SFTConfig", "DPOConfig", "GRPOConfig", "KTOConfig", "RewardConfig", "ORPOConfig", "PPOConfig",
          "CPOConfig", "BCOConfig", "RLOOConfig", "OnlineDPOConfig", "PRMConfig", "GKDConfig"]:
    cls = find(n)
    if cls is None: continue
    try: a = cls(output_dir=os.path.join(out, n), bf16=False, use_cpu=True, report_to="none")
    except Exception: continue
    torch.save(a, os.path.join(out, f"training_args-{n}.bin")); done.append(n)
print(json.dumps({"versions": versions("trl", "transformers", "torch"), "configs": done}))
"""
_DEEPSPEED_ARGS = _ARGS_COMMON + """
from transformers import TrainingArguments
for stage in (1, 2, 3):
    ds = {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": "auto",
          "train_batch_size": "auto", "gradient_accumulation_steps": "auto", "bf16": {"enabled": "auto"}}
    a = TrainingArguments(output_dir=os.path.join(out, f"z{stage}"), use_cpu=True, report_to="none", deepspeed=ds)
    torch.save(a, os.path.join(out, f"training_args-zero{stage}.bin"))
print(json.dumps({"versions": versions("deepspeed", "transformers", "accelerate", "torch"), "configs": [1, 2, 3]}))
"""
_ACCELERATE_DEEPSPEED = _ARGS_COMMON + """
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29650",
                  ACCELERATE_USE_DEEPSPEED="true")
from torch import nn
from accelerate import Accelerator, DeepSpeedPlugin
from accelerate.state import AcceleratorState
done = []
for stage in (1, 2, 3):
    AcceleratorState._reset_state(reset_partial_state=True)
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=stage, gradient_accumulation_steps=1))
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    dl = torch.utils.data.DataLoader([torch.randn(4) for _ in range(4)], batch_size=2)
    model, opt, dl, sched = acc.prepare(model, opt, dl, sched)
    for x in dl:
        acc.backward(model(x).float().sum()); opt.step(); sched.step(); opt.zero_grad()
    acc.save_state(os.path.join(out, f"zero{stage}"))
    done.append(stage)
print(json.dumps({"versions": versions("accelerate", "deepspeed", "torch"), "configs": done}))
"""
# A real transformers.Trainer under DeepSpeed (ZeRO on DeepSpeed's CPU accelerator, one rank over gloo), run by
# tests/gate/deepspeed_trainer.py (argv[2]; its ``run`` trains a tiny Llama 2 steps and saves checkpoint-2). The
# Trainer's accelerator hands TrainingArguments' DeepSpeed plugin a weak reference to the model's config
# (accelerate/utils/dataclasses.py ``DeepSpeedPlugin.set_deepspeed_weakref``: ``self.dschf = HfDeepSpeedConfig(...)``),
# so its ``training_args.bin`` pickles what ``TrainingArguments(deepspeed=...)`` alone never holds; the engine writes
# its model and optimizer states beside it. Each ZeRO stage, CPU offload of the optimizer (and of the parameters at
# stage 3), and bf16, since each changes what the engine keeps.
_DEEPSPEED_TRAINER = _ARGS_COMMON + """
import runpy, socket, tempfile
with socket.socket() as s:  # the rendezvous port: another run may hold the default one
    s.bind(("127.0.0.1", 0)); os.environ["MASTER_PORT"] = str(s.getsockname()[1])
cpu = {"device": "cpu"}
cases = {
    "zero1": {"stage": 1}, "zero2": {"stage": 2}, "zero3": {"stage": 3},
    "zero2-offload": {"ds": {"zero_optimization": {"stage": 2, "offload_optimizer": cpu}}},
    "zero3-offload": {"ds": {"zero_optimization": {"stage": 3, "offload_optimizer": cpu, "offload_param": cpu}}},
    "zero2-bf16": {"stage": 2, "args": {"bf16": True}},
    "zero3-bf16": {"stage": 3, "args": {"bf16": True}},
}
jobs = [{**case, "out": os.path.join(out, name), "args": {"max_steps": 2, "save_steps": 2, **case.get("args", {})}}
        for name, case in cases.items()]
with tempfile.TemporaryDirectory() as tmp:
    with open(os.path.join(tmp, "jobs.json"), "w") as f: json.dump(jobs, f)
    sys.argv = [sys.argv[2], os.path.join(tmp, "jobs.json"), os.path.join(tmp, "results.json")]
    runpy.run_path(sys.argv[0], run_name="__main__")
    with open(sys.argv[2]) as f: results = json.load(f)
failed = {name: ": ".join(r["error"])[:200] for name, r in zip(cases, results) if "error" in r}
done = [name for name in cases if name not in failed]
print(json.dumps({"versions": versions("deepspeed", "transformers", "accelerate", "torch"), "configs": done,
                  "failed": failed}))
"""
DEEPSPEED_TRAINER_SCRIPT = str(ROOT / "tests" / "gate" / "deepspeed_trainer.py")
_BNB = _ARGS_COMMON + """
import bitsandbytes as bnb
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 4))
opt = bnb.optim.AdamW8bit(model.parameters(), lr=1e-3)
model(torch.randn(2, 64)).sum().backward(); opt.step()
torch.save(opt.state_dict(), os.path.join(out, "optimizer.pt"))
print(json.dumps({"versions": versions("bitsandbytes", "torch"), "configs": ["AdamW8bit"]}))
"""
# TransformerEngine's fp8 ``_extra_state`` (Megatron-LM and NeMo models): what
# ``TransformerEngineBaseModule.get_extra_state`` (transformer_engine/pytorch/module/base.py) pickles into a uint8
# tensor for each recipe TE keeps state for, saved as a module's state dict. The pip package without its compiled core
# refuses to import, so the recipe module is loaded from the layer's own source under its real module path (the
# layer: ``pip install --no-deps --target /work/stacks/te transformer_engine==2.20.2``).
_TE = _ARGS_COMMON + """
import importlib.metadata, pickle
root = next(os.path.join(p, "transformer_engine") for p in sys.path
            if os.path.isfile(os.path.join(p, "transformer_engine", "common", "recipe", "__init__.py")))
""" + LOAD_TE_RECIPE + """
class Linear(torch.nn.Linear):
    def __init__(self, fmt):
        super().__init__(2, 2)
        self.recipe = recipe.DelayedScaling(fp8_format=fmt)
    def get_extra_state(self):  # get_extra_state's dict for a delayed-scaling recipe, on CPU
        state = {"recipe": self.recipe, "scale_fwd": torch.ones(3), "amax_history_fwd": torch.zeros(16, 3),
                 "scale_bwd": torch.ones(2), "amax_history_bwd": torch.zeros(16, 2),
                 "extra_fp8_variables": {"num_gemms": 1, "fp8_checkpoint": True, "fp8_max_fwd": 448.0}}
        return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)
done = []
for fmt in (recipe.Format.HYBRID, recipe.Format.E4M3):
    torch.save(Linear(fmt).state_dict(), os.path.join(out, f"te-{fmt.name}.pt"))
    done.append(fmt.name)
version = importlib.metadata.version("transformer_engine")
print(json.dumps({"versions": {"transformer_engine": version, **versions("torch")}, "configs": done}))
"""
# bench/stack_writer.py, run by each transformers and numpy stack: TrainingArguments variants (Seq2Seq, FSDP, bf16,
# fp16, torch_compile), a 2-step Trainer run (safetensors and .bin), peft LoRA/DoRA/IA3/modules_to_save/prompt tuning
# adapters through the Trainer as .bin; or, for numpy, RNG state, arrays, scalars and object arrays.
_WRITER = (Path(__file__).with_name("stack_writer.py")).read_text()

DEEPSPEED_LAYER = "deepspeed-0.19.8"  # ZeRO engines run with it when deepspeed is not installed here

# transformers 4.4x layers: ``pip install --no-deps --target /work/stacks/tfXYZ transformers==4.X tokenizers==<its pin>
# huggingface-hub==<a release of that month>`` over this environment's torch and accelerate; 4.40 and 4.44 add
# ``peft==0.11.1`` / ``peft==0.12.0`` (this environment's peft needs a newer huggingface-hub).
TRANSFORMERS_LAYERS = (
    ("transformers-4.40", "tf440"),
    ("transformers-4.44", "tf444"),
    ("transformers-4.46", "tf446"),
    ("transformers-4.49", "tf449"),
    ("transformers-4.51", "tf451"),
    ("transformers-4.55", "tf455"),
)

# The matrix: (stack, layers or venv under --stacks, script, its arguments). Layers are put on PYTHONPATH over this
# interpreter, first one first; a venv (a folder with bin/python) runs its own interpreter; no layer at all is this
# environment. Each script writes files into argv[1] the way the stack does and prints its versions as JSON.
STACKS: tuple[tuple[str, tuple[str, ...], str, tuple[str, ...]], ...] = (
    ("transformers-5 (this environment)", (), _WRITER, ("transformers",)),
    ("trl-1.16", ("trl-1.16",), _TRL, ()),
    # the last TRL with PPOConfig (trl.experimental.ppo), over TRL 1.16's layer for its dependencies
    ("trl-1.12", ("trl-1.12", "trl-1.16"), _TRL, ()),
    ("deepspeed-0.19.8", ("deepspeed-0.19.8",), _DEEPSPEED_ARGS, ()),
    ("accelerate+deepspeed-0.19.8", ("deepspeed-0.19.8",), _ACCELERATE_DEEPSPEED, ()),
    ("deepspeed-0.19.8+transformers-4.40", ("deepspeed-0.19.8", "tf440"), _DEEPSPEED_ARGS, ()),
    ("deepspeed-0.19.8+transformers-4.51", ("deepspeed-0.19.8", "tf451"), _DEEPSPEED_ARGS, ()),
    # a real Trainer run under DeepSpeed: training_args.bin as the Trainer saves it, and the engine's states
    ("deepspeed-0.19.8-trainer", ("deepspeed-0.19.8",), _DEEPSPEED_TRAINER, (DEEPSPEED_TRAINER_SCRIPT,)),
    ("deepspeed-0.19.8-trainer+transformers-4.51", ("deepspeed-0.19.8", "tf451"), _DEEPSPEED_TRAINER,
     (DEEPSPEED_TRAINER_SCRIPT,)),
    ("deepspeed-0.19.8-trainer+transformers-4.40", ("deepspeed-0.19.8", "tf440"), _DEEPSPEED_TRAINER,
     (DEEPSPEED_TRAINER_SCRIPT,)),
    ("transformers-4.57", ("tf457",), _WRITER, ("transformers",)),
    *((name, (sub,), _WRITER, ("transformers",)) for name, sub in TRANSFORMERS_LAYERS),
    ("numpy-1.26.4", ("numpy-1.26.4",), _WRITER, ("numpy",)),
    ("bitsandbytes-0.50.2", ("bnb-0.50.2",), _BNB, ()),
    ("transformer-engine-2.20.2", ("te",), _TE, ()),
)


# What a resuming process has imported when it loads a checkpoint file: the source proof of a class (policy.py) holds
# only for a class whose module is one of these, since the unpickler imports the module of every global it names
# and an import runs that module's top level. Each script is a stack's resume path up to its load (the imports of a
# resume script, then one load through the stack's loader, so the loader's own lazy imports count) and prints
# ``sorted(sys.modules)`` as JSON. Layers and venvs as in ``STACKS``.
_RESUME_LOAD = """
import io, json, sys, warnings
warnings.simplefilter("ignore")
import torch
buf = io.BytesIO(); torch.save({"t": torch.zeros(2), "step": 1}, buf); buf.seek(0)
torch.load(buf, weights_only=False)
print(json.dumps({"modules": sorted(sys.modules)}))
"""
# transformers.Trainer resuming (trainer.py ``_load_from_checkpoint``, ``_load_optimizer_and_scheduler``,
# ``_load_rng_state``: torch.load of optimizer.pt, scheduler.pt, rng_state.pth), with peft, accelerate and numpy
# imported as a fine-tuning script does
_RESUME_TRAINER = """
import warnings; warnings.simplefilter("ignore")
import torch
from transformers import Trainer, TrainingArguments
import peft, accelerate, numpy
""" + _RESUME_LOAD
# a bare torch.distributed.checkpoint resume (torchtitan's checkpointer, accelerate's FSDP path): dcp.load reads
# .metadata (FileSystemReader.read_metadata) and the .distcp blobs (torch.load, weights_only=False)
_RESUME_DCP = """
import warnings; warnings.simplefilter("ignore")
import torch, numpy
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
""" + _RESUME_LOAD
# Lightning 2.6 resuming (``trainer.fit(model, ckpt_path=...)``: lightning/fabric/utilities/cloud_io.py ``_load``)
_RESUME_LIGHTNING = """
import warnings; warnings.simplefilter("ignore")
import torch, numpy
import lightning
from lightning.fabric.utilities.cloud_io import _load
""" + _RESUME_LOAD
# DeepSpeed resuming (deepspeed/runtime/engine.py ``load_checkpoint``), when its layer is installed
_RESUME_DEEPSPEED = """
import warnings; warnings.simplefilter("ignore")
import torch, numpy
import deepspeed
from deepspeed.runtime.engine import DeepSpeedEngine
""" + _RESUME_LOAD
RESUME_PATHS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("transformers-5 Trainer (this environment)", (), _RESUME_TRAINER),
    ("transformers-4.57 Trainer", ("tf4",), _RESUME_TRAINER),
    ("transformers-4.40 Trainer", ("tf440",), _RESUME_TRAINER),
    ("transformers-5 Trainer, numpy-1.26.4", ("np1",), _RESUME_TRAINER),
    ("torch.distributed.checkpoint (this environment)", (), _RESUME_DCP),
    ("lightning-2.6.6", ("lightning-layer",), _RESUME_LIGHTNING),
    ("deepspeed-0.19.8", ("deepspeed-0.19.8",), _RESUME_DEEPSPEED),
)
MODULES_OUT = ROOT / "ckptdoctor" / "pickle_verdict" / "resume_modules.json"


def _run_stack(layers: tuple[str, ...], stacks_dir: Path, script: str, argv: tuple[str, ...] = ()) -> Any:
    """Run ``script`` in the stack made of ``layers`` under ``stacks_dir`` (none: this environment); its last JSON
    line, or a string saying why there is none."""
    where = [stacks_dir / sub for sub in layers]
    if not all(w.is_dir() for w in where):
        return "not installed here"
    venv_python = where[0] / "bin" / "python" if len(where) == 1 else None
    python = str(venv_python) if venv_python is not None and venv_python.exists() else sys.executable
    env = dict(os.environ)
    if python == sys.executable and where:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [*map(str, where), env.get("PYTHONPATH", "")]))
    proc = subprocess.run([python, "-c", script, *argv], capture_output=True, text=True, env=env, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if proc.returncode == 0 and lines else f"failed: {proc.stderr[-300:]}"


def resume_modules(stacks_dir: Path) -> dict[str, Any]:
    """The modules every stack of ``RESUME_PATHS`` that runs here has imported when it loads a file (their
    intersection: a file may be loaded by any of them), and what each stack ran or why it did not."""
    common: set[str] | None = None
    covered: dict[str, Any] = {}
    for name, layers, script in RESUME_PATHS:
        got = _run_stack(layers, stacks_dir, script)
        if not isinstance(got, dict):
            covered[name] = got
            continue
        # the process's own entry points (``__main__``, multiprocessing's ``__mp_main__``, an editable install's
        # finder) are no module a pickle can name to any effect
        mods = {m for m in got["modules"] if not m.startswith("__") or m == "__future__"}
        covered[name] = f"{len(mods)} modules"
        common = mods if common is None else common & mods
    return {
        "about": "Modules a resuming process has imported when it loads a checkpoint file: what every resume path "
        "below imports (their intersection). Generated by `python bench/make_allowlist.py --modules`; do not edit "
        "by hand. The pickle policy vouches for a class by its source only when its module is one of these.",
        "stacks": covered,
        "modules": sorted(common or ()),
    }


def write_stacks(folder: Path, stacks_dir: Path) -> dict[str, Any]:
    """Run each stack of the matrix that is installed under ``stacks_dir``; returns what each covered."""
    return {
        name: _run_stack(layers, stacks_dir, script, (str(folder / name.split(" ")[0]), *argv))
        for name, layers, script, argv in STACKS
    }


def globals_in(folder: Path, called: set[str] | None = None) -> dict[str, set[str]]:
    """dotted global -> names of the files under ``folder`` that import it (read statically by ckptdoctor); the
    globals some file calls with arguments (anything but a NEWOBJ of no arguments and its BUILD: ``calls`` without
    ``rebuilt``) are added to ``called``."""
    out: dict[str, set[str]] = {}
    for root, _dirs, files in os.walk(folder):
        in_dcp = any(n.endswith((".distcp", ".metadata")) for n in files)
        for name in files:
            path = os.path.join(root, name)
            facts = read_file(path, name, os.stat(path), in_dcp_dir=in_dcp)
            content = facts.content
            pf = content if isinstance(content, PickleFacts) else getattr(content, "pickle", None)
            if not isinstance(pf, PickleFacts):
                continue
            for g in (*pf.globals, *pf.calls):
                out.setdefault(g.dotted, set()).add(name)
            if called is not None:
                called.update(g.dotted for g in pf.calls if g not in pf.rebuilt)
    return out


def write_torch_files(folder: Path) -> None:
    """Optimizers, schedulers, scaler, rng state and TrainingArguments exactly as the Trainer saves them."""
    import numpy as np
    import torch
    import transformers
    from torch import nn

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Linear(3, 2))
    optimizers: dict[str, Any] = {
        "sgd": torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        "adam": torch.optim.Adam(model.parameters(), lr=1e-3),
        "adamw": torch.optim.AdamW(model.parameters(), lr=1e-3),
        "adagrad": torch.optim.Adagrad(model.parameters()),
        "rmsprop": torch.optim.RMSprop(model.parameters()),
        "adafactor": transformers.Adafactor(model.parameters(), lr=1e-3, relative_step=False),
    }
    for name, opt in optimizers.items():
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        torch.save(opt.state_dict(), folder / f"optimizer-{name}.pt")
    opt = optimizers["adamw"]
    for kind in ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                 "inverse_sqrt", "reduce_lr_on_plateau", "cosine_with_min_lr", "warmup_stable_decay"):  # fmt: skip
        try:
            kwargs: dict[str, Any] = {"num_warmup_steps": 2, "num_training_steps": 10}
            if kind == "cosine_with_min_lr":
                kwargs["scheduler_specific_kwargs"] = {"min_lr": 1e-5}
            sched = transformers.get_scheduler(kind, opt, **kwargs)
        except (TypeError, ValueError):
            continue
        sched.step() if kind != "reduce_lr_on_plateau" else sched.step(1.0)
        torch.save(sched.state_dict(), folder / f"scheduler-{kind}.pt")
    torch.save(torch.optim.lr_scheduler.StepLR(opt, 3).state_dict(), folder / "scheduler-step.pt")
    torch.save(torch.amp.GradScaler("cpu").state_dict(), folder / "scaler.pt")
    # Trainer._save_rng_state (single process, CPU) and numpy arrays on their own.
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()},
               folder / "rng_state.pth")  # fmt: skip
    torch.save({"a": np.arange(3), "b": np.float32(1.5), "c": np.zeros((2, 2), dtype=np.float16)}, folder / "np.pt")
    args = [
        transformers.TrainingArguments(output_dir=str(folder / "o1")),
        transformers.TrainingArguments(output_dir=str(folder / "o2"), eval_strategy="steps", save_strategy="epoch",
                                       lr_scheduler_type="cosine", optim="adafactor", hub_strategy="checkpoint",
                                       report_to="none", logging_strategy="no", debug="underflow_overflow"),
        transformers.Seq2SeqTrainingArguments(output_dir=str(folder / "o3"), predict_with_generate=True),
    ]  # fmt: skip
    for i, a in enumerate(args):
        torch.save(a, folder / f"training_args-{i}.bin")


def write_dcp(folder: Path) -> None:
    """A real torch.distributed.checkpoint save (model and optimizer state)."""
    from tests.helpers import payloads

    payloads.save_dcp(folder / "dcp")


def write_peft_adapter(folder: Path) -> None:
    """A LoRA adapter saved as adapter_model.bin (safe_serialization=False)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from torch import nn

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj = nn.Linear(4, 4)
            self.v_proj = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.v_proj(self.q_proj(x))

    model = get_peft_model(Tiny(), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    model.save_pretrained(str(folder / "adapter"), safe_serialization=False)


def write_accelerate_state(folder: Path) -> None:
    """accelerate.Accelerator.save_state on CPU (optimizer.bin, scheduler.bin, random_states_0.pkl ...), without and
    with mixed precision (bf16, fp16: accelerate runs both on CPU). An FSDP plugin is not written here: on CPU
    accelerate falls back to MULTI_CPU and saves the same files."""
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from torch import nn

    for precision in ("no", "bf16", "fp16"):
        AcceleratorState._reset_state(reset_partial_state=True)
        acc = Accelerator(cpu=True, mixed_precision=precision)
        model = nn.Linear(4, 2)
        opt = torch.optim.AdamW(model.parameters())
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        model, opt, sched = acc.prepare(model, opt, sched)
        with acc.autocast():
            loss = model(torch.randn(2, 4)).float().sum()
        acc.backward(loss)
        opt.step()
        sched.step()
        name = "accelerate" if precision == "no" else f"accelerate-{precision}"
        acc.save_state(str(folder / name), safe_serialization=False)
    AcceleratorState._reset_state(reset_partial_state=True)


def run_trainer(folder: Path) -> None:
    """A real 2-step transformers.Trainer run saving checkpoint-1 and checkpoint-2."""
    import torch
    from torch import nn
    from transformers import Trainer, TrainingArguments

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            loss = ((self.lin(x).squeeze(-1) - labels) ** 2).mean()
            return {"loss": loss}

    data = [{"x": torch.randn(4), "labels": torch.tensor(0.5)} for _ in range(8)]
    args = TrainingArguments(output_dir=str(folder / "trainer"), max_steps=2, save_steps=1,
                             per_device_train_batch_size=4, report_to="none", use_cpu=True,
                             logging_steps=1)  # fmt: skip
    Trainer(model=Model(), args=args, train_dataset=data).train()


_DEEPSPEED = """
import os, sys, torch
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[4])
import deepspeed
deepspeed.init_distributed(dist_backend="gloo")
model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
cfg = {"train_batch_size": 2, "zero_optimization": {"stage": int(sys.argv[2])},
       "zero_allow_untested_optimizer": True, "bf16": {"enabled": sys.argv[3] == "bf16"},
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
       "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}}
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
for _ in range(2):
    x = torch.randn(2, 4, dtype=next(engine.module.parameters()).dtype)
    engine.backward(engine(x).float().sum())
    engine.step()
engine.save_checkpoint(sys.argv[1])
"""


def write_deepspeed(folder: Path, layer: Path | None = None) -> list[str]:
    """DeepSpeed ZeRO 1/2/3 (fp32 and bf16) checkpoints from single-process gloo engines; returns what ran. DeepSpeed
    comes from this environment or, when it is not installed here, from the matrix's ``layer``."""
    env = dict(os.environ)
    if importlib.util.find_spec("deepspeed") is None:
        if layer is None or not layer.is_dir():
            return []
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(layer), env.get("PYTHONPATH", "")]))
    script = folder / "ds_save.py"
    script.write_text(_DEEPSPEED)
    done = []
    for i, (stage, prec) in enumerate([(1, "fp32"), (2, "fp32"), (2, "bf16"), (3, "fp32"), (3, "bf16")]):
        out = folder / f"deepspeed-z{stage}-{prec}"
        proc = subprocess.run([sys.executable, str(script), str(out), str(stage), prec, str(29600 + i)],
                              capture_output=True, timeout=900, env=env)  # fmt: skip
        if proc.returncode == 0:
            done.append(out.name)
    return done


def introspected_classes(modules: Iterable[str], *, enums_only: bool = False) -> set[str]:
    """The classes ``modules`` define (numpy.dtypes: expose), or only their enum classes (members pickle as a call
    of their class with the value): data classes a loader rebuilds by name."""
    out: set[str] = set()
    for name in modules:
        try:
            mod = importlib.import_module(name)
        except Exception:
            continue
        for attr, obj in vars(mod).items():
            if not isinstance(obj, type) or attr.startswith("__"):
                continue
            if (obj.__module__ == name or name == "numpy.dtypes") and (not enums_only or issubclass(obj, enum.Enum)):
                out.add(f"{name}.{attr}")
    return out


# Called by real files and admitted only on a condition, never for any arguments: ``torch.storage._load_from_bytes``
# (TransformerEngine's ``_extra_state``, a plain ``pickle.dumps`` of a tensor) only where each call hands it literal
# bytes that were read as ``torch.load`` reads them and judged as a nested pickle (pickle_verdict/judge.py).
CONDITIONAL_CALLS = frozenset({BYTES_LOADER.dotted})


def unreviewed_calls(called: Iterable[str]) -> list[str]:
    """The globals of ``called`` (what real files call with arguments) that the policy does not admit for calls:
    neither reviewed (``REVIEWED_CALLS``, ``CALLED_ENUMS``) nor admitted on a condition (``CONDITIONAL_CALLS``)."""
    from ckptdoctor.pickle_verdict.policy import CALLED_ENUMS, REVIEWED_CALLS

    return sorted(g for g in called if g not in REVIEWED_CALLS and g not in CALLED_ENUMS and g not in CONDITIONAL_CALLS)


def versions() -> dict[str, str]:
    out = {}
    for name in ("torch", "transformers", "accelerate", "peft", "numpy", "deepspeed"):
        try:
            out[name] = importlib.import_module(name).__version__
        except Exception:
            out[name] = "not installed"
    return out


def build(
    work: Path, *, trainer: bool = True, deepspeed: bool = True, stacks_dir: Path | None = None
) -> dict[str, Any]:
    """Write every real file into ``work`` and return the allowlist document."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        write_torch_files(work / "torch")
        write_dcp(work)
        write_peft_adapter(work)
        write_accelerate_state(work)
        if trainer:
            run_trainer(work)
    has_ds = importlib.util.find_spec("deepspeed") is not None
    ds = write_deepspeed(work, stacks_dir / DEEPSPEED_LAYER if stacks_dir else None) if deepspeed else []
    stacks = write_stacks(work / "stacks", stacks_dir) if stacks_dir is not None else {}
    called: set[str] = set()
    found = globals_in(work, called)
    # What peft adds: the globals of every adapter_model.bin the matrix wrote (LoRA, DoRA, IA3, modules_to_save,
    # prompt tuning, under each peft release of the matrix).
    adapters = sorted({g for g, files in found.items() if "adapter_model.bin" in files})
    enums = introspected_classes(ENUM_MODULES, enums_only=True)
    classes = introspected_classes(CLASS_MODULES)
    return {
        "about": "Pickle globals that genuine checkpoint files import. Generated by bench/make_allowlist.py; "
        "do not edit by hand (hand-reviewed additions live in ckptdoctor/pickle_verdict/policy.py).",
        "versions": {**versions(), **({"deepspeed": f"layer {DEEPSPEED_LAYER}"} if ds and not has_ds else {})},
        "stacks": stacks,
        "deepspeed_runs": ds,
        "adapter_globals": adapters,
        "observed": {g: sorted(files)[:4] for g, files in sorted(found.items())},
        # what real files call with arguments: each must be reviewed in pickle_policy.REVIEWED_CALLS / CALLED_ENUMS
        "called": sorted(called),
        "enums": sorted(enums - set(found)),
        "classes": sorted(classes - set(found) - enums),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with the pinned file instead of writing it")
    ap.add_argument("--no-trainer", action="store_true")
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--stacks", type=Path, default=Path("/work/stacks"), help="where the matrix's stacks live")
    ap.add_argument("--modules", action="store_true",
                    help=f"only regenerate {MODULES_OUT.name} (what resuming processes have imported)")
    args = ap.parse_args()
    if args.modules:
        mods = resume_modules(args.stacks)
        MODULES_OUT.write_text(json.dumps(mods, indent=1) + "\n")
        print(f"wrote {MODULES_OUT}: {len(mods['modules'])} modules; stacks: {mods['stacks']}")
        return
    with tempfile.TemporaryDirectory() as tmp:
        doc = build(Path(tmp), trainer=not args.no_trainer, deepspeed=not args.no_deepspeed, stacks_dir=args.stacks)
    if args.check:
        pinned = json.loads(OUT.read_text())
        known = set(pinned["observed"]) | set(pinned["enums"]) | set(pinned.get("classes", ()))
        missing = sorted(set(doc["observed"]) - known)
        print("missing from the pinned allowlist:", missing or "none")
        unreviewed = unreviewed_calls(doc["called"])
        print("called by real files, not reviewed for calls:", unreviewed or "none")
        print("called by real files, admitted on a condition:", sorted(set(doc["called"]) & CONDITIONAL_CALLS))
        print("called:", doc["called"])
        ran = {k: v if isinstance(v, str) else v.get("versions") for k, v in doc["stacks"].items()}
        print("stacks:", json.dumps(ran))
        print("deepspeed runs:", doc["deepspeed_runs"] or "none")
        sys.exit(1 if missing or unreviewed else 0)
    OUT.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
    print(f"wrote {OUT}: {len(doc['observed'])} observed globals, {len(doc['enums'])} enum classes, "
          f"{len(doc['classes'])} data classes, DeepSpeed runs: {doc['deepspeed_runs'] or 'none'}, "
          f"stacks: {', '.join(doc['stacks'])}")  # fmt: skip


if __name__ == "__main__":
    main()

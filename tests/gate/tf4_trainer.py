"""Train or resume a tiny real Trainer of another transformers version, for tests that compare the gate with it.

Run as a script by the interpreter of that version (``CKPTDOCTOR_TF4_PYTHON``; tests/gate/test_gate_tf4.py), never
imported by the suite: ``python tests/gate/tf4_trainer.py JOBS.json RESULTS.json``
reads a list of jobs and writes the list of their results to RESULTS.json. A job is ``{"out": output_dir, "args":
{TrainingArguments overrides}, "lora": bool, "resume": null | true | "checkpoint path"}``; its result says what
``train()`` did: the checkpoint ``_load_from_checkpoint`` was given, the global_step at ``on_train_begin``, the LR
of every optimizer step, the files read while loading the weights (``torch.load``,
``safetensors.torch.load_file`` and peft's adapter loaders), for a LoRA model how many of its adapter parameters
that load changed from their fresh values (``adapter_restored``: [changed, total]), or the exception ``train()``
raised. A job with
``"check_resume": true`` first asks ckptdoctor's ``check_resume`` and adds its prediction under ``check_resume``;
one with ``"gate_callback": true`` trains with ckptdoctor's ``gate_callback`` and adds its result under
``gate_callback`` (the only uses of ckptdoctor here).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """16 fixed random sequences: 4 optimizer steps per epoch at batch size 4 (as tests/test_gate_transformers)."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 32, (8,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


class Recorder(TrainerCallback):
    def __init__(self, seen: dict[str, Any]) -> None:
        self.seen = seen

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.seen["start"] = state.global_step

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.seen["lrs"].append(kwargs["optimizer"].param_groups[0]["lr"])


def _recording(seen: dict[str, Any]) -> list[tuple[Any, str, Any]]:
    """Wrap every loader the weights load can call so that the names of the files it reads are noted."""
    import safetensors.torch

    patches: list[tuple[Any, str, Any]] = [(safetensors.torch, "load_file", safetensors.torch.load_file),
                                           (torch, "load", torch.load)]
    try:
        import peft.utils.save_and_load as peft_io

        patches += [(peft_io, "safe_load_file", peft_io.safe_load_file), (peft_io, "torch_load", peft_io.torch_load)]
    except ImportError:
        pass

    def wrap(fn: Any) -> Any:
        def loader(f: Any, *args: Any, **kwargs: Any) -> Any:
            name = os.path.basename(os.fspath(f)) if isinstance(f, (str, os.PathLike)) else None
            if name is not None and name not in seen["weights_files"]:  # peft's torch_load calls torch.load
                seen["weights_files"].append(name)
            return fn(f, *args, **kwargs)

        return loader

    for owner, name, fn in patches:
        setattr(owner, name, wrap(fn))
    return patches


class RecordingTrainer(Trainer):
    seen: dict[str, Any]

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        self.seen["loaded"] = resume_from_checkpoint
        patches = _recording(self.seen)
        target = model if model is not None else self.model
        before = {n: p.detach().clone() for n, p in target.named_parameters() if ".lora_" in n}
        try:
            super()._load_from_checkpoint(resume_from_checkpoint, model)
        finally:
            for owner, name, fn in patches:
                setattr(owner, name, fn)
        if before:  # the adapter parameters the load changed from their fresh values: the ones it restored
            after = dict(target.named_parameters())
            changed = sum(not torch.equal(before[n], after[n].detach()) for n in before)
            self.seen["adapter_restored"] = [changed, len(before)]


def run(job: dict[str, Any]) -> dict[str, Any]:
    seen: dict[str, Any] = {"version": transformers.__version__, "loaded": None, "start": None, "lrs": [],
                            "weights_files": [], "raised": None}
    torch.manual_seed(0)
    model: Any = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=16, n_embd=8, n_layer=2, n_head=2))
    if job.get("lora"):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"], fan_in_fan_out=True,
                                                 task_type="CAUSAL_LM"))
    out = job["out"]
    kwargs: dict[str, Any] = {
        "output_dir": out, "per_device_train_batch_size": 4, "num_train_epochs": 2, "learning_rate": 1e-3,
        "save_strategy": "steps", "save_steps": 2, "logging_steps": 1, "report_to": [], "use_cpu": True,
        "disable_tqdm": True, "seed": 0, "dataloader_num_workers": 0,
        # 4.x's default logging_dir is runs/<date>_<host name>: it would write the host name into training_args.bin
        "logging_dir": os.path.join(out, "logs"),
    }
    kwargs.update(job.get("args") or {})
    callbacks: list[Any] = [Recorder(seen)]
    if job.get("gate_callback"):  # ckptdoctor's gate callback, judging in on_train_begin
        from ckptdoctor.integrations.transformers import gate_callback

        callbacks.append(gate_callback(job["resume"], lr_steps=1000))
    trainer = RecordingTrainer(model=model, args=TrainingArguments(**kwargs), train_dataset=Tokens(),
                               callbacks=callbacks)
    trainer.seen = seen
    if job.get("check_resume"):
        seen["check_resume"] = ask_check_resume(trainer, job["resume"])
    try:
        trainer.train(resume_from_checkpoint=job.get("resume"))
    except Exception as exc:  # the resume's own failure is a result to compare with the gate's prediction
        seen["raised"] = {"type": type(exc).__name__, "message": str(exc)}
    if job.get("gate_callback"):
        result = callbacks[-1].result
        seen["gate_callback"] = None if result is None else summary(result)
    return seen


def ask_check_resume(trainer: Trainer, resume: str) -> dict[str, Any]:
    """What ckptdoctor's ``check_resume`` predicts for ``trainer.train(resume_from_checkpoint=resume)``."""
    from ckptdoctor.integrations.transformers import ResumeGateError, check_resume

    try:
        result = check_resume(trainer, resume, lr_steps=1000)
    except ResumeGateError as exc:
        result = exc.result
    return summary(result)


def summary(result: Any) -> dict[str, Any]:
    """A gate result as JSON: what the tests compare with the resume."""
    s = result.settings
    return {"start": result.start_step, "steps_to_train": result.steps_to_train, "lrs": list(result.lr),
            "verdict": result.verdict, "weights_file": result.weights_file,
            "steps_per_epoch": None if s is None else s.steps_per_epoch,
            "adapter_tensors": result.adapter_tensors, "rules": sorted({f.rule for f in
            result.findings}), "version": None if s is None else [s.transformers_version,
                                                                   s.sources["transformers_version"]]}


def main() -> None:
    with open(sys.argv[1]) as fh:
        jobs = json.load(fh)
    results = [run(job) for job in jobs]
    with open(sys.argv[2], "w") as fh:  # not stdout: the Trainer prints its logs there
        json.dump(results, fh)


if __name__ == "__main__":
    main()

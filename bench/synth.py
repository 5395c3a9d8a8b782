"""Generate realistic, huge-looking checkpoint trees that cost almost no disk: real headers, sparse data regions.

Run by hand (needs torch; never imported by ckptdoctor):

    python bench/synth.py OUT --model llama-7b --checkpoints 100
    python bench/synth.py OUT --model llama-70b --checkpoints 1 --runs 1
    python bench/synth.py OUT --model tiny --checkpoints 3 --runs 1000 --settings-per-run   # a settings file a run
    python bench/synth.py --verify            # byte-compare the writers with safetensors/torch.save (tiny model)

How the files stay real:

* ``model-0000i-of-0000n.safetensors``: the header is written exactly as safetensors 0.8 writes it (tensors
  sorted by dtype then name, compact JSON with ``__metadata__`` first, padded with spaces to 8 bytes), then the
  file is extended to its full size with ``truncate``: the data region is a sparse hole (reads as zeros, costs no
  blocks). ``--verify`` checks the header bytes are identical to ``safetensors.torch.save_file`` of real tensors.
* ``optimizer.pt``: the AdamW ``state_dict()`` pickle is produced by a pickler that mirrors ``torch.save``'s
  (``persistent_id`` gives ``("storage", torch.FloatStorage, key, "cpu", numel)``; tensors reduce to
  ``torch._utils._rebuild_tensor_v2``), and the archive by a writer that mirrors torch's (stored records, 64-byte
  alignment through ``FB`` padding, data descriptors, zip64 end records). Small storages (``step``) carry real
  bytes; the ``exp_avg``/``exp_avg_sq`` records are holes. ``--verify`` checks ``data.pkl`` and the record layout
  are byte-identical to ``torch.save`` of the same state, and ``torch.load(mmap=True, weights_only=True)``
  accepts the sparse files.
* ``scheduler.pt``, ``rng_state.pth``, ``training_args.bin``: written by ``torch.save`` itself (they are small).
* ``trainer_state.json``: ``json.dumps(indent=2, sort_keys=True)`` with a log_history entry every
  ``--logging-steps`` and an eval entry every save, as the Trainer writes it.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import random
import struct
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# ---------------------------------------------------------------------------------------------------------------
# Model shapes (Llama architecture, as in the Hugging Face configs of the named models)


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int


MODELS = {
    "tiny": ModelShape(64, 172, 2, 4, 2, 1000),  # smoke tests only
    "llama-1b": ModelShape(2048, 5632, 22, 32, 4, 32000),  # TinyLlama-1.1B
    "llama-7b": ModelShape(4096, 11008, 32, 32, 32, 32000),  # Llama-2-7b
    "llama-70b": ModelShape(8192, 28672, 80, 64, 8, 32000),  # Llama-2-70b
}


def param_shapes(m: ModelShape) -> list[tuple[str, tuple[int, ...]]]:
    """``LlamaForCausalLM.named_parameters()`` order and shapes."""
    kv = m.hidden // m.heads * m.kv_heads
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (m.vocab, m.hidden))]
    for i in range(m.layers):
        p = f"model.layers.{i}"
        out += [
            (f"{p}.self_attn.q_proj.weight", (m.hidden, m.hidden)),
            (f"{p}.self_attn.k_proj.weight", (kv, m.hidden)),
            (f"{p}.self_attn.v_proj.weight", (kv, m.hidden)),
            (f"{p}.self_attn.o_proj.weight", (m.hidden, m.hidden)),
            (f"{p}.mlp.gate_proj.weight", (m.intermediate, m.hidden)),
            (f"{p}.mlp.up_proj.weight", (m.intermediate, m.hidden)),
            (f"{p}.mlp.down_proj.weight", (m.hidden, m.intermediate)),
            (f"{p}.input_layernorm.weight", (m.hidden,)),
            (f"{p}.post_attention_layernorm.weight", (m.hidden,)),
        ]
    out += [("model.norm.weight", (m.hidden,)), ("lm_head.weight", (m.vocab, m.hidden))]
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ---------------------------------------------------------------------------------------------------------------
# safetensors


_ST_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4}
# safetensors' Dtype enum order (tensor.rs); the writer sorts by it, largest first.
_ST_ORDER = {"BF16": 9, "F16": 8, "F32": 10}


def safetensors_header(tensors: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str]) -> tuple[bytes, int]:
    """The exact bytes safetensors writes before the data (length prefix + padded JSON), and the data size."""
    ordered = sorted(tensors, key=lambda t: (-_ST_ORDER[t[1]], t[0]))
    parts = ['"__metadata__":' + json.dumps(metadata, separators=(",", ":"))] if metadata else []
    at = 0
    for name, dtype, shape in ordered:
        n = _numel(shape) * _ST_ITEMSIZE[dtype]
        entry = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + n]}
        parts.append(json.dumps(name) + ":" + json.dumps(entry, separators=(",", ":")))
        at += n
    header = ("{" + ",".join(parts) + "}").encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header, at


def write_sparse_safetensors(path: Path, tensors: list[tuple[str, str, tuple[int, ...]]]) -> int:
    head, data = safetensors_header(tensors, {"format": "pt"})
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(len(head) + data)  # the data region is a hole
    return len(head) + data


def write_weights(folder: Path, m: ModelShape, max_shard: int) -> None:
    """Shards split like ``huggingface_hub.split_torch_state_dict_into_shards`` plus the index."""
    shards: list[list[tuple[str, str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in param_shapes(m):
        n = _numel(shape) * 2
        if shards[-1] and size + n > max_shard:
            shards.append([])
            size = 0
        shards[-1].append((name, "BF16", shape))
        size += n
    if len(shards) == 1:
        write_sparse_safetensors(folder / "model.safetensors", shards[0])
        return
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        write_sparse_safetensors(folder / fname, shard)
        for name, _, shape in shard:
            weight_map[name] = fname
            total += _numel(shape) * 2
    params = sum(_numel(s) for _, s in param_shapes(m))
    index = {"metadata": {"total_parameters": params, "total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


# ---------------------------------------------------------------------------------------------------------------
# torch.save, mirrored for tensors whose bytes are holes


_STORAGE = {"F32": (torch.FloatStorage, 4), "BF16": (torch.BFloat16Storage, 2)}


class FakeTensor:
    """A contiguous CPU tensor as torch pickles it; ``data`` None means its bytes are a hole (zeros)."""

    def __init__(self, dtype: str, shape: tuple[int, ...], data: bytes | None = None) -> None:
        self.dtype, self.shape, self.data = dtype, shape, data
        self.storage = _FakeStorage(self)

    def __reduce_ex__(self, protocol: Any) -> Any:
        stride = tuple(_numel(self.shape[i + 1 :]) for i in range(len(self.shape)))
        # Fresh tuples each time, as ``tuple(t.size())`` is in torch: pickle memoizes shared objects.
        shape = tuple(list(self.shape))
        return torch._utils._rebuild_tensor_v2, (self.storage, 0, shape, stride, False, OrderedDict())


class _FakeStorage:
    def __init__(self, t: FakeTensor) -> None:
        self.tensor = t


class _Pickler(pickle.Pickler):
    """``torch.serialization._save``'s pickler: storages become persistent ids, keyed in first-seen order."""

    def __init__(self, buf: io.BytesIO) -> None:
        super().__init__(buf, protocol=2)
        self.keys: dict[int, str] = {}
        self.records: list[tuple[str, FakeTensor]] = []

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, _FakeStorage):
            return None
        key = self.keys.get(id(obj))
        if key is None:
            key = self.keys[id(obj)] = str(len(self.keys))
            self.records.append((key, obj.tensor))
        stype, _ = _STORAGE[obj.tensor.dtype]
        return ("storage", stype, key, "cpu", _numel(obj.tensor.shape))


_CRC_OF_ZEROS: dict[int, int] = {}
_ZEROS = bytes(1 << 24)


def _crc_zeros(n: int) -> int:
    if n not in _CRC_OF_ZEROS:
        crc, left = 0, n
        while left:
            k = min(left, len(_ZEROS))
            crc = zlib.crc32(_ZEROS[:k] if k < len(_ZEROS) else _ZEROS, crc)
            left -= k
        _CRC_OF_ZEROS[n] = crc
    return _CRC_OF_ZEROS[n]


def write_torch_zip(path: Path, obj: Any, serialization_id: str) -> None:
    """An archive laid out like torch.save's (``caffe2/serialize/inline_container.cc`` over miniz)."""
    buf = io.BytesIO()
    p = _Pickler(buf)
    p.dump(obj)
    prefix = path.stem
    records: list[tuple[str, bytes | None, int]] = [
        ("data.pkl", buf.getvalue(), len(buf.getvalue())),
        (".format_version", b"1", 1),
        (".storage_alignment", b"64", 2),
        ("byteorder", b"little", 6),
    ]
    for key, t in p.records:
        n = _numel(t.shape) * _STORAGE[t.dtype][1]
        records.append((f"data/{key}", t.data, n))
    records += [("version", b"3\n", 2), (".data/serialization_id", serialization_id.encode(), 40)]
    central: list[bytes] = []
    with open(path, "wb") as f:
        for name, data, size in records:
            full = f"{prefix}/{name}".encode()
            at = f.tell()
            start = at + 30 + len(full) + 4
            pad = -start % 64
            extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
            if size >= 0xFFFFFFFF:
                raise ValueError("records of 4 GiB or more are not mirrored")
            f.write(struct.pack("<IHHHHHIIIHH", 0x04034B50, 0, 0x0808, 0, 0, 0, 0, 0, 0, len(full), len(extra)))
            f.write(full + extra)
            if data is None:
                f.seek(size, os.SEEK_CUR)
                crc = _crc_zeros(size)
            else:
                f.write(data)
                crc = zlib.crc32(data)
            f.write(struct.pack("<IIII", 0x08074B50, crc, size, size))
            z64 = at >= 0xFFFFFFFF
            cextra = struct.pack("<HHQ", 1, 8, at) if z64 else b""
            central.append(
                struct.pack(
                    "<IHHHHHHIIIHHHHHII",
                    0x02014B50,
                    0,
                    0,
                    0x0808,
                    0,
                    0,
                    0,
                    crc,
                    size,
                    size,
                    len(full),
                    len(cextra),
                    0,
                    0,
                    0,
                    0,
                    0xFFFFFFFF if z64 else at,
                )
                + full
                + cextra
            )
        cd_at = f.tell()
        cd = b"".join(central)
        f.write(cd)
        eocd64_at = f.tell()
        n = len(records)
        f.write(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 0x031E, 45, 0, 0, n, n, len(cd), cd_at))
        f.write(struct.pack("<IIQI", 0x07064B50, 0, eocd64_at, 1))
        f.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, n, n, len(cd), min(cd_at, 0xFFFFFFFF), 0))


def optimizer_state(m: ModelShape, step: int, lr: float, sparse: bool = True) -> dict[str, Any]:
    """AdamW ``state_dict()`` with the Trainer's two groups (decay / no decay), as torch 2.13 writes it."""
    params = param_shapes(m)
    decay = [i for i, (n, s) in enumerate(params) if len(s) > 1]
    nodecay = [i for i, (n, s) in enumerate(params) if len(s) == 1]
    state: dict[int, dict[str, Any]] = {}
    for i in decay + nodecay:
        shape = params[i][1]
        state[i] = {
            "step": FakeTensor("F32", (), struct.pack("<f", float(step))),
            "exp_avg": FakeTensor("F32", shape, None if sparse else bytes(_numel(shape) * 4)),
            "exp_avg_sq": FakeTensor("F32", shape, None if sparse else bytes(_numel(shape) * 4)),
        }
    group = {
        "lr": lr,
        "betas": (0.9, 0.999),
        "eps": 1e-08,
        "amsgrad": False,
        "maximize": False,
        "foreach": None,
        "capturable": False,
        "differentiable": False,
        "fused": None,
        "decoupled_weight_decay": True,
    }
    groups = [
        {"weight_decay": 0.0, **group, "initial_lr": 2e-05, "params": decay},
        {"weight_decay": 0.0, **group, "initial_lr": 2e-05, "params": nodecay},
    ]
    return {"state": state, "param_groups": groups}


# ---------------------------------------------------------------------------------------------------------------
# Small files written by torch / json themselves


def _saved(obj: Any, stem: str) -> bytes:
    """``torch.save`` to a path named like the real file: the archive's top folder is the file's stem."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / f"{stem}.bin"
        torch.save(obj, path)
        return path.read_bytes()


def scheduler_bytes(step: int, total: int) -> bytes:
    p = [torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))]
    opt = torch.optim.AdamW([{"params": p[:1]}, {"params": p[1:]}], lr=2e-5)
    import functools

    def linear(s: int, total: int) -> float:
        return max(0.0, (total - s) / total)

    sched = torch.optim.lr_scheduler.LambdaLR(opt, [functools.partial(linear, total=total)] * 2)
    sd = sched.state_dict()
    sd["last_epoch"], sd["_step_count"] = step, step + 1
    sd["_last_lr"] = [2e-5 * linear(step, total)] * 2
    return _saved(sd, "scheduler")


def rng_bytes(seed: int) -> bytes:
    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return _saved(
        {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state()}, "rng_state"
    )


def _grad_norm(step: int) -> float:
    """A grad_norm that depends on the logged step only: like a real run, each checkpoint's log_history repeats
    the previous checkpoint's entries exactly (a per-checkpoint random sequence would make every history diverge)."""
    return 0.2 + 1.8 * ((step * 2654435761) % 1000) / 1000


def trainer_state(step: int, max_steps: int, logging_steps: int, save_steps: int) -> str:
    history: list[dict[str, Any]] = []
    for s in range(logging_steps, step + 1, logging_steps):
        history.append(
            {
                "epoch": round(s / max_steps * 3, 4),
                "grad_norm": _grad_norm(s),
                "learning_rate": 2e-5 * (max_steps - s) / max_steps,
                "loss": 2.5 - s / max_steps,
                "step": s,
            }
        )
        if s % save_steps == 0:
            history.append(
                {
                    "epoch": round(s / max_steps * 3, 4),
                    "eval_loss": 2.4 - s / max_steps,
                    "eval_runtime": 12.3,
                    "eval_samples_per_second": 81.2,
                    "eval_steps_per_second": 10.1,
                    "step": s,
                }
            )
    state = {
        "best_global_step": None,
        "best_metric": None,
        "best_model_checkpoint": None,
        "epoch": round(step / max_steps * 3, 4),
        "eval_steps": save_steps,
        "global_step": step,
        "is_hyper_param_search": False,
        "is_local_process_zero": True,
        "is_world_process_zero": True,
        "log_history": history,
        "logging_steps": logging_steps,
        "max_steps": max_steps,
        "num_input_tokens_seen": 0,
        "num_train_epochs": 3,
        "save_steps": save_steps,
        "stateful_callbacks": {
            "TrainerControl": {
                "args": {
                    "should_epoch_stop": False,
                    "should_evaluate": False,
                    "should_log": False,
                    "should_save": True,
                    "should_training_stop": False,
                },
                "attributes": {},
            }
        },
        "total_flos": 1.0e18 * step,
        "train_batch_size": 8,
        "trial_name": None,
        "trial_params": None,
    }
    return json.dumps(state, indent=2, sort_keys=True) + "\n"


def config_json(m: ModelShape) -> str:
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": m.hidden,
        "intermediate_size": m.intermediate,
        "num_hidden_layers": m.layers,
        "num_attention_heads": m.heads,
        "num_key_value_heads": m.kv_heads,
        "vocab_size": m.vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-05,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }
    return json.dumps(cfg, indent=2, sort_keys=True) + "\n"


# ---------------------------------------------------------------------------------------------------------------
# Trees


def make_checkpoint(
    folder: Path, m: ModelShape, step: int, max_steps: int, args: argparse.Namespace, training_args: bytes
) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    write_weights(folder, m, args.max_shard_gb * 10**9)
    (folder / "config.json").write_text(config_json(m))
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}, indent=2))
    (folder / "training_args.bin").write_bytes(training_args)
    (folder / "trainer_state.json").write_text(trainer_state(step, max_steps, args.logging_steps, args.save_steps))
    if args.weights_only:
        return
    sid = "".join(random.Random(step).choice("0123456789") for _ in range(40))
    write_torch_zip(folder / "optimizer.pt", optimizer_state(m, step, 2e-5 * (max_steps - step) / max_steps), sid)
    (folder / "scheduler.pt").write_bytes(scheduler_bytes(step, max_steps))
    (folder / "rng_state.pth").write_bytes(rng_bytes(step))


def training_args_bytes() -> bytes:
    try:
        from transformers import TrainingArguments
    except ImportError:  # pragma: no cover - bench without transformers
        return _saved({"output_dir": "out", "learning_rate": 2e-5}, "training_args")
    return _saved(
        TrainingArguments(output_dir="out", learning_rate=2e-5, logging_steps=10, save_steps=500), "training_args"
    )


def generate(out: Path, args: argparse.Namespace) -> None:
    m = MODELS[args.model]
    targs = training_args_bytes()
    for r in range(args.runs):
        run = out / f"run-{r:03d}" if args.runs > 1 else out
        max_steps = args.checkpoints * args.save_steps
        for k in range(1, args.checkpoints + 1):
            step = k * args.save_steps
            make_checkpoint(run / f"checkpoint-{step}", m, step, max_steps, args, targs)
        if getattr(args, "settings_per_run", False):  # a settings file in each run
            (run / ".ckptdoctor.toml").write_text('ignore = ["CKD401"]\n')


# ---------------------------------------------------------------------------------------------------------------
# Verification against the real writers


def verify(tmp: Path) -> None:
    """Byte-compare the mirrored writers with safetensors and torch.save (tiny model), then load a sparse file."""
    from safetensors.torch import save_file

    m = MODELS["tiny"]
    shapes = param_shapes(m)
    real = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes}
    save_file(real, str(tmp / "real.safetensors"), metadata={"format": "pt"})
    write_sparse_safetensors(tmp / "ours.safetensors", [(n, "BF16", s) for n, s in shapes])
    assert (tmp / "real.safetensors").read_bytes() == (tmp / "ours.safetensors").read_bytes(), "safetensors differ"

    state = optimizer_state(m, 7, 1e-5, sparse=False)
    torch_state = {
        "state": {i: {k: _real(v) for k, v in s.items()} for i, s in state["state"].items()},
        "param_groups": state["param_groups"],
    }
    torch.save(torch_state, tmp / "optimizer.pt")
    real_bytes = (tmp / "optimizer.pt").read_bytes()
    import zipfile

    real_zip = zipfile.ZipFile(tmp / "optimizer.pt")
    sid = real_zip.read("optimizer/.data/serialization_id").decode()
    write_torch_zip(tmp / "optimizer-ours.pt", state, sid)
    ours_zip = zipfile.ZipFile(io.BytesIO((tmp / "optimizer-ours.pt").read_bytes()))
    names_real = [i.filename.split("/", 1)[1] for i in real_zip.infolist()]
    names_ours = [i.filename.split("/", 1)[1] for i in ours_zip.infolist()]
    assert names_real == names_ours, (names_real, names_ours)
    for a, b in zip(real_zip.infolist(), ours_zip.infolist(), strict=True):
        assert real_zip.read(a) == ours_zip.read(b), a.filename
        assert (a.CRC, a.file_size, a.compress_type) == (b.CRC, b.file_size, b.compress_type)
    # Same stem gives the same bytes, alignment padding included.
    (tmp / "x").mkdir(exist_ok=True)
    write_torch_zip(tmp / "x" / "optimizer.pt", state, sid)
    assert (tmp / "x" / "optimizer.pt").read_bytes() == real_bytes, "optimizer.pt layout differs from torch.save"
    # A sparse 7B-shaped optimizer loads with torch.load(mmap=True, weights_only=True).
    big = MODELS["llama-1b"]
    write_torch_zip(tmp / "big.pt", optimizer_state(big, 5, 1e-5), sid)
    loaded = torch.load(tmp / "big.pt", mmap=True, weights_only=True)
    assert loaded["state"][0]["exp_avg"].shape == (big.vocab, big.hidden)
    print("verify: safetensors header, optimizer.pt bytes and a sparse torch.load(mmap=True) all match")


def _real(t: FakeTensor) -> torch.Tensor:
    dt = {"F32": torch.float32, "BF16": torch.bfloat16}[t.dtype]
    assert t.data is not None
    return torch.frombuffer(bytearray(t.data), dtype=dt).reshape(t.shape).clone()


def write_real_data(out: Path, gigabytes: float) -> None:
    """Safetensors files of random BF16 and F32 tensors (real bytes, for ``--deep`` throughput on cached files)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    per_file = 256 * 2**20
    for i in range(max(1, int(gigabytes * 1e9 // per_file))):
        dtype = torch.bfloat16 if i % 2 == 0 else torch.float32
        rows = per_file // (4096 * (2 if dtype == torch.bfloat16 else 4))
        tensors = {f"layers.{i}.{k}.weight": torch.randn(rows // 4, 4096).to(dtype) for k in ("q", "k", "v", "o")}
        save_file(tensors, str(out / f"model-{i:05d}.safetensors"), metadata={"format": "pt"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("out", nargs="?", type=Path)
    ap.add_argument("--model", choices=sorted(MODELS), default="llama-7b")
    ap.add_argument("--checkpoints", type=int, default=10, help="checkpoints per run")
    ap.add_argument("--runs", type=int, default=1, help="runs (each in run-NNN/ when more than one)")
    ap.add_argument("--save-steps", type=int, default=500)
    ap.add_argument("--logging-steps", type=int, default=10)
    ap.add_argument("--max-shard-gb", type=float, default=5.0, help="transformers 4.x default: 5GB")
    ap.add_argument("--weights-only", action="store_true", help="save_only_model: no optimizer/scheduler/rng")
    ap.add_argument("--verify", action="store_true")
    ap.add_argument("--real-data-gb", type=float, help="write real random tensors instead (for --deep throughput)")
    ap.add_argument("--settings-per-run", action="store_true", help="a .ckptdoctor.toml in every run folder")
    args = ap.parse_args()
    if args.verify:
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            verify(Path(d))
        return
    if args.out is None:
        ap.error("OUT is required")
    if args.real_data_gb:
        write_real_data(args.out, args.real_data_gb)
        return
    generate(args.out, args)


if __name__ == "__main__":
    main()

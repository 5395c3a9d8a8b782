"""No false alarm on the folders real stacks write beside or instead of the Trainer's own (issue 23, section 1).

Each case is a folder written by the real library, tiny configs, synthetic tokens, CPU, nothing downloaded:

- a T5 model trained by the real ``Seq2SeqTrainer`` whose tokenizer (built locally with the ``tokenizers`` library)
  carries a chat template: transformers 5 writes ``chat_template.jinja`` beside every such tokenizer, and T5's
  weights number blocks (``block.N``) and their sub-layers (``block.N.layer.M``);
- LLaMA-Factory's ``trainer_log.jsonl`` (JSON Lines) at the run root, written by its own ``LogCallback``;
- accelerate 1.15 ``Accelerator.save_state`` folders: ``checkpoint-N`` by hand (the diffusers training scripts'
  layout) and ``ProjectConfiguration(automatic_checkpoint_naming=True)``'s ``checkpoints/checkpoint_N``. They hold
  no ``trainer_state.json`` by design and are no Trainer's interrupted saves.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.paths import TESTS

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
accelerate = pytest.importorskip("accelerate")

from ckptdoctor.findings import Finding, Severity  # noqa: E402
from ckptdoctor.scanner import scan  # noqa: E402

VOCAB = 64
DATA = TESTS / "data" / "stacks"
CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


def _alarms(root: Path) -> list[Finding]:
    """Every finding above info, plus any info other than CKD401 (a finished schedule is expected)."""
    return [f for f in scan(str(root)).findings if f.severity > Severity.INFO or f.rule != "CKD401"]


def _tokenizer() -> Any:
    """A word-level tokenizer built here (no download), wrapped by transformers, with a chat template."""
    words = {f"w{i}": i for i in range(VOCAB - 3)} | {"<pad>": VOCAB - 3, "</s>": VOCAB - 2, "<unk>": VOCAB - 1}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                                unk_token="<unk>", chat_template=CHAT_TEMPLATE)


class Pairs(torch.utils.data.Dataset):  # type: ignore[misc]
    """Random source/target token pairs for a sequence-to-sequence model."""

    def __init__(self, n: int = 8, seq: int = 6) -> None:
        gen = torch.Generator().manual_seed(0)
        self.src = torch.randint(0, VOCAB - 3, (n, seq), generator=gen)
        self.tgt = torch.randint(0, VOCAB - 3, (n, seq), generator=gen)

    def __len__(self) -> int:
        return int(self.src.shape[0])

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.src[i], "labels": self.tgt[i]}


@pytest.fixture(scope="module")
def t5_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real Seq2SeqTrainer run of a 2-block T5 (4 steps, saves at 2 and 4) with a chat-template tokenizer."""
    out = tmp_path_factory.mktemp("t5") / "run"
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
                                decoder_start_token_id=VOCAB - 3, pad_token_id=VOCAB - 3, eos_token_id=VOCAB - 2)
    args = transformers.Seq2SeqTrainingArguments(
        output_dir=str(out), max_steps=4, save_steps=2, logging_steps=1, per_device_train_batch_size=4,
        learning_rate=1e-3, use_cpu=True, report_to="none", disable_tqdm=True, seed=0)
    trainer = transformers.Seq2SeqTrainer(model=transformers.T5ForConditionalGeneration(cfg), args=args,
                                          train_dataset=Pairs(), processing_class=_tokenizer())
    trainer.train()
    return out


def test_t5_seq2seq_run_with_chat_template_is_clean(t5_run: Path) -> None:
    ck = t5_run / "checkpoint-4"
    assert (ck / "chat_template.jinja").read_text() == CHAT_TEMPLATE  # what transformers 5 writes
    cfg = json.loads((ck / "config.json").read_text())
    assert cfg["num_layers"] == 2 and cfg["is_encoder_decoder"] is True
    assert _alarms(t5_run) == []


def test_t5_layer_count_still_checked(t5_run: Path, tmp_path: Path) -> None:
    """CKD208 still fires when the decoder's count disagrees with the decoder's blocks."""
    ck = tmp_path / "checkpoint-4"
    shutil.copytree(t5_run / "checkpoint-4", ck)
    cfg = json.loads((ck / "config.json").read_text())
    cfg["num_decoder_layers"] = 3
    (ck / "config.json").write_text(json.dumps(cfg))
    hits = [f for f in scan(str(ck)).findings if f.rule == "CKD208"]
    assert [f.message for f in hits] == ["num_decoder_layers 3 but the decoder weights hold 2 layers"]


def test_json_lines_log_is_not_a_json_document(t5_run: Path, tmp_path: Path) -> None:
    """LLaMA-Factory's ``trainer_log.jsonl`` at the run root: one JSON document per line, as its ``LogCallback``
    (src/llamafactory/train/callbacks.py ``LogCallback._write_log``) appends them. The file was written by that
    callback in a real Trainer run (tests/data/stacks/make_llamafactory_log.py)."""
    run = tmp_path / "run"
    shutil.copytree(t5_run, run)
    shutil.copy(DATA / "llamafactory-0.9.5" / "trainer_log.jsonl", run)
    assert len((run / "trainer_log.jsonl").read_text().splitlines()) == 5
    assert _alarms(run) == []


@pytest.fixture(scope="module")
def accelerate_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Real ``Accelerator.save_state`` folders: ``diffusers/checkpoint-2`` and ``-4`` saved by hand (the layout of
    diffusers' training scripts), and ``project/checkpoints/checkpoint_0`` and ``_1`` by automatic naming."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    root = tmp_path_factory.mktemp("accelerate")

    def train(acc: Any) -> None:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
        model, opt, sched = acc.prepare(model, opt, sched)
        for _ in range(2):
            acc.backward(model(torch.randn(3, 4)).sum())
            opt.step()
            sched.step()
            opt.zero_grad()

    by_hand = Accelerator(cpu=True)
    train(by_hand)
    for step in (2, 4):
        by_hand.save_state(str(root / "diffusers" / f"checkpoint-{step}"))
    project = ProjectConfiguration(project_dir=str(root / "project"), automatic_checkpoint_naming=True, total_limit=3)
    automatic = Accelerator(cpu=True, project_config=project)
    train(automatic)
    automatic.save_state()
    automatic.save_state()
    return root


def test_accelerate_save_state_folders_are_no_interrupted_saves(accelerate_runs: Path) -> None:
    held = sorted(p.name for p in (accelerate_runs / "diffusers" / "checkpoint-4").iterdir())
    assert held == ["model.safetensors", "optimizer.bin", "random_states_0.pkl", "scheduler.bin"]
    assert sorted(p.name for p in (accelerate_runs / "project" / "checkpoints").iterdir()) == [
        "checkpoint_0", "checkpoint_1"]
    report = scan(str(accelerate_runs))
    assert report.findings == ()
    runs = {r.path: r for t in report.trees for r in t.runs}
    assert set(runs) == {"diffusers", "project/checkpoints"}
    assert {r.stack.value for r in runs.values()} == {"accelerate"}
    # the Trainer's pick stays a fact (the gate predicts a Trainer resume); the header says accelerate's
    assert runs["diffusers"].resume_pick == "diffusers/checkpoint-4"
    assert runs["project/checkpoints"].resume_pick is None
    from ckptdoctor.render.report import render_text

    text = render_text(report, color=False)
    assert "(accelerate `save_state` folders; `load_state(folder)` loads the folder named)" in text
    assert "(accelerate; `load_state()` loads `checkpoint_1`)" in text


def test_accelerate_fix_quarantines_nothing(accelerate_runs: Path, tmp_path: Path) -> None:
    """``fix`` (safe fixes only, as labelled) has nothing to quarantine in real accelerate folders."""
    import ckptdoctor

    root = tmp_path / "copy"
    shutil.copytree(accelerate_runs, root)
    result = ckptdoctor.fix(str(root), force=True)
    assert not result.would_change and result.fixed == 0
    assert sorted(p.name for p in (root / "diffusers").iterdir()) == ["checkpoint-2", "checkpoint-4"]
    assert sorted(p.name for p in (root / "project" / "checkpoints").iterdir()) == ["checkpoint_0", "checkpoint_1"]


def test_load_state_pick_follows_accelerate() -> None:
    """``Accelerator.load_state()`` sorts `checkpoints/` by the first number in each name and loads the last; an
    entry with no digit makes it raise (None here)."""
    from ckptdoctor.stacks.accelerate import load_state_pick

    assert load_state_pick(["checkpoint_9", "checkpoint_10", "checkpoint_2"]) == "checkpoint_10"
    assert load_state_pick(["checkpoint_0"]) == "checkpoint_0"
    assert load_state_pick(["checkpoint_1", "notes"]) is None
    assert load_state_pick([]) is None


def test_checkpoint_of_unknown_make_is_reported_never_quarantined(accelerate_runs: Path, tmp_path: Path) -> None:
    """A `checkpoint-N` holding no file of a known stack's and files no Trainer save writes first: an info."""
    ck = tmp_path / "run" / "checkpoint-5"
    ck.mkdir(parents=True)
    shutil.copy(accelerate_runs / "diffusers" / "checkpoint-2" / "model.safetensors", ck)
    (ck / "state.pkl").write_bytes(b"\x80\x04K\x05.")  # a pickled 5: the loop's own state
    found = [(f.rule, f.severity, f.path, f.fix) for f in scan(str(tmp_path / "run")).findings]
    assert found == [("CKD108", Severity.INFO, "checkpoint-5", None)]

"""No false alarm on the folders real stacks write beside or instead of the Trainer's own (issue 23, section 1).

Each case is a folder written by the real library, tiny configs, synthetic tokens, CPU, nothing downloaded:

- a T5 model trained by the real ``Seq2SeqTrainer`` whose tokenizer (built locally with the ``tokenizers`` library)
  carries a chat template: transformers 5 writes ``chat_template.jinja`` beside every such tokenizer, and T5's
  weights number blocks (``block.N``) and their sub-layers (``block.N.layer.M``);
- LLaMA-Factory's ``trainer_log.jsonl`` (JSON Lines) at the run root, as its ``LogCallback`` writes it;
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

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
accelerate = pytest.importorskip("accelerate")

from ckptdoctor.findings import Finding, Severity  # noqa: E402
from ckptdoctor.scanner import scan  # noqa: E402

VOCAB = 64
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
    (src/llamafactory/train/callbacks.py ``LogCallback._write_log``) appends them."""
    run = tmp_path / "run"
    shutil.copytree(t5_run, run)
    lines = [{"current_steps": s, "total_steps": 4, "loss": 4.1, "lr": 1e-3, "epoch": s / 2, "percentage": s * 25.0,
              "elapsed_time": "0:00:01", "remaining_time": "0:00:01"} for s in (1, 2, 3, 4)]
    (run / "trainer_log.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert _alarms(run) == []

"""A tiny Hugging Face Trainer run (a 1-layer Llama on synthetic token ids) and its worker.

``build_trainer`` makes the same run in the test process (the uninterrupted reference) and in
the worker, a process the kill tests SIGKILL. ``summary`` is what the tests compare: every
weight and optimizer tensor (as SHA-256 of its bytes), the learning rate, and the loss, grad
norm and learning rate Trainer logged at each step.

Worker: ``python trainer_worker.py ROOT OUT_DIR SUMMARY [--hold-writes S] [--sft]`` prints
``BEGIN n`` (the step training starts from), ``STEP n`` after each optimizer step,
``SAVED n`` once a save of step n started and ``COMMITTED n`` once it committed; the run that
finishes writes SUMMARY (JSON).
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
from pathlib import Path
from typing import Any

SEED, DATA_SEED = 3, 7
SAMPLES, SEQ, VOCAB, BATCH = 24, 16, 64, 4  # 6 steps per epoch
MAX_STEPS, SAVE_STEPS = 12, 3  # saves at 3, 6 (an epoch end), 9, 12

_OUT = threading.Lock()


def _say(line: str) -> None:
    """One whole line to stdout: commits are reported from a background thread, and print()
    writes the text and the newline separately, so two lines could interleave."""
    with _OUT:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


class TokenDataset:
    """Fixed synthetic token ids (a map-style dataset Trainer batches with its collator)."""

    def __init__(self) -> None:
        import torch

        ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(1))
        self.rows = ids.tolist()

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return {"input_ids": self.rows[index], "labels": self.rows[index]}


def tiny_llama() -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=SEQ, attention_dropout=0.1)
    # Eager attention applies the dropout, so every step draws from torch's RNG.
    return LlamaForCausalLM._from_config(config, attn_implementation="eager")


def training_args(output_dir: str | Path, **overrides: Any) -> Any:
    from transformers import TrainingArguments

    settings = dict(output_dir=str(output_dir), max_steps=MAX_STEPS,
                    per_device_train_batch_size=BATCH, learning_rate=1e-2, warmup_steps=2,
                    lr_scheduler_type="linear", logging_steps=1, save_strategy="steps",
                    save_steps=SAVE_STEPS, seed=SEED, data_seed=DATA_SEED,
                    dataloader_num_workers=0, report_to=[], use_cpu=True, disable_tqdm=True)
    settings.update(overrides)
    return TrainingArguments(**settings)


def build_trainer(output_dir: str | Path, *, callbacks: list[Any] | None = None,
                  **overrides: Any) -> Any:
    import torch
    from transformers import Trainer

    torch.set_num_threads(1)  # the same reductions in the test process and the worker
    return Trainer(model=tiny_llama(), args=training_args(output_dir, **overrides),
                   train_dataset=TokenDataset(), callbacks=callbacks)


def _digest(tensor: Any) -> str:
    return hashlib.sha256(tensor.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


def summary(trainer: Any) -> dict[str, Any]:
    """What an exact resume must reproduce, as JSON."""
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    moments = {f"{names[id(p)]}/{key}": _digest(value) for p, state in optimizer.state.items()
               for key, value in state.items()}
    logs = [[entry["step"], entry["loss"], entry.get("grad_norm"), entry["learning_rate"]]
            for entry in trainer.state.log_history if "loss" in entry]
    return {"weights": {n: _digest(p) for n, p in trainer.model.state_dict().items()},
            "optimizer": moments, "lr": [g["lr"] for g in optimizer.param_groups],
            "global_step": trainer.state.global_step, "logs": logs}


def sft_trainer(output_dir: str | Path, *, callbacks: list[Any] | None = None,
                **overrides: Any) -> Any:
    """TRL's SFTTrainer on pre-tokenized rows (no tokenizer download: a word-level one)."""
    import torch
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    torch.set_num_threads(1)
    vocab = {f"w{i}": i for i in range(VOCAB)}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="w0")),
        pad_token="w1", eos_token="w2")
    rows = TokenDataset().rows
    dataset = Dataset.from_dict({"input_ids": rows})
    settings = dict(output_dir=str(output_dir), max_steps=8, per_device_train_batch_size=BATCH,
                    learning_rate=1e-2, logging_steps=1, save_strategy="steps", save_steps=2,
                    seed=SEED, data_seed=DATA_SEED, dataloader_num_workers=0, report_to=[],
                    use_cpu=True, disable_tqdm=True, max_length=SEQ)
    settings.update(overrides)
    args = SFTConfig(**settings)
    return SFTTrainer(model=tiny_llama(), args=args, train_dataset=dataset,
                      processing_class=tokenizer, callbacks=callbacks)


def _markers() -> Any:
    from transformers import TrainerCallback

    class Markers(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            _say(f"BEGIN {state.global_step}")

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            _say(f"STEP {state.global_step}")

        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            _say(f"SAVED {state.global_step}")

    return Markers()


def _on_report(report: Any) -> None:
    if report.kind == "recover" and report.error is None:
        # Trainer counts steps from 1, a checkpoint from 0.
        _say(f"COMMITTED {report.step + 1}")


def main(argv: list[str]) -> None:
    from torch_bridge import DcpBackend
    from torch_bridge.integrations.transformers import use_jaxckpt

    root, output_dir, summary_path = argv[:3]
    kwargs: dict[str, Any] = {"on_report": _on_report, "mode": "async"}
    if "--hold-writes" in argv:
        from support.held_writes import hold_async_writes

        seconds = float(argv[argv.index("--hold-writes") + 1])
        kwargs["backend"] = hold_async_writes(DcpBackend(), seconds)
    make = sft_trainer if "--sft" in argv else build_trainer
    trainer = use_jaxckpt(make(output_dir, callbacks=[_markers()]), root, **kwargs)
    trainer.train()
    Path(summary_path).write_text(json.dumps(summary(trainer)))
    _say("DONE")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `support` for held_writes
    main(sys.argv[1:])

"""One rank of a DDP Trainer run on CPU (gloo), as accelerate sets it up under torchrun.

    torchrun --nproc_per_node 2 tests/integrations/trainer_worker.py OUT_DIR [attach]

Every rank builds the same tiny Llama (sdpa), attaches it when asked, and trains two steps of padding-free batches
(``DataCollatorWithFlattening``) with :func:`foundry_attn.integrations.hf_trainer.install`; the events go to
``OUT_DIR/attn_events``. Rank 0 writes ``OUT_DIR/result.json``: the world size the Trainer saw and the wrapper it
trained through.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import torch
from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

from foundry_attn.integrations import hf_trainer
from foundry_attn.path.attach import attach
from foundry_attn.proof.synthetic import synthetic_documents
from foundry_attn.verify import conformance


def main(out: Path, attached: bool) -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    model = conformance.build("llama", "sdpa")
    if attached:
        attach(model, "sdpa")
    docs = synthetic_documents(model.config, (5, 11, 3, 9, 7, 13, 4, 8) * 2, torch.device("cpu"))
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=4,
        max_steps=2,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        ddp_backend="gloo",
    )
    data = [{"input_ids": d.tolist()} for d in docs]
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=DataCollatorWithFlattening())
    hf_trainer.install(trainer, log_interval=1, verdict_interval=1)
    trainer.train()
    if args.process_index == 0:
        wrapped = type(trainer.model_wrapped).__name__
        (out / "result.json").write_text(json.dumps({"world": args.world_size, "wrapped": wrapped}))
    if torch.distributed.is_initialized():
        # every rank is done (its events are on disk: os.write per event); then leave without the interpreter's
        # teardown, where gloo's threads, joined in no set order, abort a rank now and then ("terminate called
        # without an active exception", with destroy_process_group too)
        torch.distributed.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]), len(sys.argv) > 2 and sys.argv[2] == "attach")

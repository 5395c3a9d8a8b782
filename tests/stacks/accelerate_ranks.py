"""A real accelerate 1.15 program on two gloo processes, for tests/stacks/test_stack_accelerate.py: run as
``python -m torch.distributed.run --nproc_per_node 2 accelerate_ranks.py PROJECT``, it trains 3 optimizer steps with
automatic checkpoint naming, stepping its prepared LambdaLR after each, and saves after each step. It prints each
process's scheduler count (``last_epoch``): ``AcceleratedScheduler`` steps the scheduler once per process per
optimizer step (``split_batches`` off). Not a test module.
"""

from __future__ import annotations

import sys

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration


def main() -> None:
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=sys.argv[1],
                                                                    automatic_checkpoint_naming=True))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    model, opt, sched = acc.prepare(model, opt, sched)
    for _ in range(3):
        acc.backward(model(torch.randn(3, 4)).sum())
        opt.step()
        sched.step()
        opt.zero_grad()
        acc.save_state()
    print(f"last_epoch {sched.scheduler.last_epoch}")


if __name__ == "__main__":
    main()

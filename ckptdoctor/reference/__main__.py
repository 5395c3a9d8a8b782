"""Command line: ``python -m ckptdoctor.reference {list | scenario NAME OUT_DIR | train OUT_DIR [...]}``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the process exit code."""
    parser = argparse.ArgumentParser(prog="python -m ckptdoctor.reference", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="name every scenario with a one-line summary")
    build = commands.add_parser("scenario", help="build one scenario into an empty directory")
    build.add_argument("name")
    build.add_argument("out_dir")
    run = commands.add_parser("train", help="train (or resume) one run with the reference trainer")
    run.add_argument("out_dir")
    run.add_argument("--max-steps", type=int, default=12)
    run.add_argument("--save-steps", type=int, default=4)
    run.add_argument("--lora", action="store_true", help="train a LoRA adapter through peft")
    run.add_argument("--weights-format", choices=("safetensors", "bin", "sharded"), default="safetensors")
    run.add_argument("--resume", nargs="?", const=True, default=None,
                     help="resume from the latest checkpoint, or from the given checkpoint folder")
    args = parser.parse_args(argv)

    from ckptdoctor.reference.scenarios import SCENARIOS
    from ckptdoctor.reference.scenarios import build as build_scenario

    if args.command == "list":
        width = max(len(name) for name in SCENARIOS)
        for name, item in sorted(SCENARIOS.items()):
            print(f"{name:<{width}}  {item.summary}")
        return 0
    if args.command == "scenario":
        try:
            out = build_scenario(args.name, args.out_dir)
        except (KeyError, FileExistsError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(out)
        return 0

    from ckptdoctor.reference.train import TrainConfig, train

    cfg = TrainConfig(output_dir=args.out_dir, max_steps=args.max_steps, save_steps=args.save_steps,
                      use_lora=args.lora, weights_format=args.weights_format)
    result = train(cfg, resume_from_checkpoint=args.resume)
    for step, loss in sorted(result.losses.items()):
        print(f"step {step:4d}  loss {loss:.6f}  lr {result.learning_rates[step]:.6g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

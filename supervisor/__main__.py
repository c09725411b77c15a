"""python -m supervisor [--config FILE] | --check-config FILE"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import msgspec

from config import ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m supervisor",
                                     description="Start the lip-sync server: frontend, inference workers, "
                                                 "compositing pool.")
    parser.add_argument("--config", metavar="FILE", help="YAML config (default: the embedded default, which "
                        "serves a demo avatar)")
    parser.add_argument("--check-config", metavar="FILE", help="validate FILE and exit")
    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("LIPSYNC_LOG", "INFO"), stream=sys.stderr,
                        format="%(asctime)s supervisor %(levelname)s %(message)s")
    try:
        config = load_config(args.check_config or args.config)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    if args.check_config:
        print(f"{args.check_config}: ok")
        return 0

    from supervisor.demo import build_demo
    from supervisor.tree import StartError, Supervisor

    if config.models_dir is None and not config.models:
        config = msgspec.structs.replace(config, models_dir=str(build_demo(config)))
    try:
        sup = Supervisor(config)
    except Exception as err:  # e.g. shm creation failed: nothing is left behind
        print(f"cannot start: {err}", file=sys.stderr)
        return 1
    try:
        sup.start()
        print(sup.summary(), flush=True)
        return sup.serve()
    except StartError as err:
        print(f"cannot start: {err}", file=sys.stderr)
        return 1
    finally:
        sup.shutdown()


if __name__ == "__main__":
    sys.exit(main())

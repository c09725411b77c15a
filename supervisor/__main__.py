"""python -m supervisor [--config FILE] | --check-config FILE | keys DIR NAME... | import-synctalk2d ..."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from supervisor.entry import mark   # NOTE: first: its import is the trace's "main" step

# NOTE: nothing heavy at the top: what is imported here is imported before the children are spawned.


def keys_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m supervisor keys",
                                     description="Write a CURVE key pair: DIR/NAME.key (public, share it) and "
                                                 "DIR/NAME.key_secret (secret, keep it).")
    parser.add_argument("dir")
    parser.add_argument("names", nargs="+", metavar="NAME")
    args = parser.parse_args(argv)
    import zmq.auth
    os.makedirs(args.dir, exist_ok=True)
    existing = [p for name in args.names for p in (os.path.join(args.dir, f"{name}.key"),
                                                   os.path.join(args.dir, f"{name}.key_secret")) if os.path.exists(p)]
    if existing:
        print(f"refusing to overwrite existing keys: {', '.join(existing)} (remove them first to replace a key "
              "pair; every peer that trusts the old public key must be given the new one)", file=sys.stderr)
        return 1
    for name in args.names:
        # NOTE: the umask makes the secret file private from its creation; a chmod afterwards would
        # leave it readable by others for a moment.
        previous = os.umask(0o077)
        try:
            public, secret = zmq.auth.create_certificates(args.dir, name)
        finally:
            os.umask(previous)
        os.chmod(public, 0o644)
        print(f"{public}\n{secret}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from supervisor.ownership import check_own_packages   # NOTE: first: `config` below may be another project's
    collision = check_own_packages()
    if collision:
        print(collision, file=sys.stderr)
        return 3
    mark("checked")
    if argv[:1] == ["keys"]:
        return keys_main(argv[1:])
    if argv[:1] == ["import-synctalk2d"]:
        from supervisor.importer.command import import_main   # NOTE: here: onnx and the builder stay out of the server
        return import_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m supervisor",
                                     description="Start the lip-sync server: frontend, inference workers, "
                                                 "compositing pool.")
    parser.add_argument("--config", metavar="FILE", help="YAML config (default: the embedded default, which "
                        "serves a demo avatar)")
    parser.add_argument("--check-config", metavar="FILE", help="validate FILE and exit")
    parser.add_argument("--role", choices=["all", "gpu", "edge"], default="all",
                        help="all: everything on this host (default); gpu: inference workers and the bridge that "
                             "edges connect to; edge: frontend and compositing, inference on bridge.hosts")
    args = parser.parse_args(argv)
    # NOTE: before numpy is first imported, here and (inherited) in every child: OpenBLAS starts a thread
    # per core at import, which spin for ~0.1 CPU-s in each process, and no process here multiplies
    # matrices large enough to use them (onnxruntime and OpenCV keep thread pools of their own).
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    from config import ConfigError, load_config
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
    mark("configured")

    from supervisor.tree import StartError, Supervisor, install_signal_handlers
    mark("imported")

    stop = install_signal_handlers()

    if config.models_dir is None and not config.models and args.role == "all":
        import msgspec
        from supervisor.demo import build_demo   # NOTE: here: only the embedded default serves the demo
        config = msgspec.structs.replace(config, models_dir=str(build_demo(config)))
    try:
        sup = Supervisor(config, args.role, stop)
    except Exception as err:  # e.g. shm creation failed: nothing is left behind
        print(f"cannot start: {err}", file=sys.stderr)
        return 1
    mark("created")
    try:
        sup.start()
        for warning in sup.warnings():
            logging.getLogger("supervisor").warning("%s", warning)
        print(sup.summary(), flush=True)
        mark("serving")
        return sup.serve()
    except StartError as err:
        print(f"cannot start: {err}", file=sys.stderr)
        return 1
    finally:
        sup.shutdown()


if __name__ == "__main__":
    sys.exit(main())

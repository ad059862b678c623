"""`dtrain`: run one training job from a YAML config, under torchrun or as a single process.

    torchrun --nproc_per_node=2 -m distributed_training job.yaml
    dtrain job.yaml --set training.max_steps=100 --set training.strategy=zero3
    dtrain --print-config              # the defaults, as YAML, to start a config from
"""

from __future__ import annotations

import argparse
import os
import sys

from .checkpoint import CheckpointMismatchError
from .checkpoint_lock import CheckpointDirectoryInUseError
from .config import ConfigError, JobConfig, dump_config, load_config
from .dtrain_job import run_job
from .logs import get_logger, install_default_handler

__all__ = ["main", "run_job"]

log = get_logger("cli")

_EXAMPLES = """
examples:
  torchrun --nproc_per_node=2 -m distributed_training examples/configs/gpt_cpu.yaml
  dtrain job.yaml --set training.strategy=zero3 --set training.max_steps=200 --set training.lr=3e-4
"""


def _sections_help() -> str:
    """The config's sections and fields, read from the config's own models (a new field shows up here)."""
    import textwrap
    import types
    import typing

    def choices(annotation) -> str:
        """`` (a|b)`` for a field of fixed choices, `` (or a)`` for a number that may also be a word."""
        literals, others, stack = [], False, [annotation]
        while stack:
            a = stack.pop()
            origin = typing.get_origin(a)
            if origin is typing.Literal:
                literals += typing.get_args(a)
            elif origin is typing.Annotated:
                stack.append(typing.get_args(a)[0])
            elif origin in (typing.Union, types.UnionType):
                stack += typing.get_args(a)
            elif a is not type(None):
                others = True
        if not literals:
            return ""
        return f" (or {'|'.join(literals)})" if others else f" ({'|'.join(literals)})"

    lines = ["config sections (every field optional; `dtrain --print-config` prints each one's default and meaning):"]
    for name, info in JobConfig.model_fields.items():
        fields = getattr(info.annotation, "model_fields", None)
        if fields is None:
            lines.append(f"  {name + ':':<16}{info.description or ''}")
            continue
        text = ", ".join(field + choices(finfo.annotation) for field, finfo in fields.items())
        wrapped = textwrap.wrap(text, width=96) or [""]
        lines.append(f"  {name + ':':<16}{wrapped[0]}")
        lines += [" " * 18 + line for line in wrapped[1:]]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dtrain",
        description="Train a model data-parallel from a YAML config (run it under torchrun for several processes).",
        epilog=_sections_help() + _EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", nargs="?", help="the job's YAML file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override one config field (repeatable), e.g. --set training.lr=3e-4; a whole section "
                        "(--set 'training={strategy: zero3, lr: 3e-4}') is merged into the file's")
    p.add_argument("--print-config", action="store_true", help="print the effective config as YAML and exit")
    p.add_argument("--no-resume", action="store_true",
                   help="start from step 0 even if checkpoint.dir holds checkpoints (they are moved into "
                        "checkpoint.dir/previous_run_<k>/); the same as --set checkpoint.resume=false")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    install_default_handler()
    overrides = args.overrides + (["checkpoint.resume=false"] if args.no_resume else [])
    try:
        if args.print_config:
            cfg = load_config(args.config if args.config else {}, overrides)
            sys.stdout.write(dump_config(cfg))
            return 0
        if not args.config:
            parser.error("a config file is required (or --print-config)")
        # Validated before the process group exists: a bad config costs no rendezvous, and no rank waits.
        cfg = load_config(args.config, overrides)
        from .user_job import add_import_dirs

        add_import_dirs(args.config)  # the user's my_pkg next to the YAML (model.target, ...)
        run_job(cfg)
    except ConfigError as err:
        _report_once(f"dtrain: invalid config: {err}")
        return 2
    except (CheckpointMismatchError, CheckpointDirectoryInUseError) as err:  # every rank fails alike
        _report_once(f"dtrain: {err}".replace("checkpoint_dir", "checkpoint.dir"))
        return 2
    return 0


def _report_once(message: str) -> None:
    """Say it once a node: every rank reads the same config (or checkpoint) and fails the same way, so
    only each node's first rank speaks (LOCAL_RANK 0; rank 0 where that is not set): another node's log
    would otherwise show only its launcher's lost rendezvous.

    Under torchrun, that rank writes the message to the agent's error file (TORCHELASTIC_ERROR_FILE)
    instead of stderr: torchrun's failure summary then shows it as the root cause, where it would
    otherwise point to a traceback that does not exist. The node's other ranks wait (up to
    `_PEER_GRACE_S`) for the agent to stop them after its first rank has failed: a rank that exited first
    would be taken as the root cause, and the first killed before its message is out.
    """
    import time

    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    if not _first_on_node():
        if under_torchrun:
            time.sleep(_PEER_GRACE_S)
        return
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE") if under_torchrun else None
    if error_file and _write_elastic_error(error_file, message):
        return
    log.error(message)


_PEER_GRACE_S = 20.0


def _first_on_node() -> bool:
    local = os.environ.get("LOCAL_RANK")
    return int(local or 0) == 0 if local is not None else int(os.environ.get("RANK", "0") or 0) == 0


def _write_elastic_error(path: str, message: str) -> bool:
    """The error file torchrun's agent reads for its failure summary (a plain-text message)."""
    import json
    import time

    try:
        with open(path, "w") as f:
            json.dump({"message": message, "timestamp": int(time.time())}, f)
        return True
    except OSError:
        return False


def entry() -> None:
    """The `dtrain` command: `main`, then leave without running the interpreter's finalizers.

    By the time `main` returns, the checkpoint, the output and the logs are written and closed and the
    process group is destroyed. What remains is interpreter and C++ static teardown, where a
    communication library's background thread can still be joinable and abort the process
    ("terminate called without an active exception"). Under torchrun such an abort after a finished
    job makes the agent restart the worker, which then waits for peers that have already left.
    """
    code = 1
    try:
        code = main()
    except SystemExit as stop:  # argparse errors and --help; sys.exit("message") means status 1
        if isinstance(stop.code, str):
            sys.stderr.write(f"{stop.code}\n")  # what the interpreter itself does with sys.exit("message")
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except KeyboardInterrupt:
        code = 130
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        import logging

        logging.shutdown()  # flush and close every logging handler, as a normal exit would
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    entry()

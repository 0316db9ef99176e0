"""``main``: parse, run the command, and turn what went wrong into one line and an exit
status (2: a mistake in the command; 1: a failed run; 130: Ctrl-C; 143: SIGTERM)."""
from __future__ import annotations

import os
import sys

from ..errors import FasttrainError, RunFailed
from .common import _check_common, _drop_unused_outputs, _error, _use_preset
from .fit import cmd_fit
from .infer import cmd_infer
from .ladder import cmd_ladder
from .parser import _Usage, build_parser
from .profile import cmd_profile
from .report import cmd_docs, cmd_presets, cmd_report, cmd_workloads
from .scaling import cmd_scaling
from .train import cmd_train


def _run_failed(err: Exception) -> int:
    """A run that crashed (not a mistake in the command): one line, exit status 1; with
    FASTTRAIN_TRACEBACK=1 the traceback first, for a bug report. A full disk met outside
    fasttrain's own writers (a checkpoint shard) is said as such, naming the file."""
    from ..errors import describe_error, disk_full

    if (full := disk_full(err)) is not None:
        return _error(full, 1)
    if os.environ.get("FASTTRAIN_TRACEBACK") == "1":
        import traceback

        traceback.print_exception(err)
        return _error(f"the run failed: {describe_error(err)}", 1)
    return _error(f"the run failed: {describe_error(err)} (FASTTRAIN_TRACEBACK=1 shows where)", 1)


class _Terminated(BaseException):
    """SIGTERM, raised where the command is so that its folders and children are cleaned up."""


def _on_sigterm(signum, frame) -> None:
    raise _Terminated()


def _end_with_parent() -> None:
    """A rank torchrun started ends when torchrun does (a SIGKILL leaves nothing behind)."""
    from ..distributed.launch import die_with_parent, launched

    if launched():
        die_with_parent()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    _end_with_parent()
    import signal
    import threading

    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None
    try:
        return _main(argv)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def _main(argv: list[str]) -> int:
    try:
        args, extra = build_parser().parse_known_args(argv)
        if extra:  # argparse's top level would name no command and point at the top --help
            command = getattr(args, "command", None)
            if command in argv and extra[0] in argv and argv.index(extra[0]) < argv.index(command):
                command = None  # given before the command: the top level's mistake
            where = f"fasttrain {command}" if command else "fasttrain"
            raise _Usage(f"{command + ': ' if command else ''}unrecognized arguments: "
                         f"{' '.join(extra)} (see {where} --help)")
    except _Usage as err:
        return _error(err, 2)
    try:
        if args.command not in ("report", "workloads", "presets", "infer", "docs"):
            _check_common(args)
            _use_preset(args)
        if args.command in ("train", "profile") and (args.nproc > 1 or args.nnodes > 1):
            from ..distributed.launch import launched
            from ..distributed.launch import relaunch

            if not launched():
                return relaunch(argv, args.nproc, args.nnodes, args.rdzv_endpoint)
        if args.command == "presets":
            return cmd_presets(args)
        if args.command == "docs":
            return cmd_docs(args)
        if args.command == "workloads":
            return cmd_workloads(args)
        return {"ladder": cmd_ladder, "train": cmd_train, "profile": cmd_profile,
                "fit": cmd_fit, "scaling": cmd_scaling, "report": cmd_report,
                "infer": cmd_infer}[args.command](args)
    except RunFailed as err:  # the run, not the command, went wrong: said in one line
        code = _error(err, 1)
        from ..distributed.launch import launched

        if launched():  # a peer hung: tearing the process group down would wait for it
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        return code
    except (ValueError, FasttrainError) as err:  # a complaint about the input
        return _error(err, 2)
    except KeyboardInterrupt:
        print("fasttrain: interrupted", file=sys.stderr)
        return 130
    except _Terminated:
        print("fasttrain: terminated (SIGTERM)", file=sys.stderr)
        return 143
    except Exception as err:  # noqa: BLE001 - the contract: a failed run is one line, exit 1
        return _run_failed(err)
    finally:
        _drop_unused_outputs()
        from ..distributed.env import shutdown

        shutdown()

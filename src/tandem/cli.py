"""The ``tandem`` command: ``tandem grpo|sft|dpo|rm|export|envs|version``.

User errors (a bad recipe, a typo'd key, a malformed data row, a reward that raises) print one
clear message and exit with status 2, without a traceback of tandem's; a worker that died or
failed (``WorkerError``), or a disk that filled or became read-only, prints one message naming
it and exits with status 1; Ctrl-C exits with 130, SIGTERM with 143 (``tandem.interrupts``);
anything else is a bug and keeps its traceback. docs/errors.md has the whole rule.
"""

from __future__ import annotations

import argparse
import atexit
import errno
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import tandem
from tandem.imports import pause_gc, resume_gc
from tandem.interrupts import exit_status, received, signals_as_interrupts

USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError)
ENVIRONMENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})
"""An ``OSError`` with one of these (a full disk, a quota, a read-only or forbidden folder) is
a fault of the machine, not a bug: one message naming the file, exit status 1."""


class _IntermixedParser(argparse.ArgumentParser):
    """A subcommand's parser that takes flags and ``key=value`` overrides in any order
    (``tandem grpo a.b=1 --resume c.d=2``), as ``parse_intermixed_args`` does."""

    _intermixing = False

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        if self._intermixing:  # parse_known_intermixed_args calls this for its two passes
            return super().parse_known_args(args, namespace)
        self._intermixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False


class _HelpConfig(argparse.Action):
    """``--help-config``: every key of the command's config with its type, default and doc."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        self.model_name: str = kwargs.pop("model_name")
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        from tandem import config
        from tandem.config.help import describe_config

        print(describe_config(getattr(config, self.model_name)))
        parser.exit()


def _add_run_arguments(
    parser: argparse.ArgumentParser, default_recipe: str, model_name: str
) -> None:
    parser.add_argument(
        "--resume", action="store_true", help="continue the run's latest complete checkpoint"
    )
    parser.add_argument(
        "--help-config",
        action=_HelpConfig,
        model_name=model_name,
        help="list every config key with its type, default and description, then exit",
    )
    parser.add_argument(
        "--config",
        "-c",
        default=default_recipe,
        help=f"recipe YAML file or shipped recipe name (default: {default_recipe})",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="dotted overrides, e.g. policy.optimizer.lr=3e-6 algorithm.num_steps=10",
    )


def _run_grpo(args: argparse.Namespace) -> None:
    from tandem.config import GrpoConfig, load_config

    config = load_config(GrpoConfig, args.config, args.overrides)
    from tandem.driver import run_grpo

    run_grpo(config, resume=args.resume)


def _run_sft(args: argparse.Namespace) -> None:
    from tandem.config import SftConfig, load_config

    config = load_config(SftConfig, args.config, args.overrides)
    from tandem.driver import run_sft

    run_sft(config, resume=args.resume)


def _run_export(args: argparse.Namespace) -> None:
    from tandem.runs import export_checkpoint

    print(f"exported {export_checkpoint(args.checkpoint, args.out_dir, merge=args.merge)}")


def _run_dpo(args: argparse.Namespace) -> None:
    from tandem.config import DpoConfig, load_config

    config = load_config(DpoConfig, args.config, args.overrides)
    from tandem.driver import run_dpo

    run_dpo(config, resume=args.resume)


def _run_rm(args: argparse.Namespace) -> None:
    from tandem.config import RmConfig, load_config

    config = load_config(RmConfig, args.config, args.overrides)
    from tandem.reward_training import run_rm

    run_rm(config, resume=args.resume)


def _run_envs(args: argparse.Namespace) -> None:
    from tandem.cluster import envs

    kinds = args.kinds or None
    if args.action == "list":
        print("actor kinds (kind -> environment):")
        print("\n".join(f"  {line}" for line in envs.registry_lines()))
        print(f"environments under {envs.cache_root()}:")
        infos = envs.list_envs()
    elif args.action == "build":
        infos = envs.build_envs(kinds, rebuild=args.rebuild)
    else:
        for path in envs.clean_envs(kinds):
            print(f"removed {path}")
        return
    for info in infos:
        print(info)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="tandem: RL post-training for LLMs")
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=_IntermixedParser
    )

    grpo = sub.add_parser("grpo", help="run GRPO (default: the embedded tiny model and task)")
    _add_run_arguments(grpo, "grpo_arithmetic", "GrpoConfig")
    grpo.set_defaults(func=_run_grpo)

    sft = sub.add_parser("sft", help="supervised fine-tuning on prompt/response data")
    _add_run_arguments(sft, "sft_arithmetic", "SftConfig")
    sft.set_defaults(func=_run_sft)

    dpo = sub.add_parser("dpo", help="DPO / IPO on preference pairs (prompt, chosen, rejected)")
    _add_run_arguments(dpo, "dpo_arithmetic", "DpoConfig")
    dpo.set_defaults(func=_run_dpo)

    rm = sub.add_parser("rm", help="train a reward model on preference pairs (Bradley-Terry)")
    _add_run_arguments(rm, "rm_arithmetic", "RmConfig")
    rm.set_defaults(func=_run_rm)

    export = sub.add_parser(
        "export", help="write a checkpoint's policy as a Hugging Face folder (no Ray)"
    )
    export.add_argument(
        "checkpoint",
        type=Path,
        help="a run folder (its latest checkpoint) or its checkpoints/step_N",
    )
    export.add_argument("out_dir", type=Path, help="the folder to write (replaced whole)")
    export.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA run: merge the adapters into the weights and write a model folder "
        "(default: a peft adapter folder); full-parameter runs write a model folder either way",
    )
    export.set_defaults(func=_run_export)

    env = sub.add_parser("envs", help="list, build or clean the per-actor Python environments")
    env.add_argument("action", choices=["list", "build", "clean"])
    env.add_argument("kinds", nargs="*", help="actor kinds (default: all)")
    env.add_argument("--rebuild", action="store_true", help="rebuild even if cached")
    env.set_defaults(func=_run_envs)

    version = sub.add_parser("version", help="print the tandem version")
    version.set_defaults(func=lambda _args: print(f"tandem {tandem.__version__}"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], None] = args.func
    from tandem.cluster.groups import WorkerError

    pause_gc()  # a run's start: imports, Ray, the actors (``imports.without_gc``)
    ray_was_up = _ray_is_up()
    try:
        with signals_as_interrupts(f"tandem {args.command}"):
            try:
                func(args)
            except BaseException as err:  # after a signal, whatever comes of it is the interrupt
                interrupt = received() or (err if isinstance(err, KeyboardInterrupt) else None)
                if interrupt is None:
                    raise
                status, word = exit_status(interrupt)
                print(f"tandem {args.command}: {word}", file=sys.stderr)
                return status
    except WorkerError as err:
        print(f"tandem {args.command}: error: {err}", file=sys.stderr)
        return 2 if err.from_setting else 1
    except USER_ERRORS as err:
        print(f"tandem {args.command}: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        if err.errno not in ENVIRONMENT_ERRNOS:
            raise
        where = f": {err.filename}" if err.filename else ""
        print(f"tandem {args.command}: error: {err.strerror}{where}", file=sys.stderr)
        return 1
    finally:
        resume_gc()  # run_loop resumes it for a run; here for every other way out
        if not ray_was_up and _ray_is_up():  # the Ray this command started, stopped now
            from tandem.cluster.ray_cluster import shutdown_ray

            shutdown_ray()
    return 0


def _ray_is_up() -> bool:
    ray = sys.modules.get("ray")  # a command that never imported Ray started none
    return ray is not None and ray.is_initialized()


def entry() -> NoReturn:
    """The ``tandem`` command: ``main()``, then the exit without the interpreter's teardown.

    The exit handlers run (Ray's, logging's flush, temporary files' cleanup); what is skipped is
    freeing every module's objects one by one (the heaps of torch, transformers and Ray: about
    a second, docs/benchmarks/2026-12-05-cpu-e2e-intel.md), for nothing, since every file a
    command writes is closed before ``main`` returns."""
    code = main()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()

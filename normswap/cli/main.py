"""The `normswap` entry point.

Subcommands live one per module and are imported lazily, so `normswap --help` stays fast and a
command whose optional dependencies are missing does not break the others.
"""

from __future__ import annotations

import importlib
import os
import sys

import click

from normswap.errors import NormswapError, is_environmental, os_error_message
from normswap.processes import stop_on_signals
from normswap.progress import escape_standard_streams
from normswap.version import __version__

# command name -> "module:attribute"
COMMANDS = {
    "convert": "normswap.cli.convert_command:convert",
    "export": "normswap.cli.export_command:export",
    "finetune": "normswap.cli.finetune_command:finetune",
    "study": "normswap.cli.study_command:study",
    "eval": "normswap.cli.eval_command:eval_group",
    "bench": "normswap.cli.bench_command:bench",
    "models": "normswap.cli.models_command:models",
    "families": "normswap.cli.families_command:families",
    "run": "normswap.cli.run_command:run",
    "demo": "normswap.cli.demo_command:demo",
    "slice": "normswap.cli.slice_command:slice_command",
}


class LazyGroup(click.Group):
    def resolve_command(self, ctx, args):
        """A mistyped command gets the closest one suggested (click only does this for options)."""
        name = click.utils.make_str(args[0]) if args else None
        if name is not None and not name.startswith("-") and name not in COMMANDS:
            import difflib

            close = difflib.get_close_matches(name, sorted(COMMANDS), n=1, cutoff=0.6)
            hint = f" Did you mean '{close[0]}'?" if close else f" Commands: {', '.join(sorted(COMMANDS))}."
            raise click.UsageError(f"No such command '{name}'.{hint}", ctx)
        return super().resolve_command(ctx, args)

    def list_commands(self, ctx):
        return sorted(COMMANDS)

    def get_command(self, ctx, name):
        target = COMMANDS.get(name)
        if target is None:
            return None
        module, attr = target.split(":")
        return getattr(importlib.import_module(module), attr)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="normswap")
@click.option("--debug", is_flag=True, envvar="NORMSWAP_DEBUG", help="Show full tracebacks on errors.")
@click.pass_context
def cli(ctx, debug):
    """Migrate LayerNorm checkpoints to fused RMSNorm, heal them, and measure the result."""
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug
    if debug:
        os.environ["NORMSWAP_DEBUG"] = "1"
    _quiet_libraries(debug)


def _quiet_libraries(debug: bool):
    """transformers' and the hub's progress bars and config warnings drown normswap's output.

    Done through environment variables (read when those libraries are imported), so that
    starting the CLI - `normswap --help` included - imports none of them.
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if debug:
        return
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' own bars follow this too
    if "transformers" in sys.modules:  # already imported (an embedding program): set it directly
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()


def _debug_requested(argv) -> bool:
    return "--debug" in argv or os.environ.get("NORMSWAP_DEBUG") == "1"


def main(argv=None):
    """Run the CLI; turn user errors into one line and a non-zero exit (traceback with --debug)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # SIGTERM unwinds like Ctrl-C (staging removed, locks released) after every process the command
    # started has been ended; SIGKILL cannot be caught: the next run removes what it leaves (publish.py)
    restore = stop_on_signals()
    # every line a command prints passes one escaping layer: names come from directory names and
    # received files, and a control character in one must show, not act (normswap/progress.py)
    unescape = escape_standard_streams()
    try:
        _run(argv)
    finally:
        unescape()
        restore()


def _json_requested(argv) -> bool:
    """``--json`` among the options (before a ``--``): every command's --json is a flag (options.py)."""
    args = argv[: argv.index("--")] if "--" in argv else argv
    return "--json" in args


def _fail(argv, message: str, exit_code: int) -> None:
    """The one way a command fails: one line on stderr and, under --json, the same as one JSON object
    on stdout, so that a script reading stdout gets an answer instead of nothing."""
    click.echo(message, err=True)
    if _json_requested(argv):
        import json

        text = message.removeprefix("normswap: error: ").removeprefix("Error: ")
        click.echo(json.dumps({"error": text, "exit_code": exit_code}))
    sys.exit(exit_code)


def _run(argv):
    try:
        cli.main(args=argv, prog_name="normswap", standalone_mode=False)
    except click.exceptions.Abort:
        _fail(argv, "normswap: aborted", 130)
    except click.ClickException as e:
        if isinstance(e, click.UsageError) and "extra argument" in e.message and _json_requested(argv):
            # `--json FILE`: the benchmarks' old spelling of --save FILE (scripts still send it)
            e.message += " (--json is a flag: it prints the result on stdout; --save FILE writes it to a file)"
        if not _json_requested(argv):
            e.show()
            sys.exit(e.exit_code)
        _fail(argv, f"Error: {e.format_message()}", e.exit_code)
    except NormswapError as e:
        if _debug_requested(argv):
            raise
        _fail(argv, f"normswap: error: {e}", e.exit_code)
    except KeyboardInterrupt:
        _fail(argv, "normswap: interrupted", 130)
    except OSError as e:
        # the machine, not normswap: a full disk, a read-only or busy path, a name too long (most are
        # caught where they happen, with more context; this is the net for the rest)
        if _debug_requested(argv):
            raise
        if not is_environmental(e):
            _unanticipated(e, argv)
        _fail(argv, f"normswap: error: {os_error_message(e)}", 2)
    except Exception as e:  # a bug, or an error from a library we did not anticipate
        if _debug_requested(argv):
            raise
        _unanticipated(e, argv)
    except (SystemExit, GeneratorExit):
        raise
    except BaseException as e:  # a Rust library's panic (pyo3_runtime.PanicException) is no Exception
        if _debug_requested(argv):
            raise
        _unanticipated(e, argv)


def _unanticipated(e: BaseException, argv=()):
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    _fail(list(argv), f"normswap: error: {type(e).__name__}: {msg} (rerun with --debug for the traceback)", 1)


if __name__ == "__main__":
    main()

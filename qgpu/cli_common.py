"""What every qgpu command line shares, so that they all read and fail the same way.

Used by ``qgpu`` and its adapter subcommands, ``qgpu-ray``, ``qgpu-dask-worker``, the
examples and the benchmarks:

- `Parser`: help that shows each option's default, and usage errors in one line;
- ``--version`` (`add_version`);
- enumerated values parsed by the core's one case rule, `qgpu.model.parse_choice`
  (`choice`, `isolation_choice`, `placement_choice`);
- one flag per meaning: ``--isolation`` (best-effort / fixed-share / burst-share) and
  ``--placement`` / ``--gpu-placement`` (binpack / spread / frag); old spellings such as
  ``--policy`` are accepted for one release with a one-line deprecation warning
  (`add_isolation_option`, `add_placement_options`, `deprecated_alias`);
- rule violations told with the flag the user typed (`flag_violation`, `describe`):
  ``--memory 90: must not exceed the card ...``, never ``qgpu-memory=90`` or ``=None``;
- output into a pipe that closes early (``qgpu status --json | head``) ends quietly
  (`exit_code_of`);
- rich tables as wide as their content when stdout is not a terminal (`stdout_console`).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import textwrap
from collections.abc import Callable, Iterable, Mapping, Sequence
from enum import StrEnum
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from rich.console import Console

from qgpu.errors import RuleViolation
from qgpu.model import (
    DEFAULT_PLACEMENT,
    IsolationPolicy,
    PlacementPolicy,
    SliceRequest,
    parse_choice,
)

EXIT_INVALID = 2
EXIT_BROKEN_PIPE = 128 + 13  # what a shell reports for a filter killed by SIGPIPE
PIPE_WIDTH = 500  # columns of a rich console writing to a pipe or file: tables are never cut

# the request's fields (and their aliases) -> the flag a command line reads them from
REQUEST_FLAGS: dict[str, str] = {
    "core": "--core",
    "qgpu-core": "--core",
    "memory": "--memory",
    "memory_gib": "--memory",
    "qgpu-memory": "--memory",
    "isolation": "--isolation",
    "placement": "--placement",
    "gpu_placement": "--gpu-placement",
    "model": "--model",
}


def qgpu_version() -> str:
    """The installed distribution's version (``pyproject.toml``)."""
    try:
        return version("qgpu")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


class HelpFormatter(argparse.HelpFormatter):
    """Wraps each paragraph of a description on its own (indented lines, such as usage
    examples, are kept as written) and appends ``(default: X)`` to every option that has a
    default worth showing and does not state it already."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out = []
        for para in textwrap.dedent(text).strip("\n").split("\n\n"):
            lines = para.splitlines()
            if any(line[:1].isspace() for line in lines):
                out.append("\n".join(indent + line for line in lines))
            else:
                out.append(
                    textwrap.fill(
                        " ".join(line.strip() for line in lines),
                        width,
                        initial_indent=indent,
                        subsequent_indent=indent,
                    )
                )
        return "\n\n".join(out)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if text == argparse.SUPPRESS or "default" in text.lower():
            return text
        default = action.default
        if default is None or default is False or default is argparse.SUPPRESS:
            return text
        if isinstance(default, list | tuple) and not default:
            return text
        if action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"
        return text


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line and whose help shows defaults."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> Any:  # argparse's signature: NoReturn
        self.exit(EXIT_INVALID, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def add_version(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--version",
        action="version",
        version=f"%(prog)s {qgpu_version()}",
        help="print the version and exit",
    )


def _names(choices: Iterable[str] | type[StrEnum]) -> list[str]:
    return [c.value if isinstance(c, StrEnum) else str(c) for c in choices]


def choice(choices: Iterable[str] | type[StrEnum], flag: str) -> Callable[[str], str]:
    """An argparse ``type=`` for an enumerated option: the core's case rule, the canonical
    (lower-case) name back, and a one-line error naming the flag and the accepted names."""
    table = {n.lower(): n for n in _names(choices)}

    def parse(text: str) -> str:
        try:
            return parse_choice(text, table, flag)
        except RuleViolation as exc:
            raise argparse.ArgumentTypeError(f"{text!r} {exc.rule}") from None

    parse.__name__ = flag.lstrip("-")  # argparse names the type in some messages
    return parse


def isolation_choice(flag: str = "--isolation") -> Callable[[str], str]:
    """``--isolation``'s type: a full name or its abbreviation (``fs``), any case."""

    def parse(text: str) -> str:
        try:
            return IsolationPolicy.parse(text, flag).value
        except RuleViolation as exc:
            raise argparse.ArgumentTypeError(f"{text!r} {exc.rule}") from None

    parse.__name__ = flag.lstrip("-")
    return parse


def placement_choice(flag: str = "--placement") -> Callable[[str], str]:
    return choice(PlacementPolicy, flag)


ISOLATION_METAVAR = "|".join(p.value for p in IsolationPolicy)
PLACEMENT_METAVAR = "|".join(p.value for p in PlacementPolicy)
ISOLATION_HELP = (
    "how the slice's compute is capped (memory is always a hard cap): best-effort (be) "
    "has no compute cap, fixed-share (fs) is held to its qgpu-core, burst-share (bs) is "
    "held to it only while another slice of the GPU is busy"
)
PLACEMENT_HELP = (
    "where the slice lands: frag (fragmentation-aware), binpack (fullest first) or spread "
    f"(emptiest first) (default: {DEFAULT_PLACEMENT.value})"
)
# the one default every entry point that places slices names in its help
DEFAULT_PLACEMENT_HELP = f"(default: {DEFAULT_PLACEMENT.value}, qgpu's default placement)"


class _DeprecatedAlias(argparse.Action):
    """An old spelling of a flag: stores into the new flag's destination and says once, on
    stderr, which flag replaces it."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        self.replacement: str = kwargs.pop("replacement")
        kwargs.setdefault("default", argparse.SUPPRESS)
        kwargs.setdefault("help", argparse.SUPPRESS)
        super().__init__(option_strings, dest, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        print(
            f"{parser.prog}: warning: {option_string} is deprecated and will be removed in the "
            f"next release; use {self.replacement}",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, values)


def deprecated_alias(
    parser: argparse.ArgumentParser,
    old: str,
    replacement: str,
    dest: str,
    type: Callable[[str], Any] | None = None,
) -> None:
    """Accept `old` as a hidden, deprecated spelling of `replacement` (same destination)."""
    parser.add_argument(
        old, dest=dest, type=type, action=_DeprecatedAlias, replacement=replacement
    )


def add_isolation_option(
    parser: argparse.ArgumentParser,
    *,
    default: str | None = None,
    help: str = ISOLATION_HELP,
    old: Sequence[str] = (),
) -> None:
    """``--isolation`` (dest ``isolation``), plus deprecated spellings from `old`."""
    parser.add_argument(
        "--isolation",
        type=isolation_choice(),
        default=default,
        metavar=ISOLATION_METAVAR,
        help=help,
    )
    for spelling in old:
        deprecated_alias(parser, spelling, "--isolation", "isolation", isolation_choice(spelling))


def add_placement_options(
    parser: argparse.ArgumentParser,
    *,
    default: str | None = None,
    help: str = PLACEMENT_HELP,
    gpu: bool = True,
    gpu_help: str = "GPU-level placement inside the chosen node, if it differs from "
    "--placement (default: the same as --placement)",
    old: Sequence[str] = (),
    old_gpu: Sequence[str] = (),
) -> None:
    """``--placement`` (dest ``placement``) and, with `gpu`, ``--gpu-placement`` (dest
    ``gpu_placement``), plus deprecated spellings from `old` / `old_gpu`."""
    parser.add_argument(
        "--placement",
        type=placement_choice(),
        default=default,
        metavar=PLACEMENT_METAVAR,
        help=help,
    )
    for spelling in old:
        deprecated_alias(parser, spelling, "--placement", "placement", placement_choice(spelling))
    if not gpu:
        return
    parser.add_argument(
        "--gpu-placement",
        type=placement_choice("--gpu-placement"),
        metavar=PLACEMENT_METAVAR,
        help=gpu_help,
    )
    for spelling in old_gpu:
        deprecated_alias(
            parser, spelling, "--gpu-placement", "gpu_placement", placement_choice(spelling)
        )


def flag_violation(exc: RuleViolation, flags: Mapping[str, str]) -> RuleViolation:
    """`exc` renamed to the flag its field came from, when `flags` knows the field."""
    flag = flags.get(exc.field)
    return exc if flag is None else exc.renamed(flag)


def describe(exc: RuleViolation) -> str:
    """One line for a rule violation: ``--memory 90: rule`` when the field is a flag (the
    value as it would be typed), else ``field=value: rule``."""
    field = exc.field
    if field.startswith("--") and " " not in field:
        if exc.value is None:
            return f"{field}: {exc.rule}"
        shown = shlex.quote(exc.value) if isinstance(exc.value, str) else str(exc.value)
        return f"{field} {shown}: {exc.rule}"
    return str(exc)


def request_from_args(args: argparse.Namespace) -> SliceRequest:
    """A SliceRequest from ``--core``/``--memory``/``--isolation``/``--placement``/
    ``--gpu-placement``/``--model``; a broken rule names the flag."""
    raw: dict[str, object] = {"core": args.core}
    for key in ("memory", "isolation", "placement", "gpu_placement", "model"):
        value = getattr(args, key, None)
        if value is not None:
            raw[key] = value
    try:
        return SliceRequest.parse(raw)
    except RuleViolation as exc:
        raise flag_violation(exc, REQUEST_FLAGS) from exc


def stdout_console() -> Console:
    """A rich console for stdout: the terminal's width, or, in a pipe or file (unless
    ``COLUMNS`` says otherwise), wide enough that no table is cut or wrapped."""
    piped = not sys.stdout.isatty() and "COLUMNS" not in os.environ
    return Console(width=PIPE_WIDTH if piped else None)


def exit_code_of(main: Callable[[], int]) -> int:
    """Run a command's body; a reader that closed the pipe early (``| head``) ends it
    quietly with the shell's SIGPIPE status, and Ctrl-C with 130, never a traceback."""
    try:
        code = main()
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return code
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's last flush must not fail
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        return 130


__all__ = [
    "ISOLATION_HELP",
    "PLACEMENT_HELP",
    "REQUEST_FLAGS",
    "HelpFormatter",
    "Parser",
    "add_isolation_option",
    "add_placement_options",
    "add_version",
    "choice",
    "deprecated_alias",
    "describe",
    "exit_code_of",
    "flag_violation",
    "isolation_choice",
    "placement_choice",
    "qgpu_version",
    "request_from_args",
    "stdout_console",
]

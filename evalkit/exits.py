"""The exit-code contract (evalkit.errors) applied to a command's entry point, in one place."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable

from evalkit.errors import EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_USAGE, ConfigError

BUG = (
    "evalkit: internal error (a bug in evalkit, not in your input): please report it with the command and the "
    "traceback above"
)


def error(message: object) -> int:
    """Print a user error on stderr as `evalkit: error: ...` and return exit code 2."""
    print(f"evalkit: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def guarded(main: Callable[[], int | None]) -> int:
    """Run `main` and map what escapes it to the contract: ConfigError 2 (one line), Ctrl-C 130, any other
    exception 3 (traceback kept). SystemExit passes through with its own code."""
    try:
        return main() or 0
    except ConfigError as err:
        return error(err)
    except KeyboardInterrupt:
        print("evalkit: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception:  # noqa: BLE001 - anything else is a bug: keep its traceback, ask for a report
        return internal(traceback.format_exc())


def internal(trace: str) -> int:
    """Print a bug's traceback and the request for a report on stderr; return exit code 3."""
    print(f"{trace}{BUG}", file=sys.stderr)
    return EXIT_INTERNAL

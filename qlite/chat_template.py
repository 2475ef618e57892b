"""Chat templates come from strangers: rendered in Jinja's immutable sandbox (no attribute tricks, no
mutation of arguments), bounded in size, time, memory and output. A template longer than
MAX_TEMPLATE_CHARS, compiling or rendering past MAX_SECONDS of this thread's CPU time (so a busy
machine does not turn a template's own error into a timeout; WALL_SECONDS bounds the wall clock
too), an operation that would build a huge string, list or number, memory past MAX_EXTRA_BYTES, or
output past MAX_OUTPUT_CHARS is an error."""
from __future__ import annotations

import contextlib
import functools
import json
import re
import string
import sys
import time
from datetime import datetime

try:
    import resource
except ImportError:  # Windows
    pass

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from .errors import QliteError

MAX_SECONDS = 2.0  # of this thread's CPU time
WALL_SECONDS = 60.0  # of the wall clock, however busy the machine
MAX_TEMPLATE_CHARS = 256 << 10  # real chat templates, tools and all, are a few KB to a few tens of KB
MAX_OUTPUT_CHARS = 1 << 20  # a prompt is at most a context of tokens; this is far more
MAX_EXTRA_BYTES = 512 << 20  # address space the process may grow by while rendering
MAX_INT_ARG = 100_000  # widths, counts, repeats (Jinja's own range() bound)
MAX_INT_BITS = 4096
PRINTF_WIDTH = re.compile(r"%[-+ #0]*(\d*|\*)(?:\.(\d*|\*))?")


def _too_big(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and abs(n) > MAX_INT_ARG


def _sized(x) -> bool:
    return isinstance(x, (str, list, tuple))


def check_binop(op: str, left, right) -> None:
    """Refuse one operation that would build an oversized result before it is built."""
    if op == "*":
        for a, n in ((left, right), (right, left)):
            if _sized(a) and isinstance(n, int) and len(a) * max(n, 0) > MAX_OUTPUT_CHARS:
                raise SecurityError("repeats a sequence past the output bound")
        if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise SecurityError("multiplies numbers past the size bound")
    elif op == "**":
        if isinstance(left, int) and isinstance(right, int) and left.bit_length() * abs(right) > MAX_INT_BITS:
            raise SecurityError("raises a number past the size bound")
    elif op == "+" and _sized(left) and _sized(right) and len(left) + len(right) > MAX_OUTPUT_CHARS:
        raise SecurityError("concatenates past the output bound")
    elif op == "%" and isinstance(left, str):
        widths = [w for spec in PRINTF_WIDTH.findall(left) for w in spec if w.isdigit()]
        if any(int(w) > MAX_INT_ARG for w in widths) or any(map(_too_big, right if isinstance(right, tuple) else (right,))):
            raise SecurityError("formats a field past the size bound")


def check_args(args, kwargs) -> None:
    if any(map(_too_big, (*args, *kwargs.values()))):
        raise SecurityError(f"an argument is larger than {MAX_INT_ARG}")


def _bounded_filter(f):
    """A filter whose integer arguments (widths, counts) are bounded."""
    @functools.wraps(f)  # keeps the pass_context / pass_environment marks
    def checked(*args, **kwargs):
        check_args(args[1:], kwargs)
        return f(*args, **kwargs)
    return checked


class BoundedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self):
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        self.filters = {name: _bounded_filter(f) for name, f in self.filters.items()}
        self.filters["format"] = _bounded_filter(lambda value, *args, **kwargs: self.call_binop(
            None, "%", str(value), kwargs or args))
        self.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, **_: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii)
        self.globals.pop("lipsum", None)
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)

    def call_binop(self, context, operator, left, right):
        check_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's signature)
        check_args(args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value):
        """str.format / format_map, refused when a field's width or precision is past the bound."""
        formatter = super().wrap_str_format(value)
        if formatter is not None:
            for _, _, spec, _ in string.Formatter().parse(value.__self__):
                if spec and any(int(w) > MAX_INT_ARG for w in re.findall(r"\d+", spec)):
                    raise SecurityError("formats a field past the size bound")
        return formatter


def _raise_exception(message):
    raise TemplateError(message)


@contextlib.contextmanager
def memory_headroom(extra: int):
    """Allocations past the process's current address space plus `extra` fail with MemoryError
    while inside (Linux; elsewhere the explicit size checks are the bound)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            mapped = int(f.read().split()[0]) * resource.getpagesize()
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    except (OSError, NameError):
        yield
        return
    limit = mapped + extra
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@contextlib.contextmanager
def time_bound(seconds: float | None = None):
    """Inside, this thread's Python code stops with SecurityError past `seconds` of its CPU time (or
    WALL_SECONDS of the wall clock): a tracer on this thread only checks the clocks every 64 steps,
    so a loop cannot run on, whatever it does."""
    seconds = MAX_SECONDS if seconds is None else seconds
    cpu_deadline, wall_deadline = time.thread_time() + seconds, time.monotonic() + WALL_SECONDS
    steps = 0

    def trace(frame, event, arg):
        nonlocal steps
        steps += 1
        if not steps & 63:
            if time.thread_time() > cpu_deadline:
                raise SecurityError(f"took longer than {seconds:g} s")
            if time.monotonic() > wall_deadline:
                raise SecurityError(f"took longer than {WALL_SECONDS:g} s on the wall clock")
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        yield
    finally:
        sys.settrace(previous)


def render_bounded(template, seconds: float | None = None, max_output: int = MAX_OUTPUT_CHARS, **context) -> str:
    """Render within the time, memory and output bounds: time by time_bound; memory by an
    address-space limit while rendering; output as it is produced."""
    pieces, size = [], 0
    with memory_headroom(MAX_EXTRA_BYTES), time_bound(seconds):
        for piece in template.generate(**context):
            size += len(piece)
            if size > max_output:
                raise SecurityError(f"output passed {max_output} characters")
            pieces.append(piece)
    return "".join(pieces)


class ChatTemplate:
    def __init__(self, source: str, origin: str):
        self.origin = origin  # the file it came from, for messages
        if len(source) > MAX_TEMPLATE_CHARS:
            raise QliteError(f"{origin}: chat template is {len(source)} characters, more than the "
                             f"{MAX_TEMPLATE_CHARS} a template may be")
        try:
            with time_bound():
                self.template = BoundedSandbox().from_string(source)
        except SecurityError as e:
            raise QliteError(f"{origin}: chat template refused: compiling it {e}") from None
        except TemplateError as e:
            raise QliteError(f"{origin}: chat template does not compile: {e}") from None
        except RecursionError:
            raise QliteError(f"{origin}: chat template does not compile: nested too deeply") from None

    def render(self, **context) -> str:
        """The output bound is MAX_OUTPUT_CHARS beyond twice what the messages hold: a long message is
        the user's (the context check names it), not the template's doing."""
        given = sum(len(m.get("content") or "") for m in context.get("messages") or () if isinstance(m, dict)
                    and isinstance(m.get("content") or "", str))
        try:
            return render_bounded(self.template, max_output=MAX_OUTPUT_CHARS + 2 * given, **context)
        except SecurityError as e:
            raise QliteError(f"{self.origin}: chat template refused: {e}") from None
        except TemplateError as e:
            raise QliteError(f"{self.origin}: chat template failed: {e}") from None
        except MemoryError:
            raise QliteError(f"{self.origin}: chat template refused: needs more than {MAX_EXTRA_BYTES >> 20} MiB") from None
        except (RecursionError, ArithmeticError, ValueError, TypeError) as e:
            raise QliteError(f"{self.origin}: chat template failed: {type(e).__name__}: {e}") from None

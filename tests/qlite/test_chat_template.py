"""Chat templates render as Jinja does, within time, memory and output bounds."""
import json
import time

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from qlite.chat_template import ChatTemplate
from qlite.errors import QliteError
from tiny_models import CHAT_TEMPLATE

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo {{ 1 }}"}]
TOOLS_TEMPLATE = ("{%- if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}"
                  "{{ '%-6s|' | format(m.role) }}{{ '{:>3}'.format(loop.index) }}{{ m.content | center(12) }}"
                  "{% endfor %}{{ strftime_now('%Y') | length }}")


@pytest.mark.parametrize("source", [CHAT_TEMPLATE, TOOLS_TEMPLATE])
def test_renders_as_jinja_does(source):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)
    env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
    tools = [{"name": "f"}]
    expected = env.from_string(source).render(messages=MESSAGES, add_generation_prompt=True, tools=tools)
    assert ChatTemplate(source, "t").render(messages=MESSAGES, add_generation_prompt=True, tools=tools) == expected


HOSTILE = {
    "a loop of 1e10 steps": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                             "took longer than"),
    "a huge repeat": ("{{ 'x' * 10000000000 }}", "repeats a sequence"),
    "a huge list": ("{{ 10000000000 * [1] }}", "repeats a sequence"),
    "a huge power": ("{{ 10 ** 100000000 }}", "raises a number"),
    "squaring in a loop": ("{% set ns = namespace(n=2) %}{% for i in range(64) %}{% set ns.n = ns.n * ns.n %}"
                           "{% endfor %}", "multiplies numbers"),
    "a wide str method": ("{{ 'x'.ljust(10000000000) }}", "argument is larger"),
    "a wide filter": ("{{ 'x' | center(10000000000) }}", "argument is larger"),
    "a wide printf field": ("{{ '%10000000000d' % 1 }}", "formats a field"),
    "a wide printf * field": ("{{ '%*d' % (10000000000, 1) }}", "formats a field"),
    "a wide format field": ("{{ '{:10000000000}'.format(1) }}", "formats a field"),
    "a wide format filter": ("{{ '%10000000000d' | format(1) }}", "formats a field"),
    "doubling by concatenation": ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                                  "{% endfor %}", "needs more than"),
    "a product of join": ("{{ range(100000) | join(',' * 100000) }}", "needs more than"),
    "too much output": ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "output passed"),
    "endless recursion": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "RecursionError"),
    "lipsum, not given": ("{{ lipsum(5) }}", "undefined"),
    "an attribute trick": ("{{ ''.__class__.__mro__ }}", "unsafe|undefined"),
    "raise_exception": ("{{ raise_exception('no system role') }}", "no system role"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_templates_are_a_clear_error_in_bounded_time(name):
    source, message = HOSTILE[name]
    t0 = time.monotonic()
    with pytest.raises(QliteError, match=rf"^tokenizer_config.json: chat template .*({message})"):
        ChatTemplate(source, "tokenizer_config.json").render(messages=MESSAGES)
    assert time.monotonic() - t0 < 60  # CPU time is the bound (2 s); the wall clock's slack is a busy CI's
    assert ChatTemplate(CHAT_TEMPLATE, "t").render(messages=MESSAGES)  # the process is left as it was


def test_hostile_templates_keep_their_own_message_on_a_busy_machine(monkeypatch):
    """Under load (other processes taking the CPU) the wall clock runs on while this thread waits: the
    bound is this thread's CPU time, so a recursion or memory error is still reported as itself."""
    import qlite.chat_template as ct

    wall = iter(range(10**9))
    monkeypatch.setattr(ct.time, "monotonic", lambda: next(wall) * 0.005)  # 5 ms of wall clock per check: a
    # machine so loaded that a 2 s wall-clock bound would fire within 400 checks
    for name in ("endless recursion", "doubling by concatenation"):
        source, message = HOSTILE[name]
        with pytest.raises(QliteError, match=message):
            ChatTemplate(source, "t").render(messages=MESSAGES)


def test_an_oversized_template_is_refused_before_compiling():
    t0 = time.monotonic()
    with pytest.raises(QliteError, match=r"^t.jinja: chat template is 21000000 characters, more than the 262144"):
        ChatTemplate("x" * 21_000_000, "t.jinja")
    assert time.monotonic() - t0 < 5


def test_compiling_is_time_bounded(monkeypatch):
    import qlite.chat_template as ct

    monkeypatch.setattr(ct, "MAX_SECONDS", 0.0)
    with pytest.raises(QliteError, match=r"^t.jinja: chat template refused: compiling it took longer than 0 s"):
        ChatTemplate("{{ 1 }}" * 2000, "t.jinja")


def test_a_template_that_does_not_compile():
    with pytest.raises(QliteError, match="^t.jinja: chat template does not compile"):
        ChatTemplate("{% for %}", "t.jinja")

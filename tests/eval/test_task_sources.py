"""The suite builder on a small sdist written here: which functions become tasks, which tests go with
them, and the soundness check that keeps only tasks whose reference passes and whose bare stub fails."""
import subprocess
import textwrap

import pytest

from eval import task_sources
from eval.code_tasks import Task, dump_tasks, load_tasks
from eval.sandbox import run_python
from eval.task_sources import Source, passing, sound, tasks_from_sdist
from qlite.errors import QliteError

SOURCE = Source("pkg", "1.0", "pkg", "MIT")
FILES = {
    "pkg/__init__.py": "from .text import *\nfrom .nums import *\n",
    "pkg/text.py": '''
        import re
        from collections import Counter
        from .nums import double

        _WORD = re.compile(r"[a-z]+")

        def _words(text):
            return _WORD.findall(text.lower())

        def top_word(text):
            """The most common word of text, lower-cased."""
            return Counter(_words(text)).most_common(1)[0][0]

        def twice_len(text):
            """Twice the length of text."""
            return double(len(text))

        def no_doc(text):
            return text

        def dup(x):
            """Defined here."""
            return x
        ''',
    "pkg/nums.py": '''
        def double(x):
            """2 * x."""
            return 2 * x

        def is_even(n):
            """True when n is even."""
            return n % 2 == 0

        def wrong(n):
            """Claims n + 1, returns n."""
            return n

        def dup(x):
            """Defined again."""
            return x
        ''',
    "tests/test_text.py": '''
        import unittest
        import pytest
        import pkg as p
        from pkg import top_word as tw, double, is_even, wrong

        HELPER = 3

        class TopWordTests(unittest.TestCase):
            def test_counts(self):
                self.assertEqual(p.top_word("b a B"), "b")

            def test_alias(self):
                self.assertEqual(tw("x y y"), "y")

            def test_two_functions(self):
                self.assertEqual(double(1), is_even(2) + 1)

            def test_uses_a_module_name(self):
                self.assertEqual(double(HELPER), 6)

        class WithFixture(unittest.TestCase):
            def setUp(self):
                self.n = 2

            def test_fixture(self):
                self.assertEqual(double(self.n), 4)

        def test_double():
            assert double(3) == 6

        def test_is_even():
            assert is_even(4) and not is_even(3)

        def test_even_raises_with_pytest():
            with pytest.raises(TypeError):
                is_even(None)

        def test_wrong():
            assert wrong(1) == 2
        ''',
}


@pytest.fixture
def sdist(tmp_path):
    for name, text in FILES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(textwrap.dedent(text))
    return tmp_path


def test_tasks_are_documented_functions_with_tests_that_call_only_them(sdist):
    tasks = {t.entry: t for t in tasks_from_sdist(sdist, SOURCE)}
    # no_doc has no docstring, twice_len leans on another module, dup is defined twice, and no test calls them
    assert sorted(tasks) == ["double", "is_even", "top_word", "wrong"]
    top = tasks["top_word"]
    assert top.name == "pkg/top_word"
    # the stdlib imports it uses and the module's helpers it leans on come before the stub
    assert top.prompt.startswith("from collections import Counter\nimport re\n\n_WORD = re.compile(")
    assert "def _words(text):" in top.prompt and top.prompt.endswith('"""The most common word of text, lower-cased."""')
    assert top.solution.strip() == "return Counter(_words(text)).most_common(1)[0][0]"
    # both aliases resolve; the test calling two functions, the one using a module constant, the one
    # with a fixture and the one needing pytest (not in the sandbox) are left out
    assert "test_counts" in top.tests and "test_alias" in top.tests and "tw(" not in top.tests
    double = tasks["double"].tests
    assert "def test_double" in double and "test_two_functions" not in double and "HELPER" not in double
    assert "setUp" not in double and "pytest" not in tasks["is_even"].tests


def test_scripts_run_every_test_and_the_soundness_check_filters(sdist):
    tasks = {t.entry: t for t in tasks_from_sdist(sdist, SOURCE)}
    for entry in ("top_word", "double", "is_even"):
        assert sound(tasks[entry]), entry
    assert not sound(tasks["wrong"])  # its reference fails its own test
    broken = Task("x", "top_word", tasks["top_word"].prompt, tasks["top_word"].tests + "assert False\n",
                  tasks["top_word"].solution)
    assert not run_python(broken.reference + "\n\n" + broken.tests).passed
    vacuous = Task("v", "double", tasks["double"].prompt, "assert True\n", tasks["double"].solution)
    assert not sound(vacuous)  # a stub of `pass` passes it: it tests nothing
    assert [t.entry for t in passing(list(tasks.values()) + [vacuous])] == ["double", "is_even", "top_word"]


def test_a_failing_download_is_one_line_naming_the_pin(tmp_path, monkeypatch):
    monkeypatch.setattr(task_sources.subprocess, "run",
                        lambda *a, **k: subprocess.CompletedProcess(a, 1, "", "warning\nERROR: No matching distribution\n"))
    with pytest.raises(QliteError, match=r"^--tasks suite: pip could not download pkg==1.0: ERROR: No matching"):
        task_sources.unpack_sdist(SOURCE, tmp_path)


def test_the_suite_is_read_from_the_cache_once_built(sdist, tmp_path, monkeypatch):
    monkeypatch.setenv("QLITE_CACHE", str(tmp_path / "cache"))
    built = passing(tasks_from_sdist(sdist, SOURCE))
    monkeypatch.setattr(task_sources, "build_suite", lambda out: dump_tasks(built, out) or built)
    task_sources.suite_path().parent.mkdir(parents=True)
    assert task_sources.tasks_named("suite") == built
    monkeypatch.setattr(task_sources, "build_suite", lambda out: pytest.fail("rebuilt"))
    assert task_sources.tasks_named("suite") == built
    assert task_sources.tasks_named("builtin") == load_tasks("builtin")

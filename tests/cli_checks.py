"""Running qlite's CLI in-process in tests, and what every user-facing failure must look like."""
from qlite.cli import main


def run_cli(capsys, *args):
    """(exit code, stdout, stderr) of `qlite ARGS`."""
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code, err, *needles):
    """A non-zero exit and one line on stderr, `error: ...`, holding every needle."""
    assert code != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for n in needles:
        assert n in lines[0], lines[0]

"""PythonREPL's sandbox: escapes are refused or killed and reported; normal code works; the agent carries on."""

from __future__ import annotations

import time

import pytest

from opentinker.llm import LangChainAgent, PythonREPL, SandboxLimits, run_python

LIMITS = SandboxLimits(wall_time_s=3, memory_mb=512, max_output_chars=2000)


def test_plain_code_runs_and_echoes_last_expression():
    result = run_python("x = sum(range(10))\nprint('hello')\nx * 2", LIMITS)
    assert result.ok, result.report()
    assert result.output.split() == ["hello", "90"]


def test_writes_inside_the_sandbox_dir_work():
    result = run_python("open('notes.txt', 'w').write('kept'); open('notes.txt').read()", LIMITS)
    assert result.ok and "'kept'" in result.output


@pytest.mark.parametrize(
    "code, expected",
    [
        ("open('/etc/hostname').read()", "outside the sandbox directory"),
        ("open('../escape.txt', 'w').write('x')", "outside the sandbox directory"),
        ("import os; os.listdir('/')", "outside the sandbox directory"),
        ("import socket; socket.socket()", "socket.__new__ is not allowed"),
        ("import urllib.request; urllib.request.urlopen('http://127.0.0.1:9')", "not allowed"),
        ("import subprocess; subprocess.run(['echo', 'hi'])", "subprocess.Popen is not allowed"),
        ("import os\nwhile True: os.fork()", "os.fork is not allowed"),
        ("import ctypes; ctypes.CDLL(None).getpid()", "not allowed"),
    ],
)
def test_escape_attempts_are_refused_and_reported(code, expected):
    result = run_python(code, LIMITS)
    assert not result.ok
    assert expected in result.report(), result.report()


def test_infinite_loop_is_killed_at_the_wall_time_limit():
    started = time.monotonic()
    result = run_python("while True:\n    pass", LIMITS)
    assert result.timed_out and "wall-time limit" in result.report()
    assert time.monotonic() - started < LIMITS.wall_time_s + 5


def test_memory_limit_raises_memory_error_in_the_child():
    result = run_python("block = bytearray(2_000_000_000)", LIMITS)
    assert not result.ok and "MemoryError" in result.report()


def test_output_is_capped():
    result = run_python("while True:\n    print('y' * 10_000)", LIMITS)
    assert result.truncated and len(result.output) <= LIMITS.max_output_chars
    assert "[output truncated]" in result.report()


def test_limits_are_validated():
    with pytest.raises(ValueError, match="wall_time_s"):
        SandboxLimits(wall_time_s=0)


def test_agent_keeps_working_after_an_escape_attempt(tmp_path):
    agent = LangChainAgent("scripted", [PythonREPL(limits=LIMITS)], checkpointer=tmp_path / "t.sqlite")
    try:
        refused = agent.chat('/python_repl {"code": "open(\'/etc/hostname\').read()"}')
        assert refused.tool_calls[0].name == "python_repl"
        assert "outside the sandbox directory" in refused.tool_calls[0].content
        fine = agent.chat('/python_repl {"code": "6 * 7"}')
        assert fine.tool_calls[0].content == "42" and "42" in fine.text
    finally:
        agent.close()

"""Loaded by ``python -m bench.opcodes`` into the process it measures (this directory goes
first on that process's ``PYTHONPATH``): counts the Python bytecode instructions the event
loop's thread executes, per function, between SIGUSR1 and SIGUSR2.

Nothing happens unless ``BENCH_OPCOUNT_FILE`` names where the counts go. On SIGUSR1 the
main thread's trace function is set (``sys.settrace``, ``f_trace_opcodes`` on every
frame); on SIGUSR2 it is cleared and the counts are written as JSON rows
``[file, function, first line, instructions, calls]``. A coroutine's every resumption is
a "call" to the tracer, so calls count steps of coroutines, not awaits of them.

With ``BENCH_OPCOUNT_LINES`` set, the functions of files whose path holds that text are
also counted line by line: rows ``[file, function, first line, instructions, 0, line]``
follow the functions' (``python -m bench.opcodes --lines``).
"""

from __future__ import annotations

import os

_OUT = os.environ.get("BENCH_OPCOUNT_FILE")
_LINES = os.environ.get("BENCH_OPCOUNT_LINES")

if _OUT:
    import json
    import signal
    import sys
    from collections import Counter
    from types import FrameType
    from typing import Any

    _instructions: Counter[tuple[str, str, int]] = Counter()
    _calls: Counter[tuple[str, str, int]] = Counter()
    #: (file, function, first line, line) → instructions, for the files ``_LINES`` names.
    _by_line: Counter[tuple[str, str, int, int]] = Counter()

    def _key(frame: FrameType) -> tuple[str, str, int]:
        code = frame.f_code
        if code.co_filename == "<string>":  # generated code (dataclass __init__): name the class
            owner = frame.f_locals.get("self")
            return f"<string>:{type(owner).__name__}", code.co_name, code.co_firstlineno
        return code.co_filename, code.co_name, code.co_firstlineno

    def _tracer(frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename == __file__:  # the SIGUSR2 handler itself
            return None
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        key = _key(frame)
        _calls[key] += 1

        if _LINES and _LINES in key[0]:

            def count_lines(frame: FrameType, event: str, arg: Any) -> Any:
                if event == "opcode":
                    _instructions[key] += 1
                    _by_line[(*key, frame.f_lineno)] += 1
                return count_lines

            return count_lines

        def count(frame: FrameType, event: str, arg: Any) -> Any:
            if event == "opcode":
                _instructions[key] += 1
            return count

        return count

    def _start(signum: int, frame: Any) -> None:
        _instructions.clear()
        _calls.clear()
        _by_line.clear()
        sys.settrace(_tracer)

    def _stop(signum: int, frame: Any) -> None:
        sys.settrace(None)
        rows: list[list[Any]] = [[*key, _instructions[key], calls] for key, calls in _calls.items()]
        rows += [[*key[:3], count, 0, key[3]] for key, count in _by_line.items()]
        tmp = f"{_OUT}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(rows, fh)
        os.replace(tmp, _OUT)

    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _stop)

"""moaspec/signals.py: Ctrl-C and SIGTERM held over a block, delivered after it."""

from __future__ import annotations

import signal
import threading

import pytest

from moaspec.signals import signals_held


def test_ctrl_c_inside_the_block_is_raised_after_it() -> None:
    reached_the_end = False
    with pytest.raises(KeyboardInterrupt):
        with signals_held():
            signal.raise_signal(signal.SIGINT)
            reached_the_end = True  # not interrupted here
    assert reached_the_end and signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_sigterm_reaches_the_handler_in_place_after_the_block() -> None:
    calls: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda number, frame: calls.append(number))
    try:
        with signals_held():
            signal.raise_signal(signal.SIGTERM)
            assert calls == []
        assert calls == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_block_without_signals_and_other_threads_are_left_alone() -> None:
    with signals_held():
        pass
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    seen: list[object] = []

    def in_a_thread() -> None:  # handlers can only be set on the main thread: nothing is changed
        with signals_held():
            seen.append(signal.getsignal(signal.SIGINT))

    worker = threading.Thread(target=in_a_thread)
    worker.start()
    worker.join(timeout=10)
    assert seen == [signal.default_int_handler]


def test_the_library_is_loaded_with_signals_held() -> None:
    import sys

    from moaspec.signals import load_library_held

    load_library_held()
    assert "torch" in sys.modules and signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_block_run_while_the_interpreter_exits_is_quiet() -> None:
    """Bug: a llama.cpp target freed at exit (its __del__ holds signals around llama_free) printed
    a TypeError traceback: the handlers were already gone and could not be put back."""
    import subprocess
    import sys

    code = (
        "from moaspec.signals import signals_held\n"
        "class FreedAtExit:\n"
        "    def __del__(self):\n"
        "        with signals_held():\n"
        "            pass\n"
        "kept = FreedAtExit()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stderr == ""


def test_sigterm_with_the_default_handler_is_delivered_after_the_block() -> None:
    """SIGTERM left at its default action (a library caller that installed no handler) is held
    over the block, then ends the process as it would have: the rest of the block runs, nothing after."""
    import subprocess
    import sys

    code = (
        "import signal\n"
        "from moaspec.signals import signals_held\n"
        "with signals_held():\n"
        "    signal.raise_signal(signal.SIGTERM)\n"
        "    print('block done', flush=True)\n"
        "print('after the block', flush=True)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGTERM and proc.stdout == "block done\n", (proc.returncode, proc.stderr)


def test_an_application_signal_handler_runs_after_the_block_in_the_order_signals_came() -> None:
    """Bug: only Ctrl-C and SIGTERM were held. An application's own handler (a SIGALRM time-out
    raising TimeoutError) ran inside llama.cpp's eval callback, where ctypes swallowed the
    exception: the decode stopped part-way and the call returned wrong text without an error."""
    calls: list[int] = []

    def time_out(number, frame) -> None:
        calls.append(number)
        raise TimeoutError("the application's time-out")

    previous = {
        signal.SIGALRM: signal.signal(signal.SIGALRM, time_out),
        signal.SIGUSR1: signal.signal(signal.SIGUSR1, lambda number, frame: calls.append(number)),
    }
    try:
        reached_the_end = False
        with pytest.raises(TimeoutError):
            with signals_held():
                signal.raise_signal(signal.SIGUSR1)
                signal.raise_signal(signal.SIGALRM)
                signal.raise_signal(signal.SIGUSR1)
                reached_the_end = True  # not interrupted here
        assert reached_the_end and calls == [signal.SIGUSR1, signal.SIGALRM]
        assert signal.getsignal(signal.SIGALRM) is time_out
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def test_held_signals_are_delivered_once_each_in_arrival_order_not_by_number() -> None:
    calls: list[int] = []
    numbers = (signal.SIGALRM, signal.SIGUSR1, signal.SIGUSR2)
    previous = {number: signal.signal(number, lambda number, frame: calls.append(number)) for number in numbers}
    try:
        with signals_held():
            for number in (signal.SIGALRM, signal.SIGUSR1, signal.SIGUSR1, signal.SIGUSR2):
                signal.raise_signal(number)
            assert calls == []
        assert calls == [signal.SIGALRM, signal.SIGUSR1, signal.SIGUSR2]
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def test_signals_under_their_c_level_actions_are_left_alone() -> None:
    previous = signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    try:
        with signals_held():
            assert signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN
            signal.raise_signal(signal.SIGUSR2)  # ignored by the system, now as later
    finally:
        signal.signal(signal.SIGUSR2, previous)

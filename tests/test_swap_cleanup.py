"""Swap folders never outlive their run: SIGTERM/SIGINT remove them (and still end the process
the way the signal asks), and a run that died without cleaning up is swept by the next run on
the same nvme_path, while folders of live processes, other hosts and other programs stay."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
import torch
from support.children import next_line, start_python

from zero_offload.swap.runs import OWNER_FILE
from zero_offload.swap.swapper import Swapper

REPO = Path(__file__).resolve().parents[1]
T = 120  # seconds for a child to import torch and get ready on a loaded machine

PRELUDE = """
import os, signal, sys, time, torch
from zero_offload.swap.swapper import Swapper
def ready(*words):
    print(*words, flush=True)
"""


def _start(code: str) -> subprocess.Popen:
    return start_python(PRELUDE + textwrap.dedent(code))


def _line(proc: subprocess.Popen) -> str:
    return next_line(proc, T)


def _finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=T)
    return proc.returncode, out, err


def _swapper(path: Path) -> Swapper:
    return Swapper(path, 1 << 20, buffer_count=2, host_memory_limit=1 << 30, acquire_timeout=10.0)


def _dead_pid() -> int:
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(done.stdout)


def _fake_rank_dir(nvme: Path, run: str, owner: dict | None, nbytes: int = 1 << 20) -> Path:
    rank_dir = nvme / run / "rank0"
    rank_dir.mkdir(parents=True)
    (rank_dir / "000000-state.swp").write_bytes(b"\1" * nbytes)
    if owner is not None:
        (rank_dir / OWNER_FILE).write_text(json.dumps(owner))
    return rank_dir


def test_sigterm_removes_the_folder_and_the_process_still_dies_by_it(tmp_path: Path) -> None:
    proc = _start(f"""
        s = Swapper({str(tmp_path)!r}, 1 << 20, host_memory_limit=1 << 30)
        s.swap_out("m", torch.ones(1 << 18)).result()
        ready(s.rank_dir)
        time.sleep({T})
    """)
    rank_dir = Path(_line(proc))
    assert rank_dir.is_dir() and list(rank_dir.glob("*.swp"))
    owner = json.loads((rank_dir / OWNER_FILE).read_text())  # the folder records its owner
    assert owner["pid"] == proc.pid and owner["host"] == socket.gethostname()
    assert abs(owner["start_time"] - psutil.Process(proc.pid).create_time()) < 1.0
    proc.send_signal(signal.SIGTERM)
    rc, _, err = _finish(proc)
    assert rc == -signal.SIGTERM, err  # the default action still happens: killed by SIGTERM
    assert not rank_dir.exists() and list(tmp_path.iterdir()) == []


def test_users_sigterm_handler_runs_and_the_run_keeps_its_files(tmp_path: Path) -> None:
    """A handler that asks the loop to stop (and, say, save a checkpoint) needs the swap files:
    they stay until the process ends, then go with it."""
    proc = _start(f"""
        stop = []
        signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))
        s = Swapper({str(tmp_path)!r}, 1 << 20, host_memory_limit=1 << 30)
        s.swap_out("m", torch.full((1 << 18,), 3.0)).result()
        ready(s.rank_dir)
        while not stop:
            time.sleep(0.01)
        ready("handler ran", stop[0], float(s.swap_in("m").result().sum()))
        sys.exit(3)
    """)
    rank_dir = Path(_line(proc))
    proc.send_signal(signal.SIGTERM)
    assert _line(proc).split() == ["handler", "ran", str(int(signal.SIGTERM)), str(3.0 * (1 << 18))]
    rc, _, err = _finish(proc)
    assert rc == 3, err
    assert not rank_dir.exists() and list(tmp_path.iterdir()) == []


def test_handler_installed_later_that_chains_to_ours_keeps_its_behaviour(tmp_path: Path) -> None:
    """Frameworks install their SIGTERM handler after the engine and call the previous one when
    it is callable (they skip SIG_DFL). Ours, standing in for SIG_DFL, must then not kill."""
    proc = _start(f"""
        s = Swapper({str(tmp_path)!r}, 1 << 20, host_memory_limit=1 << 30)
        s.swap_out("m", torch.full((1 << 18,), 4.0)).result()
        previous, stop = signal.getsignal(signal.SIGTERM), []
        def graceful(signum, frame):
            stop.append(signum)
            if callable(previous):
                previous(signum, frame)
        signal.signal(signal.SIGTERM, graceful)
        ready(s.rank_dir)
        while not stop:
            time.sleep(0.01)
        ready("saving", float(s.swap_in("m").result().sum()))
    """)
    rank_dir = Path(_line(proc))
    proc.send_signal(signal.SIGTERM)
    assert _line(proc).split() == ["saving", str(4.0 * (1 << 18))]
    rc, _, err = _finish(proc)
    assert rc == 0, err
    assert not rank_dir.exists() and list(tmp_path.iterdir()) == []


def test_keyboard_interrupt_still_works_and_files_go_at_exit(tmp_path: Path) -> None:
    proc = _start(f"""
        s = Swapper({str(tmp_path)!r}, 1 << 20, host_memory_limit=1 << 30)
        s.swap_out("m", torch.full((1 << 18,), 2.0)).result()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        try:  # the ready line is inside: Ctrl-C may come the moment it is printed
            ready(s.rank_dir)
            time.sleep({T})
        except KeyboardInterrupt:  # a notebook cell interrupted: the run goes on
            ready("caught", float(s.swap_in("m").result().sum()))
        time.sleep({T})  # the next Ctrl-C is not caught
    """)
    rank_dir = Path(_line(proc))
    proc.send_signal(signal.SIGINT)
    assert _line(proc).split() == ["caught", str(2.0 * (1 << 18))]
    assert rank_dir.exists()
    proc.send_signal(signal.SIGINT)
    rc, _, err = _finish(proc)
    assert rc == -signal.SIGINT and "KeyboardInterrupt" in err, err
    assert not rank_dir.exists() and list(tmp_path.iterdir()) == []


def test_sigint_left_to_its_default_action_removes_the_folder(tmp_path: Path) -> None:
    proc = _start(f"""
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # as some launchers leave it
        s = Swapper({str(tmp_path)!r}, 1 << 20, host_memory_limit=1 << 30)
        s.swap_out("m", torch.ones(1 << 18)).result()
        ready(s.rank_dir)
        time.sleep({T})
    """)
    rank_dir = Path(_line(proc))
    proc.send_signal(signal.SIGINT)
    rc, _, err = _finish(proc)
    assert rc == -signal.SIGINT, err
    assert not rank_dir.exists() and list(tmp_path.iterdir()) == []


def test_forked_child_killed_by_sigterm_leaves_its_parents_files(tmp_path: Path) -> None:
    """A forked worker (a DataLoader's, say) inherits the handler but not the folder."""
    proc = _start(f"""
        s = Swapper({str(tmp_path)!r}, 1 << 20, host_memory_limit=1 << 30)
        s.swap_out("m", torch.full((1 << 18,), 5.0)).result()
        pid = os.fork()
        if pid == 0:
            time.sleep({T})
            os._exit(0)
        time.sleep(0.5)
        os.kill(pid, signal.SIGTERM)
        _, status = os.waitpid(pid, 0)
        ready(os.WIFSIGNALED(status) and os.WTERMSIG(status), s.rank_dir.exists(),
              float(s.swap_in("m").result().sum()))
        s.close()
    """)
    assert _line(proc).split() == [str(int(signal.SIGTERM)), "True", str(5.0 * (1 << 18))]
    rc, _, err = _finish(proc)
    assert rc == 0, err
    assert list(tmp_path.iterdir()) == []


def test_handlers_installed_from_the_main_thread_only_and_put_back() -> None:
    proc = _start("""
        import tempfile, threading
        path = tempfile.mkdtemp()
        made = []
        th = threading.Thread(
            target=lambda: made.append(Swapper(path, 1 << 20, host_memory_limit=1 << 30))
        )
        th.start(); th.join()
        ready("thread", signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
        s = Swapper(path, 1 << 20, host_memory_limit=1 << 30)
        ready("main", signal.getsignal(signal.SIGTERM) != signal.SIG_DFL,
              signal.getsignal(signal.SIGINT) is signal.default_int_handler)
        s.close(); made[0].close()
        ready("closed", signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, os.listdir(path) == [])
    """)
    assert _line(proc) == "thread True"
    assert _line(proc) == "main True True"
    assert _line(proc) == "closed True True"
    rc, _, err = _finish(proc)
    assert rc == 0, err


def test_sigkilled_runs_folder_is_removed_by_the_next_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    proc = _start(f"""
        s = Swapper({str(tmp_path)!r}, 4 << 20, host_memory_limit=1 << 30)
        s.swap_out("m", torch.ones(1 << 20)).result()  # 4 MiB
        ready(s.rank_dir)
        time.sleep({T})
    """)
    rank_dir = Path(_line(proc))
    proc.kill()
    proc.wait(T)
    assert rank_dir.exists()  # nothing runs on SIGKILL
    with caplog.at_level(logging.WARNING, logger="zero_offload.swap.runs"):
        sw = _swapper(tmp_path)
    try:
        assert not rank_dir.exists() and not rank_dir.parent.exists()
        assert [p.name for p in tmp_path.iterdir()] == [sw.run_id]
        msg = " ".join(r.getMessage() for r in caplog.records)
        assert f"pid {proc.pid}" in msg and "freed" in msg
        freed = int(msg.split("freed ")[1].split()[0])
        assert freed >= 4 << 20
    finally:
        sw.close()


def test_folders_of_dead_owners_go_others_stay(tmp_path: Path) -> None:
    me = psutil.Process()
    host = socket.gethostname()
    dead = _fake_rank_dir(tmp_path, "dead", {"host": host, "pid": _dead_pid(), "start_time": 1.0})
    reused = _fake_rank_dir(
        tmp_path,
        "reused",  # our pid, but an older process had it
        {"host": host, "pid": os.getpid(), "start_time": me.create_time() - 1000},
    )
    live = _fake_rank_dir(
        tmp_path, "live", {"host": host, "pid": os.getpid(), "start_time": me.create_time()}
    )
    other_host = _fake_rank_dir(
        tmp_path,
        "other-host",
        {"host": "another-node.example", "pid": _dead_pid(), "start_time": 1.0},
    )
    unowned = _fake_rank_dir(tmp_path, "users-own-data", None)  # not ours: never touched
    garbled = _fake_rank_dir(tmp_path, "garbled", None)
    (garbled / OWNER_FILE).write_text("{not json")
    not_a_rank_dir = (
        tmp_path / "users-project" / "cache"
    )  # a record we did not write: never looked at
    not_a_rank_dir.mkdir(parents=True)
    (not_a_rank_dir / OWNER_FILE).write_text(
        json.dumps({"host": host, "pid": _dead_pid(), "start_time": 1.0})
    )
    child = _start(f"""
        s = Swapper({str(tmp_path)!r}, 1 << 20, host_memory_limit=1 << 30)
        ready(s.rank_dir)
        time.sleep({T})
    """)
    child_dir = Path(_line(child))
    try:
        with _swapper(tmp_path) as sw:
            assert not dead.parent.exists() and not reused.parent.exists()
            for kept in (live, other_host, unowned, garbled, child_dir):
                assert kept.exists(), kept
                assert kept == child_dir or (kept / "000000-state.swp").stat().st_size == 1 << 20
            assert (not_a_rank_dir / OWNER_FILE).exists()
            assert sw.rank_dir.exists()
    finally:
        child.send_signal(signal.SIGTERM)
        _finish(child)
    assert not child_dir.exists()


def test_two_runs_sweeping_together_remove_each_folder_once(tmp_path: Path) -> None:
    host = socket.gethostname()
    for i in range(6):
        _fake_rank_dir(tmp_path, f"run{i}", {"host": host, "pid": _dead_pid(), "start_time": 1.0})
    code = f"""
        import logging
        from zero_offload.swap.runs import remove_dead_runs
        ready("go")
        sys.stdin.readline()
        ready(remove_dead_runs({str(tmp_path)!r}))
    """
    kids = [
        subprocess.Popen(
            [sys.executable, "-c", PRELUDE + textwrap.dedent(code)],
            cwd=REPO,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(2)
    ]
    for k in kids:
        assert _line(k) == "go"
    for k in kids:
        assert k.stdin is not None
        k.stdin.write("\n")
        k.stdin.flush()
    freed = [int(_line(k)) for k in kids]
    for k in kids:
        _finish(k)
    assert list(tmp_path.iterdir()) == []
    assert sum(freed) >= 6 << 20 and sum(freed) < 7 << 20  # each folder counted once


def test_owner_record_is_written_for_every_rank(tmp_path: Path) -> None:
    with (
        _swapper(tmp_path) as a,
        Swapper(tmp_path, 1 << 20, rank=1, run_id=a.run_id, host_memory_limit=1 << 30) as b,
    ):
        for sw in (a, b):
            rec = json.loads((sw.rank_dir / OWNER_FILE).read_text())
            assert rec == {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "start_time": psutil.Process().create_time(),
            }
        assert a.rank_dir.parent == b.rank_dir.parent
        a.swap_out("k", torch.ones(1024)).result(10)
    assert list(tmp_path.iterdir()) == []

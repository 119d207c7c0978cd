"""`dex-agents demo` and `dex-agents chat` as a user runs them: real processes, real terminal I/O."""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dex_agents.builtin_loop import ModelRequest, ToolResultInput, UserTextInput
from dex_agents.demo import demo_reply, read_ledger

pytestmark = pytest.mark.slow

CLI = [sys.executable, "-c", "from dex_agents.cli import main; main()"]
# Generous: Worker processes start on a loaded CI machine.
CLI_TIMEOUT_SECONDS = 240


def _run(args: list[str], stdin: str = "") -> subprocess.CompletedProcess[str]:
    # A wide terminal, so rich does not wrap the lines the assertions read.
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([*CLI, *args], check=False, input=stdin, capture_output=True, text=True,
                          timeout=CLI_TIMEOUT_SECONDS, env=env)


def _run_with_pause(args: list[str], first: str, shown: str, then: str) -> tuple[int, str]:
    """Type `first`, wait until the chat prints `shown`, then type `then` and end the input.

    Lines piped all at once race the turn: a /cancel taken before the model asked for the wait
    cancels a turn that never waited. A person types it after seeing the wait, and so does this."""
    env = {**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen([*CLI, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=env)
    watchdog = threading.Timer(CLI_TIMEOUT_SECONDS, process.kill)
    watchdog.start()
    try:
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write(first)
        process.stdin.flush()
        seen = ""  # read by the character: a prompt (`[y/n] `) ends no line
        while not seen.endswith(shown):
            char = process.stdout.read(1)
            if not char:
                process.wait()
                pytest.fail(f"the chat never printed {shown!r}:\n{seen}")
            seen += char
        process.stdin.write(then)
        process.stdin.close()
        rest = process.stdout.read()
        return process.wait(), seen + rest
    finally:
        watchdog.cancel()
        process.kill()


def test_chat_quits_cleanly_while_its_input_stays_open(tmp_path: Path) -> None:
    """/quit typed at a terminal, whose input stays open: the chat exits with code 0. Catches: the
    reader thread, blocked in stdin's buffered read, holding its lock as the interpreter shut down,
    which aborted it (SIGABRT, "could not acquire lock for <_io.BufferedReader name='<stdin>'>").
    --data-dir names a directory two levels below one that exists: the chat makes both."""
    env = {**os.environ, "COLUMNS": "200"}
    process = subprocess.Popen([*CLI, "chat", "--data-dir", str(tmp_path / "new" / "d")], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write("/echo one\n/quit\n")
        process.stdin.flush()  # and left open, as a terminal is
        code = process.wait(CLI_TIMEOUT_SECONDS)
        output = process.stdout.read()
    finally:
        process.kill()
    assert code == 0, output
    assert "agent> one" in output and "Fatal Python error" not in output, output
    assert (tmp_path / "new" / "d" / "agents.db").is_file()


def test_chat_whose_output_is_closed_ends_with_one_error_line_and_saves_the_session(tmp_path: Path) -> None:
    """The chat's standard output closed by its reader (`dex-agents chat | head -1`) while its input
    stays open: the chat ends with one error line, exit code 1, and the session resumes. Catches:
    rich's SystemExit raised inside the chat's task, which asyncio printed with a traceback ("Task
    exception was never retrieved")."""
    process = _started_chat(tmp_path)
    try:
        assert process.stdin is not None and process.stdout is not None and process.stderr is not None
        process.stdout.close()  # as `head -1` does after its line
        process.stdin.write("hello\n")
        process.stdin.flush()  # and left open, as a terminal is
        code = process.wait(CLI_TIMEOUT_SECONDS)
        errors = process.stderr.read()
    finally:
        process.kill()
    assert code == 1, errors
    assert errors.startswith("Error: ") and len(errors.strip().splitlines()) == 1, errors
    assert "standard output" in errors and "Traceback" not in errors, errors
    # Whether "hello" was sent depends on which print met the closed pipe first: the prompt, or the reply.
    _assert_resumes(tmp_path)


def _started_chat(data_dir: Path) -> subprocess.Popen[str]:
    """A chat on `data_dir`, its three pipes the caller's, once it has said its session is new."""
    env = {**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen([*CLI, "chat", "--data-dir", str(data_dir)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert process.stdout is not None
        assert "new session 'chat'" in process.stdout.readline()
    except BaseException:
        process.kill()
        raise
    return process


def _assert_resumes(data_dir: Path) -> None:
    """A chat started again on `data_dir` resumes its session and answers."""
    again = _run(["chat", "--data-dir", str(data_dir)], stdin="/echo still here\n")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "resuming session 'chat'" in again.stdout and "agent> still here" in again.stdout, again.stdout


def test_demo_shows_the_write_ran_once_across_a_worker_kill(tmp_path: Path) -> None:
    """The demo kills a Worker during the approval wait; the refund runs once and the record shows it."""
    result = _run(["demo", "--data-dir", str(tmp_path)])
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "Worker 1 killed with SIGKILL" in out
    assert "resolve_interrupt -> True" in out and "resolve_interrupt -> False" in out
    assert "refunds in the payment ledger: 1" in out
    shape = "StartAgentSession -> RunModel -> AwaitToolApproval -> CallSingleAttemptTool -> ResumeTurn -> RunModel"
    assert shape in out
    assert "the write ran exactly once across a Worker kill" in out
    ledger = read_ledger(tmp_path / "ledger.jsonl")
    assert [(r["order_id"], r["amount_cents"]) for r in ledger] == [("A-1001", 1500)]
    assert re.fullmatch(r"demo-session/turn-1/call_[0-9a-f]{12}_0", str(ledger[0]["idempotency_key"]))


def test_demo_runs_in_a_directory_holding_a_dex_agents_folder_of_its_own(tmp_path: Path) -> None:
    """`dex-agents demo` run in a project whose working directory holds a `dex_agents` folder.
    Catches: its Worker (`python -m`, which searched the working directory first) importing that
    folder instead, exiting as it started, and the demo failing with a traceback."""
    (tmp_path / "dex_agents").mkdir()
    (tmp_path / "dex_agents" / "__init__.py").touch()
    script = str(Path(sys.executable).with_name("dex-agents"))  # not `python -c`, which searches it too
    done = subprocess.run([script, "demo", "--data-dir", "d"], cwd=tmp_path, check=False, capture_output=True,
                          text=True, timeout=CLI_TIMEOUT_SECONDS, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "the write ran exactly once across a Worker kill" in done.stdout


async def test_a_demo_worker_that_exits_as_it_starts_ends_the_demo_with_its_log_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A demo Worker that exits as it starts (here an interpreter that is not one): the demo ends
    with DemoError naming its exit code and its log's last line, which the command prints as one
    line. Catches: RuntimeError("the demo Worker exited with code 3") as a traceback, its reason
    only in a log the demo's temporary directory took with it."""
    from rich.console import Console

    from dex_agents.demo._run import DemoError, run_demo

    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'no interpreter here' >&2\nexit 3\n")
    broken.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(broken))
    with pytest.raises(DemoError, match=r"exited with code 3 as it started; the last line of its log "
                                        r"'.*worker-1\.log': no interpreter here$"):
        await run_demo(Console(file=io.StringIO()), tmp_path / "d")


def test_chat_answers_asks_for_approval_and_resumes_after_restart(tmp_path: Path) -> None:
    """A chat turn, an approval answered inline, then a new process resumes the same conversation."""
    refund = '/tool refund_order {"order_id": "A-1002", "amount_cents": 100}'
    first = _run(["chat", "--data-dir", str(tmp_path)], stdin=f"hello\n{refund}\ny\n")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "agent> Demo reply: hello" in first.stdout
    assert "approve refund_order" in first.stdout
    assert "refund_order: succeeded" in first.stdout
    assert len(read_ledger(tmp_path / "demo-ledger.jsonl")) == 1
    second = _run(["chat", "--data-dir", str(tmp_path)], stdin="/echo still here\n")
    assert second.returncode == 0, second.stdout + second.stderr
    assert "resuming session 'chat'" in second.stdout
    assert "user> hello" in second.stdout  # the earlier conversation, from the stored session
    assert "agent> still here" in second.stdout


def test_chat_asks_again_for_an_approval_answer_that_is_not_yes_or_no(tmp_path: Path) -> None:
    """An empty line or a typo at the [y/n] prompt asks again; only n rejects. Catches: anything but
    y/yes taken as a rejection, the call rejected for good by a stray Enter."""
    refund = '/tool refund_order {"order_id": "A-1001", "amount_cents": 5}'
    result = _run(["chat", "--data-dir", str(tmp_path)], stdin=f"{refund}\n\nye\ny\n")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("answer y or n") == 2
    assert "refund_order: succeeded" in result.stdout
    assert len(read_ledger(tmp_path / "demo-ledger.jsonl")) == 1


def test_chat_cancel_typed_at_an_approval_prompt_cancels_the_turn(tmp_path: Path) -> None:
    """/cancel at an approval prompt cancels the turn, as /help says it does while a turn runs.
    Catches: the line taken for the answer (a rejection), the turn going on."""
    refund = '/tool refund_order {"order_id": "A-1001", "amount_cents": 5}'
    code, out = _run_with_pause(["chat", "--data-dir", str(tmp_path)], f"{refund}\n", "[y/n]",
                                "/cancel\n/echo after\n")
    assert code == 0, out
    assert "turn cancelled" in out
    assert out.index("turn cancelled") < out.index("agent> after")
    assert read_ledger(tmp_path / "demo-ledger.jsonl") == []


def test_chat_shows_brackets_as_typed_and_resumes_a_session_holding_them(tmp_path: Path) -> None:
    """Text with square brackets is shown as typed, now and when the session is resumed. Catches:
    messages printed as rich markup: '[/x]' raised MarkupError, so the chat ended and could never
    show the session again, and '[red]' vanished."""
    first = _run(["chat", "--data-dir", str(tmp_path)], stdin="/echo closing tag [/x] and [red] in arr[i]\n")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "agent> closing tag [/x] and [red] in arr[i]" in first.stdout
    second = _run(["chat", "--data-dir", str(tmp_path)], stdin="/echo again\n")
    assert second.returncode == 0, second.stdout + second.stderr
    assert "assistant> closing tag [/x] and [red] in arr[i]" in second.stdout


def test_chat_refuses_a_line_too_large_to_send_and_goes_on(tmp_path: Path) -> None:
    """A line over the engine's value limit is refused with the reason, and the next line is
    answered. Catches: the error ending the whole chat (exit code 1)."""
    result = _run(["chat", "--data-dir", str(tmp_path)], stdin="x" * 1_100_000 + "\n/echo still here\n")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "that message was not sent: value for 'request of RPC send_user_message' is" in result.stdout
    assert "agent> still here" in result.stdout


def test_chat_echoes_a_long_unbroken_word(tmp_path: Path) -> None:
    """A pasted token of 300,000 characters is answered. Catches: rich's highlighter, whose time
    grows faster than the text (87 s for 100,000 characters), holding the chat for many minutes."""
    token = "t0K" * 100_000
    result = _run(["chat", "--data-dir", str(tmp_path)], stdin=f"/echo {token}\n")
    assert result.returncode == 0, result.stderr[-2000:]
    assert token in "".join(result.stdout.split("\n"))  # the terminal width wraps it


ENGINE_CLI = [sys.executable, "-c", "from dex_engine.cli import main; main()"]


def _stop_session(data_dir: Path) -> None:
    stopped = subprocess.run([*ENGINE_CLI, "stop", "chat", "--db", f"sqlite:///{data_dir / 'agents.db'}"],
                             capture_output=True, text=True, timeout=CLI_TIMEOUT_SECONDS, check=False)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr


def test_chat_on_a_stopped_session_says_it_has_ended(tmp_path: Path) -> None:
    """A session stopped with dex-engine stop: the chat says it has ended and how to start another
    (exit code 1), and does not offer to resume it. Catches: 'resuming session', then a traceback-
    like error at the first message and 'run the same command to resume it', again and again."""
    assert _run(["chat", "--data-dir", str(tmp_path)], stdin="/echo one\n").returncode == 0
    _stop_session(tmp_path)
    again = _run(["chat", "--data-dir", str(tmp_path)], stdin="/echo two\n")
    assert again.returncode == 1, again.stdout + again.stderr
    assert "session 'chat' has ended (flow 'chat' is stopped" in again.stdout
    assert "start another with --session NAME" in again.stdout
    assert "resume it" not in again.stdout and "resuming" not in again.stdout


def _delete_session(data_dir: Path) -> None:
    deleted = subprocess.run([*ENGINE_CLI, "delete", "chat", "--db", f"sqlite:///{data_dir / 'agents.db'}"],
                             capture_output=True, text=True, timeout=CLI_TIMEOUT_SECONDS, check=False)
    assert deleted.returncode == 0, deleted.stdout + deleted.stderr


def _stopped_while_chatting(data_dir: Path, typed: str, shown: str, then_close_input: bool,
                            then_delete: bool = False, then_type: str = "") -> tuple[int, str]:
    """Type `typed` into a chat, stop its session with dex-engine once the chat printed `shown`,
    delete it and type `then_type` if asked, end the input if asked; the chat's exit code and what
    it printed after."""
    env = {**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen([*CLI, "chat", "--data-dir", str(data_dir)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write(typed)
        process.stdin.flush()
        for line in process.stdout:
            if shown in line:
                break
        else:
            pytest.fail(f"the chat never printed {shown!r}")
        _stop_session(data_dir)
        if then_delete:
            _delete_session(data_dir)
        if then_type:
            process.stdin.write(then_type)
            process.stdin.flush()
        if then_close_input:
            process.stdin.close()
        code = process.wait(CLI_TIMEOUT_SECONDS)
        return code, process.stdout.read()
    finally:
        process.kill()


def test_chat_following_a_turn_ends_when_its_session_is_stopped(tmp_path: Path) -> None:
    """dex-engine stop while the chat follows a turn waiting on a durable timer: the chat says the
    session has ended and exits, its input still open. Catches: the chat waiting for the turn's
    events for ever, deaf to Ctrl-D."""
    code, rest = _stopped_while_chatting(tmp_path, "/wait 600 coffee\n", "waiting until", then_close_input=False)
    assert code == 1, rest
    assert "session 'chat' has ended (flow 'chat' is stopped" in rest


def test_chat_rejection_never_runs_the_write(tmp_path: Path) -> None:
    """Answering n rejects the call: the ledger stays empty and the model sees the rejection."""
    refund = '/tool refund_order {"order_id": "A-1001", "amount_cents": 5}'
    result = _run(["chat", "--data-dir", str(tmp_path), "--session", "other"], stdin=f"{refund}\nn\n")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "refund_order: rejected" in result.stdout
    assert "The user rejected this tool call." in result.stdout
    assert read_ledger(tmp_path / "demo-ledger.jsonl") == []


def test_chat_shows_a_draft_plan_and_executes_it_on_yes(tmp_path: Path) -> None:
    """/plan drafts a plan in a planning turn; the chat shows it, asks, and y runs the executing turn."""
    result = _run(["chat", "--data-dir", str(tmp_path)], stdin="/plan look up A-1001; refund it\ny\n")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "plan revision 1 is draft (2 tasks)" in out
    assert "plan revision 1 (draft):\n  [pending] look up A-1001\n  [pending] refund it" in out
    assert "execute plan revision 1? [y/n]" in out
    assert "plan revision 1 is active (2 tasks)" in out
    assert "agent> Executing the plan: look up A-1001; refund it." in out
    assert "plan revision 2 is completed (2 tasks)" in out


def test_chat_steers_a_waiting_turn_with_a_steer_line(tmp_path: Path) -> None:
    """/steer while a durable wait runs rejects the wait as steered and starts a turn with the new text."""
    code, out = _run_with_pause(["chat", "--data-dir", str(tmp_path)], "/wait 600 coffee\n", "waiting until",
                                "/steer /echo never mind\n")
    assert code == 0, out
    assert "durable_wait: rejected" in out
    assert "turn steered" in out
    assert "agent> never mind" in out


def test_chat_cancels_a_waiting_turn_and_goes_on(tmp_path: Path) -> None:
    """/cancel while a durable wait runs stops the turn; the next line is an ordinary message."""
    code, out = _run_with_pause(["chat", "--data-dir", str(tmp_path)], "/wait 600 coffee\n", "waiting until",
                                "/cancel\n/echo after\n")
    assert code == 0, out
    assert "durable_wait: rejected" in out
    assert "turn cancelled" in out
    assert out.index("turn cancelled") < out.index("agent> after")


def test_chat_control_lines_without_a_turn_are_refused(tmp_path: Path) -> None:
    """/steer and /cancel with no running turn say so and send nothing to the model."""
    result = _run(["chat", "--data-dir", str(tmp_path)], stdin="/cancel\n/steer hi\n/echo ok\n")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("no turn is running") == 2
    assert "agent> ok" in result.stdout and "Demo reply" not in result.stdout


def test_chat_help_is_answered_by_the_chat_and_sends_nothing(tmp_path: Path) -> None:
    """/help prints the demo model's commands and the chat's once, and starts no turn.
    Catches: "/help" also sent to the agent as a message, whose turn printed the commands again."""
    result = _run(["chat", "--data-dir", str(tmp_path)], stdin="/help\n/echo ok\n")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert out.count("Demo model commands:") == 1 and out.count("While a turn runs:") == 1
    assert "agent> Demo model commands:" not in out
    assert "agent> ok" in out


@pytest.mark.parametrize("errors", ["strict", "surrogateescape"])
def test_chat_refuses_a_line_that_is_not_utf8_and_goes_on(tmp_path: Path, errors: str) -> None:
    """A line that is not UTF-8 (a Latin-1 'é') is refused with one line saying it was not sent, and
    the next line is answered, whichever error handler stdin has (strict on en_US.UTF-8,
    surrogateescape in the C locale). Catches: with strict, the stdin reader thread dying and the
    chat waiting for ever; with surrogateescape, the chat ending with an internal JSON error."""
    env = {**os.environ, "COLUMNS": "200", "PYTHONIOENCODING": f"utf-8:{errors}"}
    done = subprocess.run([*CLI, "chat", "--data-dir", str(tmp_path)], check=False, input=b"caf\xe9\n/echo after\n",
                          capture_output=True, timeout=CLI_TIMEOUT_SECONDS, env=env)
    out, err = done.stdout.decode(), done.stderr.decode()
    assert done.returncode == 0, out + err
    refusal = "the line b'caf\\xe9' is not utf-8 text, so it was not sent; type it again"
    assert out.count(refusal) == 1, out
    assert "agent> after" in out and "Demo reply" not in out
    assert "Traceback" not in err, err


def test_demo_model_commands() -> None:
    """The demo model: /echo, /tool with JSON, bad JSON, /help, plain text, and results after tools."""

    def ask(*items: object) -> str | None:
        return demo_reply(ModelRequest(instructions=None, input=tuple(items))).text  # type: ignore[arg-type]

    assert ask(UserTextInput("/echo hi there")) == "hi there"
    assert ask(UserTextInput("hello")) == "Demo reply: hello"
    assert "/tool NAME" in (ask(UserTextInput("/help")) or "")
    assert ask(UserTextInput("/tool lookup_order {bad")) == "The arguments for lookup_order are not JSON: {bad"
    reply = demo_reply(ModelRequest(None, (UserTextInput('/tool lookup_order {"order_id": "A-1001"}'),)))
    assert [c.name for c in reply.tool_calls] == ["lookup_order"]
    assert json.loads(str(reply.tool_calls[0].arguments)) == {"order_id": "A-1001"}
    assert ask(UserTextInput("x"), ToolResultInput("c", "lookup_order", "ok")) == "lookup_order returned: ok"


def test_demo_wait_takes_whole_seconds_and_shows_its_usage_for_anything_else() -> None:
    """/wait SECONDS REASON asks durable_wait for those seconds; a count int() cannot read gets the
    usage line. Catches: '/wait ² x' ("²" is a digit to str.isdigit, not to int()) raising in the
    model call, which failed the chat's turn with "invalid literal for int() with base 10: '²'"; so
    did a count of more digits than int() converts."""

    def wait_call(text: str) -> object:
        reply = demo_reply(ModelRequest(None, (UserTextInput(text),)))
        if not reply.tool_calls:
            return reply.text
        assert [c.name for c in reply.tool_calls] == ["durable_wait"]
        return json.loads(str(reply.tool_calls[0].arguments))

    assert wait_call("/wait 5 coffee") == {"duration_seconds": 5, "reason": "coffee"}
    assert wait_call("/wait 0 now") == {"duration_seconds": 0, "reason": "now"}  # durable_wait refuses it
    for text in ("/wait ² x", "/wait ½ x", "/wait 1.5 x", "/wait -3 x", "/wait x", "/wait " + "9" * 5000 + " x"):
        assert wait_call(text) == "Usage: /wait SECONDS REASON", text


def test_bad_session_ids_and_unusable_directories_end_with_a_message_not_a_traceback(tmp_path: Path) -> None:
    """A session ID that is not a usable ID, a data directory that cannot be made, or a database
    that cannot be opened there ends the command with exit code 1 and one line that names the
    problem. Catches: a Python traceback for a typo, and the chat's "session is saved, run the
    same command to resume it" printed for a session that could not exist."""
    unusable = tmp_path / "a-file"
    unusable.write_text("not a directory")
    cases = [
        (["chat", "--data-dir", str(tmp_path / "d"), "--session", "a/b"],
         "Error: flow ID 'a/b' contains reserved character '/'; it joins IDs into keys"),
        (["chat", "--data-dir", str(unusable / "d")], f"Error: [Errno 20] Not a directory: '{unusable / 'd'}'"),
        (["demo", "--data-dir", str(unusable / "d")], f"Error: [Errno 20] Not a directory: '{unusable / 'd'}'"),
    ]
    no_files = Path("/proc/1")  # a directory where no one, root included, may make a file
    if no_files.is_dir():
        cases.append((["chat", "--data-dir", str(no_files)],
                      f"Error: cannot open '{no_files / 'agents.db'}' (from 'sqlite:///{no_files / 'agents.db'}') as "
                      "a dex_engine database: "))
    for args, message in cases:
        done = _run(args)
        assert done.returncode == 1, (args, done.returncode, done.stdout, done.stderr)
        assert done.stderr.startswith(message), (args, done.stderr)
        assert "Traceback" not in done.stderr and "is saved" not in done.stdout, (args, done.stdout, done.stderr)


def test_demo_refuses_a_directory_it_did_not_make_and_deletes_nothing(tmp_path: Path) -> None:
    """--data-dir must be new or empty; one holding anything is refused (exit code 2, naming what it
    holds) and left as it was. Catches: the demo deleting another program's demo.db, every demo.db*
    file and a ledger.jsonl before it started."""
    held = {"demo.db": b"another program's database", "demo.db.notes.txt": b"notes", "ledger.jsonl": b"{}\n"}
    for name, data in held.items():
        (tmp_path / name).write_bytes(data)
    done = _run(["demo", "--data-dir", str(tmp_path)])
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"'{tmp_path}' is not empty (it holds demo.db, demo.db.notes.txt, ledger.jsonl)" in done.stderr
    assert "name a new or empty directory" in done.stderr
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == held


@pytest.mark.parametrize("command", ["chat", "demo"])
@pytest.mark.parametrize("name", ["has#hash", "q?x=1", "tab\there"])
def test_a_data_dir_a_sqlite_url_cannot_name_is_refused_by_the_option(tmp_path: Path, command: str,
                                                                       name: str) -> None:
    """A --data-dir with '#' or '?' is refused (exit code 2) before anything is made. Catches: a
    traceback from the URL parser, after the directory had been made."""
    directory = tmp_path / name
    done = _run([command, "--data-dir", str(directory)])
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Invalid value for '--data-dir'" in done.stderr and "a sqlite URL cannot hold in its path" in done.stderr
    assert "Traceback" not in done.stderr
    assert not directory.exists()


def test_chat_whose_input_cannot_be_read_ends_with_one_error_line(tmp_path: Path) -> None:
    """Standard input open for writing only, as nohup leaves it when it was a terminal: the chat ends
    with one error line (exit code 1). Catches: the reader thread dying with a traceback, and the
    chat waiting at its prompt for ever."""
    with open(tmp_path / "write-only", "w") as write_only:
        try:
            done = subprocess.run([*CLI, "chat", "--data-dir", str(tmp_path / "d")], stdin=write_only,
                                  capture_output=True, text=True, timeout=60, check=False,
                                  env={**os.environ, "COLUMNS": "200"})
        except subprocess.TimeoutExpired as expired:
            pytest.fail(f"the chat waited for a line it could never read: {expired.stderr!r}")
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr == ("Error: [Errno 9] cannot read standard input (Bad file descriptor); the chat reads "
                           "what you type from it\n"), done.stderr


def test_chat_with_standard_input_closed_says_so(tmp_path: Path) -> None:
    """Catches: "session ... is saved", then an AttributeError traceback from reading a closed stdin."""
    done = subprocess.run([*CLI, "chat", "--data-dir", str(tmp_path)], check=False, capture_output=True, text=True,
                          timeout=CLI_TIMEOUT_SECONDS, stdin=None, preexec_fn=lambda: os.close(0))
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr == "Error: standard input is closed; the chat reads what you type from it\n"
    assert "is saved" not in done.stdout


def test_chat_does_not_call_a_session_it_could_not_use_saved(tmp_path: Path) -> None:
    """An ID held by a Flow of another kind: the chat's error, and no "saved ... resume it". Catches:
    the resume hint printed after every error."""
    url = f"sqlite:///{tmp_path / 'agents.db'}"
    started = subprocess.run([sys.executable, "-c", (
        "import asyncio\n"
        "from dex_engine import AsyncClient, Channel, Flow, Registry, Step, StepDecision, Wait\n"
        "names = Channel('Names', str)\n"
        "async def wait(ctx, _): return Wait.until(names.for_one())\n"
        "async def end(ctx, _): return StepDecision.dead_end()\n"
        "flow = Flow('Greeter', [Step('Start', end, wait_for=wait)], schema=[names])\n"
        "async def main():\n"
        "    client = AsyncClient(Registry([flow]), " + repr(url) + ")\n"
        "    await client.start_flow('Greeter', 'chat')\n"
        "    await client.close()\n"
        "asyncio.run(main())\n")], capture_output=True, text=True, timeout=CLI_TIMEOUT_SECONDS, check=False)
    assert started.returncode == 0, started.stderr
    done = _run(["chat", "--data-dir", str(tmp_path)], stdin="/echo hi\n")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Greeter" in done.stderr
    assert "is saved" not in done.stdout


def test_chat_ended_by_eof_after_its_session_was_stopped_says_it_has_ended(tmp_path: Path) -> None:
    """dex-engine stop while the chat waits for a line, then end of input: the chat says the session
    has ended (exit code 1). Catches: exit code 0 and "saved ...; run the same command to resume it"."""
    code, rest = _stopped_while_chatting(tmp_path, "/echo one\n", "agent> one", then_close_input=True)
    assert code == 1, rest
    assert "session 'chat' has ended (flow 'chat' is stopped" in rest
    assert "is saved" not in rest


def test_chat_whose_session_was_deleted_says_so_and_how_to_start_it_again(tmp_path: Path) -> None:
    """dex-engine stop and delete while the chat waits for a line, then a line typed: the chat says
    the session was deleted and how to start a new one (exit code 1), and sends nothing. Catches:
    the chat ending on the engine's bare "Error: no flow with ID 'chat'"."""
    code, rest = _stopped_while_chatting(tmp_path, "/echo one\n", "agent> one", then_close_input=True,
                                         then_delete=True, then_type="/echo two\n")
    assert code == 1, rest
    assert "session 'chat' was deleted while this chat ran; run the same command to start a new one" in rest, rest
    assert "Error:" not in rest and "is saved" not in rest, rest


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (not a zombie waiting for its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL])
def test_no_demo_worker_outlives_the_demo(tmp_path: Path, sig: signal.Signals) -> None:
    """The demo ended by SIGTERM or SIGHUP (a closed terminal) stops its Worker and exits with 128 +
    the signal; killed outright, its Worker sees its parent gone and kills itself. Catches: a Worker
    left running for ever, its parent init."""
    env = {**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen([*CLI, "demo", "--data-dir", str(tmp_path / "d")], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=env)
    try:
        assert process.stdout is not None
        for line in process.stdout:
            found = re.search(r"Worker 1 started \(pid (\d+)\)", line)
            if found:
                worker = int(found.group(1))
                break
        else:
            pytest.fail("the demo never started its Worker")
        process.send_signal(sig)
        code = process.wait(CLI_TIMEOUT_SECONDS)
    finally:
        process.kill()
    assert code == (-sig if sig == signal.SIGKILL else 128 + sig)
    deadline = time.monotonic() + 30
    while _running(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(worker), f"the demo's Worker {worker} outlived it"


def test_chat_on_a_full_disk_ends_with_one_error_line(small_disk: Path) -> None:
    """The disk under the chat's database fills while it chats: the chat ends (exit code 1) with one
    error that says the disk is full. Catches: the chat following a turn its Worker could never
    commit, for ever, the terminal filling with the Worker's tracebacks."""
    lines = "".join(f"/echo {'y' * 20_000}\n" for _ in range(200))
    done = subprocess.run([*CLI, "chat", "--data-dir", str(small_disk / "d")], check=False, input=lines,
                          capture_output=True, text=True, timeout=CLI_TIMEOUT_SECONDS,
                          env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stderr.startswith("Error: ") and "full" in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-4000:]


def test_a_command_leaves_an_ignored_sighup_ignored_and_restores_signal_handlers() -> None:
    """Catches: a nohup'd chat or demo ended by the SIGHUP it was told to ignore, and SIG_DFL left
    in place of the caller's own handlers once the command returned."""
    from dex_agents.cli import _run

    def mine(signum: int, frame: object) -> None:
        raise AssertionError("not called")

    before = signal.signal(signal.SIGTERM, mine), signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        seen: list[object] = []

        async def command() -> int:
            os.kill(os.getpid(), signal.SIGHUP)  # ignored: the command goes on
            await asyncio.sleep(0.05)
            seen.append(signal.getsignal(signal.SIGHUP))
            return 7

        assert _run(command) == 7
        assert seen == [signal.SIG_IGN]
        assert signal.getsignal(signal.SIGTERM) is mine and signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, before[0])
        signal.signal(signal.SIGHUP, before[1])


def test_a_demo_error_ends_the_demo_command_with_one_error_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The DemoError of a demo Worker that exits as it starts reaches the user as the command's one
    error line (exit code 1). Catches: the error raised through click as a traceback."""
    from click.testing import CliRunner

    from dex_agents.cli import main

    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'no interpreter here' >&2\nexit 3\n")
    broken.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(broken))
    done = CliRunner().invoke(main, ["demo", "--data-dir", str(tmp_path / "d")])
    assert done.exit_code == 1, (done.output, done.exception)
    assert done.stderr.startswith("Error: the demo Worker exited with code 3 as it started"), done.stderr
    assert done.stderr.rstrip().endswith("no interpreter here") and "Traceback" not in done.output


def test_chat_ended_by_ctrl_c_exits_with_130_and_the_session_resumes(tmp_path: Path) -> None:
    """Ctrl-C (SIGINT) at the chat's prompt ends it with exit code 130, as a shell expects of a
    command the user interrupted, with no traceback; the session resumes. Catches: the
    KeyboardInterrupt shown as a traceback, or another exit code (scripts test for 130)."""
    process = _started_chat(tmp_path)
    try:
        assert process.stderr is not None
        process.send_signal(signal.SIGINT)
        code = process.wait(CLI_TIMEOUT_SECONDS)
        errors = process.stderr.read()
    finally:
        process.kill()
    assert code == 130, errors
    assert "Traceback" not in errors, errors
    _assert_resumes(tmp_path)


def test_a_sqlite_error_ends_the_chat_command_with_one_error_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An sqlite3 error that reaches the command (not one dex_engine words itself) ends it with its
    message as one error line, exit code 1. Catches: the error raised through click as a traceback."""
    import sqlite3

    from click.testing import CliRunner

    from dex_agents.cli import main
    from dex_agents.demo import _chat

    async def locked(*_args: object) -> int:
        raise sqlite3.OperationalError("database is locked")

    monkeypatch.setattr(_chat, "run_chat", locked)
    done = CliRunner().invoke(main, ["chat", "--data-dir", str(tmp_path / "d")], input="")
    assert done.exit_code == 1, (done.output, done.exception)
    assert done.stderr == "Error: database is locked\n", done.stderr

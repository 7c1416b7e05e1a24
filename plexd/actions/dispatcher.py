"""Validate → acknowledge → run → report, for ``action_request`` events, actions a pulled state lists, and local
runs alike.

Checks, in order (docs/protocol.md §7.4 as settled in docs/decisions.md, Actions): the request is well-formed
(``invalid_request``), actions are enabled (``actions_disabled``), plexd is not shutting down (``shutting_down``),
the execution id was never accepted before — running, finished, or cut short by a crash (``duplicate_execution_id``),
the action exists (``unknown_action``), its parameters are the declared ones (``invalid_request``), a hook's file
still has the checksum of the request and of the last announcement, and is still safe to run
(``integrity_violation``, with ``POST /integrity/violations``), and a slot is free (``max_concurrent_reached``).
Only then is the execution journaled with its ``accepted`` ack (one transaction) and started; every refusal is
acked ``rejected`` with its reason and logged once with the detail. Nothing here waits for the control plane:
acks, results and violations go through the outbox, and one the journal cannot take (data_dir full or read-only)
waits in memory until it can (plexd.actions.unwritten).

Timeout: the request's, else the hook's sidecar's, else ``actions.timeout``; never more than 10 minutes, and
never past the request's ``expires_at``.

A state can list actions too (the platform contract's executions, `State.action_requests`): the control plane
lists each until it has the result, so `offer` sees it on every pull. The journal is what makes that one run and
one answer: an execution it knows (running, finished, refused) is not looked at again, a refusal is journaled with
its ack, and a refusal for now (busy, shutting down) is not answered at all, since the next pull offers it again.
One that has lapsed is left for the control plane to time out, and one the control plane holds as started that
this node has no record of was lost to an earlier run of the agent: reported failed once, never run.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from plexd.actions import request as rq
from plexd.actions.audit import LocalAudit
from plexd.actions.builtins import BUILTINS, EXECUTION, Builtin, NodeView
from plexd.actions.hooks import HookSet
from plexd.actions.journal import RUNNING, ActionJournal, Execution, JournalError
from plexd.actions.outbox import Outbox
from plexd.actions.request import ActionRequest, InvalidRequest
from plexd.actions.runner import Capture, OnOutput, Outcome, run_process
from plexd.actions.unwritten import UnwrittenJournal
from plexd.base.failpoint import failpoint
from plexd.base.gojson import format_duration, format_time, format_unix, now_utc, parse_duration
from plexd.config.settings import ActionsConfig, Config
from plexd.controlplane.envelope import Envelope
from plexd.trust.integrity import Hook, HookImage, HookUnusable, RefusedHook, image_hook, inspect_hook

log = logging.getLogger(__name__)

MAX_TIMEOUT = 600.0
CONTROL_PLANE, LOCAL = "control_plane", "local"
LOST = "execution lost to an agent restart"  # the control plane holds it as started; this node never ran it


@dataclass
class Running:
    request: ActionRequest
    origin: str
    started: float
    cancel: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Future[dict[str, Any]] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    task: asyncio.Task[None] | None = None
    caller: dict[str, Any] = field(default_factory=dict)  # a local caller's uid, gid, pid

    def to_json(self) -> dict[str, Any]:
        return {"execution_id": self.request.execution_id, "action": self.request.action, "origin": self.origin,
                "running_seconds": round(time.monotonic() - self.started, 1)}


@dataclass
class VerifiedHook:
    """A hook admitted to run: as on disk when it was verified, and the image of the bytes that were hashed
    (what is executed; closed once the hook started or the request was refused)."""
    hook: Hook
    image: HookImage


class ActionDispatcher:
    def __init__(self, config: ActionsConfig, journal: ActionJournal, outbox: Outbox, hooks: HookSet,
                 view: NodeView, node_id: Callable[[], str], audit: LocalAudit, *,
                 builtins: dict[str, Builtin] | None = None) -> None:
        self.config = config  # replaced by a reload (`reconfigure`)
        self.journal = journal
        self.outbox = outbox
        self.hooks = hooks
        self.view = view
        self._node_id = node_id
        self.audit = audit
        self.builtins = BUILTINS if builtins is None else builtins
        self.running: dict[str, Running] = {}
        self.shutting_down = False
        self.accepted = 0
        self.rejected: dict[str, int] = {}
        self.unwritten = UnwrittenJournal()  # acks, results and violations the journal could not take yet
        # A listed action put off for now waits for the next pull to offer it again: that pull must come (the
        # reconciler otherwise skips pulls while the event stream is connected)
        self.put_off: Callable[[str], None] = lambda reason: None

    # -- entry points -------------------------------------------------------------------------------------------

    async def handle_event(self, env: Envelope) -> None:
        """The ``action_request`` handler. Returns once the request is acked (queued) and started: never waits
        for the hook or the control plane. A payload without an execution id raises MissingExecutionId."""
        payload = env.payload()
        try:
            request = rq.parse_request(payload)
        except InvalidRequest as exc:
            self._refuse(rq.execution_id_of(payload), rq.action_of(payload), CONTROL_PLANE, exc)
            return
        try:
            await self.submit(request, CONTROL_PLANE)
        except InvalidRequest:
            pass  # acked, logged and counted in submit

    async def offer(self, requests: Sequence[ActionRequest]) -> None:
        """The actions a pulled state lists (see the module's docstring); returns once each is started or
        answered. Never waits for the hook or the control plane."""
        for request in requests:
            if request.execution_id in self.running or self.journal.known(request.execution_id) is not None:
                continue  # running, or answered already: what it has to say goes out through the outbox
            if request.expires_at is not None and request.expires_at <= time.time():
                continue
            if request.reported_started:
                self._lost(request)
            elif request.problem:
                self._refuse(request.execution_id, request.action, CONTROL_PLANE, InvalidRequest(request.problem),
                             pulled=True)
            else:
                with contextlib.suppress(InvalidRequest):  # answered, or left for the next pull, in submit
                    await self.submit(request, CONTROL_PLANE, pulled=True)

    async def submit(self, request: ActionRequest, origin: str, *, on_output: OnOutput | None = None,
                     caller: dict[str, Any] | None = None, pulled: bool = False) -> Running:
        """Admit and start `request`; raise InvalidRequest (after acking and logging it) when it is refused.
        `pulled`: offered by a pulled state, which lists it again (`offer`)."""
        target: Builtin | VerifiedHook | None = None
        try:
            target = await self._admit(request, origin)
            # From here to the start nothing awaits: the duplicate and concurrency checks and the journal entry
            # are one step, so two requests cannot both take the last slot or the same id.
            self._check_slot(request)
            ack = {"execution_id": request.execution_id, "status": "accepted", "reason": ""}
            try:
                self.journal.accept(request.execution_id, request.action, origin, request.to_json(),
                                    ack if origin == CONTROL_PLANE else None)
            except JournalError as exc:
                raise InvalidRequest(f"cannot journal the execution ({exc}); not run", for_now=True) from None
        except InvalidRequest as exc:
            if isinstance(target, VerifiedHook):
                target.image.close()
            self._refuse(request.execution_id, request.action, origin, exc, caller, pulled=pulled)
            raise
        self.accepted += 1
        running = Running(request, origin, time.monotonic(), caller=caller or {})
        self.running[request.execution_id] = running
        running.task = asyncio.create_task(self._execute(running, target, on_output),
                                           name=f"plexd:action:{request.execution_id}")
        log.info("action %s accepted (execution %s, from %s)", request.action, request.execution_id,
                 "the control plane" if origin == CONTROL_PLANE else f"local uid {(caller or {}).get('uid')}",
                 extra={"execution_id": request.execution_id, "action": request.action})
        if origin == LOCAL:
            self.audit.record("started", execution_id=request.execution_id, action=request.action,
                              parameters=sorted(request.parameters), **(caller or {}))
        return running

    def local_request(self, action: str, parameters: dict[str, str], timeout: float | None,
                      uid: int) -> ActionRequest:
        return ActionRequest("local-" + secrets.token_hex(8), action, parameters, timeout, "",
                             {"type": "local", "session_id": "", "user_id": f"uid:{uid}", "email": ""})

    # -- admission ----------------------------------------------------------------------------------------------

    async def _admit(self, request: ActionRequest, origin: str) -> Builtin | VerifiedHook:
        if not self.config.enabled:
            raise InvalidRequest("actions are disabled (actions.enabled: false)", rq.ACTIONS_DISABLED)
        if self.shutting_down:
            raise InvalidRequest("plexd is shutting down", rq.SHUTTING_DOWN)
        self._check_duplicate(request.execution_id)
        if request.kind not in ("", rq.BUILTIN, rq.HOOK):
            raise InvalidRequest(f"action type {request.kind!r}: neither builtin nor hook", rq.UNSUPPORTED_TYPE)
        builtin = self.builtins.get(request.action) if request.kind != rq.HOOK else None
        if builtin is not None:
            rq.check_declared(request.parameters, builtin.parameters)
            return builtin
        hook = self.hooks.find(request.action) if request.kind != rq.BUILTIN else None
        if hook is None:
            refused = next((r for r in self.hooks.current.refused if r.name == request.action), None)
            what = {rq.BUILTIN: "built-in action", rq.HOOK: "hook"}.get(request.kind, "built-in action or hook")
            why = f"hook {request.action!r} is refused: {refused.reason}" if refused else (
                f"no {what} named {request.action!r}")
            raise InvalidRequest(why, rq.UNKNOWN_ACTION)
        rq.check_declared(request.parameters, hook.parameters)
        return await self._verify(request, origin, hook)

    def _check_duplicate(self, execution_id: str) -> None:
        if execution_id in self.running:
            raise InvalidRequest(f"execution {execution_id} is running; not run twice", rq.DUPLICATE)
        known = self.journal.known(execution_id)
        if known is not None:
            when = format_unix(known.accepted_at)
            raise InvalidRequest(f"execution {execution_id} was accepted at {when} ({known.state}"
                                 f"{', ' + known.status if known.status else ''}); never run twice", rq.DUPLICATE)

    def _check_slot(self, request: ActionRequest) -> None:
        # Again here, after the last await: a drain that began while the hook was being verified has already
        # waited for what was running, and would never wait for this one.
        if self.shutting_down:
            raise InvalidRequest("plexd is shutting down", rq.SHUTTING_DOWN)
        self._check_duplicate(request.execution_id)
        if len(self.running) >= self.config.max_concurrent:
            raise InvalidRequest(f"{len(self.running)} actions running, the limit (actions.max_concurrent)",
                                 rq.MAX_CONCURRENT)

    async def _verify(self, request: ActionRequest, origin: str, hook: Hook) -> VerifiedHook:
        """The hook as it is on disk now: still safe, and with the checksum the request (or, for a local run, the
        last scan) and the last announcement name. Else a violation is reported and the request refused. The
        checksum compared is that of the image that will be executed (`plexd.trust.integrity.image_hook`)."""
        if origin == CONTROL_PLANE and not request.checksum and not request.checksum_announced:
            raise InvalidRequest(f"checksum: missing; hook {hook.name!r} runs only against the SHA-256 it was "
                                 "announced with")
        found = await asyncio.to_thread(inspect_hook, self.hooks.directory, hook.name)
        if found is None:
            raise InvalidRequest(f"hook {hook.name!r} no longer exists in {self.hooks.directory}", rq.UNKNOWN_ACTION)
        if isinstance(found, RefusedHook):
            self._violation(hook.path, hook.checksum, "", f"hook refused: {found.reason}")
            raise InvalidRequest(f"hook {hook.name!r} is no longer safe to run: {found.reason}",
                                 rq.INTEGRITY_VIOLATION)
        try:
            image = await asyncio.to_thread(image_hook, found[0].path)
        except HookUnusable as exc:
            self._violation(hook.path, hook.checksum, "", f"hook refused: {exc}")
            raise InvalidRequest(f"hook {hook.name!r} is no longer safe to run: {exc}",
                                 rq.INTEGRITY_VIOLATION) from None
        now = dataclasses.replace(found[0], checksum=image.checksum)
        problem, expected = self.hooks.checksum_problem(
            hook.name, now.checksum, request.checksum or hook.checksum,
            "differs from the request's checksum" if request.checksum else "changed since it was scanned")
        if not problem:
            return VerifiedHook(now, image)
        image.close()
        self._violation(hook.path, expected, now.checksum, f"hook checksum mismatch: the file {problem}")
        raise InvalidRequest(f"hook {hook.name!r}: sha256 {now.checksum} {problem} ({expected or 'none'}); "
                             "not run", rq.INTEGRITY_VIOLATION)

    def _violation(self, path: str, expected: str, actual: str, detail: str) -> None:
        body = {"type": "hook", "path": path, "expected_checksum": expected, "actual_checksum": actual,
                "detail": detail, "timestamp": format_time(now_utc())}
        self._write(f"the integrity violation of {path}", lambda: self.journal.queue("violation", "", body))
        log.error("integrity violation: %s: %s", path, detail,
                  extra={"path": path, "expected_checksum": expected, "actual_checksum": actual})

    def _write(self, what: str, write: Callable[[], None]) -> None:
        """A journal write that must not be lost: kept and made again later when the journal cannot take it."""
        try:
            write()
        except JournalError as exc:
            self.unwritten.keep(what, write, exc)

    def _refuse(self, execution_id: str, action: str, origin: str, exc: InvalidRequest,
                caller: dict[str, Any] | None = None, *, pulled: bool = False) -> None:
        """Log, count and answer a refusal. `pulled` (listed again by every pull until answered): answered once,
        journaled with the answer; not answered when refused for now, as the next pull offers it again."""
        if pulled and exc.for_now:
            log.info("action %r (execution %s) not started now: %s: %s; the next state pull offers it again", action,
                     execution_id, exc.reason, exc, extra={"execution_id": execution_id, "reason": exc.reason})
            self.put_off(f"action {execution_id} put off: {exc.reason}")
            return
        self.rejected[exc.reason] = self.rejected.get(exc.reason, 0) + 1
        log.warning("action %r (execution %s) rejected: %s: %s", action, execution_id, exc.reason, exc,
                    extra={"execution_id": execution_id, "reason": exc.reason})
        if origin == CONTROL_PLANE:
            ack = {"execution_id": execution_id, "status": "rejected", "reason": exc.reason}

            def write() -> None:
                if pulled:
                    self.journal.settle(execution_id, action, origin, {}, "rejected", "ack", ack)
                else:
                    self.journal.queue("ack", execution_id, ack)

            self._write(f"the rejection of {execution_id}", write)
        else:
            self.audit.record("refused", execution_id=execution_id, action=action, reason=exc.reason,
                              detail=str(exc), **(caller or {}))

    # -- running ------------------------------------------------------------------------------------------------

    def timeout_for(self, request: ActionRequest, target: Builtin | VerifiedHook) -> float:
        timeout = request.timeout
        if timeout is None and isinstance(target, VerifiedHook) and target.hook.timeout:
            timeout = parse_duration(target.hook.timeout)  # validated when the sidecar was read
        timeout = min(timeout or self.config.timeout, MAX_TIMEOUT)
        if request.expires_at is not None:  # the control plane gives up on it then
            timeout = min(timeout, max(0.0, request.expires_at - time.time()))
        return timeout

    async def _execute(self, running: Running, target: Builtin | VerifiedHook, on_output: OnOutput | None) -> None:
        request = running.request
        timeout = self.timeout_for(request, target)
        try:
            if isinstance(target, Builtin):
                outcome = await self._run_builtin(target, request, timeout, running.cancel, on_output)
            else:
                try:
                    env = rq.hook_environment(self._node_id(), request, str(target.hook.path))
                    outcome = await run_process(target.hook.path, env,
                                                timeout=timeout, cap=self.config.output_cap,
                                                kill_grace=self.config.kill_grace, cancel=running.cancel,
                                                on_output=on_output, exec_fd=target.image.fd)
                finally:
                    target.image.close()
        except Exception as exc:  # a bug must not lose the result
            log.exception("action %s (execution %s) failed inside plexd", request.action, request.execution_id)
            outcome = Outcome(rq.ERROR, 1, "", f"plexd: internal error: {exc}\n",
                              time.monotonic() - running.started, detail="internal error")
        if outcome.deferred:
            self._deferred(running, outcome)
            return
        failpoint("action.finished")
        result = result_body(request, outcome)
        self._write(f"the result of execution {request.execution_id}",
                    lambda: self.journal.finish(request.execution_id, outcome.status, result))
        self.running.pop(request.execution_id, None)
        log.info("action %s (execution %s) finished: %s, %s, after %s", request.action, request.execution_id,
                 outcome.status, outcome.detail, format_duration(outcome.duration),
                 extra={"execution_id": request.execution_id, "status": outcome.status,
                        "exit_code": outcome.exit_code})
        if running.origin == LOCAL:
            self.audit.record("finished", execution_id=request.execution_id, action=request.action,
                              status=outcome.status, exit_code=outcome.exit_code, **running.caller)
        if not running.done.done():
            running.done.set_result({**result, "signal": outcome.signal})

    async def _run_builtin(self, builtin: Builtin, request: ActionRequest, timeout: float, cancel: asyncio.Event,
                           on_output: OnOutput | None) -> Outcome:
        started = time.monotonic()
        EXECUTION.set(request.execution_id)  # this task's context only; the built-in's task copies it
        work = asyncio.ensure_future(builtin.run(self.view, request.parameters))
        stop = asyncio.ensure_future(cancel.wait())
        try:
            done, _ = await asyncio.wait({work, stop}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        elapsed = time.monotonic() - started
        if work not in done:
            work.cancel()
            status = rq.CANCELLED if stop in done else rq.TIMEOUT
            return Outcome(status, -1, "", "", elapsed, detail=status)
        try:
            out = work.result()
        except Exception as exc:
            log.warning("built-in %s failed: %s", builtin.name, exc, exc_info=True)
            return Outcome(rq.ERROR, 1, "", f"{builtin.name}: {exc}\n", elapsed, detail=f"error: {exc}")
        captured = []
        for name, text in (("stdout", out.stdout), ("stderr", out.stderr)):
            capture = Capture(name, self.config.output_cap, on_output)
            capture.add(text.encode())
            captured.append(capture.text())
        status = rq.SUCCESS if out.exit_code == 0 else rq.FAILED
        return Outcome(status, out.exit_code, captured[0], captured[1], elapsed, detail=f"exit status {out.exit_code}",
                       deferred=out.deferred)

    def _deferred(self, running: Running, outcome: Outcome) -> None:
        """A built-in whose outcome comes later (an upgrade restarting into a new release): the execution stays
        running in the journal, so that `finish_deferred` (after the restart) reports it, and nothing else does.
        A local caller gets what is known so far."""
        request = running.request
        self.running.pop(request.execution_id, None)
        log.info("action %s (execution %s): %s; its result is sent when the outcome is known", request.action,
                 request.execution_id, outcome.detail, extra={"execution_id": request.execution_id})
        if not running.done.done():
            running.done.set_result({**result_body(request, outcome), "signal": 0})

    # -- start and stop -----------------------------------------------------------------------------------------

    def _lost(self, request: ActionRequest) -> None:
        body = result_body(request, Outcome(rq.ERROR, 1, "", LOST + "\n", 0.0, detail="lost"))
        self._write(f"the loss of execution {request.execution_id}", lambda: self.journal.settle(
            request.execution_id, request.action, CONTROL_PLANE, request.to_json(), rq.ERROR, "result", body))
        log.warning("action %s (execution %s): the control plane holds it as started, and this node has no record of "
                    "it: reported as lost, not run", request.action, request.execution_id,
                    extra={"execution_id": request.execution_id})

    def finish_deferred(self, execution_id: str, exit_code: int, stdout: str, stderr: str, detail: str) -> None:
        """Report the outcome of an execution a built-in deferred (`Output.deferred`), maybe after a restart."""
        execution = self.journal.known(execution_id)
        if execution is None or execution.state != RUNNING:
            log.warning("execution %s is not waiting for its result (%s); not reported", execution_id,
                        "unknown" if execution is None else execution.state)
            return
        status = rq.SUCCESS if exit_code == 0 else rq.FAILED
        self._finish_journaled(execution, Outcome(status, exit_code, stdout, stderr,
                                                  max(0.0, time.time() - execution.accepted_at), detail=detail))

    def _finish_journaled(self, execution: Execution, outcome: Outcome) -> bool:
        """Finish an execution no task runs any more, from its journal entry; False when the journal refused."""
        request = execution.request
        triggered = request.get("triggered_by") if isinstance(request.get("triggered_by"), dict) else None
        body = result_body(ActionRequest(execution.execution_id, execution.action, triggered_by=triggered), outcome)
        try:
            self.journal.finish(execution.execution_id, outcome.status, body)
        except JournalError as exc:
            log.error("%s", exc)
            return False
        if execution.origin == LOCAL:
            self.audit.record("finished", execution_id=execution.execution_id, action=execution.action,
                              status=outcome.status, exit_code=outcome.exit_code)
        return True

    def recover(self, keep: frozenset[str] = frozenset()) -> int:
        """Finish, as ``error``, every execution a crash cut short; they are never run again. Also forget
        executions finished longer ago than the journal's retention. `keep`: executions whose result is still
        to come (a deferred built-in, see `finish_deferred`)."""
        try:
            pruned = self.journal.prune()
        except JournalError as exc:
            log.error("%s", exc)
            pruned = 0
        if pruned:
            log.info("forgot %d execution(s) finished more than 30 days ago", pruned)
        interrupted = [e for e in self.journal.interrupted() if e.execution_id not in keep]
        for execution in interrupted:
            outcome = Outcome(rq.ERROR, 1, "", "plexd stopped while this action was running (crash or kill); its "
                              "outcome is unknown and it was not run again\n",
                              max(0.0, time.time() - execution.accepted_at), detail="interrupted")
            if not self._finish_journaled(execution, outcome):
                continue
            log.warning("action %s (execution %s) was running when plexd stopped: reported as error, not re-run",
                        execution.action, execution.execution_id, extra={"execution_id": execution.execution_id})
        return len(interrupted)

    async def drain(self, grace: float) -> None:
        """Refuse new work; give running executions `grace` seconds, then cancel them (``cancelled``)."""
        self.shutting_down = True
        tasks = [r.task for r in self.running.values() if r.task is not None]
        if tasks:
            log.info("waiting up to %s for %d running action(s) to finish", format_duration(grace), len(tasks))
            _, pending = await asyncio.wait(tasks, timeout=grace)
            if pending:
                log.warning("cancelling %d action(s) still running after the drain window", len(pending))
                for running in list(self.running.values()):
                    running.cancel.set()
                await asyncio.wait(pending, timeout=self.config.kill_grace + 10)
        await self.unwritten.close()

    def reconfigure(self, running: Config) -> None:
        """A reload's new actions.* settings, read per request from now on."""
        self.config = running.actions

    def status(self) -> dict[str, Any]:
        return {"enabled": self.config.enabled, "max_concurrent": self.config.max_concurrent,
                "running": [r.to_json() for r in self.running.values()], "accepted": self.accepted,
                "rejected": dict(self.rejected), "outbox": self.outbox.status(), "hooks": self.hooks.status(),
                "unwritten": len(self.unwritten)}


def result_body(request: ActionRequest, outcome: Outcome) -> dict[str, Any]:
    """The §1.13 result: Go's duration string, UTC ``finished_at``, ``triggered_by`` echoed (omitted if absent)."""
    body: dict[str, Any] = {"execution_id": request.execution_id, "status": outcome.status,
                            "exit_code": outcome.exit_code, "stdout": outcome.stdout, "stderr": outcome.stderr,
                            "duration": format_duration(outcome.duration), "finished_at": format_time(now_utc())}
    if request.triggered_by is not None:
        body["triggered_by"] = request.triggered_by
    return body

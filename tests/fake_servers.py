"""Fake generation servers shared by the scheduler, elastic and replay tests.

* ``FakeServer``: a thread that "generates" each sample a few ms after its submit
  (real time; tests/runtime/rollout/test_scheduler.py).
* ``VirtualServer``: finishes samples at virtual times, driven by ``drive`` under a
  ``VirtualClock`` with ``_virtual_scheduler`` (thread-free runs).
* ``_Server``: a server pool member that records calls and can be made to fail.
"""

import concurrent.futures
import threading
import time

import numpy as np

from jaxflash.replay.group_buffer import GroupBuffer
from jaxflash.rewards.base import RewardResult
from jaxflash.runtime.clock import RealClock, VirtualClock
from jaxflash.runtime.rollout.dispatch import prompt_dispatch
from jaxflash.runtime.rollout.ledger import PromptLedger
from jaxflash.runtime.rollout.reward_pool import Scored
from jaxflash.runtime.rollout.scheduler import Inbox, RolloutScheduler
from jaxflash.runtime.rollout.settings import RolloutBooks, RolloutSettings
from jaxflash.runtime.rollout.thread_free import ThreadFree
from jaxflash.types import (
    FinishReason,
    GenerationRequest,
    Prompt,
    Sample,
    SamplingParams,
)

SAMPLING = SamplingParams(max_new_tokens=4)


def _request(pid, idx=0):
    return GenerationRequest(
        prompt_id=pid, sample_index=idx, prompt_tokens=np.array([1, 2], np.int32), sampling=SAMPLING
    )


def _prompt(pid):
    return Prompt(prompt_id=pid, text=f"q{pid}", prompt_tokens=np.array([1, 2]), answer="a")


class _Source:
    def __init__(self, n=100):
        self.cursor, self.n = 0, n

    def take(self, k):
        out = []
        while len(out) < k and self.cursor < self.n:
            out.append(_prompt(self.cursor))
            self.cursor += 1
        return out


class _Server:
    def __init__(self, version=0, partial_rollout="continue"):
        self.version, self.partial_rollout = version, partial_rollout
        self.fail_with = None  # raised by every call once set
        self.submitted, self.aborted, self.updates = [], [], []

    def _maybe_fail(self):
        if self.fail_with is not None:
            raise self.fail_with

    def start(self):
        pass

    def stop(self, timeout_s=60.0):
        return []

    def submit(self, request):
        self._maybe_fail()
        if request.prompt_id < 0:
            raise ValueError("prompt of 999 tokens exceeds max_prefill_length=64 tokens")
        self.submitted.append(request.prompt_id)

    def abort_prompt(self, prompt_id):
        self._maybe_fail()
        self.aborted.append(prompt_id)
        return 1

    def update_weights(self, params, version):
        self._maybe_fail()
        self.updates.append(version)

    def check(self):
        self._maybe_fail()

    def stats(self):
        self._maybe_fail()
        return {"version": self.version}


class VirtualServer:
    """Finishes each sample ``latency_s`` virtual seconds after its submit.

    Samples of prompts in ``hang`` never finish; a submit for a prompt in ``poison``
    kills the server (that submit and every later call raise).
    """

    partial_rollout = "continue"

    def __init__(self, on_finished, clock, *, latency_s=1.0, hang=(), poison=(), reject=()):
        self.on_finished, self.clock, self.latency_s = on_finished, clock, latency_s
        self.hang, self.poison, self.reject = set(hang), set(poison), set(reject)
        self.version, self.queue, self.error, self.submitted = 0, {}, None, []

    def start(self):
        pass

    def stop(self, timeout_s=60.0):
        return sorted(self.queue)

    def check(self):
        if self.error:
            raise RuntimeError(self.error)

    def submit(self, request):
        self.check()
        if request.prompt_id in self.reject:
            raise ValueError(f"prompt {request.prompt_id} cannot run on this engine")
        if request.prompt_id in self.poison:
            self.error = f"died on prompt {request.prompt_id}"
            self.check()
        key = (request.prompt_id, request.sample_index)
        self.queue[key] = (self.clock.now() + self.latency_s, request, self.version)
        self.submitted.append(key)

    def abort_prompt(self, prompt_id):
        self.check()
        keys = [k for k in self.queue if k[0] == prompt_id]
        for k in keys:
            del self.queue[k]
        return len(keys)

    def update_weights(self, params, version):
        self.check()
        self.version = version

    def stats(self):
        self.check()
        return {"version": self.version}

    def next_due(self):
        due = [t for k, (t, _, _) in self.queue.items() if k[0] not in self.hang]
        return min(due, default=None)

    def deliver_due(self):
        for key, (t, req, version) in sorted(self.queue.items()):
            if t <= self.clock.now() and key[0] not in self.hang and not self.error:
                del self.queue[key]
                self.on_finished(
                    Sample(
                        prompt_id=req.prompt_id,
                        sample_index=req.sample_index,
                        prompt_tokens=np.asarray(req.prompt_tokens, np.int32),
                        response_tokens=np.array([7, 0], np.int32),
                        behaviour_logprobs=np.zeros(2, np.float32),
                        token_versions=np.array([version, version], np.int32),
                        start_version=version,
                        finish_reason=FinishReason.EOS,
                    )
                )


class InstantRewards:
    """Reward = sample index; the future is resolved before it is returned."""

    def submit(self, item):
        f = concurrent.futures.Future()
        f.set_result(Scored(RewardResult(score=float(item[2].split()[-1]))))
        return f


class Tok:
    eos_id = 0
    stop_ids = frozenset({0})

    def decode(self, ids):
        return " ".join(map(str, ids))

    def response_text(self, ids):  # up to the first stop id, like models.Tokenizer
        ids = [int(i) for i in ids]
        cut = next((k for k, t in enumerate(ids) if t in self.stop_ids), len(ids))
        return self.decode(ids[:cut])


def drive(sched, clock, servers, learner_version, *, real_timeout_s=60.0):
    """Discrete-event loop: poll, try the batch, else jump to the next event.

    Events are server deliveries and sample deadlines (virtual time); rewards from
    a real reward pool resolve in real time, so time stands still while any is out.
    """
    stop_at = time.monotonic() + real_timeout_s
    while time.monotonic() < stop_at:
        ThreadFree(sched).poll()
        batch = ThreadFree(sched).try_batch(learner_version)
        if batch is not None:
            return batch
        if (
            ThreadFree(sched).parts.dispatcher.watch.stats()["samples_scoring"]
            or not ThreadFree(sched).parts.dispatcher.inbox.empty()
        ):
            ThreadFree(sched).parts.dispatcher.inbox.wait(RealClock(), 0.05)
            continue
        events = [s.next_due() for s in servers] + [ThreadFree(sched).next_deadline()]
        events = [t for t in events if t is not None]
        assert events, "nothing can happen: the scheduler would wait forever"
        clock.advance_to(max(clock.now(), min(events) + 1e-6))
        for s in servers:
            s.deliver_due()
    raise AssertionError("no batch within the real-time limit")


def _rollout(source, buffer, scorer, *, B, G, alpha, ledger, clock, servers, inbox, **kw):
    """A RolloutScheduler from today's keyword arguments (books, settings, dispatch)."""
    books_kw = {k: kw.pop(k) for k in ("resume_prompts", "counters") if k in kw}
    books = RolloutBooks(source=source, ledger=ledger, buffer=buffer, **books_kw)
    settings = RolloutSettings(
        batch_prompts=B, group_size=G, async_ratio=alpha, sampling=SAMPLING, seed=0, **kw
    )
    dispatch = prompt_dispatch(scorer, Tok())
    return RolloutScheduler(servers, inbox, books, settings, dispatch, clock=clock)


def _virtual_scheduler(servers_kw, *, B, G, alpha=0, scorer=None, source=None, **kw):
    clock, inbox, ledger = VirtualClock(), Inbox(), PromptLedger()
    servers = [VirtualServer(inbox.generated, clock, **s) for s in servers_kw]
    sched = _rollout(
        source or _Source(),
        GroupBuffer(G),
        scorer or InstantRewards(),
        B=B, G=G, alpha=alpha, ledger=ledger, clock=clock, servers=servers, inbox=inbox, **kw,
    )  # fmt: skip
    return sched, clock, servers, ledger


class FakeServer:
    """Finishes each request after ``delay_s``; ``dead`` servers never finish anything."""

    partial_rollout = "continue"

    def __init__(self, on_finished, *, delay_s=0.005, dead=False, hang=()):
        self.version, self.delay_s, self.dead, self.hang = 0, delay_s, dead, set(hang)
        self.on_finished = on_finished
        self.error = None  # set it to kill the server: check/submit raise, nothing finishes
        self.submitted, self.aborted = [], []
        self._lock = threading.Lock()
        self._queue = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def start(self):
        pass

    def stop(self, timeout_s=60.0):
        self._stop.set()
        return []

    def stats(self):
        return {"version": self.version}

    def check(self):
        if self.error:
            raise RuntimeError(f"server loop failed: {self.error}")

    def submit(self, request):
        self.check()
        with self._lock:
            self.submitted.append((request.prompt_id, request.sample_index))
            self._queue.append((time.monotonic() + self.delay_s, request, self.version))

    def abort_prompt(self, prompt_id):
        with self._lock:
            n = len(self._queue)
            self._queue = [q for q in self._queue if q[1].prompt_id != prompt_id]
            self.aborted.append(prompt_id)
            return n - len(self._queue)

    def update_weights(self, params, version):
        assert version > self.version
        self.version = version

    def _loop(self):
        while not self._stop.is_set():
            time.sleep(0.002)
            if self.dead or self.error:
                continue
            now, done = time.monotonic(), []
            with self._lock:
                for q in list(self._queue):
                    key = (q[1].prompt_id, q[1].sample_index)
                    if q[0] <= now and key not in self.hang:
                        self._queue.remove(q)
                        done.append(q)
            for _, req, version in done:
                self.on_finished(
                    Sample(
                        prompt_id=req.prompt_id,
                        sample_index=req.sample_index,
                        prompt_tokens=np.asarray(req.prompt_tokens, np.int32),
                        response_tokens=np.array([5, 0], np.int32),
                        behaviour_logprobs=np.zeros(2, np.float32),
                        token_versions=np.array([version, version], np.int32),
                        start_version=version,
                        finish_reason=FinishReason.EOS,
                    )
                )

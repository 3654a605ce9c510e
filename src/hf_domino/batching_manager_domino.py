"""`target.init_continuous_batching(assistant_model=drafter)`: a drafted batch that requests join as they arrive.

transformers' manager beneath `generate_batch` (`init_continuous_batching`, `continuous_batching_context_manager`,
what `transformers serve` builds) takes requests from any thread while a background thread decodes, and takes no
assistant. With a Domino drafter the generate() hook returns a `DraftedBatchingManager` instead: the same methods,
its thread stepping the drafted batch that `generate_batch` with the drafter runs (`continuous_batching_domino.
Serving`), so each request generates what `target.generate(prompt)` generates for it alone; `Results` hands results
to the readers.

This file is also written next to exported checkpoints as remote code (transformers + torch only).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import glob
import os
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus
from transformers.utils.logging import get_logger

from .continuous_batching_domino import Request, Serving, ServingCall, prompt_ids, sequence_ids

if TYPE_CHECKING:
    from transformers import GenerationConfig, PreTrainedModel

    from .modeling_domino import DominoForSpeculation

logger = get_logger(__name__)

# A manager's batch is judged every this many cycles (`Serving.judge_window`), so that a server never idle still
# learns within a batch whether speculating pays, and pauses for a window of cycles rather than whole batches.
MANAGER_JUDGE_CYCLES = 256
# Requests one drafted batch of a manager takes on; the next wait until it runs dry, and a fresh batch takes them.
# A batch keeps each row's tokens and rules until it ends, so a server that is never idle still ends a batch now and
# then: at 8 rows of 128 tokens, a tail of a few cycles in some thousands.
MANAGER_BATCH_REQUESTS = 1024
# On a CPU, `start()` releases the OpenMP worker threads of the thread that calls it (`release_openmp_workers`): with
# them and the manager thread's own, a process has more OpenMP threads than cores, and libgomp then puts idle workers
# to sleep at once, so that each of the thread's parallel regions pays for waking them (docs/benchmarks.md, "On a
# CPU, torch's work in a second thread"). The caller's next parallel work brings its workers back.
RELEASE_CALLER_OPENMP = True
# The sampling settings a request may set for itself in a batch that samples, with their types: those transformers'
# manager takes per request (`ContinuousBatchingConfig.per_request_processors`, which `transformers serve` turns on),
# each row then sampling as `generate()` with them would. They change the law of its row alone: the eager rollout
# draws each row's drafts through the row's own processors (the fused one on CUDA through the batch's first
# request's), and verification weighs every draft against the law it was drawn from, so each row's law stays exact.
REQUEST_SAMPLING = {"temperature": float, "top_k": int, "top_p": float}


class Results:
    """A manager's results in the order they came, for readers of any request or of one: a condition variable, so
    that a reader waiting for its request sleeps rather than taking and putting back others'."""

    def __init__(self):
        self._ready = threading.Condition()
        self._results: deque[GenerationOutput] = deque()
        self._producing = False  # whether a thread that puts results runs (from `open` to `close`)
        self._handlers: dict[str, tuple[Callable[[GenerationOutput], Any], Any]] = {}  # request id -> (callback, loop)

    def open(self) -> None:
        with self._ready:
            self._producing = True

    def put(self, result: GenerationOutput) -> None:
        with self._ready:
            handler = self._handlers.get(result.request_id)
            if handler is None:
                self._results.append(result)
                self._ready.notify_all()
                return
            if result.is_finished():
                del self._handlers[result.request_id]
        callback, loop = handler
        loop.call_soon_threadsafe(callback, result)

    def handle(self, request_id: str, callback: Callable[[GenerationOutput], Any], loop: Any) -> None:
        """From now on `request_id`'s results go to `callback`, called on the event loop `loop`, up to its finished
        one; those already here go first."""
        with self._ready:
            self._handlers[request_id] = (callback, loop)
            waiting = [result for result in self._results if result.request_id == request_id]
            for result in waiting:
                self._results.remove(result)
        for result in waiting:
            self.put(result)

    def close(self) -> None:
        """Wakes the readers: the thread that puts results has ended."""
        with self._ready:
            self._producing = False
            self._ready.notify_all()

    def take(self, request_id: str | None, timeout: float | None) -> GenerationOutput | None:
        """The oldest result (of `request_id`, if given); None after `timeout` seconds, or once none is left and no
        thread puts more."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._ready:
            while True:
                for result in self._results:
                    if request_id is None or result.request_id == request_id:
                        self._results.remove(result)
                        return result
                left = None if deadline is None else deadline - time.monotonic()
                if not self._producing or (left is not None and left <= 0):
                    return None
                self._ready.wait(left)


class DraftedBatchingManager:
    """transformers' `ContinuousBatchingManager` with a Domino drafter: requests added from any thread, while it
    runs, join the running drafted batch as rows finish, and their results (a streaming request's tokens so far
    too) come back through `get_result` / `request_id_iter` / iteration, as transformers' manager hands them.

    Made by `target.init_continuous_batching(assistant_model=drafter, ...)` (the generate() hook) or directly; one
    background thread does all the model work. Each request generates what `target.generate(prompt)` generates for
    it alone (`generate_batch` with the drafter, which this serves request by request: `Serving`), with its own
    `max_new_tokens` and, when the config samples, its own `temperature`, `top_k` and `top_p` (what transformers'
    manager takes per request, and `transformers serve` sends). Not served: per-request EOS tokens or other
    generation settings (set them in the generation config).
    """

    def __init__(
        self,
        target: PreTrainedModel,
        drafter: DominoForSpeculation,
        generation_config: GenerationConfig | None = None,
        continuous_batching_config: Any = None,
        **kwargs: Any,
    ):
        self.call = ServingCall.prepare(target, drafter, generation_config, continuous_batching_config, kwargs)
        self.generation_config = self.call.generation_config
        self.results = Results()
        self._incoming: queue.Queue[tuple[Request, tuple]] = queue.Queue()
        self._cancelled: queue.Queue[str] = queue.Queue()
        self._wake, self._stopping, self._hard_stop = threading.Event(), threading.Event(), threading.Event()
        self._destroyed = False
        self._thread: threading.Thread | None = None
        self._lock, self._counter = threading.Lock(), 0
        self.error: Exception | None = None  # what stopped the background thread, if anything did
        # pause(): how many threads hold one and which, and whether the background thread waits for them now.
        self._pause, self._pausing, self._holders, self._paused = threading.Condition(), 0, Counter(), False

    # ------------------------------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Starts the background thread that serves the requests."""
        if self._destroyed:
            raise RuntimeError(
                "This manager was destroyed and cannot start again: make another (init_continuous_batching)."
            )
        if self.is_running():
            if not self._stopping.is_set():
                return
            self._thread.join()  # a stop(block=False) still finishing the requests added before it: they end first
        self._stopping.clear()
        self._hard_stop.clear()
        self.error = None
        self.results.open()
        if RELEASE_CALLER_OPENMP and self.call.device.type == "cpu":
            release_openmp_workers()
        self._thread = threading.Thread(target=self._serve, name="domino-batching-manager", daemon=True)
        self._thread.start()

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def background_thread_status(self) -> SimpleNamespace:
        """What transformers' serving code (`transformers serve`) reads of a manager's thread: `fatal_error`, the
        error that stopped it (`error`), else None."""
        return SimpleNamespace(fatal_error=self.error)

    # What transformers' serving (>= 5.25, `CBGenerateRunner`) reads of its own manager besides the above.
    batch_processor = None  # its paged cache and scheduler, for a stats line: a drafted batch has neither

    @property
    def logit_processor(self) -> SimpleNamespace:
        """The sampling settings a request may set for itself (`supported_keys`, name -> type), which `transformers
        serve` reads to pass a request's on: `REQUEST_SAMPLING` when the config samples, else none (a greedy batch
        has no law to set; generate() ignores them when it decodes greedily)."""
        return SimpleNamespace(supported_keys=dict(REQUEST_SAMPLING) if self.generation_config.do_sample else {})

    def warmup(self) -> None:
        """Nothing to warm up: transformers' manager captures its CUDA graphs here; a drafted batch measures its
        verification costs when the models are prepared (`prepare_for_cpu_decoding`), else in its first cycles."""

    def stop(
        self,
        block: bool = True,
        timeout: float | None = None,
        keep_for_next_session: bool = False,
        hard_stop: bool = False,
    ) -> None:
        """Stops taking requests; the thread ends once those added before are done (with `block`, this waits for
        that, at most `timeout` seconds), or with `hard_stop` after its current step, every request it holds failed.

        `keep_for_next_session` is transformers' manager's, which caches itself on the model for the next
        `init_continuous_batching`; a drafted manager serves again whoever holds it with `start()`, so it keeps
        nothing more."""
        if block and self._holders[threading.get_ident()] > 0:
            raise RuntimeError(
                "Cannot stop the manager from inside its pause(): the paused thread would wait for the pause to end "
                "and this call for the thread. Leave the pause first."
            )
        if keep_for_next_session:
            logger.info("A drafted manager is not cached on the model: start() this one again to serve with it.")
        if hard_stop:
            self._hard_stop.set()
        self._stopping.set()
        self._wake.set()
        if block and self._thread is not None:
            self._thread.join(timeout)

    def destroy(self) -> None:
        """Stops the manager (waiting for its requests) for good: it cannot start again. Safe to call twice."""
        if self.is_running():
            self.stop(block=True)
        self._destroyed = True

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Pauses the background thread between two steps, so that the calling thread can use the models (update
        the target's weights in place, say); it resumes, its requests and caches kept, once the last thread holding
        a pause leaves."""
        if not self.is_running():
            raise RuntimeError("Cannot pause a manager whose thread is not running: start() it first.")
        with self._pause:
            self._pausing += 1
            self._holders[threading.get_ident()] += 1
            self._wake.set()
            while not self._paused:
                if not self.is_running():
                    self._pausing -= 1
                    self._holders[threading.get_ident()] -= 1
                    raise RuntimeError(f"The manager's thread ended while pausing: {self.error!r}")
                self._pause.wait(0.1)
        try:
            yield
        finally:
            with self._pause:
                self._pausing -= 1
                self._holders[threading.get_ident()] -= 1
                self._pause.notify_all()

    def _pause_point(self) -> None:
        """Between two steps: waits while a thread holds a pause."""
        with self._pause:
            if not self._pausing:
                return
            self._paused = True
            self._pause.notify_all()
            self._pause.wait_for(lambda: self._pausing == 0)
            self._paused = False

    def register_result_handler(self, request_id: str, callback: Callable[[GenerationOutput], Any]) -> None:
        """Hands `request_id`'s results (each streamed one, then its finished one) to `callback`, called on the
        asyncio event loop running in the calling thread, instead of to `get_result`."""
        self.results.handle(request_id, callback, asyncio.get_running_loop())

    def __enter__(self) -> DraftedBatchingManager:
        self.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()

    # -------------------------------------------------------------------------------------------------- requests
    def add_request(
        self,
        input_ids: list[int],
        request_id: str | None = None,
        max_new_tokens: int | None = None,
        streaming: bool = False,
        record_timestamps: bool = False,
        eos_token_id: int | list[int] | None = None,
        **sampling: Any,
    ) -> str:
        """Queues one prompt (token ids) and returns its request id (`req_<n>` unless given). With `streaming`, its
        tokens so far come back after each of its cycles (`RequestStatus.DECODING`) before its result. `sampling`:
        the request's own `temperature`, `top_k` or `top_p` where the config samples (`top_k=1`: greedy), as
        `target.generate(prompt, **sampling)` would take them."""
        if self._stopping.is_set():
            raise RuntimeError("This manager is stopping or stopped and takes no more requests: start() it again.")
        self._check_eos(eos_token_id)
        self._check_sampling(sampling)
        if request_id is None:
            with self._lock:
                request_id, self._counter = f"req_{self._counter}", self._counter + 1
        what = f"add_request's prompt ({request_id})"
        prompt = prompt_ids(input_ids, self.call.device, what, self.call.vocab_size)
        rules = self.call.rules(prompt, max_new_tokens, sampling)
        with self._lock:  # the thread fails what it holds under the same lock when it ends on an error
            if self.error is not None:
                raise RuntimeError(
                    f"This manager's thread ended on an error ({self.error!r}) and takes no more requests: start() it "
                    "again."
                )
            for name in sequence_ids(request_id, self.generation_config.num_return_sequences or 1):
                self._incoming.put((Request(name, prompt, streaming, record_timestamps), rules))
        self._wake.set()
        return request_id

    def add_requests(
        self,
        inputs: list[list[int]],
        max_new_tokens: int | None = None,
        streaming: bool = False,
        record_timestamps: bool = False,
        **sampling: Any,
    ) -> list[str]:
        """`add_request` for each prompt, in order; returns their ids."""
        return [
            self.add_request(ids, None, max_new_tokens, streaming, record_timestamps, **sampling) for ids in inputs
        ]

    def cancel_request(self, request_id: str) -> None:
        """Drops a request (and its other sequences) waiting or running; it gets no result."""
        self._cancelled.put(request_id)
        self._wake.set()

    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """The oldest result not yet taken (a streaming request's tokens so far, or a finished request), or with
        `request_id` that request's; None after `timeout` seconds (None: while the thread runs), or at once when
        none is left and the thread has ended. Other requests' results stay for their readers, so threads that each
        wait for their own request do not take each other's (transformers' manager returns None there instead)."""
        return self.results.take(request_id, timeout)

    def __iter__(self) -> Iterator[GenerationOutput]:
        """Results as they come, until the thread has ended and none is left."""
        while (result := self.get_result()) is not None:
            yield result

    def request_id_iter(self, request_id: str) -> Iterator[GenerationOutput]:
        """One request's results as they come, up to its finished one."""
        while (result := self.get_result(request_id)) is not None:
            yield result
            if result.is_finished():
                return

    def _check_eos(self, eos_token_id: int | list[int] | None) -> None:
        if eos_token_id is None:
            return
        configured = self.generation_config.eos_token_id
        listed = lambda ids: sorted([ids] if isinstance(ids, int) else list(ids or []))  # noqa: E731
        if listed(eos_token_id) != listed(configured):
            raise ValueError(
                f"This drafted batch stops every request at the generation config's EOS tokens ({configured}); got "
                f"eos_token_id={eos_token_id}. Set it in the GenerationConfig the manager is made with."
            )

    def _check_sampling(self, sampling: dict[str, Any]) -> None:
        """Raises, naming the fix, for a request's sampling setting that this manager cannot serve (as transformers'
        manager checks them: a `TypeError` for a value of another type)."""
        supported = self.logit_processor.supported_keys
        for name, value in sampling.items():
            if name not in supported:
                if name in REQUEST_SAMPLING:
                    raise ValueError(
                        f"A request sets {name}={value!r}, but this manager decodes greedily (its generation config "
                        "has do_sample=False). Make it with GenerationConfig(do_sample=True, ...) for requests to "
                        "sample, each with its own settings (top_k=1 is greedy there)."
                    )
                raise ValueError(
                    f"A request may set its own {', '.join(REQUEST_SAMPLING)} and max_new_tokens; got {name}={value!r}. "
                    "Set other generation settings in the GenerationConfig the manager is made with."
                )
            if not isinstance(value, supported[name]) or isinstance(value, bool):
                raise TypeError(f"A request's {name} is a {supported[name].__name__}; got {value!r}.")

    # --------------------------------------------------------------------------------------- background thread
    def _serve(self) -> None:
        """Takes on added requests, drops cancelled ones, steps the running batch; ends when stopping and idle."""
        pending: deque = deque()
        serving: Serving | None = None
        try:
            with torch.no_grad(), self.call.kernels():
                while True:
                    self._pause_point()
                    while not self._incoming.empty():
                        pending.append(self._incoming.get())
                    if self._hard_stop.is_set():
                        self._fail(_held(pending, serving), "the manager was stopped (stop(hard_stop=True))")
                        return
                    while not self._cancelled.empty():
                        _cancel(self._cancelled.get(), pending, serving)
                    if serving is not None and not serving.busy:  # ran dry: its last window judged
                        serving.judge_window(final=True)
                        serving = None
                    if pending and serving is None:
                        serving = Serving(self.call.decoding(pending[0][1]), self.call.limit, self.results.put)
                    while pending and serving.admitted + len(serving.waiting) < MANAGER_BATCH_REQUESTS:
                        serving.add(*pending.popleft())
                    if serving is not None:
                        serving.step()
                        serving.judge_window(MANAGER_JUDGE_CYCLES)
                    elif self._stopping.is_set():
                        return
                    else:
                        self._wake.wait(timeout=0.1)
                        self._wake.clear()
        except Exception as error:  # every request still held fails with it, as transformers' manager fails them
            with self._lock:  # requests added until now are held too; add_request refuses any later one
                self.error = error
                while not self._incoming.empty():
                    pending.append(self._incoming.get())
            logger.error(f"The drafted batching manager stopped: {error!r}")
            self._fail(_held(pending, serving), repr(error))
        finally:
            self.results.close()

    def _fail(self, requests: list[Request], error: str) -> None:
        """Hands each of `requests` back failed, with `error`, as transformers' manager fails what it holds."""
        for request in requests:
            self.results.put(
                GenerationOutput(
                    request_id=request.request_id,
                    prompt_ids=request.prompt.tolist(),
                    error=error,
                    status=RequestStatus.FAILED,
                    created_time=request.created,
                )
            )


def release_openmp_workers() -> bool:
    """Ends the calling thread's OpenMP worker threads (`omp_pause_resource_all`, OpenMP 5.0) in every OpenMP runtime
    the process has loaded that offers it (torch's, and any other library's own copy); returns whether one did. The
    thread's next parallel region starts them again. Where no runtime offers it (torch 2.6 bundles a libgomp
    without it), the workers stay and it returns False."""
    released = False
    for pause in _openmp_pause_functions():
        released = pause(1) == 0 or released  # omp_pause_soft
    return released


def _openmp_pause_functions() -> list[Callable[[int], int]]:
    """`omp_pause_resource_all` of each OpenMP runtime this process has loaded that offers it."""
    functions = []
    for path in _openmp_runtimes():
        try:
            pause = getattr(ctypes.CDLL(path), "omp_pause_resource_all", None)
        except OSError:  # a mapped file that is gone, or not a library this process can open again
            continue
        if pause is not None:
            pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
            functions.append(pause)
    return functions


def _openmp_runtimes() -> list[str]:
    """Paths of the OpenMP runtimes this process has loaded (libgomp, LLVM's libomp, Intel's libiomp5), read from
    `/proc/self/maps`; elsewhere the one bundled with torch, which importing torch loaded."""
    names = ("libgomp", "libomp", "libiomp5")
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(maxsplit=5)[-1].strip() for line in maps if "/lib" in line}
    except OSError:
        paths = set(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "lib*omp*")))
    return sorted(path for path in paths if os.path.basename(path).startswith(names))


def _held(pending: deque, serving: Serving | None) -> list[Request]:
    """The requests a manager's thread holds: not yet in a batch, waiting in it, or running."""
    held = [request for request, _ in pending]
    if serving is not None:
        held += [request for request, _ in serving.waiting] + list(serving.running.values())
    return held


def _cancel(request_id: str, pending: deque, serving: Serving | None) -> None:
    """Drops `request_id` and its extra sequences (`sequence_ids`), wherever the thread holds them."""
    prefix = f"{request_id}__child#"
    names = {
        r.request_id for r in _held(pending, serving) if r.request_id == request_id or r.request_id.startswith(prefix)
    }
    for entry in [entry for entry in pending if entry[0].request_id in names]:
        pending.remove(entry)
    if serving is not None:
        for name in names:
            serving.cancel(name)


__all__ = [
    "MANAGER_BATCH_REQUESTS",
    "MANAGER_JUDGE_CYCLES",
    "RELEASE_CALLER_OPENMP",
    "DraftedBatchingManager",
    "Results",
    "release_openmp_workers",
]

"""The frame loop over every live request, in one thread: continuous batching at frame boundaries.

One frame step, for the B rows of the batch (each a request, row b of the talker's cache):
 1. c0: the talker's head on each row's last hidden state; each row draws with its own rules and generator
    (`TalkerRules`: upstream's repetition penalty, EOS and suppressed tokens, then its sampler);
 2. rows that drew EOS (or their last allowed token) leave at once, and so do cancelled ones;
 3. c1..c{G-1}: `decode_frames` for the rest, one batch per predictor sampler, AR or the policy's tree for that
    batch size (the core's speculation: exact, so each row's codes keep their distribution); without its per-call
    checks (`decode_checked`): the drafter and trees are checked once (`Engine`, `check_set_up`), a request's sampler
    and generator are made by its adapter and the Engine, the predictor's derived copies are refreshed as a request
    joins, and a row whose state is not finite or out of range (`check_batch`'s bound) fails in step 1;
 4. each frame goes to its request (the codec workers turn it into audio) and becomes the row's next talker input
    (the model's frame embedding, plus Qwen3-TTS's trailing text);
 5. one talker step for all rows gives each its next hidden state;
 6. before the next step, a piece of a waiting request's prompt is prefilled (below).
Between steps, waiting requests are prefilled, one by one, and join at the next step (up to `max_batch` rows, and
while the measured capacity keeps the running streams at real time: `runtime/capacity.py`). While rows decode, a gap
between two steps runs one piece of at most `prefill_chunk` prompt tokens (chunked prefill), so that an arrival delays
a running stream's next frame by one piece, not by its whole prompt; with no row decoding, prompts are prefilled
whole. A prompt is prefilled into a staging row of its own (`core/talker.py`) and copied into the batch's cache
when it is done, so that it never takes part in a step half-prefilled. `PREFILL_CHUNK`: why its size. Each step and
each piece holds the thread budget's cores for the frame loop (`runtime/threads.py`), and the codec workers are woken
to turn the new frames into audio.
A row's codes do not depend on the batch: every draw of a row, its c0 and its predictor's (AR or speculative),
comes from its request's own generator, which moves on by the same amount per frame in any batch (`core/context.py`,
Draws), so a seeded request's codes are the same bits alone and in any batch, joining mid-utterance or not (given the
same logits bits: greedy or sampled, `core/talker.py`), as per-request seeds are in vLLM.

Text that arrives over time (runtime/live_text.py): a row whose frame t needs text row t that has not arrived is
parked after step 4 (out of the batch, its cache row moved to `parked_cache`, its next input kept) and rejoins for
step 5 of the first step after its text comes; it keeps its place toward `max_batch`. A live request waits in the
queue until its prompt's text has arrived, without holding the requests behind it.

A row fails alone: one whose talker state or logits turn non-finite (inf or nan: a clip or prompt out of range), or
whose draw or predictor batch raises, leaves with its own error while the others go on with the same bits. Its cache
row is zeroed first: a masked slot still multiplies its value by 0, and 0 * nan is nan for the next row there.
"""

import collections
import threading
import time
import traceback
import warnings
from dataclasses import dataclass, field

import torch
from torch import Tensor

from rvqspec.core import policy as policy_choice
from rvqspec.core import talker as talker_blocks
from rvqspec.core.decode import MAX_HIDDEN, decode_checked, fit_speculation
from rvqspec.core.errors import RvqspecError
from rvqspec.core.frame_loop import POLL_SECONDS, Stats
from rvqspec.core.policy import Policy
from rvqspec.core.sampling import Sampler
from rvqspec.core.tree import Tree
from rvqspec.runtime.capacity import Capacity
from rvqspec.runtime.codec_worker import CodecWorker, Cores, Grant
from rvqspec.runtime.request import QueueFull, Request
from rvqspec.runtime.threads import ThreadBudget

# Prompt tokens prefilled in one gap between two frame steps while rows decode. A prefill call costs a fixed part
# (the layers' weights read once: about one talker step) plus a part per token; measured at the 0.6B sizes, bfloat16,
# one thread, on an Intel Xeon with AMX (two runs): 16 tokens 1.2 talker steps, 64 tokens 1.5-1.8, 320 tokens 4.1-4.7
# (about 1.6-2 ms a token past the fixed part; benchmarks/prefill_gap.py, benchmarks/results/prefill-gap.md). At 64
# a piece delays a running stream by under two talker steps, while a long prompt's pieces cost under twice its one
# call in all (smaller pieces would cost more calls for little less delay); short prompts still go in one piece.
PREFILL_CHUNK = 64


@dataclass
class Row:
    """A request while it decodes: its talker state and the c0 it drew."""

    request: Request
    hidden: Tensor  # [H] the talker's last hidden state (emits the next c0)
    c0: list[int] = field(default_factory=list)
    pending: Tensor | None = None  # a parked row's next talker input, its text row not arrived yet (live text)
    position: int = 0  # and that input's RoPE id

    @property
    def text_arrived(self) -> bool:
        """A parked row's: whether its text row came (or the text ended), or it was cancelled."""
        live = self.request.prompt.live
        return self.request.cancelled.is_set() or live.ready(live.start + self.frames)

    @property
    def frames(self) -> int:
        return len(self.request.decoded)

    def draw(self, logits: Tensor, in_range: bool) -> None:
        """Step 1 for this row: its next c0 from `logits` [V], by its request's rules and generator; a state out of
        range (`in_range` False) or logits that are not finite raise instead (the row fails)."""
        if not in_range:
            raise NonFinite(f"the talker state at frame {self.frames} is not finite or out of range (NaN, inf or "
                            f"|x| >= {MAX_HIDDEN:.0e}): the request's input is out of range; this request ends, the "
                            "others go on")
        check_finite(logits, f"the talker's logits at frame {self.frames}")
        earlier = torch.tensor(self.c0, dtype=torch.long, device=logits.device)
        self.c0.append(self.request.prompt.rules.draw(logits, earlier, self.request.generator))

    @property
    def ended(self) -> str | None:
        """Step 2 for this row: why it leaves now, or None. It leaves once cancelled ("cancelled"), after its EOS or a
        frame that ends its request (`Prompt.ends_after`: "eos"), or after the last c0 its budget allows ("length")."""
        request, prompt = self.request, self.request.prompt
        if request.cancelled.is_set():
            return "cancelled"
        if self.c0[-1] == prompt.rules.eos or prompt.ends_after(request.decoded):
            return "eos"
        return "length" if len(self.c0) >= prompt.max_new_tokens else None


@dataclass
class Prefill:
    """A request while its prompt is prefilled into the staging row: `done` tokens so far."""

    request: Request
    done: int = 0


class Scheduler:
    """Runs `model` (a model adapter: the contract in runtime/adapter.py) over every submitted request, in a thread
    of its own, each step holding as many of `cores` as it runs intra-op threads (`budget`: `step_threads`); `codec`
    turns the frames into audio, `capacity` decides admission."""

    def __init__(self, model, drafter, tree: Tree | None, policy: Policy | None, max_batch: int, max_queue: int,
                 cores: Cores, budget: ThreadBudget, codec: CodecWorker, capacity: Capacity,
                 prefill_chunk: int | None = PREFILL_CHUNK):
        check_set_up(model.predictor, drafter, tree, policy)
        self.model, self.drafter, self.tree, self.policy = model, drafter, tree, policy
        self.max_batch, self.max_queue = max_batch, max_queue
        self.cores, self.budget, self.codec, self.capacity = cores, budget, codec, capacity
        self.prefill_chunk = prefill_chunk  # None: whole prompts
        self.waiting: collections.deque[Request] = collections.deque()
        self.rows: list[Row] = []
        self.parked: list[Row] = []  # rows waiting for their text (module docstring), row b of `parked_cache`
        self.prefilling: Prefill | None = None
        self.cache = talker_blocks.RowCache(model.talker)
        self.parked_cache = talker_blocks.RowCache(model.talker)
        self.staging = talker_blocks.RowCache(model.talker)  # the prefilling request's row (module docstring)
        self.stats = Stats()
        self.grant: Grant | None = None  # the cores the loop holds while it steps or prefills
        self.condition = threading.Condition()
        self.accepting, self.stopping = True, False
        self.thread = threading.Thread(target=self.run, name="rvqspec-engine", daemon=True)
        self.thread.start()

    # ---------------------------------------------------------------- callers' side (any thread)

    def submit(self, request: Request, first: bool = False) -> None:
        """Queue `request`; `first`: ahead of the others, queue full or not (a passage's next sentence, whose stream
        is playing: runtime/passage.py)."""
        with self.condition:
            if not self.accepting:
                raise RvqspecError("the engine is closed: make a new rvqspec.Engine to decode more")
            for cancelled in [waiting for waiting in self.waiting if waiting.cancelled.is_set()]:
                self.waiting.remove(cancelled)  # a cancelled request gives its place back at once
                cancelled.finish()
            if len(self.waiting) >= self.max_queue and not first:
                raise QueueFull(f"the engine's queue is full ({self.max_queue} requests waiting): retry later, or make "
                                "the engine with a larger max_queue")
            if first:
                self.waiting.appendleft(request)
            else:
                self.waiting.append(request)
            if request.prompt.live is not None:
                request.prompt.live.wake = self.wake
            self.condition.notify()

    def wake(self) -> None:
        """Text arrived for a live request: the loop looks again."""
        with self.condition:
            self.condition.notify()

    def counts(self) -> tuple[int, int]:
        """(rows decoding, requests waiting: the one being prefilled included)."""
        with self.condition:
            return len(self.rows) + len(self.parked), len(self.waiting) + (self.prefilling is not None)

    def real_time_factors(self) -> list[float]:
        """Each decoding row's audio seconds per second since its first frame (above 1: faster than real time)."""
        now = time.perf_counter()
        with self.condition:
            starts = [(len(row.request.decoded), row.request.started) for row in self.rows + self.parked]
        return [frames * self.model.frame_seconds / (now - start) if start else 0.0 for frames, start in starts]

    def close(self, grace: float | None) -> None:
        """Stop accepting; let what was submitted finish within `grace` seconds (None: however long); what has not
        ends with an error (`end_all`), so that no caller takes its cut audio for the whole."""
        with self.condition:
            self.accepting = False
            self.condition.notify()
        self.thread.join(grace)
        with self.condition:
            self.stopping = True
            self.condition.notify()
        self.thread.join()

    # ---------------------------------------------------------------- the loop (its own thread)

    def run(self) -> None:
        with torch.inference_mode():
            while self.next_work():
                try:
                    with self.cores.held(self.budget.loop, self.step_threads()) as self.grant:
                        self.use_threads()
                        stepping = bool(self.rows or self.parked)  # else this turn prefills, at its own count
                        self.admit()
                        if stepping:
                            self.timed_step()
                    self.codec.wake()
                except Exception as e:  # an internal error fails the requests of this step, never the engine
                    warnings.warn(f"rvqspec engine: a frame step failed ({type(e).__name__}: {e}); its requests end "
                                  f"with the error\n{traceback.format_exc()}", RuntimeWarning)
                    self.fail_all(e)
        self.end_all()

    def step_threads(self) -> int:
        """The most threads the loop may take now: the frame loop's own share while a chunk waits for a codec worker
        or decodes, else every core of the budget (a prompt prefilled while no row decodes: `prefill_most`), so
        that a chunk decodes beside the loop and the second core is not left idle between chunks
        (runtime/threads.py). Asked as a step starts and again before its talker forward (`send_frames` wakes the
        workers as a chunk comes due: it decodes beside that forward)."""
        if self.codec.decoding():
            return self.budget.loop
        return self.budget.loop_most if self.rows or self.parked else self.budget.prefill_most

    def use_threads(self) -> None:
        """This thread's intra-op count: the cores it holds (torch keeps the count per thread)."""
        if torch.get_num_threads() != self.grant.count:
            torch.set_num_threads(self.grant.count)

    def next_work(self) -> bool:
        """Wait for something to do; False once the engine stops (or stops accepting with nothing left). Live
        requests waiting for their text are looked at as text comes (`wake`), and every POLL_SECONDS for a cancel."""
        with self.condition:
            while True:
                busy = bool(self.waiting or self.prefilling or self.rows or self.parked)
                if self.stopping or not (self.accepting or busy):
                    return False
                if self.actionable():
                    return True
                self.condition.wait(POLL_SECONDS if self.parked or self.waiting else None)

    def actionable(self) -> bool:
        """Whether the loop has work now: rows to step, a prompt to prefill, a parked row or waiting request whose
        text came (or that was cancelled)."""
        room = len(self.rows) + len(self.parked) < self.max_batch
        ready = room and any(r.prompt.ready() or r.cancelled.is_set() for r in self.waiting)
        return bool(self.rows or self.prefilling or ready or any(row.text_arrived for row in self.parked))

    def admit(self) -> None:
        """Prefill waiting requests into rows (up to `max_batch`, while `capacity` admits one more): while rows
        decode, one piece in this gap (module docstring); with none decoding, until every row is taken or nothing
        waits."""
        while len(self.rows) + len(self.parked) < self.max_batch:
            if self.prefilling is None:
                with self.condition:
                    first = next((r for r in self.waiting if r.prompt.ready() or r.cancelled.is_set()), None)
                    if first is None or not self.capacity.admits(len(self.rows)):
                        return
                    self.waiting.remove(first)  # the first whose text came: the others wait for theirs
                    self.prefilling = Prefill(first)
                self.model.predictor.refresh()  # its derived copies, once per request (`decode_checked`)
            decoding = bool(self.rows)
            self.prefill_piece(self.prefill_chunk if decoding else None)
            if decoding:
                return

    def prefill_piece(self, tokens: int | None) -> None:
        """The next `tokens` of the prefilling request's prompt (None: the rest) into the staging row; at the
        prompt's end its row joins the batch. A cancelled request or a bad prompt ends there, alone."""
        state, prompt = self.prefilling, self.prefilling.request.prompt
        if state.request.cancelled.is_set():
            self.end_prefill()
            return
        if not self.staging.rows:
            self.staging.add()
        try:
            if state.done == 0:
                prompt.fill_head()
            end = len(prompt.embeds) if tokens is None else min(state.done + tokens, len(prompt.embeds))
            hidden = talker_blocks.prefill(self.model.talker, self.staging, 0, prompt.embeds[state.done:end],
                                           prompt.positions[state.done:end])
            state.done = end
            if end < len(prompt.embeds):
                return
            check_finite(hidden, "the talker state after its prompt")
        except Exception as e:  # a bad prompt fails its own request
            self.staging.clear(0)
            self.end_prefill(e if isinstance(e, RvqspecError) else RvqspecError(f"prefill failed: {e}"))
            return
        with self.condition:
            self.cache.adopt(self.staging, 0)
            self.rows.append(Row(state.request, hidden))
            self.staging.remove(0)
            self.prefilling = None

    def end_prefill(self, error: BaseException | None = None) -> None:
        """The prefilling request ends (with `error`) and gives the staging row back."""
        with self.condition:
            request, self.prefilling = self.prefilling.request, None
            if self.staging.rows:
                self.staging.remove(0)
        request.finish(error)

    def timed_step(self) -> None:
        batch, start = len(self.rows), time.perf_counter()
        self.frame_step()
        if batch:  # a step of rejoining rows alone decodes no frame
            self.capacity.record(batch, time.perf_counter() - start)

    def frame_step(self) -> None:
        """One frame for every row: the module docstring's steps 1 to 5; rows whose text row has not arrived are
        parked before step 5, and parked rows whose text came rejoin for it."""
        inputs = self.decode_and_send()
        inputs = self.rejoin(*inputs)
        if not self.rows:
            return
        self.grant.resize(self.step_threads())  # a chunk due with these frames decodes beside the forward
        self.use_threads()
        hidden = talker_blocks.step(self.model.talker, self.cache, *inputs)  # step 5
        for row, state in zip(self.rows, hidden):
            row.hidden = state

    def decode_and_send(self) -> tuple[list[Tensor], list[int]]:
        """Steps 1 to 4: the next talker input [H] and RoPE id of each row of `rows` after it (rows waiting for text
        parked)."""
        if self.rows:
            self.draw_c0()
        if not self.rows:
            return [], []
        rows, frames = self.decode_rest()
        if not rows:
            return [], []
        inputs, positions = self.send_frames(rows, frames)
        for index in reversed(range(len(rows))):
            if isinstance(inputs[index], Exception):  # its text failed (the tokenizer refused it)
                self.fail(index, inputs[index])
            elif inputs[index] is None:
                self.park(index)
            else:
                continue
            for items in (inputs, positions):  # as the rows moved (`leave`)
                items[index] = items[-1]
                items.pop()
        return inputs, positions

    def park(self, index: int) -> None:
        """Row `index` waits for its text: out of the batch (its cache row too), its next input kept."""
        with self.condition:
            self.parked_cache.adopt(self.cache, index)
            self.parked.append(self.take(index))

    def rejoin(self, inputs: list[Tensor], positions: list[int]) -> tuple[Tensor, Tensor]:
        """Parked rows whose text came rejoin the batch for step 5 (cancelled ones leave); the step's inputs [B, H]
        and RoPE ids [B]."""
        for index in reversed(range(len(self.parked))):
            row = self.parked[index]
            if row.request.cancelled.is_set():
                with self.condition:
                    self.unpark(index, finish=True)
                continue
            if not row.text_arrived or (text := self.text_row(row, index)) is None:
                continue
            inputs.append(row.pending + text)
            positions.append(row.position)
            with self.condition:
                self.cache.adopt(self.parked_cache, index)
                self.rows.append(row)
                self.unpark(index)
        if not inputs:
            return torch.zeros(0), torch.zeros(0)
        stacked = torch.stack(inputs)
        return stacked, torch.tensor(positions, device=stacked.device)

    def text_row(self, row: Row, index: int) -> Tensor | None:
        """A parked row's text row (None: it left, cancelled or failing on its text)."""
        try:
            return row.request.prompt.text_input(row.frames - 1)
        except Exception as e:
            with self.condition:
                self.unpark(index, e if isinstance(e, RvqspecError) else RvqspecError(f"text failed: {e}"))
            return None

    def unpark(self, index: int, error: BaseException | None = None, finish: bool = False) -> None:
        """Parked row `index` leaves the parked rows (rejoining, or ending: with `error`, or `finish`)."""
        row = self.parked[index]
        self.parked_cache.remove(index)
        self.parked[index] = self.parked[-1]
        self.parked.pop()
        if error is not None or finish:
            row.request.finish(error)

    def draw_c0(self) -> None:
        """Steps 1 and 2: each row draws its c0; then finished, cancelled and failed rows leave."""
        states = torch.stack([row.hidden for row in self.rows])
        logits = self.model.c0_logits(states)
        in_range = (states.abs() < MAX_HIDDEN).all(1).tolist()  # what decode_frames' check_batch refuses, one read
        for index in reversed(range(len(self.rows))):
            row = self.rows[index]  # the rows after `index` may move, never those before it: logits[index] is its own
            try:
                row.draw(logits[index], in_range[index])
            except Exception as e:
                self.fail(index, e)
                continue
            if reason := row.ended:
                self.leave(index, reason=reason)

    def decode_rest(self) -> tuple[list[Row], Tensor]:
        """Step 3: the rows still decoding and their frames [B, G] (c0, then the predictor's c1..c{G-1}); rows whose
        predictor batch raised have left, their frames dropped."""
        rows = self.rows
        hidden = torch.stack([row.hidden for row in rows])
        c0 = torch.tensor([row.c0[-1] for row in rows], device=hidden.device)  # the c0 logits' device
        codes, failures = self.predict(hidden, c0, rows)
        frames = torch.cat([c0[:, None], codes], dim=1)
        if not failures:
            return rows, frames
        position = {id(row): b for b, row in enumerate(rows)}
        for index in sorted(failures, reverse=True):
            self.fail(index, failures[index])
        return self.rows, frames[[position[id(row)] for row in self.rows]]

    def send_frames(self, rows: list[Row], frames: Tensor) -> tuple[list, list[int]]:
        """Step 4: each row's frame goes to its request; the rows' next talker inputs [H] (the frame's embedding,
        plus the trailing text; None: its text row has not arrived, the row keeps the embedding; the error where its
        text failed) and their RoPE ids."""
        embeds, inputs, positions = self.model.frame_inputs(frames), [], []
        for b, row in enumerate(rows):
            prompt, t = row.request.prompt, row.frames
            try:
                text = prompt.text_input(t)
            except Exception as e:
                text = e
            inputs.append(text if isinstance(text, Exception) else None if text is None else embeds[b] + text)
            row.pending, row.position = (embeds[b], prompt.frame_positions[t]) if text is None else (None, 0)
            positions.append(prompt.frame_positions[t])
            row.request.put(frames[b].cpu())
        self.codec.wake()  # a chunk due now decodes beside the talker forward (`frame_step`)
        return inputs, positions

    def predict(self, hidden: Tensor, c0: Tensor, rows: list[Row]) -> tuple[Tensor, dict[int, Exception]]:
        """c1..c{G-1} [B, G-1]: one `decode_checked` per predictor sampler among the rows; and {row index: error} of
        the rows that fail (a group that raises is decoded again row by row, to fail only the rows that raise)."""
        groups: dict[Sampler, list[int]] = {}
        for b, row in enumerate(rows):
            groups.setdefault(row.request.prompt.sampler, []).append(b)
        codes = torch.empty(len(rows), self.model.predictor.config.num_code_groups - 1, dtype=torch.long,
                            device=c0.device)
        failures: dict[int, Exception] = {}
        for sampler, members in groups.items():
            try:
                self.predict_group(hidden, c0, rows, sampler, members, codes)
            except Exception as e:
                if len(members) == 1:
                    failures[members[0]] = e
                    continue
                for b in members:
                    try:
                        self.predict_group(hidden, c0, rows, sampler, [b], codes)
                    except Exception as e:
                        failures[b] = e
        return codes, failures

    def predict_group(self, hidden: Tensor, c0: Tensor, rows: list[Row], sampler: Sampler, members: list[int],
                      codes: Tensor) -> None:
        """The codes of rows `members` (one sampler), written into `codes`; each row draws from its own generator."""
        tree = self.tree_for(len(members))
        generators = [rows[b].request.generator for b in members]
        index = torch.tensor(members, device=c0.device)
        result = decode_checked(self.model.predictor, hidden[index], c0[index], sampler, generators,
                                self.drafter if tree is not None else None, tree)
        self.stats.add(result, tree.size if tree is not None else 0)
        codes[index] = result.codes.to(c0.device)

    def tree_for(self, batch: int) -> Tree | None:
        return policy_choice.tree_for(self.drafter, self.tree, self.policy, batch)

    def leave(self, index: int, error: BaseException | None = None, reason: str = "cancelled") -> None:
        """Row `index` leaves: its request ends for `reason` (or with `error`), the last row takes its place (in the
        cache too)."""
        with self.condition:
            row = self.take(index)
        row.request.finish(error, reason)

    def take(self, index: int) -> Row:
        """Row `index` out of the batch, its cache row too; the last row takes its place (the caller holds the lock)."""
        row = self.rows[index]
        self.cache.remove(index)
        self.rows[index] = self.rows[-1]
        self.rows.pop()
        return row

    def fail(self, index: int, error: Exception) -> None:
        """Row `index` fails alone: its request ends with the error; its cache row is zeroed before it is reused."""
        self.cache.clear(index)
        self.leave(index, error if isinstance(error, RvqspecError) else RvqspecError(
            f"decoding failed ({type(error).__name__}: {error}): this is a bug, please report it"))

    def end_all(self) -> None:
        """When the engine stops: what it still holds ends, with an error unless its caller had cancelled it."""
        with self.condition:
            prefilling = [self.prefilling.request] if self.prefilling else []
            requests = [row.request for row in self.rows + self.parked] + prefilling + list(self.waiting)
            self.rows, self.parked, self.prefilling, self.waiting = [], [], None, collections.deque()
        for request in requests:
            request.finish(None if request.cancelled.is_set() else RvqspecError(
                f"the engine was closed after {len(request.decoded)} frames of this request, before it finished: "
                "its audio is cut short; submit it to a running engine (or close with a longer grace)"))

    def fail_all(self, error: Exception) -> None:
        while self.rows:
            self.fail(len(self.rows) - 1, error)


def check_set_up(predictor, drafter, tree: Tree | None, policy: Policy | None) -> None:
    """What `decode_frames` checks per call of the engine's drafter and trees (`fit_speculation`), checked once for
    every tree a step may take (the fixed one, the policy's)."""
    if drafter is None:
        return
    for candidate in [tree] + (list(policy.trees.values()) if policy is not None else []):
        if candidate is not None:
            fit_speculation(predictor, drafter, candidate)


class NonFinite(RvqspecError):
    """A row's talker state or logits hold inf or nan: that request fails, alone."""


def check_finite(values: Tensor, what: str) -> None:
    if not bool(torch.isfinite(values).all()):
        raise NonFinite(f"{what} is not finite (inf or nan): the request's input is out of range (a voice clip of "
                        "absurd amplitude?); this request ends, the others go on")

"""Requests streamed as a server streams them: each submitted to an engine (`rvqspec.Engine` or anything with its
`submit` and `sample_rate`) and iterated by a thread of its own, the times a listener sees recorded; and text cut
as an LLM writes it (`text_pieces`)."""

import random
import threading
import time


def text_pieces(text: str, seed: int) -> list[str]:
    """`text` in pieces of 1 to 4 characters (an LLM's tokens)."""
    rng, out, at = random.Random(seed), [], 0
    while at < len(text):
        size = rng.randint(1, 4)
        out.append(text[at:at + size])
        at += size
    return out


def stream(engine, arguments: dict, start: float, out: dict) -> None:
    """Stream one request's audio; record its first-audio time (from `start`), largest chunk gap, audio seconds and
    when its last chunk came."""
    arguments = dict(arguments)
    request = engine.submit(arguments.pop("kind"), **arguments)
    last, gap, samples = None, 0.0, 0
    for chunk in request:
        now = time.perf_counter()
        gap = max(gap, now - last) if last is not None else gap
        if last is None:
            out["first"] = now - start
        last, samples = now, samples + len(chunk)
    out.update(gap=gap, audio=samples / engine.sample_rate, end=last)


def streamed_together(engine, requests: list[dict], stagger: float) -> tuple[list[dict], float]:
    """Request i submitted at i * stagger seconds, each streamed by a thread of its own (a server's): each one's
    record (`stream`) and the seconds from the first submit to the last chunk. A request's error is raised here."""
    outs, errors, threads = [{} for _ in requests], [], []

    def consume(arguments: dict, submitted: float, out: dict) -> None:
        try:
            stream(engine, arguments, submitted, out)
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread below
            errors.append(e)

    start = time.perf_counter()
    for i, arguments in enumerate(requests):
        time.sleep(max(0.0, start + i * stagger - time.perf_counter()))
        threads.append(threading.Thread(target=consume, args=(arguments, time.perf_counter(), outs[i]), daemon=True))
        threads[-1].start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return outs, max(out["end"] for out in outs) - start

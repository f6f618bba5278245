"""What the "weights changed" checks cost per frame step at the 0.6B size (random weights, bfloat16, CPU, 1 thread):
an accelerated qwen-tts model's check of the upstream weights it copied, once per frame step
(`Acceleration.current_decoder`), and the predictor's check of its own, once per decode call
(`MultiCodeDecoder.refresh`, after a speculative frame made its packed and int8 draft copies). Both are
`rvqspec.core.changes.Watch`; before it, each probed every tensor with an index. Measured on an AMD EPYC Zen 4 (no
AMX), 2 cores shared with other jobs: 2.3-2.6 ms together before, 0.15-0.25 ms with it (in a busier moment, runs
taking turns: 8.2-8.9 ms before, 0.15-0.31 ms with it).

    .venv/bin/python benchmarks/weights_check.py           # prints the medians
    .venv/bin/python benchmarks/weights_check.py --smoke   # a tiny predictor, a few calls: seconds
"""

import argparse
import statistics
import time

import torch

from rvqspec import ReusedHeads, Sampler, accelerate, decode_frames, default_tree
from rvqspec.bench.systems import SMOKE_PREDICTOR
from rvqspec.bench.timing import SMOKE_HELP
from rvqspec.bench.upstream import upstream_model_like
from rvqspec.core.config import QWEN3_TTS_0_6B


def microseconds(call, calls: int = 400, rounds: int = 5) -> tuple[float, float]:
    """(median, best) over `rounds` of the median time of `call()` in microseconds."""
    medians = []
    for _ in range(rounds):
        for _ in range(20):
            call()
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        medians.append(statistics.median(times) * 1e6)
    return statistics.median(medians), min(medians)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP + " (this script prints, writes nothing)")
    args = parser.parse_args(argv)
    config, calls = (SMOKE_PREDICTOR, dict(calls=20, rounds=1)) if args.smoke else (QWEN3_TTS_0_6B, {})
    torch.set_num_threads(1)
    handle = accelerate(upstream_model_like(config).to(torch.bfloat16))
    model = handle.decoder
    decode_frames(model, torch.randn(1, config.talker_hidden_size, dtype=torch.bfloat16), torch.tensor([3]),
                  Sampler(), drafter=ReusedHeads(), tree=default_tree(16))
    step, decode = microseconds(handle.current_decoder, **calls), microseconds(model.refresh, **calls)
    print(f"{len(handle.watched())} upstream tensors watched, {len(list(model.parameters()))} predictor parameters")
    print(f"per frame step: the upstream weights {step[0]:.0f} us (best round {step[1]:.0f}), the predictor's own "
          f"{decode[0]:.0f} us (best {decode[1]:.0f}); together {step[0] + decode[0]:.0f} us")


if __name__ == "__main__":
    main()

"""The decoding core: the predictor, sampling, trees, drafters, the batched AR and speculative rounds, the policy
that picks one per batch size, and the toolkit of the frame loops above it (`frame_loop.py`). It imports only itself.

Vocabulary (every module, docstring and message uses these words in these senses; docs/design.md explains why):

- core: this package, rvqspec.core ("the core", "the decoding core"). Engine: `rvqspec.Engine` (runtime/engine.py),
  the serving loop over many requests, and nothing else: never the core, `accelerate()` or a kernel.
- row: a sequence's place in a batch while it decodes, index b of the batch's tensors. In the Engine, one request's,
  which is also its row of the talker's cache (the scheduler's `Row` holds that request's state); in `accelerate()`,
  one text (or CSM conversation) of upstream's batch. A request, a synthesis or a stream is not a row; a matrix's
  row is named with its matrix.
- predictor: the small transformer that emits a frame's residual codes after the talker's c0 (c1..c15 for
  Qwen3-TTS); upstream's "code predictor" (Qwen3-TTS) or "depth decoder" (CSM), the class `MultiCodeDecoder`.
- codec: the speech tokenizer that turns frames of codes into audio; outside the core (`integrations`).
- frame: c0..c15 of one talker step; a batch decodes B frames at once, one row each. k: the codes a row has.
  A frame step: one frame of every row of the batch (one `decode_frames` call), not a predictor step.
- AR: one predictor call per code. A call (or step): one predictor forward over the batch.
- draft: a code the drafter proposes for c_{k+j} (depth j, rank r among its top-m candidates); a drafter never
  changes what is emitted, only how often drafts are accepted.
- tree: which (depth, rank) drafts a round verifies; its size N is its number of nodes (not "budget" or "nodes"),
  and a round's call is N + 1 tokens long (the root c_k, then the nodes). Public names that predate this keep
  theirs: the `budget` parameter of `tree.grow_tree` and `tree.default_tree` is N.
- round: one speculative call for the batch: draft, verify the tree, walk it (sample-then-match), compact the cache.
- accepted: a draft the walk moves to (its code equals the draw at its parent); bonus: the draw where the walk
  stops, emitted after the accepted drafts. A round emits accepted + 1 codes per row (fewer at the frame end).
- tokens per step: codes emitted per predictor call (`decode.tokens_per_step`, the one definition; AR: 1).
- path: which implementation a call takes on its device and dtype (`device_path.DevicePath`), resolved once per
  decode call into its round context (`context.RoundContext`).
"""

"""What every integration shares: a depth decoder's per-frame `generate`, replaced on one instance by
`rvqspec.decode_frames` over a MultiCodeDecoder that holds a copy of its weights, with counters and `undo()`.

A subclass says where the depth decoder is (`target`), how to copy it (`build_decoder`) and how its per-frame
generate call looks (`generate`); this class decides AR or which tree per batch size and keeps the counts, with
the frame-loop toolkit the Engine's loop uses too (`core/frame_loop.py`: the policy's set-up, `Stats`).
"""

import functools
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from rvqspec.core import device_path
from rvqspec.core import policy as policy_choice
from rvqspec.core.changes import Watch, parameters_of
from rvqspec.core.decode import BatchResult, decode_frames
from rvqspec.core.errors import RvqspecError
# Stats and check_arguments moved to core/frame_loop.py; still importable from here for a release.
from rvqspec.core.frame_loop import Stats, check_arguments, decoding_policy
from rvqspec.core.graphs import GraphCache
from rvqspec.core.model import MultiCodeDecoder
from rvqspec.core.quantize import check_scheme, quantize, quantize_linears, restore_linears
from rvqspec.core.sampling import Sampler
from rvqspec.core.tree import Tree
from rvqspec.integrations.stream import Turns
from rvqspec.integrations.tuned import load_tuned

HANDLE = "_rvqspec_acceleration"  # attribute of an accelerated model that holds its Acceleration
# Generation settings that change the distribution and that rvqspec does not implement, with their neutral
# values: a depth decoder configured with any other value keeps decoding through upstream (with a warning).
UNSUPPORTED_SETTINGS = {"repetition_penalty": 1.0, "min_p": None, "typical_p": 1.0, "epsilon_cutoff": 0.0,
                        "eta_cutoff": 0.0, "no_repeat_ngram_size": 0, "bad_words_ids": None, "suppress_tokens": None,
                        "begin_suppress_tokens": None, "sequence_bias": None, "num_beams": 1, "guidance_scale": None,
                        "forced_bos_token_id": None, "forced_eos_token_id": None, "encoder_repetition_penalty": 1.0,
                        "exponential_decay_length_penalty": None, "watermarking_config": None}


def float_entries(original: torch.nn.Module, swapped: torch.nn.Module, state: dict, prefix: str, metadata) -> None:
    """state_dict hook of a talker layer made int8 by `talker_weights`: its entries are those of the float layer it
    replaced, so the model's `state_dict()` and `save_pretrained` give upstream's weights (the int8 copy is ours)."""
    for key in [key for key in state if key.startswith(prefix)]:
        del state[key]
    original.state_dict(destination=state, prefix=prefix)


@dataclass(frozen=True)
class AccelerateOptions:
    """What `rvqspec.accelerate` was asked for (its keyword arguments, documented there), passed whole to the
    integration that serves the model."""

    drafter: torch.nn.Module | None = None
    tree: Tree | str | None = "auto"
    generator: torch.Generator | None = None
    calibration: str | None = None
    weights: str | None = None
    tuned: str | None = None
    graphs: bool = True
    talker_weights: str | None = None


class Acceleration:
    """What `accelerate` returns: `stats` after a generate call, `undo()` to restore upstream's depth decoder.

    `owner` is the model the user holds (it keeps the handle); `target` the depth decoder whose generate is
    replaced."""

    KIND = ""  # the model type a tuned folder names ("qwen-tts", "csm")

    def __init__(self, owner: torch.nn.Module, target: torch.nn.Module, options: AccelerateOptions):
        if getattr(owner, HANDLE, None) is not None:
            raise RvqspecError("this model is already accelerated: call handle.undo() (or deaccelerate(model)) first")
        self.owner, self.target = owner, target
        self.weights = options.weights and check_scheme(options.weights)
        decoder, self.latency = self.build_decoder(), None
        drafter, calibration, tree = options.drafter, options.calibration, options.tree
        if options.tuned is not None:
            if drafter is not None or calibration is not None:
                raise RvqspecError("tuned= brings its own drafter and calibration: drop drafter= and calibration=")
            drafter, calibration, latency = load_tuned(options.tuned, decoder, self.KIND)
            self.latency = None if self.weights else latency  # measured on the float model
        check_arguments(drafter, tree)
        self.drafter, self.tree, self.generator, self.calibration = drafter, tree, options.generator, calibration
        self.stats = Stats()
        self.streams = Turns()  # the streams of this model take turns (rvqspec.integrations.stream)
        self.graphs = GraphCache() if options.graphs else None  # CUDA graphs of this handle's calls (CUDA only)
        self.warned: set[str] = set()
        self.decoder, self.watch = self.quantized(decoder), Watch(self.watched())  # what it was copied from
        device_path.prepare(self.decoder, name=type(owner).__name__)  # the kernels its forwards read
        self.policy = decoding_policy(self.decoder, drafter, tree, calibration, self.latency)
        # Last: nothing can fail after the model's own layers are swapped.
        talker, kept = self.talker_parts()
        self.talker_swaps = quantize_linears(talker, options.talker_weights, kept) if options.talker_weights else []
        for parent, name, original in self.talker_swaps:
            getattr(parent, name).register_state_dict_post_hook(functools.partial(float_entries, original))
        self.replaced_instance_method = "generate" in vars(target)
        self.upstream_generate = target.generate
        target.generate = self.generate
        setattr(owner, HANDLE, self)

    def build_decoder(self) -> MultiCodeDecoder:
        """A MultiCodeDecoder holding a copy of the target's weights, on their device and dtype."""
        raise NotImplementedError

    def talker_parts(self) -> tuple[torch.nn.Module, tuple[torch.nn.Module, ...]]:
        """(the model that emits c0 and the states, the submodules of it that `talker_weights` leaves alone)."""
        raise NotImplementedError

    def watched(self) -> list[Tensor]:
        """The upstream tensors the decoder copies (subclasses add what lives outside the target): a LoRA merge,
        `load_state_dict` or a write through `.data` after `accelerate` changes them (`changes.Watch`), and the
        decoder is copied again."""
        return parameters_of(self.target)

    def quantized(self, decoder: MultiCodeDecoder) -> MultiCodeDecoder:
        """The decoder with `weights` (`rvqspec.quantize`): a different model than upstream's, chosen by the user."""
        return quantize(decoder, self.weights) if self.weights else decoder

    def followed_weight(self) -> Tensor:
        """A weight of the target whose device and dtype the decoder follows."""
        raise NotImplementedError

    def generate(self, *args, **kwargs):
        raise NotImplementedError

    def undo(self) -> None:
        """Give the depth decoder its own `generate` back (and the talker its float layers). Refused while a stream
        of this handle is generating; streams opened later are refused."""
        if getattr(self.owner, HANDLE, None) is not self:
            raise RvqspecError("this acceleration was already undone")
        self.streams.close()
        restore_linears(self.talker_swaps)
        if self.replaced_instance_method:
            self.target.generate = self.upstream_generate
        else:
            del self.target.generate
        delattr(self.owner, HANDLE)

    def current_decoder(self) -> MultiCodeDecoder:
        """The decoder, copied again if the upstream weights changed since (`watched`)."""
        self.watch.follow(self.watched(), self.copy_decoder)
        return self.decoder

    def copy_decoder(self) -> None:
        """Copy the decoder again, and the policy with it where the weights moved to another device or dtype (the
        latency of another device or dtype differs)."""
        weight = self.followed_weight()
        moved = (self.decoder.device, self.decoder.dtype) != (weight.device, weight.dtype)
        self.decoder = self.quantized(self.build_decoder())
        if moved:
            device_path.prepare(self.decoder, name=type(self.owner).__name__)
        if moved and self.policy is not None:
            self.latency = None  # a tuned table is for the device and dtype it was measured on
            self.policy = decoding_policy(self.decoder, self.drafter, self.tree, self.calibration)

    def tree_for(self, batch: int) -> Tree | None:
        """The fixed tree, or the policy's choice for this batch size (None: plain AR)."""
        return policy_choice.tree_for(self.drafter, self.tree, self.policy, batch)

    def explain(self, batch: int = 1) -> str:
        """What decodes a batch of `batch` frames, and why."""
        return policy_choice.explain(self.drafter, self.tree, self.policy, batch)

    def sampler(self, do_sample=None, top_k=None, top_p=None, temperature=None) -> Sampler:
        """The caller's settings; those left None fall back to the target's generation_config, as in HF."""
        config = self.target.generation_config

        def pick(value, name, neutral):
            value = getattr(config, name, None) if value is None else value
            return neutral if value is None else value

        return Sampler(do_sample=bool(pick(do_sample, "do_sample", False)), top_k=int(pick(top_k, "top_k", 0)),
                       top_p=float(pick(top_p, "top_p", 1.0)), temperature=float(pick(temperature, "temperature", 1.0)))

    def unsupported_settings(self) -> list[str]:
        """Settings of the target's generation_config that would change the distribution beyond the Sampler's
        (warned about once each: those frames go to upstream)."""
        config = self.target.generation_config
        found = [f"{name}={getattr(config, name)!r}" for name, neutral in UNSUPPORTED_SETTINGS.items()
                 if getattr(config, name, neutral) not in (neutral, None)]
        for setting in set(found) - self.warned:
            warnings.warn(f"rvqspec does not implement the depth decoder's generation setting {setting}: frames "
                          "decode through upstream while it is set", stacklevel=3)
        self.warned.update(found)
        return found

    def decode(self, hidden: Tensor, c0: Tensor, sampler: Sampler) -> BatchResult:
        """One batched frame step: codes [B, G-1] for talker/backbone states [B, H] and their c0 [B]."""
        decoder = self.current_decoder()
        tree = self.tree_for(len(c0))
        result = decode_frames(decoder, hidden, c0, sampler, self.generator,
                               self.drafter if tree is not None else None, tree,
                               self.graphs if device_path.replays_graphs(decoder.device) else None)
        self.stats.add(result, tree.size if tree is not None else 0)
        return result

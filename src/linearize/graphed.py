"""A training step's forward and backward replayed as CUDA graphs.

On an H100 the linearized students' training steps are bound by the host, not the GPU: their
kernels take less GPU time than the teacher's, but each step issues ~240 Triton launches through
Python (fla's autotuner and wrappers, our own kernels) and the host needs longer to issue a step than
the GPU needs to run it. Captured once as CUDA graphs
(``torch.cuda.make_graphed_callables``: one graph for the forward, one for the backward), a step is a
replay of each; the optimizer, gradient clipping and the scheduler stay eager.

What capture needs, and how it is met here:
- static shapes: packed blocks all have one shape; another shape (a last, shorter batch) is
  captured anew, and so is a change in which parameters train (XATL's LIT unfreezing);
- no host synchronisation inside the model: transformers skips its own checks while a stream is
  capturing, and so do the mixers (``mixers.base.key_padding_mask``);
- autocast without its weight cache, set up inside the captured callable.
The loss it returns is the graph's output buffer: read it before the next step replays over it.

A distillation objective (``kl``, ``kl+next_token``) is captured too: the teacher's forward stays
eager (under no_grad, before each replay) and what the loss reads from it (``Objective.teacher_tensors``:
the teacher's logits, or their top k) enters the graphs as further inputs, copied into their static
buffers like the batch.

A loss that runs the student's forward itself (``Objective.captured_whole``: LoLCATs' ``attention_mse``,
whose teacher is the student's own softmax attention, swapped in per layer for the forward) is captured
whole: the graphs replay its call, probes and all, and it takes no inputs but the batch.

A training run's ``cuda_graph`` setting (``auto``, ``on``, ``off``) becomes a yes or no through
``use_graphs``: ``auto`` graphs the steps wherever every condition holds and otherwise names the
first that fails; ``on`` refuses a run where one fails.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager

import torch
from torch import nn

from .errors import LinearizeError
from .mixers.base import unpadded_batches
from .recipes.config import MODES, graph_mode  # noqa: F401  (the recipes' cuda_graph setting, read without torch)


def use_graphs(mode: str, *, cuda: bool, uncapturable: str | None = None, fsdp: bool = False,
               compile: bool = False, checkpointing: bool = False, other: str | None = None) -> tuple[bool, str | None]:
    """Whether a run's training steps replay as CUDA graphs under ``cuda_graph`` ``mode``:
    ``(True, None)``, or ``(False, why)`` with the first condition that fails (under ``off``: None).

    The conditions: a CUDA device (``cuda``); a loss whose every term is capturable (``uncapturable``:
    what in it is not, e.g. "hidden_mse in the loss 'kl+hidden_mse'"); no FSDP (``fsdp``: its sharded
    parameters); no ``compile``; no gradient checkpointing (``checkpointing``); and ``other``, a recipe's
    own reason (XATL's LIT under torchrun).
    ``on`` raises one ``LinearizeError`` where one fails; ``auto`` returns it, and the run trains eagerly.
    """
    mode = graph_mode(mode)
    if mode == "off":
        return False, None
    conditions = [(not cuda, "there is no CUDA device"),
                  (uncapturable, (f"{uncapturable} cannot be captured (the graphs replay losses computed from "
                                  "the student's forward and the teacher's logits: lm, kl, kl+lm; or one that runs "
                                  "the student's forward itself: attention_mse)")),
                  (fsdp, ("FSDP's sharded parameters cannot be captured (graphs run on one GPU or data-parallel "
                          "under torchrun)")),
                  (compile, "--compile is on (a step is compiled or graphed, not both)"),
                  (checkpointing, "--gradient-checkpointing recomputes each layer in the backward (a step is "
                                  "checkpointed or graphed, not both)"),
                  (other, other)]
    why = next((text for failed, text in conditions if failed), None)
    if why is not None and mode == "on":
        raise LinearizeError(f"--cuda-graph on: {why}; --cuda-graph auto or off trains eagerly")
    return why is None, why


@contextmanager
def _unwrapped_forward(model: nn.Module):
    """Inside, ``model.forward`` is the forward accelerate's mixed precision wrapped (in an autocast with
    the weight cache, which a capture cannot keep), for a loss that calls ``model(...)`` itself; the
    wrapper is back afterwards. A model accelerate did not wrap is left as it is."""
    original = getattr(model, "_original_forward", None)
    if original is None:
        yield
        return
    wrapped = vars(model).get("forward")
    model.forward = original
    try:
        yield
    finally:
        if wrapped is None:
            del model.forward
        else:
            model.forward = wrapped


class _TrainingLoss(nn.Module):
    """The training loss a graph captures, under autocast to ``dtype`` (None: none): ``model``'s mean
    next-token loss of ``input_ids`` against ``labels``; with ``objective`` (a ``linearize.distill``
    objective) either that objective computed from the same forward's outputs and ``teacher`` (its
    ``teacher_tensors``; ``capturable``), after the autocast as the Trainer's eager step computes it,
    or, where it runs the student's forward itself (``captured_whole``), the objective's own call on
    ``model`` and the batch, inside the same autocast."""

    def __init__(self, model: nn.Module, dtype: torch.dtype | None, objective=None):
        super().__init__()
        self.model = model
        self.dtype = dtype
        self.objective = objective

    def forward(self, input_ids, labels, *teacher):
        whole = self.objective is not None and getattr(self.objective, "captured_whole", False)
        # no attention mask goes in, so no token is padding: the mixers need not keep transformers'
        # causal mask as a padding mask while the stream captures
        with torch.autocast("cuda", dtype=self.dtype or torch.bfloat16, enabled=self.dtype is not None,
                            cache_enabled=False), unpadded_batches():
            if whole:
                # the objective calls model(...): under accelerate's mixed precision (the Trainer's
                # bf16) that is the autocast-wrapped forward, so it gets the one it wrapped instead
                with _unwrapped_forward(self.model):
                    return self.objective(self.model, {"input_ids": input_ids, "labels": labels})
            # under accelerate's mixed precision, model.forward is wrapped in an autocast with the
            # weight cache, which a capture cannot keep: call the forward it wrapped
            forward = getattr(self.model, "_original_forward", None) or self.model
            outputs = forward(input_ids=input_ids, labels=labels, use_cache=False)
        if self.objective is None:
            return outputs.loss
        return self.objective.from_outputs(outputs, {"input_ids": input_ids, "labels": labels}, teacher)


class GraphedLoss:
    """``loss = graphed(input_ids, labels, *teacher); loss.backward()`` as two CUDA graph replays.

    Gradients land in the parameters' ``.grad`` as after an eager backward (accumulated, or set
    where they are None), so any optimizer and gradient accumulation work unchanged.
    ``dtype``: the autocast dtype (None: no autocast); ``objective``: a ``linearize.distill`` objective
    that is ``capturable`` or ``captured_whole`` (None: the next-token loss); ``teacher``: a capturable
    objective's ``teacher_tensors`` for the batch, computed eagerly before each call (none for the
    next-token loss and for an objective captured whole). The first call for
    a shape captures (after ``warmup`` eager steps on a side stream, which also let fla's kernels autotune).
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype | None = torch.bfloat16, warmup: int = 3, objective=None):
        self.model, self.dtype, self.warmup, self.objective = model, dtype, warmup, objective
        self.captures = 0
        self._key = None
        self._graphed = None

    def _signature(self, input_ids, labels, teacher):
        return (tuple(input_ids.shape), tuple(labels.shape), input_ids.device,
                tuple((tuple(t.shape), t.dtype, t.device) for t in teacher),
                tuple(p.requires_grad for p in self.model.parameters()))

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor, *teacher: torch.Tensor) -> torch.Tensor:
        self.prime(input_ids, labels, *teacher)
        return self._graphed(input_ids, labels, *teacher)

    def prime(self, input_ids: torch.Tensor, labels: torch.Tensor, *teacher: torch.Tensor) -> None:
        """Capture for batches of this shape unless that is done (the warm-up steps compute gradients
        without accumulating them: the parameters and their ``.grad`` are left as they were)."""
        key = self._signature(input_ids, labels, teacher)
        if key != self._key:
            self._graphed = self._key = None  # let the old graphs' memory go first (they sit in a
            gc.collect()                        # reference cycle: the graphed forward refers to its module)
            torch.cuda.synchronize(input_ids.device)
            torch.cuda.empty_cache()
            # the capture sets up its own autocast, on the batch's device (not only the current one)
            with torch.autocast("cuda", enabled=False), torch.cuda.device(input_ids.device):
                self._graphed = torch.cuda.make_graphed_callables(
                    _TrainingLoss(self.model, self.dtype, self.objective),
                    (input_ids.clone(), labels.clone(), *(t.detach().clone() for t in teacher)),
                    num_warmup_iters=self.warmup, allow_unused_input=True)
            self._key = key
            self.captures += 1

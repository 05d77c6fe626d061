"""What the attention stash would keep, per attention layer, before any training run: one
shape-only forward, no weights needed, nothing computed, no compiled ops needed.

    p = attnstash.plan(model, *example_inputs, example_kwargs={...})   any model the installer serves
    p = attnstash.plan(model_or_config, batch_size=4, seq_len=4096, dtype="bf16", max_bytes="8GiB")
    p = attnstash.plan("flux/transformer/config.json", batch_size=1, latent_height=128, latent_width=128,
                       text_len=512)
    print(p)                       # the table
    p.per_layer_bytes              # {layer index: bytes one micro-batch keeps}
    p.total_bytes, p.layers_that_fit
    attnstash.plan(..., offload=True).device_bytes, .host_bytes   records moved to host memory

    python -m attnstash.planner CONFIG --batch 4 --seq 4096 [--dtype bf16] [--max-bytes 8GiB]
        [--device cuda|cpu] [--backend cudnn|flash|efficient] [--padded] [--sm 90] [--offload]

sources.py: the model and the micro-batch's inputs from what is given; shape_only.py: the
forward without data, recording each F.scaled_dot_product_attention call and its layer (the
layers are the installer's: attnstash/install/layers.py); for each call the backend F.sdpa would
run is decided (on this machine's device by torch itself; on CUDA without a device by
cuda_rules.py; `backend=` forces one) and that backend's fused forward runs on meta tensors: the
bytes are those of its output, log-sum-exp and extras, exactly what the stash keeps
(attnstash/backends.py, kept_bytes). results.py: what plan() returns; table.py: the table.
quiet.py: other libraries' warnings and log lines silenced while a model built from a config is
built and run (and for the whole command), every setting restored.

A call refused on CUDA for what the CUDA backends take says that the plan is for CUDA (the
compute capability planned for, or the GPU here) and which plans would keep it: for the CPU
(--device cpu, device="cpu"), in bf16 (--dtype bf16, dtype="bf16").

Budget: the installer stashes the last n attention layers, and the budget gives its room to the
last layers of the forward (csrc/stash_registry.h, Budget); so the layers that fit are counted
from the last (results.py, layers_within).

Offload: the kept records move to host memory after the first forward and each is fetched back
one layer ahead of its recompute, so the device holds at most two layers' records per
micro-batch (the one in use and the next), the host all of them; a budget then counts the
device's (results.py, held_bytes).
"""
import contextlib
import dataclasses

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import backends
from ..errors import ArgumentError, PlanError
from . import cuda_rules, sources
from .arguments import capability_of, dtype_of, positive, backend_of
from .quiet import others_silenced
from .results import CallPlan, LayerPlan, StashPlan, budget_bytes
from .shape_only import ShapeOnlyMode, recording

__all__ = ["plan", "StashPlan", "LayerPlan", "CallPlan"]


def plan(source, *example_inputs, example_kwargs=None, batch_size=None, seq_len=None, latent_frames=None,
         latent_height=None, latent_width=None, text_len=None, dtype=None, device=None, max_bytes=None, padded=False,
         backend=None, cuda_capability=(9, 0), layers=None, filter_fn=None, offload=False) -> StashPlan:
    """What the attention stash keeps per attention layer for one micro-batch.

    Args:
        source: a model (any torch.nn.Module the installer serves; a PEFT wrapper will do), a
            transformers config (object, dict, or the path of a config.json or of its folder), or
            a diffusers transformer config (its config.json has "_class_name").
        example_inputs, example_kwargs (a dict): the model's positional and keyword inputs for one
            micro-batch (meta tensors will do); without them a transformers model or config runs
            input_ids [batch_size, seq_len], and a diffusers config the inputs its pipelines pass
            for batch_size, the latent's latent_frames, latent_height and latent_width (as the
            transformer receives the latent: video models take frames), and text_len tokens.
        dtype: "bf16", "fp16", "fp32" or the torch dtype attention runs in. Default: the model's
            parameters' dtype, else the config's, else bf16.
        device: "cpu", "cuda" or "cuda:N", the device type planned for. Default: the model's, else
            "cuda". A call refused on CUDA for what its backends take says so, and names the plans
            that would keep it (device="cpu", dtype="bf16").
        max_bytes: a budget (an int or a string such as "8GiB"): the result says how many attention
            layers, from the last, it holds.
        padded: for input_ids, plan batches with padding (a 4-D mask, which changes the backend).
        backend: force a backend ("cudnn", "flash", "efficient" or an SDPBackend), as
            sdpa_kernel([backend]) would; calls it cannot run are reported refused.
        cuda_capability: the compute capability planned for on CUDA without a CUDA device here.
        layers, filter_fn: as install_attention_stash's (neither: found by themselves).
        offload: plan with the records moved to host memory after the first forward and fetched
            back one layer ahead of the recompute: the result's device_bytes (the two largest
            layers' records) and host_bytes (all of them); max_bytes counts the device's.

    Building and running a model from a config silences other libraries' warnings and log lines
    (quiet.py) and restores every setting after; a model passed in is run as it is.

    Returns a StashPlan (results.py). Raises ValueError for arguments it cannot read (naming
    what was expected) or a model the installer cannot serve, RuntimeError if the shape-only
    forward fails (the message names the op).
    """
    from ..errors import InstallError
    from ..install.layers import find_layers
    dtype = dtype_of(dtype) if dtype is not None else None
    if not isinstance(offload, bool):
        raise ArgumentError(f"attnstash.plan: offload must be True or False, got {offload!r}.")
    limit = None if max_bytes is None else budget_bytes(max_bytes)
    forced, capability = backend_of(backend), capability_of(cuda_capability)
    planned = _source(source, example_inputs, dict(example_kwargs or {}), batch_size, seq_len, latent_frames,
                      latent_height, latent_width, text_len, dtype, padded)
    device = _device(device, source)
    try:
        found = find_layers(planned.model, layers, filter_fn)
    except InstallError as e:
        raise InstallError(f"attnstash.plan: {str(e).removeprefix('attnstash: ')}") from None
    stashable = [(i, f) for i, f in enumerate(found) if f.stashable]
    calls = _forward(planned, [f.module for _, f in stashable])
    planned_layers = []
    for index, f in stashable:
        mine = tuple(_plan_call(c, device, forced, capability) for c in calls if c.layer is f.module)
        refused = next((c.refused for c in mine if c.refused), None)
        if not mine:
            refused = "its forward called no F.scaled_dot_product_attention (training with this layer stashed raises)"
        planned_layers.append(LayerPlan(index=index, layer=type(f.module).__name__, calls=mine, refused=refused))
    if device.type == "cuda" and not torch.cuda.is_available():
        decided_by = f"the rules of attnstash/planner/cuda_rules.py for sm{capability[0]}{capability[1]} (no CUDA " \
                     "device here)"
    else:
        decided_by = f"torch on {device}"
    if forced is not None:
        decided_by = f"backend={forced.name.lower()}, " + decided_by
    return StashPlan(model=planned.name, layers_found=len(found), inputs=planned.inputs, dtype=planned.dtype,
                     device=device.type, decided_by=decided_by, layers=tuple(planned_layers), max_bytes=limit,
                     offload=offload)


def _source(source, args, kwargs, batch_size, seq_len, frames, height, width, text_len, dtype, padded):
    if isinstance(source, torch.nn.Module):
        if args or kwargs:
            return sources.from_model(source, args, kwargs, dtype)
        if batch_size is None or seq_len is None:
            raise ArgumentError(f"attnstash.plan: for {type(source).__name__}, give its inputs for one micro-batch "
                                "(attnstash.plan(model, *inputs, example_kwargs={...})), or batch_size and seq_len for "
                                "input_ids.")
        return sources.from_transformers_model(source, positive("batch_size", batch_size),
                                               positive("seq_len", seq_len), padded, dtype)
    config, where = sources.read_config(source)
    batch_size = positive("batch_size", batch_size)
    if isinstance(config, dict) and "_class_name" in config:
        size = {n: None if v is None else positive(n, v) for n, v in (("frames", frames), ("height", height),
                                                                      ("width", width), ("text_len", text_len))}
        return sources.from_diffusers_config(config, where, batch_size, dtype=dtype, **size)
    return sources.from_transformers_config(config, where, batch_size, positive("seq_len", seq_len), padded, dtype)


def _device(device, source):
    if device is None:
        param = next(iter(source.parameters()), None) if isinstance(source, torch.nn.Module) else None
        device = param.device if param is not None and param.device.type != "meta" else "cuda"
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ArgumentError(f"attnstash.plan: device must be \"cpu\", \"cuda\" or \"cuda:N\", got {device!r} ({e}).") \
            from None
    if device.type not in ("cpu", "cuda"):
        raise ArgumentError(f"attnstash.plan: the stash keeps attention on cpu and cuda; got device {device}.")
    if device.type == "cuda" and torch.cuda.is_available() and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _forward(planned, layers):
    """The F.sdpa calls of the shape-only training forward, in order."""
    calls = []
    # A model built here from a config is the planner's own: what its forward says is not the caller's.
    quiet = others_silenced() if planned.stand_ins is None else contextlib.nullcontext()
    try:
        with quiet, sources.eager_experts(planned.model), recording(calls, layers), torch.no_grad(), ShapeOnlyMode():
            if planned.stand_ins is None:
                planned.model(*planned.args, **planned.kwargs)
            else:
                torch.func.functional_call(planned.model, planned.stand_ins, planned.args, planned.kwargs,
                                           strict=False)
    except PlanError:
        raise
    except Exception as e:
        raise PlanError(f"attnstash.plan: the shape-only training forward of {planned.name} with {planned.inputs} "
                        f"failed: {e}") from e
    return calls


# ---- the backend and the bytes, per call ----------------------------------------------------

def _expanded(t, device):
    """A real tensor on `device` shaped like t with one row of storage (what the backend choice
    looks at: shapes, dtypes, the last stride)."""
    if t is None:
        return None
    return torch.empty((1,) * (t.dim() - 1) + (t.shape[-1],), dtype=t.dtype, device=device).expand(t.shape)


def _decide(call, device, forced, capability):
    """(SDPBackend, why) for one call."""
    prefix = f"backend={forced.name.lower()}; " if forced is not None else ""
    with sdpa_kernel([forced]) if forced is not None else contextlib.nullcontext():
        if device.type == "cuda" and not torch.cuda.is_available():
            chosen, why = cuda_rules.cuda_backend_without_device(
                call.query, call.key, call.value, call.mask, call.dropout_p, call.is_causal, call.enable_gqa,
                capability=capability)
            return chosen, prefix + why
        q, k, v, mask = (_expanded(t, device) for t in (call.query, call.key, call.value, call.mask))
        try:
            chosen = backends.chosen_backend(q, k, v, mask, call.dropout_p, call.is_causal, call.scale,
                                             call.enable_gqa)
        except RuntimeError as e:
            return SDPBackend.ERROR, f"torch on {device} refuses the call: {e}"
    return chosen, prefix + f"torch._fused_sdp_choice on {device}"


def _refusal(call, device, forced, capability):
    """(SDPBackend, why, the kept backend's row or None, None or why the stash refuses it) for one
    call planned for `device`."""
    chosen, why = _decide(call, device, forced, capability)
    row = backends.kept_backend(device, chosen) if chosen != SDPBackend.ERROR else None
    if call.dropout_p > 0:  # as torch_ops/keep_replay.cpp check_keepable refuses it
        refused = (f"attention dropout ({call.dropout_p}): the recompute could not reproduce its random mask "
                   "(set the config's attention_dropout to 0)")
    elif chosen == SDPBackend.ERROR:
        refused = f"no enabled SDPA backend can run it on {device.type} (F.sdpa raises; see why above)"
    elif row is None:
        refused = (f"F.sdpa would run {chosen.name.lower()} on {device.type}, which the stash cannot keep "
                   "(training with this layer stashed raises; see why above)")
    else:
        refused = row.refuses(call.query, call.key, call.value, call.mask, call.is_causal, call.scale)
    return chosen, why, row, refused


def _planned_for(device, capability):
    """The CUDA device a plan is for, in words."""
    if not torch.cuda.is_available():
        return (f"CUDA sm{capability[0]}{capability[1]} (no CUDA device here; --sm or cuda_capability= plans for "
                "another)")
    major, minor = torch.cuda.get_device_capability(device)
    return f"{device} ({torch.cuda.get_device_name(device)}, sm{major}{minor})"


def _in_dtype(call, dtype):
    """The call with its floating inputs (a float mask too) in `dtype`."""
    def cast(t):
        if t is None or not t.is_floating_point():
            return t
        return torch.empty_strided(t.shape, t.stride(), dtype=dtype, device="meta")
    return dataclasses.replace(call, query=cast(call.query), key=cast(call.key), value=cast(call.value),
                               mask=cast(call.mask))


def _elsewhere(call, device, forced, capability):
    """For a call refused on CUDA by what the CUDA backends take: that the plan is for CUDA, and
    the plans that would keep it (for the CPU; in bf16 on CUDA)."""
    tried, ways = [], []
    if forced is None:
        tried.append("for the CPU")
        chosen, _, _, refused = _refusal(call, torch.device("cpu"), None, capability)
        if refused is None:
            ways.append(f"for the CPU ({chosen.name.lower()}: plan with --device cpu, or device=\"cpu\" in "
                        "attnstash.plan)")
    if call.query.dtype not in (torch.float16, torch.bfloat16):
        tried.append("in bf16")
        chosen, _, _, refused = _refusal(_in_dtype(call, torch.bfloat16), device, forced, capability)
        if refused is None:
            ways.append(f"in bf16 on CUDA ({chosen.name.lower()}: --dtype bf16, or dtype=\"bf16\")")
    where = f". This plan is for {_planned_for(device, capability)}"
    if ways:
        return f"{where}. The stash would keep it planned {' or '.join(ways)}."
    return f"{where}; planned {' or '.join(tried)}, the stash would refuse it too." if tried else where + "."


def _plan_call(call, device, forced, capability):
    chosen, why, row, refused = _refusal(call, device, forced, capability)
    if refused and device.type == "cuda" and not call.dropout_p > 0:
        refused += _elsewhere(call, device, forced, capability)
    sizes = (0, 0, 0) if refused else backends.kept_bytes(row, call.query, call.key, call.value, call.mask,
                                                          call.is_causal, call.scale)
    mask = None if call.mask is None else (tuple(call.mask.shape), str(call.mask.dtype).replace("torch.", ""))
    return CallPlan(module=type(call.module).__name__ if call.module is not None else "?",
                    query=tuple(call.query.shape), key=tuple(call.key.shape), value=tuple(call.value.shape),
                    mask=mask, is_causal=call.is_causal, enable_gqa=call.enable_gqa, dropout_p=call.dropout_p,
                    backend=chosen, why=why, output_bytes=sizes[0], logsumexp_bytes=sizes[1], extra_bytes=sizes[2],
                    refused=refused)

"""The plan as a table (what `python -m attnstash.planner` prints and str(plan) gives)."""
import torch


DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}


def _human(n):
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _ranges(indices):
    parts, start = [], None
    for i, index in enumerate(indices):
        if start is None:
            start = index
        if i + 1 == len(indices) or indices[i + 1] != index + 1:
            parts.append(str(start) if start == index else f"{start}-{index}")
            start = None
    return ",".join(parts)


def _dims(shape):
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _call_key(call):
    return (call.module, call.query, call.key, call.value, call.mask, call.backend, call.bytes, call.refused)


def table(p):
    """The plan as `python -m attnstash.planner` prints it."""
    dtype = "" if p.dtype is None else ", " + DTYPE_NAMES[p.dtype]
    lines = [f"attnstash plan: {p.model}, {len(p.layers)} attention layers of {p.layers_found} layers found",
             f"micro-batch: {p.inputs}{dtype}",
             f"device: {p.device}; backend decided by {p.decided_by}",
             "kept per layer and micro-batch in flight: output + log-sum-exp + the backend's extras", ""]
    header = ("layers", "attention", "query", "key / value", "mask", "backend", "output", "log-sum-exp", "extras",
              "bytes per layer")
    rows = []
    groups = []  # consecutive layers with the same calls
    for layer in p.layers:
        key = tuple(_call_key(c) for c in layer.calls) + (layer.refused,)
        if groups and groups[-1][0] == key:
            groups[-1][1].append(layer)
        else:
            groups.append((key, [layer]))
    for _, members in groups:
        first = members[0]
        label = _ranges([m.index for m in members])
        if len(members) > 1:
            label += f" ({len(members)})"
        for i, call in enumerate(first.calls or [None]):
            if call is None:
                rows.append((label, "-", "-", "-", "-", "-", "-", "-", "-", "refused"))
                continue
            kv = _dims(call.key) if call.key == call.value else f"{_dims(call.key)} / {_dims(call.value)}"
            mask = "-" if call.mask is None else f"{_dims(call.mask[0])} {call.mask[1]}"
            if call.is_causal:
                mask = "causal"
            total = "" if i + 1 < len(first.calls) else ("refused" if first.refused else f"{first.bytes:,}")
            rows.append((label if i == 0 else "", call.module, _dims(call.query), kv, mask,
                         call.backend.name.lower(), f"{call.output_bytes:,}", f"{call.logsumexp_bytes:,}",
                         f"{call.extra_bytes:,}", total))
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    right = {6, 7, 8, 9}
    for r in [header] + rows:
        lines.append("  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     .rstrip())
    lines.append("")
    lines.append(f"total, all {len(p.layers)} attention layers stashed: {p.total_bytes:,} bytes "
                 f"({_human(p.total_bytes)}) per micro-batch in flight")
    if p.offload:
        kept = sum(layer.bytes is not None for layer in p.layers)
        which = "the two largest layers' records (the one in use, the next fetched)" if kept > 1 else \
            f"{kept} layer's records"
        lines.append(f"offload, on the device: {p.device_bytes:,} bytes ({_human(p.device_bytes)}) per micro-batch "
                     f"in flight, {which}")
        lines.append(f"offload, in host memory: {p.host_bytes:,} bytes ({_human(p.host_bytes)}) per micro-batch in "
                     f"flight, all {len(p.layers)} attention layers' records")
    if p.max_bytes is not None:
        n = p.layers_that_fit
        sizes = [layer.bytes for layer in p.layers[len(p.layers) - n:]] if n else []
        if p.offload:
            lines.append(f"budget {p.max_bytes:,} bytes ({_human(p.max_bytes)}) on the device, for the two largest "
                         f"layers' records (offload): the last {n} of {len(p.layers)} attention layers fit "
                         f"({p.held_on_device(sizes):,} bytes on the device, {sum(sizes):,} in host memory)")
            if n:
                lines.append(f"    attnstash.install_attention_stash(model, num_layers={n}, max_bytes={p.max_bytes}, "
                             "offload=True)")
        else:
            lines.append(f"budget {p.max_bytes:,} bytes ({_human(p.max_bytes)}): the last {n} of "
                         f"{len(p.layers)} attention layers fit ({sum(sizes):,} bytes)")
            if n:
                lines.append(f"    attnstash.install_attention_stash(model, num_layers={n}, max_bytes={p.max_bytes})")
    reasons = []
    for layer in p.layers:
        for call in layer.calls:
            line = f"{call.backend.name.lower()}: {call.why}"
            if line not in reasons:
                reasons.append(line)
    lines.append("")
    lines.extend("why " + r for r in reasons)
    refused = {}
    for layer in p.layers:
        if layer.refused:
            refused.setdefault(layer.refused, []).append(layer.index)
    for why, indices in refused.items():
        lines.append(f"refused, layers {_ranges(indices)}: {why}")
    return "\n".join(lines)
